"""How bytes move. Every transport serves the contract of :mod:`.base` (``Transport``, ``Plan``).

- ``torch_dist`` (:mod:`.torch_dist`): the hierarchy on torch.distributed sub-group collectives
  (NCCL on GPU, gloo on CPU), any number of nodes.
- ``kernels`` (:mod:`.kernels`): the ``moe_dispatch._C`` kernels behind ``Buffer``: the intranode
  kernels (:mod:`.intranode`, buffers shared by CUDA IPC) for an EP group on one node; with a
  gloo group the same protocol runs on CPU tensors through the kernels' CPU backend (shared
  memory, threads). :mod:`.internode` and :mod:`.nvshmem` launch the hierarchical kernels
  (stage 1 over NVSHMEM, stage 2 over NVLink). ``"cuda"`` is the old name of ``"kernels"``.
"""

from __future__ import annotations

import torch

# Every name Buffer(transport=...) accepts; TRANSPORT_ALIASES maps the old ones to theirs.
TRANSPORTS = ("auto", "torch_dist", "kernels", "cuda")
TRANSPORT_ALIASES = {"cuda": "kernels"}


def choose_transport(device: torch.device) -> tuple[str, str]:
    """The transport ``Buffer(transport="auto")`` picks for tensors on ``device``, and why.

    Returns:
        ``(name, reason)``, e.g. ``("torch_dist", "CPU tensors: gloo collectives ...")``.
    """
    if device.type == "cuda":
        return (
            "torch_dist",
            "CUDA tensors: NCCL sub-group all_to_all; the intranode kernels "
            "(transport='kernels', one node) are opt-in until their multi-GPU path has run on GPUs",
        )
    return ("torch_dist", f"{device.type} tensors: the hierarchy runs on torch.distributed sub-group all_to_all (gloo)")
