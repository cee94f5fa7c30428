"""Megatron-Core backend "custom": ``moe_dispatch`` as Megatron's flex token dispatcher.

Usage::

    import moe_dispatch.megatron as mdm          # installs the backend (idempotent)
    config = TransformerConfig(..., expert_model_parallel_size=8, num_moe_experts=64)
    mdm.configure(config, ranks_per_node=8)      # flex + "custom" + checks with fixes
    # or by hand: moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="custom"

The import is optional: the start-up hook ``moe_dispatch._autoload`` (run from the installed
``moe_dispatch-autoload.pth``) imports this package when the first ``MoELayer`` naming "custom" is
built or Megatron-Bridge's flex-backend helpers are given "custom".

Every ``MoELayer`` built from such a config gets a ``MoEFlexTokenDispatcher`` whose
``_comm_manager`` is a :class:`CustomDispatchManager` over ``moe_dispatch.Buffer`` (the
hierarchical dispatch/combine), with the permute fused into dispatch when padding or a static
budget is configured. EP overlap (``overlap_moe_expert_parallel_comm``) is wired as for
Megatron's own deepep/hybridep backends; with ``delay_wgrad_compute=True`` the layer's local
(non-Transformer-Engine) experts defer their weight gradients to ``MoELayer.backward_dw()`` as the
layer is built (``moe_dispatch.megatron.delayed_wgrad``; TE's experts defer through TE).
Megatron-Bridge's ``apply_flex_dispatcher_backend(model_config, "custom")`` works too. Megatron's
expert-input knobs work as its alltoall dispatcher defines them: any expert TP x EP group > 1,
capacity factors, drop-and-pad (``moe_pad_expert_input_to_capacity``) and router padding for
quantization.

``moe_dispatch.megatron.cpu`` (explicit opt-in) lets Megatron's MoELayer run under gloo on a
machine without a GPU, for tests and debugging; it is not a training path.

Supported megatron-core versions: 0.16.x (tested 0.16.1, Python 3.11), 0.19.x (tested 0.19.2) and 0.20
(Megatron-LM main, checked by hand: docs/megatron-main.md);
what differs between them is in ``moe_dispatch.megatron.compat``, applied by
``moe_dispatch.megatron.backend``.

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

from .backend import install, installed, patch_bridge  # noqa: E402
from .compat import UnsupportedMegatronVersionError, megatron_core_version  # noqa: E402
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
