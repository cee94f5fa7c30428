"""Dispatch and combine as autograd Functions, each the other's backward (they are adjoint:
dispatch copies a token to every rank that holds it, combine sums those copies back).

The Functions only wire gradients; a Buffer's :class:`~.transfers.Transfers` moves
the data, launched as the per-call :class:`~.calls.Call` says (sync,
async, or up to a receive hook). Backward passes run synchronously, except that a dispatch
given a ``wgrad_store`` launches its gradient combine first and runs the delayed weight
gradients while it is in flight.
"""

from __future__ import annotations

import torch

from ..ops.quant import per_token_cast_back
from .calls import Call


class DispatchFn(torch.autograd.Function):
    """Dispatch of ``x`` (and ``topk_weights``) as ``call.dispatch`` routes it.

    ``call`` carries the plan slot, the layout, the output ``recv_topk_idx`` and the launch
    mode, and receives the event or hook. Gradients of ``recv_topk_weights`` flow back only
    where ``recv_topk_idx`` names a local expert (elsewhere the output is 0). With a fused
    permute (``call.dispatch.layout``) the outputs are expert-major (``[P, H]`` and ``[P]``): the
    backward combine sums each token's copies, and a row's weight gradient returns to its entry.

    ``wire``: None, or the fp8 pair ``(x_fp8, scales)`` of ``x`` (``ops.quant.per_token_cast_to_fp8``)
    that travels instead of ``x`` and is dequantized to x's dtype on arrival (the call must
    complete before it returns: ``call.mode`` "sync"). Its gradient passes the quantization
    straight through, as DeepEP's fp8 dispatch in training: the backward combine moves the
    gradients in their own dtype.
    """

    @staticmethod
    def forward(ctx, transfers, call: Call, x, topk_weights, wire=None):
        ctx.transfers, ctx.call = transfers, call
        if wire is None:
            recv_x, recv_weights = transfers.dispatch(call, x, topk_weights)
            return recv_x, recv_weights
        recv_fp8, recv_scales, recv_weights = transfers.dispatch(call, list(wire), topk_weights)
        return per_token_cast_back(recv_fp8, recv_scales, x.dtype), recv_weights

    @staticmethod
    def backward(ctx, grad_recv_x, grad_recv_weights):
        routing = ctx.call.dispatch
        permute = routing.slot.permute
        tensors = [grad_recv_x.contiguous()]
        if grad_recv_weights is not None and permute is not None:
            # [P] per row -> [R, K] per entry: each entry's row (row_id_map), 0 where no row holds
            # it (another rank's expert, or dropped)
            rows = permute.row_id_map.reshape(-1)
            if grad_recv_weights.shape[0]:
                entries = grad_recv_weights.index_select(0, rows.clamp(min=0)).masked_fill_(rows < 0, 0.0)
            else:  # no row at all
                entries = grad_recv_weights.new_zeros(rows.shape)
            tensors.append(entries.view(routing.recv_topk_idx.shape))
        elif grad_recv_weights is not None:
            mine = routing.recv_topk_idx >= 0
            tensors.append(torch.where(mine, grad_recv_weights, torch.zeros_like(grad_recv_weights)))
        store = ctx.call.wgrad_store
        launch = Call(mode="async" if store is not None else "sync")
        major = [permute is not None] + [False] * (len(tensors) - 1)
        grads = ctx.transfers.combine(
            routing.slot, tensors, [None] * len(tensors), launch, "dispatch backward (combine)", major
        )
        if store is not None:  # the experts' weight gradients overlap the combine in flight
            store.backward_dw()
            launch.event.current_stream_wait()
        return None, None, grads[0], (grads[1] if len(grads) > 1 else None), None


class ReplayDispatchFn(torch.autograd.Function):
    """Dispatch of ``x`` through an existing plan slot (cached dispatch); backward is a combine."""

    @staticmethod
    def forward(ctx, transfers, slot, call: Call, x):
        ctx.transfers, ctx.slot = transfers, slot
        return transfers.forward(slot, [x], call, "cached dispatch")[0]

    @staticmethod
    def backward(ctx, grad):
        out = ctx.transfers.combine(ctx.slot, [grad.contiguous()], [None], Call(), "cached dispatch backward (combine)")
        return None, None, None, out[0]


class CombineFn(torch.autograd.Function):
    """Combine of ``y [R, H]`` (rows scaled by ``row_scale [R]`` fp32 when given); backward is a
    dispatch of the gradient through the same plan slot."""

    @staticmethod
    def forward(ctx, transfers, slot, call: Call, y, row_scale):
        ctx.transfers, ctx.slot = transfers, slot
        ctx.save_for_backward(y, row_scale)
        return transfers.combine(slot, [y], [row_scale], call, "combine")[0]

    @staticmethod
    def backward(ctx, grad_out):
        y, row_scale = ctx.saved_tensors
        grad = ctx.transfers.forward(ctx.slot, [grad_out.contiguous()], Call(), "combine backward (dispatch)")[0]
        grad_y = grad_scale = None
        if row_scale is None:
            grad_y = grad
        else:
            if ctx.needs_input_grad[3]:
                grad_y = (grad.float() * row_scale.unsqueeze(1)).to(y.dtype)
            if ctx.needs_input_grad[4]:
                grad_scale = (grad.float() * y.float()).sum(1)
        return None, None, None, grad_y, grad_scale
