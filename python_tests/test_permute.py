"""Fused permute / unpermute: Triton (under the interpreter on CPU) against the torch reference,
the reference against first principles, the static budget, fixed expert blocks (drop-and-pad),
autograd and the fp8 pair.

Data movement and indices compare exactly (bitwise); unpermute is a reduction and compares
with a tolerance (see ``assert_sum_close``).
"""

import pytest
import torch

from moe_dispatch import BudgetOverflowError, _ext
from moe_dispatch.ops.permute import (
    PermuteOverflowError,
    check_permute_overflow,
    make_permute_handle,
    permute,
    permute_map_cpu,
    permute_map_triton,
    permute_rows_triton,
    unpermute,
    unpermute_rows_triton,
)
from moe_dispatch.semantics.permute import (
    PermuteHandle,
    PermuteLayout,
    permute_map_reference,
    permute_rows_reference,
    permuted_sources,
    unpermute_rows_reference,
)

from .conftest import KERNEL_DEVICE as DEVICE

HANDLE_TENSORS = (
    "row_id_map",
    "tokens_per_expert",
    "num_tokens_per_expert",
    "expert_offsets",
    "num_rows_needed",
    "overflow",
)


pytestmark = pytest.mark.usefixtures("on_kernel_device")


def random_local_topk(num_tokens, num_topk, num_experts, gen, drop=0.3):
    """Distinct local experts per row, some slots -1 (a received token's local view)."""
    scores = torch.rand(num_tokens, max(num_experts, num_topk), generator=gen)
    idx = scores.topk(num_topk, dim=1).indices
    idx = torch.where(idx >= num_experts, -1, idx)
    return torch.where(torch.rand(num_tokens, num_topk, generator=gen) < drop, -1, idx).contiguous()


def bits(t):
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_bits_equal(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    assert torch.equal(bits(a), bits(b))


def assert_handles_equal(a: PermuteHandle, b: PermuteHandle):
    for f in HANDLE_TENSORS:
        x, y = getattr(a, f), getattr(b, f)
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), (f, x, y)
    assert (a.num_tokens, a.num_rows) == (b.num_tokens, b.num_rows)


def assert_sum_close(got, want):
    """Unpermute sums copies in fp32 in the same order as the reference, so fp32 results agree
    exactly under the interpreter; but the GPU may fuse multiply-add into an FMA (last-bit
    differences), and the interpreter rounds fp32 -> bf16 toward zero where torch (and the GPU)
    round to nearest: allow one unit in the last place of the output dtype."""
    tol = {torch.float32: 2**-22, torch.bfloat16: 2**-7, torch.float16: 2**-10}[got.dtype]
    torch.testing.assert_close(got, want, rtol=tol, atol=tol, equal_nan=True)


def naive_permute(x, idx, probs, num_experts, pad, capacity=None):
    """First-principles layout with Python loops (small inputs only); ``capacity``: every
    expert block has exactly that many rows, an expert's later copies left out."""
    rows, row_probs, tokens_per_expert, row_of = [], [], [], {}
    for e in range(num_experts):
        start = len(rows)
        for r in range(idx.shape[0]):
            for k in range(idx.shape[1]):
                if int(idx[r, k]) == e and (capacity is None or len(rows) - start < capacity):
                    row_of[(r, k)] = len(rows)
                    rows.append(x[r])
                    row_probs.append(float(probs[r, k]))
        while (len(rows) - start) % pad or (capacity is not None and len(rows) - start < capacity):
            rows.append(torch.zeros_like(x[0]))
            row_probs.append(0.0)
        tokens_per_expert.append(len(rows) - start)
    return rows, row_probs, tokens_per_expert, row_of


@pytest.mark.parametrize("pad", [1, 16, 64, 128, 256])
def test_reference_from_first_principles(gen, pad):
    num_tokens, num_topk, num_experts, hidden = 23, 3, 4, 5
    idx = random_local_topk(num_tokens, num_topk, num_experts, gen)
    x = torch.randn(num_tokens, hidden, generator=gen)
    probs = torch.rand(num_tokens, num_topk, generator=gen)
    rows, row_probs, tpe, row_of = naive_permute(x, idx, probs, num_experts, pad)
    res = permute(x, idx, probs, num_local_experts=num_experts, pad_multiple=pad, backend="torch")
    assert torch.equal(res.permuted_x, torch.stack(rows))
    assert res.permuted_probs.tolist() == pytest.approx(row_probs, abs=0)
    assert res.tokens_per_expert.tolist() == tpe
    for r in range(num_tokens):
        for k in range(num_topk):
            assert int(res.handle.row_id_map[r, k]) == row_of.get((r, k), -1)


CASES = [
    (r, p, d)
    for r in (7, 2880, 7168)
    for p in (1, 16, 64, 128, 256)
    for d in (torch.bfloat16, torch.float16, torch.float32)
]


@pytest.mark.parametrize("hidden,pad,dtype", CASES, ids=[f"H{h}-pad{p}-{str(d)[6:]}" for h, p, d in CASES])
def test_triton_matches_reference(gen, hidden, pad, dtype):
    big = hidden > 1000  # keep the interpreted tiles small: few rows, few padded expert blocks
    num_tokens = int(torch.randint(1, 16 if big else 200, (1,), generator=gen))
    num_topk, num_experts = (2, 3) if big else (4, 6)
    idx = random_local_topk(num_tokens, num_topk, num_experts, gen)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    probs = torch.rand(num_tokens, num_topk, generator=gen)
    got = permute(x, idx, probs, num_local_experts=num_experts, pad_multiple=pad, backend="triton")
    want = permute(x, idx, probs, num_local_experts=num_experts, pad_multiple=pad, backend="torch")
    assert_handles_equal(got.handle, want.handle)
    assert_bits_equal(got.permuted_x, want.permuted_x)
    assert_bits_equal(got.permuted_probs, want.permuted_probs)
    assert (got.tokens_per_expert % pad == 0).all()
    for w in (None, got.permuted_probs):
        out = unpermute(got.permuted_x, got.handle, w, backend="triton")
        assert out.dtype == dtype
        assert_sum_close(out, unpermute(want.permuted_x, want.handle, w, backend="torch"))
    # permute then weighted unpermute scales each token by the sum of its probs
    s = torch.where(idx >= 0, probs, 0.0).sum(1, keepdim=True)
    torch.testing.assert_close(out.float(), x.float() * s, rtol=2**-7, atol=1e-5)


@pytest.mark.skipif(DEVICE == "cuda", reason="the GPU may contract multiply-add into FMA")
def test_fp32_unpermute_exact_under_interpreter(gen):
    idx = random_local_topk(150, 8, 8, gen)
    h = make_permute_handle(idx, 8, pad_multiple=16, backend="triton")
    y = torch.randn(h.num_rows, 96, generator=gen)
    w = torch.rand(h.num_rows, generator=gen)
    for weights in (None, w):
        assert torch.equal(unpermute_rows_triton(y, h, weights), unpermute_rows_reference(y, h, weights))


@pytest.mark.parametrize("budget", [None, 0, 64])
def test_empty_input(budget):
    idx = torch.zeros(0, 4, dtype=torch.int64)
    x = torch.zeros(0, 32, dtype=torch.bfloat16)
    for backend in ("triton", "torch"):
        res = permute(
            x, idx, torch.zeros(0, 4), num_local_experts=3, pad_multiple=16, num_permuted_tokens=budget, backend=backend
        )
        assert res.permuted_x.shape == (budget or 0, 32) and not res.permuted_x.float().any()
        assert res.permuted_probs.shape == (budget or 0,) and not res.permuted_probs.any()
        assert res.tokens_per_expert.tolist() == [0, 0, 0] and not bool(res.handle.overflow)
        assert unpermute(res.permuted_x, res.handle, backend=backend).shape == (0, 32)


def test_blocks_not_dividing_tokens(gen):
    """Several index blocks and data blocks, none of the sizes a multiple of a block."""
    idx = random_local_topk(203, 5, 7, gen)
    x = torch.randn(203, 45, generator=gen)
    probs = torch.rand(203, 5, generator=gen)
    want = permute_map_reference(idx, PermuteLayout(7, 16))
    got = permute_map_triton(idx, PermuteLayout(7, 16), block_r=16)
    assert_handles_equal(got, want)
    out, pp = permute_rows_triton(x, got, probs, block_r=16, block_h=16, block_z=32)
    ref_out, ref_pp = permute_rows_reference(x, want, probs)
    assert_bits_equal(out, ref_out)
    assert_bits_equal(pp, ref_pp)
    assert_sum_close(
        unpermute_rows_triton(out, got, pp, block_r=64, block_h=32), unpermute_rows_reference(out, want, pp)
    )


def test_all_minus_one_rows(gen):
    idx = random_local_topk(64, 4, 4, gen)
    idx[::2] = -1
    x = torch.randn(64, 16, generator=gen)
    got = permute(x, idx, None, num_local_experts=4, pad_multiple=16, backend="triton")
    want = permute(x, idx, None, num_local_experts=4, pad_multiple=16, backend="torch")
    assert_handles_equal(got.handle, want.handle)
    assert_bits_equal(got.permuted_x, want.permuted_x)
    assert got.permuted_probs is None
    out = unpermute(got.permuted_x, got.handle, backend="triton")
    assert not out[::2].any()  # tokens with no copy come back as zeros
    all_none = torch.full((10, 4), -1, dtype=torch.int64)
    res = permute(torch.randn(10, 16), all_none, None, num_local_experts=4, pad_multiple=16, backend="triton")
    assert res.permuted_x.shape == (0, 16) and res.tokens_per_expert.tolist() == [0, 0, 0, 0]


def test_duplicates_rejected():
    idx = torch.tensor([[0, 1], [2, 2]])
    with pytest.raises(ValueError, match=r"row 1 selects an expert more than once"):
        permute(torch.randn(2, 8), idx, num_local_experts=3, backend="triton")
    with pytest.raises(ValueError, match=r"row 1 selects an expert more than once"):
        permute(torch.randn(2, 8), idx, num_local_experts=3, num_permuted_tokens=8, validate=True, backend="triton")


def test_bad_arguments(gen):
    idx = random_local_topk(8, 2, 4, gen)
    with pytest.raises(ValueError, match=r"entries must be in \[-1, 3\)"):
        permute(torch.randn(8, 4), torch.full((8, 2), 3), num_local_experts=3)
    with pytest.raises(ValueError, match="x has 7 rows but topk_idx has 8 tokens"):
        permute(torch.randn(7, 4), idx, num_local_experts=4)
    with pytest.raises(ValueError, match="pad_multiple must be a positive int"):
        permute(torch.randn(8, 4), idx, num_local_experts=4, pad_multiple=0)
    with pytest.raises(ValueError, match="probs has shape"):
        permute(torch.randn(8, 4), idx, torch.rand(8, 3), num_local_experts=4)
    with pytest.raises(TypeError, match="x must have dtype"):
        permute(torch.randn(8, 4).double(), idx, num_local_experts=4)
    res = permute(torch.randn(8, 4), idx, num_local_experts=4)
    with pytest.raises(ValueError, match="permuted_x has 3 rows but the handle's permute produced"):
        unpermute(torch.randn(3, 4), res.handle)


def test_permute_overflow_is_the_one_budget_error():
    """The permute budget raises the error every budget path raises, under its old name too."""
    assert PermuteOverflowError is BudgetOverflowError and issubclass(BudgetOverflowError, RuntimeError)


@pytest.mark.parametrize("pad", [1, 16])
def test_budget_overflow_flag(gen, pad):
    idx = random_local_topk(300, 6, 5, gen)
    x = torch.randn(300, 24, generator=gen)
    probs = torch.rand(300, 6, generator=gen)
    full = permute(x, idx, probs, num_local_experts=5, pad_multiple=pad, backend="torch")
    needed = full.handle.num_rows
    for budget in (0, 1, needed - 1, needed, needed + 37):
        for backend in ("triton", "torch"):
            res = permute(
                x, idx, probs, num_local_experts=5, pad_multiple=pad, num_permuted_tokens=budget, backend=backend
            )
            h = res.handle
            assert res.permuted_x.shape == (budget, 24)
            assert bool(h.overflow) == (needed > budget)  # set exactly when the budget is exceeded
            assert int(h.num_rows_needed) == needed
            n = min(budget, needed)
            assert_bits_equal(res.permuted_x[:n], full.permuted_x[:n])  # same layout, cut at the budget
            assert not res.permuted_x[n:].any() and not res.permuted_probs[n:].any()
            assert int(h.tokens_per_expert.sum()) == n  # grouped-GEMM splits stay inside the output
            assert torch.equal(h.row_id_map, torch.where(full.handle.row_id_map < budget, full.handle.row_id_map, -1))
            if needed > budget:
                with pytest.raises(BudgetOverflowError, match=f"needed {needed} rows .* num_permuted_tokens={budget}"):
                    check_permute_overflow(h)
                assert check_permute_overflow(h, allow_drop=True)
            else:
                assert not check_permute_overflow(h)
    assert not check_permute_overflow(full.handle)


@pytest.mark.parametrize("pad", [1, 4])
def test_fixed_expert_blocks(gen, pad):
    """expert_capacity (Megatron's drop-and-pad layout): exactly C rows per expert whatever the
    counts, the first C copies of an expert kept, overflow flagged exactly when one has more."""
    num_tokens, num_topk, num_experts, hidden = 40, 3, 4, 12
    idx = random_local_topk(num_tokens, num_topk, num_experts, gen)
    x = torch.randn(num_tokens, hidden, generator=gen)
    probs = torch.rand(num_tokens, num_topk, generator=gen)
    counts = torch.bincount(idx[idx >= 0], minlength=num_experts)
    for capacity in (0, pad, int(counts.max()) // pad * pad, -(-int(counts.max()) // pad) * pad + pad):
        rows, row_probs, tpe, row_of = naive_permute(x, idx, probs, num_experts, pad, capacity)
        results = [
            permute(
                x,
                idx,
                probs,
                num_local_experts=num_experts,
                pad_multiple=pad,
                expert_capacity=capacity,
                backend=backend,
            )
            for backend in ("torch", "triton")
        ]
        assert_handles_equal(results[1].handle, results[0].handle)
        for res in results:
            assert res.permuted_x.shape == (num_experts * capacity, hidden)
            assert res.tokens_per_expert.tolist() == tpe == [capacity] * num_experts
            if rows:
                assert_bits_equal(res.permuted_x, torch.stack(rows))
            assert res.permuted_probs.tolist() == pytest.approx(row_probs, abs=0)
            assert bool(res.handle.overflow) == bool((counts > capacity).any())
            assert int(res.handle.num_rows_needed) == int(
                torch.maximum(torch.full_like(counts, capacity), (counts + pad - 1) // pad * pad).sum()
            )
            got = {(r, k): int(res.handle.row_id_map[r, k]) for r in range(num_tokens) for k in range(num_topk)}
            assert got == {(r, k): row_of.get((r, k), -1) for r in range(num_tokens) for k in range(num_topk)}
        if bool(results[0].handle.overflow):
            with pytest.raises(
                PermuteOverflowError,
                match=rf"got {int(counts.max())} copies for one expert .* "
                rf"expert_capacity={capacity}",
            ):
                check_permute_overflow(results[0].handle)
        else:
            assert not check_permute_overflow(results[0].handle)
    for backend in ("torch", "triton"):  # no tokens: still C zero rows per expert
        res = permute(
            x[:0],
            idx[:0],
            probs[:0],
            num_local_experts=num_experts,
            pad_multiple=pad,
            expert_capacity=2 * pad,
            backend=backend,
        )
        assert res.permuted_x.shape == (num_experts * 2 * pad, hidden) and not res.permuted_x.any()
        assert res.tokens_per_expert.tolist() == [2 * pad] * num_experts
        assert res.handle.expert_offsets.tolist() == [2 * pad * e for e in range(num_experts)]
    if pad > 1:
        with pytest.raises(ValueError, match=rf"expert_capacity must be .* a multiple of pad_multiple={pad}"):
            permute(x, idx, num_local_experts=num_experts, pad_multiple=pad, expert_capacity=pad + 1)
    with pytest.raises(ValueError, match=r"pass it or num_permuted_tokens \(8\), not both"):
        permute(x, idx, num_local_experts=num_experts, expert_capacity=pad, num_permuted_tokens=8)


def _dense_maps(handle):
    """M [R, P] with M[r, p] = 1 when row p holds a copy of token r."""
    m = torch.zeros(handle.num_tokens, handle.num_rows)
    r, k = (handle.row_id_map >= 0).nonzero(as_tuple=True)
    m[r, handle.row_id_map[r, k].long()] = 1.0
    return m


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_autograd(gen, backend):
    num_tokens, num_topk, num_experts, hidden = 40, 3, 4, 12
    idx = random_local_topk(num_tokens, num_topk, num_experts, gen)
    x = torch.randn(num_tokens, hidden, generator=gen, requires_grad=True)
    probs = torch.rand(num_tokens, num_topk, generator=gen, requires_grad=True)
    res = permute(x, idx, probs, num_local_experts=num_experts, pad_multiple=16, backend=backend)
    w_out = torch.randn(res.handle.num_rows, hidden, generator=gen)
    w_pp = torch.randn(res.handle.num_rows, generator=gen)
    ((res.permuted_x * w_out).sum() + (res.permuted_probs * w_pp).sum()).backward()
    m = _dense_maps(res.handle)
    # permute's backward is the unweighted unpermute: each token sums its rows' gradients
    torch.testing.assert_close(x.grad, m @ w_out, rtol=1e-6, atol=1e-6)
    want_gp = torch.where(res.handle.row_id_map >= 0, w_pp[res.handle.row_id_map.clamp(min=0).long()], 0.0)
    assert torch.equal(probs.grad, want_gp)

    # unpermute (weighted): out = M (w * y); its backward is the (weighted) permute
    y = torch.randn(res.handle.num_rows, hidden, generator=gen, requires_grad=True)
    w = torch.rand(res.handle.num_rows, generator=gen, requires_grad=True)
    g = torch.randn(num_tokens, hidden, generator=gen)
    out = unpermute(y, res.handle, w, backend=backend)
    (out * g).sum().backward()
    y2, w2 = y.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ((m @ (w2.unsqueeze(1) * y2)) * g).sum().backward()
    torch.testing.assert_close(out, m @ (w.detach().unsqueeze(1) * y.detach()), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(y.grad, y2.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-5, atol=1e-5)  # a dot product over H: reduction

    # unweighted unpermute's backward is the plain permute (padding rows get zero gradient)
    y3 = torch.randn(res.handle.num_rows, hidden, generator=gen, requires_grad=True)
    unpermute(y3, res.handle, backend=backend).backward(g)
    assert torch.equal(y3.grad, m.t() @ g)


def test_nan_and_inf_move_unchanged(gen):
    idx = random_local_topk(32, 2, 3, gen)
    x = torch.randn(32, 8, generator=gen, dtype=torch.bfloat16)
    x[0, 0], x[1, 1], x[2, 2], x[3, 3] = float("nan"), float("inf"), -float("inf"), -0.0
    got = permute(x, idx, num_local_experts=3, pad_multiple=16, backend="triton")
    want = permute(x, idx, num_local_experts=3, pad_multiple=16, backend="torch")
    assert_bits_equal(got.permuted_x, want.permuted_x)  # bit-exact: NaN payloads, -0.0, Inf
    back = unpermute(got.permuted_x, got.handle, backend="triton")
    assert_sum_close(back, unpermute(want.permuted_x, want.handle, backend="torch"))
    for r, c in ((0, 0), (1, 1), (2, 2)):
        if (idx[r] >= 0).any():
            assert not torch.isfinite(back[r, c])


def test_fp8_pair_moves_together(gen):
    idx = random_local_topk(50, 4, 4, gen)
    q = (torch.randn(50, 256, generator=gen) * 50).to(torch.float8_e4m3fn)
    s = torch.rand(50, 2, generator=gen) + 0.5
    got = permute((q, s), idx, num_local_experts=4, pad_multiple=64, backend="triton")
    want = permute((q, s), idx, num_local_experts=4, pad_multiple=64, backend="torch")
    assert isinstance(got.permuted_x, tuple)
    assert_bits_equal(got.permuted_x[0], want.permuted_x[0])
    assert_bits_equal(got.permuted_x[1], want.permuted_x[1])
    dense = permute(q.float(), idx, num_local_experts=4, pad_multiple=64, backend="torch").permuted_x
    assert torch.equal(got.permuted_x[0].float(), dense)


# -- GPU code generation without a GPU -------------------------------------------------------

_AOT_SCRIPT = r"""
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moe_dispatch.ops import layout as L, permute as P, quant as Q

def build(kernel, types, constexprs, num_warps):
    names = kernel.arg_names
    sig = {n: ("constexpr" if n in constexprs else types[n]) for n in names}
    cx = {(names.index(k),): v for k, v in constexprs.items()}
    triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=cx), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": num_warps})

i = "i32"
cases = [
    (L._layout_count_kernel, dict(topk_idx_ptr="*i64", is_token_in_rank_ptr="*u8", rank_send_offsets_ptr="*i32",
        node_send_offsets_ptr="*i32", block_rank_counts_ptr="*i32", block_node_counts_ptr="*i32",
        block_expert_counts_ptr="*i32", num_tokens=i, num_experts=i, num_ranks=i, num_nodes=i, experts_per_rank=i,
        experts_per_node=i), dict(NUM_TOPK=8, BLOCK_T=128, RANKS_PAD=32, NODES_PAD=4, EXPERTS_PAD=256), 8),
    (L._layout_finalize_kernel, dict(rank_send_offsets_ptr="*i32", node_send_offsets_ptr="*i32",
        block_rank_counts_ptr="*i32", block_node_counts_ptr="*i32", block_expert_counts_ptr="*i32",
        num_tokens_per_rank_ptr="*i64", num_tokens_per_node_ptr="*i64", num_tokens_per_expert_ptr="*i64",
        num_tokens=i, num_blocks=i, num_experts=i, num_ranks=i, num_nodes=i),
        dict(BLOCK_T=128, RANKS_PAD=32, NODES_PAD=4, EXPERTS_PAD=256, CHUNK_B=16), 8),
    (P._permute_count_kernel, dict(topk_idx_ptr="*i64", row_id_map_ptr="*i32", block_counts_ptr="*i32",
        num_tokens=i, num_experts=i), dict(NUM_TOPK=8, BLOCK_R=512, EXPERTS_PAD=8), 8),
    (P._permute_finalize_kernel, dict(topk_idx_ptr="*i64", row_id_map_ptr="*i32", block_counts_ptr="*i32",
        tokens_per_expert_ptr="*i64", num_tokens_per_expert_ptr="*i64", expert_offsets_ptr="*i32",
        num_rows_needed_ptr="*i64", overflow_ptr="*u8", num_tokens=i, num_blocks=i, num_rows=i, num_experts=i,
        pad_multiple=i, expert_capacity=i), dict(NUM_TOPK=8, BLOCK_R=512, EXPERTS_PAD=8, CHUNK_B=8), 8),
    (P._permute_scatter_kernel, dict(x_ptr="*i16", row_id_map_ptr="*i32", probs_ptr="*fp32", out_ptr="*i16",
        permuted_probs_ptr="*fp32", expert_offsets_ptr="*i32", num_tokens_per_expert_ptr="*i64",
        tokens_per_expert_ptr="*i64", num_tokens=i, hidden=i, num_rows=i, num_token_blocks=i, num_experts=i),
        dict(NUM_TOPK=8, EXPERTS_PAD=8, BLOCK_R=8, BLOCK_H=1024, BLOCK_Z=64, HAS_PROBS=True), 4),
    (P._unpermute_gather_kernel, dict(y_ptr="*bf16", row_id_map_ptr="*i32", row_weights_ptr="*fp32",
        out_ptr="*bf16", num_tokens=i, hidden=i),
        dict(NUM_TOPK=8, TOPK_PAD=8, BLOCK_R=4, BLOCK_H=1024, HAS_WEIGHTS=True), 4),
    (Q._per_token_cast_kernel, dict(src_ptr="*bf16", scales_ptr="*fp32", dst_ptr="*u8", num_tokens=i,
        hidden=i, num_groups=i), dict(BLOCK_T=16, BLOCK_SIZE=128, GROUPS_PER_PROGRAM=8, TO_FP8=True,
        USE_UE8M0=True), 4),
    (Q._per_token_cast_kernel, dict(src_ptr="*u8", scales_ptr="*fp32", dst_ptr="*bf16", num_tokens=i,
        hidden=i, num_groups=i), dict(BLOCK_T=16, BLOCK_SIZE=128, GROUPS_PER_PROGRAM=8, TO_FP8=False,
        USE_UE8M0=False), 4),
]
for kernel, types, constexprs, num_warps in cases:
    build(kernel, types, constexprs, num_warps)
print("compiled", len(cases))
"""


@pytest.mark.skipif(DEVICE == "cuda", reason="the GPU runs the kernels for real")
def test_kernels_compile_for_sm90():
    """Every Triton kernel of layout/permute/quant lowers to sm_90 machine code (Triton's own
    ptxas, no GPU needed): catches GPU-only lowering errors the interpreter cannot see."""
    import os
    import subprocess
    import sys

    try:
        from triton.backends.nvidia import compiler  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"triton's NVIDIA backend is unavailable: {exc!r}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", _AOT_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "compiled 8" in proc.stdout


@pytest.mark.skipif(not _ext.extension_status().built, reason="the CPU index phase is in moe_dispatch._C")
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_cpu_index_phase_equals_the_reference(gen, index_dtype):
    """ops.permute.permute_map_cpu (csrc/kernels/permute_cpu.cpp) makes the reference's handle and
    its permuted_sources: padding, a budget that cuts and one that does not, fixed blocks, ids
    outside [0, E) counted as none, a repeated expert sharing its first slot's row, no tokens."""
    cases = [(97, 4, 6, pad, None, None) for pad in (1, 16)]
    cases += [(97, 4, 6, 1, budget, None) for budget in (50, 1000)]
    cases += [(97, 4, 6, 8, None, cap) for cap in (8, 64)]
    cases += [(0, 4, 6, 1, None, None), (40, 1, 3, 1, None, None)]
    for num_tokens, num_topk, e, pad, budget, capacity in cases:
        idx = random_local_topk(num_tokens, num_topk, e, gen).to(index_dtype)
        if num_tokens:
            idx[0, 0] = e + 3  # outside the local experts: none
            idx[1, :2] = idx[1, 0].clamp(min=0)  # a repeated expert
        want = permute_map_reference(idx, PermuteLayout(e, pad, budget, capacity))
        got = permute_map_cpu(idx, PermuteLayout(e, pad, budget, capacity))
        assert_handles_equal(got, want)
        for g, w in zip(got.sources, permuted_sources(want)):
            assert torch.equal(g[w >= 0], w[w >= 0]) and torch.equal(g < 0, w < 0)
