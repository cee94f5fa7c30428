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

from .sums import SumPlan, ordered_sum, plan_sum_by_output


@dataclasses.dataclass(eq=False)
class PermuteLayout:
    """The expert-major layout a permute asks for (see the module doc).

    Attributes:
        num_local_experts: E_local.
        pad_multiple: each expert block's row count is rounded up to a multiple of this.
        num_permuted_tokens: the static budget P, or None.
        expert_capacity: C, rows of every expert block (P = E_local * C; excludes a budget), or None.
    """

    num_local_experts: int
    pad_multiple: int = 1
    num_permuted_tokens: int | None = None
    expert_capacity: int | None = None

    @property
    def static_rows(self) -> int | None:
        """P when it is fixed before the index phase (fixed blocks or a budget), else None (it
        follows the ids)."""
        if self.expert_capacity is not None:
            return self.num_local_experts * self.expert_capacity
        return self.num_permuted_tokens

    def resolve_rows(self, needed: torch.Tensor) -> int:
        """P: :attr:`static_rows`, else the rows the padded layout ``needed`` (``[]`` int64: a
        host read)."""
        static = self.static_rows
        return int(needed) if static is None else static

    def layout_fields(self) -> dict:
        """This layout's own fields (a subclass's too: what a :class:`PermuteHandle` of it carries)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(PermuteLayout)}


@dataclasses.dataclass(eq=False, kw_only=True)
class PermuteHandle(PermuteLayout):
    """Everything unpermute (and the backward passes) needs; one per micro-batch: the
    :class:`PermuteLayout` it was made for (its fields) and the index phase's tables.

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
        sources: ``(src, entry)`` of :func:`permuted_sources`, once computed.
        sum_plans: unpermute's sum plans (:func:`unpermute_plan`), once computed.
    """

    row_id_map: torch.Tensor
    tokens_per_expert: torch.Tensor
    num_tokens_per_expert: torch.Tensor
    expert_offsets: torch.Tensor
    num_rows_needed: torch.Tensor
    overflow: torch.Tensor
    num_tokens: int
    num_rows: int
    # Derived once per handle, on first use (permuted_sources, unpermute_plan):
    sources: tuple[torch.Tensor, torch.Tensor] | None = dataclasses.field(default=None, repr=False)
    sum_plans: dict = dataclasses.field(default_factory=dict, repr=False)


def permute_map_reference(topk_idx: torch.Tensor, layout: PermuteLayout) -> PermuteHandle:
    """Torch reference of the index phase: the row of every (token, slot) (see module doc).

    Args:
        topk_idx: ``[R, K]`` int32/int64 local expert ids, ``-1`` = none (ids outside
            ``[0, E_local)`` count as none; validation is the caller's).
        layout: the :class:`PermuteLayout` (no budget: exactly the rows needed).

    Returns:
        :class:`PermuteHandle` on topk_idx's device.
    """
    num_tokens, num_topk = topk_idx.shape
    device = topk_idx.device
    e, pad_multiple, expert_capacity = layout.num_local_experts, layout.pad_multiple, layout.expert_capacity
    idx = topk_idx.t()  # slot-major [K, R]: the one-hot below is indexed by it without copies
    col = torch.where((idx >= 0) & (idx < e), idx, e).long().contiguous()  # expert e: none
    # hits[x, t]: token t has a copy for expert x (no expert twice in a row); the copies of x in
    # earlier tokens give each copy its rank inside its expert (ascending token order)
    hits = torch.zeros((e + 1, num_tokens), dtype=torch.int32, device=device).scatter_(0, col, 1)
    cum = torch.cumsum(hits, 1, dtype=torch.int32)  # inclusive: a copy's rank is its value - 1
    rank = cum.gather(0, col) - 1
    counts = cum[:e, -1].long() if num_tokens else torch.zeros(e, dtype=torch.int64, device=device)
    rounded = (counts + pad_multiple - 1) // pad_multiple * pad_multiple
    padded = rounded if expert_capacity is None else torch.full_like(counts, expert_capacity)
    start = torch.cumsum(padded, 0) - padded
    needed = torch.maximum(padded, rounded).sum()
    flat = col.flatten()
    row = torch.cat([start, start.new_zeros(1)]).to(torch.int32).index_select(0, flat).view_as(rank) + rank
    num_rows = layout.resolve_rows(needed)
    keep = col < e
    if layout.static_rows is not None:  # else every copy has a row
        padded_ext = torch.cat([padded, padded.new_zeros(1)]).to(torch.int32).index_select(0, flat).view_as(rank)
        keep &= (row < num_rows) & (rank < padded_ext)
    row = torch.where(keep, row, -1)
    return PermuteHandle(
        **layout.layout_fields(),
        row_id_map=row.t().contiguous(),
        tokens_per_expert=torch.minimum(torch.clamp(num_rows - start, min=0), padded),
        num_tokens_per_expert=counts,
        expert_offsets=start.to(torch.int32),
        num_rows_needed=needed.reshape(()),
        overflow=(needed > num_rows).reshape(()),
        num_tokens=num_tokens,
        num_rows=num_rows,
    )


def permuted_sources(handle: PermuteHandle) -> tuple[torch.Tensor, torch.Tensor]:
    """``(src [P], entry [P])`` int64: the received row each output row holds a copy of, and that
    copy's entry ``row * K + slot`` of ``topk_idx``; ``-1`` for zero rows (padding, the unused tail of a
    budget or block). Computed once per handle."""
    if handle.sources is None:
        num_topk = handle.row_id_map.shape[1]
        flat = handle.row_id_map.reshape(-1)
        where = torch.nonzero(flat >= 0).flatten()
        rows = flat[where].long()
        src = torch.full((handle.num_rows,), -1, dtype=torch.int64, device=flat.device)
        entry = torch.full_like(src, -1)
        src[rows] = where // num_topk
        entry[rows] = where
        handle.sources = (src, entry)
    return handle.sources


def gather_rows(x: torch.Tensor, src: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``out[i] = x[src[i]]``, a zero row where ``src[i]`` is -1: one gather, then the zero rows."""
    out = torch.empty((src.numel(), *x.shape[1:]), dtype=x.dtype, device=x.device) if out is None else out
    if x.shape[0] == 0:
        return out.zero_()
    torch.index_select(x, 0, src.clamp(min=0), out=out)
    holes = torch.nonzero(src < 0).flatten()
    if holes.numel():  # zero bits are +0.0 in every float format; bytes also cover fp8 (no index_fill_)
        out.view(torch.uint8).index_fill_(0, holes, 0)
    return out


def permute_rows_reference(
    x: torch.Tensor, handle: PermuteHandle, probs: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Torch reference of the data phase: ``x [R, H]`` -> ``[P, H]`` (zero rows where no copy
    lands); ``probs [R, K]`` -> ``[P]``. Pure data movement (bit-exact for any dtype): one gather."""
    src, entry = permuted_sources(handle)
    out = gather_rows(x, src)
    permuted_probs = None if probs is None else gather_rows(probs.reshape(-1, 1), entry).view(-1)
    return out, permuted_probs


def unpermute_plan(handle: PermuteHandle, scaled: bool = False) -> SumPlan:
    """The :class:`~moe_dispatch.semantics.sums.SumPlan` of unpermute: each output row onto its
    received row (zero rows left out), ascending row = ascending expert. Cached on the handle."""
    key = "unpermute (scaled)" if scaled else "unpermute"
    if key not in handle.sum_plans:
        handle.sum_plans[key] = plan_sum_by_output(handle.row_id_map.long(), handle.num_rows, scaled=scaled)
    return handle.sum_plans[key]


def unpermute_rows_reference(
    y: torch.Tensor, handle: PermuteHandle, row_weights: torch.Tensor | None = None
) -> torch.Tensor:
    """Torch reference of unpermute: ``out[r] = sum_k w[row] * y[row]`` over r's rows in
    ascending order (= ascending expert), accumulated in fp32, returned in y's dtype
    (:func:`~moe_dispatch.semantics.sums.ordered_sum`: each copy read once, no fp32 copy of y)."""
    scale = None if row_weights is None else row_weights.float()
    return ordered_sum(unpermute_plan(handle, scale is not None), y, scale)
