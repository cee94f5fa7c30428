"""The control plane of one Buffer's EP group: what every transport uses besides moving rows.

- a host group: gloo, all EP ranks, our timeout (host ints only: on an NCCL EP group a host
  read of the check codes would synchronise the device). The argument checks and the kernels'
  buffer set-up run on it; the torch_dist transport on gloo also moves its counts and small
  payloads on it (one ordered group per Buffer for everything that runs in the Buffer's queue);
- argument checks (:meth:`ControlPlane.check`): one equal-split exchange of every rank's row
  (:mod:`.agreement`), so ranks running different operations compare their first field instead
  of aborting in a collective of mismatched sizes;
- progress marks (:class:`~.progress.Progress`): which operation each rank has reached, for
  the messages of failures and timeouts (:meth:`ControlPlane.describe`).
"""

from __future__ import annotations

import datetime
import functools

import torch
import torch.distributed as dist

from ..errors import CommError
from ..topology import Topology
from . import agreement
from .agreement import AGREE_WORDS, Field
from .groups import Pending, new_group, retire
from .progress import Progress


class ControlPlane:
    """Process groups, argument checks and progress marks of one EP group (module docstring).

    Args:
        group: the EP process group (gloo or NCCL).
        topology: this rank's place in the group.
        timeout_s: bound on every collective of the host group, in seconds.

    Attributes:
        progress: the group's :class:`~.progress.Progress` records.
        group: the host group (gloo, all EP ranks), or None in a group of one.
        ep_group: the EP process group itself.
        group_ranks: the EP group's global ranks.
        backend: the EP group's backend (``"gloo"``, ``"nccl"``).

    Collective: construction (the host group) and :meth:`barrier`; :meth:`close` and
    :meth:`release` are local.
    """

    def __init__(self, group: dist.ProcessGroup, topology: Topology, timeout_s: float):
        self.topology, self.timeout_s = topology, timeout_s
        self.ep_group = group
        self.group_ranks = dist.get_process_group_ranks(group)
        self.backend = str(dist.get_backend(group))
        self.progress = Progress(self.group_ranks, topology.rank)
        self._timeout = datetime.timedelta(seconds=timeout_s)
        # Only members create it (use_local_synchronization): EP groups that are themselves
        # sub-groups of the world (Megatron) need no world-wide agreement.
        self.group = new_group(self.group_ranks, self._timeout, "gloo") if topology.world_size > 1 else None

    # -- argument checks ----------------------------------------------------------------------
    def check(self, fields: dict[str, Field], what: str, status: int = 0):
        """Steps comparing ``fields`` (the operation first, at most ``agreement.AGREE_FIELDS``,
        the same keys on every rank) and every rank's ``status`` (0, or this rank's refusal: its
        fields are then -1 and its text was posted with ``progress.post_refusal``): one exchange
        of :data:`~.agreement.AGREE_WORDS` words per rank on the host group, then
        :func:`.agreement.check` on every rank.

        Raises (from the steps):
            ValueError: naming each refusing rank (quoting its error), or the first field and
                the EP ranks that differ from this rank.
            CommError: a peer failed or did not join within ``timeout_s``.
        """
        row = agreement.row(fields, status, AGREE_WORDS)
        if self.group is None:
            self.verify([row], fields, what)
            return
        world = self.topology.world_size
        send = torch.tensor([row] * world, dtype=torch.int64).view(torch.uint8).view(-1)
        recv, pending = self.exchange(send, f"{what} argument check")
        yield pending
        self.verify(recv.view(torch.int64).view(world, -1).tolist(), fields, what)

    def verify(self, rows: list[list[int]], fields: dict[str, Field], what: str) -> None:
        """Every rank's ``[status, field codes...]`` row checked (:func:`.agreement.check`); a
        refusing rank's text is read from the store for the operation this thread is in.

        Raises:
            ValueError: a rank refused, or a field differs between ranks.
        """
        seq = self.progress.current_seq()
        agreement.check(
            rows,
            fields,
            rank=self.topology.rank,
            what=what,
            refusals=lambda ranks: self.progress.read_refusals(ranks, seq),
        )

    def exchange(self, send: torch.Tensor, what: str) -> tuple[torch.Tensor, Pending]:
        """Starts an equal-split ``all_to_all_single`` of ``send`` (CPU, one equal block per rank)
        on the host group; returns ``(recv, pending)``.

        Raises:
            CommError: the collective could not start (naming the operation and the peers).
        """
        recv = torch.empty_like(send)
        describe = functools.partial(self.describe, self.peers(), what)
        try:
            work = dist.all_to_all_single(recv, send, group=self.group, async_op=True)
        except RuntimeError as err:
            raise CommError(describe(err)) from err
        return recv, Pending(work, describe)

    # -- failures -----------------------------------------------------------------------------
    def peers(self) -> list[int]:
        """Every EP rank but this one."""
        return [r for r in range(self.topology.world_size) if r != self.topology.rank]

    def describe(self, peers: list[int], what: str, err: Exception) -> str:
        """The CommError text of a collective that failed or timed out: this rank and node, the
        operation, timeout or failure, the peers it waited for with their nodes, and which of them
        had not reached the operation (gloo does not say which one it missed; the progress marks
        know)."""
        topo = self.topology
        others = [r for r in peers if r != topo.rank]
        timed_out = "timed out" in str(err).lower()
        how = f"timed out after timeout_s={self.timeout_s:g}" if timed_out else "failed"
        return (
            f"EP rank {topo.rank} (node {topo.node}): {what} {how} waiting for EP ranks {others} "
            f"(nodes {[r // topo.ranks_per_node for r in others]})"
            f"{self.progress.describe_peers(others, lost=not timed_out)}: {err}"
        )

    # -- teardown -----------------------------------------------------------------------------
    def barrier(self, what: str = "close (barrier)") -> None:
        """Waits on the host group until every rank got here (collective).

        Raises:
            CommError: a peer did not get here within ``timeout_s``.
        """
        if self.group is None:
            return
        describe = functools.partial(self.describe, self.peers(), what)
        try:
            work = dist.barrier(group=self.group, async_op=True)
        except RuntimeError as err:
            raise CommError(describe(err)) from err
        Pending(work, describe).wait()

    def close(self, idle: bool = True) -> None:
        """Frees the host group (kept for the next Buffer on the same ranks where ``idle`` and
        torch < 2.14: :func:`.groups.retire`), ends the progress writer and removes this rank's
        store keys. Local; ``idle``: every rank passed a :meth:`barrier` after its last
        collective. Idempotent."""
        group, self.group = self.group, None
        retire([group], self._timeout, idle)
        self.progress.close()

    def release(self) -> None:
        """:meth:`close` for a Buffer whose peers may still use their side (broken or dropped)."""
        self.close(idle=False)
