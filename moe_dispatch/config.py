"""``Config``: launch shape and queue sizes of the CUDA intranode kernels.

Pure Python (no extension needed): it validates itself when built, sizes the communication
buffer (with the kernels' layouts mirrored in :mod:`moe_dispatch.kernel_layout`), and
``Config.auto`` picks the SM budget and ring depth from the shape with the analytical model of
:mod:`moe_dispatch.costmodel`.
"""

from __future__ import annotations

import dataclasses

from . import costmodel
from .kernel_layout import COMBINE_WARPS, COPY_VARIANTS, MAX_CHANNELS, MAX_ROWS_IN_FLIGHT, MAX_TOPK, buffer_layout

INTERNODE_PIPELINES = ("fused", "staged")

# Experimental: the named kernel variants, kept only to be timed side by side against the defaults
# (benchmarks/gpu_check.sh, bench_intranode/internode --variants) and run by the tests. Nothing on the
# main path selects one: a Config is "current" unless built with Config.with_variant(name). Each is
# Config fields over the current kernels' (csrc/kernels/variant.cuh says why each should help).
VARIANTS: dict[str, dict] = {
    "current": {},
    "loads8": {"loads_in_flight": 8},
    "uncapped": {"register_cap": False},
    "rows2": {"loads_in_flight": 8, "rows_in_flight": 2, "register_cap": False},
    "rows2-loads16": {"loads_in_flight": 16, "rows_in_flight": 2, "register_cap": False},
    "bulk": {"bulk_copy": True},
    "flags": {"slot_flags": True},
    "team2": {"combine_warps": 2},
    "team4": {"combine_warps": 4},
    "backoff": {"coordinator_backoff": True},
    "combined": {
        "loads_in_flight": 8,
        "rows_in_flight": 2,
        "register_cap": False,
        "slot_flags": True,
        "combine_warps": 2,
        "coordinator_backoff": True,
    },
}


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

    Kernel variants (``csrc/kernels/variant.cuh`` says why each should help; the defaults are the
    current kernels; every choice gives the same results bit for bit;
    ``benchmarks/bench_intranode.py`` and ``bench_internode.py`` time them side by side):

    Attributes:
        loads_in_flight: 16-byte loads per lane a row copy keeps in flight (over
            ``rows_in_flight`` rows); the combine's reduction keeps half as many per holder.
        rows_in_flight: rows (1 or 2) a warp copies at once: the ring loops hand it that many
            slots together.
        bulk_copy: rows move by TMA bulk copies (``cp.async.bulk`` through shared memory, sm_90+;
            the CPU backend copies as always).
        register_cap: ``__launch_bounds__(512, 2)`` (the current kernels, at most 64 registers);
            False: ``(512, 1)``, no cap, one block per SM.
        (loads_in_flight, rows_in_flight, bulk_copy, register_cap) must be one of the compiled
        :data:`~moe_dispatch.kernel_layout.COPY_VARIANTS`; the fused internode kernels have the
        ones marked so in their loopback mode (their NVSHMEM mode and the staged pipeline's stage 1
        run the current copies; its stage 2 is the intranode kernels).
        slot_flags: per-slot ready flags instead of per-chunk tails (no group barrier per chunk;
            intranode kernels only, the internode ones ignore it). Every rank must agree: the
            header check compares it.
        combine_warps: warps (1, 2, 4) that reduce one token together, each over its share of the
            row's columns (intranode combine and the internode source reducers).
        coordinator_backoff: the combine coordinator sleeps (``__nanosleep``, 64 ns doubling to
            1 us) while no worker moved, instead of spinning.

    Raises:
        ValueError: naming the field, the rule and the value, when built.
    """

    num_sms: int = 16
    num_slots: int = 32
    chunk_tokens: int = 8
    l2_discard: bool = False
    internode_pipeline: str = "fused"
    loads_in_flight: int = 4
    rows_in_flight: int = 1
    bulk_copy: bool = False
    register_cap: bool = True
    slot_flags: bool = False
    combine_warps: int = 1
    coordinator_backoff: bool = False

    def __post_init__(self) -> None:
        for name in ("num_sms", "num_slots", "chunk_tokens", "loads_in_flight", "rows_in_flight", "combine_warps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"Config.{name} must be an int, got {value!r}")
        for name in ("l2_discard", "bulk_copy", "register_cap", "slot_flags", "coordinator_backoff"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Config.{name} must be a bool, got {getattr(self, name)!r}")
        if not 1 <= self.rows_in_flight <= MAX_ROWS_IN_FLIGHT:
            raise ValueError(f"Config.rows_in_flight must be in [1, {MAX_ROWS_IN_FLIGHT}], got {self.rows_in_flight}")
        if self.combine_warps not in COMBINE_WARPS:
            raise ValueError(f"Config.combine_warps must be one of {COMBINE_WARPS}, got {self.combine_warps}")
        if self.copy_variant not in [v[:4] for v in COPY_VARIANTS]:
            compiled = ", ".join(f"{v[:4]}" for v in COPY_VARIANTS)
            raise ValueError(
                "Config (loads_in_flight, rows_in_flight, bulk_copy, register_cap) must be a compiled copy "
                f"variant: one of {compiled}; got {self.copy_variant}"
            )
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

    @property
    def copy_variant(self) -> tuple[int, int, bool, bool]:
        """``(loads_in_flight, rows_in_flight, bulk_copy, register_cap)``: the compiled copy kernel."""
        return (self.loads_in_flight, self.rows_in_flight, self.bulk_copy, self.register_cap)

    @property
    def fused_copy(self) -> bool:
        """Whether the fused internode kernels are compiled for this copy variant (loopback mode)."""
        return next(v[4] for v in COPY_VARIANTS if v[:4] == self.copy_variant)

    def with_variant(self, name: str) -> "Config":
        """This config with the fields of the named variant (:data:`VARIANTS`) over the current
        kernels' (the others kept). Raises ValueError for an unknown name."""
        if name not in VARIANTS:
            raise ValueError(f"unknown kernel variant {name!r}; the variants are {sorted(VARIANTS)}")
        defaults = {f.name: f.default for f in dataclasses.fields(Config) if f.name in _VARIANT_FIELDS}
        return dataclasses.replace(self, **{**defaults, **VARIANTS[name]})

    @property
    def variant_name(self) -> str:
        """The name of this config's variant in :data:`VARIANTS`, or "custom"."""
        mine = self.variant_fields()
        return next((name for name in VARIANTS if Config().with_variant(name).variant_fields() == mine), "custom")

    def variant_fields(self) -> dict[str, int]:
        """The variant as ``_C.Variant`` takes it (its fields, by keyword; csrc/kernels/variant.cuh)."""
        return {
            "loads_in_flight": self.loads_in_flight,
            "rows_in_flight": self.rows_in_flight,
            "bulk_copy": int(self.bulk_copy),
            "register_cap": int(self.register_cap),
            "slot_flags": int(self.slot_flags),
            "combine_warps": self.combine_warps,
            "coordinator_backoff": int(self.coordinator_backoff),
        }

    @classmethod
    def auto(
        cls,
        num_tokens: int,
        world_size: int,
        *,
        hidden: int = 7168,
        num_topk: int = 8,
        num_experts: int | None = None,
        fp8: bool = False,
        element_bytes: int = 2,
        num_nodes: int = 1,
        machine=None,
        max_sms: int = 24,
        num_sms: int | None = None,
        num_slots: int | None = None,
        chunk_tokens: int | None = None,
        l2_discard: bool = False,
        **fields,
    ) -> "Config":
        """The SM budget and ring depth the analytical model (:mod:`moe_dispatch.costmodel`)
        chooses for the shape on a real node; explicit arguments win.

        Args:
            num_tokens: T per rank; ``world_size``: W ranks (``num_nodes`` nodes of W / N).
            hidden, num_topk, num_experts (default 32 W), fp8 (dispatch of e4m3 rows),
                element_bytes (2: bf16/fp16, 4: fp32): the shape (defaults: DeepSeek-V3's).
            machine: a :class:`moe_dispatch.costmodel.Machine` (GPU, NVLink and NIC bandwidths,
                fitted latencies); default ``costmodel.H200`` (H200 with NVLink4, CX7).
            max_sms: the most SMs it may take (the rest stay with the experts' GEMMs).
            num_sms, num_slots, chunk_tokens, l2_discard, **fields: Config fields to keep as
                given (a variant's fields too: the model predicts for that variant).

        The choice (``costmodel.choose``): the fewest SMs within 10% of the best predicted
        dispatch + combine time up to ``max_sms``, then the shallowest ring within 10% of a deep
        one. Every rank derives the same Config from the same arguments.

        Raises:
            ValueError: a shape argument out of range, or a Config field's own check.
        """
        for name, value, low in (("num_tokens", num_tokens, 0), ("world_size", world_size, 1), ("hidden", hidden, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"Config.auto: {name} must be an int >= {low}, got {value!r}")
        if not isinstance(num_nodes, int) or num_nodes < 1 or world_size % num_nodes:
            raise ValueError(f"Config.auto: num_nodes must divide world_size={world_size}, got {num_nodes!r}")
        num_experts = num_experts or 32 * world_size
        if num_experts % world_size or not 0 <= num_topk <= min(MAX_TOPK, num_experts):
            raise ValueError(
                f"Config.auto: num_experts must be a multiple of world_size={world_size} and num_topk in "
                f"[0, min({MAX_TOPK}, num_experts)], got num_experts={num_experts}, num_topk={num_topk}"
            )
        base = cls(l2_discard=l2_discard, **fields)
        workload = costmodel.Workload(
            max(num_tokens, 1),
            hidden,
            num_topk,
            num_experts,
            world_size,
            world_size // num_nodes,
            fp8=fp8,
            element_bytes=element_bytes,
        )
        sms, slots, chunk = costmodel.choose(workload, base, machine=machine or costmodel.H200, max_sms=max_sms)
        num_sms = num_sms or sms
        chunk_tokens = chunk_tokens or min(chunk, num_slots or chunk)
        num_slots = num_slots or max(slots, chunk_tokens)
        if num_nodes > 1:  # the internode kernels put whole chunks: the chunk divides the ring
            num_slots = -(-num_slots // chunk_tokens) * chunk_tokens
        return dataclasses.replace(base, num_sms=num_sms, num_slots=num_slots, chunk_tokens=chunk_tokens)

    def buffer_bytes(self, world_size: int, slot_bytes: int) -> int:
        """Bytes of one rank's communication buffer for ``world_size`` ranks and slots of
        ``slot_bytes`` (see :func:`moe_dispatch.kernel_layout.max_slot_bytes`)."""
        return buffer_layout(world_size, self.num_channels, self.num_slots, slot_bytes).total_bytes


_VARIANT_FIELDS = (
    "loads_in_flight",
    "rows_in_flight",
    "bulk_copy",
    "register_cap",
    "slot_flags",
    "combine_warps",
    "coordinator_backoff",
)
