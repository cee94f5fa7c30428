"""What one Buffer operation carries from its entry point, through the autograd Functions, to
the data movement and back: the per-call launch settings (:class:`Call`), a fresh dispatch's
routing (:class:`FreshDispatch`), and the plan slot a handle keeps (:class:`PlanSlot`) with a
fused permute's layout (:class:`ExpertLayout`)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Literal

import torch

from ..control.agreement import Field
from ..semantics.permute import PermuteHandle, PermuteLayout
from ..transport.base import Plan

if TYPE_CHECKING:
    from ..overlap import DelayedWgrad
    from .queue import EventOverlap, RecvHook


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
        permuted_after: ``permute`` lays out rows that a ``num_worst_tokens`` dispatch received in
            receive order (``num_rows`` of them): every operation on this slot moves rows in
            receive order and (un)permutes them on the caller's stream (:mod:`moe_dispatch.ops.permute`,
            no host sync with a static P), instead of landing them expert-major.
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
    permuted_after: bool = False
    dispatch_id: int = -1
    overflow: torch.Tensor | None = None


@dataclasses.dataclass(eq=False)
class ExpertLayout(PermuteLayout):
    """A fused permute's layout (``Buffer.dispatch_to_experts``): the received rows land in
    expert-major blocks for the local experts, the
    :class:`~moe_dispatch.semantics.permute.PermuteLayout` of
    :func:`moe_dispatch.ops.permute.permute`. ``tokens_per_expert`` ``[E_local]`` int64 is an
    output: the blocks' rows, written once the top-k ids arrived."""

    tokens_per_expert: torch.Tensor | None = None


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
