"""Loopback benchmark of the CUDA internode (hierarchical) kernels: N x L simulated ranks on one GPU.

Stage 1's RDMA puts are peer stores inside the GPU here, so the times measure the kernels'
efficiency (and the hierarchy's bytes), not a network. For each shape, world (``NxL``),
pipeline (``fused``: both stages in one kernel; ``staged``: stage 1, host reads, one intranode
operation per source node; ``Config.internode_pipeline``) and ``num_sms`` (SMs per simulated
rank) it times with CUDA events:

- ``dispatch bf16`` / ``dispatch fp8``: a cached dispatch;
- ``fresh dispatch bf16 (budget)`` (fused only): notify + dispatch with ``num_worst_tokens``,
  which never waits for the host;
- ``combine bf16``: in-node pre-reduction on the forwarders, then the node partials back;
- ``d2d copy``: a torch device-to-device copy of the bf16 dispatch payload, in the same run.
``fused/staged`` rows give the staged pipeline's time over the fused one's per op (> 1: the fused
pipeline is faster).

Columns: payload GB/s = rows delivered x H x bytes / time; ``xnode GB/s/rank`` = bytes that
crossed a node boundary in stage 1 / W / time (what each GPU's NIC would carry);
``xnode/bound`` = cross-node payload bytes over the de-duplicated lower bound
``sum_t |nodes(t) minus own node| x H x bytes`` (goal: exactly 1.00); ``sms`` = SMs per rank.

Usage:
  python benchmarks/bench_internode.py                       # GPU: 2x4 and 4x2, DeepSeek-V3 + gpt-oss shapes
  python benchmarks/bench_internode.py --worlds 2x4 --num-sms 8 16 --json out.json
Without a GPU it runs the CPU backend on a tiny shape, to check the script (no goal measured).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch
from loopback_bench import (
    Shape,
    add_run_args,
    add_shapes_arg,
    cached_cases,
    cell,
    launch_device,
    make_inputs,
    print_rows,
    shapes_for,
    time_copy,
    timer,
    write_json,
)

from moe_dispatch.config import Config
from moe_dispatch.transport.internode import InternodeLoopback, cross_node_bytes

GOAL_BOUND = 1.00


@dataclasses.dataclass
class Row:
    shape: str
    world: str
    pipeline: str
    num_sms: int
    op: str
    median_us: float
    p20_us: float
    p80_us: float
    bytes: int
    gbps: float
    vs_copy: float | None
    xnode_gbps_per_rank: float | None
    xnode_vs_bound: float | None


def lower_bound_rows(handles, num_nodes: int, ranks_per_node: int) -> int:
    """sum over every rank's tokens of the nodes they reach other than their own."""
    total = 0
    for rank, h in enumerate(handles):
        in_node = h.is_token_in_node.clone()
        in_node[:, rank // ranks_per_node] = False
        total += int(in_node.sum())
    return total


def bench_world(
    shape: Shape,
    num_nodes: int,
    ranks_per_node: int,
    num_sms_list: list[int],
    args,
    device: torch.device,
    pipeline: str,
) -> list[Row]:
    on_gpu = device.type == "cuda"
    world = f"{num_nodes}x{ranks_per_node}"
    W = num_nodes * ranks_per_node
    config = Config(
        num_sms=max(num_sms_list), num_slots=args.slots, chunk_tokens=args.chunk, internode_pipeline=pipeline
    )
    lb = InternodeLoopback(
        num_nodes, ranks_per_node, shape.hidden, shape.topk, config=config, device=device, timeout_s=args.timeout_s
    )
    xs, xs8, idxs, ws = make_inputs(shape, W, device)
    time_case = timer(args, device)
    rows: list[Row] = []
    copy_rate = None
    for num_sms in num_sms_list:
        handles, received, cases = cached_cases(lb, shape, xs, xs8, idxs, ws, num_sms)
        bytes_bf16 = received * shape.hidden * 2
        if pipeline == "fused":
            budget = max(h.num_rows for h in handles) + 64
            cases.insert(
                1,
                (
                    "fresh dispatch bf16 (budget)",
                    bytes_bf16,
                    shape.hidden * 2,
                    lambda: lb.dispatch(
                        xs,
                        idxs,
                        ws,
                        shape.num_experts,
                        num_sms=num_sms,
                        num_worst_tokens=budget,
                        check=False,
                        validate=False,
                    ),
                ),
            )
        xnode_rows = cross_node_bytes(handles, ranks_per_node, 1)
        bound = lower_bound_rows(handles, num_nodes, ranks_per_node)
        ratio = xnode_rows / bound if bound else 1.0
        if on_gpu and copy_rate is None:
            med, p20, p80, copy_rate = time_copy(bytes_bf16, device, args)
            rows.append(
                Row(
                    shape.name, world, "-", 0, "d2d copy (torch)", med, p20, p80, bytes_bf16, copy_rate, 1.0, None, None
                )
            )
        for op, nbytes, row_bytes, fn in cases:
            med, p20, p80 = time_case(fn)
            rate = nbytes / (med * 1e-6) / 1e9
            rows.append(
                Row(
                    shape.name,
                    world,
                    pipeline,
                    num_sms,
                    op,
                    med,
                    p20,
                    p80,
                    nbytes,
                    rate,
                    rate / copy_rate if copy_rate else None,
                    xnode_rows * row_bytes / W / (med * 1e-6) / 1e9,
                    ratio,
                )
            )
    lb.transport.check()  # a wait that timed out during the timings fails the benchmark here
    return rows


def print_table(rows: list[Row]) -> None:
    print_rows(
        "internode loopback",
        [
            "shape",
            "world",
            "pipeline",
            "sms",
            "op",
            "median us",
            "p20-p80 us",
            "GB/s",
            "vs copy",
            "xnode GB/s/rank",
            "xnode/bound",
        ],
        [
            [
                r.shape,
                r.world,
                r.pipeline,
                str(r.num_sms),
                r.op,
                f"{r.median_us:.1f}",
                f"{r.p20_us:.1f}-{r.p80_us:.1f}",
                f"{r.gbps:.1f}",
                cell(r.vs_copy, ".2f"),
                cell(r.xnode_gbps_per_rank, ".1f"),
                cell(r.xnode_vs_bound, ".2f"),
            ]
            for r in rows
        ],
    )
    staged = {(r.shape, r.world, r.num_sms, r.op): r.median_us for r in rows if r.pipeline == "staged"}
    ratios = [
        [r.shape, r.world, str(r.num_sms), r.op, f"{staged[key] / r.median_us:.2f}"]
        for r in rows
        if r.pipeline == "fused" and (key := (r.shape, r.world, r.num_sms, r.op)) in staged
    ]
    if ratios:
        print_rows(
            "internode fused/staged (staged time / fused time)", ["shape", "world", "sms", "op", "ratio"], ratios
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_shapes_arg(parser)
    parser.add_argument("--worlds", nargs="+", default=None, help="NxL worlds (default: 2x4 4x2 on GPU, 2x2 on CPU)")
    parser.add_argument("--num-sms", nargs="+", type=int, default=None, help="default: 8 16 24 on GPU, 2 on CPU")
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--chunk", type=int, default=8)
    parser.add_argument("--pipelines", nargs="+", default=["fused", "staged"], choices=["fused", "staged"])
    add_run_args(parser, warmup=2, iters=10)
    args = parser.parse_args(argv)

    device = launch_device("bench_internode")
    if device is None:
        return 1
    on_gpu = device.type == "cuda"
    shapes = shapes_for(args, device)
    worlds = [tuple(int(v) for v in w.split("x")) for w in (args.worlds or (["2x4", "4x2"] if on_gpu else ["2x2"]))]
    num_sms_list = args.num_sms or ([6, 12, 24] if on_gpu else [2])
    if not on_gpu:
        print(
            "bench_internode: no GPU: running the CPU backend on a tiny shape to check the script; "
            "GPU figures not measured"
        )
        args.slots, args.chunk = min(args.slots, 4), min(args.chunk, 2)
    rows: list[Row] = []
    for shape in shapes:
        for num_nodes, ranks_per_node in worlds:
            for pipeline in args.pipelines:
                rows += bench_world(shape, num_nodes, ranks_per_node, num_sms_list, args, device, pipeline)
    print_table(rows)
    bounds = [r.xnode_vs_bound for r in rows if r.xnode_vs_bound is not None]
    worst = max(abs(b - GOAL_BOUND) for b in bounds)
    print(
        f"\ngoal: cross-node bytes = the de-dup lower bound (1.00): "
        f"{'met' if worst < 1e-9 else 'MISSED'} ({min(bounds):.2f}..{max(bounds):.2f} over {len(bounds)} rows)"
    )
    if args.json:
        write_json(
            args.json,
            device,
            rows,
            slots=args.slots,
            chunk=args.chunk,
            byte_formula="payload rows delivered x row bytes; xnode = stage-1 rows from other nodes",
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
