"""The CUDA internode (hierarchical) transport: stage 1 over RDMA, stage 2 over NVLink.

Importable without the extension. Protocol: ``csrc/kernels/internode.cuh`` (both pipelines in
prose, the RDMA buffer layout), ``internode_fused_roles.cuh`` (the fused pipeline's per-warp
code) and ``internode_roles.cuh`` (stage 1 of the staged one), shared by the GPU kernels and
the CPU backend.

A world of W = N nodes x L ranks (rank r = node r // L, local r % L). Two pipelines
(``Config.internode_pipeline``):

- **fused** (default): a notify kernel computes every count on the device (stage-1 ring sizes
  along the rail, relayed over NVLink to the ranks that receive), then one kernel per dispatch
  runs the RDMA puts to the forwarders (same local index on each destination node) and the
  forwarding over NVLink at the same time, as chunks land; combine runs backwards (holders ->
  forwarder over NVLink, pre-reduced there, one partial per (token, node) over RDMA, summed at
  the source). Without ``num_worst_tokens`` the host reads the receive count once (with the
  forwarded count, in the same read); with it, a fresh dispatch never waits for the host: its
  outputs have that many rows, rows past it are dropped and ``handle.overflow`` is set.
- **staged**: node notify, a host read, node dispatch into staging rows, one intranode operation
  per source node (a second host read); combine in reverse. Kept to time both side by side.

Both give rows ordered by (source rank, source token), as ``moe_dispatch.reference.dispatch``,
and combine sums equal to ``moe_dispatch.reference.combine`` bit for bit (fp32, fixed orders).

Every wait is bounded by ``timeout_s``; a timed-out launch raises
:class:`InternodeTimeoutError` naming the rank, node, channel, the rank waited for and the
counter. Every operation checks the ranks' arguments on the device
(:mod:`moe_dispatch.transport.header`): a mismatch raises
:class:`~moe_dispatch.transport.header.MismatchError` at the next synchronisation. Front ends:
:class:`InternodeLoopback` (N x L simulated ranks on one device, or CPU threads with
``device="cpu"``); one rank per process: ``moe_dispatch.transport.nvshmem.InternodeTransport``.
"""

from __future__ import annotations

import dataclasses

import torch

from ..config import ERROR_RECORD_INTS, Config, buffer_layout
from ..errors import BudgetOverflowError, CommError
from .header import OP_CACHED_DISPATCH, OP_COMBINE, OP_DISPATCH, Records, header_words
from .intranode import (
    COMBINE_DTYPES,
    IntranodeHandle,
    _alloc_outputs,
    _check_budget,
    _check_num_sms,
    _check_world_args,
    _combine_shape,
    _dispatch_fields,
    _dispatch_shape,
    _Engine,
    _ext,
    _header,
    _Input,
    _launch_dispatch,
    _Launcher,
    _loopback_device,
    _notify,
    _prepare_world,
    _ptr,
    _rank_results,
    _refusing,
    _slot_bytes,
    default_timeout_s,
)
from .intranode import (
    _combine as _intranode_combine,
)

MAX_LOOPBACK_RANKS = 16  # internode_limits["max_launch_ranks"]
MAX_NODES = 64
MAX_RANKS_PER_NODE = 16
LINE = 128

_PHASES = {
    1: "intranode notify",
    2: "intranode dispatch",
    3: "intranode combine",
    4: "node notify",
    5: "node dispatch",
    6: "node combine",
}
_FUSED_PHASES = {
    1: "notify",
    2: "dispatch (NVLink)",
    3: "combine (NVLink)",
    4: "notify",
    5: "dispatch (RDMA)",
    6: "combine (RDMA)",
}
_ROLES = {1: "barrier", 2: "sender", 3: "receiver", 4: "coordinator"}
_COUNTERS = {1: "signal", 2: "tail", 3: "head", 4: "header", 5: "relayed header", 6: "forwarded tail"}


class InternodeTimeoutError(CommError):
    """A wait inside an internode kernel ran past ``timeout_s``.

    Attributes: ``stage`` (1 = RDMA, 2 = NVLink), ``phase``, ``role``, ``rank`` / ``node`` (the
    waiting rank, global), ``channel`` (-1 for notify), ``peer`` / ``peer_node`` (the rank whose
    store never came), ``counter`` ("signal"/"tail"/"head"/"header"/...), ``expected``,
    ``observed``.
    """

    def __init__(self, message: str, fields: dict):
        super().__init__(message)
        self.__dict__.update(fields)


def describe_timeout(
    record: list[int], timeout_s: float, ranks_per_node: int, node: int | None = None, fused: bool = False
) -> tuple[str, dict]:
    """Message and fields of an error record (``int32[16]``). ``node``: the node whose intranode
    engine wrote it (staged stage 2: its ranks and peers are local), None for the RDMA engine;
    ``fused``: the record of a fused pipeline's launch (ranks are global)."""
    _, phase, role, rank, channel, peer, counter, expected, observed = record[:9]
    if phase == 0:
        message = (
            f"moe_dispatch internode operation timed out after timeout_s={timeout_s:g}, but the kernel's "
            f"record of which wait it was is missing; the buffers are in an undefined state: reset() them"
        )
        return message, dict.fromkeys(
            (
                "stage",
                "phase",
                "role",
                "rank",
                "node",
                "channel",
                "peer",
                "peer_node",
                "counter",
                "expected",
                "observed",
            )
        )
    if node is not None:  # an intranode engine: local ranks -> global
        rank, peer = node * ranks_per_node + rank, node * ranks_per_node + peer
    nvlink = node is not None or (fused and phase in (1, 2, 3))
    fields = {
        "stage": 2 if nvlink else 1,
        "phase": (_FUSED_PHASES if fused else _PHASES).get(phase, str(phase)),
        "role": _ROLES.get(role, str(role)),
        "rank": rank,
        "node": rank // ranks_per_node,
        "channel": channel,
        "peer": peer,
        "peer_node": peer // ranks_per_node,
        "counter": _COUNTERS.get(counter, str(counter)),
        "expected": expected,
        "observed": observed,
    }
    me = f"rank {rank} (node {rank // ranks_per_node}, local {rank % ranks_per_node})"
    them = f"rank {peer} (node {peer // ranks_per_node}, local {peer % ranks_per_node})"
    link = "NVLink" if nvlink else "RDMA"
    counter_name = fields["counter"]
    if counter_name == "signal":
        what = f"waited at the {fields['phase']} for {them} to arrive; saw {observed}, needed {expected}"
    elif counter_name in ("header", "relayed header"):
        what = f"waited for the {counter_name} of {them} (its operation never started or stalled)"
    elif counter_name in ("tail", "forwarded tail"):
        what = (
            f"{fields['role']} of channel {channel} waited for tokens from {them}: the tail of {link} queue "
            f"{them} -> rank {rank}, channel {channel}, should reach {expected} but stayed at {observed}"
        )
    else:
        what = (
            f"{fields['role']} of channel {channel} waited for {them} to free slots: the head of {link} queue "
            f"rank {rank} -> {them}, channel {channel}, should reach {expected} but stayed at {observed}"
        )
    message = (
        f"moe_dispatch internode {fields['phase']} (stage {fields['stage']}, {link}) timed out after "
        f"timeout_s={timeout_s:g}: {me} {what}. Rank {peer} did not take part (crashed, hung, or called another "
        f"operation). The communication buffers are now in an undefined state: reset() them (loopback) or "
        f"recreate the Buffer."
    )
    return message, fields


# ---------------------------------------------------------------------------------------------
# RDMA buffer layout (mirror of make_rdma_layout in internode.cuh; a CPU test checks it)
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RdmaLayout:
    """Byte offsets of one rank's RDMA buffer (drawn in internode.cuh)."""

    num_nodes: int
    ranks_per_node: int
    num_channels: int
    num_slots: int
    slot_bytes: int
    msg_bytes: int
    arrive_offset: int
    meta_offset: int
    meta_out_offset: int
    header_offset: int
    header_out_offset: int
    tail_offset: int
    head_offset: int
    flag_offset: int
    zero_offset: int
    recv_offset: int
    send_offset: int
    total_bytes: int


def rdma_layout(num_nodes: int, ranks_per_node: int, num_channels: int, num_slots: int, slot_bytes: int) -> RdmaLayout:
    align = lambda v: -(-v // LINE) * LINE  # noqa: E731
    queues = num_nodes * num_channels
    ring = queues * num_slots * slot_bytes
    msg = LINE + align(4 * num_channels * (1 + ranks_per_node))
    arrive = LINE
    meta = arrive + align(16 * num_nodes)
    meta_out = meta + 2 * num_nodes * msg
    header = meta_out + 2 * num_nodes * msg
    header_out = header + 2 * LINE * num_nodes
    tail = header_out + LINE * num_nodes
    head = tail + LINE * queues
    flag = head + LINE * queues
    zero = flag + align(8 * queues * num_slots)
    recv = zero + align(slot_bytes)
    return RdmaLayout(
        num_nodes,
        ranks_per_node,
        num_channels,
        num_slots,
        slot_bytes,
        msg,
        arrive,
        meta,
        meta_out,
        header,
        header_out,
        tail,
        head,
        flag,
        zero,
        recv,
        recv + ring,
        recv + 2 * ring,
    )


def check_rdma_config(config: Config) -> None:
    if config.num_slots % config.chunk_tokens:
        raise ValueError(
            f"the internode kernels need Config.chunk_tokens to divide Config.num_slots (a chunk is one "
            f"contiguous RDMA put), got chunk_tokens={config.chunk_tokens}, num_slots={config.num_slots}"
        )


def fused_channels(num_sms: int, config: Config) -> int:
    """Channels of a fused launch for an SM budget of ``num_sms``: three blocks each, at least
    one (``num_sms`` checked as the intranode kernels check it)."""
    _check_num_sms(num_sms, config)
    return max(1, num_sms // 3)


class _RdmaEngine(_Launcher):
    """Launches the RDMA-side kernels (both pipelines) for a list of ranks.

    Args:
        num_nodes, ranks_per_node: N, L.
        config: channels, ring depth, chunk (``num_slots % chunk_tokens == 0``).
        slot_bytes: capacity of an RDMA slot (and of the NVLink slots).
        buffers: loopback / CPU: every rank's RDMA buffer address (global rank order); else [].
        symmetric: NVSHMEM mode: this PE's symmetric buffer address; else None.
        nvl_buffers, nvl_first_rank: the fused pipeline's NVLink buffers (rank r's at
            ``r - nvl_first_rank``: loopback all W from 0, one process per rank its node's).
        error: ``int32[16]`` record on the launch device (zeroed); ``error_host_ptr``: a mirror.
        backend: "cuda" or "cpu"; mode: "loopback" or "nvshmem".
        records, rank_begin: the launched ranks' mismatch records (rank r's at r - rank_begin).
    """

    def __init__(
        self,
        num_nodes: int,
        ranks_per_node: int,
        config: Config,
        slot_bytes: int,
        buffers: list[int],
        symmetric: int | None,
        nvl_buffers: list[int],
        nvl_first_rank: int,
        error: torch.Tensor,
        error_host_ptr: int | None,
        backend: str,
        mode: str,
        timeout_s: float,
        cpu_options: dict | None = None,
        *,
        records: Records,
        rank_begin: int = 0,
    ):
        check_rdma_config(config)
        self.num_nodes, self.ranks_per_node = num_nodes, ranks_per_node
        self.config, self.slot_bytes, self.buffers, self.symmetric = config, slot_bytes, buffers, symmetric
        self.nvl_buffers, self.nvl_first_rank, self.mode = nvl_buffers, nvl_first_rank, mode
        self.layout = rdma_layout(num_nodes, ranks_per_node, config.num_channels, config.num_slots, slot_bytes)
        self.nvl_layout = buffer_layout(ranks_per_node, config.num_channels, config.num_slots, slot_bytes, num_nodes)
        super().__init__(error, error_host_ptr, backend, timeout_s, cpu_options, records, rank_begin)

    def common(self, num_channels: int, rank_begin: int, skip_rank: int | None) -> dict:
        return {
            "num_nodes": self.num_nodes,
            "ranks_per_node": self.ranks_per_node,
            "symmetric": self.symmetric,
            "nvl_buffers": self.nvl_buffers,
            "nvl_first_rank": self.nvl_first_rank,
            "nvl_num_slots": self.config.num_slots,
            "nvl_slot_bytes": self.slot_bytes,
            **self._common(self.config, self.slot_bytes, self.buffers, num_channels, rank_begin, skip_rank),
        }

    def _run(self, name: str, *args, cpu_options: bool = True) -> None:
        self.launches += 1
        extra = (self.cpu_options,) if cpu_options else ()
        getattr(_ext(), name)(*args, self.backend, self.mode, self._stream(), self.cooperative, *extra)

    def node_notify(self, common: dict, ranks: list[dict]) -> None:
        self._run("internode_node_notify", common, ranks, cpu_options=False)

    def node_dispatch(
        self, common: dict, ranks: list[dict], x_bytes: int, scale_bytes: int, num_topk: int, experts_per_node: int
    ) -> None:
        self._run("internode_node_dispatch", common, ranks, x_bytes, scale_bytes, num_topk, experts_per_node)

    def node_combine(self, common: dict, ranks: list[dict], y_bytes: int, dtype: torch.dtype) -> None:
        self._run("internode_node_combine", common, ranks, y_bytes, COMBINE_DTYPES[dtype])

    def fused_notify(self, common: dict, ranks: list[dict], num_topk: int) -> None:
        self._run("internode_fused_notify", common, ranks, num_topk, cpu_options=False)

    def fused_dispatch(
        self, common: dict, ranks: list[dict], x_bytes: int, scale_bytes: int, num_topk: int, experts_per_rank: int
    ) -> None:
        self._run("internode_fused_dispatch", common, ranks, x_bytes, scale_bytes, num_topk, experts_per_rank)

    def fused_combine(self, common: dict, ranks: list[dict], y_bytes: int, dtype: torch.dtype) -> None:
        self._run("internode_fused_combine", common, ranks, y_bytes, COMBINE_DTYPES[dtype])


# ---------------------------------------------------------------------------------------------
# Handles and results
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class InternodeHandle:
    """One rank's share of a fused internode dispatch: what combine and a cached dispatch replay.

    Every tensor lives on the device; nothing here needs the host to have read a count except
    ``num_recv_tokens`` (None in budget mode).

    Attributes:
        num_tokens: T; ``num_channels``: C of the dispatch.
        is_token_in_rank: ``[T, W]`` bool; ``is_token_in_node``: ``[T, N]`` bool.
        recv_prefix: ``[W * C + 1]`` int32: first receive row of each (source rank, channel).
        forward_prefix: ``[C * N + 1]`` int32: the rows this rank forwards, by (channel, source
            node) (stage-1 ring sizes); the last entry is R1.
        forward_mask: ``[forward_capacity]`` int32: per forwarded row the local ranks holding it
            (bit l), written by the dispatch, read by combine and cached dispatches.
        counts: ``[2]`` int32: R (rows received) and R1 (rows forwarded).
        overflow: ``[1]`` int32: 1 when R exceeded ``num_rows`` or R1 ``forward_capacity``.
        peer_ok: ``[N + L]`` int32: the notify's verdicts (rail pairs by node, NVLink pairs by
            local rank).
        num_recv_tokens: R as a host int (None in budget mode).
        num_rows: rows allocated for the receive (R, or ``num_worst_tokens``).
        forward_capacity: rows of forward_mask (R1, or ``L * num_worst_tokens``).
        dispatch_id, num_experts: the dispatch's identity and E (header.py).
        topk_dtype: the caller's top-k id dtype.
    """

    num_tokens: int
    num_channels: int
    is_token_in_rank: torch.Tensor
    is_token_in_node: torch.Tensor
    recv_prefix: torch.Tensor
    forward_prefix: torch.Tensor
    forward_mask: torch.Tensor
    counts: torch.Tensor
    overflow: torch.Tensor
    peer_ok: torch.Tensor
    num_recv_tokens: int | None
    num_rows: int
    forward_capacity: int
    dispatch_id: int
    num_experts: int
    topk_dtype: torch.dtype = torch.int64
    notified: bool = dataclasses.field(default=False, repr=False)  # as IntranodeHandle.notified

    @property
    def num_forward_rows(self) -> int:
        """R1: rows this rank received in stage 1 and forwarded (reads the device)."""
        return int(self.counts[1])

    def check_overflow(self) -> None:
        """Raises :class:`~moe_dispatch.errors.BudgetOverflowError` when the budget was too small
        (reads the device: a host sync)."""
        if int(self.overflow.item()):
            received, forwarded = self.counts.tolist()
            raise BudgetOverflowError(
                f"dispatch received {received} rows (forwarded {forwarded}) but num_worst_tokens allowed "
                f"{self.num_rows} (forwarding {self.forward_capacity}): rows past the budget were dropped; "
                "raise num_worst_tokens"
            )


@dataclasses.dataclass(eq=False)
class StagedInternodeHandle:
    """One rank's share of a staged internode dispatch (``Config.internode_pipeline="staged"``).

    Attributes:
        num_tokens, num_channels, is_token_in_rank, is_token_in_node: as :class:`InternodeHandle`.
        node_prefix: ``[N * C + 1]`` int32: first stage-1 receive row of each (source node, channel).
        node_peer_ok: ``[N]`` int32: the node notify's rail verdicts.
        segments: N + 1 host ints: this rank's stage-1 rows from source node m are
            ``[segments[m], segments[m + 1])`` (it forwards them inside its node).
        forward_in_rank: ``[R1, L]`` bool: which local ranks hold each forwarded row.
        local: per source node m, the :class:`~moe_dispatch.transport.intranode.IntranodeHandle` of
            stage-2 operation m; its rows start at :meth:`row_base` (m).
        num_rows: R, rows received in all.
        dispatch_id, num_experts, topk_dtype: as :class:`InternodeHandle`.
    """

    num_tokens: int
    num_channels: int
    is_token_in_rank: torch.Tensor
    is_token_in_node: torch.Tensor
    node_prefix: torch.Tensor
    node_peer_ok: torch.Tensor
    segments: list[int]
    forward_in_rank: torch.Tensor
    local: list[IntranodeHandle]
    num_rows: int
    dispatch_id: int
    num_experts: int
    topk_dtype: torch.dtype = torch.int64
    notified: bool = dataclasses.field(default=False, repr=False)

    @property
    def num_forward_rows(self) -> int:
        """R1: rows this rank received in stage 1 (and forwards)."""
        return self.segments[-1]

    def row_base(self, node: int) -> int:
        """First receive row of stage-2 op ``node`` (rows from source node ``node``)."""
        return sum(h.num_rows for h in self.local[:node])


@dataclasses.dataclass(eq=False)
class InternodeDispatch:
    """One rank's dispatch outputs (rows ``[R or budget, ...]``, by source rank then source token)."""

    recv_x: torch.Tensor | tuple[torch.Tensor, torch.Tensor]
    recv_topk_idx: torch.Tensor | None
    recv_topk_weights: torch.Tensor | None
    recv_src_idx: torch.Tensor
    num_recv_tokens_per_expert: torch.Tensor
    handle: InternodeHandle | StagedInternodeHandle


class _Transport:
    """The engines one launch uses: the RDMA engine (the fused pipeline's only one) and, for the
    staged pipeline, per node with launched ranks its intranode engine."""

    def __init__(self, num_nodes: int, ranks_per_node: int, rdma: _RdmaEngine, nodes: dict[int, _Engine]):
        self.num_nodes, self.ranks_per_node, self.rdma, self.nodes = num_nodes, ranks_per_node, rdma, nodes

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.ranks_per_node

    @property
    def fused(self) -> bool:
        return self.rdma.config.internode_pipeline == "fused"

    def check_timeouts(self) -> None:
        """Raises :class:`InternodeTimeoutError` for the first engine whose record is set (a host sync)."""
        L = self.ranks_per_node
        record = self.rdma.read_error()
        if record:
            raise InternodeTimeoutError(*describe_timeout(record, self.rdma.timeout_s, L, fused=self.fused))
        for node, engine in self.nodes.items():
            record = engine.read_error()
            if record:
                raise InternodeTimeoutError(*describe_timeout(record, engine.timeout_s, L, node=node))

    def check_mismatches(self, synchronize: bool = True) -> None:
        """Raises :class:`~moe_dispatch.transport.header.MismatchError` for the first set record."""
        self.rdma.records.raise_if_set(synchronize)
        for node, engine in self.nodes.items():
            engine.records.raise_if_set(synchronize, rank_offset=node * self.ranks_per_node)

    def check(self) -> None:
        self.check_timeouts()
        self.check_mismatches()


def _skipper(skip_rank: int | None, skip_phase: str | None):
    return lambda phase: skip_rank if skip_phase == phase else None  # noqa: E731


# ---------------------------------------------------------------------------------------------
# The fused pipeline
# ---------------------------------------------------------------------------------------------


def _fused_dispatch(
    t: _Transport,
    inputs: list[_Input],
    num_experts: int,
    *,
    num_sms: int,
    handles: list[InternodeHandle] | None,
    num_worst_tokens: int | None,
    skip_rank: int | None,
    skip_phase: str | None,
    dispatch_ids: list[int | None] | None,
    statuses: dict[int, int] | None,
    check: bool,
) -> list[InternodeDispatch]:
    """Dispatch for ranks ``inputs[i].rank`` (consecutive): the fused notify (fresh only), then
    one fused dispatch launch."""
    e, W, device = t.rdma, t.world_size, t.rdma.device
    _, num_topk, x_bytes, scale_bytes = _dispatch_shape(
        inputs, e.slot_bytes, slots="the buffers' slots", fix="size the transport"
    )
    experts_per_rank, statuses = num_experts // W, statuses or {}
    skip = _skipper(skip_rank, skip_phase)
    outs = None
    if handles is None:
        handles, outs = _fused_notify(
            t,
            inputs,
            num_experts,
            num_sms=num_sms,
            num_worst_tokens=num_worst_tokens,
            skip_rank=skip("notify"),
            dispatch_ids=dispatch_ids,
            statuses=statuses,
        )
    else:
        for inp, h in zip(inputs, handles):
            if not isinstance(h, InternodeHandle) or (h.num_tokens != inp.x.shape[0] and inp.rank not in statuses):
                raise ValueError(
                    f"rank {inp.rank}: the handle is not an InternodeHandle for {inp.x.shape[0]} tokens "
                    f"(of this transport's fused pipeline)"
                )
    if outs is None:
        outs = [_alloc_outputs(inp, h.num_rows, experts_per_rank, device) for inp, h in zip(inputs, handles)]
    _fused_launch(t, inputs, handles, outs, num_experts, skip("dispatch"), statuses, x_bytes, scale_bytes, num_topk)
    return _rank_results(InternodeDispatch, inputs, handles, outs)


def _fused_notify(
    t: _Transport,
    inputs: list[_Input],
    num_experts: int,
    *,
    num_sms: int,
    num_worst_tokens: int | None,
    skip_rank: int | None,
    dispatch_ids: list[int | None] | None,
    statuses: dict[int, int],
    outs: list[dict] | None = None,
) -> tuple[list[InternodeHandle], list[dict] | None]:
    """The fused notify launch: per rank a handle. Without a budget the host reads R and R1 (one
    read for all launched ranks); with one, nothing is read and the outputs notify fills (their
    padding rows) are made here unless passed (``outs``, as in the intranode ``_notify``)."""
    e, N, L, W, device = t.rdma, t.num_nodes, t.ranks_per_node, t.world_size, t.rdma.device
    num_topk, experts_per_rank = inputs[0].topk_idx.shape[1], num_experts // W
    if num_topk == 0:
        raise ValueError("a fresh internode dispatch needs topk_idx (the forwarders read the holders from it)")
    C = fused_channels(num_sms, e.config)
    budget = _check_budget(num_worst_tokens)
    ids = e.dispatch_ids(dispatch_ids, len(inputs))
    zeros = lambda n: torch.zeros(n, dtype=torch.int32, device=device)  # noqa: E731
    in_node = [inp.is_token_in_rank.view(-1, N, L).any(2).contiguous() for inp in inputs]
    tables = [
        {
            "recv_prefix": zeros(W * C + 1),
            "forward_prefix": zeros(C * N + 1),
            "counts": zeros(2),
            "overflow": zeros(1),
            "peer_ok": zeros(N + L),
        }
        for _ in inputs
    ]
    if budget < 0:
        outs = None
    elif outs is None:
        outs = [_alloc_outputs(inp, budget, experts_per_rank, device) for inp in inputs]
    capacity = L * budget if budget >= 0 else -1
    e.fused_notify(
        e.common(C, inputs[0].rank, skip_rank),
        [
            {
                "is_token_in_rank": _ptr(inp.is_token_in_rank),
                "is_token_in_node": _ptr(itn),
                **{k: v.data_ptr() for k, v in tb.items()},
                "recv_topk_idx": _ptr(outs[i]["topk_idx"]) if outs else None,
                "recv_topk_weights": _ptr(outs[i]["topk_weights"]) if outs else None,
                "recv_src_idx": _ptr(outs[i]["src_idx"]) if outs else None,
                "num_tokens": inp.x.shape[0],
                "budget": budget,
                "forward_capacity": capacity,
                **e.check_fields(
                    inp.rank, _header(OP_DISPATCH, ids[i], inp, num_experts, C, statuses.get(inp.rank, 0))
                ),
            }
            for i, (inp, itn, tb) in enumerate(zip(inputs, in_node, tables))
        ],
        num_topk,
    )
    if budget < 0:  # the one host read: R and R1 of every launched rank, and the timeout record
        host = torch.cat([*(tb["counts"] for tb in tables), e.error]).tolist()
        counts = [host[2 * i : 2 * i + 2] for i in range(len(inputs))]
        if host[2 * len(inputs)] or host[2 * len(inputs) + 1]:
            raise InternodeTimeoutError(*describe_timeout(host[2 * len(inputs) :], e.timeout_s, L, fused=True))
    else:
        counts = [(None, None)] * len(inputs)
    handles = [
        InternodeHandle(
            num_tokens=inp.x.shape[0],
            num_channels=C,
            is_token_in_rank=inp.is_token_in_rank,
            is_token_in_node=itn,
            recv_prefix=tb["recv_prefix"],
            forward_prefix=tb["forward_prefix"],
            forward_mask=torch.zeros(capacity if budget >= 0 else forwarded, dtype=torch.int32, device=device),
            counts=tb["counts"],
            overflow=tb["overflow"],
            peer_ok=tb["peer_ok"],
            num_recv_tokens=received,
            num_rows=budget if budget >= 0 else received,
            forward_capacity=capacity if budget >= 0 else forwarded,
            dispatch_id=ids[i],
            num_experts=num_experts,
            topk_dtype=inp.topk_dtype or torch.int64,
            notified=True,
        )
        for i, (inp, itn, tb, (received, forwarded)) in enumerate(zip(inputs, in_node, tables, counts))
    ]
    return handles, outs


def _fused_launch(
    t: _Transport,
    inputs: list[_Input],
    handles: list[InternodeHandle],
    outs: list[dict],
    num_experts: int,
    skip_rank: int | None,
    statuses: dict[int, int],
    x_bytes: int,
    scale_bytes: int,
    num_topk: int,
) -> None:
    """The fused dispatch launch into ``outs`` (per rank the dict of ``_alloc_outputs``, whose
    tensors may be views of the caller's: rows ``[handle.num_rows, ...]``)."""
    e = t.rdma
    ranks = []
    for inp, h, o in zip(inputs, handles, outs):
        fresh, fields = _dispatch_fields(e, inp, h, o, num_experts, statuses)
        ranks.append(
            {
                **fields,
                "is_token_in_node": _ptr(h.is_token_in_node),
                "recv_prefix": h.recv_prefix.data_ptr(),
                "forward_prefix": h.forward_prefix.data_ptr(),
                "forward_mask": _ptr(h.forward_mask),
                "peer_ok": h.peer_ok.data_ptr() if fresh else None,
                "forward_capacity": h.forward_capacity,
            }
        )
    e.fused_dispatch(
        e.common(handles[0].num_channels, inputs[0].rank, skip_rank),
        ranks,
        x_bytes,
        scale_bytes,
        num_topk,
        num_experts // t.world_size,
    )


def _fused_combine(
    t: _Transport,
    rank_begin: int,
    ys: list[torch.Tensor],
    handles: list[InternodeHandle],
    row_scales: list[torch.Tensor | None] | None,
    skip_rank: int | None,
    skip_phase: str | None,
    statuses: dict[int, int] | None,
) -> list[torch.Tensor]:
    e, device, statuses = t.rdma, t.rdma.device, statuses or {}
    row_scales, hidden, dtype, y_bytes = _combine_shape(
        ys, handles, row_scales, rank_begin, device, e.slot_bytes, InternodeHandle, slots="the buffers' slots"
    )
    outs = [torch.empty(h.num_tokens, hidden, dtype=dtype, device=device) for h in handles]
    e.fused_combine(
        e.common(handles[0].num_channels, rank_begin, _skipper(skip_rank, skip_phase)("combine")),
        [
            {
                "y": _ptr(y),
                "row_scale": _ptr(s.contiguous()) if s is not None else None,
                "is_token_in_node": _ptr(h.is_token_in_node),
                "recv_prefix": h.recv_prefix.data_ptr(),
                "forward_prefix": h.forward_prefix.data_ptr(),
                "forward_mask": _ptr(h.forward_mask),
                "out": _ptr(out),
                "num_tokens": h.num_tokens,
                "num_rows": h.num_rows,
                "forward_capacity": h.forward_capacity,
                **e.check_fields(
                    rank_begin + i,
                    header_words(
                        OP_COMBINE,
                        h.dispatch_id,
                        y_bytes,
                        dtype,
                        0,
                        h.num_experts,
                        h.num_channels,
                        status=statuses.get(rank_begin + i, 0),
                    ),
                ),
            }
            for i, (y, h, s, out) in enumerate(zip(ys, handles, row_scales, outs))
        ],
        y_bytes,
        dtype,
    )
    return outs


# ---------------------------------------------------------------------------------------------
# The staged pipeline
# ---------------------------------------------------------------------------------------------


def _node_groups(t: _Transport, ranks: list[int]):
    """Per node with launched ranks (consecutive, global ``ranks``): its intranode engine and the
    indices into ``ranks`` of its members."""
    groups: dict[int, list[int]] = {}
    for i, r in enumerate(ranks):
        groups.setdefault(r // t.ranks_per_node, []).append(i)
    for node, members in groups.items():
        yield node, t.nodes[node], members


def _local_statuses(t: _Transport, statuses: dict[int, int]) -> dict[int, int]:
    """Refusing ranks numbered as their node's intranode engine numbers them."""
    return {r % t.ranks_per_node: code for r, code in statuses.items()}


def _local_skip(t: _Transport, node: int, skip_rank: int | None) -> int | None:
    L = t.ranks_per_node
    return skip_rank - node * L if skip_rank is not None and skip_rank // L == node else None


def _staged_dispatch(
    t: _Transport,
    inputs: list[_Input],
    num_experts: int,
    *,
    num_sms: int,
    handles: list[StagedInternodeHandle] | None,
    skip_rank: int | None,
    skip_phase: str | None,
    dispatch_ids: list[int | None] | None,
    statuses: dict[int, int] | None,
    check: bool,
) -> list[InternodeDispatch]:
    """Dispatch for ranks ``inputs[i].rank`` (consecutive): stage 1 in one launch per step, stage
    2 one intranode launch per (node, source node)."""
    e, N, L, device = t.rdma, t.num_nodes, t.ranks_per_node, t.rdma.device
    _, num_topk, x_bytes, scale_bytes = _dispatch_shape(
        inputs, e.slot_bytes, slots="the buffers' slots", fix="size the transport"
    )
    experts_per_node, experts_per_rank = num_experts // N, num_experts // t.world_size
    ranks = [inp.rank for inp in inputs]
    skip, statuses = _skipper(skip_rank, skip_phase), statuses or {}
    fresh = handles is None
    scratch = lambda n=1: torch.zeros(n, dtype=torch.int32, device=device)  # noqa: E731
    # Stage 1: node notify (fresh only) and node dispatch into the forwarders' staging rows.
    if fresh:
        C = _check_num_sms(num_sms, e.config)
        ids = e.dispatch_ids(dispatch_ids, len(inputs))
        in_node = [inp.is_token_in_rank.view(-1, N, L).any(2).contiguous() for inp in inputs]
        node_prefix = [scratch(N * C + 1) for _ in inputs]
        node_ok = [scratch(N) for _ in inputs]
        outputs = [scratch(2) for _ in inputs]  # the count and overflow words notify writes (unused here)
        e.node_notify(
            e.common(C, ranks[0], skip("node_notify")),
            [
                {
                    "is_token_in_rank": _ptr(itn),
                    "recv_prefix": p.data_ptr(),
                    "num_recv_tokens": out.data_ptr(),
                    "overflow": out.data_ptr() + 4,
                    "peer_ok": ok.data_ptr(),
                    "recv_topk_idx": None,
                    "recv_topk_weights": None,
                    "recv_src_idx": None,
                    "num_tokens": inp.x.shape[0],
                    "budget": -1,
                    **e.check_fields(
                        inp.rank, _header(OP_DISPATCH, ids[i], inp, num_experts, C, statuses.get(inp.rank, 0))
                    ),
                }
                for i, (inp, itn, p, ok, out) in enumerate(zip(inputs, in_node, node_prefix, node_ok, outputs))
            ],
        )
        prefixes_host = torch.stack(node_prefix).tolist()  # one host sync for all launched ranks
        if check:
            t.check()
        segments = [[p[m * C] for m in range(N + 1)] for p in prefixes_host]
    else:
        C = handles[0].num_channels
        ids = [h.dispatch_id for h in handles]
        in_node = [h.is_token_in_node for h in handles]
        node_prefix = [h.node_prefix for h in handles]
        segments = [h.segments for h in handles]
    staged = [_alloc_outputs(inp, seg[-1], experts_per_node, device) for inp, seg in zip(inputs, segments)]
    overflow = [scratch() for _ in inputs]
    e.node_dispatch(
        e.common(C, ranks[0], skip("node_dispatch")),
        [
            {
                "x": _ptr(inp.x),
                "x_scales": _ptr(inp.scales),
                "topk_idx": _ptr(inp.topk_idx),
                "topk_weights": _ptr(inp.topk_weights),
                "is_token_in_rank": _ptr(itn),
                "recv_prefix": p.data_ptr(),
                "recv_x": _ptr(s["x"]),
                "recv_scales": _ptr(s["scales"]),
                "recv_topk_idx": _ptr(s["topk_idx"]),
                "recv_topk_weights": _ptr(s["topk_weights"]) if inp.topk_weights is not None else None,
                "recv_src_idx": _ptr(s["src_idx"]),
                "num_recv_per_expert": s["per_expert"].data_ptr(),
                "overflow": o.data_ptr(),
                "peer_ok": node_ok[i].data_ptr() if fresh else None,
                "num_tokens": inp.x.shape[0],
                "num_rows": seg[-1],
                **e.check_fields(
                    inp.rank,
                    _header(
                        OP_DISPATCH if fresh else OP_CACHED_DISPATCH,
                        ids[i],
                        inp,
                        num_experts,
                        C,
                        statuses.get(inp.rank, 0),
                    ),
                ),
            }
            for i, (inp, itn, p, s, o, seg) in enumerate(zip(inputs, in_node, node_prefix, staged, overflow, segments))
        ],
        x_bytes,
        scale_bytes,
        num_topk,
        experts_per_node,
    )
    if check and e.backend == "cpu":
        t.check()

    # Stage 2: per node, one intranode operation per source node m over the forwarded rows.
    def stage2_input(i: int, m: int, forward_in_rank: torch.Tensor) -> _Input:
        s, seg = staged[i], slice(segments[i][m], segments[i][m + 1])
        return _Input(
            ranks[i] % L,
            s["x"][seg],
            s["scales"][seg] if s["scales"] is not None else None,
            s["topk_idx"][seg],
            s["topk_weights"][seg] if inputs[i].topk_weights is not None else None,
            forward_in_rank[seg],
            torch.int64,
            token_ids=s["src_idx"][seg],
        )

    if fresh:
        from ..ops.layout import get_dispatch_layout

        forward_in_rank = [
            get_dispatch_layout(s["topk_idx"], experts_per_node, L, L, validate=False)[3].contiguous()
            if s["topk_idx"].numel()
            else torch.zeros(s["x"].shape[0], L, dtype=torch.bool, device=device)
            for s in staged
        ]
        local: list[list[IntranodeHandle]] = [[] for _ in inputs]
        for node, engine, members in _node_groups(t, ranks):
            for m in range(N):
                got, _ = _notify(
                    engine,
                    [stage2_input(i, m, forward_in_rank[i]) for i in members],
                    experts_per_rank,
                    num_sms=num_sms,
                    num_worst_tokens=None,
                    skip_rank=_local_skip(t, node, skip("notify")),
                    dispatch_ids=[ids[i] for i in members],
                    statuses=_local_statuses(t, statuses),
                )  # each reads R: the staged host syncs
                for i, h in zip(members, got):
                    local[i].append(h)
        if check:
            t.check()
        handles = [
            StagedInternodeHandle(
                num_tokens=inp.x.shape[0],
                num_channels=C,
                is_token_in_rank=inp.is_token_in_rank,
                is_token_in_node=itn,
                node_prefix=p,
                node_peer_ok=ok,
                segments=seg,
                forward_in_rank=fir,
                local=loc,
                num_rows=sum(h.num_rows for h in loc),
                dispatch_id=ids[i],
                num_experts=num_experts,
                topk_dtype=inp.topk_dtype or torch.int64,
            )
            for i, (inp, itn, p, ok, seg, fir, loc) in enumerate(
                zip(inputs, in_node, node_prefix, node_ok, segments, forward_in_rank, local)
            )
        ]
    outs = [_alloc_outputs(inp, h.num_rows, experts_per_rank, device) for inp, h in zip(inputs, handles)]
    for node, engine, members in _node_groups(t, ranks):
        for m in range(N):
            launch_inputs, launch_outs = [], []
            for i in members:
                h, o = handles[i], outs[i]
                rows = slice(h.row_base(m), h.row_base(m) + h.local[m].num_rows)
                inp = stage2_input(i, m, h.forward_in_rank)
                if inputs[i].topk_dtype is None:  # x alone: no top-k travels in stage 2 either
                    inp = dataclasses.replace(inp, topk_idx=inp.topk_idx[:, :0], topk_weights=None)
                launch_inputs.append(inp)
                launch_outs.append(
                    {
                        "x": o["x"][rows],
                        "scales": o["scales"][rows] if o["scales"] is not None else None,
                        "topk_idx": o["topk_idx"][rows],
                        "topk_weights": o["topk_weights"][rows],
                        "src_idx": o["src_idx"][rows],
                        "per_expert": o["per_expert"],
                    }
                )
            _launch_dispatch(
                engine,
                launch_inputs,
                [handles[i].local[m] for i in members],
                launch_outs,
                experts_per_rank,
                skip_rank=_local_skip(t, node, skip("dispatch")),
                statuses=_local_statuses(t, statuses),
            )
    return _rank_results(InternodeDispatch, inputs, handles, outs)


def _staged_combine(
    t: _Transport,
    rank_begin: int,
    ys: list[torch.Tensor],
    handles: list[StagedInternodeHandle],
    row_scales: list[torch.Tensor | None] | None,
    skip_rank: int | None,
    skip_phase: str | None,
    statuses: dict[int, int] | None,
    check: bool,
) -> list[torch.Tensor]:
    e, N, L, device, statuses = t.rdma, t.num_nodes, t.ranks_per_node, t.rdma.device, statuses or {}
    row_scales, hidden, dtype, y_bytes = _combine_shape(
        ys, handles, row_scales, rank_begin, device, e.slot_bytes, StagedInternodeHandle, slots="the buffers' slots"
    )
    C = handles[0].num_channels
    ranks = list(range(rank_begin, rank_begin + len(ys)))
    skip = _skipper(skip_rank, skip_phase)
    # Stage 2 backwards: node partials [R1, H] on every forwarder, one intranode combine per m.
    partials = [torch.empty(h.num_forward_rows, hidden, dtype=dtype, device=device) for h in handles]
    for node, engine, members in _node_groups(t, ranks):
        for m in range(N):
            rows = [
                slice(handles[i].row_base(m), handles[i].row_base(m) + handles[i].local[m].num_rows) for i in members
            ]
            segs = [slice(handles[i].segments[m], handles[i].segments[m + 1]) for i in members]
            _intranode_combine(
                engine,
                ranks[members[0]] % L,
                [ys[i][r] for i, r in zip(members, rows)],
                [handles[i].local[m] for i in members],
                [row_scales[i][r].contiguous() if row_scales[i] is not None else None for i, r in zip(members, rows)],
                _local_skip(t, node, skip("combine")),
                statuses=_local_statuses(t, statuses),
                outs=[partials[i][s] for i, s in zip(members, segs)],
            )
    if check and e.backend == "cpu":
        t.check()
    # Stage 1 backwards: each partial once to its source, summed there by ascending node.
    outs = [torch.empty(h.num_tokens, hidden, dtype=dtype, device=device) for h in handles]
    e.node_combine(
        e.common(C, rank_begin, skip("node_combine")),
        [
            {
                "y": _ptr(p),
                "row_scale": None,
                "is_token_in_rank": _ptr(h.is_token_in_node),
                "recv_prefix": h.node_prefix.data_ptr(),
                "out": _ptr(o),
                "num_tokens": h.num_tokens,
                "num_rows": h.num_forward_rows,
                **e.check_fields(
                    rank_begin + i,
                    header_words(
                        OP_COMBINE,
                        h.dispatch_id,
                        y_bytes,
                        dtype,
                        0,
                        h.num_experts,
                        C,
                        status=statuses.get(rank_begin + i, 0),
                    ),
                ),
            }
            for i, (p, h, o) in enumerate(zip(partials, handles, outs))
        ],
        y_bytes,
        dtype,
    )
    return outs


def _dispatch(
    t: _Transport,
    inputs: list[_Input],
    num_experts: int,
    *,
    num_sms: int,
    handles: list | None,
    num_worst_tokens: int | None,
    skip_rank: int | None,
    skip_phase: str | None,
    dispatch_ids: list[int | None] | None,
    statuses: dict[int, int] | None,
    check: bool,
) -> list:
    """Dispatch through the transport's pipeline (``skip_phase`` None: its main kernel)."""
    if t.fused:
        return _fused_dispatch(
            t,
            inputs,
            num_experts,
            num_sms=num_sms,
            handles=handles,
            num_worst_tokens=num_worst_tokens,
            skip_rank=skip_rank,
            skip_phase=skip_phase or "dispatch",
            dispatch_ids=dispatch_ids,
            statuses=statuses,
            check=check,
        )
    if _check_budget(num_worst_tokens) >= 0:
        raise ValueError(
            "num_worst_tokens needs Config.internode_pipeline='fused' (the staged pipeline reads its "
            "counts on the host)"
        )
    return _staged_dispatch(
        t,
        inputs,
        num_experts,
        num_sms=num_sms,
        handles=handles,
        skip_rank=skip_rank,
        skip_phase=skip_phase or "node_dispatch",
        dispatch_ids=dispatch_ids,
        statuses=statuses,
        check=check,
    )


def _combine(
    t: _Transport,
    rank_begin: int,
    ys: list[torch.Tensor],
    handles: list,
    row_scales,
    skip_rank: int | None,
    skip_phase: str | None,
    statuses: dict[int, int] | None,
    check: bool,
) -> list[torch.Tensor]:
    """Combine through the transport's pipeline (``skip_phase`` None: its main kernel)."""
    if t.fused:
        return _fused_combine(t, rank_begin, ys, handles, row_scales, skip_rank, skip_phase or "combine", statuses)
    return _staged_combine(
        t, rank_begin, ys, handles, row_scales, skip_rank, skip_phase or "node_combine", statuses, check
    )


def cross_node_bytes(handles: list, ranks_per_node: int, row_bytes: int, rank_begin: int = 0) -> int:
    """Payload bytes that crossed a node boundary in stage 1 of a dispatch: rows a rank received
    from other nodes x ``row_bytes`` (the de-duplicated lower bound when each (token, node)
    pair crossed once). Reads the device for fused handles."""
    total = 0
    for i, h in enumerate(handles):
        node = (rank_begin + i) // ranks_per_node
        if isinstance(h, InternodeHandle):
            per = h.forward_prefix.diff().view(h.num_channels, -1).sum(0).tolist()  # rows by source node
            total += (sum(per) - per[node]) * row_bytes
        else:
            total += (h.segments[-1] - (h.segments[node + 1] - h.segments[node])) * row_bytes
    return total


# ---------------------------------------------------------------------------------------------
# Loopback: N x L simulated ranks on one device
# ---------------------------------------------------------------------------------------------


class InternodeLoopback:
    """N nodes x L ranks simulated on one device: the internode kernels with every RDMA put
    replaced by a store into the peer's buffer (same device).

    On a GPU one launch per step serves all W = N * L ranks (the fused pipeline: a notify and
    one kernel per operation; staged: stage 2 one launch per node and source node). With
    ``device="cpu"`` the same role code runs on threads (``cpu_options``: ``group_warps``,
    ``num_workers``).

    Args:
        num_nodes, ranks_per_node: N, L; W = N * L <= 16.
        hidden, num_topk: the largest rows to move (sizes slots); ``element_bytes``: widest element.
        config: :class:`Config` (``num_slots % chunk_tokens == 0``; ``internode_pipeline``).
        device: a CUDA device, or CPU for the CPU backend.
        timeout_s: bound of every wait (default ``MOE_DISPATCH_KERNEL_TIMEOUT_S`` or 100 s).

    Raises:
        ValueError: shapes out of range (num_topk in [1, 32]), or a device that is neither CUDA
            nor CPU; TypeError: config is no Config; RuntimeError: a CUDA device without a GPU,
            or the extension is not built.
    """

    def __init__(
        self,
        num_nodes: int,
        ranks_per_node: int,
        hidden: int,
        num_topk: int,
        *,
        config: Config | None = None,
        device: torch.device | str = "cuda",
        element_bytes: int = 2,
        timeout_s: float | None = None,
        cpu_options: dict | None = None,
    ):
        for name, value in (("num_nodes", num_nodes), ("ranks_per_node", ranks_per_node)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if num_nodes * ranks_per_node > MAX_LOOPBACK_RANKS:
            raise ValueError(
                f"loopback simulates at most {MAX_LOOPBACK_RANKS} ranks, got {num_nodes} x {ranks_per_node}"
            )
        self.num_nodes, self.ranks_per_node = num_nodes, ranks_per_node
        self.world_size = W = num_nodes * ranks_per_node
        slot_bytes = _slot_bytes(hidden, num_topk, element_bytes, config, min_topk=1)
        self.config = config or Config()
        check_rdma_config(self.config)
        self.device, backend = _loopback_device(device)
        timeout = default_timeout_s(timeout_s)
        C, S = self.config.num_channels, self.config.num_slots
        self.rdma_layout = rdma_layout(num_nodes, ranks_per_node, C, S, slot_bytes)
        self.nvl_layout = buffer_layout(ranks_per_node, C, S, slot_bytes, num_nodes)
        zeros = lambda n: torch.zeros(n, dtype=torch.uint8, device=self.device)  # noqa: E731
        self._rdma_buffers = [zeros(self.rdma_layout.total_bytes) for _ in range(W)]
        self._nvl_buffers = [zeros(self.nvl_layout.total_bytes) for _ in range(W)]  # rank r's: index r
        record = lambda: torch.zeros(ERROR_RECORD_INTS, dtype=torch.int32, device=self.device)  # noqa: E731
        nvl = [b.data_ptr() for b in self._nvl_buffers]
        rdma = _RdmaEngine(
            num_nodes,
            ranks_per_node,
            self.config,
            slot_bytes,
            [b.data_ptr() for b in self._rdma_buffers],
            None,
            nvl,
            0,
            record(),
            None,
            backend,
            "loopback",
            timeout,
            cpu_options,
            records=Records(W, self.device),
        )
        L = ranks_per_node
        nodes = (
            {
                n: _Engine(
                    L,
                    self.config,
                    slot_bytes,
                    nvl[n * L : (n + 1) * L],
                    record(),
                    None,
                    backend,
                    timeout,
                    cpu_options,
                    records=Records(L, self.device),
                    relay_nodes=num_nodes,
                )
                for n in range(num_nodes)
            }
            if self.config.internode_pipeline == "staged"
            else {}
        )
        self.transport = _Transport(num_nodes, ranks_per_node, rdma, nodes)

    @property
    def timeout_s(self) -> float:
        """Bound, in seconds, of every wait inside the launches (settable)."""
        return self.transport.rdma.timeout_s

    @timeout_s.setter
    def timeout_s(self, value: float) -> None:
        self.transport.rdma.set_timeout(value)
        for engine in self.transport.nodes.values():
            engine.set_timeout(value)

    @property
    def buffer_bytes(self) -> tuple[int, int]:
        """(RDMA, NVLink) bytes of each simulated rank's communication buffers."""
        return self.rdma_layout.total_bytes, self.nvl_layout.total_bytes

    def set_variant(self, name: str) -> None:
        """Runs the named kernel variant (:data:`moe_dispatch.config.VARIANTS`) from the next
        operation on, over the same buffers; handles of earlier dispatches stay valid. Raises
        ValueError for an unknown name."""
        self.config = self.transport.rdma.config = self.config.with_variant(name)
        for engine in self.transport.nodes.values():
            engine.config = self.config

    def dispatch(
        self,
        xs: list,
        topk_idxs: list[torch.Tensor] | None,
        topk_weights: list[torch.Tensor] | None,
        num_experts: int,
        *,
        num_sms: int | None = None,
        handles: list | None = None,
        num_worst_tokens: int | None = None,
        dispatch_ids: list[int] | None = None,
        status: dict[int, int] | None = None,
        withhold_rank: int | None = None,
        withhold_phase: str | None = None,
        check: bool = True,
        validate: bool = True,
    ) -> list[InternodeDispatch]:
        """Dispatch for all W ranks.

        Args:
            xs: per rank ``[T_r, H]`` bf16/fp16/fp32, or ``(x_fp8 [T_r, H], scales [T_r, H/128])``.
            topk_idxs: per rank ``[T_r, K]`` int32/int64 global expert ids, -1 = none (None with
                ``handles``: only x travels).
            topk_weights: per rank ``[T_r, K]`` fp32, or None.
            num_experts: E, divisible by W.
            num_sms: SMs per simulated rank (default ``config.num_sms``; the fused pipeline runs
                ``max(1, num_sms // 3)`` channels of three blocks).
            handles: a previous result's handles: a cached dispatch (no notify, same routing).
            num_worst_tokens: budget mode (fused pipeline): this many rows per rank, nothing
                waits for the host, rows past it are dropped and ``handle.overflow`` is set.
            dispatch_ids, status: as :meth:`moe_dispatch.transport.intranode.Loopback.dispatch`.
            withhold_rank, withhold_phase: tests: that rank's blocks skip a launch: fused
                "notify" or "dispatch" (default); staged "node_notify", "node_dispatch"
                (default), "notify" or "dispatch" (stage 2).
            check: raise :class:`InternodeTimeoutError` or
                :class:`~moe_dispatch.transport.header.MismatchError` (synchronises).
            validate: check topk_idx values (a host sync).

        Returns:
            per rank an :class:`InternodeDispatch`; rows by source rank, then source token.
        """
        W = self.world_size
        topk_idxs = _check_world_args(W, xs, topk_idxs, num_experts)
        if handles is not None and len(handles) != W:
            raise ValueError(f"handles must be one handle per rank ({W}), got {len(handles)}")
        if dispatch_ids is not None and len(dispatch_ids) != W:
            raise ValueError(f"pass one dispatch id per rank ({W}), got {len(dispatch_ids)}")
        inputs = _refusing(
            _prepare_world(xs, topk_idxs, topk_weights, num_experts, self.device, validate, handles), status
        )
        return self._guard(
            lambda: _dispatch(
                self.transport,
                inputs,
                num_experts,
                num_sms=num_sms or self.config.num_sms,
                handles=handles,
                num_worst_tokens=num_worst_tokens,
                skip_rank=withhold_rank,
                skip_phase=withhold_phase,
                dispatch_ids=dispatch_ids,
                statuses=status,
                check=check,
            ),
            check,
        )

    def combine(
        self,
        ys: list[torch.Tensor],
        handles: list,
        row_scales: list[torch.Tensor | None] | None = None,
        *,
        status: dict[int, int] | None = None,
        withhold_rank: int | None = None,
        withhold_phase: str | None = None,
        check: bool = True,
    ) -> list[torch.Tensor]:
        """Combine for all W ranks: ``out[s] [T_s, H]`` in y's dtype (see the module doc for the
        summation order); ``withhold_phase``: fused "combine" (default); staged "combine"
        (stage 2) or "node_combine" (default)."""
        return self._guard(
            lambda: _combine(self.transport, 0, ys, handles, row_scales, withhold_rank, withhold_phase, status, check),
            check,
        )

    def check(self) -> None:
        """Synchronises; raises a recorded timeout (resetting the buffers) or mismatch."""
        self._guard(lambda: None, True)

    def _guard(self, fn, check: bool):
        try:
            result = fn()
            if check:
                self.transport.check_timeouts()
        except InternodeTimeoutError:
            self.reset()
            raise
        if check:
            self.transport.check_mismatches()
        return result

    def reset(self) -> None:
        """Zeroes the control regions, error and mismatch records (after a timeout left them dirty)."""
        for b in self._rdma_buffers:
            b[: self.rdma_layout.recv_offset].zero_()
        for b in self._nvl_buffers:
            b[: self.nvl_layout.queue_offset].zero_()
        for engine in (self.transport.rdma, *self.transport.nodes.values()):
            engine.error.zero_()
            engine.records.clear()


def empty_handle(t: _Transport, rank: int) -> InternodeHandle | StagedInternodeHandle:
    """A handle of no tokens and no rows for ``rank`` (a refusing rank's stand-in)."""
    N, L, W, device = t.num_nodes, t.ranks_per_node, t.world_size, t.rdma.device
    C = t.rdma.config.num_channels
    zeros = lambda *shape, dtype=torch.int32: torch.zeros(*shape, dtype=dtype, device=device)  # noqa: E731
    if t.fused:
        return InternodeHandle(
            0,
            C,
            zeros(0, W, dtype=torch.bool),
            zeros(0, N, dtype=torch.bool),
            zeros(W * C + 1),
            zeros(C * N + 1),
            zeros(0),
            zeros(2),
            zeros(1),
            zeros(N + L),
            0,
            0,
            0,
            0,
            0,
        )
    local = [
        IntranodeHandle(
            0, C, zeros(0, L, dtype=torch.bool), zeros(L * C + 1), 0, zeros(1), zeros(1), 0, peer_ok=zeros(L)
        )
        for _ in range(N)
    ]
    return StagedInternodeHandle(
        0,
        C,
        zeros(0, W, dtype=torch.bool),
        zeros(0, N, dtype=torch.bool),
        zeros(N * C + 1),
        zeros(N),
        [0] * (N + 1),
        zeros(0, L, dtype=torch.bool),
        local,
        0,
        0,
        0,
    )


__all__ = [
    "InternodeDispatch",
    "InternodeHandle",
    "InternodeLoopback",
    "InternodeTimeoutError",
    "RdmaLayout",
    "StagedInternodeHandle",
    "cross_node_bytes",
    "describe_timeout",
    "fused_channels",
    "rdma_layout",
]
