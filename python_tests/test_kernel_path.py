"""``Buffer(transport="kernels")`` on every topology, against the oracle (issue 17).

CPU (``make test``): gloo worlds of N nodes x L ranks (1x2, 1x4, 2x2, 2x4, 3x2, 4x1), one
process per rank, the kernels' CPU backend over shared memory: one node runs the intranode
kernels, several the hierarchical ones. Each world is spawned once and runs every case of
``test_dispatch`` (oracle, autograd, cached dispatch, fp8, micro-batches, close) and
``test_async`` (events, hooks, ``num_worst_tokens``, delayed weight gradients) through the
kernels, then the cases below: budget mode without host synchronisation (a whole MoE layer
step inside :func:`moe_dispatch.testing.sync.no_host_sync`), overflow raised or dropped,
topk_idx values checked on the device, the handle's identity and counts, rows sent inside and
across nodes, and a withheld rank named by the others.

GPU (``-m gpu``, skipped without one): the same kernel cases with ``device="cuda"`` in gloo
worlds whose processes share the one GPU (NCCL refuses two ranks on one device): the
intranode kernels through CUDA IPC with 2, 4 and 8 processes, the hierarchical ones over
NVSHMEM with 2 and 4 PEs; and a whole MoE layer step captured in a CUDA graph.
"""

from __future__ import annotations

import os
import re
import time

import pytest
import torch

from moe_dispatch import BudgetOverflowError, Buffer, CommError, _ext
from moe_dispatch.config import Config
from moe_dispatch.errors import MismatchError
from moe_dispatch.semantics import reference
from moe_dispatch.testing.launch import spawn_world
from moe_dispatch.testing.sync import HostSyncError, no_host_sync
from moe_dispatch.transport.kernels.timeouts import TIMEOUT_ENV

from . import test_async, test_dispatch
from .test_dispatch import expert, make_routing, make_x
from .worlds import assert_case, run_cases, world_results

built = pytest.mark.skipif(not _ext.extension_status().built, reason="transport='kernels' needs the built extension")
pytestmark = [pytest.mark.world, built]

TOPOLOGIES = [(1, 2), (1, 4), (2, 2), (2, 4), (3, 2), (4, 1)]  # nodes x ranks per node
WITHHOLD_IN = {(1, 2), (2, 2)}  # the withheld-rank case costs a timeout: two worlds run it
WITHHOLD_TIMEOUT_S = 3
# Two SMs: one channel, the fewest CPU-backend threads per launch (the 8-rank world shares two cores).
CONFIG = Config(num_sms=2)


def _dev(buf, *tensors):
    return [t.to(buf.device) if t is not None else None for t in tensors]


def _sync_free(buf) -> bool:
    """Whether this Buffer's num_worst_tokens dispatches wait for nothing (see Transfers.sync_free)."""
    return buf._transfers.sync_free


def _inputs(rank, world_size, seed, tokens=24, hidden=64, dtype=torch.bfloat16):
    num_tokens = [tokens + 3 * r for r in range(world_size)]
    idxs, ws, num_experts = make_routing(world_size, num_tokens, seed)
    xs = make_x(num_tokens, hidden, dtype, seed)
    return num_tokens, idxs, ws, num_experts, xs


def _moe_step(buf, x0, idx, w, num_experts, a, b, **dispatch):
    """A whole MoE layer step: dispatch, an expert (elementwise, so rows are independent of how
    many there are), a weighted combine, and the backward of a loss. Returns the combined
    output and the gradients of x, a, b."""
    x = x0.clone().requires_grad_()
    a, b = a.clone().requires_grad_(), b.clone().requires_grad_()
    recv_x, _, recv_w, _, handle, _ = buf.dispatch(x, idx, w, num_experts, **dispatch)
    y = torch.relu(recv_x * a) * b
    out, _ = buf.combine(y, handle, recv_w)
    (out * out).sum().backward()
    return out.detach(), x.grad, a.grad, b.grad


def _sync_free_step(rank, world_size, buf):
    """With num_worst_tokens (budget mode) the kernels keep every count on the device (one node,
    and the fused hierarchical pipeline): a whole MoE layer step, forward and backward, runs
    inside no_host_sync() and equals the sized step."""
    num_tokens, idxs, ws, num_experts, xs = _inputs(rank, world_size, seed=50, dtype=torch.float32)
    gen = torch.Generator().manual_seed(51)
    a, b = torch.rand(64, generator=gen) + 0.5, torch.randn(64, generator=gen)
    x, idx, w, a, b = _dev(buf, xs[rank], idxs[rank], ws[rank], a, b)
    budget = sum(num_tokens)  # never overflows
    sized = _moe_step(buf, x, idx, w, num_experts, a, b)
    _moe_step(buf, x, idx, w, num_experts, a, b, num_worst_tokens=budget, on_overflow="drop")  # first call: checks
    assert _sync_free(buf)
    with no_host_sync():
        static = _moe_step(buf, x, idx, w, num_experts, a, b, num_worst_tokens=budget, on_overflow="drop")
    assert torch.equal(static[0], sized[0]), "combined output"
    assert torch.equal(static[1], sized[1]), "grad x"
    for name, got, want in zip(("a", "b"), static[2:], sized[2:]):  # sums over the rows: another length
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"grad {name}")


def _detector_fails_on_a_sync(rank, world_size, buf):
    """The detector itself: a sized dispatch reads the device (its topk_idx check first, on every
    rank alike, before anything collective), and the call and its source line are named."""
    _, idxs, ws, num_experts, xs = _inputs(rank, world_size, seed=52)
    x, idx, w = _dev(buf, xs[rank], idxs[rank], ws[rank])
    kind = buf.device.type
    with pytest.raises(HostSyncError, match=rf"Tensor\.\w+\(\) of a {kind} tensor"), no_host_sync():
        buf.dispatch(x, idx, w, num_experts)
    one = torch.ones(1, device=buf.device)
    with pytest.raises(HostSyncError, match=rf"Tensor\.item\(\) of a {kind} tensor \[1\].*test_kernel_path\.py"):
        with no_host_sync():
            one.item()
    one.item()  # restored


def _budget_overflow(rank, world_size, buf):
    """More rows than num_worst_tokens on every rank: "raise" raises on every rank, naming both
    counts; "drop" keeps the first rows and flags the handle. A whole step then equals the
    oracle's with the dropped rows left out, forward (the combine sums the kept rows, the
    dropped ones as zeros) and backward (the combine's backward replays the dispatch into the
    kept rows, the dispatch's combines their gradients). Two budgets: one row per rank, and
    just below the smallest receive; several nodes: the forwarders' records of the holders then
    overflow (the rows that travel are listed) or fit."""
    L = buf.topology.ranks_per_node
    num_tokens, idxs, ws, num_experts, xs = _inputs(rank, world_size, seed=53, dtype=torch.float32)
    x, idx, w = _dev(buf, xs[rank], idxs[rank], ws[rank])
    refs = reference.dispatch(xs, idxs, ws, num_experts, L)
    received = [r.recv_x.shape[0] for r in refs]
    gen = torch.Generator().manual_seed(59)
    gouts = [torch.randn(t, xs[0].shape[1], generator=gen) for t in num_tokens]
    grads = reference.dispatch(gouts, idxs, None, num_experts, L)  # the combine's backward, before the drop
    for budget in (1, min(received) - 1):
        with pytest.raises(BudgetOverflowError, match=f"received {received[rank]} rows but num_worst_tokens={budget}"):
            buf.dispatch(x, idx, w, num_experts, num_worst_tokens=budget)
        x_ = x.clone().requires_grad_()
        recv_x, recv_idx, recv_w, per_expert, handle, _ = buf.dispatch(
            x_, idx, w, num_experts, num_worst_tokens=budget, on_overflow="drop"
        )
        assert bool(handle.overflow) and int(handle.recv_count) == received[rank] and recv_x.shape[0] == budget
        assert torch.equal(recv_x.detach().cpu(), refs[rank].recv_x[:budget])
        assert torch.equal(recv_idx.cpu(), refs[rank].recv_topk_idx[:budget])
        assert torch.equal(recv_w.cpu(), refs[rank].recv_topk_weights[:budget])
        kept = refs[rank].recv_topk_idx[:budget]
        assert torch.equal(per_expert.cpu(), torch.bincount(kept[kept >= 0], minlength=num_experts // world_size))
        y = recv_x * (rank + 1)
        y.retain_grad()
        out, _ = buf.combine(y, handle)
        (out * gouts[rank].to(buf.device)).sum().backward()
        ys = [r.recv_x * (i + 1) for i, r in enumerate(refs)]
        gys = [g.recv_x.clone() for g in grads]
        for rows in (*ys, *gys):
            rows[budget:] = 0  # what was dropped reaches no token
        assert torch.equal(out.detach().cpu(), reference.combine(ys, idxs, num_experts, L, ranks=[rank])[0])
        assert torch.equal(y.grad.cpu(), gys[rank][:budget]), f"budget {budget}: grad y (the replayed dispatch)"
        want = reference.combine([g * (i + 1) for i, g in enumerate(gys)], idxs, num_experts, L, ranks=[rank])[0]
        assert torch.equal(x_.grad.cpu(), want), f"budget {budget}: grad x (the gradients' combine)"


def _device_checked_topk_idx(rank, world_size, buf):
    """Sync-free mode checks topk_idx values on the device: rank 0 names an expert twice in a
    row; its check_errors() raises, the others' do not, or, without it, the next sized dispatch
    raises on every rank; the Buffer stays usable."""
    assert _sync_free(buf)
    num_tokens, idxs, ws, num_experts, xs = _inputs(rank, world_size, seed=54)
    x, idx, w = _dev(buf, xs[rank], idxs[rank], ws[rank])
    budget = sum(num_tokens)
    buf.dispatch(x, idx, w, num_experts, num_worst_tokens=budget)  # the signature's first call
    if rank == 0:
        idx = idx.clone()
        idx[1, 1] = idx[1, 0] = 0
    buf.dispatch(x, idx, w, num_experts, num_worst_tokens=budget)
    if rank == 0:
        with pytest.raises(ValueError, match="EP rank 0: a num_worst_tokens dispatch .* an expert twice in a row"):
            buf.check_errors()
    buf.check_errors()  # cleared
    # Without check_errors(), the next call that synchronises anyway (a sized dispatch) refuses on
    # rank 0 with that error, so every rank raises at once instead of the peers timing out later.
    buf.dispatch(x, idx, w, num_experts, num_worst_tokens=budget)
    start = time.monotonic()
    good = _dev(buf, xs[rank], idxs[rank], ws[rank])
    with pytest.raises(ValueError, match="an expert twice in a row" if rank == 0 else "rank 0 refused") as err:
        buf.dispatch(*good, num_experts)
        buf.check_errors()
    assert rank == 0 or isinstance(err.value, MismatchError), str(err.value)
    assert time.monotonic() - start < buf.timeout_s / 2, "the refusal must end the operation at once"
    buf.dispatch(*good, num_experts)  # usable


def _device_mismatch_flag(rank, world_size, buf):
    """Later calls are compared on the device: with both signatures seen before (so neither rank
    checks on the host), rank 0 combines fp32 rows while the others combine bf16 ones. No rows
    move between them, every rank raises MismatchError naming the ranks and the field where the
    operation completes, and the Buffer stays usable."""
    _, idxs, ws, num_experts, xs = _inputs(rank, world_size, seed=57)
    recv_x, _, _, _, handle, _ = buf.dispatch(*_dev(buf, xs[rank], idxs[rank], ws[rank]), num_experts)
    y = expert(recv_x, rank)
    want = buf.combine(y, handle)[0]
    buf.combine(y.float(), handle)  # both signatures seen
    mine = y.float() if rank == 0 else y
    with pytest.raises(MismatchError) as err:
        _, event = buf.combine(mine, handle, async_finish=True)
        event.current_stream_wait()
        buf.check_errors()  # on a GPU the records are read here
    assert err.value.field in ("row bytes", "dtype") and 0 in (err.value.rank, err.value.peer), str(err.value)
    assert torch.equal(buf.combine(y, handle)[0], want), "the Buffer must stay usable"


def _budget_mismatch(rank, world_size, buf):
    """num_worst_tokens on the last rank only, after warm-up (the kernels' header compares it in
    every fresh dispatch): a budget on that rank against none on the others, then a different
    budget, each a MismatchError on every rank naming the field and the rank. Both within a
    second, and the Buffer stays usable."""
    num_tokens, idxs, ws, num_experts, xs = _inputs(rank, world_size, seed=63, hidden=48)
    x, idx, w = _dev(buf, xs[rank], idxs[rank], ws[rank])
    budget, odd = sum(num_tokens), world_size - 1
    start = time.monotonic()
    want = buf.dispatch(x, idx, w, num_experts, num_worst_tokens=budget)[0]
    for theirs in (0, budget + 1):
        with pytest.raises(MismatchError, match="disagrees on the num_worst_tokens") as err:
            buf.dispatch(x, idx, w, num_experts, num_worst_tokens=theirs if rank == odd else budget)
            buf.check_errors()  # on a GPU a sync-free dispatch's records are read here
        assert err.value.field == "num_worst_tokens" and odd in (err.value.rank, err.value.peer), str(err.value)
    assert time.monotonic() - start < 2, "the mismatches must end the calls at once, not after timeout_s"
    assert torch.equal(buf.dispatch(x, idx, w, num_experts, num_worst_tokens=budget)[0], want), "usable"


def _one_rank_changes(rank, world_size, buf):
    """After warm-up, a call whose signature is new on one rank only meets its peers in the
    kernels, not in a host check they skip: rank 0 dispatches fp16 rows while the others send
    bf16 (MismatchError on every rank naming the dtype), then rows wider than the buffers hold
    while the others' fit (rank 0 joins with status "grow": every rank raises at once, naming
    it). Both end within a second and the Buffer stays usable; when every rank changes (fp16
    rows, then the wider rows: the buffers grow together) the calls equal the oracle."""
    wide = 2 * buf.transport._capacity[0]  # 4-byte elements the buffers hold now: these rows need more
    start = time.monotonic()
    for field, hidden, dtype in (("dtype", 64, torch.float16), ("status", wide, torch.bfloat16)):
        num_tokens, idxs, ws, num_experts, xs = _inputs(rank, world_size, seed=64, hidden=hidden, dtype=dtype)
        _, _, _, _, normal = _inputs(rank, world_size, seed=64)
        x = xs[rank] if rank == 0 else normal[rank]
        with pytest.raises(MismatchError) as err:
            buf.dispatch(*_dev(buf, x, idxs[rank], ws[rank]), num_experts)
            buf.check_errors()
        assert err.value.field == field, str(err.value)
        if field == "status":
            assert "rank 0 refused the operation: its call needs larger buffers" in str(err.value), str(err.value)
        else:
            assert 0 in (err.value.rank, err.value.peer), str(err.value)
    assert time.monotonic() - start < 2, "the mismatches must end the calls at once, not after timeout_s"
    for hidden, dtype in ((64, torch.float16), (wide, torch.bfloat16)):  # every rank: fine
        num_tokens, idxs, ws, num_experts, xs = _inputs(rank, world_size, seed=65, hidden=hidden, dtype=dtype)
        recv_x, _, recv_w, *_ = buf.dispatch(*_dev(buf, xs[rank], idxs[rank], ws[rank]), num_experts)
        ref = reference.dispatch(xs, idxs, ws, num_experts, buf.topology.ranks_per_node)[rank]
        assert torch.equal(recv_x.cpu(), ref.recv_x) and torch.equal(recv_w.cpu(), ref.recv_topk_weights)
    assert buf.transport._capacity[0] >= wide, "every rank's buffers grew"


def _refusal_named(rank, world_size, buf):
    """A rank whose own arguments are bad (combine rows that do not fit the handle) takes part
    with a non-zero status: it raises its ValueError, the others MismatchError naming it, all at
    once (no timeout), and the Buffer stays usable."""
    _, idxs, ws, num_experts, xs = _inputs(rank, world_size, seed=58)
    recv_x, _, _, _, handle, _ = buf.dispatch(*_dev(buf, xs[rank], idxs[rank], ws[rank]), num_experts)
    y = expert(recv_x, rank)
    want = buf.combine(y, handle)[0]
    start = time.monotonic()
    if rank == 0:
        with pytest.raises(ValueError, match=r"y has shape .* but handle \(tokens received\) has"):
            buf.combine(y[1:], handle)
    else:
        with pytest.raises(MismatchError, match="rank 0 refused the operation: its arguments were invalid"):
            buf.combine(y, handle)
            buf.check_errors()
    assert time.monotonic() - start < buf.timeout_s / 2, "the refusal must end the operation at once"
    assert torch.equal(buf.combine(y, handle)[0], want), "the Buffer must stay usable"


def _handle_fields(rank, world_size, buf):
    """Handles carry the dispatch's identity (counted the same on every rank), the received count
    on the device, and the overflow flag; rows sent inside and across nodes match torch_dist's."""
    import torch.distributed as dist

    L = buf.topology.ranks_per_node
    _, idxs, ws, num_experts, xs = _inputs(rank, world_size, seed=55)
    x, idx, w = _dev(buf, xs[rank], idxs[rank], ws[rank])
    first = buf.dispatch(x, idx, w, num_experts)[4]
    second = buf.dispatch(x, idx, w, num_experts, num_worst_tokens=sum(t.shape[0] for t in xs))[4]
    assert second.dispatch_id == first.dispatch_id + 1
    ids = [None] * world_size
    dist.all_gather_object(ids, (first.dispatch_id, second.dispatch_id))
    assert len(set(ids)) == 1, f"dispatch ids differ across ranks: {ids}"
    rows = reference.dispatch(xs, idxs, ws, num_experts, L)[rank].recv_x.shape[0]
    for h in (first, second):
        assert h.recv_count.dtype == torch.int32 and h.recv_count.device == buf.device and int(h.recv_count) == rows
        assert not bool(h.overflow)
    assert first.plan.num_recv_tokens == rows
    # num_chunks: the two stages whatever the size (a small call would take the flat route)
    torch_dist = Buffer(buf.group, transport="torch_dist", ranks_per_node=L, timeout_s=60, num_chunks=1)
    try:
        want = torch_dist.dispatch(xs[rank], idxs[rank], ws[rank], num_experts)[4]
        assert first.num_internode_tokens == want.num_internode_tokens
        assert first.num_intranode_tokens == want.num_intranode_tokens
        assert (want.num_internode_tokens > 0) == (buf.num_nodes > 1)
    finally:
        torch_dist.close()


def _withheld_rank(rank, world_size, buf):
    """The last rank skips a budget-mode dispatch of a signature every rank has run: every other
    rank raises CommError within the timeout bound (no hang), the withheld rank named by those
    that waited for it (the others name the rank they waited for in turn); then all close. The
    kernels' waits end after MOE_DISPATCH_KERNEL_TIMEOUT_S (1 s) where it is set, whatever the
    Buffer's timeout_s."""
    import torch.distributed as dist

    L = buf.topology.ranks_per_node
    os.environ[TIMEOUT_ENV] = "1"  # read when the Buffer is made
    try:
        short = Buffer(
            buf.group,
            ranks_per_node=L,
            transport="kernels",
            timeout_s=WITHHOLD_TIMEOUT_S,
            config=CONFIG,
            device=buf.device,
        )
    finally:
        del os.environ[TIMEOUT_ENV]
    num_tokens, idxs, ws, num_experts, xs = _inputs(rank, world_size, seed=56)
    x, idx, w = _dev(short, xs[rank], idxs[rank], ws[rank])
    budget, absent = sum(num_tokens), world_size - 1
    message, elapsed = None, 0.0
    short.dispatch(x, idx, w, num_experts, num_worst_tokens=budget)
    if rank == absent:
        time.sleep(3 * WITHHOLD_TIMEOUT_S)  # alive but silent
    else:
        start = time.monotonic()
        try:
            *_, event = short.dispatch(x, idx, w, num_experts, num_worst_tokens=budget, async_finish=True)
            event.current_stream_wait()
            short.check_errors()
        except CommError as err:
            message = str(err)
        elapsed = time.monotonic() - start
    dist.barrier()  # the world's group (not the Buffer's 3 s one): every rank is past the withheld operation
    if rank == absent:  # its peers' Buffers broke (they free theirs locally): its close() waits for nobody
        with pytest.raises(CommError, match="close"):
            short.close()
    else:
        short.close()
    messages = [None] * world_size
    dist.all_gather_object(messages, message)  # before any assertion: every rank gets here
    if rank != absent:
        assert message is not None, "a rank waiting for a withheld one must raise CommError"
        assert elapsed < 3 * WITHHOLD_TIMEOUT_S, f"took {elapsed:.1f} s to fail: {message}"
    named = [m for m in messages if m is not None and re.search(rf"(?i)\brank {absent}\b", m)]
    assert named, f"no rank named the withheld rank {absent}: {messages}"
    assert any("timed out after timeout_s=1:" in m for m in messages if m), f"the kernels' bound: {messages}"


KERNEL_CASES = {
    "sync-free-moe-step": _sync_free_step,
    "detector-fails-on-a-sync": _detector_fails_on_a_sync,
    "budget-overflow": _budget_overflow,
    "handle-fields": _handle_fields,
    "device-checked-topk-idx": _device_checked_topk_idx,
    "device-mismatch-flag": _device_mismatch_flag,
    "budget-mismatch": _budget_mismatch,
    "refusal-named": _refusal_named,
    "one-rank-changes": _one_rank_changes,
    "auto-config": test_dispatch._auto_config,
}


def _cpu_cases(num_nodes: int, ranks_per_node: int) -> dict:
    shared = test_dispatch._cases(ranks_per_node)
    close = shared.pop("close")
    cases = {**shared, **test_async.CASES, **KERNEL_CASES}
    if num_nodes == 1 and ranks_per_node == 2:  # the Buffer's own kernel-path cases, written for two ranks
        cases.update(test_dispatch.KERNEL_CASES)
    if (num_nodes, ranks_per_node) in WITHHOLD_IN:
        cases["withheld-rank"] = _withheld_rank
    return {**cases, "close": close}


def _cpu_entry(rank, world_size, ranks_per_node):
    buf = Buffer(ranks_per_node=ranks_per_node, transport="kernels", timeout_s=60, config=CONFIG)
    return run_cases(rank, world_size, _cpu_cases(world_size // ranks_per_node, ranks_per_node), buf)


@pytest.mark.parametrize(
    "num_nodes,ranks_per_node,case",
    [(n, rpn, case) for n, rpn in TOPOLOGIES for case in _cpu_cases(n, rpn)],
    ids=[f"{n}x{rpn}-{case}" for n, rpn in TOPOLOGIES for case in _cpu_cases(n, rpn)],
)
def test_kernels_cpu(num_nodes, ranks_per_node, case):
    assert_case(world_results(_cpu_entry, num_nodes * ranks_per_node, ranks_per_node), case)


# ---------------------------------------------------------------------------------------------
# GPU: processes sharing the one GPU (gloo carries the handles and the first-call checks)
# ---------------------------------------------------------------------------------------------


def _roundtrip(rank, world_size, buf, **launch):
    """Dispatch and combine of 2880-wide bf16 rows against the oracle, in a launch mode."""
    L = buf.topology.ranks_per_node
    num_tokens = [256] * world_size
    idxs, ws, num_experts = make_routing(world_size, num_tokens, seed=60, zipf=1.0)
    xs = make_x(num_tokens, 2880, torch.bfloat16, seed=60)
    mode = "hook" if launch.get("return_recv_hook") else "async" if launch.get("async_finish") else "sync"
    outs = buf.dispatch(*_dev(buf, xs[rank], idxs[rank], ws[rank]), num_experts, **launch)
    if mode == "hook":
        outs[-1]()
    elif mode == "async":
        outs[-1].current_stream_wait()
    recv_x, recv_idx, recv_w, _, handle = outs[:5]
    refs = reference.dispatch(xs, idxs, ws, num_experts, L)
    rows = refs[rank].recv_x.shape[0]
    assert torch.equal(recv_x[:rows].cpu(), refs[rank].recv_x)
    assert torch.equal(recv_idx[:rows].cpu(), refs[rank].recv_topk_idx)
    assert torch.equal(recv_w[:rows].cpu(), refs[rank].recv_topk_weights)
    ys = [expert(r.recv_x, i) for i, r in enumerate(refs)]
    out, event, *hook = buf.combine(
        expert(recv_x, rank), handle, **{k: v for k, v in launch.items() if k != "num_worst_tokens"}
    )
    if hook:
        hook[0]()
    event.current_stream_wait()
    assert torch.equal(out.cpu(), reference.combine(ys, idxs, num_experts, L, ranks=[rank])[0])


def _graph_step(rank, world_size, buf):
    """A whole MoE layer step (dispatch in budget mode, experts, combine, backward) captured in
    a CUDA graph through Buffer; replays with new inputs equal eager steps."""
    assert _sync_free(buf)
    num_tokens, idxs, ws, num_experts, xs = _inputs(
        rank, world_size, seed=61, tokens=128, hidden=256, dtype=torch.float32
    )
    gen = torch.Generator().manual_seed(62)
    a, b = _dev(buf, torch.rand(256, generator=gen) + 0.5, torch.randn(256, generator=gen))
    budget = sum(num_tokens)
    x, idx, w = _dev(buf, xs[rank], idxs[rank], ws[rank])
    static_x = x.clone()
    eager = [
        _moe_step(buf, static_x * s, idx, w, num_experts, a, b, num_worst_tokens=budget, on_overflow="drop")
        for s in (1.0, 2.0)
    ]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as torch.cuda.graph wants
        _moe_step(buf, static_x, idx, w, num_experts, a, b, num_worst_tokens=budget, on_overflow="drop")
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _moe_step(buf, static_x, idx, w, num_experts, a, b, num_worst_tokens=budget, on_overflow="drop")
    for s, want in zip((1.0, 2.0), eager):
        static_x.copy_(x * s)
        graph.replay()
        torch.cuda.synchronize()
        for got, ref in zip(captured, want):
            assert torch.equal(got, ref), "a graph replay differs from the eager step"


GPU_CASES = {
    "sync": lambda r, w, buf: _roundtrip(r, w, buf),
    "async-alloc-on-comm-stream": lambda r, w, buf: _roundtrip(
        r, w, buf, async_finish=True, allocate_on_comm_stream=True
    ),
    "hook": lambda r, w, buf: _roundtrip(r, w, buf, return_recv_hook=True),
    "budget": lambda r, w, buf: _roundtrip(r, w, buf, num_worst_tokens=256 * w),
    **KERNEL_CASES,
    "cuda-graph-moe-step": _graph_step,
}
GPU_TOPOLOGIES = [(1, 2), (1, 4), (1, 8), (2, 1), (2, 2), (4, 1)]  # intranode (IPC) and internode (NVSHMEM PEs)


def _gpu_entry(rank, world_size, ranks_per_node):
    torch.cuda.set_device(0)
    cases = GPU_CASES
    try:
        buf = Buffer(
            ranks_per_node=ranks_per_node,
            transport="kernels",
            timeout_s=60,
            device="cuda",
            config=Config(num_sms=4, num_slots=16, chunk_tokens=4),
        )
    except Exception as err:  # noqa: BLE001 - e.g. NVSHMEM refusing several PEs on one GPU: every case says why
        message = f"[rank {rank}] Buffer(device='cuda', ranks_per_node={ranks_per_node}) failed: {err!r}"
        return {name: message for name in cases}
    return run_cases(rank, world_size, cases, buf)


@pytest.mark.gpu
@pytest.mark.skipif(not _ext.cuda_available(), reason="needs a CUDA GPU and the built extension")
@pytest.mark.parametrize(
    "num_nodes,ranks_per_node,case",
    [(n, rpn, c) for n, rpn in GPU_TOPOLOGIES for c in GPU_CASES],
    ids=[f"{n}x{rpn}-{c}" for n, rpn in GPU_TOPOLOGIES for c in GPU_CASES],
)
def test_kernels_gpu_shared(num_nodes, ranks_per_node, case):
    """Processes sharing the one GPU through a gloo group and device="cuda": CUDA IPC inside a
    node, NVSHMEM PEs across "nodes" (NVSHMEM documents limited support for several PEs per GPU;
    a refusal fails every case of that world with NVSHMEM's message)."""
    assert_case(_gpu_world(num_nodes * ranks_per_node, ranks_per_node), case)


_GPU_WORLDS: dict = {}


def _gpu_world(world_size, ranks_per_node):
    key = (world_size, ranks_per_node)
    if key not in _GPU_WORLDS:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES") or "0"
        _GPU_WORLDS[key] = spawn_world(
            world_size, _gpu_entry, ranks_per_node, env={"CUDA_VISIBLE_DEVICES": visible}, timeout_s=300
        )
    return _GPU_WORLDS[key]
