"""Where the megatron-core versions differ for the "custom" backend, in one place: the version
table (:class:`PatchPoints` per minor version) and the answers that depend on it.

The bottom of ``moe_dispatch.megatron``'s import order (``compat`` <- ``config`` <- ``manager``
<- ``delayed_wgrad`` <- ``backend``; no module imports one above it): it reads the table,
:mod:`moe_dispatch.megatron.backend` applies it (``install``).

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
and ``validate_config``, not by a patch: its flex dispatcher's over-budget replay hooks
(``check_required_capacity`` / ``grow_ep_recv_capacity``, and the runner's clearing of
``_comm_manager.moe_expert_rank_capacity_factor``) read the manager's ``required_recv``,
``grow_recv_capacity`` and ``moe_expert_rank_capacity_factor``; ``moe_ncclep_static_shape`` is
gone (the rank capacity factor alone selects static shapes, which the backend already gives
the experts); ``moe_dispatch_fwd_dtype`` / ``moe_combine_bwd_dtype`` are refused for "custom".

To support another megatron-core minor version, add an entry to ``_PATCH_POINTS`` naming where
the patched functions live there (0.16-0.18 keep ``should_free_input`` in
``models/gpt/fine_grained_callables.py``), install that version next to this package and run
``python_tests/test_megatron*.py`` (``make test-compat`` does so for 0.16.1).
"""

from __future__ import annotations

import dataclasses

from ..errors import UnsupportedMegatronVersionError


@dataclasses.dataclass(frozen=True)
class PatchPoints:
    """Where one megatron-core minor version keeps the functions
    :func:`moe_dispatch.megatron.backend.install` wraps.

    Attributes:
        dispatcher_module: module of ``MoEFlexTokenDispatcher`` / ``MoETokenDispatcher``.
        free_input_module: module whose global ``should_free_input`` the schedule calls.
        callables_module: module defining ``build_transformer_layer_callables``.
        callables_importers: modules that import that builder by name (re-bound too).
        free_input_params: expected parameters of ``should_free_input``.
        dispatcher_init_params: expected parameters of ``MoEFlexTokenDispatcher.__init__``.
        dispatcher_has_over_budget: ``MoEFlexTokenDispatcher`` has ``check_over_budget`` /
            ``reset_over_budget`` (else ``install`` adds them).
        num_sms_field: the ``TransformerConfig`` field of the flex dispatcher's SM budget, or
            None when the version has none (the budget then lives in ``NUM_SMS_ATTR``).
        missing_config_fields: ``(field, fix)`` pairs: ``TransformerConfig`` fields of other
            supported versions that this one lacks, with what to use instead.
        align_size_needs_quantization: ``get_align_size_for_quantization`` is the expert-row
            alignment only under fp8/fp4 (else no alignment is needed, whatever it answers).
        row_parallel_has_backward_dw: ``RowParallelLinear`` has ``backward_dw`` (else
            ``install`` adds 0.19's no-op).
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


def missing_patch_point(version, what: str) -> UnsupportedMegatronVersionError:
    """The error for a megatron-core ``version`` whose patch point ``what`` is not where its
    :class:`PatchPoints` entry says (:func:`moe_dispatch.megatron.backend.install` raises it)."""
    return UnsupportedMegatronVersionError(
        f"megatron-core {'.'.join(map(str, version))} has no {what}, which moe_dispatch.megatron patches for the "
        "'custom' backend; update the version's entry in moe_dispatch/megatron/compat.py"
    )
