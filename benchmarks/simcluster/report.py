"""Summary of benchmark runs on simulated clusters of several sizes: a rich table, the goal line,
the JSON file and a PNG bar chart. Figures come from ``moe_dispatch.tools.bench``'s JSON, one per
cluster, unchanged; the speed-up is Megatron's alltoall dispatcher / ours (Megatron's flex
dispatcher with the "custom" backend), dispatch + combine medians."""

from __future__ import annotations

import json
import pathlib

GOAL_SPEEDUP = 1.5  # ours at least this much faster than Megatron's alltoall dispatcher, per shape


def speedup(case: dict) -> float | None:
    """alltoall / ours, dispatch + combine medians (the inverse of the bench's ratio); None
    without Megatron's figures."""
    ratio = case.get("ratios", {}).get("ours_over_alltoall")
    return None if ratio is None else 1.0 / ratio["ratio"]


def _cases(runs: list[dict]):
    """``(run, case)`` for every timed case of every run with figures."""
    for run in runs:
        for case in (run.get("bench") or {}).get("cases", []):
            if "skipped" not in case:
                yield run, case


def goal(runs: list[dict]) -> dict:
    """The goal figure: ours at least GOAL_SPEEDUP x faster than Megatron's alltoall for every
    model at every cluster size run."""
    per_size: dict = {}
    for run, case in _cases(runs):
        s = speedup(case)
        if s is not None:
            per_size.setdefault(run["cluster"]["num_nodes"], {})[case["model"]] = s
    return {
        "min_speedup": GOAL_SPEEDUP,
        "speedup_by_nodes": per_size,
        "met": bool(per_size) and all(s >= GOAL_SPEEDUP for sizes in per_size.values() for s in sizes.values()),
    }


def print_summary(runs: list[dict], console) -> None:
    from rich.markup import escape
    from rich.table import Table

    table = Table(
        title="simulated cluster: ours (Megatron flex + 'custom') vs Megatron's alltoall dispatcher on shaped "
        "inter-node links",
        title_justify="left",
    )
    for col in (
        "nodes x L",
        "model",
        "tokens",
        "cross-node MB ours",
        "alltoall",
        "ours / LB",
        "alltoall / LB",
        "ms ours",
        "alltoall",
        "Buffer",
        "2-stage floor",
        "flat floor",
        "speed-up",
    ):
        table.add_column(col, justify="left" if col in ("nodes x L", "model") else "right")
    notes = []
    for run in runs:
        if not run.get("bench"):
            c, error = run["cluster"], escape(str(run.get("error")))
            notes.append(f"[red]{c['num_nodes']} x {c['ranks_per_node']}: failed: {error}[/red]")
    for run, case in _cases(runs):
        c, b, lat = run["cluster"], case["bytes"], case["latency_ms"]
        s = speedup(case)

        def ms(side: str) -> str:
            return f"{lat[side]['total']['median']:.0f}" if side in lat else "-"

        def lb(side: str) -> str:
            v = b[side]["internode_over_lower_bound"]
            return "n/a" if v is None else f"{v:.2f}"

        mark = "" if case["oracle_check"] == "passed" else " [red]oracle![/red]"
        table.add_row(
            f"{c['num_nodes']} x {c['ranks_per_node']}",
            case["model"],
            str(case["num_tokens"]),
            f"{b['ours']['internode'] / 1e6:.1f}",
            f"{b['alltoall']['internode'] / 1e6:.1f}",
            lb("ours"),
            lb("alltoall"),
            ms("ours"),
            ms("alltoall"),
            ms("buffer"),
            ms("two_stage_floor"),
            ms("flat_floor"),
            ("n/a" if s is None else f"[bold]{s:.2f}x[/bold]") + mark,
        )
    table.caption = (
        "MB: hidden payload crossing nodes per direction, all ranks (moe-dispatch-bench's definition); LB: the "
        "de-dup lower bound sum_t |nodes(t) \\ own node| x H x bytes. ms: dispatch + combine, median over the "
        "iterations of the max over ranks. speed-up = Megatron alltoall / ours."
    )
    table.caption_justify = "left"
    console.print(table)
    for note in notes:
        console.print(note)
    for run in runs:
        p, c = run.get("probe"), run["cluster"]
        if p and p.get("intra_node") and p.get("inter_node"):
            intra, inter = p["intra_node"]["mb_per_s_per_rank"], p["inter_node"]["mb_per_s_per_rank"]
            console.print(
                f"links at {c['num_nodes']} nodes: intra-node {intra:.0f} MB/s per rank, inter-node "
                f"{inter:.1f} MB/s per rank ({c['rate_mbit']:.0f} Mbit/s per node link): "
                f"{p['ratio']:.1f} : 1 (NVLink : RDMA per GPU is about 9 : 1)"
            )
    g = goal(runs)
    if g["speedup_by_nodes"]:
        mark = "[green]met[/green]" if g["met"] else "[red]not met[/red]"
        sizes = "; ".join(
            f"{n} nodes: " + ", ".join(f"{m} {s:.2f}x" for m, s in models.items())
            for n, models in sorted(g["speedup_by_nodes"].items())
        )
        console.print(f"goal: ours >= {GOAL_SPEEDUP}x faster than Megatron's alltoall dispatcher: {mark} ({sizes})")


def write_json(runs: list[dict], settings: dict, path: pathlib.Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"settings": settings, "goal": goal(runs), "runs": runs}, indent=2) + "\n")


def write_chart(runs: list[dict], path: pathlib.Path) -> None:
    """Two panels per (cluster size, model, tokens): dispatch + combine time (stacked) and
    cross-node MB, ours next to Megatron's alltoall, the speed-up written above each pair."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [(run["cluster"], case) for run, case in _cases(runs) if "alltoall" in case["latency_ms"]]
    if not groups:
        return
    labels = [f"{c['num_nodes']} nodes\n{case['model']}\n{case['num_tokens']} tok" for c, case in groups]
    xs = range(len(groups))
    width = 0.38
    fig, (ax_t, ax_b) = plt.subplots(2, 1, figsize=(max(7.0, 1.5 * len(groups) + 2), 8.5))
    for offset, side, color, label in (
        (-width / 2, "ours", "#1f77b4", "ours (Megatron flex + custom)"),
        (width / 2, "alltoall", "#ff7f0e", "Megatron alltoall"),
    ):
        disp = [case["latency_ms"][side]["dispatch"]["median"] for _, case in groups]
        comb = [case["latency_ms"][side]["combine"]["median"] for _, case in groups]
        pos = [x + offset for x in xs]
        ax_t.bar(pos, disp, width, color=color, label=f"{label}: dispatch")
        ax_t.bar(pos, comb, width, bottom=disp, color=color, alpha=0.55, label=f"{label}: combine")
        ax_b.bar(pos, [case["bytes"][side]["internode"] / 1e6 for _, case in groups], width, color=color, label=label)
    ax_b.scatter(
        list(xs),
        [case["bytes"]["lower_bound_internode"] / 1e6 for _, case in groups],
        marker="_",
        s=900,
        color="black",
        zorder=3,
        label="de-dup lower bound",
    )
    for x, (_, case) in zip(xs, groups):
        top = max(case["latency_ms"][s]["total"]["median"] for s in ("ours", "alltoall"))
        ax_t.annotate(f"{speedup(case):.2f}x", (x, top), ha="center", va="bottom", fontsize=9, weight="bold")
    for ax, title, unit in (
        (ax_t, "dispatch + combine (median of max over ranks)", "ms"),
        (ax_b, "hidden payload crossing nodes, per direction", "MB"),
    ):
        ax.set_xticks(list(xs), labels, fontsize=8)
        ax.set_ylabel(unit)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=7, loc="upper left")
        ax.set_ylim(top=ax.get_ylim()[1] * 1.35)  # room for the legend and the labels
    c0 = runs[0]["cluster"]
    fig.suptitle(
        f"moe_dispatch on a simulated cluster ({c0['ranks_per_node']} ranks per node; speed-up = alltoall / ours)",
        fontsize=11,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
