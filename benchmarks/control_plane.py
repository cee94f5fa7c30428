"""The control plane's load on the job's store at thousands of ranks, simulated on one machine: a
TCPStore server on loopback (in this process, as on global rank 0) and simulated EP ranks on fewer
connections than ranks (worker processes, each connection carrying the writes and reads of
ranks / connections ranks), before and after, side by side:

- before: the earlier policy, reproduced here as the baseline (:class:`BaselineWriter`,
  :func:`baseline_read`): each rank stores its two marks (caller, comm) every 0.05 s, and on a
  failure every rank reads every peer's keys one by one (a ``check`` and a ``get`` each);
- after: ``moe_dispatch.control.progress`` itself: one record per rank stored at most every
  ``WRITE_INTERVAL_S``, and one shared read per round (``Progress._shared_records``).

Printed for each size: the sets/s into the store in a steady dispatch/combine loop (the per-rank
rate measured from each policy's own writer against a counting store, times the ranks: offered,
and what the connections achieved), the ``get`` and ``wait`` p50/p99 latency under that load (a
probe connection), and the whole job's diagnosis after a collective timed out on every rank at
once: every rank notes its failure, then every rank reads every rank's state; the time until
every rank has it, and one rank's read (p50/p99/max) against ``READ_TIMEOUT_S``. Where the baseline's diagnosis does not
finish within ``--diag-budget-s``, its time is extrapolated from the operations it completed
(marked ``~``).

    .venv/bin/python benchmarks/control_plane.py [--sizes 64 256 1024 4096] [--json out.json]

Not a timed test: figures of one run on a loaded machine. Loopback only; every loop is bounded in
count and time.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import queue
import sys
import threading
import time

import torch
import torch.distributed as dist

from moe_dispatch.control import progress
from moe_dispatch.control.store import READ_TIMEOUT_S, group_key

HOST = "127.0.0.1"
STEP_S = 0.01  # one dispatch and one combine of the simulated steady loop
WARMUP_S = 0.6  # of the loop, before its sets are counted
SEQ = 7  # the operation every rank's collective timed out in
BASELINE_FLUSH_S, BASELINE_IDLE = 0.05, 20  # the earlier writer's interval and idle intervals


# -- the write policies' rates ---------------------------------------------------------------------
class CountingStore:
    """The store of :func:`policy_rate`: counts sets; a writer's close deletes nothing."""

    def __init__(self):
        self.sets = 0

    def set(self, key, value):
        self.sets += 1

    def delete_key(self, key):
        return True


class BaselineWriter:
    """The earlier writer, reproduced as the baseline: each thread's latest mark under its own key,
    the changed keys stored every BASELINE_FLUSH_S, asleep after BASELINE_IDLE quiet intervals."""

    def __init__(self, store):
        self.store, self.latest, self.sent = store, {}, {}
        self.wake, self.closing = threading.Condition(), False
        self.thread = threading.Thread(target=self._write, daemon=True)
        self.thread.start()

    def mark(self, thread: str, seq: int, what: str) -> None:
        self.latest[thread] = f"{seq} {what}"
        with self.wake:
            self.wake.notify()

    def _changed(self):
        return {k: v for k, v in list(self.latest.items()) if self.sent.get(k) != v}

    def _write(self):
        quiet = 0
        while not self.closing:
            with self.wake:
                if quiet >= BASELINE_IDLE:
                    while not self.closing and not self._changed():
                        self.wake.wait()
                    quiet = 0
                else:
                    self.wake.wait_for(lambda: self.closing, BASELINE_FLUSH_S)
            batch = self._changed()
            quiet = 0 if batch else quiet + 1
            for key, value in batch.items():
                self.store.set(key, value)
                self.sent[key] = value

    def close(self):
        with self.wake:
            self.closing = True
            self.wake.notify()
        self.thread.join()


def policy_rate(policy: str, seconds: float) -> float:
    """Sets per second one rank makes in a steady dispatch/combine loop under ``policy``, measured
    from its writer ("after": the library's Progress) against a counting store, over ``seconds``
    after a warm-up of WARMUP_S (the loop's first marks are stored at once)."""
    store = CountingStore()
    writer = BaselineWriter(store) if policy == "before" else progress.Progress([0, 1], 0, store=store)
    seq, start, first = 0, time.monotonic(), None
    while (now := time.monotonic() - start) < WARMUP_S + seconds:
        if first is None and now >= WARMUP_S:
            first, since = store.sets, time.monotonic()
        seq += 2
        writer.mark("caller", seq, "dispatch (metadata)")
        writer.mark("comm", seq, "dispatch (metadata)")
        time.sleep(STEP_S / 2)
        writer.mark("comm", seq + 1, "combine")
        time.sleep(STEP_S / 2)
    rate = (store.sets - first) / (time.monotonic() - since)
    writer.close()
    return rate


# -- the reads on a failure --------------------------------------------------------------------------
def baseline_keys(prefix: str, rank: int) -> list[str]:
    return [f"{prefix}/{rank}/{name}" for name in ("caller", "comm", "failed")]


def baseline_read(store, prefix: str, world: int, rank: int, deadline: float) -> tuple[bool, int]:
    """The earlier diagnosis' read, reproduced as the baseline: every peer's marks and failure note,
    each a ``check`` and (when present) a ``get``. Returns whether it finished before ``deadline``
    (``time.monotonic()``) and the store operations it made."""
    ops = 0
    for peer in range(world):
        if time.monotonic() > deadline:
            return False, ops
        if peer != rank:
            for key in baseline_keys(prefix, peer):
                ops += 1
                if store.check([key]):
                    store.get(key)
                    ops += 1
    return True, ops


# -- the worker processes ----------------------------------------------------------------------------
def _client(port: int):
    return dist.TCPStore(HOST, port, is_master=False, timeout=datetime.timedelta(seconds=60))


def _load(store, keys: list[str], rate: float, seconds: float) -> int:
    """Sets ``keys`` in turn at ``rate`` per second for ``seconds`` (as fast as it can when behind)."""
    sets, start = 0, time.monotonic()
    while (now := time.monotonic() - start) < seconds:
        ahead = sets / rate - now
        if ahead > 0:
            time.sleep(ahead)
        store.set(keys[sets % len(keys)], f"{sets} combine")
        sets += 1
    return sets


def _thread_job(cmd: dict, store, index: int, state: dict) -> dict:
    """One connection's share of ``cmd``: the ranks ``r`` with ``r % connections == index``."""
    world, conns = cmd["world"], cmd["connections"]
    ranks = range(index, world, conns)
    kind = cmd["kind"]
    if kind == "load":
        keys = [f"{cmd['prefix']}/{r}/{name}" for r in ranks for name in cmd["key_names"]]
        return {"sets": _load(store, keys, cmd["rate"] / conns, cmd["seconds"])}
    if kind == "before-marks":  # the marks the baseline's ranks left
        for r in ranks:
            caller, comm, _ = baseline_keys(cmd["prefix"], r)
            store.multi_set([caller, comm], [f"{SEQ} dispatch (metadata)", f"{SEQ} combine"])
        return {}
    if kind == "before-note":
        for r in ranks:
            store.set(baseline_keys(cmd["prefix"], r)[2], f"{SEQ} combine")
        return {}
    if kind == "before-read":
        reads, ops, start = [], 0, time.monotonic()
        deadline = start + cmd["budget"]
        for r in ranks:
            began = time.monotonic()
            done, made = baseline_read(store, cmd["prefix"], world, r, deadline)
            ops += made  # a read cut off by the budget counts towards the rate
            if not done:
                break
            reads.append(time.monotonic() - began)
        return {"reads": reads, "ops": ops, "seconds": time.monotonic() - start}
    if kind == "after-create":  # as Buffer() does on every rank: the record stored at creation
        state[world] = {r: progress.Progress(list(range(world)), r, store=store) for r in ranks}
        return {}
    if kind == "after-note":
        for p in state[world].values():
            p._marks["comm"] = (SEQ, "combine")  # the rank's newest mark, without starting its writer thread
            p._note_failure(SEQ, "combine")
        return {}
    if kind == "after-read":
        reads, start = [], time.monotonic()
        for p in state[world].values():
            if time.monotonic() - start > cmd["budget"]:
                break
            began = time.monotonic()
            p._shared_records(SEQ, 0)
            reads.append(time.monotonic() - began)
        return {"reads": reads, "seconds": time.monotonic() - start}
    raise ValueError(kind)


def _run_connections(cmd: dict, stores: list, first: int, state: list[dict]) -> list[dict]:
    """``cmd`` on every connection at once (a thread each), connection ``i`` being global index
    ``first + i``."""
    out: list = [None] * len(stores)

    def run(i):
        out[i] = _thread_job(cmd, stores[i], first + i, state[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(stores))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def _worker(port: int, first: int, count: int, commands, results) -> None:
    """Worker process: ``count`` connections (global indices from ``first``), running the commands
    it is sent until None."""
    stores, state = [_client(port) for _ in range(count)], [{} for _ in range(count)]
    results.put(("ready", first))
    while (cmd := commands.get()) is not None:
        results.put((cmd["kind"], _run_connections(cmd, stores, first, state)))


class Cluster:
    """The store server here and the worker processes with their connections (``workers`` 0: the
    connections are threads of this process)."""

    def __init__(self, workers: int, connections: int):
        self.server = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False)
        self.probe = _client(self.server.port)
        self.connections = connections
        self.local = [_client(self.server.port) for _ in range(connections if not workers else 0)]
        self.local_state: list[dict] = [{} for _ in self.local]
        ctx = multiprocessing.get_context("spawn")
        self.results = ctx.Queue()
        self.queues, self.procs = [], []
        per = [connections // workers + (i < connections % workers) for i in range(workers)]
        first = 0
        for count in per:
            q = ctx.Queue()
            proc = ctx.Process(target=_worker, args=(self.server.port, first, count, q, self.results), daemon=True)
            proc.start()
            self.queues.append(q)
            self.procs.append(proc)
            first += count
        for _ in per:
            self._result()

    def _result(self, timeout_s: float = 600):
        """The next worker's answer; raises when a worker died or none came within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                return self.results.get(timeout=1)
            except queue.Empty:
                if dead := [p.exitcode for p in self.procs if not p.is_alive()]:
                    raise RuntimeError(f"a worker process exited ({dead})") from None
        raise TimeoutError(f"no worker answered within {timeout_s:g} s")

    def run(self, **cmd) -> list[dict]:
        """Every connection's result of one command."""
        cmd["connections"] = self.connections
        if self.local:
            return _run_connections(cmd, self.local, 0, self.local_state)
        for q in self.queues:
            q.put(cmd)
        out = []
        for _ in self.queues:
            out += self._result()[1]
        return out

    def close(self):
        for q in self.queues:
            q.put(None)
        for proc in self.procs:
            proc.join(30)
            if proc.is_alive():
                proc.terminate()


def _probe(store, stop: threading.Event, interval_s: float = 0.005) -> dict[str, list[float]]:
    """``get`` and ``wait`` latencies of an existing key until ``stop`` (at most 2,000 each)."""
    store.set("probe", "x")
    lat: dict[str, list[float]] = {"get": [], "wait": []}
    while not stop.is_set() and len(lat["get"]) < 2000:
        for name, call in (("get", lambda: store.get("probe")), ("wait", lambda: store.wait(["probe"]))):
            began = time.perf_counter()
            call()
            lat[name].append(time.perf_counter() - began)
        time.sleep(interval_s)
    return lat


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _under_load(cluster: Cluster, **load) -> dict:
    """The load command with the probe beside it: sets/s achieved, get/wait p50/p99 in ms."""
    stop, lat = threading.Event(), {}
    probe = threading.Thread(target=lambda: lat.update(_probe(cluster.probe, stop)))
    probe.start()
    start = time.monotonic()
    out = cluster.run(kind="load", **load)
    elapsed = time.monotonic() - start
    stop.set()
    probe.join()
    row = {"achieved_sets_per_s": sum(o["sets"] for o in out) / elapsed}
    for name, values in lat.items():
        row[f"{name}_p50_ms"], row[f"{name}_p99_ms"] = (1e3 * _pct(values, q) for q in (0.5, 0.99))
    return row


def measure_size(cluster: Cluster, world: int, rates: dict[str, float], args) -> dict:
    """Both policies at ``world`` ranks."""
    row: dict = {"ranks": world}
    group = group_key(list(range(world)))
    for policy, names in (("before", ["caller", "comm"]), ("after", ["state"])):
        offered = world * rates[policy]
        load = _under_load(
            cluster,
            world=world,
            prefix=f"bench/{policy}/{group}",
            key_names=names,
            rate=offered,
            seconds=args.load_s,
        )
        row[policy] = {"offered_sets_per_s": offered, **load}
    # the whole job's diagnosis
    prefix = f"bench/diag/{group}"
    cluster.run(kind="before-marks", world=world, prefix=prefix)
    start = time.monotonic()
    cluster.run(kind="before-note", world=world, prefix=prefix)
    noted = time.monotonic() - start
    out = cluster.run(kind="before-read", world=world, prefix=prefix, budget=args.diag_budget_s)
    reads = [t for o in out for t in o["reads"]]
    ops, seconds = sum(o["ops"] for o in out), max(o["seconds"] for o in out)
    needed = world * (world - 1) * 6  # a check and a get of each peer's three keys
    complete = len(reads) == world
    row["before"]["diagnosis_s"] = noted + (seconds if complete else seconds * needed / max(ops, 1))
    row["before"]["diagnosis_extrapolated"] = not complete
    per_op = seconds * cluster.connections / max(ops, 1)  # one connection's time per operation
    row["before"]["read_p50_s"] = _pct(reads, 0.5) if reads else per_op * needed / world
    row["before"]["read_p99_s"] = _pct(reads, 0.99) if reads else per_op * needed / world
    row["before"]["read_max_s"] = max(reads) if reads else per_op * needed / world
    row["before"]["read_estimated"] = not reads
    cluster.run(kind="after-create", world=world)
    start = time.monotonic()
    cluster.run(kind="after-note", world=world)
    noted = time.monotonic() - start
    out = cluster.run(kind="after-read", world=world, budget=args.diag_budget_s)
    reads, seconds = [t for o in out for t in o["reads"]], max(o["seconds"] for o in out)
    row["after"]["diagnosis_s"] = noted + seconds * world / max(len(reads), 1)
    row["after"]["diagnosis_extrapolated"] = len(reads) < world
    row["after"]["read_p50_s"], row["after"]["read_p99_s"] = _pct(reads, 0.5), _pct(reads, 0.99)
    row["after"]["read_max_s"] = max(reads, default=None)
    row["after"]["read_estimated"] = not reads
    row["sets_ratio"] = row["before"]["offered_sets_per_s"] / row["after"]["offered_sets_per_s"]
    return row


def run(sizes: list[int], args) -> dict:
    """Every size's row, and the policies' per-rank rates."""
    load_average = [round(x, 1) for x in os.getloadavg()]
    rates = {policy: policy_rate(policy, args.policy_s) for policy in ("before", "after")}
    cluster = Cluster(args.workers, args.connections)
    try:
        rows = [measure_size(cluster, world, rates, args) for world in sizes]
    finally:
        cluster.close()
    return {
        "sets_per_rank_per_s": rates,
        "write_interval_s": progress.WRITE_INTERVAL_S,
        "read_timeout_s": READ_TIMEOUT_S,
        "connections": args.connections,
        "workers": args.workers,
        "load_s": args.load_s,
        "diag_budget_s": args.diag_budget_s,
        "torch": torch.__version__,
        "load_average": load_average,
        "rows": rows,
    }


def _fmt(value, spec: str, approx: bool = False) -> str:
    return "-" if value is None else ("~" if approx else "") + format(value, spec)


def report(result: dict) -> str:
    """The figures side by side, as text."""
    rates = result["sets_per_rank_per_s"]
    lines = [
        f"control plane, simulated: {result['connections']} connections in {result['workers']} processes, "
        f"loopback TCPStore, torch {result['torch']}",
        f"sets per rank per second in a steady loop: before {rates['before']:.1f} (baseline replica), "
        f"after {rates['after']:.2f} (WRITE_INTERVAL_S {result['write_interval_s']:g})",
        "",
        f"{'ranks':>6} {'policy':>6} {'sets/s offered':>14} {'achieved':>9} {'get p50/p99 ms':>15} "
        f"{'wait p50/p99 ms':>16} {'diagnosis s':>12} {'read p50/p99/max s':>22}",
    ]
    for row in result["rows"]:
        for policy in ("before", "after"):
            r = row[policy]
            approx, estimated = r["diagnosis_extrapolated"], r["read_estimated"]
            lines.append(
                f"{row['ranks']:>6} {policy:>6} {r['offered_sets_per_s']:>14,.0f} {r['achieved_sets_per_s']:>9,.0f} "
                f"{_fmt(r['get_p50_ms'], '.2f'):>7}/{_fmt(r['get_p99_ms'], '.2f'):<7} "
                f"{_fmt(r['wait_p50_ms'], '.2f'):>8}/{_fmt(r['wait_p99_ms'], '.2f'):<7} "
                f"{_fmt(r['diagnosis_s'], '.2f', approx):>12} "
                f"{_fmt(r['read_p50_s'], '.3f', estimated):>7}/{_fmt(r['read_p99_s'], '.3f', estimated)}/"
                f"{_fmt(r['read_max_s'], '.3f', estimated)}"
            )
        lines.append(f"{'':>6} {'ratio':>6} {row['sets_ratio']:>14.1f}x fewer sets/s")
    lines.append(
        f"(~: extrapolated from the operations done within {result['diag_budget_s']:g} s; "
        f"load average at the start {result['load_average']})"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024, 4096], help="simulated ranks")
    parser.add_argument("--connections", type=int, default=32, help="store connections carrying the ranks")
    parser.add_argument("--workers", type=int, default=2, help="processes holding the connections (0: this one)")
    parser.add_argument("--load-s", type=float, default=2.0, help="seconds of each steady-loop load")
    parser.add_argument("--policy-s", type=float, default=4.0, help="seconds measuring each policy's write rate")
    parser.add_argument("--diag-budget-s", type=float, default=4.0, help="bound on each diagnosis' reads")
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args(argv)
    result = run(args.sizes, args)
    print(report(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
