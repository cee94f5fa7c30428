"""Route choice of the torch_dist transport: flat (one exchange over all ranks) or the two stages
(inter-node, then intra-node) at a depth, chosen per dispatch by every rank alike from sizes every
rank agreed on (:func:`choose_route`); on NCCL by a rule for GPU links, on gloo by a cost model of
the links measured once per set of ranks (:func:`measure_links`, :class:`Links`). The same links
decide whether the argument checks' blocks carry a small call's rows (:func:`padding_pays`).
The constants: :mod:`.tuning`."""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist

from ...topology import Topology
from .collectives import ALL_COMM, INTER, INTRA, Collectives, Pending
from .packing import ALIGN
from .plan import Counts, TorchDistChunk, TorchDistPlan, flat_send_idx
from .tuning import (
    CHUNK_BYTES,
    FLAT_BYTES,
    FUSED_PADDING,
    LINK_PROBE_BYTES,
    LINK_PROBE_SAMPLES,
    MIN_DEDUP,
    TWO_STAGE_GAIN,
)

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Links:
    """What :func:`measure_links` measured, in seconds: the collectives' latencies (a few bytes),
    and per byte a rank receives beyond them from its peers, each group measured alone."""

    collective_s: float  # one all-ranks exchange: the flat route, or an argument check
    per_byte: float  # ... per byte from the other ranks
    two_collectives_s: float  # an inter-node then an intra-node exchange: the two stages
    per_inter_byte: float  # per byte from other nodes (the inter-node group alone)
    per_intra_byte: float  # per byte from the other ranks of this node (the intra-node group alone)


# The links measured by measure_links, by (EP group's global ranks, ranks per node).
_measured_links: dict[tuple, Links] = {}


def measured_links(key: tuple) -> Links | None:
    """The links :func:`measure_links` measured under ``key`` in this process, or None where no
    call has needed them yet (small calls, NCCL)."""
    return _measured_links.get(key)


def measure_links(comm: Collectives, key: tuple) -> Links:
    """The links of ``comm``'s ranks (:class:`Links`), measured the first time a gloo call asks
    (collective over every rank of ``comm``): on each of its groups (all ranks, inter-node,
    intra-node, those it has), a few bytes, then :data:`LINK_PROBE_BYTES` per peer, every rank at
    once as the routes run; each rank times :data:`LINK_PROBE_SAMPLES` exchanges after one untimed
    one, every rank starting each together (so a late rank's start is not timed as the link's),
    and keeps their median. Each figure is the largest over the ranks, so every rank decides
    alike. Kept under ``key`` (the EP group's global ranks and the ranks per node) for every later
    transport over the same ranks and nodes in this process (they share the links, and so decide
    alike).

    Raises:
        CommError: a peer failed or did not join a probe within the timeout.
    """
    if comm.groups[ALL_COMM] is None:  # a group of one: nothing moves, nothing to measure
        return Links(collective_s=0.0, per_byte=0.0, two_collectives_s=0.0, per_inter_byte=0.0, per_intra_byte=0.0)
    if key not in _measured_links:
        # The all-ranks group's large exchange goes last: it drains shaped links' bursts, which
        # the inter-node figure the routes weigh would then not see.
        probes = [
            (kind, nbytes)
            for kind, nbytes in (
                (ALL_COMM, ALIGN),
                (INTER, ALIGN),
                (INTER, LINK_PROBE_BYTES),
                (INTRA, ALIGN),
                (INTRA, LINK_PROBE_BYTES),
                (ALL_COMM, LINK_PROBE_BYTES),
            )
            if comm.groups[kind] is not None
        ]
        times = []
        line_up = torch.zeros(comm.topology.world_size * ALIGN, dtype=torch.uint8)
        for kind, nbytes in probes:
            send = torch.zeros(len(comm.peers[kind]) * nbytes, dtype=torch.uint8)
            recv = torch.empty_like(send)  # one buffer: a fresh one's page faults are not the link's
            samples = []
            for _ in range(1 + LINK_PROBE_SAMPLES):
                # Every rank of every group starts the sample together (one all-ranks exchange
                # of a few bytes, untimed): groups out of step would time each other's traffic.
                comm.all_to_all(line_up, None, None, ALL_COMM, "link probe")[1].wait()
                start = time.perf_counter()
                comm.all_to_all(send, None, None, kind, "link probe", recv=recv)[1].wait()
                samples.append(time.perf_counter() - start)
            times.append(statistics.median(samples[1:]))
        slowest = torch.tensor(times, dtype=torch.float64)
        work = dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=comm.groups[ALL_COMM], async_op=True)
        Pending(work, lambda err: comm.describe(ALL_COMM, "link probe (all_reduce)", err)).wait()
        took = dict(zip(probes, slowest.tolist()))
        small = {kind: t for (kind, nbytes), t in took.items() if nbytes == ALIGN}
        per_byte = {
            kind: max(t - small[kind], 0.0) / ((len(comm.peers[kind]) - 1) * LINK_PROBE_BYTES)
            for (kind, nbytes), t in took.items()
            if nbytes == LINK_PROBE_BYTES
        }
        _measured_links[key] = Links(
            collective_s=small[ALL_COMM],
            per_byte=per_byte[ALL_COMM],
            two_collectives_s=small.get(INTER, 0.0) + small.get(INTRA, 0.0),
            per_inter_byte=per_byte.get(INTER, 0.0),
            per_intra_byte=per_byte.get(INTRA, 0.0),
        )
        if comm.topology.rank == 0:
            logger.info("links of EP ranks %s: %s", key[0], _measured_links[key])
    return _measured_links[key]


def two_stage_world(topology: Topology) -> bool:
    """Both stages cross processes (several nodes of several ranks)."""
    return topology.num_nodes > 1 and topology.ranks_per_node > 1


def two_stages_pay(counts: Counts, row_bytes: int, topology: Topology, gloo: bool, links: Callable[[], Links]) -> bool:
    """Whether the two stages would be faster than the flat route for rows of ``row_bytes``
    (from agreed sizes and links: every rank decides the same). On NCCL (``gloo`` False: GPU
    links) by :data:`FLAT_BYTES` and :data:`MIN_DEDUP`; on gloo by the links ``links()`` gives
    (called only where the call is large enough to ask, :data:`LINK_PROBE_BYTES`). Per rank, on
    average: the flat route sends its cross-node rows and, to the other ranks of its node, its
    in-node rows; the two stages send one copy per token and node across, then every row once
    more inside the destination's node, one collective more. A flat collective moves its
    cross-node and in-node rows at once (every peer's transfer is posted before any is waited
    for), so it lasts as long as the slower of the two; the stages run one after the other."""
    largest = counts.max_flat_rows * row_bytes
    if not gloo:  # NCCL: GPU links
        return largest > FLAT_BYTES and counts.stage1_cross_rows <= (1 - MIN_DEDUP) * counts.flat_cross_rows
    if largest <= LINK_PROBE_BYTES or counts.stage1_cross_rows >= counts.flat_cross_rows:
        return False
    measured = links()
    world, local_ranks = topology.world_size, topology.ranks_per_node
    others = (local_ranks - 1) / local_ranks  # of the rows for my node, those for its other ranks
    cross, stage1 = counts.flat_cross_rows * row_bytes / world, counts.stage1_cross_rows * row_bytes / world
    rows = counts.total_flat_rows * row_bytes / world
    flat = measured.collective_s + max(
        cross * measured.per_inter_byte, (rows - cross) * others * measured.per_intra_byte
    )
    two = measured.two_collectives_s + stage1 * measured.per_inter_byte + rows * others * measured.per_intra_byte
    return two < TWO_STAGE_GAIN * flat


def padding_pays(counts: Counts, row_bytes: int, block_rows: int, world_size: int, links: Callable[[], Links]) -> bool:
    """Whether a check's blocks should carry the flat rows (every block padded to ``block_rows``
    rows, at least the largest pair's: one collective) rather than the check and the rows going
    apart (two): yes where the padding adds at most :data:`FUSED_PADDING` to the bytes moved; else
    where the links ``links()`` gives move the slowest rank's extra bytes in less time than a
    collective takes (from agreed sizes: every rank decides the same)."""
    if block_rows * world_size * world_size <= FUSED_PADDING * counts.total_flat_rows:
        return True
    measured = links()
    extra = (block_rows * world_size - counts.max_flat_rows) * row_bytes
    return extra * measured.per_byte < measured.collective_s


def choose_route(
    plan: TorchDistPlan,
    row_bytes: int,
    topo: Topology,
    num_chunks: int | None,
    gloo: bool,
    links: Callable[[], Links],
) -> None:
    """Chooses ``plan``'s route and depth for rows of ``row_bytes`` packed bytes (first payload
    of the plan; every rank decides the same, from the sizes of every rank and the agreed width):
    fills its flat splits, or its chunks and ``recv_perm``. ``num_chunks``: the transport's fixed
    depth (two stages), or None (automatic: :func:`two_stages_pay` with ``gloo`` and ``links``,
    one chunk per :data:`CHUNK_BYTES`). A plan already routed is left as it is."""
    counts = plan.counts
    if counts is None or plan.chunks or plan.flat:
        return
    local_ranks, num_nodes = topo.ranks_per_node, topo.num_nodes
    if num_chunks is None and (not two_stage_world(topo) or not two_stages_pay(counts, row_bytes, topo, gloo, links)):
        plan.flat = True
        plan.flat_send_idx = counts.send_idx if counts.send_idx is not None else flat_send_idx(counts.is_token_in_rank)
        plan.flat_send_splits = [sum(col) for col in zip(*counts.to_rank)]
        plan.flat_recv_splits = counts.from_rank
        plan.internode_rows = sum(n for d, n in enumerate(plan.flat_send_splits) if d // local_ranks != topo.node)
        plan.intranode_rows = sum(
            n for d, n in enumerate(plan.flat_send_splits) if d // local_ranks == topo.node and d != topo.rank
        )
        return
    subs = len(counts.to_node)
    depth = num_chunks or max(1, min(subs, -(-counts.max_stage1_rows * row_bytes // CHUNK_BYTES)))
    spans = [(c * subs // depth, (c + 1) * subs // depth) for c in range(depth)]

    def merged(per_sub: list[list[int]], a: int, b: int) -> list[int]:
        return [sum(col) for col in zip(*per_sub[a:b])]

    arrivals = torch.tensor(counts.arrivals, dtype=torch.int64, device=counts.in_node.device)
    arrivals = torch.stack([arrivals[a:b].sum(0) for a, b in spans])  # [C, L, N]
    s2_recv = arrivals.sum(2).tolist()
    for c, (a, b) in enumerate(spans):
        begin, end = counts.bounds[a], counts.bounds[b]
        node, token = torch.nonzero(counts.in_node[begin:end].t()).unbind(1)  # node-major, tokens ascending
        plan.chunks.append(
            TorchDistChunk(
                begin,
                end,
                token,
                token * num_nodes + node,
                merged(counts.to_node, a, b),
                merged(counts.s1_recv, a, b),
                merged(counts.s2_send, a, b),
                s2_recv[c],
            )
        )
    # With one chunk, arrival order (local rank, node) is final order (node, local rank) when
    # either has one value.
    if not (depth == 1 and (local_ranks == 1 or num_nodes == 1)):
        plan.recv_perm = _reorder_blocks(arrivals, (2, 1, 0), plan.num_recv_tokens)


def _reorder_blocks(counts: torch.Tensor, dims: tuple[int, ...], total: int) -> torch.Tensor:
    """Rows lie in blocks of ``counts`` rows each, the blocks in the order of ``counts``' own
    indices; returns the gather index that orders the blocks as ``counts.permute(dims)`` does
    instead (rows keep their order inside a block). ``total``: the number of rows."""
    flat = counts.flatten()
    starts = (torch.cumsum(flat, 0) - flat).view(counts.shape).permute(dims).flatten()
    lens = counts.permute(dims).flatten()
    block = torch.repeat_interleave(torch.arange(lens.numel(), device=counts.device), lens, output_size=total)
    offset_in_block = torch.arange(total, device=counts.device) - (torch.cumsum(lens, 0) - lens)[block]
    return starts[block] + offset_in_block
