"""moe_dispatch installed from its built wheel (``make test-compat``: a Python 3.11 environment
with megatron-core 0.16.1 and torch 2.13, the tests run from a copy outside the source tree).

Runs only with ``MOE_DISPATCH_EXPECT_INSTALLED=1``, which ``make test-compat`` sets (conftest.py
then refuses to start when ``import moe_dispatch`` finds anything but that install):

- the package, its subpackages and its distribution metadata come from site-packages, the
  install is not editable, and every file the wheel installed is there;
- the CUDA extension ``moe_dispatch._C`` was built into the wheel and loads next to this torch
  (required where ``MOE_DISPATCH_REQUIRE_CUDA=1``, as on CI); built with NVSHMEM, it finds
  ``libnvshmem_host.so.3`` through its rpath alone, without the loader's preload.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from .conftest import installed_location_problem

pytestmark = pytest.mark.skipif(
    os.environ.get("MOE_DISPATCH_EXPECT_INSTALLED") != "1",
    reason="runs in `make test-compat` (moe_dispatch installed from its wheel; MOE_DISPATCH_EXPECT_INSTALLED=1)",
)

SITE_DIRS = {Path(sysconfig.get_paths()[key]).resolve() for key in ("purelib", "platlib")}


def _in_site_packages(path) -> bool:
    return any(parent in SITE_DIRS for parent in Path(path).resolve().parents)


def test_package_and_subpackages_come_from_the_wheel():
    import moe_dispatch

    assert installed_location_problem() is None
    for name in (
        "moe_dispatch",
        "moe_dispatch.transport",
        "moe_dispatch.megatron",
        "moe_dispatch.megatron.compat",
        "moe_dispatch.semantics.reference",
        "moe_dispatch.ops.permute",
        "moe_dispatch.testing.launch",
        "moe_dispatch.tools.env",
    ):
        module = importlib.import_module(name)
        assert _in_site_packages(module.__file__), f"{name} imported from {module.__file__}"
    dist = importlib.metadata.distribution("moe-dispatch")
    assert dist.version == moe_dispatch.__version__
    source = Path(__file__).resolve().parents[1] / "moe_dispatch"
    assert not source.exists(), f"a moe_dispatch source folder sits next to the tests ({source})"
    files = [f for f in dist.files if f.parts[0] == "moe_dispatch"]
    missing = [str(f) for f in files if not Path(f.locate()).exists()]
    assert files and not missing, f"files recorded by the wheel but absent: {missing}"
    assert any(str(f) == "moe_dispatch/megatron/compat.py" for f in files)


def test_extension_loads_from_the_wheel():
    from moe_dispatch._ext import extension_status

    status = extension_status()
    if not status.built:
        if os.environ.get("MOE_DISPATCH_REQUIRE_CUDA") == "1":
            pytest.fail(f"MOE_DISPATCH_REQUIRE_CUDA=1 but the installed wheel's extension did not load: {status}")
        pytest.skip(f"the wheel was built without the CUDA extension: {status.error}")
    import moe_dispatch._C as ext

    assert _in_site_packages(ext.__file__), f"moe_dispatch._C loaded from {ext.__file__}"
    assert status.cuda_archs
    if not status.with_nvshmem:
        return
    # A fresh interpreter loads the bare .so (no moe_dispatch import, so no preload of NVSHMEM):
    # its dependency must resolve through the rpath into the nvidia-nvshmem-cu13 package.
    code = (
        f"import ctypes; ctypes.CDLL({ext.__file__!r}); "
        "print(next(l.split()[-1] for l in open('/proc/self/maps') if 'libnvshmem_host.so.3' in l))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert _in_site_packages(out.stdout.strip()), f"libnvshmem_host.so.3 resolved to {out.stdout.strip()}"
