"""Routing layout, the torch reference: who receives which token.

Semantics (DeepEP's ``get_dispatch_layout``): with E experts over W ranks, rank r owns experts
``[r*E/W, (r+1)*E/W)``; a token goes to a rank once if any of its top-k experts lives there,
and to a node once if any rank of the node receives it. This is the oracle of every layout
kernel (:mod:`moe_dispatch.ops.layout`) and the CPU path of ``Buffer``.
"""

from __future__ import annotations

import torch

from .validation import check_num_experts, check_topk_idx, is_int


def get_dispatch_layout_reference(
    topk_idx: torch.Tensor, num_experts: int, num_ranks: int, ranks_per_node: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference of the routing layout (the oracle for every layout kernel).

    Args:
        topk_idx: ``[T, K]`` int32/int64, global expert ids, ``-1`` = no expert.
        num_experts: E, divisible by ``num_ranks``.
        num_ranks: W, the EP world size.
        ranks_per_node: L, dividing W.

    Returns:
        ``num_tokens_per_rank [W]`` int64, ``num_tokens_per_node [N]`` int64,
        ``num_tokens_per_expert [E]`` int64, ``is_token_in_rank [T, W]`` bool; on topk_idx's device.

    Raises:
        ValueError: bad dtype/shape/values of ``topk_idx`` or sizes that do not divide.
    """
    check_topk_idx(topk_idx, num_experts)
    check_layout_sizes(num_experts, num_ranks, ranks_per_node)
    return get_dispatch_layout_torch(topk_idx, num_experts, num_ranks, ranks_per_node)


def get_dispatch_layout_torch(
    topk_idx: torch.Tensor, num_experts: int, num_ranks: int, ranks_per_node: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`get_dispatch_layout_reference`'s four outputs without its checks, for inputs
    the caller checked (``Buffer`` on CPU); unchecked ids outside ``[0, E)`` count as ``-1``,
    as in the Triton kernels. Same shapes and dtypes; raises nothing of its own."""
    num_tokens = topk_idx.shape[0]
    valid = (topk_idx >= 0) & (topk_idx < num_experts)
    # Shifted by one so that "no expert" counts in bin 0 (no masked copy of the ids).
    num_tokens_per_expert = torch.bincount(
        torch.where(valid, topk_idx.long() + 1, 0).flatten(), minlength=num_experts + 1
    )[1:].clone()
    is_token_in_rank = _is_token_in_rank(topk_idx, valid, num_experts, num_ranks)
    num_tokens_per_rank = is_token_in_rank.sum(0)
    in_node = is_token_in_rank.view(num_tokens, num_ranks // ranks_per_node, ranks_per_node).any(2)
    num_tokens_per_node = in_node.sum(0)
    return num_tokens_per_rank, num_tokens_per_node, num_tokens_per_expert, is_token_in_rank


def is_token_in_rank_torch(topk_idx: torch.Tensor, num_experts: int, num_ranks: int) -> torch.Tensor:
    """``is_token_in_rank [T, W]`` bool of :func:`get_dispatch_layout_torch` alone (what a
    dispatch needs; the counts cost as much again on CPU). Unchecked, as that function."""
    return _is_token_in_rank(topk_idx, (topk_idx >= 0) & (topk_idx < num_experts), num_experts, num_ranks)


def _is_token_in_rank(topk_idx: torch.Tensor, valid: torch.Tensor, num_experts: int, num_ranks: int) -> torch.Tensor:
    """is_token_in_rank_torch given the ids' in-range mask ``valid [T, K]``."""
    dest_rank = torch.where(valid, topk_idx.long() // (num_experts // num_ranks), num_ranks)  # W = "nowhere"
    hits = torch.zeros(topk_idx.shape[0], num_ranks + 1, dtype=torch.bool, device=topk_idx.device)
    hits.scatter_(1, dest_rank, True)
    return hits[:, :num_ranks].contiguous()


def check_layout_sizes(num_experts: int, num_ranks: int, ranks_per_node: int) -> None:
    """Raises ValueError unless W and L are positive ints with L | W, and E passes
    :func:`~moe_dispatch.semantics.validation.check_num_experts` for W (naming the one that is not)."""
    for name, v in (("num_ranks", num_ranks), ("ranks_per_node", ranks_per_node)):
        if not is_int(v) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    check_num_experts(num_experts, num_ranks)
    if num_ranks % ranks_per_node != 0:
        raise ValueError(f"ranks_per_node must divide the EP world size {num_ranks}, got {ranks_per_node}")


def get_send_offsets_reference(
    is_token_in_rank: torch.Tensor, ranks_per_node: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each token goes in each destination's send block (torch reference).

    A sender packs the tokens for destination ``d`` in ascending token order; the slot of token
    ``t`` in that block is the number of tokens ``t' < t`` that also go to ``d`` (an exclusive
    prefix sum over tokens). With all destinations packed back to back in destination order, the
    row of ``(t, d)`` in the send buffer is ``exclusive_cumsum(num_tokens_per_dest)[d] +
    send_offsets[t, d]``.

    Args:
        is_token_in_rank: ``[T, W]`` bool, from :func:`get_dispatch_layout_reference`.
        ranks_per_node: L, dividing W.

    Returns:
        ``rank_send_offsets [T, W]`` int32 and ``node_send_offsets [T, N]`` int32 (a token goes
        to node n when any rank of n receives it); ``-1`` where the token does not go there.
    """
    num_tokens, num_ranks = is_token_in_rank.shape
    in_node = is_token_in_rank.view(num_tokens, num_ranks // ranks_per_node, ranks_per_node).any(2)
    out = []
    for hits in (is_token_in_rank, in_node):
        h = hits.to(torch.int32)
        excl = torch.cumsum(h, dim=0, dtype=torch.int32) - h
        out.append(torch.where(hits, excl, torch.full_like(excl, -1)))
    return out[0], out[1]
