"""One operation's call and a rank's dispatch input: :class:`RankInput` (a source rank's input,
checked by :func:`prepare_input`), the calls for the launched ranks (:class:`DispatchCall`,
:class:`CombineCall` on :class:`LaunchCall`), their argument checks (SM budget, row budget,
pointers and alignment, shapes in the slots), their header words, their outputs
(:func:`alloc_outputs`) and a dispatch's results (:func:`assemble_results`). The engines build
their launches from them (:mod:`.launcher`); the tests' harnesses (:mod:`moe_dispatch.testing`)
prepare their inputs with :func:`prepare_input`. Importable without the extension.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from ...config import Config
from ...kernel_layout import MAX_TOPK, slot_layout
from ...semantics.quant import FP8_BLOCK
from .header import header_words


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
