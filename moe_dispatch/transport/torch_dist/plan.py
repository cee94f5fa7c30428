"""A torch_dist dispatch's counts and plan: the counts each source writes into its blocks'
headers (:func:`dispatch_counts`), what they tell a rank once exchanged (:class:`Counts`, read by
:func:`plan_from_headers`), and the index plan of the dispatch (:class:`TorchDistPlan`, with the
:class:`TorchDistChunk` s of the two-stage route), which every later call of the dispatch
replays."""

from __future__ import annotations

import dataclasses

import torch

from ... import _ext
from ...topology import Topology
from .packing import Carried

# A fresh dispatch's header: the sender's sizes (see dispatch_counts), then its counts for the
# destination per sub-range.
NUM_SIZES = 5


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
class Counts:
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
class TorchDistPlan:
    """The index plan of one dispatch (a rank's share of the handle); its combine replays it
    backwards. A :class:`~moe_dispatch.transport.base.Plan`.

    The route (flat or two-stage, and the depth) is chosen by the first payload transfer, from
    the row width every rank agreed on; until then ``chunks`` is empty and the row counts are
    the two-stage ones."""

    num_tokens: int
    num_recv_tokens: int
    counts: Counts | None  # until routed
    flat: bool = False
    chunks: list[TorchDistChunk] = dataclasses.field(default_factory=list)
    # [R] final row i is row recv_perm[i] of the arrivals (two-stage: the chunks' stage-2 arrivals,
    # concatenated); None when they arrive in final order
    recv_perm: torch.Tensor | None = None
    flat_send_idx: torch.Tensor | None = None  # [F] token of each flat send row, by destination rank
    flat_send_splits: list[int] = dataclasses.field(default_factory=list)  # [W]
    flat_recv_splits: list[int] = dataclasses.field(default_factory=list)  # [W]
    arrived: Carried | torch.Tensor | None = None  # the flat rows that came with the counts, until landed
    internode_rows: int = 0  # rows this rank sends to other nodes per dispatch (and receives back in combine)
    intranode_rows: int = 0  # rows this rank sends to other local ranks per dispatch
    # Derived on first use and kept for every later call (combine, backward): sum plans, indices
    cache: dict = dataclasses.field(default_factory=dict, repr=False)

    def cached(self, key, make):
        """``make()``, computed once per plan under ``key``."""
        if key not in self.cache:
            self.cache[key] = make()
        return self.cache[key]


def flat_send_idx(is_token_in_rank: torch.Tensor) -> torch.Tensor:
    """``[F]``: the token of each flat send row, rank-major, tokens ascending."""
    return torch.nonzero(is_token_in_rank.t())[:, 1]


def dispatch_counts(
    is_token_in_rank: torch.Tensor, bounds: list[int], topo: Topology, head: torch.Tensor, at: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A dispatch's counts from its layout ``[T, W]``: returns ``(per_sub [S, W + N] int64, in_node
    [T, N] bool, send_idx)``, each sub-range ``[bounds[s], bounds[s + 1])``'s tokens for each rank,
    then for each node; ``send_idx`` is :func:`flat_send_idx`'s, or None where not made yet.
    Writes header words ``at ...`` of every row ``d`` of ``head [W, words]`` int64: the
    :data:`NUM_SIZES` sizes (my flat and stage-1 rows, the rows of each that cross nodes, the most
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
    head[:, at : at + NUM_SIZES] = sizes
    head[:, at + NUM_SIZES : at + NUM_SIZES + subs * (local_ranks + 1)] = sub_counts.transpose(0, 1).reshape(world, -1)
    return per_sub, in_node, None


def plan_from_headers(
    rows_of: list[list[int]],
    mine: list[int],
    is_token_in_rank: torch.Tensor,
    in_node: torch.Tensor,
    bounds: list[int],
    send_idx: torch.Tensor | None,
    topo: Topology,
    sizes_at: int,
) -> TorchDistPlan:
    """The unrouted plan of a dispatch from its exchanged headers: ``rows_of[w]`` the header words
    source ``w`` sent this rank (its sizes at ``sizes_at``, then its counts for this rank's node
    per sub-range, as :func:`dispatch_counts` wrote them), ``mine`` this rank's ``per_sub`` as
    host ints (``[S * (W + N)]``); ``is_token_in_rank [T, W]``, ``in_node [T, N]``, ``bounds`` and
    ``send_idx`` as :func:`dispatch_counts` took and returned them."""
    world, local_ranks, num_nodes = topo.world_size, topo.ranks_per_node, topo.num_nodes
    subs = len(bounds) - 1
    to_rank_l = [mine[c * (world + num_nodes) : c * (world + num_nodes) + world] for c in range(subs)]
    to_node_l = [mine[c * (world + num_nodes) + world : (c + 1) * (world + num_nodes)] for c in range(subs)]
    # Source w's counts for my node, per sub-range: its tokens for each of my node's ranks, then
    # for my node. Sources (m, my local rank) forward through me; every source sends me rows.
    counts_at = sizes_at + NUM_SIZES
    of = [
        [r[counts_at + c * (local_ranks + 1) : counts_at + (c + 1) * (local_ranks + 1)] for c in range(subs)]
        for r in rows_of
    ]  # [W][S][L + 1]
    peers = [of[m * local_ranks + topo.local_rank] for m in range(num_nodes)]  # [N][S][L + 1]
    sizes_of = [r[sizes_at:counts_at] for r in rows_of]
    counts_of = Counts(
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
    return TorchDistPlan(
        num_tokens=is_token_in_rank.shape[0],
        num_recv_tokens=sum(counts_of.from_rank),
        counts=counts_of,
        internode_rows=sum(sum(s) - s[topo.node] for s in to_node_l),
        intranode_rows=sum(sum(s) - s[topo.local_rank] for s in counts_of.s2_send),
    )


def final_of_arrival(plan: TorchDistPlan) -> torch.Tensor | None:
    """``[R]``: the final row of each arrival row, the gather index from final order into
    arrival order (None when they coincide); the inverse of ``plan.recv_perm``."""
    if plan.recv_perm is None:
        return None

    def inverse():
        arrival = torch.empty_like(plan.recv_perm)
        arrival[plan.recv_perm] = torch.arange(arrival.numel(), device=arrival.device)
        return arrival

    return plan.cached("arrival", inverse)
