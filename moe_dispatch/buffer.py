"""``Buffer``: the one object users hold (DeepEP's shape): group, topology, transport, SM budget;
``get_dispatch_layout``, ``dispatch``, ``combine``."""

from __future__ import annotations

import dataclasses
import itertools
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .config import Config
from .control import ControlPlane
from .control.agreement import DISPATCH_FIELDS, refusing_fields
from .errors import ArgumentTypeError, InvalidArgumentError, checking
from .ops.layout import check_topk_idx_cpu, get_dispatch_layout, is_token_in_rank_cpu
from .ops.permute import check_permute_args
from .ops.quant import per_token_cast_to_fp8
from .runtime import autograd
from .runtime.arguments import DEFAULT_TIMEOUT_S, agree_arguments
from .runtime.calls import Call, ExpertLayout, FreshDispatch, PlanSlot
from .runtime.checks import check_fp8_wire, check_num_worst_tokens, check_x
from .runtime.queue import EventOverlap, RecvHook, release_dropped
from .runtime.transfers import Transfers, dispatch_fields
from .semantics.layout import get_dispatch_layout_torch
from .semantics.permute import PermuteHandle
from .semantics.validation import (
    check_hidden,
    check_num_experts,
    check_topk_weights,
    dense,
    is_int,
)
from .transport import transport_class
from .transport.base import Plan, TransportOptions

if TYPE_CHECKING:
    from .overlap import DelayedWgrad
    from .transport.base import Transport

_BUFFER_IDS = itertools.count()


def _truthy(value) -> bool:
    try:
        return bool(value)
    except Exception:  # noqa: BLE001 - a value that has no truth is no size either
        return False


@dataclasses.dataclass(eq=False)
class DispatchHandle:
    """What combine (and a cached dispatch) needs to reverse or replay one dispatch.

    Per micro-batch state lives here, never on the Buffer: several handles may be in flight.

    Attributes:
        buffer_id: the creating Buffer (a handle is only valid with it).
        num_experts: E.
        recv_topk_idx: ``[R, K]`` local expert ids of the received rows (-1 elsewhere).
        is_token_in_rank: ``[T, W]`` bool layout of the sent tokens.
        slot: the transport's index plan and row counts (see :class:`PlanSlot`).

    Host ints and device tensors: ``num_tokens``, ``num_recv_tokens`` (the rows of the receive
    tensors) and ``dispatch_id`` are host ints in every mode. The count of rows actually
    received is ``recv_count`` (``[1]`` int32 on the device, readable without a host sync in
    budget mode); ``plan.num_recv_tokens`` is the same count as a host int, except in the
    kernels' budget mode, where it is None: there the host never learns it.
    """

    buffer_id: int
    num_experts: int
    recv_topk_idx: torch.Tensor
    is_token_in_rank: torch.Tensor
    slot: PlanSlot
    _hook: RecvHook | None = None  # the dispatch's receive hook, when issued with one

    @property
    def num_tokens(self) -> int:
        """T, tokens this rank sent."""
        return self.slot.num_tokens

    @property
    def dispatch_id(self) -> int:
        """The dispatch's operation number on its Buffer: equal on every rank of a consistent
        program; combine and cached dispatch compare it across ranks, so a rank holding another
        dispatch's handle gets a ValueError (on every rank) before anything moves."""
        return self.slot.dispatch_id

    @property
    def permute(self) -> PermuteHandle | None:
        """The fused permute of a :meth:`Buffer.dispatch_to_experts` (its received rows' expert-major
        layout: ``row_id_map``, ``tokens_per_expert``, ``overflow``), else None."""
        return self.slot.permute

    @property
    def num_recv_tokens(self) -> int:
        """R, rows of this rank's receive-side tensors (``num_worst_tokens`` when the dispatch
        was given it; then the received count is :attr:`recv_count`)."""
        return self.slot.num_rows

    @property
    def recv_count(self) -> torch.Tensor:
        """``[1]`` int32 on the Buffer's device: rows received (of which the first
        ``num_recv_tokens`` at most are stored). Made from the host count where the host knows
        it; in the kernels' budget mode the kernels' own count (no host sync). Valid once the
        dispatch completed."""
        plan = self.plan
        count = getattr(plan, "recv_count", None)
        if count is not None:
            return count
        return torch.full((1,), plan.num_recv_tokens, dtype=torch.int32, device=self.recv_topk_idx.device)

    @property
    def overflow(self) -> torch.Tensor:
        """``[1]`` bool on the Buffer's device: True when a ``num_worst_tokens`` dispatch received
        more rows than that (its ``on_overflow="drop"`` left them out); False otherwise. Valid
        once the dispatch completed; reading it on the host synchronises."""
        if self.slot.overflow is None:
            return torch.zeros(1, dtype=torch.bool, device=self.recv_topk_idx.device)
        return self.slot.overflow

    @property
    def plan(self) -> Plan:
        """The transport's index plan (for a ``num_worst_tokens`` dispatch: once it completed).

        Raises:
            RuntimeError: a ``num_worst_tokens`` dispatch that has not completed yet.
        """
        if self.slot.plan is None:
            raise RuntimeError(
                "this handle's dispatch (num_worst_tokens) has not completed: wait for its event "
                "(or call its hook) before reading the plan"
            )
        return self.slot.plan

    @property
    def num_internode_tokens(self) -> int:
        """Rows this rank sent to other nodes (stage 1); combine returns as many."""
        return self.plan.internode_rows

    @property
    def num_intranode_tokens(self) -> int:
        """Rows this rank forwarded to other ranks of its node (stage 2)."""
        return self.plan.intranode_rows


class Buffer:
    """Hierarchical expert-parallel dispatch/combine for one EP group.

    Args:
        group: the EP process group (default: the world group). gloo groups use CPU tensors,
            NCCL groups CUDA tensors of the current device.
        ranks_per_node: L, ranks sharing a node (NVLink domain); must divide the group size.
            Default: :func:`~moe_dispatch.runtime.arguments.default_ranks_per_node` (where the group's ranks run, from
            ``LOCAL_WORLD_SIZE`` or the GPU count; else W, one node). A CPU world may declare
            any divisor (e.g. 8 ranks as 2 nodes x 4) to exercise the hierarchy.
        transport: ``"auto"`` (see ``moe_dispatch.transport.choose_transport``: ``"torch_dist"``
            for now; it logs its choice and why once), ``"torch_dist"`` or ``"kernels"``: the
            ``_C`` kernels (``moe_dispatch.transport.kernels``), chosen by topology: the
            intranode kernels for an EP group on one node, the hierarchical ones (NVSHMEM
            between nodes, NVLink inside) for several; with CPU tensors they run through the
            kernels' CPU backend (the same protocol code; how the tests check it). ``"cuda"`` is
            the old name of ``"kernels"``.
        num_sms: SM budget of the CUDA kernels (an even int in [2, 128], two per channel; checked
            on every transport, used by ``"kernels"`` only), None = the default ``Config``.
        config: the CUDA kernels' whole launch shape and queue sizes, a
            :class:`moe_dispatch.config.Config` (``num_sms``, ring depth ``num_slots``,
            ``chunk_tokens``, ``l2_discard``, the kernel variant); None = ``Config(num_sms=num_sms)``,
            or ``Config()`` when ``num_sms`` is None too; ``"auto"``: ``Config.auto`` (the cost
            model's SMs and ring depth) at the first dispatch, from the fields every rank agreed on
            (:class:`~moe_dispatch.transport.kernels.KernelTransport`). Pass ``num_sms`` or
            ``config``, not both. Used by ``transport="kernels"`` only.
        timeout_s: bound, in seconds, on every collective: a rank that never joins makes the
            others raise ``CommError`` naming the operation and the peers instead of hanging.
        num_chunks: pipeline depth of ``transport="torch_dist"``: each source splits its tokens
            into this many chunks, so stage 1 (inter-node) of one chunk overlaps stage 2
            (intra-node) of the previous (``moe_dispatch.transport.torch_dist``). Results are the
            same bits for any depth. None (default): the route and depth follow each dispatch's
            size and, on gloo, the links measured once per EP group (one flat exchange for small
            calls and alike links, one chunk per ``torch_dist.tuning.CHUNK_BYTES``). A
            positive int, the same on every rank, keeps two stages; checked on every transport,
            used by ``"torch_dist"`` only.
        device: where the tensors live: None (NCCL groups: the current CUDA device; others:
            CPU), ``"cpu"``, or a CUDA device (``"cuda"`` = the current one). A gloo group with a
            CUDA device is how several processes share one GPU (NCCL refuses two ranks on one
            device): only ``transport="kernels"`` serves it (gloo carries the buffer handles
            and the argument checks, the kernels the payload).

    Raises (on every rank alike: the ranks agree their arguments through torch.distributed's
    store before any process group is made, so a refusal leaves the world as it was and a later
    ``Buffer()`` with good arguments works; the message names the refusing rank and the field):
        ValueError: ranks_per_node does not divide the group size, unknown transport, bad
            num_sms/timeout_s/num_chunks, both num_sms and config, more ranks per node than
            transport="kernels" serves, a device that is neither CPU nor CUDA, an NCCL group
            with CPU tensors, a gloo group with CUDA tensors and a transport other than
            "kernels"; the ranks' resolved device, transport, ranks_per_node, num_chunks or
            (kernels) config differ.
        TypeError: group is not a ProcessGroup, config is not a Config (nor None or "auto").
        RuntimeError: transport="kernels" without the built extension; a CUDA device without a
            GPU.
        CommError: a rank did not construct its Buffer within ``timeout_s``.

    Collective: every rank of ``group`` must construct its Buffer together, and :meth:`close`
    it. A Buffer dropped without close() warns (ResourceWarning) and frees its threads, groups
    and store keys at the next ``Buffer()`` or ``close()`` of this process.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        ranks_per_node: int | None = None,
        transport: str = "auto",
        num_sms: int | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        config: Config | str | None = None,
        num_chunks: int | None = None,
        device: torch.device | str | None = None,
    ):
        if not dist.is_initialized():
            raise RuntimeError("moe_dispatch.Buffer needs torch.distributed: call dist.init_process_group first")
        # A group made without this process (new_group gives its non-members NON_GROUP_MEMBER): nothing to agree with.
        if group is dist.GroupMember.NON_GROUP_MEMBER or (
            isinstance(group, dist.ProcessGroup) and dist.get_rank(group) < 0
        ):
            raise ValueError(
                f"group does not contain this process (global rank {dist.get_rank()}): build a Buffer on the "
                "ranks of its group only"
            )
        release_dropped()
        # Agreed before any process group exists, so a refusal on any rank leaves the world as it was.
        args = agree_arguments(group, ranks_per_node, transport, num_sms, timeout_s, config, num_chunks, device)
        self.group, self.topology, self.device = args.group, args.topology, args.device
        self.transport_name, self.transport_reason = args.transport, args.transport_reason
        self.num_sms = args.config.num_sms if isinstance(args.config, Config) else None
        self.timeout_s = args.timeout_s
        self._uid = next(_BUFFER_IDS)
        control = ControlPlane(self.group, self.topology, self.timeout_s)
        options = TransportOptions(self.timeout_s, self.device, config=args.config, num_chunks=args.num_chunks)
        transport = transport_class(self.transport_name)(control, self.topology, options)
        self._transfers = Transfers(control, transport, self.topology, self.device)

    def close(self) -> None:
        """Waits for this Buffer's queued operations, then frees everything it made: its process
        groups, its communication and progress-writer threads, its store keys, and with
        ``transport="kernels"`` the kernels' communication buffers (shared memory on CPU).
        Collective: every rank of the group, after its last operation; a broken Buffer (see
        :meth:`dispatch`) frees what it made locally, without waiting for its peers.
        Idempotent; later calls raise RuntimeError.

        Raises:
            CommError: a peer did not reach close() within ``timeout_s`` (freed anyway).
        """
        with self._transfers.queue.entered("close", check=False):
            self._transfers.close()
        release_dropped()

    # -- properties ------------------------------------------------------------------------
    @property
    def transport(self) -> "Transport":
        """The transport object this Buffer moves data with (read-only): a
        :class:`~moe_dispatch.transport.torch_dist.TorchDistTransport` or a
        :class:`~moe_dispatch.transport.kernels.KernelTransport` (``transport_name`` says which)."""
        return self._transfers.transport

    @property
    def rank(self) -> int:
        """This rank's index in the EP group."""
        return self.topology.rank

    @property
    def world_size(self) -> int:
        """W, the EP group size."""
        return self.topology.world_size

    @property
    def num_nodes(self) -> int:
        """N = W / ranks_per_node."""
        return self.topology.num_nodes

    # -- layout ----------------------------------------------------------------------------
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int):
        """Which ranks and nodes receive each token. Local: no communication, no host sync on GPU.

        Args:
            topk_idx: ``[T, K]`` int32/int64 global expert ids, ``-1`` = no expert; no expert
                twice in a row.
            num_experts: E, divisible by the EP size; rank r owns experts ``[r*E/W, (r+1)*E/W)``.

        Returns:
            ``(num_tokens_per_rank [W], num_tokens_per_node [N], num_tokens_per_expert [E])``
            int64 and ``is_token_in_rank [T, W]`` bool, on topk_idx's device.

        Raises:
            ValueError/TypeError: bad topk_idx (shape, dtype, range, duplicates, device) or E.
        """
        check_topk_idx_cpu(topk_idx, num_experts, device=self.device)
        check_num_experts(num_experts, self.world_size)
        return self._layout(topk_idx, num_experts)

    def _layout(self, topk_idx: torch.Tensor, num_experts: int) -> tuple:
        """The layout of validated inputs: Triton kernels on CUDA, the torch reference's ops on CPU."""
        if topk_idx.is_cuda:
            return tuple(
                get_dispatch_layout(
                    topk_idx, num_experts, self.world_size, self.topology.ranks_per_node, validate=False
                )[:4]
            )
        return get_dispatch_layout_torch(topk_idx, num_experts, self.world_size, self.topology.ranks_per_node)

    def _is_token_in_rank(self, topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
        """``is_token_in_rank`` of validated inputs: all a dispatch needs of the layout (on CPU
        the counts would cost as much again)."""
        if topk_idx.is_cuda:
            return self._layout(topk_idx, num_experts)[3]
        return is_token_in_rank_cpu(topk_idx, num_experts, self.world_size)

    # -- dispatch / combine -----------------------------------------------------------------
    def dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        num_experts: int | None = None,
        *,
        handle: DispatchHandle | None = None,
        async_finish: bool = False,
        previous_event: EventOverlap | None = None,
        allocate_on_comm_stream: bool = False,
        return_recv_hook: bool = False,
        num_worst_tokens: int = 0,
        wgrad_store: "DelayedWgrad | None" = None,
        on_overflow: str = "raise",
        use_fp8: bool = False,
    ):
        """Sends each token to every rank owning one of its experts, exactly once per rank.

        Collective over the EP group. A fresh dispatch first exchanges the layout counts (a
        small collective the host waits for: receive sizes are host ints), then moves the
        payload; a cached dispatch (``handle=``) skips the counts. With ``num_worst_tokens``
        the outputs have a static size and the counts move with the payload, so the call
        waits for nothing (DeepEP's ``num_worst_tokens``). Differentiable w.r.t. ``x`` and
        ``topk_weights`` (backward is a combine, run synchronously).

        Args:
            x: ``[T, H]`` bf16/fp16/fp32, contiguous, on the Buffer's device; or the fp8 tuple
                ``(x_fp8 [T, H] float8_e4m3fn, scales [T, H/128] fp32)`` from
                ``moe_dispatch.ops.quant.per_token_cast_to_fp8`` (H a multiple of 128; not
                differentiable), which arrives as a tuple of the same form.
            topk_idx: ``[T, K]`` int32/int64 global expert ids, ``-1`` = no expert.
            topk_weights: ``[T, K]`` fp32 gate weights, or None.
            num_experts: E, divisible by W.
            handle: a previous dispatch's handle to replay its routing (cached dispatch);
                then pass only ``x`` (same T); ``recv_topk_idx``, ``recv_topk_weights`` and
                ``num_recv_tokens_per_expert`` come back as None (the handle has them).
            async_finish: return as soon as the payload is in flight, with an
                :class:`EventOverlap` that marks its completion: outputs are allocated but must
                not be read, nor the inputs modified, before ``event.current_stream_wait()``
                (CPU: the Buffer's communication thread moves the data, reading the inputs as
                it goes; CUDA: an event recorded after the work). Otherwise the call returns
                complete and the event is empty.
            previous_event: an event this call must wait for first (the host waits on CPU).
            allocate_on_comm_stream: on CUDA, allocate the outputs from the communication
                stream's memory pool (Megatron's knob); no effect on CPU.
            return_recv_hook: issue the operation's first collective and return a ``hook`` as
                a 7th value; calling ``hook()`` completes the rest. That collective is the
                inter-node stage of a sized dispatch; with ``num_worst_tokens`` it is the counts
                (on gloo a combine's or cached dispatch's is the argument check), so the payload
                itself may move only inside ``hook()``. Nothing is held in between (the
                communication thread is free). Outputs must not be read, nor the inputs
                modified, nor the handle used, before the hook ran. Excludes ``async_finish``.
            num_worst_tokens: 0 (default), or a static receive size, the same on every rank
                (compared like the other fields: a ValueError on every rank otherwise): the
                outputs get that many rows, of which the first ``handle.plan.num_recv_tokens``
                are received (the rest: ``recv_x`` 0, ``recv_topk_idx`` -1, ``recv_topk_weights``
                0), and no collective
                runs on the caller's thread: the counts are exchanged by the transfer itself
                (CPU: on the communication thread; with the torch_dist transport on CUDA the
                host still waits inside the call, as NCCL's splits are host ints). Argument
                mismatches across ranks and an overflow (more rows arrive than
                ``num_worst_tokens``) raise where the operation completes: the event, the hook,
                or the call itself when synchronous. ``T * W`` rows can never overflow. A
                combine then takes ``y`` with ``num_worst_tokens`` rows (the padding rows are
                ignored). Not with ``handle=``. With ``transport="kernels"`` the count stays on
                the device (``handle.recv_count``): nothing on the dispatch, the experts or the
                combine waits for the host, and the step can be captured in a CUDA graph, except
                what ``on_overflow="raise"`` reads; the topk_idx values are then checked on the
                device too (raised by :meth:`check_errors`).
            wgrad_store: a :class:`moe_dispatch.overlap.DelayedWgrad`; in this dispatch's
                backward the gradient combine is launched first and ``wgrad_store.backward_dw()``
                runs while it is in flight (delayed weight gradients of the experts).
            on_overflow: with ``num_worst_tokens``, what happens when more rows arrive:
                ``"raise"`` (default): ``BudgetOverflowError`` where the operation completes
                (reading the overflow flag on the host: a host sync where the kernels keep it
                on the device); ``"drop"``: the rows past ``num_worst_tokens`` (the last ones
                in receive order) are left out, their combine contributions are zero, and
                ``handle.overflow`` (``[1]`` bool on the device) says so, read by nobody but
                the caller (HybridEP's drop-and-flag).
            use_fp8: ``x`` (bf16/fp16/fp32, H a multiple of 128) travels as its fp8 pair
                (``moe_dispatch.ops.quant.per_token_cast_to_fp8``: e4m3 with one fp32 scale per
                1x128 block, H + H/32 bytes per row instead of 2H for bf16) and ``recv_x``
                comes back dequantized to x's dtype; differentiable, the gradient passing the
                quantization straight through (the backward combine moves it in its own dtype,
                as DeepEP's fp8 dispatch in training). The rows are dequantized on the caller's
                stream, so the call completes before it returns (CUDA: the current stream waits
                for the communication stream, the host does not), whatever ``async_finish`` says.
                Not with ``handle=``, ``return_recv_hook`` or an fp8 tuple ``x``.

        Returns:
            ``recv_x [R, H]`` (x's dtype, or the fp8 tuple), ``recv_topk_idx [R, K]`` (topk_idx's dtype, this
            rank's local expert ids in ``[0, E/W)``, -1 elsewhere), ``recv_topk_weights [R, K]``
            fp32 (0 where recv_topk_idx is -1; None without topk_weights),
            ``num_recv_tokens_per_expert [E/W]`` int64, ``handle``, ``event`` (and ``hook``
            with ``return_recv_hook``). Rows are ordered by source rank, then source token.

        Raises:
            ValueError/TypeError: bad shapes, dtypes, devices, ranges (``num_experts`` an int in
                ``[1, 2**20]``, bools refused as ints; topk_idx with no column; a ``num_worst_tokens``
                whose receive buffers would not fit the memory or could not be allocated); a foreign
                handle, or (cached) the handle of another dispatch than the peers'; async_finish with
                return_recv_hook; ranks that disagree on E, K, H, dtypes, whether topk_weights are
                given or num_worst_tokens (naming the ranks and the field). A bad argument on any
                rank costs its peers one small collective, not ``timeout_s``: that rank takes part
                in the call's check with a non-zero status and raises its own error, its peers a
                ValueError naming it and quoting its error (``moe_dispatch.control.agreement``); the
                Buffer stays usable.
            RuntimeError: the handle's dispatch was issued with ``return_recv_hook`` and its hook
                not called; another thread is inside this Buffer; the Buffer was closed.
            BudgetOverflowError: more rows arrived than ``num_worst_tokens`` (naming both counts),
                with ``on_overflow="raise"``.
            MismatchError (a ValueError): with the kernels, a peer's later call differed or was
                refused (compared on the device; see :meth:`check_errors` for where it is raised).
            CommError: a peer failed or did not join within ``timeout_s`` (naming the operation,
                and the rank that most likely died); the Buffer is then broken: every later call
                raises CommError at once, saying that a new Buffer is needed and why.
        """
        with self._transfers.queue.entered("dispatch"):
            self._check_hook(handle)
            try:
                mode = self._check_call(async_finish, return_recv_hook, previous_event)
                self._check_dispatch(x, topk_idx, topk_weights, num_experts, handle, num_worst_tokens, on_overflow)
                check_fp8_wire(x, use_fp8, self.rank, handle, return_recv_hook)
            except (TypeError, ValueError) as err:
                if handle is not None:
                    self._transfers.refuse(err, "dispatch", "cached dispatch")
                worst = _truthy(num_worst_tokens)  # the peers' exchange, as far as it can be told
                what = "dispatch (num_worst_tokens)" if worst else "dispatch (metadata)"
                self._transfers.refuse(err, what, what, refusing_fields(DISPATCH_FIELDS))
            call = self._launch("sync" if use_fp8 else mode, previous_event, allocate_on_comm_stream)
            call.wgrad_store = wgrad_store
            fp8 = isinstance(x, tuple)
            if handle is not None:
                if fp8:
                    recv_x = tuple(self._transfers.forward(handle.slot, list(x), call, "cached dispatch (fp8)"))
                else:
                    recv_x = autograd.ReplayDispatchFn.apply(self._transfers, handle.slot, call, x)
                return (recv_x, None, None, None, handle, *self._completion(call))
            wire = per_token_cast_to_fp8(x) if use_fp8 else None
            routing = self._fresh(
                call, x if wire is None else wire, topk_idx, topk_weights, num_experts, num_worst_tokens, on_overflow
            )
            if fp8:  # fp8 is a forward-only format: no autograd
                *recv_x, recv_weights = self._transfers.dispatch(call, list(x), topk_weights)
                recv_x = tuple(recv_x)
            else:
                recv_x, recv_weights = autograd.DispatchFn.apply(self._transfers, call, x, topk_weights, wire)
            return (
                recv_x,
                routing.recv_topk_idx,
                recv_weights,
                routing.num_recv_tokens_per_expert,
                self._handle(call),
                *self._completion(call),
            )

    def dispatch_to_experts(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor | None,
        num_experts: int,
        *,
        pad_multiple: int = 1,
        num_permuted_tokens: int | None = None,
        expert_capacity: int | None = None,
        num_worst_tokens: int = 0,
        on_overflow: str = "raise",
        use_fp8: bool = False,
        async_finish: bool = False,
        previous_event: EventOverlap | None = None,
        allocate_on_comm_stream: bool = False,
        wgrad_store: "DelayedWgrad | None" = None,
    ):
        """:meth:`dispatch` with the permute fused (HybridEP's layout): the received rows land
        in expert-major blocks for the grouped GEMM, straight from the receive buffer, as
        :func:`moe_dispatch.ops.permute.permute` of ``dispatch``'s outputs would lay them out
        (bit for bit). :meth:`combine` given this handle takes the expert outputs in that layout
        and sums each token's copies (in fp32, ascending expert) as it returns them.

        Collective over the EP group, as :meth:`dispatch` (a bad argument on one rank makes
        every rank raise). Differentiable w.r.t. ``x`` and ``topk_weights``.

        Args:
            x, topk_idx, topk_weights, num_experts: as in :meth:`dispatch` (``x`` one
                bf16/fp16/fp32 tensor: an fp8 pair is :meth:`dispatch`'s; see ``use_fp8``).
            pad_multiple: each local expert's block is padded with zero rows to a multiple of this.
            num_permuted_tokens: static P: the output has exactly P rows (no host wait on the
                receive side); copies beyond it are dropped and ``handle.permute.overflow`` set.
            expert_capacity: fixed blocks of exactly this many rows per local expert (P =
                E/W x expert_capacity; a multiple of ``pad_multiple``); excludes
                ``num_permuted_tokens``. Copies beyond a block are dropped and flagged.
            num_worst_tokens, on_overflow: a static receive, as in :meth:`dispatch` (rows past
                ``num_worst_tokens`` in receive order dropped or raised, ``handle.overflow``):
                the rows are received in receive order, then permuted on the caller's stream
                (:func:`moe_dispatch.ops.permute.permute`; later operations on the handle
                (un)permute around their transfers the same way, bit for bit the fused layout
                of the rows kept), and the call returns complete. With ``transport="kernels"``
                and a static P (``num_permuted_tokens`` or ``expert_capacity``) nothing on the
                dispatch, its combine or their backward passes waits for the host (the way to
                a CUDA graph); on other transports it only bounds the receive.
            use_fp8: ``x`` travels as fp8 and lands dequantized, as in :meth:`dispatch` (the
                pair is permuted, then dequantized: the same bits).
            async_finish, previous_event, allocate_on_comm_stream, wgrad_store: as in
                :meth:`dispatch`; without a static P, with ``num_worst_tokens`` or with
                ``use_fp8`` the call returns complete, whatever ``async_finish`` says.

        Returns:
            ``permuted_x [P, H]`` (x's dtype; zero padding rows), ``permuted_weights [P]`` fp32 (the
            weight of each row's copy, 0 on padding; None without topk_weights),
            ``tokens_per_expert [E/W]`` int64 (rows of each block: the grouped-GEMM split sizes),
            ``handle`` (``handle.permute``: the permute's
            :class:`~moe_dispatch.semantics.permute.PermuteHandle`, set once the operation
            completed), ``event``.

        Raises:
            ValueError/TypeError: as :meth:`dispatch`; bad pad_multiple, num_permuted_tokens or
                expert_capacity.
            BudgetOverflowError: as :meth:`dispatch` (``num_worst_tokens``, ``on_overflow="raise"``).
            RuntimeError, CommError: as :meth:`dispatch`.
        """
        with self._transfers.queue.entered("dispatch"):
            try:
                mode = self._check_call(async_finish, False, previous_event)
                with checking("x", self.rank):
                    if isinstance(x, tuple):
                        raise TypeError(
                            "dispatch_to_experts takes x as one bf16/fp16/fp32 tensor (use_fp8=True sends it as "
                            "fp8); dispatch an fp8 pair with dispatch()"
                        )
                self._check_dispatch(x, topk_idx, topk_weights, num_experts, None, num_worst_tokens, on_overflow)
                check_fp8_wire(x, use_fp8, self.rank)
                layout = (pad_multiple, num_permuted_tokens, expert_capacity)
                with checking("arguments", self.rank):  # the layout's arguments together
                    check_permute_args(topk_idx, num_experts // self.world_size, *layout)
            except (TypeError, ValueError) as err:
                what = "dispatch (num_worst_tokens)" if _truthy(num_worst_tokens) else "dispatch (metadata)"
                self._transfers.refuse(err, what, what, refusing_fields(DISPATCH_FIELDS))
            call = self._launch("sync" if use_fp8 else mode, previous_event, allocate_on_comm_stream)
            call.wgrad_store = wgrad_store
            wire = per_token_cast_to_fp8(x) if use_fp8 else None
            self._fresh(
                call,
                x if wire is None else wire,
                topk_idx,
                topk_weights,
                num_experts,
                num_worst_tokens,
                on_overflow,
                permute=layout,
            )
            permuted_x, permuted_weights = autograd.DispatchFn.apply(self._transfers, call, x, topk_weights, wire)
            sizes = call.dispatch.layout.tokens_per_expert
            return (permuted_x, permuted_weights, sizes, self._handle(call), *self._completion(call))

    def _fresh(
        self,
        call: Call,
        x,
        topk_idx,
        topk_weights,
        num_experts,
        num_worst_tokens: int,
        on_overflow="raise",
        permute=None,
    ):
        """Plans a fresh dispatch whose arguments were checked (unless ``num_worst_tokens``: the
        transfer does) and sets ``call.dispatch``; returns it. ``permute``: a fused permute's
        ``(pad_multiple, num_permuted_tokens, expert_capacity)``, or None."""
        num_tokens = (x[0] if isinstance(x, tuple) else x).shape[0]
        fields = dispatch_fields(x, topk_idx, topk_weights, num_experts, num_worst_tokens)
        layout = None
        if permute is not None:
            sizes = torch.empty(num_experts // self.world_size, dtype=torch.int64, device=self.device)
            layout = ExpertLayout(num_experts // self.world_size, *permute, tokens_per_expert=sizes)
        is_token_in_rank = self._is_token_in_rank(topk_idx, num_experts)  # inputs checked above, once
        if num_worst_tokens:  # the transfer exchanges the counts first (Transfers.dispatch)
            slot = PlanSlot(num_tokens, num_worst_tokens)
            recv_topk_idx = self._transfers.allocate_budget(
                lambda: topk_idx.new_empty((slot.num_rows, topk_idx.shape[1]))
            )
        else:
            xs = list(x) if isinstance(x, tuple) else [x]
            rows = [dense(t) for t in [*xs, topk_idx, *([topk_weights] if topk_weights is not None else [])]]
            plan = self._transfers.plan(call, is_token_in_rank, fields, topk_idx=topk_idx, rows=rows)
            slot = PlanSlot(num_tokens, plan.num_recv_tokens, plan)
            recv_topk_idx = topk_idx.new_empty((slot.num_rows, topk_idx.shape[1]))
        call.dispatch = FreshDispatch(
            slot=slot,
            fields=fields,
            is_token_in_rank=is_token_in_rank,
            topk_idx=topk_idx,
            num_experts=num_experts,
            recv_topk_idx=recv_topk_idx,
            num_recv_tokens_per_expert=torch.empty(
                num_experts // self.world_size, dtype=torch.int64, device=self.device
            ),
            on_overflow=on_overflow,
            layout=layout,
        )
        return call.dispatch

    def _handle(self, call: Call) -> DispatchHandle:
        routing = call.dispatch
        return DispatchHandle(
            buffer_id=self._uid,
            num_experts=routing.num_experts,
            recv_topk_idx=routing.recv_topk_idx,
            is_token_in_rank=routing.is_token_in_rank,
            slot=routing.slot,
            _hook=call.hook,
        )

    def _check_dispatch(self, x, topk_idx, topk_weights, num_experts, handle, num_worst_tokens, on_overflow) -> None:
        """This rank's dispatch arguments (nothing collective; in the sync-free mode the values
        of topk_idx are checked on the device: :meth:`check_errors`)."""
        with checking("num_worst_tokens", self.rank):
            if not is_int(num_worst_tokens) or num_worst_tokens < 0:
                raise ValueError(
                    f"num_worst_tokens must be an int >= 0 (0: size the outputs from the counts), got "
                    f"{num_worst_tokens!r}"
                )
        with checking("on_overflow", self.rank):
            if on_overflow not in ("raise", "drop"):
                raise ValueError(f"on_overflow must be 'raise' or 'drop', got {on_overflow!r}")
        if handle is not None:
            self._check_handle(handle)
            with checking("x", self.rank):
                check_x(x, self.device, handle.num_tokens, "handle (tokens dispatched)")
            with checking("arguments", self.rank):
                if topk_idx is not None or topk_weights is not None or num_worst_tokens:
                    raise ValueError(
                        "a cached dispatch (handle=...) replays the handle's routing and row count: "
                        "pass topk_idx=None, topk_weights=None and no num_worst_tokens"
                    )
            return
        with checking("x", self.rank):
            check_x(x, self.device)
        with checking("topk_weights", self.rank):
            if is_int(topk_weights) and num_experts is None:
                raise TypeError(
                    f"topk_weights got the int {topk_weights}: pass num_experts after topk_weights, "
                    "dispatch(x, topk_idx, topk_weights, num_experts), or num_experts=... by keyword"
                )
        with checking("arguments", self.rank):
            if topk_idx is None or num_experts is None:
                raise ValueError("dispatch needs topk_idx and num_experts (or handle= for a cached dispatch)")
        num_tokens = x[0].shape[0] if isinstance(x, tuple) else x.shape[0]
        sync_free = bool(num_worst_tokens) and self._transfers.sync_free
        with checking("num_experts", self.rank):  # first: topk_idx's range check assumes a valid E
            check_num_experts(num_experts, self.world_size)
        with checking("topk_idx", self.rank):
            check_topk_idx_cpu(topk_idx, num_experts, num_tokens=num_tokens, device=self.device, values=not sync_free)
            if topk_idx.shape[1] == 0:  # the kernels route by topk_idx's columns: refused on every transport alike
                raise ValueError(
                    f"topk_idx must have at least one column (top-k >= 1; -1 marks a slot with no expert), got "
                    f"shape [{num_tokens}, 0]"
                )
        if topk_weights is not None:
            with checking("topk_weights", self.rank):
                check_topk_weights(topk_weights, topk_idx, device=self.device)
        if num_worst_tokens:
            with checking("num_worst_tokens", self.rank):
                check_num_worst_tokens(num_worst_tokens, x, topk_idx, topk_weights, self.topology, self.device)
        if sync_free:
            self._transfers.check_topk_idx_on_device(topk_idx, num_experts)
        else:
            # A call that synchronises anyway: an earlier sync-free dispatch's bad topk_idx is
            # refused here, so the peers learn of it in this call's check instead of waiting.
            with checking("topk_idx", self.rank):
                self._transfers.raise_recorded_topk_idx()

    def combine(
        self,
        y: torch.Tensor,
        handle: DispatchHandle,
        topk_weights: torch.Tensor | None = None,
        *,
        async_finish: bool = False,
        previous_event: EventOverlap | None = None,
        allocate_on_comm_stream: bool = False,
        return_recv_hook: bool = False,
    ):
        """Sums each received row back onto its source token (the adjoint of dispatch).

        Collective over the EP group. Accumulates in fp32 in a fixed order (inside each node by
        ascending local rank, the node partial rounded to y's dtype, then by ascending node),
        so results are deterministic and equal ``moe_dispatch.reference.combine`` (the order is
        defined once, in ``moe_dispatch.semantics.summation``).
        Differentiable w.r.t. ``y`` and ``topk_weights`` (backward is a dispatch).

        Args:
            y: ``[R, H]`` bf16/fp16/fp32 rows in the handle's receive order; for a handle of
                :meth:`dispatch_to_experts`, ``[P, H]`` in its expert-major layout (each token then
                gets the fp32 sum of its copies, in ascending expert order, before the combine's sums).
            handle: from this Buffer's ``dispatch`` (its receive hook, if any, already called).
            topk_weights: None (unweighted sum, Megatron's contract), ``[R]`` fp32 row scales,
                or ``[R, K]`` fp32 (e.g. ``recv_topk_weights``), whose row sums scale the rows.
            async_finish, previous_event, allocate_on_comm_stream, return_recv_hook: as in
                :meth:`dispatch` (``y`` and ``topk_weights`` must stay unchanged until the
                event or the hook completes the operation).

        Returns:
            ``combined [T, H]`` in y's dtype (zero rows for tokens no rank held), ``event``
            (and ``hook`` with ``return_recv_hook``).

        Raises:
            ValueError/TypeError: shapes, dtypes, devices; a foreign handle, or the handle of
                another dispatch than the peers' (naming the dispatches and the ranks); as in
                :meth:`dispatch`, a bad argument on one rank makes every rank raise at once.
            RuntimeError: the handle's dispatch hook not called; another thread inside; closed.
            CommError: a peer failed or did not join within ``timeout_s``; the Buffer is broken.
        """
        with self._transfers.queue.entered("combine"):
            self._check_hook(handle)
            try:
                mode = self._check_call(async_finish, return_recv_hook, previous_event)
                row_scale = self._check_combine(y, handle, topk_weights)
            except (TypeError, ValueError) as err:
                self._transfers.refuse(err, "combine", "combine")
            call = self._launch(mode, previous_event, allocate_on_comm_stream)
            out = autograd.CombineFn.apply(self._transfers, handle.slot, call, y, row_scale)
            return (out, *self._completion(call))

    def _check_combine(self, y, handle, topk_weights) -> torch.Tensor | None:
        """This rank's combine arguments (nothing collective); returns the ``[R]`` row scales."""
        self._check_handle(handle)
        with checking("y", self.rank):
            if isinstance(y, tuple):
                raise TypeError(
                    "combine takes y as one bf16/fp16/fp32 tensor; fp8 (x_fp8, scales) is a dispatch-only "
                    "format (dequantize the expert output, or keep it in bf16)"
                )
            if handle.permute is not None:
                rows, what = handle.permute.num_rows, "handle (expert-major rows)"
            else:
                rows, what = handle.num_recv_tokens, "handle (tokens received)"
            check_hidden("y", y, self.device, num_rows=rows, rows_what=what)
        if topk_weights is None:
            return None
        with checking("topk_weights", self.rank):
            return self._row_scales(handle, topk_weights)

    def _row_scales(self, handle, topk_weights) -> torch.Tensor:
        """Combine's ``[R]`` row scales from ``topk_weights`` ``[R]`` or ``[R, K]`` fp32."""
        if handle.permute is not None:
            raise ValueError(
                "combine of a dispatch_to_experts handle sums the expert outputs unweighted (experts apply "
                "the permuted weights themselves): pass topk_weights=None"
            )
        if not isinstance(topk_weights, torch.Tensor) or topk_weights.dtype != torch.float32:
            got = (
                str(topk_weights.dtype).removeprefix("torch.")
                if isinstance(topk_weights, torch.Tensor)
                else type(topk_weights).__name__
            )
            raise TypeError(f"topk_weights must be an fp32 tensor, got {got}")
        rows, topk = handle.num_recv_tokens, handle.recv_topk_idx.shape[1]
        if (
            topk_weights.device != self.device
            or topk_weights.dim() not in (1, 2)
            or topk_weights.shape[0] != rows
            or (topk_weights.dim() == 2 and topk_weights.shape[1] != topk)
        ):
            raise ValueError(
                f"topk_weights must be [{rows}] or [{rows}, {topk}] on {self.device}, got "
                f"{list(topk_weights.shape)} on {topk_weights.device}"
            )
        return topk_weights if topk_weights.dim() == 1 else topk_weights.sum(1)

    def check_errors(self) -> None:
        """Waits for this Buffer's queued operations (a host synchronisation), then raises the
        first error recorded without one since the last check.

        What is recorded rather than raised at once, with ``transport="kernels"``: a kernel
        wait that ran out; a peer whose call differed from this rank's (the kernels compare
        the operation, the dispatch id the handle carries, row bytes, dtype, top-k, experts and
        SMs on the device; no rows moved between the two) or that refused its own arguments;
        and, in the sync-free budget mode (``num_worst_tokens``, see :meth:`dispatch`), topk_idx
        values out of ``[-1, num_experts)`` or naming an expert twice in a row. On a GPU they
        are raised here and at the next point that synchronises anyway (a dispatch without
        ``num_worst_tokens``, after its payload launch); on CPU tensors right after the
        operation. Collective: no; local to this rank.

        Raises:
            CommError: a kernel wait timed out (its message names the rank and what it waited
                for; the Buffer is then broken: make a new Buffer).
            MismatchError (a ValueError, ``moe_dispatch.transport.kernels.header``): a peer's call
                differed or was refused, naming the ranks, the field and both values (the
                buffers stay usable).
            ValueError: bad topk_idx values reached a sync-free dispatch.
        """
        with self._transfers.queue.entered("check_errors"):
            self._transfers.check_errors()

    # -- helpers ---------------------------------------------------------------------------
    def _check_handle(self, handle) -> None:
        if not isinstance(handle, DispatchHandle):
            raise ArgumentTypeError(
                f"handle must be a DispatchHandle returned by Buffer.dispatch, got {type(handle).__name__}",
                argument="handle",
                rank=self.rank,
            )
        if handle.buffer_id != self._uid:
            raise InvalidArgumentError(
                f"handle was made by another Buffer (id {handle.buffer_id}, this is {self._uid}); "
                "use it with the Buffer that dispatched",
                argument="handle",
                rank=self.rank,
            )

    @staticmethod
    def _check_hook(handle) -> None:
        """Raises (locally, at once) while the dispatch that made ``handle`` is still issued: its
        peers wait for this rank to complete it (``hook()``) before any later operation."""
        if isinstance(handle, DispatchHandle) and handle._hook is not None and not handle._hook.called:
            raise RuntimeError(
                "the dispatch that made this handle was issued with return_recv_hook=True and its "
                "hook() has not been called: call hook() before using the handle or its outputs"
            )

    def _check_call(self, async_finish: bool, return_recv_hook: bool, previous_event: EventOverlap | None) -> str:
        """The launch mode of an operation's per-call settings."""
        if async_finish and return_recv_hook:
            raise InvalidArgumentError(
                "async_finish=True and return_recv_hook=True exclude each other: the hook variant "
                "returns before the receive, the async variant completes it in the background",
                argument="async_finish",
                rank=self.rank,
            )
        if previous_event is not None and not isinstance(previous_event, EventOverlap):
            raise ArgumentTypeError(
                f"previous_event must be an EventOverlap returned by this package, got {type(previous_event).__name__}",
                argument="previous_event",
                rank=self.rank,
            )
        return "hook" if return_recv_hook else "async" if async_finish else "sync"

    @staticmethod
    def _launch(mode: str, previous_event: EventOverlap | None, allocate_on_comm_stream: bool) -> Call:
        """The per-call launch settings, passed through the autograd Functions, once
        ``previous_event`` completed."""
        if previous_event is not None:
            previous_event.current_stream_wait()
        return Call(mode=mode, allocate_on_comm_stream=allocate_on_comm_stream)

    @staticmethod
    def _completion(call: Call) -> tuple:
        """``(event,)``, or ``(event, hook)`` for the hook variant."""
        event = call.event if call.event is not None else EventOverlap()
        return (event, call.hook) if call.mode == "hook" else (event,)
