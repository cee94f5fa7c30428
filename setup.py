"""Build of moe_dispatch: metadata lives in pyproject.toml; this file drives CMake to compile
the CUDA extension ``moe_dispatch._C`` from csrc/ and records how the package was built.

nvcc is looked up on PATH, then in ``$CUDA_HOME/bin``, then in ``/usr/local/cuda/bin``. Without
it the package is pure Python (a ``py3-none-any`` wheel) and the build prints one line saying
so; with it the wheel is a platform wheel holding ``moe_dispatch/_C*.so``. Environment:

- ``MOE_DISPATCH_CUDA_ARCHS``: CUDA architectures for CMake, e.g. ``90`` or ``90;100a``.
  Default: ``90`` plus ``100`` when ``nvcc --list-gpu-arch`` names ``compute_100``.
- ``MOE_DISPATCH_REQUIRE_CUDA=1``: a missing nvcc fails the build instead.
- ``MOE_DISPATCH_SKIP_CUDA=1``: build the pure-Python package even where nvcc exists.
- ``NVSHMEM_HOME``: NVSHMEM root; default: the ``nvidia-nvshmem-cu13`` pip package. Without
  NVSHMEM the extension builds without the internode kernels.

Every non-editable build writes ``moe_dispatch/_build_info.py`` into the wheel (never into the
source tree): the git commit, nvcc version, CUDA architectures and NVSHMEM version it was built
with, which ``python -m moe_dispatch.env`` reports.

Every build, editable ones too, puts ``moe_dispatch-autoload.pth`` at the top of the wheel (so in
site-packages): Python runs it at start-up, and it installs the import hook that makes the
Megatron flex backend "custom" work without an explicit import (``moe_dispatch/_autoload.py``).
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
from collections.abc import Collection, Mapping
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

ROOT = Path(__file__).resolve().parent
DEFAULT_CUDA_HOME = "/usr/local/cuda"
# Hopper always; Blackwell (sm_100 code also runs on sm_103) where the nvcc knows it.
DEFAULT_CUDA_ARCHS = ("90", "100")
BUILD_INFO_MODULE = "_build_info.py"
AUTOLOAD_PTH = "moe_dispatch-autoload.pth"
# site.py executes a .pth line that starts with "import"
AUTOLOAD_LINE = "import moe_dispatch._autoload; moe_dispatch._autoload.install_at_startup()\n"
TOOL_TIMEOUT_S = 30
_ARCH = re.compile(r"\d+[af]?(-real|-virtual)?")


def _flag(environ: Mapping[str, str], name: str) -> bool:
    return environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def find_nvcc(environ: Mapping[str, str], default_cuda_home: str = DEFAULT_CUDA_HOME) -> str | None:
    """Path of nvcc from ``PATH``, ``$CUDA_HOME/bin`` or ``default_cuda_home/bin``; None if absent."""
    on_path = shutil.which("nvcc", path=environ.get("PATH", os.defpath))
    if on_path:
        return on_path
    for home in (environ.get("CUDA_HOME"), default_cuda_home):
        if home and os.access(Path(home, "bin", "nvcc"), os.X_OK):
            return str(Path(home, "bin", "nvcc"))
    return None


def nvcc_version(nvcc: str) -> str:
    """``"13.0.88"`` from ``nvcc --version`` (its ``V13.0.88`` token).

    Raises:
        SystemExit: nvcc does not run or prints no version.
    """
    try:
        out = subprocess.run(
            [nvcc, "--version"], capture_output=True, text=True, check=True, timeout=TOOL_TIMEOUT_S
        ).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise SystemExit(f"error: {nvcc} --version failed: {e}") from e
    match = re.search(r"\bV(\d+\.\d+(?:\.\d+)?)\b", out)
    if match is None:
        raise SystemExit(
            f"error: {nvcc} --version printed no version (expected 'V<major>.<minor>.<patch>'), got {out!r}"
        )
    return match.group(1)


def nvcc_gpu_archs(nvcc: str) -> set[str] | None:
    """Virtual architectures nvcc compiles for, e.g. ``{"90", "100", ...}`` from
    ``nvcc --list-gpu-arch``; None when this nvcc lacks the option (CUDA < 11)."""
    try:
        done = subprocess.run([nvcc, "--list-gpu-arch"], capture_output=True, text=True, timeout=TOOL_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return None
    archs = set(re.findall(r"^compute_(\d+[af]?)$", done.stdout, flags=re.MULTILINE))
    return archs if done.returncode == 0 and archs else None


def cuda_archs(environ: Mapping[str, str], supported: Collection[str] | None = None) -> str:
    """The CUDA architectures to compile for, as a CMake list such as ``"90;100"``.

    ``MOE_DISPATCH_CUDA_ARCHS`` wins (entries split on ``,``, ``;`` or spaces). Otherwise the
    entries of :data:`DEFAULT_CUDA_ARCHS` that ``supported`` (what :func:`nvcc_gpu_archs`
    found) contains, or ``"90"`` when ``supported`` is None (unknown).

    Raises:
        SystemExit: an entry of ``MOE_DISPATCH_CUDA_ARCHS`` is not a CUDA architecture such as
            ``90``, ``90a`` or ``100-real``; or the nvcc supports none of the defaults.
    """
    raw = environ.get("MOE_DISPATCH_CUDA_ARCHS", "").strip()
    if not raw:
        if supported is None:
            return DEFAULT_CUDA_ARCHS[0]
        archs = [a for a in DEFAULT_CUDA_ARCHS if a in supported]
        if not archs:
            raise SystemExit(
                f"error: nvcc supports none of sm_{', sm_'.join(DEFAULT_CUDA_ARCHS)} "
                f"(it lists compute_{', compute_'.join(sorted(supported))}); use CUDA >= 12.0 "
                f"or set MOE_DISPATCH_CUDA_ARCHS"
            )
        return ";".join(archs)
    archs = [a for a in re.split(r"[,; ]+", raw) if a]
    bad = [a for a in archs if not _ARCH.fullmatch(a)]
    if bad:
        raise SystemExit(
            f"error: MOE_DISPATCH_CUDA_ARCHS must list CUDA architectures like '90' or '90;100a', "
            f"got {raw!r} (bad: {', '.join(bad)})"
        )
    return ";".join(archs)


@dataclasses.dataclass(frozen=True)
class CudaPlan:
    """What the build does about ``moe_dispatch._C``.

    Attributes:
        nvcc: the nvcc to compile with; None when the extension is skipped.
        skip_reason: why it is skipped (None when it is built).
        nvcc_version: e.g. ``"13.0.88"``; None when skipped.
        archs: CMake list of CUDA architectures, e.g. ``"90;100"``; None when skipped.
    """

    nvcc: str | None
    skip_reason: str | None = None
    nvcc_version: str | None = None
    archs: str | None = None


def plan_cuda_build(environ: Mapping[str, str], default_cuda_home: str = DEFAULT_CUDA_HOME) -> CudaPlan:
    """Decides whether to compile the extension, with which nvcc and for which architectures.

    Prints nothing (setup.py runs once per build hook); :class:`BuildPy` announces a skip.

    Raises:
        SystemExit: ``MOE_DISPATCH_REQUIRE_CUDA=1`` and the extension cannot be built, or it
            contradicts ``MOE_DISPATCH_SKIP_CUDA=1``; bad ``MOE_DISPATCH_CUDA_ARCHS``.
    """
    required = _flag(environ, "MOE_DISPATCH_REQUIRE_CUDA")
    if _flag(environ, "MOE_DISPATCH_SKIP_CUDA"):
        if required:
            raise SystemExit("error: MOE_DISPATCH_REQUIRE_CUDA=1 and MOE_DISPATCH_SKIP_CUDA=1 contradict; unset one")
        return CudaPlan(None, "MOE_DISPATCH_SKIP_CUDA=1")
    nvcc = find_nvcc(environ, default_cuda_home)
    if nvcc is None:
        reason = f"nvcc not found on PATH, in $CUDA_HOME/bin or in {default_cuda_home}/bin"
        if required:
            raise SystemExit(
                f"error: MOE_DISPATCH_REQUIRE_CUDA=1 but {reason}; install the CUDA toolkit or set CUDA_HOME"
            )
        return CudaPlan(None, reason)
    return CudaPlan(nvcc, None, nvcc_version(nvcc), cuda_archs(environ, nvcc_gpu_archs(nvcc)))


def find_nvshmem(environ: Mapping[str, str]) -> str | None:
    """NVSHMEM root (``include/nvshmem.h``, ``lib/libnvshmem_host.so.3``): ``$NVSHMEM_HOME``,
    else the ``nvidia.nvshmem`` pip package of the environment being installed into. None if absent.

    pip's build isolation hides that environment's site-packages from ``sys.path``, but
    sysconfig still names them, so both places are searched.
    """
    candidates = [Path(environ["NVSHMEM_HOME"])] if environ.get("NVSHMEM_HOME") else []
    if not candidates:
        try:
            spec = importlib.util.find_spec("nvidia.nvshmem")
        except ImportError:
            spec = None
        if spec is not None and spec.submodule_search_locations:
            candidates += [Path(p) for p in spec.submodule_search_locations]
        candidates += [Path(sysconfig.get_path(k), "nvidia", "nvshmem") for k in ("platlib", "purelib")]
    for root in candidates:
        if (root / "include" / "nvshmem.h").exists() and (root / "lib" / "libnvshmem_host.so.3").exists():
            return str(root)
    return None


def nvshmem_version(root: str) -> str | None:
    """``"3.4.5"`` from ``include/non_abi/nvshmem_version.h`` under an NVSHMEM root; None if unreadable."""
    try:
        header = Path(root, "include", "non_abi", "nvshmem_version.h").read_text()
    except OSError:
        return None
    parts = [re.search(rf"#define\s+NVSHMEM_VENDOR_{p}_VERSION\s+(\d+)", header) for p in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(m.group(1) for m in parts) if all(parts) else None


def git_commit(root: Path) -> tuple[str | None, bool]:
    """``(commit, dirty)`` of the git checkout whose top level is ``root``: the ``HEAD`` commit
    and whether tracked files differ from it. ``(None, False)`` when ``root`` is not such a
    checkout (an unpacked sdist) or git is missing."""

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=TOOL_TIMEOUT_S)

    try:
        top = git("rev-parse", "--show-toplevel")
        if top.returncode != 0 or Path(top.stdout.strip()).resolve() != root.resolve():
            return None, False
        head = git("rev-parse", "HEAD")
        status = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None, False
    if head.returncode != 0:
        return None, False
    return head.stdout.strip(), bool(status.stdout.strip())


def build_info_source(plan: CudaPlan, commit: str | None, dirty: bool, nvshmem: str | None) -> str:
    """Text of the generated ``moe_dispatch/_build_info.py`` (read by ``moe_dispatch.env``)."""
    values = {
        "COMMIT": commit,
        "COMMIT_DIRTY": dirty,
        "NVCC_VERSION": plan.nvcc_version,
        "CUDA_ARCHS": plan.archs,
        "NVSHMEM_VERSION": nvshmem,
    }
    lines = ['"""How this copy of moe_dispatch was built: generated by setup.py, not kept in git."""', ""]
    lines += [f"{name} = {value!r}" for name, value in values.items()]
    return "\n".join(lines) + "\n"


def _tool(module: str, attr: str, name: str) -> str | None:
    """A build tool from its pip package when importable (the one pyproject.toml asks for),
    else from PATH."""
    try:
        bin_dir = getattr(__import__(module), attr)
    except ImportError:
        return shutil.which(name)
    return str(Path(bin_dir, name)) if Path(bin_dir, name).exists() else shutil.which(name)


def announce_skip(plan: CudaPlan) -> None:
    """The build's one line on stderr saying that ``moe_dispatch._C`` is skipped and why."""
    print(
        f"moe_dispatch: CUDA extension moe_dispatch._C skipped ({plan.skip_reason}); "
        "building the pure-Python package (py3-none-any)",
        file=sys.stderr,
        flush=True,
    )


class BuildPy(build_py):
    """Copies the Python sources; announces a skipped extension in one line and writes
    ``moe_dispatch/_build_info.py`` into the build tree (editable installs skip the file:
    ``moe_dispatch.env`` asks git there)."""

    plan: CudaPlan  # set before setup() runs

    def run(self) -> None:
        if self.plan.nvcc is None:
            announce_skip(self.plan)
        super().run()
        if self.editable_mode:
            return
        Path(self.build_lib, AUTOLOAD_PTH).write_text(AUTOLOAD_LINE)
        nvshmem_root = find_nvshmem(os.environ) if self.plan.nvcc else None
        commit, dirty = git_commit(ROOT)
        text = build_info_source(self.plan, commit, dirty, nvshmem_version(nvshmem_root) if nvshmem_root else None)
        Path(self.build_lib, "moe_dispatch", BUILD_INFO_MODULE).write_text(text)


class EditableWheel(editable_wheel):
    """An editable install with :data:`AUTOLOAD_PTH` beside setuptools' own ``.pth`` (an
    editable wheel holds no build tree: the file goes into the unpacked wheel's top level)."""

    def _run_build_commands(self, dist_name, unpacked_wheel, build_lib, tmp_dir):
        result = super()._run_build_commands(dist_name, unpacked_wheel, build_lib, tmp_dir)
        Path(unpacked_wheel, AUTOLOAD_PTH).write_text(AUTOLOAD_LINE)
        return result


class CMakeBuild(build_ext):
    """Configures and builds csrc/ with CMake in a persistent tree under build/ (rebuilds are
    incremental), then copies ``_C*.so`` to where setuptools expects ``moe_dispatch._C``."""

    plan: CudaPlan  # set before setup() runs

    def run(self) -> None:
        # Runs without extensions only when called directly (`setup.py build_ext --inplace`):
        # a full build skips this command and BuildPy says why.
        if self.plan.nvcc is None:
            announce_skip(self.plan)
        super().run()

    def build_extension(self, ext: Extension) -> None:
        import pybind11  # a build requirement; imported here so metadata steps do not need it

        cmake = _tool("cmake", "CMAKE_BIN_DIR", "cmake")
        if cmake is None:
            raise SystemExit("error: cmake not found; pip install cmake")
        target = Path(self.get_ext_fullpath(ext.name)).resolve()
        nvshmem = find_nvshmem(os.environ) or ""  # CMake says when it builds without it
        nvcc, archs = self.plan.nvcc, self.plan.archs
        key = hashlib.sha1(f"{sys.executable}|{nvcc}|{archs}|{nvshmem}".encode()).hexdigest()[:8]
        build_dir = ROOT / "build" / f"cmake-{sys.implementation.cache_tag}-{key}"
        built = build_dir / "lib" / target.name
        configure = [
            cmake,
            "-S",
            str(ROOT),
            "-B",
            str(build_dir),
            "-DCMAKE_BUILD_TYPE=Release",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DCMAKE_CUDA_COMPILER={nvcc}",
            f"-DCMAKE_CUDA_ARCHITECTURES={archs}",
            f"-DNVSHMEM_DIR={nvshmem}",
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={built.parent}",
        ]
        ninja = _tool("ninja", "BIN_DIR", "ninja")
        if ninja is not None and not (build_dir / "CMakeCache.txt").exists():
            configure += ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"]
        jobs = self.parallel or len(os.sched_getaffinity(0))
        start = time.monotonic()
        build_dir.mkdir(parents=True, exist_ok=True)
        # Concurrent builds (an editable install while a wheel builds) share the tree: one at a time.
        with open(build_dir.with_name(build_dir.name + ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            subprocess.run(configure, check=True)
            subprocess.run([cmake, "--build", str(build_dir), "-j", str(jobs)], check=True)
            if not built.exists():
                raise SystemExit(f"error: CMake finished but {built} is missing; check CMakeLists.txt's output name")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(built, target)
        print(
            f"moe_dispatch: built {ext.name} with nvcc {self.plan.nvcc_version} for CUDA archs {archs} "
            f"in {time.monotonic() - start:.0f} s",
            file=sys.stderr,
            flush=True,
        )


if __name__ == "__main__":
    BuildPy.plan = CMakeBuild.plan = plan = plan_cuda_build(os.environ)
    setup(
        # No extension at all when skipped: the distribution is then pure and its wheel py3-none-any.
        ext_modules=[Extension("moe_dispatch._C", sources=[])] if plan.nvcc else [],
        cmdclass={"build_py": BuildPy, "build_ext": CMakeBuild, "editable_wheel": EditableWheel},
    )
