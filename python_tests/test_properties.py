"""Property tests: dispatch and combine against the oracle over drawn worlds, shapes, dtypes and
modes (hypothesis).

Drawn: world shapes W <= 6 with any ranks per node L dividing W; T in [0, 512] per rank (fewer
for wide rows: T * H <= ROW_BUDGET, so H in [1, 8192] stays cheap); K, E = W * (experts per
rank); x dtypes fp32/bf16/fp16 and the fp8 pair; int32/int64 ids; -1 entries from none to all;
one mode per test (sync, async, hook, num_worst_tokens, cached, weighted, backward).
``transport="torch_dist"`` runs every mode; ``transport="kernels"`` (their CPU backend, where
built) the weighted combines of every dtype across 2+ nodes, the kernels' own two-level sums
(issue 34: their fp16 node partials were once left unrounded).

One live 6-rank gloo world serves every example (``LiveWorld``): hypothesis draws in this
process and each example runs on every rank, with a Buffer per transport and world shape made on
first use (ranks [0, W) of the world, kept while among the last BUFFERS_KEPT used). Each rank
rebuilds every rank's inputs from the example's seed and checks its own results against the
oracle bit for bit (:mod:`moe_dispatch.testing.cases`, which the soak benchmark runs too). A
fixed seed per mode (from its name), a fixed ``max_examples`` and no deadline: the same
examples on every run, bounded time.
"""

from __future__ import annotations

import collections
import math
import zlib

import pytest
import torch.distributed as dist
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from moe_dispatch import Buffer, _ext
from moe_dispatch.config import Config
from moe_dispatch.testing import cases
from moe_dispatch.testing.cases import DTYPES, FP8_MODES, MODES

from .worlds import LiveWorld

pytestmark = pytest.mark.world

WORLD_SIZE = 6
SHAPES = [(w, n) for w in range(1, WORLD_SIZE + 1) for n in range(1, w + 1) if w % n == 0]
ROW_BUDGET = 1 << 16  # T * H per rank: 512 tokens of 128, or 8 tokens of 8192
BUFFERS_KEPT = 4
EXAMPLES_PER_MODE = 64
NODE_SHAPES = [(w, n) for w, n in SHAPES if w // n > 1]
KERNEL_EXAMPLES = 24
KERNEL_CONFIG = Config(num_sms=2)  # one channel: the fewest CPU-backend threads per launch


class _Buffers:
    """A rank's Buffers by world shape, made and closed as every rank of the live world sees
    the same examples in the same order (so the collective steps line up)."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        # Every rank creates every sub-group first, while c10d's group count (which names
        # groups) is still the same on every rank: the Buffers' own groups advance it on their
        # members only.
        self.groups = {w: dist.new_group(list(range(w))) if w < world_size else None for w in range(1, world_size + 1)}
        self.used: collections.OrderedDict[tuple[str, int, int], Buffer | None] = collections.OrderedDict()

    def get(self, shape: tuple[int, int], transport: str) -> Buffer | None:
        """The Buffer of ``shape`` (W, L) and ``transport`` on ranks [0, W), None on the other ranks."""
        world, local = shape
        key = (transport, world, local)
        if key in self.used:
            self.used.move_to_end(key)
            return self.used[key]
        if len(self.used) == BUFFERS_KEPT:
            _, old = self.used.popitem(last=False)
            if old is not None:
                old.close()
        member = self.rank < world
        options = {"transport": transport, "timeout_s": 120}
        if transport == "kernels":
            options["config"] = KERNEL_CONFIG
        self.used[key] = Buffer(self.groups[world], ranks_per_node=local, **options) if member else None
        return self.used[key]

    def close(self) -> None:
        for buf in self.used.values():
            if buf is not None:
                buf.close()


def _setup(rank: int, world_size: int) -> _Buffers:
    return _Buffers(rank, world_size)


def _run_case(rank: int, world_size: int, state: _Buffers, case: dict, transport: str) -> None:
    buf = state.get(tuple(case["world"]), transport)
    if buf is not None:
        cases.run_case(buf, rank, case)


@st.composite
def _cases(draw, mode: str, shapes=SHAPES) -> dict:
    world = draw(st.sampled_from(shapes))
    dtype = draw(st.sampled_from([*DTYPES, "fp8"] if mode in FP8_MODES else list(DTYPES)))
    hidden = draw(st.integers(1, 8192))
    if dtype == "fp8":
        hidden = 128 * math.ceil(hidden / 128)
    most = max(1, min(512, ROW_BUDGET // hidden))
    num_experts = world[0] * draw(st.integers(1, 64))
    return {
        "world": world,
        "mode": mode,
        "dtype": dtype,
        "hidden": hidden,
        "tokens": draw(st.lists(st.integers(0, most), min_size=world[0], max_size=world[0])),
        "num_experts": num_experts,
        "topk": draw(st.integers(1, min(num_experts, 9))),
        "drop": draw(st.sampled_from([0.0, 0.1, 0.5, 1.0])),
        "index_dtype": draw(st.sampled_from(["int64", "int32"])),
        "seed": draw(st.integers(0, 2**31 - 1)),
        "slack": draw(st.integers(0, 40)),
    }


@pytest.fixture(scope="module")
def live_world():
    with LiveWorld(WORLD_SIZE, _setup) as world:
        yield world


def _check_draws(live_world, name: str, draws, examples: int, transport: str) -> None:
    """Runs ``examples`` cases drawn from ``draws`` on ``transport``, with a seed fixed per
    ``name``: the same examples every run, other ones per name."""

    @seed(zlib.crc32(name.encode()))
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(case=draws)
    def check(case):
        failures = [value for ok, value in live_world.run(_run_case, case, transport) if not ok]
        assert not failures, f"case {case}:\n" + "\n".join(failures)

    check()


@pytest.mark.parametrize("mode", MODES)
def test_matches_the_oracle(live_world, mode):
    _check_draws(live_world, mode, _cases(mode), EXAMPLES_PER_MODE, "torch_dist")


@pytest.mark.skipif(not _ext.extension_status().built, reason="transport='kernels' needs the built extension")
def test_kernels_weighted_combine_across_nodes_matches_the_oracle(live_world):
    _check_draws(live_world, "kernels weighted", _cases("weighted", NODE_SHAPES), KERNEL_EXAMPLES, "kernels")
