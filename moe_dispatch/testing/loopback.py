"""Loopback harnesses of the kernels: every simulated rank of a world in one process, each
operation one launch serving all of them.

- :class:`Loopback`: W ranks of one node (the intranode kernels, :mod:`moe_dispatch.transport.kernels.intranode`).
- :class:`InternodeLoopback`: N nodes x L ranks (the hierarchical kernels,
  :mod:`moe_dispatch.transport.kernels.internode`), every RDMA put a store into the peer's buffer.

On a GPU the "peer" buffers are allocations of that one GPU, so one device checks correctness and
kernel efficiency of the whole protocol; with ``device="cpu"`` the same role code runs on threads
(the kernels' CPU backend). Tests and benchmarks use them; one rank per process is
:mod:`moe_dispatch.testing.ranks`.
"""

from __future__ import annotations

import dataclasses

import torch

from .._ext import require_extension
from ..config import Config
from ..errors import InternodeTimeoutError, IntranodeTimeoutError
from ..kernel_layout import ERROR_RECORD_INTS, MAX_LAUNCH_RANKS, MAX_RANKS
from ..transport.kernels.header import Records
from ..transport.kernels.internode import InternodeDispatch, InternodeEngines, RdmaEngine, check_rdma_config
from ..transport.kernels.internode import run_combine as run_internode_combine
from ..transport.kernels.internode import run_dispatch as run_internode_dispatch
from ..transport.kernels.intranode import IntranodeEngine, IntranodeHandle, RankDispatch, run_combine, run_dispatch
from ..transport.kernels.launcher import RankInput, default_timeout_s, prepare_input, resolve_device, slot_bytes_for

__all__ = ["InternodeLoopback", "Loopback"]


class Loopback:
    """W simulated ranks on one device; each operation is one launch serving all of them.

    On a GPU the "peer" buffers are W allocations of that GPU, so one H200 checks correctness
    and kernel efficiency of the whole protocol. With ``device="cpu"`` (CPU tensors) the same
    role code runs on threads (``cpu_options``: ``group_warps`` threads per peer group,
    ``num_workers`` combine workers).

    Args:
        world_size: W simulated ranks (1..16; one node).
        hidden: largest hidden size to move; ``num_topk``: largest top-k.
        config: :class:`moe_dispatch.config.Config` (default ``Config()``); calls may use fewer SMs.
        device: where buffers and outputs live (a CUDA device, or CPU for the CPU backend).
        element_bytes: widest element of x / y (2 for bf16, 4 for fp32 rows).
        timeout_s: bound of every wait (default ``MOE_DISPATCH_KERNEL_TIMEOUT_S`` or 100 s).

    Raises:
        ValueError: W, hidden, num_topk or element_bytes out of range, or a device that is neither
            CUDA nor CPU; TypeError: config is no Config; RuntimeError: a CUDA device without a
            GPU, or the extension is not built.
    """

    def __init__(
        self,
        world_size: int,
        hidden: int,
        num_topk: int,
        *,
        config: Config | None = None,
        device: torch.device | str = "cuda",
        element_bytes: int = 2,
        timeout_s: float | None = None,
        cpu_options: dict | None = None,
    ):
        if not isinstance(world_size, int) or not 1 <= world_size <= MAX_RANKS:
            raise ValueError(f"world_size must be in [1, {MAX_RANKS}], got {world_size!r}")
        self.world_size = world_size
        slot_bytes = slot_bytes_for(hidden, num_topk, element_bytes, config)
        self.config = config or Config()
        self.device, backend = resolve_device(device)
        self.layout = require_extension().intranode_buffer_layout(
            world_size, self.config.num_channels, self.config.num_slots, slot_bytes
        )
        self._buffers = [
            torch.zeros(self.layout.total_bytes, dtype=torch.uint8, device=self.device) for _ in range(world_size)
        ]
        error = torch.zeros(ERROR_RECORD_INTS, dtype=torch.int32, device=self.device)
        self.engine = IntranodeEngine(
            world_size,
            self.config,
            slot_bytes,
            [b.data_ptr() for b in self._buffers],
            error,
            None,
            backend,
            default_timeout_s(timeout_s),
            cpu_options,
            records=Records(world_size, self.device),
        )

    @property
    def timeout_s(self) -> float:
        """Bound, in seconds, of every wait inside the launches (settable)."""
        return self.engine.timeout_s

    @timeout_s.setter
    def timeout_s(self, value: float) -> None:
        self.engine.set_timeout(value)

    @property
    def buffer_bytes(self) -> int:
        """Bytes of each simulated rank's communication buffer."""
        return self.layout.total_bytes

    def set_variant(self, name: str) -> None:
        """Runs the named kernel variant (:data:`moe_dispatch.config.VARIANTS`) from the next
        operation on, over the same buffers (their layout does not depend on the variant fields);
        handles of earlier dispatches stay valid. Raises ValueError for an unknown name."""
        self.config = self.engine.config = self.config.with_variant(name)

    def dispatch(
        self,
        xs: list,
        topk_idxs: list[torch.Tensor] | None,
        topk_weights: list[torch.Tensor] | None,
        num_experts: int,
        *,
        num_sms: int | None = None,
        handles: list[IntranodeHandle] | None = None,
        num_worst_tokens: int | None = None,
        dispatch_ids: list[int] | None = None,
        status: dict[int, int] | None = None,
        withhold_rank: int | None = None,
        withhold_phase: str = "dispatch",
        check: bool = True,
        validate: bool = True,
    ) -> list[RankDispatch]:
        """Dispatch for all W ranks (see the module doc).

        Args:
            xs: per rank ``[T_r, H]`` bf16/fp16/fp32, or ``(x_fp8 [T_r, H], scales [T_r, H/128])``.
            topk_idxs: per rank ``[T_r, K]`` int32/int64 global expert ids, -1 = none (None with
                ``handles``: only x travels and ``recv_topk_idx`` is None).
            topk_weights: per rank ``[T_r, K]`` fp32, or None.
            num_experts: E, divisible by W.
            num_sms: SMs per simulated rank for this call (default ``config.num_sms``).
            handles: previous results' handles: a cached dispatch (no notify, same routing).
            num_worst_tokens: budget mode: this many rows per rank, no host sync (None or 0: off).
            dispatch_ids: per rank the fresh dispatch's identity (default: the next of a count
                shared by all ranks), carried by the handles.
            status: tests: rank -> a non-zero header status; that rank refuses (no tokens) and the
                others record it (:class:`~moe_dispatch.transport.kernels.header.MismatchError` from
                :meth:`check`).
            withhold_rank, withhold_phase: tests: that rank's blocks skip "notify", "dispatch".
            check: synchronise and raise :class:`IntranodeTimeoutError` if a wait timed out, or
                :class:`~moe_dispatch.transport.kernels.header.MismatchError` if ranks disagreed.
            validate: check topk_idx values (a host sync; pass False under CUDA-graph capture).

        Returns:
            per rank a :class:`RankDispatch`; rows ordered by source rank, then source token.
        """
        topk_idxs = check_world_args(self.world_size, xs, topk_idxs, num_experts)
        if handles is not None and len(handles) != self.world_size:
            raise ValueError(f"pass one handle per rank ({self.world_size}), got {len(handles)}")
        if dispatch_ids is not None and len(dispatch_ids) != self.world_size:
            raise ValueError(f"pass one dispatch id per rank ({self.world_size}), got {len(dispatch_ids)}")
        inputs = prepare_inputs(xs, topk_idxs, topk_weights, num_experts, self.device, validate, handles)
        inputs = refusing_inputs(inputs, status)
        try:
            results = run_dispatch(
                self.engine,
                inputs,
                num_experts,
                num_sms=num_sms or self.config.num_sms,
                handles=handles,
                num_worst_tokens=num_worst_tokens,
                skip_rank=withhold_rank,
                skip_phase=withhold_phase if withhold_rank is not None else None,
                dispatch_ids=dispatch_ids,
                statuses=status,
            )
        except IntranodeTimeoutError:
            self.reset()
            raise
        if check:
            self.check()
        return results

    def combine(
        self,
        ys: list[torch.Tensor],
        handles: list[IntranodeHandle],
        row_scales: list[torch.Tensor | None] | None = None,
        *,
        status: dict[int, int] | None = None,
        withhold_rank: int | None = None,
        check: bool = True,
    ) -> list[torch.Tensor]:
        """Combine for all W ranks: ``out[s] [T_s, H]`` in y's dtype, the fp32 sum over holders
        in ascending rank order of ``y * row_scale``, rounded once (zero rows for tokens no rank
        held). ``status``: as in :meth:`dispatch`."""
        outs = run_combine(self.engine, 0, ys, handles, row_scales, withhold_rank, statuses=status)
        if check:
            self.check()
        return outs

    def check(self) -> None:
        """Synchronises, then raises :class:`IntranodeTimeoutError` (and resets the buffers) if
        a wait of a previous launch timed out, or
        :class:`~moe_dispatch.transport.kernels.header.MismatchError` (clearing the records: the buffers
        stay usable) if ranks disagreed."""
        record = self.engine.read_error()
        if record:
            self.reset()
            self.engine.raise_if_timed_out(record)
        self.engine.records.raise_if_set()

    def reset(self) -> None:
        """Zeroes the control regions, the error record and the mismatch records (after a
        timeout left them dirty)."""
        for b in self._buffers:
            b[: self.layout.queue_offset].zero_()
        self.engine.error.zero_()
        self.engine.records.clear()


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

    Attributes:
        engines: the :class:`~moe_dispatch.transport.kernels.internode.InternodeEngines` of every
            launch (the RDMA engine; the staged pipeline's node engines too).

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
        if num_nodes * ranks_per_node > MAX_LAUNCH_RANKS:
            raise ValueError(f"loopback simulates at most {MAX_LAUNCH_RANKS} ranks, got {num_nodes} x {ranks_per_node}")
        self.num_nodes, self.ranks_per_node = num_nodes, ranks_per_node
        self.world_size = W = num_nodes * ranks_per_node
        slot_bytes = slot_bytes_for(hidden, num_topk, element_bytes, config, min_topk=1)
        self.config = config or Config()
        check_rdma_config(self.config)
        self.device, backend = resolve_device(device)
        timeout = default_timeout_s(timeout_s)
        C, S = self.config.num_channels, self.config.num_slots
        self.rdma_layout = require_extension().internode_rdma_layout(num_nodes, ranks_per_node, C, S, slot_bytes)
        self.nvl_layout = require_extension().intranode_buffer_layout(ranks_per_node, C, S, slot_bytes, num_nodes)
        zeros = lambda n: torch.zeros(n, dtype=torch.uint8, device=self.device)  # noqa: E731
        self._rdma_buffers = [zeros(self.rdma_layout.total_bytes) for _ in range(W)]
        self._nvl_buffers = [zeros(self.nvl_layout.total_bytes) for _ in range(W)]  # rank r's: index r
        record = lambda: torch.zeros(ERROR_RECORD_INTS, dtype=torch.int32, device=self.device)  # noqa: E731
        nvl = [b.data_ptr() for b in self._nvl_buffers]
        rdma = RdmaEngine(
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
                n: IntranodeEngine(
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
        self.engines = InternodeEngines(num_nodes, ranks_per_node, rdma, nodes)

    @property
    def timeout_s(self) -> float:
        """Bound, in seconds, of every wait inside the launches (settable)."""
        return self.engines.rdma.timeout_s

    @timeout_s.setter
    def timeout_s(self, value: float) -> None:
        self.engines.rdma.set_timeout(value)
        for engine in self.engines.nodes.values():
            engine.set_timeout(value)

    @property
    def buffer_bytes(self) -> tuple[int, int]:
        """(RDMA, NVLink) bytes of each simulated rank's communication buffers."""
        return self.rdma_layout.total_bytes, self.nvl_layout.total_bytes

    def set_variant(self, name: str) -> None:
        """Runs the named kernel variant (:data:`moe_dispatch.config.VARIANTS`) from the next
        operation on, over the same buffers; handles of earlier dispatches stay valid. Raises
        ValueError for an unknown name."""
        self.config = self.engines.rdma.config = self.config.with_variant(name)
        for engine in self.engines.nodes.values():
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
            dispatch_ids, status: as :meth:`Loopback.dispatch`.
            withhold_rank, withhold_phase: tests: that rank's blocks skip a launch: fused
                "notify" or "dispatch" (default); staged "node_notify", "node_dispatch"
                (default), "notify" or "dispatch" (stage 2).
            check: raise :class:`InternodeTimeoutError` or
                :class:`~moe_dispatch.transport.kernels.header.MismatchError` (synchronises).
            validate: check topk_idx values (a host sync).

        Returns:
            per rank an :class:`InternodeDispatch`; rows by source rank, then source token.
        """
        W = self.world_size
        topk_idxs = check_world_args(W, xs, topk_idxs, num_experts)
        if handles is not None and len(handles) != W:
            raise ValueError(f"handles must be one handle per rank ({W}), got {len(handles)}")
        if dispatch_ids is not None and len(dispatch_ids) != W:
            raise ValueError(f"pass one dispatch id per rank ({W}), got {len(dispatch_ids)}")
        inputs = refusing_inputs(
            prepare_inputs(xs, topk_idxs, topk_weights, num_experts, self.device, validate, handles), status
        )
        return self._guard(
            lambda: run_internode_dispatch(
                self.engines,
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
            lambda: run_internode_combine(
                self.engines, 0, ys, handles, row_scales, withhold_rank, withhold_phase, status, check
            ),
            check,
        )

    def check(self) -> None:
        """Synchronises; raises a recorded timeout (resetting the buffers) or mismatch."""
        self._guard(lambda: None, True)

    def _guard(self, fn, check: bool):
        try:
            result = fn()
            if check:
                self.engines.check_timeouts()
        except InternodeTimeoutError:
            self.reset()
            raise
        if check:
            self.engines.check_mismatches()
        return result

    def reset(self) -> None:
        """Zeroes the control regions, error and mismatch records (after a timeout left them dirty)."""
        for b in self._rdma_buffers:
            b[: self.rdma_layout.recv_offset].zero_()
        for b in self._nvl_buffers:
            b[: self.nvl_layout.queue_offset].zero_()
        for engine in (self.engines.rdma, *self.engines.nodes.values()):
            engine.error.zero_()
            engine.records.clear()


def check_world_args(world_size: int, xs: list, topk_idxs: list | None, num_experts: int) -> list:
    """A loopback call's per-rank lists and E; returns ``topk_idxs`` (one None per rank when None)."""
    if topk_idxs is None:
        topk_idxs = [None] * world_size
    if len(xs) != world_size or len(topk_idxs) != world_size:
        raise ValueError(f"pass one x and one topk_idx per rank ({world_size}), got {len(xs)} and {len(topk_idxs)}")
    if not isinstance(num_experts, int) or num_experts < 1 or num_experts % world_size:
        raise ValueError(f"num_experts must be a positive multiple of {world_size}, got {num_experts!r}")
    return topk_idxs


def prepare_inputs(
    xs: list,
    topk_idxs: list,
    topk_weights: list | None,
    num_experts: int,
    device: torch.device,
    validate: bool,
    handles: list | None,
) -> list[RankInput]:
    """:func:`prepare_input` for every rank of a loopback call (lists already checked)."""
    weights = topk_weights if topk_weights is not None else [None] * len(xs)
    return [
        prepare_input(
            r,
            xs[r],
            topk_idxs[r],
            weights[r],
            num_experts,
            len(xs),
            device,
            validate,
            handles[r] if handles is not None else None,
        )
        for r in range(len(xs))
    ]


def refusing_inputs(inputs: list[RankInput], status: dict[int, int] | None) -> list[RankInput]:
    """``inputs`` with no tokens on the ranks that refuse (a non-zero ``status``)."""
    if not status:
        return inputs
    for code in status.values():
        if not isinstance(code, int) or code == 0:
            raise ValueError(f"status must map ranks to non-zero ints, got {status!r}")
    return [empty_input(inp) if inp.rank in status else inp for inp in inputs]


def empty_input(inp: RankInput) -> RankInput:
    """``inp`` with no tokens (its shapes otherwise kept)."""
    return dataclasses.replace(
        inp,
        x=inp.x[:0],
        scales=inp.scales[:0] if inp.scales is not None else None,
        topk_idx=inp.topk_idx[:0],
        topk_weights=inp.topk_weights[:0] if inp.topk_weights is not None else None,
        is_token_in_rank=inp.is_token_in_rank[:0],
    )
