"""Property tests: dispatch and combine against the oracle over drawn worlds, shapes, dtypes and
modes (hypothesis).

Drawn: world shapes W <= 6 with any ranks per node L dividing W; T in [0, 512] per rank (fewer
for wide rows: T * H <= ROW_BUDGET, so H in [1, 8192] stays cheap); K, E = W * (experts per
rank); x dtypes fp32/bf16/fp16 and the fp8 pair; int32/int64 ids; -1 entries from none to all;
one mode per test (sync, async, hook, num_worst_tokens, cached, weighted, backward).

One live 6-rank gloo world serves every example (``LiveWorld``): hypothesis draws in this
process and each example runs on every rank, with a Buffer per world shape made on first use
(ranks [0, W) of the world, kept while among the last BUFFERS_KEPT shapes used). Each rank
rebuilds every rank's inputs from the example's seed and checks its own results against the
oracle bit for bit. A fixed seed per mode (from its name), a fixed ``max_examples`` and no
deadline: the same examples on every run, bounded time.
"""

from __future__ import annotations

import collections
import math
import zlib

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from moe_dispatch import Buffer
from moe_dispatch.ops.quant import per_token_cast_to_fp8
from moe_dispatch.semantics import reference

from .test_dispatch import expert
from .worlds import LiveWorld

pytestmark = pytest.mark.world

WORLD_SIZE = 6
SHAPES = [(w, n) for w in range(1, WORLD_SIZE + 1) for n in range(1, w + 1) if w % n == 0]
ROW_BUDGET = 1 << 16  # T * H per rank: 512 tokens of 128, or 8 tokens of 8192
BUFFERS_KEPT = 4
MODES = ("sync", "async", "hook", "num_worst_tokens", "cached", "weighted", "backward")
EXAMPLES_PER_MODE = 64
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FP8_MODES = ("sync", "num_worst_tokens", "cached")  # fp8 is a dispatch-only, forward-only format


class _Buffers:
    """A rank's Buffers by world shape, made and closed as every rank of the live world sees
    the same examples in the same order (so the collective steps line up)."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        # Every rank creates every sub-group first, while c10d's group count (which names
        # groups) is still the same on every rank: the Buffers' own groups advance it on their
        # members only.
        self.groups = {w: dist.new_group(list(range(w))) if w < world_size else None for w in range(1, world_size + 1)}
        self.used: collections.OrderedDict[tuple[int, int], Buffer | None] = collections.OrderedDict()

    def get(self, shape: tuple[int, int]) -> Buffer | None:
        """The Buffer of ``shape`` (W, L) on ranks [0, W), None on the other ranks."""
        world, local = shape
        if shape in self.used:
            self.used.move_to_end(shape)
            return self.used[shape]
        if len(self.used) == BUFFERS_KEPT:
            _, old = self.used.popitem(last=False)
            if old is not None:
                old.close()
        member = self.rank < world
        self.used[shape] = Buffer(self.groups[world], ranks_per_node=local, timeout_s=120) if member else None
        return self.used[shape]

    def close(self) -> None:
        for buf in self.used.values():
            if buf is not None:
                buf.close()


def _setup(rank: int, world_size: int) -> _Buffers:
    return _Buffers(rank, world_size)


def _inputs(case: dict, seed_offset: int = 0):
    """Every rank's ``(x, topk_idx, topk_weights)`` from the case's seed."""
    gen = torch.Generator().manual_seed(case["seed"] + seed_offset)
    num_experts, topk, hidden = case["num_experts"], case["topk"], case["hidden"]
    index_dtype = getattr(torch, case["index_dtype"])
    xs, idxs, ws = [], [], []
    for t in case["tokens"]:
        idx = torch.rand(t, num_experts, generator=gen).argsort(1)[:, :topk]  # distinct experts per row
        idx[torch.rand(t, topk, generator=gen) < case["drop"]] = -1
        idxs.append(idx.to(index_dtype).contiguous())
        ws.append(torch.rand(t, topk, generator=gen))
        x = torch.randn(t, hidden, generator=gen)
        xs.append(per_token_cast_to_fp8(x.bfloat16()) if case["dtype"] == "fp8" else x.to(DTYPES[case["dtype"]]))
    return xs, idxs, ws


def _oracle(case, xs, idxs, ws):
    """Every rank's oracle dispatch (for fp8, of the bits and of the scales)."""
    num_experts, local = case["num_experts"], case["world"][1]
    if case["dtype"] != "fp8":
        return reference.dispatch(xs, idxs, ws, num_experts, local)
    bits = reference.dispatch([x.view(torch.uint8) for x, _ in xs], idxs, ws, num_experts, local)
    scales = reference.dispatch([s for _, s in xs], idxs, None, num_experts, local)
    return [(b, s) for b, s in zip(bits, scales)]


def _check_dispatch(case, rank, got, ref, rows=None):
    """``got = (recv_x, recv_topk_idx, recv_topk_weights, per_expert)`` against the oracle's
    ``ref``; with ``rows`` (num_worst_tokens) the first ``rows`` rows, the rest padding."""
    recv_x, recv_idx, recv_w, per_expert = got
    if case["dtype"] == "fp8":
        ref, ref_scales = ref
        recv_x, recv_scales = recv_x
        n = ref.recv_x.shape[0]
        assert torch.equal(recv_scales[:n], ref_scales.recv_x) and not recv_scales[n:].any(), "fp8 scales"
        recv_x = recv_x.view(torch.uint8)
    n = ref.recv_x.shape[0]
    assert torch.equal(recv_x[:n], ref.recv_x), "recv_x"
    assert recv_idx.dtype == getattr(torch, case["index_dtype"]) and torch.equal(recv_idx[:n], ref.recv_topk_idx)
    assert torch.equal(recv_w[:n], ref.recv_topk_weights), "recv_topk_weights"
    assert torch.equal(per_expert, ref.num_recv_tokens_per_expert), "num_recv_tokens_per_expert"
    if rows is not None:
        assert recv_x.shape[0] == rows and not recv_x[n:].any() and bool((recv_idx[n:] == -1).all())
        assert not recv_w[n:].any(), "padding rows"


def _combined(case, rank, refs, idxs, scales=None):
    ys = [expert(r.recv_x, i) for i, r in enumerate(refs)]
    return reference.combine(ys, idxs, case["num_experts"], case["world"][1], scales, ranks=[rank])[0]


def _run_case(rank: int, world_size: int, state: _Buffers, case: dict) -> None:
    buf = state.get(tuple(case["world"]))
    if buf is None:
        return
    xs, idxs, ws = _inputs(case)
    refs = _oracle(case, xs, idxs, ws)
    x, idx, w, e, mode = xs[rank], idxs[rank], ws[rank], case["num_experts"], case["mode"]
    ref = refs[rank]
    if mode == "num_worst_tokens":
        rows_of = [(r[0] if case["dtype"] == "fp8" else r).recv_x.shape[0] for r in refs]
        worst = max(rows_of) + case["slack"] + 1
        *got, handle, _ = buf.dispatch(x, idx, w, e, num_worst_tokens=worst)
        _check_dispatch(case, rank, got, ref, rows=worst)
        assert handle.plan.num_recv_tokens == rows_of[rank]
        if case["dtype"] != "fp8":
            y = expert(got[0], rank)
            y[rows_of[rank] :] = 7  # padding rows are ignored
            assert torch.equal(buf.combine(y, handle)[0], _combined(case, rank, refs, idxs))
        return
    if mode == "backward":
        _check_backward(case, rank, buf, refs, xs, idxs, ws)
        return
    launch = {"async": {"async_finish": True}, "hook": {"return_recv_hook": True}}.get(mode, {})
    returned = buf.dispatch(x, idx, w, e, **launch)
    got, handle = returned[:4], returned[4]
    _complete(mode, *returned[5:])
    _check_dispatch(case, rank, got, ref)
    if mode == "cached":
        xs2, _, _ = _inputs(case, seed_offset=1)
        cached = buf.dispatch(xs2[rank], handle=handle)[0]
        ref2 = _oracle(case, xs2, idxs, ws)[rank]
        if case["dtype"] == "fp8":
            assert torch.equal(cached[0].view(torch.uint8), ref2[0].recv_x) and torch.equal(cached[1], ref2[1].recv_x)
        else:
            assert torch.equal(cached, ref2.recv_x), "cached dispatch"
    if case["dtype"] == "fp8":
        return
    weights = got[2] if mode == "weighted" else None
    scales = [r.recv_topk_weights.sum(1) for r in refs] if mode == "weighted" else None
    out, *completion = buf.combine(expert(got[0], rank), handle, weights, **launch)
    _complete(mode, *completion)
    assert torch.equal(out, _combined(case, rank, refs, idxs, scales)), f"{mode} combine"


def _complete(mode, event, hook=None) -> None:
    if mode == "async":
        event.current_stream_wait()
    elif mode == "hook" and hook is not None:
        hook()


def _check_backward(case, rank, buf, refs, xs, idxs, ws):
    """Dispatch's backward is the oracle's combine of the gradients (weights: only where the
    rank owns the expert); combine's backward is the oracle's dispatch of the gradient."""
    gen = torch.Generator().manual_seed(case["seed"] + 2)
    local, e, dtype = case["world"][1], case["num_experts"], DTYPES[case["dtype"]]
    gxs = [torch.randn(r.recv_x.shape, generator=gen).to(dtype) for r in refs]
    gws = [torch.randn(r.recv_topk_weights.shape, generator=gen) for r in refs]
    x, w = xs[rank].clone().requires_grad_(), ws[rank].clone().requires_grad_()
    recv_x, _, recv_w, *_, handle, _ = buf.dispatch(x, idxs[rank], w, e)
    ((recv_x * gxs[rank]).sum() + (recv_w * gws[rank]).sum()).backward()
    assert torch.equal(x.grad, reference.combine(gxs, idxs, e, local, ranks=[rank])[0]), "grad x"
    masked = [torch.where(r.recv_topk_idx >= 0, g, torch.zeros_like(g)) for r, g in zip(refs, gws)]
    assert torch.equal(w.grad, reference.combine(masked, idxs, e, local, ranks=[rank])[0]), "grad topk_weights"
    gouts = [torch.randn(t, case["hidden"], generator=gen).to(dtype) for t in case["tokens"]]
    y = expert(recv_x.detach(), rank).requires_grad_()
    (buf.combine(y, handle)[0] * gouts[rank]).sum().backward()
    expected = reference.dispatch(gouts, idxs, None, e, local, ranks=[rank])[0].recv_x
    assert torch.equal(y.grad, expected), "grad y"


@st.composite
def _cases(draw, mode: str) -> dict:
    world = draw(st.sampled_from(SHAPES))
    dtype = draw(st.sampled_from([*DTYPES, "fp8"] if mode in FP8_MODES else list(DTYPES)))
    hidden = draw(st.integers(1, 8192))
    if dtype == "fp8":
        hidden = 128 * math.ceil(hidden / 128)
    most = max(1, min(512, ROW_BUDGET // hidden))
    num_experts = world[0] * draw(st.integers(1, 64))
    return {
        "world": world,
        "mode": mode,
        "dtype": dtype,
        "hidden": hidden,
        "tokens": draw(st.lists(st.integers(0, most), min_size=world[0], max_size=world[0])),
        "num_experts": num_experts,
        "topk": draw(st.integers(1, min(num_experts, 9))),
        "drop": draw(st.sampled_from([0.0, 0.1, 0.5, 1.0])),
        "index_dtype": draw(st.sampled_from(["int64", "int32"])),
        "seed": draw(st.integers(0, 2**31 - 1)),
        "slack": draw(st.integers(0, 40)),
    }


@pytest.fixture(scope="module")
def live_world():
    with LiveWorld(WORLD_SIZE, _setup) as world:
        yield world


@pytest.mark.parametrize("mode", MODES)
def test_matches_the_oracle(live_world, mode):
    @seed(zlib.crc32(mode.encode()))  # fixed per mode: the same examples every run, other ones per mode
    @settings(
        max_examples=EXAMPLES_PER_MODE,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(case=_cases(mode))
    def check(case):
        failures = [value for ok, value in live_world.run(_run_case, case) if not ok]
        assert not failures, f"case {case}:\n" + "\n".join(failures)

    check()
