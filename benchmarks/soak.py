"""Soak: N iterations of random dispatch/combine calls in one world, the oracle checked every
k-th; each rank's RSS, threads, file descriptors, shared-memory mappings and process groups
printed every interval; exits 1 on a mismatch or on growth past the bounds. Not a timed test.

Each iteration draws one case with a seeded ``random.Random`` (the same on every rank): a mode
(sync, async, hook, num_worst_tokens, cached, weighted, backward), a dtype (fp32, bf16, fp16,
the fp8 pair), T per rank, H, K, E and the share of -1 entries, and runs it
(``moe_dispatch.testing.cases``); every ``--check-every``-th iteration every rank compares its
outputs with the oracle bit for bit, and the ranks stop together at the first mismatch (with
``--keep-going`` they count the mismatched iterations and go on, so that one soak measures both).

Growth: the sample after ``--warmup`` iterations is each rank's baseline (gloo's and the
allocator's one-time state are in place by then); at every later interval its threads, fds,
shared-memory mappings and process groups may exceed the baseline by at most ``--slack``, its RSS
by at most ``--rss-growth-mib``.

CPU: spawns a gloo world (default 2 nodes x 2 ranks, ``--transport torch_dist``;
``--transport kernels`` runs the kernels' CPU backend, on any topology). Under torchrun: the launched
world (NCCL with CUDA tensors is not supported here: the cases are CPU tensors).
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import random
import sys
import time

import torch.distributed as dist
from rich.console import Console
from rich.table import Table

from moe_dispatch import Buffer
from moe_dispatch.testing.cases import OracleMismatch, random_case, run_case
from moe_dispatch.testing.launch import launch_ranks
from moe_dispatch.testing.resources import process_resources
from moe_dispatch.tools.env import source_commit

COUNTED = ("threads", "fds", "shm_mappings", "groups")  # must stay within --slack of the baseline


def growth(baseline: dict[str, int], sample: dict[str, int], slack: int, rss_growth_mib: float) -> list[str]:
    """What grew past the bounds from ``baseline`` to ``sample`` (``process_resources`` dicts), in words."""
    grown = [f"{k} {baseline[k]} -> {sample[k]}" for k in COUNTED if sample[k] > baseline[k] + slack]
    rss_mib = (sample["rss_kib"] - baseline["rss_kib"]) / 1024
    if rss_mib > rss_growth_mib:
        grown.append(f"RSS +{rss_mib:.1f} MiB (bound {rss_growth_mib:g})")
    return grown


def _rank(rank: int, world_size: int, args: argparse.Namespace) -> dict | None:
    buf = Buffer(ranks_per_node=args.ranks_per_node, transport=args.transport, timeout_s=args.timeout_s)
    rng = random.Random(args.seed)
    console = Console()
    samples, modes, rows = [], collections.Counter(), 0
    baseline, mismatch, checks, mismatched = None, None, 0, 0
    start = time.monotonic()
    done = 0
    for it in range(1, args.iterations + 1):
        case = random_case(
            rng, (world_size, args.ranks_per_node), max_tokens=args.max_tokens, max_hidden=args.max_hidden
        )
        check, new = it % args.check_every == 0, False
        try:
            run_case(buf, rank, case, check=check)
        except OracleMismatch as err:
            mismatch = mismatch or f"EP rank {rank}, iteration {it}: {err}"
            new = True
        done, checks = it, checks + check
        modes[case["mode"]] += 1
        rows += sum(case["tokens"])
        if check:  # stop together at the first mismatch, or count it with --keep-going
            found = [None] * world_size
            dist.all_gather_object(found, (mismatch, new))
            if any(n for _, n in found):
                mismatched += 1
                mismatch = next(m for m, _ in found if m)
                if not args.keep_going:
                    break
        if it == args.warmup or it % args.interval == 0 or it == args.iterations:
            sample = [None] * world_size
            dist.all_gather_object(sample, process_resources())
            if baseline is None and it >= args.warmup:
                baseline = sample
            grown = (
                [g for base, now in zip(baseline, sample) for g in growth(base, now, args.slack, args.rss_growth_mib)]
                if baseline
                else []
            )
            samples.append({"iteration": it, "elapsed_s": time.monotonic() - start, "ranks": sample, "growth": grown})
            if rank == 0:
                console.print(_line(samples[-1], baseline), soft_wrap=True)
    buf.close()
    if rank != 0:
        return None
    return {
        "iterations": done,
        "checks": checks,
        "modes": dict(modes),
        "rows_per_rank": rows / world_size,
        "samples": samples,
        "baseline_iteration": args.warmup,
        "mismatch": mismatch,
        "mismatched_iterations": mismatched,
        "growth": [g for s in samples for g in s["growth"]],
    }


def _span(sample: list[dict], key: str, scale: float = 1.0) -> str:
    values = [s[key] / scale for s in sample]
    lo, hi = min(values), max(values)
    return f"{lo:.0f}" if lo == hi else f"{lo:.0f}-{hi:.0f}"


def _line(s: dict, baseline) -> str:
    ranks = s["ranks"]
    state = "[red]" + "; ".join(s["growth"]) + "[/]" if s["growth"] else ("baseline" if baseline is ranks else "flat")
    return (
        f"iteration {s['iteration']:>6} {s['elapsed_s']:7.1f} s  RSS {_span(ranks, 'rss_kib', 1024)} MiB  "
        f"threads {_span(ranks, 'threads')}  fds {_span(ranks, 'fds')}  shm {_span(ranks, 'shm_mappings')}  "
        f"groups {_span(ranks, 'groups')}  {state}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=10_000)
    parser.add_argument("--check-every", type=int, default=10, help="oracle check every k-th iteration")
    parser.add_argument("--interval", type=int, default=500, help="iterations between resource samples")
    parser.add_argument("--warmup", type=int, default=200, help="iterations before the baseline sample")
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--transport", choices=("torch_dist", "kernels"), default="torch_dist")
    parser.add_argument("--max-tokens", type=int, default=256, help="T per rank at most")
    parser.add_argument("--max-hidden", type=int, default=512, help="H at most")
    parser.add_argument("--slack", type=int, default=0, help="threads/fds/shm maps/groups allowed past the baseline")
    parser.add_argument("--rss-growth-mib", type=float, default=64.0, help="RSS growth allowed past the baseline")
    parser.add_argument("--timeout-s", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep-going", action="store_true", help="count oracle mismatches instead of stopping")
    parser.add_argument("--json", type=pathlib.Path, default=pathlib.Path("bench_results/soak.json"))
    args = parser.parse_args(argv)
    if not (1 <= args.warmup <= args.iterations and args.check_every >= 1 and args.interval >= 1):
        parser.error("need 1 <= --warmup <= --iterations, --check-every >= 1 and --interval >= 1")
    started = time.monotonic()
    result = launch_ranks(args.world_size, _rank, args)
    if result is None:
        return 0
    wall_s = time.monotonic() - started

    console = Console()
    table = Table(
        title=f"soak: {args.transport}, {args.world_size // args.ranks_per_node} nodes x {args.ranks_per_node}, "
        f"{result['iterations']} iterations, oracle every {args.check_every}",
        caption=f"per interval, min-max over ranks; bounds past the baseline (iteration {args.warmup}): "
        f"threads/fds/shm/groups +{args.slack}, RSS +{args.rss_growth_mib:g} MiB",
    )
    for col in ("iteration", "s", "RSS MiB", "threads", "fds", "shm maps", "groups", "growth"):
        table.add_column(col, justify="right" if col != "growth" else "left")
    for s in result["samples"]:
        ranks = s["ranks"]
        table.add_row(
            str(s["iteration"]),
            f"{s['elapsed_s']:.0f}",
            _span(ranks, "rss_kib", 1024),
            _span(ranks, "threads"),
            _span(ranks, "fds"),
            _span(ranks, "shm_mappings"),
            _span(ranks, "groups"),
            "; ".join(s["growth"]) or ("baseline" if s["iteration"] == args.warmup else "flat"),
        )
    console.print(table)
    ok = result["mismatch"] is None and not result["growth"] and result["iterations"] == args.iterations
    console.print(
        f"{result['iterations']} iterations ({', '.join(f'{m} {n}' for m, n in sorted(result['modes'].items()))}), "
        f"{result['checks']} checked against the oracle ({result['mismatched_iterations']} mismatched), "
        f"{result['rows_per_rank']:.0f} rows sent per rank, "
        f"{wall_s:.0f} s: " + ("[green]ok[/]" if ok else f"[red]FAILED[/] {result['mismatch'] or result['growth']}")
    )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(
            {
                "config": {k: str(v) for k, v in vars(args).items()},
                "git_commit": source_commit()["commit"],
                "wall_s": wall_s,
                "ok": ok,
                **result,
            },
            indent=1,
        )
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
