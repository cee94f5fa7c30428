"""What the kernels' engines share to launch: :class:`Launcher` (the typed ``_C`` launch and
what every pipeline builds its launches from: shapes, outputs, rank fields, header checks), the
run of a dispatch through a pipeline (:func:`dispatch_through`), a loopback harness's device and
slot checks, and :class:`RankBuffers`, the interface of a rank's buffers in its own process.
Below it: :mod:`.calls` (a rank's prepared input, one operation's call, their checks and
outputs) and :mod:`.timeouts` (wait bounds and the error record).

:mod:`.intranode` and :mod:`.internode` build their engines on :class:`Launcher` and run every
dispatch through :func:`dispatch_through` (the staged pipeline of :mod:`.experimental` its own
way). Importable without the extension (only the launches need it).
"""

from __future__ import annotations

import abc
import os
from collections.abc import Callable
from typing import ClassVar

import torch
import torch.distributed as dist

from ..._ext import require_extension
from ...config import Config, check_config
from ...kernel_layout import MAX_TOPK, max_slot_bytes
from .calls import (
    CombineCall,
    DispatchCall,
    DispatchShape,
    RankInput,
    alloc_outputs,
    assemble_results,
    check_combine,
    dispatch_header,
    dispatch_shape,
    ptr,
    refusal_input,
)
from .header import OP_CACHED_DISPATCH, OP_COMBINE, OP_DISPATCH, STATUS_INVALID_ARGUMENTS, Records, header_words
from .timeouts import default_timeout_s, timeout_cycles

COOPERATIVE_ENV = "MOE_DISPATCH_COOPERATIVE"
COMBINE_DTYPES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


def resolve_device(device: torch.device | str) -> tuple[torch.device, str]:
    """A loopback harness's device (a CUDA one with its index) and the backend that serves it."""
    device = torch.device(device)
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"device must be a CUDA device or 'cpu' (the kernels' CPU backend), got {str(device)!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"device={str(device)!r} but torch sees no CUDA GPU; pass device='cpu' for the kernels' CPU backend"
            )
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device, "cuda" if device.type == "cuda" else "cpu"


def slot_bytes_for(hidden: int, num_topk: int, element_bytes: int, config: Config | None, *, min_topk: int = 0) -> int:
    """The slot size of a buffer for rows up to ``hidden`` x ``element_bytes`` and ``num_topk``
    (at least ``min_topk``); checks the constructor arguments the transports share."""
    check_config(config)
    if not isinstance(hidden, int) or isinstance(hidden, bool) or hidden < 1:
        raise ValueError(f"hidden must be a positive int (the largest row to move, in elements), got {hidden!r}")
    if not isinstance(num_topk, int) or isinstance(num_topk, bool) or not min_topk <= num_topk <= MAX_TOPK:
        raise ValueError(f"num_topk must be an int in [{min_topk}, {MAX_TOPK}], got {num_topk!r}")
    if element_bytes not in (2, 4):
        raise ValueError(f"element_bytes must be 2 (bf16/fp16 rows) or 4 (fp32 rows), got {element_bytes!r}")
    return max_slot_bytes(hidden, num_topk, element_bytes=element_bytes)


class Launcher:
    """What every engine's launches share: device and backend, stream, cooperative launch, the
    wait bound and the error record (``int32[16]`` on the launch device, ``error_host_ptr``: a
    pinned mirror's device address, or None), and what every pipeline's operation builds its
    launches from (shapes, outputs, rank fields, header checks). A subclass sets ``slot_bytes``
    (its slots' capacity), ``config`` and ``buffers``."""

    # How the argument errors name the slots, and what the caller does about a row too wide.
    slots: ClassVar[str] = "the buffer's slots"
    fix: ClassVar[str] = "size the Buffer"
    slot_bytes: int

    def __init__(
        self,
        error: torch.Tensor,
        error_host_ptr: int | None,
        backend: str,
        timeout_s: float,
        cpu_options: dict | None,
        records: Records,
        rank_begin: int = 0,
    ):
        self.error, self.error_host_ptr = error, error_host_ptr
        self.backend, self.cpu_options = backend, dict(cpu_options or {})  # CpuOptions fields
        self.device = error.device
        self.cooperative = os.environ.get(COOPERATIVE_ENV, "1") != "0"
        self.records, self.record_base = records, rank_begin  # records[r - rank_begin]: rank r's
        self.launches = 0  # kernel launches so far (a refusal only happens before any)
        self.next_dispatch_id = 1  # the default identity of the next fresh dispatch
        self.set_timeout(timeout_s)

    @property
    def slot_flags(self) -> bool:
        """What the headers say of ready flags: the intranode kernels' ``Config.slot_flags``; the
        internode kernels have none."""
        return False

    def check_fields(self, rank: int, header: list[int]) -> dict:
        """A launched rank's ``check`` field: its ``_C.Check`` (header.Records.fields)."""
        return {"check": require_extension().Check(**self.records.fields(rank - self.record_base, header))}

    def combine_check(
        self, rank: int, handle, y_bytes: int, dtype: torch.dtype, num_channels: int, status: int
    ) -> dict:
        """The ``check`` field of launched rank ``rank``'s combine of ``handle``'s dispatch
        (``y_bytes`` rows of ``dtype``; header.py)."""
        header = header_words(
            OP_COMBINE,
            handle.dispatch_id,
            y_bytes,
            dtype,
            0,
            handle.num_experts,
            num_channels,
            slot_flags=self.slot_flags,
            status=status,
        )
        return self.check_fields(rank, header)

    def dispatch_check(
        self, op: int, dispatch_id: int, inp: RankInput, num_experts: int, num_channels: int, status: int, budget=-1
    ) -> dict:
        """The ``check`` field of ``inp``'s rank in a dispatch launch (``op``: OP_DISPATCH or
        OP_CACHED_DISPATCH; :func:`~.calls.dispatch_header`)."""
        header = dispatch_header(op, dispatch_id, inp, num_experts, num_channels, status, self.slot_flags, budget)
        return self.check_fields(inp.rank, header)

    def dispatch_shape(self, inputs: list[RankInput]) -> DispatchShape:
        """:func:`~.calls.dispatch_shape` of ``inputs`` in this engine's slots."""
        return dispatch_shape(inputs, self.slot_bytes, self.slots, self.fix)

    def dispatch_fields(self, call: DispatchCall, inp: RankInput, handle, out: dict) -> dict:
        """The fields every dispatch launch's rank struct shares: inputs, outputs (``out``), the
        handle's routing (``routing_fields()``) and the header check. A handle's first launch after
        its notify alone reuses the notify's verdicts (``peer_ok``; its ``notified`` flag is
        cleared); a later one exchanges headers in the kernel."""
        fresh, handle.notified = handle.notified, False
        op = OP_DISPATCH if fresh else OP_CACHED_DISPATCH
        status = call.statuses.get(inp.rank, 0)
        return {
            "x": ptr(inp.x),
            "x_scales": ptr(inp.scales),
            "topk_idx": ptr(inp.topk_idx),
            "topk_weights": ptr(inp.topk_weights),
            "recv_x": ptr(out["x"]),
            "recv_scales": ptr(out["scales"]),
            "recv_topk_idx": ptr(out["topk_idx"]),
            "recv_topk_weights": ptr(out["topk_weights"]) if inp.topk_weights is not None else None,
            "recv_src_idx": ptr(out["src_idx"]),
            "num_recv_per_expert": out["per_expert"].data_ptr(),
            "overflow": handle.overflow.data_ptr(),
            "num_tokens": inp.x.shape[0],
            "num_rows": handle.num_rows,
            **handle.routing_fields(),
            "peer_ok": handle.peer_ok.data_ptr() if fresh else None,
            **self.dispatch_check(op, handle.dispatch_id, inp, call.num_experts, handle.num_channels, status),
        }

    def notify_outputs(self, call: DispatchCall, experts_per_rank: int) -> list[dict] | None:
        """The receive tensors whose padding rows a fresh dispatch's notify fills: in budget mode
        ``call.outs``, made here where None; without a budget none (``call.outs`` cleared)."""
        if call.budget < 0:
            call.outs = None
        elif call.outs is None:
            call.outs = [alloc_outputs(inp, call.budget, experts_per_rank, self.device) for inp in call.inputs]
        return call.outs

    def prepare_combine(self, call: CombineCall, handle_type: type) -> tuple[int, torch.dtype, int]:
        """``(hidden, dtype, y_bytes)`` of a combine in this engine's slots whose handles must be
        ``handle_type`` (see :func:`~.calls.check_combine`); makes ``call.outs`` (``[T, H]`` per rank)
        where None."""
        for i, h in enumerate(call.handles):
            if not isinstance(h, handle_type):
                raise ValueError(
                    f"rank {call.rank_begin + i}: the handle must be a {handle_type.__name__} (of a dispatch on "
                    f"this transport), got {type(h).__name__}"
                )
        hidden, dtype, y_bytes = check_combine(call, self.device, self.slot_bytes, self.slots)
        if call.outs is None:
            call.outs = [torch.empty(h.num_tokens, hidden, dtype=dtype, device=self.device) for h in call.handles]
        return hidden, dtype, y_bytes

    def combine_ranks(self, struct: str, call: CombineCall, y_bytes: int, dtype: torch.dtype) -> list:
        """Per launched rank of ``call`` its ``_C.<struct>`` (``CombineRank``, ``FusedCombineRank``):
        its y, row scale and output (``call.outs``), its handle's routing (``routing_fields()``)
        and header check."""
        make, row_bytes = getattr(require_extension(), struct), call.row_bytes or y_bytes
        ranks = range(call.rank_begin, call.rank_begin + len(call.ys))
        return [
            make(
                y=ptr(y),
                row_scale=ptr(s.contiguous()) if s is not None else None,
                **h.routing_fields(),
                out=ptr(out),
                num_tokens=h.num_tokens,
                num_rows=h.num_rows,
                **self.combine_check(r, h, row_bytes, dtype, h.num_channels, call.statuses.get(r, 0)),
            )
            for r, y, h, s, out in zip(ranks, call.ys, call.handles, call.row_scales, call.outs)
        ]

    def dispatch_ids(self, given: list[int | None] | None, count: int) -> list[int]:
        """The identities of a fresh dispatch's ``count`` launched ranks: ``given`` (per rank), or
        the next of this engine's sequence (every rank counts the same) for all."""
        if given is None:
            self.next_dispatch_id += 1
            return [self.next_dispatch_id - 1] * count
        for dispatch_id in given:
            if not isinstance(dispatch_id, int) or isinstance(dispatch_id, bool):
                raise ValueError(
                    f"dispatch_id must be an int (the same on every rank for the same dispatch), got {dispatch_id!r}"
                )
        return list(given)

    def set_timeout(self, timeout_s: float) -> None:
        """Bound of every wait from the next launch on (clock64 cycles on the GPU, ns on CPU)."""
        self.timeout_cycles = timeout_cycles(self.backend, self.device, timeout_s)
        self.timeout_s = float(timeout_s)

    def _common(self, struct: str, num_channels: int, rank_begin: int, skip_rank: int | None, **fields):
        """The launch's ``_C.<struct>`` (``IntranodeCommon`` or ``InternodeCommon``): the engine's
        own ``fields`` and those both carry."""
        return getattr(require_extension(), struct)(
            **fields,
            num_channels=num_channels,
            rank_begin=rank_begin,
            skip_rank=-1 if skip_rank is None else skip_rank,
            chunk_tokens=self.config.chunk_tokens,
            l2_discard=int(self.config.l2_discard),
            variant=require_extension().Variant(**self.config.variant_fields()),
            timeout_cycles=self.timeout_cycles,
            buffers=self.buffers,
            error=self.error.data_ptr(),
            error_host=self.error_host_ptr,
        )

    def _stream(self) -> int:
        return torch.cuda.current_stream(self.device).cuda_stream if self.backend == "cuda" else 0

    def _backend_args(self) -> tuple:
        """What every ``_C`` launch takes after its own arguments, before the stream."""
        return (self.backend,)

    def _run_combine(self, name: str, common, ranks: list, y_bytes: int, dtype: torch.dtype) -> None:
        """Launches combine ``_C.<name>`` of ``y_bytes`` rows of ``dtype`` (bf16, fp16 or fp32)."""
        self._run(name, common, ranks, y_bytes, COMBINE_DTYPES[dtype])

    def _run(self, name: str, *args, cpu_options: bool = True) -> None:
        """Calls ``_C.<name>`` with ``args`` and the launch settings (a notify takes no CPU options)."""
        self.launches += 1
        extra = (self._cpu_options(),) if cpu_options else ()
        getattr(require_extension(), name)(*args, *self._backend_args(), self._stream(), self.cooperative, *extra)

    def _cpu_options(self):
        return require_extension().CpuOptions(**self.cpu_options)

    def read_error(self) -> list[int] | None:
        """The error record if a wait timed out (reads the device: a host sync)."""
        record = self.error.tolist()
        return record if record[0] or record[1] else None


def dispatch_through(engine, call: DispatchCall, notify, launch, result_type: type, handle_type: type) -> list:
    """A pipeline's dispatch on ``engine`` (its ``world_size`` and ``device``): a fresh one's
    ``notify(engine, call)`` (fills ``call.handles``), a cached one's handles checked (one
    ``handle_type`` per rank, for the rank's tokens unless it refuses); then the outputs where
    ``call.outs`` has none, ``launch(engine, call)``, and per rank a ``result_type``."""
    inputs, handles = call.inputs, call.handles
    if handles is None:
        notify(engine, call)
    elif len(handles) != len(inputs):
        raise ValueError(f"pass one handle per rank: {len(inputs)} inputs, {len(handles)} handles")
    else:
        for inp, h in zip(inputs, handles):
            if not isinstance(h, handle_type) or (h.num_tokens != inp.x.shape[0] and inp.rank not in call.statuses):
                raise ValueError(
                    f"rank {inp.rank}: the handle is not an {handle_type.__name__} for {inp.x.shape[0]} tokens "
                    f"(of a dispatch on these buffers)"
                )
    if call.outs is None:
        experts_per_rank, device = call.num_experts // engine.world_size, engine.device
        call.outs = [alloc_outputs(inp, h.num_rows, experts_per_rank, device) for inp, h in zip(inputs, call.handles)]
    launch(engine, call)
    return assemble_results(result_type, inputs, call.handles, call.outs)


class RankBuffers(abc.ABC):
    """This process's rank of the kernels, one rank per process: its communication buffers
    (shared with the peers' processes), the engine over them, and each operation for this one
    rank. :class:`~moe_dispatch.transport.kernels.transport.KernelTransport` drives one; so do the
    tests' :mod:`moe_dispatch.testing.ranks`.

    Subclasses: ``intranode.IntranodeBuffers`` (one node) and ``internode.InternodeBuffers``
    (several): each builds its buffers and ``engine`` (:meth:`_build`) and names its topology's
    operations on that engine (``_notify``, ``_launch``, ``_dispatch``, ``_combine``: a
    :class:`~.calls.DispatchCall` or :class:`~.calls.CombineCall` for this one rank). Every operation is
    collective (every rank of the group calls it) and launches at once; none checks its
    arguments against the peers' on the host (the kernels' headers do, on the device).

    Args:
        group: the EP process group; W = its size.
        rank: this rank's index in the group.
        hidden, num_topk, element_bytes: the largest rows these buffers move (sizes slots).
        config: :class:`Config`; every rank must pass the same.
        timeout_s: bound of every wait inside the kernels (default :func:`~.timeouts.default_timeout_s`).
        device: where buffers, inputs and outputs live: None (the current CUDA device), a
            CUDA device, or ``"cpu"``.
        build: the subclass's own keywords (:meth:`_build`).

    Raises:
        ValueError: hidden, num_topk or element_bytes out of range, or a device that is neither
            CUDA nor CPU; TypeError: config is no Config; RuntimeError: a CUDA device without a
            GPU (and what :meth:`_build` raises).

    Attributes:
        group, rank, world_size, device, config, timeout_s: as constructed (W: the group's size).
        rows: ``(hidden, num_topk, element_bytes)``, the largest rows the buffers move.
        engine: what the operations launch on (the subclass's engine, or engines).

    Collective: every rank constructs it together.
    """

    min_topk: ClassVar[int] = 0  # the fewest top-k entries a slot holds
    # The topology's operations (static methods), each on (self.engine, a call of this rank):
    _notify: ClassVar[Callable]  # a fresh dispatch's notify: fills call.handles
    _launch: ClassVar[Callable]  # the dispatch launch on call.handles into call.outs
    _dispatch: ClassVar[Callable]  # a whole dispatch -> per rank its result
    _combine: ClassVar[Callable]  # a combine -> per rank its [T, H] output

    def __init__(
        self,
        group: dist.ProcessGroup,
        rank: int,
        hidden: int,
        num_topk: int,
        *,
        config: Config | None = None,
        element_bytes: int = 2,
        timeout_s: float | None = None,
        device: torch.device | str | None = None,
        **build,
    ):
        self.group, self.rank, self.world_size = group, rank, dist.get_world_size(group)
        self.rows = (hidden, num_topk, element_bytes)
        slot_bytes = slot_bytes_for(hidden, num_topk, element_bytes, config, min_topk=self.min_topk)
        self.config = config or Config()
        self.device, _ = resolve_device("cuda" if device is None else device)  # before anything collective
        self.timeout_s = default_timeout_s(timeout_s)
        self._build(slot_bytes, **build)

    @abc.abstractmethod
    def _build(self, slot_bytes: int, **build) -> None:
        """Checks what the topology needs, then (collective) makes the buffers and ``engine``."""

    @property
    @abc.abstractmethod
    def launches(self) -> int:
        """Kernel launches on these buffers so far (a refusal only happens before any)."""

    @property
    @abc.abstractmethod
    def records(self) -> list[Records]:
        """The mismatch records the launches write (header.py)."""

    def notify(
        self,
        inp: RankInput,
        num_experts: int,
        *,
        num_sms: int,
        num_worst_tokens: int | None,
        dispatch_id: int,
        outs: dict | None = None,
    ):
        """A fresh dispatch's notify of ``inp``: returns its handle, for :meth:`launch_dispatch`.
        Without a budget (``num_worst_tokens`` None) the host reads the receive count; with one,
        nothing waits for the host and notify fills the padding rows of ``outs`` (the dict of
        :func:`~.calls.alloc_outputs`; None: no tables)."""
        call = DispatchCall(
            inputs=[inp],
            num_experts=num_experts,
            num_sms=num_sms,
            num_worst_tokens=num_worst_tokens,
            dispatch_ids=[dispatch_id],
            outs=[outs] if outs else None,
        )
        self._notify(self.engine, call)
        return call.handles[0]

    def launch_dispatch(self, inp: RankInput, handle, outs: dict, num_experts: int) -> None:
        """The dispatch launch of ``inp`` on ``handle`` into ``outs`` (the dict of
        :func:`~.calls.alloc_outputs`, whose tensors may be views of the caller's)."""
        self._launch(self.engine, DispatchCall(inputs=[inp], num_experts=num_experts, handles=[handle], outs=[outs]))

    def dispatch(
        self,
        inp: RankInput,
        num_experts: int,
        *,
        num_sms: int,
        handle=None,
        num_worst_tokens: int | None = None,
        dispatch_id: int | None = None,
        statuses: dict[int, int] | None = None,
    ):
        """A whole dispatch of ``inp``: notify (unless ``handle`` is given: a cached dispatch),
        then the dispatch launch into new outputs; returns this rank's result. ``statuses``:
        rank -> non-zero header status (a refusing rank's, see :meth:`refuse`)."""
        call = DispatchCall(
            inputs=[inp],
            num_experts=num_experts,
            num_sms=num_sms,
            handles=[handle] if handle is not None else None,
            num_worst_tokens=num_worst_tokens,
            dispatch_ids=[dispatch_id] if dispatch_id is not None else None,
            statuses=statuses,
        )
        return self._dispatch(self.engine, call)[0]

    def combine(
        self,
        y: torch.Tensor,
        handle,
        row_scale: torch.Tensor | None = None,
        statuses: dict[int, int] | None = None,
        row_bytes: int | None = None,
    ) -> torch.Tensor:
        """Combine of ``y [handle.num_rows, H]`` (times ``row_scale``, fp32) onto this rank's
        tokens: ``[T, H]`` in y's dtype. ``row_bytes``: what the header says of a row, the
        caller's before padding (None: y's)."""
        call = CombineCall(
            rank_begin=self.rank,
            ys=[y],
            handles=[handle],
            row_scales=[row_scale],
            statuses=statuses,
            row_bytes=row_bytes,
        )
        return self._combine(self.engine, call)[0]

    @abc.abstractmethod
    def empty_handle(self):
        """A handle of no tokens and no rows (a refusing rank's stand-in)."""

    @abc.abstractmethod
    def check_timeout(self) -> None:
        """Raises the timeout error a launch recorded (``IntranodeTimeoutError`` /
        ``InternodeTimeoutError``), without a device synchronisation (:func:`~.timeouts.recorded`)."""

    @abc.abstractmethod
    def check_mismatches(self) -> None:
        """Raises :class:`~moe_dispatch.transport.kernels.header.MismatchError` for a recorded
        mismatch (the pinned mirrors on a GPU: no device synchronisation)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Frees the buffers (collective: every rank, after its last launch)."""

    def check_errors(self, mismatches: bool = True) -> None:
        """Raises a recorded timeout, then (``mismatches``) a recorded header mismatch. Reads host
        memory only: call it after the launches completed to see theirs."""
        self.check_timeout()
        if mismatches:
            self.check_mismatches()

    def refuse(self, op: int, status: int = STATUS_INVALID_ARGUMENTS) -> None:
        """Runs operation ``op`` (header.py's OP_*) with no tokens and header ``status`` (default
        STATUS_INVALID_ARGUMENTS): the peers skip this rank at once and record why (a fresh
        dispatch runs its notify too). Collective, as the operation; raises a CommError when a
        peer does not take part either."""
        statuses = {self.rank: status}
        inp = refusal_input(self.rank, self.world_size, self.device)
        if op == OP_COMBINE:
            self.combine(inp.x, self.empty_handle(), None, statuses)
        else:
            handle = None if op == OP_DISPATCH else self.empty_handle()
            self.dispatch(inp, self.world_size, num_sms=self.config.num_sms, handle=handle, statuses=statuses)
