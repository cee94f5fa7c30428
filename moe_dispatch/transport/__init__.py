"""How bytes move. Every transport is a :class:`.base.Transport` (the contract: one signature per
operation, :class:`.base.Capabilities`), registered by name in :data:`TRANSPORTS`, which
``Buffer(transport=...)``, ``"auto"`` and the Megatron backend's options read: a new transport is
one class and one entry here.

- ``torch_dist`` (:mod:`.torch_dist`): the hierarchy on torch.distributed sub-group collectives
  (NCCL on GPU, gloo on CPU), any number of nodes.
- ``kernels`` (the package :mod:`.kernels`): the ``moe_dispatch._C`` kernels behind ``Buffer``,
  chosen by topology: the intranode kernels (:mod:`.kernels.intranode`, buffers shared by CUDA
  IPC) for an EP group on one node, the hierarchical ones (:mod:`.kernels.internode`: stage 1
  over NVSHMEM, stage 2 over NVLink) for several; with CPU tensors the same protocol runs through
  the kernels' CPU backend (shared memory, threads). ``"cuda"`` is the old name of ``"kernels"``.
"""

from __future__ import annotations

import logging

import torch

from .base import Transport
from .kernels import KernelTransport
from .torch_dist import TorchDistTransport

TRANSPORTS: dict[str, type[Transport]] = {cls.name: cls for cls in (TorchDistTransport, KernelTransport)}
TRANSPORT_ALIASES = {"cuda": "kernels"}  # old names
# Every name Buffer(transport=...) accepts.
TRANSPORT_NAMES = ("auto", *TRANSPORTS, *TRANSPORT_ALIASES)


def transport_class(name: str) -> type[Transport]:
    """The transport registered as ``name`` (or its old name).

    Raises:
        ValueError: an unknown name (the message lists :data:`TRANSPORT_NAMES`).
    """
    cls = TRANSPORTS.get(TRANSPORT_ALIASES.get(name, name))
    if cls is None:
        raise ValueError(f"transport must be one of {TRANSPORT_NAMES}, got {name!r}")
    return cls


# Why transport="auto" does not pick the kernels on CUDA yet (README, python -m moe_dispatch.env).
KERNELS_OPT_IN = (
    "transport='kernels' is opt-in: auto picks it on CUDA once its multi-process GPU check "
    "(benchmarks/gpu_check.sh) has passed on a GPU and the result is committed under benchmarks/results/"
)
_LOGGED: set[tuple[str, str]] = set()


def choose_transport(device: torch.device) -> tuple[str, str]:
    """The transport ``Buffer(transport="auto")`` picks for tensors on ``device``, and why.

    Returns:
        ``(name, reason)``, e.g. ``("torch_dist", "CPU tensors: gloo collectives ...")``.
    """
    if device.type == "cuda":
        return "torch_dist", f"CUDA tensors: NCCL sub-group all_to_all; {KERNELS_OPT_IN}"
    return ("torch_dist", f"{device.type} tensors: the hierarchy runs on torch.distributed sub-group all_to_all (gloo)")


def log_choice(name: str, reason: str) -> None:
    """Logs ``transport="auto"``'s choice and reason once per process (logger ``moe_dispatch``,
    level INFO), so a run says what moves its tokens without repeating it per Buffer."""
    if (name, reason) not in _LOGGED:
        _LOGGED.add((name, reason))
        logging.getLogger("moe_dispatch").info("transport='auto' picked %r: %s", name, reason)
