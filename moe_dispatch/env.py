"""What this installation can do: ``python -m moe_dispatch.env``.

Prints versions, whether the CUDA extension is built (and why not), NVSHMEM, the GPUs and their
NVLink topology, the transport ``Buffer(transport="auto")`` would pick, and the environment
variables that change behaviour. Paste its output into bug reports.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import shutil
import subprocess
import sys

import torch

from . import __version__
from ._ext import extension_status, nvshmem_package_dir

NOT_INSTALLED = "not installed"
# Variables read by moe_dispatch or by the libraries under it (CUDA, NVSHMEM, NCCL, torchrun).
ENV_VAR_PATTERN = re.compile(r"^(MOE_DISPATCH_\w+|NVSHMEM_\w+|NCCL_\w+|CUDA_DEVICE_MAX_CONNECTIONS|"
                             r"CUDA_VISIBLE_DEVICES|LOCAL_WORLD_SIZE|WORLD_SIZE|TRITON_INTERPRET)$")
NVIDIA_SMI_TIMEOUT_S = 10


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return NOT_INSTALLED


def _nvshmem() -> dict:
    package_dir = nvshmem_package_dir()
    status = extension_status()
    linked = None
    if status.built and status.with_nvshmem:
        from ._ext import _C

        linked = ".".join(str(v) for v in _C.nvshmem_version())
    return {
        "package_dir": str(package_dir) if package_dir else None,
        "package_version": next((v for v in (_version("nvidia-nvshmem-cu13"), _version("nvidia-nvshmem-cu12"))
                                 if v != NOT_INSTALLED), NOT_INSTALLED),
        "linked_version": linked,
    }


def _extension() -> dict:
    status = extension_status()
    info = {"built": status.built, "error": status.error, "with_nvshmem": status.with_nvshmem,
            "cuda_archs": status.cuda_archs, "nvshmem_lib": status.nvshmem_lib, "device_count": None}
    if status.built:
        from ._ext import _C

        # The extension's own (static) CUDA runtime: a driver too old for it shows up here.
        try:
            info["device_count"] = _C.device_count()
        except RuntimeError as e:
            info["device_count"] = f"error: {getattr(e, 'name', type(e).__name__)}"
    return info


def _gpus() -> dict:
    count = torch.cuda.device_count()
    devices = []
    for i in range(count):
        major, minor = torch.cuda.get_device_capability(i)
        devices.append({"index": i, "name": torch.cuda.get_device_name(i), "capability": f"{major}.{minor}"})
    return {"count": count, "devices": devices, "torch_cuda": torch.version.cuda}


def _nvlink_topology() -> str | None:
    """``nvidia-smi topo -m`` output, an explanation if it fails, or None without nvidia-smi."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        done = subprocess.run([smi, "topo", "-m"], capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"nvidia-smi topo -m did not answer within {NVIDIA_SMI_TIMEOUT_S} s"
    except OSError as e:
        return f"nvidia-smi topo -m failed to start: {e}"
    if done.returncode != 0:
        return f"nvidia-smi topo -m exited {done.returncode}: {(done.stderr or done.stdout).strip()}"
    return done.stdout.rstrip()


def _transport() -> dict:
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        from .transport import choose_transport

        name, reason = choose_transport(device)
    except Exception as e:  # report, never crash: this tool is what users run when things are broken
        name, reason = "unknown", f"moe_dispatch.transport.choose_transport failed: {type(e).__name__}: {e}"
    return {"device": str(device), "name": name, "reason": reason}


def collect() -> dict:
    """Everything the report shows, as plain data (str/int/bool/None, nested dicts and lists).

    Keys: ``moe_dispatch``, ``python``, ``platform``, ``packages`` (distribution -> version or
    ``"not installed"``), ``extension`` (built, error, with_nvshmem, cuda_archs, nvshmem_lib,
    device_count: int, ``"error: <CUDA error name>"`` or None when not built),
    ``nvshmem``, ``gpus``, ``nvlink_topology`` (None without nvidia-smi), ``transport`` (device,
    name, reason), ``env`` (variable -> value, only those set).
    """
    return {
        "moe_dispatch": __version__,
        "python": f"{platform.python_version()} ({sys.executable})",
        "platform": platform.platform(),
        "packages": {name: _version(name) for name in ("torch", "triton", "numpy", "megatron-core")},
        "extension": _extension(),
        "nvshmem": _nvshmem(),
        "gpus": _gpus(),
        "nvlink_topology": _nvlink_topology(),
        "transport": _transport(),
        "env": {k: v for k, v in sorted(os.environ.items()) if ENV_VAR_PATTERN.match(k)},
    }


def _sections(info: dict) -> list[tuple[str, list[tuple[str, str]]]]:
    """The report as (section title, [(label, value)]) for either printer."""
    ext, nvs, gpus, tr = info["extension"], info["nvshmem"], info["gpus"], info["transport"]
    extension = [("CUDA extension", "built" if ext["built"] else f"not built: {ext['error']}")]
    if ext["built"]:
        extension += [("CUDA archs", ext["cuda_archs"]), ("with NVSHMEM", str(ext["with_nvshmem"])),
                      ("GPUs seen by extension", str(ext["device_count"]))]
    gpu_rows = [("GPUs seen by torch", str(gpus["count"])), ("torch CUDA", str(gpus["torch_cuda"]))]
    gpu_rows += [(f"GPU {d['index']}", f"{d['name']} (sm {d['capability']})") for d in gpus["devices"]]
    topo = info["nvlink_topology"]
    gpu_rows.append(("NVLink topology", "nvidia-smi not found" if topo is None else "below"))
    return [
        ("Versions", [("moe_dispatch", info["moe_dispatch"]), ("Python", info["python"]),
                      ("platform", info["platform"])] + list(info["packages"].items())),
        ("Extension", extension + [
            ("NVSHMEM package", f"{nvs['package_dir']} ({nvs['package_version']})" if nvs["package_dir"] else NOT_INSTALLED),
            ("NVSHMEM linked", nvs["linked_version"] or "no"),
        ]),
        ("GPUs", gpu_rows),
        ("Transport", [("auto transport", f"{tr['name']} (for {tr['device']})"), ("why", tr["reason"])]),
        ("Environment", list(info["env"].items()) or [("(none set)", "")]),
    ]


def print_report(info: dict | None = None) -> None:
    """Prints :func:`collect`'s report to stdout, with ``rich`` tables when it is installed."""
    info = collect() if info is None else info
    sections = _sections(info)
    topo = info["nvlink_topology"]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        for title, rows in sections:
            print(f"== {title}")
            for label, value in rows:
                print(f"  {label}: {value}")
        if topo is not None:
            print(f"== NVLink topology (nvidia-smi topo -m)\n{topo}")
        return
    # Piped output (bug reports) gets a wide fixed width instead of rich's 80 columns.
    console = Console(width=None if sys.stdout.isatty() else 160)
    for title, rows in sections:
        table = Table(title=title, show_header=False, title_justify="left")
        table.add_column(style="bold")
        table.add_column(overflow="fold")
        for label, value in rows:
            table.add_row(label, value)
        console.print(table)
    if topo is not None:
        console.print("NVLink topology (nvidia-smi topo -m)", style="italic")
        console.print(topo, markup=False, highlight=False, soft_wrap=True)


if __name__ == "__main__":
    print_report()
