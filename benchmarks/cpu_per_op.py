"""Host CPU per MoE layer, ours (Megatron's flex dispatcher with the "custom" backend) beside
Megatron's alltoall dispatcher, in one gloo world, interleaved: forward dispatch, forward
combine, and the backward of both, each timed as process CPU (every thread: the Python ones and
gloo's) and as wall time, averaged over the ranks.

Why CPU: on a machine with fewer cores than ranks (the 2-core CI machine runs 4), a collective
waits for every rank's host work, so an operation's wall time follows the CPU all ranks spend
on it, not only its own rank's. Ratios of one run are what to compare (the machine is noisy).

    .venv/bin/python benchmarks/cpu_per_op.py [--model mixtral-8x7b] [--num-tokens 256] [--hidden 256]

Not a timed test: it prints figures and, with ``--json``, writes them.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import resource
import time

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

from moe_dispatch.testing import routing
from moe_dispatch.testing.launch import spawn_world
from moe_dispatch.tools.quiet import NOTE as QUIET_NOTE
from moe_dispatch.tools.quiet import filter_known_warnings

KINDS = ("ours", "alltoall")
PHASES = ("dispatch", "combine", "backward")


def _process_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this process
    return usage.ru_utime + usage.ru_stime


def _rank(rank: int, world: int, args: dict) -> dict:
    """This rank's mean ``{kind: {phase: (cpu ms, wall ms)}}`` over the timed iterations."""
    filter_known_warnings()
    from moe_dispatch.tools import bench

    torch.set_num_threads(1)
    preset = routing.PRESETS[args["model"]]
    preset = preset.with_hidden_scale(args["hidden"] / preset.hidden)
    megatron = bench._Megatron(world)
    gen = torch.Generator().manual_seed(args["seed"] + rank)
    x = torch.randn(args["num_tokens"], preset.hidden, generator=gen).to(torch.bfloat16).requires_grad_(True)
    logits = torch.randn(args["num_tokens"], preset.num_experts, generator=gen)
    topk = logits.topk(preset.topk, dim=1).indices
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, topk, True)
    probs = (torch.softmax(logits, 1) * routing_map).requires_grad_(True)
    calls = {
        kind: bench._megatron_calls(
            megatron.dispatcher(preset, torch.bfloat16, kind, args["ranks_per_node"]), x, routing_map, probs
        )
        for kind in KINDS
    }
    sums = {kind: torch.zeros(len(PHASES), 2, dtype=torch.float64) for kind in KINDS}

    def timed(fn):
        dist.barrier()
        cpu, wall = _process_cpu_s(), time.perf_counter()
        out = fn()
        return out, torch.tensor([_process_cpu_s() - cpu, time.perf_counter() - wall], dtype=torch.float64)

    for it in range(args["warmup"] + args["iters"]):
        for kind in KINDS if it % 2 else KINDS[::-1]:  # each first in every other iteration
            dispatch, combine = calls[kind]
            recv, t_dispatch = timed(dispatch)
            out, t_combine = timed(lambda recv=recv, combine=combine: combine(recv[0] * 2))  # the "experts"
            out = out[0] if isinstance(out, tuple) else out
            _, t_backward = timed(lambda out=out: out.float().sum().backward())
            if it >= args["warmup"]:
                sums[kind] += torch.stack([t_dispatch, t_combine, t_backward])
    megatron.mdm.clear_buffers()
    return {kind: (s / args["iters"] * 1e3).tolist() for kind, s in sums.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(routing.PRESETS), default="mixtral-8x7b")
    parser.add_argument("--num-tokens", type=int, default=256, help="tokens per rank (default 256, make train's)")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size (default 256, make train's)")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--iters", type=int, default=150)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=pathlib.Path, default=None)
    args = vars(parser.parse_args(argv))
    print(QUIET_NOTE, flush=True)
    per_rank = spawn_world(args["ranks"], _rank, args, timeout_s=1800)
    mean = {
        kind: [[sum(r[kind][p][j] for r in per_rank) / len(per_rank) for j in range(2)] for p in range(len(PHASES))]
        for kind in KINDS
    }
    table = Table(
        title=f"host CPU and wall ms per MoE layer, mean over {args['ranks']} ranks ({args['ranks_per_node']} "
        f"per node), {args['model']} routing, {args['num_tokens']} tokens, hidden {args['hidden']}, bf16, "
        f"{args['iters']} iterations"
    )
    for col in (
        "phase",
        "CPU ours",
        "CPU alltoall",
        "ours / alltoall",
        "wall ours",
        "wall alltoall",
        "ours / alltoall",
    ):
        table.add_column(col, justify="left" if col == "phase" else "right")
    rows = [(name, mean["ours"][p], mean["alltoall"][p]) for p, name in enumerate(PHASES)]
    rows.append(
        (
            "layer",
            *[[sum(m[p][j] for p in range(len(PHASES))) for j in range(2)] for m in (mean["ours"], mean["alltoall"])],
        )
    )
    for name, ours, a2a in rows:
        table.add_row(
            name,
            f"{ours[0]:.2f}",
            f"{a2a[0]:.2f}",
            f"{ours[0] / a2a[0]:.2f}",
            f"{ours[1]:.2f}",
            f"{a2a[1]:.2f}",
            f"{ours[1] / a2a[1]:.2f}",
        )
    Console(width=160).print(table)
    if args["json"] is not None:
        args["json"].write_text(
            json.dumps(
                {
                    "config": {k: str(v) for k, v in args.items()},
                    "mean_ms": {k: dict(zip(PHASES, v)) for k, v in mean.items()},
                },
                indent=1,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
