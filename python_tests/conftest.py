"""Shared test set-up. Triton kernels run under the interpreter when no GPU is present; the
variable must be set before triton is first imported."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# Kernel tests run for real on a GPU machine, under the interpreter otherwise.
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


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
