"""The combine's sums of the torch_dist transport, in the summation order that
:mod:`moe_dispatch.semantics.summation` defines (``test_sums`` compares these functions with its
``combine_sum``): a forwarder forms the node partials (:func:`forwarder_sums`), the source sums them
(:func:`source_sums`); the flat route runs both levels at the source (:func:`flat_sums`). A fused
permute's expert-major rows are first summed per received row (:func:`unpermute`). Every sum is
:func:`moe_dispatch.semantics.sums.ordered_sum` (:mod:`moe_dispatch.ops.sums`: in one native pass
on CPU, ``csrc/kernels/sums_cpu.cpp``), planned once per dispatch and kept in its plan."""

from __future__ import annotations

import torch

from ... import _ext
from ...ops.sums import BlockedRows, OnePassPlan, grouped_sum, ordered_sum, plan_grouped, plan_sum, plan_sum_by_output
from ...semantics.permute import PermuteHandle
from ...semantics.sums import SumPlan
from ...topology import Topology
from .plan import TorchDistChunk, TorchDistPlan, final_of_arrival


def sum_plan(
    plan: TorchDistPlan, key, index: torch.Tensor, num_out: int, scaled: bool = False
) -> SumPlan | OnePassPlan:
    """The plan's :class:`SumPlan` of rows onto ``num_out`` outputs by ``index``, made once per key."""
    return plan.cached((key, scaled), lambda: plan_sum(index, num_out, scaled=scaled))


def row_scales(fields: list, scales: list[torch.Tensor | None], num_tensors: int) -> list:
    """Per tensor its scale column among the packed ``fields`` (``[rows]`` fp32), or None: the
    scales travel as extra fp32 columns after the ``num_tensors`` tensors, so whoever sums
    multiplies in fp32."""
    out, k = [], num_tensors
    for s in scales:
        if s is None:
            out.append(None)
            continue
        column = fields[k].gathered() if isinstance(fields[k], BlockedRows) else fields[k]
        out.append(column.view(-1))
        k += 1
    return out


def unpermute(plan: TorchDistPlan, rows: torch.Tensor, permute: PermuteHandle) -> torch.Tensor:
    """``[R, ...]`` in arrival order: each received row the fp32 sum of its copies among the
    expert-major ``rows [P, ...]`` that ``permute`` laid out, ascending row (unpermute)."""

    def make():
        arrival = final_of_arrival(plan)
        terms = permute.row_id_map
        terms = terms if arrival is None else terms[arrival]  # outputs in arrival order
        return permute, plan_sum_by_output(terms, permute.num_rows)

    made_for, by_output = plan.cached("unpermute", make)
    if made_for is not permute:  # another expert layout over the same dispatch
        made_for, by_output = plan.cache["unpermute"] = make()
    return ordered_sum(by_output, rows)


def forwarder_sums(
    plan: TorchDistPlan, c: int, chunk: TorchDistChunk, rows: list[torch.Tensor], scales: list[torch.Tensor | None]
) -> list[torch.Tensor]:
    """A forwarder's sums of chunk ``c``: per tensor, the rows its node's ranks returned
    (``rows``: ``[S2, ...]`` in stage-2 send order, ``scales`` the matching ``[S2]`` fp32 or None)
    summed onto the ``[S1, ...]`` rows stage 1 brought, ascending local rank, in fp32, rounded."""
    num_forwarded = sum(chunk.s1_recv_splits)
    return [
        ordered_sum(sum_plan(plan, ("forwarder", c), chunk.s2_send_idx, num_forwarded, sc is not None), t, sc)
        for t, sc in zip(rows, scales)
    ]


def source_sums(plan: TorchDistPlan, chunk: TorchDistChunk, rows: list[torch.Tensor], out: list[torch.Tensor]) -> None:
    """The source's sums of a chunk: per tensor, the node partials stage 1 returned (``rows``:
    ``[S1, ...]`` in stage-1 send order) summed onto the chunk's tokens of ``out`` (``[T, ...]``),
    ascending node, in fp32, rounded."""
    source = sum_plan(plan, ("source", chunk.begin), chunk.s1_send_idx, chunk.end - chunk.begin)
    for dst, field in zip(out, rows):
        ordered_sum(source, field, out=dst[chunk.begin : chunk.end])


def flat_sums(
    plan: TorchDistPlan,
    rows: torch.Tensor | BlockedRows,
    scale: torch.Tensor | None,
    out: torch.Tensor,
    topo: Topology,
) -> None:
    """The flat route's combine at the source: ``rows`` come back from every holder in rank
    order (each holder's in token order); inside each node they are summed in fp32 over its
    ranks (ascending) and rounded, then the node partials in fp32 over the nodes (ascending)."""
    local_ranks, num_nodes, num_tokens = topo.ranks_per_node, topo.num_nodes, plan.num_tokens
    if num_nodes == 1 or (local_ranks == 1 and scale is None):
        # one level: with one node the node sum is the sum; with one rank per node and no
        # scales a node partial is its one row
        one_level = sum_plan(plan, "flat", plan.flat_send_idx, num_tokens, scale is not None)
        ordered_sum(one_level, rows, scale, out=out)
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
