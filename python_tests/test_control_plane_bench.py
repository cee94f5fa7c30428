"""Smoke test of ``benchmarks/control_plane.py`` (the control plane's store load, simulated) at its
smallest size, its connections as threads of this process: the figures of both policies come
out, the ratio is computed, and the library's write policy makes fewer sets than the baseline."""

from __future__ import annotations

import argparse


def test_control_plane_bench_smallest_size():
    from benchmarks import control_plane as bench

    args = argparse.Namespace(workers=0, connections=4, load_s=0.3, policy_s=1.0, diag_budget_s=1.0)
    result = bench.run([64], args)
    rates = result["sets_per_rank_per_s"]
    assert 0 < rates["after"] < rates["before"], rates
    (row,) = result["rows"]
    before, after = row["before"], row["after"]
    assert row["sets_ratio"] == before["offered_sets_per_s"] / after["offered_sets_per_s"] > 1, row
    assert after["achieved_sets_per_s"] < before["achieved_sets_per_s"], row
    for figures in (before, after):
        assert figures["diagnosis_s"] > 0 and figures["read_p99_s"] is not None and figures["get_p99_ms"] > 0
    assert "fewer sets/s" in bench.report(result)
