"""The transports' row sums: :func:`moe_dispatch.semantics.sums.ordered_sum`, in one pass on the
CPU (``csrc/kernels/sums_cpu.cpp``) where it can run, its torch reference elsewhere.

:func:`plan_sum` and :func:`plan_sum_by_output` return, on CPU with ``moe_dispatch._C`` built and
for sums with an fp32 path (an output of three terms or more, or row scales), a
:class:`OnePassPlan`: each output's rows, ascending. :func:`ordered_sum` adds them in one pass
that reads each row once into an fp32 accumulator and rounds once, as c10 rounds, which are the
bits of the reference's torch path (``test_sums`` compares them); the reference gathers the rows
of each slot and copies the sums twice. Every other plan, and a call the one pass cannot serve,
is the reference's. Sums of at most two terms per output keep the reference's ``index_add_``,
which reads their rows in order and is faster there than any gather.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch

from .. import _ext
from ..semantics import sums as reference
from ..semantics.sums import SumPlan

_DTYPES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}  # sums_cpu.cpp's dtype codes
enabled = True  # False: the reference everywhere (A/B comparisons in one run)


@dataclasses.dataclass(eq=False)
class OnePassPlan:
    """How :func:`ordered_sum` adds rows onto ``num_out`` outputs in one pass.

    Attributes:
        num_out: outputs.
        scaled: the plan is for rows with scales.
        offsets: ``[num_out + 1]`` int64; output ``o``'s rows are ``terms[offsets[o]:offsets[o + 1]]``.
        terms: ``[rows summed]`` int64, each output's rows ascending.
        fallback: makes the reference's :class:`~moe_dispatch.semantics.sums.SumPlan` of the same
            sums, for a call the one pass cannot serve (:meth:`torch_plan`).
    """

    num_out: int
    scaled: bool
    offsets: torch.Tensor
    terms: torch.Tensor
    fallback: Callable[[], SumPlan] = dataclasses.field(repr=False)
    _torch: SumPlan | None = dataclasses.field(default=None, repr=False)

    def torch_plan(self) -> SumPlan:
        """The reference's plan of these sums (made once, when first asked)."""
        if self._torch is None:
            self._torch = self.fallback()
        return self._torch


def _kernel():
    """``_C.ordered_sum_cpu``, or None (the extension is not built, or :data:`enabled` is off)."""
    if not enabled or not _ext.extension_status().built:
        return None
    return getattr(_ext._C, "ordered_sum_cpu", None)


def _has_fp32_path(counts: torch.Tensor, scaled: bool) -> bool:
    """Whether sums with these term counts per output have an fp32 path (the one pass pays there)."""
    fewest = 1 if scaled else reference.ROW_DTYPE_TERMS + 1
    return counts.numel() > 0 and int(counts.max()) >= fewest


def _offsets(counts: torch.Tensor) -> torch.Tensor:
    offsets = torch.zeros(counts.numel() + 1, dtype=torch.int64, device=counts.device)
    torch.cumsum(counts, 0, out=offsets[1:])
    return offsets


def plan_sum(index: torch.Tensor, num_out: int, *, scaled: bool = False) -> SumPlan | OnePassPlan:
    """:func:`moe_dispatch.semantics.sums.plan_sum` (same arguments), or its :class:`OnePassPlan`
    (module docstring). Synchronises the host once."""
    if index.device.type != "cpu" or _kernel() is None:
        return reference.plan_sum(index, num_out, scaled=scaled)
    kept = torch.bincount(index, minlength=num_out + 1)[:num_out]
    if not _has_fp32_path(kept, scaled):
        return reference.plan_sum(index, num_out, scaled=scaled)
    summed = torch.nonzero(index < num_out).flatten()
    terms = summed[torch.argsort(index[summed], stable=True)]  # output by output, rows ascending
    return OnePassPlan(
        num_out, scaled, _offsets(kept), terms, lambda: reference.plan_sum(index, num_out, scaled=scaled)
    )


def plan_sum_by_output(terms: torch.Tensor, num_rows: int, *, scaled: bool = False) -> SumPlan | OnePassPlan:
    """:func:`moe_dispatch.semantics.sums.plan_sum_by_output` (same arguments), or its
    :class:`OnePassPlan` (module docstring). Synchronises the host once."""
    if terms.device.type != "cpu" or _kernel() is None:
        return reference.plan_sum_by_output(terms, num_rows, scaled=scaled)
    listed = terms >= 0
    counts = listed.sum(1)
    if not _has_fp32_path(counts, scaled):
        return reference.plan_sum_by_output(terms, num_rows, scaled=scaled)
    key = torch.sort(torch.where(listed, terms, num_rows), dim=1).values  # each output's rows ascending
    return OnePassPlan(
        terms.shape[0],
        scaled,
        _offsets(counts),
        key[key < num_rows],  # row-major: output by output
        lambda: reference.plan_sum_by_output(terms, num_rows, scaled=scaled),
    )


def ordered_sum(
    plan: SumPlan | OnePassPlan,
    rows: torch.Tensor,
    scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`moe_dispatch.semantics.sums.ordered_sum` (same arguments and result, bit for bit),
    in one pass for a :class:`OnePassPlan` where the rows allow it: CPU rows of bf16, fp16 or
    fp32 whose elements are contiguous within a row, into a contiguous ``out`` of their dtype.

    Raises:
        ValueError: ``scale`` given for a plan made without ``scaled``, or the reverse.
    """
    if isinstance(plan, OnePassPlan):
        if (scale is not None) != plan.scaled:
            raise ValueError("ordered_sum: row scales need a plan made with scaled=True, and such a plan needs them")
        summed = _run(plan, rows, scale, out)
        if summed is not None:
            return summed
        plan = plan.torch_plan()
    return reference.ordered_sum(plan, rows, scale, out)


def _run(
    plan: OnePassPlan, rows: torch.Tensor, scale: torch.Tensor | None, out: torch.Tensor | None
) -> torch.Tensor | None:
    """The one pass into ``out`` (made when None); None where it cannot run."""
    kernel = _kernel()
    if kernel is None or rows.device.type != "cpu" or rows.dtype not in _DTYPES:
        return None
    if out is not None and (not out.is_contiguous() or out.dtype != rows.dtype):
        return None
    flat = rows.reshape(rows.shape[0], math.prod(rows.shape[1:]))
    if flat.shape[1] > 1 and flat.stride(1) != 1:
        return None
    if out is None:
        out = rows.new_empty((plan.num_out, *rows.shape[1:]))
    if scale is not None:
        scale = scale.to(torch.float32).contiguous()
    kernel(
        rows=flat.data_ptr(),
        row_stride=flat.stride(0),
        width=flat.shape[1],
        dtype=_DTYPES[rows.dtype],
        offsets=plan.offsets.data_ptr(),
        terms=plan.terms.data_ptr(),
        scale=scale.data_ptr() if scale is not None else 0,
        out=out.data_ptr(),
        out_stride=flat.shape[1],
        num_out=plan.num_out,
    )
    return out
