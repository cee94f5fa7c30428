"""Fused permute / unpermute: received tokens <-> expert-major rows for the grouped GEMM.

The semantics (row order, padding, the static budget, autograd), :class:`PermuteHandle` and the
torch references are :mod:`moe_dispatch.semantics.permute`. This module holds the Triton
kernels (the CUDA path, also run under ``TRITON_INTERPRET=1`` in tests), the autograd
Functions, and the public :func:`permute` / :func:`unpermute`, which pick a kernel or its
reference.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .. import _ext
from ..errors import BudgetOverflowError
from ..semantics.permute import (
    PermuteHandle,
    PermuteLayout,
    permute_map_reference,
    permute_rows_reference,
    unpermute_rows_reference,
)
from ..semantics.validation import FLOAT_DTYPES, INDEX_DTYPES, check_tensor, check_topk_idx
from .layout import _accumulate_hits, _block_prefix, _device_of, _next_pow2, resolve_backend

INT32_MAX = 2**31 - 1
_FP8_DTYPES = tuple(d for d in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None)) if d)


PermuteOverflowError = BudgetOverflowError  # the permute budget's name for the one overflow error


class PermuteResult(NamedTuple):
    """Result of :func:`permute`.

    Attributes:
        permuted_x: ``[P, H]`` in x's dtype (a ``(x_fp8, scales)`` tuple for fp8 input).
        permuted_probs: ``[P]`` in probs' dtype (0 on padding), or None without probs.
        tokens_per_expert: ``[E_local]`` int64 padded rows per expert (= ``handle.tokens_per_expert``).
        handle: :class:`PermuteHandle` for :func:`unpermute`.
    """

    permuted_x: torch.Tensor | tuple[torch.Tensor, torch.Tensor]
    permuted_probs: torch.Tensor | None
    tokens_per_expert: torch.Tensor
    handle: PermuteHandle


# ---------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------


@triton.jit
def _permute_count_kernel(
    topk_idx_ptr,
    row_id_map_ptr,
    block_counts_ptr,
    num_tokens,
    num_experts,
    NUM_TOPK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    EXPERTS_PAD: tl.constexpr,
):
    """Index pass 1: per block of BLOCK_R tokens, the rank of each copy inside its expert
    among the block's copies (written to ``row_id_map``) and the block's per-expert counts."""
    pid = tl.program_id(0)
    tokens = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    token_mask = tokens < num_tokens
    rows = tokens.to(tl.int64)
    hits = tl.zeros([BLOCK_R, EXPERTS_PAD], tl.int1)
    for k in tl.static_range(NUM_TOPK):
        expert = tl.load(topk_idx_ptr + rows * NUM_TOPK + k, mask=token_mask, other=-1).to(tl.int32)
        valid = (expert >= 0) & (expert < num_experts)
        hits = _accumulate_hits(hits, expert, valid, 1, EXPERTS_PAD)
    h = hits.to(tl.int32)
    excl = tl.cumsum(h, axis=0) - h  # copies of expert e in earlier tokens of this block
    experts = tl.arange(0, EXPERTS_PAD)
    for k in tl.static_range(NUM_TOPK):
        expert = tl.load(topk_idx_ptr + rows * NUM_TOPK + k, mask=token_mask, other=-1).to(tl.int32)
        valid = (expert >= 0) & (expert < num_experts)
        local = tl.sum(tl.where(experts[None, :] == expert[:, None], excl, 0), axis=1)
        tl.store(row_id_map_ptr + rows * NUM_TOPK + k, tl.where(valid, local, -1), mask=token_mask)
    tl.store(block_counts_ptr + pid * num_experts + experts, tl.sum(h, axis=0), mask=experts < num_experts)


@triton.jit
def _permute_finalize_kernel(
    topk_idx_ptr,
    row_id_map_ptr,
    block_counts_ptr,
    tokens_per_expert_ptr,
    num_tokens_per_expert_ptr,
    expert_offsets_ptr,
    num_rows_needed_ptr,
    overflow_ptr,
    num_tokens,
    num_blocks,
    num_rows,
    num_experts,
    pad_multiple,
    expert_capacity,
    NUM_TOPK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    EXPERTS_PAD: tl.constexpr,
    CHUNK_B: tl.constexpr,
):
    """Index pass 2: row = padded start of the expert + copies in earlier blocks + rank in the
    block; rows >= num_rows or past the expert's block are dropped (-1). Program 0 writes the
    per-expert tables. ``expert_capacity`` >= 0: every block has that many rows (-1: none)."""
    pid = tl.program_id(0)
    before, count = _block_prefix(block_counts_ptr, pid, num_blocks, num_experts, EXPERTS_PAD, CHUNK_B)
    rounded = (count + pad_multiple - 1) // pad_multiple * pad_multiple
    padded = tl.where(expert_capacity >= 0, tl.zeros_like(rounded) + expert_capacity, rounded)
    start = tl.cumsum(padded, axis=0) - padded
    base = start + before
    end = start + padded
    experts = tl.arange(0, EXPERTS_PAD)
    tokens = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    token_mask = tokens < num_tokens
    rows = tokens.to(tl.int64)
    for k in tl.static_range(NUM_TOPK):
        expert = tl.load(topk_idx_ptr + rows * NUM_TOPK + k, mask=token_mask, other=-1).to(tl.int32)
        valid = (expert >= 0) & (expert < num_experts)
        local = tl.load(row_id_map_ptr + rows * NUM_TOPK + k, mask=token_mask, other=-1)
        match = experts[None, :] == expert[:, None]
        row = tl.sum(tl.where(match, base[None, :], 0), axis=1) + local
        row_end = tl.sum(tl.where(match, end[None, :], 0), axis=1)
        tl.store(
            row_id_map_ptr + rows * NUM_TOPK + k,
            tl.where(valid & (row < num_rows) & (row < row_end), row, -1),
            mask=token_mask,
        )
    if pid == 0:
        emask = experts < num_experts
        clipped = tl.minimum(tl.maximum(num_rows - start, 0), padded)
        tl.store(tokens_per_expert_ptr + experts, clipped.to(tl.int64), mask=emask)
        tl.store(num_tokens_per_expert_ptr + experts, count.to(tl.int64), mask=emask)
        tl.store(expert_offsets_ptr + experts, start, mask=emask)
        needed = tl.sum(tl.maximum(padded, rounded).to(tl.int64), axis=0)
        tl.store(num_rows_needed_ptr, needed)
        tl.store(overflow_ptr, (needed > num_rows).to(tl.uint8))


@triton.jit
def _store_rows(out_ptr, rows, values, row_mask, cols, col_mask, hidden):
    """``out[rows[i], cols] = values[i]`` where ``row_mask[i]`` (a ``[N, BLOCK_H]`` tile of a
    ``[*, hidden]`` row-major output)."""
    tl.store(
        out_ptr + rows.to(tl.int64)[:, None] * hidden + cols[None, :],
        values,
        mask=row_mask[:, None] & col_mask[None, :],
    )


@triton.jit
def _permute_scatter_kernel(
    x_ptr,
    row_id_map_ptr,
    probs_ptr,
    out_ptr,
    permuted_probs_ptr,
    expert_offsets_ptr,
    num_tokens_per_expert_ptr,
    tokens_per_expert_ptr,
    num_tokens,
    hidden,
    num_rows,
    num_token_blocks,
    num_experts,
    NUM_TOPK: tl.constexpr,
    EXPERTS_PAD: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_Z: tl.constexpr,
    HAS_PROBS: tl.constexpr,
):
    """Data pass, grid ``(token blocks + zero blocks, H blocks)``.

    Token programs read each token's ``[BLOCK_H]`` slice once and write it to each of its rows
    (R*H read, P*H written: no gather re-reads). Zero programs cover output rows
    ``[z*BLOCK_Z, (z+1)*BLOCK_Z)`` and write zeros to the rows no token fills (expert
    padding, the unused rows of fixed blocks, and the tail of a budget); the two sets of rows
    are disjoint (an expert's copies fill at most its block: ``tokens_per_expert``).
    """
    pid = tl.program_id(0)
    pid_h = tl.program_id(1)
    cols = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    col_mask = cols < hidden
    if pid < num_token_blocks:
        tokens = pid * BLOCK_R + tl.arange(0, BLOCK_R)
        token_mask = tokens < num_tokens
        rows = tokens.to(tl.int64)
        tile = tl.load(x_ptr + rows[:, None] * hidden + cols[None, :], mask=token_mask[:, None] & col_mask[None, :])
        for k in tl.static_range(NUM_TOPK):
            dst = tl.load(row_id_map_ptr + rows * NUM_TOPK + k, mask=token_mask, other=-1)
            dst_mask = dst >= 0
            _store_rows(out_ptr, dst, tile, dst_mask, cols, col_mask, hidden)
            if HAS_PROBS:
                if pid_h == 0:
                    p = tl.load(probs_ptr + rows * NUM_TOPK + k, mask=dst_mask)
                    tl.store(permuted_probs_ptr + dst, p, mask=dst_mask)
    else:
        out_rows = (pid - num_token_blocks) * BLOCK_Z + tl.arange(0, BLOCK_Z)
        experts = tl.arange(0, EXPERTS_PAD)
        emask = experts < num_experts
        start = tl.load(expert_offsets_ptr + experts, mask=emask, other=0)
        count = tl.minimum(
            tl.load(num_tokens_per_expert_ptr + experts, mask=emask, other=0),
            tl.load(tokens_per_expert_ptr + experts, mask=emask, other=0),
        ).to(tl.int32)
        filled = (out_rows[:, None] >= start[None, :]) & (out_rows[:, None] < (start + count)[None, :])
        hole = (tl.max(filled.to(tl.int32), axis=1) == 0) & (out_rows < num_rows)
        if tl.max(hole.to(tl.int32), axis=0) > 0:
            zeros = tl.zeros([BLOCK_Z, BLOCK_H], out_ptr.dtype.element_ty)
            _store_rows(out_ptr, out_rows, zeros, hole, cols, col_mask, hidden)
            if HAS_PROBS:
                if pid_h == 0:
                    tl.store(
                        permuted_probs_ptr + out_rows,
                        tl.zeros([BLOCK_Z], permuted_probs_ptr.dtype.element_ty),
                        mask=hole,
                    )


@triton.jit
def _unpermute_gather_kernel(
    y_ptr,
    row_id_map_ptr,
    row_weights_ptr,
    out_ptr,
    num_tokens,
    hidden,
    NUM_TOPK: tl.constexpr,
    TOPK_PAD: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
):
    """out[r, cols] = sum over r's rows in ascending order of w[row] * y[row, cols] in fp32.

    Gather form: each output element is written once, no atomics, deterministic."""
    pid_r = tl.program_id(0)
    pid_h = tl.program_id(1)
    tokens = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    token_mask = tokens < num_tokens
    rows = tokens.to(tl.int64)
    cols = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    col_mask = cols < hidden
    slots = tl.arange(0, TOPK_PAD)
    src = tl.load(
        row_id_map_ptr + rows[:, None] * NUM_TOPK + slots[None, :],
        mask=token_mask[:, None] & (slots < NUM_TOPK)[None, :],
        other=-1,
    )
    key = tl.where(src >= 0, src, 2147483647)
    if TOPK_PAD > 1:
        # Expert blocks are laid out in ascending expert order, so ascending row = ascending expert.
        key = tl.sort(key, dim=1)
    acc = tl.zeros([BLOCK_R, BLOCK_H], tl.float32)
    for i in tl.static_range(NUM_TOPK):
        row = tl.sum(tl.where(slots[None, :] == i, key, 0), axis=1)
        valid = row != 2147483647
        v = tl.load(
            y_ptr + row.to(tl.int64)[:, None] * hidden + cols[None, :],
            mask=valid[:, None] & col_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        if HAS_WEIGHTS:
            w = tl.load(row_weights_ptr + row, mask=valid, other=0.0).to(tl.float32)
            v = v * w[:, None]
        acc += v
    tl.store(
        out_ptr + rows[:, None] * hidden + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=token_mask[:, None] & col_mask[None, :],
    )


# Launch configuration of the data kernels on GPU (benchmarks/bench_kernels.py may override).
GPU_CONFIG = {
    "scatter_block_r": 8,
    "scatter_block_bytes": 2048,
    "zero_block": 64,
    "gather_block_r": 4,
    "gather_block_h": 1024,
    "num_warps": 4,
}


def _index_block(num_tokens: int, experts_pad: int, on_gpu: bool) -> int:
    """Tokens per program of the index kernels: a [BLOCK_R, EXPERTS_PAD] tile of <= 4096
    elements on GPU (register-resident over 8 warps for sm_90), big tiles for the interpreter."""
    tile = 1 << 12 if on_gpu else 1 << 16
    cap = 512 if on_gpu else 1 << 14
    return max(16, min(_next_pow2(max(num_tokens, 1)), tile // experts_pad, cap))


def permute_map_triton(topk_idx: torch.Tensor, layout: PermuteLayout, *, block_r: int | None = None) -> PermuteHandle:
    """Triton index phase; same result as :func:`permute_map_reference`. Two kernels (block
    counts and ranks, then block prefixes). Synchronises the host only where the layout has no
    static size (neither ``num_permuted_tokens`` nor ``expert_capacity``: to size the output)."""
    num_tokens, num_topk = topk_idx.shape
    device = topk_idx.device
    e, expert_capacity, static = layout.num_local_experts, layout.expert_capacity, layout.static_rows
    experts_pad = _next_pow2(e)
    row_id_map = torch.empty(num_tokens, num_topk, dtype=torch.int32, device=device)
    alloc = torch.empty if num_tokens > 0 else torch.zeros  # the kernels write every table
    tokens_per_expert = alloc(e, dtype=torch.int64, device=device)
    num_tokens_per_expert = alloc(e, dtype=torch.int64, device=device)
    expert_offsets = alloc(e, dtype=torch.int32, device=device)
    num_rows_needed = alloc((), dtype=torch.int64, device=device)
    overflow = alloc((), dtype=torch.bool, device=device)
    budget = INT32_MAX if static is None else static
    if num_tokens > 0:
        block = block_r or _index_block(num_tokens, experts_pad, topk_idx.is_cuda)
        num_blocks = triton.cdiv(num_tokens, block)
        block_counts = torch.empty(num_blocks, e, dtype=torch.int32, device=device)
        num_warps = 8 if block * experts_pad >= 2048 else 4
        with _device_of(topk_idx):
            _permute_count_kernel[(num_blocks,)](
                topk_idx,
                row_id_map,
                block_counts,
                num_tokens,
                e,
                NUM_TOPK=num_topk,
                BLOCK_R=block,
                EXPERTS_PAD=experts_pad,
                num_warps=num_warps,
            )
            _permute_finalize_kernel[(num_blocks,)](
                topk_idx,
                row_id_map,
                block_counts,
                tokens_per_expert,
                num_tokens_per_expert,
                expert_offsets,
                num_rows_needed,
                overflow.view(torch.uint8),
                num_tokens,
                num_blocks,
                budget,
                e,
                layout.pad_multiple,
                -1 if expert_capacity is None else expert_capacity,
                NUM_TOPK=num_topk,
                BLOCK_R=block,
                EXPERTS_PAD=experts_pad,
                CHUNK_B=max(1, min(_next_pow2(num_blocks), 4096 // experts_pad)),
                num_warps=num_warps,
            )
    if num_tokens == 0 and expert_capacity is not None:  # no kernel ran: the fixed blocks' tables
        tokens_per_expert.fill_(expert_capacity)
        expert_offsets.copy_(torch.arange(e, dtype=torch.int32, device=device) * expert_capacity)
        num_rows_needed.fill_(budget)
    return PermuteHandle(
        **layout.layout_fields(),
        row_id_map=row_id_map,
        tokens_per_expert=tokens_per_expert,
        num_tokens_per_expert=num_tokens_per_expert,
        expert_offsets=expert_offsets,
        num_rows_needed=num_rows_needed,
        overflow=overflow,
        num_tokens=num_tokens,
        num_rows=layout.resolve_rows(num_rows_needed),
    )


def permute_map_cpu(topk_idx: torch.Tensor, layout: PermuteLayout) -> PermuteHandle:
    """The index phase on CPU in two passes over ``topk_idx`` (``csrc/kernels/permute_cpu.cpp``),
    with :func:`~moe_dispatch.semantics.permute.permuted_sources` filled in: the handle of
    :func:`~moe_dispatch.semantics.permute.permute_map_reference` (same arguments), which runs
    where ``moe_dispatch._C`` is not built or ``topk_idx`` is not a CPU tensor."""
    if topk_idx.device.type != "cpu" or not _ext.extension_status().built:
        return permute_map_reference(topk_idx, layout)
    topk_idx = topk_idx.contiguous()
    num_tokens, num_topk = topk_idx.shape
    e, budget, capacity = layout.num_local_experts, layout.num_permuted_tokens, layout.expert_capacity
    most = layout.static_rows
    if most is None:  # every copy, each block padded
        most = num_tokens * num_topk + e * (layout.pad_multiple - 1)
    row_id_map = torch.empty((num_tokens, num_topk), dtype=torch.int32)
    counts, tokens_per_expert = torch.empty((2, e), dtype=torch.int64)
    expert_offsets = torch.empty(e, dtype=torch.int32)
    src, entry = torch.empty((2, most), dtype=torch.int64)
    needed, num_rows = _ext._C.permute_map_cpu(
        topk_idx=topk_idx.data_ptr(),
        index_bytes=topk_idx.element_size(),
        num_tokens=num_tokens,
        num_topk=num_topk,
        num_experts=e,
        pad_multiple=layout.pad_multiple,
        num_permuted_tokens=-1 if budget is None else budget,
        expert_capacity=-1 if capacity is None else capacity,
        row_id_map=row_id_map.data_ptr(),
        num_tokens_per_expert=counts.data_ptr(),
        tokens_per_expert=tokens_per_expert.data_ptr(),
        expert_offsets=expert_offsets.data_ptr(),
        src=src.data_ptr(),
        entry=entry.data_ptr(),
        sources_size=most,
    )
    return PermuteHandle(
        **layout.layout_fields(),
        row_id_map=row_id_map,
        tokens_per_expert=tokens_per_expert,
        num_tokens_per_expert=counts,
        expert_offsets=expert_offsets,
        num_rows_needed=torch.tensor(needed, dtype=torch.int64),
        overflow=torch.tensor(needed > num_rows),
        num_tokens=num_tokens,
        num_rows=num_rows,
        sources=(src[:num_rows], entry[:num_rows]),
    )


def _int_view(t: torch.Tensor) -> torch.Tensor:
    """Same bytes as an integer tensor: data movement then copies bits (NaN payloads, -0.0,
    fp8) and the interpreter needs no fp8/bf16 support."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _row_blocks(
    rows: int, hidden: int, on_gpu: bool, gpu: tuple[int, int], tile: int, block_r=None, block_h=None
) -> tuple[int, int]:
    """``(block_r, block_h)`` of a data kernel over ``rows`` x ``hidden``: explicit values win; on
    GPU ``gpu`` (rows, at most that many columns); under the interpreter few programs, big tiles
    (up to 8192 columns, ``tile`` elements)."""
    if on_gpu:
        block_h = block_h or min(_next_pow2(hidden), gpu[1])
        block_r = block_r or gpu[0]
    else:
        block_h = block_h or min(_next_pow2(hidden), 8192)
        block_r = block_r or max(1, min(_next_pow2(max(rows, 1)), tile // block_h))
    return block_r, block_h


def permute_rows_triton(
    x: torch.Tensor, handle: PermuteHandle, probs: torch.Tensor | None = None, **blocks
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Triton data phase; same result as :func:`permute_rows_reference` (bit-exact). One launch,
    no host synchronisation. ``blocks``: the launch shape's ``block_r``, ``block_h`` and
    ``block_z`` (rows per zero program), where given (tests, benchmarks)."""
    num_tokens, hidden = x.shape
    num_rows = handle.num_rows
    out = torch.empty(num_rows, hidden, dtype=x.dtype, device=x.device)
    permuted_probs = None
    if probs is not None:
        permuted_probs = torch.empty(num_rows, dtype=probs.dtype, device=probs.device)
    if num_rows == 0 or hidden == 0:
        return out, permuted_probs
    on_gpu, block_z = x.is_cuda, blocks.pop("block_z", None)
    gpu = (GPU_CONFIG["scatter_block_r"], max(16, GPU_CONFIG["scatter_block_bytes"] // x.element_size()))
    block_r, block_h = _row_blocks(num_tokens, hidden, on_gpu, gpu, 1 << 20, **blocks)
    if on_gpu:
        block_z = block_z or GPU_CONFIG["zero_block"]
    else:  # the interpreter: few programs, big tiles
        block_z = block_z or max(1, min(_next_pow2(num_rows), (1 << 20) // block_h))
    num_token_blocks = triton.cdiv(num_tokens, block_r)
    grid = (num_token_blocks + triton.cdiv(num_rows, block_z), triton.cdiv(hidden, block_h))
    has_probs = probs is not None
    with _device_of(x):
        _permute_scatter_kernel[grid](
            _int_view(x),
            handle.row_id_map,
            probs if has_probs else x,
            _int_view(out),
            permuted_probs if has_probs else x,
            handle.expert_offsets,
            handle.num_tokens_per_expert,
            handle.tokens_per_expert,
            num_tokens,
            hidden,
            num_rows,
            num_token_blocks,
            handle.num_local_experts,
            NUM_TOPK=handle.row_id_map.shape[1],
            EXPERTS_PAD=_next_pow2(handle.num_local_experts),
            BLOCK_R=block_r,
            BLOCK_H=block_h,
            BLOCK_Z=block_z,
            HAS_PROBS=has_probs,
            num_warps=GPU_CONFIG["num_warps"] if on_gpu else 4,
        )
    return out, permuted_probs


def unpermute_rows_triton(
    y: torch.Tensor, handle: PermuteHandle, row_weights: torch.Tensor | None = None, **blocks
) -> torch.Tensor:
    """Triton unpermute; matches :func:`unpermute_rows_reference` up to fp32 rounding (on GPU
    the multiply-add may fuse into an FMA). No host synchronisation. ``blocks``: the launch
    shape's ``block_r`` and ``block_h``, where given (tests, benchmarks)."""
    num_tokens = handle.num_tokens
    hidden = y.shape[1]
    out = torch.empty(num_tokens, hidden, dtype=y.dtype, device=y.device)
    if num_tokens == 0 or hidden == 0:
        return out
    num_topk = handle.row_id_map.shape[1]
    gpu = (GPU_CONFIG["gather_block_r"], GPU_CONFIG["gather_block_h"])
    block_r, block_h = _row_blocks(num_tokens, hidden, y.is_cuda, gpu, 1 << 19, **blocks)
    grid = (triton.cdiv(num_tokens, block_r), triton.cdiv(hidden, block_h))
    with _device_of(y):
        _unpermute_gather_kernel[grid](
            y,
            handle.row_id_map,
            row_weights if row_weights is not None else y,
            out,
            num_tokens,
            hidden,
            NUM_TOPK=num_topk,
            TOPK_PAD=_next_pow2(num_topk),
            BLOCK_R=block_r,
            BLOCK_H=block_h,
            HAS_WEIGHTS=row_weights is not None,
            num_warps=GPU_CONFIG["num_warps"] if y.is_cuda else 4,
        )
    return out


# ---------------------------------------------------------------------------------------------
# Autograd
# ---------------------------------------------------------------------------------------------


def _permute_rows(x, handle, probs, use_triton):
    return (permute_rows_triton if use_triton else permute_rows_reference)(x, handle, probs)


def _unpermute_rows(y, handle, row_weights, use_triton):
    return (unpermute_rows_triton if use_triton else unpermute_rows_reference)(y, handle, row_weights)


def _gather_row_grads(grad_rows: torch.Tensor, handle: PermuteHandle) -> torch.Tensor:
    """``[P]`` per-row gradient -> ``[R, K]`` per-slot gradient (0 where the slot has no row)."""
    row = handle.row_id_map
    g = grad_rows[row.clamp(min=0).long()] if grad_rows.numel() else grad_rows.new_zeros(row.shape)
    return torch.where(row >= 0, g, torch.zeros_like(g))


class _PermuteFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, probs, handle, use_triton):
        out, permuted_probs = _permute_rows(x, handle, probs, use_triton)
        ctx.handle, ctx.use_triton = handle, use_triton
        if permuted_probs is None:
            return out
        return out, permuted_probs

    @staticmethod
    def backward(ctx, grad_out, grad_permuted_probs=None):
        grad_x = grad_probs = None
        if ctx.needs_input_grad[0]:
            grad_x = _unpermute_rows(grad_out.contiguous(), ctx.handle, None, ctx.use_triton)
        if ctx.needs_input_grad[1] and grad_permuted_probs is not None:
            grad_probs = _gather_row_grads(grad_permuted_probs, ctx.handle)
        return grad_x, grad_probs, None, None


class _UnpermuteFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, row_weights, handle, use_triton):
        ctx.handle, ctx.use_triton = handle, use_triton
        ctx.save_for_backward(y if (row_weights is not None and ctx.needs_input_grad[1]) else None, row_weights)
        return _unpermute_rows(y, handle, row_weights, use_triton)

    @staticmethod
    def backward(ctx, grad_out):
        y, row_weights = ctx.saved_tensors
        g, _ = _permute_rows(grad_out.contiguous(), ctx.handle, None, ctx.use_triton)  # [P, H], holes 0
        grad_w = None
        if row_weights is not None and ctx.needs_input_grad[1]:
            grad_w = (g.float() * y.float()).sum(1).to(row_weights.dtype)
        if row_weights is not None:
            g = (g.float() * row_weights.float().unsqueeze(1)).to(g.dtype)
        return (g if ctx.needs_input_grad[0] else None), grad_w, None, None


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------


def check_permute_args(topk_idx, num_local_experts, pad_multiple, num_permuted_tokens, expert_capacity):
    """Raises TypeError/ValueError naming the first bad argument of a permute (see :func:`permute`)."""
    check_tensor("topk_idx", topk_idx, ndim=2, dtypes=INDEX_DTYPES)
    if not isinstance(num_local_experts, int) or isinstance(num_local_experts, bool) or num_local_experts < 1:
        raise ValueError(f"num_local_experts must be a positive int, got {num_local_experts!r}")
    if not isinstance(pad_multiple, int) or isinstance(pad_multiple, bool) or pad_multiple < 1:
        raise ValueError(f"pad_multiple must be a positive int (1, 16, 64, 128, 256 are usual), got {pad_multiple!r}")
    if num_permuted_tokens is not None and (not isinstance(num_permuted_tokens, int) or num_permuted_tokens < 0):
        raise ValueError(f"num_permuted_tokens must be None or an int >= 0, got {num_permuted_tokens!r}")
    if expert_capacity is None:
        return
    if (
        not isinstance(expert_capacity, int)
        or isinstance(expert_capacity, bool)
        or expert_capacity < 0
        or expert_capacity % pad_multiple
    ):
        raise ValueError(
            f"expert_capacity must be None or an int >= 0 that is a multiple of pad_multiple="
            f"{pad_multiple} (rows of every expert block), got {expert_capacity!r}"
        )
    if num_permuted_tokens is not None:
        raise ValueError(
            f"expert_capacity ({expert_capacity}) fixes the output at E_local * expert_capacity rows: "
            f"pass it or num_permuted_tokens ({num_permuted_tokens}), not both"
        )


def make_permute_handle(
    topk_idx: torch.Tensor,
    num_local_experts: int,
    *,
    pad_multiple: int = 1,
    num_permuted_tokens: int | None = None,
    expert_capacity: int | None = None,
    validate: bool | None = None,
    backend: str = "auto",
) -> PermuteHandle:
    """Computes only the index phase of :func:`permute` (the row of every copy, the split sizes).

    Args:
        topk_idx: ``[R, K]`` int32/int64, contiguous, local expert ids in ``[0, E_local)``,
            ``-1`` = none; no expert twice in a row.
        num_local_experts: E_local.
        pad_multiple: each expert's rows are padded with zero rows to a multiple of this.
        num_permuted_tokens: static output budget P (no host sync; overflow flagged), or None
            for exactly the rows needed (synchronises the host to size the output).
        expert_capacity: C, rows of every expert block (a multiple of ``pad_multiple``): the
            output has E_local * C rows, no host sync, copies beyond C flagged (Megatron's
            drop-and-pad layout); excludes ``num_permuted_tokens``. None: blocks as needed.
        validate: check ``topk_idx`` values on the host (a sync). Default: when there is no
            budget and no ``expert_capacity``. Unvalidated ids outside ``[0, E_local)`` count
            as -1; a repeated expert in a row makes two copies share one row (the sum in
            unpermute counts it twice). The torch backend always validates.
        backend: ``"auto"`` (Triton on CUDA, torch on CPU), ``"triton"`` or ``"torch"``.

    Returns:
        :class:`PermuteHandle`.

    Raises:
        TypeError / ValueError: bad arguments (named in the message).
    """
    check_permute_args(topk_idx, num_local_experts, pad_multiple, num_permuted_tokens, expert_capacity)
    use_triton = resolve_backend(backend, topk_idx)
    if validate is None:
        validate = num_permuted_tokens is None and expert_capacity is None
    if validate or not use_triton:
        check_topk_idx(topk_idx, num_local_experts)
    build = permute_map_triton if use_triton else permute_map_cpu
    return build(topk_idx, PermuteLayout(num_local_experts, pad_multiple, num_permuted_tokens, expert_capacity))


def permute(
    x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    topk_idx: torch.Tensor,
    probs: torch.Tensor | None = None,
    *,
    handle: PermuteHandle | None = None,
    backend: str = "auto",
    **index_phase,
) -> PermuteResult:
    """Received tokens -> expert-major, padded rows (fused: one kernel moves the data).

    Args:
        x: ``[R, H]`` fp32/bf16/fp16 (differentiable), or an fp8 pair ``(x_fp8 [R, H]
            float8_e4m3fn, scales [R, S] fp32)`` whose two parts move together (no autograd).
        topk_idx: ``[R, K]`` int32/int64 local expert ids, ``-1`` = none (see
            :func:`make_permute_handle`). Ignored when ``handle`` is given.
        probs: ``[R, K]`` floating weights of the slots, or None; permuted alongside
            (differentiable).
        handle: reuse a handle from :func:`make_permute_handle` / an earlier permute (then
            ``index_phase`` is not read).
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.
        index_phase: the keywords of :func:`make_permute_handle` after ``topk_idx``:
            ``num_local_experts`` (E_local, required), ``pad_multiple`` (zero-row padding
            multiple per expert block), ``num_permuted_tokens`` (static budget P: output rows
            fixed, no host synchronisation, overflow flagged in ``handle.overflow``: check with
            :func:`check_permute_overflow`), ``expert_capacity`` (fixed expert blocks of this
            many rows), ``validate``.

    Returns:
        :class:`PermuteResult` ``(permuted_x [P, H], permuted_probs [P] | None,
        tokens_per_expert [E_local] int64, handle)``.

    Raises:
        TypeError / ValueError: bad arguments (named in the message).
    """
    fp8 = isinstance(x, (tuple, list))
    data = x[0] if fp8 else x
    if fp8:
        if len(x) != 2:
            raise ValueError(f"x as a tuple must be (x_fp8, scales), got {len(x)} items")
        check_tensor("x[0] (x_fp8)", x[0], ndim=2, dtypes=_FP8_DTYPES)
        check_tensor("x[1] (scales)", x[1], ndim=2, dtypes=(torch.float32,))
        if x[1].shape[0] != x[0].shape[0]:
            raise ValueError(f"scales has {x[1].shape[0]} rows but x_fp8 has {x[0].shape[0]}")
    else:
        check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    if handle is None:
        handle = make_permute_handle(topk_idx, backend=backend, **index_phase)
    if data.shape[0] != handle.num_tokens:
        raise ValueError(f"x has {data.shape[0]} rows but topk_idx has {handle.num_tokens} tokens")
    if handle.row_id_map.device != data.device:
        raise ValueError(f"x is on {data.device} but topk_idx is on {handle.row_id_map.device}")
    if probs is not None:
        check_tensor("probs", probs, ndim=2, dtypes=FLOAT_DTYPES)
        if probs.shape != handle.row_id_map.shape:
            raise ValueError(
                f"probs has shape {list(probs.shape)} but topk_idx has shape {list(handle.row_id_map.shape)}"
            )
    use_triton = resolve_backend(backend, data)
    if fp8:
        with torch.no_grad():
            q, permuted_probs = _permute_rows(x[0], handle, probs, use_triton)
            s, _ = _permute_rows(x[1], handle, None, use_triton)
        return PermuteResult((q, s), permuted_probs, handle.tokens_per_expert, handle)
    res = _PermuteFunction.apply(x, probs, handle, use_triton)
    out, permuted_probs = res if probs is not None else (res, None)
    return PermuteResult(out, permuted_probs, handle.tokens_per_expert, handle)


def unpermute(
    permuted_x: torch.Tensor,
    handle: PermuteHandle,
    permuted_probs: torch.Tensor | None = None,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """Inverse of :func:`permute`: ``out[r] = sum over r's copies (ascending expert) of
    permuted_probs[row] * permuted_x[row]`` (weight 1 without probs), fp32 accumulation.

    Args:
        permuted_x: ``[P, H]`` fp32/bf16/fp16, the expert outputs in the permuted row order.
        handle: from :func:`permute`.
        permuted_probs: ``[P]`` floating per-row weights (e.g. ``permute``'s permuted_probs),
            or None for an unweighted sum (Megatron's combine: experts applied the probs).
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.

    Returns:
        ``[R, H]`` in permuted_x's dtype; tokens with no copy are zero. Differentiable in
        ``permuted_x`` and ``permuted_probs``. No host synchronisation on the Triton path.

    Raises:
        TypeError / ValueError: bad shapes/dtypes/devices.
    """
    check_tensor("permuted_x", permuted_x, ndim=2, dtypes=FLOAT_DTYPES)
    if permuted_x.shape[0] != handle.num_rows:
        raise ValueError(
            f"permuted_x has {permuted_x.shape[0]} rows but the handle's permute produced {handle.num_rows}"
        )
    if handle.row_id_map.device != permuted_x.device:
        raise ValueError(f"permuted_x is on {permuted_x.device} but the handle is on {handle.row_id_map.device}")
    if permuted_probs is not None:
        check_tensor("permuted_probs", permuted_probs, ndim=1, dtypes=FLOAT_DTYPES)
        if permuted_probs.shape[0] != handle.num_rows:
            raise ValueError(f"permuted_probs has {permuted_probs.shape[0]} rows but permuted_x has {handle.num_rows}")
    use_triton = resolve_backend(backend, permuted_x)
    return _UnpermuteFunction.apply(permuted_x, permuted_probs, handle, use_triton)


def check_permute_overflow(handle: PermuteHandle, *, allow_drop: bool = False) -> bool:
    """Reads the overflow flag of a budgeted or fixed-block permute on the host (synchronises
    the device).

    Args:
        handle: from :func:`permute` / :func:`make_permute_handle`.
        allow_drop: return True on overflow instead of raising (the caller accepts that the
            copies beyond the budget are missing from the output and from unpermute's sum).

    Returns:
        True when rows were dropped (only with ``allow_drop``), else False.

    Raises:
        BudgetOverflowError (alias ``PermuteOverflowError``): the padded layout needed more rows
            than ``num_permuted_tokens``, or an expert more copies than ``expert_capacity``.
    """
    if (handle.num_permuted_tokens is None and handle.expert_capacity is None) or not bool(handle.overflow):
        return False
    if allow_drop:
        return True
    if handle.expert_capacity is not None:
        counts = handle.num_tokens_per_expert.tolist()
        raise BudgetOverflowError(
            f"permute got {max(counts)} copies for one expert (per expert: {counts}) but expert_capacity="
            f"{handle.expert_capacity}; the copies beyond an expert's capacity were dropped. Raise expert_capacity, "
            f"or pass allow_drop=True to accept the loss"
        )
    raise BudgetOverflowError(
        f"permute needed {int(handle.num_rows_needed)} rows (pad_multiple={handle.pad_multiple}, "
        f"{handle.num_local_experts} local experts) but num_permuted_tokens={handle.num_permuted_tokens}; "
        f"the copies at rows >= {handle.num_permuted_tokens} were dropped. Raise num_permuted_tokens, "
        f"or pass allow_drop=True to accept the loss"
    )
