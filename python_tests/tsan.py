"""Builds the CPU backend's ThreadSanitizer drivers (csrc/tests/<name>_tsan.cpp)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def build_tsan_driver(tmp_path: Path, name: str) -> tuple[Path, dict[str, str]]:
    """Compiles ``csrc/tests/<name>_tsan.cpp`` with ``csrc/kernels/<name>_cpu.cpp`` (``name``:
    "intranode" or "internode") under ``-fsanitize=thread`` into ``tmp_path``; returns the
    executable and the environment to run it in (the first race ends it with exit code 66).
    Skips where g++ or ThreadSanitizer is missing; fails on any other build error."""
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ not found")
    exe = tmp_path / f"{name}_tsan"
    build = subprocess.run(
        [
            gxx,
            "-std=c++17",
            "-O1",
            "-g",
            "-fsanitize=thread",
            f"-I{ROOT / 'csrc'}",
            str(ROOT / f"csrc/kernels/{name}_cpu.cpp"),
            str(ROOT / f"csrc/tests/{name}_tsan.cpp"),
            "-o",
            str(exe),
            "-pthread",
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if build.returncode != 0 and "tsan" in build.stderr.lower():
        pytest.skip(f"ThreadSanitizer unavailable: {build.stderr[-300:]}")
    assert build.returncode == 0, build.stderr
    return exe, dict(os.environ, TSAN_OPTIONS="halt_on_error=1 exitcode=66")
