"""The intranode transport (``moe_dispatch.transport.kernels.intranode``) against ``moe_dispatch.reference``.

CPU (wherever the extension is built): the byte layouts of the Python mirror equal the C++
ones; the channel split is a partition; ``Config`` validates itself; and the protocol itself -
the very role code the kernels run, on threads standing in for warps - reproduces the oracle
bit for bit across world sizes, ring depths down to one slot, warps per group, routing shapes,
empty ranks, fp8, bf16/fp16/fp32, weights, budget mode and cached dispatch, and names the
withheld rank when a wait times out. The device-side header check (header.py): a handle of
another dispatch on one rank, a differing hidden size on one rank, and a refusal (status != 0)
on one rank, in dispatch, cached dispatch and combine, are recorded by every other rank, raise
MismatchError and time nothing out; the world works again after. A ThreadSanitizer build of the
same code (csrc/tests/intranode_tsan.cpp) checks that the protocol orders every slot access.

GPU (skipped without one): the kernels through the loopback harness (W simulated ranks on one
GPU, one launch) against the oracle for W in {2, 4, 8}, hidden 2880 and 7168, bf16 and fp8,
random and skewed routing, empty ranks; budget mode inside a CUDA graph; the header cases; the
timeout error.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import zlib

import pytest
import torch

from moe_dispatch import BudgetOverflowError, _ext
from moe_dispatch.config import VARIANTS, Config
from moe_dispatch.control.agreement import status_of
from moe_dispatch.errors import ArgumentTypeError, IntranodeTimeoutError, MismatchError
from moe_dispatch.kernel_layout import buffer_layout, max_slot_bytes, slot_layout
from moe_dispatch.semantics import reference
from moe_dispatch.semantics.quant import per_token_cast_to_fp8_reference
from moe_dispatch.testing.launch import spawn_world
from moe_dispatch.testing.loopback import Loopback
from moe_dispatch.testing.ranks import IntranodeRank
from moe_dispatch.transport.kernels.header import (
    FIELD_STATUS,
    STATUS_INVALID_ARGUMENTS,
    STATUS_TEST,
    describe_mismatch,
    header_words,
    refusal_status,
)
from moe_dispatch.transport.kernels.intranode import IntranodeHandle, describe_timeout
from python_tests.conftest import needs_gpu
from python_tests.tsan import build_tsan_driver
from python_tests.worlds import assert_case, run_cases, world_results

STATUS = _ext.extension_status()
built = pytest.mark.skipif(not STATUS.built, reason=f"moe_dispatch._C not available: {STATUS.error}")


# --- routing and data (one seed builds every rank's inputs) ------------------------------------


def make_world(
    seed: int,
    world_size: int,
    tokens: list[int] | int,
    hidden: int,
    num_topk: int,
    num_experts: int,
    *,
    skewed: bool = False,
    drop: float = 0.1,
    dtype=torch.bfloat16,
    weights: bool = True,
    device: str = "cpu",
):
    """Per rank x (values that name their source rank and token), topk_idx, topk_weights."""
    gen = torch.Generator().manual_seed(seed)
    tokens = [tokens] * world_size if isinstance(tokens, int) else tokens
    popularity = (torch.rand(num_experts, generator=gen) ** 8 + 1e-4) if skewed else torch.ones(num_experts)
    xs, idxs, ws = [], [], []
    for r, t in enumerate(tokens):
        x = torch.randn(t, hidden, generator=gen)
        x[:, 0] = r  # the source rank and token, readable in any failure
        x[:, 1] = torch.arange(t) % 256
        idx = (
            torch.multinomial(popularity.expand(t, -1), num_topk, generator=gen)
            if t
            else torch.empty(0, num_topk, dtype=torch.int64)
        )
        idx[torch.rand(idx.shape, generator=gen) < drop] = -1
        xs.append(x.to(dtype).to(device))
        idxs.append(idx.to(device))
        ws.append(torch.rand(t, num_topk, generator=gen).to(device) if weights else None)
    return xs, idxs, (ws if weights else None)


def seed_of(case) -> int:
    """A seed that names the case and is the same in every process."""
    return zlib.crc32(repr(case).encode()) % 100_000


def cpu(value):
    """Tensors (in lists and tuples) on the CPU: the oracle runs there."""
    if isinstance(value, (list, tuple)):
        return type(value)(cpu(v) for v in value)
    return value.cpu() if isinstance(value, torch.Tensor) else value


def assert_dispatch_equal(results, refs, num_rows=None):
    for r, (got, want) in enumerate(zip(results, refs)):
        got = dataclasses.replace(
            got,
            recv_x=cpu(got.recv_x),
            recv_topk_idx=cpu(got.recv_topk_idx),
            recv_topk_weights=cpu(got.recv_topk_weights),
            recv_src_idx=cpu(got.recv_src_idx),
            num_recv_tokens_per_expert=cpu(got.num_recv_tokens_per_expert),
        )
        n = want.src_idx.numel() if num_rows is None else min(num_rows, want.src_idx.numel())
        recv_x = got.recv_x[0] if isinstance(got.recv_x, tuple) else got.recv_x
        want_x = want.recv_x[0] if isinstance(want.recv_x, tuple) else want.recv_x
        assert torch.equal(recv_x[:n].view(torch.uint8), want_x[:n].view(torch.uint8)), f"recv_x of rank {r}"
        if isinstance(got.recv_x, tuple):
            assert torch.equal(got.recv_x[1][:n], want.recv_x[1][:n]), f"recv scales of rank {r}"
        assert torch.equal(got.recv_topk_idx[:n], want.recv_topk_idx[:n]), f"recv_topk_idx of rank {r}"
        if want.recv_topk_weights is not None:
            assert torch.equal(got.recv_topk_weights[:n], want.recv_topk_weights[:n]), f"weights of rank {r}"
        assert torch.equal(got.recv_src_idx[:n].long(), want.src_idx[:n]), f"source index of rank {r}"
        if num_rows is None:
            assert recv_x.shape[0] == n, f"rank {r} received {recv_x.shape[0]} rows, the oracle {n}"
            assert torch.equal(got.num_recv_tokens_per_expert, want.num_recv_tokens_per_expert), f"counts of rank {r}"


def fp8_reference_dispatch(xs8, idxs, ws, num_experts, world_size):
    """The oracle on the fp8 pair: bytes and scales moved like any rows."""
    refs = reference.dispatch([x.view(torch.uint8) for x, _ in xs8], idxs, ws, num_experts, world_size)
    scales = reference.dispatch([s for _, s in xs8], idxs, ws, num_experts, world_size)
    for ref, sc in zip(refs, scales):
        ref.recv_x = (ref.recv_x.view(torch.float8_e4m3fn), sc.recv_x)
    return refs


def run_roundtrip(
    lb,
    xs,
    idxs,
    ws,
    num_experts,
    *,
    row_scales=False,
    fp8=False,
    ranks_per_node=None,
    seed=99,
    after_dispatch=None,
    **dispatch_kw,
):
    """Dispatch then combine on a loopback (``Loopback`` or ``InternodeLoopback``), both checked
    against the oracle; ``ranks_per_node``: L of the combine's summation order (default W, one
    node); ``after_dispatch(results)``: further checks between the two. Returns the dispatch
    results."""
    world_size = len(xs)
    L = ranks_per_node or world_size
    if fp8:
        xs8 = [per_token_cast_to_fp8_reference(x) for x in xs]
        results = lb.dispatch(xs8, idxs, ws, num_experts, **dispatch_kw)
        refs = fp8_reference_dispatch(cpu(xs8), cpu(idxs), cpu(ws), num_experts, world_size)
    else:
        results = lb.dispatch(xs, idxs, ws, num_experts, **dispatch_kw)
        refs = reference.dispatch(cpu(xs), cpu(idxs), cpu(ws), num_experts, L)
    assert_dispatch_equal(results, refs)
    if after_dispatch is not None:
        after_dispatch(results)
    gen = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16 if fp8 else xs[0].dtype
    ys = [torch.randn(ref.src_idx.shape[0], xs[0].shape[1], generator=gen).to(dtype) for ref in refs]
    scales = [torch.rand(y.shape[0], generator=gen) for y in ys] if row_scales else None
    outs = lb.combine(
        [y.to(lb.device) for y in ys],
        [r.handle for r in results],
        [sc.to(lb.device) for sc in scales] if scales else None,
    )
    want = reference.combine(ys, cpu(idxs), num_experts, L, weights=scales)
    for r, (o, w) in enumerate(zip(cpu(outs), want)):
        assert o.dtype == w.dtype and torch.equal(o, w), (
            f"combine of rank {r}: max diff {(o.float() - w.float()).abs().max().item()}"
        )
    return results


# --- layouts, channels, Config (pure host) ------------------------------------------------------


@built
@pytest.mark.parametrize(
    "x_bytes, scale_bytes, num_topk",
    [(14336, 224, 8), (5760, 0, 8), (16, 0, 0), (256, 8, 3), (7168, 224, 32), (11520, 0, 1)],
)
def test_slot_layout_mirror_matches_extension(x_bytes, scale_bytes, num_topk):
    assert (
        slot_layout(x_bytes, scale_bytes, num_topk).__dict__
        == _ext._C.intranode_slot_layout(x_bytes, scale_bytes, num_topk).to_dict()
    )
    s = slot_layout(x_bytes, scale_bytes, num_topk)
    fields = [0, s.scale_offset, s.topk_idx_offset, s.topk_weights_offset, s.aux_offset, s.slot_bytes]
    assert all(f % 16 == 0 for f in fields) and fields == sorted(fields)
    assert s.scale_offset >= x_bytes and s.topk_idx_offset - s.scale_offset >= scale_bytes


@built
@pytest.mark.parametrize(
    "world_size, channels, slots, slot_bytes", [(1, 1, 1, 16), (8, 8, 32, 14640), (16, 64, 4, 5808), (3, 5, 7, 48)]
)
def test_buffer_layout_mirror_matches_extension(world_size, channels, slots, slot_bytes):
    layout = buffer_layout(world_size, channels, slots, slot_bytes)
    assert layout.__dict__ == _ext._C.intranode_buffer_layout(world_size, channels, slots, slot_bytes).to_dict()
    relay = buffer_layout(world_size, channels, slots, slot_bytes, relay_nodes=5)  # an internode node's buffers
    assert relay.__dict__ == _ext._C.intranode_buffer_layout(world_size, channels, slots, slot_bytes, 5).to_dict()
    assert relay.queue_offset > layout.queue_offset and relay.relay_bytes >= 128 + 4 * 5 * channels
    assert layout.queue_offset % 128 == 0 and layout.tail_offset >= layout.meta_offset + 4 * world_size * channels
    stride = -(-slot_bytes // 128) * 128  # every slot starts on a cache line
    assert layout.slot_bytes == stride and stride - slot_bytes < 128
    assert layout.total_bytes == layout.queue_offset + world_size * channels * slots * stride


@built
def test_channels_partition_the_tokens():
    for num_tokens in [1, 2, 3, 7, 64, 129, 1000]:
        for num_channels in [1, 2, 3, 8, 13, 64]:
            ranges = []
            for t in range(num_tokens):
                c, begin, end = _ext._C.intranode_channel_of_token(num_tokens, num_channels, t)
                assert 0 <= c < num_channels and begin <= t < end
                ranges.append((c, begin, end))
            channels = [c for c, _, _ in ranges]
            assert channels == sorted(channels)  # contiguous, ascending: rows come out in token order
            sizes = torch.bincount(torch.tensor(channels), minlength=num_channels)
            assert int(sizes.max() - sizes.min()) <= 1  # balanced


def test_config_validates_itself():
    with pytest.raises(ValueError, match=r"Config.num_sms must be an even int in \[2, 128\].*got 7"):
        Config(num_sms=7)
    with pytest.raises(ValueError, match=r"Config.chunk_tokens must be in \[1, num_slots=4\], got 5"):
        Config(num_slots=4, chunk_tokens=5)
    with pytest.raises(ValueError, match=r"Config.num_slots must be an int, got '8'"):
        Config(num_slots="8")
    with pytest.raises(ValueError, match=r"Config.l2_discard must be a bool, got 1"):
        Config(l2_discard=1)
    assert Config.auto(4096, 8, l2_discard=True).l2_discard and Config.auto(32, 8).chunk_tokens == 4
    auto = Config.auto(4096, 8, num_sms=24)
    assert auto.num_channels == 12 and auto.num_slots >= auto.chunk_tokens
    # DeepSeek-V3 dispatch slots: bf16 row + top-8, fp8 row + 56 scales; EP8 with 8 channels.
    assert max_slot_bytes(7168, 8) == slot_layout(7168 * 2, 0, 8).slot_bytes
    assert Config().buffer_bytes(8, max_slot_bytes(7168, 8)) < 64 << 20


def test_config_variants_validate_themselves():
    assert Config().variant_name == "current" and Config().copy_variant == (4, 1, False, True)
    for name in VARIANTS:
        assert Config(num_sms=4).with_variant(name).variant_name == name
    # A variant replaces the variant fields, not the rest of the config.
    assert Config(num_sms=6).with_variant("flags").with_variant("team2") == Config(num_sms=6, combine_warps=2)
    with pytest.raises(ValueError, match=r"must be a compiled copy variant: one of \(4, 1, False, True\).*got \(16, 1"):
        Config(loads_in_flight=16)
    with pytest.raises(ValueError, match=r"Config.combine_warps must be one of \(1, 2, 4\), got 3"):
        Config(combine_warps=3)
    with pytest.raises(ValueError, match=r"Config.rows_in_flight must be in \[1, 2\], got 0"):
        Config(rows_in_flight=0)
    with pytest.raises(ValueError, match=r"Config.slot_flags must be a bool, got 1"):
        Config(slot_flags=1)
    with pytest.raises(ValueError, match=r"unknown kernel variant 'fast'"):
        Config().with_variant("fast")
    assert not Config().with_variant("loads8").fused_copy and Config().with_variant("rows2").fused_copy


def test_timeout_message_names_rank_channel_and_counter():
    message, fields = describe_timeout([1, 2, 3, 1, 5, 3, 2, 7, 4] + [0] * 7, 0.5)
    assert "dispatch timed out after timeout_s=0.5: rank 1 (receiver, channel 5)" in message
    assert "tail of queue rank 3 -> rank 1, channel 5 should reach 7 but stayed at 4" in message
    assert fields["peer"] == 3 and fields["counter"] == "tail"
    message, _ = describe_timeout([1, 1, 1, 0, -1, 6, 1, 1, 0] + [0] * 7, 2)
    assert "notify barrier for rank 6" in message


# --- the protocol on CPU threads vs the oracle -------------------------------------------------

PROTOCOL_CASES = [
    # W, tokens, hidden, K, E, num_sms, slots, chunk, group_warps, workers, skewed
    (1, 19, 32, 2, 4, 2, 2, 1, 1, 1, False),
    (2, 33, 64, 4, 8, 4, 1, 1, 2, 3, False),  # one-slot rings: every entry waits for the last
    (3, [0, 25, 40], 48, 3, 9, 6, 3, 2, 3, 2, True),  # an empty source, W not a power of two
    (4, 37, 64, 3, 16, 4, 4, 2, 2, 3, False),
    (4, [50, 0, 0, 9], 32, 8, 32, 8, 5, 5, 1, 7, True),
    (8, 24, 32, 8, 64, 2, 3, 2, 1, 2, True),
]


# Every case with the current kernels; the cases that stress the rings most (one-slot rings, an
# empty source, W = 8 with one channel, 7 workers) with every variant too (the copy-only ones
# run the same role code as the current kernels on the CPU; the GPU tests cover their copies).
VARIANT_CASES = [(case, "current") for case in PROTOCOL_CASES] + [
    (case, name)
    for case in (PROTOCOL_CASES[1], PROTOCOL_CASES[2], PROTOCOL_CASES[4], PROTOCOL_CASES[5])
    for name in VARIANTS
    if name != "current"
]


@built
@pytest.mark.parametrize(
    "case, variant",
    VARIANT_CASES,
    ids=lambda c: (
        c
        if isinstance(c, str)
        else "W{}-T{}-H{}-K{}-sms{}-slots{}-chunk{}-g{}-w{}".format(
            c[0], c[1], c[2], c[3], c[5], c[6], c[7], c[8], c[9]
        )
    ),
)
def test_cpu_protocol_matches_oracle(case, variant):
    world_size, tokens, hidden, num_topk, num_experts, num_sms, slots, chunk, group_warps, workers, skewed = case
    lb = Loopback(
        world_size,
        hidden,
        num_topk,
        config=Config(num_sms=num_sms, num_slots=slots, chunk_tokens=chunk).with_variant(variant),
        device="cpu",
        timeout_s=60,
        cpu_options={"group_warps": group_warps, "num_workers": workers},
    )
    xs, idxs, ws = make_world(seed_of(case), world_size, tokens, hidden, num_topk, num_experts, skewed=skewed)
    first = run_roundtrip(lb, xs, idxs, ws, num_experts, row_scales=True)
    # The rings and counters were reset: a second, cached dispatch reproduces the first; so does
    # one of x alone (no top-k fields travel).
    again = lb.dispatch(xs, idxs, None, num_experts, handles=[r.handle for r in first])
    bare = lb.dispatch(xs, None, None, num_experts, handles=[r.handle for r in first])
    for a, b, c in zip(first, again, bare):
        assert torch.equal(a.recv_x, b.recv_x) and torch.equal(a.recv_topk_idx, b.recv_topk_idx)
        assert (
            torch.equal(a.recv_x, c.recv_x) and c.recv_topk_idx is None and torch.equal(a.recv_src_idx, c.recv_src_idx)
        )


@built
@pytest.mark.parametrize(
    "case",
    [
        # W, tokens, hidden, K, E, num_sms, slots, chunk, group_warps, workers
        (2, 40, 256, 4, 8, 4, 1, 1, 2, 3),  # one-slot rings: each slot is rewritten right after its discard
        (3, [30, 0, 45], 200, 3, 9, 2, 3, 2, 2, 2),
        (4, 37, 448, 8, 16, 4, 4, 2, 1, 3),
    ],
    ids=lambda c: f"W{c[0]}-H{c[2]}-slots{c[6]}-chunk{c[7]}",
)
@pytest.mark.parametrize("variant", ["current", "flags", "team2", "combined"])
def test_cpu_l2_discard_poisons_slots_only_after_their_last_read(case, variant):
    """Config.l2_discard: on the CPU backend a discard overwrites the slot's whole 128-byte lines
    with a poison byte, so a receiver that discards a slot before its last read of it (x, scales,
    top-k or source fields) breaks the round trip's equality with the oracle. A discard after the
    head that frees the slot races with the sender's rewrite: that is
    test_protocol_has_no_data_race_under_threadsanitizer's to catch. With ready flags the slot's
    aux line (its flag) survives the discard; a combine team discards the lines of its own
    columns."""
    world_size, tokens, hidden, num_topk, num_experts, num_sms, slots, chunk, group_warps, workers = case
    config = Config(num_sms=num_sms, num_slots=slots, chunk_tokens=chunk, l2_discard=True).with_variant(variant)
    lb = Loopback(
        world_size,
        hidden,
        num_topk,
        config=config,
        device="cpu",
        timeout_s=60,
        cpu_options={"group_warps": group_warps, "num_workers": workers},
    )
    xs, idxs, ws = make_world(seed_of(case), world_size, tokens, hidden, num_topk, num_experts, skewed=True)
    results = run_roundtrip(lb, xs, idxs, ws, num_experts, row_scales=True)
    run_roundtrip(lb, xs, idxs, ws, num_experts)  # the rings after discards serve the next operation
    for rank, (buf, res) in enumerate(zip(lb._buffers, results)):
        poisoned = int((buf[lb.layout.queue_offset :] == 0xA5).sum())
        if res.recv_x.shape[0] > 0:  # it received rows, so its receivers discarded slots
            assert poisoned >= 128, f"rank {rank}: no discarded line in its rings"


@built
def test_cpu_protocol_fp8_fp32_and_no_weights():
    lb = Loopback(
        4, 256, 4, config=Config(num_sms=4, num_slots=3, chunk_tokens=2), device="cpu", element_bytes=4, timeout_s=60
    )
    xs, idxs, _ = make_world(3, 4, [20, 0, 31, 8], 256, 4, 8, weights=False)
    run_roundtrip(lb, xs, idxs, None, 8, fp8=True)
    run_roundtrip(lb, [x.float() for x in xs], idxs, None, 8, row_scales=True)  # fp32 rows and combine
    run_roundtrip(lb, [x.half() for x in xs], idxs, None, 8, row_scales=True)  # fp16: the sum rounded once


@built
def test_cpu_protocol_budget_mode_and_overflow():
    world_size, num_experts = 4, 16
    lb = Loopback(world_size, 32, 4, config=Config(num_sms=4, num_slots=4, chunk_tokens=2), device="cpu", timeout_s=60)
    xs, idxs, ws = make_world(5, world_size, 30, 32, 4, num_experts)
    refs = reference.dispatch(xs, idxs, ws, num_experts, world_size)
    most = max(r.src_idx.numel() for r in refs)
    # A budget that fits: the first R rows equal the oracle, the rest read "no expert".
    fits = lb.dispatch(xs, idxs, ws, num_experts, num_worst_tokens=most + 5)
    assert_dispatch_equal(fits, refs, num_rows=most + 5)
    for got, want in zip(fits, refs):
        n = want.src_idx.numel()
        assert got.recv_x.shape[0] == most + 5 and got.handle.num_recv_tokens is None
        assert int(got.handle.num_recv_tokens_dev) == n and int(got.handle.overflow) == 0
        assert bool((got.recv_topk_idx[n:] == -1).all()) and bool((got.recv_src_idx[n:] == -1).all())
        got.handle.check_overflow()
    # A budget that does not: rows up to it are right, the flag is set, combine drops the rest.
    budget = min(r.src_idx.numel() for r in refs) - 3
    short = lb.dispatch(xs, idxs, ws, num_experts, num_worst_tokens=budget)
    assert_dispatch_equal(short, refs, num_rows=budget)
    assert any(int(r.handle.overflow) for r in short)
    with pytest.raises(BudgetOverflowError, match=rf"num_worst_tokens={budget}: rows past the budget were dropped"):
        next(r for r in short if int(r.handle.overflow)).handle.check_overflow()
    ys_full = [torch.randn(r.src_idx.numel(), 32).to(torch.bfloat16) for r in refs]
    outs = lb.combine([y[:budget] for y in ys_full], [r.handle for r in short])
    kept = [torch.cat([y[:budget], torch.zeros_like(y[budget:])]) for y in ys_full]
    for o, w in zip(outs, reference.combine(kept, idxs, num_experts, world_size)):
        assert torch.equal(o, w)


@built
@pytest.mark.parametrize("phase", ["notify", "dispatch", "combine"])
def test_cpu_withheld_rank_times_out_with_its_name(phase):
    world_size, withheld = 4, 2
    lb = Loopback(world_size, 32, 2, config=Config(num_sms=4, num_slots=2, chunk_tokens=1), device="cpu", timeout_s=0.3)
    xs, idxs, ws = make_world(11, world_size, 16, 32, 2, 8, drop=0.0)
    if phase == "combine":
        results = lb.dispatch(xs, idxs, ws, 8)
        ys = [torch.ones(r.handle.num_rows, 32, dtype=torch.bfloat16) for r in results]
        with pytest.raises(IntranodeTimeoutError, match=rf"intranode combine timed out .* rank {withheld}") as info:
            lb.combine(ys, [r.handle for r in results], withhold_rank=withheld)
    else:
        with pytest.raises(IntranodeTimeoutError, match=rf"intranode {phase} timed out .* rank {withheld}") as info:
            lb.dispatch(xs, idxs, ws, 8, withhold_rank=withheld, withhold_phase=phase)
    error = info.value
    assert error.peer == withheld and error.rank != withheld and error.phase == phase
    assert error.counter == ("signal" if phase == "notify" else error.counter)
    assert "close() it on every rank and make a new Buffer" in str(error)
    # reset() ran: the same world works again.
    lb.timeout_s = 60
    run_roundtrip(lb, xs, idxs, ws, 8)


@built
def test_bad_arguments_name_the_value():
    lb = Loopback(2, 64, 2, config=Config(num_sms=4, num_slots=4, chunk_tokens=2), device="cpu", timeout_s=5)
    xs, idxs, ws = make_world(1, 2, 8, 64, 2, 4)
    with pytest.raises(ValueError, match=r"num_sms must be even and in \[2, 4\].*got 6"):
        lb.dispatch(xs, idxs, ws, 4, num_sms=6)
    with pytest.raises(ValueError, match=r"num_experts must be a positive multiple of 2, got 5"):
        lb.dispatch(xs, idxs, ws, 5)
    with pytest.raises(ValueError, match=r"rows of x must be a multiple of 16 bytes, got 4 x 2 bytes"):
        lb.dispatch([x[:, :4].contiguous() for x in xs], idxs, ws, 4)
    with pytest.raises(ValueError, match=r"needs \d+ bytes but the buffer's slots hold \d+"):
        lb.dispatch([torch.zeros(8, 128, dtype=torch.bfloat16)] * 2, idxs, ws, 4)
    shifted = [torch.zeros(8 * 64 + 1, dtype=torch.bfloat16)[1:].view(8, 64)] * 2
    with pytest.raises(ValueError, match=r"x \(rank 0\) must start on a 16-byte boundary.*2 bytes past one"):
        lb.dispatch(shifted, idxs, ws, 4)
    results = lb.dispatch(xs, idxs, ws, 4)
    with pytest.raises(ValueError, match=r"y \(rank 0\) has shape \[1, 64\] but the handle \(rows received\) has"):
        lb.combine([torch.zeros(1, 64, dtype=torch.bfloat16)] * 2, [r.handle for r in results])
    with pytest.raises(ValueError, match=r"num_worst_tokens must be None or an int >= 0 .*got -1"):
        lb.dispatch(xs, idxs, ws, 4, num_worst_tokens=-1)
    unbudgeted = lb.dispatch(xs, idxs, ws, 4, num_worst_tokens=0)  # 0: no budget, as in Buffer.dispatch
    assert [r.recv_x.shape for r in unbudgeted] == [r.recv_x.shape for r in results]
    with pytest.raises(ValueError, match=r"world_size must be in \[1, 16\], got 17"):
        Loopback(17, 64, 2, device="cpu")
    for bad, match in [
        (dict(hidden=0), r"hidden must be a positive int .*got 0"),
        (dict(num_topk=40), r"num_topk must be an int in \[0, 32\], got 40"),
        (dict(element_bytes=3), r"element_bytes must be 2 .* or 4 .*got 3"),
        (dict(device="meta"), r"device must be a CUDA device or 'cpu'.*got 'meta'"),
    ]:
        with pytest.raises(ValueError, match=match):
            Loopback(**{"world_size": 2, "hidden": 64, "num_topk": 2, "device": "cpu", **bad})
    with pytest.raises(TypeError, match=r"config must be a moe_dispatch.config.Config or None, got str"):
        Loopback(2, 64, 2, config="x", device="cpu")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match=r"torch sees no CUDA GPU; pass device='cpu'"):
            Loopback(2, 64, 2)
    with pytest.raises(ValueError, match=r"common is missing 'num_ranks'"):
        _ext._C.IntranodeCommon()


@built
def test_protocol_has_no_data_race_under_threadsanitizer(tmp_path):
    """The CPU backend's driver (csrc/tests/intranode_tsan.cpp), built with -fsanitize=thread:
    every simulated rank runs notify/dispatch/cached dispatch/combine rounds as its own
    launches, not joined with the others between operations (the real multi-GPU launch shape),
    over reused buffers. The queue protocol must order every slot write before its read and
    every read before the slot is rewritten, the barrier-free reuse of rings, counters and
    header lines must hold while ranks run ahead, and a last round's mismatched combine must be
    recorded by every rank without a timeout."""
    exe, env = build_tsan_driver(tmp_path, "intranode")
    for args in (
        ["3", "2", "2", "1", "2", "2", "4"],
        ["4", "1", "1", "1", "1", "3", "4"],
        ["2", "3", "3", "2", "3", "1", "4"],
        ["8", "1", "2", "1", "1", "1", "2"],
        # The variants whose role code differs (variant.cuh): ready flags on one-slot rings, rows
        # in pairs, combine teams, the coordinator's backoff.
        ["3", "2", "2", "1", "2", "2", "4", "flags=1"],
        ["4", "1", "1", "1", "2", "4", "3", "flags=1", "rows=2", "team=2", "backoff=1"],
        ["2", "3", "3", "2", "3", "4", "3", "rows=2", "team=4"],
    ):
        run = subprocess.run([str(exe), *args], capture_output=True, text=True, env=env, timeout=300)
        assert run.returncode == 0 and "ThreadSanitizer" not in run.stderr, run.stdout + run.stderr[-4000:]
        assert "ok" in run.stdout


# --- the kernels on one GPU (loopback) ---------------------------------------------------------

GPU_CASES = [
    # W, tokens, hidden, K, E, skewed, fp8
    (2, 512, 2880, 4, 32, False, False),
    (4, [700, 0, 300, 1024], 7168, 8, 64, True, False),
    (8, 512, 7168, 8, 256, False, False),
    (8, [256, 0, 0, 512, 128, 0, 64, 300], 2880, 4, 128, True, False),
    (4, 512, 7168, 8, 256, False, True),
    (8, 384, 7168, 8, 256, True, True),
]


@needs_gpu
@pytest.mark.parametrize("l2_discard", [False, True], ids=["keep", "l2-discard"])
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "W{}-H{}-K{}-E{}-skew{}-fp8{}".format(*c[:1], *c[2:]))
def test_gpu_loopback_matches_oracle(case, l2_discard):
    world_size, tokens, hidden, num_topk, num_experts, skewed, fp8 = case
    config = Config(num_sms=8, num_slots=16, chunk_tokens=4, l2_discard=l2_discard)
    lb = Loopback(world_size, hidden, num_topk, config=config, timeout_s=20)
    xs, idxs, ws = make_world(
        seed_of(case), world_size, tokens, hidden, num_topk, num_experts, skewed=skewed, device="cuda"
    )
    results = run_roundtrip(lb, xs, idxs, ws, num_experts, row_scales=not fp8, fp8=fp8)
    for r in results:
        assert (r.recv_x[0] if fp8 else r.recv_x).device == lb.device


@needs_gpu
@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != "current"])
@pytest.mark.parametrize("case", [GPU_CASES[2], GPU_CASES[4]], ids=["W8-bf16", "W4-fp8"])
def test_gpu_variants_match_oracle(case, variant):
    """Every kernel variant's kernels (their copies, TMA included, and launch bounds: what the CPU
    backend cannot run) against the oracle, with l2_discard (where the flags' and teams' discards
    differ)."""
    world_size, tokens, hidden, num_topk, num_experts, skewed, fp8 = case
    config = Config(num_sms=8, num_slots=16, chunk_tokens=4, l2_discard=True).with_variant(variant)
    lb = Loopback(world_size, hidden, num_topk, config=config, timeout_s=20)
    xs, idxs, ws = make_world(
        seed_of((case, variant)), world_size, tokens, hidden, num_topk, num_experts, skewed=skewed, device="cuda"
    )
    run_roundtrip(lb, xs, idxs, ws, num_experts, row_scales=not fp8, fp8=fp8)


@needs_gpu
def test_gpu_combine_is_deterministic_and_num_sms_independent():
    lb = Loopback(8, 7168, 8, config=Config(num_sms=16, num_slots=32, chunk_tokens=8), timeout_s=20)
    xs, idxs, ws = make_world(21, 8, 1024, 7168, 8, 256, skewed=True, device="cuda")
    outs = []
    for num_sms in (16, 4, 16):
        results = lb.dispatch(xs, idxs, ws, 256, num_sms=num_sms)
        ys = [r.recv_x * 0.5 for r in results]
        outs.append(lb.combine(ys, [r.handle for r in results]))
    for a, b in zip(outs[0], outs[1]):
        assert torch.equal(a, b)
    for a, b in zip(outs[0], outs[2]):
        assert torch.equal(a, b)


@needs_gpu
def test_gpu_budget_mode_in_a_cuda_graph():
    world_size, hidden, num_experts = 4, 2880, 32
    lb = Loopback(world_size, hidden, 4, config=Config(num_sms=8, num_slots=16, chunk_tokens=4), timeout_s=20)
    xs, idxs, ws = make_world(8, world_size, 256, hidden, 4, num_experts, device="cuda")
    replay_budget_dispatch(lb, xs, idxs, ws, num_experts, world_size)


def replay_budget_dispatch(lb, xs, idxs, ws, num_experts: int, ranks_per_node: int, *, combine: bool = False):
    """A budget-mode (``num_worst_tokens``) dispatch of the loopback ``lb`` and, with ``combine``,
    the combine of its rows, captured in a CUDA graph after a warm-up (Triton compiles), replayed
    after the inputs were rewritten in place with their own values: the rows must equal the oracle,
    with no overflow. Returns the oracle's dispatch and the combined outputs (None without
    ``combine``)."""
    refs = reference.dispatch(cpu(xs), cpu(idxs), cpu(ws), num_experts, ranks_per_node)
    budget = max(r.src_idx.numel() for r in refs) + 16
    lb.dispatch(xs, idxs, ws, num_experts, num_worst_tokens=budget, validate=False)  # warm-up: Triton compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    outs = None
    with torch.cuda.graph(graph):
        captured = lb.dispatch(xs, idxs, ws, num_experts, num_worst_tokens=budget, check=False, validate=False)
        if combine:
            outs = lb.combine([r.recv_x for r in captured], [r.handle for r in captured], check=False)
    for x in xs:
        x.mul_(1)  # same inputs: a replay must reproduce the oracle
    graph.replay()
    torch.cuda.synchronize()
    lb.check()
    assert_dispatch_equal(captured, refs, num_rows=budget)
    assert all(int(r.handle.overflow) == 0 for r in captured)
    return refs, outs


@needs_gpu
@pytest.mark.parametrize("phase", ["notify", "dispatch", "combine"])
def test_gpu_withheld_rank_times_out_with_its_name(phase):
    world_size, withheld = 4, 1
    lb = Loopback(world_size, 2880, 4, config=Config(num_sms=4, num_slots=8, chunk_tokens=2), timeout_s=0.2)
    xs, idxs, ws = make_world(12, world_size, 256, 2880, 4, 16, drop=0.0, device="cuda")
    if phase == "combine":
        results = lb.dispatch(xs, idxs, ws, 16)
        ys = [r.recv_x for r in results]
        with pytest.raises(IntranodeTimeoutError, match=rf"intranode combine timed out .* rank {withheld}") as info:
            lb.combine(ys, [r.handle for r in results], withhold_rank=withheld)
    else:
        with pytest.raises(IntranodeTimeoutError, match=rf"intranode {phase} timed out .* rank {withheld}") as info:
            lb.dispatch(xs, idxs, ws, 16, withhold_rank=withheld, withhold_phase=phase)
    assert info.value.peer == withheld and info.value.rank != withheld
    lb.timeout_s = 20
    run_roundtrip(lb, xs, idxs, ws, 16)  # after reset() the buffers work again


# --- the device-side header check (moe_dispatch.transport.kernels.header) -------------------------------


def set_records(records) -> dict[int, list[int]]:
    """Launched rank -> its set mismatch record (read without clearing)."""
    return {i: row for i, row in enumerate(records.records.tolist()) if row[0]}


def assert_recorded(lb, records, culprit: int, field: str, world_size: int, *, refusal: bool = False):
    """Every rank (but a refusing culprit, whose host knows) recorded the mismatch naming the
    culprit (the culprit names another rank), and ``lb.check()`` raises it once."""
    seen = set_records(records)
    expected = set(range(world_size)) - ({culprit} if refusal else set())
    assert set(seen) == expected, f"ranks with a record: {sorted(seen)}, expected {sorted(expected)}"
    for rank, row in seen.items():
        message, fields = describe_mismatch(row)
        assert fields["field"] == field and fields["rank"] == rank, message
        assert (fields["peer"] == culprit) == (rank != culprit), message
    with pytest.raises(
        MismatchError,
        match=rf"rank {culprit} refused the operation"
        if field == "status"
        else rf"rank {culprit} disagrees on the {re.escape(field)}",
    ):
        lb.check()
    assert not set_records(records)  # cleared: the buffers stay usable


def header_cases(lb, records, device: str, roundtrip=None) -> None:
    """A handle of another dispatch on rank 1 (combine and cached dispatch) and a refusal on rank
    2 (dispatch, cached dispatch, combine), over a loopback of either transport: recorded,
    raised, and the world works again (``roundtrip(lb, xs, idxs, ws, E, row_scales=True)``,
    default :func:`run_roundtrip`)."""
    W, E = lb.world_size, 4 * lb.world_size
    xs, idxs, ws = make_world(17, W, [24, 0, 30, 12, 9, 40, 7, 16][:W], 32, 2, E, device=device)
    first = lb.dispatch(xs, idxs, ws, E)
    second = lb.dispatch(xs, idxs, ws, E)
    handles = [r.handle for r in second]
    handles[1] = first[1].handle  # the same routing, another dispatch
    lb.combine([r.recv_x for r in second], handles, check=False)
    assert_recorded(lb, records, 1, "dispatch id (handle)", W)
    lb.dispatch(xs, None, None, E, handles=handles, check=False)
    assert_recorded(lb, records, 1, "dispatch id (handle)", W)
    refuse = {2: STATUS_TEST}
    lb.dispatch(xs, idxs, ws, E, status=refuse, check=False)
    assert_recorded(lb, records, 2, "status", W, refusal=True)
    lb.dispatch(xs, idxs, ws, E, handles=[r.handle for r in second], status=refuse, check=False)
    assert_recorded(lb, records, 2, "status", W, refusal=True)
    lb.combine([r.recv_x for r in second], [r.handle for r in second], status=refuse, check=False)
    assert_recorded(lb, records, 2, "status", W, refusal=True)
    (roundtrip or run_roundtrip)(lb, xs, idxs, ws, E, row_scales=True)


@built
def test_cpu_header_mismatch_and_refusal_are_recorded_by_every_rank():
    lb = Loopback(4, 32, 2, config=Config(num_sms=2, num_slots=2, chunk_tokens=1), device="cpu", timeout_s=30)
    header_cases(lb, lb.engine.records, "cpu")


def test_mismatch_message_names_ranks_and_field():
    assert describe_mismatch([0] * 8) is None
    message, fields = describe_mismatch([1, 3, 1, 1, 7, 9, -1, 0])
    assert "rank 1 disagrees on the dispatch id (handle): 9 on rank 1, 7 on rank 3" in message
    assert fields == {
        "rank": 3,
        "peer": 1,
        "field": "dispatch id (handle)",
        "mine": 7,
        "theirs": 9,
        "via": None,
        "refuser": None,
        "argument": None,
        "kind": None,
    }
    # a refusal's record carries the refuser's argument and kind as data (no message text parsed)
    refused = refusal_status(status_of(ArgumentTypeError("x must be a tensor", argument="x")))
    _, fields = describe_mismatch([1, 2, 0, FIELD_STATUS, 0, refused, -1, 0])
    assert (fields["refuser"], fields["argument"], fields["kind"]) == (0, "x", TypeError), fields
    message, fields = describe_mismatch([1, 5, 0, 7, 0, STATUS_INVALID_ARGUMENTS, 4, 0])
    assert "rank 0 refused the operation: its arguments were invalid" in message and fields["via"] == 4
    message, _ = describe_mismatch([1, 0, 2, 3, 0, 2, -1, 0])
    assert "dtype: float32 on rank 2, bfloat16 on rank 0" in message
    message, fields = describe_mismatch([1, 0, 1, 8, 64, 0, -1, 0])
    assert "num_worst_tokens: 0 (none) on rank 1, 64 on rank 0" in message and fields["field"] == "num_worst_tokens"
    flagged = header_words(3, 1, 64, torch.bfloat16, 0, 8, 4, slot_flags=True)[6]
    message, _ = describe_mismatch([1, 0, 1, 6, 4, flagged, -1, 0])
    assert "channels and flags: 4 channels, ready flags on rank 1, 4 channels on rank 0" in message


@needs_gpu
def test_gpu_header_mismatch_and_refusal_are_recorded_by_every_rank():
    lb = Loopback(4, 2880, 4, config=Config(num_sms=4, num_slots=8, chunk_tokens=2), timeout_s=20)
    header_cases(lb, lb.engine.records, "cuda")


def test_handle_is_a_named_dataclass():
    fields = {f for f in IntranodeHandle.__dataclass_fields__}
    assert {"is_token_in_rank", "recv_prefix", "num_rows", "overflow", "num_channels"} <= fields


# --- one process per rank, buffers shared through CUDA IPC ---------------------------------------


def cpu_transport(rank, hidden, num_topk, *, timeout_s, num_sms=2, num_slots=4):
    """This rank's IntranodeRank over the WORLD gloo group on the CPU path (shared memory,
    one process per rank), with 2-token chunks."""
    import torch.distributed as dist

    config = Config(num_sms=num_sms, num_slots=num_slots, chunk_tokens=2)
    return IntranodeRank(dist.group.WORLD, rank, hidden, num_topk, device="cpu", config=config, timeout_s=timeout_s)


def _shm_world_roundtrip(rank, world_size):
    """The CPU path of IntranodeRank: each process's buffer is a shared-memory segment
    its peers map by name; the kernels' CPU backend runs this rank's blocks on threads."""

    hidden, num_topk, num_experts = 256, 4, 4 * world_size
    xs, idxs, ws = make_world(45, world_size, [96, 0, 64, 40][:world_size], hidden, num_topk, num_experts)
    transport = cpu_transport(rank, hidden, num_topk, timeout_s=30, num_sms=4, num_slots=8)
    try:
        rank_roundtrips(transport, rank, xs, idxs, ws, num_experts, world_size)
        first = transport.dispatch(xs[rank], idxs[rank], ws[rank], num_experts)
        cached = transport.dispatch(xs[rank] * 2, None, None, num_experts, handle=first.handle)
        assert torch.equal(cached.recv_x, first.recv_x * 2) and cached.recv_topk_idx is None
    finally:
        transport.close()


def _shm_world_withheld_rank(rank, world_size):
    """A rank that never dispatches: the others' bounded waits end in an error naming it."""
    import torch.distributed as dist

    withheld = world_size - 1
    xs, idxs, ws = make_world(46, world_size, 32, 128, 2, 2 * world_size, drop=0.0)
    transport = cpu_transport(rank, 128, 2, timeout_s=0.5)
    try:
        if rank != withheld:
            with pytest.raises(IntranodeTimeoutError, match=f"rank {withheld}") as info:
                transport.dispatch(xs[rank], idxs[rank], ws[rank], 2 * world_size)
            assert info.value.peer == withheld
        dist.barrier()
    finally:
        transport.close()


def expect_mismatch(
    call, rank: int, culprit: int, field: str, *, refusing: type | None = None, limit_s: float = 5.0
) -> None:
    """``call()`` raises MismatchError naming ``culprit`` and ``field`` (the culprit itself: the
    ``refusing`` error, or MismatchError naming another rank), within ``limit_s`` (nothing timed
    out: the transports' bound is longer)."""
    import time

    start = time.monotonic()
    expected = refusing if (rank == culprit and refusing is not None) else MismatchError
    with pytest.raises(expected) as info:
        call()
    assert time.monotonic() - start < limit_s, f"rank {rank} took {time.monotonic() - start:.1f} s"
    if expected is MismatchError:
        assert info.value.field == field and (info.value.peer == culprit) == (rank != culprit), str(info.value)


def transport_header_cases(transport, rank: int, xs, idxs, ws, num_experts: int, ranks_per_node: int) -> None:
    """One rank's part of the header cases over a one-process-per-rank transport: a handle of
    another dispatch on rank 1, a hidden size of its own on rank 1, a bad argument on rank 1 in
    dispatch, cached dispatch and combine; then a round of :func:`rank_roundtrips` must still
    equal the oracle. Closes ``transport``."""
    try:
        device = transport.device
        x, idx, w = xs[rank].to(device), idxs[rank].to(device), ws[rank].to(device)
        first = transport.dispatch(x, idx, w, num_experts)
        second = transport.dispatch(x, idx, w, num_experts)
        mine = first.handle if rank == 1 else second.handle
        expect_mismatch(lambda: transport.combine(second.recv_x, mine), rank, 1, "dispatch id (handle)")
        expect_mismatch(
            lambda: transport.dispatch(x, None, None, num_experts, handle=mine), rank, 1, "dispatch id (handle)"
        )
        y = second.recv_x[:, : x.shape[1] // 2].contiguous() if rank == 1 else second.recv_x  # fits the slots too
        expect_mismatch(lambda: transport.combine(y, second.handle), rank, 1, "row bytes")
        bad_idx = torch.full_like(idx, num_experts) if rank == 1 else idx  # out of range on rank 1
        expect_mismatch(lambda: transport.dispatch(x, bad_idx, w, num_experts), rank, 1, "status", refusing=ValueError)
        bad_x = x[:-1] if rank == 1 else x  # one token short of the handle
        expect_mismatch(
            lambda: transport.dispatch(bad_x, None, None, num_experts, handle=second.handle),
            rank,
            1,
            "status",
            refusing=ValueError,
        )
        bad_y = second.recv_x[:-1] if rank == 1 and second.recv_x.shape[0] else second.recv_x
        if rank == 1 and not second.recv_x.shape[0]:
            bad_y = torch.zeros(1, x.shape[1], dtype=x.dtype, device=device)
        expect_mismatch(lambda: transport.combine(bad_y, second.handle), rank, 1, "status", refusing=ValueError)
        rank_roundtrips(transport, rank, xs, idxs, ws, num_experts, ranks_per_node, rounds=1)
    finally:
        transport.close()


def _shm_world_headers(rank, world_size):
    """The header cases over IntranodeRank's CPU path (shared memory, one process per rank)."""

    hidden, num_topk, num_experts = 64, 2, 4 * world_size
    xs, idxs, ws = make_world(48, world_size, [40, 12, 0, 33][:world_size], hidden, num_topk, num_experts)
    transport = cpu_transport(rank, hidden, num_topk, timeout_s=20)
    transport_header_cases(transport, rank, xs, idxs, ws, num_experts, world_size)


def _shm_entry(rank, world_size):
    return run_cases(
        rank,
        world_size,
        {"roundtrip": _shm_world_roundtrip, "withheld rank": _shm_world_withheld_rank, "headers": _shm_world_headers},
    )


@pytest.mark.world
@built
@pytest.mark.parametrize("case", ["roundtrip", "withheld rank", "headers"])
def test_cpu_shared_memory_world_matches_oracle(case):
    assert_case(world_results(_shm_entry, 3), case)


def _failed_setup(rank, world_size):
    """Rank 1 cannot map its peer's buffer: every rank raises, and removes what it made."""

    from moe_dispatch.transport.kernels import memory

    if rank == 1:

        def refuse(self, path):
            raise OSError(f"mapping {path} refused (test)")

        memory.SharedMemoryBuffer.open = refuse
    try:
        cpu_transport(rank, 64, 2, timeout_s=5)
    except Exception as err:  # noqa: BLE001 - the test reports which error each rank saw
        return type(err).__name__
    return "no error"


@pytest.mark.world
@built
def test_cpu_failed_setup_leaves_no_shared_memory():
    before = set(os.listdir("/dev/shm"))
    errors = spawn_world(2, _failed_setup, timeout_s=60)
    assert errors[1] == "OSError" and errors[0] != "no error", errors
    left = {f for f in set(os.listdir("/dev/shm")) - before if f.startswith("moe_dispatch-")}
    assert not left, f"shared-memory files left behind: {left}"


def _ipc_world_roundtrip(rank, world_size):
    """IntranodeRank as Buffer would use it: each process allocates its buffer, the IPC
    handles travel over torch.distributed, every rank launches its own kernels. On a machine
    with one GPU all ranks share it (IPC across processes of one device is allowed; the driver
    time-slices their kernels, so the bounded waits see slow but steady progress)."""
    import torch.distributed as dist

    torch.cuda.set_device(rank % torch.cuda.device_count())
    hidden, num_topk, num_experts = 2880, 4, 8 * world_size
    xs, idxs, ws = make_world(44, world_size, [256, 0, 384, 128][:world_size], hidden, num_topk, num_experts)
    transport = IntranodeRank(
        dist.group.WORLD, rank, hidden, num_topk, config=Config(num_sms=4, num_slots=16, chunk_tokens=4), timeout_s=30
    )
    try:
        rank_roundtrips(transport, rank, xs, idxs, ws, num_experts, world_size)
    finally:
        transport.close()


def rank_roundtrips(transport, rank, xs, idxs, ws, num_experts, ranks_per_node, rounds=2):
    """This rank's dispatch and combine through a one-rank-per-process transport, each checked
    against the oracle, ``rounds`` times (later rounds reuse the rings)."""
    refs = reference.dispatch(xs, idxs, ws, num_experts, ranks_per_node)
    hidden, device = xs[0].shape[1], transport.device
    for _ in range(rounds):
        got = transport.dispatch(xs[rank].to(device), idxs[rank].to(device), ws[rank].to(device), num_experts)
        assert_dispatch_equal([got], [refs[rank]])
        ys = [
            torch.randn(ref.src_idx.shape[0], hidden, generator=torch.Generator().manual_seed(r)).to(torch.bfloat16)
            for r, ref in enumerate(refs)
        ]
        out = transport.combine(ys[rank].to(device), got.handle)
        want = reference.combine(ys, idxs, num_experts, ranks_per_node, ranks=[rank])[0]
        assert torch.equal(out.cpu(), want), f"combine of rank {rank}"


def _ipc_entry(rank, world_size):
    return run_cases(rank, world_size, {"roundtrip": _ipc_world_roundtrip})


@pytest.mark.world
@needs_gpu
@pytest.mark.parametrize("world_size", [2, 4])
def test_gpu_ipc_world_matches_oracle(world_size):
    # gloo carries the handles; the ranks keep the GPUs this process sees (a gloo world hides them by default).
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") or ",".join(map(str, range(torch.cuda.device_count())))
    results = spawn_world(world_size, _ipc_entry, env={"CUDA_VISIBLE_DEVICES": visible}, timeout_s=120)
    assert_case(results, "roundtrip")
