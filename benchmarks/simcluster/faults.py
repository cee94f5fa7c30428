"""Faults in the simulated cluster: a node's link cut in the middle of a dispatch, a rank
killed in the middle of a combine. Every surviving rank must raise ``CommError`` within the
Buffer's ``timeout_s`` naming the operation and whom it waited for; nothing may hang; the
cluster is torn down afterwards whatever happened.

The ranks (``rank.py fault``) loop dispatch + combine and mark each operation as they enter it
(``phase-rank<r>.json``); the harness strikes as soon as the marks say the ranks are inside the
operation, records the wall time, and collects each rank's ``fault-rank<r>.json`` and exit code.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
import shutil
import tempfile
import time

from .cluster import SUBNET, SimCluster, netns_names

FAULT_EXIT_CODE = 3  # a rank that raised CommError (rank.py exits with it)

SCENARIOS = ("link-cut", "rank-kill")
# The operation each fault interrupts. A survivor whose own part of it was already done (its
# peers in the stage still in flight are not the ones cut off) fails in the operation after it.
OPERATION = {"link-cut": "dispatch", "rank-kill": "combine"}


def _allowed_ops(op: str, iteration: int) -> list[tuple[str, int]]:
    return [(op, iteration), ("combine", iteration) if op == "dispatch" else ("dispatch", iteration + 1)]


@dataclasses.dataclass
class FaultOutcome:
    """What one fault did to the world.

    Attributes:
        scenario: "link-cut" or "rank-kill".
        fault: what was done, in words.
        iteration: the loop iteration whose operation the fault interrupted.
        timeout_s: the ranks' ``Buffer(timeout_s=...)``.
        ranks: per rank: ``rank``, ``node``, ``exit_code``, ``victim`` (the killed rank),
            ``hung`` (still running when the harness gave up, then killed), and from its report
            ``op``, ``iteration``, ``error``, ``message``, ``seconds_after_fault``.
        cleaned_up: no namespace of the cluster is left.
        wall_s: the whole scenario, cluster set-up and teardown included.
    """

    scenario: str
    fault: str
    iteration: int
    timeout_s: float
    ranks: list[dict]
    cleaned_up: bool
    wall_s: float

    @property
    def survivors(self) -> list[dict]:
        return [r for r in self.ranks if not r["victim"]]

    def problems(self, slack_s: float) -> list[str]:
        """Every way this outcome misses the contract (empty: it holds)."""
        out = []
        want_op = OPERATION[self.scenario]
        allowed = _allowed_ops(want_op, self.iteration)
        for r in self.survivors:
            who = f"rank {r['rank']} (node {r['node']})"
            if r["hung"]:
                out.append(f"{who} hung: still running {self.timeout_s + slack_s:g} s after the fault")
            elif r["exit_code"] != FAULT_EXIT_CODE or r.get("error") != "CommError":
                out.append(f"{who} exited with {r['exit_code']} and {r.get('error')}: {r.get('message')}")
            else:
                late = r["seconds_after_fault"]
                if not -0.5 <= late <= self.timeout_s + slack_s:
                    out.append(f"{who} failed {late:.2f} s after the fault, outside [0, timeout_s + {slack_s:g} s]")
                if (r["op"], r["iteration"]) not in allowed or f"{r['op']} " not in r["message"]:
                    out.append(
                        f"{who} failed in {r['op']} {r['iteration']}, expected {want_op} {self.iteration} "
                        f"(or the operation after it) named in the message: {r['message']}"
                    )
                if "EP ranks [" not in r["message"]:
                    out.append(f"{who}'s error does not name the peers it waited for: {r['message']}")
        if self.survivors and not any(r.get("op") == want_op for r in self.survivors):
            out.append(f"no survivor failed in the interrupted {want_op}")
        if not self.cleaned_up:
            out.append("namespaces of the cluster were left behind")
        return out


def name_nodes(message: str) -> str:
    """The message with each cluster address annotated with its node (``10.213.0.2`` -> node 1)."""

    def node_of(match: re.Match) -> str:
        return f"{match.group(0)} (node {int(match.group(1)) - 1})"

    return re.sub(re.escape(SUBNET) + r"\.(\d+)", node_of, message)


def _read_json(path: pathlib.Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def run_fault(
    scenario: str,
    *,
    num_nodes: int = 2,
    ranks_per_node: int = 2,
    timeout_s: float = 5.0,
    rate_mbit: float = 100.0,
    num_tokens: int = 1024,
    hidden: int = 1024,
    target: int | None = None,
    slack_s: float = 5.0,
    start_timeout_s: float = 120.0,
    log=print,
) -> FaultOutcome:
    """Runs one fault scenario in a fresh simulated cluster and reports every rank's fate.

    Args:
        scenario: "link-cut" (node ``target``, default the last, loses its link while the ranks
            are in a dispatch) or "rank-kill" (rank ``target``, default the last, gets SIGKILL
            while it is in a combine).
        num_nodes, ranks_per_node, rate_mbit: the cluster (a slow link makes each operation
            last long enough to strike inside it).
        timeout_s: the ranks' ``Buffer(timeout_s=...)``.
        num_tokens, hidden: tokens per rank and row width (bf16), DeepSeek-V3 routing.
        slack_s: how long after ``timeout_s`` the harness waits before it calls a rank hung.
        start_timeout_s: bound on start-up (process start, rendezvous, first iterations).

    Raises:
        SetupError: the machine cannot host the cluster. RuntimeError: the ranks never got to
        the point of the fault (the logs are quoted).
    """
    if scenario not in SCENARIOS:
        raise ValueError(f"scenario must be one of {SCENARIOS}, got {scenario!r}")
    world = num_nodes * ranks_per_node
    if num_nodes < 2:
        raise ValueError(f"a fault between nodes needs at least 2 nodes, got {num_nodes}")
    target = (num_nodes - 1 if scenario == "link-cut" else world - 1) if target is None else target
    started = time.monotonic()
    run_dir = pathlib.Path(tempfile.mkdtemp(prefix=f"simcluster-{scenario}-"))
    try:
        cluster = SimCluster(num_nodes, ranks_per_node, rate_mbit=rate_mbit, delay_ms=None, log=log)
        with cluster:
            cluster.launch(
                [
                    "fault",
                    "--timeout-s",
                    str(timeout_s),
                    "--num-tokens",
                    str(num_tokens),
                    "--hidden",
                    str(hidden),
                    "--max-seconds",
                    str(start_timeout_s + 60),
                ],
                run_dir,
            )
            watch = range(world) if scenario == "link-cut" else [target]
            op = OPERATION[scenario]
            deadline = time.monotonic() + start_timeout_s
            while True:  # bounded by the deadline
                marks = [_read_json(run_dir / f"phase-rank{r}.json") for r in watch]
                if all(m and m["op"] == op and m["iteration"] >= 0 for m in marks):
                    break
                dead = sorted(cluster.exit_codes())
                if dead or time.monotonic() > deadline:
                    cluster.kill_all()
                    logs = "\n".join(
                        f"--- {log.name} ---\n{log.read_text()[-2000:]}" for log in sorted(run_dir.glob("*.log"))
                    )
                    why = f"ranks {dead} exited" if dead else f"nothing happened within {start_timeout_s:g} s"
                    raise RuntimeError(f"{scenario}: the ranks never reached the fault point ({why})\n{logs}")
                time.sleep(0.002)
            if scenario == "link-cut":
                cluster.cut_link(target)
                fault = f"node {target}'s link cut (switch port down) during dispatch {marks[0]['iteration']}"
            else:
                cluster.kill_rank(target)
                fault = (
                    f"rank {target} (node {target // ranks_per_node}) SIGKILLed during combine {marks[0]['iteration']}"
                )
            fault_time = time.time()
            log(f"[simcluster] {scenario}: {fault}")
            codes, hung = cluster.wait(timeout_s + slack_s)
        cleaned_up = not any(ns.startswith(cluster.name + "-") for ns in netns_names())
        ranks = []
        for r in range(world):
            report = _read_json(run_dir / f"fault-rank{r}.json") or {}
            entry = {
                "rank": r,
                "node": r // ranks_per_node,
                "exit_code": codes[r],
                "hung": r in hung,
                "victim": scenario == "rank-kill" and r == target,
            }
            if report:
                entry.update(
                    op=report["op"],
                    iteration=report["iteration"],
                    error=report["error"],
                    message=report["message"],
                    seconds_after_fault=report["time"] - fault_time,
                )
            ranks.append(entry)
        return FaultOutcome(
            scenario=scenario,
            fault=fault,
            iteration=marks[0]["iteration"],
            timeout_s=timeout_s,
            ranks=ranks,
            cleaned_up=cleaned_up,
            wall_s=time.monotonic() - started,
        )
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
