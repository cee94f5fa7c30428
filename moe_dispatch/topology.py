"""Where each rank sits: W ranks = N nodes x L local ranks (rank r = node r // L, local r % L)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Topology:
    """Node layout of an expert-parallel world.

    Attributes:
        rank: this process's rank in the EP group, in ``[0, world_size)``.
        world_size: W, number of EP ranks.
        ranks_per_node: L, ranks that share one NVLink domain (GPUs of one node); a CPU world
            may declare any divisor of W to exercise the hierarchy.

    Raises:
        ValueError: ``world_size`` not divisible by ``ranks_per_node``, or ``rank`` out of range.
    """

    rank: int
    world_size: int
    ranks_per_node: int

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.ranks_per_node < 1 or self.world_size % self.ranks_per_node != 0:
            raise ValueError(
                f"ranks_per_node must divide the world size {self.world_size}, got "
                f"ranks_per_node={self.ranks_per_node}; set ranks_per_node (or LOCAL_WORLD_SIZE) "
                f"to the number of ranks per node"
            )
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {self.rank}")

    @property
    def num_nodes(self) -> int:
        """N, the number of nodes."""
        return self.world_size // self.ranks_per_node

    @property
    def node(self) -> int:
        """This rank's node index (its rdma rank)."""
        return self.rank // self.ranks_per_node

    @property
    def local_rank(self) -> int:
        """This rank's index inside its node (its nvl rank)."""
        return self.rank % self.ranks_per_node

    def node_ranks(self, node: int) -> list[int]:
        """Global ranks of ``node``, ascending (one intra-node/NVLink group)."""
        return list(range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node))

    def peer_ranks(self, local_rank: int) -> list[int]:
        """Global ranks with local index ``local_rank`` on every node (one inter-node/RDMA group)."""
        return list(range(local_rank, self.world_size, self.ranks_per_node))
