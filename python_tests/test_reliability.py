"""Every rank learns of a bad call at once and the Buffer stays usable; a mismatched handle is a
ValueError on every rank; a refused ``Buffer()`` leaves the world usable; a broken Buffer says
so; ``close()`` frees what a Buffer made; a killed rank is named; the boundary checks.

Worlds are 2 nodes x 2 ranks on gloo (the issue's shape) with ``timeout_s`` large (60 s), so a
peer that waited for a bad rank's collective would show as a slow raise: every rank must raise
within ``FAST_S``.
"""

from __future__ import annotations

import gc
import os
import re
import signal
import threading
import time
import warnings

import pytest
import torch

from moe_dispatch import Buffer, CommError, _ext
from moe_dispatch.config import Config
from moe_dispatch.control.groups import NAMES_REUSED
from moe_dispatch.errors import MismatchError
from moe_dispatch.ops.quant import per_token_cast_to_fp8
from moe_dispatch.semantics import reference
from moe_dispatch.testing.resources import process_resources

from .test_dispatch import check_roundtrip, expert, make_routing, make_x
from .worlds import assert_case, run_cases, world_results

pytestmark = pytest.mark.world

W, L = 4, 2  # 2 nodes x 2 ranks
BAD = 2  # the rank with the bad argument in the one-rank cases (node 1, so every group sees it)
FAST_S = 3.0  # every rank raises within this (timeout_s is 60)
TIMEOUT_S = 60.0


def _inputs(rank, world_size, seed=40, hidden=16, num_tokens=12):
    idxs, ws, num_experts = make_routing(world_size, [num_tokens] * world_size, seed)
    return make_x([num_tokens] * world_size, hidden, torch.float32, seed)[rank], idxs[rank], ws[rank], num_experts


def _timed(fn):
    """``(seconds, error or None)`` of ``fn()``."""
    start = time.monotonic()
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - returned to the case
        return time.monotonic() - start, err
    return time.monotonic() - start, None


def _still_usable(rank, world_size, buf, seed=41):
    check_roundtrip(
        buf, rank, world_size, buf.topology.ranks_per_node, [9 + r for r in range(world_size)], 8, torch.float32, seed
    )


def _expect_refusal(rank, buf, good, bad, what, error, match, bad_rank=BAD, on_device=False):
    """Rank ``bad_rank`` calls ``bad`` (its own ``error`` matching ``match``), the others ``good``;
    every rank raises ``error``'s type (``on_device``, for a ValueError: the kernels'
    MismatchError), naming ``bad_rank`` and quoting its error; all within FAST_S; then the
    Buffer works."""
    import torch.distributed as dist

    elapsed, err = _timed(bad if rank == bad_rank else good)
    assert isinstance(err, error) and re.search(match, str(err)), repr(err)
    if on_device:
        assert isinstance(err, MismatchError) or error is TypeError, repr(err)
        expected = rf"rank {bad_rank} refused the operation.* \(EP rank {bad_rank} refused: {error.__name__}: .*{match}"
        assert re.search(expected, str(err)), str(err)
        assert "the buffers stay usable" in str(err), str(err)
    else:
        expected = rf"EP rank {rank}: {re.escape(what)} refused by EP rank {bad_rank} \({error.__name__}: .*{match}"
        assert re.search(expected, str(err)), str(err)
        assert "the Buffer stays usable" in str(err), str(err)
    types = [None] * dist.get_world_size()
    dist.all_gather_object(types, type(err).__name__)
    assert len(set(types)) == 1, f"every rank must raise the same type: {types}"
    assert elapsed < FAST_S, f"rank {rank} took {elapsed:.2f} s to raise: {err}"
    _still_usable(rank, W, buf)


def _dispatch_cases() -> dict:
    """name -> (what, error type, message pattern, bad call maker, good call maker); makers take
    ``(buf, x, idx, w, num_experts)``."""
    worst = 12 * W

    def fp8_list(buf, x, idx, w, e):
        pair = per_token_cast_to_fp8(torch.randn(x.shape[0], 128))
        return buf.dispatch(list(pair), idx, w, e)

    def sized(buf, x, idx, w, e):
        return buf.dispatch(x, idx, w, e)

    def out_of_memory(buf, x, idx, w, e):
        """A num_worst_tokens dispatch whose receive buffers this rank cannot allocate."""

        def alloc(call, shapes_like):
            raise torch.OutOfMemoryError("out of memory (simulated)")

        buf._transfers.queue.alloc = alloc
        try:
            return buf.dispatch(x, idx, w, e, num_worst_tokens=worst)
        finally:
            del buf._transfers.queue.alloc

    def nwt(buf, x, idx, w, e):
        return buf.dispatch(x, idx, w, e, num_worst_tokens=worst)

    return {
        "x-dtype": (
            "dispatch",
            TypeError,
            r"x must have dtype in",
            lambda b, x, i, w, e: b.dispatch(x.long(), i, w, e),
            sized,
        ),
        "topk-idx-range": (
            "dispatch",
            ValueError,
            r"topk_idx entries must be in \[-1, 16\)",
            lambda b, x, i, w, e: b.dispatch(x, torch.where(i == 3, 99, i), w, e),
            sized,
        ),
        "num-experts-bool": (
            "dispatch",
            ValueError,
            r"num_experts must be a positive int, got True",
            lambda b, x, i, w, e: b.dispatch(x, i.clamp(max=0), w, True),
            sized,
        ),
        "num-experts-huge": (
            "dispatch",
            ValueError,
            r"num_experts must be at most 1048576 .*got 1099511627776",
            lambda b, x, i, w, e: b.dispatch(x, i, w, 2**40),
            sized,
        ),
        "fp8-as-list": (
            "dispatch",
            TypeError,
            r"x must be a tensor, or the fp8 pair as the tuple \(x_fp8, scales\), got a list of 2",
            fp8_list,
            sized,
        ),
        "topk-zero": (
            "dispatch",
            ValueError,
            r"topk_idx must have at least one column .*got shape \[12, 0\]",
            lambda b, x, i, w, e: b.dispatch(x, i[:, :0], w[:, :0], e),
            sized,
        ),
        "num-worst-tokens-bool": (
            "dispatch",
            ValueError,
            r"num_worst_tokens must be an int >= 0 .*got True",
            lambda b, x, i, w, e: b.dispatch(x, i, w, e, num_worst_tokens=True),
            nwt,
        ),
        "num-worst-tokens-huge": (
            "dispatch",
            ValueError,
            r"num_worst_tokens must be at most \d+ here .*got 1099511627776",
            lambda b, x, i, w, e: b.dispatch(x, i, w, e, num_worst_tokens=2**40),
            nwt,
        ),
        "num-worst-tokens-out-of-memory": (
            "dispatch",
            ValueError,
            r"num_worst_tokens: the receive buffers of that many rows could not be allocated \(out of memory",
            out_of_memory,
            nwt,
        ),
        "num-worst-tokens-weights": (
            "dispatch",
            ValueError,
            r"topk_weights has shape \[12, 1\]",
            lambda b, x, i, w, e: b.dispatch(x, i, w[:, :1].contiguous(), e, num_worst_tokens=worst),
            nwt,
        ),
    }


def _handle_cases() -> dict:
    """name -> (what, error, pattern, bad, good); calls take ``(buf, x, recv_x, handle)``."""
    return {
        "cached-dispatch-rows": (
            "cached dispatch",
            ValueError,
            r"x has shape \[5, 16\] but handle",
            lambda b, x, r, h: b.dispatch(x[:5].contiguous(), handle=h),
            lambda b, x, r, h: b.dispatch(x, handle=h),
        ),
        "cached-dispatch-dtype": (
            "cached dispatch",
            TypeError,
            r"x must have dtype in",
            lambda b, x, r, h: b.dispatch(x.int(), handle=h),
            lambda b, x, r, h: b.dispatch(x, handle=h),
        ),
        "combine-rows": (
            "combine",
            ValueError,
            r"y has shape \[\d+, 16\] but handle \(tokens received\)",
            lambda b, x, r, h: b.combine(torch.cat([r, r[:1]]), h),
            lambda b, x, r, h: b.combine(r, h),
        ),
        "combine-weights-dtype": (
            "combine",
            TypeError,
            r"topk_weights must be an fp32 tensor, got float64",
            lambda b, x, r, h: b.combine(r, h, torch.ones(r.shape[0], dtype=torch.float64)),
            lambda b, x, r, h: b.combine(r, h),
        ),
        "combine-async": (
            "combine",
            ValueError,
            r"exclude each other",
            lambda b, x, r, h: b.combine(r, h, async_finish=True, return_recv_hook=True),
            lambda b, x, r, h: b.combine(r, h, async_finish=True)[1].current_stream_wait(),
        ),
    }


def _one_rank_entry(rank, world_size):
    buf = Buffer(ranks_per_node=L, transport="torch_dist", timeout_s=TIMEOUT_S)
    cases = {}
    for name, (what, error, match, bad, good) in _dispatch_cases().items():

        def case(r, w, what=what, error=error, match=match, bad=bad, good=good):
            x, idx, wts, e = _inputs(r, w)
            _expect_refusal(
                r, buf, lambda: good(buf, x, idx, wts, e), lambda: bad(buf, x, idx, wts, e), what, error, match
            )

        cases[name] = case
    for name, (what, error, match, bad, good) in _handle_cases().items():

        def case(r, w, what=what, error=error, match=match, bad=bad, good=good):
            x, idx, wts, e = _inputs(r, w)
            recv_x, *_, handle, _ = buf.dispatch(x, idx, wts, e)
            _expect_refusal(
                r, buf, lambda: good(buf, x, recv_x, handle), lambda: bad(buf, x, recv_x, handle), what, error, match
            )

        cases[name] = case
    cases["bad-rank-0"] = lambda r, w: _expect_refusal(
        r,
        buf,
        lambda: buf.dispatch(*_inputs(r, w)),
        lambda: buf.dispatch(*_inputs(r, w)[:3], 18),
        "dispatch",
        ValueError,
        r"num_experts must be divisible by the EP world size 4, got 18",
        bad_rank=0,
    )
    cases["every-rank-bad"] = lambda r, w: _every_rank_bad(r, w, buf)
    results = run_cases(rank, world_size, cases)
    buf.close()
    return results


def _every_rank_bad(rank, world_size, buf):
    """Every rank refuses: each raises at once, its own error's type, naming itself and quoting
    every rank's error, and the Buffer works afterwards."""
    x, idx, w, e = _inputs(rank, world_size)
    recv_x, *_, handle, _ = buf.dispatch(x, idx, w, e)
    for call, match in (
        (lambda: buf.dispatch(x.long(), idx, w, e), "x must have dtype"),
        (lambda: buf.dispatch(x, idx, w, e, num_worst_tokens=-1), "num_worst_tokens must be an int >= 0"),
        (lambda: buf.dispatch(x[:3].contiguous(), handle=handle), r"x has shape \[3, 16\]"),
        (lambda: buf.combine(recv_x[:, :3], handle), "y must be contiguous"),
    ):
        elapsed, err = _timed(call)
        assert err is not None and re.search(match, str(err)) and f"EP rank {rank}:" in str(err), repr(err)
        assert elapsed < FAST_S, f"{elapsed:.2f} s: {err}"
    _still_usable(rank, world_size, buf)


ONE_RANK_CASES = [*_dispatch_cases(), *_handle_cases(), "bad-rank-0", "every-rank-bad"]


@pytest.mark.parametrize("case", ONE_RANK_CASES)
def test_one_bad_rank_costs_its_peers_nothing(case):
    """A bad argument on one rank: it raises its own error, its peers a ValueError naming it and
    quoting the error, all within FAST_S (timeout_s is 60); then the Buffer works."""
    assert_case(world_results(_one_rank_entry, W), case)


KERNEL_CASES = [
    "x-dtype",
    "num-experts-huge",
    "num-worst-tokens-bool",
    "num-worst-tokens-huge",
    "num-worst-tokens-out-of-memory",
    "topk-zero",
    "cached-dispatch-rows",
    "combine-rows",
]


def _kernel_refusal_entry(rank, world_size):
    """transport="kernels" (one node): the Buffer's first dispatch refused (every rank in the host
    check of a first call), then each case in the steady state (the good call run once by every
    rank first: the peers skip the host check and the refusal runs in the kernels)."""
    buf = Buffer(ranks_per_node=world_size, transport="kernels", timeout_s=TIMEOUT_S)
    dispatch_cases, handle_cases = _dispatch_cases(), _handle_cases()

    def cold(r, w):
        x, idx, wts, e = _inputs(r, w)
        what, error, match, bad, good = dispatch_cases["x-dtype"]
        _expect_refusal(r, buf, lambda: good(buf, x, idx, wts, e), lambda: bad(buf, x, idx, wts, e), what, error, match)

    def warm(r, w, name):
        x, idx, wts, e = _inputs(r, w)
        if name in dispatch_cases:
            what, error, match, bad, good = dispatch_cases[name]
            calls = (lambda: good(buf, x, idx, wts, e), lambda: bad(buf, x, idx, wts, e))
        else:
            what, error, match, bad, good = handle_cases[name]
            recv_x, *_, handle, _ = buf.dispatch(x, idx, wts, e)
            calls = (lambda: good(buf, x, recv_x, handle), lambda: bad(buf, x, recv_x, handle))
        calls[0]()  # every rank: this signature is checked on the host once
        _expect_refusal(r, buf, *calls, what, error, match, on_device=True)

    cases = {"cold-x-dtype": cold, **{name: lambda r, w, n=name: warm(r, w, n) for name in KERNEL_CASES}}
    results = run_cases(rank, world_size, cases)
    buf.close()
    return results


@pytest.mark.skipif(not _ext.extension_status().built, reason="transport='kernels' needs the built extension")
@pytest.mark.parametrize("case", ["cold-x-dtype", *KERNEL_CASES])
def test_one_bad_rank_on_the_kernel_transport(case):
    """The same through transport="kernels" (one node of 4 ranks): before any call of its kind
    passed the host check the refusal meets the peers there, afterwards in the kernels (their
    MismatchError names the rank and quotes its error)."""
    assert_case(world_results(_kernel_refusal_entry, W), case)


# -- handles carry their dispatch's identity ----------------------------------------------------
def _mismatched_handle_entry(rank, world_size):
    buf = Buffer(ranks_per_node=L, timeout_s=TIMEOUT_S)
    x, idx, w, e = _inputs(rank, world_size)
    other_x, other_idx, other_w, _ = _inputs(rank, world_size, seed=43, num_tokens=20)
    messages = {}
    for name, second in (("same-rows", (x * 2, idx, w)), ("different-rows", (other_x, other_idx, other_w))):
        first = buf.dispatch(x, idx, w, e)
        then = buf.dispatch(*second, e)
        if rank == 1:
            same = first[0].shape[0] == then[0].shape[0]
            assert same == (name == "same-rows"), "the case's row counts are not what it says"
        mine = then if rank == 1 else first  # rank 1 holds the other dispatch's handle
        for op, call in (
            ("combine", lambda m=mine: buf.combine(m[0], m[4])),
            ("cached dispatch", lambda m=mine: buf.dispatch(x if m is first else second[0], handle=m[4])),
        ):
            elapsed, err = _timed(call)
            assert isinstance(err, ValueError), f"{name} {op}: {err!r}"
            assert elapsed < FAST_S, f"{name} {op}: {elapsed:.2f} s"
            messages[f"{name} {op}"] = (str(err), first[4].dispatch_id, then[4].dispatch_id)
        _still_usable(rank, world_size, buf)
    buf.close()
    return messages


def test_mismatched_handle_is_a_value_error_on_every_rank():
    """Rank 1 combines (and replays) the handle of another dispatch than its peers, with the
    same and with different row counts: a ValueError on every rank naming the dispatches and
    the ranks, never a gloo abort or a wrong sum; the Buffer works afterwards."""
    results = world_results(_mismatched_handle_entry, W)
    for rank, messages in enumerate(results):
        assert len(messages) == 4
        for case, (message, first, then) in messages.items():
            if rank == 1:
                theirs = ", ".join(f"dispatch #{first} on EP rank {r}" for r in (0, 2, 3))
                expected = f"handle is dispatch #{then} here but {theirs}"
            else:
                expected = f"handle is dispatch #{first} here but dispatch #{then} on EP rank 1;"
            assert f"EP rank {rank}: " in message and "arguments differ across ranks" in message, (case, message)
            assert expected in message, (case, message)


# -- Buffer() agrees its arguments before any process group ---------------------------------------
def _construction_entry(rank, world_size):
    cases = {
        "ranks-per-node": (
            lambda: Buffer(ranks_per_node=3 if rank == 1 else L, timeout_s=TIMEOUT_S),
            ValueError,
            r"EP rank \d: Buffer\(\) refused by EP rank 1: ranks_per_node: ranks_per_node must divide the world "
            r"size 4, got ranks_per_node=3",
        ),
        "ranks-per-node-bool": (
            lambda: Buffer(ranks_per_node=True if rank == 1 else L, timeout_s=TIMEOUT_S),
            ValueError,
            r"refused by EP rank 1: ranks_per_node: ranks_per_node must be a positive int, got True",
        ),
        "group-type": (
            lambda: Buffer("world" if rank == 1 else None, ranks_per_node=L, timeout_s=TIMEOUT_S),
            TypeError,
            r"refused by EP rank 1: group: group must be a torch.distributed ProcessGroup",
        ),
        "num-chunks-bool": (
            lambda: Buffer(ranks_per_node=L, num_chunks=True if rank == 1 else None, timeout_s=TIMEOUT_S),
            ValueError,
            r"refused by EP rank 1: num_chunks: num_chunks must be a positive int .*got True",
        ),
        "kernels-config": (
            lambda: Buffer(
                ranks_per_node=L,
                transport="kernels" if rank == 1 else "torch_dist",
                config=Config(num_slots=12, chunk_tokens=8) if rank == 1 else None,
                timeout_s=TIMEOUT_S,
            ),
            ValueError,
            r"refused by EP rank 1: transport: the internode kernels need Config.chunk_tokens to divide",
        ),
        "ranks-per-node-differ": (
            lambda: Buffer(ranks_per_node=4 if rank == 1 else L, timeout_s=TIMEOUT_S),
            ValueError,
            r"Buffer\(\) arguments differ across ranks: ranks_per_node is "
            + (
                r"4 here but 2 on EP rank 0, 2 on EP rank 2, 2 on EP rank 3"
                if rank == 1
                else r"2 here but 4 on EP rank 1"
            ),
        ),
        "num-chunks-differ": (
            lambda: Buffer(ranks_per_node=L, num_chunks=2 if rank == 3 else None, timeout_s=TIMEOUT_S),
            ValueError,
            r"Buffer\(\) arguments differ across ranks: num_chunks is "
            + (r"2 here" if rank == 3 else r"None here but 2 on EP rank 3"),
        ),
        "config-auto-differ": (  # one node of W kernels ranks; config="auto" is agreed like a Config
            lambda: Buffer(
                ranks_per_node=W, transport="kernels", config="auto" if rank == 1 else None, timeout_s=TIMEOUT_S
            ),
            ValueError,
            r"Buffer\(\) arguments differ across ranks: config is .*'auto'",
        ),
        "num-sms-differ": (  # a Config's fields are compared by name
            lambda: Buffer(ranks_per_node=W, transport="kernels", num_sms=2 if rank == 1 else 4, timeout_s=TIMEOUT_S),
            ValueError,
            r"Buffer\(\) arguments differ across ranks: config.num_sms is "
            + (
                r"2 here but 4 on EP rank 0, 4 on EP rank 2, 4 on EP rank 3"
                if rank == 1
                else r"4 here but 2 on EP rank 1"
            ),
        ),
        "every-rank-bad": (
            lambda: Buffer(ranks_per_node=L, timeout_s=-1),
            ValueError,
            r"refused by EP rank 0 \(EP ranks \[1, 2, 3\] refused theirs too\): timeout_s: timeout_s must be a "
            r"positive",
        ),
    }

    def run(name, make, error, match):
        elapsed, err = _timed(make)
        assert isinstance(err, error) and re.search(match, str(err)), f"{name}: {err!r}"
        assert "a Buffer() with good arguments can follow" in str(err), str(err)
        assert elapsed < FAST_S, f"{name}: {elapsed:.2f} s"
        good = Buffer(ranks_per_node=L, timeout_s=TIMEOUT_S)  # the world is unchanged
        _still_usable(rank, world_size, good)
        good.close()

    return run_cases(rank, world_size, {name: lambda r, w, a=args, n=name: run(n, *a) for name, args in cases.items()})


CONSTRUCTION_CASES = [
    "ranks-per-node",
    "ranks-per-node-bool",
    "group-type",
    "num-chunks-bool",
    "kernels-config",
    "ranks-per-node-differ",
    "num-chunks-differ",
    "config-auto-differ",
    "num-sms-differ",
    "every-rank-bad",
]


@pytest.mark.parametrize("case", CONSTRUCTION_CASES)
def test_refused_buffer_leaves_the_world_usable(case):
    """Buffer() with a bad (or different) argument on one rank: every rank raises the same error
    naming the rank and the field within FAST_S, and a good Buffer() right after works."""
    if case in ("config-auto-differ", "num-sms-differ") and not _ext.extension_status().built:
        pytest.skip("transport='kernels' needs the built extension moe_dispatch._C")
    results = world_results(_construction_entry, W)
    assert_case(results, case)


# -- close() frees what a Buffer made -----------------------------------------------------------
def _settled() -> dict[str, int]:
    """:func:`process_resources` once threads that were told to end have ended (bounded)."""
    deadline = time.monotonic() + 5.0
    while True:
        gc.collect()
        now = process_resources()
        if now["threads"] <= threading.active_count() + 4 or time.monotonic() > deadline:
            return now
        time.sleep(0.05)


NUM_BUFFERS = 50
RSS_GROWTH_KIB = 48 * 1024  # allocator noise over 50 Buffers; a leak of one Buffer's state per Buffer is more
# torch's own store keys: gloo's rendezvous leaves one key per member of each group made, and a Buffer
# makes at most three groups per rank (the host group; a node group, or torch_dist's node and rail groups)
TORCH_KEYS_PER_RANK = 3


def _store_keys() -> tuple[int, set[str] | None]:
    """The default store's key count, and its keys where the store lists them (``list_keys``, newer torch)."""
    store = torch.distributed.distributed_c10d._get_default_store()
    return store.num_keys(), set(store.list_keys()) if hasattr(store, "list_keys") else None


def _buffers_entry(rank, world_size, transport, closed, ranks_per_node=None):
    """Makes, uses and closes (or drops) NUM_BUFFERS Buffers after a warm-up; returns the
    resources before and after, the ResourceWarnings seen, the store keys left (count), those of
    them that are not moe_dispatch's own (torch's, where the store lists its keys: else all), and
    whether the last Buffer's progress record is left."""

    def one():
        buf = Buffer(transport=transport, timeout_s=TIMEOUT_S, ranks_per_node=ranks_per_node)
        x, idx, w, e = _inputs(rank, world_size, hidden=256, num_tokens=64)
        recv_x, *_, handle, _ = buf.dispatch(x, idx, w, e)
        buf.combine(expert(recv_x, rank), handle)
        return buf

    for _ in range(3):  # warm-up: gloo's and the allocator's one-time state
        one().close()
    before = _settled()
    torch.distributed.barrier()  # every rank's warm-up keys are gone
    count_before, keys_before = _store_keys()
    torch.distributed.barrier()  # every rank read them before the next Buffer() posts its arguments
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", ResourceWarning)
        for _ in range(NUM_BUFFERS):
            buf = one()
            state = buf.transport.progress._key(rank, "state")
            if closed:
                buf.close()
            del buf
        Buffer(transport=transport, timeout_s=TIMEOUT_S, ranks_per_node=ranks_per_node).close()  # frees the dropped
    after = _settled()
    torch.distributed.barrier()  # every rank closed: its keys are gone
    count_after, keys_after = _store_keys()
    left = count_after - count_before
    theirs = left if keys_after is None else sum(not k.startswith("moe_dispatch/") for k in keys_after - keys_before)
    stale = [k for k in [state] if torch.distributed.distributed_c10d._get_default_store().check([k])]
    torch.distributed.barrier()  # rank 0 hosts the store: it waits for the others' reads
    warned = [str(w.message) for w in seen if issubclass(w.category, ResourceWarning)]
    return before, after, warned, left, theirs, stale


def _transports():
    kinds = ["torch_dist"]
    if _ext.extension_status().built:
        kinds.append("kernels")
    return kinds


def _churns():
    """(transport, ranks_per_node) of the churn tests: one node of 2 ranks on each transport, and
    2 nodes of one rank on the kernels (their hierarchical path)."""
    one_node = [pytest.param(t, None, id=f"{t}-1x2") for t in _transports()]
    return one_node + [pytest.param(t, 1, id=f"{t}-2x1") for t in _transports() if t == "kernels"]


@pytest.mark.parametrize("closed", [True, False], ids=["closed", "dropped"])
@pytest.mark.parametrize(("transport", "ranks_per_node"), _churns())
def test_close_frees_everything(transport, ranks_per_node, closed):
    """50 Buffers made, used and closed (or dropped without close()) on each transport (kernels:
    their CPU backend, shared memory; across two nodes, too): threads, fds, process groups,
    /dev/shm files and mappings stay exactly flat, RSS within RSS_GROWTH_KIB, no moe_dispatch
    store key is left, and torch's own (group rendezvous keys) stay within TORCH_KEYS_PER_RANK
    per rank and Buffer; a dropped Buffer warns (ResourceWarning)."""
    results = world_results(_buffers_entry, 2, transport, closed, ranks_per_node)
    for rank, (before, after, warned, left, theirs, stale) in enumerate(results):
        counted = ("threads", "fds", "shm_files", "shm_mappings")
        # torch < 2.14 keeps a dropped Buffer's groups on purpose (groups.NAMES_REUSED, docs/status.md)
        counted += ("groups",) if closed or not NAMES_REUSED else ()
        for what in counted:
            assert after[what] == before[what], f"rank {rank}: {what} {before[what]} -> {after[what]}"
        growth = after["rss_kib"] - before["rss_kib"]
        assert growth < RSS_GROWTH_KIB, f"rank {rank}: RSS grew by {growth} KiB over {NUM_BUFFERS} Buffers"
        assert not stale and left == theirs, f"rank {rank}: {left - theirs} moe_dispatch store keys left: {stale}"
        bound = TORCH_KEYS_PER_RANK * 2 * (NUM_BUFFERS + 1)
        assert theirs <= bound, f"rank {rank}: {theirs} store keys left by {NUM_BUFFERS + 1} Buffers (bound {bound})"
        if closed:
            assert not warned, warned
        else:
            assert len(warned) == NUM_BUFFERS, f"{len(warned)} ResourceWarnings for {NUM_BUFFERS} dropped Buffers"
            assert "was garbage-collected without close()" in warned[0], warned[0]


# -- after a CommError the Buffer is broken --------------------------------------------------------
def _broken_entry(rank, world_size):
    timeout = 2.0
    buf = Buffer(timeout_s=timeout)
    x, idx, w, e = _inputs(rank, world_size)
    out = {}
    if rank == 1:
        time.sleep(2 * timeout)  # rank 0 times out without it
    elapsed, err = _timed(lambda: buf.dispatch(x, idx, w, e))
    out["first"] = (elapsed, type(err).__name__, str(err))
    for name, call in (("dispatch", lambda: buf.dispatch(x, idx, w, e)), ("combine", lambda: buf.combine(x, None))):
        elapsed, err = _timed(call)
        out[name] = (elapsed, type(err).__name__, str(err))
    elapsed, err = _timed(buf.close)
    out["close"] = (elapsed, repr(err))
    fresh = Buffer(timeout_s=TIMEOUT_S)  # a new Buffer works
    _still_usable(rank, world_size, fresh)
    fresh.close()
    return out


def test_comm_error_breaks_the_buffer():
    """A CommError (rank 0 timed out waiting for rank 1, then rank 1 for rank 0) marks the Buffer
    broken: every later call raises CommError at once, saying that a new Buffer is needed and
    why; close() frees it locally at once; a new Buffer works."""
    for rank, out in enumerate(world_results(_broken_entry, 2)):
        elapsed, kind, message = out["first"]
        assert kind == "CommError", message
        for name in ("dispatch", "combine"):
            elapsed, kind, message = out[name]
            assert kind == "CommError" and elapsed < 0.5, (name, elapsed, message)
            assert (
                f"EP rank {rank}: this Buffer is broken and refuses every later call: a new Buffer is needed" in message
            )
            assert "It broke on: CommError: EP rank" in message, message
        assert out["close"][0] < 1.0 and out["close"][1] == "None", out["close"]


# -- one thread per Buffer -------------------------------------------------------------------------
def _threads_entry(rank, world_size):
    buf = Buffer(timeout_s=TIMEOUT_S)
    x, idx, w, e = _inputs(rank, world_size)
    result, second = {}, None
    if rank == 1:
        time.sleep(1.0)  # rank 0's first thread waits inside its dispatch meanwhile
        buf.dispatch(x, idx, w, e)
    else:
        worker = threading.Thread(target=lambda: result.update(out=buf.dispatch(x, idx, w, e)), name="first")
        worker.start()
        time.sleep(0.3)
        elapsed, err = _timed(lambda: buf.dispatch(x, idx, w, e))
        second = (elapsed, repr(err))
        worker.join(30)
        expected = reference.dispatch(*_world(world_size), e, world_size)[rank].recv_x
        assert torch.equal(result["out"][0], expected), "the first thread's dispatch must complete unharmed"
    # Another thread, one at a time: fine.
    done = {}
    worker = threading.Thread(target=lambda: done.update(ok=_still_usable(rank, world_size, buf) or True))
    worker.start()
    worker.join(30)
    buf.close()
    return second, done.get("ok", False)


def _world(world_size):
    xs, idxs, ws = [], [], []
    for r in range(world_size):
        x, idx, w, _ = _inputs(r, world_size)
        xs.append(x)
        idxs.append(idx)
        ws.append(w)
    return xs, idxs, ws


def test_a_second_thread_gets_a_clear_error():
    """While one thread is inside a Buffer's dispatch, a second thread's call raises RuntimeError
    at once naming both; the first completes; another thread later may use it."""
    (second, ok0), (_, ok1) = world_results(_threads_entry, 2)
    elapsed, message = second
    assert elapsed < 0.5, elapsed
    assert (
        "RuntimeError(\"EP rank 0: Buffer.dispatch called on thread 'MainThread' while thread 'first' is inside "
        "Buffer.dispatch: one thread at a time may use a Buffer" in message
    ), message
    assert ok0 and ok1


# -- boundary checks ----------------------------------------------------------------------------
def _boundary_entry(rank, world_size):
    buf = Buffer(timeout_s=TIMEOUT_S)
    cases = {}

    def strided_column(r, w):
        """[T, 1] of strides (1, T): torch calls it contiguous, a byte view does not; it travels."""
        xs = [torch.randn(1, 5, generator=torch.Generator().manual_seed(i)).t() for i in range(w)]
        assert xs[r].is_contiguous() and xs[r].stride() == (1, 5)
        idxs, ws, e = make_routing(w, [5] * w, seed=44)
        recv_x, *_, handle, _ = buf.dispatch(xs[r], idxs[r], ws[r], e)
        assert torch.equal(recv_x, reference.dispatch(xs, idxs, ws, e, w)[r].recv_x)
        out, _ = buf.combine(recv_x, handle, torch.ones(recv_x.shape[0] * 2)[::2])  # strided [R] scales
        assert torch.equal(out, buf.combine(recv_x, handle)[0])

    def backward_t1_h1(r, w):
        """backward() of a T=1, H=1 output: an expanded [1, 1] gradient reaches the transport."""
        idxs, ws, e = make_routing(w, [1] * w, seed=45, drop=0.0)
        idxs = [torch.tensor([[(r * 4 + 5) % e]]) for r in range(w)]
        x = torch.randn(1, 1).requires_grad_()
        recv_x, *_, handle, _ = buf.dispatch(x, idxs[r], None, e)
        out, _ = buf.combine(recv_x, handle)
        out.sum().backward()
        assert torch.equal(x.grad, handle.is_token_in_rank.sum(1, keepdim=True).float())

    def strict_ints(r, w):
        idx = torch.zeros(2, 1, dtype=torch.int64)
        with pytest.raises(ValueError, match=r"num_experts must be a positive int, got True"):
            buf.get_dispatch_layout(idx, True)
        with pytest.raises(ValueError, match=r"num_experts must be at most 1048576 \(2\^20: .*got 2097152"):
            buf.get_dispatch_layout(idx, 2**21)

    def not_a_member(r, w):
        alone = torch.distributed.new_group([0])  # every rank creates it
        if r == 0:
            Buffer(alone, timeout_s=TIMEOUT_S).close()
        else:
            with pytest.raises(ValueError, match=r"group does not contain this process \(global rank 1\)"):
                Buffer(alone, timeout_s=TIMEOUT_S)

    cases.update(
        strided_column=strided_column, backward_t1_h1=backward_t1_h1, strict_ints=strict_ints, not_a_member=not_a_member
    )
    results = run_cases(rank, world_size, cases)
    buf.close()
    return results


@pytest.mark.parametrize("case", ["strided_column", "backward_t1_h1", "strict_ints", "not_a_member"])
def test_boundary(case):
    assert_case(world_results(_boundary_entry, 2), case)


# -- kill diagnosis ----------------------------------------------------------------------------
KILL_AT = 4  # the victim dies before its KILL_AT-th dispatch


def _kill_entry(rank, world_size, victim, out_dir):
    buf = Buffer(ranks_per_node=L, timeout_s=TIMEOUT_S)
    for i in range(50):
        x, idx, w, e = _inputs(rank, world_size, seed=i)
        if rank == victim and i == KILL_AT:
            os.kill(os.getpid(), signal.SIGKILL)
        start = time.monotonic()
        try:
            recv_x, *_, handle, _ = buf.dispatch(x, idx, w, e)
            buf.combine(recv_x, handle)
        except CommError as err:
            with open(os.path.join(out_dir, f"rank{rank}.part"), "w") as f:
                f.write(f"{time.monotonic() - start:.3f}\n{err}")
            os.replace(os.path.join(out_dir, f"rank{rank}.part"), os.path.join(out_dir, f"rank{rank}"))
            return None
    return None


@pytest.mark.parametrize("victim", [3, 0], ids=["rank3", "rank0-store-host"])
def test_kill_names_the_dead_rank(victim, tmp_path):
    """SIGKILL one rank of a 2x2 world between operations: every survivor raises CommError
    within seconds (timeout_s is 60) naming the dead rank; when the dead rank hosted the store
    (global rank 0), that the store died with it."""
    from moe_dispatch.testing.launch import spawn_world

    with pytest.raises(RuntimeError, match=rf"ranks \[{victim}\] exited without a result \(exit codes \[-9\]\)"):
        spawn_world(W, _kill_entry, victim, str(tmp_path), timeout_s=120)
    for rank in range(W):
        if rank == victim:
            continue
        path = tmp_path / f"rank{rank}"
        for _ in range(100):  # the survivors may still be writing when the launcher gives up
            if path.exists():
                break
            time.sleep(0.1)
        seconds, message = path.read_text().split("\n", 1)
        assert float(seconds) < 10, f"rank {rank} took {seconds} s: {message}"
        if victim == 0:
            assert "the store died with rank 0: EP rank 0 is gone" in message, message
        else:
            # Its last mark may be an earlier operation's: marks are stored every WRITE_INTERVAL_S.
            assert re.search(
                rf"the connection to a peer was lost, and EP rank {victim} \(last at #\d+ .*?\) is the only peer "
                r"that neither failed in this operation nor passed it: most likely it died",
                message,
            ), message


# -- Buffers on overlapping groups ------------------------------------------------------------------
def _overlapping_entry(rank, world_size):
    """A Buffer on ranks [0, 1] only, then one on the world: c10d names the transports' groups
    after a count of the groups each process made, which the first Buffer advanced on ranks 0
    and 1 only."""
    pair = torch.distributed.new_group([0, 1])  # every rank creates it
    if rank < 2:
        first = Buffer(pair, timeout_s=TIMEOUT_S)
        _still_usable(rank, 2, first)
        first.close()
    start = time.monotonic()
    whole = Buffer(timeout_s=TIMEOUT_S)
    _still_usable(rank, world_size, whole)
    whole.close()
    return time.monotonic() - start


def test_buffers_on_overlapping_groups():
    """No deadlock in new_group after a Buffer on a sub-group: the ranks continue from the
    largest group count."""
    for elapsed in world_results(_overlapping_entry, W):
        assert elapsed < 20, elapsed
