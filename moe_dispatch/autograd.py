"""Dispatch and combine as autograd Functions, each the other's backward (they are adjoint:
dispatch copies a token to every rank that holds it, combine sums those copies back).

The Functions only wire gradients; the Buffer's ``_move_*`` methods move the data (possibly
asynchronously: outputs are allocated up front and filled by the communication thread).
Backward passes run synchronously.
"""

from __future__ import annotations

import torch


class DispatchFn(torch.autograd.Function):
    """Dispatch of ``x`` (and ``topk_weights``) through ``state["plan"]``.

    ``state`` (a dict owned by the handle being built) carries the plan, the layout, the
    output ``recv_topk_idx`` and receives the ``event``. Gradients of ``recv_topk_weights``
    flow back only where ``recv_topk_idx`` names a local expert (elsewhere the output is 0).
    """

    @staticmethod
    def forward(ctx, buffer, state: dict, async_finish: bool, x, topk_weights):
        ctx.buffer, ctx.state = buffer, state
        recv_x, recv_weights = buffer._move_dispatch(state, x, topk_weights, async_finish)
        return recv_x, recv_weights

    @staticmethod
    def backward(ctx, grad_recv_x, grad_recv_weights):
        tensors = [grad_recv_x.contiguous()]
        if grad_recv_weights is not None:
            mine = ctx.state["recv_topk_idx"] >= 0
            tensors.append(torch.where(mine, grad_recv_weights, torch.zeros_like(grad_recv_weights)))
        grads = ctx.buffer._move_combine(ctx.state["plan"], tensors, [None] * len(tensors), False,
                                         "dispatch backward (combine)")[0]
        return None, None, None, grads[0], (grads[1] if len(grads) > 1 else None)


class ReplayDispatchFn(torch.autograd.Function):
    """Dispatch of ``x`` through an existing plan (cached dispatch); backward is a combine."""

    @staticmethod
    def forward(ctx, buffer, plan, events: list, async_finish: bool, x):
        ctx.buffer, ctx.plan = buffer, plan
        outs, event = buffer._move_forward(plan, [x], async_finish, "cached dispatch")
        events.append(event)
        return outs[0]

    @staticmethod
    def backward(ctx, grad):
        outs, _ = ctx.buffer._move_combine(ctx.plan, [grad.contiguous()], [None], False,
                                           "cached dispatch backward (combine)")
        return None, None, None, None, outs[0]


class CombineFn(torch.autograd.Function):
    """Combine of ``y [R, H]`` (rows scaled by ``row_scale [R]`` fp32 when given); backward is a
    dispatch of the gradient through the same plan."""

    @staticmethod
    def forward(ctx, buffer, plan, events: list, async_finish: bool, y, row_scale):
        ctx.buffer, ctx.plan = buffer, plan
        ctx.save_for_backward(y, row_scale)
        outs, event = buffer._move_combine(plan, [y], [row_scale], async_finish, "combine")
        events.append(event)
        return outs[0]

    @staticmethod
    def backward(ctx, grad_out):
        y, row_scale = ctx.saved_tensors
        outs, _ = ctx.buffer._move_forward(ctx.plan, [grad_out.contiguous()], False, "combine backward (dispatch)")
        grad = outs[0]
        grad_y = grad_scale = None
        if row_scale is None:
            grad_y = grad
        else:
            if ctx.needs_input_grad[4]:
                grad_y = (grad.float() * row_scale.unsqueeze(1)).to(y.dtype)
            if ctx.needs_input_grad[5]:
                grad_scale = (grad.float() * y.float()).sum(1)
        return None, None, None, None, grad_y, grad_scale
