"""Dispatch and combine as autograd Functions, each the other's backward (they are adjoint:
dispatch copies a token to every rank that holds it, combine sums those copies back)."""

from __future__ import annotations

import torch


class DispatchFn(torch.autograd.Function):
    """First dispatch of a routing: moves ``x`` (and raw ``topk_weights``) and builds the plan.

    ``box`` (a dict) receives the plan and the received global ``topk_idx``; the backward is a
    combine of the gradients through that plan.
    """

    @staticmethod
    def forward(ctx, transport, box: dict, topk_idx, is_token_in_rank, x, topk_weights):
        tensors = [x] if topk_weights is None else [x, topk_weights]
        received, recv_topk_idx, plan = transport.dispatch(tensors, topk_idx, is_token_in_rank)
        box["plan"], box["recv_topk_idx"] = plan, recv_topk_idx
        ctx.transport, ctx.plan = transport, plan
        return received[0], (received[1] if topk_weights is not None else None)

    @staticmethod
    def backward(ctx, grad_recv_x, grad_recv_weights):
        tensors = [grad_recv_x.contiguous()]
        if grad_recv_weights is not None:
            tensors.append(grad_recv_weights.contiguous())
        grads = ctx.transport.combine(tensors, [None] * len(tensors), ctx.plan, what="dispatch backward (combine)")
        return None, None, None, None, grads[0], (grads[1] if len(grads) > 1 else None)


class ReplayDispatchFn(torch.autograd.Function):
    """Dispatch of ``x`` through an existing plan (cached dispatch); backward is a combine."""

    @staticmethod
    def forward(ctx, transport, plan, x):
        ctx.transport, ctx.plan = transport, plan
        return transport.forward([x], plan, what="cached dispatch")[0]

    @staticmethod
    def backward(ctx, grad):
        return None, None, ctx.transport.combine([grad.contiguous()], [None], ctx.plan,
                                                 what="cached dispatch backward (combine)")[0]


class CombineFn(torch.autograd.Function):
    """Combine of ``y [R, H]`` (rows scaled by ``row_scale [R]`` fp32 when given); backward is a
    dispatch of the gradient through the same plan."""

    @staticmethod
    def forward(ctx, transport, plan, y, row_scale):
        ctx.transport, ctx.plan = transport, plan
        ctx.save_for_backward(y, row_scale)
        return transport.combine([y], [row_scale], plan)[0]

    @staticmethod
    def backward(ctx, grad_out):
        y, row_scale = ctx.saved_tensors
        grad = ctx.transport.forward([grad_out.contiguous()], ctx.plan, what="combine backward (dispatch)")[0]
        grad_y = grad_scale = None
        if row_scale is None:
            grad_y = grad
        else:
            if ctx.needs_input_grad[2]:
                grad_y = (grad.float() * row_scale.unsqueeze(1)).to(y.dtype)
            if ctx.needs_input_grad[3]:
                grad_scale = (grad.float() * y.float()).sum(1)
        return None, None, grad_y, grad_scale
