"""The summation order: every sum that combine and unpermute compute, defined here once.

The semantics promise bitwise-equal results on every transport and device, so the order of
the additions and the points of rounding are part of them. This module states that order and
computes it in the plainest way; every other implementation must give its bits (docs/semantics.md,
"The summation order", lists them and the tests that compare each with this module).

**A level** sums terms onto outputs. Each output starts from +0.0 in fp32 and adds its terms one
after the other in the level's order; a term is converted to fp32 and, if it has a scale,
multiplied by that fp32 scale with the product rounded to fp32 before the add (no fused
multiply-add); each add rounds to fp32 (round to nearest even). The fp32 sum is then rounded once
to the rows' dtype (round to nearest even, as torch's ``Tensor.to``): the level's result. An
output with no terms is +0.0, and so is a sum of zeros (-0.0 never survives a level).

**Combine** of rank ``s``'s tokens (``y [R, H]`` on every rank -> ``out [T, H]``, H of bf16, fp16
or fp32) is two levels:

1. the node partial, per (token, node) holding it (where the hierarchical transports form it: on
   the forwarder, the "pre-reduction"): the token's rows on that node's ranks, in ascending local
   rank, each times its row scale when the combine has scales; rounded to y's dtype (it is what
   crosses the inter-node link);
2. the token, on rank ``s``: its node partials in ascending node, without scales; rounded to
   y's dtype.

With one node the second level changes nothing (a rounded value added to +0.0 and rounded
again), nor does the first with one rank per node and no scales beyond turning -0.0 into +0.0,
which the second level does anyway: transports may skip either there.

**Unpermute** (a fused permute's expert-major rows ``[P, H]`` -> the received rows ``[R, H]``, and
:func:`moe_dispatch.ops.permute.unpermute`) is one level before those: a received row is the sum
of its copies in ascending expert-major row (= ascending local expert), each times its prob when
weighted.

:func:`sum_level` is a level, :func:`sum_by_index` a level given each row's output (what the fast
:func:`moe_dispatch.semantics.sums.ordered_sum` and the native CPU sums compute), and
:func:`combine_sum` the combine (what :func:`moe_dispatch.semantics.reference.combine` computes
for each source rank).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

# A level's terms, in its order: (outputs [num_out] bool: the outputs that get a term from here,
# rows [outputs.sum(), ...]: their terms in ascending output, scale [outputs.sum()] fp32 or None).
Terms = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


def sum_level(
    terms: Iterable[Terms], shape: Sequence[int], dtype: torch.dtype, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """One level of the summation order (module docstring).

    Args:
        terms: the level's terms in its order, as :data:`Terms`; an entry gives each output at
            most one term, so the entries' order is the order of every output's terms.
        shape: ``(num_out, ...)`` of the result.
        dtype: the rows' dtype, the result's.
        device: the rows' device.

    Returns:
        ``shape`` of ``dtype``: each output's fp32 sum, rounded once.
    """
    acc = torch.zeros(tuple(shape), dtype=torch.float32, device=device)
    widen = [1] * (len(shape) - 1)
    for outputs, rows, scale in terms:
        term = rows.float()
        if scale is not None:
            term = term * scale.view(-1, *widen)  # the product rounded to fp32, then the add
        acc[outputs] += term
    return acc.to(dtype)


def sum_by_index(
    rows: torch.Tensor, index: torch.Tensor, num_out: int, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """One level with each row's output given: output ``o`` sums the rows ``i`` with
    ``index[i] == o`` in ascending ``i``.

    Args:
        rows: ``[n, ...]`` floating.
        index: ``[n]`` int64 in ``[0, num_out]``; ``num_out`` leaves the row out.
        num_out: outputs.
        scale: ``[n]`` fp32 row scales, or None.

    Returns:
        ``[num_out, ...]`` of ``rows.dtype``.
    """
    order = torch.argsort(index, stable=True)  # output by output, each one's rows ascending
    of_row = index[order]
    counts = torch.bincount(index, minlength=num_out + 1)
    first = torch.cumsum(counts, 0) - counts
    position = torch.arange(index.numel(), device=index.device) - first[of_row]  # the j-th term of its output
    kept = of_row < num_out
    max_terms = int(counts[:num_out].max()) if num_out else 0

    def terms():
        for j in range(max_terms):  # the j-th terms of every output that has one, ascending output
            sel = order[kept & (position == j)]
            outputs = torch.zeros(num_out, dtype=torch.bool, device=index.device)
            outputs[index[sel]] = True
            yield outputs, rows[sel], None if scale is None else scale[sel]

    return sum_level(terms(), (num_out, *rows.shape[1:]), rows.dtype, rows.device)


def combine_sum(
    rows: Sequence[torch.Tensor],
    is_token_in_rank: torch.Tensor,
    ranks_per_node: int,
    scales: Sequence[torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """Combine's sums for one source rank: its tokens' node partials, then their sum (module
    docstring).

    Args:
        rows: per rank ``r`` of the world, ``[is_token_in_rank[:, r].sum(), ...]``: the rows ``r``
            returns for the source's tokens it holds, in token order; one floating dtype.
        is_token_in_rank: ``[T, W]`` bool, which ranks hold each token.
        ranks_per_node: L, dividing W.
        scales: per rank None or ``[rows[r].shape[0]]`` fp32 row scales; None: none at all.

    Returns:
        ``[T, ...]`` of the rows' dtype; +0.0 rows for tokens no rank holds.
    """
    num_tokens, world_size = is_token_in_rank.shape
    shape, dtype, device = (num_tokens, *rows[0].shape[1:]), rows[0].dtype, rows[0].device
    scales = [None] * world_size if scales is None else scales

    def node_partials():
        for first in range(0, world_size, ranks_per_node):
            node = range(first, first + ranks_per_node)
            partial = sum_level(((is_token_in_rank[:, r], rows[r], scales[r]) for r in node), shape, dtype, device)
            held = is_token_in_rank[:, first : first + ranks_per_node].any(1)
            yield held, partial[held], None

    return sum_level(node_partials(), shape, dtype, device)
