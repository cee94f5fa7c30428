"""Summary of benchmark runs on simulated clusters of several sizes: a rich table, the goal line,
the JSON file and a PNG bar chart. Figures come from ``moe_dispatch.tools.bench``'s JSON, one per
cluster, unchanged; the speed-up is flat / hierarchical, dispatch + combine medians."""

from __future__ import annotations

import json
import pathlib

GOAL_MODEL, GOAL_SPEEDUP = "deepseek-v3", 1.5


def speedup(fig: dict) -> float:
    """flat / hierarchical, dispatch + combine medians (the inverse of the bench's total ratio)."""
    return 1.0 / fig["ratio_ours_over_flat"]["total"]


def link_model(fig: dict, run: dict) -> float | None:
    """The speed-up predicted from the probed link throughputs when only bytes on the wire cost
    time: flat moves its cross-node and in-node rows at once, the hierarchy's stages run one
    after the other (stage 1 on the node links, then stage 2 in the node), as the torch_dist
    transport runs them. None without both probe figures."""
    probe, c = run.get("probe") or {}, run["cluster"]
    if not (probe.get("intra_node") and probe.get("inter_node")):
        return None
    num_nodes, world = c["num_nodes"], c["num_nodes"] * c["ranks_per_node"]
    node_link = probe["inter_node"]["mb_per_s_per_rank"] * c["ranks_per_node"] * 1e6  # B/s per node
    in_node = probe["intra_node"]["mb_per_s_per_rank"] * 1e6  # B/s per rank
    b = fig["bytes"]
    flat = max(b["flat"]["internode"] / num_nodes / node_link, b["flat"]["intranode"] / world / in_node)
    ours = b["ours"]["internode"] / num_nodes / node_link + b["ours"]["intranode"] / world / in_node
    return flat / ours if ours else None


def goal(runs: list[dict]) -> dict:
    """The goal figure: hierarchical at least GOAL_SPEEDUP x faster on GOAL_MODEL at every size run."""
    per_size = {}
    for run in runs:
        fig = run["bench"]["models"].get(GOAL_MODEL) if run.get("bench") else None
        if fig and "skipped" not in fig:
            per_size[run["cluster"]["num_nodes"]] = speedup(fig)
    return {
        "model": GOAL_MODEL,
        "min_speedup": GOAL_SPEEDUP,
        "speedup_by_nodes": per_size,
        "met": bool(per_size) and all(s >= GOAL_SPEEDUP for s in per_size.values()),
    }


def print_summary(runs: list[dict], console) -> None:
    from rich.markup import escape
    from rich.table import Table

    table = Table(
        title="simulated cluster: hierarchical vs flat all_to_all on shaped inter-node links", title_justify="left"
    )
    for col in (
        "nodes x L",
        "model",
        "cross-node MB ours",
        "flat",
        "ours / LB",
        "flat / LB",
        "dispatch ms ours",
        "flat",
        "combine ms ours",
        "flat",
        "speed-up",
        "link model",
    ):
        table.add_column(col, justify="left" if col in ("nodes x L", "model") else "right")
    notes = []
    for run in runs:
        c = run["cluster"]
        size = f"{c['num_nodes']} x {c['ranks_per_node']}"
        if not run.get("bench"):
            notes.append(f"[red]{size}: failed: {escape(str(run.get('error', '?')))}[/red]")
            continue
        for name, fig in run["bench"]["models"].items():
            if "skipped" in fig:
                notes.append(f"[yellow]{size} {name}: skipped ({escape(fig['skipped'])})[/yellow]")
                continue
            b, lat = fig["bytes"], fig["latency_ms"]
            lb = lambda v: "n/a" if v is None else f"{v:.2f}"  # noqa: E731
            s, model = speedup(fig), link_model(fig, run)
            table.add_row(
                size,
                name,
                f"{b['ours']['internode'] / 1e6:.1f}",
                f"{b['flat']['internode'] / 1e6:.1f}",
                lb(b["ours"]["internode_over_lower_bound"]),
                lb(b["flat"]["internode_over_lower_bound"]),
                f"{lat['ours']['dispatch']['median']:.0f}",
                f"{lat['flat']['dispatch']['median']:.0f}",
                f"{lat['ours']['combine']['median']:.0f}",
                f"{lat['flat']['combine']['median']:.0f}",
                f"[bold]{s:.2f}x[/bold]" + ("" if fig["oracle_check"] == "passed" else " [red]oracle![/red]"),
                "n/a" if model is None else f"{model:.2f}x",
            )
    table.caption = (
        "MB: hidden payload crossing nodes per direction, all ranks (moe-dispatch-bench's definition); LB: the "
        "de-dup lower bound sum_t |nodes(t) \\ own node| x H x bytes. ms: median over the iterations of the max over "
        "ranks. speed-up = flat / hierarchical, dispatch + combine. link model: the speed-up if only wire time "
        "counted, at the probed link throughputs, with the hierarchy's two stages in sequence (as the torch_dist "
        "transport runs them)."
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
        sizes = ", ".join(f"{n} nodes {s:.2f}x" for n, s in sorted(g["speedup_by_nodes"].items()))
        console.print(
            f"goal: hierarchical dispatch + combine >= {GOAL_SPEEDUP}x faster than flat all_to_all on "
            f"{GOAL_MODEL} routing: {mark} ({sizes})"
        )


def write_json(runs: list[dict], settings: dict, path: pathlib.Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"settings": settings, "goal": goal(runs), "runs": runs}, indent=2) + "\n")


def write_chart(runs: list[dict], path: pathlib.Path) -> None:
    """Two panels per (cluster size, model): dispatch + combine time (stacked) and cross-node MB,
    hierarchical next to flat, the speed-up written above each pair."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [
        (run["cluster"], name, fig)
        for run in runs
        if run.get("bench")
        for name, fig in run["bench"]["models"].items()
        if "skipped" not in fig
    ]
    if not groups:
        return
    labels = [f"{c['num_nodes']} nodes\n{name}" for c, name, _ in groups]
    xs = range(len(groups))
    width = 0.38
    fig, (ax_t, ax_b) = plt.subplots(2, 1, figsize=(max(7.0, 1.5 * len(groups) + 2), 8.5))
    for offset, side, color, label in (
        (-width / 2, "ours", "#1f77b4", "hierarchical"),
        (width / 2, "flat", "#ff7f0e", "flat all_to_all"),
    ):
        disp = [f["latency_ms"][side]["dispatch"]["median"] for _, _, f in groups]
        comb = [f["latency_ms"][side]["combine"]["median"] for _, _, f in groups]
        pos = [x + offset for x in xs]
        ax_t.bar(pos, disp, width, color=color, label=f"{label}: dispatch")
        ax_t.bar(pos, comb, width, bottom=disp, color=color, alpha=0.55, label=f"{label}: combine")
        ax_b.bar(pos, [f["bytes"][side]["internode"] / 1e6 for _, _, f in groups], width, color=color, label=label)
    ax_b.scatter(
        list(xs),
        [f["bytes"]["lower_bound_internode"] / 1e6 for _, _, f in groups],
        marker="_",
        s=900,
        color="black",
        zorder=3,
        label="de-dup lower bound",
    )
    for x, (_, _, f) in zip(xs, groups):
        top = max(
            f["latency_ms"][s]["dispatch"]["median"] + f["latency_ms"][s]["combine"]["median"] for s in ("ours", "flat")
        )
        ax_t.annotate(f"{speedup(f):.2f}x", (x, top), ha="center", va="bottom", fontsize=9, weight="bold")
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
        f"moe_dispatch on a simulated cluster ({c0['ranks_per_node']} ranks per node; speed-up = flat / hierarchical)",
        fontsize=11,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
