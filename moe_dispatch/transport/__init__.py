"""How bytes move. ``torch_dist``: the hierarchy on torch.distributed sub-group collectives
(NCCL on GPU, gloo on CPU). ``cuda``: the ``moe_dispatch._C`` kernels (intranode over CUDA IPC,
internode over NVSHMEM: ``cuda.py``, ``internode.py``, ``nvshmem.py``); written and checked on
CPU and in a single-GPU loopback, not yet selectable in ``Buffer`` until they have run on GPUs."""

from __future__ import annotations

import torch

TRANSPORTS = ("auto", "torch_dist", "cuda")


def choose_transport(device: torch.device) -> tuple[str, str]:
    """The transport ``Buffer(transport="auto")`` picks for tensors on ``device``, and why.

    Returns:
        ``(name, reason)``, e.g. ``("torch_dist", "CPU tensors: gloo collectives ...")``.
    """
    if device.type == "cuda":
        return ("torch_dist", "CUDA tensors: NCCL sub-group all_to_all; the intranode kernels "
                              "(transport='cuda', one node) are opt-in until their multi-GPU path has run on GPUs")
    return ("torch_dist", f"{device.type} tensors: the hierarchy runs on torch.distributed "
                          "sub-group all_to_all (gloo)")
