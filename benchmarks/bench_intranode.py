"""Loopback benchmark of the CUDA intranode kernels: W simulated ranks on one GPU.

For each shape, W, ring configuration, ``l2_discard`` setting, ``num_sms`` (SMs per simulated
rank; the launch holds W times as many blocks) and kernel variant (``--variants``:
``moe_dispatch.config.VARIANTS``, timed side by side over the same buffers and handles) it times,
with CUDA events over one launch serving all W ranks:

- ``dispatch`` bf16 and ``dispatch`` fp8 (e4m3 + scales): the dispatch kernel of a cached
  dispatch (the routing's notify done once before);
- ``combine`` bf16: every received row back to its source, fp32 sums in rank order;
- ``fresh dispatch bf16 (host read)``: layout, notify, the host reading the receive counts,
  dispatch (wall clock); ``fresh dispatch bf16 (budget)``: the same with ``num_worst_tokens``,
  which never waits for the host (CUDA events). Goal: at most 1.1x the cached dispatch.

Byte formula (payload delivered, top-k metadata excluded; b = bytes per element):
  dispatch  sum over receivers r of R_r * H * b        (fp8: R_r * (H + 4 H / 128))
  combine   the same rows * H * b                      (each row read once, sums written)
  copy      a device-to-device torch copy of the bf16 dispatch byte count, timed in the same run;
            its rate is bytes / time (each byte read once and written once, like a queue hop
            that stays in L2).
Columns: ``GB/s/SM`` = payload GB/s / (W x num_sms): what one SM moves (goal: 25 where HBM does not
bind, 4 ranks at 2-4 SMs); ``vs copy``; ``vs 2-hop`` = the rate against half the copy rate, the
loopback's own bound when the rings do not stay in L2 (every payload byte crosses HBM twice;
goal at 16 SMs: 0.9 without l2_discard); ``vs current`` = the current kernels' time / this
variant's (> 1: faster); ``model`` = the cost model's prediction (moe_dispatch.costmodel) and
``model/meas`` its ratio to the measured time (0.7-1.3 counts as good). A variant whose blocks
cannot all be resident (no register cap: one block per SM) is skipped for that configuration.
A slot that stays in L2 is still written back to HBM once evicted, unless its receiver discards
it after reading (``Config.l2_discard``): rings of W * W * C * slots * slot_bytes that fit the
50 MB L2 with l2_discard on should reach 0.6 of a copy.
On a real 8-GPU node the first hop is NVLink and the second a local copy; that needs
one process per GPU (Buffer(transport="kernels") or moe_dispatch.testing.ranks.IntranodeRank
under torchrun; not measured here).

Usage:
  python benchmarks/bench_intranode.py                            # GPU: EP8, DeepSeek-V3 + gpt-oss shapes
  python benchmarks/bench_intranode.py --world-sizes 4 --num-sms 2 4 --shapes deepseek-v3 qwen3 --variants all
  python benchmarks/bench_intranode.py ... --estimate-only        # the plan's predicted GPU time, no run
On a machine without a GPU it runs the CPU backend of the same protocol on a tiny shape, to
check the script (and prints the variants' CPU ratios); no goal is measured there.
"""

from __future__ import annotations

import dataclasses
import sys

import loopback_bench as bench
import torch

from moe_dispatch import costmodel
from moe_dispatch.config import Config
from moe_dispatch.testing.loopback import Loopback

GOAL_TWO_HOP = 0.9  # of the two-hop HBM bound, 16 SMs, without l2_discard
GOAL_L2_COPY = 0.6  # of the copy, 16 SMs, l2_discard and rings that fit in L2
FRESH_HOST, FRESH_BUDGET = "fresh dispatch bf16 (host read)", "fresh dispatch bf16 (budget)"
# the plan's flags when not given: (on a GPU, on CPU)
DEVICE_DEFAULTS = {"world_sizes": ([8], [4]), "num_sms": ([4, 8, 16, 24], [2, 4])}
# op -> (cost model op, fp8, fresh mode)
MODEL_OPS = {
    "dispatch bf16": ("dispatch", False, None),
    "dispatch fp8": ("dispatch", True, None),
    "combine bf16": ("combine", False, None),
    FRESH_HOST: ("dispatch", False, "host"),
    FRESH_BUDGET: ("dispatch", False, "budget"),
}


@dataclasses.dataclass(kw_only=True)
class Row(bench.Row):
    """A row of one ring configuration (``rings``: depth x chunk tokens, "-" for the copy baseline)
    and ``l2_discard`` setting; ``fits_l2``: its rings fit in L2."""

    rings: str
    l2_discard: bool
    fits_l2: bool

    @property
    def vs_two_hop(self) -> float | None:
        return None if self.vs_copy is None or self.num_sms == 0 else 2 * self.vs_copy


def predicted_us(
    op: str, shape: bench.Shape, world_size: int, rows_per_rank: float | None, config, num_sms: int
) -> float:
    kind, fp8, fresh = MODEL_OPS[op]
    workload = costmodel.Workload(
        shape.tokens, shape.hidden, shape.topk, shape.num_experts, world_size, fp8=fp8, rows=rows_per_rank
    )
    return costmodel.predict(kind, workload, config, num_sms=num_sms, fresh=fresh).time_us


def base_config(rings: str, l2_discard: bool, num_sms_list: list[int]) -> Config:
    num_slots, chunk_tokens = (int(v) for v in rings.split("x"))
    return Config(num_sms=max(num_sms_list), num_slots=num_slots, chunk_tokens=chunk_tokens, l2_discard=l2_discard)


def fits_l2(shape: bench.Shape, world_size: int, config: Config, num_sms: int) -> bool:
    from moe_dispatch.kernel_layout import max_slot_bytes

    slot = -(-max_slot_bytes(shape.hidden, shape.topk) // 128) * 128
    return world_size * world_size * (num_sms // 2) * config.num_slots * slot <= costmodel.H200.l2_bytes


def bench_config(
    shape: bench.Shape,
    world_size: int,
    rings: str,
    l2_discard: bool,
    num_sms_list: list[int],
    variants: list[str],
    args,
    device: torch.device,
    copy_rate: float | None,
) -> tuple[list[Row], float | None]:
    """Rows of one shape, W and queue configuration, every variant over the same buffers; the copy
    baseline is timed once per shape and W (pass None) and reused by its other configurations."""
    on_gpu = device.type == "cuda"
    config = base_config(rings, l2_discard, num_sms_list)
    lb = Loopback(world_size, shape.hidden, shape.topk, config=config, device=device, timeout_s=args.timeout_s)
    xs, xs8, idxs, ws = bench.make_inputs(shape, world_size, device)
    time_case = bench.timer(args, device)
    rows: list[Row] = []
    for num_sms in num_sms_list:
        lb.set_variant("current")
        handles, received, cases = bench.cached_cases(lb, shape, xs, xs8, idxs, ws, num_sms)
        bytes_bf16 = received * shape.hidden * 2
        budget = max(h.num_rows for h in handles) + 64
        fits = fits_l2(shape, world_size, config, num_sms)
        if on_gpu and copy_rate is None:  # the baseline, once per shape: same byte count
            baseline = {"rings": "-", "l2_discard": False, "fits_l2": False}
            rows.append(bench.copy_row(Row, shape, world_size, bytes_bf16, device, args, **baseline))
            copy_rate = rows[-1].gbps
        fresh = [
            (
                FRESH_HOST,
                bytes_bf16,
                lambda: bench.time_host(
                    lambda: lb.dispatch(xs, idxs, ws, shape.num_experts, num_sms=num_sms, check=False, validate=False),
                    1,
                    max(3, args.iters // 4),
                    device,
                ),
            ),
            (
                FRESH_BUDGET,
                bytes_bf16,
                lambda: time_case(
                    lambda: lb.dispatch(
                        *(xs, idxs, ws, shape.num_experts),
                        num_sms=num_sms,
                        num_worst_tokens=budget,
                        check=False,
                        validate=False,
                    )
                ),
            ),
        ]
        timed = [(op, nbytes, lambda fn=fn: time_case(fn)) for op, nbytes, _, fn in cases] + fresh
        where = f"{world_size} x {num_sms} SMs"
        labels = {"shape": shape.name, "world_size": world_size, "num_sms": num_sms, "rings": rings}
        for (op, _, _), fields in bench.time_variants(
            lb, variants, timed, "bench_intranode", where, **labels, l2_discard=l2_discard, fits_l2=fits
        ):
            model = predicted_us(op, shape, world_size, received / world_size, lb.config, num_sms) if on_gpu else None
            rows.append(Row(**fields, copy_gbps=copy_rate, model_us=model))
        del handles, cases
    lb.check()  # a wait that timed out during the timings fails the benchmark here
    return rows, copy_rate


def plan_estimate(args, variants: list[str]) -> list[tuple[str, float]]:
    """(what, predicted GPU seconds) per shape and W of the flags' plan: every timed launch at the
    model's time for the expected routing, the copy baseline, and a fixed 2 s per configuration
    (buffers, inputs, the first dispatch, Triton's first layout launch) plus 10 s to start."""
    runs, rings_list, discards, num_sms_list = args.warmup + args.iters, args.rings, args.l2_discard, args.num_sms
    steps = [("process start, CUDA and Triton warm-up", 10.0)]
    for shape in bench.shapes_for(args):
        for world_size in args.world_sizes:
            total = 2.0 * len(rings_list) * len(discards)
            workload = costmodel.Workload(shape.tokens, shape.hidden, shape.topk, shape.num_experts, world_size)
            total += runs * workload.payload_bytes("dispatch") * world_size / (costmodel.H200.copy_gbps * 1e3) * 1e-6
            for rings in rings_list:
                for discard in discards:
                    config = base_config(rings, discard == "on", num_sms_list)
                    for num_sms in num_sms_list:
                        for variant in variants:
                            c = config.with_variant(variant)
                            for op in bench.model_ops(shape, MODEL_OPS):
                                n = 1 + max(3, args.iters // 4) if op == FRESH_HOST else runs
                                total += n * predicted_us(op, shape, world_size, None, c, num_sms) * 1e-6
            steps.append((f"{shape.name} W={world_size}", total))
    return steps


def print_table(rows: list[Row]) -> None:
    bench.print_rows(
        "intranode loopback",
        ["shape", "W", "rings", "l2 discard", "sms", *bench.TIMING_COLUMNS, "vs 2-hop", *bench.MODEL_COLUMNS],
        [
            [r.shape, str(r.world_size), r.rings, ("on" if r.l2_discard else "off") if r.num_sms else "-"]
            + [str(r.num_sms), *r.timing_cells(), bench.cell(r.vs_two_hop, ".2f"), *r.model_cells()]
            for r in rows
        ],
    )


def print_variants(rows: list[Row]) -> None:
    """The variants side by side (the copy baseline left out)."""
    bench.print_variant_ratios(
        "variants: current time / variant time (> 1: faster), same run",
        [r for r in rows if r.num_sms],
        ["shape", "W", "rings", "l2", "sms", "op"],
        lambda r: (r.shape, str(r.world_size), r.rings, "on" if r.l2_discard else "off", str(r.num_sms), r.op),
    )


def print_discard_ratios(rows: list[Row]) -> None:
    """Median time with l2_discard over the time without, per configuration timed both ways
    (below 1: the discard pays)."""
    key = lambda r: (r.shape, r.world_size, r.rings, r.num_sms, r.op, r.variant)  # noqa: E731
    keep = {key(r): r for r in rows if r.num_sms and not r.l2_discard}
    pairs = [(keep[key(r)], r) for r in rows if r.l2_discard and key(r) in keep]
    if pairs:
        print()
        bench.print_rows(
            "l2_discard: time on / time off, same run",
            ["shape", "W", "rings", "sms", "op", "variant", "ratio"],
            [
                [*(on.shape, str(on.world_size), on.rings, str(on.num_sms), on.op, on.variant)]
                + [f"{on.median_us / off.median_us:.2f}"]
                for off, on in pairs
            ],
        )


def best(rows: list[Row], key) -> Row | None:
    return max(rows, key=key, default=None)


def print_goals(rows: list[Row]) -> None:
    """One line per goal of issue 21 that this run measured (greppable: "goal: ...")."""
    timed = [r for r in rows if r.num_sms]
    kernel_ops = ("dispatch bf16", "dispatch fp8", "combine bf16")
    print()
    per_sm = [r for r in timed if r.world_size == 4 and r.num_sms <= 4 and r.op in kernel_ops]
    for op in kernel_ops:
        if b := best([r for r in per_sm if r.op == op], lambda r: r.gbps_per_sm):
            verdict = "met" if b.gbps_per_sm >= bench.GOAL_GBPS_PER_SM else "MISSED"
            print(
                f"goal: {op} >= {bench.GOAL_GBPS_PER_SM:g} GB/s per SM (4 ranks, 2-4 SMs): {verdict}, best "
                f"{b.gbps_per_sm:.1f} ({b.variant}, {b.shape}, {b.num_sms} SMs, rings {b.rings})"
            )
    at16 = [r for r in timed if r.world_size == 8 and r.num_sms == 16 and r.op in ("dispatch bf16", "combine bf16")]
    for op in ("dispatch bf16", "combine bf16"):
        if b := best([r for r in at16 if r.op == op and not r.l2_discard], lambda r: r.vs_two_hop or 0):
            verdict = "met" if (b.vs_two_hop or 0) >= GOAL_TWO_HOP else "MISSED"
            print(
                f"goal: {op} >= {GOAL_TWO_HOP} of the two-hop bound (8 ranks, 16 SMs, no l2_discard): {verdict}, "
                f"best {bench.cell(b.vs_two_hop, '.2f')} ({b.variant}, {b.shape}, rings {b.rings})"
            )
        if b := best([r for r in at16 if r.op == op and r.l2_discard and r.fits_l2], lambda r: r.vs_copy or 0):
            verdict = "met" if (b.vs_copy or 0) >= GOAL_L2_COPY else "MISSED"
            print(
                f"goal: {op} >= {GOAL_L2_COPY} of a copy (8 ranks, 16 SMs, l2_discard, rings in L2): {verdict}, "
                f"best {bench.cell(b.vs_copy, '.2f')} ({b.variant}, {b.shape}, rings {b.rings})"
            )
    cached = {
        (r.shape, r.world_size, r.rings, r.l2_discard, r.num_sms, r.variant): r
        for r in timed
        if r.op == "dispatch bf16"
    }
    for op in (FRESH_BUDGET, FRESH_HOST):
        bench.print_fresh_goal(
            op,
            [
                (f"{r.variant}, {r.shape}, W={r.world_size}, {r.num_sms} SMs", r.median_us / cached[k].median_us)
                for r in timed
                if r.op == op and (k := (r.shape, r.world_size, r.rings, r.l2_discard, r.num_sms, r.variant)) in cached
            ],
        )
    bench.print_model_goal("rows", [r.model_ratio for r in timed if r.model_ratio is not None])


def main(argv: list[str] | None = None) -> int:
    parser = bench.bench_parser(__doc__)
    parser.add_argument("--world-sizes", nargs="+", type=int, default=None, help="default: 8 on GPU, 4 on CPU")
    parser.add_argument("--num-sms", nargs="+", type=int, default=None, help="default: 4 8 16 24 on GPU, 2 4 on CPU")
    parser.add_argument(
        "--rings",
        nargs="+",
        default=["32x8", "4x2"],
        help="ring depth x chunk tokens per configuration (default: 32x8 4x2)",
    )
    parser.add_argument(
        "--l2-discard",
        nargs="+",
        choices=["off", "on"],
        default=["off", "on"],
        help="Config.l2_discard per configuration (default: off on, side by side)",
    )
    bench.add_variant_args(parser)
    bench.add_run_args(parser, warmup=3, iters=20)
    args = parser.parse_args(argv)
    variants = bench.variant_names(args.variants)

    device = bench.start("bench_intranode", args, "goals", DEVICE_DEFAULTS, lambda: plan_estimate(args, variants))
    on_gpu = device.type == "cuda"
    rows: list[Row] = []
    for shape in bench.shapes_for(args):
        for world_size in args.world_sizes:
            copy_rate = None
            for rings in args.rings:
                for l2_discard in args.l2_discard:
                    new, copy_rate = bench_config(
                        shape, world_size, rings, l2_discard == "on", args.num_sms, variants, args, device, copy_rate
                    )
                    rows += new
    print_table(rows)
    print_variants(rows)
    print_discard_ratios(rows)
    if on_gpu:
        print_goals(rows)
    else:
        runs = bench.timed_runs(args, device)
        print(
            f"\nbench_intranode: CPU backend ({runs} runs a case): the times check the script "
            "only (l2_discard writes a poison pattern there; the variants' CPU ratios above say nothing about a GPU)"
        )
    formula = "payload rows delivered x row bytes"
    bench.write_json(args.json, device, rows, variants, formula, rings=args.rings, l2_discard=args.l2_discard)
    return 0


if __name__ == "__main__":
    sys.exit(main())
