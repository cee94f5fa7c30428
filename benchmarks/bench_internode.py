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
pipeline is faster). ``--variants`` times the fused pipeline's kernel variants side by side over
the same buffers and handles (``moe_dispatch.config.VARIANTS`` compiled for the fused kernels;
ready flags are intranode only); the staged pipeline runs the current kernels.

Columns: payload GB/s = rows delivered x H x bytes / time; ``GB/s/SM`` = that / (W x sms);
``vs current`` = the current kernels' time / the variant's; ``model`` / ``model/meas``: the cost
model's prediction of a fused row (moe_dispatch.costmodel, not fitted to any fused run) and its
ratio to the measurement; ``xnode GB/s/rank`` = bytes that crossed a node boundary in stage 1 /
W / time (what each GPU's NIC would carry); ``xnode/bound`` = cross-node payload bytes over the
de-duplicated lower bound ``sum_t |nodes(t) minus own node| x H x bytes`` (goal: exactly 1.00);
``sms`` = SMs per rank. Goals (issue 21): 2x4 at 0.4 of a copy; a fresh dispatch with a budget
at most 1.1x a cached one.

Usage:
  python benchmarks/bench_internode.py                       # GPU: 2x4 and 4x2, DeepSeek-V3 + gpt-oss shapes
  python benchmarks/bench_internode.py --worlds 2x4 --num-sms 12 --variants all --json out.json
  python benchmarks/bench_internode.py ... --estimate-only   # the plan's predicted GPU time, no run
Without a GPU it runs the CPU backend on a tiny shape, to check the script (no goal measured).
"""

from __future__ import annotations

import dataclasses
import sys

import loopback_bench as bench
import torch

from moe_dispatch import costmodel
from moe_dispatch.config import VARIANTS, Config
from moe_dispatch.testing.loopback import InternodeLoopback
from moe_dispatch.transport.kernels.internode import cross_node_bytes

GOAL_BOUND = 1.00
GOAL_VS_COPY = 0.4  # 2x4
FRESH_BUDGET = "fresh dispatch bf16 (budget)"
# the plan's flags when not given: (on a GPU, on CPU)
DEVICE_DEFAULTS = {"worlds": (["2x4", "4x2"], ["2x2"]), "num_sms": ([6, 12, 24], [2])}
MODEL_OPS = {
    "dispatch bf16": ("dispatch", False),
    "dispatch fp8": ("dispatch", True),
    "combine bf16": ("combine", False),
}


def fused_variant(name: str) -> bool:
    """Variants the fused kernels run: their copies compiled for them, and not ready flags alone
    (intranode only: the current kernels here)."""
    return Config().with_variant(name).fused_copy and VARIANTS[name] != {"slot_flags": True}


@dataclasses.dataclass(kw_only=True)
class Row(bench.Row):
    """A row of one world (``NxL``) and pipeline ("-": the copy baseline); cross-node rate and bytes
    over the lower bound (None: the baseline)."""

    world: str
    pipeline: str
    xnode_gbps_per_rank: float | None = None
    xnode_vs_bound: float | None = None


def predicted_us(
    op: str, shape: bench.Shape, num_nodes: int, ranks_per_node: int, rows: float | None, config, num_sms: int
):
    """The cost model's time of a fused row (None for the ops it does not model)."""
    if op not in MODEL_OPS and op != FRESH_BUDGET:
        return None
    kind, fp8 = MODEL_OPS.get(op, ("dispatch", False))
    W = num_nodes * ranks_per_node
    workload = costmodel.Workload(
        shape.tokens, shape.hidden, shape.topk, shape.num_experts, W, ranks_per_node, fp8=fp8, rows=rows
    )
    t = costmodel.predict_internode(kind, workload, config, num_sms=num_sms).time_us
    return t + (costmodel.H200.notify_us if op == FRESH_BUDGET else 0.0)


def lower_bound_rows(handles, num_nodes: int, ranks_per_node: int) -> int:
    """sum over every rank's tokens of the nodes they reach other than their own."""
    total = 0
    for rank, h in enumerate(handles):
        in_node = h.is_token_in_node.clone()
        in_node[:, rank // ranks_per_node] = False
        total += int(in_node.sum())
    return total


def bench_world(
    shape: bench.Shape,
    num_nodes: int,
    ranks_per_node: int,
    num_sms_list: list[int],
    args,
    device: torch.device,
    pipeline: str,
    variants: list[str],
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
    xs, xs8, idxs, ws = bench.make_inputs(shape, W, device)
    time_case = bench.timer(args, device)
    rows: list[Row] = []
    copy_rate = None
    for num_sms in num_sms_list:
        lb.set_variant("current")
        handles, received, cases = bench.cached_cases(lb, shape, xs, xs8, idxs, ws, num_sms)
        bytes_bf16 = received * shape.hidden * 2
        if pipeline == "fused":
            budget = max(h.num_rows for h in handles) + 64
            cases.insert(
                1,
                (
                    FRESH_BUDGET,
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
        xnode_ratio = xnode_rows / bound if bound else 1.0
        if on_gpu and copy_rate is None:
            rows.append(bench.copy_row(Row, shape, W, bytes_bf16, device, args, world=world, pipeline="-"))
            copy_rate = rows[-1].gbps
        timed = [(op, nbytes, row_bytes, lambda fn=fn: time_case(fn)) for op, nbytes, row_bytes, fn in cases]
        labels = {"shape": shape.name, "world_size": W, "num_sms": num_sms, "world": world, "pipeline": pipeline}
        for (op, _, row_bytes, _), fields in bench.time_variants(
            lb,
            variants if pipeline == "fused" else ["current"],
            timed,
            "bench_internode",
            f"{world} x {num_sms} SMs",
            **labels,
        ):
            model = None
            if on_gpu and pipeline == "fused":
                model = predicted_us(op, shape, num_nodes, ranks_per_node, received / W, lb.config, num_sms)
            xnode_gbps = xnode_rows * row_bytes / W / (fields["median_us"] * 1e-6) / 1e9
            rows.append(
                Row(
                    **fields,
                    copy_gbps=copy_rate,
                    model_us=model,
                    xnode_gbps_per_rank=xnode_gbps,
                    xnode_vs_bound=xnode_ratio,
                )
            )
    lb.engines.check()  # a wait that timed out during the timings fails the benchmark here
    return rows


def parse_worlds(worlds: list[str]) -> list[tuple[int, int]]:
    """``NxL`` worlds as (N, L)."""
    return [tuple(int(v) for v in w.split("x")) for w in worlds]


def plan_estimate(args, variants: list[str]) -> list[tuple[str, float]]:
    """(what, predicted GPU seconds) per world of the flags' plan: every timed fused launch at the
    model's time for the expected routing, a staged one at twice the fused (2026-11-30: the staged
    pipeline ran at 0.19 of a copy, stage by stage), plus 2 s per world and 10 s to start."""
    runs, num_sms_list = args.warmup + args.iters, args.num_sms
    steps = [("process start, CUDA and Triton warm-up", 10.0)]
    for shape in bench.shapes_for(args):
        for num_nodes, ranks_per_node in parse_worlds(args.worlds):
            total = 2.0
            for pipeline in args.pipelines:
                config = Config(num_sms=max(num_sms_list), num_slots=args.slots, chunk_tokens=args.chunk)
                for num_sms in num_sms_list:
                    for variant in variants if pipeline == "fused" else ["current"]:
                        for op in bench.model_ops(
                            shape, [*MODEL_OPS, FRESH_BUDGET] if pipeline == "fused" else MODEL_OPS
                        ):
                            t = predicted_us(
                                op, shape, num_nodes, ranks_per_node, None, config.with_variant(variant), num_sms
                            )
                            total += runs * t * (1 if pipeline == "fused" else 2) * 1e-6
            steps.append((f"{shape.name} {num_nodes}x{ranks_per_node}", total))
    return steps


def print_table(rows: list[Row]) -> None:
    bench.print_rows(
        "internode loopback",
        [
            "shape",
            "world",
            "pipeline",
            "sms",
            *bench.TIMING_COLUMNS,
            *bench.MODEL_COLUMNS,
            "xnode GB/s/rank",
            "xnode/bound",
        ],
        [
            [r.shape, r.world, r.pipeline, str(r.num_sms), *r.timing_cells(), *r.model_cells()]
            + [bench.cell(r.xnode_gbps_per_rank, ".1f"), bench.cell(r.xnode_vs_bound, ".2f")]
            for r in rows
        ],
    )
    current = [r for r in rows if r.variant == "current"]
    staged = {(r.shape, r.world, r.num_sms, r.op): r.median_us for r in current if r.pipeline == "staged"}
    ratios = [
        [r.shape, r.world, str(r.num_sms), r.op, f"{staged[key] / r.median_us:.2f}"]
        for r in current
        if r.pipeline == "fused" and (key := (r.shape, r.world, r.num_sms, r.op)) in staged
    ]
    if ratios:
        bench.print_rows(
            "internode fused/staged (staged time / fused time)", ["shape", "world", "sms", "op", "ratio"], ratios
        )
    bench.print_variant_ratios(
        "fused variants: current time / variant time (> 1: faster), same run",
        [r for r in rows if r.pipeline == "fused"],
        ["shape", "world", "sms", "op"],
        lambda r: (r.shape, r.world, str(r.num_sms), r.op),
    )


def print_goals(rows: list[Row]) -> None:
    """The goals of issue 21 this run measured (greppable: "goal: ...")."""
    fused = [r for r in rows if r.pipeline == "fused"]
    at2x4 = [r for r in fused if r.world == "2x4" and r.op in ("dispatch bf16", "combine bf16")]
    for op in ("dispatch bf16", "combine bf16"):
        if b := max((r for r in at2x4 if r.op == op), key=lambda r: r.vs_copy or 0, default=None):
            verdict = "met" if (b.vs_copy or 0) >= GOAL_VS_COPY else "MISSED"
            print(
                f"goal: internode 2x4 {op} >= {GOAL_VS_COPY} of a copy: {verdict}, best {bench.cell(b.vs_copy, '.2f')} "
                f"({b.variant}, {b.shape}, {b.num_sms} SMs)"
            )
    cached = {(r.shape, r.world, r.num_sms, r.variant): r.median_us for r in fused if r.op == "dispatch bf16"}
    bench.print_fresh_goal(
        f"internode {FRESH_BUDGET}",
        [
            (f"{r.variant}, {r.shape} {r.world}", r.median_us / cached[k])
            for r in fused
            if r.op == FRESH_BUDGET and (k := (r.shape, r.world, r.num_sms, r.variant)) in cached
        ],
    )
    bench.print_model_goal("fused rows", [r.model_ratio for r in fused if r.model_ratio is not None])


def main(argv: list[str] | None = None) -> int:
    parser = bench.bench_parser(__doc__)
    parser.add_argument("--worlds", nargs="+", default=None, help="NxL worlds (default: 2x4 4x2 on GPU, 2x2 on CPU)")
    parser.add_argument("--num-sms", nargs="+", type=int, default=None, help="default: 6 12 24 on GPU, 2 on CPU")
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--chunk", type=int, default=8)
    parser.add_argument("--pipelines", nargs="+", default=["fused", "staged"], choices=["fused", "staged"])
    bench.add_variant_args(parser)
    bench.add_run_args(parser, warmup=2, iters=10)
    args = parser.parse_args(argv)
    variants = bench.variant_names(args.variants, fused_variant)

    device = bench.start("bench_internode", args, "figures", DEVICE_DEFAULTS, lambda: plan_estimate(args, variants))
    on_gpu = device.type == "cuda"
    if not on_gpu:
        args.slots, args.chunk = min(args.slots, 4), min(args.chunk, 2)
    rows: list[Row] = []
    for shape in bench.shapes_for(args):
        for num_nodes, ranks_per_node in parse_worlds(args.worlds):
            for pipeline in args.pipelines:
                rows += bench_world(shape, num_nodes, ranks_per_node, args.num_sms, args, device, pipeline, variants)
    print_table(rows)
    if on_gpu:
        print_goals(rows)
    bounds = [r.xnode_vs_bound for r in rows if r.xnode_vs_bound is not None]
    worst = max(abs(b - GOAL_BOUND) for b in bounds)
    print(
        f"\ngoal: cross-node bytes = the de-dup lower bound (1.00): "
        f"{'met' if worst < 1e-9 else 'MISSED'} ({min(bounds):.2f}..{max(bounds):.2f} over {len(bounds)} rows)"
    )
    formula = "payload rows delivered x row bytes; xnode = stage-1 rows from other nodes"
    bench.write_json(args.json, device, rows, variants, formula, slots=args.slots, chunk=args.chunk)
    return 0


if __name__ == "__main__":
    sys.exit(main())
