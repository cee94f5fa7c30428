"""Row sums in a fixed order, fast: one level of the summation order (:mod:`.summation`), the
reduction of the transports' combine and of unpermute.

``ordered_sum(plan, rows)`` computes, for every output row ``o``,

    out[o] = round(+0.0 + rows[i_1] + rows[i_2] + ...)     (i_1 < i_2 < ... the rows that map to o)

with every addition in fp32 (each row optionally multiplied by its fp32 scale first) and one rounding
to the rows' dtype at the end: the bits of :func:`.summation.sum_by_index` for bf16, fp16 and fp32
rows (``test_sums`` compares them), where ascending row is ascending local rank, node or expert.
Outputs no row maps to are +0.0.

How, without an fp32 copy of whole blocks:

- An output of at most two terms is added in the rows' own dtype (``index_add_``): torch adds two
  values of a 16-bit float type in fp32 and rounds the result, which is the fp32 sum's rounding; the
  first add starts from +0.0 (so -0.0 becomes +0.0 as in fp32). Two terms commute, so the order of
  the adds (atomics on CUDA) cannot change the bits. One ``index_add_`` serves all of them, over
  their rows only (gathered first where other rows are left out or take the fp32 path: on CPU an
  ``index_add_`` costs about three row gathers per row).
- Outputs of three terms or more (every output, with scales) are accumulated in fp32 by slot: sorted
  by their number of terms (most first) and taken in blocks whose fp32 accumulator fits the cache,
  slot ``j`` adds the ``j``-th term of every output of the block that has one (a prefix of the
  block), gathered in the rows' dtype (the add converts it on the fly). Every slot touches each
  output at most once and the slots run in order, so the result is the same on any device and any
  thread count (no atomics decide an order).

The plan (:func:`plan_sum`) depends only on the row -> output index, so a combine computes it once per
dispatch and reuses it for every call and the backward pass.
"""

from __future__ import annotations

import dataclasses

import torch

ROW_DTYPE_TERMS = 2  # outputs with at most this many terms are added in the rows' dtype
# Outputs per block of the fp32 path on CPU: its accumulator stays in the cache (measured on rows of
# 896 bf16: 128 outputs take a quarter of the time of one block for all); one block on GPU.
_CPU_BLOCK_OUTPUTS = 128


@dataclasses.dataclass(eq=False)
class SumPlan:
    """How :func:`ordered_sum` adds ``n`` rows onto ``num_out`` outputs.

    Attributes:
        num_out: outputs.
        max_terms: most rows any output gets.
        index: the row-dtype path: ``[m]`` int64, the output each of its rows is added to; None
            without one.
        low_rows: ``[m]`` int64 the rows ``index`` lists (ascending), or None when it lists every
            row in order.
        slot_rows: the fp32 path: per slot ``j``, ``[n_j]`` int64 rows, the ``j``-th term of the
            first ``n_j`` outputs of ``slot_outputs``; empty without one.
        slot_outputs: ``[m]`` int64 the outputs of the fp32 path, most terms first, or None.
        scaled: the plan is for rows with scales (every output on the fp32 path).
    """

    num_out: int
    max_terms: int
    index: torch.Tensor | None
    low_rows: torch.Tensor | None
    slot_rows: list[torch.Tensor]
    slot_outputs: torch.Tensor | None
    scaled: bool


def _row_dtype_path(index: torch.Tensor, low: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(index, low_rows)`` of :class:`SumPlan` for the rows where ``low [n]`` is True."""
    if bool(low.all()):
        return index, None
    rows = torch.nonzero(low).flatten()
    return (index[rows], rows) if rows.numel() else (None, None)


def plan_sum(index: torch.Tensor, num_out: int, *, scaled: bool = False) -> SumPlan:
    """The plan of summing rows onto ``num_out`` outputs by ``index``.

    Args:
        index: ``[n]`` int64 output of each row in ``[0, num_out]``; ``num_out`` leaves the row out.
        num_out: outputs.
        scaled: rows will come with scales (then every output is summed in fp32).

    Synchronises the host once (the term counts decide the path).
    """
    device = index.device
    counts = torch.bincount(index, minlength=num_out + 1)
    kept = counts[:num_out]
    max_terms = int(kept.max()) if num_out else 0
    fewest = 1 if scaled else ROW_DTYPE_TERMS + 1  # the fewest terms an output of the fp32 path has
    if max_terms < fewest:
        return SumPlan(num_out, max_terms, *_row_dtype_path(index, index < num_out), [], None, scaled)
    outputs = torch.nonzero(kept >= fewest).flatten()
    outputs = outputs[torch.argsort(kept[outputs], descending=True, stable=True)]
    rank = torch.full((num_out + 1,), -1, dtype=torch.int64, device=device)
    rank[outputs] = torch.arange(outputs.numel(), device=device)
    key = rank[index]
    fp32 = key >= 0
    rows = torch.nonzero(fp32).flatten()
    rows = rows[torch.argsort(key[rows], stable=True)]  # output by output, each one's rows ascending
    sizes = kept[outputs]
    starts = torch.cumsum(sizes, 0) - sizes
    position = torch.arange(rows.numel(), device=device) - torch.repeat_interleave(
        starts, sizes, output_size=rows.numel()
    )
    order = torch.argsort(position, stable=True)  # slot-major; inside a slot, outputs in order
    slot_rows = list(torch.split(rows[order], torch.bincount(position, minlength=max_terms).tolist()))
    low = (None, None) if scaled else _row_dtype_path(index, ~fp32 & (index < num_out))
    return SumPlan(num_out, max_terms, *low, slot_rows, outputs, scaled)


def plan_sum_by_output(terms: torch.Tensor, num_rows: int, *, scaled: bool = False) -> SumPlan:
    """:func:`plan_sum` from the other side: ``terms [num_out, K]`` int64 lists the rows of each
    output (any order, ``-1`` for none), of ``num_rows`` rows; rows no output lists are left out.
    Sorts K entries per output instead of all rows (a permute's ``row_id_map`` is this form).

    Synchronises the host once.
    """
    num_out, device = terms.shape[0], terms.device
    listed = terms >= 0
    key = torch.sort(torch.where(listed, terms, num_rows), dim=1).values  # each output's rows ascending
    counts = listed.sum(1)
    max_terms = int(counts.max()) if num_out else 0
    fewest = 1 if scaled else ROW_DTYPE_TERMS + 1  # the fewest terms an output of the fp32 path has
    slot_rows: list[torch.Tensor] = []
    outputs = None
    low = counts < fewest
    if max_terms >= fewest:
        outputs = torch.nonzero(~low).flatten()
        outputs = outputs[torch.argsort(counts[outputs], descending=True, stable=True)]
        per_slot = (counts[outputs].unsqueeze(1) > torch.arange(max_terms, device=device)).sum(0).tolist()
        by_slot = key.index_select(0, outputs).t().contiguous()  # [K, m]: slot j's rows, a prefix each
        slot_rows = [by_slot[j, :n] for j, n in enumerate(per_slot)]
    index = low_rows = None
    if not scaled and bool(low.any()):
        # A row-dtype output's rows are its first ROW_DTYPE_TERMS keys (the others are num_rows);
        # a row belongs to one output at most, so the scatter has one writer per row (the
        # num_rows slot takes the rest and is dropped).
        low_key = torch.where(low.unsqueeze(1), key[:, :ROW_DTYPE_TERMS], num_rows)
        of_row = torch.full((num_rows + 1,), -1, dtype=torch.int64, device=device)
        owner = torch.arange(num_out, device=device).unsqueeze(1).expand_as(low_key)
        of_row.scatter_(0, low_key.flatten(), owner.flatten())
        of_row = of_row[:num_rows]
        index, low_rows = _row_dtype_path(of_row, of_row >= 0)
    return SumPlan(num_out, max_terms, index, low_rows, slot_rows, outputs, scaled)


def ordered_sum(
    plan: SumPlan, rows: torch.Tensor, scale: torch.Tensor | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``out[o]`` = the fp32 sum of the rows that ``plan`` maps to ``o``, in ascending row order,
    times their scales, rounded once to ``rows.dtype`` (module docstring).

    Args:
        plan: from :func:`plan_sum` (``scaled`` when ``scale`` is given).
        rows: ``[n, ...]`` floating, contiguous or row-strided.
        scale: ``[n]`` fp32 row scales, or None.
        out: ``[num_out, ...]`` of rows' dtype to write (allocated when None).

    Returns:
        ``out``.
    """
    num_out, width = plan.num_out, rows.shape[1:]
    if (scale is not None) != plan.scaled:
        raise ValueError("ordered_sum: row scales need a plan made with scaled=True, and such a plan needs them")
    result = rows.new_zeros((num_out, *width)) if out is None else out.zero_()
    if plan.index is not None and rows.shape[0]:
        result.index_add_(0, plan.index, rows if plan.low_rows is None else rows.index_select(0, plan.low_rows))
    outputs = plan.slot_outputs
    if outputs is not None:
        block = outputs.numel() if rows.is_cuda else _CPU_BLOCK_OUTPUTS
        widen = [1] * (rows.dim() - 1)
        sums = rows.new_empty((outputs.numel(), *width))  # in the order of `outputs`
        acc = torch.empty((min(block, outputs.numel()), *width), dtype=torch.float32, device=rows.device)
        for first in range(0, outputs.numel(), block):
            part_acc = acc[: min(block, outputs.numel() - first)].zero_()
            for sel in plan.slot_rows:  # slot j: the j-th term of the block's outputs that have one
                sel = sel[first : first + block]
                if not sel.numel():
                    break
                part = rows.index_select(0, sel)
                if scale is not None:
                    part = part.float().mul_(scale.index_select(0, sel).view(-1, *widen))
                part_acc[: sel.numel()].add_(part)
            sums[first : first + part_acc.shape[0]].copy_(part_acc)  # the one rounding
        result.index_copy_(0, outputs, sums)
    return result
