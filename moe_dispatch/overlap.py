"""Delayed weight gradients: the expert GEMMs' weight gradients are deferred at backward time
and run by an explicit ``backward_dw()``, so they can overlap the dispatch's backward (a
combine) in flight. Megatron-Core does this with Transformer Engine's ``GroupedLinear``
(``delay_wgrad_compute=True``); this mechanism needs no Transformer Engine.

Usage::

    store = DelayedWgrad()
    recv_x, ..., handle, _ = buf.dispatch(x, topk_idx, topk_weights, E, wgrad_store=store)
    h = delayed_linear(recv_x, w1, store)          # experts, weight gradients deferred
    out, _ = buf.combine(delayed_linear(act(h), w2, store), handle)
    out.sum().backward()   # dispatch backward: launch combine, store.backward_dw(), wait
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class DelayedWgrad:
    """FIFO of deferred weight-gradient computations (one per layer or micro-batch).

    ``backward_dw()`` runs them in the order they were deferred and accumulates into each
    weight's ``.grad`` exactly as autograd would (set when None, else add), so gradients are
    bitwise identical to the non-delayed order.
    """

    def __init__(self) -> None:
        self._pending: list[Callable[[], None]] = []

    def __len__(self) -> int:
        """Number of deferred computations not yet run."""
        return len(self._pending)

    def defer(self, compute: Callable[[], None]) -> None:
        """Queues ``compute`` (it writes a weight gradient) for :meth:`backward_dw`."""
        self._pending.append(compute)

    def backward_dw(self) -> None:
        """Runs and clears every deferred weight-gradient computation, in order."""
        pending, self._pending = self._pending, []
        with torch.no_grad():
            for compute in pending:
                compute()


def _accumulate(weight: torch.Tensor, grad: torch.Tensor) -> None:
    if weight.grad is None:
        weight.grad = grad
    else:
        weight.grad += grad


class _DelayedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, store):
        ctx.save_for_backward(x, weight)
        ctx.store = store
        return x @ weight.t()

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        grad_x = grad_y @ weight if ctx.needs_input_grad[0] else None
        if ctx.needs_input_grad[1]:
            if ctx.store is None:
                return grad_x, grad_y.t() @ x, None
            ctx.store.defer(lambda: _accumulate(weight, grad_y.t() @ x))
        return grad_x, None, None


def delayed_linear(x: torch.Tensor, weight: torch.Tensor, store: DelayedWgrad | None) -> torch.Tensor:
    """``y = x @ weight.T`` whose weight gradient is deferred into ``store`` (computed now when
    ``store`` is None).

    Args:
        x: ``[M, in_features]``.
        weight: ``[out_features, in_features]`` leaf parameter (its ``.grad`` is written by
            ``store.backward_dw()``).
        store: the :class:`DelayedWgrad` to defer into, or None.

    Returns:
        ``[M, out_features]``.
    """
    return _DelayedLinear.apply(x, weight, store)
