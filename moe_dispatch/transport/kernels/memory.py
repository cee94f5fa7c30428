"""The kernels' communication buffers and how peers map them: device memory shared by CUDA IPC
(one process per GPU, or several sharing one), or ``/dev/shm`` files mapped by path (the CPU
backend and the internode kernels' loopback stage 1). Each kind has the same small interface:
``address``, ``handle`` (what travels to the peers), ``open(handle)``, ``mapped()``,
``close_peer(address)``, ``free()``.
"""

from __future__ import annotations

import mmap
import os
import uuid

import torch
import torch.distributed as dist

from ..._ext import require_extension


def map_peers(own, group: dist.ProcessGroup, rank: int, world_size: int, opened: dict[int, int]) -> list[int]:
    """Every rank's buffer address as this process sees it: the handles of ``own``'s kind
    (:class:`CudaIpcBuffer`, :class:`SharedMemoryBuffer`) travel over ``group``, and each
    peer's is opened into ``opened`` as it comes, so a failure leaves the opened ones closable."""
    handles: list = [None] * world_size
    dist.all_gather_object(handles, own.handle, group=group)
    for r, handle in enumerate(handles):
        if r != rank:
            opened[r] = own.open(handle)
    return [own.address if r == rank else opened[r] for r in range(world_size)]


class CudaIpcBuffer:
    """A rank's buffer in device memory: ``cudaMalloc``'ed (a base pointer, as
    ``cudaIpcGetMemHandle`` needs), its control part zeroed before peers map it."""

    def __init__(self, layout, device: torch.device):
        C = require_extension()
        self.address = C.cuda_malloc(layout.total_bytes)
        zero = torch.zeros(min(layout.total_bytes, layout.queue_offset), dtype=torch.uint8, device=device)
        torch.cuda.synchronize(device)
        copy_to_raw(self.address, zero)
        torch.cuda.synchronize(device)
        self.handle = C.ipc_get_handle(self.address)

    @staticmethod
    def open(handle) -> int:
        return require_extension().ipc_open_handle(handle)

    def mapped(self) -> None:
        pass  # an IPC handle names nothing that outlives the allocation

    @staticmethod
    def close_peer(address: int) -> None:
        require_extension().ipc_close(address)

    def free(self) -> None:
        if self.address:
            require_extension().cuda_free(self.address)
            self.address = 0


class SharedMemoryBuffer:
    """A rank's buffer in shared memory (a ``/dev/shm`` file, zero-filled when created) that
    peers map by path. The file is unlinked once every peer has mapped it, so nothing is left
    behind if a process dies; the mappings live until :meth:`free` / :meth:`close_peer`."""

    def __init__(self, layout):
        self.handle = f"/dev/shm/moe_dispatch-{os.getpid()}-{uuid.uuid4().hex}"
        fd = os.open(self.handle, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, layout.total_bytes)
            self._map = mmap.mmap(fd, layout.total_bytes)
        except BaseException:
            os.unlink(self.handle)
            raise
        finally:
            os.close(fd)
        self._peers: dict[int, mmap.mmap] = {}
        self.address = self._address(self._map)

    @staticmethod
    def _address(mapping: mmap.mmap) -> int:
        return torch.frombuffer(mapping, dtype=torch.uint8).data_ptr()  # the view is dropped at once

    def open(self, path: str) -> int:
        fd = os.open(path, os.O_RDWR)
        try:
            mapping = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        address = self._address(mapping)
        self._peers[address] = mapping
        return address

    def mapped(self) -> None:
        if self.handle is not None:
            os.unlink(self.handle)
            self.handle = None

    def close_peer(self, address: int) -> None:
        self._peers.pop(address).close()

    def free(self) -> None:
        self.mapped()  # unlinked already, unless the peers never mapped it
        if self.address:
            self._map.close()
            self.address = 0


def copy_to_raw(address: int, src: torch.Tensor) -> None:
    """Copies a CUDA tensor's bytes to a raw device address (through a tensor view of it)."""
    dst = raw_tensor(address, src.numel(), src.device)
    dst.copy_(src)


def raw_tensor(address: int, num_bytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over raw device memory (not owned: the caller keeps the memory alive)."""

    class _Holder:
        __cuda_array_interface__ = {"shape": (num_bytes,), "typestr": "|u1", "data": (address, False), "version": 3}

    with torch.cuda.device(device):
        return torch.as_tensor(_Holder(), device=device)
