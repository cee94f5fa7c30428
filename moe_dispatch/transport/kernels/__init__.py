"""``Buffer(transport="kernels")``: the ``moe_dispatch._C`` kernels, one module per layer and one
word per layer (Transport, Buffers, Engine, Launcher), top down:

- :mod:`.transport`: :class:`KernelTransport`, the one front door: the transport contract of
  :mod:`moe_dispatch.transport.base`, what ``Buffer`` drives.
- :mod:`.intranode` / :mod:`.internode`, per topology: ``IntranodeBuffers`` /
  ``InternodeBuffers`` (on ``launcher.RankBuffers``), this process's rank of the kernels (its
  buffers, its peers' mapped, one operation for this rank), over the engines
  (``IntranodeEngine``; in :mod:`.internode_engines`, below both internode pipelines,
  ``InternodeEngines``: ``RdmaEngine`` and the node engines), which run an operation for a list
  of ranks, one launch per kernel.
- :mod:`.launcher`: what the engines share to launch: :class:`~.launcher.Launcher` (the typed
  ``_C`` launch) and ``RankBuffers``; below it :mod:`.calls` (a rank's prepared input, one
  operation's call, shapes and headers) and :mod:`.timeouts` (wait bounds and timeout records).
- ``moe_dispatch._C``: the kernels (``csrc/kernels``).

Beside them: :mod:`.header` (the operation header every launch compares), :mod:`.memory` (the
buffers peers map: CUDA IPC, shared memory), :mod:`.nvshmem` (the NVSHMEM world), and
:mod:`.experimental` (the staged internode pipeline, kept only to be timed against the default;
imported only where a Config selects it). Tests and benchmarks run the engines without a Buffer
through :mod:`moe_dispatch.testing.loopback` (a whole world in one process) and
:mod:`moe_dispatch.testing.ranks` (one rank per process, over the same Buffers).
"""

from .transport import KernelPlan, KernelTransport

__all__ = ["KernelPlan", "KernelTransport"]
