"""The simulated multi-node cluster (``benchmarks/simcluster``): faults and plumbing.

A node's link cut in the middle of a dispatch and a rank killed in the middle of a combine must
make every surviving rank raise ``CommError`` within ``timeout_s`` (plus a little slack),
naming the operation and the peers it waited for, with nothing hanging and the cluster torn down.
These tests need root, iproute2 and network namespaces (CI runs as root); elsewhere they skip
and say what is missing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from benchmarks.simcluster import cluster as simcluster
from benchmarks.simcluster import faults
from benchmarks.simcluster.__main__ import main as simcluster_main

TIMEOUT_S = 4.0  # the ranks' Buffer(timeout_s=...)
SLACK_S = 4.0  # how late after timeout_s a survivor may fail (process exit, a loaded CI machine)


@pytest.fixture(scope="module")
def cluster_support():
    """Skips the test with the reason when this machine cannot host a simulated cluster."""
    missing = simcluster.missing_requirements()
    if missing:
        pytest.skip("simulated cluster unavailable: needs " + "; ".join(missing))
    try:
        with simcluster.SimCluster(2, 1, rate_mbit=100, delay_ms=0, log=lambda _: None):
            pass
    except simcluster.SetupError as err:
        pytest.skip(f"simulated cluster unavailable: {err}")


def _ours_left() -> list[str]:
    """Namespaces of this test process still present."""
    return [ns for ns in simcluster.netns_names() if ns.startswith(f"{simcluster.PREFIX}-{os.getpid()}-")]


def _check(outcome: faults.FaultOutcome) -> None:
    report = json.dumps([{k: v for k, v in r.items()} for r in outcome.ranks], indent=1)
    assert not outcome.problems(SLACK_S), "\n".join(outcome.problems(SLACK_S)) + "\n" + report
    assert outcome.cleaned_up and not _ours_left()
    print(f"{outcome.scenario}: {outcome.fault}; {outcome.wall_s:.1f} s in all")
    for r in outcome.survivors:
        print(
            f"  rank {r['rank']}: {r['seconds_after_fault']:.2f} s after the fault: {faults.name_nodes(r['message'])}"
        )


@pytest.mark.world
def test_link_cut_during_dispatch(cluster_support):
    outcome = faults.run_fault(
        "link-cut", num_nodes=2, ranks_per_node=2, timeout_s=TIMEOUT_S, slack_s=SLACK_S, log=lambda _: None
    )
    _check(outcome)
    assert len(outcome.survivors) == 4  # nobody died: every rank must notice the cut by itself
    for r in outcome.survivors:
        # Every inter-node group spans the cut: nobody gets past the next inter-node stage, and a
        # silent link shows only as the timeout.
        assert f"timeout_s={TIMEOUT_S:g}" in r["message"], r
        assert r["seconds_after_fault"] >= 0.25 * TIMEOUT_S, r


@pytest.mark.world
def test_rank_kill_during_combine(cluster_support):
    outcome = faults.run_fault(
        "rank-kill", num_nodes=2, ranks_per_node=2, timeout_s=TIMEOUT_S, slack_s=SLACK_S, log=lambda _: None
    )
    _check(outcome)
    victim = [r for r in outcome.ranks if r["victim"]]
    assert len(victim) == 1 and victim[0]["exit_code"] == -9, victim
    assert len(outcome.survivors) == 3
    # The victim's peers in the stage in flight fail in the combine, at once (the kernel closed
    # its sockets); a rank whose part was done fails in the next dispatch (checked by problems()).
    assert any(
        r["op"] == "combine" and f"EP rank {r['rank']} (node {r['node']}): combine " in r["message"]
        for r in outcome.survivors
    )


@pytest.mark.world
def test_intra_node_traffic_stays_off_the_uplinks(cluster_support, tmp_path):
    """Ranks of one node talk over its loopback; only inter-node traffic crosses the shaped link."""
    run_dir = tmp_path
    num_mb, reps = 2.0, 5  # rank.probe_links default reps
    with simcluster.SimCluster(2, 2, rate_mbit=400, delay_ms=0, log=lambda _: None) as cluster:
        before = [cluster.uplink_bytes(n)["tx"] for n in range(2)]
        cluster.launch(["bench", "--probe-only", "--probe-mb", str(num_mb)], run_dir)
        deadline = time.monotonic() + 120
        while not (run_dir / "intra.json").exists() and time.monotonic() < deadline:
            assert not cluster.exit_codes(), "a rank exited during the probe"
            time.sleep(0.05)
        (run_dir / "links.json").write_text(json.dumps({"rate_mbit": 400}))
        codes, hung = cluster.wait(120)
        sent = [cluster.uplink_bytes(n)["tx"] - b for n, b in zip(range(2), before)]
    assert not _ours_left()
    assert codes == [0, 0, 0, 0] and not hung, (codes, (run_dir / "rank0.log").read_text()[-2000:])
    probe = json.loads((run_dir / "probe.json").read_text())
    # Per node: (reps + 1 warm-up) all_to_alls, 2 ranks each sending num_mb to 1 peer on each side.
    per_kind = (reps + 1) * 2 * num_mb * 1e6
    for node_sent in sent:
        assert 0.95 * per_kind <= node_sent <= 1.25 * per_kind, (sent, per_kind)  # the inter-node probe alone
    assert probe["intra_node"]["mb_per_s_per_rank"] > probe["inter_node"]["mb_per_s_per_rank"], probe


def test_leftovers_of_a_killed_harness_are_swept(cluster_support):
    code = (
        "import sys, time; from benchmarks.simcluster import SimCluster\n"
        "c = SimCluster(2, 1, rate_mbit=100, delay_ms=0, log=lambda _: None).__enter__()\n"
        "print(c.name, flush=True); time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=simcluster.REPO_ROOT, stdout=subprocess.PIPE, text=True)
    try:
        name = proc.stdout.readline().strip()
        assert name.startswith(simcluster.PREFIX), name
    finally:
        proc.kill()  # SIGKILL: no teardown runs
        proc.wait(timeout=10)
    assert any(ns.startswith(name + "-") for ns in simcluster.netns_names())
    removed = simcluster.sweep_leftovers(log=lambda _: None)
    assert {f"{name}-sw", f"{name}-n0", f"{name}-n1"} <= set(removed), removed
    assert not any(ns.startswith(name + "-") for ns in simcluster.netns_names())


def test_missing_requirements_are_named(monkeypatch, capsys):
    """Without root or without iproute2 the harness stops at once and says what is missing."""
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(simcluster.shutil, "which", lambda tool: None)
    missing = simcluster.missing_requirements()
    assert (
        any("root" in m for m in missing) and any("`ip`" in m for m in missing) and any("`tc`" in m for m in missing)
    ), missing
    with pytest.raises(simcluster.SetupError, match="root privileges"):
        simcluster.SimCluster(2, 1, rate_mbit=100).__enter__()
    assert simcluster_main(["faults"]) == 2
    out = capsys.readouterr().out
    assert "missing: root privileges" in out and "iproute2" in out, out
