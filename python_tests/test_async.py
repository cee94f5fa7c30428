"""Overlap hooks: asynchronous dispatch/combine (``async_finish=True``) return while the payload
is in flight on the Buffer's communication thread; receive hooks complete an issued operation
later; delayed weight gradients run while the dispatch backward is in flight. Results always
equal the synchronous ones."""

from __future__ import annotations

import time

import pytest
import torch

from moe_dispatch import BudgetOverflowError, Buffer

from .test_dispatch import expert, make_routing, make_x
from .worlds import assert_case, run_cases, world_results

pytestmark = pytest.mark.world

LATE_S = 1.0  # how late the last rank joins, to show the others do not wait for it


def _inputs(rank, world_size, seed=30):
    num_tokens = [32] * world_size
    idxs, ws, num_experts = make_routing(world_size, num_tokens, seed)
    return make_x(num_tokens, 64, torch.bfloat16, seed)[rank], idxs[rank], ws[rank], num_experts


def _async_matches_sync(rank, world_size, buf):
    x, idx, w, num_experts = _inputs(rank, world_size)
    sync = buf.dispatch(x, idx, w, num_experts)
    recv_x, recv_idx, recv_w, per_expert, handle, event = buf.dispatch(x, idx, w, num_experts, async_finish=True)
    event.current_stream_wait()
    assert torch.equal(recv_x, sync[0]) and torch.equal(recv_idx, sync[1]) and torch.equal(recv_w, sync[2])
    assert torch.equal(per_expert, sync[3])
    out, event = buf.combine(expert(recv_x, rank), handle, recv_w, async_finish=True)
    with event:  # leaving the block waits for the combine
        pass
    assert torch.equal(out, buf.combine(expert(recv_x, rank), handle, recv_w)[0])


def _returns_before_late_peer(rank, world_size, buf):
    """Combine, cached dispatch and a num_worst_tokens dispatch need no host-visible metadata:
    with the last rank joining LATE_S seconds late, the others' calls return at once and
    complete after it joins."""
    x, idx, w, num_experts = _inputs(rank, world_size, seed=31)
    recv_x, *_, handle, _ = buf.dispatch(x, idx, w, num_experts)
    expected_out = buf.combine(recv_x, handle)[0]
    expected_cached = buf.dispatch(x, handle=handle)[0]
    late = rank == world_size - 1
    worst = x.shape[0] * world_size
    expected_worst = torch.cat([recv_x, recv_x.new_zeros((worst - recv_x.shape[0], recv_x.shape[1]))])
    for name, call, expected in (
        ("combine", lambda: buf.combine(recv_x, handle, async_finish=True), expected_out),
        ("cached dispatch", lambda: buf.dispatch(x, handle=handle, async_finish=True)[::5], expected_cached),
        (
            "num_worst_tokens dispatch",
            lambda: buf.dispatch(x, idx, w, num_experts, num_worst_tokens=worst, async_finish=True)[::5],
            expected_worst,
        ),
    ):
        if late:
            time.sleep(LATE_S)
        start = time.monotonic()
        out, event = call()
        returned = time.monotonic() - start
        event.current_stream_wait()
        completed = time.monotonic() - start
        assert torch.equal(out, expected), f"async {name} differs from sync"
        if not late and world_size > 1:
            assert returned < LATE_S / 2, f"async {name} took {returned:.2f} s to return"
            assert completed > LATE_S / 2, f"async {name} completed in {completed:.2f} s, before the late rank joined"


def _worst_tokens(rank, world_size, buf):
    """num_worst_tokens: static-size outputs whose first rows equal the sized dispatch, padding
    rows 0 / -1 / 0; combine ignores the padding; gradients equal the sized path's."""
    x, idx, w, num_experts = _inputs(rank, world_size, seed=38)
    worst = x.shape[0] * world_size
    sync = buf.dispatch(x, idx, w, num_experts)
    rows = sync[0].shape[0]
    for async_finish in (False, True):
        recv_x, recv_idx, recv_w, per_expert, handle, event = buf.dispatch(
            x, idx, w, num_experts, num_worst_tokens=worst, async_finish=async_finish
        )
        assert recv_x.shape[0] == recv_idx.shape[0] == recv_w.shape[0] == handle.num_recv_tokens == worst
        event.current_stream_wait()
        assert int(handle.recv_count) == rows and handle.plan.num_recv_tokens in (rows, None)  # None: on the device
        assert torch.equal(recv_x[:rows], sync[0]) and torch.equal(recv_idx[:rows], sync[1])
        assert torch.equal(recv_w[:rows], sync[2]) and torch.equal(per_expert, sync[3])
        assert not recv_x[rows:].any() and bool((recv_idx[rows:] == -1).all()) and not recv_w[rows:].any()
        y = expert(recv_x, rank)
        y[rows:] = 1e4  # padding rows must not reach any token
        out, event = buf.combine(y, handle, recv_w, async_finish=async_finish)
        event.current_stream_wait()
        assert torch.equal(out, buf.combine(expert(sync[0], rank), sync[4], sync[2])[0])
    grads = []
    for worst_rows in (0, worst):
        xg = x.float().requires_grad_()
        recv_x, _, recv_w, *_, handle, _ = buf.dispatch(xg, idx, w, num_experts, num_worst_tokens=worst_rows)
        out, _ = buf.combine(recv_x * 2, handle, recv_w)
        (out * out).sum().backward()
        grads.append(xg.grad)
    assert torch.equal(*grads), "num_worst_tokens changed the gradient"


def _worst_tokens_overflow(rank, world_size, buf):
    """More rows than num_worst_tokens: every rank still completes the transfer (nobody hangs),
    the overflowing ranks raise naming both counts, and the Buffer stays usable."""
    x, idx, w, num_experts = _inputs(rank, world_size, seed=39)
    rows = buf.dispatch(x, idx, w, num_experts)[0].shape[0]
    *_, event = buf.dispatch(x, idx, w, num_experts, num_worst_tokens=1, async_finish=True)
    if rows <= 1:
        event.current_stream_wait()
    else:
        with pytest.raises(BudgetOverflowError, match=f"received {rows} rows but num_worst_tokens=1"):
            event.current_stream_wait()
    assert buf.dispatch(x, idx, w, num_experts)[0].shape[0] == rows, "the Buffer must stay usable"


def _worst_tokens_mismatch(rank, world_size, buf):
    """Ranks that disagree on hidden, with num_worst_tokens: every rank raises the named
    ValueError where the operation completes (the counts travel with the transfer; the kernels
    compare the row bytes in their header on the device)."""
    if world_size == 1:
        return
    x, idx, w, num_experts = _inputs(rank, world_size, seed=40)
    if rank == 0:
        x = x[:, :32].contiguous()
    *_, event = buf.dispatch(x, idx, w, num_experts, num_worst_tokens=64, async_finish=True)
    with pytest.raises(ValueError, match="arguments differ across ranks: hidden is|disagrees on the row bytes"):
        event.current_stream_wait()


def _autograd_after_async(rank, world_size, buf):
    """Backward after an async dispatch is ordered after it (same communication thread)."""
    x, idx, w, num_experts = _inputs(rank, world_size, seed=32)
    x = x.float().requires_grad_()
    recv_x, *_, handle, event = buf.dispatch(x, idx, w, num_experts, async_finish=True)
    event.current_stream_wait()
    recv_x.sum().backward()
    holders = handle.is_token_in_rank.sum(1, keepdim=True).float()
    assert torch.equal(x.grad, holders.expand_as(x)), "grad of sum(recv_x) must count the holders"


def _recv_hook(rank, world_size, buf):
    """return_recv_hook: outputs are complete after hook(); misuse raises clearly."""
    x, idx, w, num_experts = _inputs(rank, world_size, seed=33)
    sync = buf.dispatch(x, idx, w, num_experts)
    recv_x, recv_idx, recv_w, per_expert, handle, event, hook = buf.dispatch(
        x, idx, w, num_experts, return_recv_hook=True
    )
    try:
        buf.combine(recv_x, handle)
        raise AssertionError("combine before the dispatch hook must raise")
    except RuntimeError as err:
        assert "hook() has not been called" in str(err), err
    hook()
    assert torch.equal(recv_x, sync[0]) and torch.equal(recv_idx, sync[1]) and torch.equal(recv_w, sync[2])
    try:
        hook()
        raise AssertionError("a second hook() call must raise")
    except RuntimeError as err:
        assert "already called" in str(err), err
    out, _, combine_hook = buf.combine(expert(recv_x, rank), handle, return_recv_hook=True)
    combine_hook()
    assert torch.equal(out, buf.combine(expert(recv_x, rank), handle)[0])
    try:
        buf.dispatch(x, idx, w, num_experts, async_finish=True, return_recv_hook=True)
        raise AssertionError("async_finish with return_recv_hook must raise")
    except ValueError as err:
        assert "exclude each other" in str(err), err


def _two_microbatch_hooks(rank, world_size, buf):
    """Dispatch A and B issued with hooks, completed in reverse order, then combined A, B."""
    inputs = [_inputs(rank, world_size, seed=s) for s in (34, 35)]
    expected = [buf.combine(expert(buf.dispatch(*i)[0], rank), buf.dispatch(*i)[4])[0] for i in inputs]
    issued = [buf.dispatch(*i, return_recv_hook=True) for i in inputs]
    for *_, hook in reversed(issued):
        hook()
    for (recv_x, *_, handle, _, _), want in zip(issued, expected):
        assert torch.equal(buf.combine(expert(recv_x, rank), handle)[0], want)


def _delayed_wgrad(rank, world_size, buf):
    """Experts with deferred weight gradients: the dispatch backward runs backward_dw while its
    combine is in flight; every gradient is bitwise equal to the eager order."""
    from moe_dispatch.overlap import DelayedWgrad, delayed_linear

    x0, idx, w0, num_experts = _inputs(rank, world_size, seed=36)
    gen = torch.Generator().manual_seed(37)
    w1, w2 = torch.randn(96, 64, generator=gen), torch.randn(64, 96, generator=gen)
    grads = []
    for delayed in (False, True):
        store = DelayedWgrad() if delayed else None
        x, w, p1, p2 = (t.float().clone().requires_grad_() for t in (x0, w0, w1, w2))
        recv_x, _, recv_w, *_, handle, _ = buf.dispatch(x, idx, w, num_experts, wgrad_store=store)
        y = delayed_linear(torch.relu(delayed_linear(recv_x, p1, store)), p2, store)
        out, _ = buf.combine(y, handle, recv_w)
        (out * out).sum().backward()
        assert store is None or len(store) == 0, "the dispatch backward must have run the deferred wgrads"
        grads.append([t.grad for t in (x, w, p1, p2)])
    for name, eager, late in zip(("x", "topk_weights", "w1", "w2"), *grads):
        assert torch.equal(eager, late), f"delayed wgrad changed grad of {name}"


CASES = {
    "async-matches-sync": _async_matches_sync,
    "returns-before-late-peer": _returns_before_late_peer,
    "autograd-after-async": _autograd_after_async,
    "recv-hook": _recv_hook,
    "two-microbatch-hooks": _two_microbatch_hooks,
    "delayed-wgrad": _delayed_wgrad,
    "worst-tokens": _worst_tokens,
    "worst-tokens-overflow": _worst_tokens_overflow,
    "worst-tokens-mismatch": _worst_tokens_mismatch,
}


def _entry(rank, world_size, ranks_per_node, transport="auto"):
    buf = Buffer(ranks_per_node=ranks_per_node, transport=transport, timeout_s=60)
    return run_cases(rank, world_size, CASES, buf)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("world_size,ranks_per_node", [(1, 1), (2, 1), (4, 2)])
def test_async(world_size, ranks_per_node, case):
    assert_case(world_results(_entry, world_size, ranks_per_node), case)


# The same cases through Buffer(transport="kernels"): test_kernel_path.py, in worlds of every topology.
