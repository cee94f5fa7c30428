"""Single-process oracle: every rank's dispatch/combine results from every rank's inputs.

The executable statement of the semantics that ``Buffer.dispatch`` and ``Buffer.combine``
document (``moe_dispatch/buffer.py``); tests compare each transport against it bit for bit. It
is deliberately written per rank and per node with boolean masks, independently of the
transports' index plans.

Combine's summation order is part of the semantics (so results are deterministic and equal
on every transport): :mod:`.summation` defines it, and :func:`combine` computes it there.
"""

from __future__ import annotations

import dataclasses

import torch

from .layout import get_dispatch_layout_reference
from .summation import combine_sum


@dataclasses.dataclass
class RankDispatch:
    """One rank's dispatch result (see ``Buffer.dispatch`` for the meaning of each field).

    ``src_rank``/``src_idx`` ``[R]`` int64 name the source rank and source token of each row.
    """

    recv_x: torch.Tensor
    recv_topk_idx: torch.Tensor
    recv_topk_weights: torch.Tensor | None
    num_recv_tokens_per_expert: torch.Tensor
    src_rank: torch.Tensor
    src_idx: torch.Tensor


def _layouts(topk_idxs, num_experts, ranks_per_node):
    world_size = len(topk_idxs)
    return [get_dispatch_layout_reference(t, num_experts, world_size, ranks_per_node)[3] for t in topk_idxs]


def dispatch(
    xs: list[torch.Tensor],
    topk_idxs: list[torch.Tensor],
    topk_weights: list[torch.Tensor] | None,
    num_experts: int,
    ranks_per_node: int,
    ranks: list[int] | None = None,
) -> list[RankDispatch]:
    """Dispatch for a whole world at once.

    Args:
        xs: per source rank ``[T_s, H]`` floating tensors.
        topk_idxs: per source rank ``[T_s, K]`` int32/int64, ``-1`` = no expert.
        topk_weights: per source rank ``[T_s, K]`` fp32, or None.
        num_experts: E, divisible by W = ``len(xs)``.
        ranks_per_node: L (does not change dispatch results; kept for symmetry with combine).
        ranks: receivers to compute (default all W), e.g. ``[my_rank]`` inside a world.

    Returns:
        one :class:`RankDispatch` per entry of ``ranks``: rows ordered by source rank, then source token index;
        ``recv_topk_idx`` in the receiver's local expert numbering with -1 elsewhere and
        ``recv_topk_weights`` 0 where ``recv_topk_idx`` is -1.
    """
    world_size = len(xs)
    experts_per_rank = num_experts // world_size
    in_rank = _layouts(topk_idxs, num_experts, ranks_per_node)
    results = []
    for r in range(world_size) if ranks is None else ranks:
        rows = [torch.nonzero(in_rank[s][:, r]).flatten() for s in range(world_size)]
        idx = torch.cat([topk_idxs[s][rows[s]] for s in range(world_size)])
        local = idx - r * experts_per_rank
        mine = (idx >= 0) & (local >= 0) & (local < experts_per_rank)
        recv_topk_idx = torch.where(mine, local, torch.full_like(local, -1))
        recv_w = None
        if topk_weights is not None:
            w = torch.cat([topk_weights[s][rows[s]] for s in range(world_size)])
            recv_w = torch.where(mine, w, torch.zeros_like(w))
        results.append(
            RankDispatch(
                recv_x=torch.cat([xs[s][rows[s]] for s in range(world_size)]),
                recv_topk_idx=recv_topk_idx,
                recv_topk_weights=recv_w,
                num_recv_tokens_per_expert=torch.bincount(recv_topk_idx[mine].long(), minlength=experts_per_rank),
                src_rank=torch.cat([torch.full((len(rows[s]),), s, dtype=torch.int64) for s in range(world_size)]),
                src_idx=torch.cat(rows),
            )
        )
    return results


def combine(
    ys: list[torch.Tensor],
    topk_idxs: list[torch.Tensor],
    num_experts: int,
    ranks_per_node: int,
    weights: list[torch.Tensor] | None = None,
    ranks: list[int] | None = None,
) -> list[torch.Tensor]:
    """Combine for a whole world at once: the adjoint of :func:`dispatch`.

    Args:
        ys: per rank ``[R_r, H]``, rows in the order :func:`dispatch` produced.
        topk_idxs: the source ranks' ``[T_s, K]`` routing used by that dispatch.
        num_experts: E.
        ranks_per_node: L; fixes the summation order (:mod:`.summation`).
        weights: per rank ``[R_r]`` fp32 row scales applied before the sum, or None.
        ranks: source ranks to compute (default all W).

    Returns:
        per entry of ``ranks`` ``[T_s, H]`` in y's dtype; zero rows for tokens no rank held.
    """
    world_size = len(ys)
    in_rank = _layouts(topk_idxs, num_experts, ranks_per_node)
    # Row offset of source rank s's block inside each receiver's rows.
    counts = torch.stack([m.sum(0) for m in in_rank])  # [src, dst]
    starts = torch.cumsum(counts, 0) - counts
    outs = []
    for s in range(world_size) if ranks is None else ranks:
        held = [slice(int(starts[s, r]), int(starts[s, r] + counts[s, r])) for r in range(world_size)]
        rows = [ys[r][held[r]] for r in range(world_size)]
        scales = None if weights is None else [weights[r][held[r]] for r in range(world_size)]
        outs.append(combine_sum(rows, in_rank[s], ranks_per_node, scales))
    return outs
