"""FP8 dispatch format, the torch reference: per-token, per-128-channel e4m3 quantization with
fp32 scales.

Format (DeepEP's fp8 dispatch input; DeepGEMM's 1x128 activation scaling):
``x_fp8 [T, H]`` ``torch.float8_e4m3fn`` and ``scales [T, H/128]`` fp32 with
``x[t, h] ~= float(x_fp8[t, h]) * scales[t, h // 128]``. Each block of 128 consecutive elements
of a row gets ``scale = max(amax, 1e-4) / 448`` (448 = the largest e4m3 value, 1e-4 the
customary floor that keeps all-zero blocks finite), optionally rounded up to a power of two
(UE8M0 scales, what Blackwell's block-scaled GEMMs consume); elements are divided by the
scale and rounded to nearest-even e4m3.

Error bound: e4m3 keeps 3 mantissa bits, so a normal element is off by at most 2^-4 of its
magnitude; every element is within 2^-3 of its block's max (the bound the tests check).

Non-finite input (e4m3fn has a NaN but no Inf): by default NaN stays NaN and +-Inf becomes
NaN; they are left out of the block's amax, so the block's finite elements keep their
precision, and nothing is silently clamped to +-448 (a plain ``.to(torch.float8_e4m3fn)``
saturates Inf to +-448). ``non_finite="raise"`` rejects such input with a ValueError instead
(a host synchronisation).

The reference uses torch's own e4m3 conversion: an oracle independent of the Triton kernels in
:mod:`moe_dispatch.ops.quant`, which round with integer operations.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_BLOCK = 128  # elements per fp32 scale of the dispatch format (the block_size every caller passes)
FP8_MAX = 448.0
AMAX_FLOOR = 1e-4


def _round_up_pow2_reference(scale: torch.Tensor) -> torch.Tensor:
    mantissa, exponent = torch.frexp(scale)  # scale = mantissa * 2**exponent, mantissa in [0.5, 1)
    return torch.where(mantissa == 0.5, scale, torch.ldexp(torch.ones_like(scale), exponent))


def per_token_cast_to_fp8_reference(
    x: torch.Tensor, block_size: int = 128, use_ue8m0: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`~moe_dispatch.ops.quant.per_token_cast_to_fp8` (non-finite elements
    become NaN)."""
    num_tokens, hidden = x.shape
    xf = x.float().view(num_tokens, hidden // block_size, block_size)
    finite = torch.isfinite(xf)
    amax = torch.where(finite, xf.abs(), 0.0).amax(dim=-1).clamp(min=AMAX_FLOOR)
    # A tensor divisor: torch on CUDA divides by a Python scalar as a multiply by its reciprocal,
    # which is not the correctly rounded quotient the kernel (and torch on CPU) computes.
    scales = amax / torch.full_like(amax, FP8_MAX)
    if use_ue8m0:
        scales = _round_up_pow2_reference(scales)
    q = torch.where(finite, xf / scales.unsqueeze(-1), float("nan"))
    return q.to(FP8_DTYPE).view(num_tokens, hidden), scales.contiguous()


def per_token_cast_back_reference(
    x_fp8: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Torch reference of :func:`~moe_dispatch.ops.quant.per_token_cast_back`."""
    num_tokens, hidden = x_fp8.shape
    groups = scales.shape[1]
    xf = x_fp8.float().view(num_tokens, groups, hidden // groups) * scales.unsqueeze(-1)
    return xf.view(num_tokens, hidden).to(dtype)
