"""The two-stage hierarchy on torch.distributed sub-group ``all_to_all_single``.

Portable (gloo on CPU, NCCL on GPU, PCIe-safe) and the executable mirror of the CUDA kernels'
orchestration. Rank (n, l) is node n, local index l (see ``Topology``).

Dispatch:
  metadata (group: all EP ranks): each source tells each destination d how many of its
    tokens reach d's node, each rank of d's node, and each of d's experts. From that every
    rank knows every split below and its receive count before any payload moves (so outputs
    can be allocated up front and the payload can move asynchronously).
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

Every stage moves all row tensors of one call as a single packed uint8 buffer, so a stage is
one collective whatever the number of tensors. Operations are written as generators that
yield each in-flight collective (a :class:`Pending`); :func:`drive` runs one to completion,
and callers may instead stop after the first yield to overlap the first stage with their own
work.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
from collections.abc import Generator

import torch
import torch.distributed as dist

from ..topology import Topology
from ..validation import CommError


@dataclasses.dataclass
class TorchDistPlan:
    """The index plan of one dispatch (a rank's share of the handle); its combine replays it
    backwards. Splits are host ints (gloo and ``all_to_all_single`` take lists)."""

    num_tokens: int
    s1_send_idx: torch.Tensor  # [S1] source token of each stage-1 send row, grouped by destination node
    s1_send_splits: list[int]  # [N]
    s1_recv_splits: list[int]  # [N] rows to forward, from each source node
    s2_send_splits: list[int]  # [L]
    s2_recv_splits: list[int]  # [L]
    recv_perm: torch.Tensor  # [R] final row i is stage-2 received row recv_perm[i]
    num_recv_tokens_per_expert: list[int]  # [E/W]
    internode_rows: int  # rows this rank sends to other nodes per dispatch (and receives back in combine)
    intranode_rows: int  # rows this rank forwards to other local ranks per dispatch
    # Known once stage 1 has delivered the forwarded rows' routing:
    s2_send_idx: torch.Tensor | None = None  # [S2] stage-1 row of each stage-2 send row, by destination local rank

    @property
    def num_recv_tokens(self) -> int:
        return int(self.recv_perm.numel())


class Pending:
    """One in-flight collective; :meth:`wait` turns a failure or timeout into :class:`CommError`."""

    def __init__(self, work, describe):
        self.work, self.describe = work, describe

    def wait(self) -> None:
        try:
            self.work.wait()
        except RuntimeError as err:  # gloo raises on timeout and on a lost peer
            raise CommError(self.describe(err)) from err


Steps = Generator["Pending | None", None, object]


def drive(steps: Steps):
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


def finish(steps: Steps, started) -> object:
    """Completes an operation begun with :func:`start`; returns its result."""
    done, value = started
    if done:
        return value
    if value is not None:
        value.wait()
    return drive(steps)


_ALIGN = 8  # bytes; every packed field starts at a multiple, so it can be viewed in place as its dtype


def _row_bytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return dtype.itemsize * math.prod(shape)


def _padded(width: int) -> int:
    return -(-width // _ALIGN) * _ALIGN


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``[rows, ...]`` -> ``[rows, bytes]`` uint8 (a view when ``t`` is contiguous)."""
    return t.reshape(t.shape[0], math.prod(t.shape[1:])).contiguous().view(torch.uint8)


def _pack(rows: list[tuple[torch.Tensor, torch.Tensor | None]]) -> torch.Tensor:
    """Packs row tensors side by side into one ``[rows, bytes]`` uint8 buffer, one copy each:
    ``(t, index)`` contributes ``t[index]`` (gathered straight into place), ``(t, None)`` all of
    ``t``. Fields are padded to ``_ALIGN`` bytes.

    ``Tensor.index_select`` is used for every row gather: advanced indexing (``t[index]``)
    copies element by element and is several times slower on uint8 rows on CPU."""
    num_rows = next(t.shape[0] if index is None else index.numel() for t, index in rows)
    widths = [_padded(_row_bytes(t.dtype, tuple(t.shape[1:]))) for t, _ in rows]
    buf = torch.empty((num_rows, sum(widths)), dtype=torch.uint8, device=rows[0][0].device)
    offset = 0
    for (t, index), width in zip(rows, widths):
        src = _as_bytes(t)
        dst = buf[:, offset:offset + src.shape[1]]
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
            out.append(buf[:, offset:offset + width].view(dtype).view(buf.shape[0], *shape))
        offset += _padded(width)
    return out


def _unpack_rows(buf: torch.Tensor, index: torch.Tensor, out: list[torch.Tensor]) -> None:
    """``out[j] = field j of buf[index]`` for contiguous ``out`` tensors, one copy each."""
    offset = 0
    for dst in out:
        width = _row_bytes(dst.dtype, tuple(dst.shape[1:]))
        torch.index_select(buf[:, offset:offset + width], 0, index, out=_as_bytes(dst))
        offset += _padded(width)


def _specs(tensors: list[torch.Tensor]) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    return [(t.dtype, tuple(t.shape[1:])) for t in tensors]


def _to_host(t: torch.Tensor) -> list[int]:
    return t.tolist()


INTER, INTRA, ALL = "inter-node", "intra-node", "all-ranks"


class TorchDistTransport:
    """Hierarchical dispatch/combine for one EP group over torch.distributed.

    Args:
        group: the EP process group (gloo or NCCL).
        topology: this rank's place in the group.
        timeout_s: bound on every collective; a peer that never joins makes it raise
            :class:`CommError` naming the operation and the peers.

    Collective: construction creates the sub-groups and must be called by every rank of
    ``group`` (each rank joins its own inter-node, intra-node and all-ranks group).
    """

    def __init__(self, group: dist.ProcessGroup, topology: Topology, timeout_s: float):
        self.topology = topology
        self.timeout_s = timeout_s
        group_ranks = dist.get_process_group_ranks(group)
        backend = dist.get_backend(group)
        timeout = datetime.timedelta(seconds=timeout_s)
        self.peers = {INTER: topology.peer_ranks(topology.local_rank),  # EP ranks, one per node
                      INTRA: topology.node_ranks(topology.node),
                      ALL: list(range(topology.world_size))}
        # Only members create a sub-group (use_local_synchronization), so EP groups that are
        # themselves sub-groups of the world (Megatron) need no world-wide agreement. Our own
        # groups carry our timeout, whatever the caller's group has.
        self.groups = {kind: (dist.new_group([group_ranks[r] for r in ranks], timeout=timeout, backend=backend,
                                             use_local_synchronization=True) if len(ranks) > 1 else None)
                       for kind, ranks in self.peers.items()}

    # -- collectives -------------------------------------------------------------------------
    def _all_to_all(self, send: torch.Tensor, send_splits: list[int] | None, recv_splits: list[int] | None,
                    kind: str, what: str) -> tuple[torch.Tensor, Pending | None]:
        """Starts ``all_to_all_single`` on the ``kind`` group (equal splits when None)."""
        group = self.groups[kind]
        rows = sum(recv_splits) if recv_splits is not None else send.shape[0]
        recv = send.new_empty((rows, *send.shape[1:]))
        if group is None:  # a group of one: the only destination is this rank
            recv.copy_(send)
            return recv, None

        def describe(err):
            # gloo does not say which peer it missed: name the others with their nodes.
            topo = self.topology
            others = [r for r in self.peers[kind] if r != topo.rank]
            how = f"timed out after timeout_s={self.timeout_s:g}" if "timed out" in str(err).lower() else "failed"
            return (f"EP rank {topo.rank} (node {topo.node}): {what} ({kind} all_to_all) {how} waiting for "
                    f"EP ranks {others} (nodes {[r // topo.ranks_per_node for r in others]}): {err}")

        try:
            work = dist.all_to_all_single(recv, send, recv_splits, send_splits, group=group, async_op=True)
        except RuntimeError as err:
            raise CommError(describe(err)) from err
        return recv, Pending(work, describe)

    # -- dispatch ----------------------------------------------------------------------------
    def plan(self, num_tokens_per_rank: torch.Tensor, num_tokens_per_node: torch.Tensor,
             num_tokens_per_expert: torch.Tensor, is_token_in_rank: torch.Tensor,
             what: str = "dispatch") -> Steps:
        """Steps that exchange the layout counts and return the :class:`TorchDistPlan`
        (stage-2 send indices still unset). Arguments as from ``get_dispatch_layout``."""
        topo = self.topology
        world, local_ranks, num_nodes = topo.world_size, topo.ranks_per_node, topo.num_nodes
        device = is_token_in_rank.device
        num_tokens = is_token_in_rank.shape[0]
        experts_per_rank = num_tokens_per_expert.numel() // world
        # Row for destination d = (n_d, l_d): my counts for d's experts, d's node's ranks, d's node.
        dest_node = torch.arange(world, device=device) // local_ranks
        meta = torch.cat([num_tokens_per_expert.view(world, experts_per_rank),
                          num_tokens_per_rank.view(num_nodes, local_ranks)[dest_node],
                          num_tokens_per_node[dest_node].view(world, 1)], 1).to(torch.int64)
        got, pending = self._all_to_all(meta, None, None, ALL, f"{what} metadata")
        yield pending
        got = got.view(world, experts_per_rank + local_ranks + 1)  # [source rank, row]
        # Sources with my local index (my inter-node peers), one per node.
        peer_rows = got[topo.local_rank::local_ranks]  # [N, row]
        ranks_of_node = peer_rows[:, experts_per_rank:experts_per_rank + local_ranks]  # [m', l']
        # From source (m', l_s) to me: [l_s, m'] counts, the arrival blocks of stage 2.
        recv_counts = got[:, experts_per_rank + topo.local_rank].view(num_nodes, local_ranks).t()
        in_node = is_token_in_rank.view(num_tokens, num_nodes, local_ranks).any(2)
        s1_send_idx = torch.nonzero(in_node.t())[:, 1]  # node-major, tokens ascending
        s1_send_splits = _to_host(num_tokens_per_node)
        s2_send_splits = _to_host(ranks_of_node.sum(0))
        return TorchDistPlan(
            num_tokens=num_tokens,
            s1_send_idx=s1_send_idx,
            s1_send_splits=s1_send_splits,
            s1_recv_splits=_to_host(peer_rows[:, -1]),
            s2_send_splits=s2_send_splits,
            s2_recv_splits=_to_host(recv_counts.sum(1)),
            recv_perm=_block_transpose(recv_counts),
            num_recv_tokens_per_expert=_to_host(got[:, :experts_per_rank].sum(0)),
            internode_rows=sum(s1_send_splits) - s1_send_splits[topo.node],
            intranode_rows=sum(s2_send_splits) - s2_send_splits[topo.local_rank],
        )

    def dispatch(self, tensors: list[torch.Tensor], is_token_in_rank: torch.Tensor, plan: TorchDistPlan,
                 out: list[torch.Tensor], what: str = "dispatch") -> Steps:
        """Steps that move row tensors ``[T, ...]`` to the ranks holding each token and write
        them, in (source rank, source token) order, into ``out`` (``[R, ...]`` each); they
        also fill the plan's stage-2 indices."""
        topo = self.topology
        num_tokens, local_ranks = is_token_in_rank.shape[0], topo.ranks_per_node
        in_rank = is_token_in_rank.view(num_tokens, topo.num_nodes, local_ranks)
        device = is_token_in_rank.device
        # Stage 1. Each row also carries the destination node's L columns of is_token_in_rank:
        # the forwarder's routing.
        dest_node = torch.repeat_interleave(torch.arange(topo.num_nodes, device=device),
                                            torch.tensor(plan.s1_send_splits, device=device),
                                            output_size=plan.s1_send_idx.numel())
        send1 = _pack([*[(t, plan.s1_send_idx) for t in tensors], (in_rank[plan.s1_send_idx, dest_node], None)])
        recv1, pending = self._all_to_all(send1, plan.s1_send_splits, plan.s1_recv_splits, INTER, f"{what} stage 1")
        yield pending
        # The forwarder keeps the rows packed; stage 2 forwards them whole (routing columns too).
        specs = [*_specs(tensors), (torch.bool, (local_ranks,))]
        in_local = _fields(recv1, specs)[-1]
        # Stage 2: the forwarder (n, l) hands each row to the local ranks of node n that hold it.
        plan.s2_send_idx = torch.nonzero(in_local.t())[:, 1]  # local-rank-major, rows ascending
        if plan.s2_send_idx.numel() != sum(plan.s2_send_splits):
            raise RuntimeError(f"EP rank {topo.rank}: {what}: forwarded rows ({plan.s2_send_idx.numel()}) disagree "
                               f"with the metadata ({sum(plan.s2_send_splits)}); did every rank pass the same "
                               f"num_experts?")
        yield from self._stage2(recv1, plan, out, what)

    def _stage2(self, recv1: torch.Tensor, plan: TorchDistPlan, out: list[torch.Tensor], what: str) -> Steps:
        send2 = recv1.index_select(0, plan.s2_send_idx)
        recv2, pending = self._all_to_all(send2, plan.s2_send_splits, plan.s2_recv_splits, INTRA, f"{what} stage 2")
        yield pending
        _unpack_rows(recv2, plan.recv_perm, out)

    def forward(self, tensors: list[torch.Tensor], plan: TorchDistPlan, out: list[torch.Tensor],
                what: str) -> Steps:
        """Steps replaying a plan's dispatch for other row tensors ``[T, ...]`` into ``out``
        (cached dispatch, combine's backward)."""
        send1 = _pack([(t, plan.s1_send_idx) for t in tensors])
        recv1, pending = self._all_to_all(send1, plan.s1_send_splits, plan.s1_recv_splits, INTER, f"{what} stage 1")
        yield pending
        yield from self._stage2(recv1, plan, out, what)

    # -- combine -----------------------------------------------------------------------------
    def combine(self, tensors: list[torch.Tensor], scales: list[torch.Tensor | None], plan: TorchDistPlan,
                out: list[torch.Tensor], what: str = "combine") -> Steps:
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
        # Back to stage-2 arrival order by gathering with the inverse permutation.
        arrival = torch.empty_like(plan.recv_perm)
        arrival[plan.recv_perm] = torch.arange(arrival.numel(), device=arrival.device)
        unsorted = _pack([(t, arrival) for t in payload])
        back2, pending = self._all_to_all(unsorted, plan.s2_recv_splits, plan.s2_send_splits, INTRA,
                                          f"{what} stage 2")
        yield pending
        back2 = _fields(back2, _specs(payload))
        num_forwarded = sum(plan.s1_recv_splits)
        row_scales, k = [], len(tensors)
        for s in scales:
            row_scales.append(None if s is None else back2[k].view(-1))
            k += s is not None
        partials = [_block_sum(t, sc, plan.s2_send_idx, plan.s2_send_splits, num_forwarded)
                    for t, sc in zip(back2[:len(tensors)], row_scales)]
        back1, pending = self._all_to_all(_pack([(p, None) for p in partials]), plan.s1_recv_splits,
                                          plan.s1_send_splits, INTER, f"{what} stage 1")
        yield pending
        for dst, rows in zip(out, _fields(back1, _specs(partials))):
            dst.copy_(_block_sum(rows, None, plan.s1_send_idx, plan.s1_send_splits, plan.num_tokens))


def _block_sum(rows: torch.Tensor, scale: torch.Tensor | None, index: torch.Tensor, splits: list[int],
               num_out: int) -> torch.Tensor:
    """``out[index[i]] += rows[i] * scale[i]`` in fp32, rounded to ``rows.dtype``.

    ``rows`` come in one block per destination (``splits``, ascending destination) and an index
    occurs at most once per block, so adding block after block accumulates every output row in
    ascending destination order: the fixed order of the module docstring, with no masks, gathers
    or full-size fp32 copies."""
    acc = torch.zeros((num_out, *rows.shape[1:]), dtype=torch.float32, device=rows.device)
    start = 0
    for num in splits:
        if num:
            vals = rows[start:start + num].float()
            if scale is not None:
                vals.mul_(scale[start:start + num].view(-1, *([1] * (rows.dim() - 1))))
            acc.index_add_(0, index[start:start + num], vals)
        start += num
    return acc.to(rows.dtype)


def _block_transpose(counts: torch.Tensor) -> torch.Tensor:
    """Rows arrive in blocks ordered (forwarder l, source node m); the result order is source
    rank m*L + l, i.e. blocks ordered (m, l). Returns the gather index for that reorder."""
    local_ranks, num_nodes = counts.shape
    flat = counts.flatten()
    starts = torch.cumsum(flat, 0) - flat  # block starts in arrival order
    order = torch.arange(local_ranks * num_nodes, device=counts.device).view(local_ranks, num_nodes).t().flatten()
    lens, begins = flat[order], starts[order]
    total = int(flat.sum())
    block = torch.repeat_interleave(torch.arange(order.numel(), device=counts.device), lens, output_size=total)
    offset_in_block = torch.arange(total, device=counts.device) - (torch.cumsum(lens, 0) - lens)[block]
    return begins[block] + offset_in_block
