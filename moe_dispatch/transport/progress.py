"""Which operation each EP rank of a Buffer has reached, kept in torch.distributed's store, so
that a timed-out or failed collective can name the rank it is waiting for (gloo and NCCL only
say that the collective failed, not which peer is missing).

Every operation of a Buffer gets a sequence number, the same on every rank (operations are
collective and issued in the same order everywhere). When a thread of a rank starts one, it
writes ``"<seq> <what>"`` under its own key (the caller's thread for a fresh dispatch's
metadata, the communication thread/stream for the payloads). On a failure the waiting rank
reads its peers' keys: a peer whose latest number is below the one it waits in has not reached
that operation (absent, hung, dead before it, or busy elsewhere).

The store may be unreachable exactly when this matters (a cut link, its host dead), and its
calls block until the store's own timeout, so no store call runs on a thread that moves data:
a daemon writer thread sends the latest value of each key, at most every
:data:`FLUSH_INTERVAL_S` (a store round trip per operation would cost more than small
operations themselves), and the read on failure waits for an answer at most
:data:`READ_TIMEOUT_S`. A failure within that interval of a peer's last operation may see its
previous one.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import threading
import time

import torch.distributed as dist

READ_TIMEOUT_S = 2.0
FLUSH_INTERVAL_S = 0.05
# Progress objects made in this process per group: the n-th on a group is the n-th on every rank
# of it (Buffers are created collectively), whatever Buffers of other groups came before.
_MADE_PER_GROUP: dict[str, itertools.count] = collections.defaultdict(itertools.count)


class Progress:
    """The progress keys of one Buffer's EP group.

    Args:
        group_ranks: the group's global ranks (names the group in the store, so Buffers of
            different EP groups never share keys; Buffers of one group are told apart by
            their creation order on it).
        rank: this rank's index in the group.

    Recording never raises: without a reachable store (a custom process group, or the store's
    host gone) it stops and failures are described without it.
    """

    def __init__(self, group_ranks: list[int], rank: int):
        try:
            self._store = dist.distributed_c10d._get_default_store()
        except (RuntimeError, ValueError, AttributeError):
            self._store = None
        group = hashlib.sha1(",".join(map(str, group_ranks)).encode()).hexdigest()[:12]
        self._prefix = f"moe_dispatch/progress/{group}/{next(_MADE_PER_GROUP[group])}"
        self._rank = rank
        self._current = threading.local()  # per thread: the operation it is in
        self._unsent: dict[str, str] = {}  # key -> latest value, for the writer thread
        self._wake = threading.Condition()
        self._writer: threading.Thread | None = None

    def _key(self, rank: int, thread: str) -> str:
        return f"{self._prefix}/{rank}/{thread}"

    def mark(self, thread: str, seq: int, what: str) -> None:
        """Records that this rank's ``thread`` ("caller" or "comm") started operation ``seq``."""
        self._current.op = (seq, what)
        if self._store is None:
            return
        with self._wake:
            self._unsent[self._key(self._rank, thread)] = f"{seq} {what}"
            self._wake.notify()
            if self._writer is None:
                self._writer = threading.Thread(target=self._write, name="moe_dispatch-progress", daemon=True)
                self._writer.start()

    def _write(self) -> None:
        while True:
            with self._wake:
                while not self._unsent:
                    self._wake.wait()
                batch, self._unsent = self._unsent, {}
            try:
                for key, value in batch.items():
                    self._store.set(key, value)
            except Exception:  # noqa: BLE001 - a lost store only costs the diagnostic
                self._store = None
                return
            time.sleep(FLUSH_INTERVAL_S)  # later marks meanwhile coalesce into one write per key

    def describe_peers(self, peers: list[int]) -> str:
        """For the operation the calling thread is in: which of ``peers`` have not reached it,
        and where they are; "" when unknown (no store, or no operation marked)."""
        op = getattr(self._current, "op", None)
        if self._store is None or op is None:
            return ""
        answer: list[str] = []
        reader = threading.Thread(target=lambda: answer.append(self._read(peers, *op)), daemon=True)
        reader.start()
        reader.join(READ_TIMEOUT_S)
        if not answer:
            return f"; which peer is missing is unknown (the store did not answer within {READ_TIMEOUT_S:g} s)"
        return answer[0]

    def _read(self, peers: list[int], seq: int, what: str) -> str:
        behind, elsewhere = [], []
        try:
            for peer in peers:
                latest = None
                for thread in ("caller", "comm"):
                    key = self._key(peer, thread)
                    if self._store.check([key]):
                        num, _, label = self._store.get(key).decode().partition(" ")
                        if latest is None or int(num) > latest[0]:
                            latest = (int(num), label)
                if latest is None:
                    behind.append(f"{peer} (no operation of this Buffer yet)")
                elif latest[0] < seq:
                    behind.append(f"{peer} (last at #{latest[0]} {latest[1]})")
                elif latest[0] == seq and _kind(latest[1]) != _kind(what):
                    elsewhere.append(f"{peer} ({latest[1]})")
        except Exception:  # noqa: BLE001 - the store's host may be the rank that died
            return ""
        if behind:
            return f"; not yet at this operation (#{seq} {what}): EP rank {', EP rank '.join(behind)}"
        if elsewhere:
            return (
                f"; at this operation (#{seq} {what}) but running it differently: EP rank "
                f"{', EP rank '.join(elsewhere)} (every rank must pass the same arguments, num_worst_tokens "
                f"given or not included)"
            )
        return f"; every peer reached this operation (#{seq} {what}), so one failed or was cut off inside it"


def _kind(what: str) -> str:
    """The operation without the sized dispatch's metadata step, which its payload continues."""
    return what.removesuffix(" (metadata)")
