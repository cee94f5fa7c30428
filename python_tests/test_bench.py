"""The main job (``moe_dispatch.tools.bench``) on a tiny CPU world, and the routing generators it runs on."""

import io
import json
import statistics

import pytest
import torch

from moe_dispatch.testing import routing
from moe_dispatch.tools import bench, bench_page

from .worlds import TINY_BENCH_RUN


# -- routing ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(routing.PRESETS))
def test_preset_routing_shapes_and_contract(name):
    preset = routing.PRESETS[name]
    topk_idx, topk_weights = routing.generate_routing(preset, 512, seed=3, rank=1)
    assert topk_idx.shape == (512, preset.topk) and topk_idx.dtype == torch.int64
    assert topk_weights.shape == (512, preset.topk) and topk_weights.dtype == torch.float32
    assert topk_idx.is_contiguous() and topk_weights.is_contiguous()
    assert int(topk_idx.min()) >= 0 and int(topk_idx.max()) < preset.num_experts
    ordered = topk_idx.sort(dim=1).values
    assert not bool((ordered[:, 1:] == ordered[:, :-1]).any()), "an expert appears twice in a row"
    assert bool((topk_weights > 0).all())
    # norm_topk_prob: weights sum to routed_scaling_factor.
    torch.testing.assert_close(topk_weights.sum(1), torch.full((512,), preset.routed_scaling_factor))


def test_deepseek_v3_routing_stays_in_topk_group_groups():
    preset = routing.PRESETS["deepseek-v3"]
    topk_idx, _ = routing.generate_routing(preset, 2048, seed=0, rank=0)
    group = topk_idx // (preset.num_experts // preset.n_group)
    used = torch.zeros(2048, preset.n_group, dtype=torch.bool).scatter_(1, group, True)
    assert int(used.sum(1).max()) <= preset.topk_group
    assert int(used.sum(1).max()) == preset.topk_group  # random logits do spread over all allowed groups


def test_group_limited_routing_ranks_groups_by_their_two_best_scores():
    # 4 groups of 2 experts, 2 groups allowed, top-2. Group 0 holds the single best expert but a
    # poor second, so by the sum of its two best scores it loses to groups 1 and 2.
    preset = routing.ModelPreset("toy", num_experts=8, topk=2, hidden=16, score_func="sigmoid", n_group=4, topk_group=2)
    logits = torch.tensor([[6.0, -6.0, 1.0, 1.0, 2.0, 0.5, -3.0, -3.0]])
    topk_idx, topk_weights = routing.select_experts(logits, preset)
    assert set(topk_idx[0].tolist()) == {4, 2} or set(topk_idx[0].tolist()) == {4, 3}
    assert 0 not in topk_idx[0].tolist()
    # A selection bias moves the choice but not the weights (the unbiased scores).
    bias = torch.zeros(8)
    bias[3] = 1.0
    biased_idx, biased_w = routing.select_experts(logits, preset, expert_bias=bias)
    assert biased_idx[0].tolist() == [3, 4]
    scores = torch.sigmoid(logits[0, [3, 4]])
    torch.testing.assert_close(biased_w[0], scores / scores.sum())


def test_routing_is_deterministic_per_seed_and_rank():
    preset = routing.PRESETS["qwen3-30b-a3b"]
    a = routing.generate_routing(preset, 256, seed=7, rank=2)
    b = routing.generate_routing(preset, 256, seed=7, rank=2)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    other_rank = routing.generate_routing(preset, 256, seed=7, rank=3)
    other_seed = routing.generate_routing(preset, 256, seed=8, rank=2)
    assert not torch.equal(a[0], other_rank[0]) and not torch.equal(a[0], other_seed[0])
    assert routing.rank_seed(7, 2) != routing.rank_seed(2, 7)


def test_zipf_routing_is_skewed_by_popularity():
    num_experts, topk = 64, 4
    popularity = routing.zipf_popularity(num_experts, 1.2, seed=5)
    torch.testing.assert_close(popularity.sum(), torch.tensor(1.0))
    topk_idx, topk_weights = routing.zipf_routing(20000, num_experts, topk, 1.2, seed=5, rank=0)
    assert topk_idx.shape == (20000, topk) and topk_idx.dtype == torch.int64 and topk_weights.dtype == torch.float32
    ordered = topk_idx.sort(dim=1).values
    assert not bool((ordered[:, 1:] == ordered[:, :-1]).any())
    torch.testing.assert_close(topk_weights.sum(1), torch.ones(20000))
    counts = torch.bincount(topk_idx.flatten(), minlength=num_experts).float()
    by_popularity = counts[popularity.argsort(descending=True)]
    assert by_popularity[0] > 8 * by_popularity[-1]
    assert by_popularity[:8].sum() > 0.4 * counts.sum()  # 1/8 of the experts get > 40% of the picks
    # Popularity is shared by every rank; the draws are not.
    other = routing.zipf_routing(20000, num_experts, topk, 1.2, seed=5, rank=1)[0]
    assert not torch.equal(topk_idx, other)
    uniform = torch.bincount(
        routing.zipf_routing(20000, num_experts, topk, 0.0, seed=5, rank=0)[0].flatten(), minlength=num_experts
    ).float()
    assert uniform.max() < 1.3 * uniform.mean()


def test_drop_entries_and_tokens():
    preset = routing.PRESETS["qwen3-30b-a3b"]
    topk_idx, topk_weights = routing.generate_routing(preset, 4000, seed=1, rank=0)
    gen = routing.make_generator(1, 99)
    idx, w = routing.drop_entries(topk_idx, topk_weights, 0.25, gen)
    dropped = idx == -1
    assert 0.2 < dropped.float().mean() < 0.3
    assert bool((w[dropped] == 0).all()) and torch.equal(idx[~dropped], topk_idx[~dropped])
    idx, w = routing.drop_tokens(topk_idx, topk_weights, 0.1, gen)
    empty = (idx == -1).all(1)
    assert 0.05 < empty.float().mean() < 0.15
    assert bool(((idx == -1).any(1) == empty).all()), "drop_tokens empties whole rows only"
    assert bool((w[empty] == 0).all())
    with pytest.raises(ValueError, match=r"drop probability must be in \[0, 1\], got 1.5"):
        routing.drop_entries(topk_idx, topk_weights, 1.5, gen)


def test_preset_validation_and_hidden_scale():
    with pytest.raises(ValueError, match="topk_group must be in"):
        routing.ModelPreset("bad", num_experts=16, topk=2, hidden=64, n_group=4, topk_group=5)
    with pytest.raises(ValueError, match="exceeds the 1 groups x 4 experts"):
        routing.ModelPreset("bad", num_experts=16, topk=8, hidden=64, n_group=4, topk_group=1)
    with pytest.raises(ValueError, match="score_func must be"):
        routing.ModelPreset("bad", num_experts=16, topk=2, hidden=64, score_func="relu")
    deepseek = routing.PRESETS["deepseek-v3"]
    assert deepseek.with_hidden_scale(0.125).hidden == 896
    assert deepseek.with_hidden_scale(1e-6).hidden == 16
    assert deepseek.with_hidden_scale(0.125).num_experts == 256


# -- the benchmark ---------------------------------------------------------------------------------
@pytest.mark.world
@pytest.mark.megatron
def test_bench_tiny_world_checks_and_writes_figures(tmp_path, capsys, monkeypatch):
    pytest.importorskip("megatron.core")
    monkeypatch.setenv("COLUMNS", "300")  # a wide console: the page must fit 120 columns by itself
    out = tmp_path / "bench.json"
    status = bench.main(
        [
            "--world-size",
            "4",
            "--ranks-per-node",
            "2",
            "4",
            "--num-tokens",
            "96",
            *TINY_BENCH_RUN,
            "--timeout-s",
            "120",
            "--json",
            str(out),
        ]
    )
    assert status == 0
    printed = capsys.readouterr().out
    figures = json.loads(out.read_text())
    _page(printed, figures)
    assert "goal" not in printed
    assert figures["oracle_check"] == "passed"
    assert figures["config"]["world_size"] == 4 and figures["config"]["topologies"] == [2, 4]
    assert figures["config"]["timeout_s"] == 120 and figures["torch_version"] == torch.__version__
    cases = figures["cases"]
    assert {(c["model"], c["ranks_per_node"]) for c in cases} == {(m, L) for m in routing.PRESETS for L in (2, 4)}
    for case in cases:
        assert case["oracle_check"] == "passed" and case["mismatches"] == []
        assert set(case["latency_ms"]) == set(bench.SIDES)
        for side in bench.SIDES:
            for op in ("dispatch", "combine", "total"):
                stats = case["latency_ms"][side][op]
                assert 0 < stats["min"] <= stats["median"] <= stats["max"]
        ratio = case["ratios"]["ours_over_alltoall"]
        want = case["latency_ms"]["ours"]["total"]["median"] / case["latency_ms"]["alltoall"]["total"]["median"]
        assert ratio["ratio"] == pytest.approx(want) and ratio["p10"] <= ratio["p90"]
        b = case["bytes"]
        if case["num_nodes"] == 1:
            assert b["lower_bound_internode"] == 0 and b["ours"]["internode_over_lower_bound"] is None
        else:  # Megatron sends a copy per (token, expert): never fewer cross-node bytes than a copy per node
            assert b["alltoall"]["internode"] >= b["ours"]["internode"] >= b["lower_bound_internode"] > 0
    for model, verdict in figures["verdicts"].items():
        ratios = [c["ratios"]["ours_over_alltoall"]["ratio"] for c in cases if c["model"] == model]
        assert verdict["ratios"] == ratios and verdict["faster"] == sum(r < 1 for r in ratios)
        assert f"faster than alltoall in {verdict['faster']} of {len(ratios)} cases" in verdict["line"]
        assert verdict["bytes_over_bound"]["alltoall"] >= verdict["bytes_over_bound"]["ours"] >= 1


def _page(printed: str, figures: dict) -> list[str]:
    """The report's lines, from the table's title to the last verdict, checked: each fits 120
    columns, each case is one table row, each model has one verdict line (the JSON's)."""
    lines = printed.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("dispatch + combine, ms:"))
    verdicts = [v["line"] for v in figures["verdicts"].values()]
    page = lines[start : lines.index(verdicts[-1]) + 1]
    assert max(map(len, page)) <= bench_page.PAGE_WIDTH
    rows = [[cell.strip() for cell in line.split("│")[1:-1]] for line in page if line.startswith("│")]
    assert [row[:3] for row in rows] == [
        [f"{c['num_nodes']} x {c['ranks_per_node']}", c["model"], str(c["num_tokens"])] for c in figures["cases"]
    ]
    assert [row[-1] for row in rows] == [c.get("oracle_check", "skipped") for c in figures["cases"]]
    for model, line in zip(figures["verdicts"], verdicts):
        assert [x for x in page if x.startswith(f"{model}: ")] == [line]
    return page


def _figures(model: str, nodes: int, ranks_per_node: int, ms: float, ratio: float, bound_mb: float) -> dict:
    """One case's figures as _bench_case returns them, every side taking ``ms`` except ours (and
    Buffer) taking ``ratio`` x that; cross-node bytes of ours 1.6x the bound, alltoall's 4x."""
    times = {side: ms * (ratio if side in ("ours", "buffer") else 1.0) for side in bench.SIDES}
    lower = int(bound_mb * 1e6) if nodes > 1 else 0
    stats = {s: {"total": dict.fromkeys(("median", "min", "max", "p10", "p90"), t)} for s, t in times.items()}
    spread = {"ratio": ratio, "p10": ratio * 0.9, "p90": ratio * 1.1}
    return {
        "model": model,
        "num_tokens": 16384,
        "num_nodes": nodes,
        "ranks_per_node": ranks_per_node,
        "oracle_check": "passed",
        "mismatches": [],
        "latency_ms": stats,
        "ratios": {"ours_over_alltoall": spread, "buffer_over_two_stage_floor": spread},
        "bytes": {
            "lower_bound_internode": lower,
            **{
                s: {"internode": int(lower * x), "internode_over_lower_bound": x if lower else None}
                for s, x in (("ours", 1.6), ("alltoall", 4.0), ("flat", 2.0))
            },
        },
    }


@pytest.mark.parametrize("megatron", [True, False])
def test_bench_report_fits_120_columns_with_one_verdict_per_model(tmp_path, megatron):
    """Wide figures (5-digit ms and MB, the longest model name, a skipped model, a model on one node
    only) still give a page within 120 columns on a 300-column console, one verdict per model."""
    from rich.console import Console

    results = [
        _figures("qwen3-30b-a3b", 8, 8, 12345.6, 0.7, 15000.0),
        _figures("qwen3-30b-a3b", 1, 64, 12345.6, 1.2, 0.0),
        _figures("deepseek-v3", 1, 64, 99.0, 0.5, 0.0),
        {"model": "mixtral-8x7b", "num_tokens": 16384, "num_nodes": 8, "ranks_per_node": 8, "skipped": "E % W"},
    ]
    config = bench.BenchConfig(("qwen3-30b-a3b",), (16384,), 1.0, 64, (8, 64), 50, 10, "bf16", 0, megatron=megatron)
    out = io.StringIO()
    status = bench._report(
        results, config, "8 nodes x 8 x GPU (NCCL)", tmp_path / "b.json", console=Console(file=out, width=300)
    )
    figures = json.loads((tmp_path / "b.json").read_text())
    page = _page(out.getvalue(), figures)
    assert status == 0 and figures["cases"] == results and "goal" not in out.getvalue()
    side, base = ("ours", "alltoall") if megatron else ("Buffer", "floor")
    header = [line for line in page if line.startswith("┃")]
    assert len(header) == 2 and f"{side} /" in header[0] and f"{base} ┃" in header[1]
    qwen, deepseek, mixtral = figures["verdicts"].values()
    assert (
        qwen["faster"] == 1
        and qwen["cases"] == 2
        and qwen["bytes_over_bound"] == pytest.approx({"ours": 1.6, "alltoall": 4.0}, rel=1e-6)
    )
    assert "in 1 of 2 cases (0.70-1.20x its time); cross-node 1.60x the bound, alltoall 4.00x" in qwen["line"]
    assert deepseek["bytes_over_bound"] is None and "(0.50x its time); one node" in deepseek["line"]
    assert mixtral["cases"] == 0 and mixtral["line"] == "mixtral-8x7b: skipped: E % W"


def test_bench_console_is_120_columns_in_logs_and_pipes_unless_columns_says(monkeypatch, capsys):
    monkeypatch.delenv("COLUMNS", raising=False)
    assert bench_page.console().width == bench_page.PAGE_WIDTH == 120  # capsys: stdout is not a terminal
    monkeypatch.setenv("COLUMNS", "90")
    assert bench_page.console().width == 90


def test_bench_defaults_cover_the_issue_table():
    config, _ = bench._parse_args([], None)
    assert config.world_size == 4 and config.topologies == (2, 4) and config.num_tokens == (4096, 256)
    assert set(config.models) == set(routing.PRESETS) and config.dtype == "bf16"
    config, _ = bench._parse_args(["--ranks-per-node", "2"], (0, 8, 4))  # torchrun: W and L from its variables
    assert config.world_size == 8 and config.topologies == (2,)


@pytest.mark.world
def test_bench_overlap_tiny_world_writes_consistent_figures(tmp_path, capsys):
    from benchmarks import bench_overlap

    out = tmp_path / "overlap.json"
    assert (
        bench_overlap.main(
            [
                "--models",
                "mixtral-8x7b",
                "--num-tokens",
                "64",
                "--micro-batches",
                "2",
                "--iters",
                "3",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    assert "hidden static" in capsys.readouterr().out
    (r,) = json.loads(out.read_text())["results"]
    times, med = r["times_ms"], r["median_ms"]
    assert set(times) == set(bench_overlap.MODES) and all(len(v) == 3 and min(v) > 0 for v in times.values())
    assert med == {m: statistics.median(v) for m, v in times.items()}
    assert r["hidden_fraction_static"] == pytest.approx(1 - (med["static"] - med["compute"]) / med["comm"])
    a, b, c = sorted(1 - (st - co) / cm for st, co, cm in zip(times["static"], times["compute"], times["comm"]))
    assert r["hidden_fraction_static_quartiles"] == pytest.approx([(a + b) / 2, b, (b + c) / 2])  # inclusive
    assert set(r["parts_ms"]["static"]) == set(bench_overlap.PARTS) and r["parts_ms"]["static"]["experts"] > 0


def test_bench_reports_mismatches():
    got = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    want = got.clone()
    want[1, 0] = 0.0
    assert bench._mismatches([("recv_x", got, got.clone())], rank=3) == []
    errors = bench._mismatches([("recv_x", got, want), ("recv_topk_weights", None, want)], rank=3)
    assert errors == [
        "rank 3: recv_x: 1 of 3 rows differ from the oracle (first: [1])",
        "rank 3: recv_topk_weights: got NoneType, oracle Tensor",
    ]


def test_bench_rejects_bad_sizes():
    with pytest.raises(SystemExit):
        bench.main(["--world-size", "6", "--ranks-per-node", "4"])
    with pytest.raises(SystemExit):
        bench.main(["--timeout-s", "0"])


def test_bench_zero_ranks_is_an_error_not_the_default(capsys):
    for flag in ("--world-size", "--ranks-per-node", "--num-tokens"):
        with pytest.raises(SystemExit):
            bench._parse_args([flag, "0"], None)
        assert f"{flag} must be >= 1, got 0" in capsys.readouterr().err


def test_bench_layout_names_nodes_and_warns_when_a_node_spans_hosts():
    lines, warnings = bench._layout(["a", "a", "b", "b"], 2)
    assert lines == ["node 0: a (ranks 0-1)", "node 1: b (ranks 2-3)"] and warnings == []
    assert bench._layout(["a"] * 4, 2)[1] == []  # several nodes on one host: a simulated cluster
    lines, warnings = bench._layout(["a", "b", "a", "b"], 2)  # LOCAL_WORLD_SIZE larger than the GPUs per host
    assert len(warnings) == 2 and warnings[0].startswith("node 0 (ranks 0-1) spans hosts a, b: ranks_per_node=2")
    lines, _ = bench._layout([f"h{n}" for n in range(10)], 1)
    assert len(lines) == 7 and lines[4] == "... (4 more)" and lines[-1] == "node 9: h9 (ranks 9-9)"
    ratio = bench._ratio([2.0, 4.0, 6.0], [1.0, 4.0, 3.0])
    assert ratio["ratio"] == pytest.approx(4.0 / 3.0) and (ratio["p10"], ratio["p90"]) == (1.0, 2.0)


# -- soak ---------------------------------------------------------------------------------------
@pytest.mark.world
@pytest.mark.parametrize("transport", ["torch_dist", "kernels"])
def test_soak_tiny_world_checks_and_samples(tmp_path, capsys, transport):
    """benchmarks/soak.py on 2 ranks: every mode runs, every 2nd iteration is checked against the
    oracle, the samples stay within the bounds, and it exits 0."""
    from benchmarks import soak
    from moe_dispatch import _ext
    from moe_dispatch.testing.cases import MODES

    if transport == "kernels" and not _ext.extension_status().built:
        pytest.skip("transport='kernels' needs the built extension")
    out = tmp_path / "soak.json"
    argv = ["--iterations", "40", "--check-every", "2", "--interval", "10", "--warmup", "10", "--world-size", "2"]
    assert (
        soak.main(
            [
                *argv,
                "--ranks-per-node",
                "1",
                "--transport",
                transport,
                "--max-tokens",
                "32",
                "--max-hidden",
                "256",
                "--rss-growth-mib",
                "256",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "soak: " in printed and "20 checked against the oracle" in printed and "ok" in printed
    figures = json.loads(out.read_text())
    assert figures["ok"] and figures["iterations"] == 40 and figures["checks"] == 20 and figures["mismatch"] is None
    assert set(figures["modes"]) == set(MODES)
    assert [s["iteration"] for s in figures["samples"]] == [10, 20, 30, 40]
    assert all(len(s["ranks"]) == 2 and s["ranks"][0]["threads"] > 0 for s in figures["samples"])
    assert all(r["groups"] >= 1 for s in figures["samples"] for r in s["ranks"])  # the world's, at least


def test_soak_growth_names_what_grew():
    from benchmarks.soak import growth

    base = {"threads": 10, "fds": 40, "shm_mappings": 2, "groups": 3, "rss_kib": 100 * 1024}
    assert growth(base, dict(base), slack=0, rss_growth_mib=8) == []
    grown = dict(base, threads=11, fds=41, groups=4, rss_kib=120 * 1024)
    assert growth(grown, grown, 0, 8) == []
    assert growth(base, grown, slack=0, rss_growth_mib=8) == [
        "threads 10 -> 11",
        "fds 40 -> 41",
        "groups 3 -> 4",
        "RSS +20.0 MiB (bound 8)",
    ]
    assert growth(base, grown, slack=1, rss_growth_mib=32) == []


def test_known_megatron_warnings_are_filtered_and_others_kept(monkeypatch):
    import logging
    import warnings

    from moe_dispatch.tools import quiet

    monkeypatch.setattr(quiet, "_INSTALLED", False)
    logger = logging.getLogger("torch.utils.cpp_extension")
    monkeypatch.setattr(logger, "filters", [])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet.filter_known_warnings()
        warnings.warn("Apex is not installed. Falling back to Torch Norm", UserWarning, stacklevel=1)
        warnings.warn("moe_ffn_hidden_size is not set, using ffn_hidden_size instead.", UserWarning, stacklevel=1)
        warnings.warn("something else went wrong", UserWarning, stacklevel=1)
    assert [str(w.message) for w in seen] == ["something else went wrong"]
    record = logging.LogRecord(logger.name, logging.WARNING, __file__, 1, "No CUDA runtime is found, using X", (), None)
    assert not logger.filter(record)
    other = logging.LogRecord(logger.name, logging.WARNING, __file__, 1, "a real problem", (), None)
    assert logger.filter(other)
