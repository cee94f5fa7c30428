"""moe_dispatch: hierarchical MoE token dispatch/combine for expert parallelism.

See README.md for the API and docs/semantics.md for the semantics; ``python -m moe_dispatch.env``
reports what this installation can do.
"""

__version__ = "0.1.0"

from ._ext import cuda_available
from .buffer import Buffer, DispatchHandle, EventOverlap
from .config import Config
from .errors import BudgetOverflowError, CommError
from .topology import Topology

__all__ = [
    "BudgetOverflowError",
    "Buffer",
    "CommError",
    "Config",
    "DispatchHandle",
    "EventOverlap",
    "Topology",
    "__version__",
    "cuda_available",
]
