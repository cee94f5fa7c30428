"""The data movement of one Buffer (:class:`Transfers`): a fresh dispatch's plan, the dispatch,
its replays (cached dispatch, combine's backward) and combine, each allocated, checked across
ranks and queued in the Buffer's :class:`~.queue.OperationQueue`; a refusal of this rank's own
arguments taken part in, so its peers raise at once; the static budget (``num_worst_tokens``)."""

from __future__ import annotations

import functools
import math
from typing import NoReturn

import torch

from ..control import ControlPlane, agreement
from ..control.agreement import DISPATCH_FIELDS, DispatchId, Field
from ..errors import ArgumentTypeError, BudgetOverflowError, CommError, InvalidArgumentError, MismatchError, error_name
from ..ops.layout import localize_topk_idx_cpu
from ..ops.permute import permute, permute_map_cpu, permute_map_triton, unpermute
from ..semantics.permute import PermuteHandle, gather_rows, permuted_sources
from ..semantics.validation import dense
from ..topology import Topology
from ..transport.base import Plan, PlanRequest, Transfer, Transport, byte_rows
from .calls import Call, FreshDispatch, PlanSlot
from .queue import OperationQueue, drive, stream_order_wait


def _release(transport: Transport, control: ControlPlane) -> None:
    """Frees, without a collective, what a Buffer made: its transport, then its control plane."""
    transport.release()
    control.release()


def dispatch_fields(
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


def _signature_key(fields: dict[str, Field], device_checked: dict[str, frozenset[str]]) -> tuple:
    """A call signature: its checked fields but those the device compares in every launch
    (``device_checked``, the transport's ``capabilities.device_checked_fields``). Whether a
    signature is new must not depend on such a value: ranks that disagree on one would otherwise
    split, some into the host check of a new signature, the others into the kernels of one they
    have seen, and wait for each other until ``timeout_s`` instead of comparing headers."""
    carried = device_checked.get(fields["operation"], frozenset())
    return tuple((name, value) for name, value in fields.items() if name not in carried)


class Transfers:
    """The data movement of one Buffer: what the Buffer's entry points and the autograd
    Functions (:mod:`.autograd`) call to move rows.

    :meth:`dispatch`, :meth:`forward` and :meth:`combine` allocate their outputs, queue the
    transport's steps in the Buffer's :class:`~.queue.OperationQueue` and return the outputs,
    launched as their :class:`~.calls.Call` says: ``"sync"`` returns complete, ``"async"`` sets
    ``call.event``, ``"hook"`` issues the first collective and sets ``call.hook``. Each is
    collective over the EP group. On CPU a synchronous transfer with nothing queued before it
    runs on the caller's thread: the same order, without handing it to the communication
    thread and back.

    Argument checks across ranks: a transport whose operations exchange their sizes (torch_dist)
    compares the arguments of every operation. The kernels compare them on the device in every
    launch (their operation header, ``capabilities.device_checks``); then the host compares them
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
        control: the EP group's control plane (closed with the transport).
        transport: the Buffer's transport.
        topology: this rank's place in the EP group.
        device: the Buffer's device (CUDA: the communication stream lives there).

    Attributes:
        queue: the Buffer's :class:`~.queue.OperationQueue` (its state, its thread guard).
    """

    def __init__(self, control: ControlPlane, transport: Transport, topology: Topology, device: torch.device):
        self.control, self.transport, self.topology, self.device = control, transport, topology, device
        self.queue = OperationQueue(topology.rank, device, functools.partial(_release, transport, control))
        self._signatures: set[tuple] = set()  # call signatures checked across ranks on the host
        # Sync-free dispatches' topk_idx checked on the device: set when one had bad values.
        self._bad_topk_idx = torch.zeros((), dtype=torch.bool, device=device)
        self._topk_idx_unread = False  # whether _bad_topk_idx may be set (a sync-free dispatch since)

    @property
    def sync_free(self) -> bool:
        """Whether a ``num_worst_tokens`` dispatch runs without any host synchronisation: the
        transport keeps the counts on the device and checks the ranks' arguments there."""
        caps = self.transport.capabilities
        return caps.budget_on_device and caps.device_checks

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
        self.queue.check_open()
        self.queue.drain()
        self.queue.guarded(self._raise_recorded)

    def _raise_recorded(self) -> None:
        """Raises what the device recorded; the caller has synchronised with the operations."""
        self.transport.check_errors()
        self.raise_recorded_topk_idx()

    def close(self) -> None:
        """Waits for the queued transfers; once every rank got here (the control plane's barrier),
        closes the transport and the control plane (collective; once). A broken Buffer frees what
        it made locally, without waiting for its peers.

        Raises:
            CommError: a peer did not reach close() within the timeout (freed anyway).
        """
        if not self.queue.close():
            return
        if self.queue.broken:
            _release(self.transport, self.control)
            return
        try:
            self.control.barrier()
        except CommError as err:
            self.queue.break_(err)
            _release(self.transport, self.control)
            raise
        self.transport.close()
        self.control.close()

    def refuse(
        self,
        err: BaseException,
        operation: str,
        what: str,
        fields: dict[str, Field] | None = None,
    ) -> NoReturn:
        """Takes part, for a call this rank refuses with ``err``, in the check its peers run,
        with a non-zero status and ``err``'s text posted in the store (the agreement:
        :mod:`moe_dispatch.control.agreement`); once every rank has seen the refusal, raises
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
        call = Call(seq=self.queue.next_seq())
        self.transport.progress.post_refusal(call.seq, f"{error_name(err)}: {err}")
        if self.transport.capabilities.device_checks and self._checked_kind(operation):
            kind = "cached dispatch" if what == "cached dispatch" else operation.split(" (")[0]
            self._run(_steps_calling(self.transport.refuse, kind, err), call, [], f"{what} (refused)")
            raise self.transport.refusal(err) from err  # what the peers raise of it (Transfers._marked)
        empty = torch.zeros((0, self.topology.world_size), dtype=torch.bool, device=self.device)
        try:
            if operation == "dispatch (metadata)":
                self.plan(call, empty, fields, status=status)
            elif operation == "dispatch (num_worst_tokens)":
                self._run(self._plan(PlanRequest(empty, fields, status=status), call), call, [], what)
            else:
                self._run(self._check({"operation": operation}, what, status), call, [], what)
        except (ValueError, TypeError) as refused:  # the refusal itself, which every rank raises
            raise refused.with_traceback(None) from err
        raise err  # unreachable: the check raises every rank's refusal

    def allocate_budget(self, allocate):
        """``allocate()``'s tensors: receive buffers of a ``num_worst_tokens`` dispatch, allocated
        before its first collective, so a failure (out of memory) is refused as a bad
        ``num_worst_tokens`` (:meth:`refuse`: every rank raises, the Buffer stays usable).

        Raises:
            InvalidArgumentError: the allocation failed here (naming num_worst_tokens), or, via
                :meth:`refuse`, on a peer.
        """
        try:
            return allocate()
        except RuntimeError as err:  # torch.OutOfMemoryError is one
            reason = str(err).splitlines()[0] if str(err) else error_name(err)
            refusal = InvalidArgumentError(
                f"num_worst_tokens: the receive buffers of that many rows could not be allocated ({reason}); pass "
                "a smaller num_worst_tokens (a dispatch delivers at most the sum of every rank's tokens)",
                argument="num_worst_tokens",
                rank=self.topology.rank,
            )
            refusal.__cause__ = err
            what = "dispatch (num_worst_tokens)"
            self.refuse(refusal, what, what, agreement.refusing_fields(DISPATCH_FIELDS))

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
        ``call.seq``, which its payload transfer reuses. The exchange runs in the queue (the
        kernels: one queue for every launch; torch_dist: the counts share the checks' group), and
        the caller waits (on CPU with nothing queued, on the caller's thread: the same order).

        ``topk_idx``: ``[T, K]``, what the kernels' notify routes by. ``status``: this rank's
        refusal (see :meth:`refuse`), 0 otherwise. ``rows``: the row tensors the dispatch will
        move (as :meth:`dispatch` packs them), which a transport may send with the counts.

        Raises:
            ValueError: a rank refused, or ranks disagree on a field (naming it and the ranks).
            CommError: a peer failed or did not join in time.
        """
        with self.queue.entered("dispatch"):
            call.seq = call.seq or self.queue.next_seq()
            self.transport.progress.mark("caller", call.seq, "dispatch (metadata)")
            steps = self._marked(
                self._plan(PlanRequest(is_token_in_rank, fields, status=status, rows=rows, topk_idx=topk_idx), call),
                call.seq,
                "dispatch (metadata)",
            )
            if self.queue.idle_cpu():  # in queue order already (see OperationQueue.run)
                return self.queue.guarded(drive, steps)
            plan = stream_order_wait(self.queue.submit(drive, steps))
            self.queue.join()
            return plan

    def _plan(self, request: PlanRequest, call: Call):
        """Steps of a fresh dispatch's plan on the communication thread/stream: where the
        transport's plan does not compare the fields itself (``checks_in_plan``: torch_dist's
        counts carry them), the argument check first (:meth:`_check`; a refusal is the
        transport's plan's own check), then the plan, with the dispatch's identity
        (``call.seq``, taken when the steps run)."""
        if not (self.transport.capabilities.checks_in_plan or request.status):
            # The operation first, so it is told apart from a combine's check.
            yield from self._check({"operation": "dispatch (metadata)", **request.fields}, "dispatch")
        request.dispatch_id = call.seq
        return (yield from self.transport.plan(request))

    def dispatch(self, call: Call, x, topk_weights: torch.Tensor | None) -> list[torch.Tensor | None]:
        """A fresh dispatch (``call.dispatch`` says where to): allocates the outputs and moves x
        (a ``[T, H]`` tensor, or a list of row tensors such as the fp8 pair), topk_idx and
        topk_weights (``[T, K]`` fp32 or None) into them; converts topk_idx to local numbering
        into ``call.dispatch.recv_topk_idx`` (-1 for other ranks' experts), zeroes the weights
        of other ranks' experts and counts ``num_recv_tokens_per_expert``. A slot without a
        plan (static ``num_worst_tokens`` size) gets it here, first, and pads the outputs. With
        a layout (``call.dispatch.layout``) the x tensors and the weights come back expert-major:
        landed so where the plan is known, else (``num_worst_tokens``) permuted once the call
        completed (:meth:`_permute_received`; the call then returns complete).

        Returns:
            The received x tensors (``[num_rows, ...]`` each), then the received weights
            ``[num_rows, K]`` (or None); with a layout ``[P, ...]`` and ``[P]``.

        Raises (where the operation completes: here, the event or the hook):
            BudgetOverflowError: more rows arrived than ``num_worst_tokens`` (``on_overflow="raise"``).
        """
        routing = call.dispatch
        xs = x if isinstance(x, list) else [x]
        tensors = [dense(t) for t in [*xs, routing.topk_idx] + ([topk_weights] if topk_weights is not None else [])]
        slot = routing.slot
        if routing.layout is not None:
            if slot.plan is not None:
                return self._dispatch_permuted(call, tensors, len(xs))
            call.mode = "sync"  # permuted on the caller's stream once the rows are in
        budget = slot.plan is None  # num_worst_tokens: the plan comes with the transfer
        shapes = [(t, (slot.num_rows, *t.shape[1:])) for t in tensors]
        out = self.allocate_budget(lambda: self.queue.alloc(call, shapes)) if budget else self.queue.alloc(call, shapes)
        out[len(xs)] = recv_idx = routing.recv_topk_idx

        def steps():
            if budget:
                request = PlanRequest(
                    routing.is_token_in_rank, routing.fields, topk_idx=routing.topk_idx, num_rows=slot.num_rows
                )
                slot.plan = yield from self._plan(request, call)
            rows = slot.plan.num_recv_tokens
            if rows is None:  # the count is on the device: the kernels filled every row, padding too
                yield from self.transport.dispatch(
                    Transfer(tensors, slot.plan, out, "dispatch"), routing.is_token_in_rank
                )
                slot.overflow = slot.plan.overflow != 0
                _pad_rows(out, _padding(slot), recv_idx)
                if routing.on_overflow == "raise" and bool(slot.overflow):  # a host read, as asked
                    self._overflow(int(slot.plan.recv_count), slot.num_rows)
            else:
                # Past the static size the rows still arrive (peers send them regardless), into
                # scratch; they are dropped, or the overflow raised once the transfer is complete.
                stored, over = min(rows, slot.num_rows), rows > slot.num_rows
                dst = [o.new_empty((rows, *o.shape[1:])) for o in out] if over else [o[:rows] for o in out]
                yield from self.transport.dispatch(
                    Transfer(tensors, slot.plan, dst, "dispatch"), routing.is_token_in_rank
                )
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
        received = [*out[: len(xs)], out[-1] if topk_weights is not None else None]
        return received if routing.layout is None else self._permute_received(routing, received)

    @staticmethod
    def _permute_received(routing: FreshDispatch, received: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """The expert-major layout (``routing.layout``) of a completed ``num_worst_tokens``
        dispatch's rows (``received``: the x tensors, then the weights or None), on the caller's
        stream: sets ``slot.permute`` (``permuted_after``) and the layout's ``tokens_per_expert``;
        returns the permuted x tensors, then the permuted weights ``[P]`` (or None).
        :func:`~moe_dispatch.ops.permute.permute` of the received ids (this rank's own, localized:
        not checked again), so with a static P nothing waits for the host on CUDA."""
        layout, slot = routing.layout, routing.slot
        *xs, weights = received
        result = permute(
            tuple(xs) if len(xs) > 1 else xs[0],  # several x tensors: the fp8 pair
            routing.recv_topk_idx,
            weights,
            num_local_experts=layout.num_local_experts,
            pad_multiple=layout.pad_multiple,
            num_permuted_tokens=layout.num_permuted_tokens,
            expert_capacity=layout.expert_capacity,
            validate=False,
        )
        slot.permute, slot.permuted_after = result.handle, True
        layout.tokens_per_expert.copy_(result.tokens_per_expert)
        permuted = list(result.permuted_x) if len(xs) > 1 else [result.permuted_x]
        return [*permuted, result.permuted_probs]

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
        static = layout.static_rows
        if static is None:
            call.mode = "sync"
        recv = self.queue.alloc(call, [(t, (rows, *t.shape[1:])) for t in tensors[k + 1 :]])
        permuted = self.queue.alloc(call, [(t, (static or 0, *t.shape[1:])) for t in xs])
        if weighted:
            permuted += self.queue.alloc(call, [(tensors[-1], (static or 0,))])
        dst = [*permuted[:k], routing.recv_topk_idx, *recv]

        def expert_layout() -> PermuteHandle:
            # The top-k ids arrived: the permute's index phase, then (dynamic P) its outputs.
            self._localize(routing, recv[0] if recv else None)
            # the ids are this rank's own (localized above): no second check on the host
            index_phase = permute_map_triton if routing.recv_topk_idx.is_cuda else permute_map_cpu
            handle = index_phase(routing.recv_topk_idx, layout)
            slot.permute = handle
            layout.tokens_per_expert.copy_(handle.tokens_per_expert)
            if static is None:
                for j, t in enumerate(permuted):
                    permuted[j] = t.new_empty((handle.num_rows, *t.shape[1:]))
                dst[:k] = permuted[:k]
            return handle

        def steps():
            transfer = Transfer(tensors, slot.plan, dst, "dispatch")
            yield from self.transport.dispatch(transfer, routing.is_token_in_rank, permute=(k, expert_layout))
            if weighted:
                gather_rows(recv[0].view(-1, 1), permuted_sources(slot.permute)[1], out=permuted[-1].view(-1, 1))

        self._run(steps(), call, [*tensors, *recv, *permuted], "dispatch")
        slot.dispatch_id = call.seq
        return [*permuted[:k], permuted[-1] if weighted else None]

    def forward(self, slot: PlanSlot, tensors: list[torch.Tensor], call: Call, what: str) -> list[torch.Tensor]:
        """Replays a plan's dispatch for row tensors ``[T, ...]`` into new ``[num_rows, ...]``
        outputs (rows past the received ones zero), or, on a fused permute's slot, into
        ``[P, ...]`` expert-major ones (landed so, or, where the slot was ``permuted_after``,
        permuted on the caller's stream once the call completed); returns them."""
        tensors = [dense(t) for t in tensors]
        landed = None if slot.permuted_after else slot.permute  # expert-major as the rows land
        num_rows = slot.num_rows if landed is None else landed.num_rows
        if slot.permuted_after:
            call.mode = "sync"  # permuted on the caller's stream once the rows are in
        out = self.queue.alloc(call, [(t, (num_rows, *t.shape[1:])) for t in tensors])

        def steps():
            check = self._agree("dispatch", slot, tensors, 0, what)
            rows = slot.plan.num_recv_tokens
            if rows is None:  # the count is on the device (budget mode: no fused permute there)
                yield from self.transport.forward(Transfer(tensors, slot.plan, out, what), check=check)
                _pad_rows(out, _padding(slot))
                return
            if landed is not None:
                yield from self.transport.forward(Transfer(tensors, slot.plan, out, what), landed, check)
                return
            stored, over = min(rows, slot.num_rows), rows > slot.num_rows
            # scratch: the rows a drop left out arrive too
            dst = [o.new_empty((rows, *o.shape[1:])) for o in out] if over else [o[:rows] for o in out]
            yield from self.transport.forward(Transfer(tensors, slot.plan, dst, what), check=check)
            for o, d in zip(out, dst):
                if over:  # a dispatch that dropped rows: the same rows again
                    o.copy_(d[:stored])
                o[stored:].zero_()

        self._run(steps(), call, [*tensors, *out], what)
        if not slot.permuted_after:
            return out
        handle = slot.permute
        rows = tuple(out) if len(out) > 1 else out[0]  # several tensors: the fp8 pair
        permuted = permute(rows, None, num_local_experts=handle.num_local_experts, handle=handle).permuted_x
        return list(permuted) if len(out) > 1 else [permuted]

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
        (unpermute), fused into the transfer where the transport can, or on the caller's stream
        first where the slot was ``permuted_after``."""
        tensors = [dense(t) for t in tensors]
        if expert_major is None:
            expert_major = [slot.permute is not None] * len(tensors)
        if slot.permuted_after:
            tensors = [unpermute(t, slot.permute) if major else t for t, major in zip(tensors, expert_major)]
            expert_major = [False] * len(tensors)
        scales = [None if sc is None else dense(sc) for sc in scales]
        out = self.queue.alloc(call, [(t, (slot.num_tokens, *t.shape[1:])) for t in tensors])
        uses = [*tensors, *[sc for sc in scales if sc is not None], *out]

        def steps():
            check = self._agree("combine", slot, tensors, sum(sc is not None for sc in scales), what)
            rows = slot.plan.num_recv_tokens
            if rows is None:  # the kernels read only the rows they stored (budget mode: no fused permute)
                yield from self.transport.combine(Transfer(tensors, slot.plan, out, what, scales), check=check)
                return
            # the received rows, the ones a dropping dispatch left out as zeros
            ins = [t if major else _rows(t, rows) for t, major in zip(tensors, expert_major)]
            row_scales = [None if sc is None else _rows(sc, rows) for sc in scales]
            permuted = [slot.permute if major else None for major in expert_major]
            yield from self.transport.combine(Transfer(ins, slot.plan, out, what, row_scales), permuted, check)

        self._run(steps(), call, uses, what)
        return out

    def _marked(self, steps, seq: int, what: str):
        """``steps``, first recording on the thread that runs them that operation ``seq`` began.
        A peer's refusal recorded by the kernels is raised quoting the error it posted."""
        self.transport.progress.mark("comm", seq, what)
        try:
            return (yield from steps)
        except MismatchError as err:
            if err.field != "status" or err.kind is None:  # not a Buffer's refusal
                raise
            others = [r for r in range(self.topology.world_size) if r != self.topology.rank]
            texts = self.transport.progress.read_refusals(others, seq)
            quoted = "; ".join(f"EP rank {r} refused: {text}" for r, text in sorted(texts.items()))
            message = f"{err} ({quoted})" if quoted else str(err)
            if err.kind is TypeError:  # the refusing rank's kind on every rank, from its status
                raise ArgumentTypeError(message, argument=err.argument, rank=err.refuser) from err
            raise MismatchError(message, dict(vars(err))) from err

    def _run(self, steps, call: Call, uses: list[torch.Tensor], what: str) -> None:
        """Runs transport steps in the queue per ``call.mode`` (:meth:`.queue.OperationQueue.run`),
        marked with the operation's number, which it takes into ``call.seq`` unless the call has
        one."""
        with self.queue.entered(what):
            call.seq = call.seq or self.queue.next_seq()
            self.queue.run(self._marked(steps, call.seq, what), call, uses)

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
        if self.transport.capabilities.device_checks and not status:
            return self._check_first(fields, what)
        return self.transport.agree(fields, what, status)

    def _check_first(self, fields: dict[str, Field], what: str):
        """Steps of :meth:`_check` on a transport with ``device_checks``: the host check of a
        signature new to this Buffer, nothing for one seen before."""
        signature = _signature_key(fields, self.transport.capabilities.device_checked_fields)
        if signature in self._signatures:
            return
        yield from self.transport.agree(fields, what)
        self._signatures.add(signature)


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
        else:
            byte_rows(o).masked_fill_(padding.view(-1, 1), 0)
