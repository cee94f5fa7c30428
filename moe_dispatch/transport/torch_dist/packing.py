"""Row packing of the torch_dist transport: every stage moves all row tensors of one call as a
single ``[rows, bytes]`` uint8 buffer, each row the tensors' rows side by side, every field padded
to :data:`ALIGN` bytes; the blocks ``[header | packed rows]`` of the block exchanges; and the
landing of received rows into their outputs (final order, or a fused permute's expert-major
layout).

On CPU with ``moe_dispatch._C`` built the blocks are written (``_C.pack_blocks_cpu``) and landed
from (``_C.land_blocks_cpu``) in one pass; elsewhere torch does the same with a copy per field.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Callable

import torch

from ... import _ext
from ...ops.sums import BlockedRows
from ...semantics.permute import PermuteHandle, gather_rows, permuted_sources

ALIGN = 8  # bytes; every packed field starts at a multiple, so it can be viewed in place as its dtype


def field_bytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    """Bytes of one row of a field of ``dtype`` and row shape ``shape``, unpadded."""
    return dtype.itemsize * math.prod(shape)


def padded(width: int) -> int:
    """``width`` bytes rounded up to :data:`ALIGN`."""
    return -(-width // ALIGN) * ALIGN


def packed_width(tensors: list[torch.Tensor]) -> int:
    """Bytes of one row of ``tensors`` packed side by side (:func:`pack`: each field padded)."""
    return sum(padded(field_bytes(t.dtype, tuple(t.shape[1:]))) for t in tensors)


def specs_of(tensors: list[torch.Tensor]) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    """``(dtype, row shape)`` of each tensor: what :func:`field_views` needs to read them back."""
    return [(t.dtype, tuple(t.shape[1:])) for t in tensors]


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``[rows, ...]`` -> ``[rows, bytes]`` uint8 (a view when ``t`` is contiguous)."""
    width = math.prod(t.shape[1:])
    if t.numel() == 0:  # empty tensors count as contiguous whatever their strides (e.g. expanded grads)
        return t.new_empty((t.shape[0], width * t.element_size()), dtype=torch.uint8)
    return t.reshape(t.shape[0], width).contiguous().view(torch.uint8)


def pack(rows: list[tuple[torch.Tensor, torch.Tensor | None]]) -> torch.Tensor:
    """Packs row tensors side by side into one ``[rows, bytes]`` uint8 buffer, one copy each:
    ``(t, index)`` contributes ``t[index]`` (gathered straight into place), ``(t, None)`` all of
    ``t``. Fields are padded to :data:`ALIGN` bytes. A single contiguous ``(t, None)`` whose rows
    need no padding comes back as a byte view of ``t``: no copy at all.

    ``Tensor.index_select`` is used for every row gather: advanced indexing (``t[index]``)
    copies element by element and is several times slower on uint8 rows on CPU."""
    num_rows = next(t.shape[0] if index is None else index.numel() for t, index in rows)
    widths = [padded(field_bytes(t.dtype, tuple(t.shape[1:]))) for t, _ in rows]
    if (
        len(rows) == 1
        and rows[0][1] is None
        and rows[0][0].is_contiguous()
        and rows[0][0].numel()
        and widths[0] == field_bytes(rows[0][0].dtype, tuple(rows[0][0].shape[1:]))
    ):
        return as_bytes(rows[0][0])
    buf = torch.empty((num_rows, sum(widths)), dtype=torch.uint8, device=rows[0][0].device)
    offset = 0
    for (t, index), width in zip(rows, widths):
        src = as_bytes(t)
        dst = buf[:, offset : offset + src.shape[1]]
        if index is None:
            dst.copy_(src)
        else:
            torch.index_select(src, 0, index, out=dst)
        offset += width
    return buf


def pack_blocks(send: torch.Tensor, head: torch.Tensor, fields: list, splits: list[int], count_word: int) -> None:
    """Writes block ``d`` of ``send [W, block bytes]``: header ``head[d]`` (int64 words) with
    word ``count_word`` set to ``splits[d]``, then the next ``splits[d]`` rows of ``fields`` (as
    :func:`pack` takes them) packed. On CPU in one pass (``_C.pack_blocks_cpu``), else
    :func:`pack` and a copy per destination."""
    head, head_bytes = head.contiguous(), head.shape[1] * 8
    widths = [field_bytes(t.dtype, tuple(t.shape[1:])) for t, _ in fields]
    row_bytes = sum(padded(w) for w in widths)
    if send.device.type == "cpu" and _ext.extension_status().built:
        index = {i.data_ptr(): i.contiguous() for _, i in fields if i is not None}  # one index for every field
        assert len(index) <= 1, "pack_blocks: the fields share one index"
        sources = [as_bytes(t) if t.numel() else None for t, _ in fields]
        offsets = itertools.accumulate([0] + [padded(w) for w in widths[:-1]])
        _ext._C.pack_blocks_cpu(
            out=send.data_ptr(),
            block_bytes=send.shape[1],
            head=head.data_ptr(),
            head_bytes=head_bytes,
            row_bytes=row_bytes,
            fields=[
                (src.data_ptr(), src.stride(0), w, o) for src, w, o in zip(sources, widths, offsets) if src is not None
            ],
            index=next(iter(index.values())).data_ptr() if index else 0,
            splits=list(splits),
            count_word=count_word,
        )
        return
    head = head.clone()
    head[:, count_word] = torch.tensor(splits, dtype=torch.int64, device=head.device)
    packed, offset = pack(fields), 0
    for d, n in enumerate(splits):
        send[d, head_bytes : head_bytes + n * row_bytes] = packed[offset : offset + n].view(-1)
        offset += n
    send[:, :head_bytes].view(torch.int64).copy_(head)


def field_views(buf: torch.Tensor, like: list[tuple[torch.dtype, tuple[int, ...]]]) -> list[torch.Tensor]:
    """The packed fields of ``buf`` as ``[rows, *shape]`` tensors of their dtypes: strided views
    into ``buf``, no copies."""
    out, offset = [], 0
    for dtype, shape in like:
        width = field_bytes(dtype, shape)
        if buf.shape[0] == 0:  # an empty slice keeps the packed strides, which view() rejects
            out.append(buf.new_empty((0, *shape), dtype=dtype))
        else:
            out.append(buf[:, offset : offset + width].view(dtype).view(buf.shape[0], *shape))
        offset += padded(width)
    return out


def unpack_rows(buf: torch.Tensor, index: torch.Tensor | None, out: list[torch.Tensor]) -> None:
    """``out[j] = field j of buf[index]`` (of ``buf`` when ``index`` is None) for contiguous
    ``out`` tensors, one copy each."""
    offset = 0
    for dst in out:
        assert dst.is_contiguous(), "unpack_rows writes through a byte view: out tensors must be contiguous"
        width = field_bytes(dst.dtype, tuple(dst.shape[1:]))
        if index is None:
            as_bytes(dst).copy_(buf[:, offset : offset + width])
        else:
            torch.index_select(buf[:, offset : offset + width], 0, index, out=as_bytes(dst))
        offset += padded(width)


def carried_rows(blocks: torch.Tensor, carried: list[int], head_bytes: int, width: int) -> torch.Tensor:
    """``[R, width]`` uint8: the rows of ``width`` bytes each source's block of ``blocks [W, block
    bytes]`` carried after its ``head_bytes`` header (``carried`` of them), by source."""
    return torch.cat([blocks[s, head_bytes : head_bytes + n * width].view(n, width) for s, n in enumerate(carried)])


@dataclasses.dataclass(eq=False)
class Carried:
    """Rows that came in the blocks of an exchange, still there: ``blocks [W, block bytes]``
    uint8, block ``s`` its header (``head_bytes``), then ``carried[s]`` packed rows of ``width``
    bytes (arrival rows counted across the blocks)."""

    blocks: torch.Tensor
    carried: list[int]
    head_bytes: int
    width: int

    def fields(self, like: list[tuple[torch.dtype, tuple[int, ...]]]) -> list[BlockedRows]:
        """The packed fields of every carried row (:func:`field_views`' order), left in the blocks
        for the sums to read in place."""
        out, offset = [], self.head_bytes
        for dtype, shape in like:
            out.append(BlockedRows(self.blocks, offset, self.width, self.carried, dtype, shape))
            offset += padded(field_bytes(dtype, shape))
        return out

    def land(self, fields: list[tuple[int, int, torch.Tensor, torch.Tensor | None]]) -> None:
        """For each ``(offset, bytes, out, index)``: row ``i`` of the contiguous ``out [n, ...]``
        gets the field at ``offset`` of arrival row ``index[i]`` (``i`` when None; a zero row where
        -1), in one pass (``_C.land_blocks_cpu``)."""
        kept, args = [], []
        for offset, nbytes, out, index in fields:
            assert out.is_contiguous(), "Carried.land writes through a byte view: out tensors must be contiguous"
            if out.numel() == 0:
                continue
            dst = as_bytes(out)
            assert index is None or index.numel() == dst.shape[0], "Carried.land: an index entry per output row"
            index = None if index is None else index.to(torch.int64).contiguous()
            kept.append((dst, index))  # alive until the pass returns
            args.append(
                (offset, nbytes, dst.data_ptr(), dst.stride(0), 0 if index is None else index.data_ptr(), dst.shape[0])
            )
        if args:
            _ext._C.land_blocks_cpu(
                blocks=self.blocks.data_ptr(),
                block_bytes=self.blocks.shape[1],
                head_bytes=self.head_bytes,
                row_bytes=self.width,
                carried=self.carried,
                fields=args,
            )


def land(
    recv: torch.Tensor | Carried,
    recv_perm: torch.Tensor | None,
    specs: list[tuple[torch.dtype, tuple[int, ...]]],
    out: list[torch.Tensor],
    permute: tuple[int, Callable[[], PermuteHandle]] | None,
    permuted: PermuteHandle | None = None,
) -> None:
    """Writes the packed arrivals ``recv`` (``[R, bytes]`` uint8, or the blocks they came in)
    into ``out``: in final order (row ``i`` is arrival row ``recv_perm[i]``; arrival order when
    None); or, for the first ``k`` tensors of ``permute = (k, layout)``, expert-major as the
    permute handle ``layout()`` lays the received rows out (zero padding rows; ``layout`` is
    called once the other tensors landed). With ``permuted`` every tensor lands in that handle's
    layout. ``specs``: each tensor's ``(dtype, row shape)``. One gather per tensor."""
    k, layout = permute if permute is not None else (len(out) if permuted is not None else 0, None)
    offsets = list(itertools.accumulate([0, *(padded(field_bytes(*spec)) for spec in specs)]))
    if isinstance(recv, Carried):  # still in the blocks they came in: one pass each way
        assert recv_perm is None, "rows come with the counts on the flat route only (final order)"
        recv.land([(offsets[j], field_bytes(*specs[j]), out[j], None) for j in range(k, len(out))])
        if k:
            src, _ = permuted_sources(permuted if permuted is not None else layout())
            recv.land([(offsets[j], field_bytes(*specs[j]), out[j], src) for j in range(k)])
        return
    fields = [recv[:, offsets[j] : offsets[j] + field_bytes(*spec)] for j, spec in enumerate(specs)]
    for field, dst in zip(fields[k:], out[k:]):
        unpack_rows(field, recv_perm, [dst])
    if not k:
        return
    src, _ = permuted_sources(permuted if permuted is not None else layout())
    if recv_perm is not None:  # final rows -> arrival rows
        src = torch.where(src >= 0, recv_perm[src.clamp(min=0)], -1)
    for field, dst in zip(fields[:k], out[:k]):
        gather_rows(field, src, out=as_bytes(dst))
