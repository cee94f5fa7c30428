"""FP8 dispatch format, the Triton kernels: per-token, per-128-channel e4m3 quantization.

The format, its error bound and its handling of non-finite input are
:mod:`moe_dispatch.semantics.quant`, with the torch reference. The conversion to and from the
e4m3 bit pattern is written out with integer operations so the kernels round identically on
GPU and under the interpreter; the torch reference uses torch's own conversion, an independent
oracle. :func:`per_token_cast_to_fp8` and :func:`per_token_cast_back` pick a kernel or the
reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..semantics.quant import FP8_DTYPE, per_token_cast_back_reference, per_token_cast_to_fp8_reference
from ..semantics.validation import FLOAT_DTYPES, check_tensor
from .layout import _device_of, _next_pow2, resolve_backend

NON_FINITE_MODES = ("nan", "raise")


def _check_block_size(block_size: int) -> None:
    if (
        not isinstance(block_size, int)
        or isinstance(block_size, bool)
        or block_size < 16
        or block_size & (block_size - 1)
    ):
        raise ValueError(f"block_size must be a power of two >= 16 (128 is the dispatch format), got {block_size!r}")


def _check_hidden_multiple(name: str, hidden: int, block_size: int) -> None:
    if hidden % block_size != 0:
        raise ValueError(
            f"{name} has hidden size {hidden}, which is not a multiple of the fp8 block size {block_size} "
            f"(one scale per {block_size} elements); dispatch this hidden size in bf16, or pad it to "
            f"{triton.cdiv(hidden, block_size) * block_size}"
        )


def check_fp8_pair(
    x_fp8: torch.Tensor,
    scales: torch.Tensor,
    block_size: int = 128,
    *,
    num_tokens: int | None = None,
    device: torch.device | None = None,
) -> None:
    """Validates an fp8 dispatch tuple ``(x_fp8 [T, H] float8_e4m3fn, scales [T, H/block] fp32)``.

    Raises:
        TypeError / ValueError: naming the part, the expectation and what came (including
            ``H % block_size != 0``).
    """
    _check_block_size(block_size)
    check_tensor("x_fp8", x_fp8, ndim=2, dtypes=(FP8_DTYPE,), device=device)
    check_tensor("scales", scales, ndim=2, dtypes=(torch.float32,), device=device)
    num_rows, hidden = x_fp8.shape
    _check_hidden_multiple("x_fp8", hidden, block_size)
    if tuple(scales.shape) != (num_rows, hidden // block_size):
        raise ValueError(
            f"scales must have shape [{num_rows}, {hidden // block_size}] for x_fp8 of shape "
            f"[{num_rows}, {hidden}] and block size {block_size}, got {list(scales.shape)}"
        )
    if num_tokens is not None and num_rows != num_tokens:
        raise ValueError(f"x_fp8 has {num_rows} rows but topk_idx has {num_tokens} tokens")


# ---------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------


@triton.jit
def _fp32_to_e4m3_bits(v):
    """Round-to-nearest-even fp32 -> float8_e4m3fn bit pattern (int32 in [0, 255]) for finite
    ``v``; magnitudes beyond 448 saturate to 448 (the caller scales into range)."""
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = tl.abs(v)
    abits = a.to(tl.int32, bitcast=True)
    # normal: keep 3 mantissa bits (add half-ulp - 1 plus the kept lsb, truncate), then
    # rebias the exponent from 127 to 7 (120 << 3 in the 4.3 code)
    normal = ((abits + 0x7FFFF + ((abits >> 20) & 1)) >> 20) - (120 << 3)
    # below 2^-6: subnormal multiples of 2^-9; adding 2^23 makes fp32 round to an integer (RNE)
    sub = (a * 512.0 + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000
    code = tl.where(a < 0.015625, sub, tl.minimum(normal, 126))
    return code | sign


@triton.jit
def _e4m3_bits_to_fp32(code):
    """float8_e4m3fn bit pattern (int32 in [0, 255]) -> fp32 (exact; 0x7F/0xFF -> NaN)."""
    mag = code & 0x7F
    exponent = mag >> 3
    mantissa = mag & 7
    normal = (((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    sub = mantissa.to(tl.float32) * 0.001953125  # 2^-9
    val = tl.where(exponent == 0, sub, normal)
    val = tl.where(mag == 0x7F, tl.full(val.shape, 0x7FC00000, tl.int32).to(tl.float32, bitcast=True), val)
    return (val.to(tl.int32, bitcast=True) | ((code & 0x80) << 24)).to(tl.float32, bitcast=True)


@triton.jit
def _per_token_cast_kernel(
    src_ptr,
    scales_ptr,
    dst_ptr,
    num_tokens,
    hidden,
    num_groups,
    BLOCK_T: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    GROUPS_PER_PROGRAM: tl.constexpr,
    TO_FP8: tl.constexpr,
    USE_UE8M0: tl.constexpr,
):
    """Program (p, q) converts rows ``[p*BLOCK_T, ...)`` x blocks ``[q*GROUPS_PER_PROGRAM, ...)``:
    to fp8 when ``TO_FP8`` (src: x, scales written, dst: the e4m3 codes), else back (src: the
    codes, scales read, dst: the output). One kernel walks the blocks for both directions."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    rows = tokens.to(tl.int64)
    for i in range(GROUPS_PER_PROGRAM):
        g = tl.program_id(1) * GROUPS_PER_PROGRAM + i
        offs = rows[:, None] * hidden + g * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)[None, :]
        # rows and group in range, both sides [BLOCK_T] int1 (a scalar operand of & made an int32
        # mask in Triton 3.9's interpreter, which it refuses)
        mask = (tokens < num_tokens) & (tl.full((BLOCK_T,), g, tl.int32) < num_groups)
        scale_offs = rows * num_groups + g
        if TO_FP8:
            x = tl.load(src_ptr + offs, mask=mask[:, None], other=0.0).to(tl.float32)
            finite = tl.abs(x) <= 3.4028234663852886e38  # False for NaN and +-Inf
            amax = tl.maximum(tl.max(tl.where(finite, tl.abs(x), 0.0), axis=1), 1e-4)
            scale = tl.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))
            if USE_UE8M0:  # round up to a power of two: bump the exponent unless the mantissa is 0
                sb = scale.to(tl.int32, bitcast=True)
                sb = tl.where((sb & 0x7FFFFF) != 0, (sb & 0x7F800000) + 0x800000, sb)
                scale = sb.to(tl.float32, bitcast=True)
            code = _fp32_to_e4m3_bits(tl.div_rn(x, scale[:, None]))
            code = tl.where(finite, code, 0x7F)
            tl.store(dst_ptr + offs, code.to(tl.uint8), mask=mask[:, None])
            tl.store(scales_ptr + scale_offs, scale, mask=mask)
        else:
            code = tl.load(src_ptr + offs, mask=mask[:, None], other=0).to(tl.int32)
            scale = tl.load(scales_ptr + scale_offs, mask=mask, other=0.0)
            val = _e4m3_bits_to_fp32(code) * scale[:, None]
            tl.store(dst_ptr + offs, val.to(dst_ptr.dtype.element_ty), mask=mask[:, None])


# Launch configuration on GPU (benchmarks/bench_kernels.py may override).
GPU_CONFIG = {"block_t": 16, "groups_per_program": 8, "num_warps": 4}


def _cast(
    src: torch.Tensor,
    scales: torch.Tensor,
    dst: torch.Tensor,
    block_size: int | None,
    to_fp8: bool,
    use_ue8m0: bool = False,
    block_t: int | None = None,
    gpp: int | None = None,
) -> None:
    """Launches :func:`_per_token_cast_kernel` over ``src`` ``[T, H]`` (fp8 codes as uint8) in
    ``[T, H / block_size]`` blocks (``block_size`` None: ``H / scales.shape[1]``); nothing for
    an empty one. Explicit ``block_t`` / ``gpp`` (groups per program) win over the launch
    configuration."""
    num_tokens, hidden = src.shape
    num_groups = scales.shape[1]
    if not (num_tokens and num_groups):
        return
    block_size = block_size or hidden // num_groups
    if src.is_cuda:
        block_t = block_t or GPU_CONFIG["block_t"]
        gpp = gpp or min(GPU_CONFIG["groups_per_program"], num_groups)
    else:  # the interpreter: one column of programs, each looping over every block of its rows
        block_t = block_t or max(1, min(_next_pow2(num_tokens), (1 << 17) // block_size))
        gpp = gpp or num_groups
    with _device_of(src):
        _per_token_cast_kernel[(triton.cdiv(num_tokens, block_t), triton.cdiv(num_groups, gpp))](
            src,
            scales,
            dst,
            num_tokens,
            hidden,
            num_groups,
            BLOCK_T=block_t,
            BLOCK_SIZE=block_size,
            GROUPS_PER_PROGRAM=gpp,
            TO_FP8=to_fp8,
            USE_UE8M0=use_ue8m0,
            num_warps=GPU_CONFIG["num_warps"] if src.is_cuda else 4,
        )


def per_token_cast_to_fp8_triton(
    x: torch.Tensor,
    block_size: int = 128,
    use_ue8m0: bool = False,
    *,
    block_t: int | None = None,
    groups_per_program: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton quantization; bit-identical to :func:`per_token_cast_to_fp8_reference`. No
    validation, no host synchronisation. ``block_t``/``groups_per_program`` override the
    launch shape (tests)."""
    num_tokens, hidden = x.shape
    x_fp8 = torch.empty(num_tokens, hidden, dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty(num_tokens, hidden // block_size, dtype=torch.float32, device=x.device)
    _cast(x, scales, x_fp8.view(torch.uint8), block_size, True, use_ue8m0, block_t, groups_per_program)
    return x_fp8, scales


def per_token_cast_back_triton(
    x_fp8: torch.Tensor,
    scales: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
    *,
    block_t: int | None = None,
    groups_per_program: int | None = None,
) -> torch.Tensor:
    """Triton dequantization; matches :func:`per_token_cast_back_reference` exactly in fp32
    (bf16/fp16 outputs differ by the final rounding under the interpreter, which truncates)."""
    out = torch.empty(x_fp8.shape, dtype=dtype, device=x_fp8.device)
    _cast(x_fp8.view(torch.uint8), scales, out, None, False, block_t=block_t, gpp=groups_per_program)
    return out


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------


def per_token_cast_to_fp8(
    x: torch.Tensor,
    block_size: int = 128,
    *,
    use_ue8m0: bool = False,
    non_finite: str = "nan",
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantizes ``x`` to the fp8 dispatch format (see the module doc for the exact rule).

    Not collective; on the Triton path no host synchronisation (unless ``non_finite="raise"``).

    Args:
        x: ``[T, H]`` fp32/bf16/fp16, contiguous, ``H % block_size == 0``.
        block_size: elements per scale (128 for the dispatch format; a power of two >= 16).
        use_ue8m0: round each scale up to a power of two (UE8M0-representable).
        non_finite: ``"nan"``: NaN and +-Inf become e4m3 NaN and are excluded from their
            block's scale; ``"raise"``: reject such input with a ValueError (host sync).
        backend: ``"auto"`` (Triton on CUDA, torch on CPU), ``"triton"`` or ``"torch"``.

    Returns:
        ``(x_fp8 [T, H] torch.float8_e4m3fn, scales [T, H/block_size] fp32)``.

    Raises:
        TypeError / ValueError: bad dtype/shape, ``H`` not a multiple of ``block_size``, bad
            option, or non-finite input with ``non_finite="raise"``.
    """
    _check_block_size(block_size)
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    _check_hidden_multiple("x", x.shape[1], block_size)
    if non_finite not in NON_FINITE_MODES:
        raise ValueError(f"non_finite must be one of {NON_FINITE_MODES}, got {non_finite!r}")
    if non_finite == "raise" and x.numel() and not bool(torch.isfinite(x).all()):
        t, h = (int(i) for i in (~torch.isfinite(x)).nonzero()[0])
        raise ValueError(
            f"x has a non-finite value {x[t, h].item()} at [{t}, {h}]; e4m3 has no Inf "
            f"(use non_finite='nan' to carry it as NaN)"
        )
    if resolve_backend(backend, x):
        return per_token_cast_to_fp8_triton(x, block_size, use_ue8m0)
    return per_token_cast_to_fp8_reference(x, block_size, use_ue8m0)


def per_token_cast_back(
    x_fp8: torch.Tensor,
    scales: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """Dequantizes the fp8 dispatch format: ``out[t, h] = float(x_fp8[t, h]) * scales[t, h // B]``.

    Args:
        x_fp8: ``[T, H]`` torch.float8_e4m3fn.
        scales: ``[T, H/B]`` fp32 (B = H / scales.shape[1], 128 for the dispatch format).
        dtype: output dtype, fp32/bf16/fp16 (the product is formed in fp32, then rounded).
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.

    Returns:
        ``[T, H]`` in ``dtype``; e4m3 NaN stays NaN.

    Raises:
        TypeError / ValueError: bad dtypes/shapes.
    """
    check_tensor("x_fp8", x_fp8, ndim=2, dtypes=(FP8_DTYPE,))
    check_tensor("scales", scales, ndim=2, dtypes=(torch.float32,))
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype must be one of float32, bfloat16, float16, got {dtype}")
    num_tokens, hidden = x_fp8.shape
    groups = scales.shape[1]
    if scales.shape[0] != num_tokens or groups == 0 and hidden != 0 or groups and hidden % groups:
        raise ValueError(
            f"scales of shape {list(scales.shape)} do not fit x_fp8 of shape {list(x_fp8.shape)}: "
            f"expected [{num_tokens}, H / block_size]"
        )
    if groups:
        _check_block_size(hidden // groups)
    if resolve_backend(backend, x_fp8):
        return per_token_cast_back_triton(x_fp8, scales, dtype)
    return per_token_cast_back_reference(x_fp8, scales, dtype)
