"""A dispatch's own argument checks that need no peer and no Buffer state beyond its device and
topology: ``x`` (a tensor or the fp8 pair), ``use_fp8`` and ``num_worst_tokens``. Each raises
``TypeError`` / ``ValueError`` naming the argument, what was expected and what came (the Buffer
runs them inside :func:`moe_dispatch.errors.checking`, which makes them argument errors)."""

from __future__ import annotations

import os

import torch

from ..errors import checking
from ..ops.permute import INT32_MAX
from ..ops.quant import check_fp8_pair
from ..semantics.quant import FP8_BLOCK
from ..semantics.validation import check_hidden
from ..topology import Topology


def check_fp8_wire(x, use_fp8, rank: int, handle=None, return_recv_hook: bool = False) -> None:
    """``use_fp8`` of a dispatch whose ``x`` was checked: a bool, and with True a fresh
    dispatch of one tensor whose rows split into 1x128 blocks, completed by the call."""
    with checking("use_fp8", rank):
        if not isinstance(use_fp8, bool):
            raise TypeError(f"use_fp8 must be a bool, got {type(use_fp8).__name__}")
        if not use_fp8:
            return
        if isinstance(x, tuple) or handle is not None:
            raise ValueError(
                "use_fp8=True quantizes a bf16/fp16/fp32 x for a fresh dispatch: pass x as one tensor and no "
                "handle (an fp8 pair travels as it is without use_fp8)"
            )
        if return_recv_hook:
            raise ValueError("use_fp8=True dequantizes the rows as the call completes: not with return_recv_hook=True")
        if x.shape[1] % FP8_BLOCK:
            raise ValueError(
                f"use_fp8=True quantizes rows in 1x{FP8_BLOCK} blocks, but x has hidden size {x.shape[1]}: "
                f"dispatch it in {str(x.dtype).removeprefix('torch.')}, or pad it to a multiple of {FP8_BLOCK}"
            )


def check_num_worst_tokens(
    num_worst_tokens: int, x, topk_idx: torch.Tensor, topk_weights, topology: Topology, device
) -> None:
    """``num_worst_tokens`` of a dispatch whose other arguments were checked: its receive
    buffers (``num_worst_tokens`` rows of x, topk_idx and topk_weights) must fit this rank's
    share of the memory they live in (a GPU's own; on CPU the host's, shared by the EP
    group's ranks). The most rows a dispatch can deliver is the sum of every rank's tokens,
    which no rank knows before the transfer, so the bound is the memory (and the kernels'
    int32 row counts); ``num_tokens * num_ranks`` (DeepEP's convention) passes wherever it fits.

    Raises:
        ValueError: the buffers would not fit (naming the bound and the value).
    """
    xs = list(x) if isinstance(x, tuple) else [x]
    row_bytes = sum(t.shape[1] * t.element_size() for t in xs) + topk_idx.shape[1] * topk_idx.element_size()
    if topk_weights is not None:
        row_bytes += topk_weights.shape[1] * topk_weights.element_size()
    if device.type == "cuda":
        memory, where = torch.cuda.mem_get_info(device)[1], f"{device}'s memory"
    else:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        memory, where = total // topology.world_size, f"1/{topology.world_size} of the host's memory"
    # The kernels count a node's rows (ranks_per_node budgets) in int32.
    limit = min(memory // max(row_bytes, 1), INT32_MAX // topology.ranks_per_node)
    if num_worst_tokens > limit:
        num_tokens = xs[0].shape[0]
        raise ValueError(
            f"num_worst_tokens must be at most {limit} here (its receive buffers take {row_bytes} bytes per row "
            f"and must fit {where}, {memory} bytes, and a node's rows are counted in int32; a dispatch delivers "
            f"at most the sum of every rank's tokens, num_tokens * num_ranks = {num_tokens * topology.world_size} "
            f"with this rank's), got {num_worst_tokens}"
        )


def check_x(x, device, num_tokens: int | None = None, rows_what: str = "topk_idx") -> None:
    """``x`` of a dispatch: a ``[T, H]`` tensor (``T`` = ``num_tokens`` when given, the rows of
    ``rows_what``) or the fp8 pair ``(x_fp8, scales)``; TypeError/ValueError otherwise."""
    if isinstance(x, list):
        raise TypeError(f"x must be a tensor, or the fp8 pair as the tuple (x_fp8, scales), got a list of {len(x)}")
    if isinstance(x, tuple):
        if len(x) != 2:
            raise ValueError(f"an fp8 x must be the tuple (x_fp8, scales), got a tuple of {len(x)}")
        check_fp8_pair(*x, num_tokens=num_tokens, device=device)
    else:
        check_hidden("x", x, device, num_rows=num_tokens, rows_what=rows_what)
