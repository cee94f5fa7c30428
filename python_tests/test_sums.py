"""``ordered_sum``: the fp32 row sums in ascending row order that combine and unpermute share,
against a loop that adds row by row in fp32 (the order ``moe_dispatch.reference`` defines)."""

import pytest
import torch

from moe_dispatch import _ext
from moe_dispatch.ops import sums as one_pass
from moe_dispatch.semantics.sums import ordered_sum, plan_sum, plan_sum_by_output


def loop_sum(rows, index, num_out, scale=None):
    """Row by row from +0.0 in fp32, then one rounding: the definition."""
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
    want = loop_sum(rows, index, num_out)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))  # bits, signed zeros included
    scale = torch.rand(index.numel(), generator=gen) * 4 - 2
    scaled = ordered_sum(plan_sum(index, num_out, scaled=True), rows, scale)
    assert torch.equal(scaled.view(torch.uint8), loop_sum(rows, index, num_out, scale).view(torch.uint8))


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
        assert torch.equal(want.view(torch.uint8), loop_sum(values, index, num_out, scale).view(torch.uint8))


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
            want = loop_sum(rows, index, num_out, scale)
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
        partials = loop_sum(rows, group_of_row, num_groups, scale)
        want = loop_sum(partials, output_of_group, num_out)
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
