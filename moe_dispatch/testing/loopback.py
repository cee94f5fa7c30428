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
from collections.abc import Callable
from typing import ClassVar

import torch

from .._ext import require_extension
from ..config import Config
from ..errors import InternodeTimeoutError, IntranodeTimeoutError
from ..kernel_layout import ERROR_RECORD_INTS, MAX_LAUNCH_RANKS, MAX_RANKS
from ..transport.kernels.calls import CombineCall, DispatchCall, RankInput, prepare_input
from ..transport.kernels.header import Records
from ..transport.kernels.internode import run_combine as run_internode_combine
from ..transport.kernels.internode import run_dispatch as run_internode_dispatch
from ..transport.kernels.internode_engines import InternodeEngines, RdmaEngine, check_rdma_config
from ..transport.kernels.intranode import IntranodeEngine, run_combine, run_dispatch
from ..transport.kernels.launcher import resolve_device, slot_bytes_for
from ..transport.kernels.timeouts import default_timeout_s

__all__ = ["InternodeLoopback", "Loopback"]


class _Harness:
    """What both harnesses share: the set-up of their engines' shapes, dispatch and combine for
    every simulated rank, and raising what the launches recorded (a timeout first resets the
    buffers, a mismatch clears the records: the buffers stay usable).

    A harness sets ``_engines`` (every engine it launches on, the first one's timeout the
    harness's), ``_control`` (per buffer, the bytes of its control region) and ``_runs_on``
    (what its topology's operations take: the engine, or the internode engines), and names
    those operations (``_dispatch``, ``_combine``: its topology's ``run_dispatch`` /
    ``run_combine``).
    """

    _min_topk = 0  # the fewest top-k entries a slot holds
    _timeout_error: type[Exception] = IntranodeTimeoutError
    _dispatch: ClassVar[Callable]
    _combine: ClassVar[Callable]
    _engines: list
    _control: list[tuple[torch.Tensor, int]]
    _runs_on: object

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
        slot_bytes = slot_bytes_for(hidden, num_topk, element_bytes, config, min_topk=self._min_topk)
        self.config = config or Config()
        self.device, backend = resolve_device(device)
        self._build(slot_bytes, backend, default_timeout_s(timeout_s), cpu_options)

    def _build(self, slot_bytes: int, backend: str, timeout_s: float, cpu_options: dict | None) -> None:
        """Allocates the buffers and makes the engines over them."""
        raise NotImplementedError

    @property
    def timeout_s(self) -> float:
        """Bound, in seconds, of every wait inside the launches (settable)."""
        return self._engines[0].timeout_s

    @timeout_s.setter
    def timeout_s(self, value: float) -> None:
        for engine in self._engines:
            engine.set_timeout(value)

    def set_variant(self, name: str) -> None:
        """Runs the named kernel variant (:data:`moe_dispatch.config.VARIANTS`) from the next
        operation on, over the same buffers (their layout does not depend on the variant fields);
        handles of earlier dispatches stay valid. Raises ValueError for an unknown name."""
        self.config = self.config.with_variant(name)
        for engine in self._engines:
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
    ) -> list:
        """Dispatch for all W ranks (see the module doc).

        Args:
            xs: per rank ``[T_r, H]`` bf16/fp16/fp32, or ``(x_fp8 [T_r, H], scales [T_r, H/128])``.
            topk_idxs: per rank ``[T_r, K]`` int32/int64 global expert ids, -1 = none (None with
                ``handles``: only x travels and ``recv_topk_idx`` is None).
            topk_weights: per rank ``[T_r, K]`` fp32, or None.
            num_experts: E, divisible by W.
            num_sms: SMs per simulated rank for this call (default ``config.num_sms``; the fused
                internode pipeline runs ``max(1, num_sms // 3)`` channels of three blocks).
            handles: previous results' handles: a cached dispatch (no notify, same routing).
            num_worst_tokens: budget mode (not the staged pipeline): this many rows per rank,
                nothing waits for the host, rows past it are dropped and ``handle.overflow`` is set
                (None or 0: off).
            dispatch_ids: per rank the fresh dispatch's identity (default: the next of a count
                shared by all ranks), carried by the handles.
            status: tests: rank -> a non-zero header status; that rank refuses (no tokens) and the
                others record it (:class:`~moe_dispatch.transport.kernels.header.MismatchError` from
                :meth:`check`).
            withhold_rank, withhold_phase: tests: that rank's blocks skip a launch: intranode and
                fused "notify" or "dispatch" (default); staged "node_notify", "node_dispatch"
                (default), "notify" or "dispatch" (stage 2).
            check: synchronise and raise the topology's timeout error if a wait timed out, or
                :class:`~moe_dispatch.transport.kernels.header.MismatchError` if ranks disagreed.
            validate: check topk_idx values (a host sync; pass False under CUDA-graph capture).

        Returns:
            per rank a :class:`~moe_dispatch.transport.kernels.intranode.RankDispatch` (intranode)
            or :class:`~moe_dispatch.transport.kernels.internode_engines.InternodeDispatch`; rows ordered
            by source rank, then source token.
        """
        W = self.world_size
        topk_idxs = check_world_args(W, xs, topk_idxs, num_experts)
        if handles is not None and len(handles) != W:
            raise ValueError(f"pass one handle per rank ({W}), got {len(handles)}")
        if dispatch_ids is not None and len(dispatch_ids) != W:
            raise ValueError(f"pass one dispatch id per rank ({W}), got {len(dispatch_ids)}")
        inputs = refusing_inputs(
            prepare_inputs(xs, topk_idxs, topk_weights, num_experts, self.device, validate, handles), status
        )
        call = DispatchCall(
            inputs=inputs,
            num_experts=num_experts,
            num_sms=num_sms or self.config.num_sms,
            handles=handles,
            num_worst_tokens=num_worst_tokens,
            dispatch_ids=dispatch_ids,
            **_launch_fields(status, withhold_rank, withhold_phase, check),
        )
        return self._guard(lambda: self._dispatch(self._runs_on, call), check)

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
        """Combine for all W ranks: ``out[s] [T_s, H]`` in y's dtype, the fp32 sum over holders
        of ``y * row_scale`` in the order of the module doc, rounded once (zero rows for tokens
        no rank held). ``status``: as in :meth:`dispatch`; ``withhold_phase``: the internode
        pipelines' (fused "combine", the default; staged "combine" (stage 2) or "node_combine",
        the default); the intranode combine is one launch."""
        call = CombineCall(
            rank_begin=0,
            ys=ys,
            handles=handles,
            row_scales=row_scales,
            **_launch_fields(status, withhold_rank, withhold_phase, check),
        )
        return self._guard(lambda: self._combine(self._runs_on, call), check)

    def check(self) -> None:
        """Synchronises, then raises a recorded timeout (resetting the buffers) or mismatch
        (clearing the records: the buffers stay usable)."""
        self._guard(lambda: None, True)

    def _guard(self, fn, check: bool):
        """``fn()``, then (``check``) the recorded timeouts and mismatches raised; a timeout
        resets the buffers first."""
        try:
            result = fn()
            if check:
                self._raise_timeouts()
        except self._timeout_error:
            self.reset()
            raise
        if check:
            self._raise_mismatches()
        return result

    def _raise_timeouts(self) -> None:
        """Raises a timeout the engines recorded (a host sync)."""
        raise NotImplementedError

    def _raise_mismatches(self) -> None:
        """Raises a mismatch the engines recorded, clearing the records."""
        raise NotImplementedError

    def reset(self) -> None:
        """Zeroes the control regions, the error records and the mismatch records (after a
        timeout left them dirty)."""
        for buffer, control_bytes in self._control:
            buffer[:control_bytes].zero_()
        for engine in self._engines:
            engine.error.zero_()
            engine.records.clear()


class Loopback(_Harness):
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

    _dispatch = staticmethod(run_dispatch)
    _combine = staticmethod(run_combine)

    def _build(self, slot_bytes: int, backend: str, timeout_s: float, cpu_options: dict | None) -> None:
        W = self.world_size
        self.layout = require_extension().intranode_buffer_layout(
            W, self.config.num_channels, self.config.num_slots, slot_bytes
        )
        self._buffers = [torch.zeros(self.layout.total_bytes, dtype=torch.uint8, device=self.device) for _ in range(W)]
        self.engine = IntranodeEngine(
            W,
            self.config,
            slot_bytes,
            [b.data_ptr() for b in self._buffers],
            torch.zeros(ERROR_RECORD_INTS, dtype=torch.int32, device=self.device),
            None,
            backend,
            timeout_s,
            cpu_options,
            records=Records(W, self.device),
        )
        self._engines, self._runs_on = [self.engine], self.engine
        self._control = [(b, self.layout.queue_offset) for b in self._buffers]

    @property
    def buffer_bytes(self) -> int:
        """Bytes of each simulated rank's communication buffer."""
        return self.layout.total_bytes

    def _raise_timeouts(self) -> None:
        self.engine.raise_if_timed_out()

    def _raise_mismatches(self) -> None:
        self.engine.records.raise_if_set()


class InternodeLoopback(_Harness):
    """N nodes x L ranks simulated on one device: the internode kernels with every RDMA put
    replaced by a store into the peer's buffer (same device).

    On a GPU one launch per step serves all W = N * L ranks (the fused pipeline: a notify and
    one kernel per operation; staged: stage 2 one launch per node and source node). With
    ``device="cpu"`` the same role code runs on threads (``cpu_options``: ``group_warps``,
    ``num_workers``).

    Args:
        num_nodes, ranks_per_node: N, L; W = N * L <= 16.
        hidden, num_topk: the largest rows to move (sizes slots); ``options``: the keywords of
            :class:`Loopback` (``config``: ``num_slots % chunk_tokens == 0``, its
            ``internode_pipeline`` the pipeline run).

    Attributes:
        engines: the :class:`~moe_dispatch.transport.kernels.internode_engines.InternodeEngines` of every
            launch (the RDMA engine; the staged pipeline's node engines too).

    Raises:
        ValueError: shapes out of range (num_topk in [1, 32]), or a device that is neither CUDA
            nor CPU; TypeError: config is no Config; RuntimeError: a CUDA device without a GPU,
            or the extension is not built.
    """

    _min_topk = 1
    _timeout_error = InternodeTimeoutError
    _dispatch = staticmethod(run_internode_dispatch)
    _combine = staticmethod(run_internode_combine)

    def __init__(self, num_nodes: int, ranks_per_node: int, hidden: int, num_topk: int, **options):
        for name, value in (("num_nodes", num_nodes), ("ranks_per_node", ranks_per_node)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if num_nodes * ranks_per_node > MAX_LAUNCH_RANKS:
            raise ValueError(f"loopback simulates at most {MAX_LAUNCH_RANKS} ranks, got {num_nodes} x {ranks_per_node}")
        self.num_nodes, self.ranks_per_node = num_nodes, ranks_per_node
        super().__init__(num_nodes * ranks_per_node, hidden, num_topk, **options)

    def _build(self, slot_bytes: int, backend: str, timeout_s: float, cpu_options: dict | None) -> None:
        check_rdma_config(self.config)
        N, L, W = self.num_nodes, self.ranks_per_node, self.world_size
        C, S = self.config.num_channels, self.config.num_slots
        self.rdma_layout = require_extension().internode_rdma_layout(N, L, C, S, slot_bytes)
        self.nvl_layout = require_extension().intranode_buffer_layout(L, C, S, slot_bytes, N)
        zeros = lambda n: torch.zeros(n, dtype=torch.uint8, device=self.device)  # noqa: E731
        self._rdma_buffers = [zeros(self.rdma_layout.total_bytes) for _ in range(W)]
        self._nvl_buffers = [zeros(self.nvl_layout.total_bytes) for _ in range(W)]  # rank r's: index r
        record = lambda: torch.zeros(ERROR_RECORD_INTS, dtype=torch.int32, device=self.device)  # noqa: E731
        nvl = [b.data_ptr() for b in self._nvl_buffers]
        rdma = RdmaEngine(
            N,
            L,
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
            timeout_s,
            cpu_options,
            records=Records(W, self.device),
        )
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
                    timeout_s,
                    cpu_options,
                    records=Records(L, self.device),
                    relay_nodes=N,
                )
                for n in range(N)
            }
            if self.config.internode_pipeline == "staged"
            else {}
        )
        self.engines = InternodeEngines(N, L, rdma, nodes)
        self._engines, self._runs_on = [rdma, *nodes.values()], self.engines
        self._control = [(b, self.rdma_layout.recv_offset) for b in self._rdma_buffers]
        self._control += [(b, self.nvl_layout.queue_offset) for b in self._nvl_buffers]

    @property
    def buffer_bytes(self) -> tuple[int, int]:
        """(RDMA, NVLink) bytes of each simulated rank's communication buffers."""
        return self.rdma_layout.total_bytes, self.nvl_layout.total_bytes

    def _raise_timeouts(self) -> None:
        self.engines.check_timeouts()

    def _raise_mismatches(self) -> None:
        self.engines.check_mismatches()


def _launch_fields(status, withhold_rank, withhold_phase, check: bool) -> dict:
    """A harness operation's test keywords as the kernels' calls name them
    (:class:`~moe_dispatch.transport.kernels.calls.LaunchCall`)."""
    return {"statuses": status, "skip_rank": withhold_rank, "skip_phase": withhold_phase, "check": check}


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
