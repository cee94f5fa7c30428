"""The host side of ``moe_dispatch._C``'s internode (hierarchical) kernels: stage 1 over RDMA,
stage 2 over NVLink.

Importable without the extension. Protocol: ``csrc/kernels/internode.cuh`` (both pipelines in
prose, the RDMA buffer layout), ``internode_fused_roles.cuh`` (the fused pipeline's per-warp
code) and ``internode_roles.cuh`` (stage 1 of the staged one), shared by the GPU kernels and
the CPU backend.

A world of W = N nodes x L ranks (rank r = node r // L, local r % L). Two pipelines
(``Config.internode_pipeline``):

- **fused** (default): a notify kernel computes every count on the device (stage-1 ring sizes
  along the rail, relayed over NVLink to the ranks that receive), then one kernel per dispatch
  runs the RDMA puts to the forwarders (same local index on each destination node) and the
  forwarding over NVLink at the same time, as chunks land; combine runs backwards (holders ->
  forwarder over NVLink, pre-reduced there, one partial per (token, node) over RDMA, summed at
  the source). Without ``num_worst_tokens`` the host reads the receive count once (with the
  forwarded count, in the same read); with it, a fresh dispatch never waits for the host: its
  outputs have that many rows, rows past it are dropped and ``handle.overflow`` is set.
- **staged**: node notify, a host read, node dispatch into staging rows, one intranode operation
  per source node (a second host read); combine in reverse. Kept only to time both side by
  side: its host code is :mod:`.experimental`, imported only where a Config selects it.

Both give rows ordered by (source rank, source token), as ``moe_dispatch.reference.dispatch``,
and combine sums equal to ``moe_dispatch.reference.combine`` bit for bit (fp32, fixed orders).

Every wait is bounded by ``timeout_s``; a timed-out launch raises
:class:`InternodeTimeoutError` naming the rank, node, channel, the rank waited for and the
counter. Every operation checks the ranks' arguments on the device
(:mod:`moe_dispatch.transport.kernels.header`): a mismatch raises
:class:`~moe_dispatch.transport.kernels.header.MismatchError` at the next synchronisation.

The layers here: the engines (:class:`~.internode_engines.RdmaEngine`, and per node with
launched ranks an intranode engine, together :class:`~.internode_engines.InternodeEngines`, in
:mod:`.internode_engines` below both pipelines) launch each kernel for a list of ranks;
:func:`run_dispatch` / :func:`run_combine` run an operation through the configured pipeline.
:class:`InternodeBuffers` is one rank per process (NVSHMEM on GPUs, shared memory on CPU), what
:class:`~moe_dispatch.transport.kernels.transport.KernelTransport` drives for several nodes.
Tests and benchmarks run the engines for N x L simulated ranks in one process
(:class:`moe_dispatch.testing.loopback.InternodeLoopback`, on one device or CPU threads) or one
rank per process (:class:`moe_dispatch.testing.ranks.InternodeRank`).
"""

from __future__ import annotations

import datetime
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..._ext import require_extension
from ...config import Config
from ...control.groups import setup_group
from ...errors import InternodeTimeoutError
from ...kernel_layout import ERROR_RECORD_INTS
from .calls import CombineCall, DispatchCall, check_num_sms, ptr
from .header import OP_DISPATCH, Records
from .internode_engines import InternodeDispatch, InternodeEngines, InternodeHandle, RdmaEngine, check_rdma_config
from .intranode import IntranodeBuffers
from .launcher import RankBuffers, dispatch_through
from .memory import SharedMemoryBuffer, map_peers
from .nvshmem import NvshmemWorld, symmetric_heap_bytes
from .timeouts import describe_internode_timeout as describe_timeout
from .timeouts import recorded

if TYPE_CHECKING:  # the staged pipeline is imported only where a Config selects it
    from .experimental import StagedInternodeHandle

__all__ = [
    "InternodeBuffers",
    "InternodeTimeoutError",
    "cross_node_bytes",
    "describe_timeout",
    "empty_handle",
    "fused_channels",
    "fused_launch",
    "fused_notify",
    "run_combine",
    "run_dispatch",
]


def fused_channels(num_sms: int, config: Config) -> int:
    """Channels of a fused launch for an SM budget of ``num_sms``: three blocks each, at least
    one (``num_sms`` checked as the intranode kernels check it)."""
    check_num_sms(num_sms, config)
    return max(1, num_sms // 3)


def fused_notify(t: InternodeEngines, call: DispatchCall) -> None:
    """The fused notify launch: per rank a handle into ``call.handles``. Without a budget the
    host reads R and R1 (one read for all launched ranks); with one, nothing is read and the
    outputs notify fills (their padding rows) are made here unless ``call.outs`` holds them
    (as in the intranode ``run_notify``)."""
    e, N, L, W, device = t.rdma, t.num_nodes, t.ranks_per_node, t.world_size, t.rdma.device
    inputs = call.inputs
    num_topk, experts_per_rank = inputs[0].topk_idx.shape[1], call.num_experts // W
    if num_topk == 0:
        raise ValueError("a fresh internode dispatch needs topk_idx (the forwarders read the holders from it)")
    C = fused_channels(call.num_sms, e.config)
    budget = call.budget
    ids = e.dispatch_ids(call.dispatch_ids, len(inputs))
    zeros = lambda n: torch.zeros(n, dtype=torch.int32, device=device)  # noqa: E731
    in_node = [inp.is_token_in_rank.view(-1, N, L).any(2).contiguous() for inp in inputs]
    tables = [
        {
            "recv_prefix": zeros(W * C + 1),
            "forward_prefix": zeros(C * N + 1),
            "counts": zeros(2),
            "overflow": zeros(1),
            "peer_ok": zeros(N + L),
            "relay_prefix": zeros(L * (N * C + 1)),
        }
        for _ in inputs
    ]
    outs = e.notify_outputs(call, experts_per_rank)
    capacity = L * budget if budget >= 0 else -1
    e.notify(
        "fused",
        e.common(C, inputs[0].rank, call.skip("notify", "dispatch")),
        [
            require_extension().FusedNotifyRank(
                is_token_in_rank=ptr(inp.is_token_in_rank),
                is_token_in_node=ptr(itn),
                **{k: v.data_ptr() for k, v in tb.items()},
                recv_topk_idx=ptr(outs[i]["topk_idx"]) if outs else None,
                recv_topk_weights=ptr(outs[i]["topk_weights"]) if outs else None,
                recv_src_idx=ptr(outs[i]["src_idx"]) if outs else None,
                num_tokens=inp.x.shape[0],
                budget=budget,
                forward_capacity=capacity,
                **e.dispatch_check(
                    OP_DISPATCH, ids[i], inp, call.num_experts, C, call.statuses.get(inp.rank, 0), budget
                ),
            )
            for i, (inp, itn, tb) in enumerate(zip(inputs, in_node, tables))
        ],
        num_topk,
    )
    if budget < 0:  # the one host read: R and R1 of every launched rank, and the timeout record
        host = torch.cat([*(tb["counts"] for tb in tables), e.error]).tolist()
        counts = [host[2 * i : 2 * i + 2] for i in range(len(inputs))]
        if host[2 * len(inputs)] or host[2 * len(inputs) + 1]:
            raise InternodeTimeoutError(*describe_timeout(host[2 * len(inputs) :], e.timeout_s, L, fused=True))
    else:
        counts = [(None, None)] * len(inputs)
    call.handles = [
        InternodeHandle(
            **call.handle_fields(inp, ids[i], C),
            is_token_in_node=itn,
            recv_prefix=tb["recv_prefix"],
            forward_prefix=tb["forward_prefix"],
            relay_prefix=tb["relay_prefix"],
            forward_mask=torch.zeros(capacity if budget >= 0 else forwarded, dtype=torch.int32, device=device),
            forward_cut=zeros(L * C * N),
            counts=tb["counts"],
            overflow=tb["overflow"],
            peer_ok=tb["peer_ok"],
            num_recv_tokens=received,
            num_rows=budget if budget >= 0 else received,
            forward_capacity=capacity if budget >= 0 else forwarded,
            notified=True,
        )
        for i, (inp, itn, tb, (received, forwarded)) in enumerate(zip(inputs, in_node, tables, counts))
    ]


def fused_launch(t: InternodeEngines, call: DispatchCall) -> None:
    """The fused dispatch launch on ``call.handles`` into ``call.outs`` (per rank the dict of
    ``alloc_outputs``: rows ``[handle.num_rows, ...]``)."""
    e = t.rdma
    ranks = [
        require_extension().FusedDispatchRank(**e.dispatch_fields(call, inp, h, o))
        for inp, h, o in zip(call.inputs, call.handles, call.outs)
    ]
    common = e.common(call.handles[0].num_channels, call.inputs[0].rank, call.skip("dispatch", "dispatch"))
    e.dispatch("fused", common, ranks, call, call.num_experts // t.world_size)


def run_dispatch(t: InternodeEngines, call: DispatchCall) -> list[InternodeDispatch]:
    """Dispatch for ranks ``call.inputs[i].rank`` (consecutive) through the configured pipeline:
    fused, the fused notify (fresh only), then one fused dispatch launch (``call.skip_phase``
    None: "dispatch"); staged, :func:`~.experimental.staged_dispatch`."""
    if t.fused:
        t.rdma.dispatch_shape(call.inputs)
        return dispatch_through(t, call, fused_notify, fused_launch, InternodeDispatch, InternodeHandle)
    from .experimental import staged_dispatch

    return staged_dispatch(t, call)


def run_combine(t: InternodeEngines, call: CombineCall) -> list[torch.Tensor]:
    """Combine through the transport's pipeline (``call.skip_phase`` None: its main kernel): the
    fused one in one launch, the staged one by :func:`~.experimental.staged_combine`."""
    if not t.fused:
        from .experimental import staged_combine

        return staged_combine(t, call)
    e = t.rdma
    _, dtype, y_bytes = e.prepare_combine(call, InternodeHandle)
    common = e.common(call.handles[0].num_channels, call.rank_begin, call.skip("combine", "combine"))
    e.combine("fused", common, e.combine_ranks("FusedCombineRank", call, y_bytes, dtype), y_bytes, dtype)
    return call.outs


def cross_node_bytes(handles: list, ranks_per_node: int, row_bytes: int, rank_begin: int = 0) -> int:
    """Payload bytes that crossed a node boundary in stage 1 of a dispatch: rows a rank received
    from other nodes x ``row_bytes`` (the de-duplicated lower bound when each (token, node)
    pair crossed once). Reads the device for fused handles."""
    total = 0
    for i, h in enumerate(handles):
        node = (rank_begin + i) // ranks_per_node
        if isinstance(h, InternodeHandle):
            per = h.forward_prefix.diff().view(h.num_channels, -1).sum(0).tolist()  # rows by source node
            total += (sum(per) - per[node]) * row_bytes
        else:
            total += (h.segments[-1] - (h.segments[node + 1] - h.segments[node])) * row_bytes
    return total


def empty_handle(t: InternodeEngines, rank: int) -> InternodeHandle | StagedInternodeHandle:
    """A handle of no tokens and no rows for ``rank`` (a refusing rank's stand-in)."""
    if t.fused:
        N, L, W, C, device = t.num_nodes, t.ranks_per_node, t.world_size, t.rdma.config.num_channels, t.rdma.device
        zeros = lambda *shape, dtype=torch.int32: torch.zeros(*shape, dtype=dtype, device=device)  # noqa: E731
        return InternodeHandle(
            0,
            C,
            zeros(0, W, dtype=torch.bool),
            zeros(0, N, dtype=torch.bool),
            zeros(W * C + 1),
            zeros(C * N + 1),
            zeros(L * (N * C + 1)),
            zeros(0),
            zeros(L * C * N),
            zeros(2),
            zeros(1),
            zeros(N + L),
            0,
            0,
            0,
            0,
            0,
        )
    from .experimental import empty_staged_handle

    return empty_staged_handle(t)


class InternodeBuffers(RankBuffers):
    """This process's rank of the internode kernels, for an EP group of W = N x L ranks, one
    process each (PE = group rank): its RDMA buffer, its node's NVLink buffers
    (:attr:`node_buffers`) and :attr:`engine` over them.

    On GPUs (one each) stage 1 puts over NVSHMEM (put-with-signal to the PE of the same local
    index; :class:`~moe_dispatch.transport.kernels.nvshmem.NvshmemWorld`) and stage 2 runs on
    CUDA IPC buffers. On CPU (``device="cpu"``) every rank's RDMA buffer is shared memory that
    every rank maps, the puts are copies (the kernels' CPU backend in loopback mode) and the
    NVLink buffers are :class:`~moe_dispatch.transport.kernels.intranode.IntranodeBuffers` on
    their CPU path: the multi-process path is tested without GPUs.

    Pipelines: ``Config.internode_pipeline`` (the module doc). What synchronises (fused): a fresh
    dispatch without ``num_worst_tokens`` reads its receive count once (R and R1 in one read);
    with it, nothing waits for the host; cached dispatch and combine never do. Mismatched calls
    (header.py) are recorded, and :meth:`check_errors` raises them as
    :class:`~moe_dispatch.transport.kernels.header.MismatchError`.

    Args:
        group: the EP process group (NCCL on GPUs, gloo on CPU); ranks ``[n L, (n+1) L)`` form
            node n.
        rank: this rank's index in the group.
        ranks_per_node: L (<= 16, the NVLink domain of stage 2).
        hidden, num_topk: the largest rows moved (sizes slots); ``options``: the keywords of
            :class:`~moe_dispatch.transport.kernels.launcher.RankBuffers` (``config``:
            ``num_slots % chunk_tokens == 0``).

    Raises:
        ValueError: ranks_per_node not dividing W, hidden, num_topk (in [1, 32]) or
            element_bytes out of range, a Config the RDMA stage cannot use, or a device that is
            neither CUDA nor CPU; TypeError: config is no Config; RuntimeError: a CUDA device
            without a GPU, or the extension is not built.

    Collective: every rank constructs it together (NVSHMEM init or shared memory, the stage-2
    buffers over a group of its node's ranks, freed once they are set up). :meth:`close` tears it
    down, also collectively.
    """

    min_topk = 1
    _notify = staticmethod(fused_notify)
    _launch = staticmethod(fused_launch)
    _dispatch = staticmethod(run_dispatch)
    _combine = staticmethod(run_combine)

    def __init__(self, group: dist.ProcessGroup, rank: int, ranks_per_node: int, hidden: int, num_topk: int, **options):
        world_size = dist.get_world_size(group)
        if not isinstance(ranks_per_node, int) or ranks_per_node < 1 or world_size % ranks_per_node:
            raise ValueError(f"ranks_per_node must divide the group size {world_size}, got {ranks_per_node!r}")
        self.ranks_per_node = ranks_per_node
        super().__init__(group, rank, hidden, num_topk, **options)

    def _build(self, slot_bytes: int) -> None:
        check_rdma_config(self.config)
        # The kernel refuses it at the first dispatch; refused here, at construction.
        fused = self.config.internode_pipeline == "fused"
        if fused and self.device.type == "cuda" and self.config.copy_variant != Config().copy_variant:
            raise ValueError(
                "the fused kernels' NVSHMEM mode is compiled for the current copies only (Config.loads_in_flight=4, "
                f"rows_in_flight=1, bulk_copy=False, register_cap=True), got {self.config.copy_variant}; the copy "
                "variants run in loopback mode (InternodeLoopback)"
            )
        L = self.ranks_per_node
        node = self.rank // L
        # Only this node's ranks make its group; it carries the stage-2 buffers' set-up only, and
        # _build_stages ends with a barrier of the EP group after its last collective on it.
        with setup_group(
            [group_rank(self.group, node * L + i) for i in range(L)],
            datetime.timedelta(seconds=self.timeout_s),
            str(dist.get_backend(self.group)),
        ) as node_group:
            self._build_stages(slot_bytes, node_group)

    def _build_stages(self, slot_bytes: int, node_group: dist.ProcessGroup) -> None:
        """The RDMA stage's buffer and engine and, on ``node_group`` (this node's ranks), the
        NVLink stage's buffers (collective; ends with a barrier of the EP group)."""
        C = require_extension()
        group, rank, world_size, L = self.group, self.rank, self.world_size, self.ranks_per_node
        self.num_nodes = N = world_size // L
        on_gpu = self.device.type == "cuda"
        layout = C.internode_rdma_layout(N, L, self.config.num_channels, self.config.num_slots, slot_bytes)
        node = rank // L
        hidden, num_topk, element_bytes = self.rows
        self.node_buffers = IntranodeBuffers(
            node_group,
            rank % L,
            hidden,
            num_topk,
            config=self.config,
            element_bytes=element_bytes,
            timeout_s=self.timeout_s,
            device=self.device,
            relay_nodes=N,
        )
        nodes = {node: self.node_buffers.engine} if self.config.internode_pipeline == "staged" else {}
        self.nvshmem, self._rdma_own, self._rdma_peers, self.error_host = None, None, {}, None
        symmetric, error_host_ptr = None, None
        if on_gpu:
            self.nvshmem = NvshmemWorld(group, self.device, symmetric_heap_bytes(layout.total_bytes))
            symmetric = self.nvshmem.malloc(layout.total_bytes)
            self.error_host = torch.zeros(ERROR_RECORD_INTS, dtype=torch.int32).pin_memory()
            error_host_ptr = C.host_device_pointer(self.error_host.data_ptr())
        else:
            self._rdma_own = SharedMemoryBuffer(layout)
        try:
            rdma = RdmaEngine(
                N,
                L,
                self.config,
                slot_bytes,
                map_peers(self._rdma_own, group, rank, world_size, self._rdma_peers) if not on_gpu else [],
                symmetric,
                self.node_buffers.engine.buffers,
                node * L,
                torch.zeros(ERROR_RECORD_INTS, dtype=torch.int32, device=self.device),
                error_host_ptr,
                "cuda" if on_gpu else "cpu",
                "nvshmem" if on_gpu else "loopback",
                self.timeout_s,
                records=Records(1, self.device, mirror=on_gpu),
                rank_begin=rank,
            )
            self.engine = InternodeEngines(N, L, rdma, nodes)
            dist.barrier(group=group)  # every rank has mapped every buffer
        except BaseException:
            if not on_gpu:
                self.close()  # leave no mapping or shared-memory file behind (local: no collective)
            raise
        if not on_gpu:
            self._rdma_own.mapped()

    @property
    def launches(self) -> int:
        return self.engine.rdma.launches + self.node_buffers.engine.launches

    @property
    def records(self) -> list[Records]:
        return [self.engine.rdma.records, *(e.records for e in self.engine.nodes.values())]

    def empty_handle(self) -> InternodeHandle | StagedInternodeHandle:
        return empty_handle(self.engine, self.rank)

    def check_timeout(self) -> None:
        """Raises :class:`InternodeTimeoutError` for a wait of the RDMA engine's launches or of the
        node engine's (the staged pipeline's stage 2: its ranks made global)."""
        L, node = self.ranks_per_node, self.node_buffers
        record = recorded(self.error_host, self.engine.rdma.error)
        if record:
            raise InternodeTimeoutError(
                *describe_timeout(record, self.engine.rdma.timeout_s, L, fused=self.engine.fused)
            )
        record = recorded(node.error_host, node.engine.error)
        if record:
            raise InternodeTimeoutError(*describe_timeout(record, node.engine.timeout_s, L, node=self.rank // L))

    def check_mismatches(self) -> None:
        self.engine.check_mismatches(synchronize=False)  # the node engine's with global ranks

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
        self.node_buffers.close()


def group_rank(group: dist.ProcessGroup, index: int) -> int:
    """The global rank of ``group``'s rank ``index`` (new_group takes global ranks)."""
    return dist.get_global_rank(group, index)
