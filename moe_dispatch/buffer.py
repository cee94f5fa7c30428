"""``Buffer``: the one object users hold (DeepEP's shape): group, topology, transport, SM budget;
``get_dispatch_layout``, ``dispatch``, ``combine``."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import os
import re
import threading
import warnings
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, NoReturn

import torch
import torch.distributed as dist

from . import autograd
from .config import Config, check_config, num_sms_error
from .errors import BudgetOverflowError, CommError
from .ops.layout import check_topk_idx_cpu, get_dispatch_layout, is_token_in_rank_cpu, localize_topk_idx_cpu
from .ops.permute import check_permute_args, permute_map_cpu, permute_map_triton
from .ops.quant import check_fp8_pair
from .semantics.layout import get_dispatch_layout_torch
from .semantics.permute import PermuteHandle, gather_rows, permuted_sources, unpermute_plan
from .semantics.sums import ordered_sum
from .semantics.validation import (
    check_hidden,
    check_num_experts,
    check_timeout_s,
    check_topk_weights,
    dense,
    is_int,
)
from .topology import Topology
from .transport import TRANSPORT_ALIASES, TRANSPORTS, agreement, choose_transport, log_choice
from .transport.agreement import DispatchId, agree_in_store, refusing_fields
from .transport.base import (
    Call,
    ExpertLayout,
    Field,
    FreshDispatch,
    Plan,
    PlanSlot,
    Transport,
    drive,
    finish,
    start,
    stream_order_wait,
)
from .transport.kernels import KernelTransport
from .transport.kernels.header import FIELD_STATUS, STATUS_INVALID_ARGUMENTS, MismatchError, describe_mismatch
from .transport.torch_dist import TorchDistTransport

if TYPE_CHECKING:
    from .overlap import DelayedWgrad

_BUFFER_IDS = itertools.count()
# A fresh dispatch's fields, compared across ranks in its metadata exchange (in this order).
DISPATCH_FIELDS = (
    "num_experts",
    "top-k",
    "hidden",
    "x dtype",
    "fp8 x",
    "topk_idx dtype",
    "topk_weights given",
    "num_worst_tokens",
)
# Transports of Buffers dropped without close(), released at the next Buffer() or close() (where
# destroying process groups cannot cut into c10d's own bookkeeping, as a garbage collection could).
_DROPPED: list[Transport] = []


def _dropped(rank: int, comm: ThreadPoolExecutor, transport: Transport) -> None:
    """A Buffer's finalizer: warns, ends its communication thread, queues the rest."""
    warnings.warn(
        f"moe_dispatch.Buffer of EP rank {rank} was garbage-collected without close(): its process groups, "
        "threads and store keys are freed at the next Buffer() or close() of this process; call close() on "
        "every rank after the last operation",
        ResourceWarning,
        stacklevel=2,
    )
    comm.shutdown(wait=False)
    _DROPPED.append(transport)


def release_dropped() -> None:
    """Frees what Buffers dropped without close() made (local: no collective)."""
    while _DROPPED:
        _DROPPED.pop().release()


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


class EventOverlap:
    """Completion of an asynchronous operation (DeepEP's ``EventOverlap``).

    On GPU it holds a ``torch.cuda.Event`` recorded after the operation; on CPU a future of the
    Buffer's communication thread. ``EventOverlap()`` (neither) is an operation that already
    completed.
    """

    def __init__(self, event: "torch.cuda.Event | None" = None, future: "Future | None" = None):
        self.event, self.future = event, future

    def current_stream_wait(self) -> None:
        """Orders the caller after the operation: the current CUDA stream waits for the event
        (no host synchronisation); on CPU the host waits for the communication thread.

        Raises:
            CommError: the operation failed or timed out (CPU; raised here, where it is awaited).
        """
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)
        if self.future is not None:
            stream_order_wait(self.future)

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, *exc) -> None:
        self.current_stream_wait()


def default_ranks_per_node(group: dist.ProcessGroup) -> int:
    """EP ranks per node of ``group``, from where its ranks run.

    The node size is ``LOCAL_WORLD_SIZE`` (torchrun), else the visible GPU count; the group's
    global ranks are mapped to nodes of that size and must sit in equal contiguous runs (a
    Megatron EP group, strided by TP x CP, does on homogeneous nodes): the run length is the
    answer. Without a known node size, or with uneven runs, the group is one "node" (a flat
    exchange, still exact), with a warning in the latter case saying how to set it.
    """
    world_size = dist.get_world_size(group)
    local = os.environ.get("LOCAL_WORLD_SIZE")
    node_size = int(local) if local is not None and local.isdigit() and int(local) > 0 else None
    if node_size is None and torch.cuda.is_available() and torch.cuda.device_count() > 0:
        node_size = torch.cuda.device_count()
    if node_size is None:
        return world_size
    nodes = [r // node_size for r in dist.get_process_group_ranks(group)]
    runs = [len(list(run)) for _, run in itertools.groupby(nodes)]
    if len(runs) == len(set(nodes)) and len(set(runs)) == 1:
        return runs[0]
    warnings.warn(
        f"the EP group's ranks sit on nodes {nodes} (node size {node_size}), not as equal contiguous runs: "
        "moe_dispatch treats the group as one node (exact, but no inter-node de-duplication); pass "
        "ranks_per_node= to set the hierarchy",
        stacklevel=3,
    )
    return world_size


DEFAULT_TIMEOUT_S = 300.0


def _buffer_device(device: torch.device | str | None, backend: str) -> torch.device:
    """The device of a Buffer on a group of ``backend`` (see ``Buffer(device=...)``)."""
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device must be None, 'cpu' or a CUDA device, got {device!r}") from err
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be None, 'cpu' or a CUDA device, got {str(device)!r}")
    if device.type == "cpu":
        if "nccl" in backend:
            raise ValueError(
                "device='cpu' with an NCCL group: NCCL moves CUDA tensors only; use a gloo group for "
                "CPU tensors, or device=None for the current CUDA device"
            )
        return device
    if not torch.cuda.is_available():
        raise RuntimeError(f"device={str(device)!r} but torch sees no CUDA GPU")
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def _resolve_arguments(
    group, ranks_per_node, transport, num_sms, timeout_s, config, num_chunks, device=None
) -> tuple[dict, dict | None]:
    """``Buffer()``'s arguments checked and resolved on this rank (nothing collective).

    Returns:
        ``(args, None)``: the resolved arguments, ``args["posted"]`` what the ranks compare; or
        ``(args, refused)`` with ``refused = {"field", "type", "message"}`` for the first bad
        argument (``args`` then holds what is needed to agree: the group, the timeout).
    """
    args = {"group": dist.group.WORLD, "timeout_s": DEFAULT_TIMEOUT_S}
    field = "group"
    try:
        if group is not None and not isinstance(group, dist.ProcessGroup):
            # Agreed over the world: peers that pass None learn of it at once.
            raise TypeError(
                f"group must be a torch.distributed ProcessGroup or None (the world), got {type(group).__name__}"
            )
        args["group"] = group = group if group is not None else dist.group.WORLD
        field = "timeout_s"
        args["timeout_s"] = check_timeout_s(timeout_s)
        field = "ranks_per_node"
        given_ranks_per_node = ranks_per_node
        if ranks_per_node is None:
            ranks_per_node = default_ranks_per_node(group)
        if not is_int(ranks_per_node) or ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be a positive int, got {ranks_per_node!r}")
        topology = Topology(dist.get_rank(group), dist.get_world_size(group), ranks_per_node)
        field = "transport"
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        transport = TRANSPORT_ALIASES.get(transport, transport)
        field = "num_sms"
        if num_sms is not None and (error := num_sms_error(num_sms)) is not None:
            raise ValueError(f"num_sms {error}, or None for the default")
        field = "config"
        if isinstance(config, str) and config != "auto":
            raise ValueError(f"config must be a moe_dispatch.config.Config, None or 'auto', got {config!r}")
        if config != "auto":
            check_config(config)
        if config is not None:
            if num_sms is not None:
                budget = "'auto'" if config == "auto" else f"(num_sms={config.num_sms})"
                raise ValueError(f"num_sms={num_sms} and config {budget} both set the SM budget: pass one")
        elif num_sms is not None:
            config = Config(num_sms=num_sms)
        field = "num_chunks"
        if num_chunks is not None and (not is_int(num_chunks) or num_chunks < 1):
            raise ValueError(
                f"num_chunks must be a positive int (the torch_dist pipeline depth: chunks per dispatch "
                f"and combine) or None for the default, got {num_chunks!r}"
            )
        field = "device"
        backend = str(dist.get_backend(group))
        device = _buffer_device(device, backend)
        field = "transport"
        reason = "requested"
        if transport == "auto":
            transport, reason = choose_transport(device)
            log_choice(transport, reason)
        if device.type == "cuda" and "nccl" not in backend and transport != "kernels":
            raise ValueError(
                f"device={str(device)!r} with a {backend} group needs transport='kernels' (the kernels move "
                f"the CUDA tensors, {backend} carries only their buffer handles and checks); transport="
                f"{transport!r} ({reason}) would run its collectives on {backend}, which cannot move CUDA tensors"
            )
        if transport == "kernels":
            # "auto" is resolved at the first dispatch, within what the default Config allows
            KernelTransport.check(topology, Config() if config is None or config == "auto" else config)
            num_chunks = None
    except (TypeError, ValueError, RuntimeError) as err:
        args["error"] = err
        return args, {"field": field, "type": type(err).__name__, "message": str(err)}
    args.update(
        topology=topology,
        transport=transport,
        transport_reason=reason,
        device=device,
        config=config,
        num_chunks=num_chunks,
        given_ranks_per_node=given_ranks_per_node,
        posted={
            "device": device.type,
            "transport": transport,
            "ranks_per_node": ranks_per_node,
            "num_chunks": num_chunks,
            **(_posted_config(config) if transport == "kernels" else {"config": None}),
        },
    )
    return args, None


def _posted_config(config: Config | str | None) -> dict:
    """What the ranks compare of the kernels' Config (None: the default): each field by name (a
    difference is named as ``config.num_sms``, not as two whole reprs), or ``"auto"``."""
    if config == "auto":
        return {"config": "auto"}
    config = config or Config()
    return {"config": "Config", **{f"config.{f.name}": getattr(config, f.name) for f in dataclasses.fields(config)}}


# c10d names a group made with use_local_synchronization (as the transports make theirs) after its
# ranks and a count of the groups this process has made: members whose counts differ (one made a
# Buffer on a group the others are not in) would name the same group differently and deadlock in
# new_group. The ranks post their counts and all continue from the largest.
_GROUP_COUNT = "c10d group count"


def _c10d_group_count() -> int | None:
    return getattr(getattr(dist.distributed_c10d, "_world", None), "group_count", None)


def _align_group_count(count: int | None) -> None:
    if count is not None and _c10d_group_count() is not None:
        dist.distributed_c10d._world.group_count = count


_ERROR_TYPES = {t.__name__: t for t in (TypeError, ValueError, RuntimeError)}
_UNCHANGED = "no rank created anything, so a Buffer() with good arguments can follow"


def _check_posts(posts: list[dict], rank: int, args: dict) -> None:
    """Raises, on every rank alike, when a rank refused its arguments (the first such rank's
    error, of its type) or the ranks' resolved arguments differ (ValueError)."""
    bad = [(r, post["error"]) for r, post in enumerate(posts) if "error" in post]
    if bad:
        first, error = bad[0]
        others = f" (EP ranks {[r for r, _ in bad[1:]]} refused theirs too)" if len(bad) > 1 else ""
        raise _ERROR_TYPES.get(error["type"], ValueError)(
            f"EP rank {rank}: Buffer() refused by EP rank {first}{others}: {error['field']}: {error['message']}; "
            f"{_UNCHANGED}"
        ) from args.get("error")
    mine = args["posted"]
    for field, value in mine.items():
        differ = [(r, post.get(field)) for r, post in enumerate(posts) if post.get(field) != value]
        if differ:
            theirs = ", ".join(f"{v!r} on EP rank {r}" for r, v in differ)
            resolved = (
                " (resolved from LOCAL_WORLD_SIZE or the GPU count where not given)"
                if field == "ranks_per_node" and args["given_ranks_per_node"] is None
                else ""
            )
            raise ValueError(
                f"EP rank {rank}: Buffer() arguments differ across ranks: {field} is {value!r} here{resolved} but "
                f"{theirs}; every rank must pass the same ({_UNCHANGED})"
            )


class Buffer:
    """Hierarchical expert-parallel dispatch/combine for one EP group.

    Args:
        group: the EP process group (default: the world group). gloo groups use CPU tensors,
            NCCL groups CUDA tensors of the current device.
        ranks_per_node: L, ranks sharing a node (NVLink domain); must divide the group size.
            Default: :func:`default_ranks_per_node` (where the group's ranks run, from
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
        args, refused = _resolve_arguments(
            group, ranks_per_node, transport, num_sms, timeout_s, config, num_chunks, device
        )
        # Agreed before any process group exists, so a refusal on any rank leaves the world as it was.
        posts = agree_in_store(
            dist.get_process_group_ranks(args["group"]),
            dist.get_rank(args["group"]),
            {**(args["posted"] if refused is None else {"error": refused}), _GROUP_COUNT: _c10d_group_count()},
            args["timeout_s"],
        )
        _check_posts(posts, dist.get_rank(args["group"]), args)
        _align_group_count(max((p[_GROUP_COUNT] for p in posts if p[_GROUP_COUNT] is not None), default=None))
        self.group, self.topology, self.device = args["group"], args["topology"], args["device"]
        self.transport_name, self.transport_reason = args["transport"], args["transport_reason"]
        self.num_sms = args["config"].num_sms if isinstance(args["config"], Config) else None
        self.timeout_s = args["timeout_s"]
        self._uid = next(_BUFFER_IDS)
        if self.transport_name == "kernels":
            chosen: Transport = KernelTransport(
                self.group, self.topology, self.timeout_s, args["config"] or Config(), self.device
            )
        else:
            chosen = TorchDistTransport(self.group, self.topology, self.timeout_s, num_chunks=args["num_chunks"])
        self._transfers = Transfers(chosen, self.topology, self.device)

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
        with self._transfers.entered("close", check=False):
            self._transfers.close()
        release_dropped()

    # -- properties ------------------------------------------------------------------------
    @property
    def transport(self) -> Transport:
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

        Returns:
            ``recv_x [R, H]`` (x's dtype, or the fp8 tuple), ``recv_topk_idx [R, K]`` (topk_idx's dtype, this
            rank's local expert ids in ``[0, E/W)``, -1 elsewhere), ``recv_topk_weights [R, K]``
            fp32 (0 where recv_topk_idx is -1; None without topk_weights),
            ``num_recv_tokens_per_expert [E/W]`` int64, ``handle``, ``event`` (and ``hook``
            with ``return_recv_hook``). Rows are ordered by source rank, then source token.

        Raises:
            ValueError/TypeError: bad shapes, dtypes, devices, ranges (``num_experts`` an int in
                ``[1, 2**20]``, bools refused as ints); a foreign handle, or (cached) the handle of
                another dispatch than the peers'; async_finish with return_recv_hook; ranks that
                disagree on E, K, H, dtypes, whether topk_weights are given or num_worst_tokens
                (naming the ranks and the field). A bad argument on any rank costs its peers one
                small collective, not ``timeout_s``: that rank takes part in the call's check with
                a non-zero status and raises its own error, its peers a ValueError naming it and
                quoting its error (``moe_dispatch.transport.agreement``); the Buffer stays usable.
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
        with self._transfers.entered("dispatch"):
            self._check_hook(handle)
            try:
                mode = self._check_call(async_finish, return_recv_hook, previous_event)
                self._check_dispatch(x, topk_idx, topk_weights, num_experts, handle, num_worst_tokens, on_overflow)
            except (TypeError, ValueError) as err:
                if handle is not None:
                    self._transfers.refuse(err, "dispatch", "cached dispatch")
                worst = _truthy(num_worst_tokens)  # the peers' exchange, as far as it can be told
                what = "dispatch (num_worst_tokens)" if worst else "dispatch (metadata)"
                self._transfers.refuse(err, what, what, refusing_fields(DISPATCH_FIELDS))
            call = self._launch(mode, previous_event, allocate_on_comm_stream)
            call.wgrad_store = wgrad_store
            fp8 = isinstance(x, tuple)
            if handle is not None:
                if fp8:
                    recv_x = tuple(self._transfers.forward(handle.slot, list(x), call, "cached dispatch (fp8)"))
                else:
                    recv_x = autograd.ReplayDispatchFn.apply(self._transfers, handle.slot, call, x)
                return (recv_x, None, None, None, handle, *self._completion(call))
            routing = self._fresh(call, x, topk_idx, topk_weights, num_experts, num_worst_tokens, on_overflow)
            if fp8:  # fp8 is a forward-only format: no autograd
                *recv_x, recv_weights = self._transfers.dispatch(call, list(x), topk_weights)
                recv_x = tuple(recv_x)
            else:
                recv_x, recv_weights = autograd.DispatchFn.apply(self._transfers, call, x, topk_weights)
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
                bf16/fp16/fp32 tensor; fp8 is not fused).
            pad_multiple: each local expert's block is padded with zero rows to a multiple of this.
            num_permuted_tokens: static P: the output has exactly P rows (no host wait on the
                receive side); copies beyond it are dropped and ``handle.permute.overflow`` set.
            expert_capacity: fixed blocks of exactly this many rows per local expert (P =
                E/W x expert_capacity; a multiple of ``pad_multiple``); excludes
                ``num_permuted_tokens``. Copies beyond a block are dropped and flagged.
            async_finish, previous_event, allocate_on_comm_stream, wgrad_store: as in
                :meth:`dispatch`; without a static P the call returns complete (the output size
                follows the received ids), whatever ``async_finish`` says.

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
            RuntimeError, CommError: as :meth:`dispatch`.
        """
        with self._transfers.entered("dispatch"):
            try:
                mode = self._check_call(async_finish, False, previous_event)
                if isinstance(x, tuple):
                    raise TypeError(
                        "dispatch_to_experts takes x as one bf16/fp16/fp32 tensor; dispatch fp8 with dispatch()"
                    )
                self._check_dispatch(x, topk_idx, topk_weights, num_experts, None, 0, "raise")
                layout = (pad_multiple, num_permuted_tokens, expert_capacity)
                check_permute_args(topk_idx, num_experts // self.world_size, *layout)
            except (TypeError, ValueError) as err:
                what = "dispatch (metadata)"
                self._transfers.refuse(err, what, what, refusing_fields(DISPATCH_FIELDS))
            call = self._launch(mode, previous_event, allocate_on_comm_stream)
            call.wgrad_store = wgrad_store
            self._fresh(call, x, topk_idx, topk_weights, num_experts, 0, permute=layout)
            permuted_x, permuted_weights = autograd.DispatchFn.apply(self._transfers, call, x, topk_weights)
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
        fields = _dispatch_fields(x, topk_idx, topk_weights, num_experts, num_worst_tokens)
        layout = None
        if permute is not None:
            sizes = torch.empty(num_experts // self.world_size, dtype=torch.int64, device=self.device)
            layout = ExpertLayout(num_experts // self.world_size, *permute, tokens_per_expert=sizes)
        is_token_in_rank = self._is_token_in_rank(topk_idx, num_experts)  # inputs checked above, once
        if num_worst_tokens:  # the transfer exchanges the counts first (Transfers.dispatch)
            slot = PlanSlot(num_tokens, num_worst_tokens)
        else:
            xs = list(x) if isinstance(x, tuple) else [x]
            rows = [dense(t) for t in [*xs, topk_idx, *([topk_weights] if topk_weights is not None else [])]]
            plan = self._transfers.plan(call, is_token_in_rank, fields, topk_idx=topk_idx, rows=rows)
            slot = PlanSlot(num_tokens, plan.num_recv_tokens, plan)
        call.dispatch = FreshDispatch(
            slot=slot,
            fields=fields,
            is_token_in_rank=is_token_in_rank,
            topk_idx=topk_idx,
            num_experts=num_experts,
            recv_topk_idx=topk_idx.new_empty((slot.num_rows, topk_idx.shape[1])),
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
        if not is_int(num_worst_tokens) or num_worst_tokens < 0:
            raise ValueError(
                f"num_worst_tokens must be an int >= 0 (0: size the outputs from the counts), got {num_worst_tokens!r}"
            )
        if on_overflow not in ("raise", "drop"):
            raise ValueError(f"on_overflow must be 'raise' or 'drop', got {on_overflow!r}")
        if handle is not None:
            self._check_handle(handle)
            self._check_x(x, handle.num_tokens, "handle (tokens dispatched)")
            if topk_idx is not None or topk_weights is not None or num_worst_tokens:
                raise ValueError(
                    "a cached dispatch (handle=...) replays the handle's routing and row count: "
                    "pass topk_idx=None, topk_weights=None and no num_worst_tokens"
                )
            return
        self._check_x(x)
        if is_int(topk_weights) and num_experts is None:
            raise TypeError(
                f"topk_weights got the int {topk_weights}: pass num_experts after topk_weights, "
                "dispatch(x, topk_idx, topk_weights, num_experts), or num_experts=... by keyword"
            )
        if topk_idx is None or num_experts is None:
            raise ValueError("dispatch needs topk_idx and num_experts (or handle= for a cached dispatch)")
        num_tokens = x[0].shape[0] if isinstance(x, tuple) else x.shape[0]
        sync_free = bool(num_worst_tokens) and self._transfers.sync_free
        check_num_experts(num_experts, self.world_size)  # first: topk_idx's range check assumes a valid E
        check_topk_idx_cpu(topk_idx, num_experts, num_tokens=num_tokens, device=self.device, values=not sync_free)
        if topk_weights is not None:
            check_topk_weights(topk_weights, topk_idx, device=self.device)
        if sync_free:
            self._transfers.check_topk_idx_on_device(topk_idx, num_experts)
        else:
            # A call that synchronises anyway: an earlier sync-free dispatch's bad topk_idx is
            # refused here, so the peers learn of it in this call's check instead of waiting.
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
        so results are deterministic and equal ``moe_dispatch.reference.combine``.
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
        with self._transfers.entered("combine"):
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
        if isinstance(y, tuple):
            raise TypeError(
                "combine takes y as one bf16/fp16/fp32 tensor; fp8 (x_fp8, scales) is a dispatch-only "
                "format (dequantize the expert output, or keep it in bf16)"
            )
        if handle.permute is not None:
            check_hidden("y", y, self.device, num_rows=handle.permute.num_rows, rows_what="handle (expert-major rows)")
            if topk_weights is not None:
                raise ValueError(
                    "combine of a dispatch_to_experts handle sums the expert outputs unweighted (experts apply "
                    "the permuted weights themselves): pass topk_weights=None"
                )
            return None
        check_hidden("y", y, self.device, num_rows=handle.num_recv_tokens, rows_what="handle (tokens received)")
        if topk_weights is None:
            return None
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
        with self._transfers.entered("check_errors"):
            self._transfers.check_errors()

    # -- helpers ---------------------------------------------------------------------------
    def _check_handle(self, handle) -> None:
        if not isinstance(handle, DispatchHandle):
            raise TypeError(f"handle must be a DispatchHandle returned by Buffer.dispatch, got {type(handle).__name__}")
        if handle.buffer_id != self._uid:
            raise ValueError(
                f"handle was made by another Buffer (id {handle.buffer_id}, this is {self._uid}); "
                "use it with the Buffer that dispatched"
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

    @staticmethod
    def _check_call(async_finish: bool, return_recv_hook: bool, previous_event: EventOverlap | None) -> str:
        """The launch mode of an operation's per-call settings."""
        if async_finish and return_recv_hook:
            raise ValueError(
                "async_finish=True and return_recv_hook=True exclude each other: the hook variant "
                "returns before the receive, the async variant completes it in the background"
            )
        if previous_event is not None and not isinstance(previous_event, EventOverlap):
            raise TypeError(
                f"previous_event must be an EventOverlap returned by this package, got {type(previous_event).__name__}"
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

    def _check_x(self, x, num_tokens: int | None = None, rows_what: str = "topk_idx") -> None:
        if isinstance(x, list):
            raise TypeError(f"x is a list of {len(x)}: pass the fp8 pair as the tuple (x_fp8, scales)")
        if isinstance(x, tuple):
            if len(x) != 2:
                raise ValueError(f"an fp8 x must be the tuple (x_fp8, scales), got a tuple of {len(x)}")
            check_fp8_pair(*x, num_tokens=num_tokens, device=self.device)
        else:
            check_hidden("x", x, self.device, num_rows=num_tokens, rows_what=rows_what)


def _dispatch_fields(
    x, topk_idx: torch.Tensor, topk_weights, num_experts: int, num_worst_tokens: int
) -> dict[str, Field]:
    """A fresh dispatch's fields (:data:`DISPATCH_FIELDS`), as every rank compares them."""
    fp8 = isinstance(x, tuple)
    x0 = x[0] if fp8 else x
    return dict(
        zip(
            DISPATCH_FIELDS,
            (
                num_experts,
                topk_idx.shape[1],
                x0.shape[1],
                x0.dtype,
                fp8,
                topk_idx.dtype,
                topk_weights is not None,
                num_worst_tokens,
            ),
        )
    )


def _row_fields(operation: str, tensors: list[torch.Tensor], num_scales: int) -> dict[str, Field]:
    """The fields of an operation that exchanges no sizes (combine, cached dispatch), without
    the handle's dispatch id."""
    t = tensors[0]
    return {
        "operation": operation,
        "hidden": math.prod(t.shape[1:]),
        "dtype": t.dtype,
        "tensors": len(tensors),
        "row scales": num_scales,
    }


def _steps_calling(fn, *args):
    """Steps that call ``fn(*args)`` when driven (on the communication thread/stream) and wait
    for nothing."""
    yield from ()
    fn(*args)


# The checked fields the kernels' operation header compares in every launch (transport/kernels/header.py),
# by operation: the fresh dispatch's notify header carries its exact row bytes, dtype, top-k,
# experts, weights flag and num_worst_tokens; a combine's or cached dispatch's its handle, the
# caller's row bytes and dtype. topk_idx's dtype only names the received ids' dtype on each rank.
_HEADER_FIELDS = {
    "dispatch (metadata)": frozenset(DISPATCH_FIELDS),
    "dispatch": frozenset({"handle", "hidden", "dtype"}),
    "combine": frozenset({"handle", "hidden", "dtype"}),
}


def _signature_key(fields: dict[str, Field]) -> tuple:
    """A call signature: its checked fields but those the kernels' header compares in every
    launch (:data:`_HEADER_FIELDS`). Whether a signature is new must not depend on such a value:
    ranks that disagree on one would otherwise split, some into the host check of a new
    signature, the others into the kernels of one they have seen, and wait for each other until
    ``timeout_s`` instead of comparing headers."""
    carried = _HEADER_FIELDS.get(fields["operation"], frozenset())
    return tuple((name, value) for name, value in fields.items() if name not in carried)


class Transfers:
    """The data movement of one Buffer: what the Buffer's entry points and the autograd
    Functions (:mod:`moe_dispatch.autograd`) call to move rows.

    Every transfer runs in one ordered queue per Buffer, so asynchronous calls overlap the
    caller's compute and a Buffer's collectives never interleave: a high-priority CUDA stream
    (CUDA tensors) or one thread (CPU), the communication stream/thread. :meth:`dispatch`,
    :meth:`forward` and :meth:`combine` allocate their outputs, queue the transport's steps and
    return the outputs, launched as their :class:`~moe_dispatch.transport.base.Call` says:
    ``"sync"`` returns complete, ``"async"`` sets ``call.event``, ``"hook"`` issues the first
    collective and sets ``call.hook``. Each is collective over the EP group. On CPU a
    synchronous transfer with nothing queued before it runs on the caller's thread: the same
    order, without handing it to the communication thread and back.

    States: open; broken after an operation failed halfway (a CommError, or any error but the
    agreement's ValueError/TypeError and an overflow), when every later call raises CommError
    at once; closed. One thread at a time may be inside the Buffer (:meth:`entered`).

    Argument checks across ranks: a transport whose operations exchange their sizes (torch_dist)
    compares the arguments of every operation. The kernels compare them on the device in every
    launch (their operation header, ``transport.device_checks``); then the host compares them
    only the first time a call signature appears on this Buffer, where a signature leaves out
    the fields the header compares (:func:`_signature_key`): in practice the first fresh
    dispatch, the first combine and the first cached dispatch, and every rank takes part in that
    check. A later call that differs on one rank only (a dtype, hidden, top-k, experts, weights
    or num_worst_tokens) therefore meets its peers in the kernels, which tell them apart; one
    that needs larger buffers joins with status "grow" first (``transport._sized``), so every
    rank raises MismatchError at once unless every rank grows. A rank refusing its own
    arguments (:meth:`refuse`) joins the host check while no call of that kind has passed one,
    the kernels after that. What that leaves: calls that differ in what the header does not
    carry (the number of row tensors of a combine or cached dispatch, its fp8 scales), and a
    rank in a combine while its peers start a fresh dispatch: such ranks wait for each other
    in different places and end in a CommError naming the other within ``timeout_s`` (no
    hang), instead of recording a mismatch.

    Args:
        transport: the Buffer's transport.
        topology: this rank's place in the EP group.
        device: the Buffer's device (CUDA: the communication stream lives there).
    """

    def __init__(self, transport: Transport, topology: Topology, device: torch.device):
        self.transport, self.topology, self.device = transport, topology, device
        self._seq = 0  # operations issued, the same count on every rank (they are collective)
        self._comm = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"moe_dispatch-comm-{topology.rank}")
        self._comm_stream = torch.cuda.Stream(device, priority=-1) if device.type == "cuda" else None
        self._closed = False
        self._signatures: set[tuple] = set()  # call signatures checked across ranks on the host
        # Sync-free dispatches' topk_idx checked on the device: set when one had bad values.
        self._bad_topk_idx = torch.zeros((), dtype=torch.bool, device=device)
        self._topk_idx_unread = False  # whether _bad_topk_idx may be set (a sync-free dispatch since)
        self._broken: str | None = None  # why, once an operation failed halfway
        self._guard = threading.Lock()
        self._owner: tuple[int, str, str] | None = None  # (thread id, thread name, entry point) inside
        self._depth = 0
        self._queued = 0  # CPU: operations submitted to the communication thread and not done yet
        self._queued_lock = threading.Lock()
        # Dropped without close(): warn, and free what needs no peer at the next safe point.
        self._finalizer = weakref.finalize(self, _dropped, topology.rank, self._comm, transport)
        self._finalizer.atexit = False

    @property
    def sync_free(self) -> bool:
        """Whether a ``num_worst_tokens`` dispatch runs without any host synchronisation: the
        transport keeps the counts on the device and checks the ranks' arguments there."""
        t = self.transport
        return bool(getattr(t, "budget_on_device", False) and getattr(t, "device_checks", False))

    def check_topk_idx_on_device(self, topk_idx: torch.Tensor, num_experts: int) -> None:
        """Records, on the device, whether ``topk_idx [T, K]`` has entries outside
        ``[-1, num_experts)`` or an expert twice in a row (what ``check_topk_idx`` checks on the
        host); :meth:`check_errors` raises it. Static-size device ops only (CUDA-graph safe)."""
        bad = ((topk_idx < -1) | (topk_idx >= num_experts)).any()
        if topk_idx.shape[1] > 1:
            s = topk_idx.sort(dim=1).values
            bad = bad | ((s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)).any()
        self._bad_topk_idx |= bad
        self._topk_idx_unread = True

    def raise_recorded_topk_idx(self) -> None:
        """Raises (once) the ValueError :meth:`check_topk_idx_on_device` recorded since the last
        read; a host read of the flag, made only after a sync-free dispatch.

        Raises:
            ValueError: a sync-free dispatch since the last check had bad topk_idx entries.
        """
        if not self._topk_idx_unread:
            return
        self._topk_idx_unread = False
        if bool(self._bad_topk_idx):
            self._bad_topk_idx.zero_()
            raise ValueError(
                f"EP rank {self.topology.rank}: a num_worst_tokens dispatch since the last check had topk_idx "
                "entries outside [-1, num_experts) or an expert twice in a row (checked on the device in the "
                "sync-free mode; its rows went only to the experts its valid ids name)"
            )

    def check_errors(self) -> None:
        """Waits for the queued operations (a host synchronisation), then raises what was
        recorded on the device (see ``Buffer.check_errors``)."""
        self.check_open()
        if self._comm_stream is not None:
            self._comm_stream.synchronize()
        else:
            self._comm.submit(lambda: None).result()  # the communication thread's queue is drained
        self._guarded(self._raise_recorded)

    def _raise_recorded(self) -> None:
        """Raises what the device recorded; the caller has synchronised with the operations."""
        check = getattr(self.transport, "check_errors", None)
        if check is not None:
            check()
        self.raise_recorded_topk_idx()

    def check_open(self) -> None:
        """Raises RuntimeError once the Buffer was closed, CommError once it is broken."""
        if self._closed:
            raise RuntimeError(f"EP rank {self.topology.rank}: this Buffer was closed; make a new one")
        if self._broken is not None:
            raise CommError(self._broken)

    @contextlib.contextmanager
    def entered(self, what: str, check: bool = True):
        """Marks the calling thread as inside the Buffer for ``what`` (re-entrant): a Buffer's
        operations are collective and ordered, so a second thread at the same time gets a
        RuntimeError at once (its peers' collectives would interleave differently), and the
        first thread's operation goes on. Checks that the Buffer is usable unless ``check``."""
        me = threading.get_ident()
        with self._guard:
            if self._owner is not None and self._owner[0] != me:
                _, name, inside = self._owner
                raise RuntimeError(
                    f"EP rank {self.topology.rank}: Buffer.{what} called on thread "
                    f"{threading.current_thread().name!r} while thread {name!r} is inside Buffer.{inside}: "
                    "one thread at a time may use a Buffer (its operations are collective and ordered); use "
                    "one Buffer per thread, or a lock around the calls"
                )
            if self._owner is None:
                self._owner = (me, threading.current_thread().name, what)
            self._depth += 1
        try:
            if check:
                self.check_open()
            yield
        finally:
            with self._guard:
                self._depth -= 1
                if not self._depth:
                    self._owner = None

    def close(self) -> None:
        """Waits for the queued transfers, then closes the transport (collective; once). A
        broken Buffer's transport is released locally, without waiting for its peers."""
        if self._closed:
            return
        self._closed = True
        self._finalizer.detach()
        self._comm.shutdown(wait=True)
        if self._comm_stream is not None:
            self._comm_stream.synchronize()
        if self._broken is not None:
            self.transport.release()
            return
        try:
            self.transport.close()
        except CommError as err:
            self._break(err)
            raise

    def _break(self, err: BaseException) -> None:
        if self._broken is None:
            self._broken = (
                f"EP rank {self.topology.rank}: this Buffer is broken and refuses every later call: a new Buffer is "
                "needed (close() this one on every rank: a broken Buffer frees what it made without waiting for "
                f"its peers). It broke on: {type(err).__name__}: {err}"
            )

    def _guarded(self, fn, *args):
        """``fn(*args)``, an operation's steps: refused at once on a broken Buffer; a failure
        that may have left the ranks out of step breaks it (the agreement's ValueError and
        TypeError come before any payload moved, an overflow after it completed: those do not)."""
        if self._broken is not None:
            raise CommError(self._broken)
        try:
            return fn(*args)
        except ValueError as err:
            kind = _refusal_type(str(err))
            if kind is TypeError:  # a peer's refused TypeError: the same type on every rank
                raise TypeError(str(err)) from err
            raise
        except (TypeError, BudgetOverflowError):
            raise
        except Exception as err:
            self._break(err)
            raise

    def refuse(
        self,
        err: BaseException,
        operation: str,
        what: str,
        fields: dict[str, Field] | None = None,
    ) -> NoReturn:
        """Takes part, for a call this rank refuses with ``err``, in the check its peers run,
        with a non-zero status and ``err``'s text posted in the store (the agreement:
        :mod:`moe_dispatch.transport.agreement`); once every rank has seen the refusal, raises
        what the peers raise: the refusing rank's error type (TypeError or ValueError; with
        several refusals the lowest rank's), naming the refusing ranks and quoting their errors
        (this rank's ``err`` is the cause). The Buffer stays usable.

        With the kernels (``device_checks``), once a call of this operation's kind has passed
        the host check on this Buffer, the peers are taken to run a signature they have seen
        (the steady state: the refused arguments themselves tell nothing of the peers' call),
        so they skip that check and run the kernels: this rank then takes part in the operation
        itself with no rows and a non-zero header status (``transport.refuse``), and the peers
        raise MismatchError (a TypeError for a refused TypeError) naming it and quoting its
        error where their operation completes; so does this rank. Before that, everyone is in
        the host check of a first call.

        Args:
            operation: the check the peers run: ``"dispatch (metadata)"`` (a fresh dispatch's
                exchange), ``"dispatch (num_worst_tokens)"`` (that exchange on the comm thread),
                ``"dispatch"`` (a cached dispatch's argument check) or ``"combine"``.
            what: the operation, for the progress marks and messages.
            fields: a fresh dispatch's fields (the refusing rank's: all -1).

        Raises:
            ValueError, TypeError: the refusal (MismatchError where the kernels compared it).
            CommError: the check itself failed or timed out.
        """
        status = agreement.status_of(err)
        call = Call(seq=self._next_seq())
        self.transport.progress.post_refusal(call.seq, f"{type(err).__name__}: {err}")
        refuse_on_device = getattr(self.transport, "refuse", None)
        if refuse_on_device is not None and self._checked_kind(operation):
            kind = "cached dispatch" if what == "cached dispatch" else operation.split(" (")[0]
            self._run(_steps_calling(refuse_on_device, kind, err), call, [], f"{what} (refused)")
            # What the peers' records say of this rank, quoting its error (Transfers._marked).
            rank = self.topology.rank
            message, fields = describe_mismatch([1, rank, rank, FIELD_STATUS, STATUS_INVALID_ARGUMENTS, 0, -1, 0])
            message = f"{message} (EP rank {rank} refused: {type(err).__name__}: {err})"
            raise (TypeError(message) if isinstance(err, TypeError) else MismatchError(message, fields)) from err
        empty = torch.zeros((0, self.topology.world_size), dtype=torch.bool, device=self.device)
        try:
            if operation == "dispatch (metadata)":
                self.plan(call, empty, fields, status=status)
            elif operation == "dispatch (num_worst_tokens)":
                self._run(self._plan(empty, fields, None, None, call, status), call, [], what)
            else:
                self._run(self._check({"operation": operation}, what, status), call, [], what)
        except (ValueError, TypeError) as refused:  # the refusal itself, which every rank raises
            raise type(refused)(str(refused)) from err
        raise err  # unreachable: the check raises every rank's refusal

    def _checked_kind(self, operation: str) -> bool:
        """Whether a call of ``operation``'s kind (a refusal's check name) passed the host check
        of a first signature on this Buffer (only with ``device_checks``)."""
        kind = "dispatch (metadata)" if operation == "dispatch (num_worst_tokens)" else operation
        return any(dict(signature)["operation"] == kind for signature in self._signatures)

    def plan(
        self,
        call: Call,
        is_token_in_rank: torch.Tensor,
        fields: dict[str, Field],
        topk_idx: torch.Tensor | None = None,
        status: int = 0,
        rows: list[torch.Tensor] | None = None,
    ) -> Plan:
        """A fresh dispatch's plan: the counts exchanged and ``fields`` compared across ranks (a
        host synchronisation: receive sizes are host ints). Takes the operation's number into
        ``call.seq``, which its payload transfer reuses.

        The exchange runs on the caller's thread, on a group no other thread uses, so it does
        not queue behind payloads in flight; where the transport ``plans_on_comm_thread`` (the
        kernels: one queue for every launch; torch_dist: the counts share the checks' group), it
        runs in the queue and the caller waits (on CPU with nothing queued, on the caller's
        thread: the same order).

        ``topk_idx``: ``[T, K]``, what the kernels' notify routes by. ``status``: this rank's
        refusal (see :meth:`refuse`), 0 otherwise. ``rows``: the row tensors the dispatch will
        move (as :meth:`dispatch` packs them), which a transport that ``fuses_layout`` may send
        with the counts.

        Raises:
            ValueError: a rank refused, or ranks disagree on a field (naming it and the ranks).
            CommError: a peer failed or did not join in time.
        """
        with self.entered("dispatch"):
            call.seq = call.seq or self._next_seq()
            self.transport.progress.mark("caller", call.seq, "dispatch (metadata)")
            if not self.transport.plans_on_comm_thread:
                return self._guarded(drive, self.transport.plan(is_token_in_rank, fields, status=status))
            steps = self._marked(
                self._plan(is_token_in_rank, fields, topk_idx, None, call, status, rows),
                call.seq,
                "dispatch (metadata)",
            )
            if self.device.type != "cuda" and not self._queued:  # in queue order already (see _run)
                return self._guarded(drive, steps)
            plan = stream_order_wait(self.submit(drive, steps))
            self.join()
            return plan

    def _plan(
        self,
        is_token_in_rank: torch.Tensor,
        fields: dict[str, Field],
        topk_idx: torch.Tensor | None,
        num_rows: int | None,
        call: Call,
        status: int = 0,
        rows: list[torch.Tensor] | None = None,
    ):
        """Steps of a fresh dispatch's plan on the communication thread/stream: the kernels
        (``routes_on_device``) check the arguments first (:meth:`_check`), then run notify, with
        the dispatch's identity (``call.seq``); torch_dist exchanges the counts with the fields
        (and, where they fit, ``rows``)."""
        t = self.transport
        if not getattr(t, "routes_on_device", False):
            extra = {"rows": rows} if rows is not None and getattr(t, "fuses_layout", False) else {}
            return (yield from t.plan(is_token_in_rank, fields, on_comm_thread=True, status=status, **extra))
        if not status:  # a refusal is the transport's plan's own check
            # The operation first, so it is told apart from a combine's check.
            yield from self._check({"operation": "dispatch (metadata)", **fields}, "dispatch")
        return (
            yield from t.plan(
                is_token_in_rank,
                fields,
                on_comm_thread=True,
                status=status,
                topk_idx=topk_idx,
                num_rows=num_rows,
                dispatch_id=call.seq,
            )
        )

    def dispatch(self, call: Call, x, topk_weights: torch.Tensor | None) -> list[torch.Tensor | None]:
        """A fresh dispatch (``call.dispatch`` says where to): allocates the outputs and moves x
        (a ``[T, H]`` tensor, or a list of row tensors such as the fp8 pair), topk_idx and
        topk_weights (``[T, K]`` fp32 or None) into them; converts topk_idx to local numbering
        into ``call.dispatch.recv_topk_idx`` (-1 for other ranks' experts), zeroes the weights
        of other ranks' experts and counts ``num_recv_tokens_per_expert``. A slot without a
        plan (static ``num_worst_tokens`` size) gets it here, first, and pads the outputs.

        Returns:
            The received x tensors (``[num_rows, ...]`` each), then the received weights
            ``[num_rows, K]`` (or None).

        Raises (where the operation completes: here, the event or the hook):
            BudgetOverflowError: more rows arrived than ``num_worst_tokens`` (``on_overflow="raise"``).
        """
        routing = call.dispatch
        xs = x if isinstance(x, list) else [x]
        tensors = [dense(t) for t in [*xs, routing.topk_idx] + ([topk_weights] if topk_weights is not None else [])]
        if routing.layout is not None:
            return self._dispatch_permuted(call, tensors, len(xs))
        slot = routing.slot
        out = self._alloc(call, [(t, (slot.num_rows, *t.shape[1:])) for t in tensors])
        out[len(xs)] = recv_idx = routing.recv_topk_idx
        budget = slot.plan is None  # num_worst_tokens: the plan comes with the transfer

        def steps():
            if budget:
                slot.plan = yield from self._plan(
                    routing.is_token_in_rank, routing.fields, routing.topk_idx, slot.num_rows, call
                )
            rows = slot.plan.num_recv_tokens
            if rows is None:  # the count is on the device: the kernels filled every row, padding too
                yield from self.transport.dispatch(tensors, routing.is_token_in_rank, slot.plan, out)
                slot.overflow = slot.plan.overflow != 0
                _pad_rows(out, _padding(slot), recv_idx)
                if routing.on_overflow == "raise" and bool(slot.overflow):  # a host read, as asked
                    self._overflow(int(slot.plan.recv_count), slot.num_rows)
            else:
                # Past the static size the rows still arrive (peers send them regardless), into
                # scratch; they are dropped, or the overflow raised once the transfer is complete.
                stored, over = min(rows, slot.num_rows), rows > slot.num_rows
                dst = [o.new_empty((rows, *o.shape[1:])) for o in out] if over else [o[:rows] for o in out]
                yield from self.transport.dispatch(tensors, routing.is_token_in_rank, slot.plan, dst)
                self._raise_recorded()  # the host read the counts: a point that synchronises anyway
                if budget:
                    slot.overflow = torch.full((1,), over, dtype=torch.bool, device=self.device)
                if over:
                    if routing.on_overflow == "raise":
                        self._overflow(rows, slot.num_rows)
                    for o, d in zip(out, dst):  # "drop": the rows that fit
                        o.copy_(d[: slot.num_rows])
                for o in out:  # the padding rows of a static size
                    if o is not recv_idx:
                        o[stored:].zero_()
                recv_idx[stored:] = -1
            self._localize(routing, out[-1] if topk_weights is not None else None)

        what = "dispatch" if slot.plan is not None else "dispatch (num_worst_tokens)"
        self._run(steps(), call, [*tensors, *out], what)
        slot.dispatch_id = call.seq
        return [*out[: len(xs)], out[-1] if topk_weights is not None else None]

    def _overflow(self, rows: int, num_rows: int) -> None:
        raise BudgetOverflowError(
            f"EP rank {self.topology.rank}: dispatch received {rows} rows but num_worst_tokens={num_rows}; raise "
            f"num_worst_tokens to at least {rows} (T * W never overflows), or pass on_overflow='drop'"
        )

    def _localize(self, routing: FreshDispatch, recv_weights: torch.Tensor | None) -> None:
        """The received top-k ids (``routing.recv_topk_idx``, global) in local numbering, -1 for
        other ranks' experts (their weights zeroed), and ``num_recv_tokens_per_expert``."""
        experts_per_rank = routing.num_experts // self.topology.world_size
        # Counted from the rows that arrived: the metadata carries no per-expert counts, so its
        # size is the same on every rank whatever num_experts each one passed.
        localize_topk_idx_cpu(
            routing.recv_topk_idx,
            routing.num_recv_tokens_per_expert,
            experts_per_rank * self.topology.rank,
            experts_per_rank,
            recv_weights,
        )

    def _dispatch_permuted(self, call: Call, tensors: list[torch.Tensor], k: int) -> list[torch.Tensor | None]:
        """A fresh dispatch of ``tensors`` (k x tensors, topk_idx, then the weights if given) whose
        x tensors land expert-major (``call.dispatch.layout``, the permute of
        :func:`moe_dispatch.ops.permute.permute` over the received rows): straight from the
        receive buffer where the transport fuses it, else permuted after the transfer. Sets
        ``slot.permute``. With a dynamic P (no budget, no fixed blocks) the outputs exist only
        once the ids arrived: the call then completes before it returns.

        Returns:
            The permuted x tensors (``[P, ...]`` each), then the permuted weights ``[P]`` fp32
            (0 on zero rows; or None).
        """
        routing = call.dispatch
        slot, layout = routing.slot, routing.layout
        xs, weighted = tensors[:k], len(tensors) > k + 1
        rows = slot.num_rows  # the plan is known: no num_worst_tokens here
        static = layout.num_rows
        if static is None:
            call.mode = "sync"
        recv = self._alloc(call, [(t, (rows, *t.shape[1:])) for t in tensors[k + 1 :]])
        permuted = self._alloc(call, [(t, (static or 0, *t.shape[1:])) for t in xs])
        if weighted:
            permuted += self._alloc(call, [(tensors[-1], (static or 0,))])
        dst = [*permuted[:k], routing.recv_topk_idx, *recv]

        def expert_layout() -> PermuteHandle:
            # The top-k ids arrived: the permute's index phase, then (dynamic P) its outputs.
            self._localize(routing, recv[0] if recv else None)
            # the ids are this rank's own (localized above): no second check on the host
            handle = (permute_map_triton if routing.recv_topk_idx.is_cuda else permute_map_cpu)(
                routing.recv_topk_idx,
                layout.num_local_experts,
                layout.pad_multiple,
                layout.num_permuted_tokens,
                layout.expert_capacity,
            )
            slot.permute = handle
            layout.tokens_per_expert.copy_(handle.tokens_per_expert)
            if static is None:
                for j, t in enumerate(permuted):
                    permuted[j] = t.new_empty((handle.num_rows, *t.shape[1:]))
                dst[:k] = permuted[:k]
            return handle

        def steps():
            if getattr(self.transport, "fuses_layout", False):
                yield from self.transport.dispatch(
                    tensors, routing.is_token_in_rank, slot.plan, dst, permute=(k, expert_layout)
                )
            else:
                scratch = [t.new_empty((rows, *t.shape[1:])) for t in xs]
                yield from self.transport.dispatch(tensors, routing.is_token_in_rank, slot.plan, [*scratch, *dst[k:]])
                src, _ = permuted_sources(expert_layout())
                for s, o in zip(scratch, permuted[:k]):
                    gather_rows(_bytes(s), src, out=_bytes(o))
            if weighted:
                gather_rows(recv[0].view(-1, 1), permuted_sources(slot.permute)[1], out=permuted[-1].view(-1, 1))

        self._run(steps(), call, [*tensors, *recv, *permuted], "dispatch")
        slot.dispatch_id = call.seq
        return [*permuted[:k], permuted[-1] if weighted else None]

    def forward(self, slot: PlanSlot, tensors: list[torch.Tensor], call: Call, what: str) -> list[torch.Tensor]:
        """Replays a plan's dispatch for row tensors ``[T, ...]`` into new ``[num_rows, ...]``
        outputs (rows past the received ones zero), or, on a fused permute's slot, into
        ``[P, ...]`` expert-major ones; returns them."""
        tensors = [dense(t) for t in tensors]
        permute = slot.permute
        num_rows = slot.num_rows if permute is None else permute.num_rows
        out = self._alloc(call, [(t, (num_rows, *t.shape[1:])) for t in tensors])
        fuses = getattr(self.transport, "fuses_layout", False)

        def steps():
            check = self._agree("dispatch", slot, tensors, 0, what)
            rows = slot.plan.num_recv_tokens
            if rows is None:  # the count is on the device (budget mode: no fused permute there)
                yield from check
                yield from self.transport.forward(tensors, slot.plan, out, what)
                _pad_rows(out, _padding(slot))
                return
            stored, over = min(rows, slot.num_rows), rows > slot.num_rows
            if permute is not None and fuses:
                dst = out
            elif permute is not None or over:  # scratch: permuted after, or the rows a drop left out
                dst = [o.new_empty((rows, *o.shape[1:])) for o in out]
            else:
                dst = [o[:rows] for o in out]
            if fuses:
                yield from self.transport.forward(tensors, slot.plan, dst, what, permuted=permute, check=check)
            else:
                yield from check
                yield from self.transport.forward(tensors, slot.plan, dst, what)
            if permute is not None:
                if not fuses:
                    src, _ = permuted_sources(permute)
                    for s, o in zip(dst, out):
                        gather_rows(_bytes(s), src, out=_bytes(o))
                return
            for o, d in zip(out, dst):
                if over:  # a dispatch that dropped rows: the same rows again
                    o.copy_(d[:stored])
                o[stored:].zero_()

        self._run(steps(), call, [*tensors, *out], what)
        return out

    def combine(
        self,
        slot: PlanSlot,
        tensors: list[torch.Tensor],
        scales: list[torch.Tensor | None],
        call: Call,
        what: str,
        expert_major: list[bool] | None = None,
    ) -> list[torch.Tensor]:
        """Combines row tensors ``[num_rows, ...]`` (only the received rows are read; each times
        its ``[num_rows]`` fp32 scale, if any) onto their source tokens into new ``[T, ...]``
        outputs; returns them. Rows a ``num_worst_tokens`` dispatch dropped contribute zero. On a
        fused permute's slot a tensor flagged in ``expert_major`` (default: every tensor there)
        is ``[P, ...]`` expert-major: each received row is the fp32 sum of its copies
        (unpermute), fused into the transfer where the transport can."""
        tensors = [dense(t) for t in tensors]
        scales = [None if sc is None else dense(sc) for sc in scales]
        out = self._alloc(call, [(t, (slot.num_tokens, *t.shape[1:])) for t in tensors])
        uses = [*tensors, *[sc for sc in scales if sc is not None], *out]
        if expert_major is None:
            expert_major = [slot.permute is not None] * len(tensors)
        fuses = getattr(self.transport, "fuses_layout", False)

        def steps():
            check = self._agree("combine", slot, tensors, sum(sc is not None for sc in scales), what)
            rows = slot.plan.num_recv_tokens
            if rows is None:  # the kernels read only the rows they stored (budget mode: no fused permute)
                yield from check
                yield from self.transport.combine(tensors, scales, slot.plan, out, what)
                return
            # the received rows, the ones a dropping dispatch left out as zeros
            ins = [t if major else _rows(t, rows) for t, major in zip(tensors, expert_major)]
            row_scales = [None if sc is None else _rows(sc, rows) for sc in scales]
            if fuses:
                permuted = [slot.permute if major else None for major in expert_major]
                yield from self.transport.combine(ins, row_scales, slot.plan, out, what, permuted=permuted, check=check)
                return
            yield from check
            ins = [ordered_sum(unpermute_plan(slot.permute), t) if major else t for t, major in zip(ins, expert_major)]
            yield from self.transport.combine(ins, row_scales, slot.plan, out, what)

        self._run(steps(), call, uses, what)
        return out

    def submit(self, fn, *args) -> Future:
        """CPU: queues ``fn(*args)`` on the communication thread. CUDA: runs it now with the
        communication stream current, after the work already queued on the caller's stream."""
        self.check_open()
        if self.device.type != "cuda":
            with self._queued_lock:
                self._queued += 1
            future = self._comm.submit(self._guarded, fn, *args)
            future.add_done_callback(self._done)
            return future
        future: Future = Future()
        self._comm_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._comm_stream):
            future.set_result(self._guarded(fn, *args))
        return future

    def _done(self, _future: Future) -> None:
        with self._queued_lock:
            self._queued -= 1

    def join(self) -> None:
        """Orders the caller's CUDA stream after the communication stream (no host wait)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream().wait_stream(self._comm_stream)

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _marked(self, steps, seq: int, what: str):
        """``steps``, first recording on the thread that runs them that operation ``seq`` began.
        A peer's refusal recorded by the kernels is raised quoting the error it posted."""
        self.transport.progress.mark("comm", seq, what)
        try:
            return (yield from steps)
        except MismatchError as err:
            if err.field != "status":
                raise
            others = [r for r in range(self.topology.world_size) if r != self.topology.rank]
            texts = self.transport.progress.read_refusals(others, seq)
            if not texts:
                raise
            quoted = "; ".join(f"EP rank {r} refused: {text}" for r, text in sorted(texts.items()))
            if texts[min(texts)].startswith("TypeError"):  # the refusing rank's type on every rank
                raise TypeError(f"{err} ({quoted})") from err
            raise MismatchError(f"{err} ({quoted})", dict(vars(err))) from err

    def _run(self, steps, call: Call, uses: list[torch.Tensor], what: str) -> None:
        """Runs transport steps per ``call.mode`` (see the class docstring). ``uses``: tensors of
        the caller's stream that the transfer reads or writes (on CUDA the caching allocator is
        told, so an early free cannot hand their memory to other work). Takes the operation's
        number into ``call.seq`` unless the call has one."""
        with self.entered(what):
            call.seq = call.seq or self._next_seq()
            steps = self._marked(steps, call.seq, what)
            if call.mode == "hook":
                first = stream_order_wait(self.submit(start, steps))
                call.hook = RecvHook(self, steps, first)
                self._record(uses)
                return
            if call.mode == "sync" and self.device.type != "cuda" and not self._queued:
                # Nothing queued before it: the caller's thread runs it, in queue order all the same,
                # without two thread hand-offs.
                self.check_open()
                self._guarded(drive, steps)
                return
            future = self.submit(drive, steps)
            if call.mode == "sync":
                self.join()
                stream_order_wait(future)
                return
            self._record(uses)
            if self.device.type == "cuda":
                event = torch.cuda.Event()
                event.record(self._comm_stream)
                call.event = EventOverlap(event)
            else:
                call.event = EventOverlap(future=future)

    def _record(self, tensors: list[torch.Tensor]) -> None:
        if self.device.type == "cuda":
            for t in tensors:
                t.record_stream(self._comm_stream)

    def _alloc(self, call: Call, shapes_like: list[tuple[torch.Tensor, tuple[int, ...]]]) -> list[torch.Tensor]:
        """Outputs ``t.new_empty(shape)``; with ``allocate_on_comm_stream`` on CUDA they come from the
        communication stream's pool and are recorded for the caller's stream, which reads them."""
        if not (call.allocate_on_comm_stream and self.device.type == "cuda"):
            return [t.new_empty(shape) for t, shape in shapes_like]
        with torch.cuda.stream(self._comm_stream):
            out = [t.new_empty(shape) for t, shape in shapes_like]
        for t in out:
            t.record_stream(torch.cuda.current_stream())
        return out

    def _agree(self, operation: str, slot: PlanSlot, tensors: list[torch.Tensor], num_scales: int, what: str):
        """Steps checking that every rank runs the same kind of operation, with the handle of
        the same dispatch, on rows of the same width and dtype: combine and cached dispatch
        exchange no sizes (see :meth:`_check` for where the check runs)."""
        return self._check(
            {**_row_fields(operation, tensors, num_scales), "handle": DispatchId(slot.dispatch_id)}, what
        )

    def _check(self, fields: dict[str, Field], what: str, status: int = 0):
        """Steps comparing ``fields`` (an operation's signature) and every rank's ``status``
        across ranks on the host (``transport.agree``, whose check object a transport that
        ``fuses_layout`` takes back to carry rows in it): every time, or, where the transport
        compares every launch on the device (``device_checks``), the first time this signature
        appears on this Buffer, and for a refusal."""
        if getattr(self.transport, "device_checks", False) and not status:
            return self._check_first(fields, what)
        return self.transport.agree(fields, what, status)

    def _check_first(self, fields: dict[str, Field], what: str):
        """Steps of :meth:`_check` on a transport with ``device_checks``: the host check of a
        signature new to this Buffer, nothing for one seen before."""
        signature = _signature_key(fields)
        if signature in self._signatures:
            return
        yield from self.transport.agree(fields, what)
        self._signatures.add(signature)


# The lowest refusing rank's error type in an agreement's refusal message (agreement.check): its
# posted text ("TypeError: ...") or, where the store did not answer, its status in words.
_FIRST_REFUSAL = re.compile(r"refused by EP ranks? \d+ \((?:(TypeError|ValueError): |[^()]*\((TypeError|ValueError)\))")


def _refusal_type(message: str) -> type | None:
    """TypeError or ValueError: the type of the first refusal ``message`` quotes; None for none."""
    found = _FIRST_REFUSAL.search(message)
    if found is None:
        return None
    return TypeError if "TypeError" in (found.group(1), found.group(2)) else ValueError


def _rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """The first ``rows`` rows of ``t [num_rows, ...]``, zero rows appended where ``rows`` exceeds
    them (the rows a dropping dispatch left out)."""
    if rows <= t.shape[0]:
        return t[:rows]
    return torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))])


def _padding(slot: PlanSlot) -> torch.Tensor:
    """``[num_rows]`` bool on the device: rows past those received (the plan's device count)."""
    count = slot.plan.recv_count
    return torch.arange(slot.num_rows, device=count.device) >= count


def _pad_rows(out: list[torch.Tensor], padding: torch.Tensor, index: torch.Tensor | None = None) -> None:
    """Zeroes the ``padding`` rows of each tensor of ``out`` (bit patterns: any dtype), -1 in
    ``index``'s. Static-size device ops (CUDA-graph safe)."""
    for o in out:
        if o is index:
            o.masked_fill_(padding.view(-1, 1), -1)
        elif o.numel():
            o.view(o.shape[0], -1).view(torch.uint8).masked_fill_(padding.view(-1, 1), 0)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``[rows, ...]`` contiguous -> its ``[rows, bytes]`` uint8 view (row gathers of any dtype)."""
    return t.view(t.shape[0], -1).view(torch.uint8)


class RecvHook:
    """Completes an operation issued with ``return_recv_hook=True``: ``hook()`` waits for the
    issued stage and runs the rest (on the Buffer's communication thread), then returns.

    Raises:
        RuntimeError: called twice.
        CommError: the operation failed or timed out.
    """

    def __init__(self, transfers: Transfers, steps, first):
        self._transfers, self._steps, self._first = transfers, steps, first
        self.called = False

    def __call__(self) -> None:
        if self.called:
            raise RuntimeError("this receive hook was already called; each hook completes its operation once")
        self.called = True
        stream_order_wait(self._transfers.submit(finish, self._steps, self._first))
        self._transfers.join()
