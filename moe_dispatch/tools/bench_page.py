"""What ``moe-dispatch-bench`` prints: one table within :data:`PAGE_WIDTH` columns and one verdict
line per model, from the figures :mod:`moe_dispatch.tools.bench` measured (its JSON holds them all).

The page compares ours (Megatron-Core's flex dispatcher with backend "custom") with Megatron-Core's
alltoall dispatcher; a run without Megatron-Core compares the bare ``Buffer`` with the two-stage
floor instead.
"""

from __future__ import annotations

import os

PAGE_WIDTH = 120  # columns of the page in logs and pipes; the table and the verdicts fit in it
# Short names of the compared sides (keys of a case's "latency_ms"), and the legend's sentences.
NAMES = {"ours": "ours", "alltoall": "alltoall", "buffer": "Buffer", "two_stage_floor": "floor"}
LEGENDS = {
    "ours": 'ours = Megatron-Core\'s flex dispatcher with backend "custom", alltoall = its alltoall dispatcher, on the '
    "same routing and tensors.",
    "buffer": "Buffer = bare Buffer.dispatch + combine; floor = the hierarchy's two all_to_all_single alone.",
    "rest": "Ratio: of the medians (p10-p90 per iteration). Cross-node: hidden payload sent across nodes per "
    "direction, all ranks; bound: each token once per other node it needs. Oracle: bit-equal to "
    "moe_dispatch.reference on every rank.",
}


def console():
    """A rich ``Console`` on stdout for the page: the terminal's width; in logs and pipes the
    ``COLUMNS`` environment variable, else :data:`PAGE_WIDTH`."""
    from rich.console import Console

    out = Console()
    if not out.is_terminal and "COLUMNS" not in os.environ:
        out = Console(width=PAGE_WIDTH)
    return out


def verdicts(results: list[dict], side: str, base: str) -> dict[str, dict]:
    """Per model (in run order), how ``side`` fares against ``base`` over its timed cases, and the
    cross-node bytes of ours and Megatron's alltoall against the de-dup lower bound.

    Args:
        results: the case figures of :func:`moe_dispatch.tools.bench._bench_case`; a skipped case
            has ``"skipped"`` (the reason) and no timings.
        side, base: keys of a case's ``"latency_ms"`` with ``f"{side}_over_{base}"`` in its
            ``"ratios"``: ``"ours", "alltoall"`` or ``"buffer", "two_stage_floor"``.

    Returns:
        ``{model: {"cases": timed cases, "faster": those whose median ratio is below 1, "ratios":
        the median ratio of each, "bytes_over_bound": {"ours": x, "alltoall": x} (bytes summed over
        the multi-node cases over their bounds summed; None without such a case), "line": the
        printed verdict}}``.
    """
    out = {}
    for model in dict.fromkeys(f["model"] for f in results):
        cases = [f for f in results if f["model"] == model]
        timed = [f for f in cases if "skipped" not in f]
        ratios = [f["ratios"][f"{side}_over_{base}"]["ratio"] for f in timed]
        bound = sum(f["bytes"]["lower_bound_internode"] for f in timed)
        over = (
            {s: sum(f["bytes"][s]["internode"] for f in timed) / bound for s in ("ours", "alltoall")} if bound else None
        )
        verdict = {"cases": len(ratios), "faster": sum(r < 1 for r in ratios), "ratios": ratios}
        if not timed:
            line = f"{model}: skipped: {cases[0]['skipped']}"
        else:
            lo, hi = f"{min(ratios):.2f}", f"{max(ratios):.2f}"
            line = (  # the subject, ours or Buffer, is the table's and the legend's
                f"{model}: faster than {NAMES[base]} in {verdict['faster']} of {len(ratios)} cases "
                f"({lo if lo == hi else f'{lo}-{hi}'}x its time); "
            )
            line += (
                f"cross-node {over['ours']:.2f}x the bound, alltoall {over['alltoall']:.2f}x"
                if over
                else "one node: nothing crosses nodes"
            )
        out[model] = verdict | {"bytes_over_bound": over, "line": line}
    return out


def print_page(results: list[dict], title: str, megatron: bool, out) -> dict[str, dict]:
    """Prints the table (one row per case, with ``title`` above and the legend below), any oracle
    mismatches, then one verdict line per model.

    Args:
        results: the case figures, as for :func:`verdicts`.
        title: the table's title (what was timed, where).
        megatron: whether Megatron-Core's dispatchers ran: the table and verdicts compare ours with
            alltoall, else the bare Buffer with the two-stage floor.
        out: the rich ``Console`` to print on (:func:`console`).

    Returns:
        :func:`verdicts` of the compared sides.
    """
    from rich.markup import escape
    from rich.table import Table

    side, base = ("ours", "alltoall") if megatron else ("buffer", "two_stage_floor")

    def num(v: float) -> str:  # about 3 significant digits, no exponent
        return f"{v:.{2 if v < 10 else 1 if v < 100 else 0}f}"

    table = Table(
        title=title,
        title_justify="left",
        caption=LEGENDS[side] + " " + LEGENDS["rest"],
        caption_justify="left",
    )
    for col in (
        "nodes\nx L",
        "model",
        "tokens",
        f"{NAMES[side]}\nms",
        f"{NAMES[base]}\nms",
        f"{NAMES[side]} /\n{NAMES[base]}",
        "cross-node\nMB, bound",
        "ours\nx bound",
        "alltoall\nx bound",
        "oracle",
    ):
        table.add_column(col, justify="left" if col in ("nodes\nx L", "model") else "right")
    for fig in results:
        row = [f"{fig['num_nodes']} x {fig['ranks_per_node']}", fig["model"], str(fig["num_tokens"])]
        if "skipped" in fig:
            table.add_row(*row, *["-"] * 6, "skipped")
            continue
        lat, b = fig["latency_ms"], fig["bytes"]
        r = fig["ratios"][f"{side}_over_{base}"]
        lower = b["lower_bound_internode"]

        def over(s: str) -> str:
            return f"{b[s]['internode_over_lower_bound']:.2f}x" if lower else "-"

        table.add_row(
            *row,
            num(lat[side]["total"]["median"]),
            num(lat[base]["total"]["median"]),
            f"{r['ratio']:.2f} ({r['p10']:.2f}-{r['p90']:.2f})",
            num(lower / 1e6) if lower else "-",
            over("ours"),
            over("alltoall"),
            "[green]passed[/green]" if fig["oracle_check"] == "passed" else "[bold red]FAILED[/bold red]",
        )
    out.print(table)
    for fig in results:
        for line in fig.get("mismatches", [])[:20]:
            out.print(f"[bold red]MISMATCH {escape(line)}[/bold red]")
    found = verdicts(results, side, base)
    for verdict in found.values():
        out.print(verdict["line"], markup=False, soft_wrap=True)  # one line per model, even if wide
    return found
