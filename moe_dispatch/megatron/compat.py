"""Every megatron-core version-specific patch point of the "custom" backend, in one place.

Megatron-Core has no backend registry, so :func:`install` wraps, for the installed version:

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

Supported: megatron-core 0.16.x (tested 0.16.1, the newest release for Python 3.11), 0.19.x
(tested 0.19.2) and 0.20.x (Megatron-LM main, below). What 0.16 does differently, each handled
by one field of its :class:`PatchPoints` entry:

- ``should_free_input(name, is_moe, config)`` lives in ``models/gpt/fine_grained_callables.py``
  and has no ``num_local_experts`` parameter (``free_input_module``, ``free_input_params``).
- ``build_transformer_layer_callables`` is called only inside its own module: nothing to
  re-bind (``callables_importers``).
- ``MoEFlexTokenDispatcher`` has no ``check_over_budget()`` / ``reset_over_budget()``; they
  are added with 0.19's behaviour (read / clear ``_comm_manager.over_budget`` when the manager
  has one), so the "custom" backend's static-budget overflow flag is read the same way on both
  (``dispatcher_has_over_budget``).
- ``tensor_parallel.RowParallelLinear`` has no ``backward_dw()`` (``ColumnParallelLinear`` and
  0.19's both have it, a no-op: Megatron's own linears compute wgrads at once), yet the
  EP-overlap schedule with ``delay_wgrad_compute=True`` calls it on the attention projection
  and the experts' ``linear_fc2`` of the local (non-Transformer-Engine) spec: an
  AttributeError, for every dispatcher. The same no-op is added
  (``row_parallel_has_backward_dw``), so ``delay_wgrad_compute`` and
  ``enable_delayed_wgrad`` work without TE as on 0.19.
- ``TransformerConfig`` has no ``moe_flex_dispatcher_num_sms`` (only the per-backend
  ``moe_deepep_num_sms`` / ``moe_hybridep_num_sms``): ``configure(num_sms=)`` keeps the SM
  budget in the backend's own attribute ``moe_dispatch_num_sms`` (``num_sms_field``).
- ``get_align_size_for_quantization(config)`` answers 16 for an unquantized config too (0.19:
  0, or 256 with the TE op fuser); 0.16's HybridEP consults it only under fp8/fp4, and so does
  the "custom" backend's default ``pad_multiple`` (``align_size_needs_quantization``).
- ``TransformerConfig`` has no ``moe_expert_rank_capacity_factor`` (HybridEP's static budget):
  ``configure()`` given it names the version and points at the backend's own
  ``expert_rank_capacity_factor=`` (``missing_config_fields``).

Megatron-LM main (package_info 0.20.0, not released; checked by hand at one commit, see
``docs/megatron-main.md``) keeps 0.19's patch points. What it changes is met by the manager
and ``validate_config``, not here: its flex dispatcher's over-budget replay hooks
(``check_required_capacity`` / ``grow_ep_recv_capacity``, and the runner's clearing of
``_comm_manager.moe_expert_rank_capacity_factor``) read the manager's ``required_recv``,
``grow_recv_capacity`` and ``moe_expert_rank_capacity_factor``; ``moe_ncclep_static_shape`` is
gone (the rank capacity factor alone selects static shapes, which the backend already gives
the experts); ``moe_dispatch_fwd_dtype`` / ``moe_combine_bwd_dtype`` are refused for "custom".

To support another megatron-core minor version, add an entry to ``_PATCH_POINTS`` naming where
those functions live there (0.16-0.18 keep ``should_free_input`` in
``models/gpt/fine_grained_callables.py``), install that version next to this package and run
``python_tests/test_megatron*.py`` (``make test-compat`` does so for 0.16.1).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import logging
import sys

from .. import _autoload
from ..errors import UnsupportedMegatronVersionError

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PatchPoints:
    """Where one megatron-core minor version keeps the functions :func:`install` wraps.

    Attributes:
        dispatcher_module: module of ``MoEFlexTokenDispatcher`` / ``MoETokenDispatcher``.
        free_input_module: module whose global ``should_free_input`` the schedule calls.
        callables_module: module defining ``build_transformer_layer_callables``.
        callables_importers: modules that import that builder by name (re-bound too).
        free_input_params: expected parameters of ``should_free_input``.
        dispatcher_init_params: expected parameters of ``MoEFlexTokenDispatcher.__init__``.
        dispatcher_has_over_budget: ``MoEFlexTokenDispatcher`` has ``check_over_budget`` /
            ``reset_over_budget`` (else :func:`install` adds them).
        num_sms_field: the ``TransformerConfig`` field of the flex dispatcher's SM budget, or
            None when the version has none (the budget then lives in ``NUM_SMS_ATTR``).
        missing_config_fields: ``(field, fix)`` pairs: ``TransformerConfig`` fields of other
            supported versions that this one lacks, with what to use instead.
        align_size_needs_quantization: ``get_align_size_for_quantization`` is the expert-row
            alignment only under fp8/fp4 (else no alignment is needed, whatever it answers).
        row_parallel_has_backward_dw: ``RowParallelLinear`` has ``backward_dw`` (else
            :func:`install` adds 0.19's no-op).
    """

    dispatcher_module: str
    free_input_module: str
    callables_module: str
    callables_importers: tuple[str, ...]
    free_input_params: tuple[str, ...] = ("name", "is_moe", "config", "num_local_experts")
    dispatcher_init_params: tuple[str, ...] = (
        "self",
        "num_local_experts",
        "local_expert_indices",
        "config",
        "pg_collection",
    )
    dispatcher_has_over_budget: bool = True
    num_sms_field: str | None = "moe_flex_dispatcher_num_sms"
    missing_config_fields: tuple[tuple[str, str], ...] = ()
    align_size_needs_quantization: bool = False
    row_parallel_has_backward_dw: bool = True


# The backend's own home of the SM budget where Megatron has no backend-neutral field for it.
NUM_SMS_ATTR = "moe_dispatch_num_sms"

_PATCH_POINTS: dict[tuple[int, int], PatchPoints] = {
    (0, 16): PatchPoints(
        dispatcher_module="megatron.core.transformer.moe.token_dispatcher",
        # 0.16: should_free_input(name, is_moe, config) in the GPT callables module (0.19 moved it to
        # models/common/utils.py and added num_local_experts)
        free_input_module="megatron.core.models.gpt.fine_grained_callables",
        free_input_params=("name", "is_moe", "config"),
        callables_module="megatron.core.models.gpt.fine_grained_callables",
        # 0.16: build_transformer_layer_callables is only called inside its own module (0.19 re-exports it
        # from models/common/fine_grained_callables.py)
        callables_importers=(),
        # 0.16: the flex dispatcher has no check_over_budget()/reset_over_budget() (0.19 added them with
        # HybridEP's static budget)
        dispatcher_has_over_budget=False,
        # 0.16: only per-backend moe_deepep_num_sms / moe_hybridep_num_sms (0.19 unified them into
        # moe_flex_dispatcher_num_sms)
        num_sms_field=None,
        # 0.16: no HybridEP static budget (0.19 added moe_expert_rank_capacity_factor) and no unified SM budget
        missing_config_fields=(
            (
                "moe_expert_rank_capacity_factor",
                "the 'custom' backend's own static budget works on every version: "
                "configure(config, expert_rank_capacity_factor=...)",
            ),
            ("moe_flex_dispatcher_num_sms", "pass configure(config, num_sms=...)"),
        ),
        # 0.16: get_align_size_for_quantization returns 16 without fp8/fp4 as well (its router padding size;
        # 0.16's HybridEP pads only under fp8/fp4); 0.19 returns 0 there
        align_size_needs_quantization=True,
        # 0.16: RowParallelLinear lacks the no-op backward_dw that ColumnParallelLinear has (0.19: both), which
        # the EP-overlap schedule calls under delay_wgrad_compute on the local spec's linears
        row_parallel_has_backward_dw=False,
    ),
    (0, 19): PatchPoints(
        dispatcher_module="megatron.core.transformer.moe.token_dispatcher",
        free_input_module="megatron.core.models.common.utils",
        callables_module="megatron.core.models.gpt.fine_grained_callables",
        callables_importers=("megatron.core.models.common.fine_grained_callables",),
    ),
    # Megatron-LM main (package_info 0.20.0, not on PyPI yet): 0.19's places (its changes: module docstring)
    (0, 20): PatchPoints(
        dispatcher_module="megatron.core.transformer.moe.token_dispatcher",
        free_input_module="megatron.core.models.common.utils",
        callables_module="megatron.core.models.gpt.fine_grained_callables",
        callables_importers=("megatron.core.models.common.fine_grained_callables",),
    ),
}

TESTED_VERSIONS = "0.16.1, 0.19.2, 0.20.0.dev main@d98e8a6 by hand"


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
            f"moe_dispatch.megatron supports megatron-core {supported} (tested: {TESTED_VERSIONS}), found "
            f"{'.'.join(map(str, version))}. Install a supported version (pip install 'moe-dispatch[megatron]' "
            "pins one), or add this version's patch points to _PATCH_POINTS in moe_dispatch/megatron/compat.py"
        )
    return points


def version_string(version: tuple[int, int, int] | None = None) -> str:
    """``"0.16.1"``: ``version`` (default: the installed megatron-core) as text."""
    return ".".join(map(str, version or megatron_core_version()))


def num_sms_attr(version: tuple[int, int, int] | None = None) -> str:
    """Attribute of a ``TransformerConfig`` holding the flex dispatcher's SM budget in
    ``version`` (default: the installed one): Megatron's field where it has one, else
    :data:`NUM_SMS_ATTR`."""
    return patch_points(version).num_sms_field or NUM_SMS_ATTR


def missing_config_field(name: str, version: tuple[int, int, int] | None = None) -> str | None:
    """What to use instead of ``TransformerConfig`` field ``name`` when ``version`` (default:
    the installed one) lacks it but another supported version has it; None otherwise."""
    return dict(patch_points(version).missing_config_fields).get(name)


def quantization_align_size(config) -> int:
    """Rows of each expert block must be a multiple of this for ``config``'s expert GEMMs (0 or
    1: no alignment): Megatron's ``get_align_size_for_quantization`` where it means that (see
    ``PatchPoints.align_size_needs_quantization``)."""
    from megatron.core.transformer.moe.moe_utils import get_align_size_for_quantization

    if patch_points().align_size_needs_quantization and not (
        getattr(config, "fp8", None) or getattr(config, "fp4", None)
    ):
        return 0
    return int(get_align_size_for_quantization(config))


def _missing(version, what: str) -> UnsupportedMegatronVersionError:
    return UnsupportedMegatronVersionError(
        f"megatron-core {'.'.join(map(str, version))} has no {what}, which moe_dispatch.megatron patches for the "
        "'custom' backend; update the version's entry in moe_dispatch/megatron/compat.py"
    )


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
    from .config import is_custom_backend, resolve_fuse_permute

    module = importlib.import_module(points.free_input_module)
    function = getattr(module, "should_free_input", None)
    if not callable(function):
        raise _missing(version, f"{points.free_input_module}.should_free_input")
    params = tuple(inspect.signature(getattr(function, "__wrapped_original__", function)).parameters)
    if params != points.free_input_params:
        raise _missing(version, f"should_free_input{points.free_input_params} (found {params})")

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
    from .config import validate_config
    from .delayed_wgrad import defer_built_layer

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
    from .config import BACKEND_NAME, OPTIONS_ATTR, CustomBackendOptions

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
    from .config import validate_config

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
