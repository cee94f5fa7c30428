"""What the loopback benchmarks (bench_intranode.py, bench_internode.py) share: the shapes, the
inputs, the timers, the first (fresh) dispatch, the timed cached cases, the d2d copy baseline,
the rows and their tables, the command line they have in common and the JSON they write."""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time

import torch

from moe_dispatch import _ext
from moe_dispatch.ops.quant import per_token_cast_to_fp8


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    tokens: int  # per simulated rank
    hidden: int
    topk: int
    num_experts: int


SHAPES = {
    "deepseek-v3": Shape("deepseek-v3", 4096, 7168, 8, 256),
    "qwen3": Shape("qwen3", 4096, 4096, 8, 128),  # Qwen3-235B-A22B: hidden 4096, 128 experts, top-8
    "gpt-oss": Shape("gpt-oss", 4096, 2880, 4, 128),
    "tiny": Shape("tiny", 64, 256, 4, 32),
}
GOAL_GBPS_PER_SM = 25.0  # issue 21: payload per SM where HBM does not bind (DeepEP V2: 643 GB/s / 24 SMs)
MODEL_GOOD = (0.7, 1.3)  # model / measurement counted as a good prediction


@dataclasses.dataclass(kw_only=True)
class Row:
    """One timed row; each script's Row adds its configuration's fields. ``num_sms``: SMs per
    simulated rank (0: the copy baseline); times in microseconds; ``bytes``: the payload
    delivered; ``copy_gbps``: the copy baseline's rate (None where not timed), which gives
    ``vs_copy``; ``vs_current``: the current kernels' time over this row's (None for the current
    kernels' own rows until they ran); ``model_us``: the cost model's time (None: not modelled)."""

    shape: str
    world_size: int
    num_sms: int
    op: str
    variant: str
    median_us: float
    p20_us: float
    p80_us: float
    bytes: int
    copy_gbps: dataclasses.InitVar[float | None]
    vs_current: float | None = None
    model_us: float | None = None
    gbps: float = dataclasses.field(init=False)
    vs_copy: float | None = dataclasses.field(init=False)

    def __post_init__(self, copy_gbps: float | None) -> None:
        self.gbps = self.bytes / (self.median_us * 1e-6) / 1e9
        self.vs_copy = ratio(self.gbps, copy_gbps)

    @property
    def gbps_per_sm(self) -> float | None:
        return self.gbps / (self.world_size * self.num_sms) if self.num_sms else None

    @property
    def model_ratio(self) -> float | None:
        return ratio(self.model_us, self.median_us)

    def timing_cells(self) -> list[str]:
        """The cells under :data:`TIMING_COLUMNS`."""
        times = [f"{self.median_us:.1f}", f"{self.p20_us:.1f}-{self.p80_us:.1f}", f"{self.gbps:.1f}"]
        return [self.op, self.variant, *times, cell(self.gbps_per_sm, ".1f"), cell(self.vs_copy, ".2f")]

    def model_cells(self) -> list[str]:
        """The cells under :data:`MODEL_COLUMNS`."""
        return [cell(self.vs_current, ".2f"), cell(self.model_us, ".1f"), cell(self.model_ratio, ".2f")]


TIMING_COLUMNS = ["op", "variant", "median us", "p20-p80 us", "GB/s", "GB/s/SM", "vs copy"]
MODEL_COLUMNS = ["vs current", "model us", "model/meas"]


def time_gpu(fn, warmup: int, iters: int) -> tuple[float, float, float]:
    """(median, p20, p80) microseconds of fn() by CUDA events, one pair per call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return _quantiles(times)


def time_host(fn, warmup: int, iters: int, device: torch.device) -> tuple[float, float, float]:
    """Wall-clock microseconds (the call synchronises, or runs on CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t0) * 1e6)
    return _quantiles(times)


def _quantiles(times: list[float]) -> tuple[float, float, float]:
    times = sorted(times)
    pick = lambda f: times[min(len(times) - 1, int(f * len(times)))]  # noqa: E731
    return statistics.median(times), pick(0.2), pick(0.8)


def timer(args, device: torch.device):
    """The timer of the cached cases: CUDA events on a GPU, a few wall-clock runs on CPU."""
    if device.type == "cuda":
        return lambda fn: time_gpu(fn, args.warmup, args.iters)
    return lambda fn: time_host(fn, 1, 3, device)


def make_inputs(shape: Shape, world_size: int, device: torch.device, seed: int = 0):
    """Per rank bf16 x, top-k over all experts without repeats (DeepSeek-V3-like uniform
    routing), fp32 weights; plus the fp8 xs (None when H is not a multiple of 128)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    xs, idxs, ws = [], [], []
    for _ in range(world_size):
        xs.append(torch.randn(shape.tokens, shape.hidden, device=device, generator=gen).to(torch.bfloat16))
        scores = torch.rand(shape.tokens, shape.num_experts, device=device, generator=gen)
        idxs.append(scores.topk(shape.topk, dim=1).indices)
        ws.append(torch.rand(shape.tokens, shape.topk, device=device, generator=gen))
    xs8 = [per_token_cast_to_fp8(x) for x in xs] if shape.hidden % 128 == 0 else None
    return xs, xs8, idxs, ws


def cached_cases(lb, shape: Shape, xs, xs8, idxs, ws, num_sms: int):
    """The first (fresh) dispatch of ``lb`` (a loopback harness), then what to time over its
    handles: ``(handles, rows received, [(op, payload bytes, bytes per row, fn)])`` for cached
    dispatches (bf16, and fp8 when there are ``xs8``) and a bf16 combine."""
    first = lb.dispatch(xs, idxs, ws, shape.num_experts, num_sms=num_sms)
    handles = [r.handle for r in first]
    ys = [r.recv_x for r in first]
    received = sum(h.num_rows for h in handles)
    row_bf16 = shape.hidden * 2
    cases = [
        (
            "dispatch bf16",
            received * row_bf16,
            row_bf16,
            lambda: lb.dispatch(xs, idxs, ws, shape.num_experts, handles=handles, check=False, validate=False),
        ),
        ("combine bf16", received * row_bf16, row_bf16, lambda: lb.combine(ys, handles, check=False)),
    ]
    if xs8 is not None:
        row8 = shape.hidden + 4 * (shape.hidden // 128)
        cases.insert(
            1,
            (
                "dispatch fp8",
                received * row8,
                row8,
                lambda: lb.dispatch(xs8, idxs, ws, shape.num_experts, handles=handles, check=False, validate=False),
            ),
        )
    return handles, received, cases


def variant_names(requested: list[str], usable=None) -> list[str]:
    """The variants to time: ``requested`` ("all": every one of moe_dispatch.config.VARIANTS),
    "current" always first (the others' ratios are to it), kept only where ``usable(name)``."""
    from moe_dispatch.config import VARIANTS

    names = list(VARIANTS) if "all" in requested else list(dict.fromkeys(["current", *requested]))
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; the variants are {sorted(VARIANTS)} or 'all'")
    return [n for n in names if usable is None or usable(n)]


def add_variant_args(parser) -> None:
    parser.add_argument(
        "--variants",
        nargs="+",
        default=["current"],
        help="kernel variants (moe_dispatch.config.VARIANTS) to time side by side, or 'all' (default: current)",
    )
    parser.add_argument(
        "--estimate-only",
        action="store_true",
        help="print the GPU time this plan is predicted to take (the cost model: 2026-11-30 rates) and exit",
    )


def not_resident(err: Exception) -> bool:
    """Whether a launch failed because its blocks cannot all be resident (a variant without the
    register cap, one block per SM, in a loopback of many ranks): that row is skipped."""
    return isinstance(err, ValueError) and "resident at once" in str(err)


def time_variants(lb, variants: list[str], cases: list[tuple], prog: str, where: str, **fields):
    """Times every case ``(op, payload bytes, ..., run)`` (``run()`` gives median, p20, p80 in us)
    under each kernel variant (the loopback's ``set_variant``), yielding ``(case, row fields)``:
    ``fields`` (the configuration's) with the op, variant, times, bytes and vs_current (the
    current kernels' median over this one; None until the current kernels ran the op). A variant
    whose blocks are not all resident is skipped (said on stdout: ``prog: variant at where: not
    resident, skipped``). Ends on the current kernels."""
    current: dict[str, float] = {}
    for variant in variants:
        lb.set_variant(variant)
        for case in cases:
            op = case[0]
            try:
                med, p20, p80 = case[-1]()
            except ValueError as err:
                if not_resident(err):
                    print(f"{prog}: {variant} at {where}: not resident, skipped")
                    break
                raise
            if variant == "current":
                current[op] = med
            timing = {"op": op, "variant": variant, "median_us": med, "p20_us": p20, "p80_us": p80, "bytes": case[1]}
            yield case, {**fields, **timing, "vs_current": ratio(current.get(op), med)}
    lb.set_variant("current")


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def timed_runs(args, device: torch.device) -> int:
    """Launches one timed case costs: warmup and iterations (CPU: 1 + 3)."""
    return args.warmup + args.iters if device.type == "cuda" else 4


GOAL_FRESH = 1.1  # issue 21: a fresh dispatch at most 1.1x a cached one


def print_fresh_goal(op: str, fresh: list[tuple[str, float]]) -> None:
    """The fresh-dispatch goal line: ``fresh`` = (where, fresh time / cached time) per configuration."""
    if fresh:
        where, x = min(fresh, key=lambda p: p[1])
        print(
            f"goal: {op} <= {GOAL_FRESH}x the cached dispatch: {'met' if x <= GOAL_FRESH else 'MISSED'}, "
            f"best {x:.2f}x ({where}), worst {max(p[1] for p in fresh):.2f}x"
        )


def print_model_goal(what: str, ratios: list[float]) -> None:
    """The cost model's line: how many of ``what``'s model / measurement ratios are good."""
    if ratios:
        good = sum(MODEL_GOOD[0] <= x <= MODEL_GOOD[1] for x in ratios)
        print(
            f"model: {good}/{len(ratios)} {what} predicted within {MODEL_GOOD[0]}-{MODEL_GOOD[1]} of the measurement "
            f"(model/meas {min(ratios):.2f}..{max(ratios):.2f})"
        )


def print_estimate(name: str, steps: list[tuple[str, float]]) -> None:
    """``steps``: (what, predicted GPU seconds) of a plan."""
    total = sum(t for _, t in steps)
    print(f"{name}: predicted GPU time of this plan (moe_dispatch.costmodel, 2026-11-30 rates): {total:.1f} s")
    for what, t in steps:
        print(f"  {what}: {t:.1f} s")


def copy_row(row_type: type[Row], shape: Shape, world_size: int, nbytes: int, device: torch.device, args, **fields):
    """The baseline, a ``row_type`` row: a torch device-to-device copy of ``nbytes`` timed with
    CUDA events; ``fields``: the script's own ("-" where a configuration does not apply)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    med, p20, p80 = time_gpu(lambda: dst.copy_(src), args.warmup, args.iters)
    times = {"median_us": med, "p20_us": p20, "p80_us": p80}
    rate = nbytes / (med * 1e-6) / 1e9
    return row_type(
        **times,
        shape=shape.name,
        world_size=world_size,
        num_sms=0,
        op="d2d copy (torch)",
        variant="-",
        bytes=nbytes,
        copy_gbps=rate,
        **fields,
    )


def bench_parser(doc: str) -> argparse.ArgumentParser:
    """Both scripts' parser: ``doc``'s first paragraph as the description, and ``--shapes``."""
    parser = argparse.ArgumentParser(
        description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--shapes",
        nargs="+",
        default=None,
        choices=sorted(SHAPES),
        help="default: deepseek-v3 gpt-oss on GPU, tiny on CPU",
    )
    return parser


def add_run_args(parser, warmup: int, iters: int) -> None:
    """The arguments both scripts end with (their own defaults of warmup and iters)."""
    parser.add_argument("--warmup", type=int, default=warmup)
    parser.add_argument("--iters", type=int, default=iters)
    parser.add_argument("--timeout-s", type=float, default=30.0)
    parser.add_argument("--json", default=None, help="write the rows and the environment here")


def start(name: str, args, unmeasured: str, defaults: dict[str, tuple], plan) -> torch.device:
    """The device to run on, a GPU when there is one, else CPU (saying that such a run checks the
    script and measures no GPU ``unmeasured``), with the flags left unset at its defaults
    (:func:`set_defaults`), after printing the predicted GPU time of the run (``plan()``: its
    ``(what, predicted GPU seconds)`` steps; a placeholder on CPU). With ``--estimate-only`` it
    prints that of the GPU's plan and exits 0; it exits 1, saying why on stderr, when the
    extension is not built."""
    if args.estimate_only:
        set_defaults(args, True, defaults)
        print_estimate(name, plan())
        raise SystemExit(0)
    if not _ext.extension_status().built:
        print(f"{name}: the extension is not built ({_ext.extension_status().error})", file=sys.stderr)
        raise SystemExit(1)
    on_gpu = _ext.cuda_available() and torch.cuda.is_available()
    if not on_gpu:
        print(
            f"{name}: no GPU: running the CPU backend on a tiny shape to check the script; "
            f"GPU {unmeasured} not measured"
        )
    set_defaults(args, on_gpu, defaults)
    print_estimate(name, plan() if on_gpu else [("(a GPU run of this plan)", 0.0)])
    return torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")


def set_defaults(args, on_gpu: bool, defaults: dict[str, tuple]) -> None:
    """Sets each flag of ``args`` left None to its default on a GPU (``on_gpu``) or CPU:
    ``defaults`` maps a flag to its ``(GPU, CPU)`` defaults; ``--shapes``: deepseek-v3 gpt-oss
    on a GPU, tiny on CPU."""
    for flag, (gpu, cpu) in {"shapes": (["deepseek-v3", "gpt-oss"], ["tiny"]), **defaults}.items():
        if getattr(args, flag) is None:
            setattr(args, flag, gpu if on_gpu else cpu)


def model_ops(shape: Shape, ops) -> list[str]:
    """The ops of ``ops`` that ``shape`` runs (an FP8 dispatch needs hidden % 128 == 0)."""
    return [op for op in ops if op != "dispatch fp8" or shape.hidden % 128 == 0]


def shapes_for(args) -> list[Shape]:
    """The shapes of ``--shapes`` (after :func:`set_defaults`)."""
    return [SHAPES[s] for s in args.shapes]


def cell(value: float | None, spec: str) -> str:
    """A table cell: ``value`` formatted by ``spec``, or "-" for None."""
    return "-" if value is None else format(value, spec)


def print_variant_ratios(title: str, rows: list[Row], columns: list[str], key) -> None:
    """The variants of ``rows`` side by side, when there are several: per configuration and op
    (``key(row)``, a tuple of the cells under ``columns``), the current kernels' time over each
    variant's (> 1: the variant is faster; "-": not timed there, e.g. not resident), after a
    blank line."""
    variants = list(dict.fromkeys(r.variant for r in rows))
    if len(variants) < 2:
        return
    print()
    by = {(key(r), r.variant): r for r in rows}
    print_rows(
        title,
        [*columns, *variants],
        [
            [*k, *(cell(by[k, v].vs_current if (k, v) in by else None, ".2f") for v in variants)]
            for k in dict.fromkeys(key(r) for r in rows)
        ],
    )


def print_rows(title: str, columns: list[str], rows: list[list[str]]) -> None:
    """A table of formatted cells, titled: rich (the machine's own package) when installed, else
    plain lines. No vertical rules: gpu_check.sh's summary picks rows by whitespace columns."""
    try:
        from rich import box
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(f"{title}\n" + "  ".join(columns))
        for row in rows:
            print("  ".join(row))
        return
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for column in columns:
        table.add_column(column, no_wrap=True)
    for row in rows:
        table.add_row(*row)
    Console(width=240).print(table)


def write_json(
    path: str | None, device: torch.device, rows: list[Row], variants: list[str], byte_formula: str, **env
) -> None:
    """The rows (with their derived gbps_per_sm and model_ratio) and the environment (device,
    torch, gpu, ``env``, the kernel variants timed, the byte formula) to ``path``; nothing
    without a path."""
    if path is None:
        return
    on_gpu = device.type == "cuda"
    env = {
        "device": torch.cuda.get_device_name(device) if on_gpu else platform.processor() or "cpu",
        "torch": torch.__version__,
        "gpu": on_gpu,
        **env,
        "variants": variants,
        "byte_formula": byte_formula,
    }
    with open(path, "w") as f:
        json.dump(
            {
                "env": env,
                "rows": [
                    dict(dataclasses.asdict(r), gbps_per_sm=r.gbps_per_sm, model_ratio=r.model_ratio) for r in rows
                ],
            },
            f,
            indent=1,
        )
