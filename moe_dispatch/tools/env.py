"""What this installation is and can do: ``python -m moe_dispatch.env [--json]``.

Prints the moe_dispatch version and the git commit it comes from, how ``moe_dispatch._C`` was
built (nvcc, CUDA architectures) or why it is unavailable, the versions of Python and the
libraries under it, NVSHMEM, the GPUs and their topology, the transport
``Buffer(transport="auto")`` would pick, and the environment variables that change behaviour.
Paste its output into bug reports.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from .. import __version__
from .._ext import NVSHMEM_HOST_LIB, extension_status, nvshmem_package_dir

NOT_INSTALLED = "not installed"
PACKAGES = ("torch", "triton", "numpy", "megatron-core", "transformer-engine")
# Variables read by moe_dispatch or by the libraries under it (CUDA, NVSHMEM, NCCL, torch
# distributed, torchrun, the dynamic loader).
ENV_VAR_PATTERN = re.compile(
    r"^(MOE_DISPATCH_\w+|NVSHMEM_\w+|NCCL_\w+|TORCH_NCCL_\w+|TORCH_DISTRIBUTED_DEBUG|"
    r"CUDA_DEVICE_MAX_CONNECTIONS|CUDA_VISIBLE_DEVICES|CUDA_HOME|LD_LIBRARY_PATH|"
    r"MASTER_ADDR|MASTER_PORT|WORLD_SIZE|LOCAL_WORLD_SIZE|TRITON_INTERPRET)$"
)
TOOL_TIMEOUT_S = 10
PACKAGE_DIR = Path(__file__).resolve().parents[1]  # moe_dispatch/


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return NOT_INSTALLED


def _run(*args: str) -> subprocess.CompletedProcess | str:
    """The finished process, or a one-line reason why it did not run to the end."""
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=TOOL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"{' '.join(args)} did not answer within {TOOL_TIMEOUT_S} s"
    except OSError as e:
        return f"{' '.join(args)} failed to start: {e}"


def _build_info() -> dict | None:
    """The constants setup.py wrote into ``moe_dispatch/_build_info.py`` of a wheel or regular
    install, lower-cased; None for a source checkout (editable install), which has no such file."""
    try:
        module = importlib.import_module("moe_dispatch._build_info")
    except ModuleNotFoundError:
        return None
    return {name.lower(): value for name, value in vars(module).items() if name.isupper()}


def source_commit() -> dict:
    """The git commit this copy of moe_dispatch comes from.

    A wheel (or any non-editable install) reports the commit setup.py recorded when it was
    built; a source checkout (editable install) asks git about the checkout holding this
    package. Never raises.

    Returns:
        ``{"commit": 40-hex str or None, "dirty": bool (tracked files differed from it),
        "source": "recorded at build" | "git checkout <dir>" | why it is unknown}``.
    """
    info = _build_info()
    if info is not None and info.get("commit"):
        return {"commit": info["commit"], "dirty": bool(info.get("commit_dirty")), "source": "recorded at build"}
    if shutil.which("git") is None:
        return {"commit": None, "dirty": False, "source": "unknown: not recorded at build and git not found"}
    top = _run("git", "-C", str(PACKAGE_DIR), "rev-parse", "--show-toplevel")
    # Only the checkout whose top level holds this package (not, say, a repository around a venv).
    if isinstance(top, str) or top.returncode != 0 or Path(top.stdout.strip()).resolve() != PACKAGE_DIR.parent:
        return {"commit": None, "dirty": False, "source": "unknown: not recorded at build and not in a git checkout"}
    head = _run("git", "-C", str(PACKAGE_DIR.parent), "rev-parse", "HEAD")
    status = _run("git", "-C", str(PACKAGE_DIR.parent), "status", "--porcelain", "--untracked-files=no")
    if isinstance(head, str) or head.returncode != 0:
        return {"commit": None, "dirty": False, "source": f"unknown: git rev-parse HEAD failed in {PACKAGE_DIR.parent}"}
    dirty = not isinstance(status, str) and bool(status.stdout.strip())
    return {"commit": head.stdout.strip(), "dirty": dirty, "source": f"git checkout {PACKAGE_DIR.parent}"}


def _nvcc_on_path() -> dict:
    """The nvcc a rebuild would use (same lookup as setup.py: PATH, $CUDA_HOME, /usr/local/cuda)."""
    nvcc = shutil.which("nvcc")
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if nvcc is None and home and os.access(Path(home, "bin", "nvcc"), os.X_OK):
            nvcc = str(Path(home, "bin", "nvcc"))
    if nvcc is None:
        return {"path": None, "version": None}
    done = _run(nvcc, "--version")
    match = None if isinstance(done, str) else re.search(r"\bV(\d+\.\d+(?:\.\d+)?)\b", done.stdout)
    return {"path": nvcc, "version": match.group(1) if match else None}


def _extension() -> dict:
    status = extension_status()
    build = _build_info()
    info = {
        "built": status.built,
        "error": status.error,
        "with_nvshmem": status.with_nvshmem,
        "cuda_archs": status.cuda_archs,
        "nvshmem_lib": status.nvshmem_lib,
        "device_count": None,
        "nvcc_version": build["nvcc_version"] if build else None,
        "nvcc_on_path": _nvcc_on_path(),
    }
    if status.built:
        from .._ext import _C

        # The extension's own (static) CUDA runtime: a driver too old for it shows up here.
        try:
            info["device_count"] = _C.device_count()
        except RuntimeError as e:
            info["device_count"] = f"error: {getattr(e, 'name', type(e).__name__)}"
    return info


def _nvshmem() -> dict:
    package_dir = nvshmem_package_dir()
    status = extension_status()
    build = _build_info()
    linked = None
    if status.built and status.with_nvshmem:
        from .._ext import _C

        linked = ".".join(str(v) for v in _C.nvshmem_version())
    host_lib = package_dir / "lib" / NVSHMEM_HOST_LIB if package_dir else None
    return {
        "package_dir": str(package_dir) if package_dir else None,
        "package_version": next(
            (v for v in (_version("nvidia-nvshmem-cu13"), _version("nvidia-nvshmem-cu12")) if v != NOT_INSTALLED),
            NOT_INSTALLED,
        ),
        "host_lib": str(host_lib) if host_lib and host_lib.exists() else None,
        "linked_version": linked,
        "build_version": build["nvshmem_version"] if build else None,
    }


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
    done = _run(smi, "topo", "-m")
    if isinstance(done, str):
        return done
    if done.returncode != 0:
        return f"nvidia-smi topo -m exited {done.returncode}: {(done.stderr or done.stdout).strip()}"
    return done.stdout.rstrip()


def _transport() -> dict:
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        from ..transport import KERNELS_OPT_IN, choose_transport

        name, reason = choose_transport(device)
    except Exception as e:  # report, never crash: this tool is what users run when things are broken
        name, reason = "unknown", f"moe_dispatch.transport.choose_transport failed: {type(e).__name__}: {e}"
        KERNELS_OPT_IN = "unknown"
    return {"device": str(device), "name": name, "reason": reason, "kernels": KERNELS_OPT_IN}


def collect() -> dict:
    """Everything the report shows, as plain data (str/int/bool/None, nested dicts and lists).

    Keys: ``moe_dispatch`` (version, commit, dirty, source of the commit, location),
    ``python``, ``platform``, ``packages`` (distribution -> version or ``"not installed"``),
    ``extension`` (built, error, with_nvshmem, cuda_archs, nvshmem_lib, device_count: int,
    ``"error: <CUDA error name>"`` or None when not built, nvcc_version that built it or None
    when not recorded, nvcc_on_path {path, version}), ``nvshmem`` (package_dir,
    package_version, host_lib, linked_version, build_version), ``gpus`` (count, devices,
    torch_cuda), ``nvlink_topology`` (None without nvidia-smi), ``transport`` (device, name, kernels,
    reason), ``env`` (variable -> value, only those set). Runs git and nvcc (bounded by
    10 s each); never raises for a missing tool.
    """
    return {
        "moe_dispatch": {"version": __version__, **source_commit(), "location": str(PACKAGE_DIR)},
        "python": f"{platform.python_version()} ({sys.executable})",
        "platform": platform.platform(),
        "packages": {name: _version(name) for name in PACKAGES},
        "extension": _extension(),
        "nvshmem": _nvshmem(),
        "gpus": _gpus(),
        "nvlink_topology": _nvlink_topology(),
        "transport": _transport(),
        "env": {k: v for k, v in sorted(os.environ.items()) if ENV_VAR_PATTERN.match(k)},
    }


def _sections(info: dict) -> list[tuple[str, list[tuple[str, str]]]]:
    """The report as (section title, [(label, value)]) for either printer."""
    md, ext, nvs, gpus, tr = info["moe_dispatch"], info["extension"], info["nvshmem"], info["gpus"], info["transport"]
    commit = (
        f"{md['commit']}{' + uncommitted changes' if md['dirty'] else ''} ({md['source']})"
        if md["commit"]
        else md["source"]
    )
    extension = [("CUDA extension", "built" if ext["built"] else f"not built: {ext['error']}")]
    if ext["built"]:
        extension += [
            ("CUDA archs", ext["cuda_archs"]),
            ("built with nvcc", ext["nvcc_version"] or "not recorded (source checkout)"),
            (
                "with NVSHMEM",
                str(ext["with_nvshmem"])
                if ext["with_nvshmem"]
                else "False: the build found neither NVSHMEM_HOME nor the nvidia-nvshmem-cu13 package (no "
                "internode kernels); rebuild where it is installed, e.g. pip wheel --no-build-isolation",
            ),
            ("GPUs seen by extension", str(ext["device_count"])),
        ]
    on_path = ext["nvcc_on_path"]
    extension.append(
        ("nvcc for a rebuild", f"{on_path['path']} ({on_path['version']})" if on_path["path"] else "not found")
    )
    nvshmem = [
        (
            "NVSHMEM package",
            f"{nvs['package_dir']} ({nvs['package_version']})" if nvs["package_dir"] else NOT_INSTALLED,
        ),
        ("NVSHMEM host library", nvs["host_lib"] or f"{NVSHMEM_HOST_LIB} not found"),
        ("NVSHMEM loaded by _C", nvs["linked_version"] or "no"),
    ]
    if nvs["build_version"]:
        nvshmem.append(("NVSHMEM at build", nvs["build_version"]))
        if nvs["package_version"] and nvs["package_version"] != nvs["build_version"]:
            nvshmem.append(
                (
                    "NVSHMEM mismatch",
                    f"_C was built against {nvs['build_version']} but this environment "
                    f"has {nvs['package_version']}: _C needs the same version (rebuild here with "
                    "pip wheel --no-build-isolation, or install that nvidia-nvshmem-cu13)",
                )
            )
    gpu_rows = [("GPUs seen by torch", str(gpus["count"])), ("torch CUDA", str(gpus["torch_cuda"]))]
    gpu_rows += [(f"GPU {d['index']}", f"{d['name']} (sm {d['capability']})") for d in gpus["devices"]]
    topo = info["nvlink_topology"]
    gpu_rows.append(("topology", "none (nvidia-smi not found)" if topo is None else "below (nvidia-smi topo -m)"))
    return [
        (
            "Versions",
            [
                ("moe_dispatch", md["version"]),
                ("commit", commit),
                ("location", md["location"]),
                ("Python", info["python"]),
                ("platform", info["platform"]),
            ]
            + list(info["packages"].items()),
        ),
        ("Extension", extension + nvshmem),
        ("GPUs", gpu_rows),
        (
            "Transport",
            [
                ("auto transport", f"{tr['name']} (for {tr['device']})"),
                ("why", tr["reason"]),
                ("kernels", tr["kernels"]),
            ],
        ),
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
            print(f"== Topology (nvidia-smi topo -m)\n{topo}")
        return
    # Piped output (bug reports) gets a wide fixed width instead of rich's 80 columns.
    console = Console(width=None if sys.stdout.isatty() else 200)
    for title, rows in sections:
        table = Table(title=title, show_header=False, title_justify="left")
        table.add_column(style="bold")
        table.add_column(overflow="fold")
        for label, value in rows:
            table.add_row(label, value)
        console.print(table)
    if topo is not None:
        console.print("Topology (nvidia-smi topo -m)", style="italic")
        console.print(topo, markup=False, highlight=False, soft_wrap=True)


def main(argv: list[str] | None = None) -> int:
    """``python -m moe_dispatch.env [--json]``: prints the report (or its data as JSON); returns 0."""
    parser = argparse.ArgumentParser(prog="python -m moe_dispatch.env", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print collect()'s data as JSON instead of tables")
    args = parser.parse_args(argv)
    if args.json:
        print(json.dumps(collect(), indent=2))
    else:
        print_report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
