"""The transports' row sums: :func:`moe_dispatch.semantics.sums.ordered_sum` (one level of the
summation order, :mod:`moe_dispatch.semantics.summation`), in one pass on the CPU
(``csrc/kernels/sums_cpu.cpp``) where it can run, its torch path elsewhere.

On CPU with ``moe_dispatch._C`` built, :func:`plan_sum` and :func:`plan_sum_by_output` return a
:class:`OnePassPlan` (each output's rows, ascending, made in one pass: a counting sort) and
:func:`plan_grouped` a :class:`GroupedPlan`. :func:`ordered_sum` and :func:`grouped_sum` add the
rows in one pass that reads each row once into an fp32 accumulator and rounds once, as c10
rounds: the bits of the reference's torch path (``test_sums`` compares them), which adds outputs
of at most two terms with ``index_add_`` into zeroed outputs (two terms commute, so the fp32 sum
rounded once is the same) and gathers the rows of each slot of the others, copying the sums
twice. A call the one pass cannot serve takes the reference's plan of the same sums.
"""

from __future__ import annotations

import dataclasses
import itertools
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
    """``moe_dispatch._C`` with its CPU sums, or None (not built, or :data:`enabled` is off)."""
    if not enabled or not _ext.extension_status().built:
        return None
    return _ext._C if hasattr(_ext._C, "plan_by_row_cpu") else None


def _plan_by_row(kernel, index: torch.Tensor, num_out: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(offsets [num_out + 1], terms)`` int64 of rows onto outputs by ``index`` (num_out: left out)."""
    index = index.to(torch.int64).contiguous()
    offsets = torch.empty(num_out + 1, dtype=torch.int64)
    terms = torch.empty(index.numel(), dtype=torch.int64)
    summed = kernel.plan_by_row_cpu(
        index=index.data_ptr(), n=index.numel(), num_out=num_out, offsets=offsets.data_ptr(), sorted=terms.data_ptr()
    )
    return offsets, terms[:summed]


def plan_sum(index: torch.Tensor, num_out: int, *, scaled: bool = False) -> SumPlan | OnePassPlan:
    """:func:`moe_dispatch.semantics.sums.plan_sum` (same arguments), or its :class:`OnePassPlan`
    (module docstring)."""
    kernel = _kernel()
    if index.device.type != "cpu" or kernel is None:
        return reference.plan_sum(index, num_out, scaled=scaled)
    offsets, terms = _plan_by_row(kernel, index, num_out)
    return OnePassPlan(num_out, scaled, offsets, terms, lambda: reference.plan_sum(index, num_out, scaled=scaled))


def plan_sum_by_output(terms: torch.Tensor, num_rows: int, *, scaled: bool = False) -> SumPlan | OnePassPlan:
    """:func:`moe_dispatch.semantics.sums.plan_sum_by_output` (same arguments; int32 ``terms``
    too), or its :class:`OnePassPlan` (module docstring)."""
    kernel = _kernel()
    if terms.device.type != "cpu" or kernel is None:
        return reference.plan_sum_by_output(terms.long(), num_rows, scaled=scaled)
    terms = terms.contiguous()
    num_out, num_topk = terms.shape
    offsets = torch.empty(num_out + 1, dtype=torch.int64)
    rows = torch.empty(terms.numel(), dtype=torch.int64)
    listed = kernel.plan_by_output_cpu(
        terms=terms.data_ptr(),
        index_bytes=terms.element_size(),
        num_out=num_out,
        num_topk=num_topk,
        num_rows=num_rows,
        offsets=offsets.data_ptr(),
        sorted=rows.data_ptr(),
    )
    return OnePassPlan(
        num_out,
        scaled,
        offsets,
        rows[:listed],
        lambda: reference.plan_sum_by_output(terms.long(), num_rows, scaled=scaled),
    )


def ordered_sum(
    plan: SumPlan | OnePassPlan,
    rows: torch.Tensor | BlockedRows,
    scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`moe_dispatch.semantics.sums.ordered_sum` (same arguments and result, bit for bit),
    in one pass for a :class:`OnePassPlan` where the rows allow it: CPU rows of bf16, fp16 or
    fp32 whose elements are contiguous within a row, into a contiguous ``out`` of their dtype.
    ``rows`` may be :class:`BlockedRows` (read in place; copied out where the one pass cannot run).

    Raises:
        ValueError: ``scale`` given for a plan made without ``scaled``, or the reverse.
    """
    if (scale is not None) != plan.scaled:
        raise ValueError("ordered_sum: row scales need a plan made with scaled=True, and such a plan needs them")
    if isinstance(plan, OnePassPlan):
        summed = _run(plan, rows, scale, out)
        if summed is not None:
            return summed
        plan = plan.torch_plan()
    return reference.ordered_sum(plan, _tensor(rows), scale, out)


def _tensor(rows: torch.Tensor | BlockedRows) -> torch.Tensor:
    return rows.gathered() if isinstance(rows, BlockedRows) else rows


@dataclasses.dataclass(eq=False)
class BlockedRows:
    """Rows left in the blocks of the exchange that carried them (a combine's rows, by source),
    for :func:`ordered_sum` and :func:`grouped_sum` to read in place.

    Attributes:
        blocks: ``[B, block bytes]`` contiguous uint8.
        offset: bytes from a block's start to its first row's field.
        row_bytes: bytes from one row to the next in a block.
        counts: rows per block; the rows are numbered block after block.
        dtype: the field's dtype.
        shape: one row's field shape.
    """

    blocks: torch.Tensor
    offset: int
    row_bytes: int
    counts: list[int]
    dtype: torch.dtype
    shape: tuple[int, ...]

    def gathered(self) -> torch.Tensor:
        """``[R, *shape]``: the rows copied out (for the sums the one pass cannot run)."""
        width, start = self.dtype.itemsize * math.prod(self.shape), self.blocks.storage_offset() + self.offset
        parts = [
            self.blocks.as_strided((n, width), (self.row_bytes, 1), start + b * self.blocks.shape[1])
            for b, n in enumerate(self.counts)
        ]
        return torch.cat(parts).view(self.dtype).view(sum(self.counts), *self.shape)

    def strides(self) -> tuple[int, int] | None:
        """``(row stride, block stride)`` in elements, or None where the bytes do not divide."""
        size, block_bytes = self.dtype.itemsize, self.blocks.shape[1]
        if self.offset % size or self.row_bytes % size or block_bytes % size:
            return None
        return self.row_bytes // size, block_bytes // size


def _flat_rows(rows: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor | None:
    """``rows`` as ``[n, width]`` with contiguous elements, where the CPU passes can read them
    and write ``out``; None where they cannot."""
    if rows.device.type != "cpu" or rows.dtype not in _DTYPES:
        return None
    if out is not None and (not out.is_contiguous() or out.dtype != rows.dtype):
        return None
    flat = rows.reshape(rows.shape[0], math.prod(rows.shape[1:]))
    return None if flat.shape[1] > 1 and flat.stride(1) != 1 else flat


def _run(
    plan: OnePassPlan, rows: torch.Tensor, scale: torch.Tensor | None, out: torch.Tensor | None
) -> torch.Tensor | None:
    """The one pass into ``out`` (made when None); None where it cannot run."""
    return _launch("ordered_sum_cpu", plan.num_out, rows, out, offsets=plan.offsets, terms=plan.terms, scale=scale)


def _launch(
    name: str, num_out: int, rows: torch.Tensor | BlockedRows, out: torch.Tensor | None, **plan
) -> torch.Tensor | None:
    """``_C.<name>`` over ``rows`` into ``out`` (made when None), with the plan's arguments (int64
    tensors, a scale as fp32, None as a null pointer, ints as they are); None where the CPU passes
    cannot run."""
    kernel = _kernel()
    if kernel is None:
        return None
    blocked = {}
    if isinstance(rows, BlockedRows):
        strides = rows.strides()
        if strides is None or rows.dtype not in _DTYPES or rows.blocks.device.type != "cpu":
            return None
        if out is not None and (not out.is_contiguous() or out.dtype != rows.dtype):
            return None
        ptr, row_stride, width = rows.blocks.data_ptr() + rows.offset, strides[0], math.prod(rows.shape)
        first = torch.tensor([0, *itertools.accumulate(rows.counts)], dtype=torch.int64)
        blocked = {"block_stride": strides[1], "num_blocks": len(rows.counts), "block_first": first}
        shape, dtype = rows.shape, rows.dtype
    else:
        flat = _flat_rows(rows, out)
        if flat is None:
            return None
        ptr, row_stride, width = flat.data_ptr(), flat.stride(0), flat.shape[1]
        shape, dtype = tuple(rows.shape[1:]), rows.dtype
    if out is None:
        out = torch.empty((num_out, *shape), dtype=dtype)
    kept = {  # the tensors stay alive until the pass returns
        k: (v.to(torch.float32) if k == "scale" else v).contiguous() if isinstance(v, torch.Tensor) else v
        for k, v in {**plan, **blocked}.items()
    }
    getattr(kernel, name)(
        rows=ptr,
        row_stride=row_stride,
        width=width,
        dtype=_DTYPES[dtype],
        out=out.data_ptr(),
        out_stride=width,
        num_out=num_out,
        **{k: 0 if v is None else v.data_ptr() if isinstance(v, torch.Tensor) else v for k, v in kept.items()},
    )
    return out


@dataclasses.dataclass(eq=False)
class GroupedPlan:
    """How :func:`grouped_sum` adds rows onto groups and the groups onto ``num_out`` outputs in one
    pass (from :func:`plan_grouped`).

    Attributes:
        num_out: outputs.
        scaled: the plan is for rows with scales (applied in the groups' sums).
        group_offsets: ``[num_out + 1]`` int64; output ``o``'s groups are ``group_offsets[o]:group_offsets[o + 1]``.
        row_offsets: ``[groups + 1]`` int64; group ``g``'s rows are ``terms[row_offsets[g]:row_offsets[g + 1]]``.
        terms: ``[rows summed]`` int64, each group's rows ascending.
        levels: the two plans of the same sums, rows onto groups then groups onto outputs, for a
            call the one pass cannot serve.
    """

    num_out: int
    scaled: bool
    group_offsets: torch.Tensor
    row_offsets: torch.Tensor
    terms: torch.Tensor
    levels: Callable[[], tuple[SumPlan | OnePassPlan, SumPlan | OnePassPlan]] = dataclasses.field(repr=False)


def plan_grouped(
    group_of_row: torch.Tensor, output_of_group: torch.Tensor, num_out: int, *, scaled: bool = False
) -> GroupedPlan | tuple[SumPlan | OnePassPlan, SumPlan | OnePassPlan]:
    """The plan of a sum of sums: rows onto groups by ``group_of_row`` (:func:`plan_sum`'s index;
    the number of groups leaves a row out), the groups' sums, rounded, onto outputs by
    ``output_of_group [groups]`` (ascending: groups are listed output by output). A
    :class:`GroupedPlan` on CPU with ``moe_dispatch._C`` built, else the two plans.
    Synchronises the host once."""
    num_groups = output_of_group.numel()
    levels = lambda: (  # noqa: E731
        plan_sum(group_of_row, num_groups, scaled=scaled),
        plan_sum(output_of_group, num_out),
    )
    kernel = _kernel()
    if group_of_row.device.type != "cpu" or kernel is None:
        return levels()
    row_offsets, terms = _plan_by_row(kernel, group_of_row, num_groups)  # group by group, rows ascending
    group_offsets, _ = _plan_by_row(kernel, output_of_group, num_out)
    return GroupedPlan(num_out, scaled, group_offsets, row_offsets, terms, levels)


def grouped_sum(
    plan: GroupedPlan | tuple[SumPlan | OnePassPlan, SumPlan | OnePassPlan],
    rows: torch.Tensor | BlockedRows,
    scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``ordered_sum(output plan, ordered_sum(group plan, rows, scale), out=out)`` for a plan of
    :func:`plan_grouped`, bit for bit: on CPU in one pass that keeps each group's sum in fp32
    only until it is rounded and added to its output's. ``rows``: as :func:`ordered_sum` takes them.

    Raises:
        ValueError: ``scale`` given for a plan made without ``scaled``, or the reverse.
    """
    if isinstance(plan, GroupedPlan):
        if (scale is not None) != plan.scaled:
            raise ValueError("grouped_sum: row scales need a plan made with scaled=True, and such a plan needs them")
        summed = _launch(
            "grouped_sum_cpu",
            plan.num_out,
            rows,
            out,
            group_offsets=plan.group_offsets,
            row_offsets=plan.row_offsets,
            terms=plan.terms,
            scale=scale,
        )
        if summed is not None:
            return summed
        plan = plan.levels()
    groups, outputs = plan
    return ordered_sum(outputs, ordered_sum(groups, _tensor(rows), scale), out=out)
