"""Process groups of the control plane and the transports: made by their members only, with our
timeout, reused where torch would misname a new one, and destroyed without a collective; plus
the one collective in flight (:class:`Pending`), whose failure becomes a ``CommError``.

c10d names a group made with ``use_local_synchronization`` after its ranks and a count of the
groups this process has made: members whose counts differ (one made a Buffer on a group the
others are not in) would name the same group differently and deadlock in ``new_group``. A
``Buffer()``'s ranks post their counts when they agree their arguments and all continue from the
largest (:func:`group_count`, :func:`align_group_count`).
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from ..errors import CommError

# torch < 2.14 names a group made with use_local_synchronization after its ranks and the number of
# live groups, so a group made after a destroyed one on the same ranks gets the dead group's name and
# reads its stale rendezvous keys (gloo connects to closed ports and times out). There a closed
# Buffer hands its idle groups to the next one on the same ranks instead of destroying them, and a
# Buffer dropped without close() keeps its groups (its peers may still be using theirs).
NAMES_REUSED = tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 14)
_spare_groups: dict[tuple, list[dist.ProcessGroup]] = {}


def new_group(ranks: list[int], timeout: datetime.timedelta, backend: str) -> dist.ProcessGroup:
    """A process group of the global ``ranks``, made by its members only (collective over them):
    on torch < 2.14 a spare one a closed Buffer left on the same ranks, if any. Every member
    closed that Buffer at the same point of its program, so all find the same spares."""
    spares = _spare_groups.get((tuple(ranks), backend, timeout), []) if NAMES_REUSED else []
    while spares:
        group = spares.pop()
        if group in dist.distributed_c10d._world.pg_map:  # not gone with a destroyed world
            return group
    return dist.new_group(ranks, timeout=timeout, backend=backend, use_local_synchronization=True)


def retire(groups: list[dist.ProcessGroup | None], timeout: datetime.timedelta, idle: bool) -> None:
    """Frees ``groups`` locally (no collective). ``idle``: every member passed a barrier after
    its last collective on them, so on torch < 2.14 they are kept for the next Buffer on the same
    ranks (:func:`new_group`); otherwise, or on newer torch, destroyed (not kept while a peer
    may still use its side: on torch < 2.14 they are then left alone)."""
    for group in groups:
        if group is None or not dist.is_initialized():
            continue
        if NAMES_REUSED:
            if idle:
                key = (tuple(dist.get_process_group_ranks(group)), str(dist.get_backend(group)), timeout)
                _spare_groups.setdefault(key, []).append(group)
            continue
        try:
            dist.destroy_process_group(group)
        except (RuntimeError, ValueError):  # already gone with the world's teardown
            pass


@contextlib.contextmanager
def setup_group(ranks: list[int], timeout: datetime.timedelta, backend: str) -> Iterator[dist.ProcessGroup]:
    """A group of the global ``ranks`` (:func:`new_group`) for a collective set-up only, retired
    when the block ends: as idle when it ends normally, so the block must end with a barrier of a
    group holding every member, after its last collective on this one; not idle when it raises."""
    group = new_group(ranks, timeout, backend)
    try:
        yield group
    except BaseException:
        retire([group], timeout, idle=False)
        raise
    retire([group], timeout, idle=True)


class Pending:
    """One in-flight collective; :meth:`wait` turns a failure or timeout into :class:`CommError`
    with the text ``describe(err)`` gives."""

    def __init__(self, work, describe: Callable[[Exception], str]):
        self.work, self.describe = work, describe

    def wait(self) -> None:
        try:
            self.work.wait()
        except RuntimeError as err:  # gloo raises on timeout and on a lost peer
            raise CommError(self.describe(err)) from err


def group_count() -> int | None:
    """How many groups c10d has made in this process (None where torch keeps no such count)."""
    return getattr(getattr(dist.distributed_c10d, "_world", None), "group_count", None)


def align_group_count(count: int | None) -> None:
    """Continues c10d's group count from ``count`` (the largest any rank posted)."""
    if count is not None and group_count() is not None:
        dist.distributed_c10d._world.group_count = count
