"""The CUDA internode (hierarchical) transport: stage 1 over RDMA, stage 2 over NVLink.

Importable without the extension. Protocol: ``csrc/kernels/internode.cuh`` (design in prose,
RDMA buffer layout) and ``internode_roles.cuh`` (stage-1 per-warp code, shared by the GPU
kernels and the CPU backend); stage 2 is the intranode machinery of
:mod:`moe_dispatch.transport.intranode`, unchanged.

A world of W = N nodes x L ranks (rank r = node r // L, local r % L). For rank r:

- **dispatch**: layout (``is_token_in_rank [T, W]``, ``is_token_in_node [T, N]``); node notify
  (per-(source node, channel) counts along the rail of r's local index; one host sync reads the
  stage-1 receive counts); node dispatch (each token once to each node holding it, to the
  forwarder of the same local index; rows ``[R1]`` by (source node, source token), top-k ids
  node-local); then, inside each node, one intranode operation per source node m whose tokens
  are the forwarder's rows from m (a second host sync reads the final counts). Rows come out
  ordered by (source rank, source token), as ``moe_dispatch.reference.dispatch``.
- **combine**: the intranode combines (per m) pre-reduce each forwarded row on its forwarder
  (holders in ascending local rank, fp32, rounded once to y's dtype: the node partial); the
  node combine returns each partial once over RDMA and the source sums them in ascending node
  order (fp32, rounded once): ``moe_dispatch.reference.combine`` bit for bit.

Every wait is bounded by ``timeout_s``; a timed-out launch raises
:class:`InternodeTimeoutError` naming the rank, node, channel, the rank waited for and the
counter. Front ends: :class:`InternodeLoopback` (N x L simulated ranks on one device, or on
CPU threads with ``device="cpu"``); the NVSHMEM mode of the same engine runs one rank per
process (``moe_dispatch.transport.nvshmem``).
"""

from __future__ import annotations

import dataclasses

import torch

from ..config import ERROR_RECORD_INTS, Config, buffer_layout
from ..errors import CommError
from .intranode import (
    COMBINE_DTYPES,
    _alloc_outputs,
    _check_combine,
    _check_num_sms,
    _check_world_args,
    _dispatch_shape,
    _Engine,
    _ext,
    _Launcher,
    _loopback_device,
    _prepare_world,
    _ptr,
    _rank_results,
    _slot_bytes,
    default_timeout_s,
)

MAX_LOOPBACK_RANKS = 16  # internode_limits["max_launch_ranks"]
MAX_NODES = 64
LINE = 128

_PHASES = {1: "intranode notify", 2: "intranode dispatch", 3: "intranode combine", 4: "node notify",
           5: "node dispatch", 6: "node combine"}
_ROLES = {1: "barrier", 2: "sender", 3: "receiver", 4: "coordinator"}
_COUNTERS = {1: "signal", 2: "tail", 3: "head"}


class InternodeTimeoutError(CommError):
    """A wait inside an internode kernel ran past ``timeout_s``.

    Attributes: ``stage`` (1 = RDMA, 2 = NVLink), ``phase``, ``role``, ``rank`` / ``node`` (the
    waiting rank, global), ``channel`` (-1 for notify), ``peer`` / ``peer_node`` (the rank whose
    store never came), ``counter`` ("signal"/"tail"/"head"), ``expected``, ``observed``.
    """

    def __init__(self, message: str, fields: dict):
        super().__init__(message)
        self.__dict__.update(fields)


def describe_timeout(record: list[int], timeout_s: float, ranks_per_node: int,
                     node: int | None = None) -> tuple[str, dict]:
    """Message and fields of an error record (``int32[16]``). ``node``: the node whose intranode
    engine wrote it (stage 2: its ranks and peers are local), None for the RDMA engine."""
    _, phase, role, rank, channel, peer, counter, expected, observed = record[:9]
    if phase == 0:
        message = (f"moe_dispatch internode operation timed out after timeout_s={timeout_s:g}, but the kernel's "
                   f"record of which wait it was is missing; the buffers are in an undefined state: reset() them")
        return message, dict.fromkeys(("stage", "phase", "role", "rank", "node", "channel", "peer", "peer_node",
                                       "counter", "expected", "observed"))
    if node is not None:  # an intranode engine: local ranks -> global
        rank, peer = node * ranks_per_node + rank, node * ranks_per_node + peer
    fields = {"stage": 2 if node is not None else 1, "phase": _PHASES.get(phase, str(phase)),
              "role": _ROLES.get(role, str(role)), "rank": rank, "node": rank // ranks_per_node, "channel": channel,
              "peer": peer, "peer_node": peer // ranks_per_node, "counter": _COUNTERS.get(counter, str(counter)),
              "expected": expected, "observed": observed}
    me = f"rank {rank} (node {rank // ranks_per_node}, local {rank % ranks_per_node})"
    them = f"rank {peer} (node {peer // ranks_per_node}, local {peer % ranks_per_node})"
    link = "RDMA" if node is None else "NVLink"
    if fields["counter"] == "signal":
        what = f"waited at the {fields['phase']} for {them} to arrive; saw {observed}, needed {expected}"
    elif fields["counter"] == "tail":
        what = (f"{fields['role']} of channel {channel} waited for tokens from {them}: the tail of {link} queue "
                f"{them} -> rank {rank}, channel {channel}, should reach {expected} but stayed at {observed}")
    else:
        what = (f"{fields['role']} of channel {channel} waited for {them} to free slots: the head of {link} queue "
                f"rank {rank} -> {them}, channel {channel}, should reach {expected} but stayed at {observed}")
    message = (f"moe_dispatch internode {fields['phase']} (stage {fields['stage']}, {link}) timed out after "
               f"timeout_s={timeout_s:g}: {me} {what}. Rank {peer} did not take part (crashed, hung, or called another "
               f"operation). The communication buffers are now in an undefined state: reset() them (loopback) or "
               f"recreate the Buffer.")
    return message, fields


# ---------------------------------------------------------------------------------------------
# RDMA buffer layout (mirror of make_rdma_layout in internode.cuh; a CPU test checks it)
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class RdmaLayout:
    """Byte offsets of one rank's RDMA buffer (drawn in internode.cuh)."""

    num_nodes: int
    num_channels: int
    num_slots: int
    slot_bytes: int
    arrive_offset: int
    meta_offset: int
    meta_out_offset: int
    tail_offset: int
    head_offset: int
    recv_offset: int
    send_offset: int
    total_bytes: int


def rdma_layout(num_nodes: int, num_channels: int, num_slots: int, slot_bytes: int) -> RdmaLayout:
    align = lambda v: -(-v // LINE) * LINE  # noqa: E731
    queues = num_nodes * num_channels
    ring = queues * num_slots * slot_bytes
    arrive = LINE
    meta = arrive + align(16 * num_nodes)
    meta_out = meta + align(8 * queues)
    tail = meta_out + align(8 * queues)
    head = tail + LINE * queues
    recv = head + LINE * queues
    return RdmaLayout(num_nodes, num_channels, num_slots, slot_bytes, arrive, meta, meta_out, tail, head, recv,
                      recv + ring, recv + 2 * ring)


def check_rdma_config(config: Config) -> None:
    if config.num_slots % config.chunk_tokens:
        raise ValueError(f"the internode kernels need Config.chunk_tokens to divide Config.num_slots (a chunk is one "
                         f"contiguous RDMA put), got chunk_tokens={config.chunk_tokens}, num_slots={config.num_slots}")


class _RdmaEngine(_Launcher):
    """Launches the stage-1 kernels for a list of ranks over their RDMA buffers.

    Args:
        num_nodes, ranks_per_node: N, L.
        config: channels, ring depth, chunk (``num_slots % chunk_tokens == 0``).
        slot_bytes: capacity of an RDMA slot.
        buffers: loopback / CPU: every rank's buffer address (global rank order); else [].
        symmetric: NVSHMEM mode: this PE's symmetric buffer address; else None.
        error: ``int32[16]`` record on the launch device (zeroed); ``error_host_ptr``: a mirror.
        backend: "cuda" or "cpu"; mode: "loopback" or "nvshmem".
    """

    def __init__(self, num_nodes: int, ranks_per_node: int, config: Config, slot_bytes: int, buffers: list[int],
                 symmetric: int | None, error: torch.Tensor, error_host_ptr: int | None, backend: str, mode: str,
                 timeout_s: float, cpu_options: dict | None = None):
        check_rdma_config(config)
        self.num_nodes, self.ranks_per_node = num_nodes, ranks_per_node
        self.config, self.slot_bytes, self.buffers, self.symmetric = config, slot_bytes, buffers, symmetric
        self.mode = mode
        self.layout = rdma_layout(num_nodes, config.num_channels, config.num_slots, slot_bytes)
        super().__init__(error, error_host_ptr, backend, timeout_s, cpu_options)

    def common(self, num_channels: int, rank_begin: int, skip_rank: int | None) -> dict:
        return {"num_nodes": self.num_nodes, "ranks_per_node": self.ranks_per_node, "symmetric": self.symmetric,
                **self._common(self.config, self.slot_bytes, self.buffers, num_channels, rank_begin, skip_rank)}

    def notify(self, common: dict, ranks: list[dict]) -> None:
        _ext().internode_node_notify(common, ranks, self.backend, self.mode, self._stream(), self.cooperative)

    def dispatch(self, common: dict, ranks: list[dict], x_bytes: int, scale_bytes: int, num_topk: int,
                 experts_per_node: int) -> None:
        _ext().internode_node_dispatch(common, ranks, x_bytes, scale_bytes, num_topk, experts_per_node, self.backend,
                                       self.mode, self._stream(), self.cooperative, self.cpu_options)

    def combine(self, common: dict, ranks: list[dict], y_bytes: int, dtype: torch.dtype) -> None:
        _ext().internode_node_combine(common, ranks, y_bytes, COMBINE_DTYPES[dtype], self.backend, self.mode,
                                      self._stream(), self.cooperative, self.cpu_options)


# ---------------------------------------------------------------------------------------------
# The operations, for the ranks of one launch (loopback: all W; one process per GPU: one)
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(eq=False)
class InternodeHandle:
    """One rank's share of an internode dispatch: what combine and a cached dispatch replay.

    Attributes:
        num_tokens: T, tokens this rank sent; ``num_channels``: C of the dispatch.
        is_token_in_rank: ``[T, W]`` bool; ``is_token_in_node``: ``[T, N]`` bool.
        node_prefix: ``[N * C + 1]`` int32: first stage-1 receive row of each (source node, channel).
        segments: N + 1 host ints: this rank's stage-1 rows from source node m are
            ``[segments[m], segments[m + 1])`` (it forwards them inside its node).
        forward_in_rank: ``[R1, L]`` bool: which local ranks hold each forwarded row.
        local_prefix: per source node m, ``[L * C + 1]`` int32: the stage-2 receive prefix of op m.
        local_rows: per m, rows received in op m (host ints); rows of op m start at ``sum(local_rows[:m])``.
        num_rows: R, rows received in all.
        topk_dtype: the caller's top-k id dtype.
    """

    num_tokens: int
    num_channels: int
    is_token_in_rank: torch.Tensor
    is_token_in_node: torch.Tensor
    node_prefix: torch.Tensor
    segments: list[int]
    forward_in_rank: torch.Tensor
    local_prefix: list[torch.Tensor]
    local_rows: list[int]
    num_rows: int
    topk_dtype: torch.dtype = torch.int64

    @property
    def num_forward_rows(self) -> int:
        """R1: rows this rank received in stage 1 (and forwards)."""
        return self.segments[-1]

    def row_base(self, node: int) -> int:
        """First receive row of stage-2 op ``node`` (rows from source node ``node``)."""
        return sum(self.local_rows[:node])


@dataclasses.dataclass(eq=False)
class InternodeDispatch:
    """One rank's dispatch outputs (rows ``[R, ...]``, by source rank then source token)."""

    recv_x: torch.Tensor | tuple[torch.Tensor, torch.Tensor]
    recv_topk_idx: torch.Tensor | None
    recv_topk_weights: torch.Tensor | None
    recv_src_idx: torch.Tensor
    num_recv_tokens_per_expert: torch.Tensor
    handle: InternodeHandle


class _Transport:
    """The engines one launch uses: the RDMA engine and, per node with launched ranks, its
    intranode engine with the first launched local rank."""

    def __init__(self, num_nodes: int, ranks_per_node: int, rdma: _RdmaEngine, nodes: dict[int, _Engine]):
        self.num_nodes, self.ranks_per_node, self.rdma, self.nodes = num_nodes, ranks_per_node, rdma, nodes

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.ranks_per_node

    def check(self) -> None:
        """Raises :class:`InternodeTimeoutError` for the first engine whose record is set (a host sync)."""
        L = self.ranks_per_node
        record = self.rdma.read_error()
        if record:
            raise InternodeTimeoutError(*describe_timeout(record, self.rdma.timeout_s, L))
        for node, engine in self.nodes.items():
            record = engine.read_error()
            if record:
                raise InternodeTimeoutError(*describe_timeout(record, engine.timeout_s, L, node=node))


def _node_launches(t: _Transport, ranks: list[int], num_channels: int, skip_rank: int | None):
    """Per node with launched ranks (consecutive, global ``ranks``): its intranode engine, the
    launch fields for its first launched local rank (``skip_rank`` withheld when on this node)
    and the indices into ``ranks`` of its members."""
    L = t.ranks_per_node
    groups: dict[int, list[int]] = {}
    for i, r in enumerate(ranks):
        groups.setdefault(r // L, []).append(i)
    for node, members in groups.items():
        engine = t.nodes[node]
        local_skip = skip_rank - node * L if skip_rank is not None and skip_rank // L == node else None
        yield engine, engine.common(num_channels, ranks[members[0]] % L, local_skip), members


def _dispatch(t: _Transport, inputs: list, num_experts: int, *, num_sms: int, handles: list[InternodeHandle] | None,
              skip_rank: int | None, skip_phase: str | None, check: bool) -> list[InternodeDispatch]:
    """Dispatch for ranks ``inputs[i].rank`` (consecutive): stage 1 in one launch per step, stage
    2 one intranode launch per (node, source node)."""
    N, L, device = t.num_nodes, t.ranks_per_node, t.rdma.device
    _, num_topk, x_bytes, scale_bytes = _dispatch_shape(inputs, t.rdma.slot_bytes, slots="the buffers' slots",
                                                        fix="size the transport")
    experts_per_node, experts_per_rank = num_experts // N, num_experts // t.world_size
    ranks = [inp.rank for inp in inputs]
    skip = lambda phase: skip_rank if skip_phase == phase else None  # noqa: E731
    fresh = handles is None
    C = _check_num_sms(num_sms, t.rdma.config) if fresh else handles[0].num_channels
    scratch = lambda: torch.zeros(1, dtype=torch.int32, device=device)  # noqa: E731

    # Stage 1: node notify (fresh only) and node dispatch into the forwarders' staging rows.
    if fresh:
        in_node = [inp.is_token_in_rank.view(-1, N, L).any(2).contiguous() for inp in inputs]
        node_prefix = [torch.zeros(N * C + 1, dtype=torch.int32, device=device) for _ in inputs]
        counts = [scratch() for _ in inputs]
        flags = [scratch() for _ in inputs]  # notify's overflow output (no budget here: stays 0)
        t.rdma.notify(t.rdma.common(C, ranks[0], skip("node_notify")),
                      [{"is_token_in_rank": _ptr(itn), "recv_prefix": p.data_ptr(), "num_recv_tokens": n.data_ptr(),
                        "overflow": f.data_ptr(), "recv_topk_idx": None, "recv_topk_weights": None,
                        "recv_src_idx": None, "num_tokens": inp.x.shape[0], "budget": -1}
                       for inp, itn, p, n, f in zip(inputs, in_node, node_prefix, counts, flags)])
        prefixes_host = torch.stack(node_prefix).tolist()  # one host sync for all launched ranks
        if check:
            t.check()
        segments = [[p[m * C] for m in range(N + 1)] for p in prefixes_host]
    else:
        in_node = [h.is_token_in_node for h in handles]
        node_prefix = [h.node_prefix for h in handles]
        segments = [h.segments for h in handles]
    staged = [_alloc_outputs(inp, seg[-1], experts_per_node, device) for inp, seg in zip(inputs, segments)]
    overflow = [scratch() for _ in inputs]
    t.rdma.dispatch(t.rdma.common(C, ranks[0], skip("node_dispatch")),
                    [{"x": _ptr(inp.x), "x_scales": _ptr(inp.scales), "topk_idx": _ptr(inp.topk_idx),
                      "topk_weights": _ptr(inp.topk_weights), "is_token_in_rank": _ptr(itn),
                      "recv_prefix": p.data_ptr(), "recv_x": _ptr(s["x"]), "recv_scales": _ptr(s["scales"]),
                      "recv_topk_idx": _ptr(s["topk_idx"]),
                      "recv_topk_weights": _ptr(s["topk_weights"]) if inp.topk_weights is not None else None,
                      "recv_src_idx": _ptr(s["src_idx"]), "num_recv_per_expert": s["per_expert"].data_ptr(),
                      "overflow": o.data_ptr(), "num_tokens": inp.x.shape[0], "num_rows": seg[-1]}
                     for inp, itn, p, s, o, seg in zip(inputs, in_node, node_prefix, staged, overflow, segments)],
                    x_bytes, scale_bytes, num_topk, experts_per_node)
    if check and t.rdma.backend == "cpu":
        t.check()

    # Stage 2: per node, one intranode operation per source node m over the forwarded rows.
    if fresh:
        from ..ops.layout import get_dispatch_layout

        forward_in_rank = [get_dispatch_layout(s["topk_idx"], experts_per_node, L, L, validate=False)[3].contiguous()
                           for s in staged]
        local_prefix = [[torch.zeros(L * C + 1, dtype=torch.int32, device=device) for _ in range(N)] for _ in inputs]
        local_counts = [[scratch() for _ in range(N)] for _ in inputs]
        for engine, common, members in _node_launches(t, ranks, C, skip("notify")):
            for m in range(N):
                engine.notify(common,
                              [{"is_token_in_rank": _ptr(forward_in_rank[i][segments[i][m]:segments[i][m + 1]]),
                                "recv_prefix": local_prefix[i][m].data_ptr(),
                                "num_recv_tokens": local_counts[i][m].data_ptr(), "overflow": overflow[i].data_ptr(),
                                "recv_topk_idx": None, "recv_topk_weights": None, "recv_src_idx": None,
                                "num_tokens": segments[i][m + 1] - segments[i][m], "budget": -1} for i in members],
                              num_topk)
        local_rows = torch.cat([c for row in local_counts for c in row]).view(len(inputs), N).tolist()  # host sync
        if check:
            t.check()
        handles = [InternodeHandle(num_tokens=inp.x.shape[0], num_channels=C, is_token_in_rank=inp.is_token_in_rank,
                                   is_token_in_node=itn, node_prefix=p, segments=seg, forward_in_rank=fir,
                                   local_prefix=lp, local_rows=lr, num_rows=sum(lr),
                                   topk_dtype=inp.topk_dtype or torch.int64)
                   for inp, itn, p, seg, fir, lp, lr in zip(inputs, in_node, node_prefix, segments, forward_in_rank,
                                                            local_prefix, local_rows)]
    outs = [_alloc_outputs(inp, h.num_rows, experts_per_rank, device) for inp, h in zip(inputs, handles)]
    for engine, common, members in _node_launches(t, ranks, C, skip("dispatch")):
        for m in range(N):
            launch = []
            for i in members:
                h, s, o = handles[i], staged[i], outs[i]
                seg = slice(h.segments[m], h.segments[m + 1])
                rows = slice(h.row_base(m), h.row_base(m) + h.local_rows[m])
                launch.append({
                    "x": _ptr(s["x"][seg]), "x_scales": _ptr(s["scales"][seg]) if s["scales"] is not None else None,
                    "topk_idx": _ptr(s["topk_idx"][seg]),
                    "topk_weights": _ptr(s["topk_weights"][seg]) if inputs[i].topk_weights is not None else None,
                    "is_token_in_rank": _ptr(h.forward_in_rank[seg]), "token_ids": _ptr(s["src_idx"][seg]),
                    "recv_prefix": h.local_prefix[m].data_ptr(), "recv_x": _ptr(o["x"][rows]),
                    "recv_scales": _ptr(o["scales"][rows]) if o["scales"] is not None else None,
                    "recv_topk_idx": _ptr(o["topk_idx"][rows]),
                    "recv_topk_weights": _ptr(o["topk_weights"][rows]) if inputs[i].topk_weights is not None else None,
                    "recv_src_idx": _ptr(o["src_idx"][rows]), "num_recv_per_expert": o["per_expert"].data_ptr(),
                    "overflow": overflow[i].data_ptr(), "num_tokens": seg.stop - seg.start,
                    "num_rows": h.local_rows[m]})
            engine.dispatch(common, launch, x_bytes, scale_bytes, num_topk, experts_per_rank)
    return _rank_results(InternodeDispatch, inputs, handles, outs)


def _combine(t: _Transport, rank_begin: int, ys: list[torch.Tensor], handles: list[InternodeHandle],
             row_scales: list[torch.Tensor | None] | None, skip_rank: int | None, skip_phase: str | None,
             check: bool) -> list[torch.Tensor]:
    N, device = t.num_nodes, t.rdma.device
    row_scales = row_scales or [None] * len(ys)
    hidden, dtype, y_bytes = _check_combine(ys, handles, row_scales, rank_begin, device, t.rdma.slot_bytes,
                                            slots="the buffers' slots")
    C = handles[0].num_channels
    ranks = list(range(rank_begin, rank_begin + len(ys)))
    skip = lambda phase: skip_rank if skip_phase == phase else None  # noqa: E731
    # Stage 2 backwards: node partials [R1, H] on every forwarder, one intranode combine per m.
    partials = [torch.empty(h.num_forward_rows, hidden, dtype=dtype, device=device) for h in handles]
    for engine, common, members in _node_launches(t, ranks, C, skip("combine")):
        for m in range(N):
            launch = []
            for i in members:
                h = handles[i]
                seg = slice(h.segments[m], h.segments[m + 1])
                rows = slice(h.row_base(m), h.row_base(m) + h.local_rows[m])
                scale = row_scales[i]
                launch.append({"y": _ptr(ys[i][rows]), "row_scale": _ptr(scale[rows].contiguous()) if scale is not None
                               else None, "is_token_in_rank": _ptr(h.forward_in_rank[seg]),
                               "recv_prefix": h.local_prefix[m].data_ptr(), "out": _ptr(partials[i][seg]),
                               "num_tokens": seg.stop - seg.start, "num_rows": h.local_rows[m]})
            engine.combine(common, launch, y_bytes, dtype)
    if check and t.rdma.backend == "cpu":
        t.check()
    # Stage 1 backwards: each partial once to its source, summed there by ascending node.
    outs = [torch.empty(h.num_tokens, hidden, dtype=dtype, device=device) for h in handles]
    t.rdma.combine(t.rdma.common(C, rank_begin, skip("node_combine")),
                   [{"y": _ptr(p), "row_scale": None, "is_token_in_rank": _ptr(h.is_token_in_node),
                     "recv_prefix": h.node_prefix.data_ptr(), "out": _ptr(o), "num_tokens": h.num_tokens,
                     "num_rows": h.num_forward_rows} for p, h, o in zip(partials, handles, outs)],
                   y_bytes, dtype)
    return outs


def cross_node_bytes(handles: list[InternodeHandle], ranks_per_node: int, row_bytes: int,
                     rank_begin: int = 0) -> int:
    """Payload bytes that crossed a node boundary in stage 1 of a dispatch: rows a rank received
    from other nodes x ``row_bytes`` (the de-duplicated lower bound when each (token, node)
    pair crossed once)."""
    total = 0
    for i, h in enumerate(handles):
        node = (rank_begin + i) // ranks_per_node
        total += (h.segments[-1] - (h.segments[node + 1] - h.segments[node])) * row_bytes
    return total


# ---------------------------------------------------------------------------------------------
# Loopback: N x L simulated ranks on one device
# ---------------------------------------------------------------------------------------------

class InternodeLoopback:
    """N nodes x L ranks simulated on one device: the internode kernels with every RDMA put
    replaced by a store into the peer's buffer (same device), stage 2 the intranode kernels.

    On a GPU one launch per step serves all W = N * L ranks (stage 2: one launch per node and
    source node). With ``device="cpu"`` the same role code runs on threads (``cpu_options``:
    ``group_warps``, ``num_workers``).

    Args:
        num_nodes, ranks_per_node: N, L; W = N * L <= 16.
        hidden, num_topk: the largest rows to move (sizes slots); ``element_bytes``: widest element.
        config: :class:`Config` (``num_slots % chunk_tokens == 0``), shared by both stages.
        device: a CUDA device, or CPU for the CPU backend.
        timeout_s: bound of every wait (default ``MOE_DISPATCH_KERNEL_TIMEOUT_S`` or 100 s).

    Raises:
        ValueError: shapes out of range (num_topk in [1, 32]), or a device that is neither CUDA
            nor CPU; TypeError: config is no Config; RuntimeError: a CUDA device without a GPU,
            or the extension is not built.
    """

    def __init__(self, num_nodes: int, ranks_per_node: int, hidden: int, num_topk: int, *,
                 config: Config | None = None, device: torch.device | str = "cuda", element_bytes: int = 2,
                 timeout_s: float | None = None, cpu_options: dict | None = None):
        for name, value in (("num_nodes", num_nodes), ("ranks_per_node", ranks_per_node)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if num_nodes * ranks_per_node > MAX_LOOPBACK_RANKS:
            raise ValueError(f"loopback simulates at most {MAX_LOOPBACK_RANKS} ranks, got {num_nodes} x "
                             f"{ranks_per_node}")
        self.num_nodes, self.ranks_per_node = num_nodes, ranks_per_node
        self.world_size = num_nodes * ranks_per_node
        slot_bytes = _slot_bytes(hidden, num_topk, element_bytes, config, min_topk=1)
        self.config = config or Config()
        check_rdma_config(self.config)
        self.device, backend = _loopback_device(device)
        timeout = default_timeout_s(timeout_s)
        self.rdma_layout = rdma_layout(num_nodes, self.config.num_channels, self.config.num_slots, slot_bytes)
        self.nvl_layout = buffer_layout(ranks_per_node, self.config.num_channels, self.config.num_slots, slot_bytes)
        zeros = lambda n: torch.zeros(n, dtype=torch.uint8, device=self.device)  # noqa: E731
        self._rdma_buffers = [zeros(self.rdma_layout.total_bytes) for _ in range(self.world_size)]
        self._nvl_buffers = [[zeros(self.nvl_layout.total_bytes) for _ in range(ranks_per_node)]
                             for _ in range(num_nodes)]
        record = lambda: torch.zeros(ERROR_RECORD_INTS, dtype=torch.int32, device=self.device)  # noqa: E731
        rdma = _RdmaEngine(num_nodes, ranks_per_node, self.config, slot_bytes,
                           [b.data_ptr() for b in self._rdma_buffers], None, record(), None, backend, "loopback",
                           timeout, cpu_options)
        nodes = {n: _Engine(ranks_per_node, self.config, slot_bytes, [b.data_ptr() for b in self._nvl_buffers[n]],
                            record(), None, backend, timeout, cpu_options) for n in range(num_nodes)}
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

    def dispatch(self, xs: list, topk_idxs: list[torch.Tensor] | None, topk_weights: list[torch.Tensor] | None,
                 num_experts: int, *, num_sms: int | None = None, handles: list[InternodeHandle] | None = None,
                 withhold_rank: int | None = None, withhold_phase: str = "node_dispatch", check: bool = True,
                 validate: bool = True) -> list[InternodeDispatch]:
        """Dispatch for all W ranks.

        Args:
            xs: per rank ``[T_r, H]`` bf16/fp16/fp32, or ``(x_fp8 [T_r, H], scales [T_r, H/128])``.
            topk_idxs: per rank ``[T_r, K]`` int32/int64 global expert ids, -1 = none (None with
                ``handles``: only x travels).
            topk_weights: per rank ``[T_r, K]`` fp32, or None.
            num_experts: E, divisible by W.
            num_sms: SMs per simulated rank and stage (default ``config.num_sms``).
            handles: a previous result's handles: a cached dispatch (no notify, same routing).
            withhold_rank, withhold_phase: tests: that rank's blocks skip "node_notify",
                "node_dispatch" (stage 1), "notify" or "dispatch" (stage 2).
            check: raise :class:`InternodeTimeoutError` if a wait timed out (synchronises).
            validate: check topk_idx values (a host sync).

        Returns:
            per rank an :class:`InternodeDispatch`; rows by source rank, then source token.
        """
        W = self.world_size
        topk_idxs = _check_world_args(W, xs, topk_idxs, num_experts)
        if handles is not None and (len(handles) != W or not all(isinstance(h, InternodeHandle) for h in handles)):
            raise ValueError(f"handles must be one InternodeHandle per rank ({W})")
        inputs = _prepare_world(xs, topk_idxs, topk_weights, num_experts, self.device, validate, handles)
        return self._guard(lambda: _dispatch(self.transport, inputs, num_experts,
                                             num_sms=num_sms or self.config.num_sms, handles=handles,
                                             skip_rank=withhold_rank, skip_phase=withhold_phase, check=check), check)

    def combine(self, ys: list[torch.Tensor], handles: list[InternodeHandle],
                row_scales: list[torch.Tensor | None] | None = None, *, withhold_rank: int | None = None,
                withhold_phase: str = "node_combine", check: bool = True) -> list[torch.Tensor]:
        """Combine for all W ranks: ``out[s] [T_s, H]`` in y's dtype (see the module doc for the
        summation order); ``withhold_phase``: "combine" (stage 2) or "node_combine" (stage 1)."""
        return self._guard(lambda: _combine(self.transport, 0, ys, handles, row_scales, withhold_rank,
                                            withhold_phase, check), check)

    def _guard(self, fn, check: bool):
        try:
            result = fn()
            if check:
                self.transport.check()
        except InternodeTimeoutError:
            self.reset()
            raise
        return result

    def reset(self) -> None:
        """Zeroes the control regions and error records (after a timeout left them dirty)."""
        for b in self._rdma_buffers:
            b[:self.rdma_layout.recv_offset].zero_()
        for node in self._nvl_buffers:
            for b in node:
                b[:self.nvl_layout.queue_offset].zero_()
        self.transport.rdma.error.zero_()
        for engine in self.transport.nodes.values():
            engine.error.zero_()


__all__ = ["InternodeDispatch", "InternodeHandle", "InternodeLoopback", "InternodeTimeoutError", "RdmaLayout",
           "cross_node_bytes", "describe_timeout", "rdma_layout"]
