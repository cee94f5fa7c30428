"""Shared test set-up. Triton kernels run under the interpreter when no GPU is present; the
variable must be set before triton is first imported.

``MOE_DISPATCH_EXPECT_INSTALLED=1`` (set by ``make test-compat``) declares that the tests must
run against moe_dispatch installed from its wheel: the session stops at once when
``import moe_dispatch`` finds anything else (the source tree, an editable install)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def installed_location_problem() -> str | None:
    """Why the imported moe_dispatch is not a regular (wheel) install in this interpreter's
    site-packages, or None when it is."""
    import importlib.metadata
    import json
    import sysconfig
    from pathlib import Path

    import moe_dispatch

    package_dir = Path(moe_dispatch.__file__).resolve().parent
    site_dirs = {Path(sysconfig.get_paths()[key]).resolve() for key in ("purelib", "platlib")}
    if package_dir.parent not in site_dirs:
        return (
            f"moe_dispatch was imported from {package_dir}, not from this environment's site-packages "
            f"({', '.join(sorted(map(str, site_dirs)))}): the source tree or another install shadows the wheel"
        )
    try:
        direct_url = importlib.metadata.distribution("moe-dispatch").read_text("direct_url.json")
    except importlib.metadata.PackageNotFoundError:
        return "moe_dispatch imports from site-packages but has no installed distribution metadata (moe-dispatch)"
    if direct_url and json.loads(direct_url).get("dir_info", {}).get("editable", False):
        return f"moe-dispatch is an editable install ({direct_url.strip()}), not the built wheel"
    return None


def pytest_configure(config):
    if os.environ.get("MOE_DISPATCH_EXPECT_INSTALLED") == "1":
        problem = installed_location_problem()
        if problem is not None:
            raise pytest.UsageError(f"MOE_DISPATCH_EXPECT_INSTALLED=1: {problem}")


# Kernel tests run for real on a GPU machine, under the interpreter otherwise.
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def needs_gpu(test):
    """Marks ``test`` ``gpu`` and skips it without a CUDA GPU and the built extension."""
    from moe_dispatch import _ext

    skip = pytest.mark.skipif(not _ext.cuda_available(), reason="needs a CUDA GPU and the built extension")
    return pytest.mark.gpu(skip(test))


@pytest.fixture
def on_kernel_device():
    """Makes KERNEL_DEVICE the default device of the test (kernel tests opt in with pytestmark)."""
    with torch.device(KERNEL_DEVICE):
        yield


@pytest.fixture
def gen():
    """A generator on KERNEL_DEVICE with a fresh seed each run (printed, so a failure can be replayed)."""
    g = torch.Generator(device=KERNEL_DEVICE)
    g.seed()
    print("generator seed", g.initial_seed())
    return g
