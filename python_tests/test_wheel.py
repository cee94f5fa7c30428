"""The wheels ``pip wheel .`` builds: a platform wheel holding ``moe_dispatch._C`` where nvcc
exists, a ``py3-none-any`` pure-Python wheel with ``MOE_DISPATCH_SKIP_CUDA=1`` (or no nvcc).

Each wheel is built once per module, by this interpreter with ``--no-build-isolation`` (the
build tools of the dev environment), into a temporary folder; setuptools' staging folders go
there too (``DIST_EXTRA_CONFIG``). Only CMake's tree under ``build/`` is shared with ``make
install``, so the CUDA build is incremental: seconds when csrc/ is unchanged. Without nvcc the
CUDA-wheel tests skip, unless ``MOE_DISPATCH_REQUIRE_CUDA=1`` (CI), where the build must succeed.

The ELF and fatbin readers below are small on purpose: they need neither readelf nor cuobjdump
(cuobjdump, when present, cross-checks the fatbin reader).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

import moe_dispatch
from moe_dispatch._ext import NVSHMEM_HOST_LIB, nvshmem_package_dir

from .test_extension import ROOT, setup_py

NVCC = setup_py.find_nvcc(os.environ)
REQUIRE_CUDA = os.environ.get("MOE_DISPATCH_REQUIRE_CUDA", "") == "1"
BUILD_TIMEOUT_S = 900  # a cold CUDA build on 2 cores; incremental ones take seconds
CPYTHON_TAG = f"cp{sys.version_info.major}{sys.version_info.minor}"
PLATFORM_TAG = re.sub(r"[-.]", "_", sysconfig.get_platform())
EXT_SUFFIX = sysconfig.get_config_var("EXT_SUFFIX")
RUNPATH = "$ORIGIN/../nvidia/nvshmem/lib"
# Libraries the extension must not need: the torch C++ ABI, and CUDA runtime/driver (cudart is
# linked statically; the driver API is not used).
FORBIDDEN_NEEDED = re.compile(r"^(libtorch\w*|libc10\w*|libcudart|libcuda)\.so")


def _head_commit() -> str | None:
    done = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else None


def _pip_wheel(out: Path, **env_changes: str | None) -> tuple[Path, str]:
    """Builds the wheel of ROOT into ``out``; returns it and pip's verbose log (the build's lines)."""
    config = out / "staging.cfg"
    out.mkdir(parents=True, exist_ok=True)
    config.write_text(f"[build]\nbuild_base = {out / 'build'}\n[egg_info]\negg_base = {out}\n")
    env = {**os.environ, "DIST_EXTRA_CONFIG": str(config)}
    for name, value in env_changes.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-v",
            "--no-build-isolation",
            "--no-deps",
            "--no-index",
            "-w",
            str(out / "dist"),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=out,
        timeout=BUILD_TIMEOUT_S,
    )
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    wheels = list((out / "dist").glob("*.whl"))
    assert len(wheels) == 1, f"expected one wheel in {out / 'dist'}, got {wheels}"
    return wheels[0], log


@pytest.fixture(scope="module")
def cuda_wheel(tmp_path_factory) -> tuple[Path, str]:
    if NVCC is None and not REQUIRE_CUDA:
        pytest.skip(
            "nvcc not found: the CUDA wheel cannot be built here (CI has nvcc and sets MOE_DISPATCH_REQUIRE_CUDA=1)"
        )
    return _pip_wheel(tmp_path_factory.mktemp("cuda_wheel"), MOE_DISPATCH_SKIP_CUDA=None)


@pytest.fixture(scope="module")
def pure_wheel(tmp_path_factory) -> tuple[Path, str]:
    return _pip_wheel(tmp_path_factory.mktemp("pure_wheel"), MOE_DISPATCH_SKIP_CUDA="1", MOE_DISPATCH_REQUIRE_CUDA=None)


@pytest.fixture(scope="module")
def extension_bytes(cuda_wheel) -> bytes:
    with zipfile.ZipFile(cuda_wheel[0]) as wheel:
        names = [n for n in wheel.namelist() if re.fullmatch(r"moe_dispatch/_C\..*\.so", n)]
        assert names == [f"moe_dispatch/_C{EXT_SUFFIX}"], wheel.namelist()
        return wheel.read(names[0])


# --- minimal ELF64 (little-endian) and fatbin readers ------------------------------------------


def _elf_sections(data: bytes) -> dict[str, tuple[int, int, int]]:
    """Section name -> (file offset, size, sh_link)."""
    assert data[:6] == b"\x7fELF\x02\x01", "not a 64-bit little-endian ELF file"
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names_offset = headers[shstrndx][4]

    def name(offset: int) -> str:
        return data[names_offset + offset : data.index(b"\0", names_offset + offset)].decode()

    return {name(h[0]): (h[4], h[5], h[6]) for h in headers}


def _elf_dynamic(data: bytes) -> tuple[list[str], list[str]]:
    """(DT_NEEDED entries, DT_RUNPATH/DT_RPATH entries) of a shared object."""
    sections = _elf_sections(data)
    offset, size, link = sections[".dynamic"]
    strtab = list(sections.values())[link][0]
    needed, runpath = [], []
    for pos in range(offset, offset + size, 16):
        tag, value = struct.unpack_from("<qQ", data, pos)
        if tag == 0:  # DT_NULL
            break
        if tag in (1, 15, 29):  # DT_NEEDED, DT_RPATH, DT_RUNPATH
            text = data[strtab + value : data.index(b"\0", strtab + value)].decode()
            (needed if tag == 1 else runpath).append(text)
    return needed, runpath


def _fatbin_cubin_archs(data: bytes) -> set[int]:
    """SM versions of the cubins (entry kind 2) in the ``.nv_fatbin`` section: the device code
    the CUDA runtime loads (``__nv_relfatbin`` only holds the relocatable inputs of the device link).

    A fatbin is a 16-byte header (magic 0xBA55ED50, u16 version, u16 header size, u64 size of the
    entries) followed by entries: u16 kind (1 PTX, 2 cubin), u16, u32 entry-header size,
    u64 payload size, ..., u32 SM version at byte 28.
    """
    offset, size, _ = _elf_sections(data)[".nv_fatbin"]
    archs, pos, end = set(), offset, offset + size
    while pos + 16 <= end:
        magic, _, header_size, entries_size = struct.unpack_from("<IHHQ", data, pos)
        if magic != 0xBA55ED50:  # padding between fatbins
            pos += 8
            continue
        entry, entries_end = pos + header_size, pos + header_size + entries_size
        while entry < entries_end:
            kind, _, entry_header_size, payload_size = struct.unpack_from("<HHIQ", data, entry)
            (arch,) = struct.unpack_from("<I", data, entry + 28)
            if kind == 2:
                archs.add(arch)
            entry += entry_header_size + payload_size
        pos = entries_end
    return archs


def _expected_sass_archs() -> set[int]:
    """The SM versions setup.py compiles real code for with this environment."""
    archs = setup_py.cuda_archs(os.environ, setup_py.nvcc_gpu_archs(NVCC))
    return {int(re.match(r"\d+", a).group()) for a in archs.split(";") if not a.endswith("-virtual")}


# --- both wheels --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["cuda_wheel", "pure_wheel"])
def test_metadata_entry_point_and_build_commit(kind, request):
    wheel_path, _ = request.getfixturevalue(kind)
    dist_info = f"moe_dispatch-{moe_dispatch.__version__}.dist-info"
    with zipfile.ZipFile(wheel_path) as wheel:
        metadata = wheel.read(f"{dist_info}/METADATA").decode()
        entry_points = wheel.read(f"{dist_info}/entry_points.txt").decode()
        build_info = wheel.read("moe_dispatch/_build_info.py").decode()
        autoload = wheel.read(setup_py.AUTOLOAD_PTH).decode()  # top level: site-packages
    assert autoload == setup_py.AUTOLOAD_LINE
    assert re.search(r"^Name: moe-dispatch$", metadata, re.MULTILINE)
    assert re.search(rf"^Version: {re.escape(moe_dispatch.__version__)}$", metadata, re.MULTILINE), metadata[:500]
    assert re.search(r"^moe-dispatch-bench = moe_dispatch\.tools\.bench:main$", entry_points, re.MULTILINE), (
        entry_points
    )
    recorded = {}
    exec(build_info, recorded)
    head = _head_commit()
    if head is None:
        assert recorded["COMMIT"] is None
    else:
        assert recorded["COMMIT"] == head
    if kind == "pure_wheel":
        assert recorded["NVCC_VERSION"] is None and recorded["CUDA_ARCHS"] is None
    else:
        assert recorded["NVCC_VERSION"] == setup_py.nvcc_version(NVCC)
        assert recorded["CUDA_ARCHS"] == setup_py.cuda_archs(os.environ, setup_py.nvcc_gpu_archs(NVCC))


# --- the pure-Python wheel ----------------------------------------------------------------------


def test_pure_wheel_is_py3_none_any_without_shared_objects(pure_wheel):
    wheel_path, log = pure_wheel
    assert wheel_path.name == f"moe_dispatch-{moe_dispatch.__version__}-py3-none-any.whl"
    with zipfile.ZipFile(wheel_path) as wheel:
        names = wheel.namelist()
        wheel_file = wheel.read(f"moe_dispatch-{moe_dispatch.__version__}.dist-info/WHEEL").decode()
    assert not [n for n in names if n.endswith(".so")]
    for package in ("megatron", "transport", "semantics", "ops", "testing", "tools"):
        assert f"moe_dispatch/{package}/__init__.py" in names, names
    assert "Root-Is-Purelib: true" in wheel_file and "Tag: py3-none-any" in wheel_file
    skip_lines = [line for line in log.splitlines() if "moe_dispatch: CUDA extension moe_dispatch._C skipped" in line]
    assert len(skip_lines) == 1, log[-3000:]
    assert "(MOE_DISPATCH_SKIP_CUDA=1); building the pure-Python package (py3-none-any)" in skip_lines[0]


# --- the CUDA wheel -----------------------------------------------------------------------------


def test_cuda_wheel_is_a_platform_wheel(cuda_wheel, extension_bytes):
    wheel_path, log = cuda_wheel
    assert wheel_path.name == f"moe_dispatch-{moe_dispatch.__version__}-{CPYTHON_TAG}-{CPYTHON_TAG}-{PLATFORM_TAG}.whl"
    assert "moe_dispatch._C skipped" not in log
    assert re.search(r"moe_dispatch: built moe_dispatch\._C with nvcc [\d.]+ for CUDA archs ", log), log[-3000:]


def test_extension_needs_no_torch_cudart_or_driver_and_finds_nvshmem_beside_it(extension_bytes):
    needed, runpath = _elf_dynamic(extension_bytes)
    assert not [n for n in needed if FORBIDDEN_NEEDED.match(n)], needed
    if NVSHMEM_HOST_LIB not in needed:
        assert setup_py.find_nvshmem(os.environ) is None, "NVSHMEM is installed but the wheel's _C does not link it"
        pytest.skip("built without NVSHMEM (nvidia-nvshmem-cu13 not installed): no RUNPATH to check")
    assert runpath == [RUNPATH], "only the relative RUNPATH into site-packages, no build paths"


def test_extension_carries_sass_for_the_default_archs(extension_bytes):
    archs = _fatbin_cubin_archs(extension_bytes)
    assert 90 in archs, f"no sm_90 cubin in .nv_fatbin (found {sorted(archs)})"
    assert archs == _expected_sass_archs()
    if "compute_100" in subprocess.run(
        [NVCC, "--list-gpu-arch"], capture_output=True, text=True
    ).stdout and not os.environ.get("MOE_DISPATCH_CUDA_ARCHS"):
        assert 100 in archs, "this nvcc supports sm_100 but the default build lacks it"


def test_fatbin_reader_agrees_with_cuobjdump(cuda_wheel, extension_bytes, tmp_path):
    cuobjdump = shutil.which("cuobjdump") or (str(Path(NVCC).parent / "cuobjdump") if NVCC else None)
    if cuobjdump is None or not os.access(cuobjdump, os.X_OK):
        pytest.skip("cuobjdump not found (the CUDA toolkit here has no cuobjdump)")
    so = tmp_path / "_C.so"
    so.write_bytes(extension_bytes)
    listed = subprocess.run([cuobjdump, "--list-elf", str(so)], capture_output=True, text=True, check=True).stdout
    assert {int(a) for a in re.findall(r"\.sm_(\d+)[af]?\.cubin", listed)} >= _fatbin_cubin_archs(extension_bytes)


def _unpack(wheel_path: Path, site: Path) -> Path:
    """Unpacks the wheel like an install into ``site``; returns the extension's path."""
    with zipfile.ZipFile(wheel_path) as wheel:
        wheel.extractall(site)
    return site / "moe_dispatch" / f"_C{EXT_SUFFIX}"


def _bare_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "LD_PRELOAD", "PYTHONPATH")}


def test_runpath_finds_nvshmem_from_site_packages(cuda_wheel, extension_bytes, tmp_path):
    if NVSHMEM_HOST_LIB not in _elf_dynamic(extension_bytes)[0]:
        pytest.skip("built without NVSHMEM")
    package = nvshmem_package_dir()
    site = tmp_path / "site-packages"
    extension = _unpack(cuda_wheel[0], site)
    # dlopen of the bare .so in a fresh interpreter (no moe_dispatch import, so no preload):
    # only the RUNPATH can lead the loader to site-packages/nvidia/nvshmem/lib.
    load = [sys.executable, "-c", f"import ctypes; ctypes.CDLL({str(extension)!r})"]
    missing = subprocess.run(load, capture_output=True, text=True, env=_bare_env(), cwd=tmp_path, timeout=60)
    assert missing.returncode != 0 and f"{NVSHMEM_HOST_LIB}: cannot open shared object file" in missing.stderr
    lib_dir = site / "nvidia" / "nvshmem" / "lib"
    lib_dir.mkdir(parents=True)
    (lib_dir / NVSHMEM_HOST_LIB).symlink_to(package / "lib" / NVSHMEM_HOST_LIB)
    found = subprocess.run(load, capture_output=True, text=True, env=_bare_env(), cwd=tmp_path, timeout=60)
    assert found.returncode == 0, found.stderr


# Runs in a fresh interpreter whose sys.path starts with an unpacked wheel, outside any checkout.
INSTALLED_PROBE = """
import json
import moe_dispatch
from moe_dispatch.tools import env
print(json.dumps({"file": moe_dispatch.__file__, "report": env.collect()}))
"""


def test_wheel_installed_elsewhere_loads_and_reports_its_build(cuda_wheel, tmp_path):
    site = tmp_path / "site-packages"
    _unpack(cuda_wheel[0], site)
    done = subprocess.run(
        [sys.executable, "-c", INSTALLED_PROBE],
        capture_output=True,
        text=True,
        env={**_bare_env(), "PYTHONPATH": str(site)},
        cwd=tmp_path,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    probe = json.loads(done.stdout.strip().splitlines()[-1])
    assert Path(probe["file"]).parent == site / "moe_dispatch"
    report = probe["report"]
    assert report["extension"]["built"], report["extension"]["error"]
    assert report["extension"]["cuda_archs"] == setup_py.cuda_archs(os.environ, setup_py.nvcc_gpu_archs(NVCC)).replace(
        ";", ","
    )
    assert report["extension"]["nvcc_version"] == setup_py.nvcc_version(NVCC)
    # No git checkout around it: the commit is the one setup.py recorded.
    assert report["moe_dispatch"]["source"] == "recorded at build"
    assert report["moe_dispatch"]["commit"] == _head_commit()
