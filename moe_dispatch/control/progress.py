"""A Buffer's records in torch.distributed's store: which operation each EP rank has reached
(progress marks), why a rank refused a call (refusals), and that a rank saw a collective fail
(failure notes). With them a failed or timed-out collective names the rank it is missing (gloo
and NCCL only say that the collective failed, not which peer is gone), and the peers of a
rank that refused a call can quote its error.

Every operation of a Buffer gets a sequence number, the same on every rank (operations are
collective and issued in the same order everywhere). When a thread of a rank starts one, it
marks ``"<seq> <what>"`` under its own key (the caller's thread for a fresh dispatch's
metadata, the communication thread/stream for the payloads).

The store may be unreachable exactly when this matters (a cut link, its host dead), and its
calls block until the store's own timeout, so no store call runs unbounded on a thread that
moves data: a writer thread sends the latest mark of each key, at most every
:data:`FLUSH_INTERVAL_S` (a store round trip per operation would cost more than small
operations themselves), and every other call (a refusal's text, a failure note, the reads on
a failure) runs on a helper thread that is waited for at most :data:`READ_TIMEOUT_S`.

Diagnosis. A rank whose collective fails notes it (``failed``), then (after a lost connection;
a timeout waited long enough already) reads the peers' records until at most one peer is
unaccounted for, for at most :data:`SETTLE_S`, so that its live peers' latest marks and notes
reach the store (their writer threads may run late on a loaded machine). A peer that noted a failure in this
operation, or marked a later one, is alive; after a lost connection the peers that did neither
are the suspects (a dead rank can do neither), and a peer whose latest mark is below the
operation has not reached it. When the store itself fails because its host died (global rank
0 with ``tcp://`` and ``env://`` initialisation), the message says that the store died with
that rank.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time

from .store import READ_TIMEOUT_S, bounded, default_store, group_key

FLUSH_INTERVAL_S = 0.05
IDLE_INTERVALS = 20  # flush intervals without a mark after which the writer sleeps until the next one
# How long a diagnosis after a lost connection waits for the live peers' notes and marks: many times
# FLUSH_INTERVAL_S plus a store round trip, so that it holds with a loaded machine's late threads;
# it ends as soon as at most one peer is unaccounted for (the usual case: one rank died).
SETTLE_S = 2.0
REFUSAL_SLOTS = 8  # a rank's refusal texts rotate over this many keys (read by seq, so a quick next refusal keeps it)
# Progress objects made in this process per group: the n-th on a group is the n-th on every rank
# of it (Buffers are created collectively), whatever Buffers of other groups came before.
_MADE_PER_GROUP: dict[str, itertools.count] = collections.defaultdict(itertools.count)


def _latest(store, key: str) -> tuple[int, str] | None:
    """``(seq, label)`` stored as ``"<seq> <label>"`` under ``key``, or None when absent."""
    if not store.check([key]):
        return None
    num, _, label = store.get(key).decode().partition(" ")
    return int(num), label


class Progress:
    """The store records of one Buffer's EP group.

    Args:
        group_ranks: the group's global ranks (names the group in the store, so Buffers of
            different EP groups never share keys; Buffers of one group are told apart by
            their creation order on it).
        rank: this rank's index in the group.

    Recording never raises: without a reachable store (a custom process group, or the store's
    host gone) it stops and failures are described without it. :meth:`close` removes this
    rank's keys and ends the writer thread.
    """

    def __init__(self, group_ranks: list[int], rank: int):
        self._store = default_store()
        self._store_error: Exception | None = None  # the store failed: recording stops
        group = group_key(group_ranks)
        self._prefix = f"moe_dispatch/progress/{group}/{next(_MADE_PER_GROUP[group])}"
        self._rank, self._world_size = rank, len(group_ranks)
        self._store_host = group_ranks.index(0) if 0 in group_ranks else None  # EP rank of global rank 0
        self._current = threading.local()  # per thread: the operation it is in
        self._latest: dict[str, str] = {}  # key -> latest mark, set by the marking threads without a lock
        self._sent: dict[str, str] = {}  # key -> what the writer last stored
        self._written: set[str] = set()  # this rank's keys in the store, removed by close()
        self._wake = threading.Condition()
        self._idle = False  # the writer sleeps until a mark wakes it (after IDLE_INTERVALS without one)
        self._writer: threading.Thread | None = None
        self._closing = False

    def _key(self, rank: int, name: str) -> str:
        return f"{self._prefix}/{rank}/{name}"

    def current_seq(self) -> int | None:
        """The operation the calling thread last marked, or None."""
        op = getattr(self._current, "op", None)
        return None if op is None else op[0]

    # -- writing ---------------------------------------------------------------------------
    def mark(self, thread: str, seq: int, what: str) -> None:
        """Records that this rank's ``thread`` ("caller" or "comm") started operation ``seq``."""
        self._current.op = (seq, what)
        if self._store is None or self._store_error is not None:
            return
        # One dict item set (atomic under the GIL), no lock: the writer stores the latest value
        # at its next interval. Only a writer gone idle is woken (it re-checks after going idle).
        self._latest[self._key(self._rank, thread)] = f"{seq} {what}"
        if self._idle or self._writer is None:
            with self._wake:
                if self._closing:
                    return
                self._wake.notify()
                if self._writer is None:
                    self._writer = threading.Thread(target=self._write, name="moe_dispatch-progress", daemon=True)
                    self._writer.start()

    def _changed(self) -> dict[str, str]:
        return {key: value for key, value in list(self._latest.items()) if self._sent.get(key) != value}

    def _write(self) -> None:
        quiet = 0  # intervals in a row without a new mark
        while True:
            with self._wake:
                if quiet >= IDLE_INTERVALS:
                    self._idle = True
                    while not self._closing and not self._changed():
                        self._wake.wait()
                    self._idle, quiet = False, 0
                else:  # marks meanwhile coalesce into one write per key
                    self._wake.wait_for(lambda: self._closing, FLUSH_INTERVAL_S)
                closing = self._closing
            batch = self._changed()
            quiet = 0 if batch else quiet + 1
            try:
                for key, value in batch.items():
                    self._store.set(key, value)
                    self._sent[key] = value
                    self._written.add(key)
            except Exception as err:  # noqa: BLE001 - a lost store only costs the diagnostic
                self._store_error = err
                return
            if closing:
                self._remove_keys()
                return

    def _post(self, name: str, seq: int, text: str) -> None:
        """Stores ``"<seq> <text>"`` under this rank's key ``name`` now (bounded)."""
        store = self._store
        if store is None or self._store_error is not None:
            return
        key = self._key(self._rank, name)
        self._written.add(key)
        ok, err = bounded(lambda: store.set(key, f"{seq} {text}"))
        if not ok and err is not None:
            self._store_error = err

    def post_refusal(self, seq: int, text: str) -> None:
        """Stores why this rank refuses operation ``seq`` (its error's text), before it takes
        part in the operation's check, so the peers can quote it once the check is done."""
        self._post(f"refused/{seq % REFUSAL_SLOTS}", seq, text)

    def read_refusals(self, ranks: list[int], seq: int | None) -> dict[int, str]:
        """The texts ``ranks`` posted for refusing operation ``seq`` (bounded; missing when the
        store did not answer)."""
        store = self._store
        if store is None or self._store_error is not None or not ranks or seq is None:
            return {}

        def read():
            texts = {}
            for rank in ranks:
                got = _latest(store, self._key(rank, f"refused/{seq % REFUSAL_SLOTS}"))
                if got is not None and got[0] == seq:
                    texts[rank] = got[1]
            return texts

        ok, texts = bounded(read)
        return texts if ok else {}

    def _remove_keys(self) -> None:
        store, keys, self._written = self._store, list(self._written), set()
        if store is not None and self._store_error is None and keys:
            bounded(lambda: [store.delete_key(key) for key in keys])

    def close(self) -> None:
        """Ends the writer thread and removes this rank's keys (each bounded by READ_TIMEOUT_S)."""
        with self._wake:
            self._closing = True
            self._wake.notify()
            writer = self._writer
        if writer is not None and writer.is_alive():
            writer.join(READ_TIMEOUT_S)
        else:
            self._remove_keys()

    # -- reading on a failure ----------------------------------------------------------------
    def describe_peers(self, peers: list[int], lost: bool = False) -> str:
        """For the operation the calling thread is in: where ``peers`` (the EP ranks it waited
        for) and, after a lost connection (``lost``), which rank most likely died; "" when
        unknown (no store, or no operation marked). Notes this rank's own failure first."""
        op = getattr(self._current, "op", None)
        if self._store is None or op is None:
            return ""
        seq, what = op
        self._post("failed", seq, what)
        if self._store_error is not None:
            return self._store_gone(self._store_error)
        deadline = time.monotonic() + SETTLE_S
        while True:
            ok, states = bounded(self._read_states)
            if not ok:
                return self._store_gone(states)
            # After a timeout the peers' records had timeout_s to land; after a lost connection
            # the live peers' notes may still be on their way.
            if not lost or len(_suspects(states, seq)) <= 1 or time.monotonic() >= deadline:
                return _describe(states, peers, seq, what, lost)
            time.sleep(FLUSH_INTERVAL_S)

    def _read_states(self) -> dict[int, tuple]:
        """Every other rank's ``(latest mark, failure note)``, each ``(seq, label)`` or None."""
        states = {}
        for rank in range(self._world_size):
            if rank != self._rank:
                marks = [m for t in ("caller", "comm") if (m := _latest(self._store, self._key(rank, t)))]
                states[rank] = (max(marks, default=None), _latest(self._store, self._key(rank, "failed")))
        return states

    def _store_gone(self, err: Exception | None) -> str:
        how = f"failed ({err})" if err is not None else f"did not answer within {READ_TIMEOUT_S:g} s"
        if self._store_host is None:
            return (
                f"; which peer is missing is unknown: the store {how} (its host, global rank 0, is not in this group)"
            )
        if err is None:
            return (
                f"; which peer is missing is unknown: the store {how} (its host is global rank 0, EP rank "
                f"{self._store_host}: dead, or the store is overloaded)"
            )
        return (
            f"; the store {how}: it lived in the process of global rank 0 (EP rank {self._store_host}), so the "
            f"store died with rank 0: EP rank {self._store_host} is gone"
        )


def _describe(states: dict[int, tuple], peers: list[int], seq: int, what: str, lost: bool) -> str:
    """The diagnosis of :meth:`Progress.describe_peers` from the peers' records."""

    def where(rank: int) -> str:
        mark = states[rank][0]
        # close() deletes a rank's marks with its other store keys: no mark is also a closed Buffer
        return "no operation of this Buffer yet, or closed it" if mark is None else f"last at #{mark[0]} {mark[1]}"

    failed = _failed(states, seq)
    parts = []
    if lost:
        suspects = _suspects(states, seq)
        if len(suspects) == 1:
            parts.append(
                f"the connection to a peer was lost, and EP rank {suspects[0]} ({where(suspects[0])}) is the only "
                "peer that neither failed in this operation nor passed it: most likely it died (see its exit code)"
            )
        elif suspects:
            listed = ", ".join(f"{r} ({where(r)})" for r in suspects)
            parts.append(
                f"the connection to a peer was lost; the peers that neither failed in this operation nor passed it "
                f"are EP ranks {listed}: one of them most likely died, the others wait"
            )
    marks = {r: states[r][0] for r in peers}
    behind = [r for r, mark in marks.items() if r not in failed and (mark is None or mark[0] < seq)]
    elsewhere = [r for r, mark in marks.items() if mark and mark[0] == seq and _kind(mark[1]) != _kind(what)]
    if behind and not lost:
        listed = ", EP rank ".join(f"{r} ({where(r)})" for r in behind)
        parts.append(f"not yet at this operation (#{seq} {what}): EP rank {listed}")
    if elsewhere:
        parts.append(
            f"at this operation (#{seq} {what}) but running it differently: EP rank "
            + ", EP rank ".join(f"{r} ({marks[r][1]})" for r in elsewhere)
            + " (every rank must pass the same arguments, num_worst_tokens included)"
        )
    if failed:
        parts.append(f"EP ranks {failed} failed in this operation too (their own errors say why)")
    if not parts:
        parts.append(f"every peer reached this operation (#{seq} {what}), so one failed or was cut off inside it")
    return "; " + "; ".join(parts)


def _failed(states: dict[int, tuple], seq: int) -> list[int]:
    """The peers that noted a failure in operation ``seq`` (or later)."""
    return [r for r, (_, note) in states.items() if note is not None and note[0] >= seq]


def _suspects(states: dict[int, tuple], seq: int) -> list[int]:
    """The peers that neither noted a failure in operation ``seq`` nor marked a later one: after
    a lost connection, the ones that may have died."""
    failed = _failed(states, seq)
    return [r for r, (mark, _) in states.items() if r not in failed and (mark is None or mark[0] <= seq)]


def _kind(what: str) -> str:
    """The operation without the sized dispatch's metadata step, which its payload continues."""
    return what.removesuffix(" (metadata)")
