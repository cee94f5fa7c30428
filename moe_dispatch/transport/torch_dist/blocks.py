"""The block exchanges of the torch_dist transport: every first collective of an operation (a
fresh dispatch's counts, every argument check) is one equal-split exchange of one block per peer,
so ranks running different operations get a ValueError rather than a collective of mismatched
sizes. Block ``[header | payload]``: the header's int64 words are the sender's agreement row
(:mod:`moe_dispatch.control.agreement`), the rows of payload the block carries (-1: none), and
for a fresh dispatch the sender's sizes and counts (:func:`.plan.dispatch_counts`); the payload,
on the all-ranks group, is :attr:`Blocks.capacity` bytes, which carry a small call's flat rows
where every rank's fit (one collective per call instead of two, :data:`.tuning.FUSED_BYTES`).

An argument check (:class:`Agreement`) is iterated for its steps, or given to a combine or cached
dispatch, which starts it (:func:`begin`), packs its first payload meanwhile, and completes it
(:func:`complete`) before that payload moves, or lets its rows ride in the check's blocks.
"""

from __future__ import annotations

import array
import collections
import dataclasses
from typing import Callable

import torch

from ... import _ext
from ...control import agreement
from ...control.agreement import AGREE_WORDS, Field
from ..base import Steps
from .collectives import ALL_COMM, Collectives
from .packing import Carried, carried_rows, pack, pack_blocks, packed_width
from .plan import TorchDistPlan
from .route import Links, padding_pays
from .tuning import FUSED_BYTES, RECENT_DISPATCHES


class Blocks:
    """The block exchanges of one transport, over ``comm``'s groups; every block's header is
    ``header_words`` int64 words.

    Attributes:
        capacity: payload bytes a block on the all-ranks group carries to each peer: set by every
            fresh dispatch's payload from its agreed sizes (:meth:`resize`: the same on every
            rank, in queue order), so every rank's blocks have the same size whatever its
            arguments are.
    """

    def __init__(self, comm: Collectives, header_words: int):
        self.comm = comm
        self.header_words = header_words
        self.capacity = 0
        self._recent_pairs = collections.deque(maxlen=RECENT_DISPATCHES)  # their largest pair's bytes

    def resize(self, plan: TorchDistPlan, width: int, links: Callable[[], Links]) -> None:
        """Sizes the blocks of the following checks after a dispatch of rows ``width`` bytes wide
        on ``plan`` (routed): they carry this dispatch's flat rows (combine's are at most as wide),
        from agreed sizes, at the same point of the queue on every rank. Blocks sized for the
        largest of the recent dispatches also carry the next dispatch's rows with its counts more
        often (a model's layers route differently), where that padding pays (:func:`padding_pays`
        with the links ``links()`` gives)."""
        fused = plan.counts.max_pair_rows * width if plan.flat and plan.counts is not None else 0
        self._recent_pairs.append(fused)
        self.capacity = 0
        if 0 < fused and self.comm.agree_kind == ALL_COMM:
            for capacity in dict.fromkeys((max(self._recent_pairs), fused)):
                if capacity <= FUSED_BYTES and padding_pays(
                    plan.counts, width, capacity // width, self.comm.topology.world_size, links
                ):
                    self.capacity = capacity
                    break

    def headers(self, fields: dict[str, Field], status: int, device) -> torch.Tensor:
        """``[W, header words]`` int64, a row per destination: this rank's agreement row, no
        payload, zero sizes and counts (what a check sends; a fresh dispatch fills the rest)."""
        world = self.comm.topology.world_size
        row = [*agreement.row(fields, status, AGREE_WORDS), -1] + [0] * (self.header_words - AGREE_WORDS - 1)
        # from an array's buffer: a third of torch.tensor's time on a nested list
        head = torch.frombuffer(array.array("q", row * world), dtype=torch.int64)
        return head.view(world, -1).to(device)

    def exchange(self, head: torch.Tensor, what: str, kind: str, rows: tuple | None = None) -> Steps:
        """Steps of one equal-split exchange of blocks ``[header | payload]`` on the ``kind`` group
        (every rank's blocks have the same size: the header's, plus :attr:`capacity` bytes when
        ``kind`` is the payloads' group); returns ``(headers [W, header words] int64, blocks [W,
        block bytes] uint8)`` by source. ``rows = (fields, send_splits)``: the rows by
        destination, ``fields`` as :func:`.packing.pack` takes them, packed straight into the
        blocks (the caller checked they fit); their count per destination goes in the header."""
        world = self.comm.topology.world_size
        head_bytes = self.header_words * 8
        capacity = self.capacity if kind == ALL_COMM else 0
        send = torch.empty((world, head_bytes + capacity), dtype=torch.uint8, device=head.device)
        if rows is not None:
            fields, splits = rows
            pack_blocks(send, head, fields, splits, AGREE_WORDS)
        else:
            send[:, :head_bytes].view(torch.int64).copy_(head)
        recv, pending = self.comm.all_to_all(send.view(-1), None, None, kind, what)
        yield pending
        recv = recv.view(world, -1)
        return recv[:, :head_bytes].view(torch.int64), recv

    def carried(self, blocks: torch.Tensor, carried: list[int], expected: list[int], width: int, what: str):
        """The rows of ``width`` bytes each source's block carried (``carried`` of them; the plan's
        ``expected``), by source: left in the blocks (a :class:`~.packing.Carried`) where ``_C``
        lands them from there, else ``[R, width]`` uint8.

        Raises:
            RuntimeError: the peers sent other counts than the plan expects.
        """
        self.expect(carried, expected, what)
        if blocks.device.type == "cpu" and _ext.extension_status().built:
            return Carried(blocks, carried, self.header_words * 8, width)
        return carried_rows(blocks, carried, self.header_words * 8, width)

    def expect(self, carried: list[int], expected: list[int], what: str) -> None:
        """Raises RuntimeError unless the peers sent the rows the plan expects."""
        if carried != expected:
            raise RuntimeError(
                f"EP rank {self.comm.topology.rank}: {what}: the peers sent {carried} rows, the plan expects {expected}"
            )

    def carries(self, send_splits: list[int], width: int, device: torch.device) -> bool:
        """Whether an argument check's blocks carry flat rows of ``width`` bytes sent by
        ``send_splits`` (the same answer on every rank: the block holds every rank's largest)."""
        return self.comm.agree_kind == ALL_COMM and device.type == "cpu" and max(send_splits) * width <= self.capacity

    def agreed(self, check: Agreement, rows: tuple | None = None) -> Steps:
        """Steps of ``check`` (see :meth:`TorchDistTransport.agree`); with ``rows = (fields,
        send_splits, recv_splits, what, in_blocks)`` also the flat exchange of the rows of
        ``fields`` (as :func:`.packing.pack` takes them), returned packed as ``[R, wb]`` by source:
        inside the check's blocks where every rank's fit (one collective; with ``in_blocks`` they
        may stay there, a :class:`~.packing.Carried`), else after it.

        Raises (from the steps):
            ValueError: a rank refused, or a field differs between ranks.
            CommError: a peer failed or did not join within the timeout.
        """
        kind = self.comm.agree_kind
        if self.comm.groups[kind] is None:  # a group of one: nothing to compare, the rows are this rank's
            self.comm.control.verify([agreement.row(check.fields, check.status, AGREE_WORDS)], check.fields, check.what)
            return None if rows is None else pack(rows[0])
        fused = width = None
        if rows is not None:
            fields, send_splits = rows[0], rows[1]
            width = packed_width([t for t, _ in fields])
            if self.carries(send_splits, width, fields[0][0].device):
                # packed straight into the blocks (one index for every field), else packed first
                shared = all(i is fields[0][1] for _, i in fields)
                fused = (fields if shared else [(pack(fields), None)], send_splits)
        head = self.headers(check.fields, check.status, torch.device("cpu"))
        headers, blocks = yield from self.exchange(head, f"{check.what} argument check", kind, fused)
        got = headers[:, : AGREE_WORDS + 1].tolist()  # the agreement rows, then the rows carried
        self.comm.control.verify([r[:AGREE_WORDS] for r in got], check.fields, check.what)
        if rows is None:
            return None
        fields, send_splits, recv_splits, what, in_blocks = rows
        carried = [r[AGREE_WORDS] for r in got]
        if all(n >= 0 for n in carried):  # every rank's rows came with its header
            if in_blocks:
                return self.carried(blocks, carried, recv_splits, width, what)
            self.expect(carried, recv_splits, what)
            return carried_rows(blocks, carried, self.header_words * 8, width)  # the sums read rows of one stride
        recv, pending = self.comm.all_to_all(pack(fields), send_splits, recv_splits, ALL_COMM, what)
        yield pending
        return recv


@dataclasses.dataclass(eq=False)
class Agreement:
    """An argument check (:meth:`TorchDistTransport.agree`): iterating it gives its steps; a
    combine or cached dispatch given it may carry its rows in the check's blocks."""

    blocks: Blocks
    fields: dict[str, Field]
    what: str
    status: int = 0

    def __iter__(self):
        return self.blocks.agreed(self)


def begin(check: Agreement | None):
    """Issues ``check``'s first collective; returns ``(steps, waitable)`` to complete later, or None."""
    if check is None:
        return None
    steps = iter(check)
    try:
        return steps, next(steps)
    except StopIteration:
        return None


def complete(check: Agreement | None, begun) -> Steps:
    """Steps finishing a check begun with :func:`begin` (its ValueError is raised here)."""
    if begun is not None:
        steps, pending = begun
        yield pending
        yield from steps
