"""The internode kernels' engines and what a dispatch returns, below both pipelines' host code
(the fused one in :mod:`.internode`, the staged one in :mod:`.experimental`): the
:class:`RdmaEngine` (the RDMA-side launches of both pipelines), :class:`InternodeEngines` (the
RDMA engine and, for the staged pipeline, per node its intranode engine), the fused pipeline's
:class:`InternodeHandle` and a rank's :class:`InternodeDispatch`. Importable without the
extension (only the engines' construction and launches need it).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from ..._ext import require_extension
from ...config import Config
from ...errors import BudgetOverflowError, InternodeTimeoutError
from .calls import DispatchCall, ptr
from .header import Records
from .intranode import IntranodeEngine
from .launcher import Launcher
from .timeouts import describe_internode_timeout as describe_timeout

if TYPE_CHECKING:  # the staged pipeline is imported only where a Config selects it
    from .experimental import StagedInternodeHandle

__all__ = ["InternodeDispatch", "InternodeEngines", "InternodeHandle", "RdmaEngine", "check_rdma_config"]


def check_rdma_config(config: Config) -> None:
    """Raises ValueError unless ``config.chunk_tokens`` divides ``config.num_slots`` (a chunk is one RDMA put)."""
    if config.num_slots % config.chunk_tokens:
        raise ValueError(
            f"the internode kernels need Config.chunk_tokens to divide Config.num_slots (a chunk is one "
            f"contiguous RDMA put), got chunk_tokens={config.chunk_tokens}, num_slots={config.num_slots}"
        )


class RdmaEngine(Launcher):
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

    slots, fix = "the buffers' slots", "size the transport"

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
        C = require_extension()
        self.layout = C.internode_rdma_layout(
            num_nodes, ranks_per_node, config.num_channels, config.num_slots, slot_bytes
        )
        self.nvl_layout = C.intranode_buffer_layout(
            ranks_per_node, config.num_channels, config.num_slots, slot_bytes, num_nodes
        )
        super().__init__(error, error_host_ptr, backend, timeout_s, cpu_options, records, rank_begin)

    def common(self, num_channels: int, rank_begin: int, skip_rank: int | None):
        """The launch's ``_C.InternodeCommon``."""
        return self._common(
            "InternodeCommon",
            num_channels,
            rank_begin,
            skip_rank,
            num_nodes=self.num_nodes,
            ranks_per_node=self.ranks_per_node,
            layout=self.layout,
            symmetric=self.symmetric,
            nvl_buffers=self.nvl_buffers,
            nvl_first_rank=self.nvl_first_rank,
            nvl_layout=self.nvl_layout,
        )

    def _backend_args(self) -> tuple:
        return (self.backend, self.mode)

    def notify(self, pipeline: str, common, ranks: list, *args) -> None:
        """Launches pipeline ``"node"`` (staged stage 1, ``ranks``: ``_C.NotifyRank``) or ``"fused"``
        (``ranks``: ``_C.FusedNotifyRank``, ``args``: num_topk)'s notify."""
        self._run(f"internode_{pipeline}_notify", common, ranks, *args, cpu_options=False)

    def dispatch(self, pipeline: str, common, ranks: list, call: DispatchCall, num_experts: int) -> None:
        """Launches pipeline ``"node"``'s dispatch of ``call`` (``ranks``: ``_C.DispatchRank``,
        ``num_experts``: experts per node) or ``"fused"``'s (``_C.FusedDispatchRank``, experts per
        rank)."""
        shape = self.dispatch_shape(call.inputs)
        self._run(f"internode_{pipeline}_dispatch", common, ranks, *shape.launch_args, num_experts)

    def combine(self, pipeline: str, common, ranks: list, y_bytes: int, dtype: torch.dtype) -> None:
        """Launches pipeline ``"node"``'s combine (``ranks``: ``_C.CombineRank``) or ``"fused"``'s
        (``_C.FusedCombineRank``)."""
        self._run_combine(f"internode_{pipeline}_combine", common, ranks, y_bytes, dtype)


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
        relay_prefix: ``[L * (N * C + 1)]`` int32: per local rank d, the rows this rank forwards to
            d before each (source node, channel), d's total last.
        forward_mask: ``[forward_capacity]`` int32, written by the dispatch, read by combine and
            cached dispatches: per forwarded row the local ranks holding it (bit l); in budget
            mode with R1 above ``forward_capacity``, per local rank d instead the stage-1 ring
            indices of the ``num_rows`` rows that travel between d and this rank
            (``csrc/kernels/internode.cuh``, "budget").
        forward_cut: ``[L * C * N]`` int32: per (local rank, channel, source node) the first
            stage-1 ring index whose row does not travel (budget mode; INT32_MAX: all do).
        counts: ``[2]`` int32: R (rows received) and R1 (rows forwarded).
        overflow: ``[1]`` int32: 1 when R exceeded ``num_rows`` (budget mode).
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
    relay_prefix: torch.Tensor
    forward_mask: torch.Tensor
    forward_cut: torch.Tensor
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

    @property
    def budget(self) -> int:
        """The static receive size of a budget-mode dispatch (``num_worst_tokens``), else -1."""
        return self.num_rows if self.num_recv_tokens is None else -1

    def routing_fields(self) -> dict:
        """The fused dispatch and combine rank structs' fields this handle's routing fills (its
        device tensors' addresses, the forward record's capacity, the budget)."""
        return dict(
            is_token_in_node=ptr(self.is_token_in_node),
            recv_prefix=self.recv_prefix.data_ptr(),
            forward_prefix=self.forward_prefix.data_ptr(),
            relay_prefix=self.relay_prefix.data_ptr(),
            forward_mask=ptr(self.forward_mask),
            forward_cut=self.forward_cut.data_ptr(),
            forward_capacity=self.forward_capacity,
            budget=self.budget,
        )

    def check_overflow(self) -> None:
        """Raises :class:`~moe_dispatch.errors.BudgetOverflowError` when the budget was too small
        (reads the device: a host sync)."""
        if int(self.overflow.item()):
            raise BudgetOverflowError(
                f"dispatch received {int(self.counts[0])} rows but num_worst_tokens allowed {self.num_rows}: "
                "rows past the budget were dropped; raise num_worst_tokens"
            )


@dataclasses.dataclass(eq=False)
class InternodeDispatch:
    """One rank's dispatch outputs (rows ``[R or budget, ...]``, by source rank then source token)."""

    recv_x: torch.Tensor | tuple[torch.Tensor, torch.Tensor]
    recv_topk_idx: torch.Tensor | None
    recv_topk_weights: torch.Tensor | None
    recv_src_idx: torch.Tensor
    num_recv_tokens_per_expert: torch.Tensor
    handle: InternodeHandle | StagedInternodeHandle


class InternodeEngines:
    """The engines one launch uses: the RDMA engine (the fused pipeline's only one) and, for the
    staged pipeline, per node with launched ranks its intranode engine."""

    def __init__(self, num_nodes: int, ranks_per_node: int, rdma: RdmaEngine, nodes: dict[int, IntranodeEngine]):
        self.num_nodes, self.ranks_per_node, self.rdma, self.nodes = num_nodes, ranks_per_node, rdma, nodes

    @property
    def world_size(self) -> int:
        """W = N x L."""
        return self.num_nodes * self.ranks_per_node

    @property
    def device(self) -> torch.device:
        """Where the launches run (the RDMA engine's device)."""
        return self.rdma.device

    @property
    def fused(self) -> bool:
        """Whether the launches run the fused pipeline (Config.internode_pipeline)."""
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
        """Raises :class:`~moe_dispatch.transport.kernels.header.MismatchError` for the first set record."""
        self.rdma.records.raise_if_set(synchronize)
        for node, engine in self.nodes.items():
            engine.records.raise_if_set(synchronize, rank_offset=node * self.ranks_per_node)

    def check(self) -> None:
        """Raises a recorded timeout, then a recorded mismatch (a host sync)."""
        self.check_timeouts()
        self.check_mismatches()
