"""Boundary checks: every bad input becomes an error naming the argument, the expectation and
what came (never a bare assert)."""

from __future__ import annotations

import math

import torch

# The largest E: the [E] count tensors a layout makes per call stay at 8 MiB of int64 (2^24 experts
# cost about 120 MiB per dispatch), and ids fit int32 topk_idx. The largest published MoE layers have
# a few hundred experts.
MAX_EXPERTS = 2**20


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def is_int(value) -> bool:
    """``value`` is an int and not a bool (``True`` is an int to Python, never a count here)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_num_experts(num_experts, world_size: int | None = None) -> None:
    """Validates E: an int (not a bool) in ``[1, MAX_EXPERTS]``, divisible by ``world_size``.

    Raises:
        ValueError: naming the rule and the value.
    """
    if not is_int(num_experts) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    if num_experts > MAX_EXPERTS:
        raise ValueError(
            f"num_experts must be at most {MAX_EXPERTS} (2^20: each layout holds [num_experts] int64 counts), "
            f"got {num_experts}"
        )
    if world_size is not None and num_experts % world_size != 0:
        raise ValueError(f"num_experts must be divisible by the EP world size {world_size}, got {num_experts}")


def dense(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a row-major copy when its last stride is not 1: torch counts a ``[T, 1]``
    tensor of strides ``(1, T)`` contiguous (the gradient ``backward()`` gives a T=1, H=1
    output is one), but a byte view of its rows needs ``stride(-1) == 1``; 1-D row scales may
    also come strided."""
    if t.dim() and t.numel() and t.stride(-1) != 1:
        return t.clone(memory_format=torch.contiguous_format)
    return t


def check_tensor(
    name: str, t, *, ndim: int, dtypes: tuple[torch.dtype, ...] | None = None, device: torch.device | None = None
) -> None:
    """Checks that ``t`` is a contiguous tensor of rank ``ndim`` with an allowed dtype on ``device``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {_shape(t)}")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({allowed}), got {str(t.dtype).removeprefix('torch.')}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous()), got strides {tuple(t.stride())}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")


FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


def check_topk_idx(
    topk_idx,
    num_experts: int,
    *,
    num_tokens: int | None = None,
    device: torch.device | None = None,
    values: bool = True,
) -> None:
    """Validates ``topk_idx [T, K]`` int32/int64 with entries in ``[-1, num_experts)`` and no
    expert repeated within a row, and E (:func:`check_num_experts`). ``values=False`` checks
    only what the host knows without reading the tensor (a host sync on a GPU): shape, dtype,
    device and E."""
    check_tensor("topk_idx", topk_idx, ndim=2, dtypes=INDEX_DTYPES, device=device)
    check_num_experts(num_experts)
    if num_tokens is not None and topk_idx.shape[0] != num_tokens:
        raise ValueError(f"topk_idx has shape {_shape(topk_idx)} but x has {num_tokens} tokens")
    if topk_idx.numel() == 0 or not values:
        return
    lo, hi = int(topk_idx.min()), int(topk_idx.max())
    dup_row = -1
    if lo >= -1 and hi < num_experts and topk_idx.shape[1] > 1:
        s = topk_idx.sort(dim=1).values
        dup = (s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)
        if bool(dup.any()):
            dup_row = int(dup.any(1).nonzero()[0, 0])
    raise_on_topk_idx_values(topk_idx, num_experts, lo, hi, dup_row)


def raise_on_topk_idx_values(topk_idx: torch.Tensor, num_experts: int, lo: int, hi: int, dup_row: int) -> None:
    """The errors of :func:`check_topk_idx`'s value check, given the smallest and largest id and
    the first row that names an expert twice (-1: none), however they were found."""
    if lo < -1 or hi >= num_experts:
        bad = lo if lo < -1 else hi
        raise ValueError(f"topk_idx entries must be in [-1, {num_experts}) (-1 = no expert), got {bad}")
    if dup_row >= 0:
        raise ValueError(f"topk_idx row {dup_row} selects an expert more than once: {topk_idx[dup_row].tolist()}")


def check_topk_weights(topk_weights, topk_idx: torch.Tensor, device: torch.device | None = None) -> None:
    """Validates ``topk_weights [T, K]`` fp32 matching ``topk_idx``."""
    check_tensor("topk_weights", topk_weights, ndim=2, dtypes=(torch.float32,), device=device)
    if topk_weights.shape != topk_idx.shape:
        raise ValueError(f"topk_weights has shape {_shape(topk_weights)} but topk_idx has shape {_shape(topk_idx)}")


def check_hidden(
    name: str, x, device: torch.device | None = None, *, num_rows: int | None = None, rows_what: str = ""
) -> None:
    """Validates a ``[rows, hidden]`` floating tensor with hidden >= 1."""
    check_tensor(name, x, ndim=2, dtypes=FLOAT_DTYPES, device=device)
    if x.shape[1] < 1:
        raise ValueError(f"{name} must have a hidden size >= 1, got shape {_shape(x)}")
    if num_rows is not None and x.shape[0] != num_rows:
        raise ValueError(f"{name} has shape {_shape(x)} but {rows_what} has {num_rows} rows")


def check_timeout_s(timeout_s) -> float:
    """``timeout_s`` as a float: a positive, finite number of seconds (every wait is bounded).

    Raises:
        ValueError: not a number, a bool, <= 0, inf or NaN.
    """
    if (
        isinstance(timeout_s, bool)
        or not isinstance(timeout_s, (int, float))
        or not (math.isfinite(timeout_s) and timeout_s > 0)
    ):
        raise ValueError(
            f"timeout_s must be a positive, finite number of seconds (every wait is bounded), got {timeout_s!r}"
        )
    return float(timeout_s)
