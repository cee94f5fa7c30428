"""The two-stage hierarchy on torch.distributed sub-group ``all_to_all_single``.

Portable (gloo on CPU, NCCL on GPU, PCIe-safe) and the executable mirror of the CUDA kernels'
orchestration. Rank (n, l) is node n, local index l (see ``Topology``).

Dispatch:
  metadata (group: all EP ranks, the one of the argument checks, in the Buffer's queue): each
    source tells each destination d how many of its tokens reach d's node and each rank of d's
    node, per sub-range of its tokens, plus its own send sizes by either route, behind its
    agreement row (:mod:`moe_dispatch.transport.agreement`). From that every rank knows every
    split below and its receive count before any payload moves (so outputs can be allocated up
    front and the payload can move asynchronously), and every rank takes the same route. Small
    calls' rows travel in the same blocks (one collective per dispatch and per combine, see
    :data:`FUSED_BYTES`):
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
node) and round. Exactly the order of ``moe_dispatch.reference.combine``; the flat route runs
both sums at the source, the same sums in the same order. A fused permute's expert-major rows
are summed per received row (ascending expert, fp32) straight into the send buffer. Every sum
is :func:`moe_dispatch.semantics.sums.ordered_sum` (:mod:`moe_dispatch.ops.sums`: in one pass on
CPU), planned once per dispatch.

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
per :data:`CHUNK_BYTES` of the largest stage-1 payload, at most :data:`NUM_CHUNKS`. Calls where
the cross-node bytes the two stages save would not pay for their second collective and the
forwarded rows take the flat route (one collective instead of two; the combine order is the
semantics', not the route's): on NCCL (GPU links) calls whose largest flat payload is at most
:data:`FLAT_BYTES`, or whose routing the two stages would de-duplicate by less than
:data:`MIN_DEDUP` of the cross-node rows; on gloo, where links range from a loopback to a shaped
or real network, as the links measured once per transport predict
(:meth:`TorchDistTransport._links`). An explicit ``num_chunks`` fixes the two-stage route at that
depth.

Every stage moves all row tensors of one call as a single packed uint8 buffer, so a stage is
one collective per chunk whatever the number of tensors. Operations are written as generators
that yield each collective they wait for (a :class:`Pending`; others may be in flight
meanwhile): the steps of :mod:`moe_dispatch.transport.base`, which ``drive`` runs to
completion; callers may instead stop after the first yield to overlap the first transfer with
their own work. A combine or cached dispatch given its argument check (``check``) carries its
flat rows in the check's blocks where they fit; on the two-stage route it starts the check,
packs its first payload meanwhile, and completes the check before that payload moves.
"""

from __future__ import annotations

import array
import collections
import dataclasses
import datetime
import functools
import itertools
import logging
import math
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist

from .. import _ext
from ..errors import CommError
from ..ops.sums import BlockedRows, OnePassPlan, grouped_sum, ordered_sum, plan_grouped, plan_sum, plan_sum_by_output
from ..semantics.permute import PermuteHandle, gather_rows, permuted_sources
from ..semantics.sums import SumPlan
from ..topology import Topology
from . import agreement
from .agreement import AGREE_WORDS
from .base import Field, Steps
from .progress import Progress

logger = logging.getLogger(__name__)

NUM_CHUNKS = 4  # deepest automatic pipeline: enough to hide stage 2 behind stage 1, few collectives
CHUNK_BYTES = 16 << 20  # automatic depth: one chunk per this many stage-1 bytes of the largest sender
# Automatic route on NCCL: flat when no rank sends more payload bytes than this (the sizes where a
# second collective's latency costs more than the de-duplicated bytes save: a few MB at 50 GB/s
# and tens of microseconds per collective) ...
FLAT_BYTES = 4 << 20
# ... or when the two stages would cut the rows crossing nodes by less than this fraction (routing
# that reaches few ranks per node, e.g. top-2: the second stage's latency and forwarding copy then
# cost more than they save).
MIN_DEDUP = 0.25
# On gloo the links are measured instead (TorchDistTransport._links), the first time a call's
# largest flat payload exceeds LINK_PROBE_BYTES (below it a second collective never pays) or the
# fused blocks' padding exceeds FUSED_PADDING (below): an exchange of a few bytes and of
# LINK_PROBE_BYTES per peer on each of the transport's groups (all ranks, inter-node,
# intra-node). Megabytes: smaller exchanges fit a shaped link's burst or a switch's buffers and
# see the link faster than it is.
LINK_PROBE_BYTES = 2 << 20
# Each probe is timed this many times after one untimed exchange; a rank keeps the median (a
# descheduled rank or a shaped link's refilled burst moves one sample, not the figure).
LINK_PROBE_SAMPLES = 5
# The two stages are taken on gloo where the links say they take at most this fraction of the flat
# route's time: they do host work the links do not see (a second route, a reorder), and a choice
# on a near tie flips with the measurement's noise between runs.
TWO_STAGE_GAIN = 0.85
# The flat route: a dispatch's rows travel in its counts' blocks, a combine's or cached dispatch's
# in its argument check's, where no rank sends a peer more than the block holds; blocks hold the
# previous dispatch's largest flat payload to one peer (or more, below), if at most this many
# bytes (one collective instead of two: at these sizes the round trip costs more than the padding
# up to the block size).
FUSED_BYTES = 1 << 20
# ... and the padding adds at most a quarter to the bytes; or, on gloo, the measured links move the
# padding in less time than the collective saved takes (TorchDistTransport._padding_pays).
FUSED_PADDING = 1.25
# ... the blocks hold the largest pair of this many recent dispatches where that padding pays too
# (a step's MoE layers: each routes differently, and the next one's rows then fit more often).
RECENT_DISPATCHES = 8


@dataclasses.dataclass(eq=False)
class TorchDistChunk:
    """One chunk of a two-stage dispatch's plan: source tokens ``[begin, end)``. Splits are host
    ints (gloo and ``all_to_all_single`` take lists)."""

    begin: int
    end: int
    s1_send_idx: torch.Tensor  # [S1] source token - begin of each stage-1 send row, grouped by destination node
    s1_route_idx: torch.Tensor  # [S1] row of is_token_in_rank[begin:end].view(-1, L) sent along with each row
    s1_send_splits: list[int]  # [N]
    s1_recv_splits: list[int]  # [N] rows to forward, from each source node
    s2_send_splits: list[int]  # [L]
    s2_recv_splits: list[int]  # [L]
    # Known once stage 1 has delivered the forwarded rows' routing:
    s2_send_idx: torch.Tensor | None = None  # [S2] stage-1 row of each stage-2 send row, by destination local rank


@dataclasses.dataclass(eq=False)
class _Counts:
    """What the metadata exchange told a rank, per sub-range of the sources' tokens (a plan's
    input until its route is chosen)."""

    is_token_in_rank: torch.Tensor  # [T, W] bool, this rank's layout
    in_node: torch.Tensor  # [T, N] bool
    bounds: list[int]  # [S + 1] sub-range bounds of this rank's tokens
    to_rank: list[list[int]]  # [S][W] my tokens for each rank
    to_node: list[list[int]]  # [S][N] my tokens for each node
    from_rank: list[int]  # [W] each source's tokens for me (the flat receive splits)
    s1_recv: list[list[int]]  # [S][N] rows the sources (m, my l) forward through me
    s2_send: list[list[int]]  # [S][L] rows I forward to each rank of my node
    arrivals: list[list[list[int]]]  # [S][L][N] rows of source (m, l') reaching me through forwarder (n, l')
    max_flat_rows: int  # the largest flat payload of any rank, in rows
    max_stage1_rows: int  # the largest stage-1 payload of any rank, in rows
    max_pair_rows: int  # the most flat rows any rank sends one rank
    total_flat_rows: int  # the flat rows of all ranks
    flat_cross_rows: int  # rows all ranks would send to other nodes by the flat route
    stage1_cross_rows: int  # ... and by the two stages (one copy per token and node)
    send_idx: torch.Tensor | None  # [F] the flat route's send rows (token of each, by rank), once made


@dataclasses.dataclass(eq=False)
class _Carried:
    """Rows that came in the blocks of an exchange, still there: ``blocks [W, block bytes]``
    uint8, block ``s`` its header (``head_bytes``), then ``carried[s]`` packed rows of ``width``
    bytes (arrival rows counted across the blocks)."""

    blocks: torch.Tensor
    carried: list[int]
    head_bytes: int
    width: int

    def fields(self, like: list[tuple[torch.dtype, tuple[int, ...]]]) -> list[BlockedRows]:
        """The packed fields of every carried row (:func:`_fields`' order), left in the blocks
        for the sums to read in place."""
        out, offset = [], self.head_bytes
        for dtype, shape in like:
            out.append(BlockedRows(self.blocks, offset, self.width, self.carried, dtype, shape))
            offset += _padded(_row_bytes(dtype, shape))
        return out

    def land(self, fields: list[tuple[int, int, torch.Tensor, torch.Tensor | None]]) -> None:
        """For each ``(offset, bytes, out, index)``: row ``i`` of the contiguous ``out [n, ...]``
        gets the field at ``offset`` of arrival row ``index[i]`` (``i`` when None; a zero row where
        -1), in one pass (``_C.land_blocks_cpu``)."""
        kept, args = [], []
        for offset, nbytes, out, index in fields:
            assert out.is_contiguous(), "_Carried.land writes through a byte view: out tensors must be contiguous"
            if out.numel() == 0:
                continue
            dst = _as_bytes(out)
            assert index is None or index.numel() == dst.shape[0], "_Carried.land: an index entry per output row"
            index = None if index is None else index.to(torch.int64).contiguous()
            kept.append((dst, index))  # alive until the pass returns
            args.append(
                (offset, nbytes, dst.data_ptr(), dst.stride(0), 0 if index is None else index.data_ptr(), dst.shape[0])
            )
        if args:
            _ext._C.land_blocks_cpu(
                blocks=self.blocks.data_ptr(),
                block_bytes=self.blocks.shape[1],
                head_bytes=self.head_bytes,
                row_bytes=self.width,
                carried=self.carried,
                fields=args,
            )


@dataclasses.dataclass(eq=False)
class TorchDistPlan:
    """The index plan of one dispatch (a rank's share of the handle); its combine replays it
    backwards. A :class:`~moe_dispatch.transport.base.Plan`.

    The route (flat or two-stage, and the depth) is chosen by the first payload transfer, from
    the row width every rank agreed on; until then ``chunks`` is empty and the row counts are
    the two-stage ones."""

    num_tokens: int
    num_recv_tokens: int
    counts: _Counts | None  # until routed
    flat: bool = False
    chunks: list[TorchDistChunk] = dataclasses.field(default_factory=list)
    # [R] final row i is row recv_perm[i] of the arrivals (two-stage: the chunks' stage-2 arrivals,
    # concatenated); None when they arrive in final order
    recv_perm: torch.Tensor | None = None
    flat_send_idx: torch.Tensor | None = None  # [F] token of each flat send row, by destination rank
    flat_send_splits: list[int] = dataclasses.field(default_factory=list)  # [W]
    flat_recv_splits: list[int] = dataclasses.field(default_factory=list)  # [W]
    arrived: "_Carried | torch.Tensor | None" = None  # the flat rows that came with the counts, until landed
    internode_rows: int = 0  # rows this rank sends to other nodes per dispatch (and receives back in combine)
    intranode_rows: int = 0  # rows this rank sends to other local ranks per dispatch
    # Derived on first use and kept for every later call (combine, backward): sum plans, indices
    cache: dict = dataclasses.field(default_factory=dict, repr=False)

    def cached(self, key, make):
        """``make()``, computed once per plan under ``key``."""
        if key not in self.cache:
            self.cache[key] = make()
        return self.cache[key]


class Pending:
    """One in-flight collective; :meth:`wait` turns a failure or timeout into :class:`CommError`."""

    def __init__(self, work, describe):
        self.work, self.describe = work, describe

    def wait(self) -> None:
        try:
            self.work.wait()
        except RuntimeError as err:  # gloo raises on timeout and on a lost peer
            raise CommError(self.describe(err)) from err


_NUM_SIZES = 5  # a fresh dispatch's header: the sender's sizes (see TorchDistTransport.plan)
_ALIGN = 8  # bytes; every packed field starts at a multiple, so it can be viewed in place as its dtype


def _row_bytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return dtype.itemsize * math.prod(shape)


def _padded(width: int) -> int:
    return -(-width // _ALIGN) * _ALIGN


def _packed_width(tensors: list[torch.Tensor]) -> int:
    """Bytes of one row of ``tensors`` packed side by side (:func:`_pack`: each field padded)."""
    return sum(_padded(_row_bytes(t.dtype, tuple(t.shape[1:]))) for t in tensors)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``[rows, ...]`` -> ``[rows, bytes]`` uint8 (a view when ``t`` is contiguous)."""
    width = math.prod(t.shape[1:])
    if t.numel() == 0:  # empty tensors count as contiguous whatever their strides (e.g. expanded grads)
        return t.new_empty((t.shape[0], width * t.element_size()), dtype=torch.uint8)
    return t.reshape(t.shape[0], width).contiguous().view(torch.uint8)


def _pack(rows: list[tuple[torch.Tensor, torch.Tensor | None]]) -> torch.Tensor:
    """Packs row tensors side by side into one ``[rows, bytes]`` uint8 buffer, one copy each:
    ``(t, index)`` contributes ``t[index]`` (gathered straight into place), ``(t, None)`` all of
    ``t``. Fields are padded to ``_ALIGN`` bytes. A single contiguous ``(t, None)`` whose rows
    need no padding comes back as a byte view of ``t``: no copy at all.

    ``Tensor.index_select`` is used for every row gather: advanced indexing (``t[index]``)
    copies element by element and is several times slower on uint8 rows on CPU."""
    num_rows = next(t.shape[0] if index is None else index.numel() for t, index in rows)
    widths = [_padded(_row_bytes(t.dtype, tuple(t.shape[1:]))) for t, _ in rows]
    if (
        len(rows) == 1
        and rows[0][1] is None
        and rows[0][0].is_contiguous()
        and rows[0][0].numel()
        and widths[0] == _row_bytes(rows[0][0].dtype, tuple(rows[0][0].shape[1:]))
    ):
        return _as_bytes(rows[0][0])
    buf = torch.empty((num_rows, sum(widths)), dtype=torch.uint8, device=rows[0][0].device)
    offset = 0
    for (t, index), width in zip(rows, widths):
        src = _as_bytes(t)
        dst = buf[:, offset : offset + src.shape[1]]
        if index is None:
            dst.copy_(src)
        else:
            torch.index_select(src, 0, index, out=dst)
        offset += width
    return buf


def _pack_blocks(send: torch.Tensor, head: torch.Tensor, fields: list, splits: list[int], count_word: int) -> None:
    """Writes block ``d`` of ``send [W, block bytes]``: header ``head[d]`` (int64 words) with
    word ``count_word`` set to ``splits[d]``, then the next ``splits[d]`` rows of ``fields`` (as
    :func:`_pack` takes them) packed. On CPU in one pass (``_C.pack_blocks_cpu``), else
    :func:`_pack` and a copy per destination."""
    head, head_bytes = head.contiguous(), head.shape[1] * 8
    widths = [_row_bytes(t.dtype, tuple(t.shape[1:])) for t, _ in fields]
    row_bytes = sum(_padded(w) for w in widths)
    if send.device.type == "cpu" and _ext.extension_status().built:
        index = {i.data_ptr(): i.contiguous() for _, i in fields if i is not None}  # one index for every field
        assert len(index) <= 1, "_pack_blocks: the fields share one index"
        sources = [_as_bytes(t) if t.numel() else None for t, _ in fields]
        offsets = itertools.accumulate([0] + [_padded(w) for w in widths[:-1]])
        _ext._C.pack_blocks_cpu(
            out=send.data_ptr(),
            block_bytes=send.shape[1],
            head=head.data_ptr(),
            head_bytes=head_bytes,
            row_bytes=row_bytes,
            fields=[
                (src.data_ptr(), src.stride(0), w, o) for src, w, o in zip(sources, widths, offsets) if src is not None
            ],
            index=next(iter(index.values())).data_ptr() if index else 0,
            splits=list(splits),
            count_word=count_word,
        )
        return
    head = head.clone()
    head[:, count_word] = torch.tensor(splits, dtype=torch.int64, device=head.device)
    packed, offset = _pack(fields), 0
    for d, n in enumerate(splits):
        send[d, head_bytes : head_bytes + n * row_bytes] = packed[offset : offset + n].view(-1)
        offset += n
    send[:, :head_bytes].view(torch.int64).copy_(head)


def _fields(buf: torch.Tensor, like: list[tuple[torch.dtype, tuple[int, ...]]]) -> list[torch.Tensor]:
    """The packed fields of ``buf`` as ``[rows, *shape]`` tensors of their dtypes: strided views
    into ``buf``, no copies."""
    out, offset = [], 0
    for dtype, shape in like:
        width = _row_bytes(dtype, shape)
        if buf.shape[0] == 0:  # an empty slice keeps the packed strides, which view() rejects
            out.append(buf.new_empty((0, *shape), dtype=dtype))
        else:
            out.append(buf[:, offset : offset + width].view(dtype).view(buf.shape[0], *shape))
        offset += _padded(width)
    return out


def _unpack_rows(buf: torch.Tensor, index: torch.Tensor | None, out: list[torch.Tensor]) -> None:
    """``out[j] = field j of buf[index]`` (of ``buf`` when ``index`` is None) for contiguous
    ``out`` tensors, one copy each."""
    offset = 0
    for dst in out:
        assert dst.is_contiguous(), "_unpack_rows writes through a byte view: out tensors must be contiguous"
        width = _row_bytes(dst.dtype, tuple(dst.shape[1:]))
        if index is None:
            _as_bytes(dst).copy_(buf[:, offset : offset + width])
        else:
            torch.index_select(buf[:, offset : offset + width], 0, index, out=_as_bytes(dst))
        offset += _padded(width)


def _specs(tensors: list[torch.Tensor]) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    return [(t.dtype, tuple(t.shape[1:])) for t in tensors]


def _flat_send_idx(is_token_in_rank: torch.Tensor) -> torch.Tensor:
    """``[F]``: the token of each flat send row, rank-major, tokens ascending."""
    return torch.nonzero(is_token_in_rank.t())[:, 1]


def _dispatch_counts(
    is_token_in_rank: torch.Tensor, bounds: list[int], topo: Topology, head: torch.Tensor, at: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A dispatch's counts from its layout ``[T, W]``: returns ``(per_sub [S, W + N] int64, in_node
    [T, N] bool, send_idx)``, each sub-range ``[bounds[s], bounds[s + 1])``'s tokens for each rank,
    then for each node; ``send_idx`` is :func:`_flat_send_idx`'s, or None where not made yet.
    Writes header words ``at ...`` of every row ``d`` of ``head [W, words]`` int64: the
    ``_NUM_SIZES`` sizes (my flat and stage-1 rows, the rows of each that cross nodes, the most
    flat rows I send one rank), then per sub-range my tokens for the ranks of ``d``'s node and for
    ``d``'s node. On CPU in one pass (``_C.dispatch_counts_cpu``)."""
    world, local_ranks, num_nodes = topo.world_size, topo.ranks_per_node, topo.num_nodes
    num_tokens, subs, device = is_token_in_rank.shape[0], len(bounds) - 1, is_token_in_rank.device
    if device.type == "cpu" and _ext.extension_status().built and head.is_contiguous():
        is_token_in_rank = is_token_in_rank.contiguous()
        per_sub = torch.empty((subs, world + num_nodes), dtype=torch.int64)
        in_node = torch.empty((num_tokens, num_nodes), dtype=torch.bool)
        send_idx = torch.empty(num_tokens * world, dtype=torch.int64)
        num_send = _ext._C.dispatch_counts_cpu(
            is_token_in_rank=is_token_in_rank.data_ptr(),
            num_tokens=num_tokens,
            num_ranks=world,
            ranks_per_node=local_ranks,
            node=topo.node,
            bounds=bounds,
            head=head.data_ptr(),
            head_words=head.shape[1],
            head_offset=at,
            per_sub=per_sub.data_ptr(),
            in_node=in_node.data_ptr(),
            send_idx=send_idx.data_ptr(),
        )
        return per_sub, in_node, send_idx[:num_send]
    # My tokens per sub-range for each rank and each node: running counts at the bounds.
    in_node = is_token_in_rank.view(num_tokens, num_nodes, local_ranks).any(2)
    if subs == 1:
        per_sub = torch.cat([is_token_in_rank.sum(0), in_node.sum(0)]).unsqueeze(0)  # [1, W + N]
    else:
        running = torch.zeros((num_tokens + 1, world + num_nodes), dtype=torch.int64, device=device)
        torch.cumsum(torch.cat([is_token_in_rank, in_node], 1), 0, out=running[1:])
        per_sub = running[bounds[1:]] - running[bounds[:-1]]  # [S, W + N]
    to_rank, to_node = per_sub[:, :world], per_sub[:, world:]
    own_ranks = slice(topo.node * local_ranks, (topo.node + 1) * local_ranks)
    flat_rows, stage1_rows = to_rank.sum(), to_node.sum()
    sizes = torch.stack(
        [
            flat_rows,
            stage1_rows,
            flat_rows - to_rank[:, own_ranks].sum(),
            stage1_rows - to_node[:, topo.node].sum(),
            to_rank.sum(0).max(),
        ]
    )
    dest_node = torch.arange(world, device=device) // local_ranks
    sub_counts = torch.cat(
        [to_rank.view(subs, num_nodes, local_ranks)[:, dest_node], to_node[:, dest_node].unsqueeze(2)], 2
    )  # [S, W, L + 1]
    head[:, at : at + _NUM_SIZES] = sizes
    head[:, at + _NUM_SIZES : at + _NUM_SIZES + subs * (local_ranks + 1)] = sub_counts.transpose(0, 1).reshape(
        world, -1
    )
    return per_sub, in_node, None


INTER, INTRA = "inter-node", "intra-node"

ALL_COMM = "all-ranks (comm thread)"  # the counts, flat payloads, gloo argument checks
HOST = "all-ranks (host, gloo)"  # the argument checks of an NCCL EP group: host ints, no device synchronisation


# torch < 2.14 names a group made with use_local_synchronization after its ranks and the number of
# live groups, so a group made after a destroyed one on the same ranks gets the dead group's name and
# reads its stale rendezvous keys (gloo connects to closed ports and times out). There close() hands
# its idle groups to the next transport on the same ranks instead of destroying them, and a Buffer
# dropped without close() keeps its groups (its peers may still be using theirs).
_NAMES_REUSED = tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 14)
_spare_groups: dict[tuple, list[dist.ProcessGroup]] = {}


@dataclasses.dataclass(frozen=True)
class Links:
    """What :meth:`TorchDistTransport._links` measured, in seconds: the collectives' latencies (a
    few bytes), and per byte a rank receives beyond them from its peers, each group measured alone."""

    collective_s: float  # one all-ranks exchange: the flat route, or an argument check
    per_byte: float  # ... per byte from the other ranks
    two_collectives_s: float  # an inter-node then an intra-node exchange: the two stages
    per_inter_byte: float  # per byte from other nodes (the inter-node group alone)
    per_intra_byte: float  # per byte from the other ranks of this node (the intra-node group alone)


# The links measured by TorchDistTransport._links, by (EP group's global ranks, ranks per node).
_measured_links: dict[tuple, Links] = {}


def _new_group(ranks: list[int], timeout: datetime.timedelta, backend: str) -> dist.ProcessGroup:
    """A process group of the global ``ranks``, made by its members only (collective over them):
    on torch < 2.14 a spare one a closed transport left on the same ranks, if any. Every member
    closed that transport at the same point of its program, so all find the same spares."""
    spares = _spare_groups.get((tuple(ranks), backend, timeout), []) if _NAMES_REUSED else []
    while spares:
        group = spares.pop()
        if group in dist.distributed_c10d._world.pg_map:  # not gone with a destroyed world
            return group
    return dist.new_group(ranks, timeout=timeout, backend=backend, use_local_synchronization=True)


class TorchDistTransport:
    """Hierarchical dispatch/combine for one EP group over torch.distributed (a
    :class:`~moe_dispatch.transport.base.Transport`).

    Args:
        group: the EP process group (gloo or NCCL).
        topology: this rank's place in the group.
        timeout_s: bound on every collective; a peer that never joins makes it raise
            :class:`CommError` naming the operation and the peers.
        num_chunks: the two-stage pipeline depth (module docstring), the same on every rank; 1
            runs the stages one after the other. None (default): the route and depth follow each
            dispatch's size (flat for small calls and for worlds of one node or one rank per
            node, or little de-duplication; one chunk per :data:`CHUNK_BYTES`, at most
            :data:`NUM_CHUNKS`).

    Collective: construction creates the sub-groups and must be called by every rank of
    ``group`` (each rank joins its own inter-node, intra-node and all-ranks groups; on NCCL also
    a gloo group of all ranks for the argument checks, :meth:`agree`). :meth:`close` destroys
    them.
    """

    # A fresh dispatch's counts travel in the Buffer's one queue, on the group of the checks: every
    # first collective of an operation is the same block exchange, so ranks running different
    # operations (or a dispatch sized on one rank and num_worst_tokens on another) get a ValueError.
    plans_on_comm_thread = True
    # dispatch / forward / combine take the fused permute (``permute``, ``permuted``) and the
    # argument check to overlap (``check``) as keywords (see base.Transport).
    fuses_layout = True

    def __init__(self, group: dist.ProcessGroup, topology: Topology, timeout_s: float, num_chunks: int | None = None):
        if num_chunks is not None and not (isinstance(num_chunks, int) and num_chunks >= 1):
            raise ValueError(f"num_chunks must be a positive int or None (automatic), got {num_chunks!r}")
        self.topology = topology
        self.timeout_s = timeout_s
        self.num_chunks = num_chunks
        # The count sub-ranges of a fresh dispatch, and the words of every block's header: the
        # agreement row, the rows of payload the block carries (-1: none), the sender's sizes,
        # then its counts for the destination, per sub-range.
        self._subs = num_chunks or (NUM_CHUNKS if topology.num_nodes > 1 and topology.ranks_per_node > 1 else 1)
        self._header_words = AGREE_WORDS + 1 + _NUM_SIZES + self._subs * (topology.ranks_per_node + 1)
        # Payload bytes a check's block carries to each peer: set by every fresh dispatch's payload
        # from its agreed sizes (the same on every rank, in queue order), so every rank's blocks
        # have the same size whatever its arguments are.
        self._capacity = 0
        self._recent_pairs = collections.deque(maxlen=RECENT_DISPATCHES)  # their largest pair's bytes
        group_ranks = dist.get_process_group_ranks(group)
        self._links_key = (tuple(group_ranks), topology.ranks_per_node)  # see _links
        self.progress = Progress(group_ranks, topology.rank)
        backend = dist.get_backend(group)
        timeout = datetime.timedelta(seconds=timeout_s)
        self.peers = {
            INTER: topology.peer_ranks(topology.local_rank),  # EP ranks, one per node
            INTRA: topology.node_ranks(topology.node),
            ALL_COMM: list(range(topology.world_size)),
        }
        # The argument checks move host ints: over the comm thread's group on gloo, else over a
        # gloo group of their own (on NCCL a host read of the codes would synchronise the device).
        gloo = str(backend) == "gloo"
        self._agree_kind = ALL_COMM if gloo else HOST
        if not gloo:
            self.peers[HOST] = list(range(topology.world_size))
        # Only members create a sub-group (use_local_synchronization), so EP groups that are
        # themselves sub-groups of the world (Megatron) need no world-wide agreement. Our own
        # groups carry our timeout, whatever the caller's group has.
        self.groups = {
            kind: (
                _new_group([group_ranks[r] for r in ranks], timeout, "gloo" if kind == HOST else str(backend))
                if len(ranks) > 1
                else None
            )
            for kind, ranks in self.peers.items()
        }

    def close(self) -> None:
        """Waits at a barrier until every rank's last collective is done, then :meth:`release`
        (collective: every rank, after its last operation; the payload lives in the tensors of
        each call, nothing else to free).

        Raises:
            CommError: a peer did not reach the barrier within ``timeout_s`` (released anyway).
        """
        try:
            group = self.groups.get(self._agree_kind)
            if group is not None:
                describe = functools.partial(self._describe, self._agree_kind, "close (barrier)")
                try:
                    work = dist.barrier(group=group, async_op=True)
                except RuntimeError as err:
                    raise CommError(describe(err)) from err
                Pending(work, describe).wait()
            if _NAMES_REUSED:  # every rank passed the barrier: the groups are idle on every rank
                timeout = datetime.timedelta(seconds=self.timeout_s)
                for group in self.groups.values():
                    if group is not None:
                        key = (tuple(dist.get_process_group_ranks(group)), str(dist.get_backend(group)), timeout)
                        _spare_groups.setdefault(key, []).append(group)
                self.groups = {}
        finally:
            self.release()

    def release(self) -> None:
        """Frees what needs no peer (local, no collective; what a Buffer dropped without close()
        gets): destroys this transport's process groups, ends the progress writer thread and
        removes this rank's store keys. Idempotent."""
        groups, self.groups = self.groups, {}
        for group in groups.values():
            if group is not None and dist.is_initialized() and not _NAMES_REUSED:
                try:
                    dist.destroy_process_group(group)
                except (RuntimeError, ValueError):  # already gone with the world's teardown
                    pass
        self.progress.close()

    # -- collectives -------------------------------------------------------------------------
    def _describe(self, kind: str, what: str, err: Exception) -> str:
        """The CommError text: this rank and node, the operation, timeout or failure, the peers
        it waited for with their nodes, and which of them had not reached the operation (gloo
        does not say which one it missed; :class:`Progress` knows)."""
        topo = self.topology
        others = [r for r in self.peers[kind] if r != topo.rank]
        timed_out = "timed out" in str(err).lower()
        how = f"timed out after timeout_s={self.timeout_s:g}" if timed_out else "failed"
        return (
            f"EP rank {topo.rank} (node {topo.node}): {what} {how} waiting for EP ranks {others} "
            f"(nodes {[r // topo.ranks_per_node for r in others]})"
            f"{self.progress.describe_peers(others, lost=not timed_out)}: {err}"
        )

    def _all_to_all(
        self,
        send: torch.Tensor,
        send_splits: list[int] | None,
        recv_splits: list[int] | None,
        kind: str,
        what: str,
        recv: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, Pending | None]:
        """Starts ``all_to_all_single`` on the ``kind`` group (equal splits when None) into
        ``recv`` (contiguous, allocated when None). In a group of one the rows are already this
        rank's: ``send`` itself comes back (no ``recv`` then)."""
        group = self.groups[kind]
        if group is None:
            assert recv is None, "a group of one receives nothing: its caller skips the copy"
            return send, None
        if recv is None:
            rows = sum(recv_splits) if recv_splits is not None else send.shape[0]
            recv = send.new_empty((rows, *send.shape[1:]))

        def describe(err):
            return self._describe(kind, f"{what} ({kind} all_to_all)", err)

        try:
            work = dist.all_to_all_single(recv, send, recv_splits, send_splits, group=group, async_op=True)
        except RuntimeError as err:
            raise CommError(describe(err)) from err
        return recv, Pending(work, describe)

    def _check(self, rows: list[list[int]], fields: dict[str, Field], what: str) -> None:
        """Every rank's ``[status, field codes...]`` row checked (:func:`agreement.check`); a
        refusing rank's text is read from the store for the operation this thread is in."""
        seq = self.progress.current_seq()
        agreement.check(
            rows,
            fields,
            rank=self.topology.rank,
            what=what,
            refusals=lambda ranks: self.progress.read_refusals(ranks, seq),
        )

    def agree(self, fields: dict[str, Field], what: str, status: int = 0) -> "Agreement":
        """The argument check of an operation whose sizes are not exchanged (combine, cached
        dispatch, the kernels' plan): iterating it gives its steps, one block exchange on the host
        group (the comm thread's group on gloo, a gloo group of the same ranks on NCCL, so no
        device synchronisation), then :func:`agreement.check` on every rank. Ranks that disagree
        would abort inside gloo, or hang or read garbage on NCCL, had the payload moved first.
        Given to :meth:`combine` or :meth:`forward` as ``check``, the flat route's rows travel in
        the same blocks where they fit (:data:`FUSED_BYTES`). The wire format and the messages:
        :mod:`moe_dispatch.transport.agreement`.

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
        return Agreement(self, fields, what, status)

    def _headers(self, fields: dict[str, Field], status: int, device) -> torch.Tensor:
        """``[W, header words]`` int64, a row per destination: this rank's agreement row, no
        payload, zero sizes and counts (what a check sends; a fresh dispatch fills the rest)."""
        row = [*agreement.row(fields, status, AGREE_WORDS), -1] + [0] * (self._header_words - AGREE_WORDS - 1)
        # from an array's buffer: a third of torch.tensor's time on a nested list
        head = torch.frombuffer(array.array("q", row * self.topology.world_size), dtype=torch.int64)
        return head.view(self.topology.world_size, -1).to(device)

    def _exchange_blocks(self, head: torch.Tensor, what: str, kind: str, rows: tuple | None = None) -> Steps:
        """Steps of one equal-split exchange of blocks ``[header | payload]`` on the ``kind`` group
        (every rank's blocks have the same size: the header's, plus :attr:`_capacity` bytes when
        ``kind`` is the payloads' group); returns ``(headers [W, header words] int64, blocks [W,
        block bytes] uint8)`` by source. ``rows = (fields, send_splits)``: the rows by
        destination, ``fields`` as :func:`_pack` takes them, packed straight into the blocks (the
        caller checked they fit); their count per destination goes in the header."""
        world = self.topology.world_size
        head_bytes = self._header_words * 8
        capacity = self._capacity if kind == ALL_COMM else 0
        send = torch.empty((world, head_bytes + capacity), dtype=torch.uint8, device=head.device)
        if rows is not None:
            fields, splits = rows
            _pack_blocks(send, head, fields, splits, AGREE_WORDS)
        else:
            send[:, :head_bytes].view(torch.int64).copy_(head)
        recv, pending = self._all_to_all(send.view(-1), None, None, kind, what)
        yield pending
        recv = recv.view(world, -1)
        return recv[:, :head_bytes].view(torch.int64), recv

    def _carried(self, blocks: torch.Tensor, carried: list[int], expected: list[int], width: int, what: str):
        """The rows of ``width`` bytes each source's block carried (``carried`` of them; the plan's
        ``expected``), by source: left in the blocks (a :class:`_Carried`) where ``_C`` lands
        them from there, else ``[R, width]`` uint8 (:meth:`_carried_rows`)."""
        self._expect(carried, expected, what)
        if blocks.device.type == "cpu" and _ext.extension_status().built:
            return _Carried(blocks, carried, self._header_words * 8, width)
        return self._carried_rows(blocks, carried, width)

    def _expect(self, carried: list[int], expected: list[int], what: str) -> None:
        if carried != expected:
            raise RuntimeError(
                f"EP rank {self.topology.rank}: {what}: the peers sent {carried} rows, the plan expects {expected}"
            )

    def _carried_rows(self, blocks: torch.Tensor, carried: list[int], width: int) -> torch.Tensor:
        """``[R, width]`` uint8: the rows each source's block carried, by source."""
        head_bytes = self._header_words * 8
        return torch.cat([blocks[s, head_bytes : head_bytes + n * width].view(n, width) for s, n in enumerate(carried)])

    def _carries(self, send_splits: list[int], width: int, device: torch.device) -> bool:
        """Whether an argument check's blocks carry flat rows of ``width`` bytes sent by
        ``send_splits`` (the same answer on every rank: the block holds every rank's largest)."""
        return self._agree_kind == ALL_COMM and device.type == "cpu" and max(send_splits) * width <= self._capacity

    def _agreed(self, check: "Agreement", rows: tuple | None = None) -> Steps:
        """Steps of ``check`` (see :meth:`agree`); with ``rows = (fields, send_splits, recv_splits,
        what, in_blocks)`` also the flat exchange of the rows of ``fields`` (as :func:`_pack` takes
        them), returned packed as ``[R, wb]`` by source: inside the check's blocks where every
        rank's fit (one collective; with ``in_blocks`` they may stay there, a :class:`_Carried`),
        else after it."""
        kind = self._agree_kind
        if self.groups[kind] is None:  # a group of one: nothing to compare, the rows are this rank's
            self._check([agreement.row(check.fields, check.status, AGREE_WORDS)], check.fields, check.what)
            return None if rows is None else _pack(rows[0])
        fused = width = None
        if rows is not None:
            fields, send_splits = rows[0], rows[1]
            width = _packed_width([t for t, _ in fields])
            if self._carries(send_splits, width, fields[0][0].device):
                # packed straight into the blocks (one index for every field), else packed first
                shared = all(i is fields[0][1] for _, i in fields)
                fused = (fields if shared else [(_pack(fields), None)], send_splits)
        head = self._headers(check.fields, check.status, torch.device("cpu"))
        headers, blocks = yield from self._exchange_blocks(head, f"{check.what} argument check", kind, fused)
        got = headers[:, : AGREE_WORDS + 1].tolist()  # the agreement rows, then the rows carried
        self._check([r[:AGREE_WORDS] for r in got], check.fields, check.what)
        if rows is None:
            return None
        fields, send_splits, recv_splits, what, in_blocks = rows
        carried = [r[AGREE_WORDS] for r in got]
        if all(n >= 0 for n in carried):  # every rank's rows came with its header
            if in_blocks:
                return self._carried(blocks, carried, recv_splits, width, what)
            self._expect(carried, recv_splits, what)
            return self._carried_rows(blocks, carried, width)  # the sums read rows of one stride
        recv, pending = self._all_to_all(_pack(fields), send_splits, recv_splits, ALL_COMM, what)
        yield pending
        return recv

    # -- dispatch ----------------------------------------------------------------------------
    def plan(
        self,
        is_token_in_rank: torch.Tensor,
        fields: dict[str, Field],
        what: str = "dispatch",
        on_comm_thread: bool = False,
        status: int = 0,
        rows: list[torch.Tensor] | None = None,
    ) -> Steps:
        """Steps that exchange the layout counts and return the :class:`TorchDistPlan` (its route
        is chosen by the first payload transfer); one block exchange on the all-ranks group, the
        one every argument check uses (:meth:`agree`), so the blocks have the same size whatever
        operation a peer runs, and the operation is the first field compared.

        Args:
            is_token_in_rank: ``[T, W]`` bool, as from ``get_dispatch_layout``; the per-rank and
                per-node counts are taken per sub-range of the tokens from it.
            fields: arguments that must agree on every rank (ints, bools, dtypes, the same keys
                everywhere). They ride in front of the counts, after this rank's status
                (:mod:`~moe_dispatch.transport.agreement`), so they are compared before any
                payload moves and the message has the same size on every rank whatever they
                hold (a size mismatch inside a collective aborts the process instead of raising).
            on_comm_thread: unused: the steps always run in the Buffer's one queue
                (``plans_on_comm_thread``), as every collective of this transport.
            status: 0, or this rank's refusal: then ``is_token_in_rank`` is ``[0, W]`` (zero
                counts), the fields are -1, and every rank raises after the exchange.
            rows: the dispatch's row tensors ``[T, ...]`` (what :meth:`dispatch` will get), or
                None. Where they fit the blocks (the previous dispatch's size, see
                :data:`FUSED_BYTES`) they travel with the counts, and if every rank's did and the
                route is flat, :meth:`dispatch` only lands them: one collective per dispatch.

        Raises (from the steps):
            ValueError: a rank refused (naming each and quoting its error), or naming the first
                field and the EP ranks that differ from this rank.
        """
        topo = self.topology
        world, local_ranks, num_nodes = topo.world_size, topo.ranks_per_node, topo.num_nodes
        device, num_tokens = is_token_in_rank.device, is_token_in_rank.shape[0]
        subs = self._subs
        bounds = [c * num_tokens // subs for c in range(subs + 1)]
        checked = {"operation": "dispatch (metadata)", **fields}
        head = self._headers(checked, status, device)
        sizes_at = AGREE_WORDS + 1  # header words: agreement row, carried rows, sizes, counts
        per_sub, in_node, send_idx = _dispatch_counts(is_token_in_rank, bounds, topo, head, sizes_at)
        fused = None
        if rows is not None and self._capacity and device.type == "cpu":
            width = _packed_width(rows)
            send_splits = [sum(col) for col in zip(*per_sub.tolist())][:world]
            if max(send_splits) * width <= self._capacity:
                send_idx = _flat_send_idx(is_token_in_rank) if send_idx is None else send_idx
                fused = ([(t, send_idx) for t in rows], send_splits)
        if self.groups[ALL_COMM] is None:
            got, blocks = head, None
        else:
            got, blocks = yield from self._exchange_blocks(head, f"{what} metadata", ALL_COMM, fused)
        # Every header and my counts as host ints in one transfer (one host sync on GPU).
        host = torch.cat([got.flatten(), per_sub.flatten()]).tolist()
        words = got.shape[1]
        rows_of = [host[w * words : (w + 1) * words] for w in range(world)]
        mine = host[world * words :]
        self._check([r[:AGREE_WORDS] for r in rows_of], checked, what)
        to_rank_l = [mine[c * (world + num_nodes) : c * (world + num_nodes) + world] for c in range(subs)]
        to_node_l = [mine[c * (world + num_nodes) + world : (c + 1) * (world + num_nodes)] for c in range(subs)]
        # Source w's counts for my node, per sub-range: its tokens for each of my node's ranks, then
        # for my node. Sources (m, my local rank) forward through me; every source sends me rows.
        counts_at = sizes_at + _NUM_SIZES
        of = [
            [r[counts_at + c * (local_ranks + 1) : counts_at + (c + 1) * (local_ranks + 1)] for c in range(subs)]
            for r in rows_of
        ]  # [W][S][L + 1]
        peers = [of[m * local_ranks + topo.local_rank] for m in range(num_nodes)]  # [N][S][L + 1]
        sizes_of = [r[sizes_at:counts_at] for r in rows_of]
        counts_of = _Counts(
            is_token_in_rank=is_token_in_rank,
            in_node=in_node,
            bounds=bounds,
            to_rank=to_rank_l,
            to_node=to_node_l,
            from_rank=[sum(sub[topo.local_rank] for sub in src) for src in of],
            s1_recv=[[peers[m][c][-1] for m in range(num_nodes)] for c in range(subs)],
            s2_send=[[sum(peers[m][c][j] for m in range(num_nodes)) for j in range(local_ranks)] for c in range(subs)],
            arrivals=[
                [[of[m * local_ranks + j][c][topo.local_rank] for m in range(num_nodes)] for j in range(local_ranks)]
                for c in range(subs)
            ],
            max_flat_rows=max(z[0] for z in sizes_of),
            max_stage1_rows=max(z[1] for z in sizes_of),
            max_pair_rows=max(z[4] for z in sizes_of),
            total_flat_rows=sum(z[0] for z in sizes_of),
            flat_cross_rows=sum(z[2] for z in sizes_of),
            stage1_cross_rows=sum(z[3] for z in sizes_of),
            send_idx=send_idx,
        )
        plan = TorchDistPlan(
            num_tokens=num_tokens,
            num_recv_tokens=sum(counts_of.from_rank),
            counts=counts_of,
            internode_rows=sum(sum(s) - s[topo.node] for s in to_node_l),
            intranode_rows=sum(sum(s) - s[topo.local_rank] for s in counts_of.s2_send),
        )
        carried = [r[AGREE_WORDS] for r in rows_of]
        if blocks is not None and all(n >= 0 for n in carried):  # every rank's rows came along
            self._route(plan, width)  # the packed rows' width: set where the rows were fused
            if plan.flat:
                plan.arrived = self._carried(blocks, carried, counts_of.from_rank, width, what)
        return plan

    @property
    def _two_stage_world(self) -> bool:
        """Both stages cross processes (several nodes of several ranks)."""
        return self.topology.num_nodes > 1 and self.topology.ranks_per_node > 1

    def _route(self, plan: TorchDistPlan, row_bytes: int) -> None:
        """Chooses ``plan``'s route and depth for rows of ``row_bytes`` packed bytes (first payload
        of the plan; every rank decides the same, from the sizes of every rank and the agreed width)."""
        counts = plan.counts
        if counts is None or plan.chunks or plan.flat:
            return
        topo = self.topology
        local_ranks, num_nodes = topo.ranks_per_node, topo.num_nodes
        if self.num_chunks is None and (not self._two_stage_world or not self._two_stages_pay(counts, row_bytes)):
            plan.flat = True
            plan.flat_send_idx = (
                counts.send_idx if counts.send_idx is not None else _flat_send_idx(counts.is_token_in_rank)
            )
            plan.flat_send_splits = [sum(col) for col in zip(*counts.to_rank)]
            plan.flat_recv_splits = counts.from_rank
            plan.internode_rows = sum(n for d, n in enumerate(plan.flat_send_splits) if d // local_ranks != topo.node)
            plan.intranode_rows = sum(
                n for d, n in enumerate(plan.flat_send_splits) if d // local_ranks == topo.node and d != topo.rank
            )
            return
        subs = len(counts.to_node)
        depth = self.num_chunks or max(1, min(subs, -(-counts.max_stage1_rows * row_bytes // CHUNK_BYTES)))
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

    def _two_stages_pay(self, counts: _Counts, row_bytes: int) -> bool:
        """Whether the two stages would be faster than the flat route for rows of ``row_bytes``
        (from agreed sizes and links: every rank decides the same). Per rank, on average: the flat
        route sends its cross-node rows and, to the other ranks of its node, its in-node rows; the
        two stages send one copy per token and node across, then every row once more inside the
        destination's node, one collective more. A flat collective moves its cross-node and
        in-node rows at once (every peer's transfer is posted before any is waited for), so it
        lasts as long as the slower of the two; the stages run one after the other."""
        largest = counts.max_flat_rows * row_bytes
        if self._agree_kind != ALL_COMM:  # NCCL: GPU links
            return largest > FLAT_BYTES and counts.stage1_cross_rows <= (1 - MIN_DEDUP) * counts.flat_cross_rows
        if largest <= LINK_PROBE_BYTES or counts.stage1_cross_rows >= counts.flat_cross_rows:
            return False
        links = self._links()
        world, local_ranks = self.topology.world_size, self.topology.ranks_per_node
        others = (local_ranks - 1) / local_ranks  # of the rows for my node, those for its other ranks
        cross, stage1 = counts.flat_cross_rows * row_bytes / world, counts.stage1_cross_rows * row_bytes / world
        rows = counts.total_flat_rows * row_bytes / world
        flat = links.collective_s + max(cross * links.per_inter_byte, (rows - cross) * others * links.per_intra_byte)
        two = links.two_collectives_s + stage1 * links.per_inter_byte + rows * others * links.per_intra_byte
        return two < TWO_STAGE_GAIN * flat

    def _padding_pays(self, counts: _Counts, row_bytes: int, block_rows: int) -> bool:
        """Whether a check's blocks should carry the flat rows (every block padded to
        ``block_rows`` rows, at least the largest pair's: one collective) rather than the check and
        the rows going apart (two): yes where the padding adds at most FUSED_PADDING to the bytes
        moved; else where the measured links move the slowest rank's extra bytes in less time
        than a collective takes (from agreed sizes: every rank decides the same)."""
        world = self.topology.world_size
        if block_rows * world * world <= FUSED_PADDING * counts.total_flat_rows:
            return True
        links = self._links()
        extra = (block_rows * world - counts.max_flat_rows) * row_bytes
        return extra * links.per_byte < links.collective_s

    def _links(self) -> "Links":
        """The links of this transport's ranks (:class:`Links`), measured the first time a gloo call
        asks: on each of its groups (all ranks, inter-node, intra-node, those it has), a few bytes,
        then :data:`LINK_PROBE_BYTES` per peer, every rank at once as the routes run; each rank times
        :data:`LINK_PROBE_SAMPLES` exchanges after one untimed one, every rank of the transport
        starting each together (so a late rank's start is not timed as the link's), and keeps
        their median. Each figure is the largest over the ranks, so every rank decides alike.
        Kept for every later transport over the same ranks and nodes in this process (they share
        the links, and so decide alike)."""
        if self.groups[ALL_COMM] is None:  # a group of one: nothing moves, nothing to measure
            return Links(collective_s=0.0, per_byte=0.0, two_collectives_s=0.0, per_inter_byte=0.0, per_intra_byte=0.0)
        if self._links_key not in _measured_links:
            # The all-ranks group's large exchange goes last: it drains shaped links' bursts, which
            # the inter-node figure the routes weigh would then not see.
            probes = [
                (kind, nbytes)
                for kind, nbytes in (
                    (ALL_COMM, _ALIGN),
                    (INTER, _ALIGN),
                    (INTER, LINK_PROBE_BYTES),
                    (INTRA, _ALIGN),
                    (INTRA, LINK_PROBE_BYTES),
                    (ALL_COMM, LINK_PROBE_BYTES),
                )
                if self.groups[kind] is not None
            ]
            times = []
            line_up = torch.zeros(self.topology.world_size * _ALIGN, dtype=torch.uint8)
            for kind, nbytes in probes:
                send = torch.zeros(len(self.peers[kind]) * nbytes, dtype=torch.uint8)
                recv = torch.empty_like(send)  # one buffer: a fresh one's page faults are not the link's
                samples = []
                for _ in range(1 + LINK_PROBE_SAMPLES):
                    # Every rank of every group starts the sample together (one all-ranks exchange
                    # of a few bytes, untimed): groups out of step would time each other's traffic.
                    self._all_to_all(line_up, None, None, ALL_COMM, "link probe")[1].wait()
                    start = time.perf_counter()
                    self._all_to_all(send, None, None, kind, "link probe", recv=recv)[1].wait()
                    samples.append(time.perf_counter() - start)
                times.append(statistics.median(samples[1:]))
            slowest = torch.tensor(times, dtype=torch.float64)
            work = dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=self.groups[ALL_COMM], async_op=True)
            Pending(work, lambda err: self._describe(ALL_COMM, "link probe (all_reduce)", err)).wait()
            took = dict(zip(probes, slowest.tolist()))
            small = {kind: t for (kind, nbytes), t in took.items() if nbytes == _ALIGN}
            per_byte = {
                kind: max(t - small[kind], 0.0) / ((len(self.peers[kind]) - 1) * LINK_PROBE_BYTES)
                for (kind, nbytes), t in took.items()
                if nbytes == LINK_PROBE_BYTES
            }
            _measured_links[self._links_key] = Links(
                collective_s=small[ALL_COMM],
                per_byte=per_byte[ALL_COMM],
                two_collectives_s=small.get(INTER, 0.0) + small.get(INTRA, 0.0),
                per_inter_byte=per_byte.get(INTER, 0.0),
                per_intra_byte=per_byte.get(INTRA, 0.0),
            )
            if self.topology.rank == 0:
                logger.info("links of EP ranks %s: %s", self._links_key[0], _measured_links[self._links_key])
        return _measured_links[self._links_key]

    @property
    def measured_links(self) -> "Links | None":
        """The links :meth:`_links` measured for these ranks and nodes in this process, or None
        where no call has needed them yet (small calls, NCCL)."""
        return _measured_links.get(self._links_key)

    def _final_of_arrival(self, plan: TorchDistPlan) -> torch.Tensor | None:
        """``[R]``: the final row of each arrival row, the gather index from final order into
        arrival order (None when they coincide); the inverse of ``plan.recv_perm``."""
        if plan.recv_perm is None:
            return None

        def inverse():
            arrival = torch.empty_like(plan.recv_perm)
            arrival[plan.recv_perm] = torch.arange(arrival.numel(), device=arrival.device)
            return arrival

        return plan.cached("arrival", inverse)

    def _land(
        self,
        recv: "torch.Tensor | _Carried",
        plan: TorchDistPlan,
        specs: list[tuple[torch.dtype, tuple[int, ...]]],
        out: list[torch.Tensor],
        permute: tuple[int, Callable[[], PermuteHandle]] | None,
        permuted: PermuteHandle | None = None,
    ) -> None:
        """Writes the packed arrivals ``recv`` (or the blocks they came in) into ``out``: in final
        order; or, for the first ``k`` tensors of ``permute = (k, layout)``, expert-major as the
        permute handle ``layout()`` lays the received rows out (zero padding rows; ``layout`` is
        called once the other tensors landed). With ``permuted`` every tensor lands in that
        handle's layout. One gather per tensor."""
        k, layout = permute if permute is not None else (len(out) if permuted is not None else 0, None)
        offsets = list(itertools.accumulate([0, *(_padded(_row_bytes(*spec)) for spec in specs)]))
        if isinstance(recv, _Carried):  # still in the blocks they came in: one pass each way
            assert plan.recv_perm is None, "rows come with the counts on the flat route only (final order)"
            recv.land([(offsets[j], _row_bytes(*specs[j]), out[j], None) for j in range(k, len(out))])
            if k:
                src, _ = permuted_sources(permuted if permuted is not None else layout())
                recv.land([(offsets[j], _row_bytes(*specs[j]), out[j], src) for j in range(k)])
            return
        fields = [recv[:, offsets[j] : offsets[j] + _row_bytes(*spec)] for j, spec in enumerate(specs)]
        for field, dst in zip(fields[k:], out[k:]):
            _unpack_rows(field, plan.recv_perm, [dst])
        if not k:
            return
        src, _ = permuted_sources(permuted if permuted is not None else layout())
        if plan.recv_perm is not None:  # final rows -> arrival rows
            src = torch.where(src >= 0, plan.recv_perm[src.clamp(min=0)], -1)
        for field, dst in zip(fields[:k], out[:k]):
            gather_rows(field, src, out=_as_bytes(dst))

    def dispatch(
        self,
        tensors: list[torch.Tensor],
        is_token_in_rank: torch.Tensor,
        plan: TorchDistPlan,
        out: list[torch.Tensor],
        what: str = "dispatch",
        permute: tuple[int, Callable[[], PermuteHandle]] | None = None,
    ) -> Steps:
        """Steps that move row tensors ``[T, ...]`` to the ranks holding each token and write
        them, in (source rank, source token) order, into ``out`` (``[R, ...]`` each); the first
        payload chooses the plan's route, and two-stage ones fill the chunks' stage-2 indices.

        ``permute = (k, layout)`` fuses a permute: ``tensors[:k]`` land expert-major into
        ``out[:k]`` (``[P, ...]``) as the :class:`~moe_dispatch.semantics.permute.PermuteHandle`
        ``layout()`` lays the received rows out (zero padding rows); ``layout`` is called once
        ``out[k:]`` hold their rows (it reads the received top-k ids)."""
        width = _packed_width(tensors)
        self._route(plan, width)
        # The blocks of the following checks carry this dispatch's flat rows (combine's are at most
        # as wide): from agreed sizes, at the same point of the queue on every rank.
        # Blocks sized for the largest of the recent dispatches also carry the next dispatch's rows
        # with its counts more often (a model's layers route differently), where that padding pays.
        fused = plan.counts.max_pair_rows * width if plan.flat and plan.counts is not None else 0
        self._recent_pairs.append(fused)
        self._capacity = 0
        if 0 < fused and self._agree_kind == ALL_COMM:
            for capacity in dict.fromkeys((max(self._recent_pairs), fused)):
                if capacity <= FUSED_BYTES and self._padding_pays(plan.counts, width, capacity // width):
                    self._capacity = capacity
                    break
        if plan.arrived is not None:  # the rows came with the counts
            recv, plan.arrived = plan.arrived, None
            self._land(recv, plan, _specs(tensors), out, permute)
            return
        if plan.flat:
            yield from self._flat_dispatch(tensors, plan, out, what, permute)
            return
        topo = self.topology
        num_tokens, local_ranks = is_token_in_rank.shape[0], topo.ranks_per_node
        routing = is_token_in_rank.view(num_tokens * topo.num_nodes, local_ranks)  # row t * N + node

        def send1(chunk):
            # Each row also carries the destination node's L columns of is_token_in_rank: the
            # forwarder's routing.
            rows = slice(chunk.begin, chunk.end)
            return _pack(
                [
                    *[(t[rows], chunk.s1_send_idx) for t in tensors],
                    (routing[chunk.begin * topo.num_nodes : chunk.end * topo.num_nodes], chunk.s1_route_idx),
                ]
            )

        specs = [*_specs(tensors), (torch.bool, (local_ranks,))]

        def route2(chunk, recv1):
            # The forwarder (n, l) hands each row to the local ranks of node n that hold it; it
            # keeps the rows packed and forwards them whole (routing columns too).
            in_local = _fields(recv1, specs)[-1]
            chunk.s2_send_idx = torch.nonzero(in_local.t())[:, 1]  # local-rank-major, rows ascending
            if chunk.s2_send_idx.numel() != sum(chunk.s2_send_splits):
                raise RuntimeError(
                    f"EP rank {topo.rank}: {what}: forwarded rows ({chunk.s2_send_idx.numel()}) "
                    f"disagree with the metadata ({sum(chunk.s2_send_splits)}); did every rank "
                    f"pass the same num_experts?"
                )
            return chunk.s2_send_idx

        recv2 = yield from self._dispatch_pipeline(send1, route2, plan, what)
        self._land(recv2, plan, specs[:-1], out, permute)

    def _flat_dispatch(self, tensors, plan, out, what, permute=None, permuted=None, check=None) -> Steps:
        """The flat route: one exchange, rows arrive in final order; a replay's (``check``: its
        argument check) travel inside the check's blocks where they fit, and land from there."""
        fields = [(t, plan.flat_send_idx) for t in tensors]
        width = _packed_width(tensors)
        if check is not None and not self._carries(plan.flat_send_splits, width, tensors[0].device):
            begun = _begin(check)  # the rows go after the check: pack them while it is in flight
            fields = [(_pack(fields), None)]
            yield from _complete(check, begun)
            check = None
        recv = yield from self._flat_exchange(fields, plan.flat_send_splits, plan.flat_recv_splits, what, check, True)
        self._land(recv, plan, _specs(tensors), out, permute, permuted)

    def _flat_exchange(self, fields, send_splits, recv_splits, what, check=None, in_blocks=False) -> Steps:
        """Steps moving the rows of ``fields`` (as :func:`_pack` takes them, by destination) on
        the flat route; returns them packed, ``[R, wb]`` by source, or, with ``in_blocks``, maybe
        still in the blocks they came in (a :class:`_Carried`, for :meth:`_land` or the sums).
        With ``check`` (an :class:`Agreement`) the check runs first, or carries the rows
        (:meth:`_agreed`)."""
        what = f"{what} (flat exchange)"
        if check is not None:
            return (yield from self._agreed(check, (fields, send_splits, recv_splits, what, in_blocks)))
        recv, pending = self._all_to_all(_pack(fields), send_splits, recv_splits, ALL_COMM, what)
        yield pending
        return recv

    def forward(
        self,
        tensors: list[torch.Tensor],
        plan: TorchDistPlan,
        out: list[torch.Tensor],
        what: str,
        permuted: PermuteHandle | None = None,
        check: Steps | None = None,
    ) -> Steps:
        """Steps replaying a plan's dispatch for other row tensors ``[T, ...]`` into ``out``
        (cached dispatch, combine's backward); with ``permuted`` (a permute handle of the received
        rows) into ``[P, ...]`` outputs in its expert-major layout (a fused permute's replay).
        ``check``: the argument check, started before the first payload is packed and completed
        before it moves."""
        if plan.flat:
            yield from self._flat_dispatch(tensors, plan, out, what, None, permuted, check)
            return
        begun = _begin(check)

        def send1(chunk):
            return _pack([(t[chunk.begin : chunk.end], chunk.s1_send_idx) for t in tensors])

        first = send1(plan.chunks[0])
        yield from _complete(check, begun)
        recv2 = yield from self._dispatch_pipeline(send1, lambda chunk, recv1: chunk.s2_send_idx, plan, what, first)
        self._land(recv2, plan, _specs(tensors), out, None, permuted)

    def _dispatch_pipeline(self, send1, route2, plan: TorchDistPlan, what: str, first=None) -> Steps:
        """Stage 1 of chunk c + 1 crosses nodes while stage 2 forwards chunk c. ``send1(chunk)``
        packs a chunk's stage-1 rows (``first``: chunk 0's, already packed), ``route2(chunk,
        recv1)`` returns the index of its stage-2 send rows in what stage 1 delivered; the stage-2
        rows of every chunk land back to back in one buffer, which the steps return (in arrival
        order). With one rank per node stage 2 stays on this rank and forwards every row (the
        index is ``arange``): its rows are gathered straight into that buffer, or, with one chunk,
        stage 1 delivered the buffer itself."""
        chunks = plan.chunks
        recv2, landed, in_flight = None, 0, []
        inter = self._all_to_all(
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
                inter = self._all_to_all(
                    packed, following.s1_send_splits, following.s1_recv_splits, INTER, f"{what} stage 1"
                )
            index = route2(chunk, recv1)
            if self.groups[INTRA] is None and len(chunks) == 1 and index.numel() == recv1.shape[0]:
                return recv1  # every row forwarded to itself, in order
            if recv2 is None:  # stage 2 forwards whole packed rows
                recv2 = recv1.new_empty((plan.num_recv_tokens, recv1.shape[1]))
            rows = sum(chunk.s2_recv_splits)
            if self.groups[INTRA] is None:
                torch.index_select(recv1, 0, index, out=recv2[landed : landed + rows])
            else:
                _, pending = self._all_to_all(
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

    # -- combine -----------------------------------------------------------------------------
    def combine(
        self,
        tensors: list[torch.Tensor],
        scales: list[torch.Tensor | None],
        plan: TorchDistPlan,
        out: list[torch.Tensor],
        what: str = "combine",
        permuted: list[PermuteHandle | None] | None = None,
        check: Steps | None = None,
    ) -> Steps:
        """Steps summing received rows back onto their source tokens.

        Args:
            tensors: floating row tensors: ``[R, ...]`` in dispatch's receive order, or, where
                ``permuted`` gives a permute handle of the received rows, ``[P, ...]`` in its
                expert-major layout (padding rows ignored): a received row is then the fp32 sum of
                its copies in ascending row order (unpermute), rounded.
            scales: per tensor, None or ``[R]`` fp32 row scales applied (in fp32) before summing.
            plan: the dispatch's plan.
            out: per tensor ``[T, ...]`` in its dtype, written with the sums in the order of the
                module docstring.
            permuted: per tensor None or the handle; None = all None.
            check: the argument check, started before the first payload is prepared and
                completed before it moves.
        """
        permuted = permuted if permuted is not None else [None] * len(tensors)
        if any(s is not None for s in scales) and any(p is not None for p in permuted):
            raise ValueError("combine: row scales apply to received rows, not to expert-major ones")
        arrival = None if plan.flat else self._final_of_arrival(plan)
        # Each tensor's received rows in arrival order: the expert-major ones summed straight there
        # (one pass), the others gathered there as they are packed (index None: in order already).
        # The flat route's rows travel in the check's blocks where they fit; else the check starts
        # first and the rows are made while it is in flight.
        width = _packed_width([*tensors, *[s.view(-1, 1) for s in scales if s is not None]])
        in_blocks = plan.flat and tensors and self._carries(plan.flat_recv_splits, width, tensors[0].device)
        begun = None if in_blocks else _begin(check)
        rows_of = [t if h is None else self._unpermute(plan, t, h) for t, h in zip(tensors, permuted)]
        index_of = [arrival if h is None else None for h in permuted]
        # Scales travel as extra fp32 columns so whoever sums multiplies in fp32.
        payload = [*rows_of, *[s.view(-1, 1) for s in scales if s is not None]]
        payload_index = [*index_of, *[arrival for s in scales if s is not None]]
        specs = _specs(payload)
        if plan.flat:
            fields = list(zip(payload, payload_index))
            if not in_blocks:
                yield from _complete(check, begun)
                check = None
            # the sums read the rows in the blocks they came in, where they came in the check's
            back = yield from self._flat_exchange(
                fields, plan.flat_recv_splits, plan.flat_send_splits, what, check, in_blocks=True
            )
            fields = back.fields(specs) if isinstance(back, _Carried) else _fields(back, specs)
            row_scales = self._row_scales(fields, scales, len(tensors))
            for dst, rows, sc in zip(out, fields[: len(tensors)], row_scales):
                self._flat_sums(plan, rows, sc, dst)
            return
        chunks = plan.chunks
        bounds = [0, *itertools.accumulate(sum(chunk.s2_recv_splits) for chunk in chunks)]

        def send2(c):
            b = slice(bounds[c], bounds[c + 1])
            return _pack([(p[b], None) if i is None else (p, i[b]) for p, i in zip(payload, payload_index)])

        def forwarder_sums(c, chunk, back2):
            back2 = _fields(back2, specs)
            num_forwarded = sum(chunk.s1_recv_splits)
            row_scales = self._row_scales(back2, scales, len(tensors))
            return [
                ordered_sum(_sum_plan(plan, ("forwarder", c), chunk.s2_send_idx, num_forwarded, sc is not None), t, sc)
                for t, sc in zip(back2[: len(tensors)], row_scales)
            ]

        def land(chunk, back1):
            source_sum = _sum_plan(plan, ("source", chunk.begin), chunk.s1_send_idx, chunk.end - chunk.begin)
            for dst, rows in zip(out, _fields(back1, _specs(tensors))):
                ordered_sum(source_sum, rows, out=dst[chunk.begin : chunk.end])

        # With one rank per node and no scales a forwarder's sums are its own rows, which stage 2
        # returned packed just as stage 1 sends them (a sum of one term is the term).
        passthrough = self.groups[INTRA] is None and all(s is None for s in scales)

        # The intra-node return and forwarder sums of chunk c + 1 overlap the inter-node return
        # of chunk c; the source's sums of chunk c overlap the inter-node return of chunk c + 1.
        first = send2(0)
        yield from _complete(check, begun)
        intra = self._all_to_all(first, chunks[0].s2_recv_splits, chunks[0].s2_send_splits, INTRA, f"{what} stage 2")
        in_flight = None  # (chunk, back1, pending): the inter-node return on the wire
        for c, chunk in enumerate(chunks):
            packed = send2(c + 1) if c + 1 < len(chunks) else None
            back2, pending = intra
            yield pending
            if packed is not None:
                intra = self._all_to_all(
                    packed, chunks[c + 1].s2_recv_splits, chunks[c + 1].s2_send_splits, INTRA, f"{what} stage 2"
                )
            send1 = back2 if passthrough else _pack([(p, None) for p in forwarder_sums(c, chunk, back2)])
            arrived = in_flight
            if arrived is not None:
                yield arrived[2]  # the inter-node link is free again
            back1, pending = self._all_to_all(
                send1, chunk.s1_recv_splits, chunk.s1_send_splits, INTER, f"{what} stage 1"
            )
            in_flight = (chunk, back1, pending)
            if arrived is not None:
                land(*arrived[:2])  # while chunk c crosses back
        yield in_flight[2]
        land(*in_flight[:2])

    @staticmethod
    def _row_scales(fields: list, scales: list[torch.Tensor | None], num_tensors: int) -> list:
        """Per tensor its scale column among the packed ``fields`` (``[rows]`` fp32), or None."""
        out, k = [], num_tensors
        for s in scales:
            if s is None:
                out.append(None)
                continue
            column = fields[k].gathered() if isinstance(fields[k], BlockedRows) else fields[k]
            out.append(column.view(-1))
            k += 1
        return out

    def _unpermute(self, plan: TorchDistPlan, rows: torch.Tensor, permute: PermuteHandle) -> torch.Tensor:
        """``[R, ...]`` in arrival order: each received row the fp32 sum of its copies among the
        expert-major ``rows [P, ...]`` that ``permute`` laid out, ascending row (unpermute)."""

        def make():
            final_of_arrival = self._final_of_arrival(plan)
            terms = permute.row_id_map
            terms = terms if final_of_arrival is None else terms[final_of_arrival]  # outputs in arrival order
            return permute, plan_sum_by_output(terms, permute.num_rows)

        made_for, sum_plan = plan.cached("unpermute", make)
        if made_for is not permute:  # another expert layout over the same dispatch
            made_for, sum_plan = plan.cache["unpermute"] = make()
        return ordered_sum(sum_plan, rows)

    def _flat_sums(
        self, plan: TorchDistPlan, rows: torch.Tensor | BlockedRows, scale: torch.Tensor | None, out: torch.Tensor
    ) -> None:
        """The flat route's combine at the source: ``rows`` come back from every holder in rank
        order (each holder's in token order); inside each node they are summed in fp32 over its
        ranks (ascending) and rounded, then the node partials in fp32 over the nodes (ascending)."""
        topo = self.topology
        local_ranks, num_nodes, num_tokens = topo.ranks_per_node, topo.num_nodes, plan.num_tokens
        if num_nodes == 1 or (local_ranks == 1 and scale is None):
            # one level: with one node the node sum is the sum; with one rank per node and no
            # scales a node partial is its one row
            sum_plan = _sum_plan(plan, "flat", plan.flat_send_idx, num_tokens, scale is not None)
            ordered_sum(sum_plan, rows, scale, out=out)
            return

        device = plan.flat_send_idx.device

        def levels():
            if device.type == "cpu" and _ext.extension_status().built:
                in_node, send_idx = plan.counts.in_node.contiguous(), plan.flat_send_idx.contiguous()
                pair_of_row = torch.empty(send_idx.numel(), dtype=torch.int64)
                pair_token = torch.empty(in_node.numel(), dtype=torch.int64)
                num_pairs = _ext._C.flat_pairs_cpu(
                    in_node=in_node.data_ptr(),
                    num_tokens=num_tokens,
                    num_nodes=num_nodes,
                    ranks_per_node=local_ranks,
                    send_idx=send_idx.data_ptr(),
                    splits=plan.flat_send_splits,
                    pair_of_row=pair_of_row.data_ptr(),
                    pair_token=pair_token.data_ptr(),
                )
                return plan_grouped(pair_of_row, pair_token[:num_pairs], num_tokens, scaled=scale is not None)
            pairs = torch.nonzero(plan.counts.in_node)  # (token, node), token-major: the node partials
            where = torch.full((num_nodes, num_tokens), -1, dtype=torch.int64, device=device)
            where[pairs[:, 1], pairs[:, 0]] = torch.arange(pairs.shape[0], device=device)
            holder_node = torch.repeat_interleave(
                torch.arange(topo.world_size, device=device) // local_ranks,
                torch.tensor(plan.flat_send_splits, device=device),
                output_size=plan.flat_send_idx.numel(),
            )
            pair_of_row = where[holder_node, plan.flat_send_idx]
            return plan_grouped(pair_of_row, pairs[:, 0].contiguous(), num_tokens, scaled=scale is not None)

        grouped_sum(plan.cached(("flat levels", scale is not None), levels), rows, scale, out=out)


def _sum_plan(
    plan: TorchDistPlan, key, index: torch.Tensor, num_out: int, scaled: bool = False
) -> SumPlan | OnePassPlan:
    """The plan's :class:`SumPlan` of rows onto ``num_out`` outputs by ``index``, made once per key."""
    return plan.cached((key, scaled), lambda: plan_sum(index, num_out, scaled=scaled))


def _begin(check: "Agreement | None"):
    """Issues ``check``'s first collective; returns ``(steps, waitable)`` to complete later, or None."""
    if check is None:
        return None
    steps = iter(check)
    try:
        return steps, next(steps)
    except StopIteration:
        return None


def _complete(check: "Agreement | None", begun) -> Steps:
    """Steps finishing a check begun with :func:`_begin` (its ValueError is raised here)."""
    if begun is not None:
        steps, pending = begun
        yield pending
        yield from steps


@dataclasses.dataclass(eq=False)
class Agreement:
    """An argument check (:meth:`TorchDistTransport.agree`): iterating it gives its steps; a
    combine or cached dispatch given it may carry its rows in the check's blocks."""

    transport: TorchDistTransport
    fields: dict[str, Field]
    what: str
    status: int = 0

    def __iter__(self):
        return self.transport._agreed(self)


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
