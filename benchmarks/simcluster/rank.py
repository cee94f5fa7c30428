"""What runs inside a node's namespace (started by :class:`SimCluster.launch`).

``python -m benchmarks.simcluster.rank node <first rank> -- <rank argv>``
    the node process: imports torch once, forks the node's ranks, reaps them (:func:`node_main`).

``python -m benchmarks.simcluster.rank bench [--probe-mb MB] -- <moe-dispatch-bench args>``
    measures the links (:func:`probe_links`: intra-node, then, once the harness has set the
    inter-node rate, inter-node), rank 0 writes ``probe.json`` to the run folder, then runs
    the standalone benchmark ``moe_dispatch.tools.bench.main`` unchanged (its torchrun mode) in a
    fresh world on the next port.

``python -m benchmarks.simcluster.rank overlap -- <bench_overlap args>``
    ``benchmarks/bench_overlap.py`` (its torchrun mode) on the simulated links.
``python -m benchmarks.simcluster.rank fault --timeout-s S ...``
    dispatch + combine in a loop (bounded in count and time) with ``Buffer(timeout_s=S)``;
    marks progress in the run folder so the harness can strike mid-operation; on a
    ``CommError`` writes ``fault-rank<r>.json`` (operation, iteration, wall time, message) and
    exits with status 3 at once, as a crashed training process would.

Environment: torchrun's variables plus ``GLOO_SOCKET_IFNAME`` and ``SIMCLUSTER_RUN_DIR``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import statistics
import sys
import time
import traceback

import torch
import torch.distributed as dist

from .cluster import die_with_parent
from .faults import FAULT_EXIT_CODE

OTHER_ERROR_EXIT_CODE = 4


def _env_int(name: str) -> int:
    return int(os.environ[name])


def _write_text(path: pathlib.Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)  # the harness polls these files: it never sees half of one


def _write_json(path: pathlib.Path, payload: dict) -> None:
    _write_text(path, json.dumps(payload, indent=2) + "\n")


def _init(port: int, timeout_s: float) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{os.environ['MASTER_ADDR']}:{port}",
        rank=_env_int("RANK"),
        world_size=_env_int("WORLD_SIZE"),
        timeout=datetime.timedelta(seconds=timeout_s),
    )


# -- link probe -------------------------------------------------------------------------------
def _probe_group(group, peers: int, num_bytes: int, reps: int) -> float:
    """Median seconds of an equal-split all_to_all_single moving ``num_bytes`` to each peer."""
    send = torch.zeros((peers + 1) * num_bytes, dtype=torch.uint8)
    recv = torch.empty_like(send)
    times = []
    for _ in range(reps + 1):  # the first one warms the connections up
        dist.barrier()
        start = time.perf_counter()
        if group is not None:
            dist.all_to_all_single(recv, send, group=group)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def _probe(group, peers: int, num_mb: float, reps: int) -> dict | None:
    """One probe phase; every rank joins (the barriers are world-wide). None without peers."""
    if peers == 0:
        return None
    t = torch.tensor([_probe_group(group, peers, int(num_mb * 1e6), reps)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest group bounds the phase
    return {"seconds": float(t), "mb_per_s_per_rank": peers * num_mb / float(t)}


def probe_links(num_mb: float, run_dir: pathlib.Path, reps: int = 5, wait_s: float = 120.0) -> dict | None:
    """Per-rank throughput (MB/s sent to other ranks) inside nodes, then across nodes, every
    node busy at once (the traffic of stage 2 and of stage 1). Collective.

    Between the two, rank 0 writes ``intra.json`` and waits (at most ``wait_s``) for the
    harness's ``links.json``: the harness may set the inter-node rate from the intra-node figure.
    Returns the figures on rank 0 (None elsewhere).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    local_ranks = _env_int("LOCAL_WORLD_SIZE")
    num_nodes, node, local = world // local_ranks, rank // local_ranks, rank % local_ranks
    intra = (
        dist.new_group(list(range(node * local_ranks, (node + 1) * local_ranks)), use_local_synchronization=True)
        if local_ranks > 1
        else None
    )
    inter = (
        dist.new_group(list(range(local, world, local_ranks)), use_local_synchronization=True)
        if num_nodes > 1
        else None
    )
    out: dict = {"probe_mb_per_peer": num_mb, "reps": reps, "intra_node": _probe(intra, local_ranks - 1, num_mb, reps)}
    if rank == 0:
        _write_json(run_dir / "intra.json", out)
        deadline = time.monotonic() + wait_s
        while not (run_dir / "links.json").exists():  # bounded: the harness answers within seconds
            if time.monotonic() > deadline:
                raise RuntimeError(f"the harness did not write {run_dir / 'links.json'} within {wait_s:g} s")
            time.sleep(0.02)
        out["links"] = json.loads((run_dir / "links.json").read_text())
    dist.barrier()
    out["inter_node"] = _probe(inter, num_nodes - 1, num_mb, reps)
    if out["intra_node"] and out["inter_node"]:
        out["ratio"] = out["intra_node"]["mb_per_s_per_rank"] / out["inter_node"]["mb_per_s_per_rank"]
    return out if rank == 0 else None


def bench_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="simcluster rank bench")
    parser.add_argument("--probe-mb", type=float, default=2.0, help="MB per peer of the link probe")
    parser.add_argument("--probe-only", action="store_true", help="stop after the link probe")
    parser.add_argument("bench_args", nargs=argparse.REMAINDER, help="arguments of moe-dispatch-bench after --")
    args = parser.parse_args(argv)
    bench_args = args.bench_args[1:] if args.bench_args[:1] == ["--"] else args.bench_args
    port = _env_int("MASTER_PORT")
    torch.set_num_threads(1)
    run_dir = pathlib.Path(os.environ["SIMCLUSTER_RUN_DIR"])
    _init(port, 300)
    try:
        figures = probe_links(args.probe_mb, run_dir)
    finally:
        dist.destroy_process_group()
    if figures is not None:
        _write_json(run_dir / "probe.json", figures)
    if args.probe_only:
        return 0
    os.environ["MASTER_PORT"] = str(port + 1)  # a fresh store for the benchmark's own world
    from moe_dispatch.tools import bench

    return bench.main(bench_args)


def overlap_main(argv: list[str]) -> int:
    """``overlap -- <bench_overlap args>``: ``benchmarks/bench_overlap.py`` in its torchrun mode, so
    the overlap of communication with expert compute is measured on links that make the
    communication wait on the network rather than on this machine's cores."""
    overlap_args = argv[1:] if argv[:1] == ["--"] else argv
    torch.set_num_threads(1)
    from benchmarks import bench_overlap

    return bench_overlap.main(overlap_args)


# -- faults -----------------------------------------------------------------------------------
def fault_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="simcluster rank fault")
    parser.add_argument("--timeout-s", type=float, required=True)
    parser.add_argument("--model", default="deepseek-v3")
    parser.add_argument("--num-tokens", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--max-iters", type=int, default=200)
    parser.add_argument("--max-seconds", type=float, default=60.0)
    args = parser.parse_args(argv)

    from moe_dispatch import Buffer, CommError
    from moe_dispatch.testing import routing

    torch.set_num_threads(1)
    rank, local_ranks = _env_int("RANK"), _env_int("LOCAL_WORLD_SIZE")
    run_dir = pathlib.Path(os.environ["SIMCLUSTER_RUN_DIR"])
    _init(_env_int("MASTER_PORT"), 120)
    buf = Buffer(ranks_per_node=local_ranks, timeout_s=args.timeout_s)
    preset = routing.PRESETS[args.model]
    topk_idx, topk_weights = routing.generate_routing(preset, args.num_tokens, seed=0, rank=rank)
    x = torch.randn(args.num_tokens, args.hidden, generator=routing.make_generator(1, rank)).to(torch.bfloat16)

    phase = {"op": "warm-up", "iteration": -1}

    def mark(op: str, iteration: int) -> None:  # where this rank is, for the harness to strike
        phase.update(op=op, iteration=iteration)
        _write_json(run_dir / f"phase-rank{rank}.json", {"op": op, "iteration": iteration, "time": time.time()})

    try:
        recv_x, *_, handle, _ = buf.dispatch(x, topk_idx, topk_weights, preset.num_experts)
        buf.combine(recv_x, handle)
        dist.barrier()
        deadline = time.monotonic() + args.max_seconds
        for it in range(args.max_iters):
            if time.monotonic() > deadline:
                break
            mark("dispatch", it)
            recv_x, *_, handle, _ = buf.dispatch(x, topk_idx, topk_weights, preset.num_experts)
            mark("combine", it)
            buf.combine(recv_x, handle)
        mark("done", args.max_iters)
    except BaseException as err:  # noqa: BLE001 - reported to the harness, then out
        _write_json(
            run_dir / f"fault-rank{rank}.json",
            {
                "rank": rank,
                "op": phase["op"],
                "iteration": phase["iteration"],
                "time": time.time(),
                "error": type(err).__name__,
                "message": str(err),
            },
        )
        sys.stdout.flush()
        sys.stderr.flush()
        # no teardown collectives: the world may be broken (it is after a CommError)
        os._exit(FAULT_EXIT_CODE if isinstance(err, CommError) else OTHER_ERROR_EXIT_CODE)
    os._exit(0)  # no fault came (the harness reports a survivor without an error as a failure)


# -- the node process -----------------------------------------------------------------------
def node_main(argv: list[str]) -> int:
    """``node <first rank> -- <rank argv>``: forks this node's LOCAL_WORLD_SIZE ranks (torch is
    imported once, here), each pinned to one core and running ``main(<rank argv>)`` with RANK and LOCAL_RANK set and
    its output in ``rank<r>.log`` (rank 0 keeps stdout); writes ``rank<r>.pid`` and, when the
    rank is reaped, ``rank<r>.exit``. Returns 0 when every rank exited with 0."""
    first, rank_argv = int(argv[0]), argv[2:] if argv[1:2] == ["--"] else argv[1:]
    run_dir = pathlib.Path(os.environ["SIMCLUSTER_RUN_DIR"])
    children = {}
    for local in range(_env_int("LOCAL_WORLD_SIZE")):
        rank = first + local
        pid = os.fork()
        if pid == 0:  # the rank
            die_with_parent()
            os.environ.update(RANK=str(rank), LOCAL_RANK=str(local))
            # One core per rank (rank mod the cores allowed), as a launcher's CPU binding gives: a
            # rank's compute and communication threads then share its core, not its neighbour's.
            cores = sorted(os.sched_getaffinity(0))
            os.sched_setaffinity(0, {cores[rank % len(cores)]})
            log = os.open(run_dir / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(log, 2)
            if rank != 0:
                os.dup2(log, 1)
            code = 1
            try:
                code = main(rank_argv)
            except BaseException:  # noqa: BLE001 - printed to the rank's log, then out
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code if isinstance(code, int) else 1)
        children[pid] = rank
        _write_text(run_dir / f"rank{rank}.pid", str(pid))
    worst = 0
    for _ in range(len(children)):  # one reap per child
        pid, status = os.wait()
        code = os.waitstatus_to_exitcode(status)
        _write_text(run_dir / f"rank{children[pid]}.exit", str(code))
        worst = worst or code
    return 0 if worst == 0 else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    modes = {"bench": bench_main, "overlap": overlap_main, "fault": fault_main, "node": node_main}
    if not argv or argv[0] not in modes:
        print(f"usage: python -m benchmarks.simcluster.rank {{{','.join(modes)}}} ...", file=sys.stderr)
        return 2
    return modes[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
