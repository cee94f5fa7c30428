"""What is kept only to be timed against the defaults: the staged internode pipeline, and the
boundary of the kernel variants.

Nothing on the default path imports this module: :func:`~.internode.run_dispatch`,
:func:`~.internode.run_combine` and :func:`~.internode.empty_handle` import it only when a
Config selects ``internode_pipeline="staged"``. It exists so that ``benchmarks/gpu_check.sh``
can time the fused default against it side by side (``bench_internode.py``: its fused/staged
table, ``--pipelines``; the ``variants`` step's ``bench_variants_internode``; the profile's
``ncu_node_dispatch``). Results are the same bit for bit (rows by source rank then source token,
fp32 sums in fixed orders).

**The staged pipeline** (``Config.internode_pipeline="staged"``), the earlier one: a node
notify, a host read, a node dispatch into the forwarders' staging rows (stage 1, over RDMA),
then one intranode operation per source node over the node's NVLink buffers (stage 2: each a
notify with a second host read, then a dispatch); combine in reverse. It reads its counts on the
host twice per fresh dispatch, so it has no budget mode (``num_worst_tokens``). Protocol:
``csrc/kernels/internode.cuh`` and ``internode_roles.cuh`` (stage 1); stage 2 is the intranode
kernels.

**The kernel variants** are Config fields (``loads_in_flight``, ``rows_in_flight``,
``bulk_copy``, ``register_cap``, ``slot_flags``, ``combine_warps``, ``coordinator_backoff``;
:data:`moe_dispatch.config.VARIANTS` names them) that select copies and loops compiled beside
the current kernels (``csrc/kernels/variant.cuh`` says why each should help). Their defaults are
the current kernels; the host passes the fields to every launch unchanged
(:class:`~.launcher.Launcher`), so no host code of theirs runs on the default path. The loopback
harnesses' ``set_variant`` (:mod:`moe_dispatch.testing.loopback`) switches between them for the
benchmarks' ``--variants`` and gpu_check.sh's ``variants`` step (``bench_per_sm``,
``bench_variants_intranode``, ``bench_variants_internode``).
"""

from __future__ import annotations

import dataclasses

import torch

from ..._ext import require_extension
from .calls import CombineCall, DispatchCall, RankInput, alloc_outputs, assemble_results, check_num_sms, ptr
from .header import OP_CACHED_DISPATCH, OP_DISPATCH
from .internode_engines import InternodeDispatch, InternodeEngines
from .intranode import IntranodeHandle, launch_dispatch, run_notify
from .intranode import run_combine as run_intranode_combine

__all__ = ["StagedInternodeHandle", "empty_staged_handle", "staged_combine", "staged_dispatch"]


@dataclasses.dataclass(eq=False)
class StagedInternodeHandle:
    """One rank's share of a staged internode dispatch (``Config.internode_pipeline="staged"``).

    Attributes:
        num_tokens, num_channels, is_token_in_rank, is_token_in_node: as :class:`~.internode_engines.InternodeHandle`.
        node_prefix: ``[N * C + 1]`` int32: first stage-1 receive row of each (source node, channel).
        node_peer_ok: ``[N]`` int32: the node notify's rail verdicts.
        segments: N + 1 host ints: this rank's stage-1 rows from source node m are
            ``[segments[m], segments[m + 1])`` (it forwards them inside its node).
        forward_in_rank: ``[R1, L]`` bool: which local ranks hold each forwarded row.
        local: per source node m, the :class:`~moe_dispatch.transport.kernels.intranode.IntranodeHandle` of
            stage-2 operation m; its rows start at :meth:`row_base` (m).
        num_rows: R, rows received in all.
        dispatch_id, num_experts, topk_dtype: as :class:`~.internode_engines.InternodeHandle`.
    """

    num_tokens: int
    num_channels: int
    is_token_in_rank: torch.Tensor
    is_token_in_node: torch.Tensor
    node_prefix: torch.Tensor
    node_peer_ok: torch.Tensor
    segments: list[int]
    forward_in_rank: torch.Tensor
    local: list[IntranodeHandle]
    num_rows: int
    dispatch_id: int
    num_experts: int
    topk_dtype: torch.dtype = torch.int64
    notified: bool = dataclasses.field(default=False, repr=False)

    @property
    def num_forward_rows(self) -> int:
        """R1: rows this rank received in stage 1 (and forwards)."""
        return self.segments[-1]

    @property
    def num_recv_tokens(self) -> int:
        """R as a host int (the staged pipeline always reads its counts on the host)."""
        return self.num_rows

    def row_base(self, node: int) -> int:
        """First receive row of stage-2 op ``node`` (rows from source node ``node``)."""
        return sum(h.num_rows for h in self.local[:node])


def _node_groups(t: InternodeEngines, ranks: list[int]):
    """Per node with launched ranks (consecutive, global ``ranks``): its intranode engine and the
    indices into ``ranks`` of its members."""
    groups: dict[int, list[int]] = {}
    for i, r in enumerate(ranks):
        groups.setdefault(r // t.ranks_per_node, []).append(i)
    for node, members in groups.items():
        yield node, t.nodes[node], members


def _local_statuses(t: InternodeEngines, statuses: dict[int, int]) -> dict[int, int]:
    """Refusing ranks numbered as their node's intranode engine numbers them."""
    return {r % t.ranks_per_node: code for r, code in statuses.items()}


def _local_skip(t: InternodeEngines, node: int, skip_rank: int | None) -> int | None:
    L = t.ranks_per_node
    return skip_rank - node * L if skip_rank is not None and skip_rank // L == node else None


def _node_call(t: InternodeEngines, call, node: int, **fields):
    """The call (of ``call``'s type: DispatchCall or CombineCall) of node ``node``'s stage-2
    launches: ``fields`` (its members' rows), ``call``'s statuses and withheld rank numbered as
    the node's intranode engine numbers them, and the withheld phase (a stage-2 phase only where
    ``call`` names it: else the staged pipeline's main kernel)."""
    main = "node_dispatch" if isinstance(call, DispatchCall) else "node_combine"
    return type(call)(
        statuses=_local_statuses(t, call.statuses),
        skip_rank=_local_skip(t, node, call.skip_rank),
        skip_phase=call.skip_phase or main,
        **fields,
    )


def staged_dispatch(t: InternodeEngines, call: DispatchCall) -> list[InternodeDispatch]:
    """The staged pipeline's dispatch for ranks ``call.inputs[i].rank`` (consecutive): stage 1 in
    one launch per step, stage 2 one intranode launch per (node, source node)
    (``call.skip_phase`` None: "node_dispatch").

    Raises:
        ValueError: a ``num_worst_tokens`` budget (the staged pipeline reads its counts on the
            host), or the launch checks' errors.
    """
    if call.budget >= 0:
        raise ValueError(
            "num_worst_tokens needs Config.internode_pipeline='fused' (the staged pipeline reads its "
            "counts on the host)"
        )
    inputs, handles, num_experts, statuses = call.inputs, call.handles, call.num_experts, call.statuses
    e, N, L, device = t.rdma, t.num_nodes, t.ranks_per_node, t.rdma.device
    experts_per_node, experts_per_rank = num_experts // N, num_experts // t.world_size
    ranks = [inp.rank for inp in inputs]
    fresh = handles is None
    scratch = lambda n=1: torch.zeros(n, dtype=torch.int32, device=device)  # noqa: E731
    # Stage 1: node notify (fresh only) and node dispatch into the forwarders' staging rows.
    if fresh:
        C = check_num_sms(call.num_sms, e.config)
        ids = e.dispatch_ids(call.dispatch_ids, len(inputs))
        in_node = [inp.is_token_in_rank.view(-1, N, L).any(2).contiguous() for inp in inputs]
        node_prefix = [scratch(N * C + 1) for _ in inputs]
        node_ok = [scratch(N) for _ in inputs]
        outputs = [scratch(2) for _ in inputs]  # the count and overflow words notify writes (unused here)
        e.notify(
            "node",
            e.common(C, ranks[0], call.skip("node_notify", "node_dispatch")),
            [
                require_extension().NotifyRank(
                    is_token_in_rank=ptr(itn),
                    recv_prefix=p.data_ptr(),
                    num_recv_tokens=out.data_ptr(),
                    overflow=out.data_ptr() + 4,
                    peer_ok=ok.data_ptr(),
                    recv_topk_idx=None,
                    recv_topk_weights=None,
                    recv_src_idx=None,
                    num_tokens=inp.x.shape[0],
                    budget=-1,
                    **e.dispatch_check(OP_DISPATCH, ids[i], inp, num_experts, C, statuses.get(inp.rank, 0)),
                )
                for i, (inp, itn, p, ok, out) in enumerate(zip(inputs, in_node, node_prefix, node_ok, outputs))
            ],
        )
        prefixes_host = torch.stack(node_prefix).tolist()  # one host sync for all launched ranks
        if call.check:
            t.check()
        segments = [[p[m * C] for m in range(N + 1)] for p in prefixes_host]
    else:
        C = handles[0].num_channels
        ids = [h.dispatch_id for h in handles]
        in_node = [h.is_token_in_node for h in handles]
        node_prefix = [h.node_prefix for h in handles]
        segments = [h.segments for h in handles]
    staged = [alloc_outputs(inp, seg[-1], experts_per_node, device) for inp, seg in zip(inputs, segments)]
    overflow = [scratch() for _ in inputs]
    e.dispatch(
        "node",
        e.common(C, ranks[0], call.skip("node_dispatch", "node_dispatch")),
        [
            require_extension().DispatchRank(
                x=ptr(inp.x),
                x_scales=ptr(inp.scales),
                topk_idx=ptr(inp.topk_idx),
                topk_weights=ptr(inp.topk_weights),
                is_token_in_rank=ptr(itn),
                recv_prefix=p.data_ptr(),
                recv_x=ptr(s["x"]),
                recv_scales=ptr(s["scales"]),
                recv_topk_idx=ptr(s["topk_idx"]),
                recv_topk_weights=ptr(s["topk_weights"]) if inp.topk_weights is not None else None,
                recv_src_idx=ptr(s["src_idx"]),
                num_recv_per_expert=s["per_expert"].data_ptr(),
                overflow=o.data_ptr(),
                peer_ok=node_ok[i].data_ptr() if fresh else None,
                num_tokens=inp.x.shape[0],
                num_rows=seg[-1],
                **e.dispatch_check(
                    OP_DISPATCH if fresh else OP_CACHED_DISPATCH, ids[i], inp, num_experts, C, statuses.get(inp.rank, 0)
                ),
            )
            for i, (inp, itn, p, s, o, seg) in enumerate(zip(inputs, in_node, node_prefix, staged, overflow, segments))
        ],
        call,
        experts_per_node,
    )
    if call.check and e.backend == "cpu":
        t.check()

    # Stage 2: per node, one intranode operation per source node m over the forwarded rows.
    def stage2_input(i: int, m: int, forward_in_rank: torch.Tensor) -> RankInput:
        s, seg = staged[i], slice(segments[i][m], segments[i][m + 1])
        return RankInput(
            ranks[i] % L,
            s["x"][seg],
            s["scales"][seg] if s["scales"] is not None else None,
            s["topk_idx"][seg],
            s["topk_weights"][seg] if inputs[i].topk_weights is not None else None,
            forward_in_rank[seg],
            torch.int64,
            token_ids=s["src_idx"][seg],
        )

    if fresh:
        from ...ops.layout import get_dispatch_layout

        forward_in_rank = [
            get_dispatch_layout(s["topk_idx"], experts_per_node, L, L, validate=False)[3].contiguous()
            if s["topk_idx"].numel()
            else torch.zeros(s["x"].shape[0], L, dtype=torch.bool, device=device)
            for s in staged
        ]
        local: list[list[IntranodeHandle]] = [[] for _ in inputs]
        for node, engine, members in _node_groups(t, ranks):
            for m in range(N):
                stage2 = _node_call(
                    t,
                    call,
                    node,
                    inputs=[stage2_input(i, m, forward_in_rank[i]) for i in members],
                    num_experts=experts_per_rank * L,
                    num_sms=call.num_sms,
                    dispatch_ids=[ids[i] for i in members],
                )
                run_notify(engine, stage2)  # each reads R: the staged host syncs
                for i, h in zip(members, stage2.handles):
                    local[i].append(h)
        if call.check:
            t.check()
        handles = [
            StagedInternodeHandle(
                **call.handle_fields(inp, ids[i], C),
                is_token_in_node=itn,
                node_prefix=p,
                node_peer_ok=ok,
                segments=seg,
                forward_in_rank=fir,
                local=loc,
                num_rows=sum(h.num_rows for h in loc),
            )
            for i, (inp, itn, p, ok, seg, fir, loc) in enumerate(
                zip(inputs, in_node, node_prefix, node_ok, segments, forward_in_rank, local)
            )
        ]
    outs = [alloc_outputs(inp, h.num_rows, experts_per_rank, device) for inp, h in zip(inputs, handles)]
    for node, engine, members in _node_groups(t, ranks):
        for m in range(N):
            launch_inputs, launch_outs = [], []
            for i in members:
                h, o = handles[i], outs[i]
                rows = slice(h.row_base(m), h.row_base(m) + h.local[m].num_rows)
                inp = stage2_input(i, m, h.forward_in_rank)
                if inputs[i].topk_dtype is None:  # x alone: no top-k travels in stage 2 either
                    inp = dataclasses.replace(inp, topk_idx=inp.topk_idx[:, :0], topk_weights=None)
                launch_inputs.append(inp)
                launch_outs.append(
                    {
                        "x": o["x"][rows],
                        "scales": o["scales"][rows] if o["scales"] is not None else None,
                        "topk_idx": o["topk_idx"][rows],
                        "topk_weights": o["topk_weights"][rows],
                        "src_idx": o["src_idx"][rows],
                        "per_expert": o["per_expert"],
                    }
                )
            launch_dispatch(
                engine,
                _node_call(
                    t,
                    call,
                    node,
                    inputs=launch_inputs,
                    num_experts=experts_per_rank * L,
                    handles=[handles[i].local[m] for i in members],
                    outs=launch_outs,
                ),
            )
    return assemble_results(InternodeDispatch, inputs, handles, outs)


def staged_combine(t: InternodeEngines, call: CombineCall) -> list[torch.Tensor]:
    """The staged pipeline's combine for ranks ``call.rank_begin + i``: stage 2 backwards (one
    intranode combine per source node into node partials), then stage 1 (each partial to its
    source, summed there by ascending node) (``call.skip_phase`` None: "node_combine")."""
    e, N, L, device = t.rdma, t.num_nodes, t.ranks_per_node, t.rdma.device
    handles, statuses = call.handles, call.statuses
    hidden, dtype, y_bytes = e.prepare_combine(call, StagedInternodeHandle)
    C, scales = handles[0].num_channels, call.row_scales
    ranks = list(range(call.rank_begin, call.rank_begin + len(call.ys)))
    # Stage 2 backwards: node partials [R1, H] on every forwarder, one intranode combine per m.
    partials = [torch.empty(h.num_forward_rows, hidden, dtype=dtype, device=device) for h in handles]
    for node, engine, members in _node_groups(t, ranks):
        for m in range(N):
            bases = [handles[i].row_base(m) for i in members]
            rows = [slice(b, b + handles[i].local[m].num_rows) for i, b in zip(members, bases)]
            segs = [slice(handles[i].segments[m], handles[i].segments[m + 1]) for i in members]
            stage2 = _node_call(
                t,
                call,
                node,
                rank_begin=ranks[members[0]] % L,
                ys=[call.ys[i][r] for i, r in zip(members, rows)],
                handles=[handles[i].local[m] for i in members],
                row_scales=[None if scales[i] is None else scales[i][r].contiguous() for i, r in zip(members, rows)],
                outs=[partials[i][s] for i, s in zip(members, segs)],
            )
            run_intranode_combine(engine, stage2)
    if call.check and e.backend == "cpu":
        t.check()
    # Stage 1 backwards: each partial once to its source, summed there by ascending node.
    e.combine(
        "node",
        e.common(C, call.rank_begin, call.skip("node_combine", "node_combine")),
        [
            require_extension().CombineRank(
                y=ptr(p),
                row_scale=None,
                is_token_in_rank=ptr(h.is_token_in_node),
                recv_prefix=h.node_prefix.data_ptr(),
                out=ptr(o),
                num_tokens=h.num_tokens,
                num_rows=h.num_forward_rows,
                **e.combine_check(
                    call.rank_begin + i, h, call.row_bytes or y_bytes, dtype, C, statuses.get(call.rank_begin + i, 0)
                ),
            )
            for i, (p, h, o) in enumerate(zip(partials, handles, call.outs))
        ],
        y_bytes,
        dtype,
    )
    return call.outs


def empty_staged_handle(t: InternodeEngines) -> StagedInternodeHandle:
    """A staged handle of no tokens and no rows (a refusing rank's stand-in)."""
    N, L, W, C, device = t.num_nodes, t.ranks_per_node, t.world_size, t.rdma.config.num_channels, t.rdma.device
    zeros = lambda *shape, dtype=torch.int32: torch.zeros(*shape, dtype=dtype, device=device)  # noqa: E731
    local = [
        IntranodeHandle(
            0, C, zeros(0, L, dtype=torch.bool), zeros(L * C + 1), 0, zeros(1), zeros(1), 0, peer_ok=zeros(L)
        )
        for _ in range(N)
    ]
    return StagedInternodeHandle(
        0,
        C,
        zeros(0, W, dtype=torch.bool),
        zeros(0, N, dtype=torch.bool),
        zeros(N * C + 1),
        zeros(N),
        [0] * (N + 1),
        zeros(0, L, dtype=torch.bool),
        local,
        0,
        0,
        0,
    )
