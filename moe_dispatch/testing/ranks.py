"""One rank per process over the kernels, without a Buffer: the tests' harness of
:class:`~moe_dispatch.transport.kernels.intranode.IntranodeBuffers` and
:class:`~moe_dispatch.transport.kernels.internode.InternodeBuffers`.

- :class:`IntranodeRank`: the intranode kernels (one node; CUDA IPC buffers, or shared memory
  with ``device="cpu"``).
- :class:`InternodeRank`: the hierarchical kernels (NVSHMEM on GPUs, shared memory on CPU).

Each checks this rank's arguments (:func:`~moe_dispatch.transport.kernels.calls.prepare_input`),
runs the operation on its buffers (the same one-rank operations ``Buffer(transport="kernels")``
runs) and, for arguments it cannot use, the refusal instead (its peers finish at once and record
why, instead of waiting out their timeout), then synchronises as the kernel path does. Tests
spawn one process per rank (gloo worlds, ``device="cpu"``, or one GPU each);
:mod:`moe_dispatch.testing.loopback` runs a whole world in one process instead.
"""

from __future__ import annotations

import torch

from ..errors import CommError
from ..transport.kernels.calls import prepare_input
from ..transport.kernels.header import OP_CACHED_DISPATCH, OP_COMBINE, OP_DISPATCH
from ..transport.kernels.internode import InternodeBuffers
from ..transport.kernels.intranode import IntranodeBuffers, IntranodeHandle
from ..transport.kernels.launcher import RankBuffers

__all__ = ["InternodeRank", "IntranodeRank", "KernelRank"]


class KernelRank:
    """Dispatch and combine of one rank over its buffers: the argument checks, the refusal a rank
    runs instead of an operation whose arguments it cannot use, and the synchronisation after.
    A subclass names the buffers it makes from its arguments (:class:`IntranodeRank`,
    :class:`InternodeRank`).

    Attributes: ``buffers`` (a :class:`~moe_dispatch.transport.kernels.launcher.RankBuffers`) and,
    from them, ``rank``, ``world_size``, ``device``, ``config``.
    """

    buffers_type: type[RankBuffers]
    handle_type: type | None = None  # handles must be this type (None: the operation checks them)

    def __init__(self, *args, **kwargs):
        self.buffers = buffers = self.buffers_type(*args, **kwargs)
        self.rank, self.world_size, self.device, self.config = (
            buffers.rank,
            buffers.world_size,
            buffers.device,
            buffers.config,
        )

    def dispatch(
        self,
        x,
        topk_idx: torch.Tensor | None,
        topk_weights: torch.Tensor | None,
        num_experts: int,
        *,
        num_sms: int | None = None,
        handle=None,
        num_worst_tokens: int | None = None,
        dispatch_id: int | None = None,
    ):
        """This rank's dispatch (collective: every rank of the group calls it).

        Args: as :meth:`moe_dispatch.testing.loopback.Loopback.dispatch` (one node) or
        :meth:`~moe_dispatch.testing.loopback.InternodeLoopback.dispatch` (several) for one rank
        (``x``, ``topk_idx``, ``topk_weights``, ``handle``, ``dispatch_id``). Returns this rank's
        result (:class:`~moe_dispatch.transport.kernels.intranode.RankDispatch`,
        :class:`~moe_dispatch.transport.kernels.internode_engines.InternodeDispatch`). Raises ValueError /
        TypeError for bad arguments (after taking part with a refusal, so the peers finish at
        once and record it), :class:`~moe_dispatch.transport.kernels.header.MismatchError` when
        the peers' calls differ, ``IntranodeTimeoutError`` / ``InternodeTimeoutError`` for a
        wait that ran out."""
        self.check_errors()

        def run():
            self._check_handle(handle, required=False)
            inp = prepare_input(
                self.rank, x, topk_idx, topk_weights, num_experts, self.world_size, self.device, handle=handle
            )
            options = {"handle": handle, "num_worst_tokens": num_worst_tokens, "dispatch_id": dispatch_id}
            return self.buffers.dispatch(inp, num_experts, num_sms=num_sms or self.config.num_sms, **options)

        result = self._refusing(OP_DISPATCH if handle is None else OP_CACHED_DISPATCH, run)
        self._after(synchronized=handle is None and not num_worst_tokens)
        return result

    def combine(self, y: torch.Tensor, handle, row_scale: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's combine (collective; never synchronises the host on a GPU): ``[T, H]`` in
        y's dtype. Raises as :meth:`dispatch`."""
        self.check_errors()

        def run():
            self._check_handle(handle, required=True)
            return self.buffers.combine(y, handle, row_scale)

        out = self._refusing(OP_COMBINE, run)
        self._after(synchronized=False)
        return out

    def check(self) -> None:
        """Synchronises with this rank's kernels, then raises as :meth:`check_errors`."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.check_errors()

    def check_errors(self) -> None:
        """Raises the timeout error a launch of this rank recorded, or
        :class:`~moe_dispatch.transport.kernels.header.MismatchError` if a peer's call differed.
        On a GPU it reads the pinned mirrors, so it does not wait for running kernels."""
        self.buffers.check_errors()

    def close(self) -> None:
        """Frees the buffers (collective: every rank, after its last operation)."""
        self.buffers.close()

    def _check_handle(self, handle, required: bool) -> None:
        """Raises TypeError for a handle these buffers cannot replay."""
        if self.handle_type is not None and (required or handle is not None):
            if not isinstance(handle, self.handle_type):
                raise TypeError(
                    f"handle must be an {self.handle_type.__name__} (of a dispatch on this transport), got "
                    f"{type(handle).__name__}"
                )

    def _refusing(self, op: int, run):
        """``run()``; if it raises ValueError / TypeError before any launch, this rank takes part
        in ``op`` without rows first (if that fails too, the error is raised caused by why)."""
        launches = self.buffers.launches
        try:
            return run()
        except (ValueError, TypeError) as err:
            if self.buffers.launches == launches:
                try:
                    self.buffers.refuse(op)
                except CommError as refusal:
                    raise err from refusal
            raise

    def _after(self, synchronized: bool) -> None:
        """The next synchronisation after an operation: at once on the CPU backend (it has
        finished); on a GPU when the host just read the notify's count (``synchronized``), from
        the pinned mirrors, which the notify wrote (reading the device would wait for the
        dispatch kernel launched since)."""
        if self.device.type == "cpu" or synchronized:
            self.check_errors()


class IntranodeRank(KernelRank):
    """This rank of the intranode kernels, one process per rank (W <= 16 on one node): a
    :class:`KernelRank` over
    :class:`~moe_dispatch.transport.kernels.intranode.IntranodeBuffers`, made with their
    arguments (``group, rank, hidden, num_topk, *, config, element_bytes, timeout_s, device``;
    their errors; collective). Handles must be
    :class:`~moe_dispatch.transport.kernels.intranode.IntranodeHandle` (TypeError otherwise)."""

    buffers_type = IntranodeBuffers
    handle_type = IntranodeHandle


class InternodeRank(KernelRank):
    """This rank of the hierarchical kernels, one process per rank (W = N x L): a
    :class:`KernelRank` over
    :class:`~moe_dispatch.transport.kernels.internode.InternodeBuffers`, made with their
    arguments (``group, rank, ranks_per_node, hidden, num_topk, *, config, element_bytes,
    timeout_s, device``; their errors; collective)."""

    buffers_type = InternodeBuffers
