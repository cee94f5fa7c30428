"""The ``torch_dist`` transport: the two-stage hierarchy on torch.distributed sub-group
``all_to_all_single`` (gloo on CPU, NCCL on GPU), one module per concern:

- :mod:`.transport`: :class:`TorchDistTransport`, what the Buffer talks to (plan, dispatch,
  forward, combine, agree, close); its docstring explains the routes and the pipeline.
- :mod:`.plan`: a dispatch's counts and :class:`TorchDistPlan`.
- :mod:`.route`: the route choice (flat or two-stage, the depth) and the link measurement.
- :mod:`.pipeline`: the steps of both routes (the flat exchange, the chunked two stages).
- :mod:`.blocks`: the block exchanges (counts, argument checks, small calls' rows inside them).
- :mod:`.packing`: row tensors packed into one byte buffer per stage, and landed from it.
- :mod:`.sums`: the combine's sums, in the semantics' order.
- :mod:`.collectives`: the sub-groups and the collectives on them.
- :mod:`.tuning`: every tuning constant, with its unit and why its value.
"""

from .collectives import ALL_COMM
from .plan import TorchDistPlan
from .transport import TorchDistTransport

__all__ = ["ALL_COMM", "TorchDistPlan", "TorchDistTransport"]
