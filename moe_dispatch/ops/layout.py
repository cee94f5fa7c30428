"""Routing layout: who receives which token, and where in each send block.

The semantics and the torch reference (the oracle and the CPU path) are
:mod:`moe_dispatch.semantics.layout`. This module holds the Triton kernels (the CUDA path; they
also run under ``TRITON_INTERPRET=1`` for tests), :func:`get_dispatch_layout`, which picks the
kernels or the reference, the backend choice the other ops share, and the conversions between
Megatron-Core's ``routing_map``/``probs`` and the top-k form.
"""

from __future__ import annotations

import contextlib
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .. import _ext
from ..semantics.layout import (
    check_layout_sizes,
    get_dispatch_layout_torch,
    get_send_offsets_reference,
    is_token_in_rank_torch,
)
from ..semantics.validation import (
    INDEX_DTYPES,
    check_num_experts,
    check_tensor,
    check_topk_idx,
    raise_on_topk_idx_values,
)

# ---------------------------------------------------------------------------------------------
# Backend choice shared by layout / permute / quant
# ---------------------------------------------------------------------------------------------

BACKENDS = ("auto", "triton", "torch")


def _interpreting() -> bool:
    """True when Triton kernels run on CPU tensors through ``TRITON_INTERPRET=1``."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def resolve_backend(backend: str, tensor: torch.Tensor) -> bool:
    """Picks the implementation for ``tensor``: returns True for Triton, False for torch.

    ``"auto"`` takes Triton for CUDA tensors and the torch reference for CPU tensors;
    ``"triton"`` forces the kernel (a CPU tensor then needs ``TRITON_INTERPRET=1``, set before
    triton is imported); ``"torch"`` forces the reference.

    Raises:
        ValueError: unknown ``backend``, or ``"triton"`` on a CPU tensor without the interpreter.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return tensor.is_cuda
    if backend == "torch":
        return False
    if not tensor.is_cuda and not _interpreting():
        raise ValueError(
            f"backend='triton' needs CUDA tensors, or TRITON_INTERPRET=1 set before triton is "
            f"imported to run the kernels on CPU; got a tensor on {tensor.device}"
        )
    return True


def _device_of(tensor: torch.Tensor):
    """Context that makes ``tensor``'s GPU current (Triton launches on the current device)."""
    return torch.cuda.device(tensor.device) if tensor.is_cuda else contextlib.nullcontext()


def _next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


# ---------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------


@triton.jit
def _accumulate_hits(hits, expert, valid, experts_per_dest, DESTS_PAD: tl.constexpr):
    """``hits [BLOCK, DESTS_PAD]`` |= one-hot of ``expert // experts_per_dest`` where ``valid``."""
    dest = tl.where(valid, expert // experts_per_dest, -1)
    return hits | (dest[:, None] == tl.arange(0, DESTS_PAD)[None, :])


@triton.jit
def _store_block_offsets(hits, rows, row_mask, offsets_ptr, block_counts_ptr, pid, num_dests, DESTS_PAD: tl.constexpr):
    """Writes block-local exclusive prefix sums of ``hits [BLOCK, DESTS_PAD]`` over rows
    (``-1`` where no hit) to ``offsets [rows, num_dests]`` and the block's per-destination
    totals to ``block_counts [pid, num_dests]``."""
    h = hits.to(tl.int32)
    excl = tl.cumsum(h, axis=0) - h
    cols = tl.arange(0, DESTS_PAD)
    col_mask = cols < num_dests
    tl.store(
        offsets_ptr + rows[:, None] * num_dests + cols[None, :],
        tl.where(hits, excl, -1),
        mask=row_mask[:, None] & col_mask[None, :],
    )
    tl.store(block_counts_ptr + pid * num_dests + cols, tl.sum(h, axis=0), mask=col_mask)


@triton.jit
def _block_prefix(block_counts_ptr, pid, num_blocks, num_dests, DESTS_PAD: tl.constexpr, CHUNK_B: tl.constexpr):
    """``(sum of block_counts[b, :] over b < pid, sum over all b)`` as int32 ``[DESTS_PAD]``."""
    cols = tl.arange(0, DESTS_PAD)
    col_mask = cols < num_dests
    before = tl.zeros([DESTS_PAD], tl.int32)
    total = tl.zeros([DESTS_PAD], tl.int32)
    for b0 in range(0, num_blocks, CHUNK_B):
        bs = b0 + tl.arange(0, CHUNK_B)
        c = tl.load(
            block_counts_ptr + bs[:, None] * num_dests + cols[None, :],
            mask=(bs < num_blocks)[:, None] & col_mask[None, :],
            other=0,
        )
        total += tl.sum(c, axis=0)
        before += tl.sum(tl.where((bs < pid)[:, None], c, 0), axis=0)
    return before, total


@triton.jit
def _finalize_offsets(
    offsets_ptr,
    block_counts_ptr,
    rows,
    row_mask,
    pid,
    num_blocks,
    num_dests,
    DESTS_PAD: tl.constexpr,
    CHUNK_B: tl.constexpr,
):
    """Adds the count of earlier blocks to this block's offsets; returns the totals."""
    before, total = _block_prefix(block_counts_ptr, pid, num_blocks, num_dests, DESTS_PAD, CHUNK_B)
    cols = tl.arange(0, DESTS_PAD)
    ptrs = offsets_ptr + rows[:, None] * num_dests + cols[None, :]
    mask = row_mask[:, None] & (cols < num_dests)[None, :]
    off = tl.load(ptrs, mask=mask, other=-1)
    tl.store(ptrs, tl.where(off >= 0, off + before[None, :], off), mask=mask)
    return total


@triton.jit
def _layout_count_kernel(
    topk_idx_ptr,
    is_token_in_rank_ptr,
    rank_send_offsets_ptr,
    node_send_offsets_ptr,
    block_rank_counts_ptr,
    block_node_counts_ptr,
    block_expert_counts_ptr,
    num_tokens,
    num_experts,
    num_ranks,
    num_nodes,
    experts_per_rank,
    experts_per_node,
    NUM_TOPK: tl.constexpr,
    BLOCK_T: tl.constexpr,
    RANKS_PAD: tl.constexpr,
    NODES_PAD: tl.constexpr,
    EXPERTS_PAD: tl.constexpr,
):
    """Pass 1 (the only read of ``topk_idx``): program ``pid`` owns tokens
    ``[pid*BLOCK_T, (pid+1)*BLOCK_T)``; writes ``is_token_in_rank``, block-local send offsets
    and the block's rank / node / expert counts (``block_*_counts [num_blocks, D]``)."""
    pid = tl.program_id(0)
    tokens = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    token_mask = tokens < num_tokens
    rows = tokens.to(tl.int64)
    rank_hits = tl.zeros([BLOCK_T, RANKS_PAD], tl.int1)
    node_hits = tl.zeros([BLOCK_T, NODES_PAD], tl.int1)
    expert_counts = tl.zeros([EXPERTS_PAD], tl.int32)
    for k in tl.static_range(NUM_TOPK):
        expert = tl.load(topk_idx_ptr + rows * NUM_TOPK + k, mask=token_mask, other=-1).to(tl.int32)
        # ids outside [0, E) count as "no expert" (they are rejected on the host when validating)
        valid = (expert >= 0) & (expert < num_experts)
        expert_counts += tl.histogram(tl.where(valid, expert, 0), EXPERTS_PAD, mask=valid)
        rank_hits = _accumulate_hits(rank_hits, expert, valid, experts_per_rank, RANKS_PAD)
        node_hits = _accumulate_hits(node_hits, expert, valid, experts_per_node, NODES_PAD)
    ranks = tl.arange(0, RANKS_PAD)
    tl.store(
        is_token_in_rank_ptr + rows[:, None] * num_ranks + ranks[None, :],
        rank_hits.to(tl.uint8),
        mask=token_mask[:, None] & (ranks < num_ranks)[None, :],
    )
    _store_block_offsets(
        rank_hits, rows, token_mask, rank_send_offsets_ptr, block_rank_counts_ptr, pid, num_ranks, RANKS_PAD
    )
    _store_block_offsets(
        node_hits, rows, token_mask, node_send_offsets_ptr, block_node_counts_ptr, pid, num_nodes, NODES_PAD
    )
    experts = tl.arange(0, EXPERTS_PAD)
    tl.store(block_expert_counts_ptr + pid * num_experts + experts, expert_counts, mask=experts < num_experts)


@triton.jit
def _layout_finalize_kernel(
    rank_send_offsets_ptr,
    node_send_offsets_ptr,
    block_rank_counts_ptr,
    block_node_counts_ptr,
    block_expert_counts_ptr,
    num_tokens_per_rank_ptr,
    num_tokens_per_node_ptr,
    num_tokens_per_expert_ptr,
    num_tokens,
    num_blocks,
    num_experts,
    num_ranks,
    num_nodes,
    BLOCK_T: tl.constexpr,
    RANKS_PAD: tl.constexpr,
    NODES_PAD: tl.constexpr,
    EXPERTS_PAD: tl.constexpr,
    CHUNK_B: tl.constexpr,
):
    """Pass 2 (over the small per-block counts): adds earlier blocks' counts to each block's
    send offsets; program 0 also writes the int64 totals."""
    pid = tl.program_id(0)
    tokens = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    token_mask = tokens < num_tokens
    rows = tokens.to(tl.int64)
    rank_total = _finalize_offsets(
        rank_send_offsets_ptr, block_rank_counts_ptr, rows, token_mask, pid, num_blocks, num_ranks, RANKS_PAD, CHUNK_B
    )
    node_total = _finalize_offsets(
        node_send_offsets_ptr, block_node_counts_ptr, rows, token_mask, pid, num_blocks, num_nodes, NODES_PAD, CHUNK_B
    )
    if pid == 0:
        ranks = tl.arange(0, RANKS_PAD)
        tl.store(num_tokens_per_rank_ptr + ranks, rank_total.to(tl.int64), mask=ranks < num_ranks)
        nodes = tl.arange(0, NODES_PAD)
        tl.store(num_tokens_per_node_ptr + nodes, node_total.to(tl.int64), mask=nodes < num_nodes)
        _, expert_total = _block_prefix(block_expert_counts_ptr, pid, num_blocks, num_experts, EXPERTS_PAD, CHUNK_B)
        experts = tl.arange(0, EXPERTS_PAD)
        tl.store(num_tokens_per_expert_ptr + experts, expert_total.to(tl.int64), mask=experts < num_experts)


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------


class DispatchLayout(NamedTuple):
    """Result of :func:`get_dispatch_layout` (a named tuple; the first four fields are
    DeepEP's ``get_dispatch_layout`` outputs, ``layout[:4]`` equals the reference's tuple).

    Attributes:
        num_tokens_per_rank: ``[W]`` int64, tokens each rank receives from this one.
        num_tokens_per_node: ``[N]`` int64, tokens each node receives (once per node).
        num_tokens_per_expert: ``[E]`` int64, (token, expert) pairs per global expert.
        is_token_in_rank: ``[T, W]`` bool.
        rank_send_offsets: ``[T, W]`` int32, slot of token t in rank r's send block (tokens in
            ascending order), ``-1`` where t does not go to r.
        node_send_offsets: ``[T, N]`` int32, the same per destination node (stage 1 of the
            hierarchy: a token crosses to each node once).
    """

    num_tokens_per_rank: torch.Tensor
    num_tokens_per_node: torch.Tensor
    num_tokens_per_expert: torch.Tensor
    is_token_in_rank: torch.Tensor
    rank_send_offsets: torch.Tensor
    node_send_offsets: torch.Tensor


def get_dispatch_layout_triton(
    topk_idx: torch.Tensor, num_experts: int, num_ranks: int, ranks_per_node: int, *, block_t: int | None = None
) -> DispatchLayout:
    """Triton layout (no validation, no host synchronisation; CUDA-graph safe on GPU).
    ``block_t`` (a power of two) overrides the tokens per program (tests use it to cross
    block boundaries)."""
    num_tokens, num_topk = topk_idx.shape
    num_nodes = num_ranks // ranks_per_node
    device = topk_idx.device
    on_gpu = topk_idx.is_cuda
    # tl.histogram on GPU needs a bin count divisible by the warp size (32)
    ranks_pad, nodes_pad, experts_pad = _next_pow2(num_ranks), _next_pow2(num_nodes), max(32, _next_pow2(num_experts))
    # The widest register tile is [BLOCK_T, RANKS_PAD]: on GPU <= 4096 elements over 8 warps
    # keeps it in registers (checked with ptxas for sm_90); the interpreter prefers few big programs.
    if on_gpu:
        block_t = block_t or max(32, min(256, _next_pow2(max(num_tokens, 1)), 4096 // ranks_pad))
    else:
        block_t = block_t or max(32, min(1 << 14, _next_pow2(max(num_tokens, 1)), (1 << 16) // ranks_pad))
    num_blocks = triton.cdiv(num_tokens, block_t)
    is_token_in_rank = torch.empty(num_tokens, num_ranks, dtype=torch.bool, device=device)
    rank_send_offsets = torch.empty(num_tokens, num_ranks, dtype=torch.int32, device=device)
    node_send_offsets = torch.empty(num_tokens, num_nodes, dtype=torch.int32, device=device)
    # the finalize kernel writes every count (no memset launches); nothing to write for T = 0
    alloc = torch.empty if num_tokens > 0 else torch.zeros
    num_tokens_per_rank = alloc(num_ranks, dtype=torch.int64, device=device)
    num_tokens_per_node = alloc(num_nodes, dtype=torch.int64, device=device)
    num_tokens_per_expert = alloc(num_experts, dtype=torch.int64, device=device)
    if num_tokens > 0:
        # one workspace for the three per-block count tables
        work = torch.empty(num_blocks * (num_ranks + num_nodes + num_experts), dtype=torch.int32, device=device)
        block_rank_counts, block_node_counts, block_expert_counts = torch.split(
            work, [num_blocks * num_ranks, num_blocks * num_nodes, num_blocks * num_experts]
        )
        meta = dict(BLOCK_T=block_t, RANKS_PAD=ranks_pad, NODES_PAD=nodes_pad, EXPERTS_PAD=experts_pad)
        num_warps = 8 if block_t * ranks_pad >= 2048 else 4
        chunk_b = max(1, min(_next_pow2(num_blocks), 4096 // max(ranks_pad, experts_pad)))
        with _device_of(topk_idx):
            _layout_count_kernel[(num_blocks,)](
                topk_idx,
                is_token_in_rank.view(torch.uint8),
                rank_send_offsets,
                node_send_offsets,
                block_rank_counts,
                block_node_counts,
                block_expert_counts,
                num_tokens,
                num_experts,
                num_ranks,
                num_nodes,
                num_experts // num_ranks,
                num_experts // num_nodes,
                NUM_TOPK=num_topk,
                num_warps=num_warps,
                **meta,
            )
            _layout_finalize_kernel[(num_blocks,)](
                rank_send_offsets,
                node_send_offsets,
                block_rank_counts,
                block_node_counts,
                block_expert_counts,
                num_tokens_per_rank,
                num_tokens_per_node,
                num_tokens_per_expert,
                num_tokens,
                num_blocks,
                num_experts,
                num_ranks,
                num_nodes,
                CHUNK_B=chunk_b,
                num_warps=num_warps,
                **meta,
            )
    return DispatchLayout(
        num_tokens_per_rank,
        num_tokens_per_node,
        num_tokens_per_expert,
        is_token_in_rank,
        rank_send_offsets,
        node_send_offsets,
    )


def get_dispatch_layout(
    topk_idx: torch.Tensor,
    num_experts: int,
    num_ranks: int,
    ranks_per_node: int,
    *,
    validate: bool = True,
    backend: str = "auto",
) -> DispatchLayout:
    """Routing layout plus the send offsets a sender packs its buffers with.

    Semantics are those of :func:`~moe_dispatch.semantics.layout.get_dispatch_layout_reference`
    (the oracle; DeepEP's ``get_dispatch_layout``), extended by the per-destination send offsets
    of :func:`~moe_dispatch.semantics.layout.get_send_offsets_reference`. On CUDA two Triton
    kernels run: one pass over ``topk_idx`` (block-local counts and offsets), then a pass over the
    per-block counts that adds each block's prefix (no atomics: the result is deterministic).
    Not collective.

    Args:
        topk_idx: ``[T, K]`` int32/int64, contiguous, global expert ids, ``-1`` = no expert.
        num_experts: E, divisible by ``num_ranks``.
        num_ranks: W, the EP world size.
        ranks_per_node: L, dividing W.
        validate: check ``topk_idx`` values (range, no expert twice in a row). This reads
            ``topk_idx`` on the host (a device sync); pass False where the caller already
            validated or needs CUDA-graph capture: ids outside ``[0, E)`` then count as ``-1``
            and a repeated expert counts twice in ``num_tokens_per_expert`` (both backends).
        backend: ``"auto"`` (Triton on CUDA, torch reference on CPU), ``"triton"`` or ``"torch"``.

    Returns:
        :class:`DispatchLayout` on ``topk_idx``'s device.

    Raises:
        TypeError / ValueError: bad ``topk_idx`` dtype/shape (or values when validating), sizes
            that do not divide, or an unusable ``backend``.
    """
    check_layout_sizes(num_experts, num_ranks, ranks_per_node)
    check_tensor("topk_idx", topk_idx, ndim=2, dtypes=INDEX_DTYPES)
    use_triton = resolve_backend(backend, topk_idx)
    if validate:
        check_topk_idx(topk_idx, num_experts)
    if use_triton:
        return get_dispatch_layout_triton(topk_idx, num_experts, num_ranks, ranks_per_node)
    base = get_dispatch_layout_torch(topk_idx, num_experts, num_ranks, ranks_per_node)
    return DispatchLayout(*base, *get_send_offsets_reference(base[3], ranks_per_node))


def _native(topk_idx: torch.Tensor) -> bool:
    """Whether the CPU passes of ``_C`` take ``topk_idx``: on CPU, built, and not while
    torch.compile traces (Megatron compiles its dispatch_preprocess; the torch version traces)."""
    return topk_idx.device.type == "cpu" and _ext.extension_status().built and not torch.compiler.is_compiling()


def _topk_args(topk_idx: torch.Tensor) -> dict[str, int]:
    """A contiguous ``topk_idx [T, K]``'s arguments to the passes of ``csrc/kernels/layout_cpu.cpp``."""
    return dict(
        topk_idx=topk_idx.data_ptr(),
        index_bytes=topk_idx.element_size(),
        num_tokens=topk_idx.shape[0],
        num_topk=topk_idx.shape[1],
    )


def check_topk_idx_cpu(topk_idx, num_experts: int, **kwargs) -> None:
    """:func:`~moe_dispatch.semantics.validation.check_topk_idx` (same arguments, same errors)
    with the value check in one pass over a CPU ``topk_idx`` (``csrc/kernels/layout_cpu.cpp``)
    instead of a min, a max and a row sort; the reference runs on other devices or where
    ``moe_dispatch._C`` is not built."""
    values = kwargs.pop("values", True)
    native = values and isinstance(topk_idx, torch.Tensor) and _native(topk_idx)
    check_topk_idx(topk_idx, num_experts, values=values and not native, **kwargs)
    if native and topk_idx.numel():
        lo, hi, dup_row = _ext._C.check_topk_idx_cpu(**_topk_args(topk_idx))
        raise_on_topk_idx_values(topk_idx, num_experts, lo, hi, dup_row)


def is_token_in_rank_cpu(topk_idx: torch.Tensor, num_experts: int, num_ranks: int) -> torch.Tensor:
    """:func:`~moe_dispatch.semantics.layout.is_token_in_rank_torch` (``[T, W]`` bool, unchecked
    inputs: ids outside ``[0, E)`` count as none) in one pass over a contiguous CPU ``topk_idx``;
    the reference elsewhere."""
    if not (_native(topk_idx) and topk_idx.is_contiguous()):
        return is_token_in_rank_torch(topk_idx, num_experts, num_ranks)
    out = torch.empty((topk_idx.shape[0], num_ranks), dtype=torch.bool)
    _ext._C.is_token_in_rank_cpu(
        **_topk_args(topk_idx),
        num_experts=num_experts,
        num_ranks=num_ranks,
        out=out.data_ptr(),
    )
    return out


def localize_topk_idx_cpu(
    topk_idx: torch.Tensor,
    counts: torch.Tensor,
    first_expert: int,
    num_local_experts: int,
    weights: torch.Tensor | None = None,
) -> None:
    """Received top-k ids in local numbering, in place: ``topk_idx [R, K]`` ids of ``[first_expert,
    first_expert + num_local_experts)`` less ``first_expert``, the others -1 (their ``weights [R,
    K]`` zeroed in place); ``counts [num_local_experts]`` int64 gets each local id's occurrences.
    In one pass over contiguous CPU ids (``csrc/kernels/layout_cpu.cpp``), else in torch ops."""
    usable = weights is None or (weights.dtype == torch.float32 and weights.is_contiguous())
    if _native(topk_idx) and usable and topk_idx.is_contiguous() and counts.is_contiguous():
        _ext._C.localize_topk_idx_cpu(
            **_topk_args(topk_idx),
            first_expert=first_expert,
            num_local_experts=num_local_experts,
            counts=counts.data_ptr(),
            weights=0 if weights is None else weights.data_ptr(),
        )
        return
    local = topk_idx.sub_(first_expert)
    other = (local < 0) | (local >= num_local_experts)
    local.masked_fill_(other, -1)
    # -1 counts in bin 0. A static-size add: bincount would read the largest id on the host.
    bins = torch.zeros(num_local_experts + 1, dtype=torch.int64, device=local.device)
    flat = local.view(-1).to(torch.int64) + 1
    bins.index_add_(0, flat, torch.ones_like(flat))
    counts.copy_(bins[1:])
    if weights is not None:
        weights.masked_fill_(other, 0.0)


# ---------------------------------------------------------------------------------------------
# Megatron's routing_map / probs  <->  top-k form
# ---------------------------------------------------------------------------------------------


def routing_map_to_topk(
    routing_map: torch.Tensor, probs: torch.Tensor | None, num_topk: int, *, validate: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Megatron-Core's ``routing_map [T, E]`` (+ ``probs [T, E]``) to top-k form.

    Each row lists its selected experts in ascending expert id, then ``-1`` (weight 0) up to
    ``num_topk`` columns. Vectorised torch ops (a top-k per row), the same on CPU and CUDA; no
    host synchronisation unless ``validate``.

    Args:
        routing_map: ``[T, E]`` bool (or 0/1 integer), True where token t goes to expert e.
        probs: ``[T, E]`` floating or None; ``probs[t, e]`` is the weight of the pair (t, e).
        num_topk: K, the columns of the result; at least the largest row count of ``routing_map``.
        validate: check that no row selects more than ``num_topk`` experts (reads the map on
            the host); unvalidated extra selections (the highest expert ids) are dropped.

    Returns:
        ``topk_idx [T, K]`` int64 and ``topk_weights [T, K]`` fp32 (None when ``probs`` is None).

    Raises:
        TypeError / ValueError: bad shapes/dtypes, ``num_topk < 1``, or a row with more than
            ``num_topk`` selected experts.
    """
    if not isinstance(routing_map, torch.Tensor) or routing_map.dim() != 2:
        raise ValueError(f"routing_map must be a 2-D [T, E] tensor, got {_describe(routing_map)}")
    if routing_map.dtype.is_floating_point or routing_map.dtype.is_complex:
        raise TypeError(f"routing_map must be bool (or 0/1 integer), got {routing_map.dtype}")
    if not isinstance(num_topk, int) or num_topk < 1:
        raise ValueError(f"num_topk must be a positive int, got {num_topk!r}")
    if probs is not None:
        if not isinstance(probs, torch.Tensor) or probs.shape != routing_map.shape or not probs.dtype.is_floating_point:
            raise ValueError(
                f"probs must be a floating tensor of routing_map's shape "
                f"{list(routing_map.shape)}, got {_describe(probs)}"
            )
    num_tokens, num_experts = routing_map.shape
    if _native(routing_map) and routing_map.element_size() == 1 and (probs is None or probs.dtype in _PROBS_DTYPES):
        return _routing_map_to_topk_cpu(routing_map, probs, num_topk, validate)
    selected = routing_map.bool()
    if validate and num_tokens > 0:
        counts = selected.sum(1)
        worst = int(counts.max())
        if worst > num_topk:
            row = int(torch.argmax(counts))
            raise ValueError(f"routing_map row {row} selects {worst} experts but num_topk is {num_topk}")
    # The K largest keys E - e of the selected experts (0 elsewhere) are the selected experts in
    # ascending id: a top-k, not a sort of all E entries per row (int32 keys: E <= 2**20).
    width = min(num_topk, num_experts)
    key = selected.to(torch.int32).mul_(
        num_experts - torch.arange(num_experts, dtype=torch.int32, device=selected.device)
    )
    values, order = torch.topk(key, width, dim=1)
    chosen = values > 0
    topk_idx = torch.where(chosen, order, torch.full_like(order, -1))
    topk_weights = None
    if probs is not None:
        w = torch.gather(probs, 1, order).float()
        topk_weights = torch.where(chosen, w, torch.zeros_like(w))
    if width < num_topk:  # more columns than experts: pad with "no expert"
        pad = num_topk - width
        topk_idx = torch.nn.functional.pad(topk_idx, (0, pad), value=-1)
        if topk_weights is not None:
            topk_weights = torch.nn.functional.pad(topk_weights, (0, pad), value=0.0)
    return topk_idx.contiguous(), (None if topk_weights is None else topk_weights.contiguous())


_PROBS_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float64: 3}


def _routing_map_to_topk_cpu(routing_map, probs, num_topk: int, validate: bool):
    """:func:`routing_map_to_topk` of a one-byte CPU map in one pass (``csrc/kernels/layout_cpu.cpp``);
    weights that need a gradient (Megatron's router probs) are gathered by torch, for autograd."""
    routing_map = routing_map.contiguous()
    differentiable = probs is not None and probs.requires_grad and torch.is_grad_enabled()
    gathered, probs = (probs, None) if differentiable else (None, None if probs is None else probs.contiguous())
    num_tokens, num_experts = routing_map.shape
    topk_idx = torch.empty((num_tokens, num_topk), dtype=torch.int64)
    topk_weights = None if probs is None else torch.empty((num_tokens, num_topk), dtype=torch.float32)
    worst, row, fewest = _ext._C.routing_map_to_topk_cpu(
        routing_map=routing_map.data_ptr(),
        num_tokens=num_tokens,
        num_experts=num_experts,
        num_topk=num_topk,
        probs=0 if probs is None else probs.data_ptr(),
        probs_dtype=0 if probs is None else _PROBS_DTYPES[probs.dtype],
        topk_idx=topk_idx.data_ptr(),
        topk_weights=0 if topk_weights is None else topk_weights.data_ptr(),
    )
    if validate and worst > num_topk:
        raise ValueError(f"routing_map row {row} selects {worst} experts but num_topk is {num_topk}")
    if gathered is not None and fewest >= num_topk:  # every slot holds an expert (Megatron's top-k)
        topk_weights = torch.gather(gathered, 1, topk_idx).float()
    elif gathered is not None:
        w = torch.gather(gathered, 1, topk_idx.clamp(min=0)).float()
        topk_weights = w.masked_fill(topk_idx < 0, 0.0)
    return topk_idx, topk_weights


def topk_to_routing_map(
    topk_idx: torch.Tensor, topk_weights: torch.Tensor | None, num_experts: int, *, validate: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Top-k form to Megatron-Core's ``routing_map [T, E]`` bool and ``probs [T, E]``.

    Inverse of :func:`routing_map_to_topk` (up to column order). Vectorised torch ops on CPU
    and CUDA.

    Args:
        topk_idx: ``[T, K]`` int32/int64, expert ids in ``[0, E)``, ``-1`` = no expert.
        topk_weights: ``[T, K]`` floating or None.
        num_experts: E.
        validate: check ``topk_idx`` values on the host (range, no repeats); unvalidated ids
            outside ``[0, E)`` are ignored.

    Returns:
        ``routing_map [T, E]`` bool and ``probs [T, E]`` fp32 (0 where not routed; None when
        ``topk_weights`` is None).

    Raises:
        TypeError / ValueError: bad shapes/dtypes/values.
    """
    if validate:
        check_topk_idx(topk_idx, num_experts)
    else:
        check_tensor("topk_idx", topk_idx, ndim=2, dtypes=INDEX_DTYPES)
        check_num_experts(num_experts)
    if topk_weights is not None:
        if (
            not isinstance(topk_weights, torch.Tensor)
            or topk_weights.shape != topk_idx.shape
            or not topk_weights.dtype.is_floating_point
        ):
            raise ValueError(
                f"topk_weights must be a floating tensor of topk_idx's shape "
                f"{list(topk_idx.shape)}, got {_describe(topk_weights)}"
            )
    num_tokens = topk_idx.shape[0]
    idx = topk_idx.long()
    idx = torch.where((idx >= 0) & (idx < num_experts), idx, num_experts)  # column E = "nowhere"
    routing_map = torch.zeros(num_tokens, num_experts + 1, dtype=torch.bool, device=topk_idx.device)
    routing_map.scatter_(1, idx, True)
    probs = None
    if topk_weights is not None:
        probs = torch.zeros(num_tokens, num_experts + 1, dtype=torch.float32, device=topk_idx.device)
        probs.scatter_(1, idx, topk_weights.float())
        probs = probs[:, :num_experts].contiguous()
    return routing_map[:, :num_experts].contiguous(), probs


def _describe(t) -> str:
    if isinstance(t, torch.Tensor):
        return f"{str(t.dtype).removeprefix('torch.')} tensor of shape {list(t.shape)}"
    return type(t).__name__
