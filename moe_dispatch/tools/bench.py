"""The main job: dispatch + combine on routing shaped like real models, checked and timed.

``moe-dispatch-bench`` (or ``python -m moe_dispatch.tools.bench``). Without ``torchrun`` it spawns a
CPU world (gloo, default 8 processes = 2 nodes x 4 ranks); under ``torchrun`` (``RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE`` set) each process is one rank, on NCCL when CUDA is there.

Per model it
  1. builds every rank's inputs from one shared seed (:mod:`moe_dispatch.testing.routing`), so each rank
     checks its own dispatch outputs and combine output against :mod:`moe_dispatch.reference`
     with ``torch.equal`` (exact: data movement plus a fixed-order reduction);
  2. counts the hidden-payload bytes our hierarchy moves inside and across nodes, against the
     de-duplication lower bound and against a flat all-to-all (each token once to each rank that
     holds it);
  3. times dispatch and combine (the public ``Buffer`` calls, layout included) and a bare
     ``all_to_all_single`` moving the flat payload with precomputed splits, interleaved in the
     same iterations; each iteration's time is the max over ranks.

Only rank 0 prints: where the ranks run (host of each node), one table per model (with the
cross-node rate per rank, the analogue of a GPU's RDMA bandwidth), a summary line with the goal
(ours / flat <= 1.2), and a JSON file with every figure, the configuration, the hosts, torch
version, date and git commit. ``benchmarks/multinode/`` launches it on real clusters (torchrun,
Slurm).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import platform
import socket
import statistics
import sys
import time
from typing import Callable

import torch
import torch.distributed as dist

from ..buffer import Buffer
from ..semantics import reference
from ..semantics.layout import get_dispatch_layout_reference
from ..testing import routing
from ..testing.launch import launch_ranks, spawn_world
from .env import source_commit

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
GOAL_RATIO = 1.2  # goal figure: (ours dispatch + combine) / (flat dispatch + combine), medians
# CPU defaults keep `make demo` (3 models, 8 processes on 2 cores) well under 3 minutes.
CPU_HIDDEN_SCALE, CPU_ITERS, CPU_WARMUP = 0.125, 10, 2
GPU_ITERS, GPU_WARMUP = 50, 10
DEFAULT_TIMEOUT_S = 300.0  # Buffer's own default: a rank that never joins fails the run after this
# What the figures mean: printed under every table and stored in the JSON.
DEFINITIONS = {
    "bytes": "rows x H x element size of hidden payload moved per direction (dispatch; combine moves the same "
    "rows back), summed over ranks; metadata excluded; rows a rank keeps for itself are not counted",
    "lower_bound_internode": "sum over tokens t of |nodes(t) minus the source's node| x H x element size",
    "latency_ms": "per iteration the max over ranks; median, min, max, p10, p90 over the timed iterations",
    "ours": "Buffer.dispatch / Buffer.combine, layout and checks included",
    "flat": "one bare all_to_all_single over all ranks moving each token once to each rank holding it "
    "(splits precomputed, send buffer prebuilt), and its reverse for combine; timed in the same iterations",
    "ratio_ours_over_flat": "median(ours) / median(flat); total = (dispatch + combine) medians",
    "bandwidth_gbs_per_rank": "bytes (above) / world size / median latency, in GB/s (1e9 B/s): the average rate per "
    "rank (per GPU), cross-node (RDMA on a GPU cluster) and intra-node (NVLink); "
    "None where no bytes cross",
}
# glibc settings for the CPU world's processes (unless already set): freed buffers stay in the
# heap, so the tens of MB each dispatch allocates do not page-fault afresh on every call (what
# the CUDA caching allocator gives on GPU). The flat baseline reuses its buffers either way.
CPU_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 36)}


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """One benchmark run (picklable: it travels to the spawned ranks).

    Attributes:
        models: preset names of :data:`moe_dispatch.testing.routing.PRESETS`.
        num_tokens: T, tokens per rank.
        hidden_scale: factor on each model's hidden size (1.0 = full size).
        world_size: W; ranks_per_node: L (W = nodes x L).
        iters: timed iterations; warmup: untimed ones before.
        dtype: key of :data:`DTYPES`.
        seed: the shared seed every rank's inputs derive from.
        timeout_s: bound, in seconds, on every collective (``Buffer(timeout_s=...)``; under
            torchrun also the process group's timeout).
    """

    models: tuple[str, ...]
    num_tokens: int
    hidden_scale: float
    world_size: int
    ranks_per_node: int
    iters: int
    warmup: int
    dtype: str
    seed: int
    timeout_s: float = DEFAULT_TIMEOUT_S


def _torchrun_env() -> tuple[int, int, int] | None:
    """``(rank, world_size, local_world_size)`` when launched by torchrun, else None."""
    keys = ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
    if not all(k in os.environ for k in keys):
        return None
    return tuple(int(os.environ[k]) for k in keys)  # type: ignore[return-value]


def _parse_args(argv: list[str] | None, torchrun: tuple[int, int, int] | None) -> tuple[BenchConfig, pathlib.Path]:
    parser = argparse.ArgumentParser(
        prog="moe-dispatch-bench",
        description="Hierarchical MoE dispatch/combine on DeepSeek-V3, Qwen3-30B-A3B and Mixtral-8x7B routing: "
        "checked against the oracle, bytes against the de-dup lower bound, time against a flat "
        "all_to_all_single. CPU world (gloo) by default; under torchrun one rank per process.",
    )
    parser.add_argument(
        "--models",
        nargs="+",
        choices=sorted(routing.PRESETS),
        default=list(routing.PRESETS),
        help="model presets to run (default: all)",
    )
    parser.add_argument("--num-tokens", type=int, default=4096, help="tokens per rank (default 4096)")
    parser.add_argument(
        "--hidden-scale",
        type=float,
        default=None,
        help=f"factor on each model's hidden size (default {CPU_HIDDEN_SCALE} on the CPU world, 1.0 with GPUs)",
    )
    parser.add_argument("--full", action="store_true", help="full hidden sizes (same as --hidden-scale 1)")
    parser.add_argument(
        "--world-size", type=int, default=None, help="ranks of the CPU world (default 8); under torchrun: WORLD_SIZE"
    )
    parser.add_argument(
        "--ranks-per-node",
        type=int,
        default=None,
        help="ranks per node L (default 4 on the CPU world, LOCAL_WORLD_SIZE under torchrun)",
    )
    parser.add_argument(
        "--iters", type=int, default=None, help=f"timed iterations (default {CPU_ITERS} on CPU, {GPU_ITERS} on GPU)"
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=None,
        help=f"untimed warm-up iterations (default {CPU_WARMUP} on CPU, {GPU_WARMUP} on GPU)",
    )
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="hidden payload dtype (default bf16)")
    parser.add_argument("--seed", type=int, default=0, help="shared seed of every rank's inputs (default 0)")
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help=f"bound in seconds on every collective: a rank that fails or never joins makes the others "
        f"raise CommError naming it (default {DEFAULT_TIMEOUT_S:g}; under torchrun also the "
        f"process group's timeout)",
    )
    parser.add_argument(
        "--json",
        type=pathlib.Path,
        default=pathlib.Path("bench_results/bench.json"),
        help="where to write the figures (default bench_results/bench.json)",
    )
    args = parser.parse_args(argv)

    gpu = torchrun is not None and torch.cuda.is_available()
    if args.full and args.hidden_scale not in (None, 1.0):
        parser.error(f"--full means --hidden-scale 1; got --hidden-scale {args.hidden_scale}")
    hidden_scale = 1.0 if args.full else args.hidden_scale
    if hidden_scale is None:
        hidden_scale = 1.0 if gpu else CPU_HIDDEN_SCALE
    if torchrun is not None:
        _, world_size, local_world_size = torchrun
        if args.world_size not in (None, world_size):
            parser.error(f"--world-size {args.world_size} disagrees with torchrun's WORLD_SIZE={world_size}")
        ranks_per_node = local_world_size if args.ranks_per_node is None else args.ranks_per_node
    else:
        world_size = 8 if args.world_size is None else args.world_size
        ranks_per_node = min(4, world_size) if args.ranks_per_node is None else args.ranks_per_node
    iters = args.iters if args.iters is not None else (GPU_ITERS if gpu else CPU_ITERS)
    warmup = args.warmup if args.warmup is not None else (GPU_WARMUP if gpu else CPU_WARMUP)
    for name, value, low in (
        ("--num-tokens", args.num_tokens, 1),
        ("--world-size", world_size, 1),
        ("--ranks-per-node", ranks_per_node, 1),
        ("--iters", iters, 1),
        ("--warmup", warmup, 0),
    ):
        if value < low:
            parser.error(f"{name} must be >= {low}, got {value}")
    if world_size % ranks_per_node != 0:
        parser.error(f"--ranks-per-node {ranks_per_node} must divide the world size {world_size}")
    if not hidden_scale > 0:
        parser.error(f"--hidden-scale must be positive, got {hidden_scale}")
    if not args.timeout_s > 0:
        parser.error(f"--timeout-s must be positive, got {args.timeout_s}")
    config = BenchConfig(
        models=tuple(dict.fromkeys(args.models)),
        num_tokens=args.num_tokens,
        hidden_scale=hidden_scale,
        world_size=world_size,
        ranks_per_node=ranks_per_node,
        iters=iters,
        warmup=warmup,
        dtype=args.dtype,
        seed=args.seed,
        timeout_s=args.timeout_s,
    )
    return config, args.json


# -- one rank ------------------------------------------------------------------------------------
def _rank_inputs(
    preset: routing.ModelPreset, config: BenchConfig, rank: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s ``(x [T, H], topk_idx [T, K] int64, topk_weights [T, K] fp32)`` on the CPU,
    from the shared seed; each model gets its own streams."""
    model_seed = routing.rank_seed(config.seed, sorted(routing.PRESETS).index(preset.name))
    gen = routing.make_generator(model_seed, rank)
    logits = routing.router_logits(config.num_tokens, preset.num_experts, gen)
    topk_idx, topk_weights = routing.select_experts(logits, preset)
    x = torch.randn(config.num_tokens, preset.hidden, generator=gen).to(DTYPES[config.dtype])
    return x, topk_idx, topk_weights


def _expert(recv_x: torch.Tensor, rank: int) -> torch.Tensor:
    """The stand-in expert: a function of the row and the holding rank only, so the oracle can
    rebuild every rank's output from the inputs, and a row combined from the wrong rank shows."""
    return recv_x * (rank + 1)


def _mismatches(pairs: list[tuple[str, torch.Tensor | None, torch.Tensor | None]], rank: int) -> list[str]:
    """One line per ``(name, got, oracle)`` pair that is not bit-identical (None must match None)."""
    out = []
    for name, got, want in pairs:
        got = got.cpu() if isinstance(got, torch.Tensor) else got
        if got is None or want is None:
            if got is not want:
                out.append(f"rank {rank}: {name}: got {type(got).__name__}, oracle {type(want).__name__}")
        elif got.shape != want.shape or got.dtype != want.dtype:
            out.append(
                f"rank {rank}: {name}: got {list(got.shape)} {got.dtype}, oracle {list(want.shape)} {want.dtype}"
            )
        elif not torch.equal(got, want):
            bad = (got != want).reshape(got.shape[0], -1).any(1)
            rows = torch.nonzero(bad).flatten()
            out.append(
                f"rank {rank}: {name}: {rows.numel()} of {got.shape[0]} rows differ from the oracle "
                f"(first: {rows[:5].tolist()})"
            )
    return out


def _summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    n = len(ordered)
    return {
        "median": statistics.median(ordered),
        "min": ordered[0],
        "max": ordered[-1],
        "p10": ordered[int(0.1 * (n - 1))],
        "p90": ordered[round(0.9 * (n - 1))],
    }


def _bench_model(buf: Buffer, preset: routing.ModelPreset, config: BenchConfig, sync: Callable[[], None]) -> dict:
    """Checks and times one model on this rank. Collective over the world. Returns the figures
    (reduced over ranks, identical on every rank)."""
    rank, world_size, ranks_per_node = buf.rank, buf.world_size, buf.topology.ranks_per_node
    device, dtype, num_experts = buf.device, DTYPES[config.dtype], preset.num_experts
    figures: dict = {
        "model": preset.name,
        "num_experts": num_experts,
        "topk": preset.topk,
        "hidden": preset.hidden,
        "hidden_full": routing.PRESETS[preset.name].hidden,
        "n_group": preset.n_group,
        "topk_group": preset.topk_group,
        "score_func": preset.score_func,
    }
    if num_experts % world_size != 0:
        figures["skipped"] = f"num_experts={num_experts} is not divisible by the world size {world_size}"
        return figures

    inputs = [_rank_inputs(preset, config, s) for s in range(world_size)]
    xs, topk_idxs, topk_weights = (list(t) for t in zip(*inputs))
    x, topk_idx, weights = (t.to(device) for t in inputs[rank])
    in_rank = [get_dispatch_layout_reference(t, num_experts, world_size, ranks_per_node)[3] for t in topk_idxs]

    # Correctness: this rank's dispatch outputs and combine output against the oracle, exactly.
    recv_x, recv_idx, recv_w, recv_per_expert, handle, _ = buf.dispatch(x, topk_idx, weights, num_experts)
    want = reference.dispatch(xs, topk_idxs, topk_weights, num_experts, ranks_per_node, ranks=[rank])[0]
    out, _ = buf.combine(_expert(recv_x, rank), handle)
    # This rank's combine output depends only on its own tokens and the rows its holders return
    # for them, so the oracle runs on a world where the other ranks send nothing: each holder r
    # then has exactly the expert output of my rows for r.
    alone = [t if s == rank else t[:0] for s, t in enumerate(topk_idxs)]
    ys = [_expert(xs[rank][in_rank[rank][:, r]], r) for r in range(world_size)]
    want_out = reference.combine(ys, alone, num_experts, ranks_per_node, ranks=[rank])[0]

    # The flat baseline: one all_to_all_single over the world, each token once per holding rank.
    flat_send_idx = torch.nonzero(in_rank[rank].t())[:, 1]  # destination-major, tokens ascending
    flat_send_splits = in_rank[rank].sum(0).tolist()
    flat_recv_splits = [int(in_rank[s][:, rank].sum()) for s in range(world_size)]
    flat_send = x[flat_send_idx.to(device)].view(torch.uint8)  # gloo moves bytes of any dtype
    flat_recv = flat_send.new_empty((sum(flat_recv_splits), flat_send.shape[1]))
    flat_back = flat_send.new_empty(flat_send.shape)
    dist.all_to_all_single(flat_recv, flat_send, flat_recv_splits, flat_send_splits, group=buf.group)

    errors = _mismatches(
        [
            ("recv_x", recv_x, want.recv_x),
            ("recv_topk_idx", recv_idx, want.recv_topk_idx),
            ("recv_topk_weights", recv_w, want.recv_topk_weights),
            ("num_recv_tokens_per_expert", recv_per_expert, want.num_recv_tokens_per_expert),
            ("combine output", out, want_out),
            ("flat baseline recv", flat_recv.view(dtype), want.recv_x),
        ],
        rank,
    )
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, errors, group=buf.group)
    errors = [e for rank_errors in gathered for e in rank_errors]
    figures["oracle_check"] = "failed" if errors else "passed"
    figures["mismatches"] = errors
    del xs, ys, want, want_out, recv_x, out

    # Bytes of hidden payload per direction (combine moves the same rows back).
    node, num_nodes = buf.topology.node, buf.num_nodes
    held_nodes = in_rank[rank].view(-1, num_nodes, ranks_per_node).any(2)
    other_node = torch.ones(world_size, dtype=torch.bool)
    other_node[node * ranks_per_node : (node + 1) * ranks_per_node] = False
    same_node_peer = ~other_node
    same_node_peer[rank] = False
    rows = torch.tensor(
        [
            handle.num_intranode_tokens,
            handle.num_internode_tokens,
            int(held_nodes.sum() - held_nodes[:, node].sum()),  # sum_t |nodes(t) \ {my node}|
            int(in_rank[rank][:, same_node_peer].sum()),
            int(in_rank[rank][:, other_node].sum()),
        ],
        dtype=torch.int64,
        device=device,
    )
    dist.all_reduce(rows, group=buf.group)
    row_bytes = preset.hidden * dtype.itemsize
    ours_intra, ours_inter, lower, flat_intra, flat_inter = (int(v) * row_bytes for v in rows.tolist())
    figures["bytes"] = {
        "row_bytes": row_bytes,
        "lower_bound_internode": lower,
        "ours": {
            "intranode": ours_intra,
            "internode": ours_inter,
            "internode_over_lower_bound": ours_inter / lower if lower else None,
        },
        "flat": {
            "intranode": flat_intra,
            "internode": flat_inter,
            "internode_over_lower_bound": flat_inter / lower if lower else None,
        },
    }

    # Timing: ours and the bare flat all_to_all_single interleaved in each iteration.
    def timed(fn):
        dist.barrier(group=buf.group)
        sync()
        start = time.perf_counter()
        result = fn()
        sync()
        return result, (time.perf_counter() - start) * 1e3

    samples = torch.zeros(config.iters, 4, dtype=torch.float64)
    for it in range(config.warmup + config.iters):
        (recv_x, *_, handle, _), t_dispatch = timed(lambda: buf.dispatch(x, topk_idx, weights, num_experts))
        y = _expert(recv_x, rank)
        _, t_combine = timed(lambda: buf.combine(y, handle))
        _, t_flat_dispatch = timed(
            lambda: dist.all_to_all_single(flat_recv, flat_send, flat_recv_splits, flat_send_splits, group=buf.group)
        )
        _, t_flat_combine = timed(
            lambda: dist.all_to_all_single(flat_back, flat_recv, flat_send_splits, flat_recv_splits, group=buf.group)
        )
        if it >= config.warmup:
            samples[it - config.warmup] = torch.tensor([t_dispatch, t_combine, t_flat_dispatch, t_flat_combine])
    samples = samples.to(device)
    dist.all_reduce(samples, op=dist.ReduceOp.MAX, group=buf.group)  # an iteration lasts as long as its slowest rank
    columns = samples.cpu().t().tolist()
    latency = {
        "ours": {"dispatch": _summary(columns[0]), "combine": _summary(columns[1])},
        "flat": {"dispatch": _summary(columns[2]), "combine": _summary(columns[3])},
    }
    for side, (d, c) in (("ours", columns[:2]), ("flat", columns[2:])):
        latency[side]["total"] = _summary([a + b for a, b in zip(d, c)])
    figures["latency_ms"] = latency
    ours, flat = ({op: latency[side][op]["median"] for op in ("dispatch", "combine")} for side in ("ours", "flat"))
    figures["ratio_ours_over_flat"] = {
        "dispatch": ours["dispatch"] / flat["dispatch"],
        "combine": ours["combine"] / flat["combine"],
        "total": (ours["dispatch"] + ours["combine"]) / (flat["dispatch"] + flat["combine"]),
    }
    figures["bandwidth_gbs_per_rank"] = {
        side: {
            op: {
                where: _gbs_per_rank(figures["bytes"][side][where], latency[side][op]["median"], world_size)
                for where in ("internode", "intranode")
            }
            for op in ("dispatch", "combine")
        }
        for side in ("ours", "flat")
    }
    return figures


def _gbs_per_rank(nbytes: int, median_ms: float, world_size: int) -> float | None:
    """Average rate per rank in GB/s of ``nbytes`` (summed over ranks) moved in ``median_ms``."""
    if nbytes <= 0 or median_ms <= 0:
        return None
    return nbytes / world_size / (median_ms * 1e-3) / 1e9


def node_hosts(hosts: list[str], ranks_per_node: int) -> list[list[str]]:
    """Per node (ranks ``[n*L, (n+1)*L)``), the distinct hosts its ranks run on, in rank order.

    A node whose ranks run on more than one host means ``ranks_per_node`` (``LOCAL_WORLD_SIZE``
    under torchrun) does not match the machines: the "intra-node" hop would cross the network.
    Several nodes on one host is fine (a simulated cluster, or a CPU world).
    """
    return [list(dict.fromkeys(hosts[n : n + ranks_per_node])) for n in range(0, len(hosts), ranks_per_node)]


def _layout(hosts: list[str], ranks_per_node: int) -> tuple[list[str], list[str]]:
    """``(lines describing where each node runs, warnings)`` for rank 0 to print."""
    per_node = node_hosts(hosts, ranks_per_node)
    lines = [
        f"node {n}: {', '.join(h)} (ranks {n * ranks_per_node}-{(n + 1) * ranks_per_node - 1})"
        for n, h in enumerate(per_node)
    ]
    if len(lines) > 8:  # 64 nodes need not fill the screen: first 4, last 2
        lines = lines[:4] + [f"... ({len(lines) - 6} more)"] + lines[-2:]
    warnings = [
        f"node {n} (ranks {n * ranks_per_node}-{(n + 1) * ranks_per_node - 1}) spans hosts {', '.join(h)}: "
        f"ranks_per_node={ranks_per_node} does not match the ranks per host, so the hierarchy's intra-node "
        f"hop crosses the network; set --ranks-per-node (torchrun: LOCAL_WORLD_SIZE = --nproc-per-node) "
        f"to the GPUs per host"
        for n, h in enumerate(per_node)
        if len(h) > 1
    ]
    return lines, warnings


def _run_rank(config: BenchConfig) -> tuple[list[dict], list[str]]:
    """Every model on this rank of an initialised world; returns ``(figures, host of each rank)``
    (all ranks agree). Rank 0 prints where the nodes run and one progress line per model."""
    device_is_cuda = dist.get_backend() == "nccl"
    sync = torch.cuda.synchronize if device_is_cuda else (lambda: None)
    buf = Buffer(ranks_per_node=config.ranks_per_node, timeout_s=config.timeout_s)
    hosts: list = [None] * buf.world_size
    dist.all_gather_object(hosts, socket.gethostname(), group=buf.group)
    if buf.rank == 0:
        lines, warnings = _layout(hosts, config.ranks_per_node)
        print(
            f"[moe-dispatch-bench] {buf.world_size} ranks = {buf.num_nodes} nodes x {config.ranks_per_node} "
            f"({dist.get_backend()}): " + "; ".join(lines),
            flush=True,
        )
        for line in warnings:
            print(f"[moe-dispatch-bench] WARNING: {line}", flush=True)
    results = []
    for name in config.models:
        preset = routing.PRESETS[name].with_hidden_scale(config.hidden_scale)
        start = time.perf_counter()
        figures = _bench_model(buf, preset, config, sync)
        if buf.rank == 0:
            state = figures.get("skipped") or f"oracle check {figures['oracle_check']}"
            print(f"[moe-dispatch-bench] {name}: {state} ({time.perf_counter() - start:.1f} s)", flush=True)
        results.append(figures)
    return results, hosts


def _world_rank(rank: int, world_size: int, config: BenchConfig) -> tuple[list[dict], list[str]] | None:
    """Entry point of each rank (spawned or under torchrun); rank 0 returns ``(figures, hosts)``."""
    figures_and_hosts = _run_rank(config)
    return figures_and_hosts if rank == 0 else None


# -- reporting (rank 0) ---------------------------------------------------------------------------
def _report(
    results: list[dict],
    config: BenchConfig,
    device: str,
    json_path: pathlib.Path,
    environment: dict | None = None,
    hosts: list[str] | None = None,
) -> int:
    """Prints the tables and the goal line, writes the JSON; returns the exit status.
    ``hosts``: the host of each rank (stored per node in the JSON's ``layout``)."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console()
    if not console.is_terminal:  # logs and pipes: wide enough for a table row per line
        console = Console(width=180)
    mb = 1e6
    nodes = config.world_size // config.ranks_per_node
    for fig in results:
        routing_desc = f"E={fig['num_experts']}, top-{fig['topk']}"
        if fig["n_group"] > 1:
            routing_desc += f", {fig['n_group']} groups / top-{fig['topk_group']}"
        title = (
            f"{fig['model']}: {routing_desc}, H={fig['hidden']} (full {fig['hidden_full']}), {config.dtype}, "
            f"{config.num_tokens} tokens/rank, W={config.world_size} = {nodes} nodes x {config.ranks_per_node}"
        )
        if "skipped" in fig:
            console.print(f"[yellow]{title}: skipped ({fig['skipped']})[/yellow]")
            continue
        b, lat, ratio = fig["bytes"], fig["latency_ms"], fig["ratio_ours_over_flat"]
        table = Table(title=title, title_justify="left")
        for col in (
            "",
            "intra-node MB",
            "cross-node MB",
            "cross / lower bound",
            "dispatch ms",
            "combine ms",
            "total ms",
            "cross-node GB/s/rank",
        ):
            table.add_column(col, justify="left" if not col else "right")

        def ms(s: dict) -> str:
            def num(v: float) -> str:  # about 3 significant digits, no exponent
                return f"{v:.{2 if v < 10 else 1 if v < 100 else 0}f}"

            return f"{num(s['median'])} ({num(s['min'])}-{num(s['max'])})"

        def over_lb(v: float | None) -> str:
            return "n/a" if v is None else f"{v:.2f}"

        def gbs(rates_by_op: dict) -> str:  # dispatch / combine
            rates = [rates_by_op[op]["internode"] for op in ("dispatch", "combine")]
            return "n/a" if None in rates else " / ".join(f"{r:.{3 if r < 1 else 1}f}" for r in rates)

        for label, side in (("ours (hierarchical)", "ours"), ("flat all_to_all_single", "flat")):
            table.add_row(
                label,
                f"{b[side]['intranode'] / mb:.2f}",
                f"{b[side]['internode'] / mb:.2f}",
                over_lb(b[side]["internode_over_lower_bound"]),
                ms(lat[side]["dispatch"]),
                ms(lat[side]["combine"]),
                ms(lat[side]["total"]),
                gbs(fig["bandwidth_gbs_per_rank"][side]),
            )
        table.add_row(
            "ours / flat",
            "",
            "",
            "",
            f"{ratio['dispatch']:.2f}",
            f"{ratio['combine']:.2f}",
            f"{ratio['total']:.2f}",
            "",
            style="bold",
        )
        check = (
            "[green]passed[/green]"
            if fig["oracle_check"] == "passed"
            else f"[bold red]FAILED ({len(fig['mismatches'])} mismatches)[/bold red]"
        )
        elem = b["row_bytes"] // fig["hidden"]
        table.caption = (
            f"MB = rows x H x {elem} B of hidden payload per direction (combine moves the same back), summed over "
            f"ranks, metadata and rows kept by their own rank excluded. Lower bound = sum_t |nodes(t) \\ own node| "
            f"x H x {elem} B = {b['lower_bound_internode'] / mb:.2f} MB. ms = median (min-max) over {config.iters} "
            f"iterations of the max over ranks; ours = Buffer.dispatch/combine (layout included), flat = a bare "
            f"all_to_all_single of the flat payload (prebuilt send buffer), in the same iterations. "
            f"GB/s/rank = cross-node MB / W / median ms, dispatch / combine (per GPU: the RDMA rate). "
            f"Oracle check (torch.equal, every rank): {check}"
        )
        table.caption_justify = "left"
        console.print(table)
        for line in fig["mismatches"][:20]:
            console.print(f"[bold red]MISMATCH {escape(line)}[/bold red]")

    timed = [f for f in results if "skipped" not in f]
    failed = [f["model"] for f in timed if f["oracle_check"] != "passed"]
    worst = max(timed, key=lambda f: f["ratio_ours_over_flat"]["total"]) if timed else None
    goal = {
        "max_ratio_ours_over_flat_total": GOAL_RATIO,
        "worst_ratio": worst["ratio_ours_over_flat"]["total"] if worst else None,
        "worst_model": worst["model"] if worst else None,
        "met": bool(worst) and worst["ratio_ours_over_flat"]["total"] <= GOAL_RATIO,
    }
    if worst:
        mark = "[green]met[/green]" if goal["met"] else "[red]not met[/red]"
        console.print(
            f"goal: ours / flat all_to_all time (dispatch + combine medians) <= {GOAL_RATIO} on {device}: "
            f"{mark} (" + ", ".join(f"{f['model']} {f['ratio_ours_over_flat']['total']:.2f}" for f in timed) + ")"
        )
    if failed:
        console.print(
            f"[bold red]ORACLE CHECK FAILED for {', '.join(failed)}: results differ from "
            f"moe_dispatch.reference[/bold red]"
        )

    payload = {
        "config": dataclasses.asdict(config) | {"device": device, "environment": environment or {}},
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": source_commit()["commit"],
        "layout": {
            "num_nodes": nodes,
            "ranks_per_node": config.ranks_per_node,
            "node_hosts": node_hosts(hosts, config.ranks_per_node) if hosts else None,
        },
        "models": {f["model"]: f for f in results},
        "goal": goal,
        "definitions": DEFINITIONS,
        "oracle_check": "failed" if failed else "passed",
    }
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(payload, indent=2) + "\n")
    console.print(f"figures written to {json_path}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark; returns the exit status (1 when any oracle check failed).

    Args:
        argv: command-line arguments (default ``sys.argv[1:]``); see ``--help``.
    """
    torchrun = _torchrun_env()
    config, json_path = _parse_args(argv, torchrun)
    run_desc = (
        f"{config.world_size // config.ranks_per_node} nodes x {config.ranks_per_node}), "
        f"{config.num_tokens} tokens/rank, hidden x{config.hidden_scale:g}, {config.iters} iterations, "
        f"collective timeout {config.timeout_s:g} s"
    )
    if torchrun is None:
        print(f"[moe-dispatch-bench] CPU world: {config.world_size} processes (gloo, {run_desc}", flush=True)
        # The ranks inherit the environment of the forkserver, which starts with the first world of
        # this process (a forkserver already running keeps its own).
        added = [k for k in CPU_MALLOC_ENV if k not in os.environ]
        os.environ.update({k: CPU_MALLOC_ENV[k] for k in added})
        malloc_env = {k: os.environ[k] for k in CPU_MALLOC_ENV}
        try:
            results, hosts = spawn_world(config.world_size, _world_rank, config, timeout_s=3600.0)[0]
        finally:
            for k in added:
                os.environ.pop(k, None)
        return _report(results, config, "the CPU world (gloo)", json_path, {"malloc_env": malloc_env}, hosts)

    rank, world_size, _ = torchrun
    if rank == 0:
        print(f"[moe-dispatch-bench] torchrun world: {world_size} ranks ({run_desc}", flush=True)
    # The process group is bounded like the Buffer: a peer that never joins fails the run instead of hanging it.
    out = launch_ranks(world_size, _world_rank, config, timeout_s=config.timeout_s)
    if out is None:  # not rank 0
        return 0
    results, hosts = out
    nodes = world_size // config.ranks_per_node
    device = (
        f"{nodes} nodes x {config.ranks_per_node} x {torch.cuda.get_device_name()} (NCCL)"
        if torch.cuda.is_available()
        else f"torchrun CPU world of {nodes} nodes x {config.ranks_per_node} (gloo)"
    )
    return _report(results, config, device, json_path, hosts=hosts)


if __name__ == "__main__":
    # Under torchrun, record() puts a failing rank's traceback into torchrun's error summary
    # (which names the rank and its host); elsewhere it changes nothing.
    from torch.distributed.elastic.multiprocessing.errors import record

    sys.exit(record(main)())
