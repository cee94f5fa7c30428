"""FP8 dispatch format: the Triton kernels (under the interpreter on CPU) against the torch
reference (bit-exact codes and scales), the e4m3 error bound, UE8M0 scales, NaN/Inf handling
and the errors for unsupported shapes."""

import pytest
import torch

from moe_dispatch.ops.quant import (
    check_fp8_pair,
    per_token_cast_back,
    per_token_cast_back_triton,
    per_token_cast_to_fp8,
    per_token_cast_to_fp8_triton,
)
from moe_dispatch.semantics.quant import per_token_cast_back_reference, per_token_cast_to_fp8_reference

pytestmark = pytest.mark.usefixtures("on_kernel_device")


def random_x(num_tokens, hidden, dtype, gen):
    """Rows of widely different magnitudes (1e-3 .. 1e3), as activations have."""
    mag = 10.0 ** (torch.rand(num_tokens, 1, generator=gen) * 6 - 3)
    return (torch.randn(num_tokens, hidden, generator=gen) * mag).to(dtype)


def codes(q):
    return q.view(torch.uint8)


def assert_quant_equal(a, b):
    assert a[0].dtype == b[0].dtype == torch.float8_e4m3fn and a[1].dtype == b[1].dtype == torch.float32
    assert a[0].shape == b[0].shape and a[1].shape == b[1].shape
    assert torch.equal(codes(a[0]), codes(b[0]))
    assert torch.equal(a[1], b[1])


@pytest.mark.parametrize("use_ue8m0", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    "num_tokens,hidden,launch",
    [
        (0, 128, None),
        (1, 128, None),
        (77, 1024, None),
        (37, 7168, None),
        (45, 512, (16, 3)),  # several programs; T and the block count not multiples of the launch shape
    ],
)
def test_triton_matches_reference(gen, dtype, use_ue8m0, num_tokens, hidden, launch):
    x = random_x(num_tokens, hidden, dtype, gen)
    kw = {} if launch is None else {"block_t": launch[0], "groups_per_program": launch[1]}
    got = per_token_cast_to_fp8_triton(x, 128, use_ue8m0, **kw)
    want = per_token_cast_to_fp8_reference(x, 128, use_ue8m0)
    assert_quant_equal(got, want)
    assert_quant_equal(per_token_cast_to_fp8(x, use_ue8m0=use_ue8m0), want)  # auto
    # dequantize: the fp32 product is exact-same; narrower outputs are one more rounding, which
    # the interpreter does toward zero (torch and the GPU: to nearest), so allow one ulp there
    assert torch.equal(
        per_token_cast_back_triton(*got, torch.float32, **kw), per_token_cast_back_reference(*want, torch.float32)
    )
    deq = per_token_cast_back(*got, dtype, backend="triton")
    assert deq.dtype == dtype
    tol = {torch.float32: 0.0, torch.bfloat16: 2**-7, torch.float16: 2**-10}[dtype]
    torch.testing.assert_close(deq, per_token_cast_back_reference(*want, dtype), rtol=tol, atol=0)


@pytest.mark.parametrize("use_ue8m0", [False, True])
def test_round_trip_error_bound(gen, use_ue8m0):
    x = random_x(64, 2048, torch.float32, gen)
    x[3, :128] = 0.0  # an all-zero block
    x[4, 128:256] *= 1e-3  # a block far below its row
    q, s = per_token_cast_to_fp8(x, use_ue8m0=use_ue8m0, backend="triton")
    back = per_token_cast_back(q, s, torch.float32, backend="triton")
    blocks = x.view(64, 16, 128)
    amax = blocks.abs().amax(-1, keepdim=True)
    err = (back.view(64, 16, 128) - blocks).abs()
    # the bound: within 2^-3 of the block max, per element
    assert (err <= 2**-3 * amax).all()
    # the e4m3 bound: half an ulp (2^-4 relative) for normals, half the subnormal step below
    assert (err <= 2**-4 * blocks.abs() + 2**-10 * s.unsqueeze(-1)).all()
    assert not back[3, :128].any()
    floor = amax.squeeze(-1).clamp(min=1e-4)
    exact = floor / torch.full_like(floor, 448.0)  # correctly rounded (a scalar divisor is not, on CUDA)
    if use_ue8m0:
        mantissa, _ = torch.frexp(s)
        assert (mantissa == 0.5).all()  # powers of two
        assert (s >= exact).all() and (s < 2 * exact).all()
    else:
        torch.testing.assert_close(s, exact, rtol=0, atol=0)


def test_every_e4m3_value_and_tie():
    """Scale 1 exactly (each block holds 448): every e4m3 value, every midpoint (ties to even)
    and the floats next to the midpoints convert like torch does."""
    vals = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    vals = vals[torch.isfinite(vals)].unique()
    mids = (vals[1:] + vals[:-1]) / 2
    cand = torch.cat(
        [
            vals,
            mids,
            torch.nextafter(mids, torch.tensor(1e9)),
            torch.nextafter(mids, torch.tensor(-1e9)),
            torch.tensor([-0.0, 2.0**-10, 3 * 2.0**-11, 2.0**-6 - 2.0**-12]),
        ]
    )
    n = cand.numel()
    per_block = 127
    blocks = -(-n // per_block)
    body = torch.zeros(blocks * per_block)
    body[:n] = cand
    x = torch.cat([torch.full((blocks, 1), 448.0), body.view(blocks, per_block)], dim=1)
    got = per_token_cast_to_fp8(x, backend="triton")
    assert (got[1] == 1.0).all()
    assert torch.equal(codes(got[0]), codes(x.to(torch.float8_e4m3fn)))
    assert_quant_equal(got, per_token_cast_to_fp8_reference(x))


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_nan_and_inf_become_nan_without_poisoning_the_block(gen, backend, dtype):
    x = random_x(8, 256, dtype, gen)
    x[0, 5] = float("nan")
    x[1, 7] = float("inf")
    x[2, 200] = -float("inf")
    q, s = per_token_cast_to_fp8(x, backend=backend)
    back = per_token_cast_back(q, s, torch.float32, backend=backend)
    bad = ~torch.isfinite(x)
    assert torch.isnan(back[bad]).all()  # carried as NaN, never clamped to +-448
    # the rest of each block is quantized as if the non-finite element were zero
    clean = torch.where(bad, torch.zeros_like(x), x)
    q2, s2 = per_token_cast_to_fp8(clean, backend=backend)
    assert torch.equal(s, s2)
    assert torch.equal(codes(q)[~bad], codes(q2)[~bad])
    assert_quant_equal((q, s), per_token_cast_to_fp8_reference(x))
    with pytest.raises(ValueError, match=r"non-finite value nan at \[0, 5\]"):
        per_token_cast_to_fp8(x, non_finite="raise", backend=backend)
    per_token_cast_to_fp8(clean, non_finite="raise", backend=backend)  # finite input passes


@pytest.mark.parametrize("hidden", [7, 2880, 200])
def test_hidden_not_multiple_of_128_rejected(hidden):
    x = torch.randn(4, hidden)
    with pytest.raises(ValueError, match=f"hidden size {hidden}, which is not a multiple of the fp8 block size 128"):
        per_token_cast_to_fp8(x, backend="triton")
    with pytest.raises(ValueError, match="not a multiple of the fp8 block size 128"):
        check_fp8_pair(torch.zeros(4, hidden, dtype=torch.float8_e4m3fn), torch.ones(4, 1))


def test_bad_arguments():
    x = torch.randn(4, 256)
    q, s = per_token_cast_to_fp8(x)
    check_fp8_pair(q, s, num_tokens=4)
    with pytest.raises(ValueError, match=r"scales must have shape \[4, 2\]"):
        check_fp8_pair(q, s[:, :1].contiguous())
    with pytest.raises(ValueError, match="x_fp8 has 4 rows but topk_idx has 5 tokens"):
        check_fp8_pair(q, s, num_tokens=5)
    with pytest.raises(TypeError, match="x_fp8 must have dtype"):
        check_fp8_pair(x, s)
    with pytest.raises(TypeError, match="scales must have dtype"):
        per_token_cast_back(q, s.half())
    with pytest.raises(ValueError, match="non_finite must be one of"):
        per_token_cast_to_fp8(x, non_finite="clamp")
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        per_token_cast_to_fp8(x, 100)
    with pytest.raises(TypeError, match="x must have dtype"):
        per_token_cast_to_fp8(x.double())
