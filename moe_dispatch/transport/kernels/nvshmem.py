"""The NVSHMEM world: NVSHMEM initialised from torch.distributed, and its symmetric heap's size.

:class:`NvshmemWorld`: NVSHMEM initialised over a torch.distributed group with a unique id (rank
0 makes it with ``nvshmemx_get_uniqueid``, ``broadcast_object_list`` hands it to the others,
every rank calls ``nvshmemx_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID)`` with PE = group rank). The
symmetric heap is sized from the buffers asked for (:func:`symmetric_heap_bytes`;
``NVSHMEM_SYMMETRIC_SIZE``, unless already set); the network transport (IBGDA, IBRC, UCX,
libfabric) is NVSHMEM's choice from its own environment (``NVSHMEM_REMOTE_TRANSPORT``,
``NVSHMEM_IB_ENABLE_IBGDA``, ...). One per process; :meth:`NvshmemWorld.close` frees and
finalizes. :class:`~moe_dispatch.transport.kernels.internode.InternodeBuffers` makes one on GPUs
(the RDMA stage's buffer is a symmetric allocation).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ..._ext import require_extension

HEAP_ENV = "NVSHMEM_SYMMETRIC_SIZE"
HEAP_MARGIN = 64 << 20  # NVSHMEM's own symmetric allocations (signals, collectives' scratch)


def symmetric_heap_bytes(buffer_bytes: int) -> int:
    """Heap size for one buffer of ``buffer_bytes``: the buffer plus NVSHMEM's own margin,
    rounded up to 2 MiB (its allocation granularity)."""
    granule = 2 << 20
    return -(-(buffer_bytes + HEAP_MARGIN) // granule) * granule


class NvshmemWorld:
    """NVSHMEM over the ranks of ``group`` (collective: every rank constructs it together).

    Args:
        group: the process group whose ranks become PEs 0..W-1 (PE = group rank).
        device: this rank's CUDA device.
        heap_bytes: symmetric heap to ask for (sets ``NVSHMEM_SYMMETRIC_SIZE`` unless set).

    Raises:
        RuntimeError: the extension lacks NVSHMEM, NVSHMEM is already initialised in this
            process, or the PEs do not match the group's ranks.
    """

    _active: NvshmemWorld | None = None

    def __init__(self, group: dist.ProcessGroup, device: torch.device, heap_bytes: int):
        C = require_extension()
        if not C.with_nvshmem:
            raise RuntimeError(
                "moe_dispatch._C was built without NVSHMEM: reinstall with nvidia-nvshmem-cu13 present "
                "(or NVSHMEM_HOME set)"
            )
        if NvshmemWorld._active is not None:
            raise RuntimeError(
                "NVSHMEM is already initialised in this process (one NvshmemWorld per process; close() the other first)"
            )
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        os.environ.setdefault(HEAP_ENV, str(heap_bytes))
        unique_id = [C.nvshmem_unique_id() if self.rank == 0 else None]
        dist.broadcast_object_list(unique_id, src=dist.get_global_rank(group, 0), group=group)
        C.nvshmem_init(unique_id[0], self.rank, self.world_size, device.index)
        if (C.nvshmem_my_pe(), C.nvshmem_n_pes()) != (self.rank, self.world_size):
            raise RuntimeError(
                f"NVSHMEM made this rank PE {C.nvshmem_my_pe()} of {C.nvshmem_n_pes()}, expected PE "
                f"{self.rank} of {self.world_size} (the group's rank)"
            )
        self._allocations: list[int] = []
        NvshmemWorld._active = self

    def malloc(self, num_bytes: int) -> int:
        """A zeroed symmetric allocation (collective: the same size on every PE); its address."""
        ptr = require_extension().nvshmem_malloc(num_bytes)
        self._allocations.append(ptr)
        return ptr

    def close(self) -> None:
        """Frees every allocation and finalizes NVSHMEM (collective; after the last kernel)."""
        C = require_extension()
        torch.cuda.synchronize()
        for ptr in self._allocations:
            C.nvshmem_free(ptr)
        self._allocations = []
        C.nvshmem_finalize()
        NvshmemWorld._active = None
