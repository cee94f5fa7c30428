"""The kernels' operation header and mismatch record (``csrc/kernels/header.cuh``).

Every kernel operation (the notify of a fresh dispatch, a cached dispatch, a combine; intranode
and internode) exchanges a header of 9 int64 words with the peers it moves rows with:

====  ============  ===========================================================================
word  field         value
====  ============  ===========================================================================
0     op            1 dispatch (notify + dispatch), 2 cached dispatch, 3 combine
1     identity      the dispatch id the handle carries (the caller's ``dispatch_id``)
2     row bytes     bytes of one x / y row
3     dtype         :data:`DTYPE_CODES`
4     top-k         K that travels (0: none)
5     experts       E
6     shape         num_channels | flags << 16 (flag 1: top-k weights travel; flag 2: ready flags,
                    ``Config.slot_flags``, whose ranks must agree on the queue protocol)
7     status        0, or why this rank refused its own arguments (:data:`STATUS_NAMES`)
8     budget        a fresh dispatch's ``num_worst_tokens`` (0: none), in its notify; else 0
====  ============  ===========================================================================

A pair whose headers differ (or where either status is non-zero) moves no rows, so nothing
waits for rows that will not come; each rank writes what it saw into its mismatch record
(``int64[8]``: flag, rank, peer, field, mine, theirs, via, lock), which the host reads at its
next synchronisation: :func:`describe_mismatch` turns it into a message, :class:`MismatchError`
is what the transports raise.
"""

from __future__ import annotations

import torch

from ...control.agreement import decode_status, describe_status
from ...errors import MismatchError
from ...kernel_layout import MISMATCH_RECORD_WORDS

OP_DISPATCH, OP_CACHED_DISPATCH, OP_COMBINE = 1, 2, 3
OPS = {OP_DISPATCH: "dispatch", OP_CACHED_DISPATCH: "cached dispatch", OP_COMBINE: "combine"}
FIELDS = (
    "operation",
    "dispatch id (handle)",
    "row bytes",
    "dtype",
    "top-k",
    "experts",
    "channels and flags",
    "status",
    "num_worst_tokens",
)
FIELD_STATUS = 7
FIELD_BUDGET = 8
DTYPE_CODES = {
    torch.bfloat16: 0,
    torch.float16: 1,
    torch.float32: 2,
    torch.float8_e4m3fn: 3,
    torch.uint8: 4,
    torch.int8: 5,
    torch.int16: 6,
    torch.int32: 7,
    torch.int64: 8,
    torch.float64: 9,
}
_DTYPE_NAMES = {code: str(dtype).removeprefix("torch.") for dtype, code in DTYPE_CODES.items()}
FLAG_WEIGHTS = 1
FLAG_SLOT_FLAGS = 2

STATUS_INVALID_ARGUMENTS = 1
STATUS_WRONG_HANDLE = 2
# The kernels act on this one (header.cuh, kStatusGrow): a rank whose call needs larger buffers
# than the calls before it joins with it before the (collective) resize, and records every peer
# that does not grow too (its calls differ: every rank raises at once).
STATUS_GROW = 3
STATUS_TEST = 99  # the loopbacks' ``status=`` test knob
# A Buffer's rank refusing its own arguments joins with STATUS_REFUSED + its argument check's status
# (moe_dispatch.control.agreement.status_of: the argument and the error's kind), so its peers learn
# both from the record, as they would from the host check.
STATUS_REFUSED = 1000
STATUS_NAMES = {
    STATUS_INVALID_ARGUMENTS: "its arguments were invalid",
    STATUS_WRONG_HANDLE: "its handle does not belong to this transport or shape",
    STATUS_GROW: "its call needs larger buffers than the calls before it (a wider row or more top-k "
    "than its peers' calls)",
    STATUS_TEST: "a test asked it to refuse",
}


def header_words(
    op: int,
    identity: int,
    row_bytes: int,
    dtype: torch.dtype,
    num_topk: int,
    num_experts: int,
    num_channels: int,
    *,
    weights: bool = False,
    slot_flags: bool = False,
    status: int = 0,
    budget: int = 0,
) -> list[int]:
    """The 9 header words of an operation (see the module doc)."""
    return [
        op,
        identity,
        row_bytes,
        DTYPE_CODES.get(dtype, 15),
        num_topk,
        num_experts,
        num_channels | (((FLAG_WEIGHTS if weights else 0) | (FLAG_SLOT_FLAGS if slot_flags else 0)) << 16),
        status,
        budget,
    ]


def _value(field: int, value: int) -> str:
    if field == 0:
        return OPS.get(value, str(value))
    if field == 3:
        return _DTYPE_NAMES.get(value, str(value))
    if field == 6:
        flags = ", top-k weights" if (value >> 16) & FLAG_WEIGHTS else ""
        flags += ", ready flags" if (value >> 16) & FLAG_SLOT_FLAGS else ""
        return f"{value & 0xFFFF} channels{flags}"
    if field == FIELD_STATUS:
        return "0 (ok)" if value == 0 else f"{value} ({_status_name(value)})"
    if field == FIELD_BUDGET:
        return str(value) if value else "0 (none)"
    return str(value)


def refusal_status(code: int) -> int:
    """The header status of a rank refusing its own arguments with the argument check's status
    ``code`` (:func:`moe_dispatch.control.agreement.status_of`)."""
    return STATUS_REFUSED + code


def _status_name(status: int) -> str:
    if status > STATUS_REFUSED:
        return f"its arguments were invalid ({describe_status(status - STATUS_REFUSED)})"
    return STATUS_NAMES.get(status, f"status {status}")


def describe_mismatch(record: list[int]) -> tuple[str, dict] | None:
    """None for a clear record (``int64[8]``), else ``(message, fields)`` naming the ranks, the
    first differing field and both values. For a refusal (the status field) ``fields`` also
    holds ``refuser`` (its rank) and, where it refused through a Buffer, ``argument`` and
    ``kind`` (``ValueError`` / ``TypeError``) decoded from its status; else both are None."""
    flag, rank, peer, field, mine, theirs, via = record[:7]
    if not flag:
        return None
    name = FIELDS[field] if 0 <= field < len(FIELDS) else f"field {field}"
    fields = {
        "rank": rank,
        "peer": peer,
        "field": name,
        "mine": mine,
        "theirs": theirs,
        "via": None if via < 0 else via,
    }
    if via >= 0:
        who = f"rank {via} (a peer of rank {rank}) reported that rank {peer}"
        holder = f"rank {via}"
    else:
        who, holder = f"rank {peer}", f"rank {rank}"
    fields.update(refuser=None, argument=None, kind=None)
    if field == FIELD_STATUS:
        refuser, code = (peer, theirs) if theirs != 0 else ((via if via >= 0 else rank), mine)
        fields["refuser"] = refuser
        if code > STATUS_REFUSED:
            fields["argument"], fields["kind"] = decode_status(code - STATUS_REFUSED)
        what = f"rank {refuser} refused the operation: {_status_name(code)}"
    else:
        what = (
            f"{who} disagrees on the {name}: {_value(field, theirs)} on rank {peer}, {_value(field, mine)} on {holder}"
        )
    message = (
        f"moe_dispatch: rank {rank} saw mismatched kernel calls: {what}. Every rank of the group must call "
        "the same operation with the same handle and the same row size, dtype, top-k, experts, SMs and "
        "num_worst_tokens; no rows moved between the disagreeing ranks, and the buffers stay usable."
    )
    return message, fields


class Records:
    """The mismatch records of an engine's launched ranks (``int64[n, 8]`` on its device, plus
    a pinned host mirror the kernels also write when ``mirror``: readable without a sync)."""

    def __init__(self, count: int, device: torch.device, mirror: bool = False):
        from ..._ext import require_extension

        self.device = device
        self.records = torch.zeros(count, MISMATCH_RECORD_WORDS, dtype=torch.int64, device=device)
        self.host = torch.zeros(count, MISMATCH_RECORD_WORDS, dtype=torch.int64).pin_memory() if mirror else None
        self._host_ptr = require_extension().host_device_pointer(self.host.data_ptr()) if mirror else None

    def fields(self, index: int, header: list[int]) -> dict:
        """The ``header`` / ``mismatch`` / ``mismatch_host`` fields of launched rank ``index``'s
        ``_C.Check``, by keyword (``header``: the ints of :func:`header_words`)."""
        row = MISMATCH_RECORD_WORDS * 8
        out = {"header": header, "mismatch": self.records.data_ptr() + index * row}
        if self._host_ptr is not None:
            out["mismatch_host"] = self._host_ptr + index * row
        return out

    def read(self, synchronize: bool = True) -> list[list[int]]:
        """The set records (flag != 0); from the device (a host sync) or, without
        ``synchronize``, from the mirror when there is one."""
        source = self.host if (self.host is not None and not synchronize) else self.records
        # Host memory (the mirror, or the CPU backend's records) through numpy: a read, no device sync.
        rows = source.numpy().tolist() if source.device.type == "cpu" else source.tolist()
        return [r for r in rows if r[0]]

    def clear(self) -> None:
        self.records.zero_()
        if self.host is not None:
            self.host.zero_()

    def raise_if_set(self, synchronize: bool = True, rank_offset: int = 0) -> None:
        """Raises :class:`MismatchError` for the first set record (and clears them all: the
        operation completed, the buffers are usable). ``rank_offset`` turns the ranks of an
        engine that numbers them locally (a node's) into global ones."""
        rows = self.read(synchronize)
        if rows:
            self.clear()
            flag, rank, peer, field, mine, theirs, via = rows[0][:7]
            record = [
                flag,
                rank + rank_offset,
                peer + rank_offset,
                field,
                mine,
                theirs,
                via + rank_offset if via >= 0 else via,
            ]
            raise MismatchError(*describe_mismatch(record))
