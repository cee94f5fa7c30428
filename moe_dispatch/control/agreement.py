"""How a Buffer's ranks agree on a call before any payload moves: every check is one collective
that every rank takes part in, with a status word and the call's fields as int64 codes.

One rank's row (what it sends to every peer, the same number of words on every rank)::

    word 0        status: 0 = this rank's arguments are good; else the rank refuses the call,
                  and the code says which argument and which error (:func:`status_of`)
    words 1..F    the fields, in the caller's order: dtypes and words by their index in
                  FIELD_DTYPES / FIELD_WORDS, ints as they are, bools as 0/1, -1 = not known
                  (a refusing rank sends -1 for every field)

Where the rows travel (torch_dist): every first collective of an operation is one equal-split
all_to_all of blocks ``[header | payload]`` on the Buffer's queue group (gloo; on an NCCL EP group
the checks use a gloo group of the same ranks, so no device synchronisation), whose size depends on
nothing a rank's arguments hold, so ranks running different operations compare their first field
(the operation) instead of aborting in gloo:

- a fresh dispatch: the row with the operation ``"dispatch (metadata)"`` first, then its layout
  counts (``TorchDistTransport.plan``; a refusing rank sends zero counts);
- combine, cached dispatch and the kernels' plan: :meth:`TorchDistTransport.agree`, the row of
  :data:`AGREE_WORDS` words alone.

On the flat route the blocks also carry the payload where every rank's fits them (their size
follows the previous dispatch, the same on every rank): the check and the transfer are then one
collective.

After the collective every rank checks every row with :func:`check`: refusals first (a
ValueError naming each refusing rank and quoting its error, which it posted in the store
before the check: :meth:`~moe_dispatch.control.progress.Progress.post_refusal`), then the
first field that differs (naming the ranks and both values). A refusing rank catches that
ValueError and raises its own error. Every rank completed the same collectives, so the Buffer
stays usable.
"""

from __future__ import annotations

import collections
import datetime
import itertools
import json

import torch

from ..errors import ArgumentError, CommError, InvalidArgumentError, argument_error
from .store import default_store, group_key

# An argument compared across ranks before a payload moves: what travels in a check's row.
Field = int | bool | str | torch.dtype

FIELD_DTYPES = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.int32,
    torch.int64,
    torch.float64,
    torch.float8_e5m2,
    torch.int8,
    torch.uint8,
    torch.bool,
)
FIELD_WORDS = ("dispatch", "combine", "dispatch (metadata)")
# A fresh dispatch's fields, compared across ranks before its payload moves (in this order).
DISPATCH_FIELDS = (
    "num_experts",
    "top-k",
    "hidden",
    "x dtype",
    "fp8 x",
    "topk_idx dtype",
    "topk_weights given",
    "num_worst_tokens",
)
AGREE_FIELDS = 12  # every check on the host group compares this many fields (padded with -1), so ranks that
# run different operations there compare their first field (the operation) instead of aborting in gloo
AGREE_WORDS = 1 + AGREE_FIELDS  # the status, then the fields

# What a status code names: the refused argument and the error's kind (an ArgumentError's fields,
# never its text). status = 1 + ARGUMENTS.index(argument) * len(ERROR_TYPES) + ERROR_TYPES.index(kind).
ARGUMENTS = (
    "x",
    "topk_idx",
    "topk_weights",
    "num_experts",
    "num_worst_tokens",
    "on_overflow",
    "handle",
    "y",
    "previous_event",
    "async_finish",
    "return_recv_hook",
    "allocate_on_comm_stream",
    "wgrad_store",
    "pad_multiple",
    "num_permuted_tokens",
    "expert_capacity",
    "arguments",  # none of the above, or an error that names no argument
)
ERROR_TYPES = (ValueError, TypeError)


class DispatchId(int):
    """A handle's field: its dispatch's operation number on the Buffer (equal on every rank of a
    consistent program), shown as ``dispatch #n``."""

    def __str__(self) -> str:
        return f"dispatch #{int(self)}" if self >= 0 else "dispatch <unknown>"


def status_of(err: BaseException) -> int:
    """The non-zero status a rank sends when it refuses a call with ``err``: its argument (an
    :class:`~moe_dispatch.errors.ArgumentError`'s, else ``"arguments"``) and its kind."""
    argument = err.argument if isinstance(err, ArgumentError) and err.argument in ARGUMENTS else "arguments"
    kind = 1 if isinstance(err, TypeError) else 0
    return 1 + ARGUMENTS.index(argument) * len(ERROR_TYPES) + kind


def decode_status(status: int) -> tuple[str, type]:
    """``(argument, kind)`` of a non-zero status (:func:`status_of`); ``("arguments",
    ValueError)`` for a code this version does not know."""
    argument, kind = divmod(status - 1, len(ERROR_TYPES))
    if not (0 <= argument < len(ARGUMENTS)):
        return "arguments", ValueError
    return ARGUMENTS[argument], ERROR_TYPES[kind]


def describe_status(status: int) -> str:
    """``status`` in words, e.g. ``"a bad topk_idx (ValueError)"``."""
    argument, kind = divmod(status - 1, len(ERROR_TYPES))
    if not (0 <= argument < len(ARGUMENTS)):
        return f"status {status}"
    name = "bad arguments" if ARGUMENTS[argument] == "arguments" else f"a bad {ARGUMENTS[argument]}"
    return f"{name} ({ERROR_TYPES[kind].__name__})"


def encode(value: Field) -> int:
    """A field's value as the int it travels as.

    Raises:
        ValueError: a dtype or word missing from FIELD_DTYPES / FIELD_WORDS (add it at the end).
    """
    table = FIELD_DTYPES if isinstance(value, torch.dtype) else FIELD_WORDS if isinstance(value, str) else None
    if table is None:
        return int(value)
    if value not in table:
        raise ValueError(f"{value!r} cannot travel in an argument check: add it to agreement.FIELD_DTYPES/FIELD_WORDS")
    return table.index(value)


def row(fields: dict[str, Field], status: int = 0, width: int | None = None) -> list[int]:
    """One rank's row: ``[status, field codes...]``, padded with -1 to ``width`` words."""
    words = [status, *map(encode, fields.values())]
    if width is not None:
        if len(words) > width:
            raise ValueError(f"an argument check carries at most {width - 1} fields, got {len(fields)}")
        words += [-1] * (width - len(words))
    return words


def refusing_fields(names: tuple[str, ...] | list[str]) -> dict[str, Field]:
    """The fields a refusing rank sends: every one unknown (-1)."""
    return dict.fromkeys(names, -1)


def _decode(like: Field, code: int) -> Field:
    """A peer's ``code`` as a value of ``like``'s kind (the local value of the same field)."""
    table = FIELD_DTYPES if isinstance(like, torch.dtype) else FIELD_WORDS if isinstance(like, str) else None
    if table is not None:
        return table[code] if 0 <= code < len(table) else f"<code {code}>"
    if isinstance(like, bool):
        return bool(code)
    return type(like)(code) if isinstance(like, DispatchId) else code


def _show(value: Field) -> str:
    return str(value).removeprefix("torch.")


def check(rows: list[list[int]], fields: dict[str, Field], *, rank: int, what: str, refusals) -> None:
    """Checks every rank's row after the collective (on every rank, so all raise together).

    Args:
        rows: per EP rank, its row as :func:`row` made it (at least ``1 + len(fields)`` words).
        fields: this rank's fields (a refusing rank's are unknown and not compared).
        rank: this rank.
        what: the operation, for the message.
        refusals: ``refusals(ranks) -> {rank: text}``, the refusing ranks' posted texts (bounded;
            a rank missing from the answer is described by its status code).

    Raises:
        InvalidArgumentError, ArgumentTypeError: ``"EP rank 0: combine (#7) refused by EP rank 1
            (ValueError: y has shape ...) ..."``, of the lowest refusing rank's kind, with its
            argument and rank (decoded from its status); or ``"EP rank 0: combine arguments
            differ across ranks: handle is dispatch #3 here but dispatch #5 on EP rank 1; ..."``
            (an InvalidArgumentError naming the field and the first differing rank).
    """
    if 0 <= rank < len(rows) and rows[rank][0] == 0 and all(words == rows[rank] for words in rows):
        return  # every rank sent this rank's row: no refusal, no difference (the usual case)
    refusing = [r for r, words in enumerate(rows) if words[0] != 0]
    if refusing:
        texts = refusals(refusing)
        listed = ", ".join(f"{r} ({texts.get(r) or describe_status(rows[r][0])})" for r in refusing)
        argument, kind = decode_status(rows[refusing[0]][0])  # the lowest refusing rank's, on every rank
        raise argument_error(
            kind,
            f"EP rank {rank}: {what} refused by EP rank{'s' if len(refusing) > 1 else ''} {listed}; every rank "
            "raises and skips this operation, and the Buffer stays usable",
            argument=argument,
            rank=refusing[0],
        )
    for position, (name, value) in enumerate(fields.items(), start=1):
        mine = encode(value)
        differ = [(r, words[position]) for r, words in enumerate(rows) if words[position] != mine]
        if differ:
            theirs = ", ".join(f"{_show(_decode(value, code))} on EP rank {r}" for r, code in differ)
            raise InvalidArgumentError(
                f"EP rank {rank}: {what} arguments differ across ranks: {name} is {_show(value)} here but {theirs}; "
                f"every rank must pass the same {', '.join(fields)}",
                argument=name,
                rank=differ[0][0],
            )


# Buffer() attempts made in this process per group (group_key): the n-th on a group is the n-th
# on every rank of it, failed attempts included (every rank posts, whatever it found).
_ATTEMPTS_PER_GROUP: dict[str, itertools.count] = collections.defaultdict(itertools.count)


def agree_in_store(group_ranks: list[int], rank: int, posted: dict, timeout_s: float) -> list[dict]:
    """Every EP rank's ``posted`` (a JSON-able dict: its resolved arguments, or its argument
    error) through torch.distributed's store, before anything collective: each rank sets its
    key, waits at most ``timeout_s`` for every rank's, and reads them; the last reader removes
    the keys. Runs where a Buffer's process groups do not exist yet, so a refusal leaves the
    world as it was.

    Returns:
        the posts by EP rank (``[posted]`` in a group of one, or without a store).

    Raises:
        CommError: a rank did not post within ``timeout_s`` (naming the ranks), or the store
            failed.
    """
    store = default_store()
    world_size = len(group_ranks)
    if store is None or world_size == 1:
        return [posted]
    group = group_key(group_ranks)
    prefix = f"moe_dispatch/buffer/{group}/{next(_ATTEMPTS_PER_GROUP[group])}"
    keys = [f"{prefix}/{r}" for r in range(world_size)]
    try:
        store.set(keys[rank], json.dumps(posted))
        try:
            store.wait(keys, datetime.timedelta(seconds=timeout_s))
        except RuntimeError as err:  # DistStoreError: a rank never posted
            missing = [r for r, key in enumerate(keys) if not store.check([key])]
            store.delete_key(keys[rank])
            raise CommError(
                f"EP rank {rank}: Buffer() timed out after timeout_s={timeout_s:g} waiting for EP ranks "
                f"{missing} to post their arguments (they did not call Buffer() for this group, or died): {err}"
            ) from err
        posts = [json.loads(store.get(key)) for key in keys]
        if store.add(f"{prefix}/read", 1) == world_size:
            for key in [*keys, f"{prefix}/read"]:
                store.delete_key(key)
    except CommError:
        raise
    except RuntimeError as err:
        raise CommError(f"EP rank {rank}: Buffer() could not agree its arguments through the store: {err}") from err
    return posts
