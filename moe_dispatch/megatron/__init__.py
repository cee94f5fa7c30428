"""Megatron-Core backend "custom": ``moe_dispatch`` as Megatron's flex token dispatcher.

Usage::

    import moe_dispatch.megatron as mdm          # installs the backend (idempotent)
    config = TransformerConfig(..., expert_model_parallel_size=8, num_moe_experts=64)
    mdm.configure(config, ranks_per_node=8)      # flex + "custom" + checks with fixes
    # or by hand: moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="custom"

Every ``MoELayer`` built from such a config gets a ``MoEFlexTokenDispatcher`` whose
``_comm_manager`` is a :class:`CustomDispatchManager` over ``moe_dispatch.Buffer`` (the
hierarchical dispatch/combine), with the permute fused into dispatch when padding or a static
budget is configured. EP overlap (``overlap_moe_expert_parallel_comm``) and
``delay_wgrad_compute`` are wired as for Megatron's own deepep/hybridep backends. With
Megatron-Bridge, ``apply_flex_dispatcher_backend(model_config, "custom")`` works too (patched
when Bridge's module is imported). Megatron's expert-input knobs work as its alltoall
dispatcher defines them: any expert TP x EP group > 1, capacity factors, drop-and-pad
(``moe_pad_expert_input_to_capacity``) and router padding for quantization.

``enable_delayed_wgrad(model)`` (explicit opt-in, ``moe_dispatch.megatron.delayed_wgrad``) defers
the weight gradients of Megatron's local (non-TE) experts, so ``delay_wgrad_compute`` works
without Transformer Engine.

``moe_dispatch.megatron.cpu`` (explicit opt-in) lets Megatron's MoELayer run under gloo on a
machine without a GPU, for tests and debugging; it is not a training path.

Supported megatron-core versions: 0.16.x (tested 0.16.1, Python 3.11) and 0.19.x (tested 0.19.2);
what differs between them is handled in ``moe_dispatch.megatron.compat``.

Raises (on import):
    ImportError: megatron-core is not installed (``pip install 'moe-dispatch[megatron]'``).
    UnsupportedMegatronVersionError: an unsupported megatron-core version (the message lists
        the supported ones).
"""

from __future__ import annotations

try:
    import megatron.core  # noqa: F401

    HAVE_MEGATRON = True
except ImportError as _err:  # pragma: no cover - exercised only without megatron-core
    HAVE_MEGATRON = False
    raise ImportError(
        "moe_dispatch.megatron needs megatron-core (the 'custom' flex dispatcher backend plugs into "
        "it): pip install 'moe-dispatch[megatron]'"
    ) from _err

from .compat import UnsupportedMegatronVersionError, install, installed, megatron_core_version, patch_bridge  # noqa: E402
from .config import (  # noqa: E402
    BACKEND_NAME,
    OPTIONS_ATTR,
    CustomBackendOptions,
    configure,
    get_options,
    is_custom_backend,
    validate_config,
)
from .delayed_wgrad import ExpertWgradStore, disable_delayed_wgrad, enable_delayed_wgrad  # noqa: E402
from .manager import CustomDispatchManager, InflightDispatch, clear_buffers, ep_ranks_per_node, get_buffer  # noqa: E402

install()

__all__ = [
    "BACKEND_NAME",
    "HAVE_MEGATRON",
    "OPTIONS_ATTR",
    "CustomBackendOptions",
    "CustomDispatchManager",
    "ExpertWgradStore",
    "InflightDispatch",
    "UnsupportedMegatronVersionError",
    "clear_buffers",
    "configure",
    "disable_delayed_wgrad",
    "enable_delayed_wgrad",
    "ep_ranks_per_node",
    "get_buffer",
    "get_options",
    "install",
    "installed",
    "is_custom_backend",
    "megatron_core_version",
    "patch_bridge",
    "validate_config",
]
