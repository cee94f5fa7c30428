"""The two-stage hierarchy on torch.distributed sub-group ``all_to_all_single``.

Portable (gloo on CPU, NCCL on GPU, PCIe-safe) and the executable mirror of the CUDA kernels'
orchestration. Rank (n, l) is node n, local index l (see ``Topology``).

Dispatch:
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
one collective whatever the number of tensors.
"""

from __future__ import annotations

import dataclasses
import datetime
import math

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
    s1_send_slot: torch.Tensor  # [S1] how many earlier rows carry the same token (= node order)
    s1_send_splits: list[int]  # [N]
    s1_recv_splits: list[int]  # [N] forwarded rows from each source node
    s2_send_idx: torch.Tensor  # [S2] stage-1 row of each stage-2 send row, grouped by destination local rank
    s2_send_slot: torch.Tensor  # [S2] same-token ordinal (= local rank order)
    s2_send_splits: list[int]  # [L]
    s2_recv_splits: list[int]  # [L]
    recv_perm: torch.Tensor  # [R] final row i is stage-2 received row recv_perm[i]
    internode_rows: int  # rows this rank sends to other nodes per dispatch (and receives back in combine)
    intranode_rows: int  # rows this rank forwards to other local ranks per dispatch

    @property
    def num_recv_tokens(self) -> int:
        return int(self.recv_perm.numel())


def _slots(index: torch.Tensor) -> torch.Tensor:
    """``slot[i]`` = number of ``j < i`` with ``index[j] == index[i]``."""
    if index.numel() == 0:
        return index.clone()
    order = torch.sort(index, stable=True).indices
    sorted_idx = index[order]
    pos = torch.arange(index.numel(), device=index.device)
    run_start = torch.ones_like(sorted_idx, dtype=torch.bool)
    run_start[1:] = sorted_idx[1:] != sorted_idx[:-1]
    first = torch.cummax(torch.where(run_start, pos, torch.zeros_like(pos)), 0).values
    slot = torch.empty_like(index)
    slot[order] = pos - first
    return slot


def _pack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Row tensors ``[rows, ...]`` -> one ``[rows, bytes]`` uint8 buffer."""
    return torch.cat([t.reshape(t.shape[0], math.prod(t.shape[1:])).contiguous().view(torch.uint8)
                      for t in tensors], 1)


def _unpack(buf: torch.Tensor, like: list[tuple[torch.dtype, tuple[int, ...]]]) -> list[torch.Tensor]:
    out, offset = [], 0
    for dtype, shape in like:
        width = dtype.itemsize * math.prod(shape)
        if buf.shape[0] == 0:  # an empty slice keeps the packed strides, which view() rejects
            out.append(buf.new_empty((0, *shape), dtype=dtype))
        else:
            out.append(buf[:, offset:offset + width].contiguous().view(dtype).reshape(buf.shape[0], *shape))
        offset += width
    return out


def _specs(tensors: list[torch.Tensor]) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    return [(t.dtype, tuple(t.shape[1:])) for t in tensors]


class TorchDistTransport:
    """Hierarchical dispatch/combine for one EP group over torch.distributed.

    Args:
        group: the EP process group (gloo or NCCL).
        topology: this rank's place in the group.
        timeout_s: bound on every collective; a peer that never joins makes it raise
            :class:`CommError` naming the operation and the peers.

    Collective: construction creates the sub-groups and must be called by every rank of
    ``group`` (each rank joins its own inter-node and intra-node group).
    """

    def __init__(self, group: dist.ProcessGroup, topology: Topology, timeout_s: float):
        self.topology = topology
        self.timeout_s = timeout_s
        group_ranks = dist.get_process_group_ranks(group)
        backend = dist.get_backend(group)
        timeout = datetime.timedelta(seconds=timeout_s)
        self.inter_ranks = topology.peer_ranks(topology.local_rank)  # EP ranks, one per node
        self.intra_ranks = topology.node_ranks(topology.node)
        # Only members create a sub-group (use_local_synchronization), so EP groups that are
        # themselves sub-groups of the world (Megatron) need no world-wide agreement.
        self.inter_group = self.intra_group = None
        if len(self.inter_ranks) > 1:
            self.inter_group = dist.new_group([group_ranks[r] for r in self.inter_ranks], timeout=timeout,
                                              backend=backend, use_local_synchronization=True)
        if len(self.intra_ranks) > 1:
            self.intra_group = dist.new_group([group_ranks[r] for r in self.intra_ranks], timeout=timeout,
                                              backend=backend, use_local_synchronization=True)

    # -- collectives -------------------------------------------------------------------------
    def _all_to_all(self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int],
                    inter: bool, what: str) -> torch.Tensor:
        group = self.inter_group if inter else self.intra_group
        recv = send.new_empty((sum(recv_splits), *send.shape[1:]))
        if group is None:  # a group of one: the only destination is this rank
            recv.copy_(send)
            return recv
        try:
            dist.all_to_all_single(recv, send, recv_splits, send_splits, group=group)
        except RuntimeError as err:  # gloo raises on timeout and on a lost peer
            peers = self.inter_ranks if inter else self.intra_ranks
            stage = "inter-node" if inter else "intra-node"
            raise CommError(
                f"EP rank {self.topology.rank}: {what} ({stage} all_to_all with EP ranks {peers}) "
                f"failed or did not complete within timeout_s={self.timeout_s:g}: {err}"
            ) from err
        return recv

    def _exchange_counts(self, counts: torch.Tensor, inter: bool, what: str) -> torch.Tensor:
        """``counts [P, C]`` int64 for each of the P group members -> ``[P, C]`` received."""
        peers, width = counts.shape
        got = self._all_to_all(counts.reshape(-1), [width] * peers, [width] * peers, inter, what)
        return got.view(peers, width)

    # -- dispatch ----------------------------------------------------------------------------
    def dispatch(self, tensors: list[torch.Tensor], topk_idx: torch.Tensor, is_token_in_rank: torch.Tensor,
                 what: str = "dispatch") -> tuple[list[torch.Tensor], torch.Tensor, TorchDistPlan]:
        """Moves row tensors ``[T, ...]`` to the ranks holding each token.

        Args:
            tensors: row tensors aligned with the tokens (x, topk_weights, ...).
            topk_idx: ``[T, K]`` global expert ids (-1 = none); travels with the tokens.
            is_token_in_rank: ``[T, W]`` bool, from the layout.

        Returns:
            (received tensors ``[R, ...]`` in (source rank, source token) order,
            received ``topk_idx [R, K]`` (global ids), the plan for combine).
        """
        topo = self.topology
        num_nodes, local_ranks, device = topo.num_nodes, topo.ranks_per_node, topk_idx.device
        num_tokens = topk_idx.shape[0]
        in_rank = is_token_in_rank.view(num_tokens, num_nodes, local_ranks)

        # Stage 1: once per (token, node), to the forwarder with my local index. Each row also
        # carries the destination node's L columns of is_token_in_rank: the forwarder's routing.
        in_node = in_rank.any(2)
        s1_send_idx = torch.nonzero(in_node.t())[:, 1]  # node-major, tokens ascending
        s1_send_splits = in_node.sum(0).tolist()
        s1_recv_splits = self._exchange_counts(
            torch.tensor(s1_send_splits, dtype=torch.int64, device=device).view(-1, 1), True,
            f"{what} stage 1 counts").flatten().tolist()
        s1_dest_node = torch.repeat_interleave(torch.arange(num_nodes, device=device),
                                               torch.tensor(s1_send_splits, device=device),
                                               output_size=s1_send_idx.numel())
        payload = [*tensors, topk_idx]
        send1 = _pack([*[t[s1_send_idx] for t in payload], in_rank[s1_send_idx, s1_dest_node]])
        recv1 = _unpack(self._all_to_all(send1, s1_send_splits, s1_recv_splits, True, f"{what} stage 1"),
                        [*_specs(payload), (torch.bool, (local_ranks,))])
        in_local = recv1.pop()  # [J, L]
        num_forwarded = in_local.shape[0]

        # Stage 2: the forwarder (n, l) hands each token to the local ranks of node n that hold it.
        s2_send_idx = torch.nonzero(in_local.t())[:, 1]  # local-rank-major, rows ascending
        s2_send_splits = in_local.sum(0).tolist()
        # Per destination local rank, rows from each source node: the receiver's reorder key.
        src_node = torch.repeat_interleave(torch.arange(num_nodes, device=device),
                                           torch.tensor(s1_recv_splits, device=device), output_size=num_forwarded)
        counts = (in_local.t().unsqueeze(2) & (src_node.view(1, -1, 1) == torch.arange(num_nodes, device=device)))
        recv_counts = self._exchange_counts(counts.sum(1), False, f"{what} stage 2 counts")  # [l, m]
        s2_recv_splits = recv_counts.sum(1).tolist()
        recv2 = _unpack(self._all_to_all(_pack([t[s2_send_idx] for t in recv1]), s2_send_splits, s2_recv_splits,
                                         False, f"{what} stage 2"), _specs(payload))
        recv_perm = _block_transpose(recv_counts)
        plan = TorchDistPlan(
            num_tokens=num_tokens,
            s1_send_idx=s1_send_idx, s1_send_slot=_slots(s1_send_idx),
            s1_send_splits=s1_send_splits, s1_recv_splits=s1_recv_splits,
            s2_send_idx=s2_send_idx, s2_send_slot=_slots(s2_send_idx),
            s2_send_splits=s2_send_splits, s2_recv_splits=s2_recv_splits,
            recv_perm=recv_perm,
            internode_rows=sum(s1_send_splits) - s1_send_splits[topo.node],
            intranode_rows=sum(s2_send_splits) - s2_send_splits[topo.local_rank],
        )
        received = [t[recv_perm] for t in recv2]
        return received[:-1], received[-1], plan

    def forward(self, tensors: list[torch.Tensor], plan: TorchDistPlan, what: str) -> list[torch.Tensor]:
        """Replays a plan's dispatch for other row tensors ``[T, ...]`` (cached dispatch, combine's backward)."""
        specs = _specs(tensors)
        recv1 = self._all_to_all(_pack([t[plan.s1_send_idx] for t in tensors]), plan.s1_send_splits,
                                 plan.s1_recv_splits, True, f"{what} stage 1")
        recv2 = self._all_to_all(recv1[plan.s2_send_idx], plan.s2_send_splits, plan.s2_recv_splits,
                                 False, f"{what} stage 2")
        return _unpack(recv2[plan.recv_perm], specs)

    # -- combine -----------------------------------------------------------------------------
    def combine(self, tensors: list[torch.Tensor], scales: list[torch.Tensor | None], plan: TorchDistPlan,
                what: str = "combine") -> list[torch.Tensor]:
        """Sums received rows back onto their source tokens.

        Args:
            tensors: ``[R, ...]`` floating row tensors in dispatch's receive order.
            scales: per tensor, None or ``[R]`` fp32 row scales applied (in fp32) before summing.
            plan: the dispatch's plan.

        Returns:
            ``[T, ...]`` per tensor, in its dtype, reduced in the order of the module docstring.
        """
        # Scales travel as extra fp32 columns so the forwarder multiplies in fp32.
        payload = [*tensors, *[s.view(-1, 1) for s in scales if s is not None]]
        specs = _specs(payload)
        packed = _pack(payload)
        unsorted = torch.empty_like(packed)  # back to stage-2 arrival order
        unsorted[plan.recv_perm] = packed
        back2 = _unpack(self._all_to_all(unsorted, plan.s2_recv_splits, plan.s2_send_splits, False,
                                         f"{what} stage 2"), specs)
        num_forwarded = sum(plan.s1_recv_splits)
        row_scales, k = [], len(tensors)
        for s in scales:
            row_scales.append(None if s is None else back2[k].view(-1))
            k += s is not None
        partials = [_ordered_sum(t, sc, plan.s2_send_idx, plan.s2_send_slot, num_forwarded)
                    for t, sc in zip(back2[:len(tensors)], row_scales)]
        back1 = _unpack(self._all_to_all(_pack(partials), plan.s1_recv_splits, plan.s1_send_splits, True,
                                         f"{what} stage 1"), _specs(partials))
        return [_ordered_sum(t, None, plan.s1_send_idx, plan.s1_send_slot, plan.num_tokens) for t in back1]


def _ordered_sum(rows: torch.Tensor, scale: torch.Tensor | None, index: torch.Tensor, slot: torch.Tensor,
                 num_out: int) -> torch.Tensor:
    """``out[index[i]] += rows[i] * scale[i]`` in fp32, one slot at a time so each output
    row accumulates its inputs in slot order (deterministic); rounds to ``rows.dtype``."""
    acc = torch.zeros((num_out, *rows.shape[1:]), dtype=torch.float32, device=rows.device)
    vals = rows.float()
    if scale is not None:
        vals = vals * scale.view(-1, *([1] * (rows.dim() - 1)))
    num_slots = int(slot.max()) + 1 if slot.numel() else 0
    for s in range(num_slots):
        sel = slot == s
        acc.index_add_(0, index[sel], vals[sel])
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
