"""``python -m moe_dispatch.env``: the installation report users paste into bug reports.

Runs from the source tree (editable install: the commit comes from git) and from an installed
wheel (``make test-compat``: the commit setup.py recorded); the wheel case outside any checkout
is in test_wheel.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import moe_dispatch
from moe_dispatch.tools import env
from moe_dispatch.transport import choose_transport

PACKAGE_DIR = Path(moe_dispatch.__file__).resolve().parent
FROM_WHEEL = (PACKAGE_DIR / "_build_info.py").exists()


def _head_commit() -> str:
    """HEAD of the checkout holding these tests (the one the package or its wheel came from)."""
    done = subprocess.run(
        ["git", "-C", str(Path(__file__).parent), "rev-parse", "HEAD"], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"the tests are not in a git checkout: {done.stderr.strip()}")
    return done.stdout.strip()


def test_module_prints_versions_commit_transport_and_variables():
    variables = {
        "NCCL_DEBUG": "INFO",
        "MASTER_PORT": "29511",
        "NVSHMEM_REMOTE_TRANSPORT": "ucx",
        "CUDA_DEVICE_MAX_CONNECTIONS": "1",
        "MOE_DISPATCH_TEST_KNOB": "7",
        "UNRELATED_VARIABLE": "x",
    }
    done = subprocess.run(
        [sys.executable, "-m", "moe_dispatch.env"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **variables},
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()

    def row(label: str) -> str:  # a rich table row "│ label │ value │" or a plain "  label: value"
        found = [line for line in lines if f" {label} " in line or line.startswith(f"  {label}: ")]
        assert found, f"no row {label!r} in:\n{done.stdout}"
        return found[0]

    for name, value in variables.items():
        if name == "UNRELATED_VARIABLE":
            assert name not in done.stdout
        else:
            assert value in row(name)
    assert moe_dispatch.__version__ in row("moe_dispatch")
    assert _head_commit() in row("commit")
    assert torch.__version__.split("+")[0] in row("torch")
    name, _ = choose_transport(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    assert name in row("auto transport")
    assert "transport='kernels' is opt-in" in row("kernels")  # and why, in one line


def test_auto_logs_its_choice_once(caplog):
    """transport="auto" says once per process what it picked and why (logger moe_dispatch)."""
    from moe_dispatch.transport import _LOGGED, KERNELS_OPT_IN, log_choice

    name, reason = choose_transport(torch.device("cuda"))
    assert name == "torch_dist" and KERNELS_OPT_IN in reason  # CUDA: opt-in until the GPU check is committed
    _LOGGED.discard((name, reason))
    with caplog.at_level("INFO", logger="moe_dispatch"):
        log_choice(name, reason)
        log_choice(name, reason)
    records = [r for r in caplog.records if r.name == "moe_dispatch"]
    assert len(records) == 1 and f"picked 'torch_dist': {reason}" in records[0].getMessage()


def test_commit_comes_from_git_or_from_the_build(monkeypatch):
    info = env.source_commit()
    assert info["commit"] == _head_commit()
    assert info["source"] == ("recorded at build" if FROM_WHEEL else f"git checkout {PACKAGE_DIR.parent}")
    assert isinstance(info["dirty"], bool)
    # A recorded commit wins over git (a wheel installed into a venv inside some checkout).
    monkeypatch.setattr(env, "_build_info", lambda: {"commit": "f" * 40, "commit_dirty": True})
    assert env.source_commit() == {"commit": "f" * 40, "dirty": True, "source": "recorded at build"}


def test_commit_unknown_outside_a_checkout_without_build_info(monkeypatch, tmp_path):
    monkeypatch.setattr(env, "_build_info", lambda: None)
    monkeypatch.setattr(env, "PACKAGE_DIR", tmp_path / "moe_dispatch")
    (tmp_path / "moe_dispatch").mkdir()
    assert env.source_commit() == {
        "commit": None,
        "dirty": False,
        "source": "unknown: not recorded at build and not in a git checkout",
    }


def test_collect_reports_versions_extension_and_chosen_transport(monkeypatch):
    monkeypatch.setenv("MOE_DISPATCH_TEST_KNOB", "7")
    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("UNRELATED_VARIABLE", "x")
    info = env.collect()
    assert info["moe_dispatch"]["version"] == moe_dispatch.__version__
    assert info["moe_dispatch"]["location"] == str(PACKAGE_DIR)
    assert torch.__version__.startswith(info["packages"]["torch"])  # "2.x.y" vs "2.x.y+cu130"
    assert set(info["packages"]) == set(env.PACKAGES)
    assert info["gpus"]["torch_cuda"] == torch.version.cuda
    ext = info["extension"]
    assert ext["built"] in (True, False)
    assert ext["built"] or ext["error"]
    if FROM_WHEEL and ext["built"]:
        assert ext["nvcc_version"], "a wheel with _C records the nvcc that built it"
    assert info["env"]["MOE_DISPATCH_TEST_KNOB"] == "7" and info["env"]["NCCL_DEBUG"] == "WARN"
    assert info["env"]["MASTER_ADDR"] == "10.0.0.1"
    assert "UNRELATED_VARIABLE" not in info["env"]
    assert (info["transport"]["name"], info["transport"]["reason"]) == choose_transport(
        torch.device(info["transport"]["device"])
    )


def test_json_option_prints_collect(monkeypatch, capsys):
    monkeypatch.setenv("NVSHMEM_BOOTSTRAP", "UID")
    assert env.main(["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["env"]["NVSHMEM_BOOTSTRAP"] == "UID"
    assert data["moe_dispatch"]["commit"] == env.source_commit()["commit"]
    assert set(data) == {
        "moe_dispatch",
        "python",
        "platform",
        "packages",
        "extension",
        "nvshmem",
        "gpus",
        "nvlink_topology",
        "transport",
        "env",
    }


def test_plain_printer_without_rich(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "rich", None)  # makes `import rich...` raise ImportError
    monkeypatch.setitem(sys.modules, "rich.console", None)
    env.print_report()
    out = capsys.readouterr().out
    assert "== Transport" in out and "auto transport: " in out
    assert f"  moe_dispatch: {moe_dispatch.__version__}\n" in out


def _fake_tool(tmp_path, monkeypatch, name: str, script: str) -> None:
    tool = tmp_path / name
    tool.write_text("#!/bin/sh\n" + script)
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))


def test_topology_from_nvidia_smi(tmp_path, monkeypatch):
    _fake_tool(tmp_path, monkeypatch, "nvidia-smi", 'echo "GPU0 X NV18"\n')
    assert env._nvlink_topology() == "GPU0 X NV18"


def test_topology_reports_failure(tmp_path, monkeypatch):
    _fake_tool(tmp_path, monkeypatch, "nvidia-smi", 'echo "NVML init failed" >&2; exit 3\n')
    assert env._nvlink_topology() == "nvidia-smi topo -m exited 3: NVML init failed"


def test_topology_none_without_nvidia_smi(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert env._nvlink_topology() is None
    info = env.collect()
    monkeypatch.setitem(sys.modules, "rich", None)
    monkeypatch.setitem(sys.modules, "rich.console", None)
    env.print_report(info)
    assert "  topology: none (nvidia-smi not found)\n" in capsys.readouterr().out


def test_nvcc_for_a_rebuild(tmp_path, monkeypatch):
    _fake_tool(tmp_path, monkeypatch, "nvcc", 'echo "Cuda compilation tools, release 12.8, V12.8.93"\n')
    assert env._nvcc_on_path() == {"path": str(tmp_path / "nvcc"), "version": "12.8.93"}


def test_report_flags_an_nvshmem_version_mismatch():
    """_C only loads with the NVSHMEM it was built against: the report says so when they differ."""
    from moe_dispatch.tools import env

    info = env.collect()
    info["nvshmem"]["package_version"] = "3.4.5"
    for built, flagged in (("3.8.0", True), ("3.4.5", False)):
        info["nvshmem"]["build_version"] = built
        rows = dict(dict(env._sections(info))["Extension"])
        assert ("NVSHMEM mismatch" in rows) == flagged, rows
        if flagged:
            assert "built against 3.8.0 but this environment has 3.4.5" in rows["NVSHMEM mismatch"]
