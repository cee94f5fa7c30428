"""``python -m benchmarks.simcluster`` (``make simcluster``): the benchmark and the fault drills
on a simulated multi-node cluster. Needs root and iproute2 (``ip``, ``tc``); see ``--help``.

    python -m benchmarks.simcluster [bench] [--nodes 2 4] [--ranks-per-node 4] [--ratio 9 | --rate-mbit R] ...
    python -m benchmarks.simcluster overlap [--nodes 2] [--rate-mbit 400] ...   # bench_overlap on the links
    python -m benchmarks.simcluster faults [--scenarios link-cut rank-kill] [--timeout-s 5] ...
    python -m benchmarks.simcluster cleanup      # namespaces left by a killed run
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import platform
import shutil
import signal
import sys
import tempfile
import time

from . import report
from .cluster import SetupError, SimCluster, missing_requirements, sweep_leftovers
from .faults import SCENARIOS, name_nodes, run_fault


class _Stopped(BaseException):
    """SIGTERM or SIGHUP arrived (a BaseException, so only main() catches it)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def say(console, message: str) -> None:
    """A plain progress line (no rich markup: "[simcluster]" would be read as a tag)."""
    console.print(message, markup=False, highlight=False)


def _bench_args(args) -> list[str]:
    out = [
        "--models",
        *args.models,
        "--num-tokens",
        *map(str, args.num_tokens),
        "--hidden-scale",
        str(args.hidden_scale),
        "--iters",
        str(args.iters),
        "--warmup",
        str(args.warmup),
        "--dtype",
        args.dtype,
        "--seed",
        str(args.seed),
    ]
    return out + ["--ranks-per-node", str(args.ranks_per_node)]


def _wait_for(path: pathlib.Path, cluster: SimCluster, timeout_s: float) -> dict:
    """Waits (bounded) for a rank's JSON file; fails early when a rank exits."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        dead = cluster.exit_codes()
        if dead:
            raise RuntimeError(f"ranks exited before writing {path.name}: exit codes {dead}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {path.name} within {timeout_s:g} s")
        time.sleep(0.05)
    return json.loads(path.read_text())


def bench_one(num_nodes: int, args, console) -> dict:
    """The link probe and ``moe-dispatch-bench`` on one simulated cluster; returns its record."""
    from moe_dispatch.tools import bench

    # The glibc settings moe-dispatch-bench gives its own CPU worlds (torchrun mode does not set them).
    malloc_env = getattr(bench, "CPU_MALLOC_ENV", {})
    run: dict = {"cluster": {"num_nodes": num_nodes, "ranks_per_node": args.ranks_per_node, "mtu": args.mtu}}
    run_dir = pathlib.Path(tempfile.mkdtemp(prefix="simcluster-bench-"))
    started = time.monotonic()
    try:
        rate = args.rate_mbit
        with SimCluster(
            num_nodes,
            args.ranks_per_node,
            rate_mbit=rate,
            delay_ms=args.delay_ms,
            mtu=args.mtu,
            log=lambda m: say(console, m),
        ) as cluster:
            say(
                console,
                f"[simcluster] starting {cluster.world_size} ranks: link probe, then moe-dispatch-bench "
                f"{' '.join(_bench_args(args))}",
            )
            sys.stdout.flush()
            cluster.launch(
                [
                    "bench",
                    "--probe-mb",
                    str(args.probe_mb),
                    "--",
                    *_bench_args(args),
                    "--json",
                    str(run_dir / "bench.json"),
                ],
                run_dir,
                env=malloc_env,
                rank0_stdout=sys.stdout,
            )
            intra = _wait_for(run_dir / "intra.json", cluster, args.start_timeout_s)["intra_node"]
            if args.rate_mbit is None and num_nodes > 1:
                # The ratio of per-rank throughputs inside and across nodes: a node's L ranks share its link.
                rate = args.ranks_per_node * intra["mb_per_s_per_rank"] * 8 / args.ratio
                cluster.set_rate(rate)
                say(
                    console,
                    f"[simcluster] intra-node {intra['mb_per_s_per_rank']:.0f} MB/s per rank -> inter-node "
                    f"links {rate:.0f} Mbit/s per node (target ratio {args.ratio:g} : 1)",
                )
            rate = cluster.rate_mbit
            (run_dir / "links.json").write_text(json.dumps({"rate_mbit": rate}))
            codes, hung = cluster.wait(args.timeout_s)
            run["cluster"].update(rate_mbit=rate, delay_ms=cluster.delay_ms, description=cluster.describe())
        run["exit_codes"] = codes
        run["probe"] = json.loads((run_dir / "probe.json").read_text()) if (run_dir / "probe.json").exists() else None
        if (run_dir / "bench.json").exists():
            run["bench"] = json.loads((run_dir / "bench.json").read_text())
        if hung or any(codes):
            run["error"] = f"ranks {hung} still running after {args.timeout_s:g} s" if hung else f"exit codes {codes}"
            tail = (run_dir / "rank0.log").read_text()[-3000:] if (run_dir / "rank0.log").exists() else ""
            say(console, f"[simcluster] {num_nodes} nodes: {run['error']}\n{tail}")
    except RuntimeError as err:
        run["error"] = str(err)
        say(console, f"[simcluster] {num_nodes} nodes failed: {err}")
        for log in sorted(run_dir.glob("rank*.log"))[:4]:
            say(console, f"--- {log.name} ---\n{log.read_text()[-1500:]}")
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    run["wall_s"] = time.monotonic() - started
    return run


def cmd_bench(args, console) -> int:
    if args.rate_mbit is None and args.ranks_per_node < 2:
        raise SystemExit("--ranks-per-node 1 has no intra-node traffic to scale the links from: give --rate-mbit")
    load_before = os.getloadavg()
    runs = [bench_one(n, args, console) for n in args.nodes]
    settings = {k: v for k, v in vars(args).items() if k not in ("func",)} | {
        "json": str(args.json),
        "png": str(args.png),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "cpus": os.cpu_count(),
        "kernel": platform.release(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    report.print_summary(runs, console)
    if max(load_before[0], os.getloadavg()[0]) > (os.cpu_count() or 1):
        console.print(
            f"[yellow]note: the machine was busy (load average {load_before[0]:.1f} before, "
            f"{os.getloadavg()[0]:.1f} after, {os.cpu_count()} CPUs): timings are noisy[/yellow]"
        )
    report.write_json(runs, settings, args.json)
    report.write_chart(runs, args.png)
    console.print(f"figures written to {args.json} and {args.png}")
    failed = [r for r in runs if r.get("error") or not r.get("bench") or r["bench"].get("oracle_check") != "passed"]
    return 1 if failed else 0


def cmd_overlap(args, console) -> int:
    """``benchmarks/bench_overlap.py`` on a simulated cluster with fixed-rate links."""
    overlap_args = [
        "--models",
        *args.models,
        "--num-tokens",
        str(args.num_tokens),
        "--micro-batches",
        str(args.micro_batches),
        "--hidden-scale",
        str(args.hidden_scale),
        "--ffn-ratio",
        str(args.ffn_ratio),
        "--iters",
        str(args.iters),
        "--json",
        str(args.json.resolve()),
    ]
    run_dir = pathlib.Path(tempfile.mkdtemp(prefix="simcluster-overlap-"))
    try:
        with SimCluster(
            args.nodes, args.ranks_per_node, rate_mbit=args.rate_mbit, mtu=args.mtu, log=lambda m: say(console, m)
        ) as cluster:
            say(console, f"[simcluster] {cluster.describe()}: bench_overlap {' '.join(overlap_args)}")
            sys.stdout.flush()
            cluster.launch(["overlap", "--", *overlap_args], run_dir, rank0_stdout=sys.stdout)
            codes, hung = cluster.wait(args.timeout_s)
        if hung or any(codes):
            tail = (run_dir / "rank0.log").read_text()[-3000:] if (run_dir / "rank0.log").exists() else ""
            say(console, f"[simcluster] overlap failed: exit codes {codes}, still running {hung}\n{tail}")
            return 1
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    return 0


def cmd_faults(args, console) -> int:
    from rich.markup import escape
    from rich.table import Table

    outcomes, problems = [], []
    for scenario in args.scenarios:
        knobs = {name: getattr(args, name) for name in ("ranks_per_node", "timeout_s", "rate_mbit", "slack_s")}
        outcome = run_fault(scenario, num_nodes=args.nodes, **knobs, log=lambda m: say(console, m))
        outcomes.append(outcome)
        table = Table(
            title=f"{scenario}: {outcome.fault}; Buffer(timeout_s={args.timeout_s:g}); "
            f"{outcome.wall_s:.1f} s set-up to teardown",
            title_justify="left",
        )
        for col in ("rank", "node", "exit", "failed in", "s after fault", "error"):
            table.add_column(col, justify="left" if col in ("failed in", "error") else "right")
        for r in outcome.ranks:
            if r["victim"]:
                table.add_row(str(r["rank"]), str(r["node"]), str(r["exit_code"]), "-", "-", "killed (the fault)")
                continue
            when = f"{r['seconds_after_fault']:.2f}" if "seconds_after_fault" in r else "-"
            what = "HUNG" if r["hung"] else escape(name_nodes(r.get("message", "(no report)")))
            table.add_row(
                str(r["rank"]),
                str(r["node"]),
                str(r["exit_code"]),
                f"{r.get('op', '-')} {r.get('iteration', '')}",
                when,
                what,
            )
        console.print(table)
        found = outcome.problems(args.slack_s)
        problems += [f"{scenario}: {p}" for p in found]
        console.print(
            f"{scenario}: "
            + (
                "[green]every survivor failed in time, naming the operation and its peers; cluster torn down[/green]"
                if not found
                else "[red]contract broken[/red]"
            )
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: str(v) for k, v in vars(args).items() if k != "func"}
    payload = {"settings": settings, "outcomes": [dataclasses.asdict(o) for o in outcomes], "problems": problems}
    args.json.write_text(json.dumps(payload, indent=2) + "\n")
    for p in problems:
        say(console, p)
    console.print(f"figures written to {args.json}")
    return 1 if problems else 0


def cmd_cleanup(args, console) -> int:
    removed = sweep_leftovers(lambda m: say(console, m))
    say(
        console,
        f"[simcluster] {len(removed)} leftover namespaces removed" if removed else "[simcluster] nothing left over",
    )
    return 0


def _parser() -> argparse.ArgumentParser:
    from moe_dispatch.testing import routing

    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.simcluster",
        description=(
            "A simulated multi-node cluster on one machine (network namespaces, tc-shaped inter-node links, "
            "intra-node traffic over loopback): moe-dispatch-bench (ours vs Megatron's alltoall dispatcher) and "
            "fault drills. "
            "Needs root and iproute2."
        ),
    )
    sub = parser.add_subparsers(dest="command")
    bench = sub.add_parser("bench", help="the benchmark per cluster size (default command)")
    bench.add_argument("--nodes", type=int, nargs="+", default=[2, 4], help="cluster sizes to run (default 2 4)")
    bench.add_argument("--ranks-per-node", type=int, default=4, help="L, ranks per node (default 4)")
    rate = bench.add_mutually_exclusive_group()
    rate.add_argument(
        "--ratio",
        type=float,
        default=9.0,
        help="set the inter-node rate so that intra-node : inter-node throughput per rank is this "
        "(measured intra-node figure; default 9, like NVLink : RDMA per GPU)",
    )
    rate.add_argument("--rate-mbit", type=float, default=None, help="fixed inter-node rate per node link, Mbit/s")
    bench.add_argument(
        "--delay-ms",
        type=float,
        default=None,
        help="one-way inter-node delay (netem); default 0.2 when the kernel has sch_netem, else 0",
    )
    bench.add_argument("--mtu", type=int, default=9000, help="MTU of the node links (default 9000)")
    bench.add_argument("--probe-mb", type=float, default=2.0, help="MB per peer of the link probe (default 2)")
    bench.add_argument("--models", nargs="+", choices=sorted(routing.PRESETS), default=list(routing.PRESETS))
    bench.add_argument(
        "--num-tokens", type=int, nargs="+", default=[1024], help="tokens per rank, a case each (default 1024)"
    )
    bench.add_argument("--hidden-scale", type=float, default=0.125, help="factor on hidden sizes (default 0.125)")
    bench.add_argument("--iters", type=int, default=10)
    bench.add_argument("--warmup", type=int, default=2)
    bench.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--start-timeout-s", type=float, default=180.0, help="bound on start-up and the link probe")
    bench.add_argument("--timeout-s", type=float, default=1200.0, help="bound on one cluster's whole run")
    bench.add_argument("--json", type=pathlib.Path, default=pathlib.Path("bench_results/simcluster.json"))
    bench.add_argument("--png", type=pathlib.Path, default=pathlib.Path("bench_results/simcluster.png"))
    bench.set_defaults(func=cmd_bench)

    overlap = sub.add_parser("overlap", help="benchmarks/bench_overlap.py on fixed-rate links")
    overlap.add_argument("--nodes", type=int, default=2)
    overlap.add_argument("--ranks-per-node", type=int, default=1)
    overlap.add_argument("--rate-mbit", type=float, default=400.0, help="inter-node rate per node link (default 400)")
    overlap.add_argument("--mtu", type=int, default=9000)
    overlap.add_argument("--models", nargs="+", choices=sorted(routing.PRESETS), default=list(routing.PRESETS))
    overlap.add_argument("--num-tokens", type=int, default=1024)
    overlap.add_argument("--micro-batches", type=int, default=8)
    overlap.add_argument("--hidden-scale", type=float, default=0.125)
    overlap.add_argument("--ffn-ratio", type=float, default=2.0)
    overlap.add_argument("--iters", type=int, default=5)
    overlap.add_argument("--timeout-s", type=float, default=900.0, help="bound on the whole run")
    overlap.add_argument("--json", type=pathlib.Path, default=pathlib.Path("bench_results/simcluster_overlap.json"))
    overlap.set_defaults(func=cmd_overlap)

    faults = sub.add_parser("faults", help="cut a node's link during a dispatch, kill a rank during a combine")
    faults.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    faults.add_argument("--nodes", type=int, default=2)
    faults.add_argument("--ranks-per-node", type=int, default=2)
    faults.add_argument("--timeout-s", type=float, default=5.0, help="the ranks' Buffer(timeout_s=...) (default 5)")
    faults.add_argument("--slack-s", type=float, default=5.0, help="grace after timeout_s before a rank counts as hung")
    faults.add_argument(
        "--rate-mbit",
        type=float,
        default=100.0,
        help="inter-node rate: slow, so that the fault lands inside the operation (default 100)",
    )
    faults.add_argument("--json", type=pathlib.Path, default=pathlib.Path("bench_results/simcluster_faults.json"))
    faults.set_defaults(func=cmd_faults)

    cleanup = sub.add_parser("cleanup", help="remove namespaces and processes left by a killed run")
    cleanup.set_defaults(func=cmd_cleanup)
    return parser


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("bench", "overlap", "faults", "cleanup", "-h", "--help"):
        argv.insert(0, "bench")
    console = Console() if sys.stdout.isatty() else Console(width=170)
    missing = missing_requirements()
    if missing and not {"-h", "--help"} & set(argv):  # said before the slow imports of the parser
        say(console, "simcluster: cannot build the simulated cluster on this machine; missing: " + "; ".join(missing))
        return 2
    args = _parser().parse_args(argv)

    def stop(signum, _frame):  # SIGTERM/SIGHUP: unwind so every `with SimCluster` tears down
        raise _Stopped(signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop)
    try:
        return args.func(args, console)
    except SetupError as err:
        console.print(f"simcluster: {err}", markup=False)
        return 2
    except KeyboardInterrupt:
        say(console, "simcluster: interrupted; the cluster was torn down")
        return 130
    except _Stopped as stopped:
        say(console, f"simcluster: stopped by signal {stopped.signum}; the cluster was torn down")
        return 128 + stopped.signum


if __name__ == "__main__":
    sys.exit(main())
