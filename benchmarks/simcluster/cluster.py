"""N simulated nodes on one machine: Linux network namespaces behind a software switch, each
node's uplink shaped with ``tc``, L rank processes per node.

Layout of one cluster (``<name>`` = ``mdsim-<owner pid>-<serial>``, unique per run)::

    namespace <name>-sw:  bridge "sw", ports n0 .. n{N-1}      (the switch)
                             |  veth pair: one node's link, tbf on both ends
    namespace <name>-n<i>: "uplink" 10.213.0.<i+1>/24, lo        (node i, its L ranks)

Ranks of one node reach each other at the node's own address, which the kernel routes over
the namespace's loopback (fast, unshaped: the NVLink of the simulation); ranks of different
nodes cross their uplinks (``tbf`` at ``rate_mbit`` on the node's transmit side and on the
switch port towards the node, i.e. both directions; ``netem`` delay on the transmit side when
the kernel has it: the RDMA link). Addresses exist only inside these namespaces; the harness
itself never opens a socket to them.

Each node runs one process that imports torch once and forks its L ranks (what a forkserver
gives ``moe_dispatch.launch``: on two cores, 16 imports of torch take longer than the
benchmark). Everything is torn down on exit, on errors and on Ctrl-C (``SimCluster`` is a
context manager); node and rank processes also get SIGKILL when their parent dies
(``PR_SET_PDEATHSIG``), and :func:`sweep_leftovers` removes the namespaces (and the processes
inside them) of a harness that was killed outright.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

PREFIX = "mdsim"  # only this harness creates namespaces with this prefix
SUBNET = "10.213.0"  # inside the cluster's own namespaces only
UPLINK, BRIDGE = "uplink", "sw"
MASTER_PORT = 29500  # the namespaces are fresh: any port is free there
PROVISIONAL_MBIT = 10_000.0  # links before set_rate() (only the rendezvous crosses them then)
REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
_SERIAL = itertools.count()
_CMD_TIMEOUT_S = 20.0


class SetupError(RuntimeError):
    """The machine cannot host the simulated cluster (no root, no ``ip``/``tc``, a kernel
    feature missing); the message says what is missing and what to do."""


def missing_requirements() -> list[str]:
    """What this machine lacks for a simulated cluster, one line each (empty: nothing)."""
    missing = []
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        missing.append("root privileges (network namespaces and tc need CAP_NET_ADMIN): run as root, e.g. with sudo")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            missing.append(f"the `{tool}` command (package iproute2)")
    return missing


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    """Runs one ``ip``/``tc`` command (bounded); raises SetupError naming it when it fails."""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=_CMD_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as err:
        raise SetupError(f"`{' '.join(cmd)}` did not finish within {_CMD_TIMEOUT_S:g} s") from err
    if check and done.returncode != 0:
        raise SetupError(f"`{' '.join(cmd)}` failed (exit {done.returncode}): {done.stderr.strip()}")
    return done


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def netns_names() -> list[str]:
    out = _run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _kill_netns_processes(ns: str) -> None:
    """SIGKILLs the processes left inside one of our namespaces (rank processes of a run)."""
    for pid in _run("ip", "netns", "pids", ns, check=False).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def sweep_leftovers(log=print) -> list[str]:
    """Deletes the namespaces of earlier runs whose harness process is gone (a killed run),
    after killing the processes still inside them. Returns the names removed."""
    removed = []
    for ns in netns_names():
        parts = ns.split("-")
        if parts[0] != PREFIX or len(parts) < 3 or not parts[1].isdigit():
            continue
        if _pid_alive(int(parts[1])):
            continue  # a live run (maybe ours, maybe a concurrent one) owns it
        _kill_netns_processes(ns)
        _run("ip", "netns", "del", ns, check=False)
        removed.append(ns)
    if removed:
        log(f"[simcluster] removed leftovers of a killed run: {', '.join(removed)}")
    return removed


def die_with_parent() -> None:
    """SIGKILL this process when its parent dies (Linux prctl); the node processes run it as
    preexec_fn, their ranks after the fork."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class SimCluster:
    """A simulated cluster of ``num_nodes`` x ``ranks_per_node`` ranks (a context manager).

    Args:
        num_nodes: N network namespaces.
        ranks_per_node: L rank processes per namespace.
        rate_mbit: inter-node link rate per node and direction (tbf), Mbit/s; None = fast
            (``PROVISIONAL_MBIT``) until :meth:`set_rate` sets the real one.
        delay_ms: one-way inter-node delay added on each node's transmit side (netem); None =
            0.2 ms when the kernel has sch_netem, else none; a positive value on a kernel
            without netem is a SetupError.
        mtu: MTU of the node links (jumbo frames by default, as on RDMA fabrics).
        log: where progress lines go.

    Raises:
        SetupError: root, ``ip`` or ``tc`` missing, or a kernel feature (namespaces, veth,
            bridge, tbf, netem when asked for) unavailable; nothing is left behind.
    """

    def __init__(
        self,
        num_nodes: int,
        ranks_per_node: int,
        *,
        rate_mbit: float | None,
        delay_ms: float | None = None,
        mtu: int = 9000,
        log=print,
    ):
        if num_nodes < 1 or ranks_per_node < 1:
            raise ValueError(f"need at least 1 node and 1 rank per node, got {num_nodes} x {ranks_per_node}")
        if num_nodes > 250:
            raise ValueError(f"at most 250 nodes fit the cluster's /24, got {num_nodes}")
        if rate_mbit is not None and not rate_mbit > 0:
            raise ValueError(f"rate_mbit must be positive, got {rate_mbit!r}")
        self.num_nodes, self.ranks_per_node = num_nodes, ranks_per_node
        self.world_size = num_nodes * ranks_per_node
        self.rate_mbit = PROVISIONAL_MBIT if rate_mbit is None else rate_mbit
        self.rate_pending = rate_mbit is None
        self.delay_ms, self.mtu, self.log = delay_ms, mtu, log
        self.name = f"{PREFIX}-{os.getpid()}-{next(_SERIAL)}"
        self.switch_ns = f"{self.name}-sw"
        self.procs: list[subprocess.Popen] = []  # one per node (its ranks are forked from it)
        self.run_dir = pathlib.Path(".")
        self._created: list[str] = []
        self._log_files: list = []

    # -- names -----------------------------------------------------------------------------
    def node_ns(self, node: int) -> str:
        return f"{self.name}-n{node}"

    @staticmethod
    def node_addr(node: int) -> str:
        return f"{SUBNET}.{node + 1}"

    def describe(self) -> str:
        delay = f"{self.delay_ms:g} ms one-way delay" if self.delay_ms else "no added delay"
        rate = (
            "rate set after the link probe"
            if self.rate_pending
            else f"{self.rate_mbit:.0f} Mbit/s per node and direction (tbf)"
        )
        return (
            f"{self.num_nodes} nodes x {self.ranks_per_node} ranks (namespaces {self.name}-n*), inter-node "
            f"links {rate}, {delay}, MTU {self.mtu}; "
            f"intra-node traffic over each node's loopback (unshaped); each rank pinned to one core"
        )

    # -- life cycle ------------------------------------------------------------------------
    def __enter__(self) -> "SimCluster":
        missing = missing_requirements()
        if missing:
            raise SetupError("the simulated cluster needs " + "; ".join(missing))
        sweep_leftovers(self.log)
        try:
            self._up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def _netns_add(self, ns: str) -> None:
        done = _run("ip", "netns", "add", ns, check=False)
        if done.returncode != 0:
            raise SetupError(
                f"cannot create a network namespace (`ip netns add {ns}`: {done.stderr.strip()}); "
                "the simulated cluster needs root and a kernel with network namespaces"
            )
        self._created.append(ns)

    def _tbf(self, rate_mbit: float) -> list[str]:
        burst = max(64 * 1024, 2 * self.mtu, int(rate_mbit * 1e6 / 8 / 500))  # >= 2 ms of traffic
        return ["tbf", "rate", f"{rate_mbit:g}mbit", "burst", str(burst), "latency", "20ms"]

    def _links(self):
        """(namespace, device) of every shaped link end: node transmit sides, switch ports."""
        for node in range(self.num_nodes):
            yield self.node_ns(node), UPLINK
            yield self.switch_ns, f"n{node}"

    def _shape(self, ns: str, dev: str, delay_ms: float) -> None:
        done = _run(
            "tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", *self._tbf(self.rate_mbit), check=False
        )
        if done.returncode != 0:
            raise SetupError(
                f"cannot shape the node links with tc tbf ({done.stderr.strip()}); "
                "the kernel needs sch_tbf (CONFIG_NET_SCH_TBF)"
            )
        if delay_ms > 0:
            done = _run(
                "tc",
                "-n",
                ns,
                "qdisc",
                "add",
                "dev",
                dev,
                "parent",
                "1:1",
                "handle",
                "10:",
                "netem",
                "delay",
                f"{delay_ms * 1000:g}us",
                "limit",
                "100000",
                check=False,
            )
            if done.returncode != 0:
                raise SetupError(
                    f"cannot add link delay with tc netem ({done.stderr.strip()}); this kernel lacks "
                    "sch_netem (CONFIG_NET_SCH_NETEM): run with --delay-ms 0"
                )

    def set_rate(self, rate_mbit: float) -> None:
        """Changes every inter-node link to ``rate_mbit`` (per node and direction), live."""
        for ns, dev in self._links():
            _run("tc", "-n", ns, "qdisc", "change", "dev", dev, "root", "handle", "1:", *self._tbf(rate_mbit))
        self.rate_mbit, self.rate_pending = rate_mbit, False

    def _netem_available(self, ns: str) -> bool:
        probe = _run("tc", "-n", ns, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1us", check=False)
        if probe.returncode == 0:
            _run("tc", "-n", ns, "qdisc", "del", "dev", "lo", "root", check=False)
        return probe.returncode == 0

    def _up(self) -> None:
        sw = self.switch_ns
        self._netns_add(sw)
        if _run("ip", "-n", sw, "link", "add", BRIDGE, "type", "bridge", check=False).returncode != 0:
            raise SetupError("cannot create a Linux bridge in a namespace (kernel without CONFIG_BRIDGE)")
        _run("ip", "-n", sw, "link", "set", BRIDGE, "up")
        if self.delay_ms is None:
            self.delay_ms = 0.2 if self._netem_available(sw) else 0.0
            if not self.delay_ms:
                self.log(
                    "[simcluster] note: this kernel has no sch_netem, so the links get no added delay "
                    "(rate shaping only)"
                )
        for node in range(self.num_nodes):
            ns, port = self.node_ns(node), f"n{node}"
            self._netns_add(ns)
            if (
                _run(
                    "ip",
                    "-n",
                    sw,
                    "link",
                    "add",
                    port,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    UPLINK,
                    "netns",
                    ns,
                    check=False,
                ).returncode
                != 0
            ):
                raise SetupError("cannot create veth pairs between namespaces (kernel without CONFIG_VETH)")
            _run("ip", "-n", sw, "link", "set", port, "mtu", str(self.mtu), "master", BRIDGE, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "-n", ns, "link", "set", UPLINK, "mtu", str(self.mtu), "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.node_addr(node)}/24", "dev", UPLINK)
            self._shape(ns, UPLINK, self.delay_ms)  # node -> switch (transmit), with the delay
            self._shape(sw, port, 0.0)  # switch -> node (receive)
        self.log(f"[simcluster] up: {self.describe()}")

    def down(self) -> None:
        """Kills the rank processes and deletes every namespace of this cluster (idempotent)."""
        self.kill_all()
        for ns in reversed(self._created):
            _kill_netns_processes(ns)
            _run("ip", "netns", "del", ns, check=False)
        left = [ns for ns in netns_names() if ns in self._created]
        self._created = left
        for f in self._log_files:
            f.close()
        self._log_files = []
        if left:
            self.log(
                f"[simcluster] WARNING: could not delete namespaces {left}; run `python -m benchmarks.simcluster "
                f"cleanup` once their processes are gone"
            )

    # -- ranks -----------------------------------------------------------------------------
    def launch(
        self,
        args: list[str],
        run_dir: pathlib.Path,
        *,
        env: dict[str, str] | None = None,
        rank0_stdout=None,
        master_port: int = MASTER_PORT,
    ) -> None:
        """Starts the ranks (once): in each node's namespace one ``rank.py node`` process imports
        torch once and forks the node's L ranks, each running ``rank.py <args>``.

        Each rank gets torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
        MASTER_ADDR = node 0's address, MASTER_PORT) and ``GLOO_SOCKET_IFNAME=uplink``, so gloo
        binds to and advertises its node's address. Rank 0's stdout goes to ``rank0_stdout``
        (None: its log); every rank's other output goes to ``run_dir/rank<r>.log``; each rank
        leaves ``rank<r>.pid`` and, once reaped, ``rank<r>.exit`` there.
        """
        self.run_dir = run_dir
        # A CPU cluster: the ranks see no GPU, also on a machine with one (env may say otherwise).
        base = {
            **os.environ,
            "CUDA_VISIBLE_DEVICES": "",
            **(env or {}),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.ranks_per_node),
            "MASTER_ADDR": self.node_addr(0),
            "MASTER_PORT": str(master_port),
            "GLOO_SOCKET_IFNAME": UPLINK,
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            "SIMCLUSTER_RUN_DIR": str(run_dir),
        }
        base["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
        for node in range(self.num_nodes):
            log = open(run_dir / f"node{node}.log", "w")  # noqa: SIM115 - closed in down()
            self._log_files.append(log)
            out = rank0_stdout if (node == 0 and rank0_stdout is not None) else log
            cmd = [
                "ip",
                "netns",
                "exec",
                self.node_ns(node),
                sys.executable,
                "-m",
                "benchmarks.simcluster.rank",
                "node",
                str(node * self.ranks_per_node),
                "--",
                *args,
            ]
            self.procs.append(
                subprocess.Popen(
                    cmd,
                    cwd=REPO_ROOT,
                    env=base,
                    stdout=out,
                    stderr=log,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                    preexec_fn=die_with_parent,
                )
            )

    def exit_codes(self) -> dict[int, int | None]:
        """Ranks that have exited: their exit codes (None when their node process is gone
        without reaping them, e.g. killed)."""
        codes: dict[int, int | None] = {}
        for rank in range(self.world_size):
            path = self.run_dir / f"rank{rank}.exit"
            if path.exists():
                codes[rank] = int(path.read_text())
            elif self.procs and self.procs[rank // self.ranks_per_node].poll() is not None:
                codes[rank] = None
        return codes

    def wait(self, timeout_s: float) -> tuple[list[int | None], list[int]]:
        """Waits (at most ``timeout_s``) for every rank to exit; kills the ones still running.

        Returns:
            ``(exit codes by rank, ranks killed because they were still running)``.
        """
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        codes = self.exit_codes()
        hung = [r for r in range(self.world_size) if r not in codes]
        self.kill_all()
        return [codes.get(r) for r in range(self.world_size)], hung

    def kill_all(self) -> None:
        """SIGKILLs every node process and its ranks (one process group per node) and reaps them."""
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def uplink_bytes(self, node: int) -> dict[str, int]:
        """Bytes node ``node`` has sent (``tx``) and received (``rx``) over its uplink so far."""
        stats = json.loads(_run("ip", "-n", self.node_ns(node), "-s", "-j", "link", "show", UPLINK).stdout)[0]
        return {"tx": int(stats["stats64"]["tx"]["bytes"]), "rx": int(stats["stats64"]["rx"]["bytes"])}

    # -- faults ----------------------------------------------------------------------------
    def cut_link(self, node: int) -> None:
        """Unplugs node ``node``'s cable at the switch: its uplink goes down (both ends of the veth)."""
        _run("ip", "-n", self.switch_ns, "link", "set", f"n{node}", "down")

    def kill_rank(self, rank: int) -> None:
        """SIGKILLs rank ``rank``'s process (a crashed rank: the kernel closes its sockets)."""
        os.kill(int((self.run_dir / f"rank{rank}.pid").read_text()), signal.SIGKILL)
