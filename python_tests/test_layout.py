"""Routing layout: the Triton kernels (under the interpreter on CPU) against the torch reference,
the reference against first principles, and the routing_map <-> top-k conversions.

Everything here is counting and indexing, so every comparison is exact.
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moe_dispatch import _ext
from moe_dispatch.ops.layout import (
    DispatchLayout,
    check_topk_idx_cpu,
    get_dispatch_layout,
    get_dispatch_layout_triton,
    is_token_in_rank_cpu,
    resolve_backend,
    routing_map_to_topk,
    topk_to_routing_map,
)
from moe_dispatch.semantics.layout import (
    get_dispatch_layout_reference,
    get_send_offsets_reference,
    is_token_in_rank_torch,
)
from moe_dispatch.semantics.validation import check_topk_idx

from .conftest import KERNEL_DEVICE as DEVICE


def random_topk(num_tokens, num_topk, num_experts, gen, drop=0.2, dtype=torch.int64):
    """Distinct experts per row (a random top-k), some slots set to -1."""
    scores = torch.rand(num_tokens, max(num_experts, num_topk), generator=gen)
    idx = scores.topk(num_topk, dim=1).indices
    idx = torch.where(idx >= num_experts, -1, idx)
    idx = torch.where(torch.rand(num_tokens, num_topk, generator=gen) < drop, -1, idx)
    return idx.to(dtype).contiguous()


pytestmark = pytest.mark.usefixtures("on_kernel_device")


def assert_layout_equal(got: DispatchLayout, want: DispatchLayout):
    for name, a, b in zip(DispatchLayout._fields, got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, b.dtype, a.shape, b.shape)
        assert torch.equal(a, b), name


def torch_layout(idx, num_experts, num_ranks, ranks_per_node):
    base = get_dispatch_layout_reference(idx, num_experts, num_ranks, ranks_per_node)
    return DispatchLayout(*base, *get_send_offsets_reference(base[3], ranks_per_node))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize(
    "num_tokens,num_topk,num_experts,num_ranks,ranks_per_node,block_t",
    [
        (0, 8, 16, 4, 2, None),  # empty input
        (1, 1, 1, 1, 1, None),
        (100, 8, 256, 64, 8, 16),  # T not a multiple of the block, many blocks
        (333, 6, 64, 8, 4, 32),
        (300, 4, 12, 3, 1, None),  # non power-of-two sizes
        (4096, 8, 256, 32, 8, None),  # the DeepSeek-V3 routing shape
    ],
)
def test_triton_matches_reference(gen, dtype, num_tokens, num_topk, num_experts, num_ranks, ranks_per_node, block_t):
    idx = random_topk(num_tokens, num_topk, num_experts, gen, dtype=dtype)
    want = torch_layout(idx, num_experts, num_ranks, ranks_per_node)
    got = get_dispatch_layout_triton(idx, num_experts, num_ranks, ranks_per_node, block_t=block_t)
    assert_layout_equal(got, want)
    assert_layout_equal(get_dispatch_layout(idx, num_experts, num_ranks, ranks_per_node, backend="triton"), want)
    assert_layout_equal(get_dispatch_layout(idx, num_experts, num_ranks, ranks_per_node), want)  # auto


def test_all_minus_one_rows(gen):
    idx = random_topk(200, 8, 64, gen)
    idx[::3] = -1
    idx[150:] = -1
    got = get_dispatch_layout_triton(idx, 64, 8, 2, block_t=64)
    want = torch_layout(idx, 64, 8, 2)
    assert_layout_equal(got, want)
    assert not got.is_token_in_rank[::3].any()
    assert (got.rank_send_offsets[150:] == -1).all() and (got.node_send_offsets[150:] == -1).all()


def test_reference_from_first_principles(gen):
    """The oracle itself, checked with plain Python loops on a small case."""
    num_tokens, num_experts, num_ranks, ranks_per_node = 37, 12, 6, 2
    idx = random_topk(num_tokens, 3, num_experts, gen)
    lay = torch_layout(idx, num_experts, num_ranks, ranks_per_node)
    per_rank = num_experts // num_ranks
    rank_seen = [0] * num_ranks
    node_seen = [0] * (num_ranks // ranks_per_node)
    expert_count = [0] * num_experts
    for t in range(num_tokens):
        experts = [e for e in idx[t].tolist() if e >= 0]
        ranks = {e // per_rank for e in experts}
        nodes = {r // ranks_per_node for r in ranks}
        for e in experts:
            expert_count[e] += 1
        for r in range(num_ranks):
            assert bool(lay.is_token_in_rank[t, r]) == (r in ranks)
            assert int(lay.rank_send_offsets[t, r]) == (rank_seen[r] if r in ranks else -1)
        for n in range(len(node_seen)):
            assert int(lay.node_send_offsets[t, n]) == (node_seen[n] if n in nodes else -1)
        for r in ranks:
            rank_seen[r] += 1
        for n in nodes:
            node_seen[n] += 1
    assert lay.num_tokens_per_rank.tolist() == rank_seen
    assert lay.num_tokens_per_node.tolist() == node_seen
    assert lay.num_tokens_per_expert.tolist() == expert_count


@settings(
    max_examples=25 if DEVICE == "cpu" else 8,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    num_tokens=st.integers(0, 300),
    num_topk=st.integers(1, 9),
    experts_per_rank=st.integers(1, 5),
    num_nodes=st.integers(1, 4),
    ranks_per_node=st.integers(1, 4),
    block_t=st.sampled_from([16, 32, 128, None]),
    drop=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**31 - 1),
)
def test_property_triton_equals_reference(
    num_tokens, num_topk, experts_per_rank, num_nodes, ranks_per_node, block_t, drop, seed
):
    num_ranks = num_nodes * ranks_per_node
    num_experts = experts_per_rank * num_ranks
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    idx = random_topk(num_tokens, num_topk, num_experts, g, drop=drop)
    got = get_dispatch_layout_triton(idx, num_experts, num_ranks, ranks_per_node, block_t=block_t)
    assert_layout_equal(got, torch_layout(idx, num_experts, num_ranks, ranks_per_node))


def test_send_offsets_pack_in_token_order(gen):
    """Packing rows at ``rank_start[r] + offset`` gives each destination its tokens in order."""
    idx = random_topk(500, 8, 64, gen)
    lay = get_dispatch_layout_triton(idx, 64, 16, 4, block_t=64)
    start = torch.cumsum(lay.num_tokens_per_rank, 0) - lay.num_tokens_per_rank
    t, r = lay.is_token_in_rank.nonzero(as_tuple=True)
    slot = start[r] + lay.rank_send_offsets[t, r].long()
    packed = torch.empty(int(lay.num_tokens_per_rank.sum()), dtype=torch.long)
    packed[slot] = t
    assert torch.equal(torch.sort(slot).values, torch.arange(packed.numel()))  # a permutation
    want = torch.cat([lay.is_token_in_rank[:, d].nonzero()[:, 0] for d in range(16)])
    assert torch.equal(packed, want)


def test_duplicates_rejected():
    idx = torch.tensor([[0, 1], [3, 3]], dtype=torch.int64)
    with pytest.raises(ValueError, match=r"row 1 selects an expert more than once"):
        get_dispatch_layout(idx, 4, 2, 1, backend="triton")


def test_bad_arguments():
    idx = torch.tensor([[0, 1], [2, -1], [-1, -1], [3, 0]], dtype=torch.int64)
    with pytest.raises(ValueError, match="divisible by the EP world size 3"):
        get_dispatch_layout(idx, 4, 3, 1)
    with pytest.raises(ValueError, match="ranks_per_node must divide"):
        get_dispatch_layout(idx, 4, 4, 3)
    with pytest.raises(TypeError, match="topk_idx must have dtype"):
        get_dispatch_layout(idx.float(), 4, 2, 1)
    with pytest.raises(ValueError, match=r"entries must be in \[-1, 4\)"):
        get_dispatch_layout(idx + 8, 4, 2, 1)
    with pytest.raises(ValueError, match="backend must be one of"):
        get_dispatch_layout(idx, 4, 2, 1, backend="cuda")
    with pytest.raises(ValueError, match="backend must be one of"):
        resolve_backend("gpu", idx)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_unvalidated_ids_out_of_range_count_as_none(gen, backend):
    idx = random_topk(64, 4, 8, gen)
    bad = idx.clone()
    bad[::5, 0] = 8  # out of range
    bad[1::7, 1] = -5
    got = get_dispatch_layout(bad, 8, 4, 2, validate=False, backend=backend)
    clean = torch.where((bad >= 0) & (bad < 8), bad, -1)
    assert_layout_equal(got, torch_layout(clean, 8, 4, 2))


# -- routing_map <-> top-k -------------------------------------------------------------------


def test_routing_map_round_trip(gen):
    num_tokens, num_experts, num_topk = 257, 32, 6
    idx = random_topk(num_tokens, num_topk, num_experts, gen)
    weights = torch.rand(num_tokens, num_topk, generator=gen)
    routing_map, probs = topk_to_routing_map(idx, weights, num_experts)
    assert routing_map.dtype == torch.bool and probs.dtype == torch.float32
    assert torch.equal(routing_map.sum(1), (idx >= 0).sum(1))
    # probs carry the weights at the selected experts and zeros elsewhere
    rows = torch.arange(num_tokens).unsqueeze(1).expand_as(idx)
    sel = idx >= 0
    assert torch.equal(probs[rows[sel], idx[sel]], weights[sel])
    assert (probs[~routing_map] == 0).all()
    back_idx, back_w = routing_map_to_topk(routing_map, probs, num_topk)
    # canonical form: ascending expert ids, then -1 with weight 0
    key = torch.where(idx >= 0, idx, num_experts)
    order = key.sort(1).indices
    want_idx = torch.gather(idx, 1, order)
    want_w = torch.where(want_idx >= 0, torch.gather(weights, 1, order), 0.0)
    want_idx = torch.where(want_idx >= 0, want_idx, -1)
    assert torch.equal(back_idx, want_idx) and torch.equal(back_w, want_w)
    assert back_idx.dtype == torch.int64
    # and the layout only depends on the set of experts
    assert_layout_equal(
        get_dispatch_layout_triton(back_idx, num_experts, 8, 4), get_dispatch_layout_triton(idx, num_experts, 8, 4)
    )


def test_routing_map_edge_cases():
    empty = torch.zeros(0, 8, dtype=torch.bool)
    idx, w = routing_map_to_topk(empty, None, 2)
    assert idx.shape == (0, 2) and w is None
    rm = torch.tensor([[True, False, True], [False, False, False]])
    idx, w = routing_map_to_topk(rm, torch.ones(2, 3), 5)  # more columns than experts
    assert idx.tolist() == [[0, 2, -1, -1, -1], [-1] * 5]
    assert w.tolist() == [[1, 1, 0, 0, 0], [0] * 5]
    with pytest.raises(ValueError, match="row 0 selects 2 experts but num_topk is 1"):
        routing_map_to_topk(rm, None, 1)
    with pytest.raises(ValueError, match="probs must be a floating tensor"):
        routing_map_to_topk(rm, torch.ones(3, 3), 2)
    with pytest.raises(ValueError, match="topk_weights must be a floating tensor"):
        topk_to_routing_map(torch.zeros(2, 2, dtype=torch.long) - 1, torch.ones(2, 3), 4)


# -- the CPU passes of moe_dispatch._C (csrc/kernels/layout_cpu.cpp) against the torch reference --


def _error_of(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except (TypeError, ValueError) as err:
        return type(err), str(err)
    return None


@pytest.mark.skipif(not _ext.extension_status().built, reason="the one-pass checks are in moe_dispatch._C")
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_native_topk_idx_check_and_layout_equal_the_reference(gen, dtype):
    """check_topk_idx_cpu raises what check_topk_idx raises (range below and above, an expert twice,
    which error comes first, empty input) and is_token_in_rank_cpu equals the torch version, ids
    outside [0, E) counting as none."""
    cases = [random_topk(0, 4, 16, gen, dtype=dtype), random_topk(1, 1, 1, gen, dtype=dtype)]
    for num_tokens, num_topk, num_experts in ((37, 4, 16), (200, 8, 64), (64, 1, 8)):
        idx = random_topk(num_tokens, num_topk, num_experts, gen, dtype=dtype)
        cases.append(idx)
        for row, slot, value in ((5, 0, num_experts), (3, 0, -2), (num_tokens - 1, 0, num_experts + 7)):
            bad = idx.clone()
            bad[row, slot] = value
            cases.append(bad)
        if num_topk > 1:
            for row in (0, 9, num_tokens - 1):
                bad = idx.clone()
                bad[row, 1] = bad[row, 0] = 3  # an expert twice
                cases.append(bad)
                worse = bad.clone()
                worse[row + 1 if row + 1 < num_tokens else 0, 0] = -3  # a range error elsewhere wins
                cases.append(worse)
    for idx in cases:
        num_experts = max(16, int(idx.max()) + 1) if idx.numel() else 16
        for e in (num_experts, 16 if num_experts > 16 else 8):
            assert _error_of(check_topk_idx_cpu, idx, e) == _error_of(check_topk_idx, idx, e), idx
        for num_ranks in (1, 2, 4):
            assert torch.equal(is_token_in_rank_cpu(idx, 16, num_ranks), is_token_in_rank_torch(idx, 16, num_ranks)), (
                num_ranks
            )


@pytest.mark.skipif(not _ext.extension_status().built, reason="the one-pass conversion is in moe_dispatch._C")
def test_native_routing_map_to_topk_equals_torch(gen, monkeypatch):
    """routing_map_to_topk's pass over a one-byte CPU map gives the torch version's ids, weights
    (fp32, bf16, fp16 incl. subnormals, fp64 probs) and errors, also unvalidated rows with too many
    experts (the highest ids dropped) and more columns than experts."""
    import moe_dispatch.ops.layout as layout_ops

    def both(*args, **kwargs):
        got = _error_of(routing_map_to_topk, *args, **kwargs) or routing_map_to_topk(*args, **kwargs)
        monkeypatch.setattr(layout_ops, "_native", lambda t: False)
        want = _error_of(routing_map_to_topk, *args, **kwargs) or routing_map_to_topk(*args, **kwargs)
        monkeypatch.undo()
        return got, want

    for num_tokens, num_experts, num_topk in ((0, 8, 2), (50, 16, 4), (33, 3, 5), (64, 128, 8)):
        rm = torch.rand(num_tokens, num_experts, generator=gen) < 0.2
        probs = torch.rand(num_tokens, num_experts, generator=gen) * 2 - 1
        probs[::3, ::2] *= 1e-6  # subnormal in fp16
        for m in (rm, rm.to(torch.uint8)):
            for p in (None, probs, probs.bfloat16(), probs.half(), probs.double()):
                for validate in (True, False):
                    got, want = both(m, p, num_topk, validate=validate)
                    if isinstance(want, tuple) and isinstance(want[0], type):
                        assert got == want
                        continue
                    assert torch.equal(got[0], want[0]), (m.dtype, validate)
                    assert (got[1] is None) == (want[1] is None)
                    if want[1] is not None:
                        assert got[1].dtype == want[1].dtype and torch.equal(got[1], want[1]), p.dtype
    # Router probs that need a gradient keep it: the weights' backward reaches probs as torch's does,
    # with free slots (-1) and with every slot an expert (Megatron's router: exactly K per token).
    probs = torch.rand(50, 16, generator=gen, requires_grad=True)
    sparse = torch.rand(50, 16, generator=gen) < 0.2
    exact = torch.zeros(50, 16, dtype=torch.bool).scatter_(1, torch.rand(50, 16, generator=gen).topk(4).indices, True)
    for rm, num_topk in ((sparse, 16), (exact, 4)):
        grads, weights = [], []
        for native in (True, False):
            if not native:
                monkeypatch.setattr(layout_ops, "_native", lambda t: False)
            probs.grad = None
            idx, w = routing_map_to_topk(rm, probs, num_topk)
            (w * torch.arange(float(num_topk))).sum().backward()
            grads.append(probs.grad.clone())
            weights.append(w.detach())
        monkeypatch.undo()
        assert torch.equal(weights[0], weights[1]) and torch.equal(grads[0], grads[1]) and grads[0].abs().sum() > 0


@pytest.mark.skipif(not _ext.extension_status().built, reason="the one-pass localize is in moe_dispatch._C")
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_native_localize_equals_torch(gen, dtype, monkeypatch):
    """The received ids made local in one pass and in torch ops (Buffer._localize's two paths):
    the same ids, per-expert counts and zeroed weights."""
    import moe_dispatch.ops.layout as layout_ops

    ids = torch.randint(-1, 32, (40, 6), generator=gen).to(dtype)
    weights = torch.rand(40, 6, generator=gen)
    for first, local in ((8, 8), (0, 4), (28, 4)):
        want = ids - first
        other = (want < 0) | (want >= local)
        want = want.masked_fill(other, -1)
        for native in (True, False):
            if not native:
                monkeypatch.setattr(layout_ops, "_native", lambda t: False)
            got, counts, w = ids.clone(), torch.empty(local, dtype=torch.int64), weights.clone()
            layout_ops.localize_topk_idx_cpu(got, counts, first, local, w)
            monkeypatch.undo()
            assert torch.equal(got, want), native
            assert torch.equal(counts, torch.bincount(want[~other].long(), minlength=local)), native
            assert torch.equal(w, weights.masked_fill(other, 0.0)), native
