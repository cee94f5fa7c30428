"""The torch_dist transport's process groups and collectives: the sub-groups a rank joins
(inter-node, intra-node, all ranks; the argument checks run on the control plane's host group,
which on gloo is also the all-ranks group), an ``all_to_all_single`` started on one of them, and
the :class:`CommError` text of one that failed or timed out (the control plane's)."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from ...control import ControlPlane
from ...control.groups import Pending, new_group, retire
from ...errors import CommError
from ...topology import Topology

INTER, INTRA = "inter-node", "intra-node"

ALL_COMM = "all-ranks (comm thread)"  # the counts, flat payloads, gloo argument checks
HOST = "all-ranks (host, gloo)"  # the argument checks of an NCCL EP group: host ints, no device synchronisation


class Collectives:
    """One EP group's sub-groups and the collectives on them.

    Args:
        control: the EP group's control plane (its host group, progress records, messages).
        topology: this rank's place in the group.
        backend: the EP group's backend (``"gloo"`` or ``"nccl"``).

    Attributes:
        peers: the EP ranks of each group, by kind (:data:`INTER`, :data:`INTRA`,
            :data:`ALL_COMM`, :data:`HOST`).
        groups: the process group of each kind; None for a group of one (nothing moves).
            :data:`HOST` is the control plane's host group; on gloo :data:`ALL_COMM` is that
            same group (everything in the Buffer's queue on one ordered group).
        agree_kind: the group of the argument checks: :data:`ALL_COMM` on gloo (the checks'
            blocks may carry payload rows), :data:`HOST` on NCCL (host ints: a host read of the
            codes on NCCL would synchronise the device).

    Collective: construction creates the sub-groups and must be called by every rank of the EP
    group.
    """

    def __init__(self, control: ControlPlane, topology: Topology, backend: str):
        self.control = control
        self.topology = topology
        self.timeout_s = control.timeout_s
        group_ranks = control.group_ranks
        timeout = datetime.timedelta(seconds=control.timeout_s)
        everyone = list(range(topology.world_size))
        self.peers = {
            INTER: topology.peer_ranks(topology.local_rank),  # EP ranks, one per node
            INTRA: topology.node_ranks(topology.node),
            ALL_COMM: everyone,
            HOST: everyone,
        }
        gloo = str(backend) == "gloo"
        self.agree_kind = ALL_COMM if gloo else HOST
        # Only members create a sub-group (use_local_synchronization), so EP groups that are
        # themselves sub-groups of the world (Megatron) need no world-wide agreement. Our own
        # groups carry our timeout, whatever the caller's group has.
        self.groups = {
            kind: new_group([group_ranks[r] for r in ranks], timeout, str(backend)) if len(ranks) > 1 else None
            for kind, ranks in self.peers.items()
            if kind in (INTER, INTRA) or (kind == ALL_COMM and not gloo)
        }
        self._own = list(self.groups.values())
        self.groups[HOST] = control.group
        if gloo:
            self.groups[ALL_COMM] = control.group
        self.progress = control.progress

    def close(self) -> None:
        """Frees this transport's own sub-groups after every rank passed the control plane's
        barrier (on torch < 2.14 kept for the next transport on the same ranks). Local."""
        own, self._own = self._own, []
        retire(own, datetime.timedelta(seconds=self.timeout_s), idle=True)

    def release(self) -> None:
        """Frees the sub-groups :meth:`close` did not (local, no collective). Idempotent."""
        own, self._own = self._own, []
        retire(own, datetime.timedelta(seconds=self.timeout_s), idle=False)

    def describe(self, kind: str, what: str, err: Exception) -> str:
        """The CommError text of a collective on the ``kind`` group (the control plane's)."""
        return self.control.describe(self.peers[kind], what, err)

    def all_to_all(
        self,
        send: torch.Tensor,
        send_splits: list[int] | None,
        recv_splits: list[int] | None,
        kind: str,
        what: str,
        recv: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, Pending | None]:
        """Starts ``all_to_all_single`` on the ``kind`` group (equal splits when None) into
        ``recv`` (contiguous, allocated when None). In a group of one the rows are already this
        rank's: ``send`` itself comes back (no ``recv`` then).

        Raises:
            CommError: the collective could not start (naming the operation and the peers).
        """
        group = self.groups[kind]
        if group is None:
            assert recv is None, "a group of one receives nothing: its caller skips the copy"
            return send, None
        if recv is None:
            rows = sum(recv_splits) if recv_splits is not None else send.shape[0]
            recv = send.new_empty((rows, *send.shape[1:]))

        def describe(err):
            return self.describe(kind, f"{what} ({kind} all_to_all)", err)

        try:
            work = dist.all_to_all_single(recv, send, recv_splits, send_splits, group=group, async_op=True)
        except RuntimeError as err:
            raise CommError(describe(err)) from err
        return recv, Pending(work, describe)
