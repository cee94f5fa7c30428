"""``Buffer(transport="kernels")``: the Buffer's transport interface served by the intranode kernels.

The interface is :class:`~moe_dispatch.transport.base.Transport`, the torch_dist transport's
too, so everything the Buffer builds on it (autograd, ``async_finish``, receive hooks,
``num_worst_tokens``, cached dispatch, fp8, delayed weight gradients) works unchanged. The
launches need no host wait: ``dispatch``, ``forward`` and ``combine`` launch when called and
return :func:`~moe_dispatch.transport.base.completed` steps. Underneath is one
:class:`~moe_dispatch.transport.intranode.IntranodeTransport`: CUDA IPC buffers and the kernels on
GPUs; on CPU tensors, shared memory and the kernels' CPU backend (the same protocol code on
threads), which is how the tests run this path without a GPU.

- One node: every rank of the EP group on one node (a group spanning nodes takes
  ``transport="torch_dist"``).
- Every launch goes through the Buffer's one ordered queue (``plans_on_comm_thread``): the
  launches share one set of rings, so a fresh dispatch's notify must not run beside another
  operation's kernels.
- ``plan`` compares the arguments across ranks (on gloo, as the torch_dist transport does),
  sizes the buffers for the rows (fp32 rows of the dispatch's hidden size, so gradients and
  fp32 combines fit; a later, wider dispatch re-sizes them on every rank), runs notify and
  reads the receive count. ``dispatch`` then runs the dispatch kernel into the Buffer's
  outputs (top-k ids handed back in global numbering, which the Buffer converts as it does
  for torch_dist); ``forward`` replays a plan for any row tensors; ``combine`` sums rows in
  fp32 in ascending rank order, as ``moe_dispatch.reference.combine`` does for one node.
- Rows whose width is not a multiple of 16 bytes (what the kernels move per vector) travel
  zero-padded; fp16 combines on CPU run as fp32 rows (the same fp32 sum, rounded once).
- The buffers grow, on every rank, when an operation needs wider rows than they hold (the
  Buffer's argument checks keep the ranks in step on gloo; on NCCL every rank must pass the
  same shapes, as for any collective). ``Buffer.close()`` frees them.
- Host synchronisation: a fresh dispatch reads its receive count (also with
  ``num_worst_tokens``, unlike the kernels' own budget mode); combine and cached dispatch do
  not. On a GPU, a kernel that timed out is reported by the next call on this Buffer.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist

from ..config import MAX_RANKS, Config
from ..topology import Topology
from .base import Field, Steps, completed
from .intranode import (
    COMBINE_DTYPES,
    IntranodeHandle,
    IntranodeTransport,
    _combine,
    _Input,
    _launch_dispatch,
    _notify,
)
from .torch_dist import ALL_COMM, TorchDistTransport

_VECTOR = 16  # bytes the kernels move per access


@dataclasses.dataclass
class KernelPlan:
    """A dispatch's routing as the kernels keep it (a :class:`~moe_dispatch.transport.base.Plan`).

    Attributes:
        handle: the kernels' :class:`~moe_dispatch.transport.intranode.IntranodeHandle` (receive
            prefix per source and channel).
        experts_per_rank: E / W.
        rank: this rank's index in the EP group.
    """

    handle: IntranodeHandle
    experts_per_rank: int
    rank: int

    @property
    def num_recv_tokens(self) -> int:
        """R, the rows this rank received."""
        return self.handle.num_recv_tokens

    @property
    def internode_rows(self) -> int:
        """Rows sent to other nodes: none (one node)."""
        return 0

    @property
    def intranode_rows(self) -> int:
        """Rows this rank sent to the other ranks of its node (reads the layout: a host sync)."""
        sent = self.handle.is_token_in_rank
        return int(sent.sum()) - int(sent[:, self.rank].sum())


class KernelTransport:
    """The intranode kernels behind a Buffer (see the module docstring), a
    :class:`~moe_dispatch.transport.base.Transport`.

    Args:
        group: the EP process group (NCCL with CUDA tensors, gloo with CPU tensors).
        topology: this rank's place; must be one node.
        timeout_s: bound of every wait (kernels and the argument checks).
        config: the kernels' launch shape and queue sizes (the Buffer checked it), or "auto":
            ``Config.auto`` at the first plan, from the agreed fields (``_auto_config``).
        device: the Buffer's device.

    Raises:
        ValueError: more than one node, or more ranks than the kernels serve.
        RuntimeError: the extension is not built.

    Collective: every rank of ``group`` constructs it together.
    """

    plans_on_comm_thread = True

    def __init__(
        self, group: dist.ProcessGroup, topology: Topology, timeout_s: float, config: Config | str, device: torch.device
    ):
        self.check(topology)
        self.config = config
        self.topology, self.timeout_s, self.device = topology, timeout_s, device
        # The argument checks and progress records are the torch_dist transport's; its
        # comm-thread group also carries the kernels' handle exchange.
        self._dist = TorchDistTransport(group, topology, timeout_s, num_chunks=1)
        self.progress = self._dist.progress
        self._group = self._dist.groups[ALL_COMM] or group
        self._kernels: IntranodeTransport | None = None
        self._capacity = (0, 0)  # (row elements at 4 bytes, top-k) the buffers hold

    @staticmethod
    def check(topology: Topology) -> None:
        """Raises unless the kernels can serve ``topology`` here (Buffer checks it before its
        ranks agree on their arguments, so no rank fails alone later).

        Raises:
            ValueError: more than one node, or more ranks than the kernels serve.
            RuntimeError: the extension is not built.
        """
        if topology.num_nodes != 1:
            raise ValueError(
                f"transport='kernels' runs the intranode kernels, for an EP group on one node, but this "
                f"one spans {topology.num_nodes} nodes ({topology.ranks_per_node} ranks per node); use "
                "transport='torch_dist' across nodes (the internode kernels are not wired into Buffer "
                "yet)"
            )
        from .. import _ext

        status = _ext.extension_status()
        if not status.built:
            raise RuntimeError(f"transport='kernels' needs the built extension moe_dispatch._C: {status.error}")
        if topology.world_size > MAX_RANKS:
            raise ValueError(
                f"transport='kernels' serves EP groups of at most {MAX_RANKS} ranks on one node (an "
                f"NVLink domain), this one has {topology.world_size}; use transport='torch_dist'"
            )

    def agree(self, fields: dict[str, Field], what: str, status: int = 0) -> Steps:
        """Steps comparing ``fields`` and statuses across ranks (``TorchDistTransport.agree``)."""
        return self._dist.agree(fields, what, status)

    # -- dispatch ----------------------------------------------------------------------------
    def plan(
        self,
        is_token_in_rank: torch.Tensor,
        fields: dict[str, Field],
        what: str = "dispatch",
        on_comm_thread: bool = True,
        status: int = 0,
    ) -> Steps:
        """Steps that check the arguments and statuses across ranks, size the buffers and run
        notify; returns the :class:`KernelPlan` (a host sync: R is read back). A refusal
        (``status`` != 0) raises ValueError on every rank after the check."""
        # The operation first, so it is told apart from a combine's check.
        fields = {"operation": "dispatch (metadata)", **fields}
        yield from self._dist.agree(fields, what, status)
        self._check_errors()
        if self.config == "auto":
            self.config = _auto_config(fields, self.topology)
        kernels = self._sized(_padded_width(fields["hidden"], 4), fields["top-k"])
        num_tokens = is_token_in_rank.shape[0]
        inp = _Input(
            self.topology.rank,
            torch.empty(num_tokens, 0, device=self.device),
            None,
            torch.empty(num_tokens, fields["top-k"], dtype=torch.int64, device=self.device),
            None,
            is_token_in_rank.contiguous(),
            torch.int64,
        )
        experts_per_rank = fields["num_experts"] // self.topology.world_size
        (handle,), _ = _notify(
            kernels.engine, [inp], experts_per_rank, num_sms=self.config.num_sms, num_worst_tokens=None, skip_rank=None
        )
        return KernelPlan(handle, experts_per_rank, self.topology.rank)

    def dispatch(
        self,
        tensors: list[torch.Tensor],
        is_token_in_rank: torch.Tensor,
        plan: KernelPlan,
        out: list[torch.Tensor],
        what: str = "dispatch",
    ) -> Steps:
        """Steps moving ``tensors`` = ``[x, (fp8 scales), topk_idx, (topk_weights)]`` into ``out``
        (the same list, ``[R, ...]``); top-k ids arrive in global numbering (-1 where the expert
        is another rank's), weights 0 there."""
        k = next(i for i, t in enumerate(tensors) if not t.is_floating_point())  # topk_idx, the integer one
        x, scales = tensors[0], (tensors[1] if k == 2 else None)
        topk_idx, weights = tensors[k], (tensors[k + 1] if len(tensors) > k + 1 else None)
        inp = _Input(
            self.topology.rank,
            _rows16(x),
            scales.contiguous() if scales is not None else None,
            topk_idx.to(torch.int64).contiguous(),
            weights.contiguous() if weights is not None else None,
            is_token_in_rank.contiguous(),
            topk_idx.dtype,
        )
        recv_x = _landing(out[0], inp.x.shape[1])
        launched = self._outputs(
            plan,
            recv_x,
            out[1] if scales is not None else None,
            out[-1] if weights is not None else None,
            topk_idx.shape[1],
        )
        self._launch(inp, plan, launched)
        _land(out[0], recv_x)
        first = self.topology.rank * plan.experts_per_rank
        local = launched["topk_idx"]
        out[k].copy_(torch.where(local >= 0, local + first, torch.full_like(local, -1)))
        return completed()

    def forward(self, tensors: list[torch.Tensor], plan: KernelPlan, out: list[torch.Tensor], what: str) -> Steps:
        """Steps replaying ``plan`` for row tensors ``[T, ...]`` into ``out`` ``[R, ...]`` (an fp8
        pair travels as one row)."""
        fp8 = len(tensors) == 2 and tensors[0].dtype == torch.float8_e4m3fn
        groups = [(tensors, out)] if fp8 else [([t], [o]) for t, o in zip(tensors, out)]
        for (x, *scales), (dst, *dst_scales) in groups:
            x2d = _rows16(_flat(x))
            inp = _Input(
                self.topology.rank,
                x2d,
                scales[0].contiguous() if scales else None,
                torch.empty(x.shape[0], 0, dtype=torch.int64, device=self.device),
                None,
                plan.handle.is_token_in_rank,
                None,
            )
            dst2d = _flat(dst)
            recv_x = _landing(dst2d, x2d.shape[1])
            self._launch(inp, plan, self._outputs(plan, recv_x, dst_scales[0] if scales else None, None, 0))
            _land(dst2d, recv_x)
        return completed()

    def combine(
        self,
        tensors: list[torch.Tensor],
        scales: list[torch.Tensor | None],
        plan: KernelPlan,
        out: list[torch.Tensor],
        what: str,
    ) -> Steps:
        """Steps summing each tensor's rows ``[R, ...]`` (times its ``[R]`` fp32 scale, if any)
        onto their source tokens in ``out`` ``[T, ...]``."""
        for y, scale, dst in zip(tensors, scales, out):
            if y.dtype not in COMBINE_DTYPES:
                raise TypeError(f"{what}: the kernels combine bf16/fp16/fp32 rows, got {y.dtype}")
            if y.dtype == torch.float16 and self.device.type == "cpu":
                y = y.float()  # the CPU backend sums fp16 as fp32 rows: the same fp32 sum, rounded once below
            y2d = _rows16(_flat(y))
            self._check_errors()  # before a resize could drop the record with the old buffers
            kernels = self._sized(_row_elements(y2d), 0)
            summed = _combine(
                kernels.engine,
                self.topology.rank,
                [y2d],
                [plan.handle],
                [scale.contiguous() if scale is not None else None],
                None,
            )[0]
            kernels.check_errors()
            dst2d = _flat(dst)
            dst2d.copy_(summed[:, : dst2d.shape[1]])
        return completed()

    # -- helpers -----------------------------------------------------------------------------
    def _sized(self, row_elements: int, num_topk: int) -> IntranodeTransport:
        """The kernels' buffers, (re)made when a dispatch needs wider rows or more top-k
        (collective: every rank's plan sees the same, checked fields)."""
        held_rows, held_topk = self._capacity
        if self._kernels is None or row_elements > held_rows or num_topk > held_topk:
            capacity = (max(row_elements, held_rows), max(num_topk, held_topk))
            # Made before the old one is freed: if a peer fails here, the old buffers stay valid.
            # Its collective setup also means every rank's earlier launches have finished.
            kernels = IntranodeTransport(
                self._group,
                self.topology.rank,
                *capacity,
                config=self.config,
                element_bytes=4,
                timeout_s=self.timeout_s,
                device=self.device,
            )
            old, self._kernels, self._capacity = self._kernels, kernels, capacity
            if old is not None:
                old.close()
        return self._kernels

    def _outputs(
        self,
        plan: KernelPlan,
        recv_x: torch.Tensor,
        recv_scales: torch.Tensor | None,
        recv_weights: torch.Tensor | None,
        num_topk: int,
    ) -> dict:
        """A dispatch launch's outputs: the rows the caller keeps, and scratch for what the
        Buffer derives itself (local top-k ids, source indices, per-expert counts)."""
        rows, device = plan.num_recv_tokens, self.device
        return {
            "x": recv_x,
            "scales": recv_scales,
            "topk_weights": recv_weights,
            "topk_idx": torch.empty(rows, num_topk, dtype=torch.int64, device=device),
            "src_idx": torch.empty(rows, dtype=torch.int32, device=device),
            "per_expert": torch.zeros(plan.experts_per_rank, dtype=torch.int64, device=device),
        }

    def _launch(self, inp: _Input, plan: KernelPlan, out: dict) -> None:
        # A cached dispatch may move wider rows than the plan's dispatch (every rank the same:
        # checked by the Buffer's agree on gloo). fp8 scales are fp32: one 4-byte element each.
        row_elements = _row_elements(inp.x) + (inp.scales.shape[1] if inp.scales is not None else 0)
        self._check_errors()  # before a resize could drop the record with the old buffers
        kernels = self._sized(_padded_width(row_elements, 4), inp.topk_idx.shape[1])
        _launch_dispatch(kernels.engine, [inp], [plan.handle], [out], plan.experts_per_rank, skip_rank=None)
        kernels.check_errors()

    def _check_errors(self) -> None:
        """Raises a timeout the kernels recorded (on a GPU: one of an earlier, asynchronous launch)."""
        if self._kernels is not None:
            self._kernels.check_errors()

    def close(self) -> None:
        """Frees the kernels' buffers, then the argument checks' groups (collective: every rank,
        after its last operation; the barrier first keeps a peer's last kernel from writing into
        freed memory)."""
        try:
            if self._kernels is not None:
                dist.barrier(group=self._group)
                self._kernels.close()
                self._kernels = None
        finally:
            self._dist.close()

    def release(self) -> None:
        """Frees what needs no peer: shared memory on CPU (a peer's mapping of it stays valid);
        on a GPU the buffers stay until the process exits, as a peer's kernel may still write
        into them. Then ``TorchDistTransport.release``."""
        if self._kernels is not None and self.device.type == "cpu":
            self._kernels.close()
        self._kernels = None
        self._dist.release()


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``t [N, ...]`` as ``[N, prod(...)]`` (a view where ``t`` allows one)."""
    return t.reshape(t.shape[0], math.prod(t.shape[1:]))


def _row_elements(rows: torch.Tensor) -> int:
    """Row width of ``rows [R, W]`` counted in 4-byte elements (what the buffers are sized in)."""
    return -(-rows.shape[1] * rows.element_size() // 4)


def _padded_width(width: int, element_bytes: int) -> int:
    """``width`` elements rounded up to a multiple of 16 bytes."""
    per = _VECTOR // element_bytes
    return -(-width // per) * per


def _rows16(x: torch.Tensor) -> torch.Tensor:
    """``x [T, H]`` contiguous, 16-byte aligned, rows zero-padded to a multiple of 16 bytes."""
    width = _padded_width(x.shape[1], x.element_size())
    if width == x.shape[1] and x.is_contiguous() and x.data_ptr() % _VECTOR == 0:
        return x
    padded = x.new_zeros(x.shape[0], width)
    padded[:, : x.shape[1]] = x
    return padded


def _landing(dst: torch.Tensor, width: int) -> torch.Tensor:
    """Where the kernel writes rows of ``width`` for ``dst``: dst itself when it fits as is."""
    if width == dst.shape[1] and dst.is_contiguous() and (dst.numel() == 0 or dst.data_ptr() % _VECTOR == 0):
        return dst
    return dst.new_empty(dst.shape[0], width)


def _land(dst: torch.Tensor, landed: torch.Tensor) -> None:
    if landed is not dst:
        dst.copy_(landed[:, : dst.shape[1]])


AUTO_TOKENS = 4096  # config="auto": the tokens per rank Config.auto assumes (the ranks' own counts differ)


def _auto_config(fields: dict[str, Field], topology: Topology) -> Config:
    """``Config.auto`` for ``config="auto"`` from a dispatch's checked fields (``hidden``,
    ``top-k``, ``num_experts``, ``fp8 x``, ``x dtype``: the same on every rank, so every rank
    gets the same Config) and :data:`AUTO_TOKENS` tokens per rank."""
    return Config.auto(
        AUTO_TOKENS,
        topology.world_size,
        hidden=fields["hidden"],
        num_topk=fields["top-k"],
        num_experts=fields["num_experts"],
        fp8=fields["fp8 x"],
        element_bytes=4 if fields["x dtype"] == torch.float32 else 2,
        num_nodes=topology.num_nodes,
    )
