"""Permute / unpermute, the torch reference: received tokens <-> expert-major rows for the
grouped GEMM.

Semantics (the layout Megatron-Core's HybridEP path hands its experts):

- Input: ``x [R, H]`` received tokens and ``topk_idx [R, K]`` in local expert numbering
  ``0..E_local-1`` (``-1`` = no local expert for that slot), optionally ``probs [R, K]``.
- Output rows are expert-major: expert 0's copies, then expert 1's, ...; inside an expert the
  copies follow ascending received-row order (deterministic, no atomics). Each expert's block
  is padded with zero rows up to a multiple of ``pad_multiple`` (1, 16, 64, 128, 256 are the
  usual values: fp8/fp4 grouped GEMMs want aligned groups). ``permuted_probs`` follows the
  rows (0 on padding).
- The inverse map ``row_id_map [R, K]`` int32 gives the output row of each (token, slot), or
  ``-1``. Unpermute gathers a token's copies in ascending expert order (= ascending row),
  optionally multiplies each by its row's prob, sums in fp32 and returns x's dtype.
- Static budget ``num_permuted_tokens = P``: the output has exactly P rows, no host
  synchronisation; rows >= P are not written and the device flag ``handle.overflow`` is set
  exactly when the padded layout needs more than P rows.
- Fixed expert blocks ``expert_capacity = C`` (Megatron's drop-and-pad,
  ``moe_pad_expert_input_to_capacity``): every expert block has exactly C rows, P = E_local * C,
  no host synchronisation; an expert's copies beyond C (the last in received-row order) are not
  written and set ``handle.overflow``; the unused rows of a block are zero rows (prob 0).
  :func:`~moe_dispatch.ops.permute.check_permute_overflow` turns the flag into an error on the
  host (or accepts the loss when asked).
- Autograd: permute's backward is the unweighted unpermute of the gradient, unpermute's
  backward is the permute of the gradient (times the probs when weighted); the gradient of
  the probs flows in both.

Each step has a torch reference here (``*_reference``: the oracle and the CPU path) and a
Triton kernel in :mod:`moe_dispatch.ops.permute` (the CUDA path, also run under
``TRITON_INTERPRET=1`` in tests).
"""

from __future__ import annotations

import dataclasses

import torch

_INT32_MAX = 2**31 - 1


@dataclasses.dataclass(eq=False)
class PermuteHandle:
    """Everything unpermute (and the backward passes) needs; one per micro-batch.

    Attributes:
        row_id_map: ``[R, K]`` int32, output row of (received token r, slot k); ``-1`` where the
            slot has no local expert or the row fell beyond the budget.
        tokens_per_expert: ``[E_local]`` int64, rows of each expert block in the output
            (padded to ``pad_multiple``, clipped to the budget; ``expert_capacity`` each with fixed
            blocks): the grouped-GEMM split sizes.
        num_tokens_per_expert: ``[E_local]`` int64, real copies per expert (unpadded, unclipped).
        expert_offsets: ``[E_local]`` int32, first output row of each expert block.
        num_rows_needed: ``[]`` int64, rows the padded layout needs to keep every copy (sum over
            experts of the padded count, or of the larger of it and ``expert_capacity``).
        overflow: ``[]`` bool, ``num_rows_needed > num_rows`` (only possible with a budget or
            fixed blocks).
        num_tokens: R.
        num_rows: P, rows of the permuted output.
        num_local_experts: E_local.
        pad_multiple: the padding multiple.
        num_permuted_tokens: the static budget, or None.
        expert_capacity: rows of every expert block (fixed blocks), or None.
    """

    row_id_map: torch.Tensor
    tokens_per_expert: torch.Tensor
    num_tokens_per_expert: torch.Tensor
    expert_offsets: torch.Tensor
    num_rows_needed: torch.Tensor
    overflow: torch.Tensor
    num_tokens: int
    num_rows: int
    num_local_experts: int
    pad_multiple: int
    num_permuted_tokens: int | None
    expert_capacity: int | None = None


def permute_map_reference(
    topk_idx: torch.Tensor,
    num_local_experts: int,
    pad_multiple: int = 1,
    num_permuted_tokens: int | None = None,
    expert_capacity: int | None = None,
) -> PermuteHandle:
    """Torch reference of the index phase: the row of every (token, slot) (see module doc).

    Args:
        topk_idx: ``[R, K]`` int32/int64 local expert ids, ``-1`` = none (ids outside
            ``[0, E_local)`` count as none; validation is the caller's).
        num_local_experts: E_local.
        pad_multiple: each expert block's row count is rounded up to a multiple of this.
        num_permuted_tokens: static budget P, or None for exactly the rows needed.
        expert_capacity: C, rows of every expert block (P = E_local * C; excludes a budget), or None.

    Returns:
        :class:`PermuteHandle` on topk_idx's device.
    """
    num_tokens, num_topk = topk_idx.shape
    device = topk_idx.device
    e = num_local_experts
    idx = topk_idx.long()
    valid = (idx >= 0) & (idx < e)
    flat = torch.where(valid, idx, e).flatten()  # row-major: token-major, slot-minor
    counts_all = torch.bincount(flat, minlength=e + 1)
    counts = counts_all[:e]
    rounded = (counts + pad_multiple - 1) // pad_multiple * pad_multiple
    padded = rounded if expert_capacity is None else torch.full_like(counts, expert_capacity)
    start = torch.cumsum(padded, 0) - padded
    needed = torch.maximum(padded, rounded).sum()
    # stable sort by expert keeps ascending token order inside each expert (no repeats in a row)
    order = torch.argsort(flat, stable=True)
    first = torch.cumsum(counts_all, 0) - counts_all
    rank_sorted = torch.arange(flat.numel(), device=device) - first[flat[order]]
    rank = torch.empty_like(rank_sorted)
    rank[order] = rank_sorted
    start_ext = torch.cat([start, start.new_zeros(1)])
    padded_ext = torch.cat([padded, padded.new_zeros(1)])
    row = start_ext[flat] + rank
    if expert_capacity is not None:
        num_rows = e * expert_capacity
    else:
        num_rows = int(needed) if num_permuted_tokens is None else num_permuted_tokens
    row = torch.where((flat < e) & (row < num_rows) & (rank < padded_ext[flat]), row, -1)
    return PermuteHandle(
        row_id_map=row.view(num_tokens, num_topk).to(torch.int32),
        tokens_per_expert=torch.minimum(torch.clamp(num_rows - start, min=0), padded),
        num_tokens_per_expert=counts,
        expert_offsets=start.to(torch.int32),
        num_rows_needed=needed.reshape(()),
        overflow=(needed > num_rows).reshape(()),
        num_tokens=num_tokens,
        num_rows=num_rows,
        num_local_experts=e,
        pad_multiple=pad_multiple,
        num_permuted_tokens=num_permuted_tokens,
        expert_capacity=expert_capacity,
    )


def permute_rows_reference(
    x: torch.Tensor, handle: PermuteHandle, probs: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Torch reference of the data phase: ``x [R, H]`` -> ``[P, H]`` (zero rows where no copy
    lands); ``probs [R, K]`` -> ``[P]``. Pure data movement (bit-exact for any dtype)."""
    row = handle.row_id_map
    sel = row >= 0
    src = torch.arange(handle.num_tokens, device=x.device).unsqueeze(1).expand_as(row)[sel]
    dst = row[sel].long()
    out = torch.zeros(handle.num_rows, *x.shape[1:], dtype=x.dtype, device=x.device)
    out[dst] = x[src]
    permuted_probs = None
    if probs is not None:
        permuted_probs = torch.zeros(handle.num_rows, dtype=probs.dtype, device=probs.device)
        permuted_probs[dst] = probs[sel]
    return out, permuted_probs


def unpermute_rows_reference(
    y: torch.Tensor, handle: PermuteHandle, row_weights: torch.Tensor | None = None
) -> torch.Tensor:
    """Torch reference of unpermute: ``out[r] = sum_k w[row] * y[row]`` over r's rows in
    ascending order (= ascending expert), accumulated in fp32, returned in y's dtype."""
    num_rows = y.shape[0]
    key = torch.where(handle.row_id_map >= 0, handle.row_id_map, _INT32_MAX)
    key = torch.sort(key, dim=1).values.long()
    key = torch.where(key == _INT32_MAX, num_rows, key)  # -> an extra zero row
    y_ext = torch.cat([y, y.new_zeros(1, y.shape[1])])
    w_ext = None
    if row_weights is not None:
        w_ext = torch.cat([row_weights.float(), row_weights.new_zeros(1, dtype=torch.float32)])
    acc = torch.zeros(handle.num_tokens, y.shape[1], dtype=torch.float32, device=y.device)
    for i in range(key.shape[1]):  # K steps of vectorised work, in the kernel's order
        v = y_ext.index_select(0, key[:, i]).float()
        if w_ext is not None:
            v = v * w_ext.index_select(0, key[:, i]).unsqueeze(1)
        acc += v
    return acc.to(y.dtype)
