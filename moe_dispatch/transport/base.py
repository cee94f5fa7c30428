"""The contract between ``Buffer`` and its transports, written down.

A transport moves rows between the ranks of one EP group; the ``Buffer`` builds everything
else on it (argument checks, output allocation, autograd, ``async_finish``, receive hooks,
``num_worst_tokens``, cached dispatch). Every operation of a transport returns **steps**: a
generator that yields each collective it waits for (an object with ``wait()``, or None) and
returns its result. The Buffer drives the steps on its communication thread (CPU) or stream
(CUDA), all of a Buffer's operations in one ordered queue: :func:`drive` runs them to the end,
:func:`start` / :func:`finish` stop after the first yield and go on later (receive hooks). An
operation that waits for nothing returns :func:`completed`.

The Buffer calls each operation from inside the steps it drives, so an operation may do its
work when called (the kernels enqueue their launches then) or when its steps are driven (the
torch_dist collectives): either way it runs in queue order on the communication thread or
stream.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Generator
from typing import TYPE_CHECKING, Literal, Protocol, TypeVar

import torch

if TYPE_CHECKING:
    from ..buffer import EventOverlap, RecvHook
    from ..overlap import DelayedWgrad
    from ..semantics.permute import PermuteHandle
    from .progress import Progress

T = TypeVar("T")


class Waitable(Protocol):
    """A collective in flight, yielded by steps: ``wait()`` blocks until it completed, raising
    :class:`~moe_dispatch.errors.CommError` on a failure or timeout."""

    def wait(self) -> None: ...


Steps = Generator["Waitable | None", None, T]

# An argument compared across ranks before a payload moves (see Transport.agree).
Field = int | bool | str | torch.dtype


def drive(steps: Steps[T]) -> T:
    """Runs an operation's steps to completion, waiting on each collective; returns its result.

    Data movement is never differentiated here (the autograd Functions wire gradients), and
    grad mode is per thread, so it is switched off explicitly for the communication thread.
    """
    with torch.no_grad():
        try:
            while True:
                pending = next(steps)
                if pending is not None:
                    pending.wait()
        except StopIteration as stop:
            return stop.value


def start(steps: Steps):
    """Runs an operation up to its first collective (issued, not awaited); returns what
    :func:`finish` needs."""
    with torch.no_grad():
        try:
            return False, next(steps)
        except StopIteration as stop:
            return True, stop.value


def finish(steps: Steps[T], started) -> T:
    """Completes an operation begun with :func:`start`; returns its result."""
    done, value = started
    if done:
        return value
    if value is not None:
        value.wait()
    return drive(steps)


_ORDERING = threading.local()  # .active: this thread is in stream_order_wait


def stream_order_wait(future):
    """``future.result()`` of a communication-thread future where, on a GPU, a stream would wait
    for another instead of the host: on CPU the Buffer's communication thread stands in for its
    CUDA stream, so this is the stand-in of ``wait_stream`` / ``wait_event``, not a host
    synchronisation (``moe_dispatch.testing.sync`` lets these waits pass). Returns the result."""
    previous = getattr(_ORDERING, "active", False)
    _ORDERING.active = True
    try:
        return future.result()
    finally:
        _ORDERING.active = previous


def in_stream_order_wait() -> bool:
    """Whether this thread is inside :func:`stream_order_wait`."""
    return getattr(_ORDERING, "active", False)


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


class Transport(Protocol):
    """What a ``Buffer`` asks of a transport (``TorchDistTransport``, ``KernelTransport``).

    Shapes: T tokens sent by this rank, R rows received, W ranks. Row tensors are ``[rows, ...]``
    of any dtype unless an operation says otherwise; ``out`` tensors are allocated by the Buffer
    and written by the steps. Every operation is collective over the EP group: every rank runs
    the same operations in the same order.

    Attributes:
        plans_on_comm_thread: where a fresh dispatch's :meth:`plan` runs. False: on the
            caller's thread, on a process group of its own, so the counts do not queue behind
            payloads in flight. True: on the communication thread/stream, in the one queue with
            every other operation (the kernels: their launches share one set of rings).
        progress: the :class:`~moe_dispatch.transport.progress.Progress` records that name,
            in a timeout's message, the operation each peer had reached.

    Optional capabilities, where a transport has them (read with ``getattr``, absent = False /
    None):

    - ``fuses_layout`` (torch_dist): :meth:`dispatch` takes ``permute=(k, layout)`` (its first
      ``k`` tensors land expert-major as the :class:`~moe_dispatch.semantics.permute.PermuteHandle`
      ``layout()`` lays the received rows out; ``layout`` is called once the other tensors
      landed), :meth:`forward` takes ``permuted`` (a handle: every tensor lands so), :meth:`combine`
      takes ``permuted`` (per tensor None, or a handle: the tensor is ``[P, ...]`` in its layout
      and each received row is the fp32 sum of its copies, ascending), and :meth:`forward` and
      :meth:`combine` take ``check``, the argument check (what :meth:`agree` returned), which
      they run before their payload moves or which carries it; :meth:`plan` takes ``rows=``, the
      dispatch's row tensors, which may travel with the counts. Without it the Buffer permutes
      around the transport and runs the check first.
    - ``routes_on_device``: :meth:`plan` takes ``topk_idx=``, ``num_rows=`` (a static receive
      size) and ``dispatch_id=`` instead of ``status``; the Buffer runs the argument check
      (:meth:`agree`, with this rank's status) before it.
    - ``budget_on_device``: with ``num_rows`` the plan keeps R on the device
      (``num_recv_tokens`` None, see :class:`Plan`).
    - ``device_checks``: every launch compares the ranks' calls on the device, so the Buffer
      compares a call signature on the host only the first time it appears.
    - ``refuse(operation, err)``: takes part in an operation with no rows for a rank whose own
      arguments were refused, so its peers finish at once.
    - ``check_errors()``: raises what the device recorded (timeouts, mismatched calls),
      reading host memory only.
    """

    plans_on_comm_thread: bool
    progress: Progress

    def agree(self, fields: dict[str, Field], what: str, status: int = 0) -> Steps[None]:
        """Steps comparing ``fields`` (the operation first) and every rank's ``status`` across
        ranks before an operation whose sizes are not exchanged (combine, cached dispatch), on
        every backend; ValueError names each refusing rank, or the first field and the ranks
        that differ (:mod:`moe_dispatch.transport.agreement`). A refusing rank passes its
        non-zero status and -1 fields, takes part, and raises its own error afterwards."""

    def plan(
        self,
        is_token_in_rank: torch.Tensor,
        fields: dict[str, Field],
        what: str = "dispatch",
        on_comm_thread: bool = False,
        status: int = 0,
    ) -> Steps[Plan]:
        """Steps exchanging a fresh dispatch's counts (``is_token_in_rank [T, W]`` bool) and
        comparing ``fields`` and every rank's ``status`` across ranks; returns the
        :class:`Plan`. ``on_comm_thread``: the steps run on the communication thread, not the
        caller's. A refusing rank (``status`` != 0) passes ``[0, W]`` and -1 fields; then
        every rank raises ValueError after the exchange, as in :meth:`agree`."""

    def dispatch(
        self,
        tensors: list[torch.Tensor],
        is_token_in_rank: torch.Tensor,
        plan: Plan,
        out: list[torch.Tensor],
        what: str = "dispatch",
    ) -> Steps[None]:
        """Steps moving ``tensors`` = ``[x, (fp8 scales), topk_idx, (topk_weights)]`` (``[T, ...]``
        each) into ``out`` (``[R, ...]`` each) in (source rank, source token) order; top-k ids
        arrive in global numbering."""

    def forward(self, tensors: list[torch.Tensor], plan: Plan, out: list[torch.Tensor], what: str) -> Steps[None]:
        """Steps replaying ``plan``'s dispatch for row tensors ``[T, ...]`` into ``out`` ``[R, ...]``
        (cached dispatch, combine's backward)."""

    def combine(
        self,
        tensors: list[torch.Tensor],
        scales: list[torch.Tensor | None],
        plan: Plan,
        out: list[torch.Tensor],
        what: str,
    ) -> Steps[None]:
        """Steps summing each tensor's rows ``[R, ...]`` (times its ``[R]`` fp32 scale, if any) in
        fp32 onto their source tokens in ``out`` ``[T, ...]``, in the order of
        ``moe_dispatch.reference.combine``."""

    def close(self) -> None:
        """Frees what the transport holds: its process groups, threads, store keys and buffers
        (collective: every rank, after its last operation)."""

    def release(self) -> None:
        """Frees what needs no peer (local, no collective): for a broken Buffer's close() and
        a Buffer dropped without close(). Idempotent."""


@dataclasses.dataclass(eq=False)
class PlanSlot:
    """A dispatch's index plan and the row counts around it.

    ``plan`` is set when the dispatch returns, except for a ``num_worst_tokens`` dispatch: that
    one computes it on the communication thread/stream, where every later user of the slot
    runs after it (one ordered queue per Buffer).

    Attributes:
        num_tokens: T, tokens the source sent.
        num_rows: rows of the receive-side tensors (R, or ``num_worst_tokens``).
        plan: the transport's plan (its first ``min(R, num_rows)`` rows are valid; R is
            ``plan.num_recv_tokens``, or ``plan.recv_count`` on the device when that is None).
        permute: a fused permute's handle (set once the top-k ids arrived): then the receive-side
            row tensors of every operation on this slot are expert-major, ``[P, ...]``.
        dispatch_id: the dispatch's operation number on its Buffer, equal on every rank of a
            consistent program (combine and cached dispatch compare it across ranks: on the host,
            or, with the kernels, in their operation header on the device); set when the
            dispatch is issued.
        overflow: ``[1]`` bool on the device, for a dispatch with ``num_worst_tokens``: more
            than ``num_rows`` rows arrived (set once the dispatch completed); None otherwise.
    """

    num_tokens: int
    num_rows: int
    plan: Plan | None = None
    permute: PermuteHandle | None = None
    dispatch_id: int = -1
    overflow: torch.Tensor | None = None


@dataclasses.dataclass(eq=False)
class ExpertLayout:
    """A fused permute's layout (``Buffer.dispatch_to_experts``): the received rows land in
    expert-major blocks for the local experts, as :func:`moe_dispatch.ops.permute.permute` defines
    them (``pad_multiple``, the static budget ``num_permuted_tokens`` or the fixed blocks
    ``expert_capacity``). ``tokens_per_expert`` ``[E_local]`` int64 is an output: the blocks'
    rows, written once the top-k ids arrived."""

    num_local_experts: int
    pad_multiple: int = 1
    num_permuted_tokens: int | None = None
    expert_capacity: int | None = None
    tokens_per_expert: torch.Tensor | None = None

    @property
    def num_rows(self) -> int | None:
        """P when static (a budget or fixed blocks), else None (it follows the received ids)."""
        if self.expert_capacity is not None:
            return self.num_local_experts * self.expert_capacity
        return self.num_permuted_tokens


@dataclasses.dataclass(eq=False)
class FreshDispatch:
    """The routing a fresh (not cached) dispatch carries to its data movement.

    Attributes:
        slot: where the plan goes (already set unless ``num_worst_tokens``).
        fields: the arguments every rank must agree on (compared by the plan's steps).
        is_token_in_rank: ``[T, W]`` bool layout of the sent tokens.
        topk_idx: ``[T, K]`` int32/int64 global expert ids, ``-1`` = none.
        num_experts: E.
        recv_topk_idx: ``[num_rows, K]`` output: local expert ids of the received rows, -1
            elsewhere.
        num_recv_tokens_per_expert: ``[E/W]`` int64 output.
        layout: a fused permute's layout, or None (rows in receive order).
        on_overflow: with ``num_worst_tokens``, what more rows than ``num_rows`` do: ``"raise"``
            (BudgetOverflowError where the dispatch completes) or ``"drop"`` (the rows past
            ``num_rows`` are left out, ``slot.overflow`` says so).
    """

    slot: PlanSlot
    fields: dict[str, Field]
    is_token_in_rank: torch.Tensor
    topk_idx: torch.Tensor
    num_experts: int
    recv_topk_idx: torch.Tensor
    num_recv_tokens_per_expert: torch.Tensor
    layout: ExpertLayout | None = None
    on_overflow: Literal["raise", "drop"] = "raise"


@dataclasses.dataclass(eq=False)
class Call:
    """What one Buffer operation (a dispatch, a combine, or a backward pass) carries from its
    entry point through the autograd Functions to the data movement, and what it hands back.

    Attributes:
        mode: ``"sync"`` (returns complete), ``"async"`` (returns as soon as the transfer is
            queued, with :attr:`event`), ``"hook"`` (issues the first collective, returns with
            :attr:`hook`).
        allocate_on_comm_stream: on CUDA, outputs come from the communication stream's pool.
        wgrad_store: a dispatch's ``DelayedWgrad``, run in its backward while the gradient
            combine is in flight.
        dispatch: a fresh dispatch's routing; None for every other operation.
        seq: the operation's number when the entry point already took it (a fresh dispatch's
            plan), else None (taken when the data moves).
        event: set by the data movement in ``"async"`` mode: marks completion.
        hook: set by the data movement in ``"hook"`` mode: completes the operation.
    """

    mode: Literal["sync", "async", "hook"] = "sync"
    allocate_on_comm_stream: bool = False
    wgrad_store: DelayedWgrad | None = None
    dispatch: FreshDispatch | None = None
    seq: int | None = None
    event: EventOverlap | None = None
    hook: RecvHook | None = None
