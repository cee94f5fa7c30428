"""The contract between the runtime (``moe_dispatch.runtime``) and its transports.

A transport moves rows between the ranks of one EP group; the runtime builds everything else
on it (argument checks, output allocation, autograd, ``async_finish``, receive hooks,
``num_worst_tokens``, cached dispatch). Every operation of a transport returns **steps**: a
generator that yields each collective it waits for (an object with ``wait()``, or None) and
returns its result. The runtime drives the steps on its communication thread (CPU) or stream
(CUDA), all of a Buffer's operations in one ordered queue. An operation that waits for nothing
returns :func:`completed`.

The runtime calls each operation from inside the steps it drives, so an operation may do its
work when called (the kernels enqueue their launches then) or when its steps are driven (the
torch_dist collectives): either way it runs in queue order on the communication thread or
stream.

:class:`Transport` is the abstract base: one signature per operation. A transport moves rows
in (source rank, source token) order (``dispatch_rows``, ``forward_rows``, ``combine_rows``);
the base class lays them out expert-major around that (the unfused permute) and runs the
argument check first. A transport that does either itself (torch_dist: the permute fused into
its landing, the check's blocks carrying small calls' rows) overrides :meth:`Transport.dispatch`,
:meth:`Transport.forward` and :meth:`Transport.combine`. What else a transport can do is its
:class:`Capabilities`, a frozen record the runtime reads.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, ClassVar, Protocol, TypeVar

import torch

from ..control.agreement import Field
from ..semantics.permute import PermuteHandle, gather_rows, permuted_sources, unpermute_plan
from ..semantics.sums import ordered_sum

if TYPE_CHECKING:
    from ..config import Config
    from ..control import ControlPlane
    from ..topology import Topology

T = TypeVar("T")


class Waitable(Protocol):
    """A collective in flight, yielded by steps: ``wait()`` blocks until it completed, raising
    :class:`~moe_dispatch.errors.CommError` on a failure or timeout."""

    def wait(self) -> None: ...


Steps = Generator["Waitable | None", None, T]


def completed(value: T = None) -> Steps[T]:
    """Steps that finish at once with ``value``, waiting for nothing: what an operation returns
    when its work was done (or enqueued on the current CUDA stream) as it was called."""
    yield from ()
    return value


class Plan(Protocol):
    """A fresh dispatch's routing as a transport keeps it: combine, cached dispatch and the
    backward passes replay it (:class:`~moe_dispatch.transport.torch_dist.TorchDistPlan`,
    :class:`~moe_dispatch.transport.kernels.KernelPlan`).

    Attributes:
        num_recv_tokens: R, the rows this rank received, as a host int; None where only the
            device knows it (the kernels' budget mode): then ``recv_count`` (``[1]`` int32) and
            ``overflow`` (``[1]`` int32: more rows than the plan's static size arrived) are
            device tensors.
        internode_rows: rows this rank sent to other nodes (and receives back in combine).
        intranode_rows: rows this rank sent to the other ranks of its node.
    """

    @property
    def num_recv_tokens(self) -> int | None: ...

    @property
    def internode_rows(self) -> int: ...

    @property
    def intranode_rows(self) -> int: ...


@dataclasses.dataclass(eq=False)
class PlanRequest:
    """A fresh dispatch's routing, what :meth:`Transport.plan` exchanges.

    Attributes:
        is_token_in_rank: ``[T, W]`` bool layout of the sent tokens (``[0, W]`` for a refusing
            rank).
        fields: the arguments every rank must agree on (compared by the plan where the
            transport ``checks_in_plan``, else by the runtime first).
        what: the operation, for messages.
        status: 0, or this rank's refusal: its fields are -1, and every rank raises ValueError
            after the exchange.
        rows: the row tensors the dispatch will move (its :class:`Transfer`'s), which may travel
            with the counts (torch_dist; others ignore them), or None.
        topk_idx: ``[T, K]`` global expert ids, for a transport that routes on the device (the
            kernels' notify; others ignore it), or None.
        num_rows: a static receive size (``num_worst_tokens``), or None.
        dispatch_id: the dispatch's operation number, the same on every rank.
    """

    is_token_in_rank: torch.Tensor
    fields: dict[str, Field]
    what: str = "dispatch"
    status: int = 0
    rows: list[torch.Tensor] | None = None
    topk_idx: torch.Tensor | None = None
    num_rows: int | None = None
    dispatch_id: int = 0


@dataclasses.dataclass(eq=False)
class Transfer:
    """The rows one operation moves on a plan, what the runtime hands a transport's dispatch,
    forward and combine (and the ``*_rows`` methods).

    Attributes:
        tensors: the row tensors: ``[T, ...]`` each for a dispatch or forward (dispatch:
            ``[x, (fp8 scales), topk_idx, (topk_weights)]``); for a combine floating ``[R, ...]``
            in dispatch's receive order, or ``[P, ...]`` expert-major where a permute handle
            says so.
        plan: the dispatch's :class:`Plan`.
        out: per tensor its output, allocated by the runtime and written by the steps
            (``[R, ...]``, or ``[P, ...]`` expert-major; combine: ``[T, ...]``).
        what: the operation, for messages.
        scales: combine only: per tensor None or its ``[R]`` fp32 row scales, applied in fp32
            before summing.
    """

    tensors: list[torch.Tensor]
    plan: Plan
    out: list[torch.Tensor]
    what: str
    scales: list[torch.Tensor | None] | None = None


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What a transport does beyond the contract's minimum (read by the runtime, set once by
    the transport).

    Attributes:
        checks_in_plan: a fresh dispatch's :meth:`Transport.plan` compares the fields and
            statuses itself (they ride with its counts: torch_dist); otherwise the runtime runs
            the argument check before it (the kernels).
        budget_on_device: with ``num_rows`` a plan keeps R on the device (``num_recv_tokens``
            None, see :class:`Plan`): a ``num_worst_tokens`` dispatch never waits for the host.
        device_checks: every launch compares the ranks' calls on the device, so the runtime
            compares a call signature on the host only the first time it appears, and a rank
            refusing its own arguments later takes part through :meth:`Transport.refuse`.
        device_checked_fields: per operation kind (``"dispatch (metadata)"``, ``"dispatch"``,
            ``"combine"``), the fields every launch's device check compares: they are left out
            of a call signature (a difference on one rank must meet its peers in the device
            check, not split them between the host check and the launch).
    """

    checks_in_plan: bool = False
    budget_on_device: bool = False
    device_checks: bool = False
    device_checked_fields: dict[str, frozenset[str]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class TransportOptions:
    """What ``Buffer()`` hands every transport (each reads what it uses).

    Attributes:
        timeout_s: bound on every collective, in seconds.
        device: the Buffer's device.
        config: the kernels' launch shape (a :class:`~moe_dispatch.config.Config`, or
            ``"auto"``); used by ``"kernels"``.
        num_chunks: the torch_dist pipeline depth, or None (automatic); used by ``"torch_dist"``.
    """

    timeout_s: float
    device: torch.device
    config: Config | str | None = None
    num_chunks: int | None = None


class Transport(abc.ABC):
    """What the runtime asks of a transport (``TorchDistTransport``, ``KernelTransport``).

    Shapes: T tokens sent by this rank, R rows received, W ranks. Row tensors are ``[rows, ...]``
    of any dtype unless an operation says otherwise; ``out`` tensors are allocated by the runtime
    and written by the steps. Every operation is collective over the EP group: every rank runs
    the same operations in the same order.

    Args:
        control: the EP group's control plane (process groups, argument checks, progress
            marks): every transport's checks and records go through it.
        topology: this rank's place in the group.
        options: see :class:`TransportOptions`.

    Attributes:
        name: the registry's name (``moe_dispatch.transport.TRANSPORTS``).
        capabilities: see :class:`Capabilities`.
        control: the control plane.

    Collective: construction, :meth:`close`.
    """

    name: ClassVar[str]
    capabilities: Capabilities = Capabilities()

    def __init__(self, control: ControlPlane, topology: Topology, options: TransportOptions):
        self.control, self.topology, self.options = control, topology, options

    @classmethod  # noqa: B027 - a default
    def check_options(cls, topology: Topology, options: TransportOptions) -> None:
        """Raises unless this transport can serve ``topology`` with ``options`` here (run by
        ``Buffer()`` on every rank before the ranks agree their arguments, so no rank fails
        alone later). Nothing to check by default.

        Raises:
            ValueError, RuntimeError: what the transport cannot do (the message says the fix).
        """

    @property
    def progress(self):
        """The :class:`~moe_dispatch.control.progress.Progress` records of the EP group."""
        return self.control.progress

    def agree(self, fields: dict[str, Field], what: str, status: int = 0) -> Steps[None]:
        """Steps comparing ``fields`` (the operation first) and every rank's ``status`` across
        ranks before an operation whose sizes are not exchanged (combine, cached dispatch): the
        control plane's check (:meth:`~moe_dispatch.control.ControlPlane.check`). A refusing
        rank passes its non-zero status and -1 fields, takes part, and raises its own error
        afterwards.

        Raises (from the steps):
            ValueError: naming each refusing rank, or the first field and the ranks that differ.
            CommError: a peer failed or did not join within the timeout.
        """
        return self.control.check(fields, what, status)

    @abc.abstractmethod
    def plan(self, request: PlanRequest) -> Steps[Plan]:
        """Steps exchanging a fresh dispatch's routing (:class:`PlanRequest`); returns the
        :class:`Plan`."""

    def dispatch(
        self,
        transfer: Transfer,
        is_token_in_rank: torch.Tensor,
        permute: tuple[int, Callable[[], PermuteHandle]] | None = None,
    ) -> Steps[None]:
        """Steps moving ``transfer.tensors`` = ``[x, (fp8 scales), topk_idx, (topk_weights)]``
        (``[T, ...]`` each, laid out by ``is_token_in_rank`` ``[T, W]``) into ``transfer.out``
        (``[R, ...]`` each) in (source rank, source token) order; top-k ids arrive in global
        numbering.

        ``permute = (k, layout)``: ``tensors[:k]`` land expert-major into ``out[:k]``
        (``[P, ...]``) as the :class:`~moe_dispatch.semantics.permute.PermuteHandle` ``layout()``
        lays the received rows out; ``layout`` is called once ``out[k:]`` hold their rows (it
        reads the received top-k ids). Here: the rows land in receive order, then one gather.
        """
        if permute is None:
            yield from self.dispatch_rows(transfer, is_token_in_rank)
            return
        k, layout = permute
        out = transfer.out
        rows = out[k].shape[0]  # the received top-k ids: R rows
        scratch = [t.new_empty((rows, *t.shape[1:])) for t in transfer.tensors[:k]]
        yield from self.dispatch_rows(dataclasses.replace(transfer, out=[*scratch, *out[k:]]), is_token_in_rank)
        handle = layout()  # may replace out[:k] (a P known only now)
        _gather_permuted(scratch, handle, out[:k])

    def forward(
        self, transfer: Transfer, permuted: PermuteHandle | None = None, check: Steps | None = None
    ) -> Steps[None]:
        """Steps replaying the plan's dispatch for row tensors ``[T, ...]`` into ``transfer.out``
        ``[R, ...]`` (cached dispatch, combine's backward); with ``permuted`` (the permute handle
        of the received rows) into ``[P, ...]`` outputs in its expert-major layout. ``check``:
        the argument check's steps, run before any row moves (or None)."""
        if check is not None:
            yield from check
        if permuted is None:
            yield from self.forward_rows(transfer)
            return
        scratch = [o.new_empty((transfer.plan.num_recv_tokens, *o.shape[1:])) for o in transfer.out]
        yield from self.forward_rows(dataclasses.replace(transfer, out=scratch))
        _gather_permuted(scratch, permuted, transfer.out)

    def combine(
        self,
        transfer: Transfer,
        permuted: list[PermuteHandle | None] | None = None,
        check: Steps | None = None,
    ) -> Steps[None]:
        """Steps summing each tensor's rows ``[R, ...]`` (times its ``[R]`` fp32 scale, if any) in
        fp32 onto their source tokens in ``transfer.out`` ``[T, ...]``, in the order of
        ``moe_dispatch.reference.combine``. ``permuted``: per tensor None, or the permute handle
        of the received rows: the tensor is then ``[P, ...]`` expert-major and each received row
        the fp32 sum of its copies (ascending), rounded (the unpermute). ``check``: the
        argument check's steps, run before any row moves (or None)."""
        if check is not None:
            yield from check
        if permuted is not None:
            tensors = [
                t if h is None else ordered_sum(unpermute_plan(h), t) for t, h in zip(transfer.tensors, permuted)
            ]
            transfer = dataclasses.replace(transfer, tensors=tensors)
        yield from self.combine_rows(transfer)

    # -- what a transport moves (the base class's operations call these) ---------------------
    def dispatch_rows(self, transfer: Transfer, is_token_in_rank: torch.Tensor) -> Steps[None]:
        """:meth:`dispatch` without a permute. A transport implements the ``*_rows`` methods, or
        overrides the operations that call them."""
        raise NotImplementedError(f"{type(self).__name__} implements dispatch itself")

    def forward_rows(self, transfer: Transfer) -> Steps[None]:
        """:meth:`forward` in receive order, without a check."""
        raise NotImplementedError(f"{type(self).__name__} implements forward itself")

    def combine_rows(self, transfer: Transfer) -> Steps[None]:
        """:meth:`combine` of rows in receive order, without a check."""
        raise NotImplementedError(f"{type(self).__name__} implements combine itself")

    # -- errors and teardown -------------------------------------------------------------------
    def refuse(self, operation: str, err: Exception) -> None:  # noqa: B027 - a default
        """Takes part in ``operation`` ("dispatch", "cached dispatch" or "combine") with no rows,
        for a rank whose own arguments were refused (``err``), so its peers finish at once: only
        where the transport has ``device_checks`` (the runtime calls it there); nothing here."""

    def refusal(self, err: Exception) -> Exception:
        """The error a rank raises after :meth:`refuse` took part for it: what its peers raise
        of its refusal (here ``err`` itself)."""
        return err

    def check_errors(self) -> None:  # noqa: B027 - a default
        """Raises what the device recorded (timeouts, mismatched calls), reading host memory
        only; nothing here (transports without device records raise where they fail)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Frees what the transport holds (collective: every rank, after its last operation)."""

    @abc.abstractmethod
    def release(self) -> None:
        """Frees what needs no peer (local, no collective): for a broken Buffer's close() and
        a Buffer dropped without close(). Idempotent."""


def _gather_permuted(rows: list[torch.Tensor], handle: PermuteHandle, out: list[torch.Tensor]) -> None:
    """``out[j][p] = rows[j][source of p]`` for the expert-major layout ``handle`` (padding rows 0)."""
    src, _ = permuted_sources(handle)
    for r, o in zip(rows, out):
        gather_rows(byte_rows(r), src, out=byte_rows(o))


def byte_rows(t: torch.Tensor) -> torch.Tensor:
    """``[rows, ...]`` contiguous -> its ``[rows, bytes]`` uint8 view (row gathers of any dtype;
    the width is spelled out: -1 is ambiguous for a rank that received no rows)."""
    return t.view(t.shape[0], math.prod(t.shape[1:])).view(torch.uint8)
