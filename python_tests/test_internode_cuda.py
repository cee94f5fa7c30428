"""The internode transport (``moe_dispatch.transport.internode``) against ``moe_dispatch.reference``.

CPU (wherever the extension is built): the RDMA buffer layout mirror equals the C++ one; the
hierarchical protocol - stage 1's role code (put-with-signal as memcpy + release store) and
stage 2's intranode role code, on threads standing in for warps - reproduces the oracle bit for
bit for 2x4, 3x2, 4x1 and 1x4 worlds, random and skewed routing, tokens touching every node,
empty ranks, bf16, fp32 and fp8-with-scales rows, hidden 2880 and small, row scales, cached
dispatch; a withheld rank makes the others time out with a message naming rank, node, channel
and counter; stage 1's standalone driver (internode_cpu.cpp, -DMOE_INTERNODE_CPU_MAIN) runs
clean under ThreadSanitizer.

GPU (skipped without one): the same kernels in loopback mode (N x L simulated ranks on one
GPU) against the oracle, determinism, and the timeout error.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import torch

from moe_dispatch import _ext
from moe_dispatch.config import Config, max_slot_bytes
from moe_dispatch.semantics import reference
from moe_dispatch.semantics.quant import per_token_cast_to_fp8_reference
from moe_dispatch.transport.internode import (
    InternodeLoopback,
    InternodeTimeoutError,
    cross_node_bytes,
    describe_timeout,
    rdma_layout,
)
from moe_dispatch.transport.nvshmem import HEAP_MARGIN, symmetric_heap_bytes
from python_tests.conftest import needs_gpu
from python_tests.test_intranode_cuda import (
    ROOT,
    assert_dispatch_equal,
    cpu,
    fp8_reference_dispatch,
    make_world,
    rank_roundtrips,
    seed_of,
)
from python_tests.worlds import assert_case, run_cases, world_results

STATUS = _ext.extension_status()
built = pytest.mark.skipif(not STATUS.built, reason=f"moe_dispatch._C not available: {STATUS.error}")


def lower_bound_bytes(idxs, num_experts: int, num_nodes: int, ranks_per_node: int, row_bytes: int) -> int:
    """sum over tokens of |nodes(t) minus the source's node| x row bytes: each (token, node) pair
    crosses once (what ``moe_dispatch.transport.internode.cross_node_bytes`` measures)."""
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
    """Dispatch then combine, both checked against the oracle; returns the dispatch results."""
    W, L = lb.world_size, lb.ranks_per_node
    if fp8:
        xs8 = [per_token_cast_to_fp8_reference(x) for x in xs]
        results = lb.dispatch(xs8, idxs, ws, num_experts, **kw)
        refs = fp8_reference_dispatch(cpu(xs8), cpu(idxs), cpu(ws), num_experts, W)
    else:
        results = lb.dispatch(xs, idxs, ws, num_experts, **kw)
        refs = reference.dispatch(cpu(xs), cpu(idxs), cpu(ws), num_experts, L)
    assert_dispatch_equal(results, refs)
    hidden = xs[0].shape[1]
    row_bytes = hidden * (1 if fp8 else xs[0].element_size())
    assert cross_node_bytes([r.handle for r in results], L, row_bytes) == \
        lower_bound_bytes(cpu(idxs), num_experts, lb.num_nodes, L, row_bytes)
    gen = torch.Generator().manual_seed(7)
    dtype = torch.bfloat16 if fp8 else xs[0].dtype
    ys = [torch.randn(ref.src_idx.shape[0], hidden, generator=gen).to(dtype) for ref in refs]
    scales = [torch.rand(y.shape[0], generator=gen) for y in ys] if row_scales else None
    outs = lb.combine([y.to(lb.device) for y in ys], [r.handle for r in results],
                      [s.to(lb.device) for s in scales] if scales else None)
    want = reference.combine(ys, cpu(idxs), num_experts, L, weights=scales)
    for r, (o, w) in enumerate(zip(cpu(outs), want)):
        assert o.dtype == w.dtype and torch.equal(o, w), \
            f"combine of rank {r}: max diff {(o.float() - w.float()).abs().max().item()}"
    return results


def all_nodes_routing(num_nodes: int, ranks_per_node: int, tokens: int, num_experts: int, seed: int):
    """Top-k = N with one expert on every node: each token touches every node."""
    gen = torch.Generator().manual_seed(seed)
    per_node = num_experts // num_nodes
    return [(torch.randint(0, per_node, (tokens, num_nodes), generator=gen) + torch.arange(num_nodes) * per_node)
            for _ in range(num_nodes * ranks_per_node)]


# --- layout ------------------------------------------------------------------------------------

@built
@pytest.mark.parametrize("nodes, channels, slots, slot_bytes", [(1, 1, 1, 16), (2, 8, 32, 14640), (64, 16, 4, 5808),
                                                               (3, 5, 6, 48)])
def test_rdma_layout_mirror_matches_extension(nodes, channels, slots, slot_bytes):
    layout = rdma_layout(nodes, channels, slots, slot_bytes)
    assert layout.__dict__ == _ext._C.internode_rdma_layout(nodes, channels, slots, slot_bytes)
    assert layout.recv_offset % 128 == 0 and layout.send_offset - layout.recv_offset == nodes * channels * slots * \
        slot_bytes


def test_symmetric_heap_is_sized_from_the_buffer():
    layout = rdma_layout(4, 8, 32, max_slot_bytes(7168, 8))
    heap = symmetric_heap_bytes(layout.total_bytes)
    need = layout.total_bytes + HEAP_MARGIN
    assert heap % (2 << 20) == 0 and need <= heap < need + (2 << 20)


@built
def test_nvshmem_host_calls_are_compiled_in():
    if not STATUS.with_nvshmem:
        pytest.skip("the extension was built without NVSHMEM")
    for name in ("nvshmem_unique_id", "nvshmem_init", "nvshmem_malloc", "nvshmem_free", "nvshmem_barrier_all",
                 "nvshmem_finalize", "nvshmem_my_pe", "nvshmem_n_pes"):
        assert callable(getattr(_ext._C, name)), name
    assert _ext._C.internode_limits["max_nodes"] == 64


def test_timeout_message_names_rank_node_channel_and_counter():
    message, fields = describe_timeout([1, 5, 3, 5, 2, 1, 2, 7, 4] + [0] * 7, 0.5, ranks_per_node=4)
    assert "node dispatch (stage 1, RDMA) timed out after timeout_s=0.5: rank 5 (node 1, local 1)" in message
    assert "tail of RDMA queue rank 1 (node 0, local 1) -> rank 5, channel 2, should reach 7 but stayed at 4" in message
    assert fields["node"] == 1 and fields["peer_node"] == 0 and fields["counter"] == "tail"
    message, fields = describe_timeout([1, 2, 2, 0, 1, 3, 3, 5, 0] + [0] * 7, 1, ranks_per_node=4, node=1)
    assert "rank 4 (node 1, local 0)" in message and "NVLink queue rank 4 -> rank 7 (node 1, local 3)" in message
    assert fields["stage"] == 2 and fields["peer"] == 7


# --- the protocol on CPU threads vs the oracle -------------------------------------------------

CPU_CASES = [
    # N, L, tokens, hidden, K, E, num_sms, slots, chunk, group_warps, workers, skewed
    (2, 4, 24, 64, 4, 32, 2, 2, 1, 1, 2, False),
    (3, 2, [10, 0, 17, 9, 0, 12], 32, 3, 12, 4, 4, 2, 2, 2, True),  # empty ranks, N not a power of two
    (4, 1, 20, 48, 2, 8, 2, 1, 1, 1, 1, False),                      # one-slot rings, L = 1
    (1, 4, [15, 3, 0, 11], 32, 2, 8, 2, 2, 2, 2, 3, True),           # one node: stage 1 is a local copy
    (2, 2, 9, 2880, 4, 16, 2, 2, 1, 1, 2, True),                     # hidden 2880
]


@built
@pytest.mark.parametrize("case", CPU_CASES,
                         ids=lambda c: f"{c[0]}x{c[1]}-H{c[3]}-K{c[4]}-sms{c[6]}-slots{c[7]}-chunk{c[8]}")
def test_cpu_internode_matches_oracle(case):
    N, L, tokens, hidden, K, E, num_sms, slots, chunk, group_warps, workers, skewed = case
    lb = InternodeLoopback(N, L, hidden, K, config=Config(num_sms=num_sms, num_slots=slots, chunk_tokens=chunk),
                           device="cpu", timeout_s=60, cpu_options={"group_warps": group_warps, "num_workers": workers})
    xs, idxs, ws = make_world(seed_of(case), N * L, tokens, hidden, K, E, skewed=skewed)
    first = roundtrip(lb, xs, idxs, ws, E, row_scales=True)
    # Counters reset themselves: a cached dispatch, and one of x alone, reproduce the first.
    again = lb.dispatch(xs, idxs, ws, E, handles=[r.handle for r in first])
    bare = lb.dispatch(xs, None, None, E, handles=[r.handle for r in first])
    for a, b, c in zip(first, again, bare):
        assert torch.equal(a.recv_x, b.recv_x) and torch.equal(a.recv_topk_idx, b.recv_topk_idx)
        assert torch.equal(a.recv_x, c.recv_x) and c.recv_topk_idx is None
        assert torch.equal(a.recv_src_idx, c.recv_src_idx)


@built
def test_cpu_tokens_touching_every_node_fp8_and_fp32():
    N, L, E = 2, 2, 16
    lb = InternodeLoopback(N, L, 256, N, config=Config(num_sms=2, num_slots=2, chunk_tokens=2), device="cpu",
                           element_bytes=4, timeout_s=60)
    idxs = all_nodes_routing(N, L, 14, E, seed=3)
    xs = [torch.randn(14, 256).to(torch.bfloat16) for _ in range(N * L)]
    results = roundtrip(lb, xs, idxs, None, E)
    assert all(r.handle.num_forward_rows == 14 * N for r in results)  # every token reached every node's forwarder
    roundtrip(lb, xs, idxs, None, E, fp8=True)
    roundtrip(lb, [x.float() for x in xs], idxs, None, E, row_scales=True)


@built
@pytest.mark.parametrize("phase", ["node_notify", "node_dispatch", "dispatch", "node_combine"])
def test_cpu_withheld_rank_times_out_with_its_name(phase):
    N, L, withheld = 2, 2, 3  # rank 3 = node 1, local 1
    lb = InternodeLoopback(N, L, 32, 2, config=Config(num_sms=2, num_slots=2, chunk_tokens=1), device="cpu",
                           timeout_s=0.3)
    idxs = all_nodes_routing(N, L, 6, 8, seed=1)
    xs = [torch.randn(6, 32).to(torch.bfloat16) for _ in range(N * L)]
    if phase == "node_combine":
        results = lb.dispatch(xs, idxs, None, 8)
        ys = [torch.ones(r.handle.num_rows, 32, dtype=torch.bfloat16) for r in results]
        with pytest.raises(InternodeTimeoutError, match=r"internode node combine \(stage 1, RDMA\) timed out") as info:
            lb.combine(ys, [r.handle for r in results], withhold_rank=withheld)
    else:
        with pytest.raises(InternodeTimeoutError, match=rf"internode .*{phase.replace('_', ' ')}.* timed out") as info:
            lb.dispatch(xs, idxs, None, 8, withhold_rank=withheld, withhold_phase=phase)
    error = info.value
    assert error.peer == withheld and error.rank != withheld
    assert f"rank {withheld} (node 1, local 1)" in str(error)
    assert error.node == error.rank // L and error.counter in ("signal", "tail", "head")
    if error.counter != "signal":
        assert error.channel == 0 and "channel 0" in str(error)
    assert error.stage == (2 if phase == "dispatch" else 1)
    lb.timeout_s = 60  # reset() ran: the same world works again
    roundtrip(lb, xs, idxs, None, 8)


@built
def test_bad_arguments_name_the_value():
    with pytest.raises(ValueError, match=r"chunk_tokens to divide Config.num_slots.*chunk_tokens=3, num_slots=4"):
        InternodeLoopback(2, 2, 32, 2, config=Config(num_sms=2, num_slots=4, chunk_tokens=3), device="cpu")
    with pytest.raises(ValueError, match=r"loopback simulates at most 16 ranks, got 3 x 6"):
        InternodeLoopback(3, 6, 32, 2, device="cpu")
    lb = InternodeLoopback(2, 2, 32, 2, config=Config(num_sms=2, num_slots=2, chunk_tokens=1), device="cpu",
                           timeout_s=5)
    xs, idxs, ws = make_world(2, 4, 8, 32, 2, 8)
    with pytest.raises(ValueError, match=r"num_experts must be a positive multiple of 4, got 6"):
        lb.dispatch(xs, idxs, ws, 6)
    with pytest.raises(ValueError, match=r"needs \d+ bytes but the buffers' slots hold \d+"):
        lb.dispatch([torch.zeros(8, 64, dtype=torch.bfloat16)] * 4, idxs, ws, 8)
    with pytest.raises(ValueError, match=r"common is missing 'num_nodes'"):
        _ext._C.internode_node_notify({}, [{}], "cpu", "loopback")
    common = lb.transport.rdma.common(1, 0, None)
    with pytest.raises(ValueError, match=r"mode must be 'loopback' or 'nvshmem', got 'x'"):
        _ext._C.internode_node_combine(common, [{"y": None, "row_scale": None, "is_token_in_rank": None,
                                                 "recv_prefix": None, "out": None, "num_tokens": 0, "num_rows": 0}],
                                       64, 0, "cpu", "x")


TSAN_CASES = [
    # N, L, channels, slots, chunk, group_warps, workers, rounds
    (2, 2, 2, 2, 1, 2, 2, 4),
    (3, 1, 1, 2, 2, 1, 3, 4),  # N not a power of two, L = 1, one chunk fills the ring
    (2, 2, 1, 1, 1, 1, 1, 3),  # one-slot rings: every slot is reused at once
    (1, 3, 2, 2, 1, 2, 2, 3),  # one node: stage 1 is a local copy
    (4, 2, 2, 4, 2, 2, 2, 3),
]


def test_node_protocol_has_no_data_race_under_threadsanitizer(tmp_path):
    """Stage 1's standalone driver, built with -fsanitize=thread: every simulated rank runs
    node notify / node dispatch / node combine rounds as its own launches (the NVSHMEM launch
    shape), not joined with its rail peers between operations, over reused RDMA buffers. Every
    put must be ordered before the reads its signal releases, every read before the slot is
    put again, and the epoch parity of notify and the self-resetting head/tail signals must
    hold while ranks run ahead. The driver also checks dispatch against a direct computation
    and that combine of the received rows returns x times the number of holding nodes."""
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ not found")
    exe = tmp_path / "internode_tsan"
    build = subprocess.run([gxx, "-std=c++17", "-O1", "-g", "-fsanitize=thread", "-DMOE_INTERNODE_CPU_MAIN",
                            f"-I{ROOT / 'csrc'}", str(ROOT / "csrc/kernels/internode_cpu.cpp"), "-o", str(exe),
                            "-pthread"], check=False, capture_output=True, text=True, timeout=300)
    if build.returncode != 0 and "tsan" in build.stderr.lower():
        pytest.skip(f"ThreadSanitizer unavailable: {build.stderr[-300:]}")
    assert build.returncode == 0, build.stderr
    env = dict(os.environ, TSAN_OPTIONS="halt_on_error=1 exitcode=66")
    for case in TSAN_CASES:
        run = subprocess.run([str(exe), *map(str, case)], check=False, capture_output=True, text=True, env=env,
                             timeout=120)
        if "FATAL: ThreadSanitizer" in run.stderr:  # e.g. a kernel whose memory layout the runtime rejects
            pytest.skip(f"ThreadSanitizer runtime unusable here: {run.stderr[-300:]}")
        output = run.stdout + run.stderr
        assert run.returncode == 0 and "WARNING: ThreadSanitizer" not in output, f"{case}: {output[-6000:]}"
        assert "ok" in run.stdout, f"{case}: {output[-2000:]}"


# --- the kernels on one GPU (loopback) ---------------------------------------------------------

GPU_CASES = [
    # N, L, tokens, hidden, K, E, skewed, fp8
    (2, 4, 512, 7168, 8, 256, False, False),
    (2, 4, [700, 0, 300, 1024, 64, 0, 512, 256], 2880, 4, 128, True, False),
    (4, 2, 384, 7168, 8, 256, True, True),
    (3, 2, 256, 2880, 6, 48, False, False),
    (8, 1, 256, 7168, 8, 64, False, True),
]


@needs_gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "{}x{}-H{}-K{}-E{}-skew{}-fp8{}".format(*c[:2], *c[3:]))
def test_gpu_internode_loopback_matches_oracle(case):
    N, L, tokens, hidden, K, E, skewed, fp8 = case
    lb = InternodeLoopback(N, L, hidden, K, config=Config(num_sms=8, num_slots=16, chunk_tokens=4), timeout_s=20)
    xs, idxs, ws = make_world(seed_of(case), N * L, tokens, hidden, K, E, skewed=skewed, device="cuda")
    roundtrip(lb, xs, idxs, ws, E, row_scales=not fp8, fp8=fp8)


@needs_gpu
def test_gpu_internode_combine_is_deterministic_and_num_sms_independent():
    lb = InternodeLoopback(2, 4, 7168, 8, config=Config(num_sms=16, num_slots=32, chunk_tokens=8), timeout_s=20)
    xs, idxs, ws = make_world(31, 8, 1024, 7168, 8, 256, skewed=True, device="cuda")
    outs = []
    for num_sms in (16, 4, 16):
        results = lb.dispatch(xs, idxs, ws, 256, num_sms=num_sms)
        outs.append(lb.combine([r.recv_x * 0.5 for r in results], [r.handle for r in results]))
    for a, b, c in zip(*outs):
        assert torch.equal(a, b) and torch.equal(a, c)


@needs_gpu
@pytest.mark.parametrize("phase", ["node_notify", "node_dispatch", "dispatch", "node_combine"])
def test_gpu_withheld_rank_times_out_with_its_name(phase):
    N, L, withheld = 2, 4, 5
    lb = InternodeLoopback(N, L, 2880, 4, config=Config(num_sms=4, num_slots=8, chunk_tokens=2), timeout_s=0.2)
    idxs = [i.cuda() for i in all_nodes_routing(N, L, 128, 32, seed=2)]
    xs = [torch.randn(128, 2880, device="cuda").to(torch.bfloat16) for _ in range(N * L)]
    if phase == "node_combine":
        results = lb.dispatch(xs, idxs, None, 32)
        with pytest.raises(InternodeTimeoutError, match="node combine") as info:
            lb.combine([r.recv_x for r in results], [r.handle for r in results], withhold_rank=withheld)
    else:
        with pytest.raises(InternodeTimeoutError, match=phase.replace("_", " ")) as info:
            lb.dispatch(xs, idxs, None, 32, withhold_rank=withheld, withhold_phase=phase)
    assert info.value.peer == withheld and info.value.rank != withheld and "(node 1, local 1)" in str(info.value)
    lb.timeout_s = 20
    roundtrip(lb, xs, idxs, None, 32)


# --- the multi-process NVSHMEM path (one rank per GPU; a single GPU is one PE) ------------------

def _nvshmem_world_roundtrip(rank, world_size):
    """NVSHMEM bootstrap (unique id over torch.distributed), symmetric allocation, the NVSHMEM-mode
    kernels and teardown, each rank its own node (ranks_per_node=1), against the oracle."""
    import torch.distributed as dist

    from moe_dispatch.transport.nvshmem import InternodeTransport

    hidden, num_topk, num_experts = 2880, 4, 8 * world_size
    xs, idxs, ws = make_world(43, world_size, 256, hidden, num_topk, num_experts)
    transport = InternodeTransport(dist.group.WORLD, rank, 1, hidden, num_topk,
                                   config=Config(num_sms=8, num_slots=16, chunk_tokens=4), timeout_s=20)
    try:
        rank_roundtrips(transport, rank, xs, idxs, ws, num_experts, 1)
    finally:
        transport.close()


def _shm_world_roundtrip(rank, world_size, ranks_per_node):
    """The CPU path of InternodeTransport: stage-1 buffers in shared memory mapped by every
    rank, copies for the puts, stage 2 on the intranode CPU path; each process its own rank."""
    import torch.distributed as dist

    from moe_dispatch.transport.nvshmem import InternodeTransport

    hidden, num_topk, num_experts = 256, 4, 4 * world_size
    xs, idxs, ws = make_world(47, world_size, [48, 0, 64, 40, 24, 56][:world_size], hidden, num_topk, num_experts)
    transport = InternodeTransport(dist.group.WORLD, rank, ranks_per_node, hidden, num_topk, device="cpu",
                                   config=Config(num_sms=4, num_slots=8, chunk_tokens=2), timeout_s=30)
    try:
        rank_roundtrips(transport, rank, xs, idxs, ws, num_experts, ranks_per_node)
    finally:
        transport.close()


def _shm_entry(rank, world_size, ranks_per_node):
    return run_cases(rank, world_size, {"roundtrip": lambda r, w: _shm_world_roundtrip(r, w, ranks_per_node)})


@pytest.mark.world
@built
@pytest.mark.parametrize("world_size,ranks_per_node", [(4, 2), (3, 1), (6, 3)])
def test_cpu_shared_memory_world_matches_oracle(world_size, ranks_per_node):
    assert_case(world_results(_shm_entry, world_size, ranks_per_node), "roundtrip")


def _nvshmem_entry(rank, world_size):
    return run_cases(rank, world_size, {"roundtrip": _nvshmem_world_roundtrip})


@pytest.mark.world
@needs_gpu
@pytest.mark.skipif(not STATUS.with_nvshmem, reason="moe_dispatch._C was built without NVSHMEM")
def test_gpu_nvshmem_world_matches_oracle():
    assert_case(world_results(_nvshmem_entry, torch.cuda.device_count(), backend="nccl"), "roundtrip")
