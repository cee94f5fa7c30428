"""The internode transport (``moe_dispatch.transport.kernels.internode``) against ``moe_dispatch.reference``.

CPU (wherever the extension is built): the RDMA buffer layout mirror equals the C++ one; both
pipelines (fused, the default, and staged) - their role code on threads standing in for warps,
put-with-signal as memcpy + release store - reproduce the oracle bit for bit in N x L worlds of
1x2, 2x1, 2x2, 2x4, 3x2 and 4x1 (and 1x4), with empty ranks, tokens touching every node, bf16,
fp16, fp32 and fp8-with-scales rows, weights or none, row scales, cached dispatch (with top-k
or x alone); the fused pipeline's budget mode fills and overflows without reading the host; the
device-side header check catches a handle of another dispatch, a hidden size of its own and a
refusal (status != 0) on one rank, in dispatch, cached dispatch and combine, on every rank and
without a timeout; a withheld rank makes the others time out with a message naming rank, node,
channel and counter; multi-process gloo worlds (shared memory, one process per rank) of 2x2 and
3x2 do all of it through ``testing.ranks.InternodeRank(device="cpu")``; the CPU backend's driver
(csrc/tests/internode_tsan.cpp) runs clean under ThreadSanitizer.

GPU (skipped without one): the same kernels in loopback mode (N x L simulated ranks on one GPU)
against the oracle for both pipelines, determinism, budget mode in a CUDA graph, the header
cases, the timeout error, and the NVSHMEM world.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from moe_dispatch import BudgetOverflowError, _ext
from moe_dispatch.config import VARIANTS, Config
from moe_dispatch.errors import InternodeTimeoutError
from moe_dispatch.kernel_layout import HEADER_WORDS, max_slot_bytes, rdma_layout
from moe_dispatch.semantics import reference
from moe_dispatch.semantics.quant import per_token_cast_to_fp8_reference
from moe_dispatch.testing.loopback import InternodeLoopback
from moe_dispatch.transport.kernels.experimental import StagedInternodeHandle
from moe_dispatch.transport.kernels.internode import cross_node_bytes, describe_timeout, fused_channels
from moe_dispatch.transport.kernels.internode_engines import InternodeHandle
from moe_dispatch.transport.kernels.nvshmem import HEAP_MARGIN, symmetric_heap_bytes
from python_tests.conftest import needs_gpu
from python_tests.test_intranode_cuda import (
    assert_dispatch_equal,
    cpu,
    header_cases,
    make_world,
    rank_roundtrips,
    replay_budget_dispatch,
    run_roundtrip,
    seed_of,
    transport_header_cases,
)
from python_tests.tsan import build_tsan_driver
from python_tests.worlds import assert_case, run_cases, world_results

STATUS = _ext.extension_status()
built = pytest.mark.skipif(not STATUS.built, reason=f"moe_dispatch._C not available: {STATUS.error}")
PIPELINES = ("fused", "staged")


def lower_bound_bytes(idxs, num_experts: int, num_nodes: int, ranks_per_node: int, row_bytes: int) -> int:
    """sum over tokens of |nodes(t) minus the source's node| x row bytes (DESIGN.md)."""
    experts_per_node = num_experts // num_nodes
    total = 0
    for r, idx in enumerate(idxs):
        nodes = torch.zeros(idx.shape[0], num_nodes, dtype=torch.bool)
        for k in range(idx.shape[1]):
            valid = idx[:, k] >= 0
            nodes[valid, (idx[valid, k] // experts_per_node).long()] = True
        nodes[:, r // ranks_per_node] = False
        total += int(nodes.sum()) * row_bytes
    return total


def roundtrip(lb: InternodeLoopback, xs, idxs, ws, num_experts: int, *, row_scales=False, fp8=False, **kw):
    """Dispatch then combine, both checked against the oracle, and the bytes that crossed nodes
    equal to the de-duplicated lower bound; returns the dispatch results."""
    L = lb.ranks_per_node
    row_bytes = xs[0].shape[1] * (1 if fp8 else xs[0].element_size())

    def crossed_once(results):
        assert cross_node_bytes([r.handle for r in results], L, row_bytes) == lower_bound_bytes(
            cpu(idxs), num_experts, lb.num_nodes, L, row_bytes
        )

    return run_roundtrip(
        lb,
        xs,
        idxs,
        ws,
        num_experts,
        row_scales=row_scales,
        fp8=fp8,
        ranks_per_node=L,
        seed=7,
        after_dispatch=crossed_once,
        **kw,
    )


def all_nodes_routing(num_nodes: int, ranks_per_node: int, tokens: int, num_experts: int, seed: int):
    """Top-k = N with one expert on every node: each token touches every node."""
    gen = torch.Generator().manual_seed(seed)
    per_node = num_experts // num_nodes
    return [
        (torch.randint(0, per_node, (tokens, num_nodes), generator=gen) + torch.arange(num_nodes) * per_node)
        for _ in range(num_nodes * ranks_per_node)
    ]


def cpu_loopback(
    N,
    L,
    hidden,
    num_topk,
    *,
    pipeline="fused",
    num_sms=2,
    slots=2,
    chunk=1,
    group_warps=1,
    workers=2,
    timeout_s=60,
    variant="current",
    **kw,
) -> InternodeLoopback:
    config = Config(num_sms=num_sms, num_slots=slots, chunk_tokens=chunk, internode_pipeline=pipeline).with_variant(
        variant
    )
    return InternodeLoopback(
        N,
        L,
        hidden,
        num_topk,
        config=config,
        device="cpu",
        timeout_s=timeout_s,
        cpu_options={"group_warps": group_warps, "num_workers": workers},
        **kw,
    )


# --- layout ------------------------------------------------------------------------------------


@built
@pytest.mark.parametrize(
    "nodes, local, channels, slots, slot_bytes",
    [(1, 1, 1, 1, 16), (2, 8, 8, 32, 14640), (64, 16, 16, 4, 5808), (3, 5, 5, 6, 48)],
)
def test_rdma_layout_mirror_matches_extension(nodes, local, channels, slots, slot_bytes):
    layout = rdma_layout(nodes, local, channels, slots, slot_bytes)
    assert layout.__dict__ == _ext._C.internode_rdma_layout(nodes, local, channels, slots, slot_bytes).to_dict()
    assert (
        layout.recv_offset % 128 == 0
        and layout.send_offset - layout.recv_offset == nodes * channels * slots * slot_bytes
    )
    assert layout.msg_bytes >= 128 + 4 * channels * (1 + local)  # header line, node counts, per-rank counts


def test_symmetric_heap_is_sized_from_the_buffer():
    layout = rdma_layout(4, 8, 8, 32, max_slot_bytes(7168, 8))
    heap = symmetric_heap_bytes(layout.total_bytes)
    need = layout.total_bytes + HEAP_MARGIN
    assert heap % (2 << 20) == 0 and need <= heap < need + (2 << 20)


def test_fused_channels_keep_the_sm_budget():
    config = Config(num_sms=16)
    assert [fused_channels(n, config) for n in (2, 4, 6, 16)] == [1, 1, 2, 5]
    with pytest.raises(ValueError, match=r"num_sms must be even and in \[2, 16\]"):
        fused_channels(18, config)
    with pytest.raises(ValueError, match=r"Config.internode_pipeline must be one of \('fused', 'staged'\), got 'x'"):
        Config(internode_pipeline="x")


@built
def test_nvshmem_host_calls_are_compiled_in():
    if not STATUS.with_nvshmem:
        pytest.skip("the extension was built without NVSHMEM")
    for name in (
        "nvshmem_unique_id",
        "nvshmem_init",
        "nvshmem_malloc",
        "nvshmem_free",
        "nvshmem_barrier_all",
        "nvshmem_finalize",
        "nvshmem_my_pe",
        "nvshmem_n_pes",
    ):
        assert callable(getattr(_ext._C, name)), name
    assert _ext._C.internode_limits["max_nodes"] == 64 and _ext._C.internode_limits["max_ranks_per_node"] == 16


def test_timeout_message_names_rank_node_channel_and_counter():
    message, fields = describe_timeout([1, 5, 3, 5, 2, 1, 2, 7, 4] + [0] * 7, 0.5, ranks_per_node=4)
    assert "node dispatch (stage 1, RDMA) timed out after timeout_s=0.5: rank 5 (node 1, local 1)" in message
    assert "tail of RDMA queue rank 1 (node 0, local 1) -> rank 5, channel 2, should reach 7 but stayed at 4" in message
    assert fields["node"] == 1 and fields["peer_node"] == 0 and fields["counter"] == "tail"
    message, fields = describe_timeout([1, 2, 2, 0, 1, 3, 3, 5, 0] + [0] * 7, 1, ranks_per_node=4, node=1)
    assert "rank 4 (node 1, local 0)" in message and "NVLink queue rank 4 -> rank 7 (node 1, local 3)" in message
    assert fields["stage"] == 2 and fields["peer"] == 7
    message, fields = describe_timeout([1, 2, 3, 6, 0, 4, 6, 3, 0] + [0] * 7, 1, ranks_per_node=2, fused=True)
    assert "dispatch (NVLink)" in message and fields["counter"] == "forwarded tail" and fields["stage"] == 2
    message, fields = describe_timeout([1, 4, 1, 2, -1, 0, 4, 9, 0] + [0] * 7, 1, ranks_per_node=2, fused=True)
    assert "waited for the header of rank 0 (node 0, local 0)" in message and fields["phase"] == "notify"


# --- the protocol on CPU threads vs the oracle -------------------------------------------------

CPU_WORLDS = [
    # N, L, tokens, hidden, K, E, slots, chunk, group_warps, workers, skewed
    (1, 2, [14, 0], 32, 2, 8, 2, 1, 1, 2, False),  # one node: stage 1 is a local copy
    (2, 1, [12, 9], 48, 2, 8, 1, 1, 1, 1, True),  # one rank per node: stage 2 is trivial
    (2, 2, [10, 0, 17, 9], 32, 3, 16, 2, 2, 2, 2, True),  # an empty rank
    (2, 4, 8, 32, 4, 32, 2, 1, 1, 2, False),
    (3, 2, [9, 0, 11, 7, 0, 10], 32, 3, 12, 4, 2, 1, 2, True),  # N not a power of two
    (4, 1, 10, 48, 2, 8, 1, 1, 1, 1, False),  # one-slot rings, L = 1
    (1, 4, [11, 3, 0, 8], 32, 2, 8, 2, 2, 2, 3, True),
]


def world_id(c) -> str:
    return c if isinstance(c, str) else f"{c[0]}x{c[1]}-K{c[4]}-slots{c[6]}-chunk{c[7]}"


# The internode kernels' variants whose role code differs (rows in pairs, combine teams in the
# source reducers, the coordinators' backoff; ready flags are intranode only) on the worlds with
# an empty rank, N = 3, and one-slot rings; every world with the current kernels.
INTERNODE_VARIANTS = ["rows2", "team2", "team4", "backoff", "combined"]
FUSED_CASES = [(case, "current") for case in CPU_WORLDS] + [
    (case, name) for case in (CPU_WORLDS[2], CPU_WORLDS[4], CPU_WORLDS[5]) for name in INTERNODE_VARIANTS
]


@built
@pytest.mark.parametrize("case, variant", FUSED_CASES, ids=world_id)
def test_cpu_fused_matches_oracle(case, variant):
    N, L, tokens, hidden, K, E, slots, chunk, group_warps, workers, skewed = case
    workers = max(workers, 4) if variant.startswith("team") or variant == "combined" else workers
    lb = cpu_loopback(
        N, L, hidden, K, slots=slots, chunk=chunk, group_warps=group_warps, workers=workers, variant=variant
    )
    xs, idxs, ws = make_world(seed_of(case), N * L, tokens, hidden, K, E, skewed=skewed)
    first = roundtrip(lb, xs, idxs, ws, E, row_scales=True)
    assert all(isinstance(r.handle, InternodeHandle) for r in first)
    # Counters and flags need no reset: a cached dispatch, and one of x alone, reproduce the first.
    again = lb.dispatch(xs, idxs, ws, E, handles=[r.handle for r in first])
    bare = lb.dispatch(xs, None, None, E, handles=[r.handle for r in first])
    for a, b, c in zip(first, again, bare):
        assert torch.equal(a.recv_x, b.recv_x) and torch.equal(a.recv_topk_idx, b.recv_topk_idx)
        assert torch.equal(a.recv_x, c.recv_x) and c.recv_topk_idx is None
        assert torch.equal(a.recv_src_idx, c.recv_src_idx)


@built
@pytest.mark.parametrize(
    "case, variant",
    [(CPU_WORLDS[2], "current"), (CPU_WORLDS[4], "current"), (CPU_WORLDS[5], "current")]
    + [(CPU_WORLDS[4], name) for name in ("combined", "flags")],
    ids=world_id,
)
def test_cpu_staged_matches_oracle(case, variant):
    """The staged pipeline; its stage 2 is the intranode kernels, ready flags included."""
    N, L, tokens, hidden, K, E, slots, chunk, group_warps, workers, skewed = case
    lb = cpu_loopback(
        N,
        L,
        hidden,
        K,
        pipeline="staged",
        slots=slots,
        chunk=chunk,
        group_warps=group_warps,
        workers=max(workers, 4),
        variant=variant,
    )
    xs, idxs, ws = make_world(seed_of(case), N * L, tokens, hidden, K, E, skewed=skewed)
    first = roundtrip(lb, xs, idxs, ws, E, row_scales=True)
    assert all(isinstance(r.handle, StagedInternodeHandle) for r in first)
    bare = lb.dispatch(xs, None, None, E, handles=[r.handle for r in first])
    for a, c in zip(first, bare):
        assert torch.equal(a.recv_x, c.recv_x) and c.recv_topk_idx is None


@built
@pytest.mark.parametrize("pipeline", PIPELINES)
def test_cpu_every_node_fp8_fp16_fp32_and_no_weights(pipeline):
    N, L, E = 2, 2, 16
    lb = cpu_loopback(N, L, 256, N, pipeline=pipeline, element_bytes=4)
    idxs = all_nodes_routing(N, L, 9, E, seed=3)
    xs = [torch.randn(9, 256).to(torch.bfloat16) for _ in range(N * L)]
    results = roundtrip(lb, xs, idxs, None, E)
    assert all(r.handle.num_forward_rows == 9 * N for r in results)  # every token reached every node's forwarder
    roundtrip(lb, xs, idxs, None, E, fp8=True)
    roundtrip(lb, [x.float() for x in xs], idxs, None, E, row_scales=True)
    roundtrip(lb, [x.half() for x in xs], idxs, None, E, row_scales=True)


@built
def test_cpu_fused_budget_mode_fills_and_overflows_without_a_host_read(monkeypatch):
    N, L, E = 2, 2, 16
    lb = cpu_loopback(N, L, 32, 3)
    xs, idxs, ws = make_world(5, N * L, [16, 0, 20, 12], 32, 3, E)
    refs = reference.dispatch(xs, idxs, ws, E, L)
    most = max(r.src_idx.numel() for r in refs)

    def no_host_read(*_):
        raise AssertionError("a budget-mode dispatch read the device on the host")

    for method in ("tolist", "item", "cpu", "__bool__", "__int__"):  # what a host sync would take
        monkeypatch.setattr(torch.Tensor, method, no_host_read)
    fits = lb.dispatch(xs, idxs, ws, E, num_worst_tokens=most + 3, check=False, validate=False)
    short_budget = min(r.src_idx.numel() for r in refs if r.src_idx.numel()) - 2
    short = lb.dispatch(xs, idxs, ws, E, num_worst_tokens=short_budget, check=False, validate=False)
    monkeypatch.undo()
    lb.check()
    assert_dispatch_equal(fits, refs, num_rows=most + 3)
    for got, want in zip(fits, refs):
        n = want.src_idx.numel()
        assert got.recv_x.shape[0] == most + 3 and got.handle.num_recv_tokens is None
        assert int(got.handle.counts[0]) == n and int(got.handle.overflow) == 0
        assert bool((got.recv_topk_idx[n:] == -1).all()) and bool((got.recv_src_idx[n:] == -1).all())
        got.handle.check_overflow()
    # Rows up to the budget are right, the flag is set, combine counts the dropped rows as zeros.
    assert_dispatch_equal(short, refs, num_rows=short_budget)
    assert any(int(r.handle.overflow) for r in short)
    with pytest.raises(BudgetOverflowError, match=rf"allowed {short_budget}: rows past the budget were dropped"):
        next(r for r in short if int(r.handle.overflow)).handle.check_overflow()
    ys_full = [torch.randn(r.src_idx.numel(), 32).to(torch.bfloat16) for r in refs]
    outs = lb.combine(
        [torch.cat([y, y.new_zeros(max(0, short_budget - y.shape[0]), 32)])[:short_budget] for y in ys_full],
        [r.handle for r in short],
    )
    kept = [torch.cat([y[:short_budget], torch.zeros_like(y[short_budget:])]) for y in ys_full]
    for o, w in zip(outs, reference.combine(kept, idxs, E, L)):
        assert torch.equal(o, w)


@built
def test_cpu_fused_budget_drop_combine_and_replay_over_channels():
    """A budget far below the receive (2 channels, 2 x 3): combine and a cached dispatch move the
    rows each rank kept, whether the forwarders' holders fit forward_capacity (cut per ring) or
    not (the travelling rows listed): the kept rows combine as the oracle's, the dropped ones as
    zeros, and the replay lands the kept rows again."""
    N, L, E = 2, 3, 12
    lb = cpu_loopback(N, L, 32, 3, num_sms=6, slots=4, chunk=2)
    xs, idxs, ws = make_world(6, N * L, [16, 0, 20, 12, 9, 14], 32, 3, E)
    refs = reference.dispatch(xs, idxs, ws, E, L)
    ys = [torch.randn(r.src_idx.numel(), 32).to(torch.bfloat16) for r in refs]
    modes = set()
    for budget in (2, 7):
        short = lb.dispatch(xs, idxs, ws, E, num_worst_tokens=budget)
        assert_dispatch_equal(short, refs, num_rows=budget)
        assert short[0].handle.num_channels == 2
        modes |= {int(r.handle.counts[1]) > r.handle.forward_capacity for r in short}
        outs = lb.combine([torch.cat([y, y.new_zeros(budget, 32)])[:budget] for y in ys], [r.handle for r in short])
        kept = [torch.cat([y[:budget], torch.zeros_like(y[budget:])]) for y in ys]
        for o, w in zip(outs, reference.combine(kept, idxs, E, L)):
            assert torch.equal(o, w), f"budget {budget}: combine"
        replay = lb.dispatch([x * 2 for x in xs], None, None, E, handles=[r.handle for r in short])
        for got, want in zip(replay, refs):
            n = min(budget, want.src_idx.numel())
            assert torch.equal(got.recv_x[:n], want.recv_x[:n] * 2), f"budget {budget}: cached dispatch"
            assert not got.recv_x[n:].any()
    assert modes == {True, False}, "both records of the forwarded rows (holders, listed) must run"


@built
def test_cpu_header_mismatch_and_refusal_are_recorded_by_every_rank():
    """A handle of another dispatch on rank 1 and a refusal on rank 2 (fused pipeline, 2 x 2):
    every rank records it - directly (rail or local peer) or from a local peer's report."""
    lb = cpu_loopback(2, 2, 32, 2)
    header_cases(lb, lb.engines.rdma.records, "cpu", roundtrip)


WITHHELD = [
    ("fused", "notify", 1),
    ("fused", "dispatch", 1),
    ("fused", "combine", 1),
    ("staged", "node_notify", 1),
    ("staged", "node_dispatch", 1),
    ("staged", "dispatch", 2),
    ("staged", "node_combine", 1),
]


@built
@pytest.mark.parametrize("pipeline, phase, stage", WITHHELD, ids=lambda v: str(v))
def test_cpu_withheld_rank_times_out_with_its_name(pipeline, phase, stage):
    N, L, withheld = 2, 2, 3  # rank 3 = node 1, local 1
    lb = cpu_loopback(N, L, 32, 2, pipeline=pipeline, timeout_s=0.3)
    idxs = all_nodes_routing(N, L, 6, 8, seed=1)
    xs = [torch.randn(6, 32).to(torch.bfloat16) for _ in range(N * L)]
    if phase.endswith("combine"):
        results = lb.dispatch(xs, idxs, None, 8)
        ys = [torch.ones(r.handle.num_rows, 32, dtype=torch.bfloat16) for r in results]
        with pytest.raises(InternodeTimeoutError, match=r"timed out") as info:
            lb.combine(ys, [r.handle for r in results], withhold_rank=withheld, withhold_phase=phase)
    else:
        with pytest.raises(InternodeTimeoutError, match=r"timed out") as info:
            lb.dispatch(xs, idxs, None, 8, withhold_rank=withheld, withhold_phase=phase)
    error = info.value
    assert error.peer == withheld and error.rank != withheld, str(error)
    assert f"rank {withheld} (node 1, local 1)" in str(error)
    assert error.node == error.rank // L and error.counter in ("signal", "tail", "head", "header", "relayed header")
    assert error.stage == stage, str(error)
    lb.timeout_s = 60  # reset() ran: the same world works again
    roundtrip(lb, xs, idxs, None, 8)


@built
def test_bad_arguments_name_the_value():
    with pytest.raises(ValueError, match=r"chunk_tokens to divide Config.num_slots.*chunk_tokens=3, num_slots=4"):
        InternodeLoopback(2, 2, 32, 2, config=Config(num_sms=2, num_slots=4, chunk_tokens=3), device="cpu")
    with pytest.raises(ValueError, match=r"loopback simulates at most 16 ranks, got 3 x 6"):
        InternodeLoopback(3, 6, 32, 2, device="cpu")
    lb = cpu_loopback(2, 2, 32, 2, timeout_s=5)
    xs, idxs, ws = make_world(2, 4, 8, 32, 2, 8)
    with pytest.raises(ValueError, match=r"num_experts must be a positive multiple of 4, got 6"):
        lb.dispatch(xs, idxs, ws, 6)
    with pytest.raises(ValueError, match=r"needs \d+ bytes but the buffers' slots hold \d+"):
        lb.dispatch([torch.zeros(8, 64, dtype=torch.bfloat16)] * 4, idxs, ws, 8)
    results = lb.dispatch(xs, idxs, ws, 8)
    staged = cpu_loopback(2, 2, 32, 2, pipeline="staged", timeout_s=5)
    with pytest.raises(ValueError, match=r"the handle must be a StagedInternodeHandle .*got InternodeHandle"):
        staged.combine([r.recv_x for r in results], [r.handle for r in results])
    with pytest.raises(ValueError, match=r"num_worst_tokens needs Config.internode_pipeline='fused'"):
        staged.dispatch(xs, idxs, ws, 8, num_worst_tokens=20)
    with pytest.raises(ValueError, match=r"common is missing 'num_nodes'"):
        _ext._C.InternodeCommon()
    common = lb.engines.rdma.common(1, 0, None)
    with pytest.raises(ValueError, match=r"fused notify rank is missing 'is_token_in_rank'"):
        _ext._C.FusedNotifyRank()
    rank = _ext._C.FusedCombineRank(
        y=None,
        row_scale=None,
        is_token_in_node=None,
        recv_prefix=None,
        forward_prefix=None,
        relay_prefix=None,
        forward_mask=None,
        forward_cut=None,
        out=None,
        check=_ext._C.Check(header=[0] * HEADER_WORDS, mismatch=8),
        num_tokens=0,
        num_rows=0,
        forward_capacity=0,
        budget=-1,
    )
    with pytest.raises(ValueError, match=r"mode must be 'loopback' or 'nvshmem', got 'x'"):
        _ext._C.internode_fused_combine(common, [rank], 64, 0, "cpu", "x")


EXPERIMENTAL_IMPORTS = """
import sys
import torch
from moe_dispatch import Buffer, Config
from moe_dispatch.testing.loopback import InternodeLoopback
from moe_dispatch.testing.ranks import InternodeRank

xs = [torch.randn(6, 32).to(torch.bfloat16) for _ in range(4)]
idxs = [torch.stack([torch.randperm(8)[:2] for _ in range(6)]) for _ in range(4)]
for pipeline in ("fused", "staged"):
    config = Config(num_sms=2, num_slots=2, chunk_tokens=1, internode_pipeline=pipeline)
    lb = InternodeLoopback(2, 2, 32, 2, config=config, device="cpu", timeout_s=60)
    results = lb.dispatch(xs, idxs, None, 8)
    lb.combine([r.recv_x for r in results], [r.handle for r in results])
    print(pipeline, "moe_dispatch.transport.kernels.experimental" in sys.modules)
"""


@built
def test_only_the_staged_pipeline_imports_the_experimental_module():
    """kernels/experimental.py (the staged pipeline, kept to be timed) stays out of the default
    path: importing the package and running the fused pipeline leaves it unimported."""
    run = subprocess.run(
        [sys.executable, "-c", EXPERIMENTAL_IMPORTS], check=False, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["fused", "False", "staged", "True"], run.stdout


TSAN_CASES = [
    # N, L, channels, slots, chunk, group_warps, workers, rounds[, variant fields]
    (2, 2, 2, 2, 1, 2, 2, 3),
    (3, 1, 1, 2, 2, 1, 3, 3),  # N not a power of two, L = 1, one chunk fills the ring
    (2, 2, 1, 1, 1, 1, 1, 2),  # one-slot rings: every slot is reused at once
    (1, 3, 2, 2, 1, 2, 2, 2),  # one node: stage 1 is a local copy
    (2, 4, 1, 2, 1, 1, 2, 2),
    (2, 2, 2, 4, 2, 2, 4, 3, "rows=2", "team=2", "backoff=1"),  # the variants whose role code differs
    (3, 2, 1, 2, 2, 2, 4, 2, "rows=2", "team=4"),
]


def test_internode_protocol_has_no_data_race_under_threadsanitizer(tmp_path):
    """The CPU backend's driver (csrc/tests/internode_tsan.cpp), built with -fsanitize=thread:
    every simulated rank runs the fused notify / dispatch / cached dispatch / combine and the
    staged stage 1 as its own launches (the NVSHMEM launch shape), not joined with its peers
    between operations, over reused buffers. Every put must be ordered before the reads its
    signal releases, every read before the slot is put again; the notify parities, the chunk
    tags and the forwarders' head updates must hold while ranks run ahead; a mismatched last
    combine must be recorded by every rank without a timeout. The driver also checks dispatch
    against a direct computation and combine of the received rows."""
    exe, env = build_tsan_driver(tmp_path, "internode")
    for case in TSAN_CASES:
        run = subprocess.run(
            [str(exe), *map(str, case)], check=False, capture_output=True, text=True, env=env, timeout=300
        )
        if "FATAL: ThreadSanitizer" in run.stderr:  # e.g. a kernel whose memory layout the runtime rejects
            pytest.skip(f"ThreadSanitizer runtime unusable here: {run.stderr[-300:]}")
        output = run.stdout + run.stderr
        assert run.returncode == 0 and "WARNING: ThreadSanitizer" not in output, f"{case}: {output[-6000:]}"
        assert "ok" in run.stdout, f"{case}: {output[-2000:]}"


# --- one process per rank over shared memory (gloo worlds) ---------------------------------------


def _shm_transport(rank, world_size, ranks_per_node, pipeline, hidden, num_topk):
    import torch.distributed as dist

    from moe_dispatch.testing.ranks import InternodeRank

    return InternodeRank(
        dist.group.WORLD,
        rank,
        ranks_per_node,
        hidden,
        num_topk,
        device="cpu",
        config=Config(num_sms=2, num_slots=4, chunk_tokens=2, internode_pipeline=pipeline),
        timeout_s=30,
    )


def _shm_roundtrip(rank, world_size, ranks_per_node, pipeline):
    """InternodeRank's CPU path: RDMA buffers in shared memory mapped by every rank, copies
    for the puts, the NVLink buffers of the node's IntranodeBuffers; each process its own rank."""
    hidden, num_topk, num_experts = 64, 3, 4 * world_size
    xs, idxs, ws = make_world(47, world_size, [24, 0, 32, 20, 12, 28][:world_size], hidden, num_topk, num_experts)
    transport = _shm_transport(rank, world_size, ranks_per_node, pipeline, hidden, num_topk)
    try:
        rank_roundtrips(transport, rank, xs, idxs, ws, num_experts, ranks_per_node)
        first = transport.dispatch(xs[rank], idxs[rank], ws[rank], num_experts)
        cached = transport.dispatch(xs[rank] * 2, None, None, num_experts, handle=first.handle)
        assert torch.equal(cached.recv_x, first.recv_x * 2) and cached.recv_topk_idx is None
        if pipeline == "fused":
            budget = sum(x.shape[0] for x in xs)  # the same on every rank (their headers compare it), never short
            fits = transport.dispatch(xs[rank], idxs[rank], ws[rank], num_experts, num_worst_tokens=budget)
            assert fits.recv_x.shape[0] == budget and torch.equal(fits.recv_x[: first.recv_x.shape[0]], first.recv_x)
            fits.handle.check_overflow()
    finally:
        transport.close()


def _shm_headers(rank, world_size, ranks_per_node):
    """The header cases of test_intranode_cuda.transport_header_cases over the fused pipeline."""
    hidden, num_topk, num_experts = 64, 2, 4 * world_size
    xs, idxs, ws = make_world(49, world_size, [30, 12, 0, 25, 18, 9][:world_size], hidden, num_topk, num_experts)
    transport = _shm_transport(rank, world_size, ranks_per_node, "fused", hidden, num_topk)
    transport_header_cases(transport, rank, xs, idxs, ws, num_experts, ranks_per_node)


def _shm_withheld(rank, world_size, ranks_per_node):
    """A rank that never dispatches: the others' bounded waits end in an error. Its rail and
    local peers name it; a rank two hops away (another node, another local index) can only
    name the local peer whose relayed header never came, as it waits for the missing rank."""
    import torch.distributed as dist

    from moe_dispatch.testing.ranks import InternodeRank

    withheld, num_experts = world_size - 1, 4 * world_size
    xs, idxs, ws = make_world(46, world_size, 16, 32, 2, num_experts, drop=0.0)
    transport = InternodeRank(
        dist.group.WORLD,
        rank,
        ranks_per_node,
        32,
        2,
        device="cpu",
        timeout_s=0.5,
        config=Config(num_sms=2, num_slots=2, chunk_tokens=1),
    )
    try:
        if rank != withheld:
            with pytest.raises(InternodeTimeoutError, match=r"notify .*timed out") as info:
                transport.dispatch(xs[rank], idxs[rank], ws[rank], num_experts)
            L = ranks_per_node
            if rank // L == withheld // L or rank % L == withheld % L:
                assert info.value.peer == withheld, str(info.value)
            else:
                assert info.value.counter == "relayed header" and info.value.peer == (rank // L) * L + withheld % L
        dist.barrier()
    finally:
        transport.close()


def _shm_entry(rank, world_size, ranks_per_node):
    cases = {
        "fused": lambda r, w: _shm_roundtrip(r, w, ranks_per_node, "fused"),
        "staged": lambda r, w: _shm_roundtrip(r, w, ranks_per_node, "staged"),
    }
    if world_size == 4:
        cases["headers"] = lambda r, w: _shm_headers(r, w, ranks_per_node)
        cases["withheld rank"] = lambda r, w: _shm_withheld(r, w, ranks_per_node)
    return run_cases(rank, world_size, cases)


@built
@pytest.mark.parametrize(
    "world_size, ranks_per_node, case",
    [(4, 2, "fused"), (4, 2, "staged"), (4, 2, "headers"), (4, 2, "withheld rank"), (6, 2, "fused")],
)
@pytest.mark.world
def test_cpu_shared_memory_world_matches_oracle(world_size, ranks_per_node, case):
    assert_case(world_results(_shm_entry, world_size, ranks_per_node), case)


# --- the kernels on one GPU (loopback) ---------------------------------------------------------

GPU_CASES = [
    # N, L, tokens, hidden, K, E, skewed, fp8
    (2, 4, 512, 7168, 8, 256, False, False),
    (2, 4, [700, 0, 300, 1024, 64, 0, 512, 256], 2880, 4, 128, True, False),
    (4, 2, 384, 7168, 8, 256, True, True),
    (3, 2, 256, 2880, 6, 48, False, False),
    (8, 1, 256, 7168, 8, 64, False, True),
    (1, 8, 256, 2880, 8, 64, True, False),
]


@needs_gpu
@pytest.mark.parametrize("pipeline", PIPELINES)
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "{}x{}-H{}-K{}-E{}-skew{}-fp8{}".format(*c[:2], *c[3:]))
def test_gpu_internode_loopback_matches_oracle(case, pipeline):
    N, L, tokens, hidden, K, E, skewed, fp8 = case
    config = Config(num_sms=12, num_slots=16, chunk_tokens=4, internode_pipeline=pipeline)
    lb = InternodeLoopback(N, L, hidden, K, config=config, timeout_s=20)
    xs, idxs, ws = make_world(seed_of(case), N * L, tokens, hidden, K, E, skewed=skewed, device="cuda")
    first = roundtrip(lb, xs, idxs, ws, E, row_scales=not fp8, fp8=fp8)
    bare = lb.dispatch(
        [x if not fp8 else per_token_cast_to_fp8_reference(x) for x in xs],
        None,
        None,
        E,
        handles=[r.handle for r in first],
    )
    for a, b in zip(first, bare):
        assert torch.equal(
            cpu(a.recv_x if not fp8 else a.recv_x[0]).view(torch.uint8),
            cpu(b.recv_x if not fp8 else b.recv_x[0]).view(torch.uint8),
        )


@needs_gpu
@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != "current" and Config().with_variant(v).fused_copy])
def test_gpu_fused_variants_match_oracle(variant):
    """The fused kernels of every variant compiled for them (copies, TMA, launch bounds: what the
    CPU backend cannot run), 2x4, bf16 and fp8, with l2_discard."""
    config = Config(num_sms=12, num_slots=16, chunk_tokens=4, l2_discard=True).with_variant(variant)
    lb = InternodeLoopback(2, 4, 7168, 8, config=config, timeout_s=20)
    for fp8 in (False, True):
        xs, idxs, ws = make_world(seed_of((variant, fp8)), 8, 256, 7168, 8, 64, device="cuda")
        roundtrip(lb, xs, idxs, ws, 64, row_scales=not fp8, fp8=fp8)


@needs_gpu
@pytest.mark.parametrize("pipeline", PIPELINES)
def test_gpu_internode_combine_is_deterministic_and_num_sms_independent(pipeline):
    config = Config(num_sms=24, num_slots=32, chunk_tokens=8, internode_pipeline=pipeline)
    lb = InternodeLoopback(2, 4, 7168, 8, config=config, timeout_s=20)
    xs, idxs, ws = make_world(31, 8, 1024, 7168, 8, 256, skewed=True, device="cuda")
    outs = []
    for num_sms in (24, 6, 24):
        results = lb.dispatch(xs, idxs, ws, 256, num_sms=num_sms)
        outs.append(lb.combine([r.recv_x * 0.5 for r in results], [r.handle for r in results]))
    for a, b, c in zip(*outs):
        assert torch.equal(a, b) and torch.equal(a, c)


@needs_gpu
def test_gpu_fused_budget_mode_in_a_cuda_graph():
    N, L, hidden, E = 2, 4, 2880, 64
    lb = InternodeLoopback(N, L, hidden, 4, config=Config(num_sms=12, num_slots=16, chunk_tokens=4), timeout_s=20)
    xs, idxs, ws = make_world(8, N * L, 256, hidden, 4, E, device="cuda")
    refs, outs = replay_budget_dispatch(lb, xs, idxs, ws, E, L, combine=True)
    want = reference.combine([ref.recv_x for ref in refs], cpu(idxs), E, L)
    for o, w in zip(cpu(outs), want):
        assert torch.equal(o, w)


@needs_gpu
def test_gpu_header_mismatch_and_refusal_are_recorded_by_every_rank():
    lb = InternodeLoopback(2, 2, 2880, 2, config=Config(num_sms=6, num_slots=8, chunk_tokens=2), timeout_s=20)
    header_cases(lb, lb.engines.rdma.records, "cuda", roundtrip)


@needs_gpu
@pytest.mark.parametrize("pipeline, phase, stage", WITHHELD, ids=lambda v: str(v))
def test_gpu_withheld_rank_times_out_with_its_name(pipeline, phase, stage):
    N, L, withheld = 2, 4, 5
    config = Config(num_sms=6, num_slots=8, chunk_tokens=2, internode_pipeline=pipeline)
    lb = InternodeLoopback(N, L, 2880, 4, config=config, timeout_s=0.2)
    idxs = [i.cuda() for i in all_nodes_routing(N, L, 128, 32, seed=2)]
    xs = [torch.randn(128, 2880, device="cuda").to(torch.bfloat16) for _ in range(N * L)]
    if phase.endswith("combine"):
        results = lb.dispatch(xs, idxs, None, 32)
        with pytest.raises(InternodeTimeoutError, match="timed out") as info:
            lb.combine(
                [r.recv_x for r in results], [r.handle for r in results], withhold_rank=withheld, withhold_phase=phase
            )
    else:
        with pytest.raises(InternodeTimeoutError, match="timed out") as info:
            lb.dispatch(xs, idxs, None, 32, withhold_rank=withheld, withhold_phase=phase)
    assert info.value.peer == withheld and info.value.rank != withheld and "(node 1, local 1)" in str(info.value)
    lb.timeout_s = 20
    roundtrip(lb, xs, idxs, None, 32)


# --- the multi-process NVSHMEM path (one rank per GPU; a single GPU is one PE) ------------------


def _nvshmem_world_roundtrip(rank, world_size):
    """NVSHMEM bootstrap (unique id over torch.distributed), symmetric allocation, the NVSHMEM-mode
    kernels and teardown, each rank its own node (ranks_per_node=1), against the oracle."""
    import torch.distributed as dist

    from moe_dispatch.testing.ranks import InternodeRank

    hidden, num_topk, num_experts = 2880, 4, 8 * world_size
    xs, idxs, ws = make_world(43, world_size, 256, hidden, num_topk, num_experts)
    transport = InternodeRank(
        dist.group.WORLD,
        rank,
        1,
        hidden,
        num_topk,
        config=Config(num_sms=12, num_slots=16, chunk_tokens=4),
        timeout_s=20,
    )
    try:
        rank_roundtrips(transport, rank, xs, idxs, ws, num_experts, 1)
    finally:
        transport.close()


def _nvshmem_entry(rank, world_size):
    return run_cases(rank, world_size, {"roundtrip": _nvshmem_world_roundtrip})


@pytest.mark.world
@needs_gpu
@pytest.mark.skipif(not STATUS.with_nvshmem, reason="moe_dispatch._C was built without NVSHMEM")
def test_gpu_nvshmem_world_matches_oracle():
    assert_case(world_results(_nvshmem_entry, torch.cuda.device_count(), backend="nccl"), "roundtrip")
