"""A simulated multi-node cluster on one machine, for the benchmark and the fault drills.

Nodes are Linux network namespaces joined by a software switch; each node's uplink is shaped
with ``tc`` (the slow inter-node network), while the ranks of one node talk over the node's
loopback (the fast intra-node fabric). Modules:

- ``cluster``: :class:`SimCluster` (namespaces, links, rank processes, teardown, leftovers).
- ``rank``: what each rank process runs (link probe + ``moe_dispatch.tools.bench``, or the fault loop).
- ``faults``: the two fault scenarios (link cut during dispatch, rank killed during combine).
- ``report``: summary table, goal line, JSON, PNG chart.
- ``__main__``: the command line (``python -m benchmarks.simcluster --help``).
"""

from .cluster import SetupError, SimCluster, missing_requirements, sweep_leftovers

__all__ = ["SetupError", "SimCluster", "missing_requirements", "sweep_leftovers"]
