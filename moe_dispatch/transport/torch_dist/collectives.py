"""The torch_dist transport's process groups and collectives: the sub-groups a rank joins
(inter-node, intra-node, all ranks; on NCCL also a gloo group of all ranks for the argument
checks), an ``all_to_all_single`` started on one of them, and the :class:`CommError` text of one
that failed or timed out (which peers had not reached it: :class:`Progress`)."""

from __future__ import annotations

import datetime
import functools

import torch
import torch.distributed as dist

from ...errors import CommError
from ...topology import Topology
from ..progress import Progress

INTER, INTRA = "inter-node", "intra-node"

ALL_COMM = "all-ranks (comm thread)"  # the counts, flat payloads, gloo argument checks
HOST = "all-ranks (host, gloo)"  # the argument checks of an NCCL EP group: host ints, no device synchronisation


# torch < 2.14 names a group made with use_local_synchronization after its ranks and the number of
# live groups, so a group made after a destroyed one on the same ranks gets the dead group's name and
# reads its stale rendezvous keys (gloo connects to closed ports and times out). There close() hands
# its idle groups to the next transport on the same ranks instead of destroying them, and a Buffer
# dropped without close() keeps its groups (its peers may still be using theirs).
_NAMES_REUSED = tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 14)
_spare_groups: dict[tuple, list[dist.ProcessGroup]] = {}


def _new_group(ranks: list[int], timeout: datetime.timedelta, backend: str) -> dist.ProcessGroup:
    """A process group of the global ``ranks``, made by its members only (collective over them):
    on torch < 2.14 a spare one a closed transport left on the same ranks, if any. Every member
    closed that transport at the same point of its program, so all find the same spares."""
    spares = _spare_groups.get((tuple(ranks), backend, timeout), []) if _NAMES_REUSED else []
    while spares:
        group = spares.pop()
        if group in dist.distributed_c10d._world.pg_map:  # not gone with a destroyed world
            return group
    return dist.new_group(ranks, timeout=timeout, backend=backend, use_local_synchronization=True)


class Pending:
    """One in-flight collective; :meth:`wait` turns a failure or timeout into :class:`CommError`."""

    def __init__(self, work, describe):
        self.work, self.describe = work, describe

    def wait(self) -> None:
        try:
            self.work.wait()
        except RuntimeError as err:  # gloo raises on timeout and on a lost peer
            raise CommError(self.describe(err)) from err


class Collectives:
    """One EP group's sub-groups and the collectives on them.

    Args:
        group: the EP process group (gloo or NCCL).
        topology: this rank's place in the group.
        timeout_s: bound on every collective, in seconds (the sub-groups carry it, whatever
            ``group`` has).
        progress: where every rank is, for the messages of :meth:`describe`.

    Attributes:
        peers: the EP ranks of each group, by kind (:data:`INTER`, :data:`INTRA`,
            :data:`ALL_COMM`, and :data:`HOST` on NCCL).
        groups: the process group of each kind; None for a group of one (nothing moves).
        agree_kind: the group of the argument checks: :data:`ALL_COMM` on gloo, :data:`HOST` on
            NCCL (host ints: a host read of the codes on NCCL would synchronise the device).

    Collective: construction creates the sub-groups and must be called by every rank of
    ``group``.
    """

    def __init__(self, group: dist.ProcessGroup, topology: Topology, timeout_s: float, progress: Progress):
        self.topology = topology
        self.timeout_s = timeout_s
        self.progress = progress
        group_ranks = dist.get_process_group_ranks(group)
        backend = dist.get_backend(group)
        timeout = datetime.timedelta(seconds=timeout_s)
        self.peers = {
            INTER: topology.peer_ranks(topology.local_rank),  # EP ranks, one per node
            INTRA: topology.node_ranks(topology.node),
            ALL_COMM: list(range(topology.world_size)),
        }
        # The argument checks move host ints: over the comm thread's group on gloo, else over a
        # gloo group of their own (on NCCL a host read of the codes would synchronise the device).
        gloo = str(backend) == "gloo"
        self.agree_kind = ALL_COMM if gloo else HOST
        if not gloo:
            self.peers[HOST] = list(range(topology.world_size))
        # Only members create a sub-group (use_local_synchronization), so EP groups that are
        # themselves sub-groups of the world (Megatron) need no world-wide agreement. Our own
        # groups carry our timeout, whatever the caller's group has.
        self.groups = {
            kind: (
                _new_group([group_ranks[r] for r in ranks], timeout, "gloo" if kind == HOST else str(backend))
                if len(ranks) > 1
                else None
            )
            for kind, ranks in self.peers.items()
        }

    def close(self) -> None:
        """Waits at a barrier on the argument checks' group until every rank's last collective is
        done; on torch < 2.14 then keeps the idle groups for the next transport on the same ranks
        (collective: every rank, after its last operation).

        Raises:
            CommError: a peer did not reach the barrier within ``timeout_s``.
        """
        group = self.groups.get(self.agree_kind)
        if group is not None:
            describe = functools.partial(self.describe, self.agree_kind, "close (barrier)")
            try:
                work = dist.barrier(group=group, async_op=True)
            except RuntimeError as err:
                raise CommError(describe(err)) from err
            Pending(work, describe).wait()
        if _NAMES_REUSED:  # every rank passed the barrier: the groups are idle on every rank
            timeout = datetime.timedelta(seconds=self.timeout_s)
            for group in self.groups.values():
                if group is not None:
                    key = (tuple(dist.get_process_group_ranks(group)), str(dist.get_backend(group)), timeout)
                    _spare_groups.setdefault(key, []).append(group)
            self.groups = {}

    def release(self) -> None:
        """Destroys the groups :meth:`close` did not keep (local, no collective). Idempotent."""
        groups, self.groups = self.groups, {}
        for group in groups.values():
            if group is not None and dist.is_initialized() and not _NAMES_REUSED:
                try:
                    dist.destroy_process_group(group)
                except (RuntimeError, ValueError):  # already gone with the world's teardown
                    pass

    def describe(self, kind: str, what: str, err: Exception) -> str:
        """The CommError text: this rank and node, the operation, timeout or failure, the peers
        it waited for with their nodes, and which of them had not reached the operation (gloo
        does not say which one it missed; :class:`Progress` knows)."""
        topo = self.topology
        others = [r for r in self.peers[kind] if r != topo.rank]
        timed_out = "timed out" in str(err).lower()
        how = f"timed out after timeout_s={self.timeout_s:g}" if timed_out else "failed"
        return (
            f"EP rank {topo.rank} (node {topo.node}): {what} {how} waiting for EP ranks {others} "
            f"(nodes {[r // topo.ranks_per_node for r in others]})"
            f"{self.progress.describe_peers(others, lost=not timed_out)}: {err}"
        )

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
