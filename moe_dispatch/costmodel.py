"""Analytical time model of the ``_C`` kernels: what ``Config.auto`` chooses SMs and ring depth
with, and what ``benchmarks/bench_intranode.py`` / ``bench_internode.py`` print beside each
measured row (prediction / measurement; 0.7 to 1.3 counts as good).

Pure Python, no extension needed. The model, per operation of every rank:

- **Per-SM (latency) bound.** A warp copies a row in *rounds*: each round issues the copy
  policy's 16-byte loads per lane (``Config.loads_in_flight`` over ``rows_in_flight`` rows) and
  waits one load latency before its stores (:func:`copy_rounds`); a row costs its rounds times
  ``Machine.copy_round_us``. A channel's sender block (16 warps in one group per peer) and its
  receiver block run in parallel; the slower one sets the channel's time. A queue's ring also
  bounds it: ``num_slots`` entries per round trip (a chunk written, its tail seen, read, its head
  seen). Combine's receiver reduces each token over its holders, ``kReduceVecs`` vectors per lane
  per holder step (``Machine.reduce_round_us`` each), with as many tokens in progress as the ring
  holds (``num_slots`` over the chance that a queue carries a token) and the workers allow
  (``15 / combine_warps`` teams).
- **Memory bound.** The loopback (every simulated rank on one GPU) moves each payload byte through
  HBM several times (x -> slot -> recv_x: 4 bytes of DRAM traffic per payload byte; 2 once the
  rings fit in L2 with ``l2_discard``, 3 without); all ranks share the GPU's copy bandwidth
  (``Machine.copy_gbps``, the d2d copy's payload rate: 2 DRAM bytes per payload byte). A real node
  instead bounds each rank by its NVLink (remote bytes) and its own HBM (2 bytes per payload byte).
- The two combine as ``(t_sm^p + t_mem^p)^(1/p)`` (``Machine.overlap`` p: a bandwidth-bound
  kernel's loads wait longer), plus ``Machine.launch_us`` per kernel and, for a fresh dispatch
  without a budget, ``Machine.host_read_us`` (notify, the host reading the counts, the layout).

Routing is the uniform top-k of the benchmarks: a token reaches
``W (1 - C(E - E/W, K) / C(E, K))`` ranks (:func:`expected_holders`); the benchmarks pass the
rows they measured instead.

The constants of :data:`H200` are fitted to the GPU run of 2026-11-30 (one H200,
``benchmarks/results/2026-11-30-h200-gpu-check``: the intranode loopback at 4 to 24 SMs, rings
2x1 to 64x16, DeepSeek-V3 and gpt-oss shapes); ``python_tests/test_costmodel.py`` checks the
model against those rows. The variants' effects are predicted from their mechanisms, not fitted:
their ratios in a GPU run say which mechanism the model gets wrong. The internode predictions
compose the same per-row costs over the fused pipeline's three roles, with no constant fitted
to internode rows.
"""

from __future__ import annotations

import dataclasses
import math

from .kernel_layout import max_slot_bytes

WARPS = 16  # warps of a dispatch / combine block (csrc/kernels/intranode.cuh kNumWarps)
BULK_PIECE = 2048  # csrc/kernels/intranode_device.cuh kBulkPiece, kBulkStages, kBulkMinBytes
BULK_STAGES = 3
BULK_MIN_BYTES = 1024
OPS = ("dispatch", "combine")


@dataclasses.dataclass(frozen=True)
class Machine:
    """The GPU and its links, and the fitted per-round latencies.

    Attributes:
        num_sms: SMs of the GPU.
        copy_gbps: payload GB/s of a device-to-device copy (each byte read and written once).
        nvlink_gbps: NVLink GB/s per direction per GPU; ``rdma_gbps``: the NIC's per GPU.
        link_efficiency: the share of a link's bandwidth a kernel's stores reach.
        l2_bytes: the L2 cache.
        copy_round_us: one round of a row copy (loads in flight, then their stores).
        row_us: a warp's fixed cost per slot (its share of the scan, the top-k fields, the chunk's
            barriers).
        reduce_round_us: one holder step of the combine's reduction.
        token_us: a combine worker's fixed cost per token (its holders' waits and progress).
        signal_us: a tail or head store seen by the other side.
        overlap: p of the (t_sm^p + t_mem^p)^(1/p) combination.
        launch_us: per kernel launch (header exchange, epochs, the launch itself).
        host_read_us: a fresh dispatch without a budget: notify, the host reading the counts and
            the layout (the 2026-11-30 fresh-minus-cached time).
        notify_us: a fresh dispatch with a budget: the notify kernel alone (no host read).
    """

    name: str = "H200 + NVLink4"
    num_sms: int = 132
    copy_gbps: float = 2127.0
    nvlink_gbps: float = 450.0
    rdma_gbps: float = 50.0
    link_efficiency: float = 0.85
    l2_bytes: float = 50e6
    # Fitted (least squares on log time) to the 80 intranode loopback rows of 2026-11-30.
    copy_round_us: float = 0.63
    row_us: float = 1.66
    reduce_round_us: float = 0.43
    token_us: float = 14.6
    signal_us: float = 1.25
    overlap: float = 1.25
    launch_us: float = 15.0
    host_read_us: float = 1790.0
    notify_us: float = 60.0  # estimated (the notify kernel's share of host_read_us), not fitted


H200 = Machine()


@dataclasses.dataclass(frozen=True)
class Workload:
    """One operation's shape.

    Attributes:
        tokens: T per rank; ``hidden``: H; ``topk``: K; ``num_experts``: E.
        world_size: W ranks; ``ranks_per_node``: L (default W: one node).
        fp8: dispatch of e4m3 rows with fp32 scales per 128 (combine stays ``element_bytes``).
        element_bytes: bytes per element of bf16 (2) or fp32 (4) rows.
        rows: rows each rank receives (measured), or None for :func:`expected_holders` x T.
    """

    tokens: int
    hidden: int
    topk: int
    num_experts: int
    world_size: int
    ranks_per_node: int | None = None
    fp8: bool = False
    element_bytes: int = 2
    rows: float | None = None

    @property
    def local(self) -> int:
        return self.ranks_per_node or self.world_size

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.local

    @property
    def holders(self) -> float:
        """Ranks a token reaches (its rows received per rank: ``rows / tokens``)."""
        if self.rows is not None and self.tokens:
            return self.rows / self.tokens
        return expected_holders(self.num_experts, self.world_size, self.topk)

    @property
    def received(self) -> float:
        """Rows each rank receives."""
        return self.rows if self.rows is not None else self.tokens * self.holders

    def row_bytes(self, op: str) -> int:
        """Payload bytes of one row (fp8: the e4m3 row and its scales)."""
        if op == "dispatch" and self.fp8:
            return self.hidden + 4 * (self.hidden // 128)
        return self.hidden * self.element_bytes

    def payload_bytes(self, op: str) -> float:
        """Bytes one rank's operation delivers (the benchmarks' byte formula)."""
        return self.received * self.row_bytes(op)


def expected_holders(num_experts: int, world_size: int, topk: int) -> float:
    """Ranks a token reaches under uniform top-k routing without repeats."""
    per_rank = num_experts // world_size
    if topk <= 0:
        return 0.0
    miss = math.comb(num_experts - per_rank, topk) / math.comb(num_experts, topk)
    return world_size * (1.0 - miss)


def copy_rounds(nbytes: int, loads: int = 4, rows: int = 1, bulk: bool = False) -> float:
    """Load rounds of one warp's copy of an ``nbytes`` row (per row, when ``rows`` rows are
    copied together), as csrc/kernels/intranode_device.cuh copy_rows runs it."""
    if nbytes <= 0:
        return 0.0
    vectors = -(-nbytes // 16)
    if bulk and nbytes >= BULK_MIN_BYTES:
        pieces = -(-nbytes // BULK_PIECE)
        return pieces / BULK_STAGES + 1.0  # three pieces in flight, then the last one's store
    if loads == 4 and rows == 1:  # the current loop: full rounds of 4, then one vector a round; the slowest lane
        worst = 0
        for lane in range(32):
            full = max(0, (vectors - 96 - lane + 127) // 128)
            worst = max(worst, full + max(0, -(-(vectors - lane - 128 * full) // 32)))
        return float(worst)
    per_row = loads // rows
    return -(-vectors // (32 * per_row)) / rows


def _row_rounds(workload: Workload, op: str, config) -> float:
    """Rounds of a slot's copy (the row, fp8 scales, one round for the top-k fields)."""
    kw = dict(loads=config.loads_in_flight, rows=config.rows_in_flight, bulk=config.bulk_copy)
    rounds = copy_rounds(workload.hidden * (1 if workload.fp8 and op == "dispatch" else workload.element_bytes), **kw)
    if op == "dispatch" and workload.fp8:
        rounds += copy_rounds(4 * (workload.hidden // 128), **kw)
    return rounds + (1.0 if op == "dispatch" else 0.5)


def _ring_bytes(workload: Workload, config, channels: int, loopback: bool) -> float:
    slot = -(-max_slot_bytes(workload.hidden, workload.topk) // 128) * 128
    ranks = workload.world_size if loopback else 1
    return ranks * workload.world_size * channels * config.num_slots * slot


@dataclasses.dataclass(frozen=True)
class Prediction:
    """A predicted operation: ``time_us`` and its parts (``sm_us``: the per-SM bound, ``memory_us``:
    HBM or links, ``fixed_us``), ``bound`` ("sm" or "memory") and ``gbps``: payload per rank."""

    time_us: float
    sm_us: float
    memory_us: float
    fixed_us: float
    bound: str
    gbps: float


def _combine_times(sm_us: float, memory_us: float, fixed_us: float, nbytes: float, machine: Machine) -> Prediction:
    p = machine.overlap
    body = (sm_us**p + memory_us**p) ** (1.0 / p)
    time = body + fixed_us
    return Prediction(time, sm_us, memory_us, fixed_us, "sm" if sm_us >= memory_us else "memory", nbytes / time / 1e3)


def _queue_time(rows_per_queue: float, group_warps: float, rounds: float, config, machine: Machine) -> float:
    """One queue's time through its group of warps and its ring (the tail protocol: a chunk
    written, its tail seen, read, its head seen; ready flags: one entry's round trip)."""
    per_row = rounds * machine.copy_round_us + machine.row_us
    streaming = rows_per_queue * per_row / group_warps
    chunk = 1 if config.slot_flags else config.chunk_tokens
    cycle = 2 * math.ceil(chunk / group_warps) * per_row + 2 * machine.signal_us
    ring = rows_per_queue * cycle / config.num_slots
    return max(streaming, ring)


def _intranode_sm_us(workload: Workload, op: str, config, channels: int, machine: Machine) -> float:
    W = workload.world_size
    group = WARPS // W if W <= WARPS else 1
    rows_per_queue = workload.received / W / channels
    rounds = _row_rounds(workload, op, config)
    send = _queue_time(rows_per_queue, group, rounds, config, machine)
    if op == "dispatch":
        return send
    # The reduction: tokens of the channel, each over its holders, by teams of combine_warps warps.
    holders = workload.holders
    share = holders / W  # the chance a queue carries a given token
    team = config.combine_warps
    teams = (WARPS - 1) // team
    in_flight = max(1.0, min(teams, config.num_slots / max(share, 1e-9)))
    vectors = workload.hidden * workload.element_bytes / 16
    steps = math.ceil(vectors / (32 * (config.loads_in_flight // 2) * team))
    per_token = holders * steps * machine.reduce_round_us + machine.token_us
    if config.coordinator_backoff:
        per_token *= 0.95  # the coordinator's spin no longer competes for issue slots
    tokens = workload.tokens / channels
    return max(send, tokens * per_token / in_flight)


def _dram_per_payload(op: str, fits_l2: bool, l2_discard: bool, holders: float) -> float:
    """Bytes of DRAM traffic per payload byte of a loopback operation."""
    ends = 2.0 if op == "dispatch" else 1.0 + 1.0 / max(holders, 1.0)  # x in and recv_x out (combine: out is T rows)
    if not fits_l2:
        return ends + 2.0  # the slot written and read back
    return ends + (0.0 if l2_discard else 1.0)  # an L2-resident slot is written back unless discarded


def predict(
    op: str,
    workload: Workload,
    config,
    *,
    num_sms: int | None = None,
    machine: Machine = H200,
    loopback: bool = True,
    fresh: str | None = None,
) -> Prediction:
    """The predicted time of one intranode operation.

    Args:
        op: "dispatch" or "combine".
        workload: the shape (``rows`` the measured rows, or None).
        config: a :class:`moe_dispatch.config.Config` (ring, chunk, variant; ``num_sms`` unless given).
        num_sms: SMs per rank for this call (default ``config.num_sms``).
        loopback: all W ranks on one GPU (the benchmarks), else one rank per GPU of a node.
        fresh: None (a cached dispatch or a combine), "host" (notify and a host read before the
            dispatch) or "budget" (notify with ``num_worst_tokens``: no host read).

    Raises:
        ValueError: an unknown op or fresh mode.
    """
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if fresh not in (None, "host", "budget"):
        raise ValueError(f"fresh must be None, 'host' or 'budget', got {fresh!r}")
    channels = (num_sms or config.num_sms) // 2
    sm_us = _intranode_sm_us(workload, op, config, channels, machine)
    nbytes = workload.payload_bytes(op)
    if loopback:
        fits = _ring_bytes(workload, config, channels, True) <= machine.l2_bytes
        dram = _dram_per_payload(op, fits, config.l2_discard, workload.holders)
        memory_us = workload.world_size * nbytes * dram / (2.0 * machine.copy_gbps * 1e3)
    else:
        remote = nbytes * (workload.world_size - 1) / workload.world_size
        link_us = remote / (machine.nvlink_gbps * machine.link_efficiency * 1e3)
        memory_us = max(link_us, 2.0 * nbytes / (2.0 * machine.copy_gbps * 1e3))
    fixed = machine.launch_us + {None: 0.0, "host": machine.host_read_us, "budget": machine.notify_us}[fresh]
    return _combine_times(sm_us, memory_us, fixed, nbytes, machine)


def predict_internode(
    op: str, workload: Workload, config, *, num_sms: int | None = None, machine: Machine = H200, loopback: bool = True
) -> Prediction:
    """The predicted time of one fused internode operation: its three roles per channel
    (``num_sms // 3`` channels) run at once, each at the per-row cost of :func:`predict`'s
    copies. In loopback (N x L ranks on one GPU) the memory bound counts every copy of the
    pipeline (x -> staging -> the peer's ring -> the forwarder's NVLink ring -> recv_x); on real
    nodes each rank's NIC carries its stage-1 rows to other nodes. No constant is fitted to internode rows.
    """
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    channels = max(1, (num_sms or config.num_sms) // 3)
    N, L = workload.num_nodes, workload.local
    # Stage-1 rows per rank: each token once per node it reaches (expected over the node's L ranks).
    per_node = expected_holders(workload.num_experts, N, workload.topk) if N > 1 else 1.0
    stage1 = workload.tokens * per_node
    rounds = _row_rounds(workload, op, config)
    group = max(1, WARPS // max(N, L))
    sender = _queue_time(stage1 / N / channels, group, 2 * rounds, config, machine)  # stage, then put
    forward = _queue_time(workload.received / L / channels, WARPS // L, rounds, config, machine)
    sm_us = max(sender, forward)
    if op == "combine":
        sm_us = max(sm_us, _intranode_sm_us(workload, "combine", config, channels, machine))
    nbytes = workload.payload_bytes(op)
    row = workload.row_bytes(op)
    if loopback:
        dram = stage1 * row * 6 + workload.received * row * 2  # three copies of stage-1 rows, the last hop
        memory_us = workload.world_size * dram / (2.0 * machine.copy_gbps * 1e3)
    else:
        remote = stage1 * row * (N - 1) / N
        memory_us = remote / (machine.rdma_gbps * machine.link_efficiency * 1e3)
    return _combine_times(sm_us, memory_us, machine.launch_us, nbytes, machine)


def choose(
    workload: Workload, config, *, machine: Machine = H200, max_sms: int = 24, slack: float = 0.1
) -> tuple[int, int, int]:
    """``(num_sms, num_slots, chunk_tokens)`` for a real node (one rank per GPU): the fewest SMs
    (at most ``max_sms``) whose predicted dispatch + combine time is within ``slack`` of the best
    over every budget up to ``max_sms`` (the SMs beyond buy little, and the experts' GEMMs want
    them), then the shallowest ring (a multiple of the chunk, two chunks at least) within
    ``slack`` of a 64-chunk ring's time. A chunk is 8 tokens, 4 when a channel sees fewer than 64.
    Several nodes: the fused pipeline's budget (``num_sms // 3`` channels) against the NIC."""
    step = 2 if workload.num_nodes == 1 else 6  # a channel is 2 blocks (intranode), 3 (fused internode)
    budgets = list(range(step, max(step, max_sms) + 1, step))

    def chunk_of(num_sms: int) -> int:
        channels = num_sms // 2 if workload.num_nodes == 1 else max(1, num_sms // 3)
        return 8 if workload.tokens // channels >= 64 else 4

    def total(c) -> float:
        if workload.num_nodes > 1:
            return sum(predict_internode(op, workload, c, machine=machine, loopback=False).time_us for op in OPS)
        return sum(predict(op, workload, c, machine=machine, loopback=False).time_us for op in OPS)

    def at(num_sms: int, slots: int | None = None):
        chunk = chunk_of(num_sms)
        return dataclasses.replace(config, num_sms=num_sms, num_slots=slots or 64 * chunk, chunk_tokens=chunk)

    times = {n: total(at(n)) for n in budgets}
    best = min(times.values())
    num_sms = next(n for n in budgets if times[n] <= (1 + slack) * best)
    chunk, floor = chunk_of(num_sms), times[num_sms]
    slots = next(
        (s for s in range(2 * chunk, 64 * chunk, chunk) if total(at(num_sms, s)) <= (1 + slack) * floor), 64 * chunk
    )
    return num_sms, slots, chunk
