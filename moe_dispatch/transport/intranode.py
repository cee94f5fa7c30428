"""The CUDA intranode transport: ``moe_dispatch._C``'s NVLink kernels, plus the loopback harness.

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
the ranks' calls agree (:mod:`moe_dispatch.transport.header`: the operation, the handle's
dispatch id, row bytes, dtype, top-k, experts, channels; a rank's refusal of its own
arguments): a disagreeing pair moves no rows and the host raises
:class:`~moe_dispatch.transport.header.MismatchError` at its next synchronisation.

Two front ends share one launcher (:class:`_Engine`):

- :class:`Loopback`: W simulated ranks on one device, one launch for all of them: on a GPU
  their "peer" buffers are W allocations of the same GPU; on CPU (``backend="cpu"``) the same
  protocol code runs on threads over host memory. Tests and benchmarks use it.
- :class:`IntranodeTransport`: one rank per process; buffers shared through CUDA IPC handles
  exchanged over torch.distributed (one GPU per rank), or on CPU through shared memory with
  the CPU backend (the same wrapper, handle exchange and per-rank launches, with peers in
  other processes).

``Buffer(transport="kernels")`` drives an :class:`IntranodeTransport` through
:mod:`moe_dispatch.transport.kernels` (one node).
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist

from ..config import (
    ERROR_RECORD_INTS,
    MAX_RANKS,
    MAX_TOPK,
    Config,
    buffer_layout,
    check_config,
    max_slot_bytes,
    slot_layout,
)
from ..errors import BudgetOverflowError, CommError
from .header import (
    OP_CACHED_DISPATCH,
    OP_COMBINE,
    OP_DISPATCH,
    STATUS_INVALID_ARGUMENTS,
    Records,
    header_words,
)
from .memory import CudaIpcBuffer, SharedMemoryBuffer, map_peers

TIMEOUT_ENV = "MOE_DISPATCH_KERNEL_TIMEOUT_S"
COOPERATIVE_ENV = "MOE_DISPATCH_COOPERATIVE"
DEFAULT_TIMEOUT_S = 100.0
FP8_BLOCK = 128
COMBINE_DTYPES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}

_PHASES = {1: "notify", 2: "dispatch", 3: "combine"}
_ROLES = {1: "barrier", 2: "sender", 3: "receiver", 4: "coordinator"}
_SIGNAL, _TAIL, _HEAD, _HEADER = 1, 2, 3, 4


class IntranodeTimeoutError(CommError):
    """A wait inside an intranode kernel ran past ``timeout_s``.

    Attributes (from the kernel's record): ``phase`` ("notify"/"dispatch"/"combine"),
    ``role``, ``rank`` (the waiting rank), ``channel`` (-1 for the barrier), ``peer`` (the rank
    whose store never came), ``counter`` ("signal"/"tail"/"head"), ``expected``, ``observed``.
    """

    def __init__(self, message: str, fields: dict):
        super().__init__(message)
        self.__dict__.update(fields)


def describe_timeout(record: list[int], timeout_s: float) -> tuple[str, dict]:
    """The message and fields of a kernel error record (``int32[16]``, see ``ErrorRecord``)."""
    _, phase, role, rank, channel, peer, counter, expected, observed = record[:9]
    if phase == 0:  # the flag without a record: the offering wait could not take the record's lock
        return (
            f"moe_dispatch intranode operation timed out after timeout_s={timeout_s:g}, but the kernel's record "
            f"of which wait it was is missing; the buffers are in an undefined state: reset() them (loopback) "
            f"or recreate the Buffer",
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
        f"Rank {peer} did not take part (crashed, hung, or called another operation). The communication "
        f"buffers are now in an undefined state: reset() them (loopback) or recreate the Buffer."
    )
    return message, fields


def default_timeout_s(timeout_s: float | None) -> float:
    if timeout_s is not None:
        return float(timeout_s)
    return float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))


def timeout_cycles(backend: str, device: torch.device, timeout_s: float) -> int:
    """``timeout_s`` as the kernels' wait bound: clock64 cycles of ``device`` ("cuda"), or
    nanoseconds (the CPU backend)."""
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    if backend == "cuda":
        clock_khz = _ext().device_clock_khz(device.index if device.index is not None else torch.cuda.current_device())
        return max(1, int(timeout_s * clock_khz * 1000))
    return max(1, int(timeout_s * 1e9))


def _loopback_device(device: torch.device | str) -> tuple[torch.device, str]:
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


def _slot_bytes(hidden: int, num_topk: int, element_bytes: int, config: Config | None, *, min_topk: int = 0) -> int:
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


def _ext():
    from .._ext import require_extension

    return require_extension()


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None or t.numel() == 0 else t.data_ptr()


def _check_aligned(name: str, t: torch.Tensor | None, alignment: int) -> None:
    """The kernels move rows in 16-byte vectors (fp8 scales in 4-byte words)."""
    if t is not None and t.numel() and t.data_ptr() % alignment:
        raise ValueError(
            f"{name} must start on a {alignment}-byte boundary, but its data pointer is "
            f"{t.data_ptr() % alignment} bytes past one (a view with a storage offset?); pass .clone()"
        )


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


@dataclasses.dataclass
class _Input:
    """A source rank's dispatch input after validation."""

    rank: int
    x: torch.Tensor
    scales: torch.Tensor | None
    topk_idx: torch.Tensor  # int64 ([T, 0] when no top-k travels)
    topk_weights: torch.Tensor | None
    is_token_in_rank: torch.Tensor
    topk_dtype: torch.dtype | None  # the caller's; None: no topk_idx given
    token_ids: torch.Tensor | None = None  # [T] int32: what receivers record as a row's source token (None: t)


class _Launcher:
    """What every engine's launches share: device and backend, stream, cooperative launch, the
    wait bound and the error record (``int32[16]`` on the launch device, ``error_host_ptr``: a
    pinned mirror's device address, or None)."""

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
        self.backend, self.cpu_options = backend, dict(cpu_options or {})
        self.device = error.device
        self.cooperative = os.environ.get(COOPERATIVE_ENV, "1") != "0"
        self.records, self.record_base = records, rank_begin  # records[r - rank_begin]: rank r's
        self.launches = 0  # kernel launches so far (a refusal only happens before any)
        self.next_dispatch_id = 1  # the default identity of the next fresh dispatch
        self.set_timeout(timeout_s)

    def check_fields(self, rank: int, header: list[int]) -> dict:
        """A launched rank's header-check keys (header.Records.fields)."""
        return self.records.fields(rank - self.record_base, header)

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

    def _common(
        self,
        config: Config,
        slot_bytes: int,
        buffers: list[int],
        num_channels: int,
        rank_begin: int,
        skip_rank: int | None,
    ) -> dict:
        """The launch fields both engines' ``common`` dicts carry."""
        return {
            "num_channels": num_channels,
            "rank_begin": rank_begin,
            "skip_rank": -1 if skip_rank is None else skip_rank,
            "chunk_tokens": config.chunk_tokens,
            "l2_discard": int(config.l2_discard),
            **config.variant_fields(),
            "timeout_cycles": self.timeout_cycles,
            "buffer_channels": config.num_channels,
            "num_slots": config.num_slots,
            "slot_bytes": slot_bytes,
            "buffers": buffers,
            "error": self.error.data_ptr(),
            "error_host": self.error_host_ptr,
        }

    def _stream(self) -> int:
        return torch.cuda.current_stream(self.device).cuda_stream if self.backend == "cuda" else 0

    def read_error(self) -> list[int] | None:
        """The error record if a wait timed out (reads the device: a host sync)."""
        record = self.error.tolist()
        return record if record[0] or record[1] else None


class _Engine(_Launcher):
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
        self.layout = buffer_layout(world_size, config.num_channels, config.num_slots, slot_bytes, relay_nodes)
        super().__init__(error, error_host_ptr, backend, timeout_s, cpu_options, records, rank_begin)

    def common(self, num_channels: int, rank_begin: int, skip_rank: int | None) -> dict:
        return {
            "num_ranks": self.world_size,
            "relay_nodes": self.layout.relay_nodes,
            **self._common(self.config, self.slot_bytes, self.buffers, num_channels, rank_begin, skip_rank),
        }

    def notify(self, common: dict, ranks: list[dict], num_topk: int) -> None:
        self.launches += 1
        _ext().intranode_notify(common, ranks, num_topk, self.backend, self._stream(), self.cooperative)

    def dispatch(
        self, common: dict, ranks: list[dict], x_bytes: int, scale_bytes: int, num_topk: int, experts_per_rank: int
    ) -> None:
        self.launches += 1
        _ext().intranode_dispatch(
            common,
            ranks,
            x_bytes,
            scale_bytes,
            num_topk,
            experts_per_rank,
            self.backend,
            self._stream(),
            self.cooperative,
            self.cpu_options,
        )

    def combine(self, common: dict, ranks: list[dict], y_bytes: int, dtype: torch.dtype) -> None:
        self.launches += 1
        _ext().intranode_combine(
            common,
            ranks,
            y_bytes,
            COMBINE_DTYPES[dtype],
            self.backend,
            self._stream(),
            self.cooperative,
            self.cpu_options,
        )

    def raise_if_timed_out(self, record: list[int] | None = None) -> None:
        record = record if record is not None else self.read_error()
        if record:
            raise IntranodeTimeoutError(*describe_timeout(record, self.timeout_s))


# ---------------------------------------------------------------------------------------------
# The operations, for the ranks of one launch
# ---------------------------------------------------------------------------------------------


def _check_num_sms(num_sms: int, config: Config) -> int:
    if not isinstance(num_sms, int) or num_sms < 2 or num_sms % 2 or num_sms > config.num_sms:
        raise ValueError(
            f"num_sms must be even and in [2, {config.num_sms}] (the Buffer's Config.num_sms), got {num_sms!r}"
        )
    return num_sms // 2


def _prepare(
    rank: int,
    x,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor | None,
    num_experts: int,
    world_size: int,
    device: torch.device,
    validate: bool = True,
    handle: IntranodeHandle | None = None,
) -> _Input:
    from ..ops.layout import get_dispatch_layout
    from ..ops.quant import check_fp8_pair
    from ..semantics.validation import check_hidden, check_topk_idx, check_topk_weights

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
    _check_aligned(f"x (rank {rank})", x, 16)
    _check_aligned(f"scales (rank {rank})", scales, 4)
    if topk_idx is None:  # a cached dispatch of x alone: no top-k fields travel
        if handle is None:
            raise ValueError(f"rank {rank}: topk_idx is required unless replaying a handle (cached dispatch)")
        if topk_weights is not None:
            raise ValueError(f"rank {rank}: topk_weights without topk_idx")
        return _Input(
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
    return _Input(
        rank,
        x,
        scales,
        topk_idx.to(torch.int64).contiguous(),
        topk_weights,
        is_token_in_rank.contiguous(),
        topk_idx.dtype,
    )


def _check_world_args(world_size: int, xs: list, topk_idxs: list | None, num_experts: int) -> list:
    """A loopback call's per-rank lists and E; returns ``topk_idxs`` (one None per rank when None)."""
    if topk_idxs is None:
        topk_idxs = [None] * world_size
    if len(xs) != world_size or len(topk_idxs) != world_size:
        raise ValueError(f"pass one x and one topk_idx per rank ({world_size}), got {len(xs)} and {len(topk_idxs)}")
    if not isinstance(num_experts, int) or num_experts < 1 or num_experts % world_size:
        raise ValueError(f"num_experts must be a positive multiple of {world_size}, got {num_experts!r}")
    return topk_idxs


def _prepare_world(
    xs: list,
    topk_idxs: list,
    topk_weights: list | None,
    num_experts: int,
    device: torch.device,
    validate: bool,
    handles: list | None,
) -> list[_Input]:
    """:func:`_prepare` for every rank of a loopback call (lists already checked)."""
    weights = topk_weights if topk_weights is not None else [None] * len(xs)
    return [
        _prepare(
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


def _dispatch_shape(
    inputs: list[_Input], slot_bytes: int, slots: str = "the buffer's slots", fix: str = "size the Buffer"
) -> tuple[int, int, int, int]:
    """``(hidden, num_topk, x_bytes, scale_bytes)`` of a dispatch launch: every rank must move the
    same rows, and a slot (of ``slot_bytes``) must hold one."""
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
    return hidden, num_topk, x_bytes, scale_bytes


def _rank_results(result_type: type, inputs: list[_Input], handles: list, outs: list[dict]) -> list:
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


def _dispatch(
    engine: _Engine,
    inputs: list[_Input],
    num_experts: int,
    *,
    num_sms: int,
    handles: list[IntranodeHandle] | None,
    num_worst_tokens: int | None,
    skip_rank: int | None,
    skip_phase: str | None,
    dispatch_ids: list[int | None] | None = None,
    statuses: dict[int, int] | None = None,
) -> list[RankDispatch]:
    """Dispatch for ranks ``inputs[i].rank`` (consecutive) in one launch each of notify and
    dispatch. ``dispatch_ids``: per rank the fresh dispatch's identity (None: the engine's next);
    ``statuses``: rank -> non-zero header status (that rank refuses: its inputs are empty)."""
    skip = lambda phase: skip_rank if skip_phase == phase else None  # noqa: E731
    experts_per_rank = num_experts // engine.world_size
    _dispatch_shape(inputs, engine.slot_bytes)
    if handles is None:
        handles, outs = _notify(
            engine,
            inputs,
            experts_per_rank,
            num_sms=num_sms,
            num_worst_tokens=num_worst_tokens,
            skip_rank=skip("notify"),
            dispatch_ids=dispatch_ids,
            statuses=statuses,
        )
    else:
        if len(handles) != len(inputs):
            raise ValueError(f"pass one handle per rank: {len(inputs)} inputs, {len(handles)} handles")
        for inp, h in zip(inputs, handles):
            refusing = statuses is not None and inp.rank in statuses  # its tokens were taken away
            if not isinstance(h, IntranodeHandle) or (h.num_tokens != inp.x.shape[0] and not refusing):
                raise ValueError(f"rank {inp.rank}: the handle is not an IntranodeHandle for {inp.x.shape[0]} tokens")
        outs = None
    if outs is None:
        outs = [_alloc_outputs(inp, h.num_rows, experts_per_rank, engine.device) for inp, h in zip(inputs, handles)]
    _launch_dispatch(engine, inputs, handles, outs, experts_per_rank, skip_rank=skip("dispatch"), statuses=statuses)
    return _rank_results(RankDispatch, inputs, handles, outs)


def _check_budget(num_worst_tokens) -> int:
    """The kernels' row budget: -1 for none (None or 0, as in Buffer.dispatch), else the int."""
    if num_worst_tokens is not None and (
        not isinstance(num_worst_tokens, int) or isinstance(num_worst_tokens, bool) or num_worst_tokens < 0
    ):
        raise ValueError(
            f"num_worst_tokens must be None or an int >= 0 (None, or 0 as in Buffer.dispatch: no "
            f"budget, the host reads the receive count), got {num_worst_tokens!r}"
        )
    return int(num_worst_tokens) if num_worst_tokens else -1


def _header(
    op: int, identity: int, inp: _Input, num_experts: int, num_channels: int, status: int, slot_flags: bool = False
) -> list[int]:
    """The header words of a dispatch of ``inp`` (header.py); ``slot_flags``: the intranode
    kernels' Config.slot_flags (the internode kernels have no ready flags)."""
    return header_words(
        op,
        identity,
        inp.x.shape[1] * inp.x.element_size(),
        inp.x.dtype,
        inp.topk_idx.shape[1],
        num_experts,
        num_channels,
        weights=inp.topk_weights is not None,
        slot_flags=slot_flags,
        status=status,
    )


def _notify(
    engine: _Engine,
    inputs: list[_Input],
    experts_per_rank: int,
    *,
    num_sms: int,
    num_worst_tokens: int | None,
    skip_rank: int | None,
    dispatch_ids: list[int | None] | None = None,
    statuses: dict[int, int] | None = None,
    outs: list[dict] | None = None,
) -> tuple[list[IntranodeHandle], list[dict] | None]:
    """The notify launch: per rank a handle (receive prefix, counts, the verdicts on its peers).
    Without a budget the host reads the receive counts (one sync for all launched ranks) and no
    outputs are allocated; with one, the outputs are allocated first (notify fills their padding
    rows), unless the caller passes them (``outs``: per rank the dict of :func:`_alloc_outputs`;
    notify writes only its top-k ids, weights and source indices)."""
    world_size, device = engine.world_size, engine.device
    num_topk = inputs[0].topk_idx.shape[1]
    num_channels = _check_num_sms(num_sms, engine.config)
    budget = _check_budget(num_worst_tokens)
    num_experts = experts_per_rank * world_size
    ids = engine.dispatch_ids(dispatch_ids, len(inputs))
    statuses = statuses or {}
    prefixes = [torch.zeros(world_size * num_channels + 1, dtype=torch.int32, device=device) for _ in inputs]
    counts = [torch.zeros(1, dtype=torch.int32, device=device) for _ in inputs]
    overflows = [torch.zeros(1, dtype=torch.int32, device=device) for _ in inputs]
    peer_ok = [torch.zeros(world_size, dtype=torch.int32, device=device) for _ in inputs]
    if budget < 0:
        outs = None
    elif outs is None:
        outs = [_alloc_outputs(inp, budget, experts_per_rank, device) for inp in inputs]
    ranks = [
        {
            "is_token_in_rank": _ptr(inp.is_token_in_rank),
            "recv_prefix": p.data_ptr(),
            "num_recv_tokens": n.data_ptr(),
            "overflow": o.data_ptr(),
            "peer_ok": ok.data_ptr(),
            "recv_topk_idx": _ptr(outs[i]["topk_idx"]) if outs else None,
            "recv_topk_weights": _ptr(outs[i]["topk_weights"]) if outs else None,
            "recv_src_idx": _ptr(outs[i]["src_idx"]) if outs else None,
            "num_tokens": inp.x.shape[0],
            "budget": budget,
            **engine.check_fields(
                inp.rank,
                _header(
                    OP_DISPATCH,
                    ids[i],
                    inp,
                    num_experts,
                    num_channels,
                    statuses.get(inp.rank, 0),
                    engine.config.slot_flags,
                ),
            ),
        }
        for i, (inp, p, n, o, ok) in enumerate(zip(inputs, prefixes, counts, overflows, peer_ok))
    ]
    engine.notify(engine.common(num_channels, inputs[0].rank, skip_rank), ranks, num_topk)
    if budget < 0:
        totals = torch.cat(counts).tolist()
        engine.raise_if_timed_out()
    else:
        totals = [None] * len(inputs)
    handles = [
        IntranodeHandle(
            num_tokens=inp.x.shape[0],
            num_channels=num_channels,
            is_token_in_rank=inp.is_token_in_rank,
            recv_prefix=p,
            num_recv_tokens=total,
            num_recv_tokens_dev=n,
            overflow=o,
            num_rows=budget if budget >= 0 else total,
            dispatch_id=ids[i],
            num_experts=num_experts,
            peer_ok=ok,
            topk_dtype=inp.topk_dtype or torch.int64,
            notified=True,
        )
        for i, (inp, p, n, o, ok, total) in enumerate(zip(inputs, prefixes, counts, overflows, peer_ok, totals))
    ]
    return handles, outs


def _launch_dispatch(
    engine: _Engine,
    inputs: list[_Input],
    handles: list[IntranodeHandle],
    outs: list[dict],
    experts_per_rank: int,
    *,
    skip_rank: int | None,
    statuses: dict[int, int] | None = None,
) -> None:
    """The dispatch launch into ``outs`` (per rank the dict :func:`_alloc_outputs` makes, whose
    tensors may be views of the caller's: rows ``[handle.num_rows, ...]``). Right after its
    notify a handle's launch reuses the notify's verdicts; any later one (a cached dispatch)
    exchanges headers in the kernel."""
    _, num_topk, x_bytes, scale_bytes = _dispatch_shape(inputs, engine.slot_bytes)
    num_experts, statuses = experts_per_rank * engine.world_size, statuses or {}
    ranks = []
    for inp, h, o in zip(inputs, handles, outs):
        fresh, fields = _dispatch_fields(engine, inp, h, o, num_experts, statuses, engine.config.slot_flags)
        ranks.append(
            {
                **fields,
                "token_ids": _ptr(inp.token_ids),
                "is_token_in_rank": _ptr(h.is_token_in_rank),
                "recv_prefix": h.recv_prefix.data_ptr(),
                "peer_ok": h.peer_ok.data_ptr() if fresh else None,
            }
        )
    engine.dispatch(
        engine.common(handles[0].num_channels, inputs[0].rank, skip_rank),
        ranks,
        x_bytes,
        scale_bytes,
        num_topk,
        experts_per_rank,
    )


def _dispatch_fields(
    engine: _Launcher,
    inp: _Input,
    handle,
    out: dict,
    num_experts: int,
    statuses: dict[int, int],
    slot_flags: bool = False,
) -> tuple[bool, dict]:
    """The keys every dispatch launch's rank dict shares (inputs, outputs, the header check),
    and whether this is the handle's first launch after its notify: that one alone reuses the
    notify's verdicts (the handle's ``notified`` flag is cleared). ``slot_flags``: the intranode
    kernels' ready flags (in the header)."""
    fresh, handle.notified = handle.notified, False
    header = _header(
        OP_DISPATCH if fresh else OP_CACHED_DISPATCH,
        handle.dispatch_id,
        inp,
        num_experts,
        handle.num_channels,
        statuses.get(inp.rank, 0),
        slot_flags,
    )
    return fresh, {
        "x": _ptr(inp.x),
        "x_scales": _ptr(inp.scales),
        "topk_idx": _ptr(inp.topk_idx),
        "topk_weights": _ptr(inp.topk_weights),
        "recv_x": _ptr(out["x"]),
        "recv_scales": _ptr(out["scales"]),
        "recv_topk_idx": _ptr(out["topk_idx"]),
        "recv_topk_weights": _ptr(out["topk_weights"]) if inp.topk_weights is not None else None,
        "recv_src_idx": _ptr(out["src_idx"]),
        "num_recv_per_expert": out["per_expert"].data_ptr(),
        "overflow": handle.overflow.data_ptr(),
        "num_tokens": inp.x.shape[0],
        "num_rows": handle.num_rows,
        **engine.check_fields(inp.rank, header),
    }


def _alloc_outputs(inp: _Input, rows: int, experts_per_rank: int, device: torch.device) -> dict:
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


def _check_combine(
    ys: list[torch.Tensor],
    handles: list,
    row_scales: list[torch.Tensor | None],
    rank_begin: int,
    device: torch.device,
    slot_bytes: int,
    slots: str = "the buffer's slots",
) -> tuple[int, torch.dtype, int]:
    """``(hidden, dtype, y_bytes)`` of a combine launch: every rank's y and row_scale fit its
    handle, the ranks agree, and a slot (of ``slot_bytes``) holds a row."""
    from ..semantics.validation import check_hidden

    if len(ys) != len(handles):
        raise ValueError(f"pass one y per handle: {len(ys)} ys, {len(handles)} handles")
    hidden, dtype = ys[0].shape[1], ys[0].dtype
    for i, (y, h, s) in enumerate(zip(ys, handles, row_scales)):
        check_hidden(
            f"y (rank {rank_begin + i})", y, device, num_rows=h.num_rows, rows_what="the handle (rows received)"
        )
        if y.shape[1] != hidden or y.dtype != dtype:
            raise ValueError(
                f"every rank must combine the same hidden size and dtype: rank {rank_begin + i} has "
                f"[{y.shape[1]}] {y.dtype}, rank {rank_begin} has [{hidden}] {dtype}"
            )
        _check_aligned(f"y (rank {rank_begin + i})", y, 16)  # the kernels read rows with 16-byte vectors
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


def _combine_shape(
    ys: list[torch.Tensor],
    handles: list,
    row_scales: list | None,
    rank_begin: int,
    device: torch.device,
    slot_bytes: int,
    handle_type: type,
    slots: str = "the buffer's slots",
) -> tuple[list, int, torch.dtype, int]:
    """``(row_scales, hidden, dtype, y_bytes)`` of a combine whose handles must be ``handle_type``
    (see :func:`_check_combine`)."""
    for i, h in enumerate(handles):
        if not isinstance(h, handle_type):
            raise ValueError(
                f"rank {rank_begin + i}: the handle must be a {handle_type.__name__} (of a dispatch on "
                f"this transport), got {type(h).__name__}"
            )
    row_scales = row_scales or [None] * len(ys)
    return (row_scales, *_check_combine(ys, handles, row_scales, rank_begin, device, slot_bytes, slots))


def _combine(
    engine: _Engine,
    rank_begin: int,
    ys: list[torch.Tensor],
    handles: list[IntranodeHandle],
    row_scales: list[torch.Tensor | None] | None,
    skip_rank: int | None,
    statuses: dict[int, int] | None = None,
    outs: list[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """Combine for ranks ``rank_begin + i`` into ``outs`` (contiguous ``[T, H]``, made when None)."""
    device, statuses = engine.device, statuses or {}
    row_scales, hidden, dtype, y_bytes = _combine_shape(
        ys, handles, row_scales, rank_begin, device, engine.slot_bytes, IntranodeHandle
    )
    if outs is None:
        outs = [torch.empty(h.num_tokens, hidden, dtype=dtype, device=device) for h in handles]
    ranks = [
        {
            "y": _ptr(y),
            "row_scale": _ptr(s.contiguous()) if s is not None else None,
            "is_token_in_rank": _ptr(h.is_token_in_rank),
            "recv_prefix": h.recv_prefix.data_ptr(),
            "out": _ptr(out),
            "num_tokens": h.num_tokens,
            "num_rows": h.num_rows,
            **engine.check_fields(
                rank_begin + i,
                header_words(
                    OP_COMBINE,
                    h.dispatch_id,
                    y_bytes,
                    dtype,
                    0,
                    h.num_experts,
                    h.num_channels,
                    slot_flags=engine.config.slot_flags,
                    status=statuses.get(rank_begin + i, 0),
                ),
            ),
        }
        for i, (y, h, s, out) in enumerate(zip(ys, handles, row_scales, outs))
    ]
    engine.combine(engine.common(handles[0].num_channels, rank_begin, skip_rank), ranks, y_bytes, dtype)
    return outs


# ---------------------------------------------------------------------------------------------
# Loopback: W simulated ranks on one device
# ---------------------------------------------------------------------------------------------


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
        slot_bytes = _slot_bytes(hidden, num_topk, element_bytes, config)
        self.config = config or Config()
        self.device, backend = _loopback_device(device)
        self.layout = buffer_layout(world_size, self.config.num_channels, self.config.num_slots, slot_bytes)
        self._buffers = [
            torch.zeros(self.layout.total_bytes, dtype=torch.uint8, device=self.device) for _ in range(world_size)
        ]
        error = torch.zeros(ERROR_RECORD_INTS, dtype=torch.int32, device=self.device)
        self.engine = _Engine(
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
                others record it (:class:`~moe_dispatch.transport.header.MismatchError` from
                :meth:`check`).
            withhold_rank, withhold_phase: tests: that rank's blocks skip "notify", "dispatch".
            check: synchronise and raise :class:`IntranodeTimeoutError` if a wait timed out, or
                :class:`~moe_dispatch.transport.header.MismatchError` if ranks disagreed.
            validate: check topk_idx values (a host sync; pass False under CUDA-graph capture).

        Returns:
            per rank a :class:`RankDispatch`; rows ordered by source rank, then source token.
        """
        topk_idxs = _check_world_args(self.world_size, xs, topk_idxs, num_experts)
        if handles is not None and len(handles) != self.world_size:
            raise ValueError(f"pass one handle per rank ({self.world_size}), got {len(handles)}")
        if dispatch_ids is not None and len(dispatch_ids) != self.world_size:
            raise ValueError(f"pass one dispatch id per rank ({self.world_size}), got {len(dispatch_ids)}")
        inputs = _prepare_world(xs, topk_idxs, topk_weights, num_experts, self.device, validate, handles)
        inputs = _refusing(inputs, status)
        try:
            results = _dispatch(
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
        outs = _combine(self.engine, 0, ys, handles, row_scales, withhold_rank, statuses=status)
        if check:
            self.check()
        return outs

    def check(self) -> None:
        """Synchronises, then raises :class:`IntranodeTimeoutError` (and resets the buffers) if
        a wait of a previous launch timed out, or
        :class:`~moe_dispatch.transport.header.MismatchError` (clearing the records: the buffers
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


def _refusing(inputs: list[_Input], status: dict[int, int] | None) -> list[_Input]:
    """``inputs`` with no tokens on the ranks that refuse (a non-zero ``status``)."""
    if not status:
        return inputs
    for code in status.values():
        if not isinstance(code, int) or code == 0:
            raise ValueError(f"status must map ranks to non-zero ints, got {status!r}")
    return [_empty_input(inp) if inp.rank in status else inp for inp in inputs]


def _empty_input(inp: _Input) -> _Input:
    """``inp`` with no tokens (its shapes otherwise kept)."""
    return dataclasses.replace(
        inp,
        x=inp.x[:0],
        scales=inp.scales[:0] if inp.scales is not None else None,
        topk_idx=inp.topk_idx[:0],
        topk_weights=inp.topk_weights[:0] if inp.topk_weights is not None else None,
        is_token_in_rank=inp.is_token_in_rank[:0],
    )


# ---------------------------------------------------------------------------------------------
# One rank per GPU: buffers shared through CUDA IPC
# ---------------------------------------------------------------------------------------------


class IntranodeTransport:
    """The intranode kernels for one EP group of W <= 16 ranks on one node, one process each.

    On a GPU (``device`` CUDA, the default) each rank's buffer is a ``cudaMalloc`` shared
    through CUDA IPC handles. On CPU (``device="cpu"``, CPU tensors) it is a POSIX shared-memory
    segment that every rank maps, and the same role code runs on this process's threads (the
    kernels' CPU backend), so the multi-process path is tested without a GPU.

    What is on the device and what synchronises: a fresh dispatch without ``num_worst_tokens``
    reads its receive count on the host once (R sizes the outputs); with it, nothing waits for
    the host (counts, overflow flag and the peers' verdicts stay on the device: CUDA-graph
    capturable). Cached dispatch and combine never synchronise. Every operation checks its
    arguments against every peer's on the device (header.py); a mismatch is raised as
    :class:`~moe_dispatch.transport.header.MismatchError` at the next synchronisation: right
    after the operation on the CPU backend, after a fresh dispatch's count read, or by
    :meth:`check_errors` / :meth:`check` on a GPU.

    Args:
        group: the EP process group (NCCL or gloo: it only carries the handles); W = its size,
            all ranks on this node.
        rank: this rank's index in the group.
        hidden, num_topk, element_bytes: the largest rows this transport moves (sizes slots).
        config: :class:`Config`; every rank must pass the same.
        timeout_s: bound of every wait inside the kernels.
        device: where buffers, inputs and outputs live: None (the current CUDA device), a
            CUDA device, or ``"cpu"``.
        relay_nodes: the internode transport's N when these are its NVLink buffers (adds the
            fused pipeline's relay region); 0 otherwise.

    Raises:
        ValueError: more than 16 ranks, hidden, num_topk or element_bytes out of range, or a
            device that is neither CUDA nor CPU; TypeError: config is no Config; RuntimeError:
            a CUDA device without a GPU.

    Collective: every rank constructs it together (allocation, handle exchange).
    """

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
        relay_nodes: int = 0,
    ):
        C = _ext()
        world_size = dist.get_world_size(group)
        if world_size > MAX_RANKS:
            raise ValueError(f"the intranode kernels serve at most {MAX_RANKS} ranks, the group has {world_size}")
        self.device, _ = _loopback_device("cuda" if device is None else device)
        self.group, self.rank, self.world_size = group, rank, world_size
        slot_bytes = _slot_bytes(hidden, num_topk, element_bytes, config)
        self.config = config or Config()
        self.layout = buffer_layout(
            world_size, self.config.num_channels, self.config.num_slots, slot_bytes, relay_nodes
        )
        on_gpu = self.device.type == "cuda"
        self._own = CudaIpcBuffer(self.layout, self.device) if on_gpu else SharedMemoryBuffer(self.layout)
        self._opened: dict[int, int] = {}
        try:
            buffers = map_peers(self._own, group, rank, world_size, self._opened)
            error = torch.zeros(ERROR_RECORD_INTS, dtype=torch.int32, device=self.device)
            # On a GPU a pinned mirror of the record lets check_errors read it without waiting for kernels.
            self._error_host = torch.zeros(ERROR_RECORD_INTS, dtype=torch.int32).pin_memory() if on_gpu else None
            error_host_ptr = C.host_device_pointer(self._error_host.data_ptr()) if on_gpu else None
            self.engine = _Engine(
                world_size,
                self.config,
                slot_bytes,
                buffers,
                error,
                error_host_ptr,
                "cuda" if on_gpu else "cpu",
                default_timeout_s(timeout_s),
                records=Records(1, self.device, mirror=on_gpu),
                rank_begin=rank,
                relay_nodes=relay_nodes,
            )
            dist.barrier(group=group)  # every peer has mapped every buffer
        except BaseException:
            self.close()  # a peer that failed or never came: leave no mapping or shared-memory file behind
            raise
        self._own.mapped()

    def dispatch(
        self,
        x,
        topk_idx: torch.Tensor | None,
        topk_weights: torch.Tensor | None,
        num_experts: int,
        *,
        num_sms: int | None = None,
        handle: IntranodeHandle | None = None,
        num_worst_tokens: int | None = None,
        dispatch_id: int | None = None,
    ) -> RankDispatch:
        """This rank's dispatch (collective: every rank of the group calls it).

        Args: as :meth:`Loopback.dispatch` for one rank (``x``, ``topk_idx``, ``topk_weights``,
        ``handle``, ``dispatch_id``). Returns the :class:`RankDispatch`. Raises ValueError /
        TypeError for bad arguments (after taking part with a refusal, so the peers finish at
        once and record it), :class:`~moe_dispatch.transport.header.MismatchError` when the
        peers' calls differ, :class:`IntranodeTimeoutError` for a wait that ran out."""
        self.check_errors()
        op = OP_DISPATCH if handle is None else OP_CACHED_DISPATCH
        launches = self.engine.launches
        try:
            if handle is not None and not isinstance(handle, IntranodeHandle):
                raise TypeError(
                    f"handle must be an IntranodeHandle (of a dispatch on this transport), got {type(handle).__name__}"
                )
            inp = _prepare(
                self.rank, x, topk_idx, topk_weights, num_experts, self.world_size, self.device, handle=handle
            )
            result = _dispatch(
                self.engine,
                [inp],
                num_experts,
                num_sms=num_sms or self.config.num_sms,
                handles=[handle] if handle is not None else None,
                num_worst_tokens=num_worst_tokens,
                skip_rank=None,
                skip_phase=None,
                dispatch_ids=[dispatch_id] if dispatch_id is not None else None,
            )[0]
        except (ValueError, TypeError) as err:
            if self.engine.launches == launches:  # refused before any launch: take part without rows
                _refuse_or_raise(lambda: self._refuse(op), err)
            raise
        self._after(synchronized=handle is None and not num_worst_tokens)
        return result

    def combine(self, y: torch.Tensor, handle: IntranodeHandle, row_scale: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's combine (collective; never synchronises the host on a GPU). Raises as
        :meth:`dispatch`."""
        self.check_errors()
        launches = self.engine.launches
        try:
            if not isinstance(handle, IntranodeHandle):
                raise TypeError(f"handle must be an IntranodeHandle, got {type(handle).__name__}")
            out = _combine(self.engine, self.rank, [y], [handle], [row_scale], None)[0]
        except (ValueError, TypeError) as err:
            if self.engine.launches == launches:
                _refuse_or_raise(lambda: self._refuse(OP_COMBINE), err)
            raise
        self._after(synchronized=False)
        return out

    def _refuse(self, op: int) -> None:
        """Runs operation ``op`` with no tokens and status STATUS_INVALID_ARGUMENTS: the peers
        skip this rank at once and record why (a fresh dispatch runs its notify too)."""
        statuses = {self.rank: STATUS_INVALID_ARGUMENTS}
        x = torch.zeros(0, 8, dtype=torch.bfloat16, device=self.device)
        inp = _Input(
            self.rank,
            x,
            None,
            torch.zeros(0, 1, dtype=torch.int64, device=self.device),
            None,
            torch.zeros(0, self.world_size, dtype=torch.bool, device=self.device),
            torch.int64,
        )
        epr, C = 1, self.config.num_channels
        handle = IntranodeHandle(
            0,
            C,
            inp.is_token_in_rank,
            torch.zeros(self.world_size * C + 1, dtype=torch.int32, device=self.device),
            0,
            torch.zeros(1, dtype=torch.int32, device=self.device),
            torch.zeros(1, dtype=torch.int32, device=self.device),
            0,
        )
        if op == OP_COMBINE:
            _combine(self.engine, self.rank, [x], [handle], None, None, statuses=statuses)
        else:
            _dispatch(
                self.engine,
                [inp],
                epr * self.world_size,
                num_sms=self.config.num_sms,
                handles=None if op == OP_DISPATCH else [handle],
                num_worst_tokens=None,
                skip_rank=None,
                skip_phase=None,
                statuses=statuses,
            )

    def _after(self, synchronized: bool) -> None:
        """The next synchronisation after an operation: at once on the CPU backend (it has
        finished); on a GPU when the host just read the notify's count (``synchronized``), from
        the pinned mirrors, which the notify wrote (reading the device would wait for the
        dispatch kernel launched since)."""
        if self.device.type == "cpu":
            self.engine.raise_if_timed_out()
            self.engine.records.raise_if_set()
        elif synchronized:
            self.check_errors()

    def check_errors(self) -> None:
        """Raises :class:`IntranodeTimeoutError` if a launch of this rank timed out, or
        :class:`~moe_dispatch.transport.header.MismatchError` if a peer's call differed. On a GPU
        it reads the pinned mirrors, so it does not wait for running kernels."""
        self.check_timeout()
        self.engine.records.raise_if_set(synchronize=False)

    def check_timeout(self) -> None:
        """The timeout part of :meth:`check_errors`."""
        record = self._error_host.tolist() if self._error_host is not None else self.engine.read_error()
        if record and record[0]:  # the mirror's flag is set once its fields are written
            self.engine.raise_if_timed_out(record)

    def check(self) -> None:
        """Synchronises with this rank's kernels, then raises as :meth:`check_errors`."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.check_errors()

    def close(self) -> None:
        """Unmaps the peers' buffers and frees this rank's (call on every rank, after the last op)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        for address in self._opened.values():
            self._own.close_peer(address)
        self._opened = {}
        self._own.free()


def _refuse_or_raise(refuse, err: Exception) -> None:
    """Runs a rank's refusal; if that fails too (a peer missing), raises ``err`` caused by it."""
    try:
        refuse()
    except CommError as refusal:
        raise err from refusal
