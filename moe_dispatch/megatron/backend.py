"""Registers the flex dispatcher backend "custom" with Megatron-Core and Megatron-Bridge.

Megatron-Core has no backend registry, so :func:`install` wraps, for the installed version (the
places: :mod:`moe_dispatch.megatron.compat`):

- ``MoEFlexTokenDispatcher.__init__`` (``transformer/moe/token_dispatcher.py``): builds a
  :class:`~moe_dispatch.megatron.manager.CustomDispatchManager` when
  ``config.moe_flex_dispatcher_backend == "custom"``, else runs Megatron's own code.
- ``should_free_input`` (0.19: ``models/common/utils.py``; 0.16: ``models/gpt/fine_grained_callables.py``):
  the EP-overlap schedule frees node inputs after forward; for "custom" the dispatch inputs are
  kept (they are a view of the layernorm output the router saved, as for deepep/hybridep), and
  the expert inputs too when the permute is fused into dispatch (the experts save them, as for
  hybridep).
- ``build_transformer_layer_callables`` (``models/gpt/fine_grained_callables.py``; 0.19 re-binds
  it in ``models/common/fine_grained_callables.py``): the schedule's dispatch node sets
  ``_comm_manager.token_probs`` and its expert node ``_comm_manager.dispatched_probs`` to
  the detached node inputs, and keeps ``tokens_per_expert`` referenced, as Megatron hard-codes
  for deepep/hybridep/ncclep.
- ``MoELayer.__init__`` and Megatron-Bridge's ``apply_flex_dispatcher_backend(model_config,
  "custom")`` / ``validate_flex_dispatcher_backend``, through the import hook of
  ``moe_dispatch._autoload`` (which also runs at interpreter start-up, so neither needs an
  explicit import of this package): a "custom" layer is built by :func:`build_moe_layer`
  (config checks, delayed expert wgrads), Bridge's helpers run :func:`bridge_apply` /
  :func:`bridge_validate` for "custom". Importing ``moe_dispatch.megatron`` never imports
  Bridge, whose package imports every model conversion bridge.
- Where the version lacks them: the flex dispatcher's over-budget methods and
  ``RowParallelLinear.backward_dw`` (0.19's behaviour).

The top of ``moe_dispatch.megatron``'s import order: it imports the modules it registers, none
of them imports it.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import sys

from .. import _autoload
from .compat import PatchPoints, megatron_core_version, missing_patch_point, patch_points
from .config import (
    BACKEND_NAME,
    OPTIONS_ATTR,
    CustomBackendOptions,
    is_custom_backend,
    resolve_fuse_permute,
    validate_config,
)
from .delayed_wgrad import defer_built_layer
from .manager import CustomDispatchManager

logger = logging.getLogger(__name__)


def _patch_dispatcher(points: PatchPoints, version) -> None:
    module = importlib.import_module(points.dispatcher_module)
    flex = getattr(module, "MoEFlexTokenDispatcher", None)
    base = getattr(module, "MoETokenDispatcher", None)
    if flex is None or base is None:
        raise missing_patch_point(version, f"{points.dispatcher_module}.MoEFlexTokenDispatcher")
    params = tuple(inspect.signature(getattr(flex.__init__, "__wrapped_original__", flex.__init__)).parameters)
    if params != points.dispatcher_init_params:
        raise missing_patch_point(
            version, f"MoEFlexTokenDispatcher.__init__{points.dispatcher_init_params} (found {params})"
        )

    def make(original):
        def __init__(self, num_local_experts, local_expert_indices, config, pg_collection=None):
            if getattr(config, "moe_flex_dispatcher_backend", None) != BACKEND_NAME:
                return original(
                    self, num_local_experts, local_expert_indices, config=config, pg_collection=pg_collection
                )
            base.__init__(self, config=config, pg_collection=pg_collection)
            self.num_local_experts = num_local_experts
            self.local_expert_indices = local_expert_indices
            self._comm_manager = CustomDispatchManager(
                group=self.tp_ep_group,
                num_local_experts=num_local_experts,
                router_topk=self.tp_size * config.moe_router_topk,
                num_experts=self.tp_size * config.num_moe_experts,
                config=config,
            )
            self.cudagraph_attrs = ["_comm_manager.token_probs", "_comm_manager.token_indices"]
            return None

        return __init__

    _autoload.wrap(flex, "__init__", make)
    if not points.dispatcher_has_over_budget:
        _add_over_budget_api(flex)


def _patch_row_parallel_backward_dw(points: PatchPoints) -> None:
    if points.row_parallel_has_backward_dw:
        return
    from megatron.core.tensor_parallel import layers

    if callable(getattr(layers.RowParallelLinear, "backward_dw", None)):
        return

    def backward_dw(self) -> None:
        """Weight gradients deferred by ``delay_wgrad_compute``: none here (this linear computes
        them in its backward), so nothing to do (added by moe_dispatch.megatron, as 0.19 has it)."""

    setattr(backward_dw, _autoload.PATCHED_FLAG, True)
    backward_dw.__qualname__ = "RowParallelLinear.backward_dw"
    layers.RowParallelLinear.backward_dw = backward_dw


def _add_over_budget_api(flex) -> None:
    """Gives a flex dispatcher class without them 0.19's ``check_over_budget`` (the manager's
    accumulated ``[1]`` bool overflow flag, or None when its manager keeps none) and
    ``reset_over_budget`` (clears that flag)."""

    def check_over_budget(self):
        """The communication manager's accumulated over-budget flag (``[1]`` bool), or None."""
        return getattr(self._comm_manager, "over_budget", None)

    def reset_over_budget(self):
        """Clears the communication manager's accumulated over-budget flag (if it keeps one)."""
        flag = getattr(self._comm_manager, "over_budget", None)
        if flag is not None:
            flag.fill_(0)

    for fn in (check_over_budget, reset_over_budget):
        if not hasattr(flex, fn.__name__):
            setattr(fn, _autoload.PATCHED_FLAG, True)
            fn.__qualname__ = f"{flex.__name__}.{fn.__name__}"
            setattr(flex, fn.__name__, fn)


def _patch_free_input(points: PatchPoints, version) -> None:
    module = importlib.import_module(points.free_input_module)
    function = getattr(module, "should_free_input", None)
    if not callable(function):
        raise missing_patch_point(version, f"{points.free_input_module}.should_free_input")
    params = tuple(inspect.signature(getattr(function, "__wrapped_original__", function)).parameters)
    if params != points.free_input_params:
        raise missing_patch_point(version, f"should_free_input{points.free_input_params} (found {params})")

    def make(original):
        def should_free_input(name, is_moe, config, *rest):  # rest: 0.19's num_local_experts
            free = original(name, is_moe, config, *rest)
            if not (is_moe and is_custom_backend(config)):
                return free
            if name == "moe_dispatch":
                # the flex dispatcher's input is a view of the pre-MLP layernorm output, which the
                # router saved for its backward (Megatron keeps it for deepep/hybridep too)
                return False
            if name == "mlp" and resolve_fuse_permute(config):
                # fused: dispatch hands the permuted rows straight to the experts, which save them
                return False
            return free

        return should_free_input

    _autoload.wrap(module, "should_free_input", make)


def _patch_callables(points: PatchPoints, version) -> None:
    module = importlib.import_module(points.callables_module)
    if not callable(getattr(module, "build_transformer_layer_callables", None)):
        raise missing_patch_point(version, f"{points.callables_module}.build_transformer_layer_callables")

    def make(original):
        def build_transformer_layer_callables(layer):
            forward_funcs, backward_dw = original(layer)
            dispatcher = getattr(getattr(layer, "mlp", None), "token_dispatcher", None)
            if dispatcher is None or not is_custom_backend(layer.config) or forward_funcs[1] is None:
                return forward_funcs, backward_dw
            dispatch_func, experts_func = forward_funcs[1], forward_funcs[2]

            def dispatch_forward(node, local_tokens, probs):
                # the detached node input replaces the routing probs (keeps graphs per node)
                dispatcher._comm_manager.token_probs = probs
                return dispatch_func(node, local_tokens, probs)

            def experts_forward(node, dispatched_tokens):
                dispatcher._comm_manager.dispatched_probs = node.layer_state.dispatched_probs
                output = experts_func(node, dispatched_tokens)
                # made on the communication stream: keep it referenced until the layer is done
                node.layer_state.tokens_per_expert = dispatcher._comm_manager.get_number_of_tokens_per_expert()
                return output

            forward_funcs = list(forward_funcs)
            forward_funcs[1], forward_funcs[2] = dispatch_forward, experts_forward
            return forward_funcs, backward_dw

        return build_transformer_layer_callables

    _autoload.wrap(module, "build_transformer_layer_callables", make)
    patched = module.build_transformer_layer_callables
    for name in points.callables_importers:
        importer = importlib.import_module(name)
        if getattr(importer, "build_transformer_layer_callables", None) is patched.__wrapped_original__:
            importer.build_transformer_layer_callables = patched


def build_moe_layer(original_init, layer, args: tuple, kwargs: dict) -> None:
    """Builds a ``MoELayer`` whose config names the "custom" backend (called by the wrapped
    ``MoELayer.__init__``, see ``moe_dispatch._autoload``): checks the config (a "custom" backend
    with another dispatcher type raises here, where Megatron would silently build that one), runs
    Megatron's constructor, then, with ``delay_wgrad_compute=True``, makes the experts defer their
    weight gradients to ``MoELayer.backward_dw()``
    (:func:`moe_dispatch.megatron.delayed_wgrad.defer_built_layer`).

    Raises:
        ValueError: from ``validate_config``.
    """
    validate_config(layer_config(args, kwargs))
    original_init(layer, *args, **kwargs)
    if getattr(layer.config, "delay_wgrad_compute", False):
        defer_built_layer(layer)


def layer_config(args: tuple, kwargs: dict):
    """The ``config`` argument of a ``MoELayer.__init__(config, ...)`` call."""
    return kwargs["config"] if "config" in kwargs else args[0]


def bridge_apply(model_config) -> None:
    """Megatron-Bridge's ``apply_flex_dispatcher_backend(model_config, "custom")``: flex + "custom"
    + ``moe_shared_expert_overlap=False`` (as Bridge does for its backends; no GPU-architecture
    gate: the backend runs anywhere torch.distributed does). A config without experts is left
    alone with a warning, as Bridge does."""
    if not getattr(model_config, "num_moe_experts", None):
        logger.warning(
            "the 'custom' flex dispatcher backend applies only to MoE models: num_moe_experts is not set; leaving "
            "the dispatcher unchanged"
        )
        return
    model_config.moe_token_dispatcher_type = "flex"
    model_config.moe_flex_dispatcher_backend = BACKEND_NAME
    model_config.moe_shared_expert_overlap = False
    if getattr(model_config, OPTIONS_ATTR, None) is None:
        setattr(model_config, OPTIONS_ATTR, CustomBackendOptions())


def bridge_validate(model_config) -> None:
    """Megatron-Bridge's ``validate_flex_dispatcher_backend`` for "custom": ``validate_config``.

    Raises:
        ValueError: from ``validate_config``.
    """
    validate_config(model_config)


def patch_bridge() -> bool:
    """Wraps Megatron-Bridge's flex-backend helpers for "custom" now, if Bridge's module
    ``megatron.bridge.training.flex_dispatcher_backend`` is imported (the import hook of
    ``moe_dispatch._autoload`` does it by itself when the module is imported). Idempotent.

    Returns:
        True when Bridge's module is imported (and patched), False when it is not.
    """
    _autoload.install()
    return sys.modules.get(_autoload.BRIDGE_MODULE) is not None


_INSTALLED = False


def install() -> None:
    """Makes ``moe_flex_dispatcher_backend="custom"`` build this package's manager (idempotent).

    Run by ``import moe_dispatch.megatron`` (and so, through ``moe_dispatch._autoload``, by the
    first ``MoELayer`` or Bridge helper call that names "custom"). Patches, for the installed
    megatron-core (see the module docstring): the flex dispatcher's constructor, the EP-overlap
    schedule's ``should_free_input`` and layer callables, ``MoELayer.__init__`` and
    Megatron-Bridge's helpers (through ``moe_dispatch._autoload``: now if their modules are
    imported, else when they are); on versions that lack them, adds the flex dispatcher's
    over-budget methods and ``RowParallelLinear.backward_dw`` (0.19's behaviour).

    Raises:
        UnsupportedMegatronVersionError: a megatron-core version without patch points here, or
            one whose patched functions moved (the message names the function).
    """
    global _INSTALLED
    _autoload.install()
    if _INSTALLED:
        return
    version = megatron_core_version()
    points = patch_points(version)
    _patch_dispatcher(points, version)
    _patch_free_input(points, version)
    _patch_callables(points, version)
    _patch_row_parallel_backward_dw(points)
    importlib.import_module(_autoload.MOE_LAYER_MODULE)  # the hook wraps MoELayer.__init__ as it loads
    _INSTALLED = True


def installed() -> bool:
    """Whether :func:`install` has run in this process."""
    return _INSTALLED
