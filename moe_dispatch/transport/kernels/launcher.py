"""What the kernels' engines share to launch: :class:`Launcher` (the typed ``_C`` launch and
what every pipeline builds its launches from: shapes, outputs, rank fields, header checks), wait
bounds and timeout records, pointer and alignment checks, a rank's prepared dispatch input
(:class:`RankInput`), one operation's call for its launched ranks (:class:`DispatchCall`,
:class:`CombineCall`), the assembly of a dispatch's results, and :class:`RankBuffers`, the
interface of a rank's buffers in its own process.

:mod:`.intranode` and :mod:`.internode` build their engines on :class:`Launcher` and run every
dispatch through :func:`dispatch_through` (the staged pipeline of :mod:`.experimental` its own
way); the tests' harnesses (:mod:`moe_dispatch.testing`) prepare their inputs with
:func:`prepare_input`. Importable without the extension (only the launches need it).
"""

from __future__ import annotations

import abc
import dataclasses
import math
import os
from collections.abc import Callable
from typing import ClassVar, NamedTuple

import torch
import torch.distributed as dist

from ..._ext import require_extension
from ...config import Config, check_config
from ...kernel_layout import MAX_TOPK, max_slot_bytes, slot_layout
from .header import OP_CACHED_DISPATCH, OP_COMBINE, OP_DISPATCH, STATUS_INVALID_ARGUMENTS, Records, header_words

TIMEOUT_ENV = "MOE_DISPATCH_KERNEL_TIMEOUT_S"
COOPERATIVE_ENV = "MOE_DISPATCH_COOPERATIVE"
DEFAULT_TIMEOUT_S = 100.0
# What a kernel time-out leaves and what a Buffer user does (the loopback test harnesses have reset()).
AFTER_TIMEOUT = (
    "the communication buffers are now in an undefined state: the Buffer is broken, close() it on every rank "
    "and make a new Buffer"
)
FP8_BLOCK = 128
COMBINE_DTYPES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}

# ---------------------------------------------------------------------------------------------
# Timeouts: the kernels' error record (int32[16], csrc/kernels/intranode.cuh ErrorRecord)
# ---------------------------------------------------------------------------------------------

_PHASES = {1: "notify", 2: "dispatch", 3: "combine"}
_NODE_PHASES = {
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
_SIGNAL, _TAIL, _HEAD, _HEADER = 1, 2, 3, 4
_COUNTERS = {1: "signal", 2: "tail", 3: "head", 4: "header", 5: "relayed header", 6: "forwarded tail"}


def describe_intranode_timeout(record: list[int], timeout_s: float) -> tuple[str, dict]:
    """The message and fields of a kernel error record (``int32[16]``, see ``ErrorRecord``)."""
    _, phase, role, rank, channel, peer, counter, expected, observed = record[:9]
    if phase == 0:  # the flag without a record: the offering wait could not take the record's lock
        return (
            f"moe_dispatch intranode operation timed out after timeout_s={timeout_s:g}, but the kernel's record "
            f"of which wait it was is missing; {AFTER_TIMEOUT}",
            {
                "phase": None,
                "role": None,
                "rank": None,
                "channel": None,
                "peer": None,
                "counter": None,
                "expected": None,
                "observed": None,
            },
        )
    fields = {
        "phase": _PHASES.get(phase, str(phase)),
        "role": _ROLES.get(role, str(role)),
        "rank": rank,
        "channel": channel,
        "peer": peer,
        "counter": {_SIGNAL: "signal", _TAIL: "tail", _HEAD: "head", _HEADER: "header"}.get(counter, str(counter)),
        "expected": expected,
        "observed": observed,
    }
    where = f"rank {rank} ({fields['role']}, channel {channel})" if channel >= 0 else f"rank {rank}"
    if counter == _SIGNAL:
        what = (
            f"waited at the notify barrier for rank {peer} to arrive (signal[{peer}] of rank {rank}); "
            f"saw {observed} arrivals, needed {expected}"
        )
    elif counter == _TAIL:
        what = (
            f"waited for tokens from rank {peer}: tail of queue rank {peer} -> rank {rank}, channel {channel} "
            f"should reach {expected} but stayed at {observed}"
        )
    elif counter == _HEADER:
        what = f"waited for the header of rank {peer} (its operation never started)"
    else:
        what = (
            f"waited for rank {peer} to free queue slots: head of queue rank {rank} -> rank {peer}, "
            f"channel {channel} should reach {expected} but stayed at {observed}"
        )
    message = (
        f"moe_dispatch intranode {fields['phase']} timed out after timeout_s={timeout_s:g}: {where} {what}. "
        f"Rank {peer} did not take part (crashed, hung, or called another operation); {AFTER_TIMEOUT}."
    )
    return message, fields


def describe_internode_timeout(
    record: list[int], timeout_s: float, ranks_per_node: int, node: int | None = None, fused: bool = False
) -> tuple[str, dict]:
    """Message and fields of an error record (``int32[16]``). ``node``: the node whose intranode
    engine wrote it (staged stage 2: its ranks and peers are local), None for the RDMA engine;
    ``fused``: the record of a fused pipeline's launch (ranks are global)."""
    _, phase, role, rank, channel, peer, counter, expected, observed = record[:9]
    if phase == 0:
        message = (
            f"moe_dispatch internode operation timed out after timeout_s={timeout_s:g}, but the kernel's "
            f"record of which wait it was is missing; {AFTER_TIMEOUT}"
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
        "phase": (_FUSED_PHASES if fused else _NODE_PHASES).get(phase, str(phase)),
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
        f"operation); {AFTER_TIMEOUT}."
    )
    return message, fields


def default_timeout_s(timeout_s: float | None) -> float:
    """``timeout_s``, or ``MOE_DISPATCH_KERNEL_TIMEOUT_S``, or 100: the bound of every wait of a
    loopback harness or a transport made directly, in s.

    Raises:
        ValueError: ``timeout_s`` is None and the variable is set but is no positive number.
    """
    if timeout_s is not None:
        return float(timeout_s)
    return kernel_timeout_s(DEFAULT_TIMEOUT_S)


def kernel_timeout_s(timeout_s: float) -> float:
    """The bound of the kernels' waits under a Buffer, seconds (GPU kernels and the CPU backend
    alike): ``MOE_DISPATCH_KERNEL_TIMEOUT_S`` where set (e.g. 1, to see a hang's record at once
    while the host-side checks keep ``timeout_s``), else the Buffer's ``timeout_s``.

    Raises:
        ValueError: the variable is set but is no positive number.
    """
    value = os.environ.get(TIMEOUT_ENV)
    if not value:
        return timeout_s
    try:
        bound = float(value)
    except ValueError:
        bound = math.nan
    if not (bound > 0 and math.isfinite(bound)):
        raise ValueError(f"{TIMEOUT_ENV} must be a positive number of seconds, got {value!r}")
    return bound


def timeout_cycles(backend: str, device: torch.device, timeout_s: float) -> int:
    """``timeout_s`` as the kernels' wait bound: clock64 cycles of ``device`` ("cuda"), or
    nanoseconds (the CPU backend)."""
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    if backend == "cuda":
        clock_khz = require_extension().device_clock_khz(
            device.index if device.index is not None else torch.cuda.current_device()
        )
        return max(1, int(timeout_s * clock_khz * 1000))
    return max(1, int(timeout_s * 1e9))


# ---------------------------------------------------------------------------------------------
# Devices, slots, pointers
# ---------------------------------------------------------------------------------------------


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


def ptr(t: torch.Tensor | None) -> int | None:
    """A launch field's device address of ``t``: None (null) for None or an empty tensor."""
    return None if t is None or t.numel() == 0 else t.data_ptr()


def check_aligned(name: str, t: torch.Tensor | None, alignment: int) -> None:
    """The kernels move rows in 16-byte vectors (fp8 scales in 4-byte words)."""
    if t is not None and t.numel() and t.data_ptr() % alignment:
        raise ValueError(
            f"{name} must start on a {alignment}-byte boundary, but its data pointer is "
            f"{t.data_ptr() % alignment} bytes past one (a view with a storage offset?); pass .clone()"
        )


# ---------------------------------------------------------------------------------------------
# The launcher and a rank's dispatch input
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class RankInput:
    """A source rank's dispatch input after validation."""

    rank: int
    x: torch.Tensor
    scales: torch.Tensor | None
    topk_idx: torch.Tensor  # [T, K], made contiguous int64 ([T, 0] when no top-k travels)
    topk_weights: torch.Tensor | None
    is_token_in_rank: torch.Tensor  # [T, W] bool, made contiguous
    topk_dtype: torch.dtype | None  # the caller's; None: no topk_idx given
    token_ids: torch.Tensor | None = None  # [T] int32: what receivers record as a row's source token (None: t)
    row_bytes: int | None = None  # the header's row bytes: the caller's row before padding (None: x's)

    def __post_init__(self) -> None:
        # What the launches read, whoever made the input: no copy where it already is.
        self.topk_idx = self.topk_idx.to(torch.int64).contiguous()
        self.is_token_in_rank = self.is_token_in_rank.contiguous()


@dataclasses.dataclass(eq=False, kw_only=True)
class LaunchCall:
    """What the launches of one operation read beyond its rows (a base of
    :class:`DispatchCall` and :class:`CombineCall`).

    Attributes:
        statuses: rank -> non-zero header status: that rank refuses (its inputs are empty).
        skip_rank, skip_phase: tests: ``skip_rank``'s blocks skip the launch of phase
            ``skip_phase`` (None: the pipeline's main kernel).
        check: raise what the launches recorded between them (the staged pipeline).
    """

    statuses: dict[int, int] | None = None
    skip_rank: int | None = None
    skip_phase: str | None = None
    check: bool = False

    def __post_init__(self) -> None:
        self.statuses = self.statuses or {}

    def skip(self, phase: str, main: str) -> int | None:
        """The launch's ``skip_rank`` for phase ``phase`` of a pipeline whose main kernel is ``main``."""
        return self.skip_rank if (self.skip_phase or main) == phase else None


@dataclasses.dataclass(eq=False, kw_only=True)
class DispatchCall(LaunchCall):
    """One dispatch for launched ranks ``inputs[i].rank`` (consecutive); a fresh one's notify
    fills ``handles`` (and ``outs`` in budget mode).

    Attributes:
        inputs: per rank its :class:`RankInput`.
        num_experts: E.
        num_sms: the SM budget of a fresh dispatch (even, at most ``Config.num_sms``).
        handles: per rank a previous dispatch's handle (a cached dispatch: no notify), or None.
        num_worst_tokens: a fresh dispatch's static receive size (budget mode), or None / 0.
        dispatch_ids: per rank a fresh dispatch's identity (None: the engine's next).
        outs: per rank its receive tensors (the dict of :func:`alloc_outputs`, whose tensors
            may be views of the caller's; notify writes only the top-k ids, weights and source
            indices), or None: allocated.
    """

    inputs: list[RankInput]
    num_experts: int
    num_sms: int = 0
    handles: list | None = None
    num_worst_tokens: int | None = None
    dispatch_ids: list[int | None] | None = None
    outs: list[dict] | None = None

    @property
    def budget(self) -> int:
        """The kernels' row budget: -1 for none, else ``num_worst_tokens`` (:func:`check_budget`)."""
        return check_budget(self.num_worst_tokens)

    def handle_fields(self, inp: RankInput, dispatch_id: int, num_channels: int) -> dict:
        """The fields every kernel handle of this fresh dispatch takes from rank ``inp``: its tokens
        and layout, the dispatch's identity and E (header.py), the caller's top-k id dtype."""
        return {
            "num_tokens": inp.x.shape[0],
            "num_channels": num_channels,
            "is_token_in_rank": inp.is_token_in_rank,
            "dispatch_id": dispatch_id,
            "num_experts": self.num_experts,
            "topk_dtype": inp.topk_dtype or torch.int64,
        }


@dataclasses.dataclass(eq=False, kw_only=True)
class CombineCall(LaunchCall):
    """One combine for launched ranks ``rank_begin + i``: ``ys[i]`` ``[handles[i].num_rows, H]``
    (times ``row_scales[i]`` ``[num_rows]`` fp32, if any) summed onto the rank's tokens.

    Attributes:
        rank_begin: the first launched rank.
        ys, handles, row_scales: per rank (``row_scales`` None: none).
        row_bytes: what the headers say of a row, the caller's before padding (None: y's).
        outs: per rank the ``[T, H]`` contiguous output, or None: made.
    """

    rank_begin: int
    ys: list[torch.Tensor]
    handles: list
    row_scales: list[torch.Tensor | None] | None = None
    row_bytes: int | None = None
    outs: list[torch.Tensor] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self.row_scales = self.row_scales or [None] * len(self.ys)


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
        OP_CACHED_DISPATCH; :func:`dispatch_header`)."""
        header = dispatch_header(op, dispatch_id, inp, num_experts, num_channels, status, self.slot_flags, budget)
        return self.check_fields(inp.rank, header)

    def dispatch_shape(self, inputs: list[RankInput]) -> DispatchShape:
        """:func:`dispatch_shape` of ``inputs`` in this engine's slots."""
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
        ``handle_type`` (see :func:`check_combine`); makes ``call.outs`` (``[T, H]`` per rank)
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


def check_num_sms(num_sms: int, config: Config) -> int:
    """The channels of a call with ``num_sms`` SMs (even, at most ``config.num_sms``); ValueError otherwise."""
    if not isinstance(num_sms, int) or num_sms < 2 or num_sms % 2 or num_sms > config.num_sms:
        raise ValueError(
            f"num_sms must be even and in [2, {config.num_sms}] (the Buffer's Config.num_sms), got {num_sms!r}"
        )
    return num_sms // 2


def check_budget(num_worst_tokens) -> int:
    """The kernels' row budget: -1 for none (None or 0, as in Buffer.dispatch), else the int."""
    if num_worst_tokens is not None and (
        not isinstance(num_worst_tokens, int) or isinstance(num_worst_tokens, bool) or num_worst_tokens < 0
    ):
        raise ValueError(
            f"num_worst_tokens must be None or an int >= 0 (None, or 0 as in Buffer.dispatch: no "
            f"budget, the host reads the receive count), got {num_worst_tokens!r}"
        )
    return int(num_worst_tokens) if num_worst_tokens else -1


def prepare_input(
    rank: int,
    x,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor | None,
    num_experts: int,
    world_size: int,
    device: torch.device,
    validate: bool = True,
    handle=None,
) -> RankInput:
    """Rank ``rank``'s dispatch input, checked: ``x`` (``[T, H]`` rows or the fp8 pair ``(x
    [T, H] e4m3, scales [T, H / 128] fp32)``, rows a multiple of 16 bytes on 16-byte addresses),
    ``topk_idx`` (``[T, K]`` int32/int64, K <= 32; its values checked against ``num_experts``
    when ``validate``, a host sync) and ``topk_weights`` (``[T, K]`` fp32 or None). With a
    ``handle`` (any transport's: its ``is_token_in_rank`` is replayed) ``topk_idx`` may be None:
    a cached dispatch of x alone. Raises ValueError / TypeError naming the argument."""
    from ...ops.layout import get_dispatch_layout
    from ...ops.quant import check_fp8_pair
    from ...semantics.validation import check_hidden, check_topk_idx, check_topk_weights

    if isinstance(x, tuple):
        if len(x) != 2:
            raise ValueError(f"rank {rank}: an fp8 x must be the tuple (x_fp8, scales), got a tuple of {len(x)}")
        check_fp8_pair(*x, block_size=FP8_BLOCK, device=device)
        x, scales = x
    else:
        check_hidden(f"x (rank {rank})", x, device)
        scales = None
    if x.shape[1] * x.element_size() % 16:
        raise ValueError(
            f"rank {rank}: rows of x must be a multiple of 16 bytes, got {x.shape[1]} x "
            f"{x.element_size()} bytes; pad the hidden size"
        )
    check_aligned(f"x (rank {rank})", x, 16)
    check_aligned(f"scales (rank {rank})", scales, 4)
    if topk_idx is None:  # a cached dispatch of x alone: no top-k fields travel
        if handle is None:
            raise ValueError(f"rank {rank}: topk_idx is required unless replaying a handle (cached dispatch)")
        if topk_weights is not None:
            raise ValueError(f"rank {rank}: topk_weights without topk_idx")
        return RankInput(
            rank,
            x,
            scales,
            torch.empty(x.shape[0], 0, dtype=torch.int64, device=device),
            None,
            handle.is_token_in_rank,
            None,
        )
    if validate:  # reads topk_idx on the host: skipped under CUDA-graph capture
        check_topk_idx(topk_idx, num_experts, num_tokens=x.shape[0], device=device)
    elif topk_idx.dim() != 2 or topk_idx.shape[0] != x.shape[0]:
        raise ValueError(f"rank {rank}: topk_idx has shape {list(topk_idx.shape)} but x has {x.shape[0]} tokens")
    if topk_idx.shape[1] > MAX_TOPK:
        raise ValueError(f"rank {rank}: top-k must be <= {MAX_TOPK}, got {topk_idx.shape[1]}")
    if topk_weights is not None:
        check_topk_weights(topk_weights, topk_idx, device=device)
    if handle is not None:  # a cached dispatch replays the handle's routing
        is_token_in_rank = handle.is_token_in_rank
    else:
        is_token_in_rank = get_dispatch_layout(topk_idx, num_experts, world_size, world_size, validate=False)[3]
    return RankInput(rank, x, scales, topk_idx, topk_weights, is_token_in_rank, topk_idx.dtype)


class DispatchShape(NamedTuple):
    """The rows of a dispatch launch: ``hidden`` elements, ``num_topk``, and the bytes of a row's
    x and fp8 scales (what each engine's dispatch launch takes)."""

    hidden: int
    num_topk: int
    x_bytes: int
    scale_bytes: int

    @property
    def launch_args(self) -> tuple[int, int, int]:
        """What a dispatch launch takes of it: ``(x_bytes, scale_bytes, num_topk)``."""
        return self.x_bytes, self.scale_bytes, self.num_topk


def dispatch_shape(
    inputs: list[RankInput], slot_bytes: int, slots: str = "the buffer's slots", fix: str = "size the Buffer"
) -> DispatchShape:
    """The :class:`DispatchShape` of a dispatch launch: every rank must move the same rows, and a
    slot (of ``slot_bytes``) must hold one."""
    first = inputs[0]
    hidden, dtype = first.x.shape[1], first.x.dtype
    num_topk = first.topk_idx.shape[1]
    for inp in inputs:
        if (
            inp.x.shape[1] != hidden
            or inp.x.dtype != dtype
            or inp.topk_idx.shape[1] != num_topk
            or (inp.scales is None) != (first.scales is None)
        ):
            raise ValueError(
                f"every rank must dispatch the same hidden size, dtype and top-k: rank {inp.rank} has "
                f"[{inp.x.shape[1]}] {inp.x.dtype} top-{inp.topk_idx.shape[1]}, rank {first.rank} has "
                f"[{hidden}] {dtype} top-{num_topk}"
            )
    x_bytes = hidden * first.x.element_size()
    scale_bytes = 4 * (hidden // FP8_BLOCK) if first.scales is not None else 0
    need = slot_layout(x_bytes, scale_bytes, num_topk).slot_bytes
    if need > slot_bytes:
        raise ValueError(
            f"a dispatch slot for hidden {hidden} x {first.x.element_size()} bytes, top-{num_topk} needs "
            f"{need} bytes but {slots} hold {slot_bytes}; {fix} for it"
        )
    return DispatchShape(hidden, num_topk, x_bytes, scale_bytes)


def dispatch_header(
    op: int,
    identity: int,
    inp: RankInput,
    num_experts: int,
    num_channels: int,
    status: int,
    slot_flags: bool = False,
    budget: int = -1,
) -> list[int]:
    """The header words of a dispatch of ``inp`` (header.py); ``slot_flags``: the intranode
    kernels' Config.slot_flags (the internode kernels have no ready flags); ``budget``: a fresh
    dispatch's notify, its static receive size (-1: none)."""
    return header_words(
        op,
        identity,
        inp.row_bytes if inp.row_bytes is not None else inp.x.shape[1] * inp.x.element_size(),
        inp.x.dtype,
        inp.topk_idx.shape[1],
        num_experts,
        num_channels,
        weights=inp.topk_weights is not None,
        slot_flags=slot_flags,
        status=status,
        budget=max(budget, 0),
    )


def alloc_outputs(inp: RankInput, rows: int, experts_per_rank: int, device: torch.device) -> dict:
    """A dispatch's receive tensors for ``rows`` rows of ``inp``'s shape: ``x`` ``[rows, H]`` (its
    dtype), ``scales`` ``[rows, H / 128]`` fp32 (fp8) or None, ``topk_idx`` ``[rows, K]`` int64,
    ``topk_weights`` ``[rows, K]`` fp32, ``src_idx`` ``[rows]`` int32, ``per_expert`` zeroed
    ``[E / W]`` int64."""
    hidden, num_topk = inp.x.shape[1], inp.topk_idx.shape[1]
    return {
        "x": torch.empty(rows, hidden, dtype=inp.x.dtype, device=device),
        "scales": (
            torch.empty(rows, hidden // FP8_BLOCK, dtype=torch.float32, device=device)
            if inp.scales is not None
            else None
        ),
        "topk_idx": torch.empty(rows, num_topk, dtype=torch.int64, device=device),
        "topk_weights": torch.empty(rows, num_topk, dtype=torch.float32, device=device),
        "src_idx": torch.empty(rows, dtype=torch.int32, device=device),
        "per_expert": torch.zeros(experts_per_rank, dtype=torch.int64, device=device),
    }


def assemble_results(result_type: type, inputs: list[RankInput], handles: list, outs: list[dict]) -> list:
    """Per rank a ``result_type`` (:class:`RankDispatch` or the internode one) from its outputs:
    top-k ids back in the caller's dtype, None for what did not travel."""
    results = []
    for inp, h, o in zip(inputs, handles, outs):
        recv_x = (o["x"], o["scales"]) if inp.scales is not None else o["x"]
        if inp.topk_dtype is None:
            topk = None
        else:
            topk = o["topk_idx"] if inp.topk_dtype == torch.int64 else o["topk_idx"].to(inp.topk_dtype)
        results.append(
            result_type(
                recv_x,
                topk,
                o["topk_weights"] if inp.topk_weights is not None else None,
                o["src_idx"],
                o["per_expert"],
                h,
            )
        )
    return results


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


def check_combine(
    call: CombineCall, device: torch.device, slot_bytes: int, slots: str = "the buffer's slots"
) -> tuple[int, torch.dtype, int]:
    """``(hidden, dtype, y_bytes)`` of a combine launch: every rank's y and row_scale fit its
    handle, the ranks agree, and a slot (of ``slot_bytes``) holds a row."""
    from ...semantics.validation import check_hidden

    ys, handles, rank_begin = call.ys, call.handles, call.rank_begin
    if len(ys) != len(handles):
        raise ValueError(f"pass one y per handle: {len(ys)} ys, {len(handles)} handles")
    hidden, dtype = ys[0].shape[1], ys[0].dtype
    for i, (y, h, s) in enumerate(zip(ys, handles, call.row_scales)):
        check_hidden(
            f"y (rank {rank_begin + i})", y, device, num_rows=h.num_rows, rows_what="the handle (rows received)"
        )
        if y.shape[1] != hidden or y.dtype != dtype:
            raise ValueError(
                f"every rank must combine the same hidden size and dtype: rank {rank_begin + i} has "
                f"[{y.shape[1]}] {y.dtype}, rank {rank_begin} has [{hidden}] {dtype}"
            )
        check_aligned(f"y (rank {rank_begin + i})", y, 16)  # the kernels read rows with 16-byte vectors
        if s is not None and (s.dtype != torch.float32 or tuple(s.shape) != (h.num_rows,) or s.device != device):
            raise ValueError(
                f"row_scale of rank {rank_begin + i} must be [{h.num_rows}] fp32 on {device}, got "
                f"{list(s.shape)} {s.dtype} on {s.device}"
            )
    y_bytes = hidden * ys[0].element_size()
    if y_bytes % 16:
        raise ValueError(f"rows of y must be a multiple of 16 bytes, got {hidden} x {ys[0].element_size()} bytes")
    if slot_layout(y_bytes).slot_bytes > slot_bytes:
        raise ValueError(
            f"a combine slot for hidden {hidden} x {ys[0].element_size()} bytes needs "
            f"{slot_layout(y_bytes).slot_bytes} bytes but {slots} hold {slot_bytes}"
        )
    return hidden, dtype, y_bytes


def refusal_input(rank: int, world_size: int, device: torch.device) -> RankInput:
    """The input of a rank that refuses its own arguments: no tokens (its peers skip it)."""
    return RankInput(
        rank,
        torch.zeros(0, 8, dtype=torch.bfloat16, device=device),
        None,
        torch.zeros(0, 1, dtype=torch.int64, device=device),
        None,
        torch.zeros(0, world_size, dtype=torch.bool, device=device),
        torch.int64,
    )


def recorded(mirror: torch.Tensor | None, record: torch.Tensor) -> list[int] | None:
    """A kernel error record as ints, or None when clear, read without a device synchronisation:
    from its pinned host mirror on a GPU (whose flag is written last), from the record itself on
    the CPU backend (host memory)."""
    values = (mirror if mirror is not None else record).numpy().tolist()
    return values if values[0] or (mirror is None and values[1]) else None


class RankBuffers(abc.ABC):
    """This process's rank of the kernels, one rank per process: its communication buffers
    (shared with the peers' processes), the engine over them, and each operation for this one
    rank. :class:`~moe_dispatch.transport.kernels.transport.KernelTransport` drives one; so do the
    tests' :mod:`moe_dispatch.testing.ranks`.

    Subclasses: ``intranode.IntranodeBuffers`` (one node) and ``internode.InternodeBuffers``
    (several): each builds its buffers and ``engine`` (:meth:`_build`) and names its topology's
    operations on that engine (``_notify``, ``_launch``, ``_dispatch``, ``_combine``: a
    :class:`DispatchCall` or :class:`CombineCall` for this one rank). Every operation is
    collective (every rank of the group calls it) and launches at once; none checks its
    arguments against the peers' on the host (the kernels' headers do, on the device).

    Args:
        group: the EP process group; W = its size.
        rank: this rank's index in the group.
        hidden, num_topk, element_bytes: the largest rows these buffers move (sizes slots).
        config: :class:`Config`; every rank must pass the same.
        timeout_s: bound of every wait inside the kernels (default :func:`default_timeout_s`).
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
        :func:`alloc_outputs`; None: no tables)."""
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
        :func:`alloc_outputs`, whose tensors may be views of the caller's)."""
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
        ``InternodeTimeoutError``), without a device synchronisation (:func:`recorded`)."""

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
