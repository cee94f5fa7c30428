"""The two-stage hierarchy on torch.distributed sub-group ``all_to_all_single``.

Portable (gloo on CPU, NCCL on GPU, PCIe-safe) and the executable mirror of the CUDA kernels'
orchestration. Rank (n, l) is node n, local index l (see ``Topology``).

Dispatch:
  metadata (group: all EP ranks, the one of the argument checks, in the Buffer's queue): each
    source tells each destination d how many of its tokens reach d's node and each rank of d's
    node, per sub-range of its tokens, plus its own send sizes by either route, behind its
    agreement row (:mod:`moe_dispatch.control.agreement`). From that every rank knows every
    split below and its receive count before any payload moves (so outputs can be allocated up
    front and the payload can move asynchronously), and every rank takes the same route. Small
    calls' rows travel in the same blocks (one collective per dispatch and per combine, see
    :data:`.tuning.FUSED_BYTES`, :mod:`.blocks`):
  flat (small calls, and worlds of one node or one rank per node): one exchange over all ranks,
    each token once to each rank that holds it; rows arrive in final order.
  two-stage (the rest):
    stage 1 (inter-node, group {(m, l) for all m}): each token goes once to every node m that
      holds it, to the forwarder (m, l) with the sender's local index; the copy for the
      sender's own node stays local.
    stage 2 (intra-node, group {(n, l') for all l'}): the forwarder hands each token to the
      local ranks that own its experts.
  Landing: the receiver writes each row tensor in (source rank, source token) order, or, for a
  fused permute, each expert-major output row straight from the receive buffer (one gather).
Combine runs backwards: receivers return rows to forwarders, forwarders sum their node's
contributions in fp32 (ascending local rank) and round to the payload dtype, so each
(token, node) pair crosses the network once; sources sum node partials in fp32 (ascending
node) and round: the summation order (:mod:`moe_dispatch.semantics.summation`). The flat
route runs both sums at the source, the same sums in the same order. A fused permute's
expert-major rows are summed per received row (ascending expert, fp32) straight into the send
buffer. Every sum is :func:`moe_dispatch.semantics.sums.ordered_sum` (:mod:`moe_dispatch.ops.sums`:
in one pass on CPU), planned once per dispatch (:mod:`.sums`).

Pipeline (two-stage). Each source splits its tokens into contiguous chunks; every stage runs
once per chunk, and the inter-node and intra-node groups (separate process groups) carry
different chunks at the same time, so the slow inter-node link never waits for the node::

    dispatch   inter-node | S1(0) | S1(1) | S1(2) | S1(3) |
               intra-node         | S2(0) | S2(1) | S2(2) | S2(3) | land
    combine    intra-node | S2(0) | S2(1) | S2(2) | S2(3) |
               forwarder          | sum 0 | sum 1 | sum 2 | sum 3 |
               inter-node         | S1(0) | S1(1) | S1(2) | S1(3) | (sum i lands after S1(i))

A token lives in exactly one chunk, so every sum above runs over the same rows in the same
order as without chunks: results are bit-identical for any chunk count and either route.
Stage 2 of all chunks lands in one buffer that a single gather puts in final order (a
per-chunk scatter would be many times slower on CPU). The depth follows the size: one chunk
per :data:`.tuning.CHUNK_BYTES` of the largest stage-1 payload, at most
:data:`.tuning.NUM_CHUNKS`. Calls where the cross-node bytes the two stages save would not pay
for their second collective and the forwarded rows take the flat route (one collective instead
of two; the combine order is the semantics', not the route's): on NCCL (GPU links) calls whose
largest flat payload is at most :data:`.tuning.FLAT_BYTES`, or whose routing the two stages
would de-duplicate by less than :data:`.tuning.MIN_DEDUP` of the cross-node rows; on gloo,
where links range from a loopback to a shaped or real network, as the links measured once per
transport predict (:func:`.route.measure_links`). An explicit ``num_chunks`` fixes the
two-stage route at that depth (:func:`.route.choose_route`).

Every stage moves all row tensors of one call as a single packed uint8 buffer, so a stage is
one collective per chunk whatever the number of tensors (:mod:`.packing`). Operations are
written as generators that yield each collective they wait for (a
:class:`.collectives.Pending`; others may be in flight meanwhile; :mod:`.pipeline`): the steps
of :mod:`moe_dispatch.transport.base`, which ``drive`` runs to completion; callers may instead
stop after the first yield to overlap the first transfer with their own work. A combine or
cached dispatch given its argument check (``check``) carries its flat rows in the check's blocks
where they fit; on the two-stage route it starts the check, packs its first payload meanwhile,
and completes the check before that payload moves.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from ...control import ControlPlane
from ...control.agreement import AGREE_WORDS, Field
from ...semantics.permute import PermuteHandle
from ...topology import Topology
from ..base import Capabilities, PlanRequest, Steps, Transfer, Transport, TransportOptions
from .blocks import Agreement, Blocks, begin, complete
from .collectives import ALL_COMM, Collectives
from .packing import Carried, field_views, land, packed_width, specs_of
from .pipeline import flat_dispatch, flat_exchange, two_stage_combine, two_stage_dispatch, two_stage_forward
from .plan import NUM_SIZES, TorchDistPlan, dispatch_counts, final_of_arrival, flat_send_idx, plan_from_headers
from .route import Links, choose_route, measure_links, measured_links, two_stage_world
from .sums import flat_sums, row_scales, unpermute
from .tuning import NUM_CHUNKS


class TorchDistTransport(Transport):
    """Hierarchical dispatch/combine for one EP group over torch.distributed (a
    :class:`~moe_dispatch.transport.base.Transport`).

    Args:
        control: the EP group's control plane (its host group carries the argument checks, and on
            gloo every collective of the Buffer's queue).
        topology: this rank's place in the group.
        options: ``timeout_s`` bounds every collective (a peer that never joins makes it raise
            :class:`~moe_dispatch.errors.CommError` naming the operation and the peers);
            ``num_chunks`` is the two-stage pipeline depth (module docstring), the same on every
            rank; 1 runs the stages one after the other. None (default): the route and depth
            follow each dispatch's size (flat for small calls and for worlds of one node or one
            rank per node, or little de-duplication; one chunk per :data:`.tuning.CHUNK_BYTES`,
            at most :data:`.tuning.NUM_CHUNKS`).

    Raises:
        ValueError: ``num_chunks`` is neither None nor a positive int.

    Collective: construction creates the sub-groups and must be called by every rank of the EP
    group (each rank joins its own inter-node, intra-node and, on NCCL, all-ranks groups).
    """

    name = "torch_dist"
    # A fresh dispatch's counts travel in the Buffer's one queue, on the group of the checks, behind
    # every rank's agreement row: every first collective of an operation is the same block exchange,
    # so ranks running different operations (or a dispatch sized on one rank and num_worst_tokens on
    # another) get a ValueError.
    capabilities = Capabilities(checks_in_plan=True)

    def __init__(self, control: ControlPlane, topology: Topology, options: TransportOptions):
        super().__init__(control, topology, options)
        num_chunks = options.num_chunks
        if num_chunks is not None and not (isinstance(num_chunks, int) and num_chunks >= 1):
            raise ValueError(f"num_chunks must be a positive int or None (automatic), got {num_chunks!r}")
        self.timeout_s = options.timeout_s
        self.num_chunks = num_chunks
        # The count sub-ranges of a fresh dispatch, and the words of every block's header: the
        # agreement row, the rows of payload the block carries (-1: none), the sender's sizes,
        # then its counts for the destination, per sub-range.
        self._subs = num_chunks or (NUM_CHUNKS if two_stage_world(topology) else 1)
        header_words = AGREE_WORDS + 1 + NUM_SIZES + self._subs * (topology.ranks_per_node + 1)
        self._links_key = (tuple(control.group_ranks), topology.ranks_per_node)  # see _links
        self.comm = Collectives(control, topology, control.backend)
        self.blocks = Blocks(self.comm, header_words)

    @property
    def groups(self) -> dict[str, dist.ProcessGroup | None]:
        """This transport's process groups by kind (:mod:`.collectives`; None: a group of one)."""
        return self.comm.groups

    def close(self) -> None:
        """Frees this transport's own sub-groups (local: the runtime's barrier on the control
        plane came first; the payload lives in the tensors of each call, nothing else to free)."""
        self.comm.close()

    def release(self) -> None:
        """Frees what needs no peer (local, no collective; what a Buffer dropped without close()
        gets): destroys this transport's own process groups. Idempotent."""
        self.comm.release()

    def agree(self, fields: dict[str, Field], what: str, status: int = 0) -> Agreement:
        """The argument check of an operation whose sizes are not exchanged (combine, cached
        dispatch, the kernels' plan): iterating it gives its steps, one block exchange on the host
        group (the comm thread's group on gloo, a gloo group of the same ranks on NCCL, so no
        device synchronisation), then :func:`agreement.check` on every rank. Ranks that disagree
        would abort inside gloo, or hang or read garbage on NCCL, had the payload moved first.
        Given to :meth:`combine` or :meth:`forward` as ``check``, the flat route's rows travel in
        the same blocks where they fit (:data:`.tuning.FUSED_BYTES`). The wire format and the
        messages: :mod:`moe_dispatch.control.agreement`.

        Args:
            fields: at most ``AGREE_FIELDS`` fields, the operation first (same keys on every rank).
            what: the operation, for messages.
            status: 0, or this rank's refusal (:func:`agreement.status_of`; its fields are then
                -1, and its text was posted with ``progress.post_refusal``).

        Raises (from the steps):
            ValueError: a rank refused (naming each and quoting its error), or naming the first
                field and the EP ranks that differ from this rank.
            CommError: a peer failed or did not join within ``timeout_s``.
        """
        return Agreement(self.blocks, fields, what, status)

    # -- route -------------------------------------------------------------------------------
    def _links(self) -> Links:
        """The links of this transport's ranks, measured the first time a gloo call asks
        (:func:`.route.measure_links`; collective) and kept for every later transport over the
        same ranks and nodes in this process."""
        return measure_links(self.comm, self._links_key)

    @property
    def measured_links(self) -> Links | None:
        """The links :meth:`_links` measured for these ranks and nodes in this process, or None
        where no call has needed them yet (small calls, NCCL)."""
        return measured_links(self._links_key)

    def _route(self, plan: TorchDistPlan, row_bytes: int) -> None:
        """Chooses ``plan``'s route and depth for rows of ``row_bytes`` packed bytes, once
        (:func:`.route.choose_route`)."""
        choose_route(plan, row_bytes, self.topology, self.num_chunks, self.comm.agree_kind == ALL_COMM, self._links)

    # -- dispatch ----------------------------------------------------------------------------
    def plan(self, request: PlanRequest) -> Steps:
        """Steps that exchange the layout counts and return the :class:`TorchDistPlan` (its route
        is chosen by the first payload transfer); one block exchange on the all-ranks group, the
        one every argument check uses (:meth:`agree`), so the blocks have the same size whatever
        operation a peer runs, and the operation is the first field compared.

        What it reads of ``request`` (:class:`~moe_dispatch.transport.base.PlanRequest`):
            is_token_in_rank: ``[T, W]`` bool, as from ``get_dispatch_layout``; the per-rank and
                per-node counts are taken per sub-range of the tokens from it.
            fields: arguments that must agree on every rank (ints, bools, dtypes, the same keys
                everywhere). They ride in front of the counts, after this rank's status
                (:mod:`~moe_dispatch.control.agreement`), so they are compared before any
                payload moves and the message has the same size on every rank whatever they
                hold (a size mismatch inside a collective aborts the process instead of raising).
            status: 0, or this rank's refusal: then ``is_token_in_rank`` is ``[0, W]`` (zero
                counts), the fields are -1, and every rank raises after the exchange.
            rows: the dispatch's row tensors ``[T, ...]`` (what :meth:`dispatch` will get), or
                None. Where they fit the blocks (the previous dispatch's size, see
                :data:`.tuning.FUSED_BYTES`) they travel with the counts, and if every rank's did
                and the route is flat, :meth:`dispatch` only lands them: one collective per
                dispatch.
            (``topk_idx``, ``num_rows``, ``dispatch_id`` are unused: the counts size the receive.)

        Raises (from the steps):
            ValueError: a rank refused (naming each and quoting its error), or naming the first
                field and the EP ranks that differ from this rank.
        """
        is_token_in_rank, fields, what, rows = request.is_token_in_rank, request.fields, request.what, request.rows
        topo = self.topology
        world = topo.world_size
        device, num_tokens = is_token_in_rank.device, is_token_in_rank.shape[0]
        subs = self._subs
        bounds = [c * num_tokens // subs for c in range(subs + 1)]
        checked = {"operation": "dispatch (metadata)", **fields}
        head = self.blocks.headers(checked, request.status, device)
        sizes_at = AGREE_WORDS + 1  # header words: agreement row, carried rows, sizes, counts
        per_sub, in_node, send_idx = dispatch_counts(is_token_in_rank, bounds, topo, head, sizes_at)
        fused = None
        if rows is not None and self.blocks.capacity and device.type == "cpu":
            width = packed_width(rows)
            send_splits = [sum(col) for col in zip(*per_sub.tolist())][:world]
            if max(send_splits) * width <= self.blocks.capacity:
                send_idx = flat_send_idx(is_token_in_rank) if send_idx is None else send_idx
                fused = ([(t, send_idx) for t in rows], send_splits)
        if self.comm.groups[ALL_COMM] is None:
            got, recv = head, None
        else:
            got, recv = yield from self.blocks.exchange(head, f"{what} metadata", ALL_COMM, fused)
        # Every header and my counts as host ints in one transfer (one host sync on GPU).
        host = torch.cat([got.flatten(), per_sub.flatten()]).tolist()
        words = got.shape[1]
        rows_of = [host[w * words : (w + 1) * words] for w in range(world)]
        self.control.verify([r[:AGREE_WORDS] for r in rows_of], checked, what)
        plan = plan_from_headers(
            rows_of, host[world * words :], is_token_in_rank, in_node, bounds, send_idx, topo, sizes_at
        )
        carried = [r[AGREE_WORDS] for r in rows_of]
        if recv is not None and all(n >= 0 for n in carried):  # every rank's rows came along
            self._route(plan, width)  # the packed rows' width: set where the rows were fused
            if plan.flat:
                plan.arrived = self.blocks.carried(recv, carried, plan.counts.from_rank, width, what)
        return plan

    def dispatch(
        self,
        transfer: Transfer,
        is_token_in_rank: torch.Tensor,
        permute: tuple[int, Callable[[], PermuteHandle]] | None = None,
    ) -> Steps:
        """Steps that move row tensors ``[T, ...]`` to the ranks holding each token and write
        them, in (source rank, source token) order, into ``transfer.out`` (``[R, ...]`` each);
        the first payload chooses the plan's route, and two-stage ones fill the chunks' stage-2
        indices.

        ``permute = (k, layout)`` fuses a permute: ``tensors[:k]`` land expert-major into
        ``out[:k]`` (``[P, ...]``) as the :class:`~moe_dispatch.semantics.permute.PermuteHandle`
        ``layout()`` lays the received rows out (zero padding rows); ``layout`` is called once
        ``out[k:]`` hold their rows (it reads the received top-k ids)."""
        tensors, plan, out, what = transfer.tensors, transfer.plan, transfer.out, transfer.what
        width = packed_width(tensors)
        self._route(plan, width)
        self.blocks.resize(plan, width, self._links)
        if plan.arrived is not None:  # the rows came with the counts
            recv, plan.arrived = plan.arrived, None
            land(recv, plan.recv_perm, specs_of(tensors), out, permute)
            return
        if plan.flat:
            yield from flat_dispatch(self.comm, self.blocks, tensors, plan, out, what, permute)
            return
        recv2 = yield from two_stage_dispatch(self.comm, tensors, is_token_in_rank, plan, what)
        land(recv2, plan.recv_perm, specs_of(tensors), out, permute)

    def forward(self, transfer: Transfer, permuted: PermuteHandle | None = None, check: Steps | None = None) -> Steps:
        """Steps replaying a plan's dispatch for other row tensors ``[T, ...]`` into
        ``transfer.out`` (cached dispatch, combine's backward); with ``permuted`` (a permute
        handle of the received rows) into ``[P, ...]`` outputs in its expert-major layout (a
        fused permute's replay). ``check``: the argument check, started before the first payload
        is packed and completed before it moves."""
        tensors, plan, out, what = transfer.tensors, transfer.plan, transfer.out, transfer.what
        if plan.flat:
            yield from flat_dispatch(self.comm, self.blocks, tensors, plan, out, what, None, permuted, check)
            return
        recv2 = yield from two_stage_forward(self.comm, tensors, plan, what, check)
        land(recv2, plan.recv_perm, specs_of(tensors), out, None, permuted)

    # -- combine -----------------------------------------------------------------------------
    def combine(
        self, transfer: Transfer, permuted: list[PermuteHandle | None] | None = None, check: Steps | None = None
    ) -> Steps:
        """Steps summing received rows back onto their source tokens.

        Args:
            transfer: its ``tensors``, floating row tensors: ``[R, ...]`` in dispatch's receive
                order, or, where ``permuted`` gives a permute handle of the received rows,
                ``[P, ...]`` in its expert-major layout (padding rows ignored): a received row is
                then the fp32 sum of its copies in ascending row order (unpermute), rounded; its
                ``scales``, per tensor None or ``[R]`` fp32 row scales applied (in fp32) before
                summing; its ``out``, per tensor ``[T, ...]`` in its dtype, written with the sums
                in the order of the module docstring.
            permuted: per tensor None or the handle; None = all None.
            check: the argument check, started before the first payload is prepared and
                completed before it moves.

        Raises:
            ValueError: row scales given with an expert-major tensor.
        """
        tensors, scales, plan, out, what = transfer.tensors, transfer.scales, transfer.plan, transfer.out, transfer.what
        permuted = permuted if permuted is not None else [None] * len(tensors)
        if any(s is not None for s in scales) and any(p is not None for p in permuted):
            raise ValueError("combine: row scales apply to received rows, not to expert-major ones")
        arrival = None if plan.flat else final_of_arrival(plan)
        # Each tensor's received rows in arrival order: the expert-major ones summed straight there
        # (one pass), the others gathered there as they are packed (index None: in order already).
        # The flat route's rows travel in the check's blocks where they fit; else the check starts
        # first and the rows are made while it is in flight.
        width = packed_width([*tensors, *[s.view(-1, 1) for s in scales if s is not None]])
        in_blocks = plan.flat and tensors and self.blocks.carries(plan.flat_recv_splits, width, tensors[0].device)
        begun = None if in_blocks else begin(check)
        rows_of = [t if h is None else unpermute(plan, t, h) for t, h in zip(tensors, permuted)]
        index_of = [arrival if h is None else None for h in permuted]
        # Scales travel as extra fp32 columns so whoever sums multiplies in fp32.
        payload = [*rows_of, *[s.view(-1, 1) for s in scales if s is not None]]
        payload_index = [*index_of, *[arrival for s in scales if s is not None]]
        if plan.flat:
            fields = list(zip(payload, payload_index))
            if not in_blocks:
                yield from complete(check, begun)
                check = None
            # the sums read the rows in the blocks they came in, where they came in the check's
            back = yield from flat_exchange(
                self.comm,
                self.blocks,
                fields,
                plan.flat_recv_splits,
                plan.flat_send_splits,
                what,
                check,
                in_blocks=True,
            )
            specs = specs_of(payload)
            fields = back.fields(specs) if isinstance(back, Carried) else field_views(back, specs)
            for dst, rows, sc in zip(out, fields[: len(tensors)], row_scales(fields, scales, len(tensors))):
                flat_sums(plan, rows, sc, dst, self.topology)
            return
        yield from two_stage_combine(self.comm, tensors, payload, payload_index, scales, out, plan, what, check, begun)
