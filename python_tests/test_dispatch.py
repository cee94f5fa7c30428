"""Dispatch/combine in real gloo worlds against the single-process oracle.

Every rank builds every rank's inputs from one shared seed, so it can compute the exact
expected result locally (pplx-kernels' pattern). Data movement and the fixed-order fp32
reductions are compared bit for bit: no tolerances.
"""

from __future__ import annotations

import dataclasses
import re
import types

import pytest
import torch
import torch.distributed as dist

from moe_dispatch import Buffer, _ext
from moe_dispatch.config import Config
from moe_dispatch.ops.permute import permute, unpermute
from moe_dispatch.semantics import reference

from .worlds import assert_case, run_cases, world_results

WORLDS = [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (4, 4), (8, 1), (8, 2), (8, 4)]
EXPERTS_PER_RANK = 4
TOPK = 3


def make_routing(
    world_size: int,
    num_tokens: list[int],
    seed: int,
    *,
    zipf: float = 0.0,
    drop: float = 0.2,
    num_experts: int | None = None,
):
    """Per-rank ``topk_idx [T, K]`` int64 (distinct experts per row, ~``drop`` of entries -1,
    the first token of each rank with no expert at all) and ``topk_weights [T, K]`` fp32."""
    gen = torch.Generator().manual_seed(seed)
    num_experts = num_experts or EXPERTS_PER_RANK * world_size
    popularity = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** zipf
    idxs, weights = [], []
    for t in num_tokens:
        idx = torch.multinomial(popularity.expand(max(t, 1), -1), TOPK, replacement=False, generator=gen)[:t]
        idx[torch.rand(t, TOPK, generator=gen) < drop] = -1
        if t:
            idx[0] = -1
        idxs.append(idx.contiguous())
        weights.append(torch.rand(t, TOPK, generator=gen))
    return idxs, weights, num_experts


def make_x(num_tokens: list[int], hidden: int, dtype: torch.dtype, seed: int, *, integer: bool = False):
    gen = torch.Generator().manual_seed(seed + 1)
    if integer:  # small integers: sums of copies stay exact in every dtype
        return [torch.randint(-8, 9, (t, hidden), generator=gen).to(dtype) for t in num_tokens]
    return [torch.randn(t, hidden, generator=gen).to(dtype) for t in num_tokens]


def expert(recv_x: torch.Tensor, rank: int) -> torch.Tensor:
    """A stand-in expert whose output differs per rank, so misrouted rows are visible."""
    return (recv_x.float() * (rank + 1) + 0.5).to(recv_x.dtype)


def check_roundtrip(
    buf: Buffer,
    rank: int,
    world_size: int,
    ranks_per_node: int,
    num_tokens: list[int],
    hidden: int,
    dtype: torch.dtype,
    seed: int,
    *,
    zipf: float = 0.0,
    drop: float = 0.2,
    index_dtype=torch.int64,
) -> None:
    idxs, ws, num_experts = make_routing(world_size, num_tokens, seed, zipf=zipf, drop=drop)
    idxs = [i.to(index_dtype) for i in idxs]
    check_routing(buf, rank, ranks_per_node, make_x(num_tokens, hidden, dtype, seed), idxs, ws, num_experts)


def check_routing(buf: Buffer, rank: int, ranks_per_node: int, xs, idxs, ws, num_experts: int):
    """Dispatch and combine (unweighted, weighted) of every rank's ``xs``/``idxs``/``ws`` equal the
    oracle's on this rank; returns the handle."""
    index_dtype = idxs[rank].dtype
    recv_x, recv_idx, recv_w, per_expert, handle, _ = buf.dispatch(xs[rank], idxs[rank], ws[rank], num_experts)
    refs = reference.dispatch(xs, idxs, ws, num_experts, ranks_per_node)
    ref = refs[rank]
    assert torch.equal(recv_x, ref.recv_x), "recv_x differs from the oracle"
    assert recv_idx.dtype == index_dtype and torch.equal(recv_idx, ref.recv_topk_idx), "recv_topk_idx differs"
    assert torch.equal(recv_w, ref.recv_topk_weights), "recv_topk_weights differs"
    assert torch.equal(per_expert, ref.num_recv_tokens_per_expert), "num_recv_tokens_per_expert differs"
    ys = [expert(r.recv_x, i) for i, r in enumerate(refs)]
    out, _ = buf.combine(expert(recv_x, rank), handle)
    assert torch.equal(out, reference.combine(ys, idxs, num_experts, ranks_per_node, ranks=[rank])[0]), (
        "unweighted combine differs"
    )
    out_w, _ = buf.combine(expert(recv_x, rank), handle, recv_w)
    scales = [r.recv_topk_weights.sum(1) for r in refs]
    assert torch.equal(out_w, reference.combine(ys, idxs, num_experts, ranks_per_node, scales, ranks=[rank])[0]), (
        "weighted combine differs"
    )
    return handle


def _cases(ranks_per_node: int) -> dict:
    L = ranks_per_node

    def sizes(world_size: int, base: int = 24) -> list[int]:
        return [base + 5 * r for r in range(world_size)]

    cases = {}
    for dtype in (torch.float32, torch.bfloat16):
        for hidden in (7, 128, 2880):
            name = f"random-{str(dtype).removeprefix('torch.')}-h{hidden}"
            cases[name] = lambda rank, w, buf, dtype=dtype, hidden=hidden: check_roundtrip(
                buf, rank, w, L, sizes(w), hidden, dtype, seed=hidden
            )
    cases["zipf-skewed"] = lambda rank, w, buf: check_roundtrip(
        buf, rank, w, L, sizes(w, 64), 32, torch.bfloat16, seed=7, zipf=1.5
    )
    cases["int32-topk-idx"] = lambda rank, w, buf: check_roundtrip(
        buf, rank, w, L, sizes(w), 16, torch.float32, seed=8, index_dtype=torch.int32
    )
    cases["rank-with-zero-tokens"] = lambda rank, w, buf: check_roundtrip(
        buf, rank, w, L, [0] + sizes(w)[1:], 16, torch.bfloat16, seed=9
    )
    cases["no-token-routed"] = lambda rank, w, buf: check_roundtrip(
        buf, rank, w, L, sizes(w), 16, torch.float32, seed=10, drop=1.0
    )
    cases["identity-expert"] = _identity_expert
    cases["autograd-dispatch"] = _autograd_dispatch
    cases["autograd-combine"] = _autograd_combine
    cases["deterministic"] = _deterministic
    cases["cached-dispatch"] = _cached_dispatch
    cases["interleaved-microbatches"] = _interleaved
    cases["no-topk-weights"] = _no_weights
    cases["fp8-tuple"] = _fp8
    cases["backward-with-empty-rank"] = _backward_empty_rank
    cases["dispatch-to-experts"] = _dispatch_to_experts
    cases["dispatch-to-experts-empty-rank"] = _dispatch_to_experts_empty_rank
    cases["dispatch-to-experts-backward"] = _dispatch_to_experts_backward
    cases["dispatch-to-experts-static-receive"] = _dispatch_to_experts_static_receive
    cases["fp8-wire"] = _fp8_wire
    cases["close"] = _close  # last: the Buffer is done afterwards
    return cases


def _pipeline_depths(rank, world_size, buf):
    """The transport's two-stage paths for one chunk (stage 2's arrivals in final order when a
    node has one rank or the world one node; a reorder gather otherwise) and for several chunks,
    whatever route the sizes pick by default: the same bits as the oracle, fused permute too."""
    L = buf.topology.ranks_per_node
    for num_chunks in (1, 3):
        deep = Buffer(buf.group, ranks_per_node=L, num_chunks=num_chunks, timeout_s=buf.timeout_s)
        try:
            assert deep.transport.num_chunks == num_chunks
            check_roundtrip(
                deep,
                rank,
                world_size,
                L,
                [30 + 7 * r for r in range(world_size)],
                40,
                torch.bfloat16,
                seed=20 + num_chunks,
            )
            _dispatch_to_experts(rank, world_size, deep)
            _dispatch_to_experts_backward(rank, world_size, deep)
        finally:
            deep.close()


def _identity_expert(rank, world_size, buf):
    """dispatch -> identity -> combine returns x times the number of ranks holding the token."""
    num_tokens = [40] * world_size
    idxs, ws, num_experts = make_routing(world_size, num_tokens, seed=11)
    for dtype in (torch.float32, torch.bfloat16):
        x = make_x(num_tokens, 64, dtype, seed=11, integer=True)[rank]
        recv_x, *_, handle, _ = buf.dispatch(x, idxs[rank], ws[rank], num_experts)
        out, _ = buf.combine(recv_x, handle)
        holders = handle.is_token_in_rank.sum(1, keepdim=True).to(dtype)
        assert torch.equal(out, x * holders), f"{dtype}: combine(dispatch(x)) != x * holders"


def _world_inputs(world_size, seed, hidden=24):
    num_tokens = [20 + 3 * r for r in range(world_size)]
    idxs, ws, num_experts = make_routing(world_size, num_tokens, seed)
    xs = make_x(num_tokens, hidden, torch.float32, seed)
    return num_tokens, idxs, ws, num_experts, xs


def _autograd_dispatch(rank, world_size, buf):
    """Backward of dispatch (w.r.t. x and topk_weights) equals the oracle's combine of the gradients."""
    L = buf.topology.ranks_per_node
    _, idxs, ws, num_experts, xs = _world_inputs(world_size, seed=12)
    refs = reference.dispatch(xs, idxs, ws, num_experts, L)
    gen = torch.Generator().manual_seed(13)
    gxs = [torch.randn(r.recv_x.shape, generator=gen) for r in refs]
    gws = [torch.randn(r.recv_topk_weights.shape, generator=gen) for r in refs]
    x, w = xs[rank].clone().requires_grad_(), ws[rank].clone().requires_grad_()
    recv_x, _, recv_w, *_ = buf.dispatch(x, idxs[rank], w, num_experts)
    ((recv_x * gxs[rank]).sum() + (recv_w * gws[rank]).sum()).backward()
    assert torch.equal(x.grad, reference.combine(gxs, idxs, num_experts, L, ranks=[rank])[0]), "grad x"
    # Only the rank owning expert topk_idx[t, k] passes a gradient to topk_weights[t, k].
    masked = [torch.where(r.recv_topk_idx >= 0, g, torch.zeros_like(g)) for r, g in zip(refs, gws)]
    expected_w = reference.combine(masked, idxs, num_experts, L, ranks=[rank])[0]
    assert torch.equal(w.grad, expected_w), "grad topk_weights"


def _autograd_combine(rank, world_size, buf):
    """Backward of a weighted combine equals the oracle's dispatch of the gradient."""
    L = buf.topology.ranks_per_node
    num_tokens, idxs, ws, num_experts, xs = _world_inputs(world_size, seed=14)
    recv_x, _, recv_w, *_, handle, _ = buf.dispatch(xs[rank], idxs[rank], ws[rank], num_experts)
    gen = torch.Generator().manual_seed(15)
    gouts = [torch.randn(t, xs[0].shape[1], generator=gen) for t in num_tokens]
    y = expert(recv_x, rank).requires_grad_()
    scale = recv_w.clone().requires_grad_()
    out, _ = buf.combine(y, handle, scale)
    (out * gouts[rank]).sum().backward()
    g = reference.dispatch(gouts, idxs, None, num_experts, L, ranks=[rank])[0].recv_x
    row_scale = recv_w.sum(1, keepdim=True)
    assert torch.equal(y.grad, g * row_scale), "grad y"
    expected = (g * y.detach()).sum(1, keepdim=True).expand_as(recv_w)
    torch.testing.assert_close(scale.grad, expected, rtol=1e-6, atol=1e-6)  # a dot product: summation order


def _deterministic(rank, world_size, buf):
    num_tokens = [48] * world_size
    idxs, ws, num_experts = make_routing(world_size, num_tokens, seed=16, zipf=1.0)
    x = make_x(num_tokens, 96, torch.bfloat16, seed=16)[rank]
    runs = []
    for _ in range(2):
        recv_x, _, recv_w, _, handle, _ = buf.dispatch(x, idxs[rank], ws[rank], num_experts)
        out, _ = buf.combine(expert(recv_x, rank), handle, recv_w)
        runs.append((recv_x, out))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1]), "two runs differ"


def _cached_dispatch(rank, world_size, buf):
    """A dispatch replaying a handle equals a fresh dispatch with the same routing."""
    num_tokens = [30] * world_size
    idxs, ws, num_experts = make_routing(world_size, num_tokens, seed=17)
    xs = make_x(num_tokens, 40, torch.bfloat16, seed=17)
    x2 = xs[rank] * 3
    _, _, _, _, handle, _ = buf.dispatch(xs[rank], idxs[rank], ws[rank], num_experts)
    cached, recv_idx, recv_w, per_expert, same, _ = buf.dispatch(x2, handle=handle)
    assert recv_idx is None and recv_w is None and per_expert is None and same is handle
    fresh = buf.dispatch(x2, idxs[rank], ws[rank], num_experts)[0]
    assert torch.equal(cached, fresh), "cached dispatch differs from a fresh one"


def _interleaved(rank, world_size, buf):
    """Dispatch A, dispatch B, combine A, combine B: handles keep their micro-batch apart."""
    L = buf.topology.ranks_per_node
    results = []
    handles = []
    for seed in (18, 19):
        num_tokens, idxs, ws, num_experts, xs = _world_inputs(world_size, seed)
        recv_x, *_, handle, _ = buf.dispatch(xs[rank], idxs[rank], ws[rank], num_experts)
        handles.append((recv_x, handle, idxs, xs, num_experts))
    for recv_x, handle, idxs, xs, num_experts in handles:
        out, _ = buf.combine(expert(recv_x, rank), handle)
        ys = [expert(r.recv_x, i) for i, r in enumerate(reference.dispatch(xs, idxs, None, num_experts, L))]
        results.append(torch.equal(out, reference.combine(ys, idxs, num_experts, L, ranks=[rank])[0]))
    assert all(results), f"interleaved micro-batches mixed: {results}"


def _no_weights(rank, world_size, buf):
    num_tokens = [10] * world_size
    idxs, _, num_experts = make_routing(world_size, num_tokens, seed=20)
    x = make_x(num_tokens, 8, torch.float32, seed=20)[rank]
    recv_x, recv_idx, recv_w, *_ = buf.dispatch(x, idxs[rank], None, num_experts)
    assert recv_w is None and recv_idx is not None


def _fp8(rank, world_size, buf):
    """The fp8 tuple (x_fp8, scales) travels as one row: bits equal the oracle's, cached too."""
    from moe_dispatch.ops.quant import per_token_cast_to_fp8

    L = buf.topology.ranks_per_node
    num_tokens = [12 + r for r in range(world_size)]
    idxs, ws, num_experts = make_routing(world_size, num_tokens, seed=21)
    pairs = [per_token_cast_to_fp8(x) for x in make_x(num_tokens, 256, torch.bfloat16, seed=21)]
    (recv_fp8, recv_scales), recv_idx, recv_w, *_, handle, _ = buf.dispatch(
        pairs[rank], idxs[rank], ws[rank], num_experts
    )
    bits = reference.dispatch([p[0].view(torch.uint8) for p in pairs], idxs, ws, num_experts, L)[rank]
    scales = reference.dispatch([p[1] for p in pairs], idxs, None, num_experts, L, ranks=[rank])[0]
    assert recv_fp8.dtype == torch.float8_e4m3fn and torch.equal(recv_fp8.view(torch.uint8), bits.recv_x)
    assert torch.equal(recv_scales, scales.recv_x) and torch.equal(recv_w, bits.recv_topk_weights)
    cached_fp8, cached_scales = buf.dispatch(pairs[rank], handle=handle)[0]
    assert torch.equal(cached_fp8.view(torch.uint8), bits.recv_x) and torch.equal(cached_scales, scales.recv_x)


def _backward_empty_rank(rank, world_size, buf):
    """``out.sum().backward()`` (expanded, zero-stride gradients) with rank 0 sending no token."""
    num_tokens = [0] + [9] * (world_size - 1)
    idxs, ws, num_experts = make_routing(world_size, num_tokens, seed=22)
    x = make_x(num_tokens, 16, torch.float32, seed=22, integer=True)[rank].requires_grad_()
    recv_x, *_, handle, _ = buf.dispatch(x, idxs[rank], ws[rank], num_experts)
    out, _ = buf.combine(recv_x, handle)
    out.sum().backward()
    holders = handle.is_token_in_rank.sum(1, keepdim=True).float()
    assert torch.equal(x.grad, holders.expand_as(x)), "grad of sum(combine(dispatch(x))) must count the holders"


EXPERT_LAYOUTS = ({}, {"pad_multiple": 4}, {"num_permuted_tokens": 9, "pad_multiple": 2}, {"expert_capacity": 4})


def _permuted_oracle(refs, rank, layout, experts_per_rank):
    """Rank ``rank``'s permute of the oracle's dispatch (the torch reference of ``permute``)."""
    r = refs[rank]
    return permute(
        r.recv_x, r.recv_topk_idx, r.recv_topk_weights, num_local_experts=experts_per_rank, backend="torch", **layout
    )


def _dispatch_to_experts(rank, world_size, buf):
    """The fused permute equals permute(dispatch(...)) bit for bit (rows, weights, split sizes,
    row map), and a combine of its expert-major rows equals the oracle's combine of each rank's
    unpermuted rows: dropless, padded, with a budget that drops copies, and fixed blocks."""
    num_tokens = [20 + 3 * r for r in range(world_size)]
    idxs, ws, num_experts = make_routing(world_size, num_tokens, seed=41)
    _check_dispatch_to_experts(rank, world_size, buf, idxs, ws, num_experts, EXPERT_LAYOUTS)


def _dispatch_to_experts_empty_rank(rank, world_size, buf):
    """A rank whose experts no token picks (ordinary in training) receives no rows: its
    dispatch_to_experts returns empty expert-major rows, and every rank's results equal the
    oracle's, dropless and padded."""
    num_tokens = [12 + r for r in range(world_size)]
    idxs, ws, num_experts = make_routing(world_size, num_tokens, seed=44)
    last = num_experts - num_experts // world_size  # the last rank's first expert
    idxs = [torch.where(i >= last, -1, i) for i in idxs]
    _check_dispatch_to_experts(rank, world_size, buf, idxs, ws, num_experts, EXPERT_LAYOUTS[:2])


def _check_dispatch_to_experts(rank, world_size, buf, idxs, ws, num_experts, layouts):
    """dispatch_to_experts (then combine and a cached dispatch) against the oracle for each of
    ``layouts`` (see :func:`_dispatch_to_experts`)."""
    L = buf.topology.ranks_per_node
    xs = make_x([i.shape[0] for i in idxs], 32, torch.bfloat16, seed=41)
    refs = reference.dispatch(xs, idxs, ws, num_experts, L)
    per_rank = num_experts // world_size
    for layout in layouts:
        want = _permuted_oracle(refs, rank, layout, per_rank)
        px, pw, sizes, handle, _ = buf.dispatch_to_experts(xs[rank], idxs[rank], ws[rank], num_experts, **layout)
        assert torch.equal(px, want.permuted_x) and torch.equal(pw, want.permuted_probs), layout
        assert torch.equal(sizes, want.tokens_per_expert) and torch.equal(
            handle.permute.row_id_map, want.handle.row_id_map
        )
        assert bool(handle.permute.overflow) == bool(want.handle.overflow)
        ys = []
        for r in range(world_size):
            theirs = _permuted_oracle(refs, r, layout, per_rank)
            ys.append(unpermute(expert(theirs.permuted_x, r), theirs.handle, backend="torch"))
        out, _ = buf.combine(expert(px, rank), handle)
        assert torch.equal(out, reference.combine(ys, idxs, num_experts, L, ranks=[rank])[0]), layout
        cached = buf.dispatch(xs[rank] * 2, handle=handle)[0]  # a cached dispatch lands the same way
        assert torch.equal(
            cached,
            _permuted_oracle(
                reference.dispatch([x * 2 for x in xs], idxs, ws, num_experts, L), rank, layout, per_rank
            ).permuted_x,
        )


def _dispatch_to_experts_backward(rank, world_size, buf):
    """Backward of the fused permute: x gets the oracle's combine of each rank's unpermuted row
    gradients, topk_weights the combine of each entry's row gradient (0 where no row holds it)."""
    L = buf.topology.ranks_per_node
    _, idxs, ws, num_experts, xs = _world_inputs(world_size, seed=42)
    refs = reference.dispatch(xs, idxs, ws, num_experts, L)
    per_rank = num_experts // world_size
    layout = {"pad_multiple": 4}
    perms = [_permuted_oracle(refs, r, layout, per_rank) for r in range(world_size)]
    gen = torch.Generator().manual_seed(43)
    gxs = [torch.randn(p.permuted_x.shape, generator=gen) for p in perms]
    gws = [torch.randn(p.permuted_probs.shape, generator=gen) for p in perms]
    x, w = xs[rank].clone().requires_grad_(), ws[rank].clone().requires_grad_()
    px, pw, *_ = buf.dispatch_to_experts(x, idxs[rank], w, num_experts, **layout)
    ((px * gxs[rank]).sum() + (pw * gws[rank]).sum()).backward()
    unpermuted = [unpermute(g, p.handle, backend="torch") for g, p in zip(gxs, perms)]
    assert torch.equal(x.grad, reference.combine(unpermuted, idxs, num_experts, L, ranks=[rank])[0]), "grad x"
    per_entry = []
    for g, p, r in zip(gws, perms, refs):
        row = p.handle.row_id_map.long()
        got = torch.where(row >= 0, g[row.clamp(min=0)], torch.zeros(()))
        per_entry.append(torch.where(r.recv_topk_idx >= 0, got, torch.zeros(())))
    assert torch.equal(w.grad, reference.combine(per_entry, idxs, num_experts, L, ranks=[rank])[0]), "grad w"


def _dispatch_to_experts_static_receive(rank, world_size, buf):
    """num_worst_tokens: an ample static receive gives the fused layout's bits (rows, combine,
    gradients); a tight one (on_overflow="drop") permutes the rows the plain dispatch keeps."""
    L = buf.topology.ranks_per_node
    num_tokens, idxs, ws, num_experts, xs = _world_inputs(world_size, seed=44)
    refs = reference.dispatch(xs, idxs, ws, num_experts, L)
    per_rank = num_experts // world_size
    gen = torch.Generator().manual_seed(45)
    for layout in ({"pad_multiple": 4}, {"num_permuted_tokens": 9, "pad_multiple": 2}):
        want = _permuted_oracle(refs, rank, layout, per_rank)
        g = torch.randn(want.permuted_x.shape, generator=gen)
        grads = []
        for worst in (0, sum(num_tokens)):  # the fused layout, then an ample static receive
            x, w = xs[rank].clone().requires_grad_(), ws[rank].clone().requires_grad_()
            px, pw, sizes, handle, _ = buf.dispatch_to_experts(
                x, idxs[rank], w, num_experts, **layout, num_worst_tokens=worst, on_overflow="drop"
            )
            assert torch.equal(px, want.permuted_x) and torch.equal(pw, want.permuted_probs), (layout, worst)
            assert torch.equal(sizes, want.tokens_per_expert), (layout, worst)
            out, _ = buf.combine(px * g, handle)
            (out.square().sum() + (pw * px.sum(1)).sum()).backward()
            grads.append((out.detach(), x.grad, w.grad))
        for got, ref in zip(*grads):
            assert torch.equal(got, ref), layout
        recv_x, recv_idx, recv_w, *_, handle, _ = buf.dispatch(
            xs[rank], idxs[rank], ws[rank], num_experts, num_worst_tokens=3, on_overflow="drop"
        )
        tight = permute(recv_x, recv_idx, recv_w, num_local_experts=per_rank, backend="torch", **layout)
        px, pw, _, handle, _ = buf.dispatch_to_experts(
            xs[rank], idxs[rank], ws[rank], num_experts, **layout, num_worst_tokens=3, on_overflow="drop"
        )
        assert torch.equal(px, tight.permuted_x) and torch.equal(pw, tight.permuted_probs), layout
        assert bool(handle.overflow) == (refs[rank].recv_x.shape[0] > 3)


def _fp8_wire(rank, world_size, buf):
    """use_fp8: x travels as its fp8 pair and lands dequantized (the oracle's fp8 dispatch, then
    per_token_cast_back; permuted by dispatch_to_experts); the gradient passes straight through."""
    from moe_dispatch.ops.quant import per_token_cast_back, per_token_cast_to_fp8

    L = buf.topology.ranks_per_node
    num_tokens = [12 + r for r in range(world_size)]
    idxs, ws, num_experts = make_routing(world_size, num_tokens, seed=46)
    xs = make_x(num_tokens, 128, torch.bfloat16, seed=46)
    pairs = [per_token_cast_to_fp8(x) for x in xs]
    bits = reference.dispatch([p[0].view(torch.uint8) for p in pairs], idxs, ws, num_experts, L)[rank]
    scales = reference.dispatch([p[1] for p in pairs], idxs, None, num_experts, L, ranks=[rank])[0]
    arrived = per_token_cast_back(bits.recv_x.view(torch.float8_e4m3fn), scales.recv_x, torch.bfloat16)
    x = xs[rank].clone().requires_grad_()
    recv_x, *_, handle, _ = buf.dispatch(x, idxs[rank], ws[rank], num_experts, use_fp8=True, async_finish=True)
    assert recv_x.dtype == torch.bfloat16 and torch.equal(recv_x, arrived)
    g = make_x([recv_x.shape[0]], 128, torch.bfloat16, seed=47)[0]
    (recv_x * g).sum().backward()
    assert torch.equal(x.grad, buf.combine(g, handle)[0]), "the gradient passes the quantization straight through"
    layout = {"pad_multiple": 4}
    want = permute(
        arrived, bits.recv_topk_idx, bits.recv_topk_weights, num_local_experts=num_experts // world_size, **layout
    )
    px, pw, *_ = buf.dispatch_to_experts(xs[rank], idxs[rank], ws[rank], num_experts, **layout, use_fp8=True)
    assert torch.equal(px, want.permuted_x) and torch.equal(pw, want.permuted_probs)
    with pytest.raises(ValueError, match=r"use_fp8=True quantizes rows in 1x128 blocks, but x has hidden size 64"):
        buf.dispatch(xs[rank][:, :64].contiguous(), idxs[rank], ws[rank], num_experts, use_fp8=True)


def _close(rank, world_size, buf):
    """close() frees the transport (collectively); a later call says the Buffer was closed."""
    buf.close()
    buf.close()  # idempotent
    x = torch.zeros(4, 16)
    idx = torch.zeros(4, 1, dtype=torch.int64)
    with pytest.raises(RuntimeError, match=f"EP rank {rank}: this Buffer was closed"):
        buf.dispatch(x, idx, None, world_size)


# Cases of the torch_dist transport alone (before "close", the last shared case).
def _small_calls_one_collective(rank, world_size, buf):
    """Once a dispatch sized the blocks, a small dispatch, its combine and a cached dispatch are
    one collective each (the counts' or the argument check's blocks carry the rows; every pair
    sends the same rows here, so no padding), with the oracle's bits."""
    L, experts_per_rank = buf.topology.ranks_per_node, 2
    num_experts, num_tokens = experts_per_rank * world_size, [12] * world_size
    token = torch.arange(12).view(-1, 1)
    idxs = [torch.arange(world_size) * experts_per_rank + (token + r) % experts_per_rank for r in range(world_size)]
    ws = [torch.rand(12, world_size, generator=torch.Generator().manual_seed(36 + r)) for r in range(world_size)]
    xs = make_x(num_tokens, 24, torch.bfloat16, seed=36)
    buf.dispatch(xs[rank], idxs[rank], ws[rank], num_experts)  # sizes the blocks
    calls, real = [], dist.all_to_all_single

    def counted(*args, **kwargs):
        calls.append(kwargs.get("group"))
        return real(*args, **kwargs)

    dist.all_to_all_single = counted
    try:
        recv_x, recv_idx, recv_w, _, handle, _ = buf.dispatch(xs[rank], idxs[rank], ws[rank], num_experts)
        out, _ = buf.combine(expert(recv_x, rank), handle)
        cached = buf.dispatch(xs[rank] * 3, handle=handle)[0]
    finally:
        dist.all_to_all_single = real
    assert len(calls) == (3 if world_size > 1 else 0), f"{len(calls)} collectives for a dispatch, combine, replay"
    refs = reference.dispatch(xs, idxs, ws, num_experts, L)
    assert torch.equal(recv_x, refs[rank].recv_x) and torch.equal(recv_idx, refs[rank].recv_topk_idx)
    assert torch.equal(recv_w, refs[rank].recv_topk_weights)
    ys = [expert(r.recv_x, i) for i, r in enumerate(refs)]
    assert torch.equal(out, reference.combine(ys, idxs, num_experts, L, ranks=[rank])[0])
    tripled = reference.dispatch([x * 3 for x in xs], idxs, None, num_experts, L, ranks=[rank])[0]
    assert torch.equal(cached, tripled.recv_x)


def _links_choose_the_route(rank, world_size, buf):
    """On gloo the automatic route follows the links: the first call big enough measures them
    (every rank gets the same figures; a later Buffer on the same ranks uses them); links where the
    cross-node bytes dominate take the two stages, links where a collective's latency does the flat
    route; each with the oracle's bits."""
    from moe_dispatch.transport.torch_dist import route, tuning

    L = buf.topology.ranks_per_node
    fresh = Buffer(buf.group, ranks_per_node=L, timeout_s=buf.timeout_s)
    key = fresh.transport._links_key
    route._measured_links.pop(key, None)  # not measured yet
    try:
        transport = fresh.transport
        if not route.two_stage_world(transport.topology):
            return  # one route only
        # Every token to one expert of every rank: the two stages send a node one copy, not L.
        num_tokens, hidden = [300 + 3 * r for r in range(world_size)], 512
        num_experts = EXPERTS_PER_RANK * world_size
        idxs = [
            torch.arange(world_size) * EXPERTS_PER_RANK + (torch.arange(t).view(-1, 1) + r) % EXPERTS_PER_RANK
            for r, t in enumerate(num_tokens)
        ]
        gen = torch.Generator().manual_seed(41)
        ws = [torch.rand(t, world_size, generator=gen) for t in num_tokens]
        xs = make_x(num_tokens, hidden, torch.float32, seed=41)
        assert num_tokens[0] * world_size * hidden * 4 > tuning.LINK_PROBE_BYTES  # big enough to ask
        check_routing(fresh, rank, L, xs, idxs, ws, num_experts)
        measured = route._measured_links[key]
        figures = dataclasses.astuple(measured)
        assert measured.collective_s > 0 and measured.two_collectives_s > 0 and min(figures) >= 0, measured
        everyone = [None] * world_size
        dist.all_gather_object(everyone, figures, group=buf.group)
        assert all(m == figures for m in everyone), everyone
        slow_inter = route.Links(
            collective_s=0.0, per_byte=0.0, two_collectives_s=0.0, per_inter_byte=1.0, per_intra_byte=0.0
        )
        slow_collectives = route.Links(
            collective_s=1.0, per_byte=0.0, two_collectives_s=2.0, per_inter_byte=0.0, per_intra_byte=0.0
        )
        for costs, flat in ((slow_inter, False), (slow_collectives, True)):
            route._measured_links[key] = costs
            handle = check_routing(fresh, rank, L, xs, idxs, ws, num_experts)
            assert handle.slot.plan.flat is flat, (costs, handle.slot.plan.flat)
        other = Buffer(buf.group, ranks_per_node=L, timeout_s=buf.timeout_s)  # the same links: not measured again
        try:
            assert check_routing(other, rank, L, xs, idxs, ws, num_experts).slot.plan.flat
        finally:
            other.close()
    finally:
        route._measured_links.pop(key, None)
        fresh.close()


TORCH_DIST_CASES = {
    "every-pipeline-depth": _pipeline_depths,
    "small-calls-one-collective": _small_calls_one_collective,
    "links-choose-the-route": _links_choose_the_route,
}


def _world_entry(rank, world_size, ranks_per_node, transport="auto"):
    buf = Buffer(ranks_per_node=ranks_per_node, transport=transport, timeout_s=60)
    cases = _cases(ranks_per_node)
    if transport == "auto":  # CPU tensors: torch_dist
        cases = {**{k: v for k, v in cases.items() if k != "close"}, **TORCH_DIST_CASES, "close": cases["close"]}
    return run_cases(rank, world_size, cases, buf)


CASE_NAMES = list(_cases(1))


@pytest.mark.world
@pytest.mark.parametrize("case", CASE_NAMES + list(TORCH_DIST_CASES))
@pytest.mark.parametrize("world_size,ranks_per_node", WORLDS, ids=[f"w{w}-l{rpn}" for w, rpn in WORLDS])
def test_world(world_size, ranks_per_node, case):
    assert_case(world_results(_world_entry, world_size, ranks_per_node), case)


def _wider_rows_later(rank, world_size, buf):
    """A combine (fp16) and a cached dispatch wider than the dispatch that made the plan: the
    kernels' buffers grow on every rank, and the old handle still works."""
    num_tokens = [6 + r for r in range(world_size)]
    idxs, ws, num_experts = make_routing(world_size, num_tokens, seed=30)
    xs = make_x(num_tokens, 8, torch.bfloat16, seed=30)
    *_, handle, _ = buf.dispatch(xs[rank], idxs[rank], ws[rank], num_experts)
    refs = reference.dispatch(xs, idxs, ws, num_experts, world_size)
    ys = [
        torch.randn(r.recv_x.shape[0], 64, generator=torch.Generator().manual_seed(i)).half()
        for i, r in enumerate(refs)
    ]
    out, _ = buf.combine(ys[rank], handle)
    assert torch.equal(out, reference.combine(ys, idxs, num_experts, world_size, ranks=[rank])[0])
    wide = make_x(num_tokens, 96, torch.float32, seed=31)
    recv = buf.dispatch(wide[rank], handle=handle)[0]
    assert torch.equal(recv, reference.dispatch(wide, idxs, None, num_experts, world_size)[rank].recv_x)


def _mismatch_named_by_the_plan(rank, world_size, buf):
    """The ranks' hidden sizes differ: a ValueError on every rank naming the other. torch_dist
    compares the arguments in its metadata exchange (one all_gather on the Buffer's host group);
    the kernels, after their first dispatch, in their operation header (a MismatchError naming
    the row bytes)."""
    num_tokens = [5] * world_size
    idxs, ws, num_experts = make_routing(world_size, num_tokens, seed=32, num_experts=12 * world_size)
    x = make_x(num_tokens, 8 + 8 * rank, torch.float32, seed=32)[rank]
    other = 1 - rank
    if buf.transport.capabilities.device_checks:
        match = rf"rank {other} disagrees on the row bytes: {32 + 32 * other} on rank {other}, {32 + 32 * rank} "
    else:
        match = f"hidden is {8 + 8 * rank} here but {8 + 8 * other} on EP rank {other}"
    with pytest.raises(ValueError, match=match):
        buf.dispatch(x, idxs[rank], ws[rank], num_experts)
        buf.check_errors()  # on a GPU the kernels' records are read here


def _mixed_operations(rank, world_size, buf):
    """Rank 0 combines while rank 1 replays the dispatch (a cached dispatch): both checks run
    on one group, so both ranks raise a ValueError naming the other's operation (not a gloo
    abort). The kernels check on the host the first call of each kind: on a new Buffer these
    are both ranks' first calls of their kinds."""
    fresh = Buffer(buf.group, transport="kernels", ranks_per_node=world_size, timeout_s=60, config=buf.transport.config)
    try:
        num_tokens = [5] * world_size
        idxs, ws, num_experts = make_routing(world_size, num_tokens, seed=33)
        x = make_x(num_tokens, 48, torch.float16, seed=33)[rank]
        recv_x, *_, handle, _ = fresh.dispatch(x, idxs[rank], ws[rank], num_experts)
        theirs = "dispatch" if rank == 0 else "combine"
        with pytest.raises(ValueError, match=rf"operation is .* here but {re.escape(theirs)} on EP rank {1 - rank}"):
            if rank == 0:
                fresh.combine(recv_x, handle)
            else:
                fresh.dispatch(x, handle=handle)
        out, _ = fresh.combine(recv_x, handle)  # still in step afterwards
        assert out.shape == x.shape
    finally:
        fresh.close()


def _config_reaches_the_kernels(rank, world_size, buf):
    """Buffer(config=...) launches the kernels with that Config: with one-slot rings whose
    slots are discarded after each read (l2_discard: poisoned on the CPU backend), dispatch and
    combine still equal the oracle."""
    del buf
    config = Config(num_sms=2, num_slots=1, chunk_tokens=1, l2_discard=True)
    shallow = Buffer(transport="kernels", config=config, timeout_s=60)
    try:
        assert shallow.transport.config is config and shallow.num_sms == 2
        num_tokens = [9 - r for r in range(world_size)]
        idxs, ws, num_experts = make_routing(world_size, num_tokens, seed=34)
        xs = make_x(num_tokens, 192, torch.bfloat16, seed=34)
        recv_x, _, recv_w, *_, handle, _ = shallow.dispatch(xs[rank], idxs[rank], ws[rank], num_experts)
        assert shallow.transport._kernels.engine.config is config  # what the launches read
        refs = reference.dispatch(xs, idxs, ws, num_experts, world_size)
        assert torch.equal(recv_x, refs[rank].recv_x) and torch.equal(recv_w, refs[rank].recv_topk_weights)
        ys = [
            torch.randn(r.recv_x.shape[0], 192, generator=torch.Generator().manual_seed(i)).bfloat16()
            for i, r in enumerate(refs)
        ]
        out, _ = shallow.combine(ys[rank], handle)
        assert torch.equal(out, reference.combine(ys, idxs, num_experts, world_size, ranks=[rank])[0])
    finally:
        shallow.close()


def _auto_config(rank, world_size, buf):
    """Buffer(config="auto") resolves Config.auto at its first dispatch from the fields every
    rank agreed on (the same Config on every rank), and then equals the oracle."""
    import torch.distributed as dist

    L = buf.topology.ranks_per_node
    auto = Buffer(buf.group, ranks_per_node=L, transport="kernels", config="auto", timeout_s=60)
    try:
        assert auto.transport.config == "auto" and auto.num_sms is None
        num_tokens = [7 + 3 * r for r in range(world_size)]
        idxs, ws, num_experts = make_routing(world_size, num_tokens, seed=36)
        xs = make_x(num_tokens, 64, torch.bfloat16, seed=36)
        recv_x, *_, handle, _ = auto.dispatch(xs[rank], idxs[rank], ws[rank], num_experts)
        chosen = auto.transport.config
        want = Config.auto(
            4096,
            world_size,
            hidden=64,
            num_topk=idxs[rank].shape[1],
            num_experts=num_experts,
            num_nodes=world_size // L,
        )
        assert chosen == want, (chosen, want)
        everyone = [None] * world_size
        dist.all_gather_object(everyone, chosen)
        assert all(c == chosen for c in everyone)
        refs = reference.dispatch(xs, idxs, ws, num_experts, L)
        assert torch.equal(recv_x, refs[rank].recv_x)
        out, _ = auto.combine(recv_x, handle)
        ys = [r.recv_x for r in refs]
        assert torch.equal(out, reference.combine(ys, idxs, num_experts, L, ranks=[rank])[0])
    finally:
        auto.close()


def _cuda_is_the_old_name(rank, world_size, buf):
    """transport="cuda", the old name of "kernels", builds the same transport."""
    old = Buffer(buf.group, transport="cuda", timeout_s=60)
    try:
        assert old.transport_name == buf.transport_name == "kernels"
        assert type(old.transport) is type(buf.transport)
    finally:
        old.close()


def _handle_row_counts(rank, world_size, buf):
    """A kernel plan reports the rows a dispatch sent inside and across nodes, as torch_dist's does."""
    dist_buf = Buffer(buf.group, transport="torch_dist", ranks_per_node=world_size, timeout_s=60)
    try:
        num_tokens = [11 + 2 * r for r in range(world_size)]
        idxs, ws, num_experts = make_routing(world_size, num_tokens, seed=35)
        x = make_x(num_tokens, 16, torch.float32, seed=35)[rank]
        kernel = buf.dispatch(x, idxs[rank], ws[rank], num_experts)[4]
        torch_dist = dist_buf.dispatch(x, idxs[rank], ws[rank], num_experts)[4]
        assert kernel.num_internode_tokens == torch_dist.num_internode_tokens == 0
        assert kernel.num_intranode_tokens == torch_dist.num_intranode_tokens > 0
    finally:
        dist_buf.close()


KERNEL_CASES = {
    "wider-rows-later": _wider_rows_later,
    "cuda-is-the-old-name": _cuda_is_the_old_name,
    "handle-row-counts": _handle_row_counts,
    "mismatch-named-by-the-plan": _mismatch_named_by_the_plan,
    "mixed-operations": _mixed_operations,
    "config-reaches-the-kernels": _config_reaches_the_kernels,
}


# KERNEL_CASES run in the kernels' two-rank world of test_kernel_path.py, and every case above in
# its worlds of every topology.


@pytest.mark.skipif(not _ext.extension_status().built, reason="the one-pass packing is in moe_dispatch._C")
def test_blocks_packed_in_one_pass_equal_torch_packing(monkeypatch):
    """torch_dist's blocks (header, then each destination's rows: the fields side by side, padded
    to 8 bytes) written by _C.pack_blocks_cpu hold what pack and a copy per destination write:
    gathered and in-order rows, a field needing padding, an empty destination, strided sources."""
    from moe_dispatch.transport.torch_dist import packing

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(20, 6, generator=gen).to(torch.bfloat16)  # 12 bytes: padded to 16
    weights = torch.rand(20, 2, 3, generator=gen)[:, 1]  # strided rows of 12 bytes
    idx = torch.randint(-1, 5, (20, 3), generator=gen)
    head = torch.randint(0, 99, (4, 5), generator=gen)
    splits = [3, 0, 5, 2]
    for fields in ([(x, torch.randperm(20, generator=gen)[:10]), (weights, None), (idx, None)], [(x, None)]):
        if fields[0][1] is not None:  # one index for every field
            fields = [(t, fields[0][1]) for t, _ in fields]
        got, want = (torch.zeros(4, 40 + 56 * 5, dtype=torch.uint8) for _ in range(2))
        packing.pack_blocks(got, head, fields, splits, 2)
        monkeypatch.setattr(_ext, "extension_status", lambda: types.SimpleNamespace(built=False))
        packing.pack_blocks(want, head, fields, splits, 2)
        monkeypatch.undo()
        row_bytes = packing.pack(fields).shape[1]
        specs = packing.specs_of([t for t, _ in fields])
        for d, n in enumerate(splits):  # the header and each row's fields (torch leaves the padding as it was)
            assert torch.equal(got[d, :40], want[d, :40]) and got[d, 16:24].view(torch.int64).item() == n, d
            rows = [b[d, 40 : 40 + n * row_bytes].view(n, row_bytes) for b in (got, want)]
            for a, b in zip(*(packing.field_views(r, specs) for r in rows)):
                assert torch.equal(a.view(torch.uint8) if a.numel() else a, b.view(torch.uint8) if b.numel() else b), d


@pytest.mark.skipif(not _ext.extension_status().built, reason="the one-pass counts are in moe_dispatch._C")
def test_dispatch_counts_in_one_pass_equal_torch_counts(monkeypatch):
    """torch_dist's dispatch counts made by _C.dispatch_counts_cpu (per sub-range counts, in_node,
    the header words, the flat send order) equal the torch version's, for one and several
    sub-ranges, one and several nodes, and tokens that go nowhere."""
    from moe_dispatch.topology import Topology
    from moe_dispatch.transport.torch_dist import plan as td_plan

    gen = torch.Generator().manual_seed(5)
    for world, local_ranks, num_tokens, subs in (
        (4, 2, 37, 4),
        (4, 4, 20, 1),
        (8, 2, 3, 4),
        (6, 3, 0, 2),
        (1, 1, 9, 1),
    ):
        in_rank = torch.rand(num_tokens, world, generator=gen) < 0.4
        bounds = [c * num_tokens // subs for c in range(subs + 1)]
        for rank in range(world):
            topo = Topology(rank=rank, world_size=world, ranks_per_node=local_ranks)
            words = 3 + td_plan.NUM_SIZES + subs * (local_ranks + 1)
            heads = [torch.full((world, words), -7, dtype=torch.int64) for _ in range(2)]
            got = td_plan.dispatch_counts(in_rank, bounds, topo, heads[0], 3)
            monkeypatch.setattr(_ext, "extension_status", lambda: types.SimpleNamespace(built=False))
            want = td_plan.dispatch_counts(in_rank, bounds, topo, heads[1], 3)
            monkeypatch.undo()
            assert torch.equal(heads[0], heads[1]), (world, local_ranks, rank)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (world, local_ranks, rank)
            assert want[2] is None and torch.equal(got[2], td_plan.flat_send_idx(in_rank)), (world, rank)


def test_route_choice_weighs_the_measured_links():
    """torch_dist's automatic route on gloo: the flat route where the links are alike (a loopback:
    the forwarded rows cost what the saved cross-node rows did, plus a collective) or the call is
    small, the two stages where the cross-node link is 9x slower and the routing de-duplicates;
    on NCCL the GPU-link rule (FLAT_BYTES, MIN_DEDUP), and no measurement."""
    from moe_dispatch.topology import Topology
    from moe_dispatch.transport.torch_dist import route

    def counts(max_flat, flat_cross, stage1_cross, total):
        return types.SimpleNamespace(
            max_flat_rows=max_flat, flat_cross_rows=flat_cross, stage1_cross_rows=stage1_cross, total_flat_rows=total
        )

    def pays(gloo, links, c, row_bytes=1024):
        def measured():
            assert links is not None, "measured links where the rule needs none"
            return links

        topology = Topology(rank=0, world_size=8, ranks_per_node=4)
        return route.two_stages_pay(c, row_bytes, topology, gloo, measured)

    # 8 ranks, 2 nodes of 4; every token of a rank to ~6 ranks (3 per node): 4x de-duplication.
    dedup = counts(6000, 8 * 3000, 8 * 1000, 8 * 6000)
    gloo, nccl = True, False

    def links(per_inter_byte):
        return route.Links(
            collective_s=2e-3, per_byte=2e-9, two_collectives_s=4e-3, per_inter_byte=per_inter_byte, per_intra_byte=2e-9
        )

    loopback, cluster = links(2e-9), links(18e-9)
    assert not pays(gloo, loopback, dedup)
    assert pays(gloo, cluster, dedup)
    assert not pays(gloo, cluster, counts(6000, 8 * 3000, 8 * 3000, 8 * 6000))  # nothing de-duplicated
    # Top-2 routing, half the rows to the other node: the flat route's in-node rows move while its
    # cross-node rows do (20.4 ms), the stages one after the other: 21.6 ms with a fifth of the
    # cross-node rows saved, 19.1 ms with a third (within TWO_STAGE_GAIN of the flat route: flat).
    assert not pays(gloo, cluster, counts(2100, 8 * 1000, 8 * 790, 8 * 2000))
    assert not pays(gloo, cluster, counts(2100, 8 * 1000, 8 * 650, 8 * 2000))
    assert pays(gloo, cluster, counts(2100, 8 * 1000, 8 * 400, 8 * 2000))  # 14.4 ms: three fifths saved
    assert not pays(gloo, None, counts(200, 8 * 100, 8 * 30, 8 * 200))  # small: no measurement
    assert pays(nccl, None, dedup, row_bytes=7168 * 2) and not pays(nccl, None, dedup, row_bytes=512)  # FLAT_BYTES
    assert not pays(nccl, None, counts(6000, 8 * 3000, 8 * 2500, 8 * 6000), row_bytes=7168 * 2)  # MIN_DEDUP


def test_fused_blocks_weigh_their_padding_by_the_measured_links():
    """A check's blocks carry the flat rows where padding every block to the largest pair adds at
    most FUSED_PADDING to the bytes (no measurement), else where the measured links move the
    slowest rank's extra bytes in less time than the collective saved takes."""
    from moe_dispatch.transport.torch_dist import route

    def pays(links, max_pair, max_flat, total, row_bytes=1024):
        def measured():
            assert links is not None, "measured links where the rule needs none"
            return links

        c = types.SimpleNamespace(max_flat_rows=max_flat, total_flat_rows=total)
        return route.padding_pays(c, row_bytes, max_pair, 4, measured)  # 4 ranks

    def links(collective_s, per_byte):
        return route.Links(
            collective_s=collective_s, per_byte=per_byte, two_collectives_s=0.0, per_inter_byte=0.0, per_intra_byte=0.0
        )

    assert pays(None, 100, 400, 16 * 90)  # 16 blocks of 100 rows for 1440: 1.11x, no measurement
    # 16 blocks of 200 rows for 1600 (2x); the slowest rank sends 500: 300 rows (300 KiB) of padding
    assert pays(links(1e-3, 1e-9), 200, 500, 1600)  # 0.3 ms of padding < 1 ms a collective
    assert not pays(links(1e-4, 1e-9), 200, 500, 1600)  # ... > 0.1 ms


@pytest.mark.skipif(not _ext.extension_status().built, reason="the one-pass landing is in moe_dispatch._C")
def test_rows_landed_from_the_blocks_equal_the_torch_landing():
    """_C.land_blocks_cpu writes each field of the rows the blocks carried (an empty block too)
    into its output in arrival order, or gathered by an index with zero rows at -1: what the
    blocks' concatenation, a column slice and gather_rows write."""
    from moe_dispatch.semantics.permute import gather_rows
    from moe_dispatch.transport.torch_dist import packing

    gen = torch.Generator().manual_seed(7)
    x = torch.randn(20, 6, generator=gen).to(torch.bfloat16)  # 12 bytes: padded to 16
    idx = torch.randint(-1, 5, (20, 3), generator=gen)
    send_idx, splits = torch.randperm(20, generator=gen)[:11], [4, 0, 5, 2]
    fields = [(x, send_idx), (idx, send_idx)]
    head_bytes, width = 40, packing.pack(fields).shape[1]
    blocks = torch.zeros(4, head_bytes + 5 * width, dtype=torch.uint8)
    packing.pack_blocks(blocks, torch.zeros(4, 5, dtype=torch.int64), fields, splits, 0)
    carried = packing.Carried(blocks, splits, head_bytes, width)
    rows = torch.cat([blocks[s, head_bytes : head_bytes + n * width].view(n, width) for s, n in enumerate(splits)])
    src = torch.tensor([3, -1, 0, 10, 10, -1, 7])
    got_x, got_idx = torch.full((7, 6), 9.0, dtype=torch.bfloat16), torch.empty(11, 3, dtype=torch.int64)
    carried.land([(0, 12, got_x, src), (16, 24, got_idx, None)])
    assert torch.equal(got_x.view(torch.uint8), gather_rows(rows[:, :12], src).view(torch.uint8).view(7, 12))
    assert torch.equal(got_idx, idx[send_idx])
    with pytest.raises(ValueError, match="takes arrival row 11 of 11"):
        carried.land([(0, 12, got_x[:1], torch.tensor([11]))])
