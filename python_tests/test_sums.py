"""The summation order's implementations against its definition,
:mod:`moe_dispatch.semantics.summation` (the home; docs/semantics.md lists them all): the home
itself against literal loops; ``ordered_sum`` (one level: fp32 row sums in ascending row order,
rounded once) in torch and in one native pass; and the torch_dist transport's combine sums (flat
route, forwarder and source) against the home's ``combine_sum`` and ``moe_dispatch.reference``
on drawn worlds, dtypes and weights."""

import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_dispatch import _ext
from moe_dispatch.ops import sums as one_pass
from moe_dispatch.semantics.layout import get_dispatch_layout_reference
from moe_dispatch.semantics.reference import combine as oracle_combine
from moe_dispatch.semantics.summation import combine_sum, sum_by_index
from moe_dispatch.semantics.sums import ordered_sum, plan_sum, plan_sum_by_output
from moe_dispatch.topology import Topology
from moe_dispatch.transport.torch_dist import sums as torch_dist_sums
from moe_dispatch.transport.torch_dist.plan import TorchDistChunk, TorchDistPlan, flat_send_idx

from .test_dispatch import make_routing


def row_by_row(rows, index, num_out, scale=None):
    """Row by row from +0.0 in fp32, then one rounding: one level, literally."""
    acc = torch.zeros(num_out + 1, *rows.shape[1:], dtype=torch.float32)
    for i in range(rows.shape[0]):
        term = rows[i].float()
        if scale is not None:
            term = term * scale[i]
        acc[index[i]] += term
    return acc[:num_out].to(rows.dtype)


def tricky_rows(num_rows, hidden, dtype, gen):
    """Magnitudes from 1e-3 to 1e3, rows that cancel exactly, -0.0 entries."""
    rows = torch.randn(num_rows, hidden, generator=gen) * torch.logspace(-3, 3, num_rows).view(-1, 1)
    rows = rows[torch.randperm(num_rows, generator=gen)]
    rows[1::7] = -rows[0::7][: rows[1::7].shape[0]]
    rows[2::5, :3] = -0.0
    return rows.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("max_terms", [1, 2, 3, 8])
def test_ordered_sum_equals_the_row_by_row_fp32_sum(dtype, max_terms):
    gen = torch.Generator().manual_seed(max_terms)
    num_out, hidden = 40, 24
    terms = torch.randint(0, max_terms + 1, (num_out,), generator=gen)
    terms[0] = max_terms
    index = torch.repeat_interleave(torch.arange(num_out), terms)
    index = index[torch.randperm(index.numel(), generator=gen)]  # terms of an output spread over the rows
    dropped = torch.full((5,), num_out)  # rows left out
    index = torch.cat([index, dropped])[torch.randperm(index.numel() + 5, generator=gen)]
    rows = tricky_rows(index.numel(), hidden, dtype, gen)
    plan = plan_sum(index, num_out)
    assert plan.max_terms == max_terms and plan.low_rows is not None  # the dropped rows are left out
    assert (plan.slot_outputs is None) == (max_terms <= 2)  # the fp32 path only for 3 terms or more
    if plan.slot_outputs is not None:
        fp32_terms = torch.bincount(index, minlength=num_out + 1)[plan.slot_outputs]
        assert bool((fp32_terms >= 3).all()) and (fp32_terms == max_terms).any()
    got = ordered_sum(plan, rows)
    want = sum_by_index(rows, index, num_out)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))  # bits, signed zeros included
    scale = torch.rand(index.numel(), generator=gen) * 4 - 2
    scaled = ordered_sum(plan_sum(index, num_out, scaled=True), rows, scale)
    assert torch.equal(scaled.view(torch.uint8), sum_by_index(rows, index, num_out, scale).view(torch.uint8))


def test_ordered_sum_writes_out_and_zeroes_untouched_outputs():
    index = torch.tensor([2, 0, 2, 2])
    rows = torch.tensor([[1.0], [2.0], [3.0], [-0.0]], dtype=torch.bfloat16)
    out = torch.full((4, 1), 7.0, dtype=torch.bfloat16)
    assert ordered_sum(plan_sum(index, 4), rows, out=out) is out
    assert out.flatten().tolist() == [2.0, 0.0, 4.0, 0.0]
    assert not torch.signbit(ordered_sum(plan_sum(torch.tensor([0]), 1), -torch.zeros(1, 3))).any()  # -0 -> +0
    with pytest.raises(ValueError, match="scaled=True"):
        ordered_sum(plan_sum(index, 4), rows, torch.ones(4))
    with pytest.raises(ValueError, match="scaled=True"):
        ordered_sum(plan_sum(index, 4, scaled=True), rows)
    empty = ordered_sum(plan_sum(torch.zeros(0, dtype=torch.int64), 3), torch.zeros(0, 5))
    assert empty.shape == (3, 5) and not empty.any()


@pytest.mark.parametrize("max_terms", [2, 3, 8])
def test_plan_by_output_equals_plan_by_row(max_terms):
    """The plan from each output's list of rows (a permute's row map) sums like the plan from each
    row's output: the same bits, rows that no output lists left out."""
    gen = torch.Generator().manual_seed(10 + max_terms)
    num_out, num_rows, width = 30, 90, 16
    terms = torch.full((num_out, max_terms), -1, dtype=torch.int64)
    rows = torch.randperm(num_rows, generator=gen)
    used = 0
    for o in range(num_out):
        n = int(torch.randint(0, max_terms + 1, (1,), generator=gen)) if o else max_terms
        n = min(n, num_rows - used)
        terms[o, torch.randperm(max_terms, generator=gen)[:n]] = rows[used : used + n]  # any order, -1 between
        used += n
    index = torch.full((num_rows,), num_out, dtype=torch.int64)
    listed = terms >= 0
    index[terms[listed]] = torch.arange(num_out).unsqueeze(1).expand_as(terms)[listed]
    values = tricky_rows(num_rows, width, torch.bfloat16, gen)
    for scaled in (False, True):
        scale = torch.rand(num_rows, generator=gen) if scaled else None
        got = ordered_sum(plan_sum_by_output(terms, num_rows, scaled=scaled), values, scale)
        want = ordered_sum(plan_sum(index, num_out, scaled=scaled), values, scale)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        assert torch.equal(want.view(torch.uint8), sum_by_index(values, index, num_out, scale).view(torch.uint8))


@pytest.mark.skipif(not _ext.extension_status().built, reason="the one-pass CPU sum is in moe_dispatch._C")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_one_pass_cpu_sum_equals_the_reference(dtype):
    """moe_dispatch.ops.sums plans and adds every sum in one pass (csrc/kernels/sums_cpu.cpp): the
    same bits as the reference's torch path and the row-by-row definition, for plans by row and
    by output, with and without scales, for row-strided rows and for values at fp16's edges
    (overflow to inf, subnormals, ties)."""
    gen = torch.Generator().manual_seed(77)
    num_out, hidden = 50, 40
    for max_terms in (1, 2, 3, 8):
        terms = torch.randint(0, max_terms + 1, (num_out,), generator=gen)
        index = torch.repeat_interleave(torch.arange(num_out), terms)
        index = torch.cat([index, torch.full((4,), num_out)])  # rows left out
        index = index[torch.randperm(index.numel(), generator=gen)]
        values = tricky_rows(index.numel(), hidden, torch.float32, gen)
        values[::9, :4] = torch.tensor([6.0e4, 3.0e-8, 2.0**-25, -5.96e-8])  # fp16: overflow, subnormal, tie
        wide = torch.zeros(index.numel(), 2 * hidden, dtype=dtype)
        rows = wide[:, :hidden]  # row-strided
        rows.copy_(values.to(dtype))
        by_output = torch.full((num_out, max_terms), -1, dtype=torch.int64)
        for o in range(num_out):
            mine = torch.nonzero(index == o).flatten()
            by_output[o, : mine.numel()] = mine.flip(0)  # any order
        for scaled in (False, True):
            scale = torch.rand(index.numel(), generator=gen) * 4 - 2 if scaled else None
            want = sum_by_index(rows, index, num_out, scale)
            reference = ordered_sum(plan_sum(index, num_out, scaled=scaled), rows, scale)
            for plan in (
                one_pass.plan_sum(index, num_out, scaled=scaled),
                one_pass.plan_sum_by_output(by_output, index.numel(), scaled=scaled),
            ):
                one = isinstance(plan, one_pass.OnePassPlan)
                assert one, "every CPU plan is the one pass's"
                assert one_pass._run(plan, rows, scale, None) is not None, "the one pass must run"
                got = one_pass.ordered_sum(plan, rows, scale)
                assert torch.equal(got.view(torch.uint8), reference.view(torch.uint8)), (max_terms, scaled)
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (max_terms, scaled)
                if one:  # a call the one pass cannot serve (float64 rows) takes the reference's plan
                    wide64 = one_pass.ordered_sum(plan, rows.double(), scale)
                    assert torch.equal(
                        wide64, ordered_sum(plan_sum(index, num_out, scaled=scaled), rows.double(), scale)
                    )


@pytest.mark.skipif(not _ext.extension_status().built, reason="the one-pass CPU sums are in moe_dispatch._C")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_one_pass_of_at_most_two_terms_equals_zeros_and_index_add(dtype):
    """Where the reference adds in the rows' dtype (at most two terms an output: zeroed outputs,
    then index_add_), the one pass's fp32 sum rounded once gives the same bits: -0.0 made +0.0,
    outputs no row reaches +0.0, rows left out, row-strided rows, into `out`."""
    gen = torch.Generator().manual_seed(5)
    num_out, hidden = 60, 33
    terms = torch.randint(0, 3, (num_out,), generator=gen)
    index = torch.repeat_interleave(torch.arange(num_out), terms)
    index = torch.cat([index, torch.full((6,), num_out)])
    index = index[torch.randperm(index.numel(), generator=gen)]
    values = tricky_rows(index.numel(), hidden, torch.float32, gen)
    values[::9, :4] = torch.tensor([6.0e4, 3.0e-8, 2.0**-25, -5.96e-8])
    rows = torch.zeros(index.numel(), 2 * hidden, dtype=dtype)[:, :hidden]
    rows.copy_(values.to(dtype))
    kept = index < num_out
    want = torch.zeros(num_out, hidden, dtype=dtype).index_add_(0, index[kept], rows[kept])
    plan = one_pass.plan_sum(index, num_out)
    assert isinstance(plan, one_pass.OnePassPlan)
    out = torch.full((num_out, hidden), 7.0, dtype=dtype)
    assert one_pass.ordered_sum(plan, rows, out=out) is out
    assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("max_terms", [2, 5])
def test_grouped_sum_equals_the_two_levels(dtype, max_terms):
    """ops.sums.grouped_sum (a flat combine's node partials and their sum, in one pass on CPU)
    gives the bits of the two ordered sums one after the other, and of the definition: each
    group's fp32 sum rounded, then the groups' fp32 sum rounded; with and without scales."""
    gen = torch.Generator().manual_seed(20 + max_terms)
    num_out, hidden = 30, 20
    groups_per_out = torch.randint(0, 4, (num_out,), generator=gen)
    groups_per_out[0] = 3
    output_of_group = torch.repeat_interleave(torch.arange(num_out), groups_per_out)
    num_groups = output_of_group.numel()
    rows_per_group = torch.randint(1, max_terms + 1, (num_groups,), generator=gen)
    group_of_row = torch.repeat_interleave(torch.arange(num_groups), rows_per_group)
    group_of_row = torch.cat([group_of_row, torch.full((3,), num_groups)])  # rows left out
    group_of_row = group_of_row[torch.randperm(group_of_row.numel(), generator=gen)]
    rows = tricky_rows(group_of_row.numel(), hidden, dtype, gen)
    for scaled in (False, True):
        scale = torch.rand(rows.shape[0], generator=gen) * 4 - 2 if scaled else None
        partials = sum_by_index(rows, group_of_row, num_groups, scale)
        want = sum_by_index(partials, output_of_group, num_out)
        two = (plan_sum(group_of_row, num_groups, scaled=scaled), plan_sum(output_of_group, num_out))
        plan = one_pass.plan_grouped(group_of_row, output_of_group, num_out, scaled=scaled)
        assert isinstance(plan, one_pass.GroupedPlan) == _ext.extension_status().built
        for p in (plan, two):
            got = one_pass.grouped_sum(p, rows, scale)
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (scaled, type(p))
        with pytest.raises(ValueError, match="scaled=True"):
            one_pass.grouped_sum(plan, rows, None if scaled else torch.ones(rows.shape[0]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sums_read_rows_in_the_blocks_that_carried_them(dtype):
    """ops.sums.BlockedRows (a combine's rows left in the blocks of the exchange: a header, then
    each block's rows, the field after another and before padding, the last row ending at the
    block's end, empty blocks too) gives the bits of the same rows
    as a tensor, for ordered_sum and grouped_sum, with and without scales, in one pass and where
    the pass cannot run (the reference on the rows copied out)."""
    gen = torch.Generator().manual_seed(3)
    counts, hidden, num_out = [7, 0, 12, 5], 24, 12
    num_rows, size = sum(counts), dtype.itemsize
    # bytes: a header, then rows of an 8-byte field, this one, and 8 bytes of padding
    head, row_bytes = 40, 8 + hidden * size + 8
    offset = head + 8
    block_bytes = head + max(counts) * row_bytes
    rows = tricky_rows(num_rows, hidden, dtype, gen)
    blocks = torch.randint(0, 256, (len(counts), block_bytes), dtype=torch.uint8, generator=gen)
    r = 0
    for b, n in enumerate(counts):
        for i in range(n):
            at = offset + i * row_bytes
            blocks[b, at : at + hidden * size] = rows[r].view(torch.uint8)
            r += 1
    blocked = one_pass.BlockedRows(blocks, offset, row_bytes, counts, dtype, (hidden,))
    assert torch.equal(blocked.gathered(), rows)
    assert blocked.strides() == (row_bytes // size, block_bytes // size)
    index = torch.randint(0, num_out + 1, (num_rows,), generator=gen)  # num_out: left out
    output_of_group = torch.arange(num_out) // 3
    for scaled in (False, True):
        scale = torch.rand(num_rows, generator=gen) * 4 - 2 if scaled else None
        plans = [
            (one_pass.ordered_sum, one_pass.plan_sum(index, num_out, scaled=scaled)),
            (one_pass.grouped_sum, one_pass.plan_grouped(index, output_of_group, num_out // 3, scaled=scaled)),
        ]
        for run, plan in plans:
            want = run(plan, rows, scale)
            for enabled in (True, False):
                one_pass.enabled = enabled
                try:
                    got = run(plan, blocked, scale)
                finally:
                    one_pass.enabled = True
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (run.__name__, scaled, enabled)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_home_level_equals_the_row_by_row_sum(dtype):
    """The home's sum_by_index (one level, by slots) gives the bits of adding row by row."""
    gen = torch.Generator().manual_seed(41)
    num_out = 25
    index = torch.randint(0, num_out + 1, (120,), generator=gen)  # num_out: left out
    rows = tricky_rows(index.numel(), 12, dtype, gen)
    for scale in (None, torch.rand(index.numel(), generator=gen) * 4 - 2):
        got = sum_by_index(rows, index, num_out, scale)
        assert torch.equal(got.view(torch.uint8), row_by_row(rows, index, num_out, scale).view(torch.uint8))


def token_by_token(rows, is_token_in_rank, ranks_per_node, scales):
    """Combine's two levels for one token at a time: each node's holders in ascending local rank
    from +0.0 in fp32, rounded; the node partials in ascending node, rounded."""
    num_tokens, world_size = is_token_in_rank.shape
    dtype, next_row = rows[0].dtype, [0] * world_size
    out = torch.zeros(num_tokens, *rows[0].shape[1:], dtype=dtype)
    for t in range(num_tokens):
        acc = torch.zeros(rows[0].shape[1:], dtype=torch.float32)
        for first in range(0, world_size, ranks_per_node):
            partial, held = torch.zeros_like(acc), False
            for r in range(first, first + ranks_per_node):
                if is_token_in_rank[t, r]:
                    term = rows[r][next_row[r]].float()
                    partial += term if scales is None else term * scales[r][next_row[r]]
                    next_row[r], held = next_row[r] + 1, True
            if held:
                acc += partial.to(dtype).float()
        out[t] = acc.to(dtype)
    return out


def world_case(shape, num_tokens, hidden, dtype, weighted, seed):
    """A drawn world's combine inputs: per source rank, each rank's rows for the source's tokens it
    holds (token order) and their scales, and the source's ``is_token_in_rank [T, W]``; plus the
    oracle's arguments ``(ys, idxs, num_experts, weights)``."""
    world_size, ranks_per_node = shape
    gen = torch.Generator().manual_seed(seed)
    tokens = [num_tokens + (seed + r) % 3 for r in range(world_size)]
    idxs, _, num_experts = make_routing(world_size, tokens, seed=seed)
    in_rank = [get_dispatch_layout_reference(i, num_experts, world_size, ranks_per_node)[3] for i in idxs]
    counts = torch.stack([m.sum(0) for m in in_rank])  # [source, holder]
    ys = [tricky_rows(int(n), hidden, torch.float32, gen).to(dtype) for n in counts.sum(0)]
    weights = [torch.rand(y.shape[0], generator=gen) * 4 - 2 for y in ys] if weighted else None
    starts = torch.cumsum(counts, 0) - counts
    sources = []
    for s in range(world_size):
        held = [slice(int(starts[s, r]), int(starts[s, r] + counts[s, r])) for r in range(world_size)]
        scales = None if weights is None else [w[h] for w, h in zip(weights, held)]
        sources.append(([y[h] for y, h in zip(ys, held)], scales, in_rank[s]))
    return sources, (ys, idxs, num_experts, weights)


def torch_dist_combines(rows, scales, is_token_in_rank, topo):
    """The source's combine by the torch_dist transport's sums, flat route and two-stage: ``{route: [T, H]}``."""
    num_tokens, hidden, dtype = is_token_in_rank.shape[0], rows[0].shape[1], rows[0].dtype
    local_ranks, num_nodes = topo.ranks_per_node, topo.num_nodes
    in_node = is_token_in_rank.view(num_tokens, num_nodes, local_ranks).any(2)
    cat_scales = None if scales is None else torch.cat(scales)
    # Flat: every holder's rows come back to the source, rank after rank.
    flat = TorchDistPlan(num_tokens, 0, types.SimpleNamespace(in_node=in_node), flat=True)
    flat.flat_send_idx, flat.flat_send_splits = flat_send_idx(is_token_in_rank), [r.shape[0] for r in rows]
    got = {"flat": torch.full((num_tokens, hidden), 7.0, dtype=dtype)}
    torch_dist_sums.flat_sums(flat, torch.cat(rows), cat_scales, got["flat"], topo)
    # Two stages: node n's forwarder sums its ranks' rows (stage-2 order: local rank after local
    # rank) onto the node's tokens; the source sums the node partials (stage-1 order: node after node).
    partials, forwarded = [], []
    for n in range(num_nodes):
        node = range(n * local_ranks, (n + 1) * local_ranks)
        tokens = torch.nonzero(in_node[:, n]).flatten()
        onto = torch.cat([torch.searchsorted(tokens, torch.nonzero(is_token_in_rank[:, r]).flatten()) for r in node])
        chunk = TorchDistChunk(0, num_tokens, tokens, tokens, [], [tokens.numel()], [], [], s2_send_idx=onto)
        node_scales = None if scales is None else torch.cat([scales[r] for r in node])
        node_rows = torch.cat([rows[r] for r in node])
        partials += torch_dist_sums.forwarder_sums(
            TorchDistPlan(num_tokens, 0, None), n, chunk, [node_rows], [node_scales]
        )
        forwarded.append(tokens)
    chunk = TorchDistChunk(0, num_tokens, torch.cat(forwarded), torch.cat(forwarded), [], [], [], [])
    got["two-stage"] = torch.full((num_tokens, hidden), 7.0, dtype=dtype)
    torch_dist_sums.source_sums(TorchDistPlan(num_tokens, 0, None), chunk, [torch.cat(partials)], [got["two-stage"]])
    return got


SHAPES = [(w, n) for w in range(1, 7) for n in range(1, w + 1) if w % n == 0]  # (W, L)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    shape=st.sampled_from(SHAPES),
    num_tokens=st.integers(0, 24),
    hidden=st.integers(1, 20),
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    weighted=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_torch_dist_combine_sums_equal_the_home(shape, num_tokens, hidden, dtype, weighted, seed):
    """On drawn worlds, dtypes and weights: the home's combine_sum equals a token-by-token loop
    and moe_dispatch.reference.combine; the torch_dist transport's combine sums (the flat route's
    flat_sums, the two stages' forwarder_sums then source_sums), with the native CPU sums
    (csrc/kernels/sums_cpu.cpp, where built) and with the torch path, give its bits."""
    sources, (ys, idxs, num_experts, weights) = world_case(shape, num_tokens, hidden, dtype, weighted, seed)
    oracle = oracle_combine(ys, idxs, num_experts, shape[1], weights)
    for s, (rows, scales, is_token_in_rank) in enumerate(sources):
        home = combine_sum(rows, is_token_in_rank, shape[1], scales).view(torch.uint8)
        assert torch.equal(oracle[s].view(torch.uint8), home), s
        assert torch.equal(token_by_token(rows, is_token_in_rank, shape[1], scales).view(torch.uint8), home), s
        for native in (True, False):
            one_pass.enabled = native
            try:
                got = torch_dist_combines(rows, scales, is_token_in_rank, Topology(s, shape[0], shape[1]))
            finally:
                one_pass.enabled = True
            for route, out in got.items():
                assert torch.equal(out.view(torch.uint8), home), (s, route, native)
