"""Every megatron-core version-specific patch point of the "custom" backend, in one place.

Megatron-Core has no backend registry, so :func:`install` wraps, for the installed version:

- ``MoEFlexTokenDispatcher.__init__`` (``transformer/moe/token_dispatcher.py``): builds a
  :class:`~moe_dispatch.megatron.manager.CustomDispatchManager` when
  ``config.moe_flex_dispatcher_backend == "custom"``, else runs Megatron's own code.
- ``should_free_input`` (0.19: ``models/common/utils.py``): the EP-overlap schedule frees
  node inputs after forward; for "custom" the dispatch inputs are kept (they are a view of
  the layernorm output the router saved, as for deepep/hybridep), and the expert inputs too
  when the permute is fused into dispatch (the experts save them, as for hybridep).
- ``build_transformer_layer_callables`` (``models/gpt/fine_grained_callables.py``, re-bound
  in ``models/common/fine_grained_callables.py``): the schedule's dispatch node sets
  ``_comm_manager.token_probs`` and its expert node ``_comm_manager.dispatched_probs`` to
  the detached node inputs, and keeps ``tokens_per_expert`` referenced, as Megatron hard-codes
  for deepep/hybridep/ncclep.
- Megatron-Bridge, when installed: ``apply_flex_dispatcher_backend(model_config, "custom")``
  and ``validate_flex_dispatcher_backend`` (``megatron/bridge/training/flex_dispatcher_backend.py``).

To support another megatron-core minor version, add an entry to ``_PATCH_POINTS`` naming where
those functions live there (0.16-0.18 keep ``should_free_input`` in
``models/gpt/fine_grained_callables.py``) and run ``python_tests/test_megatron.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import inspect
import logging
import sys

logger = logging.getLogger(__name__)

_PATCHED_FLAG = "_moe_dispatch_patched"


class UnsupportedMegatronVersionError(RuntimeError):
    """The installed megatron-core is a version whose patch points are not known here."""


@dataclasses.dataclass(frozen=True)
class PatchPoints:
    """Where one megatron-core minor version keeps the functions :func:`install` wraps.

    Attributes:
        dispatcher_module: module of ``MoEFlexTokenDispatcher`` / ``MoETokenDispatcher``.
        free_input_module: module whose global ``should_free_input`` the schedule calls.
        callables_module: module defining ``build_transformer_layer_callables``.
        callables_importers: modules that import that builder by name (re-bound too).
        dispatcher_init_params: expected parameters of ``MoEFlexTokenDispatcher.__init__``.
    """

    dispatcher_module: str
    free_input_module: str
    callables_module: str
    callables_importers: tuple[str, ...]
    dispatcher_init_params: tuple[str, ...] = ("self", "num_local_experts", "local_expert_indices", "config",
                                               "pg_collection")


_PATCH_POINTS: dict[tuple[int, int], PatchPoints] = {
    (0, 19): PatchPoints(
        dispatcher_module="megatron.core.transformer.moe.token_dispatcher",
        free_input_module="megatron.core.models.common.utils",
        callables_module="megatron.core.models.gpt.fine_grained_callables",
        callables_importers=("megatron.core.models.common.fine_grained_callables",),
    ),
}

_BRIDGE_MODULE = "megatron.bridge.training.flex_dispatcher_backend"


def megatron_core_version() -> tuple[int, int, int]:
    """``(major, minor, patch)`` of the installed megatron-core."""
    from megatron.core import package_info

    return int(package_info.MAJOR), int(package_info.MINOR), int(package_info.PATCH)


def patch_points(version: tuple[int, int, int] | None = None) -> PatchPoints:
    """The :class:`PatchPoints` of ``version`` (default: the installed one).

    Raises:
        UnsupportedMegatronVersionError: no entry for that minor version.
    """
    version = version or megatron_core_version()
    points = _PATCH_POINTS.get(tuple(version[:2]))
    if points is None:
        supported = ", ".join(f"{a}.{b}.x" for a, b in sorted(_PATCH_POINTS))
        raise UnsupportedMegatronVersionError(
            f"moe_dispatch.megatron supports megatron-core {supported} (tested: 0.19.2), found "
            f"{'.'.join(map(str, version))}. Install a supported version (pip install 'moe-dispatch[megatron]' "
            "pins one), or add this version's patch points to _PATCH_POINTS in moe_dispatch/megatron/compat.py")
    return points


def _wrap(owner, name: str, make_wrapper) -> None:
    """Replaces ``owner.name`` by ``make_wrapper(original)`` once (idempotent)."""
    original = getattr(owner, name)
    if getattr(original, _PATCHED_FLAG, False):
        return
    wrapper = make_wrapper(original)
    functools.update_wrapper(wrapper, original)
    setattr(wrapper, _PATCHED_FLAG, True)
    wrapper.__wrapped_original__ = original
    setattr(owner, name, wrapper)


def _missing(version, what: str) -> UnsupportedMegatronVersionError:
    return UnsupportedMegatronVersionError(
        f"megatron-core {'.'.join(map(str, version))} has no {what}, which moe_dispatch.megatron patches for the "
        "'custom' backend; update the version's entry in moe_dispatch/megatron/compat.py")


def _patch_dispatcher(points: PatchPoints, version) -> None:
    from .config import BACKEND_NAME
    from .manager import CustomDispatchManager

    module = importlib.import_module(points.dispatcher_module)
    flex = getattr(module, "MoEFlexTokenDispatcher", None)
    base = getattr(module, "MoETokenDispatcher", None)
    if flex is None or base is None:
        raise _missing(version, f"{points.dispatcher_module}.MoEFlexTokenDispatcher")
    params = tuple(inspect.signature(getattr(flex.__init__, "__wrapped_original__", flex.__init__)).parameters)
    if params != points.dispatcher_init_params:
        raise _missing(version, f"MoEFlexTokenDispatcher.__init__{points.dispatcher_init_params} (found {params})")

    def make(original):
        def __init__(self, num_local_experts, local_expert_indices, config, pg_collection=None):
            if getattr(config, "moe_flex_dispatcher_backend", None) != BACKEND_NAME:
                return original(self, num_local_experts, local_expert_indices, config=config,
                                pg_collection=pg_collection)
            base.__init__(self, config=config, pg_collection=pg_collection)
            self.num_local_experts = num_local_experts
            self.local_expert_indices = local_expert_indices
            self._comm_manager = CustomDispatchManager(
                group=self.tp_ep_group, num_local_experts=num_local_experts,
                router_topk=self.tp_size * config.moe_router_topk,
                num_experts=self.tp_size * config.num_moe_experts, config=config)
            self.cudagraph_attrs = ["_comm_manager.token_probs", "_comm_manager.token_indices"]
            return None

        return __init__

    _wrap(flex, "__init__", make)


def _patch_free_input(points: PatchPoints, version) -> None:
    from .config import is_custom_backend, resolve_fuse_permute

    module = importlib.import_module(points.free_input_module)
    if not callable(getattr(module, "should_free_input", None)):
        raise _missing(version, f"{points.free_input_module}.should_free_input")

    def make(original):
        def should_free_input(name, is_moe, config, num_local_experts):
            free = original(name, is_moe, config, num_local_experts)
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

    _wrap(module, "should_free_input", make)


def _patch_callables(points: PatchPoints, version) -> None:
    from .config import is_custom_backend

    module = importlib.import_module(points.callables_module)
    if not callable(getattr(module, "build_transformer_layer_callables", None)):
        raise _missing(version, f"{points.callables_module}.build_transformer_layer_callables")

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

    _wrap(module, "build_transformer_layer_callables", make)
    patched = module.build_transformer_layer_callables
    for name in points.callables_importers:
        importer = importlib.import_module(name)
        if getattr(importer, "build_transformer_layer_callables", None) is patched.__wrapped_original__:
            importer.build_transformer_layer_callables = patched


def _bridge_installed() -> bool:
    try:
        return importlib.util.find_spec(_BRIDGE_MODULE) is not None
    except (ImportError, ValueError):
        return False


def patch_bridge() -> bool:
    """Teaches Megatron-Bridge's flex-backend helpers the name "custom" (when Bridge is importable).

    ``apply_flex_dispatcher_backend(model_config, "custom")`` sets flex + custom +
    ``moe_shared_expert_overlap=False`` (no GPU-architecture gate: the backend runs anywhere
    torch.distributed does; a config without experts is left alone with a warning, as Bridge
    does); ``validate_flex_dispatcher_backend`` runs ``validate_config`` for "custom". Modules
    that imported the helpers by name before this call are re-bound.

    Returns:
        True when Bridge was found and patched.
    """
    if _BRIDGE_MODULE not in sys.modules and not _bridge_installed():
        return False
    from .config import BACKEND_NAME, OPTIONS_ATTR, CustomBackendOptions, validate_config

    module = importlib.import_module(_BRIDGE_MODULE)
    originals = {}

    def make_apply(original):
        originals["apply_flex_dispatcher_backend"] = original

        def apply_flex_dispatcher_backend(model_config, moe_flex_dispatcher_backend=None, *args, **kwargs):
            if moe_flex_dispatcher_backend != BACKEND_NAME:
                return original(model_config, moe_flex_dispatcher_backend, *args, **kwargs)
            if not getattr(model_config, "num_moe_experts", None):
                logger.warning("the 'custom' flex dispatcher backend applies only to MoE models: num_moe_experts is "
                               "not set; leaving the dispatcher unchanged")
                return None
            model_config.moe_token_dispatcher_type = "flex"
            model_config.moe_flex_dispatcher_backend = BACKEND_NAME
            model_config.moe_shared_expert_overlap = False
            if getattr(model_config, OPTIONS_ATTR, None) is None:
                setattr(model_config, OPTIONS_ATTR, CustomBackendOptions())
            return None

        return apply_flex_dispatcher_backend

    def make_validate(original):
        originals["validate_flex_dispatcher_backend"] = original

        def validate_flex_dispatcher_backend(model_config, *args, **kwargs):
            if getattr(model_config, "moe_flex_dispatcher_backend", None) == BACKEND_NAME:
                return validate_config(model_config)
            return original(model_config, *args, **kwargs)

        return validate_flex_dispatcher_backend

    for name, make in (("apply_flex_dispatcher_backend", make_apply),
                       ("validate_flex_dispatcher_backend", make_validate)):
        if callable(getattr(module, name, None)):
            original = getattr(module, name)
            _wrap(module, name, make)
            _rebind(original, getattr(module, name), prefix="megatron.bridge")
    return True


def _rebind(old, new, *, prefix: str) -> None:
    """Points every already-imported ``prefix*`` module attribute bound to ``old`` at ``new``."""
    for name, mod in list(sys.modules.items()):
        if mod is None or not name.startswith(prefix):
            continue
        for attr, value in list(vars(mod).items()):
            if value is old:
                setattr(mod, attr, new)


_INSTALLED = False


def install() -> None:
    """Makes ``moe_flex_dispatcher_backend="custom"`` build this package's manager (idempotent).

    Run by ``import moe_dispatch.megatron``. Patches, for the installed megatron-core (see the
    module docstring): the flex dispatcher's constructor, the EP-overlap schedule's
    ``should_free_input`` and layer callables, and Megatron-Bridge's helpers when installed.

    Raises:
        UnsupportedMegatronVersionError: a megatron-core version without patch points here, or
            one whose patched functions moved (the message names the function).
    """
    global _INSTALLED
    if not _INSTALLED:
        version = megatron_core_version()
        points = patch_points(version)
        _patch_dispatcher(points, version)
        _patch_free_input(points, version)
        _patch_callables(points, version)
        _INSTALLED = True
    try:  # Bridge may have been installed or imported since the last call
        patch_bridge()
    except Exception as err:  # noqa: BLE001 - Bridge is optional: never block the Megatron-Core backend
        logger.warning("Megatron-Bridge is installed but could not be patched for the 'custom' backend (%s: %s); "
                       "use moe_dispatch.megatron.configure(config) instead of apply_flex_dispatcher_backend",
                       type(err).__name__, err)


def installed() -> bool:
    """Whether :func:`install` has run in this process."""
    return _INSTALLED
