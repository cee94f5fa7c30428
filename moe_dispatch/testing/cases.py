"""Dispatch/combine cases checked against the oracle, for the property tests and the soak
benchmark (``benchmarks/soak.py``).

A case is a plain dict (it travels to the ranks of a world): ``world`` ``(W, L)``, ``mode`` (one
of :data:`MODES`), ``dtype`` (a key of :data:`DTYPES`, or ``"fp8"``: the ``(e4m3, scales)`` pair,
with ``hidden`` a multiple of 128 and a mode in :data:`FP8_MODES`), ``hidden``, ``tokens`` (T per
rank), ``num_experts`` (a multiple of W), ``topk`` (<= E), ``drop`` (the share of -1 entries),
``index_dtype`` (``"int32"``/``"int64"``), ``seed``, ``slack`` (num_worst_tokens rows past the
largest receive count). Every rank rebuilds every rank's inputs from the seed, so each checks
its own results against :mod:`moe_dispatch.semantics.reference` locally, bit for bit.
"""

from __future__ import annotations

import random

import torch

from ..errors import OracleMismatch
from ..ops.quant import per_token_cast_to_fp8
from ..semantics import reference

MODES = ("sync", "async", "hook", "num_worst_tokens", "cached", "weighted", "backward")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FP8_MODES = ("sync", "num_worst_tokens", "cached")  # fp8 is a dispatch-only, forward-only format


def expert(recv_x: torch.Tensor, rank: int) -> torch.Tensor:
    """A stand-in expert whose output differs per rank, so misrouted rows are visible."""
    return (recv_x.float() * (rank + 1) + 0.5).to(recv_x.dtype)


def random_case(rng: random.Random, world: tuple[int, int], *, max_tokens: int, max_hidden: int) -> dict:
    """A case drawn with ``rng`` (the same draws on every rank from the same seed)."""
    mode = rng.choice(MODES)
    dtype = rng.choice([*DTYPES, "fp8"] if mode in FP8_MODES and max_hidden >= 128 else list(DTYPES))
    hidden = 128 * rng.randint(1, max_hidden // 128) if dtype == "fp8" else rng.randint(1, max_hidden)
    num_experts = world[0] * rng.randint(1, 16)
    return {
        "world": world,
        "mode": mode,
        "dtype": dtype,
        "hidden": hidden,
        "tokens": [rng.randint(0, max_tokens) for _ in range(world[0])],
        "num_experts": num_experts,
        "topk": rng.randint(1, min(num_experts, 8)),
        "drop": rng.choice([0.0, 0.1, 0.5, 1.0]),
        "index_dtype": rng.choice(["int64", "int32"]),
        "seed": rng.randrange(2**31),
        "slack": rng.randint(0, 32),
    }


def inputs(case: dict, seed_offset: int = 0):
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
    return list(zip(bits, scales))


def _expect(ok: bool, what: str, case: dict) -> None:
    if not ok:
        raise OracleMismatch(f"{what} differs from the oracle in case {case}")


def _check_dispatch(case, got, ref, rows=None):
    """``got = (recv_x, recv_topk_idx, recv_topk_weights, per_expert)`` against the oracle's
    ``ref``; with ``rows`` (num_worst_tokens) the first rows, the rest padding."""
    recv_x, recv_idx, recv_w, per_expert = got
    if case["dtype"] == "fp8":
        ref, ref_scales = ref
        recv_x, recv_scales = recv_x
        n = ref.recv_x.shape[0]
        _expect(torch.equal(recv_scales[:n], ref_scales.recv_x) and not recv_scales[n:].any(), "fp8 scales", case)
        recv_x = recv_x.view(torch.uint8)
    n = ref.recv_x.shape[0]
    _expect(torch.equal(recv_x[:n], ref.recv_x), "recv_x", case)
    _expect(recv_idx.dtype == getattr(torch, case["index_dtype"]), "recv_topk_idx dtype", case)
    _expect(torch.equal(recv_idx[:n], ref.recv_topk_idx), "recv_topk_idx", case)
    _expect(torch.equal(recv_w[:n], ref.recv_topk_weights), "recv_topk_weights", case)
    _expect(torch.equal(per_expert, ref.num_recv_tokens_per_expert), "num_recv_tokens_per_expert", case)
    if rows is not None:
        padding_clear = not recv_x[n:].any() and bool((recv_idx[n:] == -1).all()) and not recv_w[n:].any()
        _expect(recv_x.shape[0] == rows and padding_clear, "num_worst_tokens padding rows", case)


def _combined(case, rank, refs, idxs, scales=None):
    ys = [expert(r.recv_x, i) for i, r in enumerate(refs)]
    return reference.combine(ys, idxs, case["num_experts"], case["world"][1], scales, ranks=[rank])[0]


def run_case(buf, rank: int, case: dict, check: bool = True) -> None:
    """Runs ``case`` on this rank's Buffer (collective: every rank of ``buf`` with the same
    case); with ``check``, compares every output with the oracle.

    Raises:
        OracleMismatch: naming the output and the case.
    """
    xs, idxs, ws = inputs(case)
    refs = _oracle(case, xs, idxs, ws) if check else None
    x, idx, w, e, mode = xs[rank], idxs[rank], ws[rank], case["num_experts"], case["mode"]
    if mode == "num_worst_tokens":
        _worst(buf, rank, case, refs, xs, idxs, ws, check)
    elif mode == "backward":
        _backward(buf, rank, case, refs, xs, idxs, ws, check)
    else:
        launch = {"async": {"async_finish": True}, "hook": {"return_recv_hook": True}}.get(mode, {})
        returned = buf.dispatch(x, idx, w, e, **launch)
        got, handle = returned[:4], returned[4]
        _complete(mode, *returned[5:])
        if check:
            _check_dispatch(case, got, refs[rank])
        if mode == "cached":
            xs2, _, _ = inputs(case, seed_offset=1)
            cached = buf.dispatch(xs2[rank], handle=handle)[0]
            if check:
                ref2 = _oracle(case, xs2, idxs, ws)[rank]
                if case["dtype"] == "fp8":
                    same = torch.equal(cached[0].view(torch.uint8), ref2[0].recv_x)
                    _expect(same and torch.equal(cached[1], ref2[1].recv_x), "cached fp8 dispatch", case)
                else:
                    _expect(torch.equal(cached, ref2.recv_x), "cached dispatch", case)
        if case["dtype"] == "fp8":
            return
        weights = got[2] if mode == "weighted" else None
        out, *completion = buf.combine(expert(got[0], rank), handle, weights, **launch)
        _complete(mode, *completion)
        if check:
            scales = [r.recv_topk_weights.sum(1) for r in refs] if mode == "weighted" else None
            _expect(torch.equal(out, _combined(case, rank, refs, idxs, scales)), f"{mode} combine", case)


def _complete(mode, event, hook=None) -> None:
    if mode == "async":
        event.current_stream_wait()
    elif mode == "hook" and hook is not None:
        hook()


def _worst(buf, rank, case, refs, xs, idxs, ws, check):
    """num_worst_tokens: static outputs of the largest receive count plus slack, padding rows
    zero (ids -1); a combine of that many rows ignores the padding."""
    if check:
        worst = max((r[0] if case["dtype"] == "fp8" else r).recv_x.shape[0] for r in refs)
    else:
        worst = sum(case["tokens"])  # without the oracle: every token, which never overflows
    worst += case["slack"] + 1
    *got, handle, _ = buf.dispatch(xs[rank], idxs[rank], ws[rank], case["num_experts"], num_worst_tokens=worst)
    received = int(handle.recv_count)  # plan.num_recv_tokens is None in the kernels' budget mode
    if check:
        _check_dispatch(case, got, refs[rank], rows=worst)
    if case["dtype"] != "fp8":
        y = expert(got[0], rank)
        y[received:] = 7  # padding rows are ignored
        out = buf.combine(y, handle)[0]
        if check:
            _expect(torch.equal(out, _combined(case, rank, refs, idxs)), "num_worst_tokens combine", case)


def _backward(buf, rank, case, refs, xs, idxs, ws, check):
    """Dispatch's backward is the oracle's combine of the gradients (weights: only where the
    rank owns the expert); combine's backward is the oracle's dispatch of the gradient."""
    gen = torch.Generator().manual_seed(case["seed"] + 2)
    local, e, dtype = case["world"][1], case["num_experts"], DTYPES[case["dtype"]]
    x, w = xs[rank].clone().requires_grad_(), ws[rank].clone().requires_grad_()
    recv_x, _, recv_w, *_, handle, _ = buf.dispatch(x, idxs[rank], w, e)
    # Every rank's output gradients, drawn in rank order (without the oracle only this rank's rows are known).
    rows = [r.recv_x.shape[0] for r in refs] if check else [len(recv_x) * (r == rank) for r in range(len(idxs))]
    gxs = [torch.randn(n, case["hidden"], generator=gen).to(dtype) for n in rows]
    gws = [torch.randn(n, case["topk"], generator=gen) for n in rows]
    ((recv_x * gxs[rank]).sum() + (recv_w * gws[rank]).sum()).backward()
    gouts = [torch.randn(t, case["hidden"], generator=gen).to(dtype) for t in case["tokens"]]
    y = expert(recv_x.detach(), rank).requires_grad_()
    (buf.combine(y, handle)[0] * gouts[rank]).sum().backward()
    if not check:
        return
    _expect(torch.equal(x.grad, reference.combine(gxs, idxs, e, local, ranks=[rank])[0]), "grad x", case)
    masked = [torch.where(r.recv_topk_idx >= 0, g, torch.zeros_like(g)) for r, g in zip(refs, gws)]
    _expect(torch.equal(w.grad, reference.combine(masked, idxs, e, local, ranks=[rank])[0]), "grad topk_weights", case)
    expected = reference.dispatch(gouts, idxs, None, e, local, ranks=[rank])[0].recv_x
    _expect(torch.equal(y.grad, expected), "grad y", case)
