"""The steps of the torch_dist routes: the flat exchange (one collective over all ranks, or none
where the rows ride in the blocks of the counts or the argument check), and the chunked two-stage
pipeline, in which the inter-node and intra-node groups carry different chunks at the same time
(the drawing: :mod:`.transport`). Each function is a generator of steps that yields every
collective it waits for (a :class:`~.collectives.Pending`), as
:mod:`moe_dispatch.transport.base` runs them."""

from __future__ import annotations

import itertools
from typing import Callable

import torch

from ...semantics.permute import PermuteHandle
from ..base import Steps
from .blocks import Agreement, Blocks, begin, complete
from .collectives import ALL_COMM, INTER, INTRA, Collectives
from .packing import field_views, land, pack, packed_width, specs_of
from .plan import TorchDistChunk, TorchDistPlan
from .sums import forwarder_sums, row_scales, source_sums


# -- the flat route --------------------------------------------------------------------------------
def flat_exchange(
    comm: Collectives,
    blocks: Blocks,
    fields: list,
    send_splits: list[int],
    recv_splits: list[int],
    what: str,
    check: Agreement | None = None,
    in_blocks: bool = False,
) -> Steps:
    """Steps moving the rows of ``fields`` (as :func:`.packing.pack` takes them, by destination)
    on the flat route; returns them packed, ``[R, wb]`` by source, or, with ``in_blocks``, maybe
    still in the blocks they came in (a :class:`~.packing.Carried`, for :func:`.packing.land` or
    the sums). With ``check`` the check runs first, or carries the rows (:meth:`Blocks.agreed`)."""
    what = f"{what} (flat exchange)"
    if check is not None:
        return (yield from blocks.agreed(check, (fields, send_splits, recv_splits, what, in_blocks)))
    recv, pending = comm.all_to_all(pack(fields), send_splits, recv_splits, ALL_COMM, what)
    yield pending
    return recv


def flat_dispatch(
    comm: Collectives,
    blocks: Blocks,
    tensors: list[torch.Tensor],
    plan: TorchDistPlan,
    out: list[torch.Tensor],
    what: str,
    permute: tuple[int, Callable[[], PermuteHandle]] | None = None,
    permuted: PermuteHandle | None = None,
    check: Agreement | None = None,
) -> Steps:
    """The flat route of a dispatch of ``tensors [T, ...]`` into ``out``: one exchange, rows
    arrive in final order; a replay's (``check``: its argument check) travel inside the check's
    blocks where they fit, and land from there (``permute``, ``permuted``: as
    :func:`.packing.land` takes them)."""
    fields = [(t, plan.flat_send_idx) for t in tensors]
    width = packed_width(tensors)
    if check is not None and not blocks.carries(plan.flat_send_splits, width, tensors[0].device):
        begun = begin(check)  # the rows go after the check: pack them while it is in flight
        fields = [(pack(fields), None)]
        yield from complete(check, begun)
        check = None
    recv = yield from flat_exchange(
        comm, blocks, fields, plan.flat_send_splits, plan.flat_recv_splits, what, check, True
    )
    land(recv, plan.recv_perm, specs_of(tensors), out, permute, permuted)


# -- the two stages --------------------------------------------------------------------------------
def two_stage_dispatch(
    comm: Collectives, tensors: list[torch.Tensor], is_token_in_rank: torch.Tensor, plan: TorchDistPlan, what: str
) -> Steps:
    """The two stages of a fresh dispatch of ``tensors [T, ...]`` with layout ``is_token_in_rank
    [T, W]`` bool; fills each chunk's stage-2 index and returns the stage-2 arrivals, packed ``[R,
    bytes]`` in arrival order (:func:`dispatch_pipeline`), each row also carrying its routing
    columns (``ranks_per_node`` bools after the tensors' fields).

    Raises (from the steps):
        RuntimeError: the forwarded rows disagree with the metadata (ranks passed different
            ``num_experts``).
    """
    topo = comm.topology
    num_tokens, local_ranks = is_token_in_rank.shape[0], topo.ranks_per_node
    routing = is_token_in_rank.view(num_tokens * topo.num_nodes, local_ranks)  # row t * N + node

    def send1(chunk):
        # Each row also carries the destination node's L columns of is_token_in_rank: the
        # forwarder's routing.
        rows = slice(chunk.begin, chunk.end)
        return pack(
            [
                *[(t[rows], chunk.s1_send_idx) for t in tensors],
                (routing[chunk.begin * topo.num_nodes : chunk.end * topo.num_nodes], chunk.s1_route_idx),
            ]
        )

    specs = [*specs_of(tensors), (torch.bool, (local_ranks,))]

    def route2(chunk, recv1):
        # The forwarder (n, l) hands each row to the local ranks of node n that hold it; it
        # keeps the rows packed and forwards them whole (routing columns too).
        in_local = field_views(recv1, specs)[-1]
        chunk.s2_send_idx = torch.nonzero(in_local.t())[:, 1]  # local-rank-major, rows ascending
        if chunk.s2_send_idx.numel() != sum(chunk.s2_send_splits):
            raise RuntimeError(
                f"EP rank {topo.rank}: {what}: forwarded rows ({chunk.s2_send_idx.numel()}) "
                f"disagree with the metadata ({sum(chunk.s2_send_splits)}); did every rank "
                f"pass the same num_experts?"
            )
        return chunk.s2_send_idx

    return (yield from dispatch_pipeline(comm, send1, route2, plan, what))


def two_stage_forward(
    comm: Collectives, tensors: list[torch.Tensor], plan: TorchDistPlan, what: str, check: Agreement | None
) -> Steps:
    """The two stages of a replay of ``plan``'s dispatch for ``tensors [T, ...]``; returns the
    stage-2 arrivals as :func:`two_stage_dispatch` does (without routing columns). ``check``: the
    argument check, started before the first payload is packed and completed before it moves."""
    begun = begin(check)

    def send1(chunk):
        return pack([(t[chunk.begin : chunk.end], chunk.s1_send_idx) for t in tensors])

    first = send1(plan.chunks[0])
    yield from complete(check, begun)
    return (yield from dispatch_pipeline(comm, send1, lambda chunk, recv1: chunk.s2_send_idx, plan, what, first))


def dispatch_pipeline(
    comm: Collectives,
    send1: Callable[[TorchDistChunk], torch.Tensor],
    route2: Callable[[TorchDistChunk, torch.Tensor], torch.Tensor],
    plan: TorchDistPlan,
    what: str,
    first: torch.Tensor | None = None,
) -> Steps:
    """Stage 1 of chunk c + 1 crosses nodes while stage 2 forwards chunk c. ``send1(chunk)``
    packs a chunk's stage-1 rows (``first``: chunk 0's, already packed), ``route2(chunk,
    recv1)`` returns the index of its stage-2 send rows in what stage 1 delivered; the stage-2
    rows of every chunk land back to back in one buffer, which the steps return (in arrival
    order). With one rank per node stage 2 stays on this rank and forwards every row (the
    index is ``arange``): its rows are gathered straight into that buffer, or, with one chunk,
    stage 1 delivered the buffer itself."""
    chunks = plan.chunks
    recv2, landed, in_flight = None, 0, []
    inter = comm.all_to_all(
        send1(chunks[0]) if first is None else first,
        chunks[0].s1_send_splits,
        chunks[0].s1_recv_splits,
        INTER,
        f"{what} stage 1",
    )
    for c, chunk in enumerate(chunks):
        following = chunks[c + 1] if c + 1 < len(chunks) else None
        packed = send1(following) if following is not None else None  # packed while chunk c is on the wire
        recv1, pending = inter
        yield pending
        if following is not None:
            inter = comm.all_to_all(
                packed, following.s1_send_splits, following.s1_recv_splits, INTER, f"{what} stage 1"
            )
        index = route2(chunk, recv1)
        if comm.groups[INTRA] is None and len(chunks) == 1 and index.numel() == recv1.shape[0]:
            return recv1  # every row forwarded to itself, in order
        if recv2 is None:  # stage 2 forwards whole packed rows
            recv2 = recv1.new_empty((plan.num_recv_tokens, recv1.shape[1]))
        rows = sum(chunk.s2_recv_splits)
        if comm.groups[INTRA] is None:
            torch.index_select(recv1, 0, index, out=recv2[landed : landed + rows])
        else:
            _, pending = comm.all_to_all(
                torch.index_select(recv1, 0, index),
                chunk.s2_send_splits,
                chunk.s2_recv_splits,
                INTRA,
                f"{what} stage 2",
                recv=recv2[landed : landed + rows],
            )
            in_flight.append(pending)
        landed += rows
    for pending in in_flight:
        yield pending
    return recv2


def two_stage_combine(
    comm: Collectives,
    tensors: list[torch.Tensor],
    payload: list[torch.Tensor],
    payload_index: list[torch.Tensor | None],
    scales: list[torch.Tensor | None],
    out: list[torch.Tensor],
    plan: TorchDistPlan,
    what: str,
    check: Agreement | None,
    begun,
) -> Steps:
    """The two stages of a combine, backwards: per chunk the intra-node return of the rows of
    ``payload`` (per tensor ``[R, ...]`` gathered by its ``payload_index`` where not None, then
    the scale columns: the received rows in arrival order), the
    forwarder's sums (:func:`.sums.forwarder_sums`), the inter-node return and the source's sums
    into ``out`` (:func:`.sums.source_sums`; ``tensors``: the combine's inputs, whose dtypes and
    row shapes the node partials have). ``check`` (``begun`` with :func:`.blocks.begin`)
    completes before the first payload moves."""
    chunks = plan.chunks
    bounds = [0, *itertools.accumulate(sum(chunk.s2_recv_splits) for chunk in chunks)]
    specs = specs_of(payload)

    def send2(c):
        b = slice(bounds[c], bounds[c + 1])
        return pack([(p[b], None) if i is None else (p, i[b]) for p, i in zip(payload, payload_index)])

    def forwarded(c, chunk, back2):
        back2 = field_views(back2, specs)
        return forwarder_sums(plan, c, chunk, back2[: len(tensors)], row_scales(back2, scales, len(tensors)))

    def land_sums(chunk, back1):
        source_sums(plan, chunk, field_views(back1, specs_of(tensors)), out)

    # With one rank per node and no scales a forwarder's sums are its own rows, which stage 2
    # returned packed just as stage 1 sends them (a sum of one term is the term).
    passthrough = comm.groups[INTRA] is None and all(s is None for s in scales)

    # The intra-node return and forwarder sums of chunk c + 1 overlap the inter-node return
    # of chunk c; the source's sums of chunk c overlap the inter-node return of chunk c + 1.
    first = send2(0)
    yield from complete(check, begun)
    intra = comm.all_to_all(first, chunks[0].s2_recv_splits, chunks[0].s2_send_splits, INTRA, f"{what} stage 2")
    in_flight = None  # (chunk, back1, pending): the inter-node return on the wire
    for c, chunk in enumerate(chunks):
        packed = send2(c + 1) if c + 1 < len(chunks) else None
        back2, pending = intra
        yield pending
        if packed is not None:
            intra = comm.all_to_all(
                packed, chunks[c + 1].s2_recv_splits, chunks[c + 1].s2_send_splits, INTRA, f"{what} stage 2"
            )
        send1 = back2 if passthrough else pack([(p, None) for p in forwarded(c, chunk, back2)])
        arrived = in_flight
        if arrived is not None:
            yield arrived[2]  # the inter-node link is free again
        back1, pending = comm.all_to_all(send1, chunk.s1_recv_splits, chunk.s1_send_splits, INTER, f"{what} stage 1")
        in_flight = (chunk, back1, pending)
        if arrived is not None:
            land_sums(*arrived[:2])  # while chunk c crosses back
    yield in_flight[2]
    land_sums(*in_flight[:2])
