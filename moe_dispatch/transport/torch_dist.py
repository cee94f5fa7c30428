"""The two-stage hierarchy on torch.distributed sub-group ``all_to_all_single``.

Portable (gloo on CPU, NCCL on GPU, PCIe-safe) and the executable mirror of the CUDA kernels'
orchestration. Rank (n, l) is node n, local index l (see ``Topology``).

Dispatch:
  metadata (group: all EP ranks): each source tells each destination d how many of its
    tokens reach d's node, each rank of d's node, and each of d's experts, per chunk (below).
    From that every rank knows every split below and its receive count before any payload
    moves (so outputs can be allocated up front and the payload can move asynchronously).
  stage 1 (inter-node, group {(m, l) for all m}): each token goes once to every node m that
    holds it, to the forwarder (m, l) with the sender's local index; the copy for the
    sender's own node stays local.
  stage 2 (intra-node, group {(n, l') for all l'}): the forwarder hands each token to the
    local ranks that own its experts. The receiver reorders rows to (source rank, source
    token) order.
Combine runs backwards: receivers return rows to forwarders, forwarders sum their node's
contributions in fp32 (ascending local rank) and round to the payload dtype, so each
(token, node) pair crosses the network once; sources sum node partials in fp32 (ascending
node) and round. Exactly the order of ``moe_dispatch.reference.combine``.

Pipeline. Each source splits its tokens into ``num_chunks`` contiguous ranges; every stage
runs once per chunk, and the inter-node and intra-node groups (separate process groups) carry
different chunks at the same time, so the slow inter-node link never waits for the node::

    dispatch   inter-node | S1(0) | S1(1) | S1(2) | S1(3) |
               intra-node         | S2(0) | S2(1) | S2(2) | S2(3) | reorder
    combine    intra-node | S2(0) | S2(1) | S2(2) | S2(3) |
               forwarder          | sum 0 | sum 1 | sum 2 | sum 3 |
               inter-node         | S1(0) | S1(1) | S1(2) | S1(3) | (sum i lands after S1(i))

A token lives in exactly one chunk, so every sum above runs over the same rows in the same
order as without chunks: results are bit-identical for any chunk count. Stage 2 of all
chunks lands in one buffer that a single gather puts in final order (a per-chunk scatter
would be many times slower on CPU).

Every stage moves all row tensors of one call as a single packed uint8 buffer, so a stage is
one collective per chunk whatever the number of tensors. Operations are written as generators
that yield each collective they wait for (a :class:`Pending`; others may be in flight
meanwhile): the steps of :mod:`moe_dispatch.transport.base`, which ``drive`` runs to
completion; callers may instead stop after the first yield to overlap the first transfer with
their own work.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import itertools
import math

import torch
import torch.distributed as dist

from ..errors import CommError
from ..topology import Topology
from . import agreement
from .agreement import AGREE_WORDS
from .base import Field, Steps
from .progress import Progress

NUM_CHUNKS = 4  # default pipeline depth: enough to hide stage 2 behind stage 1, few collectives


@dataclasses.dataclass
class TorchDistChunk:
    """One chunk of a dispatch's plan: source tokens ``[begin, end)``. Splits are host ints
    (gloo and ``all_to_all_single`` take lists)."""

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


@dataclasses.dataclass
class TorchDistPlan:
    """The index plan of one dispatch (a rank's share of the handle); its combine replays it
    backwards. A :class:`~moe_dispatch.transport.base.Plan`."""

    num_tokens: int
    num_recv_tokens: int
    chunks: list[TorchDistChunk]
    # [R] final row i is row recv_perm[i] of the chunks' stage-2 arrivals, concatenated; None when they
    # arrive in final order (one chunk, and one rank per node or one node)
    recv_perm: torch.Tensor | None
    internode_rows: int  # rows this rank sends to other nodes per dispatch (and receives back in combine)
    intranode_rows: int  # rows this rank forwards to other local ranks per dispatch


class Pending:
    """One in-flight collective; :meth:`wait` turns a failure or timeout into :class:`CommError`."""

    def __init__(self, work, describe):
        self.work, self.describe = work, describe

    def wait(self) -> None:
        try:
            self.work.wait()
        except RuntimeError as err:  # gloo raises on timeout and on a lost peer
            raise CommError(self.describe(err)) from err


_ALIGN = 8  # bytes; every packed field starts at a multiple, so it can be viewed in place as its dtype


def _row_bytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return dtype.itemsize * math.prod(shape)


def _padded(width: int) -> int:
    return -(-width // _ALIGN) * _ALIGN


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


INTER, INTRA, ALL = "inter-node", "intra-node", "all-ranks"

ALL_COMM = "all-ranks (comm thread)"  # the metadata of dispatches that run whole on the comm thread
HOST = "all-ranks (host, gloo)"  # the argument checks of an NCCL EP group: host ints, no device synchronisation


def default_num_chunks(topology: Topology) -> int:
    """The pipeline depth for ``num_chunks=None``: :data:`NUM_CHUNKS` where both stages cross
    processes, else 1 (with one node, or one rank per node, one stage is a local copy, so chunks
    would only add per-collective overhead)."""
    return NUM_CHUNKS if topology.num_nodes > 1 and topology.ranks_per_node > 1 else 1


# torch < 2.14 names a group made with use_local_synchronization after its ranks and the number of
# live groups, so a group made after a destroyed one on the same ranks gets the dead group's name and
# reads its stale rendezvous keys (gloo connects to closed ports and times out). There close() hands
# its idle groups to the next transport on the same ranks instead of destroying them, and a Buffer
# dropped without close() keeps its groups (its peers may still be using theirs).
_NAMES_REUSED = tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 14)
_spare_groups: dict[tuple, list[dist.ProcessGroup]] = {}


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
        num_chunks: pipeline depth (module docstring), the same on every rank; 1 runs the
            stages one after the other. Default: :func:`default_num_chunks`.

    Collective: construction creates the sub-groups and must be called by every rank of
    ``group`` (each rank joins its own inter-node, intra-node and all-ranks groups; on NCCL also
    a gloo group of all ranks for the argument checks, :meth:`agree`). :meth:`close` destroys
    them.
    """

    # A fresh dispatch's counts run on the caller's thread, on a group of their own.
    plans_on_comm_thread = False

    def __init__(self, group: dist.ProcessGroup, topology: Topology, timeout_s: float, num_chunks: int | None = None):
        if num_chunks is None:
            num_chunks = default_num_chunks(topology)
        if not (isinstance(num_chunks, int) and num_chunks >= 1):
            raise ValueError(f"num_chunks must be a positive int, got {num_chunks!r}")
        self.topology = topology
        self.timeout_s = timeout_s
        self.num_chunks = num_chunks
        group_ranks = dist.get_process_group_ranks(group)
        self.progress = Progress(group_ranks, topology.rank)
        backend = dist.get_backend(group)
        timeout = datetime.timedelta(seconds=timeout_s)
        self.peers = {
            INTER: topology.peer_ranks(topology.local_rank),  # EP ranks, one per node
            INTRA: topology.node_ranks(topology.node),
            ALL: list(range(topology.world_size)),
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

    def agree(self, fields: dict[str, Field], what: str, status: int = 0) -> Steps:
        """Steps checking ``fields`` and every rank's ``status`` across all EP ranks (one
        all_gather of :data:`~moe_dispatch.transport.agreement.AGREE_WORDS` int64 on the host
        group: the comm thread's group on gloo, a gloo group of the same ranks on NCCL, so no
        device synchronisation); run before the payload of an operation whose sizes are not
        exchanged (combine, cached dispatch, the kernels' plan), since ranks that disagree on
        them would abort inside gloo, or hang or read garbage on NCCL. The wire format and the
        messages: :mod:`moe_dispatch.transport.agreement`.

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
        mine = torch.tensor(agreement.row(fields, status, AGREE_WORDS), dtype=torch.int64)
        group = self.groups[self._agree_kind]
        if group is None:
            self._check([mine.tolist()], fields, what)
            return
        gathered = [torch.empty_like(mine) for _ in range(self.topology.world_size)]
        describe = functools.partial(self._describe, self._agree_kind, f"{what} argument check (all_gather)")
        try:
            work = dist.all_gather(gathered, mine, group=group, async_op=True)
        except RuntimeError as err:
            raise CommError(describe(err)) from err
        yield Pending(work, describe)
        self._check(torch.stack(gathered).tolist(), fields, what)

    # -- dispatch ----------------------------------------------------------------------------
    def plan(
        self,
        is_token_in_rank: torch.Tensor,
        fields: dict[str, Field],
        what: str = "dispatch",
        on_comm_thread: bool = False,
        status: int = 0,
    ) -> Steps:
        """Steps that exchange the layout counts and return the :class:`TorchDistPlan`
        (stage-2 send indices still unset); one all_to_all on the all-ranks group.

        Args:
            is_token_in_rank: ``[T, W]`` bool, as from ``get_dispatch_layout``; the per-rank and
                per-node counts are taken per chunk from it.
            fields: arguments that must agree on every rank (ints, bools, dtypes, the same keys
                everywhere). They ride in front of the counts, after this rank's status
                (:mod:`~moe_dispatch.transport.agreement`), so they are compared before any
                payload moves and the message has the same size on every rank whatever they
                hold (a size mismatch inside a collective aborts the process instead of raising).
            on_comm_thread: the steps run on the communication thread (with the payloads), not
                on the caller's: they use a group of their own, so that the two threads never
                interleave collectives of one group in different orders on different ranks.
            status: 0, or this rank's refusal: then ``is_token_in_rank`` is ``[0, W]`` (zero
                counts), the fields are -1, and every rank raises after the exchange.

        Raises (from the steps):
            ValueError: a rank refused (naming each and quoting its error), or naming the first
                field and the EP ranks that differ from this rank.
        """
        topo = self.topology
        world, local_ranks, num_nodes = topo.world_size, topo.ranks_per_node, topo.num_nodes
        num_chunks, device = self.num_chunks, is_token_in_rank.device
        num_tokens = is_token_in_rank.shape[0]
        bounds = [c * num_tokens // num_chunks for c in range(num_chunks + 1)]
        # My tokens per chunk for each rank and each node: running counts at the chunk bounds.
        in_node = is_token_in_rank.view(num_tokens, num_nodes, local_ranks).any(2)
        if num_chunks == 1:
            per_chunk = torch.cat([is_token_in_rank.sum(0), in_node.sum(0)]).unsqueeze(0)  # [1, W + N]
        else:
            running = torch.zeros((num_tokens + 1, world + num_nodes), dtype=torch.int64, device=device)
            torch.cumsum(torch.cat([is_token_in_rank, in_node], 1), 0, out=running[1:])
            per_chunk = running[bounds[1:]] - running[bounds[:-1]]  # [C, W + N]
        to_rank, to_node = per_chunk[:, :world], per_chunk[:, world:]
        # Row for destination d = (n_d, l_d): my status and fields, then per chunk my counts for
        # d's node's ranks and d's node.
        dest_node = torch.arange(world, device=device) // local_ranks
        chunk_counts = torch.cat(
            [to_rank.view(num_chunks, num_nodes, local_ranks)[:, dest_node], to_node[:, dest_node].unsqueeze(2)], 2
        )  # [C, W, L + 1]
        meta = torch.cat(
            [
                torch.tensor(agreement.row(fields, status), dtype=torch.int64, device=device).expand(world, -1),
                chunk_counts.transpose(0, 1).reshape(world, -1),
            ],
            1,
        )
        got, pending = self._all_to_all(meta, None, None, ALL_COMM if on_comm_thread else ALL, f"{what} metadata")
        yield pending
        got = got.view(world, -1)  # [source rank, row]
        self._check(got[:, : 1 + len(fields)].tolist(), fields, what)
        counts = got[:, 1 + len(fields) :].reshape(world, num_chunks, local_ranks + 1)
        peers = counts[topo.local_rank :: local_ranks]  # [N, C, L + 1]: my inter-node peers, one per node
        # Stage-2 arrivals [c, l, m]: tokens of source (m, l) in chunk c for me, in arrival order.
        arrivals = counts[:, :, topo.local_rank].reshape(num_nodes, local_ranks, num_chunks).permute(2, 1, 0)
        # Every split as host ints in one transfer (one host sync on GPU).
        host = iter(
            torch.cat(
                [
                    to_node.flatten(),
                    peers[:, :, -1].t().flatten(),
                    peers[:, :, :-1].sum(0).flatten(),
                    arrivals.sum(2).flatten(),
                ]
            ).tolist()
        )
        s1_send, s1_recv, s2_send, s2_recv = (
            [[next(host) for _ in range(n)] for _ in range(num_chunks)]
            for n in (num_nodes, num_nodes, local_ranks, local_ranks)
        )
        chunks = []
        for c in range(num_chunks):
            begin, end = bounds[c], bounds[c + 1]
            node, token = torch.nonzero(in_node[begin:end].t()).unbind(1)  # node-major, tokens ascending
            chunks.append(
                TorchDistChunk(
                    begin, end, token, token * num_nodes + node, s1_send[c], s1_recv[c], s2_send[c], s2_recv[c]
                )
            )
        num_recv_tokens = sum(map(sum, s2_recv))
        return TorchDistPlan(
            num_tokens=num_tokens,
            num_recv_tokens=num_recv_tokens,
            chunks=chunks,
            # With one chunk, arrival order (local rank, node) is final order (node, local rank)
            # when either has one value.
            recv_perm=(
                None
                if num_chunks == 1 and (local_ranks == 1 or num_nodes == 1)
                else _reorder_blocks(arrivals, (2, 1, 0), num_recv_tokens)
            ),
            internode_rows=sum(sum(s) - s[topo.node] for s in s1_send),
            intranode_rows=sum(sum(s) - s[topo.local_rank] for s in s2_send),
        )

    def dispatch(
        self,
        tensors: list[torch.Tensor],
        is_token_in_rank: torch.Tensor,
        plan: TorchDistPlan,
        out: list[torch.Tensor],
        what: str = "dispatch",
    ) -> Steps:
        """Steps that move row tensors ``[T, ...]`` to the ranks holding each token and write
        them, in (source rank, source token) order, into ``out`` (``[R, ...]`` each); they
        also fill the chunks' stage-2 indices."""
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

        yield from self._dispatch_pipeline(send1, route2, plan, out, what)

    def forward(self, tensors: list[torch.Tensor], plan: TorchDistPlan, out: list[torch.Tensor], what: str) -> Steps:
        """Steps replaying a plan's dispatch for other row tensors ``[T, ...]`` into ``out``
        (cached dispatch, combine's backward)."""
        yield from self._dispatch_pipeline(
            lambda chunk: _pack([(t[chunk.begin : chunk.end], chunk.s1_send_idx) for t in tensors]),
            lambda chunk, recv1: chunk.s2_send_idx,
            plan,
            out,
            what,
        )

    def _dispatch_pipeline(self, send1, route2, plan: TorchDistPlan, out: list[torch.Tensor], what: str) -> Steps:
        """Stage 1 of chunk c + 1 crosses nodes while stage 2 forwards chunk c. ``send1(chunk)``
        packs a chunk's stage-1 rows, ``route2(chunk, recv1)`` returns the index of its stage-2
        send rows in what stage 1 delivered; the stage-2 rows of every chunk land back to back in
        one buffer, gathered into ``out`` at the end. With one rank per node stage 2 stays on this
        rank and forwards every row (the index is ``arange``): its rows are gathered straight into
        that buffer, or, with one chunk, stage 1 delivered the buffer itself."""
        chunks = plan.chunks
        recv2, landed, in_flight = None, 0, []
        inter = self._all_to_all(
            send1(chunks[0]), chunks[0].s1_send_splits, chunks[0].s1_recv_splits, INTER, f"{what} stage 1"
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
                recv2 = recv1  # every row forwarded to itself, in order
                break
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
        _unpack_rows(recv2, plan.recv_perm, out)

    # -- combine -----------------------------------------------------------------------------
    def combine(
        self,
        tensors: list[torch.Tensor],
        scales: list[torch.Tensor | None],
        plan: TorchDistPlan,
        out: list[torch.Tensor],
        what: str = "combine",
    ) -> Steps:
        """Steps summing received rows back onto their source tokens.

        Args:
            tensors: ``[R, ...]`` floating row tensors in dispatch's receive order.
            scales: per tensor, None or ``[R]`` fp32 row scales applied (in fp32) before summing.
            plan: the dispatch's plan.
            out: per tensor ``[T, ...]`` in its dtype, written with the sums in the order of the
                module docstring.
        """
        # Scales travel as extra fp32 columns so the forwarder multiplies in fp32.
        payload = [*tensors, *[s.view(-1, 1) for s in scales if s is not None]]
        specs = _specs(payload)
        chunks = plan.chunks
        # Rows go back in stage-2 arrival order: the inverse of the dispatch's final gather.
        arrival = None
        if plan.recv_perm is not None:
            arrival = torch.empty_like(plan.recv_perm)
            arrival[plan.recv_perm] = torch.arange(arrival.numel(), device=arrival.device)
        bounds = [0, *itertools.accumulate(sum(chunk.s2_recv_splits) for chunk in chunks)]

        def send2(c):
            index = None if arrival is None else arrival[bounds[c] : bounds[c + 1]]  # None: in arrival order already
            return _pack([(t, index) for t in payload])

        def forwarder_sums(chunk, back2):
            back2 = _fields(back2, specs)
            num_forwarded = sum(chunk.s1_recv_splits)
            row_scales, k = [], len(tensors)
            for s in scales:
                row_scales.append(None if s is None else back2[k].view(-1))
                k += s is not None
            return [
                _block_sum(t, sc, chunk.s2_send_idx, chunk.s2_send_splits, num_forwarded)
                for t, sc in zip(back2[: len(tensors)], row_scales)
            ]

        def land(chunk, back1):
            for dst, rows in zip(out, _fields(back1, _specs(tensors))):
                _block_sum(
                    rows,
                    None,
                    chunk.s1_send_idx,
                    chunk.s1_send_splits,
                    chunk.end - chunk.begin,
                    out=dst[chunk.begin : chunk.end],
                )

        # With one rank per node and no scales a forwarder's sums are its own rows, which stage 2
        # returned packed just as stage 1 sends them (a sum of one term is the term).
        passthrough = self.groups[INTRA] is None and all(s is None for s in scales)

        # The intra-node return and forwarder sums of chunk c + 1 overlap the inter-node return
        # of chunk c; the source's sums of chunk c overlap the inter-node return of chunk c + 1.
        intra = self._all_to_all(send2(0), chunks[0].s2_recv_splits, chunks[0].s2_send_splits, INTRA, f"{what} stage 2")
        in_flight = None  # (chunk, back1, pending): the inter-node return on the wire
        for c, chunk in enumerate(chunks):
            packed = send2(c + 1) if c + 1 < len(chunks) else None
            back2, pending = intra
            yield pending
            if packed is not None:
                intra = self._all_to_all(
                    packed, chunks[c + 1].s2_recv_splits, chunks[c + 1].s2_send_splits, INTRA, f"{what} stage 2"
                )
            send1 = back2 if passthrough else _pack([(p, None) for p in forwarder_sums(chunk, back2)])
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


def _block_sum(
    rows: torch.Tensor,
    scale: torch.Tensor | None,
    index: torch.Tensor,
    splits: list[int],
    num_out: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out[index[i]] += rows[i] * scale[i]`` in fp32, rounded to ``rows.dtype``; ``out``
    (``[num_out, ...]`` of ``rows.dtype``) is allocated when None, else overwritten.

    ``rows`` come in one block per destination (``splits``, ascending destination) and an index
    occurs at most once per block, so adding block after block accumulates every output row in
    ascending destination order: the fixed order of the module docstring, with no masks, gathers
    or full-size fp32 copies."""
    blocks = [(start, num) for start, num in zip(itertools.accumulate([0, *splits]), splits) if num]
    if scale is None and len(blocks) <= 2:
        # At most two terms per output row: an add in the row dtype rounds fl32(a + b) to the row
        # dtype, as the fp32 path below does for two terms, and 0 + a turns a -0.0 into +0.0 as
        # there; so the values are the same bit for bit, with no fp32 copies.
        out = rows.new_zeros((num_out, *rows.shape[1:])) if out is None else out.zero_()
        for start, num in blocks:
            out.index_add_(0, index[start : start + num], rows[start : start + num])
        return out
    acc = torch.zeros((num_out, *rows.shape[1:]), dtype=torch.float32, device=rows.device)
    start = 0
    for num in splits:
        if num:
            vals = rows[start : start + num].float()
            if scale is not None:
                vals.mul_(scale[start : start + num].view(-1, *([1] * (rows.dim() - 1))))
            acc.index_add_(0, index[start : start + num], vals)
        start += num
    return acc.to(rows.dtype) if out is None else out.copy_(acc)


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
