"""``python -m moe_dispatch.env``: the installation report users paste into bug reports."""

from __future__ import annotations

import subprocess
import sys

import torch

from moe_dispatch import env
from moe_dispatch.transport import choose_transport


def test_module_runs_and_names_torch_and_transport():
    done = subprocess.run([sys.executable, "-m", "moe_dispatch.env"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "torch" in done.stdout
    assert "transport" in done.stdout
    name, _ = choose_transport(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    assert name in done.stdout


def test_collect_reports_versions_extension_and_chosen_transport(monkeypatch):
    monkeypatch.setenv("MOE_DISPATCH_TEST_KNOB", "7")
    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    monkeypatch.setenv("UNRELATED_VARIABLE", "x")
    info = env.collect()
    assert torch.__version__.startswith(info["packages"]["torch"])  # "2.x.y" vs "2.x.y+cu130"
    assert set(info["packages"]) == {"torch", "triton", "numpy", "megatron-core"}
    assert info["extension"]["built"] in (True, False)
    assert info["extension"]["built"] or info["extension"]["error"]
    assert info["env"]["MOE_DISPATCH_TEST_KNOB"] == "7" and info["env"]["NCCL_DEBUG"] == "WARN"
    assert "UNRELATED_VARIABLE" not in info["env"]
    assert (info["transport"]["name"], info["transport"]["reason"]) == choose_transport(torch.device(info["transport"]["device"]))


def test_plain_printer_without_rich(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "rich", None)  # makes `import rich...` raise ImportError
    monkeypatch.setitem(sys.modules, "rich.console", None)
    env.print_report()
    out = capsys.readouterr().out
    assert "== Transport" in out and "auto transport: " in out


def _fake_nvidia_smi(tmp_path, monkeypatch, script: str) -> None:
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\n" + script)
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))


def test_nvlink_topology_from_nvidia_smi(tmp_path, monkeypatch):
    _fake_nvidia_smi(tmp_path, monkeypatch, 'echo "GPU0 X NV18"\n')
    assert env._nvlink_topology() == "GPU0 X NV18"


def test_nvlink_topology_reports_failure(tmp_path, monkeypatch):
    _fake_nvidia_smi(tmp_path, monkeypatch, 'echo "NVML init failed" >&2; exit 3\n')
    assert env._nvlink_topology() == "nvidia-smi topo -m exited 3: NVML init failed"
