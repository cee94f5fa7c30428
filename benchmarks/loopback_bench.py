"""What the loopback benchmarks (bench_intranode.py, bench_internode.py) share: the shapes, the
inputs, the timers, the first (fresh) dispatch, the timed cached cases, the d2d copy baseline,
the command line they have in common and the JSON they write."""

from __future__ import annotations

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
    "gpt-oss": Shape("gpt-oss", 4096, 2880, 4, 128),
    "tiny": Shape("tiny", 64, 256, 4, 32),
}


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


def time_copy(nbytes: int, device: torch.device, args) -> tuple[float, float, float, float]:
    """The baseline: a torch device-to-device copy of ``nbytes``: (median, p20, p80 us, GB/s)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    med, p20, p80 = time_gpu(lambda: dst.copy_(src), args.warmup, args.iters)
    return med, p20, p80, nbytes / (med * 1e-6) / 1e9


def add_shapes_arg(parser) -> None:
    parser.add_argument(
        "--shapes",
        nargs="+",
        default=None,
        choices=sorted(SHAPES),
        help="default: deepseek-v3 gpt-oss on GPU, tiny on CPU",
    )


def add_run_args(parser, warmup: int, iters: int) -> None:
    """The arguments both scripts end with (their own defaults of warmup and iters)."""
    parser.add_argument("--warmup", type=int, default=warmup)
    parser.add_argument("--iters", type=int, default=iters)
    parser.add_argument("--timeout-s", type=float, default=30.0)
    parser.add_argument("--json", default=None, help="write the rows and the environment here")


def launch_device(name: str) -> torch.device | None:
    """The device to run on (a GPU when there is one, else CPU); None, after saying why on
    stderr, when the extension is not built."""
    if not _ext.extension_status().built:
        print(f"{name}: the extension is not built ({_ext.extension_status().error})", file=sys.stderr)
        return None
    on_gpu = _ext.cuda_available() and torch.cuda.is_available()
    return torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")


def shapes_for(args, device: torch.device) -> list[Shape]:
    return [SHAPES[s] for s in (args.shapes or (["deepseek-v3", "gpt-oss"] if device.type == "cuda" else ["tiny"]))]


def cell(value: float | None, spec: str) -> str:
    """A table cell: ``value`` formatted by ``spec``, or "-" for None."""
    return "-" if value is None else format(value, spec)


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


def write_json(path: str, device: torch.device, rows: list, **env) -> None:
    """The rows (dataclasses) and the environment (``env`` after device, torch, gpu) to ``path``."""
    on_gpu = device.type == "cuda"
    env = {
        "device": torch.cuda.get_device_name(device) if on_gpu else platform.processor() or "cpu",
        "torch": torch.__version__,
        "gpu": on_gpu,
        **env,
    }
    with open(path, "w") as f:
        json.dump({"env": env, "rows": [dataclasses.asdict(r) for r in rows]}, f, indent=1)
