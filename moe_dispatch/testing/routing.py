"""Routing shaped like real MoE models, for benchmarks and tests.

Model presets carry the router hyper-parameters under their Hugging Face config names
(``n_routed_experts``/``num_local_experts`` -> ``num_experts``, ``num_experts_per_tok`` ->
``topk``, ``hidden_size`` -> ``hidden``, and DeepSeek-V3's ``n_group``, ``topk_group``,
``scoring_func``, ``norm_topk_prob``, ``routed_scaling_factor``). Routing is computed from
random router logits, so expert popularity is uniform in expectation; :func:`zipf_routing`
gives a skewed alternative. Every generator is seeded from ``(seed, rank)``: one shared seed
lets each rank rebuild every other rank's inputs (and so compute the oracle locally).

Outputs follow the package contract: ``topk_idx [T, K]`` int64 global expert ids (``-1`` = no
expert, no expert twice in a row) and ``topk_weights [T, K]`` fp32 (0 where the id is -1).
"""

from __future__ import annotations

import dataclasses
import math

import torch

_MASK64 = (1 << 64) - 1


@dataclasses.dataclass(frozen=True)
class ModelPreset:
    """Router shape of one MoE model.

    Attributes:
        name: preset key, e.g. ``"deepseek-v3"``.
        num_experts: E, routed experts per MoE layer.
        topk: K, experts per token.
        hidden: H, model hidden size (the dispatched row width).
        score_func: ``"softmax"`` (over all E logits) or ``"sigmoid"`` (per expert).
        n_group: expert groups for group-limited routing (1 = plain top-k); E % n_group == 0.
        topk_group: groups a token may use (DeepSeek-V3: 4 of 8, i.e. at most 4 nodes when
            groups map to nodes).
        norm_topk_prob: renormalise the K selected scores to sum to 1.
        routed_scaling_factor: multiplies the final weights (DeepSeek-V3: 2.5).

    Raises:
        ValueError: inconsistent sizes (K > E, E % n_group, topk_group > n_group, K larger than
            the experts of topk_group groups) or an unknown score_func.
    """

    name: str
    num_experts: int
    topk: int
    hidden: int
    score_func: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"{self.name}: score_func must be 'softmax' or 'sigmoid', got {self.score_func!r}")
        if not 1 <= self.topk <= self.num_experts:
            raise ValueError(f"{self.name}: topk must be in [1, num_experts={self.num_experts}], got {self.topk}")
        if self.n_group < 1 or self.num_experts % self.n_group != 0:
            raise ValueError(f"{self.name}: n_group must divide num_experts={self.num_experts}, got {self.n_group}")
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"{self.name}: topk_group must be in [1, n_group={self.n_group}], got {self.topk_group}")
        if self.n_group > 1 and self.topk > self.topk_group * (self.num_experts // self.n_group):
            raise ValueError(
                f"{self.name}: topk={self.topk} exceeds the {self.topk_group} groups x "
                f"{self.num_experts // self.n_group} experts a token may use"
            )
        if self.hidden < 1:
            raise ValueError(f"{self.name}: hidden must be positive, got {self.hidden}")

    def with_hidden_scale(self, scale: float, multiple: int = 16) -> "ModelPreset":
        """This preset with ``hidden`` scaled by ``scale`` and rounded to a multiple of ``multiple``
        (at least ``multiple``), for quick runs; routing is unchanged.

        Raises:
            ValueError: scale not positive.
        """
        if not scale > 0:
            raise ValueError(f"hidden scale must be positive, got {scale!r}")
        hidden = max(multiple, round(self.hidden * scale / multiple) * multiple)
        return dataclasses.replace(self, hidden=hidden)


# Values from the models' published Hugging Face configs.
PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        # DeepSeek-V3 (arXiv 2412.19437, sec. 2.1.2): sigmoid affinities, node-limited routing
        # through 8 groups of 32 experts, top-4 groups by the sum of each group's 2 best scores.
        ModelPreset(
            "deepseek-v3",
            num_experts=256,
            topk=8,
            hidden=7168,
            score_func="sigmoid",
            n_group=8,
            topk_group=4,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
        ),
        ModelPreset("qwen3-30b-a3b", num_experts=128, topk=8, hidden=2048, score_func="softmax", norm_topk_prob=True),
        # Mixtral: softmax over the 2 selected logits = renormalised top-2 of the full softmax.
        ModelPreset("mixtral-8x7b", num_experts=8, topk=2, hidden=4096, score_func="softmax", norm_topk_prob=True),
    )
}


def rank_seed(seed: int, rank: int) -> int:
    """A 63-bit seed for ``rank``'s stream of a run seeded with ``seed`` (a splitmix64-style
    mix, so nearby (seed, rank) pairs give unrelated streams)."""
    z = (seed * 0x9E3779B97F4A7C15 + rank + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def make_generator(seed: int, rank: int) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded with :func:`rank_seed` ``(seed, rank)``."""
    return torch.Generator().manual_seed(rank_seed(seed, rank))


def router_logits(num_tokens: int, num_experts: int, generator: torch.Generator) -> torch.Tensor:
    """Random router logits ``[T, E]`` fp32 (standard normal) on the CPU."""
    return torch.randn(num_tokens, num_experts, generator=generator, dtype=torch.float32)


def select_experts(
    logits: torch.Tensor, preset: ModelPreset, expert_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The preset's top-k routing of router logits.

    Scores are ``softmax(logits)`` or ``sigmoid(logits)``. With ``n_group > 1`` (DeepSeek-V3's
    group-limited routing): each group's score is the sum of its two best biased scores, the
    ``topk_group`` best groups are kept, and the top-k experts are taken inside them only.
    ``expert_bias`` (DeepSeek-V3's auxiliary-loss-free balancing bias) affects the selection but
    not the weights, which are the unbiased scores of the chosen experts, renormalised when
    ``norm_topk_prob`` and multiplied by ``routed_scaling_factor``.

    Args:
        logits: ``[T, E]`` floating router logits.
        preset: the model's router shape; ``E`` must equal ``preset.num_experts``.
        expert_bias: ``[E]`` fp32 selection bias, or None.

    Returns:
        ``topk_idx [T, K]`` int64 (in descending biased-score order) and ``topk_weights [T, K]`` fp32.

    Raises:
        ValueError: logits or expert_bias of the wrong shape.
    """
    if logits.dim() != 2 or logits.shape[1] != preset.num_experts:
        raise ValueError(f"logits must be [T, {preset.num_experts}] for {preset.name}, got {list(logits.shape)}")
    if expert_bias is not None and tuple(expert_bias.shape) != (preset.num_experts,):
        raise ValueError(f"expert_bias must be [{preset.num_experts}], got {list(expert_bias.shape)}")
    logits = logits.float()
    scores = torch.sigmoid(logits) if preset.score_func == "sigmoid" else torch.softmax(logits, dim=-1)
    choice = scores if expert_bias is None else scores + expert_bias
    if preset.n_group > 1:
        num_tokens, group_size = logits.shape[0], preset.num_experts // preset.n_group
        grouped = choice.view(num_tokens, preset.n_group, group_size)
        group_score = grouped.topk(min(2, group_size), dim=-1).values.sum(-1)  # [T, n_group]
        top_groups = group_score.topk(preset.topk_group, dim=-1).indices
        keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, top_groups, True)
        choice = choice.masked_fill(~keep.repeat_interleave(group_size, dim=1), float("-inf"))
    topk_idx = choice.topk(preset.topk, dim=-1).indices
    weights = scores.gather(1, topk_idx)
    if preset.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    return topk_idx, (weights * preset.routed_scaling_factor).contiguous()


def generate_routing(preset: ModelPreset, num_tokens: int, seed: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing of ``rank``'s ``num_tokens`` tokens: :func:`select_experts` of random logits drawn
    from :func:`make_generator` ``(seed, rank)``. Deterministic; CPU tensors.

    Returns:
        ``topk_idx [T, K]`` int64, ``topk_weights [T, K]`` fp32.
    """
    logits = router_logits(num_tokens, preset.num_experts, make_generator(seed, rank))
    return select_experts(logits, preset)


def zipf_popularity(num_experts: int, s: float, seed: int) -> torch.Tensor:
    """Expert popularity ``p [E]`` fp32 with ``p(e) ~ 1 / popularity_rank(e)^s``; which expert
    gets which popularity rank is a permutation drawn from ``seed`` alone (the same on every rank).

    Raises:
        ValueError: s negative.
    """
    if s < 0:
        raise ValueError(f"Zipf exponent s must be >= 0, got {s!r}")
    ranks = torch.randperm(num_experts, generator=make_generator(seed, -1)).double() + 1.0
    p = ranks.pow(-s)
    return (p / p.sum()).float()


def zipf_routing(
    num_tokens: int, num_experts: int, topk: int, s: float, seed: int, rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Skewed routing: each token draws K distinct experts without replacement with probabilities
    :func:`zipf_popularity` ``(E, s, seed)`` (Gumbel-top-k, so it is exact sampling), from the
    stream :func:`make_generator` ``(seed, rank)``. ``s = 0`` is uniform; s ~ 1 is strongly skewed.

    Returns:
        ``topk_idx [T, K]`` int64 and ``topk_weights [T, K]`` fp32 (a softmax over the K chosen
        keys, so popular experts also weigh more).

    Raises:
        ValueError: K not in [1, E] or s negative.
    """
    if not 1 <= topk <= num_experts:
        raise ValueError(f"topk must be in [1, num_experts={num_experts}], got {topk}")
    log_p = zipf_popularity(num_experts, s, seed).log()
    u = torch.rand(num_tokens, num_experts, generator=make_generator(seed, rank))
    tiny = torch.finfo(torch.float32).tiny
    keys = log_p - torch.log(-torch.log(u.clamp(min=tiny, max=1.0 - 1e-7)))
    values, topk_idx = keys.topk(topk, dim=-1)
    return topk_idx, torch.softmax(values, dim=-1)


def drop_entries(
    topk_idx: torch.Tensor, topk_weights: torch.Tensor, prob: float, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of the routing with each entry independently set to ``-1`` (weight 0) with
    probability ``prob`` (e.g. capacity drops, padded slots).

    Args:
        topk_idx: ``[T, K]`` int64; topk_weights: ``[T, K]`` fp32; prob in [0, 1].

    Returns:
        new ``(topk_idx, topk_weights)``, same shapes and dtypes.

    Raises:
        ValueError: prob outside [0, 1] or mismatched shapes.
    """
    _check_drop(topk_idx, topk_weights, prob)
    drop = torch.rand(topk_idx.shape, generator=generator) < prob
    return topk_idx.masked_fill(drop, -1), topk_weights.masked_fill(drop, 0.0)


def drop_tokens(
    topk_idx: torch.Tensor, topk_weights: torch.Tensor, prob: float, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of the routing where each token independently becomes empty (all ``-1``, weights 0)
    with probability ``prob``: tokens that go nowhere and must come back as zero rows.

    Args, Returns, Raises: as :func:`drop_entries`.
    """
    _check_drop(topk_idx, topk_weights, prob)
    drop = (torch.rand(topk_idx.shape[0], generator=generator) < prob).unsqueeze(1)
    return topk_idx.masked_fill(drop, -1), topk_weights.masked_fill(drop, 0.0)


def _check_drop(topk_idx: torch.Tensor, topk_weights: torch.Tensor, prob: float) -> None:
    if not (isinstance(prob, (int, float)) and 0.0 <= prob <= 1.0 and not math.isnan(prob)):
        raise ValueError(f"drop probability must be in [0, 1], got {prob!r}")
    if topk_idx.shape != topk_weights.shape:
        raise ValueError(
            f"topk_weights has shape {list(topk_weights.shape)} but topk_idx has shape {list(topk_idx.shape)}"
        )
