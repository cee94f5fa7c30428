"""``Buffer(transport="kernels")``: the Buffer's transport interface served by our ``_C`` kernels,
chosen by topology.

The interface is :class:`~moe_dispatch.transport.base.Transport`, the torch_dist transport's
too, so everything the Buffer builds on it (autograd, ``async_finish``, receive hooks,
``num_worst_tokens``, cached dispatch, fp8, delayed weight gradients) works unchanged. Every
operation launches when called and returns :func:`~moe_dispatch.transport.base.completed`
steps; every launch goes through the Buffer's one ordered queue, a fresh dispatch's plan too
(the launches share one set of rings, so a fresh dispatch's notify must not run beside another
operation's kernels).

- **One node** (``ranks_per_node == W``): the intranode kernels
  (:class:`~moe_dispatch.transport.kernels.intranode.IntranodeBuffers`): CUDA IPC buffers on GPUs.
- **Several nodes**: the hierarchical kernels
  (:class:`~moe_dispatch.transport.kernels.internode.InternodeBuffers`): stage 1 over NVSHMEM to
  the rank of the same local index on each node, stage 2 over NVLink; by default the fused
  pipeline (``Config.internode_pipeline="fused"``: both stages in one kernel, counts on the
  device), or the staged one (kept only to be timed: :mod:`.experimental`).
- **CPU tensors** (a gloo group): the same protocol code on threads over shared memory (the
  kernels' CPU backend), one process per rank: how the tests run this path without a GPU.
- **CUDA tensors with a gloo group** (``Buffer(device="cuda")``): gloo only carries the
  buffer handles and the first-call argument checks, so several processes can share one GPU.

What synchronises the host (per rank, on a GPU):

- a fresh dispatch without ``num_worst_tokens`` reads its receive count R once (R sizes the
  outputs). With ``num_worst_tokens`` (one node, or the fused pipeline) nothing waits for the
  host: notify keeps R and the overflow flag on the device, the outputs have the static size,
  and the whole step can be captured in a CUDA graph. The staged pipeline reads its stage-1
  and stage-2 counts on the host (twice per fresh dispatch, budget or not).
- combine and cached dispatch never wait for the host.
- the arguments: every launch exchanges an operation header with its peers (identity: the
  dispatch id the handle carries; row bytes, dtype, top-k, experts, channels; a status), and a
  pair whose headers differ moves no rows (:mod:`.header`). The Buffer compares the
  arguments on the host only the first time a call signature appears
  (:class:`~moe_dispatch.runtime.transfers.Transfers`). A rank whose own arguments are bad takes part
  with a non-zero status (:meth:`KernelTransport.refuse`), so its peers finish at once.
- kernel timeouts and header mismatches are recorded on the device (and in pinned host
  mirrors on a GPU) and raised at the next point that reads them: a sized dispatch's count
  read, ``Buffer.check_errors()``, a buffer resize; on the CPU backend after each launch.

Rows whose width is not a multiple of 16 bytes (what the kernels move per vector) travel
zero-padded. The buffers grow, on every rank, when an operation needs wider rows than they hold
(a collective set-up: every rank sees the same, checked sizes). ``Buffer.close()`` frees them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ...config import Config
from ...control import ControlPlane
from ...control.agreement import DISPATCH_FIELDS, Field, status_of
from ...errors import ArgumentError, ArgumentTypeError, CommError, MismatchError, error_name
from ...kernel_layout import MAX_RANKS, MAX_TOPK
from ...topology import Topology
from ..base import Capabilities, PlanRequest, Steps, Transfer, Transport, TransportOptions, completed
from .calls import RankInput
from .header import (
    FIELD_STATUS,
    OP_CACHED_DISPATCH,
    OP_COMBINE,
    OP_DISPATCH,
    STATUS_GROW,
    describe_mismatch,
    refusal_status,
)
from .internode import InternodeBuffers
from .internode_engines import InternodeHandle, check_rdma_config
from .intranode import IntranodeBuffers, IntranodeHandle
from .launcher import COMBINE_DTYPES, RankBuffers
from .timeouts import kernel_timeout_s

if TYPE_CHECKING:  # the staged pipeline is imported only where a Config selects it
    from .experimental import StagedInternodeHandle

_VECTOR = 16  # bytes the kernels move per access
_OPS = {"dispatch": OP_DISPATCH, "cached dispatch": OP_CACHED_DISPATCH, "combine": OP_COMBINE}
# What every launch's operation header compares (.header), by operation: the fresh dispatch's notify
# header carries its exact row bytes, dtype, top-k, experts, weights flag and num_worst_tokens; a
# combine's or cached dispatch's its handle, the caller's row bytes and dtype. topk_idx's dtype only
# names the received ids' dtype on each rank.
DEVICE_CHECKED_FIELDS = {
    "dispatch (metadata)": frozenset(DISPATCH_FIELDS),
    "dispatch": frozenset({"handle", "hidden", "dtype"}),
    "combine": frozenset({"handle", "hidden", "dtype"}),
}


@dataclasses.dataclass(eq=False)
class KernelPlan:
    """A dispatch's routing as the kernels keep it (a :class:`~moe_dispatch.transport.base.Plan`).

    Attributes:
        handle: the kernels' handle: an
            :class:`~moe_dispatch.transport.kernels.intranode.IntranodeHandle` (one node), an
            :class:`~moe_dispatch.transport.kernels.internode_engines.InternodeHandle` (several, fused) or a
            :class:`~moe_dispatch.transport.kernels.experimental.StagedInternodeHandle`.
        experts_per_rank: E / W.
        topology: this rank's place.
        num_rows: rows of the receive-side tensors (R, or the static ``num_worst_tokens``).
        scratch: budget mode: the notify's receive-side tables that the dispatch launch fills
            (local top-k ids ``[num_rows, K]`` int64, source indices, per-expert counts); None
            otherwise.
    """

    handle: IntranodeHandle | InternodeHandle | StagedInternodeHandle
    experts_per_rank: int
    topology: Topology
    num_rows: int
    scratch: dict | None = None

    @property
    def dispatch_id(self) -> int:
        """The dispatch's identity (the same on every rank): what later launches on this plan
        carry in their header."""
        return self.handle.dispatch_id

    @property
    def num_recv_tokens(self) -> int | None:
        """R as a host int, or None where only the device knows it (budget mode: read
        :attr:`recv_count`)."""
        return self.handle.num_recv_tokens

    @property
    def recv_count(self) -> torch.Tensor | None:
        """``[1]`` int32 on the device: R (rows received, at most ``num_rows`` stored), for a
        budget-mode plan; None where R is a host int."""
        if self.num_recv_tokens is not None:
            return None
        if isinstance(self.handle, IntranodeHandle):
            return self.handle.num_recv_tokens_dev
        return self.handle.counts[:1]

    @property
    def overflow(self) -> torch.Tensor | None:
        """``[1]`` int32 on the device: 1 when more than ``num_rows`` rows arrived (the rest were
        dropped), for a budget-mode plan; None where R is a host int."""
        return self.handle.overflow if self.num_recv_tokens is None else None

    @property
    def internode_rows(self) -> int:
        """Rows this rank sent to other nodes in stage 1 (reads the layout: a host sync)."""
        topo = self.topology
        if topo.num_nodes == 1:
            return 0
        in_node = self.handle.is_token_in_node
        return int(in_node.sum()) - int(in_node[:, topo.node].sum())

    @property
    def intranode_rows(self) -> int:
        """Rows this rank forwarded to the other ranks of its node in stage 2 (reads the
        routing: a host sync)."""
        topo, h = self.topology, self.handle
        if isinstance(h, InternodeHandle):  # fused: the rows relayed to each local rank, its total last
            relayed = h.relay_prefix.view(topo.ranks_per_node, -1)[:, -1]
            return int(relayed.sum()) - int(relayed[topo.local_rank])
        if isinstance(h, IntranodeHandle):
            sent, me = h.is_token_in_rank, topo.rank
        else:  # staged: the rows it received in stage 1, by local destination
            sent, me = h.forward_in_rank, topo.local_rank
        return int(sent.sum()) - int(sent[:, me].sum())


class KernelTransport(Transport):
    """The ``_C`` kernels behind a Buffer (see the module docstring), a
    :class:`~moe_dispatch.transport.base.Transport`.

    Args:
        control: the EP group's control plane: its host group carries the argument checks of a
            new call signature and the kernels' buffer set-up (handles of the shared buffers).
        topology: this rank's place; one node takes the intranode kernels, several the
            hierarchical ones.
        options: ``timeout_s`` bounds every wait (the argument checks; the kernels' waits too,
            unless ``MOE_DISPATCH_KERNEL_TIMEOUT_S`` is set: :func:`kernel_timeout_s`);
            ``config`` is the kernels' launch shape and queue sizes (the Buffer checked it;
            several nodes need ``num_slots % chunk_tokens == 0``), or "auto": ``Config.auto`` at
            the first plan, from the agreed fields (``_auto_config``); ``device`` the Buffer's
            (CUDA, or CPU for the CPU backend).

    Raises:
        ValueError: more ranks per node than the kernels serve (an NVLink domain), a Config the
            hierarchical kernels cannot use, or a bad ``MOE_DISPATCH_KERNEL_TIMEOUT_S``.
        RuntimeError: the extension is not built.

    Collective: every rank of the EP group constructs it together.
    """

    name = "kernels"

    def __init__(self, control: ControlPlane, topology: Topology, options: TransportOptions):
        super().__init__(control, topology, options)
        config = options.config or Config()
        # "auto" is resolved at the first plan; it keeps the default pipeline
        shape = Config() if config == "auto" else config
        self.check_options(topology, options)
        self.config = config
        self.timeout_s, self.device = options.timeout_s, options.device
        self.kernel_timeout_s = kernel_timeout_s(self.timeout_s)
        # one node, or the hierarchical pipeline of Config.internode_pipeline
        self.pipeline = "intranode" if topology.num_nodes == 1 else shape.internode_pipeline
        self.capabilities = Capabilities(
            # one node and the fused pipeline keep R on the device; the staged one reads it on the host
            budget_on_device=self.pipeline != "staged",
            device_checks=True,
            device_checked_fields=DEVICE_CHECKED_FIELDS,
        )
        self._group = control.group or control.ep_group  # the buffers' set-up (a group of one: any)
        self._kernels: RankBuffers | None = None  # IntranodeBuffers or InternodeBuffers, sized on first use
        self._capacity = (0, 0)  # (row elements at 4 bytes, top-k) the buffers hold

    @classmethod
    def check_options(cls, topology: Topology, options: TransportOptions) -> None:
        """Raises unless the kernels can serve ``topology`` with ``options.config`` here (Buffer
        checks it before its ranks agree on their arguments, so no rank fails alone later).

        Raises:
            ValueError: more ranks per node than the kernels serve (an NVLink domain), or a
                Config the hierarchical kernels cannot use (several nodes).
            RuntimeError: the extension is not built.
        """
        from ... import _ext

        status = _ext.extension_status()
        if not status.built:
            raise RuntimeError(f"transport='kernels' needs the built extension moe_dispatch._C: {status.error}")
        if topology.ranks_per_node > MAX_RANKS:
            raise ValueError(
                f"transport='kernels' serves at most {MAX_RANKS} ranks per node (an NVLink domain), this EP group "
                f"has {topology.ranks_per_node} ({topology.num_nodes} node(s)); pass ranks_per_node= (a divisor of "
                f"{topology.world_size} up to {MAX_RANKS}) or use transport='torch_dist'"
            )
        config = options.config
        if topology.num_nodes > 1:
            check_rdma_config(Config() if config is None or config == "auto" else config)

    # -- dispatch ----------------------------------------------------------------------------
    def plan(self, request: PlanRequest) -> Steps:
        """Steps that size the buffers and run notify; returns the :class:`KernelPlan`. The
        Buffer compares the arguments across ranks first (the first call of a signature; the
        kernels' header every later one).

        What it reads of ``request`` (:class:`~moe_dispatch.transport.base.PlanRequest`):
            is_token_in_rank: ``[T, W]`` bool layout of the sent tokens.
            fields: the dispatch's checked arguments (``hidden``, ``x dtype``, ``top-k``,
                ``num_experts``, ``topk_weights given``): what notify's header carries.
            topk_idx: ``[T, K]`` int32/int64 global expert ids.
            num_rows: a static receive size (budget mode): R stays on the device (no host sync)
                where ``capabilities.budget_on_device``; None: R is read on the host.
            dispatch_id: the dispatch's identity, the same on every rank.
            status: this rank's refusal (non-zero): it takes part in the argument check with it
                (``agreement``), and every rank raises ValueError there, before any launch.
            (``rows`` is unused: the payload moves in :meth:`dispatch_rows`.)
        """
        fields, topk_idx, is_token_in_rank = request.fields, request.topk_idx, request.is_token_in_rank
        if request.status:
            yield from self.agree({"operation": "dispatch (metadata)", **fields}, request.what, request.status)
        yield from ()  # steps that wait for nothing: the launches are enqueued when driven
        if self.config == "auto":
            self.config = _auto_config(fields, self.topology)
        kernels = self._sized(_padded_width(fields["hidden"], 4), fields["top-k"], "dispatch")
        num_tokens, num_topk = topk_idx.shape
        num_experts = fields["num_experts"]
        experts_per_rank = num_experts // self.topology.world_size
        if self.pipeline == "staged":
            # The staged pipeline learns the routing by running it: a dispatch of 16-byte rows
            # (two host reads), whose handle the payload transfers replay.
            result = kernels.dispatch(
                self._input(torch.zeros(num_tokens, 4, device=self.device), None, topk_idx, None, is_token_in_rank),
                num_experts,
                num_sms=self.config.num_sms,
                dispatch_id=request.dispatch_id,
            )
            self._after_launch(mismatches=True)  # this plan's dispatch is an operation of its own
            return KernelPlan(result.handle, experts_per_rank, self.topology, result.handle.num_rows)
        # What notify's header says of the payload (the dispatch launch reuses its verdicts):
        # zero-stride stand-ins with the payload's shape and dtype.
        stand_in = lambda cols, dtype: torch.empty(1, cols, dtype=dtype, device=self.device).expand(  # noqa: E731
            num_tokens, cols
        )
        weights = stand_in(num_topk, torch.float32) if fields["topk_weights given"] else None
        inp = self._input(stand_in(fields["hidden"], fields["x dtype"]), None, topk_idx, weights, is_token_in_rank)
        budget, scratch = request.num_rows, None
        if budget is not None:  # the padding rows notify fills, and the dispatch launch's tables
            scratch = {
                "x": torch.empty(budget, 0, device=self.device),
                "scales": None,
                "topk_idx": torch.empty(budget, num_topk, dtype=torch.int64, device=self.device),
                "topk_weights": None,
                "src_idx": torch.empty(budget, dtype=torch.int32, device=self.device),
                "per_expert": torch.zeros(experts_per_rank, dtype=torch.int64, device=self.device),
            }
        handle = kernels.notify(
            inp,
            num_experts,
            num_sms=self.config.num_sms,
            num_worst_tokens=budget,
            dispatch_id=request.dispatch_id,
            outs=scratch,
        )
        # A timeout now (on a GPU the count read synchronised); a mismatch once the dispatch launch
        # that reuses notify's verdicts has run too, so every rank raises after the same launches.
        if budget is None:
            self._check_errors(mismatches=False)
        else:
            self._after_launch(mismatches=False)
        return KernelPlan(handle, experts_per_rank, self.topology, handle.num_rows, scratch)

    def dispatch_rows(self, transfer: Transfer, is_token_in_rank: torch.Tensor) -> Steps:
        """Steps moving ``transfer.tensors`` = ``[x, (fp8 scales), topk_idx, (topk_weights)]`` into
        ``transfer.out`` (the same list, ``[plan.num_rows, ...]``); top-k ids arrive in global
        numbering (-1 where the expert is another rank's, and in rows past the received ones),
        weights 0 there."""
        tensors, plan, out = transfer.tensors, transfer.plan, transfer.out
        k = next(i for i, t in enumerate(tensors) if not t.is_floating_point())  # topk_idx, the integer one
        x, scales = tensors[0], (tensors[1] if k == 2 else None)
        topk_idx, weights = tensors[k], (tensors[k + 1] if len(tensors) > k + 1 else None)
        local = self._move(
            "dispatch",
            plan,
            x,
            scales,
            topk_idx,
            weights.contiguous() if weights is not None else None,
            out[0],
            out[1] if scales is not None else None,
            out[-1] if weights is not None else None,
        )
        first = self.topology.rank * plan.experts_per_rank
        out[k].copy_(torch.where(local >= 0, local + first, torch.full_like(local, -1)))
        if plan.num_recv_tokens is not None:
            # A sized dispatch synchronised at its count read: every rank's launches up to its
            # notify have completed and recorded what they saw, so every rank raises the same here.
            self._check_errors()
        return completed()

    def forward_rows(self, transfer: Transfer) -> Steps:
        """Steps replaying the plan for row tensors ``[T, ...]`` into ``transfer.out``
        ``[num_rows, ...]`` (an fp8 pair travels as one row)."""
        tensors, plan, out = transfer.tensors, transfer.plan, transfer.out
        fp8 = len(tensors) == 2 and tensors[0].dtype == torch.float8_e4m3fn
        groups = [(tensors, out)] if fp8 else [([t], [o]) for t, o in zip(tensors, out)]
        for (x, *scales), (dst, *dst_scales) in groups:
            no_topk = torch.empty(x.shape[0], 0, dtype=torch.int64, device=self.device)
            self._move(
                "cached dispatch",
                plan,
                _flat(x),
                scales[0] if scales else None,
                no_topk,
                None,
                _flat(dst),
                dst_scales[0] if scales else None,
                None,
            )
        return completed()

    def combine_rows(self, transfer: Transfer) -> Steps:
        """Steps summing each tensor's rows ``[num_rows, ...]`` (times its fp32 scale, if any)
        onto their source tokens in ``transfer.out`` ``[T, ...]``; rows past the received ones
        are not read."""
        plan, what = transfer.plan, transfer.what
        for y, scale, dst in zip(transfer.tensors, transfer.scales, transfer.out):
            if y.dtype not in COMBINE_DTYPES:
                raise TypeError(f"{what}: the kernels combine bf16/fp16/fp32 rows, got {y.dtype}")
            row_bytes = math.prod(y.shape[1:]) * y.element_size()  # the header's: the caller's row
            y2d = _rows16(_flat(y))
            kernels = self._sized(_row_elements(y2d), 0, "combine")
            scale = scale.contiguous() if scale is not None else None
            summed = kernels.combine(y2d, plan.handle, scale, row_bytes=row_bytes)
            self._after_launch()
            dst2d = _flat(dst)
            dst2d.copy_(summed[:, : dst2d.shape[1]])
        return completed()

    # -- errors ------------------------------------------------------------------------------
    def refuse(self, operation: str, err: Exception) -> None:
        """Takes part in ``operation`` ("dispatch", "cached dispatch" or "combine") with no rows
        and a non-zero header status, for a rank whose own arguments were refused (``err``): its
        peers finish at once and record which rank refused. Before the first launch (nothing
        sized yet: the peers are in the host check of a first call) there is nothing to join.

        Raises:
            ``err``, caused by a CommError: a peer did not take part either.
        """
        if self._kernels is None:
            return
        try:
            self._join(operation, refusal_status(status_of(err)))
        except CommError as refusal:
            raise err from refusal
        # Its own verdicts name itself: not news to a rank that raises its own error now. Cleared
        # once the refusal has run (on a GPU, an error path, the host waits for it).
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        for records in self._kernels.records:
            records.clear()

    def refusal(self, err: Exception) -> Exception:
        """What a rank raises after :meth:`refuse` took part for it: what its peers' records
        say of it (their MismatchError, or for a refused TypeError an ArgumentTypeError), quoting
        ``err``."""
        rank = self.topology.rank
        message, fields = describe_mismatch([1, rank, rank, FIELD_STATUS, refusal_status(status_of(err)), 0, -1, 0])
        message = f"{message} (EP rank {rank} refused: {error_name(err)}: {err})"
        if isinstance(err, TypeError):
            argument = err.argument if isinstance(err, ArgumentError) else "arguments"
            return ArgumentTypeError(message, argument=argument, rank=rank)
        return MismatchError(message, fields)

    def _join(self, operation: str, status: int) -> None:
        """Takes part in ``operation`` ("dispatch", "cached dispatch" or "combine") with no rows
        and header ``status`` (collective, as the operation; CommError when a peer does not take
        part either)."""
        ops = [_OPS[operation]]
        if self.pipeline == "staged" and operation == "dispatch":
            ops.append(OP_CACHED_DISPATCH)  # the staged plan's metadata dispatch, then the payload's replay
        for op in ops:
            self._kernels.refuse(op, status)

    def check_errors(self) -> None:
        """Raises what the kernels recorded: an
        :class:`~moe_dispatch.transport.kernels.intranode.IntranodeTimeoutError` or
        :class:`~moe_dispatch.transport.kernels.internode.InternodeTimeoutError` (a wait that ran out,
        naming the rank and what it waited for), or a
        :class:`~moe_dispatch.transport.kernels.header.MismatchError` (a peer's call differed, naming
        the ranks, the field and both values). Reads host memory only (the pinned mirrors on a
        GPU, the records themselves on the CPU backend): call it after the launches completed
        to see theirs."""
        self._check_errors()

    def _check_errors(self, mismatches: bool = True) -> None:
        """Raises a recorded timeout, then (``mismatches``) a recorded header mismatch."""
        if self._kernels is not None:
            self._kernels.check_errors(mismatches)

    def _after_launch(self, mismatches: bool = True) -> None:
        """On the CPU backend a launch has completed when it returns: raise what it recorded now
        (every rank of the operation does, after the same launch). On a GPU a later point that
        reads the records does."""
        if self.device.type == "cpu":
            self._check_errors(mismatches)

    # -- helpers -----------------------------------------------------------------------------
    def _input(self, x, scales, topk_idx, weights, is_token_in_rank, row_bytes: int | None = None) -> RankInput:
        return RankInput(
            self.topology.rank, x, scales, topk_idx, weights, is_token_in_rank, torch.int64, row_bytes=row_bytes
        )

    def _move(
        self,
        operation: str,
        plan: KernelPlan,
        x: torch.Tensor,
        scales: torch.Tensor | None,
        topk_idx: torch.Tensor,
        weights: torch.Tensor | None,
        dst: torch.Tensor,
        dst_scales: torch.Tensor | None,
        dst_weights: torch.Tensor | None,
    ) -> torch.Tensor:
        """One dispatch launch of ``operation`` ("dispatch" or "cached dispatch") on ``plan``: rows of
        ``x [T, W]`` (with fp8 ``scales``, ``topk_idx [T, K]``, ``weights``) into
        ``dst [num_rows, W]`` (and the others); returns the received local top-k ids
        ``[num_rows, K]`` int64 (-1 in rows not received)."""
        x2d = _rows16(x)
        # A cached dispatch may move wider rows than the plan's dispatch (every rank the same:
        # checked by the Buffer). fp8 scales are fp32: one 4-byte element each.
        row_elements = _row_elements(x2d) + (scales.shape[1] if scales is not None else 0)
        kernels = self._sized(_padded_width(row_elements, 4), topk_idx.shape[1], operation)
        inp = self._input(
            x2d,
            scales.contiguous() if scales is not None else None,
            topk_idx,
            weights,
            plan.handle.is_token_in_rank,
            row_bytes=x.shape[1] * x.element_size(),  # the header's: before padding
        )
        recv_x = _landing(dst, x2d.shape[1])
        num_experts = plan.experts_per_rank * self.topology.world_size
        if self.pipeline == "staged":
            got = kernels.dispatch(inp, num_experts, num_sms=self.config.num_sms, handle=plan.handle)
            self._after_launch()
            recv_x.copy_(got.recv_x[0] if isinstance(got.recv_x, tuple) else got.recv_x)
            if dst_scales is not None:
                dst_scales.copy_(got.recv_x[1])
            if dst_weights is not None:
                dst_weights.copy_(got.recv_topk_weights)
            _land(dst, recv_x)
            return got.recv_topk_idx
        rows, num_topk = plan.num_rows, topk_idx.shape[1]
        if plan.scratch is not None and num_topk == plan.scratch["topk_idx"].shape[1]:
            local, src_idx = plan.scratch["topk_idx"], plan.scratch["src_idx"]  # padding rows set by notify
        else:
            local = torch.empty(rows, num_topk, dtype=torch.int64, device=self.device)
            src_idx = torch.empty(rows, dtype=torch.int32, device=self.device)
        outputs = {
            "x": recv_x,
            "scales": dst_scales,
            "topk_weights": dst_weights,
            "topk_idx": local,
            "src_idx": src_idx,
            "per_expert": torch.zeros(plan.experts_per_rank, dtype=torch.int64, device=self.device),
        }
        kernels.launch_dispatch(inp, plan.handle, outputs, num_experts)
        self._after_launch()
        _land(dst, recv_x)
        return local

    def _sized(self, row_elements: int, num_topk: int, operation: str):
        """The kernels' buffers for ``operation``, (re)made when it needs wider rows or more
        top-k. Growing is a collective set-up. Buffers that operations already ran on grow only
        after a join with status STATUS_GROW (:meth:`_grow_join`): every rank grows, or every
        rank raises MismatchError at once. The ranks make the largest capacity any of them asks
        for, so their buffers' layouts agree even where their calls do not (the next launch's
        headers then tell them apart before a row moves)."""
        held_rows, held_topk = self._capacity
        if self._kernels is not None and row_elements <= held_rows and num_topk <= held_topk:
            return self._kernels
        self._check_errors()  # before a resize could drop the record with the old buffers
        if self._kernels is not None:
            self._grow_join(operation)
        asked: list = [None] * self.topology.world_size
        dist.all_gather_object(asked, (row_elements, num_topk), group=self._group)
        row_elements, num_topk = max(a[0] for a in asked), max(a[1] for a in asked)
        # Grown in powers of two from 4 KiB rows and top-8.
        capacity = (max(_next_pow2(row_elements), 1024, held_rows), min(max(num_topk, held_topk, 8), MAX_TOPK))
        topo = self.topology
        options = {"config": self.config, "element_bytes": 4, "timeout_s": self.kernel_timeout_s, "device": self.device}
        if topo.num_nodes > 1:
            # One NVSHMEM world per process: the old buffers go first (every rank is here, after
            # its last launch on them: the set-up below is collective).
            if self._kernels is not None:
                self._release()
            kernels = InternodeBuffers(self._group, topo.rank, topo.ranks_per_node, *capacity, **options)
        else:
            # Made before the old one is freed: if a peer fails here, the old buffers stay valid.
            # Its collective setup also means every rank's earlier launches have finished.
            kernels = IntranodeBuffers(self._group, topo.rank, *capacity, **options)
            if self._kernels is not None:
                self._kernels.close()
        self._kernels, self._capacity = kernels, capacity
        return kernels

    def _grow_join(self, operation: str) -> None:
        """This rank's call needs larger buffers than the calls before it: it takes part in
        ``operation`` with no rows and status STATUS_GROW, then reads what it recorded (a host
        sync, as the resize's set-up is anyway). A peer that is not growing too is recorded, by
        it and by this rank, so every rank raises at once; a clear record means every rank grows.

        Raises:
            MismatchError: a peer's call needs no larger buffers (the ranks' calls differ), or
                it refused its own arguments.
            CommError: a peer did not take part in ``operation``.
        """
        self._join(operation, STATUS_GROW)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self._check_errors()

    def _release(self, barrier: bool = True) -> None:
        """Frees the buffers (collective with ``barrier``: it keeps a peer's last kernel from
        writing into freed memory)."""
        if barrier:
            dist.barrier(group=self._group)
        self._kernels.close()
        self._kernels = None

    def close(self) -> None:
        """Frees the kernels' buffers (local: the runtime's barrier on the control plane came
        first, after every rank's last operation)."""
        if self._kernels is not None:
            self._release(barrier=False)

    def release(self) -> None:
        """Frees what needs no peer: shared memory on CPU (a peer's mapping of it stays valid);
        on a GPU the buffers stay until the process exits, as a peer's kernel may still write
        into them."""
        if self._kernels is not None and self.device.type == "cpu":
            self._kernels.close()
        self._kernels = None


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``t [N, ...]`` as ``[N, prod(...)]`` (a view where ``t`` allows one)."""
    return t.reshape(t.shape[0], math.prod(t.shape[1:]))


def _row_elements(rows: torch.Tensor) -> int:
    """Row width of ``rows [R, W]`` counted in 4-byte elements (what the buffers are sized in)."""
    return -(-rows.shape[1] * rows.element_size() // 4)


def _padded_width(width: int, element_bytes: int) -> int:
    """``width`` elements rounded up to a multiple of 16 bytes."""
    per = _VECTOR // element_bytes
    return -(-width // per) * per


def _rows16(x: torch.Tensor) -> torch.Tensor:
    """``x [T, H]`` contiguous, 16-byte aligned, rows zero-padded to a multiple of 16 bytes."""
    width = _padded_width(x.shape[1], x.element_size())
    if width == x.shape[1] and x.is_contiguous() and x.data_ptr() % _VECTOR == 0:
        return x
    padded = x.new_zeros(x.shape[0], width)
    padded[:, : x.shape[1]] = x
    return padded


def _landing(dst: torch.Tensor, width: int) -> torch.Tensor:
    """Where the kernel writes rows of ``width`` for ``dst``: dst itself when it fits as is."""
    if width == dst.shape[1] and dst.is_contiguous() and (dst.numel() == 0 or dst.data_ptr() % _VECTOR == 0):
        return dst
    return dst.new_empty(dst.shape[0], width)


def _land(dst: torch.Tensor, landed: torch.Tensor) -> None:
    if landed is not dst:
        dst.copy_(landed[:, : dst.shape[1]])


AUTO_TOKENS = 4096  # config="auto": the tokens per rank Config.auto assumes (the ranks' own counts differ)


def _auto_config(fields: dict[str, Field], topology: Topology) -> Config:
    """``Config.auto`` for ``config="auto"`` from a dispatch's checked fields (``hidden``,
    ``top-k``, ``num_experts``, ``fp8 x``, ``x dtype``: the same on every rank, so every rank
    gets the same Config) and :data:`AUTO_TOKENS` tokens per rank."""
    return Config.auto(
        AUTO_TOKENS,
        topology.world_size,
        hidden=fields["hidden"],
        num_topk=fields["top-k"],
        num_experts=fields["num_experts"],
        fp8=fields["fp8 x"],
        element_bytes=4 if fields["x dtype"] == torch.float32 else 2,
        num_nodes=topology.num_nodes,
    )
