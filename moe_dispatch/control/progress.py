"""A Buffer's records in torch.distributed's store: which operation each EP rank has reached
(progress marks) and that it saw a collective fail (failure notes), in one record per rank, and
why a rank refused a call (refusals). With them a failed or timed-out collective names the rank
it is missing (gloo and NCCL only say that the collective failed, not which peer is gone), and
the peers of a rank that refused a call can quote its error.

Every operation of a Buffer gets a sequence number, the same on every rank (operations are
collective and issued in the same order everywhere). When a thread of a rank starts one, it
marks ``(seq, what)`` (the caller's thread for a fresh dispatch's metadata, the communication
thread/stream for the payloads); the rank's record holds its newest mark.

The store is one server thread on global rank 0 that also serves process-group creation and the
frameworks' barriers, so its load must not grow with the job (at 4,096 ranks, a set per rank per
operation would saturate it), and it may be unreachable exactly when this matters (a cut link,
its host dead), with calls that block until the store's own timeout. So:

- writes: a writer thread stores the record at most every :data:`WRITE_INTERVAL_S` (the newest
  mark only: the marks meanwhile coalesce), and at once after a quiet interval, so a rank that
  blocks in an operation has it stored within that interval; a failure note is stored at once.
  The record is written at creation, so a read never waits on an absent key;
- reads: one rank reads every rank's record for the whole group (a ``check`` and a
  ``multi_get``) and publishes them as one snapshot key per round; the other ranks take the
  newest snapshot that already shows their own failure note (so it was read after they failed),
  or claim the next round when none does (one ``compare_set``: one reader per round). Every
  call other than a mark runs on a helper thread waited for at most :data:`READ_TIMEOUT_S`.

Diagnosis. A rank whose collective fails notes it, then reads the records (after a lost
connection: a round every :data:`SETTLE_ROUND_S` until at most one peer is unaccounted for, for
at most :data:`SETTLE_S`, so that its live peers' notes and newer marks reach the store). A peer
that noted a failure in this operation, or marked a later one, is alive; after a lost connection
the peers that did neither are the suspects (a dead rank can do neither), and a peer whose
latest mark is below the operation has not reached it. When the store itself fails because its
host died (global rank 0 with ``tcp://`` and ``env://`` initialisation), the message says that
the store died with that rank.
"""

from __future__ import annotations

import collections
import datetime
import itertools
import json
import threading
import time

from .store import READ_TIMEOUT_S, bounded, default_store, group_key, present_values

# A rank's record is stored at most this often: 2 sets per second per rank in a steady loop (the
# earlier policy, two keys every 0.05 s, made 40), and a rank blocked in an operation has its mark
# stored within this long: well inside SETTLE_S, and far inside any collective's timeout.
WRITE_INTERVAL_S = 0.5
# How long a diagnosis after a lost connection waits for the live peers' notes and marks: a few
# WRITE_INTERVAL_S, so that it holds with a loaded machine's late threads; it ends as soon as at
# most one peer is unaccounted for (the usual case: one rank died).
SETTLE_S = 2.0
SETTLE_ROUND_S = 0.2  # between the rounds of a settling diagnosis (each rank of the group asks once a round)
SNAPSHOT_WAIT_S = READ_TIMEOUT_S / 2  # for another rank's snapshot, leaving time to read ourselves instead
REFUSAL_SLOTS = 8  # a rank's refusal texts rotate over this many keys (read by seq, so a quick next refusal keeps it)
# Progress objects made per group and rank: the n-th on a group is the n-th on every rank of it
# (Buffers are created collectively), whatever Buffers of other groups came before.
_MADE: dict[tuple[str, int], itertools.count] = collections.defaultdict(itertools.count)

Mark = tuple[int, str]  # (seq, what)


def _mark_text(mark: Mark | None) -> str:
    return "" if mark is None else f"{mark[0]} {mark[1]}"


def _parse_mark(text: str) -> Mark | None:
    """``(seq, what)`` of ``"<seq> <what>"``, None of ``""``."""
    if not text:
        return None
    num, _, label = text.partition(" ")
    return int(num), label


def _parse_record(record: str | None) -> tuple[Mark | None, Mark | None]:
    """``(newest mark, failure note)`` of a record ``"<mark>\\n<note>"``; None for an absent one."""
    if record is None:
        return None, None
    mark, _, note = record.partition("\n")
    return _parse_mark(mark), _parse_mark(note)


def _pack(records: list[str | None]) -> str:
    """Every rank's record, ranks with equal records as runs ``[first, last]``: a few groups, as
    the ranks of a job are mostly at one or two operations."""
    groups: dict[str | None, list[list[int]]] = {}
    for rank, record in enumerate(records):
        runs = groups.setdefault(record, [])
        if runs and runs[-1][1] == rank - 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    return json.dumps(list(groups.items()))


def _unpack(text: str, world_size: int) -> list[str | None]:
    """The records of :func:`_pack`."""
    records: list[str | None] = [None] * world_size
    for record, runs in json.loads(text):
        for first, last in runs:
            records[first : last + 1] = [record] * (last - first + 1)
    return records


class Progress:
    """The store records of one Buffer's EP group.

    Args:
        group_ranks: the group's global ranks (names the group in the store, so Buffers of
            different EP groups never share keys; Buffers of one group are told apart by
            their creation order on it).
        rank: this rank's index in the group.
        store: the store to record in (default: torch.distributed's default store).

    Stores this rank's record at once (bounded). Recording never raises: without a reachable
    store (a custom process group, or the store's host gone) it stops and failures are
    described without it. :meth:`close` removes this rank's keys and ends the writer thread.
    """

    def __init__(self, group_ranks: list[int], rank: int, store=None):
        self._store = default_store() if store is None else store
        self._store_error: Exception | None = None  # the store failed: recording stops
        group = group_key(group_ranks)
        self._prefix = f"moe_dispatch/progress/{group}/{next(_MADE[group, rank])}"
        self._rank, self._world_size = rank, len(group_ranks)
        self._store_host = group_ranks.index(0) if 0 in group_ranks else None  # EP rank of global rank 0
        self._current = threading.local()  # per thread: the operation it is in
        self._marks: dict[str, Mark] = {}  # thread -> its latest mark, set by the marking threads without a lock
        self._note: Mark | None = None  # the operation this rank's collective failed in
        self._sent: str | None = None  # the record as last stored
        self._storing = threading.Lock()  # the writer's and a failure note's stores, one at a time
        self._written: set[str] = set()  # this rank's keys in the store, removed by close()
        self._wake = threading.Condition()
        self._idle = False  # the writer waits for a mark to wake it
        self._writer: threading.Thread | None = None
        self._closing = False
        self._store_bounded(self._store_record)

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
        # One dict item set (atomic under the GIL), no lock: the writer stores the newest mark
        # within WRITE_INTERVAL_S. Only a waiting writer is woken (it re-checks before waiting).
        self._marks[thread] = (seq, what)
        if self._idle or self._writer is None:
            with self._wake:
                if self._closing:
                    return
                self._wake.notify()
                if self._writer is None:
                    self._writer = threading.Thread(target=self._write, name="moe_dispatch-progress", daemon=True)
                    self._writer.start()

    def _record(self) -> str:
        """This rank's record: ``"<newest mark>\\n<failure note>"``."""
        return f"{_mark_text(max(list(self._marks.values()), default=None))}\n{_mark_text(self._note)}"

    def _store_record(self) -> None:
        """Stores this rank's record when it changed (one set). Raises what the store raises."""
        with self._storing:
            record = self._record()
            if record != self._sent:
                key = self._key(self._rank, "state")
                self._written.add(key)
                self._store.set(key, record)
                self._sent = record

    def _store_bounded(self, fn) -> None:
        """Runs the store call ``fn`` bounded by READ_TIMEOUT_S; a store that failed stops recording."""
        if self._store is None or self._store_error is not None:
            return
        ok, err = bounded(fn)
        if not ok and err is not None:
            self._store_error = err

    def _write(self) -> None:
        while True:
            with self._wake:
                self._idle = True
                while not self._closing and self._record() == self._sent:
                    self._wake.wait()
                self._idle = False
                closing = self._closing
            if closing:
                self._remove_keys()
                return
            try:
                self._store_record()
            except Exception as err:  # noqa: BLE001 - a lost store only costs the diagnostic
                self._store_error = err
                return
            with self._wake:  # the marks until the next write coalesce into its newest one
                self._wake.wait_for(lambda: self._closing, WRITE_INTERVAL_S)

    def _note_failure(self, seq: int, what: str) -> None:
        """Stores at once (bounded) that this rank's collective failed in operation ``seq``."""
        self._note = (seq, what)
        self._store_bounded(self._store_record)

    def post_refusal(self, seq: int, text: str) -> None:
        """Stores why this rank refuses operation ``seq`` (its error's text), before it takes
        part in the operation's check, so the peers can quote it once the check is done."""
        key = self._key(self._rank, f"refused/{seq % REFUSAL_SLOTS}")
        self._written.add(key)
        self._store_bounded(lambda: self._store.set(key, f"{seq} {text}"))

    def read_refusals(self, ranks: list[int], seq: int | None) -> dict[int, str]:
        """The texts ``ranks`` posted for refusing operation ``seq`` (bounded: one ``check`` and
        one ``multi_get``; missing when the store did not answer)."""
        store = self._store
        if store is None or self._store_error is not None or not ranks or seq is None:
            return {}
        keys = {rank: self._key(rank, f"refused/{seq % REFUSAL_SLOTS}") for rank in ranks}
        ok, values = bounded(lambda: present_values(store, list(keys.values())))
        if not ok:
            return {}
        posted = {rank: _parse_mark(values[key].decode()) for rank, key in keys.items() if key in values}
        return {rank: got[1] for rank, got in posted.items() if got is not None and got[0] == seq}

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
        self._note_failure(seq, what)
        if self._store_error is not None:
            return self._store_gone(self._store_error)
        return self._diagnose(seq, what, peers, lost)

    def _diagnose(self, seq: int, what: str, peers: list[int], lost: bool) -> str:
        """:meth:`describe_peers` once this rank's failure note is stored."""
        deadline, after = time.monotonic() + SETTLE_S, 0
        while True:
            ok, got = bounded(lambda after=after: self._shared_records(seq, after))
            if not ok:
                return self._store_gone(got)
            after, records = got
            states = {r: _parse_record(record) for r, record in enumerate(records) if r != self._rank}
            # After a timeout the peers' records had timeout_s to land; after a lost connection
            # the live peers' notes may still be on their way.
            if not lost or len(_suspects(states, seq)) <= 1 or time.monotonic() >= deadline:
                return _describe(states, peers, seq, what, lost)
            time.sleep(SETTLE_ROUND_S)

    def _shared_records(self, seq: int, after: int) -> tuple[int, list[str | None]]:
        """Every rank's record, for a diagnosis of operation ``seq``, and the round they were
        read in: the newest round's snapshot if it is newer than round ``after`` and, on a first
        read (``after`` 0), shows this rank's failure note (so it was read after this rank
        failed); else a new round, which this rank reads and publishes unless another claimed it
        first (then that one's, read after this call began). Raises what the store raises."""
        store, counter = self._store, f"{self._prefix}/diagnosis/{seq}"
        current = store.compare_set(counter, "", "0 -1").decode()  # "<newest round> <its reader>", made if none
        newest = int(current.split()[0])
        if newest > after:
            records = self._snapshot(counter, newest)
            if records is None:  # its reader did not publish in time
                return newest, self._read_records()
            if after or _parse_record(records[self._rank])[1] == self._note:
                return newest, records
        claim = f"{newest + 1} {self._rank}"
        got = store.compare_set(counter, current, claim).decode()
        if got != claim:  # another rank took a newer round
            newest = int(got.split()[0])
            records = self._snapshot(counter, newest)
            return newest, self._read_records() if records is None else records
        records, key = self._read_records(), f"{counter}/{newest + 1}"
        self._written.update((counter, key))
        store.set(key, _pack(records))
        return newest + 1, records

    def _snapshot(self, counter: str, round_: int) -> list[str | None] | None:
        """The records published for ``round_``, or None when they did not come within
        SNAPSHOT_WAIT_S."""
        key = f"{counter}/{round_}"
        try:
            self._store.wait([key], datetime.timedelta(seconds=SNAPSHOT_WAIT_S))
        except RuntimeError:  # timed out, or the store failed (then the reader's own read raises)
            return None
        return _unpack(self._store.get(key).decode(), self._world_size)

    def _read_records(self) -> list[str | None]:
        """Every rank's record as stored now, None where absent (closed, or never made)."""
        keys = [self._key(rank, "state") for rank in range(self._world_size)]
        values = present_values(self._store, keys)
        return [value.decode() if (value := values.get(key)) is not None else None for key in keys]

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
