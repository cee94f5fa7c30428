"""Bad input gets an error naming the argument, the expectation and what came; a rank that
never joins makes its peers fail within ``timeout_s`` with the operation named."""

from __future__ import annotations

import os
import time
import types

import pytest
import torch

from moe_dispatch import Buffer, CommError
from moe_dispatch.config import Config

from .worlds import assert_case, run_cases, world_results

E = 8  # experts in a world of 2


def _inputs(num_tokens=6, hidden=4):
    x = torch.randn(num_tokens, hidden)
    idx = torch.tensor([[0, 5], [1, -1], [7, 2], [-1, -1], [3, 4], [6, 0]])[:num_tokens]
    return x, idx, torch.rand(num_tokens, 2)


def _raises(exc, match, fn):
    with pytest.raises(exc, match=match):
        fn()


def _bad_input_cases(buf: Buffer) -> dict:
    x, idx, w = _inputs()
    return {
        "x-int-dtype": lambda: _raises(
            TypeError, r"x must have dtype in .* got int64", lambda: buf.dispatch(x.long(), idx, w, E)
        ),
        "x-not-2d": lambda: _raises(
            ValueError, r"x must be 2-D, got shape \[6, 4, 1\]", lambda: buf.dispatch(x[..., None], idx, w, E)
        ),
        "x-non-contiguous": lambda: _raises(
            ValueError, r"x must be contiguous", lambda: buf.dispatch(torch.randn(4, 6).t(), idx, w, E)
        ),
        "x-hidden-zero": lambda: _raises(
            ValueError,
            r"x must have a hidden size >= 1, got shape \[6, 0\]",
            lambda: buf.dispatch(torch.zeros(6, 0), idx, w, E),
        ),
        "x-wrong-device": lambda: _raises(
            ValueError, r"x must be on cpu, got meta", lambda: buf.dispatch(x.to("meta"), idx, w, E)
        ),
        "topk-idx-float": lambda: _raises(
            TypeError,
            r"topk_idx must have dtype in \(int32, int64\), got float32",
            lambda: buf.dispatch(x, idx.float(), w, E),
        ),
        "topk-idx-rows": lambda: _raises(
            ValueError,
            r"topk_idx has shape \[5, 2\] but x has 6 tokens",
            lambda: buf.dispatch(x, idx[:5].contiguous(), w[:5], E),
        ),
        "topk-idx-too-large": lambda: _raises(
            ValueError,
            r"topk_idx entries must be in \[-1, 8\).*got 9",
            lambda: buf.dispatch(x, idx.clamp(max=9) + (idx == 7).long() * 2, w, E),
        ),
        "topk-idx-below-minus-one": lambda: _raises(
            ValueError, r"got -2", lambda: buf.dispatch(x, idx.clamp(min=-2) - (idx == -1).long(), w, E)
        ),
        "topk-idx-duplicate": lambda: _raises(
            ValueError,
            r"topk_idx row 0 selects an expert more than once: \[5, 5\]",
            lambda: buf.dispatch(x, torch.where(idx == 0, 5, idx), w, E),
        ),
        "topk-weights-shape": lambda: _raises(
            ValueError,
            r"topk_weights has shape \[6, 3\] but topk_idx has shape "
            r"\[6, 2\]",
            lambda: buf.dispatch(x, idx, torch.rand(6, 3), E),
        ),
        "topk-weights-dtype": lambda: _raises(
            TypeError,
            r"topk_weights must have dtype in \(float32\), got float16",
            lambda: buf.dispatch(x, idx, w.half(), E),
        ),
        "experts-not-divisible": lambda: _raises(
            ValueError,
            r"num_experts must be divisible by the EP world size 2, "
            r"got 9",
            lambda: buf.dispatch(x, idx, w, 9),
        ),
        "fp8-hidden-not-multiple-of-128": lambda: _raises(
            ValueError,
            r"x_fp8 has hidden size 96, which is not a multiple of the fp8 block size 128",
            lambda: buf.dispatch((torch.zeros(6, 96).to(torch.float8_e4m3fn), torch.ones(6, 1)), idx, w, E),
        ),
        "fp8-not-a-pair": lambda: _raises(
            ValueError,
            r"an fp8 x must be the tuple \(x_fp8, scales\), got a tuple of 1",
            lambda: buf.dispatch((x,), idx, w, E),
        ),
        "x-list": lambda: _raises(
            TypeError,
            r"x must be a tensor, or the fp8 pair as the tuple \(x_fp8, scales\), got a list of 2",
            lambda: buf.dispatch([x, x], idx, w, E),
        ),
        "topk-idx-no-column": lambda: _raises(
            ValueError,
            r"topk_idx must have at least one column \(top-k >= 1.*got shape \[6, 0\]",
            lambda: buf.dispatch(x, idx[:, :0], w[:, :0], E),
        ),
        "num-worst-tokens-huge": lambda: _raises(
            ValueError,
            r"num_worst_tokens must be at most \d+ here .*num_tokens \* num_ranks = 12 .*got 1099511627776",
            lambda: buf.dispatch(x, idx, w, E, num_worst_tokens=2**40),
        ),
        "num-worst-tokens-tokens-times-ranks": lambda: buf.dispatch(x, idx, w, E, num_worst_tokens=12),
        "missing-routing": lambda: _raises(
            ValueError, r"dispatch needs topk_idx and num_experts", lambda: buf.dispatch(x)
        ),
        "bad-transport": lambda: _raises(
            ValueError, r"transport must be one of .* got 'nvlink'", lambda: Buffer(transport="nvlink")
        ),
        "odd-num-sms": lambda: _raises(
            ValueError,
            r"num_sms must be an even int in \[2, 128\] \(a sender and a "
            r"receiver block per channel\), got 3, or None for the default",
            lambda: Buffer(num_sms=3),
        ),
        "bad-num-chunks": lambda: _raises(
            ValueError,
            r"num_chunks must be a positive int \(the torch_dist pipeline "
            r"depth: chunks per dispatch and combine\) or None for the "
            r"default, got 0",
            lambda: Buffer(num_chunks=0),
        ),
        "device-type": lambda: _raises(
            ValueError, r"device must be None, 'cpu' or a CUDA device, got 'meta'", lambda: Buffer(device="meta")
        ),
        "on-overflow": lambda: _raises(
            ValueError,
            r"on_overflow must be 'raise' or 'drop', got 'keep'",
            lambda: buf.dispatch(x, idx, w, E, num_worst_tokens=8, on_overflow="keep"),
        ),
        "group-type": lambda: _raises(
            TypeError, r"group must be a torch.distributed ProcessGroup or None .* got str", lambda: Buffer("world")
        ),
        "ranks-per-node-zero": lambda: _raises(
            ValueError, r"ranks_per_node must be a positive int, got 0", lambda: Buffer(ranks_per_node=0)
        ),
        "ranks-per-node-not-divisor": lambda: _raises(
            ValueError,
            r"ranks_per_node must divide the world size 2, "
            r"got ranks_per_node=3",
            lambda: Buffer(ranks_per_node=3),
        ),
        "config-type": lambda: _raises(
            TypeError,
            r"config must be a moe_dispatch.config.Config or None, got dict",
            lambda: Buffer(config={"num_sms": 4}),
        ),
        "config-string": lambda: _raises(
            ValueError,
            r"config must be a moe_dispatch.config.Config, None or 'auto', got 'fast'",
            lambda: Buffer(config="fast"),
        ),
        "num-sms-and-auto": lambda: _raises(
            ValueError,
            r"num_sms=4 and config 'auto' both set the SM budget: pass one",
            lambda: Buffer(num_sms=4, config="auto"),
        ),
        "num-sms-and-config": lambda: _raises(
            ValueError,
            r"num_sms=4 and config \(num_sms=8\) both set the SM budget: "
            r"pass one",
            lambda: Buffer(num_sms=4, config=Config(num_sms=8)),
        ),
        "num-sms": lambda: _raises(
            ValueError, r"num_sms must be an even int in \[2, 128\].*got 0", lambda: Buffer(num_sms=0)
        ),
        "timeout": lambda: _raises(
            ValueError, r"timeout_s must be a positive, finite number of seconds .*got -1", lambda: Buffer(timeout_s=-1)
        ),
        "timeout-inf": lambda: _raises(
            ValueError, r"timeout_s must be a positive, finite number .*got inf", lambda: Buffer(timeout_s=float("inf"))
        ),
    }


def _handle_setup(buf: Buffer) -> types.SimpleNamespace:
    """A dispatch's outputs and a second Buffer (collective: every rank builds it)."""
    x, idx, w = _inputs()
    recv_x, *_, handle, _ = buf.dispatch(x, idx, w, E)
    return types.SimpleNamespace(
        recv_x=recv_x, handle=handle, rows=handle.num_recv_tokens, other=Buffer(ranks_per_node=1, timeout_s=30)
    )


def _handle_cases(buf: Buffer, c: types.SimpleNamespace) -> dict:
    """Cases that need a handle; ``c`` from :func:`_handle_setup` is read only when they run."""
    x, idx, w = _inputs()
    return {
        "combine-rows": lambda: _raises(
            ValueError,
            rf"y has shape \[{c.rows + 1}, 4\] but handle \(tokens received\) "
            rf"has {c.rows} rows",
            lambda: buf.combine(torch.randn(c.rows + 1, 4), c.handle),
        ),
        "combine-weights-dtype": lambda: _raises(
            TypeError,
            r"topk_weights must be an fp32 tensor, got float64",
            lambda: buf.combine(c.recv_x, c.handle, torch.ones(c.rows, dtype=torch.float64)),
        ),
        "combine-weights-shape": lambda: _raises(
            ValueError,
            rf"topk_weights must be \[{c.rows}\] or \[{c.rows}, 2\]",
            lambda: buf.combine(c.recv_x, c.handle, torch.ones(c.rows + 2)),
        ),
        "foreign-handle": lambda: _raises(
            ValueError, r"handle was made by another Buffer", lambda: c.other.combine(c.recv_x, c.handle)
        ),
        "combine-weights-wrong-k": lambda: _raises(
            ValueError,
            rf"topk_weights must be \[{c.rows}\] or \[{c.rows}, 2\]",
            lambda: buf.combine(c.recv_x, c.handle, torch.ones(c.rows, 3)),
        ),
        "combine-fp8": lambda: _raises(
            TypeError,
            r"fp8 \(x_fp8, scales\) is a dispatch-only format",
            lambda: buf.combine((c.recv_x, c.recv_x), c.handle),
        ),
        "previous-event-type": lambda: _raises(
            TypeError,
            r"previous_event must be an EventOverlap .* got object",
            lambda: buf.combine(c.recv_x, c.handle, previous_event=object()),
        ),
        "num-experts-as-weights": lambda: _raises(
            TypeError, r"topk_weights got the int 8: pass num_experts after", lambda: buf.dispatch(x, idx, E)
        ),
        "not-a-handle": lambda: _raises(
            TypeError, r"handle must be a DispatchHandle .* got tuple", lambda: buf.combine(c.recv_x, (1, 2))
        ),
        "cached-dispatch-with-routing": lambda: _raises(
            ValueError, r"a cached dispatch \(handle=...\) replays", lambda: buf.dispatch(x, idx, handle=c.handle)
        ),
        "cached-dispatch-rows": lambda: _raises(
            ValueError,
            r"x has shape \[5, 4\] but handle \(tokens dispatched\) "
            r"has 6 rows",
            lambda: buf.dispatch(x[:5].contiguous(), handle=c.handle),
        ),
    }


def _errors_entry(rank, world_size):
    buf = Buffer(ranks_per_node=1, timeout_s=30)
    results = run_cases(rank, world_size, {k: (lambda r, w, f=f: f()) for k, f in _bad_input_cases(buf).items()})
    handle_cases = _handle_cases(buf, _handle_setup(buf))
    results.update(run_cases(rank, world_size, {k: (lambda r, w, f=f: f()) for k, f in handle_cases.items()}))
    return results


def _case_names():
    return list(_bad_input_cases(None)) + list(_handle_cases(None, None))


@pytest.mark.world
@pytest.mark.parametrize("case", _case_names())
def test_bad_input(case):
    assert_case(world_results(_errors_entry, 2), case)


TIMEOUT_S = 3.0


def _withheld_rank_entry(rank, world_size, ranks_per_node, absent, transport="auto"):
    """Rank ``absent`` never joins the dispatch; every other rank must raise CommError in time."""
    buf = Buffer(ranks_per_node=ranks_per_node, transport=transport, timeout_s=TIMEOUT_S)
    x, idx, w = _inputs()
    idx = torch.where(idx >= 0, idx % (4 * world_size), idx)
    if rank == absent:
        time.sleep(3 * TIMEOUT_S)  # alive but silent, so the peers see a timeout, not a reset
        return None
    start = time.monotonic()
    try:
        buf.dispatch(x, idx, w, 4 * world_size)
    except CommError as err:
        return time.monotonic() - start, str(err)
    return time.monotonic() - start, "no error"


@pytest.mark.world
@pytest.mark.parametrize("world_size,ranks_per_node,transport", [(2, 1, "auto"), (4, 2, "auto"), (3, 3, "kernels")])
def test_withheld_rank_times_out(world_size, ranks_per_node, transport):
    absent = world_size - 1
    results = world_results(_withheld_rank_entry, world_size, ranks_per_node, absent, transport)
    for rank, res in enumerate(results):
        if rank == absent:
            continue
        elapsed, message = res
        assert message.startswith(f"EP rank {rank} (node {rank // ranks_per_node}): dispatch"), message
        assert "timed out after timeout_s=3 waiting for EP ranks [" in message, message
        # the waiting rank names the one that never reached the operation, from the store
        assert (
            f"not yet at this operation (#1 dispatch (metadata)): EP rank {absent} "
            "(no operation of this Buffer yet, or closed it)" in message
        ), message
        assert elapsed < 2 * TIMEOUT_S + 2, f"rank {rank} took {elapsed:.1f} s to fail: {message}"


def _mode_mismatch_entry(rank, world_size):
    """Rank 0 sizes its dispatch, rank 1 passes num_worst_tokens, then both pass different values:
    the counts travel in the same exchange, so every rank raises a ValueError naming the field at
    once; the same value on every rank works."""
    buf = Buffer(ranks_per_node=1, timeout_s=TIMEOUT_S)
    x, idx, w = _inputs()
    messages, start = [], time.monotonic()
    for num_worst_tokens in (64 if rank else 0, 32 * (rank + 1)):
        try:
            buf.dispatch(x, idx, w, E, num_worst_tokens=num_worst_tokens, async_finish=True)[-1].current_stream_wait()
            messages.append("no error")
        except ValueError as err:
            messages.append(str(err))
    elapsed = time.monotonic() - start
    recv_x = buf.dispatch(x, idx, w, E, num_worst_tokens=64)[0]
    assert recv_x.shape[0] == 64
    buf.close()
    return messages, elapsed


@pytest.mark.world
def test_ranks_disagreeing_on_num_worst_tokens_are_named():
    for rank, (messages, elapsed) in enumerate(world_results(_mode_mismatch_entry, 2)):
        given, values = (0, 64), (32, 64)
        for message, mine in zip(messages, (given, values)):
            assert (
                f"EP rank {rank}: dispatch arguments differ across ranks: num_worst_tokens is {mine[rank]} "
                f"here but {mine[1 - rank]} on EP rank {1 - rank}"
            ) in message, message
        assert elapsed < TIMEOUT_S / 2, f"{elapsed:.2f} s: {messages}"


def _inconsistent_entry(rank, world_size):
    """Ranks that disagree on an argument get a ValueError naming it (not a process abort)."""
    buf = Buffer(ranks_per_node=1, timeout_s=30)
    x, idx, w = _inputs()
    variants = {
        "num_experts": lambda: buf.dispatch(x, idx, w, E * (rank + 1)),
        "hidden": lambda: buf.dispatch(torch.randn(6, 4 + rank), idx, w, E),
        "x dtype": lambda: buf.dispatch(x.to(torch.bfloat16) if rank else x, idx, w, E),
        "top-k": lambda: buf.dispatch(x, idx[:, : 2 - rank].contiguous(), w[:, : 2 - rank].contiguous(), E),
        "topk_weights given": lambda: buf.dispatch(x, idx, w if rank else None, E),
    }
    recv_x, *_, handle, _ = buf.dispatch(x, idx, w, E)
    # Operations that exchange no sizes: a mismatch would abort inside gloo without the check.
    later = {
        "combine hidden": lambda: buf.combine(torch.cat([recv_x] * (1 + rank), 1), handle),
        "combine dtype": lambda: buf.combine(recv_x.half() if rank else recv_x, handle),
        "cached dispatch dtype": lambda: buf.dispatch(x.half() if rank else x, handle=handle),
        "operation": lambda: buf.combine(recv_x, handle) if rank else buf.dispatch(x, handle=handle),
    }
    messages = {}
    for name, call in {**variants, **later}.items():
        try:
            call()
            messages[name] = "no error"
        except ValueError as err:
            messages[name] = str(err)
    assert buf.combine(recv_x, handle)[0].shape == x.shape, "the Buffer must stay usable"
    return messages


@pytest.mark.world
def test_arguments_differ_across_ranks():
    """Every rank raises, naming the field, the other rank and both values readably."""
    # case -> (the field the message names, (rank 0's value, rank 1's value) where pinned)
    expect = {
        "num_experts": ("num_experts", ("8", "16")),
        "hidden": ("hidden", ("4", "5")),
        "x dtype": ("x dtype", ("float32", "bfloat16")),
        "top-k": ("top-k", ("2", "1")),
        "topk_weights given": ("topk_weights given", ("False", "True")),
        "combine hidden": ("hidden", None),
        "combine dtype": ("dtype", ("float32", "float16")),
        "cached dispatch dtype": ("dtype", ("float32", "float16")),
        "operation": ("operation", ("dispatch", "combine")),
    }
    for rank, messages in enumerate(world_results(_inconsistent_entry, 2)):
        assert set(messages) == set(expect)
        for case, message in messages.items():
            field, values = expect[case]
            assert "arguments differ across ranks" in message and f"on EP rank {1 - rank}" in message, message
            assert f": {field} is " in message, message
            if values is not None:
                assert f"{field} is {values[rank]} here but {values[1 - rank]} on" in message, message


def _ranks_per_node_entry(rank, world_size):
    import torch.distributed as dist

    from moe_dispatch.runtime.arguments import default_ranks_per_node

    groups = {"all": [0, 1, 2, 3], "strided": [0, 2], "one node": [0, 1], "uneven": [0, 1, 2]}
    made = {name: dist.new_group(ranks) for name, ranks in groups.items()}  # every rank creates every group
    return {name: default_ranks_per_node(group) for name, group in made.items() if rank in groups[name]}


@pytest.mark.world
def test_default_ranks_per_node_follows_where_ranks_run():
    """LOCAL_WORLD_SIZE=2: 4 ranks are 2 nodes x 2; a strided EP group (Megatron with TP=2) has
    one rank per node; uneven groups fall back to one node."""
    from moe_dispatch.testing.launch import spawn_world

    results = spawn_world(4, _ranks_per_node_entry, env={"LOCAL_WORLD_SIZE": "2"}, timeout_s=120)
    assert results[0] == {"all": 2, "strided": 1, "one node": 2, "uneven": 3}
    assert results[3] == {"all": 2}


# Read when a rank imports this module: spawn_world applies its environment before that.
_PROBE_AT_IMPORT = os.environ.get("MOE_DISPATCH_TEST_PROBE")


def _environment_entry(rank, world_size):
    return _PROBE_AT_IMPORT, os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.is_available()


@pytest.mark.world
def test_gloo_world_sees_its_environment_and_no_gpu_from_the_first_import():
    """A gloo world is a CPU world also where a GPU is visible: CUDA_VISIBLE_DEVICES='' and any
    env= value hold before fn's module is imported (Megatron's import already asks CUDA for its
    devices, and CUDA reads the variable once)."""
    from moe_dispatch.testing.launch import spawn_world

    for probe in spawn_world(2, _environment_entry, env={"MOE_DISPATCH_TEST_PROBE": "set"}, timeout_s=120):
        assert probe == ("set", "", False)
    with pytest.raises(ValueError, match="module-level function"):
        spawn_world(2, lambda rank, world_size: None)


def _late_store_reader_entry(rank, world_size):
    """Rank 0 returns at once; rank 1 reads the store a second later."""
    import torch.distributed as dist

    if rank == 0:
        return None
    time.sleep(1.0)
    store = dist.distributed_c10d._get_default_store()
    store.set("late", "read")
    return store.get("late").decode()


def test_store_host_stays_until_every_rank_returned():
    """spawn_world's rank 0 holds the TCP store: it stays until every rank's function returned, so
    a slower rank (a failure's diagnosis reads its peers' records there) still reaches the store."""
    from moe_dispatch.testing.launch import spawn_world

    assert spawn_world(2, _late_store_reader_entry, timeout_s=60) == [None, "read"]


def test_progress_keys_follow_each_group_not_the_process():
    """A rank in two EP groups numbers each group's Buffers on its own, so ranks that made
    Buffers for other groups first still agree on the keys of a shared group."""
    from moe_dispatch.control.progress import Progress

    def index(p):
        return int(p._prefix.rsplit("/", 1)[1])

    first_a, other, second_a = Progress([5, 7], 0), Progress([5, 9], 0), Progress([5, 7], 0)
    assert index(second_a) == index(first_a) + 1, "the other group's Progress must not count"
    assert first_a._prefix.rsplit("/", 2)[1] != other._prefix.rsplit("/", 2)[1]


# -- the agreement's codes and messages (no world) -----------------------------------------------------
def test_agreement_codes_and_messages():
    """Status codes carry the argument and the error type of an ArgumentError (its fields, never
    its text); check() names every refusing rank with its posted text (or its code) and raises the
    lowest refusing rank's kind, argument and rank, else the first differing field with every rank
    that differs."""
    from moe_dispatch.control import agreement as ag
    from moe_dispatch.errors import ArgumentTypeError, InvalidArgumentError

    status = ag.status_of(ArgumentTypeError("topk_weights must have dtype in (float32)", argument="topk_weights"))
    assert ag.describe_status(status) == "a bad topk_weights (TypeError)"
    assert ag.decode_status(status) == ("topk_weights", TypeError)
    named = InvalidArgumentError("dispatch needs topk_idx and num_experts", argument="topk_idx")
    assert ag.describe_status(ag.status_of(named)).startswith("a bad topk_idx")
    # a plain error names no argument, whatever its text says
    assert ag.describe_status(ag.status_of(ValueError("topk_idx is bad"))) == "bad arguments (ValueError)"
    fields = {"operation": "combine", "handle": ag.DispatchId(3), "hidden": 16, "dtype": torch.bfloat16}
    good = ag.row(fields, 0, ag.AGREE_WORDS)
    assert len(good) == ag.AGREE_WORDS and good[:5] == [0, 1, 3, 16, 2]
    bad_y = ag.status_of(InvalidArgumentError("y has shape [3, 4]", argument="y"))
    refused_y = ag.row(ag.refusing_fields(list(fields)), bad_y, ag.AGREE_WORDS)
    refused = ag.row(ag.refusing_fields(list(fields)), status, ag.AGREE_WORDS)
    with pytest.raises(
        ValueError,
        match=r"EP rank 0: combine refused by EP ranks 1 \(ValueError: y has shape .*\), "
        r"2 \(a bad topk_weights \(TypeError\)\); every rank raises",
    ) as err:
        ag.check(
            [good, refused_y, refused],
            fields,
            rank=0,
            what="combine",
            refusals=lambda ranks: {1: "ValueError: y has shape [3, 4]"},
        )
    assert isinstance(err.value, InvalidArgumentError) and (err.value.argument, err.value.rank) == ("y", 1)
    with pytest.raises(ArgumentTypeError, match=r"refused by EP ranks 1 \(a bad topk_weights") as err:
        ag.check([good, refused, refused_y], fields, rank=0, what="combine", refusals=lambda ranks: {})
    assert (err.value.argument, err.value.rank) == ("topk_weights", 1)
    other = ag.row({**fields, "handle": ag.DispatchId(5)}, 0, ag.AGREE_WORDS)
    with pytest.raises(
        ValueError,
        match=r"handle is dispatch #3 here but dispatch #5 on EP rank 1, dispatch #5 on EP "
        r"rank 2; every rank must pass the same operation, handle, hidden, dtype",
    ) as err:
        ag.check([good, other, other], fields, rank=0, what="combine", refusals=lambda ranks: {})
    assert isinstance(err.value, InvalidArgumentError) and (err.value.argument, err.value.rank) == ("handle", 1)
    ag.check([good, good], fields, rank=1, what="combine", refusals=lambda ranks: {})
    with pytest.raises(ValueError, match=r"'cached combine' cannot travel in an argument check"):
        ag.row({"operation": "cached combine"})
    with pytest.raises(ValueError, match=r"carries at most 12 fields, got 13"):
        ag.row(dict.fromkeys(map(str, range(13)), 1), 0, ag.AGREE_WORDS)


def test_lost_peer_diagnosis_waits_for_late_notes():
    """After a lost connection the diagnosis reads the peers' records until one peer is left
    unaccounted for: a live peer whose failure note lands late (its threads slow on a loaded
    machine) is not taken for the dead one, and the wait ends when that note lands."""
    import threading

    import torch.distributed as dist

    from moe_dispatch.control import progress as pg

    store = dist.HashStore()
    mine, peers = pg.Progress([10, 11, 12, 13], 0), [pg.Progress([10, 11, 12, 13], r) for r in (1, 2, 3)]
    for p in (mine, *peers):  # one process plays every rank: one store, the same keys
        p._store, p._prefix = store, mine._prefix
    seq = 5
    mine.mark("caller", seq, "combine")
    peers[0]._note_failure(seq, "combine")  # EP rank 1 failed at once; EP rank 3 never answers
    late = threading.Timer(0.5, peers[1]._note_failure, (seq, "combine"))  # EP rank 2, late
    late.start()
    start = time.monotonic()
    message = mine.describe_peers([1, 2, 3], lost=True)
    elapsed = time.monotonic() - start
    late.join()
    assert "EP rank 3 (no operation of this Buffer yet, or closed it) is the only peer" in message, message
    assert 0.5 <= elapsed < pg.SETTLE_S, f"{elapsed:.2f} s"
