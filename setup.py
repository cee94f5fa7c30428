"""Build of moe_dispatch: metadata lives in pyproject.toml; this file drives CMake to compile
the CUDA extension ``moe_dispatch._C`` from csrc/.

nvcc is looked up on PATH, then in ``$CUDA_HOME/bin``, then in ``/usr/local/cuda/bin``. Without
it the pure-Python package installs and the build prints one line saying so. Environment:

- ``MOE_DISPATCH_CUDA_ARCHS``: CUDA architectures for CMake, e.g. ``90`` (default), ``90;100a``.
- ``MOE_DISPATCH_REQUIRE_CUDA=1``: a missing nvcc fails the build instead.
- ``MOE_DISPATCH_SKIP_CUDA=1``: install the pure-Python package even where nvcc exists.
- ``NVSHMEM_HOME``: NVSHMEM root; default: the ``nvidia-nvshmem-cu13`` pip package. Without
  NVSHMEM the extension builds without the internode kernels.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
from collections.abc import Mapping
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
DEFAULT_CUDA_HOME = "/usr/local/cuda"
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


def plan_cuda_build(environ: Mapping[str, str], default_cuda_home: str = DEFAULT_CUDA_HOME) -> str | None:
    """Decides whether to compile the extension: returns the nvcc to use, or None to skip.

    Skipping prints one line to stderr naming the reason.

    Raises:
        SystemExit: ``MOE_DISPATCH_REQUIRE_CUDA=1`` and the extension cannot be built, or it
            contradicts ``MOE_DISPATCH_SKIP_CUDA=1``.
    """
    required = _flag(environ, "MOE_DISPATCH_REQUIRE_CUDA")
    if _flag(environ, "MOE_DISPATCH_SKIP_CUDA"):
        if required:
            raise SystemExit("error: MOE_DISPATCH_REQUIRE_CUDA=1 and MOE_DISPATCH_SKIP_CUDA=1 contradict; unset one")
        reason = "MOE_DISPATCH_SKIP_CUDA=1"
    else:
        nvcc = find_nvcc(environ, default_cuda_home)
        if nvcc is not None:
            return nvcc
        reason = f"nvcc not found on PATH, in $CUDA_HOME/bin or in {default_cuda_home}/bin"
        if required:
            raise SystemExit(f"error: MOE_DISPATCH_REQUIRE_CUDA=1 but {reason}; install the CUDA toolkit or set CUDA_HOME")
    print(f"moe_dispatch: CUDA extension moe_dispatch._C skipped ({reason}); installing the pure-Python package",
          file=sys.stderr, flush=True)
    return None


def cuda_archs(environ: Mapping[str, str]) -> str:
    """``MOE_DISPATCH_CUDA_ARCHS`` (default ``"90"``; entries split on ``,``, ``;`` or spaces)
    as a CMake list, e.g. ``"90;100a"``.

    Raises:
        SystemExit: an entry is not a CUDA architecture such as ``90``, ``90a`` or ``100-real``.
    """
    raw = environ.get("MOE_DISPATCH_CUDA_ARCHS", "").strip() or "90"
    archs = [a for a in re.split(r"[,; ]+", raw) if a]
    bad = [a for a in archs if not _ARCH.fullmatch(a)]
    if bad:
        raise SystemExit(f"error: MOE_DISPATCH_CUDA_ARCHS must list CUDA architectures like '90' or '90;100a', "
                         f"got {raw!r} (bad: {', '.join(bad)})")
    return ";".join(archs)


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


def _tool(module: str, attr: str, name: str) -> str | None:
    """A build tool from its pip package when importable (the one pyproject.toml asks for),
    else from PATH."""
    try:
        bin_dir = getattr(__import__(module), attr)
    except ImportError:
        return shutil.which(name)
    return str(Path(bin_dir, name)) if Path(bin_dir, name).exists() else shutil.which(name)


class CMakeBuild(build_ext):
    """Configures and builds csrc/ with CMake into the location setuptools expects for
    ``moe_dispatch._C`` (editable installs then copy it next to the sources)."""

    def run(self) -> None:
        nvcc = plan_cuda_build(os.environ)
        if nvcc is None:
            return
        self._nvcc = nvcc
        self._archs = cuda_archs(os.environ)
        super().run()

    def build_extension(self, ext: Extension) -> None:
        import pybind11  # a build requirement; imported here so metadata steps do not need it

        cmake = _tool("cmake", "CMAKE_BIN_DIR", "cmake")
        if cmake is None:
            raise SystemExit("error: cmake not found; pip install cmake")
        target = Path(self.get_ext_fullpath(ext.name)).resolve()
        nvshmem = find_nvshmem(os.environ) or ""  # CMake says when it builds without it
        # One persistent build tree per configuration: rebuilds are incremental.
        key = hashlib.sha1(f"{sys.executable}|{self._nvcc}|{self._archs}|{nvshmem}".encode()).hexdigest()[:8]
        build_dir = ROOT / "build" / f"cmake-{sys.implementation.cache_tag}-{key}"
        configure = [
            cmake, "-S", str(ROOT), "-B", str(build_dir),
            "-DCMAKE_BUILD_TYPE=Release",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DCMAKE_CUDA_COMPILER={self._nvcc}",
            f"-DCMAKE_CUDA_ARCHITECTURES={self._archs}",
            f"-DNVSHMEM_DIR={nvshmem}",
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={target.parent}",
        ]
        ninja = _tool("ninja", "BIN_DIR", "ninja")
        if ninja is not None and not (build_dir / "CMakeCache.txt").exists():
            configure += ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"]
        jobs = self.parallel or len(os.sched_getaffinity(0))
        start = time.monotonic()
        subprocess.run(configure, check=True)
        subprocess.run([cmake, "--build", str(build_dir), "-j", str(jobs)], check=True)
        if not target.exists():
            raise SystemExit(f"error: CMake finished but {target} is missing; check CMakeLists.txt's output name")
        print(f"moe_dispatch: built {ext.name} for CUDA archs {self._archs} in {time.monotonic() - start:.0f} s",
              file=sys.stderr, flush=True)


if __name__ == "__main__":
    setup(
        ext_modules=[Extension("moe_dispatch._C", sources=[])],
        cmdclass={"build_ext": CMakeBuild},
    )
