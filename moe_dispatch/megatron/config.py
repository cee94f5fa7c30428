"""Configuration of the Megatron-Core backend "custom": our knobs, ``configure()`` and the checks.

Megatron-Core selects a flex-dispatcher backend by two ``TransformerConfig`` fields
(``moe_token_dispatcher_type="flex"``, ``moe_flex_dispatcher_backend``); the knobs that are
ours (simulated nodes, padding, the static budget) travel on the config object as the
attribute ``moe_dispatch_options`` (a :class:`CustomBackendOptions`). A config without it
uses the defaults.

Megatron checks its EP-overlap constraints once, in ``TransformerConfig.__post_init__``; a
config changed afterwards (what ``configure()`` and Megatron-Bridge do) is not checked again,
so :func:`validate_config` repeats the checks that matter to this backend, each message naming
the knob, the reason and the fix.

Megatron's knobs that shape the expert input, as this backend honours them:

- ``moe_expert_capacity_factor`` (token dropping): the router drops the tokens
  (``moe_utils.apply_router_token_dropping``, by ``moe_token_drop_policy``) before any
  dispatcher, so "custom" dispatches exactly the routing entries the alltoall dispatcher does.
- ``moe_pad_expert_input_to_capacity`` (drop-and-pad): every local expert block has exactly
  ``capacity x`` (TP x EP group size) rows, with ``capacity = moe_utils.get_capacity(T *
  moe_router_topk, num_moe_experts, moe_expert_capacity_factor)`` for the T tokens of a rank,
  as Megatron's alltoall dispatcher sizes them (``MoEAlltoAllTokenDispatcher.preprocess``).
  The router's padding entries (in its routing map with probability 0) are not sent: the
  fused permute fills the blocks with zero rows of probability 0 instead of copies of other
  tokens. See :func:`resolve_expert_capacity`.
- ``moe_router_padding_for_quantization``: every local expert block is padded to a multiple of
  ``get_align_size_for_quantization(config)`` (the fp8/fp4 recipe's 16 or 32), with zero rows
  of probability 0 on the receiving rank, where Megatron's alltoall dispatcher pads on the
  sending rank with copies of other tokens (``moe_utils.pad_routing_map``). The expert GEMMs
  then skip their own padding (``moe_utils.skip_routed_expert_padding``), as for deepep.
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings
from typing import Any

from .._autoload import BACKEND_NAME
from ..config import Config, num_sms_error
from ..semantics.quant import FP8_BLOCK
from ..semantics.validation import check_timeout_s
from ..transport import TRANSPORT_NAMES
from . import compat

OPTIONS_ATTR = "moe_dispatch_options"


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class CustomBackendOptions:
    """The knobs of the "custom" backend that Megatron's ``TransformerConfig`` has no field for.

    Attributes:
        ranks_per_node: ranks of the dispatch group (Megatron's expert TP x EP group) per node
            (NVLink domain) for the hierarchy. None: derived from the group's global ranks and
            ``LOCAL_WORLD_SIZE`` (torchrun), or the visible GPU count; a CPU world may declare
            any divisor of the group size to simulate nodes.
        pad_multiple: pad each local expert's rows to a multiple of this (zero rows), as
            HybridEP's fused permute does for fp8/fp4 grouped GEMMs. None: Megatron's
            ``get_align_size_for_quantization(config)`` (0 -> 1, no padding). With
            ``moe_router_padding_for_quantization`` it must be a multiple of that alignment.
        num_permuted_tokens: static receive budget P: the permuted expert input has exactly P
            rows (rows beyond it are dropped and flagged in ``manager.over_budget``).
        expert_rank_capacity_factor: budget as a factor of the balanced load, like Megatron's
            ``moe_expert_rank_capacity_factor`` for HybridEP:
            ``P = ceil(T * topk * factor)`` rounded up to ``pad_multiple``. Excludes
            ``num_permuted_tokens``.
        fuse_permute: permute inside ``dispatch`` (the HybridEP layout: ``dispatch`` returns
            expert-major rows, landed straight from the receive buffer, and ``combine`` sums each
            token's copies as it returns them) or after it (the DeepEP layout:
            ``get_permuted_hidden_states_by_experts`` permutes). None (default): fused; the
            expert input is the same either way, bit for bit.
        raise_on_overflow: read the overflow flag on the host after every budgeted dispatch and
            raise ``moe_dispatch.BudgetOverflowError`` (a host synchronisation; for
            debugging). Default: only accumulate the device flag ``over_budget``.
        timeout_s: bound on every collective of the backend's ``Buffer``.
        transport: the ``Buffer``'s transport: ``"auto"`` (torch.distributed), ``"torch_dist"``
            or ``"kernels"`` (our kernels, chosen by topology: intranode on one node, the
            hierarchical ones across nodes; ``"cuda"`` is its old name; see
            ``moe_dispatch.Buffer``).
        kernel_config: the kernels' whole launch shape, a :class:`moe_dispatch.config.Config`
            (SMs, ring depth ``num_slots``, ``chunk_tokens``, ``l2_discard``, the internode
            pipeline), handed to the ``Buffer``; ``"auto"``: ``Config.auto`` (the cost model's SMs
            and ring depth from the first dispatch's shape); None: ``Config(num_sms=...)`` from
            the SM budget. ``configure(num_sms=...)`` is the shorthand for the SMs alone: not both.
        fp8_dispatch: dispatch the tokens as fp8 ``(x_fp8, scales)`` with one fp32 scale per
            1x128 block (``moe_dispatch.ops.quant``), dequantized to the model dtype on the
            receiving rank for the experts (see
            :class:`~moe_dispatch.megatron.manager.CustomDispatchManager`). None: when Megatron
            trains in fp8 (``config.fp8`` set) and ``hidden_size`` is a multiple of 128.

    Raises:
        ValueError: a knob out of range (the message names it and the fix).
    """

    ranks_per_node: int | None = None
    pad_multiple: int | None = None
    num_permuted_tokens: int | None = None
    expert_rank_capacity_factor: float | None = None
    fuse_permute: bool | None = None
    raise_on_overflow: bool = False
    timeout_s: float = 300.0
    transport: str = "auto"
    kernel_config: Config | str | None = None
    fp8_dispatch: bool | None = None

    def __post_init__(self) -> None:
        if self.fp8_dispatch is not None and not isinstance(self.fp8_dispatch, bool):
            raise ValueError(f"fp8_dispatch must be True, False or None (follow config.fp8), got {self.fp8_dispatch!r}")
        if self.transport not in TRANSPORT_NAMES:
            raise ValueError(f"transport must be one of {TRANSPORT_NAMES} (the Buffer's), got {self.transport!r}")
        if (
            self.kernel_config is not None
            and self.kernel_config != "auto"
            and not isinstance(self.kernel_config, Config)
        ):
            raise ValueError(
                f"kernel_config must be None, 'auto' or a moe_dispatch.config.Config, got {self.kernel_config!r}"
            )
        if self.ranks_per_node is not None and (not _is_int(self.ranks_per_node) or self.ranks_per_node < 1):
            raise ValueError(
                f"ranks_per_node must be a positive int (dispatch-group ranks per node) or None to "
                f"derive it from LOCAL_WORLD_SIZE, got {self.ranks_per_node!r}"
            )
        if self.pad_multiple is not None and (not _is_int(self.pad_multiple) or self.pad_multiple < 1):
            raise ValueError(
                f"pad_multiple must be a positive int (1 = no padding; 16, 32, 128, 256 for fp8/fp4 "
                f"grouped GEMMs) or None, got {self.pad_multiple!r}"
            )
        if self.num_permuted_tokens is not None and (
            not _is_int(self.num_permuted_tokens) or self.num_permuted_tokens < 1
        ):
            raise ValueError(
                f"num_permuted_tokens must be a positive int (rows of the permuted expert input) "
                f"or None for a dropless exact size, got {self.num_permuted_tokens!r}"
            )
        factor = self.expert_rank_capacity_factor
        if factor is not None and (
            isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0 or not math.isfinite(factor)
        ):
            raise ValueError(
                f"expert_rank_capacity_factor must be a positive number (e.g. 1.5 = room for 1.5x the "
                f"balanced load) or None, got {factor!r}"
            )
        if factor is not None and self.num_permuted_tokens is not None:
            raise ValueError(
                "num_permuted_tokens and expert_rank_capacity_factor both set a static budget: "
                f"pass only one (got {self.num_permuted_tokens} and {factor})"
            )
        if self.fuse_permute is not None and not isinstance(self.fuse_permute, bool):
            raise ValueError(f"fuse_permute must be True, False or None (auto), got {self.fuse_permute!r}")
        if not isinstance(self.raise_on_overflow, bool):
            raise ValueError(f"raise_on_overflow must be a bool, got {self.raise_on_overflow!r}")
        check_timeout_s(self.timeout_s)

    @property
    def has_budget(self) -> bool:
        """Whether this object configures a static receive budget (Megatron's own
        ``moe_expert_rank_capacity_factor`` is the other way: see :func:`rank_capacity_factor`)."""
        return self.num_permuted_tokens is not None or self.expert_rank_capacity_factor is not None


def get_options(config) -> CustomBackendOptions:
    """The backend options attached to ``config`` by :func:`configure` (defaults when none)."""
    options = getattr(config, OPTIONS_ATTR, None)
    if options is None:
        return CustomBackendOptions()
    if not isinstance(options, CustomBackendOptions):
        raise TypeError(
            f"config.{OPTIONS_ATTR} must be a moe_dispatch.megatron.CustomBackendOptions, "
            f"got {type(options).__name__}; set it through moe_dispatch.megatron.configure(config, ...)"
        )
    return options


def resolve_num_sms(config) -> int | None:
    """SM budget of the backend's CUDA kernels for ``config`` (None: the Buffer's default):
    Megatron's ``moe_flex_dispatcher_num_sms``, or on megatron-core 0.16 (no such field) the
    attribute ``moe_dispatch_num_sms`` that :func:`configure` sets."""
    return getattr(config, compat.num_sms_attr(), None)


def rank_capacity_factor(config) -> float | None:
    """The static budget's capacity factor: ``configure(expert_rank_capacity_factor=...)``, or
    Megatron's own ``moe_expert_rank_capacity_factor`` (HybridEP's and NCCL EP's knob, with the
    meaning of 0.19's ``moe_ncclep_static_shape``, which Megatron-LM main folds into the factor:
    the experts get the whole fixed-size receive buffer); None when neither is set."""
    factor = get_options(config).expert_rank_capacity_factor
    return factor if factor is not None else getattr(config, "moe_expert_rank_capacity_factor", None)


def has_static_budget(config) -> bool:
    """Whether the expert input has a static row count P (a budget from either knob)."""
    return get_options(config).num_permuted_tokens is not None or rank_capacity_factor(config) is not None


def resolve_kernel_config(config) -> Config | str | None:
    """The kernels' :class:`~moe_dispatch.config.Config` (or ``"auto"``) for ``config``'s Buffer:
    ``configure(kernel_config=...)``, else one with the SM budget (:func:`resolve_num_sms`), else
    None (the Buffer's default)."""
    kernel_config = get_options(config).kernel_config
    if kernel_config is not None:
        return kernel_config
    num_sms = resolve_num_sms(config)
    return None if num_sms is None else Config(num_sms=num_sms)


def resolve_fp8_dispatch(config) -> bool:
    """Whether the manager dispatches fp8 ``(x_fp8, scales)`` (see ``CustomBackendOptions``)."""
    explicit = get_options(config).fp8_dispatch
    if explicit is not None:
        return explicit
    return bool(getattr(config, "fp8", None)) and getattr(config, "hidden_size", 0) % FP8_BLOCK == 0


def resolve_pad_multiple(config) -> int:
    """Rows of each local expert block are padded to a multiple of this (>= 1).

    ``options.pad_multiple`` when set, else Megatron's ``get_align_size_for_quantization``
    (256 with the TE op fuser, the fp8/fp4 recipe's alignment, 0 otherwise; 0 means 1;
    see ``compat.quantization_align_size``).
    """
    options = get_options(config)
    if options.pad_multiple is not None:
        return options.pad_multiple
    return max(1, compat.quantization_align_size(config))


def dispatch_group_size(config) -> int:
    """Ranks of the group the flex dispatcher communicates over for ``config``: expert TP x EP
    (Megatron's ``tp_ep`` group; expert TP defaults to the tensor-parallel size)."""
    etp = getattr(config, "expert_tensor_parallel_size", None) or getattr(config, "tensor_model_parallel_size", 1)
    return (etp or 1) * (getattr(config, "expert_model_parallel_size", 1) or 1)


def is_drop_and_pad(config) -> bool:
    """Megatron's drop-and-pad mode (``moe_pad_expert_input_to_capacity`` with a capacity factor)."""
    return bool(getattr(config, "moe_pad_expert_input_to_capacity", False))


def resolve_expert_capacity(config, num_tokens: int, group_size: int) -> int | None:
    """Rows of every local expert block in drop-and-pad mode for T = ``num_tokens`` tokens per
    rank, or None (the mode is off).

    ``capacity x group_size`` rounded up to :func:`resolve_pad_multiple`, where ``capacity =
    get_capacity(T * moe_router_topk, num_moe_experts, moe_expert_capacity_factor)`` is the
    router's per-expert capacity of one rank (``moe_utils.get_capacity`` and
    ``apply_router_token_dropping``) and each of the ``group_size`` ranks of the TP x EP group
    sends at most that many rows to an expert: Megatron's alltoall dispatcher gives each local
    expert ``capacity * tp_size * ep_size`` rows (``MoEAlltoAllTokenDispatcher.preprocess``).
    All ranks are assumed to route the same T (Megatron's alltoall makes the same assumption);
    a rank receiving more is flagged in ``over_budget``.
    """
    if not is_drop_and_pad(config):
        return None
    from megatron.core.transformer.moe.moe_utils import get_capacity

    capacity = get_capacity(
        num_tokens=num_tokens * config.moe_router_topk,
        num_experts=config.num_moe_experts,
        capacity_factor=config.moe_expert_capacity_factor,
    )
    pad = resolve_pad_multiple(config)
    return -(-capacity * group_size // pad) * pad


def resolve_fuse_permute(config) -> bool:
    """Whether the permute runs inside ``dispatch`` (HybridEP layout) for this config."""
    options = get_options(config)
    return options.fuse_permute is not False


def is_custom_backend(config) -> bool:
    """True when ``config`` selects this backend (flex dispatcher, backend "custom")."""
    return (
        getattr(config, "moe_token_dispatcher_type", None) == "flex"
        and getattr(config, "moe_flex_dispatcher_backend", None) == BACKEND_NAME
    )


# Why Megatron-Core refuses recomputation with EP overlap (its __post_init__ gives no reason).
_RECOMPUTE_VS_OVERLAP = (
    "the EP-overlap schedule runs each layer's attention, dispatch, experts and combine as separate steps "
    "interleaved with another micro-batch, and recomputation checkpoints a whole layer (or the whole MoE block) "
    "as one"
)


def _cuda_graph_captures(config) -> tuple[str, object, list[str]]:
    """The per-layer CUDA-graph field (``cuda_graph_modules`` on megatron-core 0.19, ``cuda_graph_scope``
    on 0.16), its value, and the names of the modules it captures (strings or enum members; "full" and
    empty: the whole layer, which Megatron's EP-overlap check lets pass)."""
    field = "cuda_graph_modules" if hasattr(config, "cuda_graph_modules") else "cuda_graph_scope"
    value = getattr(config, field, None)
    entries = value.split(",") if isinstance(value, str) else list(value) if isinstance(value, list) else [value]
    return field, value, [getattr(entry, "name", entry) for entry in entries if entry is not None]


def _check_ep_overlap(config, ep: int) -> None:
    """The prerequisites of ``overlap_moe_expert_parallel_comm=True`` that Megatron-Core 0.19's
    ``TransformerConfig.__post_init__`` and Megatron-Bridge's ``CommOverlapConfig`` assert, as
    ``ValueError`` s with the fix (see :func:`validate_config`); warns on
    ``CUDA_DEVICE_MAX_CONNECTIONS=1``."""
    if ep <= 1:
        raise ValueError(
            "overlap_moe_expert_parallel_comm=True hides the expert-parallel dispatch and combine behind another "
            f"micro-batch's compute, but expert_model_parallel_size={ep}: there is no EP communication to hide "
            "(Megatron-Core and Megatron-Bridge refuse it). Set expert_model_parallel_size > 1, or "
            "overlap_moe_expert_parallel_comm=False"
        )
    if not (getattr(config, "bf16", False) or getattr(config, "fp16", False)):
        raise ValueError(
            "overlap_moe_expert_parallel_comm=True needs a bf16 or fp16 model (Megatron-Core's EP-overlap schedule "
            "supports only those; Megatron-Bridge refuses others too), but bf16=False and fp16=False: set bf16=True "
            "(with params_dtype=torch.bfloat16), or overlap_moe_expert_parallel_comm=False"
        )
    pp = getattr(config, "pipeline_model_parallel_size", 1) or 1
    if pp > 1 and getattr(config, "virtual_pipeline_model_parallel_size", None) is None:
        raise ValueError(
            f"overlap_moe_expert_parallel_comm=True with pipeline_model_parallel_size={pp} needs the interleaved "
            "schedule: set virtual_pipeline_model_parallel_size (>= 2), or set "
            "overlap_moe_expert_parallel_comm=False"
        )
    if getattr(config, "recompute_granularity", None) == "full":
        raise ValueError(
            f"overlap_moe_expert_parallel_comm=True with recompute_granularity='full': {_RECOMPUTE_VS_OVERLAP}. Set "
            "recompute_granularity='selective' (recompute_modules without 'moe') or None, or "
            "overlap_moe_expert_parallel_comm=False"
        )
    method = getattr(config, "recompute_method", None)
    if method is not None:
        raise ValueError(
            f"overlap_moe_expert_parallel_comm=True with recompute_method={method!r} (which layers to recompute "
            f"whole): {_RECOMPUTE_VS_OVERLAP}. Set recompute_method=None, or overlap_moe_expert_parallel_comm=False"
        )
    num_layers = getattr(config, "recompute_num_layers", None)
    if num_layers is not None:
        raise ValueError(
            f"overlap_moe_expert_parallel_comm=True with recompute_num_layers={num_layers} (layers to recompute "
            f"whole): {_RECOMPUTE_VS_OVERLAP}. Set recompute_num_layers=None, or "
            "overlap_moe_expert_parallel_comm=False"
        )
    modules = getattr(config, "recompute_modules", None) or []  # None until Megatron's __post_init__ fills it
    if "moe" in modules:
        raise ValueError(
            f"overlap_moe_expert_parallel_comm=True with 'moe' in recompute_modules={modules!r}: "
            f"{_RECOMPUTE_VS_OVERLAP}. Drop 'moe' from recompute_modules ('moe_act' recomputes only the experts' "
            "activation), or set overlap_moe_expert_parallel_comm=False"
        )
    if getattr(config, "moe_shared_expert_overlap", False):
        raise ValueError(
            "moe_shared_expert_overlap=True and overlap_moe_expert_parallel_comm=True exclude each other (both "
            "claim the communication stream): set moe_shared_expert_overlap=False (the EP overlap hides the "
            "shared experts behind dispatch anyway)"
        )
    mtp = getattr(config, "mtp_num_layers", None)
    if mtp not in (None, 0, 1):
        raise ValueError(
            f"overlap_moe_expert_parallel_comm=True with mtp_num_layers={mtp}: Megatron-Core's EP-overlap schedule "
            "builds at most one multi-token-prediction layer. Set mtp_num_layers=1 (or None), or "
            "overlap_moe_expert_parallel_comm=False"
        )
    if getattr(config, "cuda_graph_impl", "none") == "transformer_engine":
        field, value, names = _cuda_graph_captures(config)
        captured = [name for name in ("moe", "mlp") if name in names]
        if captured:
            raise ValueError(
                f"overlap_moe_expert_parallel_comm=True with cuda_graph_impl='transformer_engine' capturing "
                f"{captured} ({field}={value!r}): a captured MoE or MLP block replays as one graph, which the "
                f"EP-overlap schedule splits into dispatch, experts and combine. Drop 'moe' and 'mlp' from {field}, "
                "or set overlap_moe_expert_parallel_comm=False"
            )
    if os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
        warnings.warn(
            "CUDA_DEVICE_MAX_CONNECTIONS=1 while overlap_moe_expert_parallel_comm=True: one hardware queue "
            "serialises the dispatch/combine stream behind the compute stream, so nothing overlaps. Unset it "
            "(or set it > 1) for EP overlap; keep it only if tensor-parallel comm overlap needs it",
            UserWarning,
            stacklevel=3,
        )


def validate_config(config) -> None:
    """Checks a ``TransformerConfig`` that selects the "custom" backend; raises or warns with
    the fix. A config that does not name the backend passes untouched.

    Raises:
        ValueError: the backend is named but the dispatcher type is not "flex" (Megatron would
            silently keep the other dispatcher); a TP x EP group of one rank (expert TP 1 and
            EP 1); num_moe_experts < 2 or not divisible by EP; ranks_per_node not dividing the
            TP x EP group size; with EP overlap (``overlap_moe_expert_parallel_comm``), what
            Megatron-Core 0.19's ``TransformerConfig.__post_init__`` and Megatron-Bridge's
            ``CommOverlapConfig`` refuse: expert_model_parallel_size 1, neither bf16 nor fp16,
            pipeline parallelism without a virtual pipeline, recompute_granularity='full', a
            recompute_method or recompute_num_layers, 'moe' in recompute_modules,
            moe_shared_expert_overlap, mtp_num_layers > 1, a Transformer Engine CUDA graph that
            captures 'moe' or 'mlp'; delay_wgrad_compute or ep_overlap_early_attn_memory_release
            without EP overlap; overlap_dispatch_backward_with_experts_wgrad together with EP
            overlap or delay_wgrad_compute; drop-and-pad without a capacity factor or with a
            static budget; router
            padding without fp8/fp4 or with a ``pad_multiple`` that is not a multiple of the
            recipe's alignment; Megatron's moe_expert_rank_capacity_factor together with the
            backend's own static budget, or not a positive number; an SM budget
            (moe_flex_dispatcher_num_sms) that is not an even int in [2, 128], or that differs
            from ``kernel_config.num_sms``; ``fp8_dispatch=True`` with a hidden size that is not
            a multiple of 128; ``moe_dispatch_fwd_dtype`` / ``moe_combine_bwd_dtype`` (Megatron-LM
            main) other than 'bf16'.

    Warns:
        UserWarning: ``CUDA_DEVICE_MAX_CONNECTIONS=1`` while EP overlap is on (the hardware
        queue serialises the communication stream behind compute: no overlap).
    """
    if getattr(config, "moe_flex_dispatcher_backend", None) != BACKEND_NAME:
        return
    get_options(config)  # type check of the attached options
    dispatcher = getattr(config, "moe_token_dispatcher_type", None)
    if dispatcher != "flex":
        raise ValueError(
            f"moe_flex_dispatcher_backend='custom' takes effect only with moe_token_dispatcher_type='flex', got "
            f"moe_token_dispatcher_type={dispatcher!r}: Megatron-Core would silently build the {dispatcher!r} "
            "dispatcher. Set moe_token_dispatcher_type='flex' (moe_dispatch.megatron.configure(config) does)"
        )
    ep = getattr(config, "expert_model_parallel_size", 1) or 1
    group_size = dispatch_group_size(config)
    if group_size <= 1:
        raise ValueError(
            "the 'custom' flex backend moves tokens between the ranks of the expert TP x EP group (what Megatron's "
            f"flex dispatcher communicates over), but expert_tensor_parallel_size x expert_model_parallel_size = "
            f"{group_size // ep} x {ep} = 1: there is nothing to dispatch. Set expert_model_parallel_size > 1 or "
            "expert_tensor_parallel_size > 1, or use moe_token_dispatcher_type='alltoall' for a single rank"
        )
    experts = getattr(config, "num_moe_experts", None)
    if experts is None or experts <= 1:
        raise ValueError(
            f"the 'custom' flex backend needs a mixture of experts, but num_moe_experts={experts}: set "
            "num_moe_experts >= 2 (and divisible by expert_model_parallel_size)"
        )
    if experts % ep != 0:
        raise ValueError(
            f"num_moe_experts={experts} is not divisible by expert_model_parallel_size={ep}: each EP rank owns "
            f"num_moe_experts / EP experts; choose num_moe_experts as a multiple of {ep}"
        )
    num_sms = resolve_num_sms(config)
    if num_sms is not None and (error := num_sms_error(num_sms)) is not None:
        raise ValueError(
            f"{compat.num_sms_attr()} (the SM budget the 'custom' backend's Buffer gets) {error}; set it "
            "so, or to None for the default (configure(config, num_sms=...) does)"
        )
    options = get_options(config)
    rpn = options.ranks_per_node
    if rpn is not None and group_size % rpn != 0:
        raise ValueError(
            f"configure(ranks_per_node={rpn}) must divide the expert TP x EP group size {group_size} (the group is "
            f"split into nodes of ranks_per_node ranks): pass a divisor of {group_size}, or None to take it from "
            "LOCAL_WORLD_SIZE"
        )
    overlap = bool(getattr(config, "overlap_moe_expert_parallel_comm", False))
    if overlap:
        _check_ep_overlap(config, ep)
    delay_wgrad = bool(getattr(config, "delay_wgrad_compute", False))
    # a 0.19 field (megatron-core 0.16 has no such option)
    if getattr(config, "overlap_dispatch_backward_with_experts_wgrad", False) and (overlap or delay_wgrad):
        raise ValueError(
            "overlap_dispatch_backward_with_experts_wgrad=True (TE's grouped experts compute their weight gradients "
            "on a side stream within one micro-batch) and the EP-overlap schedule (overlap_moe_expert_parallel_comm="
            f"{overlap}, delay_wgrad_compute={delay_wgrad}) both decide when the expert weight gradients run; "
            "Megatron-Core refuses the pair. Set overlap_dispatch_backward_with_experts_wgrad=False, or "
            "overlap_moe_expert_parallel_comm=False and delay_wgrad_compute=False"
        )
    if delay_wgrad and not overlap:
        raise ValueError(
            "delay_wgrad_compute=True defers the experts' weight gradients into the EP-overlap schedule: set "
            "overlap_moe_expert_parallel_comm=True too, or delay_wgrad_compute=False"
        )
    if getattr(config, "ep_overlap_early_attn_memory_release", False) and not overlap:
        raise ValueError(
            "ep_overlap_early_attn_memory_release=True reorders the attention backward inside the EP-overlap "
            "schedule, which runs only with overlap_moe_expert_parallel_comm=True: set that too, or "
            "ep_overlap_early_attn_memory_release=False"
        )
    if is_drop_and_pad(config):
        if getattr(config, "moe_expert_capacity_factor", None) is None:
            raise ValueError(
                "moe_pad_expert_input_to_capacity=True pads every expert's input to its capacity, which "
                "moe_expert_capacity_factor defines: set moe_expert_capacity_factor (e.g. 1.0), or set "
                "moe_pad_expert_input_to_capacity=False"
            )
        if has_static_budget(config):
            raise ValueError(
                "moe_pad_expert_input_to_capacity=True already fixes the expert input (capacity rows per expert), so "
                "a static budget (configure(num_permuted_tokens=/expert_rank_capacity_factor=), or "
                "moe_expert_rank_capacity_factor) has nothing to bound: drop the static budget, or set "
                "moe_pad_expert_input_to_capacity=False"
            )
    if getattr(config, "moe_router_padding_for_quantization", False):
        align = compat.quantization_align_size(config)
        if align <= 1:
            raise ValueError(
                "moe_router_padding_for_quantization=True pads each expert's rows to the fp8/fp4 recipe's alignment, "
                "but the config has neither fp8 nor fp4 (Megatron requires one): set fp8/fp4, or set "
                "moe_router_padding_for_quantization=False"
            )
        if options.pad_multiple is not None and options.pad_multiple % align:
            raise ValueError(
                f"moe_router_padding_for_quantization=True needs expert blocks padded to a multiple of {align} (the "
                f"fp8/fp4 recipe's alignment), but configure(pad_multiple={options.pad_multiple}) is not one: pass a "
                f"multiple of {align}, or None for {align}"
            )
    megatron_factor = getattr(config, "moe_expert_rank_capacity_factor", None)
    if megatron_factor is not None:
        if (
            isinstance(megatron_factor, bool)
            or not isinstance(megatron_factor, (int, float))
            or not (math.isfinite(megatron_factor) and megatron_factor > 0)
        ):
            raise ValueError(
                f"moe_expert_rank_capacity_factor must be a positive number (room for that many times "
                f"the balanced load), got {megatron_factor!r}"
            )
        if options.has_budget:
            raise ValueError(
                f"moe_expert_rank_capacity_factor={megatron_factor} and configure(num_permuted_tokens="
                f"{options.num_permuted_tokens}, expert_rank_capacity_factor={options.expert_rank_capacity_factor}) "
                "both set the static budget: pass one"
            )
    if isinstance(options.kernel_config, Config) and num_sms not in (None, options.kernel_config.num_sms):
        raise ValueError(
            f"{compat.num_sms_attr()}={num_sms} and configure(kernel_config=Config(num_sms="
            f"{options.kernel_config.num_sms}, ...)) both set the SM budget: keep one (the kernel_config's, or "
            "num_sms alone)"
        )
    if options.fp8_dispatch and getattr(config, "hidden_size", 0) % FP8_BLOCK:
        raise ValueError(
            f"fp8_dispatch=True quantizes rows in 1x{FP8_BLOCK} blocks, but hidden_size={config.hidden_size} is not a "
            f"multiple of {FP8_BLOCK}: pass fp8_dispatch=False (or None: fp8 only where it fits)"
        )
    # Megatron-LM main's wire dtypes: Transformer Engine's NCCL EP quantizes to an MXFP8 grouped tensor
    # that only its fused grouped GEMM reads; set after __post_init__ (which refuses them), they would be ignored
    wire = {name: getattr(config, name, "bf16") for name in ("moe_dispatch_fwd_dtype", "moe_combine_bwd_dtype")}
    if any(dtype != "bf16" for dtype in wire.values()):
        raise ValueError(
            f"{', '.join(f'{name}={dtype!r}' for name, dtype in wire.items())}: these select NCCL EP's MXFP8 payload "
            "(Megatron's 'ncclep' backend only), which the 'custom' backend does not make. Set both to 'bf16'; for "
            "fp8 on the wire use configure(config, fp8_dispatch=True) (dispatched tokens as e4m3 with 1x128 scales, "
            "dequantized on arrival; combine and the backward pass stay in the model dtype)"
        )


def configure(
    config,
    *,
    ranks_per_node: int | None = None,
    num_sms: int | None = None,
    pad_multiple: int | None = None,
    num_permuted_tokens: int | None = None,
    expert_rank_capacity_factor: float | None = None,
    fuse_permute: bool | None = None,
    raise_on_overflow: bool = False,
    timeout_s: float = 300.0,
    transport: str = "auto",
    kernel_config: Config | str | None = None,
    fp8_dispatch: bool | None = None,
    **config_fields: Any,
):
    """Selects the "custom" backend on a Megatron-Core ``TransformerConfig`` and validates it.

    Sets ``moe_token_dispatcher_type="flex"``, ``moe_flex_dispatcher_backend="custom"`` and
    ``moe_shared_expert_overlap=False`` (what Megatron-Bridge's ``apply_flex_dispatcher_backend``
    does for its backends), then any Megatron fields passed as keywords (e.g.
    ``overlap_moe_expert_parallel_comm=True``), the SM budget, attaches the backend's own knobs
    and runs :func:`validate_config`.

    Args:
        config: a ``megatron.core.transformer.TransformerConfig`` (changed in place).
        ranks_per_node, pad_multiple, num_permuted_tokens, expert_rank_capacity_factor,
            fuse_permute, raise_on_overflow, timeout_s, transport, kernel_config, fp8_dispatch:
            see :class:`CustomBackendOptions`. Megatron's own ``moe_expert_rank_capacity_factor``
            (passed as a keyword, or set on the config) sets the static budget too.
        num_sms: SM budget of the CUDA kernels (an even int in [2, 128]), the shorthand of
            ``kernel_config=Config(num_sms=...)`` (pass one); stored in Megatron's
            ``moe_flex_dispatcher_num_sms`` (megatron-core 0.16, which lacks that field: in the
            attribute ``moe_dispatch_num_sms``); None keeps the config's value. See
            :func:`resolve_num_sms`.
        **config_fields: ``TransformerConfig`` fields to set before validation.

    Returns:
        ``config``.

    Raises:
        TypeError: ``config`` is not a TransformerConfig.
        ValueError: an unknown field name (one that only other megatron-core versions have:
            the message names the installed version and the replacement), a bad knob, another
            dispatcher or backend asked for through the keywords, or a check of
            :func:`validate_config`.
    """
    if not hasattr(config, "moe_token_dispatcher_type"):
        raise TypeError(f"configure() takes a megatron.core.transformer.TransformerConfig, got {type(config).__name__}")
    if (
        config_fields.get("moe_flex_dispatcher_backend", BACKEND_NAME) != BACKEND_NAME
        or config_fields.get("moe_token_dispatcher_type", "flex") != "flex"
    ):
        raise ValueError(
            "configure() selects moe_token_dispatcher_type='flex' with moe_flex_dispatcher_backend="
            "'custom'; it got moe_token_dispatcher_type="
            f"{config_fields.get('moe_token_dispatcher_type')!r}, moe_flex_dispatcher_backend="
            f"{config_fields.get('moe_flex_dispatcher_backend')!r}. Drop "
            "those keywords (for another backend, set the config fields without configure())"
        )
    unknown = sorted(name for name in config_fields if not hasattr(config, name))
    for name in unknown:
        fix = compat.missing_config_field(name)
        if fix is not None:
            raise ValueError(
                f"configure() got {name}, but megatron-core {compat.version_string()} has no "
                f"TransformerConfig field {name} (newer supported versions do): {fix}, or upgrade "
                "megatron-core"
            )
    if unknown:
        raise ValueError(
            f"configure() got {unknown}, which are neither TransformerConfig fields nor backend knobs "
            f"(backend knobs: {[f.name for f in dataclasses.fields(CustomBackendOptions)] + ['num_sms']})"
        )
    if num_sms is not None and (error := num_sms_error(num_sms)) is not None:
        raise ValueError(f"num_sms (SMs of the dispatch/combine kernels) {error}, or None to keep the config's value")
    if num_sms is not None and kernel_config is not None:
        raise ValueError(
            f"num_sms={num_sms} and kernel_config={kernel_config!r} both set the kernels' SM budget: "
            "pass kernel_config alone (num_sms is its shorthand)"
        )
    options = CustomBackendOptions(
        ranks_per_node=ranks_per_node,
        pad_multiple=pad_multiple,
        num_permuted_tokens=num_permuted_tokens,
        expert_rank_capacity_factor=expert_rank_capacity_factor,
        fuse_permute=fuse_permute,
        raise_on_overflow=raise_on_overflow,
        timeout_s=timeout_s,
        transport=transport,
        kernel_config=kernel_config,
        fp8_dispatch=fp8_dispatch,
    )
    config.moe_token_dispatcher_type = "flex"
    config.moe_flex_dispatcher_backend = BACKEND_NAME
    config.moe_shared_expert_overlap = False
    for name, value in config_fields.items():
        setattr(config, name, value)
    if num_sms is not None:
        setattr(config, compat.num_sms_attr(), num_sms)
    setattr(config, OPTIONS_ATTR, options)
    validate_config(config)
    return config
