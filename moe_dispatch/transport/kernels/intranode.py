"""The host side of ``moe_dispatch._C``'s intranode kernels (one node, over NVLink).

Importable without the extension (only the launches need it). Kernels and protocol:
``csrc/kernels/intranode.cuh`` (buffer layout drawn byte by byte, queue protocol in prose) and
``intranode_roles.cuh`` (the per-warp code, shared with the CPU backend).

Operations, for the ranks of one launch:

- **dispatch** = notify (barrier, per-(source, channel) token counts exchanged, receive prefix)
  then the dispatch kernel (per-channel ring queues; rows ordered by source rank, then source
  token; top-k ids converted to the receiver's local numbering, weights travel with them).
  Without ``num_worst_tokens`` the host reads the receive count between the two launches (one
  host sync); with it, outputs have that many rows, nothing waits for the host (CUDA-graph
  capturable) and ``handle.overflow`` says after the fact whether rows were dropped.
  A cached dispatch (``handle=``) skips notify.
- **combine**: each token's rows from its holders, summed in fp32 in ascending rank order and
  rounded once to y's dtype (= ``moe_dispatch.reference.combine`` for one node).

Every wait inside the kernels is bounded by ``timeout_s``; a timed-out launch records rank,
channel, peer and counter, every block leaves, and :meth:`check` raises
:class:`IntranodeTimeoutError` with that text. ``MOE_DISPATCH_KERNEL_TIMEOUT_S`` overrides the
default bound (e.g. 1 to debug a hang quickly). Every operation also checks on the device that
the ranks' calls agree (:mod:`moe_dispatch.transport.kernels.header`: the operation, the handle's
dispatch id, row bytes, dtype, top-k, experts, channels; a rank's refusal of its own
arguments): a disagreeing pair moves no rows and the host raises
:class:`~moe_dispatch.transport.kernels.header.MismatchError` at its next synchronisation.

The layers here: :class:`IntranodeEngine` (on the shared
:class:`~moe_dispatch.transport.kernels.launcher.Launcher`) launches each kernel for a list of
ranks, and the functions :func:`run_notify`, :func:`launch_dispatch`, :func:`run_dispatch` and
:func:`run_combine` run an operation for them. :class:`IntranodeBuffers` is one rank per
process: buffers shared through CUDA IPC handles exchanged over torch.distributed (one GPU per
rank), or on CPU through shared memory with the CPU backend (the same handle exchange and
per-rank launches, with peers in other processes); ``Buffer(transport="kernels")`` drives it
through :class:`~moe_dispatch.transport.kernels.transport.KernelTransport` (one node). Tests and
benchmarks run the engine for a whole world in one process
(:class:`moe_dispatch.testing.loopback.Loopback`) or one rank per process
(:class:`moe_dispatch.testing.ranks.IntranodeRank`).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from ..._ext import require_extension
from ...config import Config
from ...errors import BudgetOverflowError, IntranodeTimeoutError
from ...kernel_layout import ERROR_RECORD_INTS, MAX_RANKS
from .calls import CombineCall, DispatchCall, check_num_sms, ptr
from .header import OP_DISPATCH, Records
from .launcher import Launcher, RankBuffers, dispatch_through
from .memory import CudaIpcBuffer, SharedMemoryBuffer, map_peers
from .timeouts import describe_intranode_timeout as describe_timeout
from .timeouts import recorded

__all__ = [
    "IntranodeBuffers",
    "IntranodeEngine",
    "IntranodeHandle",
    "IntranodeTimeoutError",
    "RankDispatch",
    "describe_timeout",
    "launch_dispatch",
    "run_combine",
    "run_dispatch",
    "run_notify",
]


@dataclasses.dataclass(eq=False)
class IntranodeHandle:
    """One rank's share of a dispatch: what combine and a cached dispatch replay.

    Attributes:
        num_tokens: T, tokens this rank sent.
        num_channels: C of the dispatch (combine and replays use the same).
        is_token_in_rank: ``[T, W]`` bool of this rank's tokens.
        recv_prefix: ``[W * C + 1]`` int32 on the device: first receive row of each (source,
            channel), total last.
        num_recv_tokens: R as a host int (None in budget mode: read ``num_recv_tokens_dev``).
        num_recv_tokens_dev: ``[1]`` int32 on the device.
        overflow: ``[1]`` int32 on the device: 1 when R exceeded the rows allocated (budget mode).
        num_rows: rows allocated for the receive (R, or ``num_worst_tokens``).
        dispatch_id: the dispatch's identity: a combine or cached dispatch with this handle checks
            on the device that every rank replays the same dispatch (header.py).
        num_experts: E of the dispatch.
        peer_ok: ``[W]`` int32 on the device: the notify's verdict on each peer (1: headers agreed).
        topk_dtype: the caller's top-k id dtype (outputs come back in it).
    """

    num_tokens: int
    num_channels: int
    is_token_in_rank: torch.Tensor
    recv_prefix: torch.Tensor
    num_recv_tokens: int | None
    num_recv_tokens_dev: torch.Tensor
    overflow: torch.Tensor
    num_rows: int
    dispatch_id: int = 0
    num_experts: int = 0
    peer_ok: torch.Tensor | None = None
    topk_dtype: torch.dtype = torch.int64
    # True from the notify until its dispatch launch, which alone reuses the notify's verdicts;
    # every later launch on the handle exchanges headers (ring.cuh explains why).
    notified: bool = dataclasses.field(default=False, repr=False)

    def routing_fields(self) -> dict:
        """The dispatch and combine rank structs' fields this handle's routing fills."""
        return {"is_token_in_rank": ptr(self.is_token_in_rank), "recv_prefix": self.recv_prefix.data_ptr()}

    def check_overflow(self) -> None:
        """Raises :class:`~moe_dispatch.errors.BudgetOverflowError` when the budget was too small
        (reads the device: a host sync)."""
        if int(self.overflow.item()):
            raise BudgetOverflowError(
                f"dispatch received {int(self.num_recv_tokens_dev.item())} rows but num_worst_tokens="
                f"{self.num_rows}: rows past the budget were dropped; raise num_worst_tokens"
            )


@dataclasses.dataclass(eq=False)
class RankDispatch:
    """One rank's dispatch outputs (rows ``[R or budget, ...]``)."""

    recv_x: torch.Tensor | tuple[torch.Tensor, torch.Tensor]
    recv_topk_idx: torch.Tensor | None  # None for a cached dispatch without topk_idx
    recv_topk_weights: torch.Tensor | None
    recv_src_idx: torch.Tensor
    num_recv_tokens_per_expert: torch.Tensor
    handle: IntranodeHandle


class IntranodeEngine(Launcher):
    """Launches notify / dispatch / combine for a list of ranks over a set of W buffers.

    Args:
        world_size: W.
        config: buffer shape (channels, ring depth, chunk); calls may use fewer SMs.
        slot_bytes: capacity of a queue slot.
        buffers: W buffer addresses as this process sees them.
        error: ``int32[16]`` error record on the launch device (zeroed).
        error_host_ptr: device address of a pinned mirror of it, or None.
        backend: "cuda" or "cpu".
        timeout_s: bound of every wait.
        records: the mismatch records of the ranks it launches (rank r's at r - rank_begin).
        relay_nodes: N when the buffers are an internode transport's NVLink buffers, else 0.
    """

    def __init__(
        self,
        world_size: int,
        config: Config,
        slot_bytes: int,
        buffers: list[int],
        error: torch.Tensor,
        error_host_ptr: int | None,
        backend: str,
        timeout_s: float,
        cpu_options: dict | None = None,
        *,
        records: Records,
        rank_begin: int = 0,
        relay_nodes: int = 0,
    ):
        self.world_size, self.config, self.slot_bytes, self.buffers = world_size, config, slot_bytes, buffers
        self.layout = require_extension().intranode_buffer_layout(
            world_size, config.num_channels, config.num_slots, slot_bytes, relay_nodes
        )
        super().__init__(error, error_host_ptr, backend, timeout_s, cpu_options, records, rank_begin)

    @property
    def slot_flags(self) -> bool:
        return self.config.slot_flags

    def common(self, num_channels: int, rank_begin: int, skip_rank: int | None):
        """The launch's ``_C.IntranodeCommon``."""
        return self._common(
            "IntranodeCommon", num_channels, rank_begin, skip_rank, num_ranks=self.world_size, layout=self.layout
        )

    def notify(self, common, ranks: list, num_topk: int) -> None:
        """Launches ``_C.intranode_notify`` (``ranks``: a ``_C.NotifyRank`` per launched rank)."""
        self._run("intranode_notify", common, ranks, num_topk, cpu_options=False)

    def dispatch(self, common, ranks: list, call: DispatchCall) -> None:
        """Launches ``_C.intranode_dispatch`` of ``call`` (``ranks``: a ``_C.DispatchRank`` per
        launched rank)."""
        shape = self.dispatch_shape(call.inputs)
        self._run("intranode_dispatch", common, ranks, *shape.launch_args, call.num_experts // self.world_size)

    def combine(self, common, ranks: list, y_bytes: int, dtype: torch.dtype) -> None:
        """Launches ``_C.intranode_combine`` (``ranks``: a ``_C.CombineRank`` per launched rank)."""
        self._run_combine("intranode_combine", common, ranks, y_bytes, dtype)

    def raise_if_timed_out(self, record: list[int] | None = None) -> None:
        """Raises :class:`IntranodeTimeoutError` if ``record`` (default: the device's, a host sync) is set."""
        record = record if record is not None else self.read_error()
        if record:
            raise IntranodeTimeoutError(*describe_timeout(record, self.timeout_s))


def run_dispatch(engine: IntranodeEngine, call: DispatchCall) -> list[RankDispatch]:
    """Dispatch for ranks ``call.inputs[i].rank`` (consecutive) in one launch each of notify and
    dispatch (``call.skip_phase`` None: "dispatch")."""
    engine.dispatch_shape(call.inputs)
    return dispatch_through(engine, call, run_notify, launch_dispatch, RankDispatch, IntranodeHandle)


def run_notify(engine: IntranodeEngine, call: DispatchCall) -> None:
    """The notify launch: per rank a handle into ``call.handles`` (receive prefix, counts, the
    verdicts on its peers). Without a budget the host reads the receive counts (one sync for all
    launched ranks) and no outputs are made (``call.outs`` None); with one, the outputs are
    made first (notify fills their padding rows) unless ``call.outs`` holds them."""
    inputs, world_size, device = call.inputs, engine.world_size, engine.device
    num_topk = inputs[0].topk_idx.shape[1]
    num_channels = check_num_sms(call.num_sms, engine.config)
    budget = call.budget
    ids = engine.dispatch_ids(call.dispatch_ids, len(inputs))
    prefixes = [torch.zeros(world_size * num_channels + 1, dtype=torch.int32, device=device) for _ in inputs]
    counts = [torch.zeros(1, dtype=torch.int32, device=device) for _ in inputs]
    overflows = [torch.zeros(1, dtype=torch.int32, device=device) for _ in inputs]
    peer_ok = [torch.zeros(world_size, dtype=torch.int32, device=device) for _ in inputs]
    outs = engine.notify_outputs(call, call.num_experts // world_size)
    ranks = [
        require_extension().NotifyRank(
            is_token_in_rank=ptr(inp.is_token_in_rank),
            recv_prefix=p.data_ptr(),
            num_recv_tokens=n.data_ptr(),
            overflow=o.data_ptr(),
            peer_ok=ok.data_ptr(),
            recv_topk_idx=ptr(outs[i]["topk_idx"]) if outs else None,
            recv_topk_weights=ptr(outs[i]["topk_weights"]) if outs else None,
            recv_src_idx=ptr(outs[i]["src_idx"]) if outs else None,
            num_tokens=inp.x.shape[0],
            budget=budget,
            **engine.dispatch_check(
                OP_DISPATCH, ids[i], inp, call.num_experts, num_channels, call.statuses.get(inp.rank, 0), budget
            ),
        )
        for i, (inp, p, n, o, ok) in enumerate(zip(inputs, prefixes, counts, overflows, peer_ok))
    ]
    engine.notify(engine.common(num_channels, inputs[0].rank, call.skip("notify", "dispatch")), ranks, num_topk)
    if budget < 0:
        totals = torch.cat(counts).tolist()
        engine.raise_if_timed_out()
    else:
        totals = [None] * len(inputs)
    call.handles = [
        IntranodeHandle(
            **call.handle_fields(inp, ids[i], num_channels),
            recv_prefix=p,
            num_recv_tokens=total,
            num_recv_tokens_dev=n,
            overflow=o,
            num_rows=budget if budget >= 0 else total,
            peer_ok=ok,
            notified=True,
        )
        for i, (inp, p, n, o, ok, total) in enumerate(zip(inputs, prefixes, counts, overflows, peer_ok, totals))
    ]


def launch_dispatch(engine: IntranodeEngine, call: DispatchCall) -> None:
    """The dispatch launch on ``call.handles`` into ``call.outs`` (per rank the dict of
    :func:`alloc_outputs`: rows ``[handle.num_rows, ...]``). Right after its notify a handle's
    launch reuses the notify's verdicts; any later one (a cached dispatch) exchanges headers in
    the kernel."""
    ranks = [
        require_extension().DispatchRank(**engine.dispatch_fields(call, inp, h, o), token_ids=ptr(inp.token_ids))
        for inp, h, o in zip(call.inputs, call.handles, call.outs)
    ]
    common = engine.common(call.handles[0].num_channels, call.inputs[0].rank, call.skip("dispatch", "dispatch"))
    engine.dispatch(common, ranks, call)


def run_combine(engine: IntranodeEngine, call: CombineCall) -> list[torch.Tensor]:
    """Combine for ranks ``call.rank_begin + i`` into ``call.outs`` (contiguous ``[T, H]``, made
    when None); returns them."""
    _, dtype, y_bytes = engine.prepare_combine(call, IntranodeHandle)
    common = engine.common(call.handles[0].num_channels, call.rank_begin, call.skip("combine", "combine"))
    engine.combine(common, engine.combine_ranks("CombineRank", call, y_bytes, dtype), y_bytes, dtype)
    return call.outs


class IntranodeBuffers(RankBuffers):
    """This process's rank of the intranode kernels, for one EP group of W <= 16 ranks on one
    node, one process each: its buffer, the peers' mapped, and :attr:`engine` over them.

    On a GPU (``device`` CUDA, the default) each rank's buffer is a ``cudaMalloc`` shared
    through CUDA IPC handles. On CPU (``device="cpu"``, CPU tensors) it is a POSIX shared-memory
    segment that every rank maps, and the same role code runs on this process's threads (the
    kernels' CPU backend), so the multi-process path is tested without a GPU.

    What is on the device and what synchronises: a fresh dispatch without ``num_worst_tokens``
    reads its receive count on the host once (R sizes the outputs); with it, nothing waits for
    the host (counts, overflow flag and the peers' verdicts stay on the device: CUDA-graph
    capturable). Cached dispatch and combine never synchronise. Every operation checks its
    arguments against every peer's on the device (header.py); a mismatch is recorded, and
    :meth:`check_errors` raises it as
    :class:`~moe_dispatch.transport.kernels.header.MismatchError` (on a GPU from the pinned
    mirrors, without waiting for running kernels).

    Args: those of :class:`~moe_dispatch.transport.kernels.launcher.RankBuffers` (``group``:
    NCCL or gloo, it only carries the handles; all W ranks on this node), and
        relay_nodes: the internode buffers' N when these are their NVLink buffers (adds the
            fused pipeline's relay region); 0 otherwise.

    Raises:
        ValueError: more than 16 ranks, hidden, num_topk or element_bytes out of range, or a
            device that is neither CUDA nor CPU; TypeError: config is no Config; RuntimeError:
            a CUDA device without a GPU.

    Collective: every rank constructs it together (allocation, handle exchange).
    """

    _notify = staticmethod(run_notify)
    _launch = staticmethod(launch_dispatch)
    _dispatch = staticmethod(run_dispatch)
    _combine = staticmethod(run_combine)

    def _build(self, slot_bytes: int, relay_nodes: int = 0) -> None:
        group, rank, world_size = self.group, self.rank, self.world_size
        if world_size > MAX_RANKS:
            raise ValueError(f"the intranode kernels serve at most {MAX_RANKS} ranks, the group has {world_size}")
        C = require_extension()
        self.layout = C.intranode_buffer_layout(
            world_size, self.config.num_channels, self.config.num_slots, slot_bytes, relay_nodes
        )
        on_gpu = self.device.type == "cuda"
        self._own = CudaIpcBuffer(self.layout, self.device) if on_gpu else SharedMemoryBuffer(self.layout)
        self._opened: dict[int, int] = {}
        try:
            buffers = map_peers(self._own, group, rank, world_size, self._opened)
            error = torch.zeros(ERROR_RECORD_INTS, dtype=torch.int32, device=self.device)
            # On a GPU a pinned mirror of the record lets check_errors read it without waiting for kernels.
            self.error_host = torch.zeros(ERROR_RECORD_INTS, dtype=torch.int32).pin_memory() if on_gpu else None
            error_host_ptr = C.host_device_pointer(self.error_host.data_ptr()) if on_gpu else None
            self.engine = IntranodeEngine(
                world_size,
                self.config,
                slot_bytes,
                buffers,
                error,
                error_host_ptr,
                "cuda" if on_gpu else "cpu",
                self.timeout_s,
                records=Records(1, self.device, mirror=on_gpu),
                rank_begin=rank,
                relay_nodes=relay_nodes,
            )
            dist.barrier(group=group)  # every peer has mapped every buffer
        except BaseException:
            self.close()  # a peer that failed or never came: leave no mapping or shared-memory file behind
            raise
        self._own.mapped()

    @property
    def launches(self) -> int:
        return self.engine.launches

    @property
    def records(self) -> list[Records]:
        return [self.engine.records]

    def empty_handle(self) -> IntranodeHandle:
        W, C, device = self.world_size, self.config.num_channels, self.device
        zeros = lambda *shape, dtype=torch.int32: torch.zeros(*shape, dtype=dtype, device=device)  # noqa: E731
        return IntranodeHandle(0, C, zeros(0, W, dtype=torch.bool), zeros(W * C + 1), 0, zeros(1), zeros(1), 0)

    def check_timeout(self) -> None:
        record = recorded(self.error_host, self.engine.error)
        if record:
            raise IntranodeTimeoutError(*describe_timeout(record, self.engine.timeout_s))

    def check_mismatches(self) -> None:
        self.engine.records.raise_if_set(synchronize=False)

    def close(self) -> None:
        """Unmaps the peers' buffers and frees this rank's (call on every rank, after the last op)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        for address in self._opened.values():
            self._own.close_peer(address)
        self._opened = {}
        self._own.free()
