"""``Config``: launch shape and queue sizes of the CUDA intranode kernels.

Pure Python (no extension needed): it validates itself when built, sizes the communication
buffer, and ``Config.auto`` picks defaults from the shape. The byte layouts mirror
``csrc/kernels/intranode.cuh`` (``make_slot_layout``, ``make_buffer_layout``); a CPU test
checks the mirror against the extension.
"""

from __future__ import annotations

import dataclasses
import math

# Limits of the kernels (csrc/kernels/intranode.cuh); _C.intranode_limits reports the same.
MAX_RANKS = 16  # warp groups of a 16-warp block: one per peer
MAX_CHANNELS = 64  # num_sms / 2
MAX_TOPK = 32
FIELD_ALIGN = 16  # slot fields start on 16 bytes
LINE = 128  # each head/tail counter owns a 128-byte line
ERROR_RECORD_INTS = 16
MISMATCH_RECORD_WORDS = 8  # csrc/kernels/header.cuh MismatchRecord
HEADER_WORDS = 8
INTERNODE_PIPELINES = ("fused", "staged")


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


def num_sms_error(num_sms) -> str | None:
    """What is wrong with ``num_sms`` as an SM budget of the kernels (an even int in [2, 128]:
    a sender and a receiver block per channel), or None. Config, Buffer and the Megatron
    ``configure`` check it with this one rule."""
    if (
        not isinstance(num_sms, int)
        or isinstance(num_sms, bool)
        or num_sms < 2
        or num_sms % 2
        or num_sms > 2 * MAX_CHANNELS
    ):
        return (
            f"must be an even int in [2, {2 * MAX_CHANNELS}] (a sender and a receiver block per channel), "
            f"got {num_sms!r}"
        )
    return None


def check_config(config) -> None:
    """Raises TypeError unless ``config`` is a :class:`Config` or None (Buffer and the
    transports take one)."""
    if config is not None and not isinstance(config, Config):
        raise TypeError(f"config must be a moe_dispatch.config.Config or None, got {type(config).__name__}")


@dataclasses.dataclass(frozen=True)
class Config:
    """Launch shape and queue sizes of the intranode kernels.

    Attributes:
        num_sms: SM budget per rank: ``num_sms / 2`` channels, each one sender block and one
            receiver block (even, 2..128). Each channel owns a contiguous range of every
            source's tokens.
        num_slots: depth of each ring queue (source, destination, channel), in tokens. The
            buffer holds ``W * num_channels * num_slots`` slots per rank.
        chunk_tokens: tokens a sender writes between two publications of its tail (and the
            room it waits for); ``1 <= chunk_tokens <= num_slots``.
        l2_discard: receivers discard each queue slot they consumed from L2 (PTX
            ``discard.global.L2`` on its 128-byte lines; slots start on a line) before freeing
            it, so a slot still in L2 when read is never written back to HBM. Off by default until
            measured on a GPU: ``benchmarks/bench_intranode.py`` times both (``--l2-discard``).
            On the CPU backend the discarded bytes are overwritten with a poison pattern, so tests
            catch a slot read after its discard. The internode kernels honour it in their NVLink
            stage, not in their RDMA stage.
        internode_pipeline: how the internode (several nodes) kernels run. ``"fused"`` (the
            default): one notify computes every count on the device, then one kernel per
            dispatch or combine runs the RDMA stage and the NVLink forwarding at the same time,
            with three blocks per channel: ``max(1, num_sms // 3)`` channels.
            ``"staged"``: the earlier pipeline (node stage, host read, one intranode operation per
            source node), kept to time both side by side (``benchmarks/bench_internode.py``).
            The intranode kernels ignore it.

    Raises:
        ValueError: naming the field, the rule and the value, when built.
    """

    num_sms: int = 16
    num_slots: int = 32
    chunk_tokens: int = 8
    l2_discard: bool = False
    internode_pipeline: str = "fused"

    def __post_init__(self) -> None:
        for name in ("num_sms", "num_slots", "chunk_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"Config.{name} must be an int, got {value!r}")
        if not isinstance(self.l2_discard, bool):
            raise ValueError(f"Config.l2_discard must be a bool, got {self.l2_discard!r}")
        if self.internode_pipeline not in INTERNODE_PIPELINES:
            raise ValueError(
                f"Config.internode_pipeline must be one of {INTERNODE_PIPELINES}, got {self.internode_pipeline!r}"
            )
        if (error := num_sms_error(self.num_sms)) is not None:
            raise ValueError(f"Config.num_sms {error}")
        if not 1 <= self.num_slots <= 1 << 20:
            raise ValueError(f"Config.num_slots must be in [1, 2^20], got {self.num_slots}")
        if not 1 <= self.chunk_tokens <= self.num_slots:
            raise ValueError(f"Config.chunk_tokens must be in [1, num_slots={self.num_slots}], got {self.chunk_tokens}")

    @property
    def num_channels(self) -> int:
        return self.num_sms // 2

    @classmethod
    def auto(
        cls,
        num_tokens: int,
        world_size: int,
        *,
        num_sms: int | None = None,
        num_slots: int | None = None,
        chunk_tokens: int | None = None,
        l2_discard: bool = False,
    ) -> "Config":
        """Defaults from the shape; explicit arguments win.

        One channel per 256 tokens of the largest rank, 1 to 8 channels (so <= 16 SMs: the
        rest stay with the GEMMs); chunks of 8 tokens (4 below 64 tokens per channel) in a ring
        four chunks deep.
        """
        if num_sms is None:
            num_sms = 2 * max(1, min(8, math.ceil(max(num_tokens, 1) / 256)))
        per_channel = max(1, num_tokens // (num_sms // 2))
        if chunk_tokens is None:
            chunk_tokens = 8 if per_channel >= 64 else 4
        if num_slots is None:
            num_slots = 4 * chunk_tokens
        del world_size  # the ring depth does not grow with W: every peer has its own rings
        return cls(num_sms=num_sms, num_slots=num_slots, chunk_tokens=chunk_tokens, l2_discard=l2_discard)

    def buffer_bytes(self, world_size: int, slot_bytes: int) -> int:
        """Bytes of one rank's communication buffer for ``world_size`` ranks and slots of
        ``slot_bytes`` (see :func:`max_slot_bytes`)."""
        return buffer_layout(world_size, self.num_channels, self.num_slots, slot_bytes).total_bytes
