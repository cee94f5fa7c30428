"""moe_dispatch: hierarchical MoE token dispatch/combine for expert parallelism.

See README.md for the API and docs/semantics.md for the semantics; ``python -m moe_dispatch.env``
reports what this installation can do.

The names below are imported on first use: Python runs ``moe_dispatch._autoload`` at start-up
(see that module), which must not import torch.
"""

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "ArgumentError": ".errors",
    "ArgumentTypeError": ".errors",
    "BudgetOverflowError": ".errors",
    "Buffer": ".buffer",
    "CommError": ".errors",
    "Config": ".config",
    "DispatchHandle": ".buffer",
    "EventOverlap": ".buffer",
    "InvalidArgumentError": ".errors",
    "MismatchError": ".errors",
    "Topology": ".topology",
    "cuda_available": "._ext",
}

__all__ = [*sorted(_EXPORTS), "__version__"]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'moe_dispatch' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
