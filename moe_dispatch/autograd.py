"""Dispatch and combine as autograd Functions, each the other's backward (they are adjoint:
dispatch copies a token to every rank that holds it, combine sums those copies back).

The Functions only wire gradients; the Buffer's ``_move_*`` methods move the data, launched
as the per-call ``ctl`` dict says (sync, async, or up to a receive hook). Backward passes run
synchronously, except that a dispatch given a ``wgrad_store`` launches its gradient combine
first and runs the delayed weight gradients while it is in flight.
"""

from __future__ import annotations

import torch


class DispatchFn(torch.autograd.Function):
    """Dispatch of ``x`` (and ``topk_weights``) through ``ctl["slot"]``'s plan.

    ``ctl`` carries the plan slot, the layout, the output ``recv_topk_idx``, the launch mode and
    receives the event or hook. Gradients of ``recv_topk_weights`` flow back only where
    ``recv_topk_idx`` names a local expert (elsewhere the output is 0).
    """

    @staticmethod
    def forward(ctx, buffer, ctl: dict, x, topk_weights):
        ctx.buffer, ctx.ctl = buffer, ctl
        recv_x, recv_weights = buffer._move_dispatch(ctl, x, topk_weights)
        return recv_x, recv_weights

    @staticmethod
    def backward(ctx, grad_recv_x, grad_recv_weights):
        ctl = ctx.ctl
        tensors = [grad_recv_x.contiguous()]
        if grad_recv_weights is not None:
            mine = ctl["recv_topk_idx"] >= 0
            tensors.append(torch.where(mine, grad_recv_weights, torch.zeros_like(grad_recv_weights)))
        store = ctl.get("wgrad_store")
        launch = {"mode": "async" if store is not None else "sync"}
        grads = ctx.buffer._move_combine(ctl["slot"], tensors, [None] * len(tensors), launch,
                                         "dispatch backward (combine)")
        if store is not None:  # the experts' weight gradients overlap the combine in flight
            store.backward_dw()
            launch["event"].current_stream_wait()
        return None, None, grads[0], (grads[1] if len(grads) > 1 else None)


class ReplayDispatchFn(torch.autograd.Function):
    """Dispatch of ``x`` through an existing plan slot (cached dispatch); backward is a combine."""

    @staticmethod
    def forward(ctx, buffer, slot, ctl: dict, x):
        ctx.buffer, ctx.slot = buffer, slot
        return buffer._move_forward(slot, [x], ctl, "cached dispatch")[0]

    @staticmethod
    def backward(ctx, grad):
        out = ctx.buffer._move_combine(ctx.slot, [grad.contiguous()], [None], {"mode": "sync"},
                                       "cached dispatch backward (combine)")
        return None, None, None, out[0]


class CombineFn(torch.autograd.Function):
    """Combine of ``y [R, H]`` (rows scaled by ``row_scale [R]`` fp32 when given); backward is a
    dispatch of the gradient through the same plan slot."""

    @staticmethod
    def forward(ctx, buffer, slot, ctl: dict, y, row_scale):
        ctx.buffer, ctx.slot = buffer, slot
        ctx.save_for_backward(y, row_scale)
        return buffer._move_combine(slot, [y], [row_scale], ctl, "combine")[0]

    @staticmethod
    def backward(ctx, grad_out):
        y, row_scale = ctx.saved_tensors
        grad = ctx.buffer._move_forward(ctx.slot, [grad_out.contiguous()], {"mode": "sync"},
                                        "combine backward (dispatch)")[0]
        grad_y = grad_scale = None
        if row_scale is None:
            grad_y = grad
        else:
            if ctx.needs_input_grad[3]:
                grad_y = (grad.float() * row_scale.unsqueeze(1)).to(y.dtype)
            if ctx.needs_input_grad[4]:
                grad_scale = (grad.float() * y.float()).sum(1)
        return None, None, None, grad_y, grad_scale
