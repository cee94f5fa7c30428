"""Overlap benchmark: how much dispatch/combine time hides behind expert compute.

Per model shape, M micro-batches per step, every rank times four schedules in the same run:

  comm     dispatch + combine of every micro-batch, no expert compute
  compute  the experts of every micro-batch, no communication
  off      per micro-batch: dispatch, experts, combine, each waited for
  on       pipelined: micro-batch i+1 is dispatched and i-1 combined asynchronously (on the
           Buffer's communication thread / stream) while the experts of i compute
  static   as "on", with ``num_worst_tokens`` (static-size outputs): a dispatch makes no
           collective on the caller's thread, its counts travel with the transfer

hidden = 1 - (t_on - t_compute) / t_comm: the fraction of communication time that the overlap
removes from the step (1.0 = all of it), for "on" and "static". Goal (printed, not tested):
>= 0.70 where compute >= communication, in the static mode (the one made for overlap, as
DeepEP's). The first dispatch and the last combine of a step have nothing to hide behind, so
at most about 1 - 1/M can hide. Each time is the max over ranks, median over iterations.

On CPU a second table splits the exposed time of "static" (static - compute) into the caller's
waits for the first dispatch (fill), for later dispatches and for the last combines (drain),
the dispatch/combine calls, and how much slower the experts ran than alone: the CPU (and cache)
the transport took from them, which on a rank's own core cannot hide. CPU ranks keep the memory
they free (``moe_dispatch.launch.retain_freed_memory``), as the caching allocator does on a GPU:
otherwise every mode page-faults its freshly allocated tensors in, by an amount that depends on
what ran before (the expert compute alone moved by up to 30% between runs).

CPU (default): spawns a gloo world, 2 ranks = 2 nodes x 1, so each rank has a core for its compute
and the transfer mostly waits on sockets (``python -m benchmarks.simcluster overlap`` runs it on
rate-limited links, each rank pinned to its core). GPU: run under torchrun (NCCL).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import statistics
import time

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

from moe_dispatch import Buffer
from moe_dispatch.testing import routing
from moe_dispatch.testing.launch import launch_ranks, retain_freed_memory
from moe_dispatch.tools.env import source_commit

GOAL_HIDDEN = 0.70
MODES = ("comm", "compute", "off", "on", "static")
# Where the caller's thread spends a pipelined step: the wait for the first dispatch (nothing to
# hide behind), waits for later dispatches, the wait for the last combines (the same), the
# dispatch/combine calls themselves, and the experts (slower than alone by the CPU the transport
# takes from them).
PARTS = ("fill", "waits", "drain", "calls", "experts")


def _experts(
    recv_x: torch.Tensor,
    recv_topk_idx: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """A dense stand-in for the local experts: an FFN over every received row (the compute whose
    size decides how much communication can hide), written into ``out`` when given."""
    return torch.matmul(torch.nn.functional.gelu(recv_x @ w1), w2, out=out)


@contextlib.contextmanager
def _timed(parts: dict[str, float], name: str):
    start = time.perf_counter()
    yield
    parts[name] = parts.get(name, 0.0) + time.perf_counter() - start


def _step(buf: Buffer, batches, received, weights, num_experts: int, mode: str, parts: dict[str, float]) -> None:
    """One training-step's worth of MoE layers in ``mode``; ``received`` holds each micro-batch's
    dispatched rows, so "compute" runs the experts on exactly the rows the other modes see.
    ``parts`` gets the seconds the caller's thread spent in each part of a pipelined step
    (:data:`PARTS`; meaningful on CPU, where a wait returns when the transfer is done)."""
    w1, w2 = weights
    if mode == "compute":
        for recv_x, recv_idx in received:
            _experts(recv_x, recv_idx, w1, w2)
        return
    if mode in ("comm", "off"):
        for x, idx, w in batches:
            recv_x, recv_idx, *_, handle, _ = buf.dispatch(x, idx, w, num_experts)
            y = recv_x if mode == "comm" else _experts(recv_x, recv_idx, w1, w2)
            buf.combine(y, handle)
        return
    # "on" / "static": dispatch i+1 and combine i-1 are in flight while the experts of i compute.
    worst = {"num_worst_tokens": batches[0][0].shape[0] * buf.world_size} if mode == "static" else {}
    with _timed(parts, "calls"):
        pending = [buf.dispatch(*batches[0], num_experts, async_finish=True, **worst)]
    combines = []
    for i in range(len(batches)):
        if i + 1 < len(batches):
            with _timed(parts, "calls"):
                pending.append(buf.dispatch(*batches[i + 1], num_experts, async_finish=True, **worst))
        recv_x, recv_idx, *_, handle, event = pending[i]
        with _timed(parts, "fill" if i == 0 else "waits"):
            event.current_stream_wait()
        with _timed(parts, "experts"):
            if worst:  # the experts see the received rows only; combine ignores the padding rows
                rows = handle.plan.num_recv_tokens
                y = recv_x.new_empty(recv_x.shape)
                _experts(recv_x[:rows], recv_idx[:rows], w1, w2, out=y[:rows])
            else:
                y = _experts(recv_x, recv_idx, w1, w2)
        with _timed(parts, "calls"):
            combines.append(buf.combine(y, handle, async_finish=True)[1])
    with _timed(parts, "drain"):
        for event in combines:
            event.current_stream_wait()


def _rank(rank: int, world_size: int, args: argparse.Namespace) -> list[dict] | None:
    if not torch.cuda.is_available():  # first: threads pick their malloc arena when they start
        retain_freed_memory()  # as a caching allocator would: no page faults for memory freed and reused
    buf = Buffer(ranks_per_node=args.ranks_per_node, timeout_s=120)
    torch.manual_seed(args.seed)
    results = []
    for name in args.models:
        preset = routing.PRESETS[name].with_hidden_scale(args.hidden_scale)
        if preset.num_experts % world_size:
            continue
        batches = []
        for mb in range(args.micro_batches):
            gen = routing.make_generator(routing.rank_seed(args.seed, mb), rank)
            idx, w = routing.select_experts(routing.router_logits(args.num_tokens, preset.num_experts, gen), preset)
            x = torch.randn(args.num_tokens, preset.hidden, generator=gen).to(torch.bfloat16)
            batches.append((x.to(buf.device), idx.to(buf.device), w.to(buf.device)))
        ffn = int(preset.hidden * args.ffn_ratio)
        weights = (
            torch.randn(preset.hidden, ffn, dtype=torch.bfloat16, device=buf.device) / preset.hidden**0.5,
            torch.randn(ffn, preset.hidden, dtype=torch.bfloat16, device=buf.device) / ffn**0.5,
        )
        received = [buf.dispatch(*b, preset.num_experts)[:2] for b in batches]
        times = {m: [] for m in MODES}
        parts = {m: {p: [] for p in PARTS} for m in ("on", "static")}
        for it in range(args.warmup + args.iters):
            for mode in times:
                dist.barrier()
                if buf.device.type == "cuda":
                    torch.cuda.synchronize()
                spent: dict[str, float] = {}
                start = time.perf_counter()
                _step(buf, batches, received, weights, preset.num_experts, mode, spent)
                if buf.device.type == "cuda":
                    torch.cuda.synchronize()
                # The step time, then its parts: each the max over ranks.
                elapsed = torch.tensor(
                    [time.perf_counter() - start, *(spent.get(p, 0.0) for p in PARTS)], dtype=torch.float64
                )
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                if it >= args.warmup:
                    times[mode].append(float(elapsed[0]) * 1e3)
                    for p, seconds in zip(parts.get(mode, {}), elapsed[1:].tolist()):
                        parts[mode][p].append(seconds * 1e3)
        med = {m: statistics.median(v) for m, v in times.items()}
        # The spread: the figure of each iteration (its modes ran back to back), quartiles.
        per_iter = [1 - (s - c) / m for s, c, m in zip(times["static"], times["compute"], times["comm"])]
        spread = statistics.quantiles(per_iter, n=4, method="inclusive") if len(per_iter) > 1 else per_iter * 3
        results.append(
            {
                "model": name,
                "hidden": preset.hidden,
                "ffn": ffn,
                "device": buf.device.type,
                "median_ms": med,
                "hidden_fraction": 1 - (med["on"] - med["compute"]) / med["comm"],
                "hidden_fraction_static": 1 - (med["static"] - med["compute"]) / med["comm"],
                "hidden_fraction_static_quartiles": spread,
                "times_ms": times,  # per iteration, so runs can be pooled
                "compute_over_comm": med["compute"] / med["comm"],
            }
        )
        if buf.device.type == "cpu":  # a CUDA wait returns once queued: its parts would mean nothing
            results[-1]["parts_ms"] = {m: {p: statistics.median(v) for p, v in ps.items()} for m, ps in parts.items()}
    return results if rank == 0 else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=sorted(routing.PRESETS), choices=sorted(routing.PRESETS))
    parser.add_argument("--num-tokens", type=int, default=1024, help="tokens per rank per micro-batch")
    parser.add_argument("--micro-batches", type=int, default=8, help="per step (at most ~1 - 1/M can hide)")
    parser.add_argument("--hidden-scale", type=float, default=0.125)
    parser.add_argument("--ffn-ratio", type=float, default=2.0, help="expert FFN width / hidden")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--ranks-per-node", type=int, default=1)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=pathlib.Path, default=pathlib.Path("bench_results/overlap.json"))
    args = parser.parse_args(argv)

    if "LOCAL_WORLD_SIZE" in os.environ:  # torchrun: the launched nodes decide
        args.ranks_per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    results = launch_ranks(args.world_size, _rank, args)
    if results is None:
        return 0

    table = Table(
        title=f"overlap of dispatch/combine with expert compute ({args.micro_batches} micro-batches, "
        f"{args.num_tokens} tokens each), ms",
        caption="hidden = 1 - (on - compute) / comm; ms = "
        "median of the max over ranks; per iteration: quartiles of each iteration's static figure",
    )
    for col in ("model", *MODES, "compute/comm", "hidden on", "hidden static", "static per iteration"):
        table.add_column(col, justify="right")
    for r in results:
        m, (q1, _, q3) = r["median_ms"], r["hidden_fraction_static_quartiles"]
        table.add_row(
            r["model"],
            *(f"{m[k]:.1f}" for k in MODES),
            f"{r['compute_over_comm']:.2f}",
            f"{r['hidden_fraction']:.2f}",
            f"{r['hidden_fraction_static']:.2f}",
            f"{q1:.2f}-{q3:.2f}",
        )
    console = Console(width=max(120, Console().width))  # the table is wider than a default 80-column log
    console.print(table)
    eligible = [r for r in results if r["compute_over_comm"] >= 1]
    if not eligible:
        verdict = "not measured (no shape has compute >= comm: raise --ffn-ratio)"
    else:
        met = sum(r["hidden_fraction_static"] >= GOAL_HIDDEN for r in eligible)
        verdict = (
            f"{'met' if met == len(eligible) else 'not met'}: met on {met} of the {len(eligible)} shapes "
            f"with compute >= comm ({len(results)} shapes in all)"
        )
    if results and "parts_ms" in results[0]:
        parts = Table(
            title='where the exposed time of "static" goes (static - compute), ms per step',
            caption="fill: wait for the first dispatch; drain: for the last combines (nothing to hide "
            "behind: about comm / M); waits: for later dispatches; calls: dispatch/combine calls; "
            "experts slowed: experts in the step - compute alone (CPU the transport took)",
        )
        for col in ("model", "exposed", "fill", "waits", "drain", "calls", "experts slowed"):
            parts.add_column(col, justify="right")
        for r in results:
            m, p = r["median_ms"], r["parts_ms"]["static"]
            parts.add_row(
                r["model"],
                f"{m['static'] - m['compute']:.1f}",
                *(f"{p[k]:.1f}" for k in PARTS[:4]),
                f"{p['experts'] - m['compute']:.1f}",
            )
        console.print(parts)
    console.print(f"goal: hidden (static) >= {GOAL_HIDDEN} where compute >= comm: {verdict}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(
            {
                "config": {k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(args).items()},
                "torch": torch.__version__,
                "git_commit": source_commit()["commit"],
                "results": results,
            },
            indent=2,
        )
    )
    console.print(f"figures written to {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
