"""The ``_C`` kernels' limits and byte layouts, mirrored by hand for the pure-Python wheel (which
has no ``_C`` to ask): what :class:`~moe_dispatch.config.Config` checks and sizes buffers with,
and what the cost model (:mod:`moe_dispatch.costmodel`) sizes rings with.

The sources are ``csrc/kernels/intranode.cuh``, ``internode.cuh``, ``header.cuh`` and
``variant.cuh``. Every launch takes its layouts from ``_C`` itself (``_C.intranode_buffer_layout``,
``_C.internode_rdma_layout``), and ``python_tests/test_extension.py`` checks each value here
against ``_C`` where it is built.
"""

from __future__ import annotations

import dataclasses

# Limits of the intranode kernels (csrc/kernels/intranode.cuh); _C.intranode_limits reports the same.
MAX_RANKS = 16  # warp groups of a 16-warp block: one per peer
MAX_CHANNELS = 64  # num_sms / 2
MAX_TOPK = 32
FIELD_ALIGN = 16  # slot fields start on 16 bytes
LINE = 128  # each head/tail counter owns a 128-byte line
ERROR_RECORD_INTS = 16
MISMATCH_RECORD_WORDS = 8  # csrc/kernels/header.cuh MismatchRecord
HEADER_WORDS = 9
# Limits of the internode kernels (csrc/kernels/internode.cuh); _C.internode_limits reports the same.
MAX_NODES = 64
MAX_RANKS_PER_NODE = 16  # max_ranks_per_node: the NVLink domain of stage 2
MAX_LAUNCH_RANKS = 16  # max_launch_ranks: ranks one launch serves (a loopback's whole world)
MAX_ROWS_IN_FLIGHT = 2
COMBINE_WARPS = (1, 2, 4)
# The compiled copy kernels (csrc/kernels/variant.cuh kCopyVariants; _C.copy_variants reports the
# same): (loads_in_flight, rows_in_flight, bulk_copy, register_cap, also compiled for the fused
# internode kernels' loopback mode).
COPY_VARIANTS = (
    (4, 1, False, True, True),  # the current kernels
    (8, 1, False, True, False),
    (4, 1, False, False, True),
    (8, 2, False, False, True),
    (16, 2, False, False, False),
    (4, 1, True, True, True),  # TMA bulk copies
)


def _align(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


@dataclasses.dataclass(frozen=True)
class SlotLayout:
    """Byte offsets inside one queue slot (see ``make_slot_layout`` in intranode.cuh)."""

    x_bytes: int
    scale_bytes: int
    num_topk: int
    scale_offset: int
    topk_idx_offset: int
    topk_weights_offset: int
    aux_offset: int
    slot_bytes: int


def slot_layout(x_bytes: int, scale_bytes: int = 0, num_topk: int = 0) -> SlotLayout:
    """A dispatch slot (x row, fp8 scales, top-k ids and weights, source index) or, with
    ``scale_bytes = num_topk = 0``, a combine slot (y row, row scale)."""
    scale_offset = _align(x_bytes, FIELD_ALIGN)
    topk_idx_offset = scale_offset + _align(scale_bytes, FIELD_ALIGN)
    topk_weights_offset = topk_idx_offset + _align(4 * num_topk, FIELD_ALIGN)
    aux_offset = topk_weights_offset + _align(4 * num_topk, FIELD_ALIGN)
    return SlotLayout(
        x_bytes,
        scale_bytes,
        num_topk,
        scale_offset,
        topk_idx_offset,
        topk_weights_offset,
        aux_offset,
        aux_offset + FIELD_ALIGN,
    )


@dataclasses.dataclass(frozen=True)
class BufferLayout:
    """Byte offsets of one rank's communication buffer (drawn in intranode.cuh)."""

    num_ranks: int
    num_channels: int
    num_slots: int
    slot_bytes: int
    relay_nodes: int
    relay_bytes: int
    meta_offset: int
    tail_offset: int
    head_offset: int
    epoch_offset: int
    header_offset: int
    relay_offset: int
    queue_offset: int
    total_bytes: int


def buffer_layout(
    num_ranks: int, num_channels: int, num_slots: int, slot_bytes: int, relay_nodes: int = 0
) -> BufferLayout:
    """Mirror of the C++ make_buffer_layout (intranode.cuh): slots of ``slot_bytes`` rounded up to
    128 bytes, so that each starts on a cache line; ``relay_nodes`` N > 0 adds the fused internode
    pipeline's relay region (its NVLink buffers)."""
    slot_bytes = _align(slot_bytes, LINE)
    relay_bytes = LINE + _align(4 * relay_nodes * num_channels, LINE) if relay_nodes else 0
    queues = num_ranks * num_channels
    meta = _align(4 * num_ranks, LINE)
    tail = meta + _align(4 * queues, LINE)
    head = tail + LINE * queues
    epoch = head + LINE * queues
    header = epoch + LINE
    relay = header + 2 * LINE * num_ranks
    queue = relay + (_align(8 * num_ranks, LINE) + 2 * num_ranks * relay_bytes if relay_nodes else 0)
    return BufferLayout(
        num_ranks,
        num_channels,
        num_slots,
        slot_bytes,
        relay_nodes,
        relay_bytes,
        meta,
        tail,
        head,
        epoch,
        header,
        relay,
        queue,
        queue + queues * num_slots * slot_bytes,
    )


@dataclasses.dataclass(frozen=True)
class RdmaLayout:
    """Byte offsets of one rank's RDMA buffer (drawn in internode.cuh)."""

    num_nodes: int
    ranks_per_node: int
    num_channels: int
    num_slots: int
    slot_bytes: int
    msg_bytes: int
    arrive_offset: int
    meta_offset: int
    meta_out_offset: int
    header_offset: int
    header_out_offset: int
    tail_offset: int
    head_offset: int
    flag_offset: int
    zero_offset: int
    recv_offset: int
    send_offset: int
    total_bytes: int


def rdma_layout(num_nodes: int, ranks_per_node: int, num_channels: int, num_slots: int, slot_bytes: int) -> RdmaLayout:
    """Mirror of the C++ make_rdma_layout (internode.cuh)."""
    align = lambda v: _align(v, LINE)  # noqa: E731
    queues = num_nodes * num_channels
    ring = queues * num_slots * slot_bytes
    msg = LINE + align(4 * num_channels * (1 + ranks_per_node))
    arrive = LINE
    meta = arrive + align(16 * num_nodes)
    meta_out = meta + 2 * num_nodes * msg
    header = meta_out + 2 * num_nodes * msg
    header_out = header + 2 * LINE * num_nodes
    tail = header_out + LINE * num_nodes
    head = tail + LINE * queues
    flag = head + LINE * queues
    zero = flag + align(8 * queues * num_slots)
    recv = zero + align(slot_bytes)
    return RdmaLayout(
        num_nodes,
        ranks_per_node,
        num_channels,
        num_slots,
        slot_bytes,
        msg,
        arrive,
        meta,
        meta_out,
        header,
        header_out,
        tail,
        head,
        flag,
        zero,
        recv,
        recv + ring,
        recv + 2 * ring,
    )


def max_slot_bytes(
    hidden: int, num_topk: int, *, element_bytes: int = 2, fp8: bool = True, combine_element_bytes: int | None = None
) -> int:
    """Slot size that fits every operation a Buffer for ``hidden`` performs: dispatch of
    ``element_bytes``-wide rows (and of fp8 rows with their scales when ``fp8``), and combine of
    ``combine_element_bytes``-wide rows (default ``element_bytes``)."""
    sizes = [
        slot_layout(hidden * element_bytes, 0, num_topk).slot_bytes,
        slot_layout(hidden * (combine_element_bytes or element_bytes)).slot_bytes,
    ]
    if fp8 and hidden % 128 == 0:
        sizes.append(slot_layout(hidden, 4 * (hidden // 128), num_topk).slot_bytes)
    return max(sizes)
