"""Delayed expert weight gradients for Megatron-Core MoE layers without Transformer Engine.

Megatron-Core's ``delay_wgrad_compute=True`` defers the experts' weight gradients (wgrads)
out of the backward pass so its combined-1F1B EP-overlap schedule can run them next to the
dispatch backward. Only Transformer Engine's ``GroupedLinear`` can defer; Megatron's own
linear layers (the experts of the local, non-TE spec: ``SequentialMLP`` over
``ColumnParallelLinear`` / ``RowParallelLinear``) compute them at once and their
``backward_dw()`` does nothing. This module gives those experts the same behaviour through
:class:`moe_dispatch.overlap.DelayedWgrad`. With the "custom" backend it needs no call: a
``MoELayer`` built from a config with ``delay_wgrad_compute=True`` defers at once
(:func:`defer_built_layer`, run by the backend as the layer is built)::

    import moe_dispatch.megatron as mdm
    mdm.configure(config, overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=True)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(num_experts=E), ...)
    # every MoE layer's local experts now defer their wgrads to MoELayer.backward_dw()

:func:`enable_delayed_wgrad` (explicit) does the same for a model built otherwise, or switches
the layers to ``run_wgrad="dispatch_backward"``.

Who runs the deferred wgrads (``run_wgrad``):

``"backward_dw"`` (default)
    Megatron's ``MoELayer.backward_dw()`` (the combined-1F1B schedule calls it, through the
    layer's "mlp" node, right after the experts' dgrad and just before the dispatch backward;
    on GPU it runs on the compute stream while the dispatch backward runs on the
    communication stream). With the "custom" backend the layer's dispatch is also given the
    store (``Buffer.dispatch(..., wgrad_store=)``), so wgrads still deferred when the dispatch
    backward runs (a schedule that never calls ``backward_dw``: plain autograd,
    ``delay_wgrad_compute=False``) run there, while its gradient combine is in flight.
``"dispatch_backward"``
    The dispatch backward of the "custom" backend runs them, after launching its gradient
    combine and before waiting for it (the order of Megatron's
    ``overlap_dispatch_backward_with_experts_wgrad``); Megatron's ``backward_dw()`` call,
    which the schedule makes just before that dispatch backward, hands its work over. This
    overlaps the wgrads with the combine wherever our Buffer communicates asynchronously,
    also on CPU, where Megatron's streams are no-ops. On GPU it puts the wgrad GEMMs on
    the stream that is current in the dispatch backward (Megatron's communication stream
    under EP overlap), so ``"backward_dw"`` is the better choice there.

What it patches, per ``MoELayer`` found (instance attributes only; classes are untouched):

- each local expert's ``linear_fc1`` / ``linear_fc2`` ``_forward_impl``: ``y = x @ W.T``
  (``x [N, in]`` -> ``y [N, out]``, the same matmul as Megatron's
  ``linear_with_grad_accumulation_and_async_allreduce``) whose backward returns the input
  gradient at once and defers ``grad_W = grad_y.T @ x`` into the layer's store; when run,
  it accumulates into ``W.grad`` exactly as autograd would (or into ``W.main_grad`` when
  ``gradient_accumulation_fusion`` is on: an fp32 add, not Megatron's fused kernel), so
  ``.grad`` is bitwise that of the non-delayed layer. Biases (if any) keep their immediate
  gradient. Each such weight is marked ``skip_backward_post_hook`` and its linear gains
  ``register_wgrad_accumulation_and_reduce_hooks``: Megatron's DDP, built with
  ``DistributedDataParallelConfig(delay_wgrad_compute=True)``, registers its grad-ready hook
  there, and the store calls it right after that weight's wgrad, as TE does. (A DDP built
  without that flag hooks the weight's ``AccumulateGrad`` instead, which never sees the
  deferred wgrad: build it with the flag.)
- ``layer.experts.backward_dw`` (called by ``MoELayer.backward_dw(routed_experts=True)``):
  runs (or, in ``"dispatch_backward"`` mode, hands over) the layer's store.
- a forward pre-hook on ``layer.experts`` that raises when wgrads deferred by an earlier
  backward were never run (they would be lost silently otherwise).
- with the "custom" backend: ``manager.wgrad_store`` on the layer's
  ``CustomDispatchManager``, which passes it to ``Buffer.dispatch``.

:func:`disable_delayed_wgrad` removes all of it.

Not covered: Megatron-FSDP (its ``post_wgrad_grad_acc_hook`` runs after ``backward_dw()``,
so only ``"backward_dw"`` mode could fit it; untested), Transformer Engine experts (TE defers
itself), expert linears with communication inside (sequence parallel, ``allreduce_dgrad``).
"""

from __future__ import annotations

import collections
import functools
import warnings
from collections.abc import Iterable

import torch

from ..overlap import DelayedWgrad
from .manager import CustomDispatchManager

RUN_WGRAD_MODES = ("backward_dw", "dispatch_backward")
STORE_ATTR = "moe_dispatch_wgrad_store"
_HOOKS_ATTR = "_moe_dispatch_wgrad_hooks"
_PRE_HOOK_ATTR = "_moe_dispatch_wgrad_pre_hook"
_LINEARS = ("linear_fc1", "linear_fc2")
_TE_EXTENSIONS = "megatron.core.extensions.transformer_engine"


class ExpertWgradStore(DelayedWgrad):
    """The deferred expert wgrads of one ``MoELayer``, with a record of who ran them.

    Attributes:
        layer_name: the layer's module name (for messages).
        run_wgrad: ``"backward_dw"`` or ``"dispatch_backward"`` (see the module docstring).
        counts: ``collections.Counter`` of events: ``"deferred"`` (one wgrad deferred),
            ``"run_by_backward_dw"`` / ``"run_in_dispatch_backward"`` (a non-empty store
            drained by Megatron's ``backward_dw`` / by the dispatch backward, its combine in
            flight), ``"handed_over"`` (``backward_dw`` left its work to the dispatch backward).
        history: the last 256 events in order (the same names), for checking the schedule.
    """

    def __init__(self, layer_name: str = "", run_wgrad: str = "backward_dw") -> None:
        super().__init__()
        self.layer_name = layer_name
        self.run_wgrad = run_wgrad
        self.counts: collections.Counter = collections.Counter()
        self.history: collections.deque = collections.deque(maxlen=256)

    def _note(self, event: str) -> None:
        self.counts[event] += 1
        self.history.append(event)

    def defer(self, compute) -> None:
        self._note("deferred")
        super().defer(compute)

    def backward_dw(self) -> None:
        """Runs every deferred wgrad. Called by ``Buffer.dispatch``'s backward (the store is
        its ``wgrad_store``) between launching the gradient combine and waiting for it."""
        if len(self):
            self._note("run_in_dispatch_backward")
        super().backward_dw()

    def run_for_megatron(self) -> None:
        """What ``MoELayer.backward_dw()`` does for these experts: runs the deferred wgrads
        (``"backward_dw"`` mode) or leaves them to the dispatch backward that follows."""
        if not len(self):
            return
        if self.run_wgrad == "dispatch_backward":
            self._note("handed_over")
            return
        self._note("run_by_backward_dw")
        DelayedWgrad.backward_dw(self)


class _DeferredWgradLinear(torch.autograd.Function):
    """``y = x @ weight.T`` with the weight gradient deferred into ``store`` (``x`` 2-D)."""

    @staticmethod
    def forward(ctx, x, weight, module, store, use_main_grad):
        ctx.save_for_backward(x, weight)
        ctx.module, ctx.store, ctx.use_main_grad = module, store, use_main_grad
        return torch.matmul(x, weight.t())

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        grad_x = grad_y.matmul(weight) if ctx.needs_input_grad[0] else None
        if ctx.needs_input_grad[1]:
            ctx.store.defer(functools.partial(_run_wgrad, ctx.module, weight, grad_y, x, ctx.use_main_grad))
        return grad_x, None, None, None, None


def _run_wgrad(module, weight: torch.Tensor, grad_y: torch.Tensor, x: torch.Tensor, use_main_grad: bool) -> None:
    if grad_y.is_cuda:  # made on the compute stream; the caller's stream may differ (dispatch backward)
        stream = torch.cuda.current_stream()
        grad_y.record_stream(stream)
        x.record_stream(stream)
    grad = grad_y.t().matmul(x)
    main_grad = getattr(weight, "main_grad", None) if use_main_grad else None
    if main_grad is not None:
        main_grad.add_(grad)
        if hasattr(weight, "grad_added_to_main_grad"):
            weight.grad_added_to_main_grad = True
    elif weight.grad is None:
        weight.grad = grad
    else:
        weight.grad += grad
    for hook in getattr(module, _HOOKS_ATTR, ()):
        hook()


def _delayed_forward_impl(
    module,
    store: ExpertWgradStore,
    original,
    input,
    weight,
    bias=None,
    *args,
    gradient_accumulation_fusion: bool = False,
    allreduce_dgrad: bool = False,
    sequence_parallel: bool = False,
    grad_output_buffer=None,
    gtp_remat_size: int = 1,
    **kwargs,
):
    """Replaces ``ColumnParallelLinear/RowParallelLinear._forward_impl`` of an expert linear."""
    if not weight.requires_grad:  # frozen: nothing to defer
        return original(
            input,
            weight,
            bias,
            *args,
            gradient_accumulation_fusion=gradient_accumulation_fusion,
            allreduce_dgrad=allreduce_dgrad,
            sequence_parallel=sequence_parallel,
            grad_output_buffer=grad_output_buffer,
            gtp_remat_size=gtp_remat_size,
            **kwargs,
        )
    unsupported = {
        name: value
        for name, value in (
            ("allreduce_dgrad", allreduce_dgrad),
            ("sequence_parallel", sequence_parallel),
            ("grad_output_buffer", grad_output_buffer is not None),
            ("gtp_remat_size", gtp_remat_size != 1),
        )
        if value
    }
    if unsupported or args:
        raise RuntimeError(
            f"moe_dispatch delayed wgrad: the expert linear of {store.layer_name or 'a MoE layer'} "
            f"was called with {sorted(unsupported) or list(args)} (communication or deferral inside "
            "the linear), which the delayed-wgrad linear does not implement; expert linears of "
            "Megatron's local spec need none of it. Call disable_delayed_wgrad(model) for this model"
        )
    if input.dim() != 2:
        raise RuntimeError(
            f"moe_dispatch delayed wgrad: expert linear input must be [tokens, features], got "
            f"{list(input.shape)} in {store.layer_name or 'a MoE layer'}"
        )
    output = _DeferredWgradLinear.apply(input, weight, module, store, bool(gradient_accumulation_fusion))
    return output + bias if bias is not None else output


def _register_wgrad_hooks(module, hook) -> None:
    """``register_wgrad_accumulation_and_reduce_hooks``: Megatron DDP's grad-ready hook of a
    weight whose wgrad is delayed (``skip_backward_post_hook``), called after that wgrad."""
    getattr(module, _HOOKS_ATTR).append(hook)


def _moe_layers(model) -> list[tuple[str, torch.nn.Module]]:
    from megatron.core.transformer.moe.moe_layer import MoELayer

    chunks = [model] if isinstance(model, torch.nn.Module) else list(model) if isinstance(model, Iterable) else None
    if not chunks or not all(isinstance(c, torch.nn.Module) for c in chunks):
        raise TypeError(
            f"enable_delayed_wgrad needs a torch.nn.Module (a Megatron model, a MoELayer) or a list of "
            f"them (model chunks), got {type(model).__name__}"
        )
    layers = []
    for index, chunk in enumerate(chunks):
        for name, module in chunk.named_modules():
            if isinstance(module, MoELayer):
                prefix = f"chunk{index}." if len(chunks) > 1 else ""
                layers.append((prefix + (name or type(module).__name__), module))
    return layers


def _expert_linears(name: str, layer) -> list[torch.nn.Module]:
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.moe.experts import SequentialMLP

    experts = getattr(layer, "experts", None)
    if not isinstance(experts, SequentialMLP):
        raise TypeError(
            f"enable_delayed_wgrad: {name}.experts is {type(experts).__name__}, not Megatron's SequentialMLP; only "
            "the local (non-Transformer-Engine) experts are supported. With Transformer Engine's grouped experts "
            "(TEGroupedMLP) set delay_wgrad_compute=True and let TE's GroupedLinear defer instead"
        )
    linears = []
    for index, expert in enumerate(experts.local_experts):
        for attr in _LINEARS:
            linear = getattr(expert, attr, None)
            if not isinstance(linear, (ColumnParallelLinear, RowParallelLinear)):
                raise TypeError(
                    f"enable_delayed_wgrad: {name}.experts.local_experts.{index}.{attr} is {type(linear).__name__}, "
                    "expected Megatron's ColumnParallelLinear/RowParallelLinear (the local spec); Transformer "
                    "Engine linears defer through TE's own delay_wgrad_compute"
                )
            linears.append(linear)
    return linears


def _custom_manager(layer):
    manager = getattr(getattr(layer, "token_dispatcher", None), "_comm_manager", None)
    return manager if isinstance(manager, CustomDispatchManager) else None


def enable_delayed_wgrad(model, *, run_wgrad: str = "backward_dw") -> dict[str, ExpertWgradStore]:
    """Defers the weight gradients of every MoE layer's experts in ``model``.

    Not needed with the "custom" backend and ``delay_wgrad_compute=True``: such layers defer
    from the moment they are built (:func:`defer_built_layer`). Call it for
    ``run_wgrad="dispatch_backward"``, or for the "custom" backend without
    ``delay_wgrad_compute``, on every rank after building the model and before its first
    forward (and before wrapping it in Megatron's DDP, so DDP sees ``skip_backward_post_hook``).
    Idempotent: a layer already deferring keeps its store, whose mode changes to ``run_wgrad``
    while it holds no deferred wgrads.

    Args:
        model: a Megatron model, a ``MoELayer``, or a list of model chunks (``torch.nn.Module``).
        run_wgrad: ``"backward_dw"`` (Megatron's ``MoELayer.backward_dw()`` runs them; the
            "custom" dispatch backward runs any it did not) or ``"dispatch_backward"`` (the
            "custom" dispatch backward runs them with its combine in flight). See the module
            docstring.

    Returns:
        ``{layer name: ExpertWgradStore}``, one store per MoE layer (also set as
        ``layer.moe_dispatch_wgrad_store``).

    Raises:
        TypeError: ``model`` is not a module or list of modules; a layer's experts are not
            Megatron's local ``SequentialMLP`` of ``ColumnParallelLinear``/``RowParallelLinear``.
        ValueError: unknown ``run_wgrad``; no MoE layer in ``model``; ``"dispatch_backward"``
            on a layer whose dispatcher is not the "custom" backend; ``"backward_dw"`` on a
            layer that nobody would run the wgrads for (neither the "custom" backend nor
            ``delay_wgrad_compute=True`` with ``overlap_moe_expert_parallel_comm=True``).
        RuntimeError: a layer changing mode still holds deferred wgrads.

    At run time: ``RuntimeError`` from an expert forward when wgrads deferred by an earlier
    backward were never run, or when an expert linear is called with tensor-parallel
    communication or Megatron's own wgrad deferral (not implemented here).
    """
    if run_wgrad not in RUN_WGRAD_MODES:
        raise ValueError(f"run_wgrad must be one of {RUN_WGRAD_MODES}, got {run_wgrad!r}")
    layers = _moe_layers(model)
    if not layers:
        raise ValueError(
            "enable_delayed_wgrad found no Megatron MoELayer in the model: build it with num_moe_experts "
            "set (e.g. get_gpt_layer_local_spec(num_experts=...))"
        )
    plans = []
    for name, layer in layers:  # check every layer before patching any
        linears = _expert_linears(name, layer)
        manager = _custom_manager(layer)
        config = layer.config
        existing = getattr(layer, STORE_ATTR, None)
        if existing is not None and existing.run_wgrad != run_wgrad and len(existing):
            raise RuntimeError(
                f"{name} holds {len(existing)} deferred expert weight gradients (run_wgrad={existing.run_wgrad!r}): "
                f"run layer.backward_dw() before switching to run_wgrad={run_wgrad!r}"
            )
        if run_wgrad == "dispatch_backward" and manager is None:
            raise ValueError(
                f"run_wgrad='dispatch_backward' needs the 'custom' flex dispatcher backend (its dispatch backward runs "
                f"the wgrads), but {name} uses moe_token_dispatcher_type={config.moe_token_dispatcher_type!r}: call "
                "moe_dispatch.megatron.configure(config) before building the model, or use run_wgrad='backward_dw'"
            )
        schedule_calls_dw = bool(
            getattr(config, "delay_wgrad_compute", False) and getattr(config, "overlap_moe_expert_parallel_comm", False)
        )
        if run_wgrad == "backward_dw" and manager is None and not schedule_calls_dw:
            raise ValueError(
                f"{name}'s expert wgrads would never run: its dispatcher is not the 'custom' backend (whose dispatch "
                "backward runs what is left) and Megatron calls MoELayer.backward_dw() only with "
                "delay_wgrad_compute=True and overlap_moe_expert_parallel_comm=True. Set both, or configure the "
                "'custom' backend"
            )
        plans.append((name, layer, linears, manager, existing))

    stores = {}
    for name, layer, linears, manager, existing in plans:
        if existing is not None:
            existing.run_wgrad = run_wgrad
            stores[name] = existing
        else:
            stores[name] = _defer(name, layer, linears, manager, run_wgrad)
    return stores


def _defer(name: str, layer, linears: list, manager, run_wgrad: str) -> ExpertWgradStore:
    """Patches one MoE layer's local expert linears to defer into a new store (see the module
    docstring for what is patched) and returns the store."""
    store = ExpertWgradStore(name, run_wgrad)
    for linear in linears:
        linear._forward_impl = functools.partial(_delayed_forward_impl, linear, store, linear._forward_impl)
        setattr(linear, _HOOKS_ATTR, [])
        linear.register_wgrad_accumulation_and_reduce_hooks = functools.partial(_register_wgrad_hooks, linear)
        linear.weight.skip_backward_post_hook = True
    layer.experts.backward_dw = store.run_for_megatron

    def check_nothing_left(module, args, store=store):
        if len(store) and torch.is_grad_enabled():
            raise RuntimeError(
                f"{store.layer_name}: {len(store)} expert weight gradients deferred by an earlier backward were "
                f"never run (run_wgrad={store.run_wgrad!r}); they would be lost. Megatron runs them through "
                "MoELayer.backward_dw() (combined-1F1B schedule with delay_wgrad_compute=True); the 'custom' "
                "dispatch backward runs them when the dispatch input requires grad. Call "
                "layer.backward_dw() after a hand-written backward"
            )

    setattr(layer.experts, _PRE_HOOK_ATTR, layer.experts.register_forward_pre_hook(check_nothing_left))
    if manager is not None:
        manager.wgrad_store = store
    setattr(layer, STORE_ATTR, store)
    return store


def expert_wgrad_owner(experts) -> str:
    """Who defers the weight gradients of a ``MoELayer``'s ``experts`` under
    ``delay_wgrad_compute=True``: ``"transformer_engine"`` (``TEGroupedMLP``, or a
    ``SequentialMLP`` of Transformer Engine linears: TE's own deferral, run by their
    ``backward_dw``), ``"moe_dispatch"`` (a ``SequentialMLP`` of Megatron's local
    ``ColumnParallelLinear``/``RowParallelLinear``, which compute wgrads at once: this module's
    deferral) or ``"none"`` (anything else, e.g. 0.16's legacy ``GroupedMLP``: wgrads run in the
    normal backward)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.moe.experts import SequentialMLP

    if type(experts).__name__ == "TEGroupedMLP":
        return "transformer_engine"
    if not isinstance(experts, SequentialMLP):
        return "none"
    linears = [getattr(e, attr, None) for e in experts.local_experts for attr in _LINEARS]
    if all(isinstance(lin, (ColumnParallelLinear, RowParallelLinear)) for lin in linears):
        return "moe_dispatch"
    if all(type(lin).__module__.startswith(_TE_EXTENSIONS) for lin in linears):
        return "transformer_engine"
    return "none"


def defer_built_layer(layer) -> ExpertWgradStore | None:
    """Makes a just-built ``MoELayer`` with ``delay_wgrad_compute=True`` defer its expert weight
    gradients to ``MoELayer.backward_dw()`` (run by ``moe_dispatch.megatron.backend.build_moe_layer``
    for the "custom" backend): this module's deferral for Megatron's local experts, nothing where
    Transformer Engine defers (see :func:`expert_wgrad_owner`).

    Returns:
        the layer's store, or None where TE defers.

    Warns:
        UserWarning: experts that nothing defers (their wgrads run in the normal backward).
    """
    owner = expert_wgrad_owner(layer.experts)
    if owner == "transformer_engine":
        return None
    if owner == "none":
        warnings.warn(
            f"delay_wgrad_compute=True defers nothing for experts of type {type(layer.experts).__name__}: their "
            "weight gradients run in the normal backward. Deferring experts are Transformer Engine's (TEGroupedMLP, "
            "or SequentialMLP of TE linears) and Megatron's local SequentialMLP (deferred by moe_dispatch)",
            UserWarning,
            stacklevel=2,
        )
        return None
    name = type(layer).__name__
    return _defer(name, layer, _expert_linears(name, layer), _custom_manager(layer), "backward_dw")


def disable_delayed_wgrad(model) -> int:
    """Undoes :func:`enable_delayed_wgrad` on every MoE layer of ``model``.

    Returns:
        the number of layers restored.

    Raises:
        RuntimeError: a layer still holds deferred wgrads (run ``layer.backward_dw()`` first).
    """
    restored = 0
    for name, layer in _moe_layers(model):
        store = getattr(layer, STORE_ATTR, None)
        if store is None:
            continue
        if len(store):
            raise RuntimeError(
                f"{name} holds {len(store)} deferred expert weight gradients: run layer.backward_dw() "
                "before disable_delayed_wgrad"
            )
        for linear in _expert_linears(name, layer):
            for attr in ("_forward_impl", "register_wgrad_accumulation_and_reduce_hooks", _HOOKS_ATTR):
                linear.__dict__.pop(attr, None)
            linear.weight.__dict__.pop("skip_backward_post_hook", None)
        layer.experts.__dict__.pop("backward_dw", None)
        handle = layer.experts.__dict__.pop(_PRE_HOOK_ATTR, None)
        if handle is not None:
            handle.remove()
        manager = _custom_manager(layer)
        if manager is not None and getattr(manager, "wgrad_store", None) is store:
            manager.wgrad_store = None
        delattr(layer, STORE_ATTR)
        restored += 1
    return restored
