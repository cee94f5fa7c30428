"""Row sums in a fixed order: the one reduction of combine and unpermute.

``ordered_sum(plan, rows)`` computes, for every output row ``o``,

    out[o] = round(+0.0 + rows[i_1] + rows[i_2] + ...)     (i_1 < i_2 < ... the rows that map to o)

with every addition in fp32 (each row optionally multiplied by its fp32 scale first) and one rounding
to the rows' dtype at the end: the order ``moe_dispatch.reference.combine`` and
``unpermute_rows_reference`` define (ascending row = ascending local rank, node or expert there).
Outputs no row maps to are +0.0.

How, without an fp32 copy of whole blocks:

- An output of at most two terms is added in the rows' own dtype (``index_add_``): torch adds two
  values of a 16-bit float type in fp32 and rounds the result, which is the fp32 sum's rounding; the
  first add starts from +0.0 (so -0.0 becomes +0.0 as in fp32). Two terms commute, so the order of
  the adds (atomics on CUDA) cannot change the bits.
- Outputs of three terms or more are accumulated in fp32 by slot: the outputs sorted by their number
  of terms (most first), slot ``j`` adds the ``j``-th term of every output that has one to a prefix of
  the fp32 accumulator, gathering those rows in the rows' dtype (the add converts them on the fly).
  Every slot touches each output at most once and the slots run in order, so the result is the same
  on any device and any thread count (no atomics decide an order).

The plan (:func:`plan_sum`) depends only on the row -> output index, so a combine computes it once per
dispatch and reuses it for every call and the backward pass.
"""

from __future__ import annotations

import dataclasses

import torch

_ROW_DTYPE_TERMS = 2  # outputs with at most this many terms are added in the rows' dtype


@dataclasses.dataclass(eq=False)
class SumPlan:
    """How :func:`ordered_sum` adds ``n`` rows onto ``num_out`` outputs.

    Attributes:
        index: ``[n]`` int64, output of each row; ``num_out`` marks a row that is left out.
        num_out: outputs.
        max_terms: most rows any output gets.
        dropped: whether some row is left out.
        slot_rows: the fp32 path (outputs with three terms or more, or every output when
            ``scaled``): per slot ``j``, ``[n_j]`` int64 rows, the ``j``-th term of the first ``n_j``
            outputs of ``slot_outputs``.
        slot_outputs: ``[m]`` int64 outputs of the fp32 path, most terms first.
        scaled: the plan is for rows with scales (every output takes the fp32 path).
    """

    index: torch.Tensor
    num_out: int
    max_terms: int
    dropped: bool
    slot_rows: list[torch.Tensor]
    slot_outputs: torch.Tensor | None
    scaled: bool


def plan_sum(index: torch.Tensor, num_out: int, *, scaled: bool = False) -> SumPlan:
    """The plan of summing rows onto ``num_out`` outputs by ``index``.

    Args:
        index: ``[n]`` int64 output of each row in ``[0, num_out]``; ``num_out`` leaves the row out.
        num_out: outputs.
        scaled: rows will come with scales (then every output is summed in fp32).

    Synchronises the host once (the term counts decide the path).
    """
    counts = torch.bincount(index, minlength=num_out + 1)
    kept = counts[:num_out]
    max_terms, dropped = (int(v) for v in torch.stack([kept.max() if num_out else counts[:0].sum(), counts[num_out]]))
    first = 1 if scaled else _ROW_DTYPE_TERMS + 1  # fewest terms of an output on the fp32 path
    slot_rows: list[torch.Tensor] = []
    slot_outputs = None
    if max_terms >= first:
        outputs = torch.nonzero(kept >= first).flatten()
        outputs = outputs[torch.argsort(kept[outputs], descending=True, stable=True)]
        rank = torch.full((num_out + 1,), -1, dtype=torch.int64, device=index.device)
        rank[outputs] = torch.arange(outputs.numel(), device=index.device)
        key = rank[index]
        rows = torch.nonzero(key >= 0).flatten()
        rows = rows[torch.argsort(key[rows], stable=True)]  # output by output, each one's rows ascending
        sizes = kept[outputs]
        starts = torch.cumsum(sizes, 0) - sizes
        position = torch.arange(rows.numel(), device=index.device) - torch.repeat_interleave(
            starts, sizes, output_size=rows.numel()
        )
        order = torch.argsort(position, stable=True)  # slot-major; inside a slot, outputs in order
        per_slot = torch.bincount(position, minlength=max_terms).tolist()
        slot_rows = list(torch.split(rows[order], per_slot))
        slot_outputs = outputs
    return SumPlan(index, num_out, max_terms, dropped, slot_rows, slot_outputs, scaled)


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
    num_out, shape = plan.num_out, (plan.num_out, *rows.shape[1:])
    if scale is not None and not plan.scaled:
        raise ValueError("ordered_sum got row scales but its plan was made without scaled=True")
    if plan.dropped:  # one extra output collects the rows left out
        full = rows.new_zeros((num_out + 1, *rows.shape[1:]))
        result = full[:num_out]
    else:
        full = result = rows.new_zeros(shape) if out is None else out.zero_()
    if scale is None and rows.shape[0]:
        # Every output of at most two terms, in the rows' dtype; the fp32 path below overwrites the others.
        full.index_add_(0, plan.index, rows)
    if plan.slot_outputs is not None and plan.slot_outputs.numel():
        acc = torch.zeros((plan.slot_outputs.numel(), *rows.shape[1:]), dtype=torch.float32, device=rows.device)
        for sel in plan.slot_rows:
            part = rows.index_select(0, sel)
            if scale is not None:
                part = part.float().mul_(scale.index_select(0, sel).view(-1, *([1] * (rows.dim() - 1))))
            acc[: sel.numel()].add_(part)
        result.index_copy_(0, plan.slot_outputs, acc.to(rows.dtype))
    if out is not None and result is not out:
        out.copy_(result)
        return out
    return result
