"""NVSHMEM from torch.distributed, and the internode transport for one rank per GPU.

- :class:`NvshmemWorld`: NVSHMEM initialised over a torch.distributed group with a unique id
  (rank 0 makes it with ``nvshmemx_get_uniqueid``, ``broadcast_object_list`` hands it to the
  others, every rank calls ``nvshmemx_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID)`` with PE = group
  rank). The symmetric heap is sized from the buffers asked for (``NVSHMEM_SYMMETRIC_SIZE``,
  unless already set); the transport (IBGDA, IBRC, UCX, libfabric) is NVSHMEM's choice from its
  own environment (``NVSHMEM_REMOTE_TRANSPORT``, ``NVSHMEM_IB_ENABLE_IBGDA``, ...). One per
  process; :meth:`NvshmemWorld.close` frees and finalizes.
- :class:`InternodeTransport`: the kernels of :mod:`moe_dispatch.transport.kernels.internode` for one
  rank per process: the RDMA side in NVSHMEM mode (put-with-signal to the PE of the same local
  index), the NVLink side over the buffers of an
  :class:`~moe_dispatch.transport.kernels.intranode.IntranodeTransport` of the node's ranks.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ..._ext import require_extension
from ...config import ERROR_RECORD_INTS, Config
from .header import Records
from .internode import (
    InternodeEngines,
    InternodeHandle,
    RdmaEngine,
    StagedInternodeHandle,
    check_rdma_config,
    describe_timeout,
    empty_handle,
    run_combine,
    run_dispatch,
)
from .intranode import IntranodeTransport
from .launcher import (
    InternodeTimeoutError,
    RankTransport,
    default_timeout_s,
    resolve_device,
    slot_bytes_for,
)
from .memory import SharedMemoryBuffer, map_peers

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


class InternodeTransport(RankTransport):
    """The internode kernels for an EP group of W = N x L ranks, one process each, PE = group rank.

    On GPUs (one each) stage 1 puts over NVSHMEM and stage 2 runs on CUDA IPC buffers. On CPU
    (``device="cpu"``) every rank's RDMA buffer is shared memory that every rank maps, the puts
    are copies (the kernels' CPU backend in loopback mode) and the NVLink buffers are those of an
    :class:`~moe_dispatch.transport.kernels.intranode.IntranodeTransport` on its CPU path: the multi-process
    wrapper is tested without GPUs.

    Pipelines: ``Config.internode_pipeline`` (see :mod:`moe_dispatch.transport.kernels.internode`). What
    synchronises (fused): a fresh dispatch without ``num_worst_tokens`` reads its receive count
    once (R and R1 in one read); with it, nothing waits for the host; cached dispatch and combine
    never do. Mismatched calls (header.py) raise
    :class:`~moe_dispatch.transport.kernels.header.MismatchError` at the next synchronisation: right after
    the operation on CPU, after that count read, or from :meth:`check_errors` / :meth:`check`.

    Args:
        group: the EP process group (NCCL on GPUs, gloo on CPU); ranks ``[n L, (n+1) L)`` form
            node n.
        rank: this rank's index in the group.
        ranks_per_node: L (<= 16, the NVLink domain of stage 2).
        hidden, num_topk, element_bytes: the largest rows moved (sizes slots).
        config: :class:`Config` (``num_slots % chunk_tokens == 0``); every rank passes the same.
        timeout_s: bound of every wait inside the kernels.
        device: None (the current CUDA device), a CUDA device, or ``"cpu"``.

    Raises:
        ValueError: ranks_per_node not dividing W, hidden, num_topk (in [1, 32]) or
            element_bytes out of range, a Config the RDMA stage cannot use, or a device that is
            neither CUDA nor CPU; TypeError: config is no Config; RuntimeError: a CUDA device
            without a GPU, or the extension is not built.

    Collective: every rank constructs it together (NVSHMEM init or shared memory, the node
    groups, the stage-2 buffers). :meth:`close` tears it down, also collectively.
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        rank: int,
        ranks_per_node: int,
        hidden: int,
        num_topk: int,
        *,
        config: Config | None = None,
        element_bytes: int = 2,
        timeout_s: float | None = None,
        device: torch.device | str | None = None,
    ):
        world_size = dist.get_world_size(group)
        if not isinstance(ranks_per_node, int) or ranks_per_node < 1 or world_size % ranks_per_node:
            raise ValueError(f"ranks_per_node must divide the group size {world_size}, got {ranks_per_node!r}")
        slot_bytes = slot_bytes_for(hidden, num_topk, element_bytes, config, min_topk=1)
        self.config = config or Config()
        check_rdma_config(self.config)
        self.device, _ = resolve_device("cuda" if device is None else device)  # before anything collective
        # The kernel refuses it at the first dispatch; refused here, at construction.
        fused = self.config.internode_pipeline == "fused"
        if fused and self.device.type == "cuda" and self.config.copy_variant != Config().copy_variant:
            raise ValueError(
                "the fused kernels' NVSHMEM mode is compiled for the current copies only (Config.loads_in_flight=4, "
                f"rows_in_flight=1, bulk_copy=False, register_cap=True), got {self.config.copy_variant}; the copy "
                "variants run in loopback mode (InternodeLoopback)"
            )
        C = require_extension()
        self.group, self.rank, self.world_size = group, rank, world_size
        self.num_nodes, self.ranks_per_node = N, L = world_size // ranks_per_node, ranks_per_node
        on_gpu = self.device.type == "cuda"
        timeout = default_timeout_s(timeout_s)
        layout = C.internode_rdma_layout(N, L, self.config.num_channels, self.config.num_slots, slot_bytes)
        # Every rank creates every node group, in the same order (new_group is collective).
        node = rank // L
        node_groups = [dist.new_group([group_rank(group, n * L + i) for i in range(L)]) for n in range(N)]
        self.intranode = IntranodeTransport(
            node_groups[node],
            rank % L,
            hidden,
            num_topk,
            config=self.config,
            element_bytes=element_bytes,
            timeout_s=timeout,
            device=self.device,
            relay_nodes=N,
        )
        nvl = self.intranode.engine.buffers
        error = torch.zeros(ERROR_RECORD_INTS, dtype=torch.int32, device=self.device)
        records = Records(1, self.device, mirror=on_gpu)
        nodes = {node: self.intranode.engine} if self.config.internode_pipeline == "staged" else {}
        self.nvshmem, self._rdma_own, self._rdma_peers, self._error_host = None, None, {}, None
        if on_gpu:
            self.nvshmem = NvshmemWorld(group, self.device, symmetric_heap_bytes(layout.total_bytes))
            symmetric = self.nvshmem.malloc(layout.total_bytes)
            self._error_host = torch.zeros(ERROR_RECORD_INTS, dtype=torch.int32).pin_memory()
            rdma = RdmaEngine(
                N,
                L,
                self.config,
                slot_bytes,
                [],
                symmetric,
                nvl,
                node * L,
                error,
                C.host_device_pointer(self._error_host.data_ptr()),
                "cuda",
                "nvshmem",
                timeout,
                records=records,
                rank_begin=rank,
            )
            self.transport = InternodeEngines(N, L, rdma, nodes)
            dist.barrier(group=group)
        else:
            self._rdma_own = SharedMemoryBuffer(layout)
            try:
                buffers = map_peers(self._rdma_own, group, rank, world_size, self._rdma_peers)
                rdma = RdmaEngine(
                    N,
                    L,
                    self.config,
                    slot_bytes,
                    buffers,
                    None,
                    nvl,
                    node * L,
                    error,
                    None,
                    "cpu",
                    "loopback",
                    timeout,
                    records=records,
                    rank_begin=rank,
                )
                self.transport = InternodeEngines(N, L, rdma, nodes)
                dist.barrier(group=group)  # every rank has mapped every buffer
            except BaseException:
                self.close()  # leave no mapping or shared-memory file behind (local: no collective)
                raise
            self._rdma_own.mapped()

    def _launches(self) -> int:
        return self.transport.rdma.launches + self.intranode.engine.launches

    def _dispatch_ranks(self, inputs, num_experts, **options):
        return run_dispatch(self.transport, inputs, num_experts, **options, check=False)

    def _run_combine(self, y, handle, row_scale, statuses=None):
        return run_combine(self.transport, self.rank, [y], [handle], [row_scale], None, None, statuses, check=False)[0]

    def _empty_handle(self) -> InternodeHandle | StagedInternodeHandle:
        return empty_handle(self.transport, self.rank)

    def _check_finished(self) -> None:
        self.transport.check()

    def check_errors(self) -> None:
        """Raises :class:`InternodeTimeoutError` if a kernel of this rank timed out, or
        :class:`~moe_dispatch.transport.kernels.header.MismatchError` if a peer's call differed (reads
        the pinned mirrors on a GPU: does not wait for running kernels)."""
        record = self._error_host.tolist() if self._error_host is not None else self.transport.rdma.read_error()
        if record and record[0]:
            raise InternodeTimeoutError(
                *describe_timeout(
                    record, self.transport.rdma.timeout_s, self.ranks_per_node, fused=self.transport.fused
                )
            )
        self.intranode.check_timeout()
        self.transport.check_mismatches(synchronize=False)  # the node engine's with global ranks

    def close(self) -> None:
        """Frees the buffers, finalizes NVSHMEM, unmaps the node's IPC buffers (collective)."""
        if self.nvshmem is not None:
            self.nvshmem.close()
        else:
            for address in self._rdma_peers.values():
                self._rdma_own.close_peer(address)
            self._rdma_peers = {}
            if self._rdma_own is not None:
                self._rdma_own.free()
        self.intranode.close()


def group_rank(group: dist.ProcessGroup, index: int) -> int:
    """The global rank of ``group``'s rank ``index`` (new_group takes global ranks)."""
    return dist.get_global_rank(group, index)
