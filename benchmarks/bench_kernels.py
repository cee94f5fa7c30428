"""Benchmark of the local kernels: routing layout, fused permute / unpermute, fp8 quantize.

For each model shape it reports the median time (and p20-p80 spread), the achieved bandwidth
(byte formulas below), the ratio to a device-to-device copy measured in the same run, and the
ratio to megatron-core's ``moe_utils.permute`` / ``unpermute`` (and to Transformer Engine's
fused permute through megatron-core's ``fused=True`` path when TE is installed).

Byte formulas (bytes that must cross HBM at least once; b = element size):
  copy       2 * N * b                       (read + write)
  layout     T*K*idx_b + T*W (is_token_in_rank) + 4*T*(W+N) (send offsets) + counts
  permute    R*H*b (read x) + P*H*b (write rows) + R*K*(idx_b + 4 probs) + 4*P (probs)
  unpermute  P*H*b (read rows) + R*H*b (write out) + 4*R*K (row map)
  quantize   T*H*b (read) + T*H (fp8) + 4*T*H/128 (scales)
  dequantize T*H + 4*T*H/128 + T*H*b

Received tokens of one rank are simulated from the global routing: ``tokens`` per rank times
``ep`` ranks, top-k over all experts, keeping the tokens that select at least one of rank 0's
experts (``recv_topk_idx`` in local numbering), as dispatch would deliver them.

Goals (GPU only; printed, not asserted): permute/unpermute >= 80% of the copy bandwidth and
>= 1.5x megatron-core; layout <= 20 us for 4096 x top-8 on H100/H200.

Usage:
  python benchmarks/bench_kernels.py                       # all shapes, all kernels
  python benchmarks/bench_kernels.py --shapes deepseek-v3 --json out.json
  python benchmarks/bench_kernels.py --sweep               # also try a few launch configs
On a machine without a GPU it runs the torch reference at tiny sizes (``--shapes tiny``) and
says that the GPU goals were not measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time
from typing import Callable

import torch

from moe_dispatch.ops import permute as permute_mod
from moe_dispatch.ops import quant as quant_mod
from moe_dispatch.ops.layout import get_dispatch_layout, get_dispatch_layout_triton, topk_to_routing_map
from moe_dispatch.ops.permute import make_permute_handle, permute, permute_rows_triton, unpermute
from moe_dispatch.ops.quant import per_token_cast_back, per_token_cast_to_fp8
from moe_dispatch.semantics import permute as permute_reference
from moe_dispatch.semantics import quant as quant_reference
from moe_dispatch.tools.quiet import filter_known_warnings


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    tokens: int  # tokens per rank (layout / quantize input)
    topk: int
    hidden: int
    num_experts: int
    ep: int  # EP world size; local experts = num_experts / ep
    ranks_per_node: int = 8


SHAPES = {
    "deepseek-v3": Shape("deepseek-v3", 4096, 8, 7168, 256, 32),  # 8 local experts
    "qwen3-30b-a3b": Shape("qwen3-30b-a3b", 4096, 8, 2048, 128, 16),  # 8 local experts
    "tiny": Shape("tiny", 256, 4, 256, 16, 4, 2),
}


@dataclasses.dataclass
class Row:
    shape: str
    kernel: str
    impl: str
    median_us: float
    p20_us: float
    p80_us: float
    bytes: int
    gbps: float
    vs_copy: float | None = None
    vs_megatron: float | None = None
    vs_te: float | None = None
    goal: str = ""
    note: str = ""


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------


def time_fn(fn: Callable[[], object], device: torch.device, args, graph: bool = False):
    """(median, p20, p80) in microseconds, over ``args.warmup`` and ``args.iters``. GPU: triton's
    do_bench (L2 flushed before each run, CUDA events), or do_bench_cudagraph for graph-safe
    calls. CPU: perf_counter."""
    warmup, iters = args.warmup, args.iters
    if device.type == "cuda":
        import triton.testing

        if graph:
            q = triton.testing.do_bench_cudagraph(fn, rep=max(20, iters), quantiles=[0.5, 0.2, 0.8])
        else:
            q = triton.testing.do_bench(fn, warmup=warmup, rep=max(25, iters), quantiles=[0.5, 0.2, 0.8])
        return tuple(v * 1e3 for v in q)
    for _ in range(max(1, warmup // 10)):
        fn()
    times = []
    for _ in range(max(3, iters // 10)):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    times.sort()
    pick = lambda f: times[min(len(times) - 1, int(f * len(times)))]  # noqa: E731
    return statistics.median(times), pick(0.2), pick(0.8)


def try_time(what: str, fn, device, args):
    """Times an optional baseline; None (with a note on stderr) when it fails to run."""
    try:
        return time_fn(fn, device, args)
    except Exception as exc:  # noqa: BLE001 - baselines are optional
        print(f"{what} baseline failed: {exc!r}", file=sys.stderr)
        return None


def copy_bandwidth(nbytes: int, device: torch.device, args) -> float:
    """GB/s of a device-to-device copy of ``nbytes`` (read + write counted)."""
    src = torch.empty(max(nbytes // 2, 1), dtype=torch.bfloat16, device=device)
    src.uniform_()
    dst = torch.empty_like(src)
    med, _, _ = time_fn(lambda: dst.copy_(src), device, args)
    return 2 * src.numel() * 2 / (med * 1e-6) / 1e9


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------


def global_topk(num_tokens: int, topk: int, num_experts: int, device, gen) -> torch.Tensor:
    scores = torch.rand(num_tokens, num_experts, device=device, generator=gen)
    return scores.topk(topk, dim=1).indices.contiguous()


def received_topk(shape: Shape, device, gen) -> torch.Tensor:
    """recv_topk_idx [R, K] of rank 0 (local ids, -1 elsewhere), tokens from every rank."""
    local = shape.num_experts // shape.ep
    idx = global_topk(shape.tokens * shape.ep, shape.topk, shape.num_experts, device, gen)
    mine = (idx >= 0) & (idx < local)
    keep = mine.any(1)
    return torch.where(mine, idx, -1)[keep].contiguous()


# ---------------------------------------------------------------------------------------------
# Benchmarks
# ---------------------------------------------------------------------------------------------


def megatron_moe_utils():
    filter_known_warnings()
    try:
        from megatron.core.transformer.moe import moe_utils

        return moe_utils
    except Exception as exc:  # noqa: BLE001 - optional baseline
        print(f"megatron-core baseline unavailable: {exc!r}", file=sys.stderr)
        return None


def bench_shape(shape: Shape, device: torch.device, args, rows: list[Row]) -> None:
    gen = torch.Generator(device=device)
    gen.manual_seed(args.seed)
    dtype = torch.bfloat16
    b = 2
    num_local = shape.num_experts // shape.ep
    num_nodes = shape.ep // shape.ranks_per_node
    backend = "auto"
    mu = megatron_moe_utils()
    te_ok = bool(mu is not None and getattr(mu, "HAVE_TE", False) and getattr(mu, "fused_permute", None))

    def add(kernel, impl, t, nbytes, copy_gbps=None, goal="", note="", **ratios):
        med, p20, p80 = t
        gbps = nbytes / (med * 1e-6) / 1e9
        rows.append(
            Row(
                shape.name,
                kernel,
                impl,
                med,
                p20,
                p80,
                nbytes,
                gbps,
                vs_copy=(gbps / copy_gbps) if copy_gbps else None,
                goal=goal,
                note=note,
                **ratios,
            )
        )

    # -- layout ----------------------------------------------------------------------------
    if "layout" in args.kernels:
        idx = global_topk(shape.tokens, shape.topk, shape.num_experts, device, gen)
        nbytes = (
            idx.numel() * 8
            + shape.tokens * shape.ep
            + 4 * shape.tokens * (shape.ep + num_nodes)
            + 8 * (shape.ep + num_nodes + shape.num_experts)
        )
        fn = (
            (lambda: get_dispatch_layout_triton(idx, shape.num_experts, shape.ep, shape.ranks_per_node))
            if device.type == "cuda"
            else (lambda: get_dispatch_layout(idx, shape.num_experts, shape.ep, shape.ranks_per_node))
        )
        goal = "<= 20 us (4096 x 8, H100/H200)" if device.type == "cuda" else "not measured (no GPU)"
        add("layout", "ours (eager)", time_fn(fn, device, args), nbytes, goal=goal)
        if device.type == "cuda":
            t = time_fn(fn, device, args, graph=True)
            add("layout", "ours (CUDA graph)", t, nbytes, goal=goal, note="PASS" if t[0] <= 20 else "above goal")

    # -- permute / unpermute ------------------------------------------------------------------
    if "permute" in args.kernels or "unpermute" in args.kernels:
        recv = received_topk(shape, device, gen)
        num_recv = recv.shape[0]
        x = torch.randn(num_recv, shape.hidden, device=device, dtype=dtype, generator=gen)
        probs = torch.rand(recv.shape, device=device, generator=gen)
        handle = make_permute_handle(recv, num_local, backend=backend)
        num_rows = handle.num_rows
        copies = int((recv >= 0).sum())
        copy_gbps = copy_bandwidth(num_rows * shape.hidden * b, device, args)
        add(
            "copy",
            "torch copy_ (same run)",
            (2 * num_rows * shape.hidden * b / copy_gbps / 1e3,) * 3,
            2 * num_rows * shape.hidden * b,
            note=f"R={num_recv} received tokens, P={num_rows} rows",
        )
        routing_map, merged_probs = topk_to_routing_map(recv, probs, num_local, validate=False)  # megatron's form

        if "permute" in args.kernels:
            nbytes = num_recv * shape.hidden * b + num_rows * shape.hidden * b + recv.numel() * 12 + 4 * num_rows
            goal = ">= 80% copy, >= 1.5x megatron" if device.type == "cuda" else "not measured (no GPU)"
            ours_full = time_fn(
                lambda: permute(x, recv, probs, num_local_experts=num_local, backend=backend), device, args
            )
            ours_rows = time_fn(
                lambda: (
                    permute_rows_triton(x, handle, probs)
                    if device.type == "cuda"
                    else permute_reference.permute_rows_reference(x, handle, probs)
                ),
                device,
                args,
            )
            mg = te = None
            if mu is not None:
                mg = try_time(
                    "megatron permute",
                    lambda: mu.permute(x, routing_map, merged_probs, num_out_tokens=copies),
                    device,
                    args,
                )
                if te_ok:
                    te = try_time(
                        "TE permute",
                        lambda: mu.permute(x, routing_map, merged_probs, num_out_tokens=copies, fused=True),
                        device,
                        args,
                    )
            for impl, t, note in (
                ("ours (index + data)", ours_full, "incl. the host sync that sizes P"),
                ("ours (data kernel)", ours_rows, "handle reused"),
            ):
                add(
                    "permute",
                    impl,
                    t,
                    nbytes,
                    copy_gbps,
                    goal=goal,
                    note=note,
                    vs_megatron=(mg[0] / t[0]) if mg else None,
                    vs_te=(te[0] / t[0]) if te else None,
                )
            if mg:
                add("permute", "megatron-core moe_utils.permute", mg, nbytes, copy_gbps)
            if te:
                add("permute", "TE fused (via megatron fused=True)", te, nbytes, copy_gbps)
            for pad in (128,):
                t = time_fn(
                    lambda: permute(
                        x,
                        recv,
                        probs,
                        num_local_experts=num_local,
                        pad_multiple=pad,
                        num_permuted_tokens=num_rows + pad * num_local,
                        backend=backend,
                    ),
                    device,
                    args,
                    graph=False,
                )
                add("permute", f"ours pad={pad}, static budget", t, nbytes, copy_gbps, note="no host sync")

        if "unpermute" in args.kernels:
            y = torch.randn(num_rows, shape.hidden, device=device, dtype=dtype, generator=gen)
            nbytes = num_rows * shape.hidden * b + num_recv * shape.hidden * b + 4 * recv.numel()
            goal = ">= 80% copy, >= 1.5x megatron" if device.type == "cuda" else "not measured (no GPU)"
            ours = time_fn(lambda: unpermute(y, handle, backend=backend), device, args)
            mg = te = None
            if mu is not None:
                _, _, sorted_indices, _, _ = mu.permute(x, routing_map, None, num_out_tokens=copies)
                y_mg = y[:copies].contiguous()
                mg = try_time(
                    "megatron unpermute",
                    lambda: mu.unpermute(y_mg, sorted_indices, x.shape, routing_map=routing_map),
                    device,
                    args,
                )
                if te_ok:
                    try:
                        _, _, row_id_map, _, _ = mu.permute(x, routing_map, None, num_out_tokens=copies, fused=True)
                        te = try_time(
                            "TE unpermute", lambda: mu.unpermute(y_mg, row_id_map, x.shape, fused=True), device, args
                        )
                    except Exception as exc:  # noqa: BLE001 - optional baseline
                        print(f"TE unpermute baseline failed: {exc!r}", file=sys.stderr)
            add(
                "unpermute",
                "ours",
                ours,
                nbytes,
                copy_gbps,
                goal=goal,
                vs_megatron=(mg[0] / ours[0]) if mg else None,
                vs_te=(te[0] / ours[0]) if te else None,
            )
            w = torch.rand(num_rows, device=device, generator=gen)
            add(
                "unpermute",
                "ours (weighted)",
                time_fn(lambda: unpermute(y, handle, w, backend=backend), device, args),
                nbytes + 4 * num_rows,
                copy_gbps,
            )
            if mg:
                add("unpermute", "megatron-core moe_utils.unpermute", mg, nbytes, copy_gbps)
            if te:
                add("unpermute", "TE fused (via megatron fused=True)", te, nbytes, copy_gbps)

    # -- quantize -------------------------------------------------------------------------------
    if "quant" in args.kernels:
        hidden = shape.hidden - shape.hidden % 128
        x = torch.randn(shape.tokens, hidden, device=device, dtype=dtype, generator=gen)
        copy_gbps = copy_bandwidth(x.numel() * b, device, args)
        groups = hidden // 128
        q_bytes = x.numel() * (b + 1) + 4 * shape.tokens * groups
        add(
            "quantize",
            "ours",
            time_fn(lambda: per_token_cast_to_fp8(x, backend=backend), device, args),
            q_bytes,
            copy_gbps,
        )
        add(
            "quantize",
            "ours (ue8m0)",
            time_fn(lambda: per_token_cast_to_fp8(x, use_ue8m0=True, backend=backend), device, args),
            q_bytes,
            copy_gbps,
        )
        add(
            "quantize",
            "torch reference",
            time_fn(lambda: quant_reference.per_token_cast_to_fp8_reference(x), device, args),
            q_bytes,
            copy_gbps,
        )
        q, s = per_token_cast_to_fp8(x, backend=backend)
        add(
            "dequantize",
            "ours",
            time_fn(lambda: per_token_cast_back(q, s, dtype, backend=backend), device, args),
            q_bytes,
            copy_gbps,
        )


def sweep(shape: Shape, device: torch.device, args) -> list[dict]:
    """Tries a few launch configurations of the data kernels (GPU only); returns the timings."""
    gen = torch.Generator(device=device)
    gen.manual_seed(args.seed)
    num_local = shape.num_experts // shape.ep
    recv = received_topk(shape, device, gen)
    x = torch.randn(recv.shape[0], shape.hidden, device=device, dtype=torch.bfloat16, generator=gen)
    handle = make_permute_handle(recv, num_local)
    y = torch.randn(handle.num_rows, shape.hidden, device=device, dtype=torch.bfloat16, generator=gen)
    xq = torch.randn(
        shape.tokens, shape.hidden - shape.hidden % 128, device=device, dtype=torch.bfloat16, generator=gen
    )
    out = []
    for br, bh, nw in ((4, 1024, 4), (8, 1024, 4), (16, 512, 4), (8, 2048, 8), (2, 2048, 4), (1, 4096, 8)):
        permute_mod.GPU_CONFIG.update(num_warps=nw)
        t = time_fn(lambda: permute_rows_triton(x, handle, block_r=br, block_h=bh), device, args)
        out.append(
            {
                "shape": shape.name,
                "kernel": "permute rows",
                "block_r": br,
                "block_h": bh,
                "num_warps": nw,
                "median_us": t[0],
            }
        )
        t = time_fn(lambda: permute_mod.unpermute_rows_triton(y, handle, block_r=br, block_h=bh), device, args)
        out.append(
            {
                "shape": shape.name,
                "kernel": "unpermute",
                "block_r": br,
                "block_h": bh,
                "num_warps": nw,
                "median_us": t[0],
            }
        )
    permute_mod.GPU_CONFIG.update(num_warps=4)
    for bt, gpp, nw in ((16, 8, 4), (8, 8, 4), (32, 4, 4), (16, 56, 4), (4, 16, 2)):
        quant_mod.GPU_CONFIG.update(num_warps=nw)
        t = time_fn(
            lambda: quant_mod.per_token_cast_to_fp8_triton(xq, block_t=bt, groups_per_program=gpp), device, args
        )
        out.append(
            {
                "shape": shape.name,
                "kernel": "quantize",
                "block_t": bt,
                "groups_per_program": gpp,
                "num_warps": nw,
                "median_us": t[0],
            }
        )
    quant_mod.GPU_CONFIG.update(num_warps=4)
    return out


def print_table(rows: list[Row], on_gpu: bool) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        for r in rows:
            print(dataclasses.asdict(r))
        return
    table = Table(title="moe_dispatch kernels" + ("" if on_gpu else " (CPU, torch reference: GPU goals not measured)"))
    for col in (
        "shape",
        "kernel",
        "impl",
        "median us",
        "p20-p80 us",
        "GB/s",
        "vs copy",
        "vs megatron",
        "vs TE",
        "goal",
        "note",
    ):
        table.add_column(col, overflow="fold")
    fmt = lambda v, f: "" if v is None else f.format(v)  # noqa: E731
    for r in rows:
        table.add_row(
            r.shape,
            r.kernel,
            r.impl,
            f"{r.median_us:.1f}",
            f"{r.p20_us:.1f}-{r.p80_us:.1f}",
            f"{r.gbps:.0f}",
            fmt(r.vs_copy, "{:.0%}"),
            fmt(r.vs_megatron, "{:.2f}x"),
            fmt(r.vs_te, "{:.2f}x"),
            r.goal,
            r.note,
        )
    Console(width=200).print(table)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--shapes",
        nargs="+",
        choices=sorted(SHAPES),
        default=None,
        help="model shapes (default: deepseek-v3 qwen3-30b-a3b on GPU, tiny on CPU)",
    )
    p.add_argument(
        "--kernels",
        nargs="+",
        choices=["layout", "permute", "unpermute", "quant"],
        default=["layout", "permute", "unpermute", "quant"],
    )
    p.add_argument("--warmup", type=int, default=25, help="warm-up runs (ms of warm-up on GPU)")
    p.add_argument("--iters", type=int, default=100, help="timed runs (ms of runs on GPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write the results (and the environment) as JSON")
    p.add_argument("--sweep", action="store_true", help="also time a few launch configurations (GPU)")
    p.add_argument("--device", default="auto", help="auto, cuda or cpu")
    args = p.parse_args(argv)
    device = torch.device(
        "cuda"
        if args.device == "auto" and torch.cuda.is_available()
        else ("cpu" if args.device == "auto" else args.device)
    )
    on_gpu = device.type == "cuda"
    shapes = args.shapes or (["deepseek-v3", "qwen3-30b-a3b"] if on_gpu else ["tiny"])
    if not on_gpu:
        print("No GPU: timing the torch reference path at the given sizes; the GPU goals are not measured.")
    rows: list[Row] = []
    for name in shapes:
        bench_shape(SHAPES[name], device, args, rows)
    print_table(rows, on_gpu)
    sweeps = []
    if args.sweep and on_gpu:
        for name in shapes:
            sweeps += sweep(SHAPES[name], device, args)
        for s in sweeps:
            print("sweep", s)
    if args.json:
        env = {
            "device": torch.cuda.get_device_name(device) if on_gpu else platform.processor() or "cpu",
            "torch": torch.__version__,
            "python": platform.python_version(),
        }
        try:
            import triton

            env["triton"] = triton.__version__
        except ImportError:
            pass
        with open(args.json, "w") as f:
            json.dump({"env": env, "rows": [dataclasses.asdict(r) for r in rows], "sweep": sweeps}, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
