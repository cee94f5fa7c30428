"""The analytical model (``moe_dispatch.costmodel``) and ``Config.auto``: pure Python.

The model against the only GPU measurements (2026-11-30, one H200, the intranode loopback:
``benchmarks/results/2026-11-30-h200-gpu-check``), the choices ``Config.auto`` makes from it, and
the mechanics its predictions rest on (copy rounds per row, the ring bound, the memory bound).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import pytest

from moe_dispatch import costmodel
from moe_dispatch.config import Config

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks/results/2026-11-30-h200-gpu-check"
SHAPES = {"deepseek-v3": (4096, 7168, 8, 256), "gpt-oss": (4096, 2880, 4, 128)}
ROW = re.compile(
    r"(deepseek-v3|gpt-oss)\s+(\d+)\s+(\d+x\d+)\s+(\d+)\s+(dispatch bf16|dispatch fp8|combine bf16|"
    r"dispatch\+notify bf16 \(fresh, host sync\))\s+([\d.]+)\s+\S+\s+([\d.]+)"
)


def measured_rows() -> list[dict]:
    """Every timed intranode row of 2026-11-30: run1's JSON and run2's ring sweep (its log)."""
    rows = [r for r in json.loads((RESULTS / "run1/bench_intranode.json").read_text())["rows"] if r["num_sms"]]
    for line in (RESULTS / "run2/rings.log").read_text().splitlines():
        if m := ROW.match(line):
            shape, world, rings, sms, op, median, gbps = m.groups()
            rows.append(
                {
                    "shape": shape,
                    "world_size": int(world),
                    "rings": rings,
                    "num_sms": int(sms),
                    "op": op,
                    "median_us": float(median),
                    "bytes": float(gbps) * 1e3 * float(median),
                }
            )
    return rows


def predicted_us(row: dict) -> float:
    tokens, hidden, topk, experts = SHAPES[row["shape"]]
    world, fp8 = row["world_size"], "fp8" in row["op"]
    op = "combine" if row["op"].startswith("combine") else "dispatch"
    row_bytes = hidden + 4 * (hidden // 128) if fp8 else 2 * hidden
    slots, chunk = (int(v) for v in row["rings"].split("x"))
    workload = costmodel.Workload(tokens, hidden, topk, experts, world, fp8=fp8, rows=row["bytes"] / row_bytes / world)
    config = Config(num_sms=row["num_sms"], num_slots=slots, chunk_tokens=chunk)
    fresh = "host" if "fresh" in row["op"] else None
    return costmodel.predict(op, workload, config, fresh=fresh).time_us


def test_model_predicts_the_measured_rows():
    """The fitted constants of ``costmodel.H200`` against the 80 rows they were fitted to: most
    within the goal's 0.7-1.3, none off by more than 1.6x. A change of the model that loses the
    fit fails."""
    rows = measured_rows()
    assert len(rows) == 80
    ratios = [predicted_us(r) / r["median_us"] for r in rows]
    good = sum(0.7 <= x <= 1.3 for x in ratios)
    assert good >= 0.85 * len(rows), f"{good}/{len(rows)} rows within 0.7-1.3"
    assert 1 / 1.6 < min(ratios) and max(ratios) < 1.6, (min(ratios), max(ratios))
    assert abs(sum(math.log(x) for x in ratios) / len(ratios)) < 0.05  # no bias either way


def test_copy_rounds_follow_the_copy_loops():
    # The current loop (4 loads per lane, then one at a time), its slowest lane: a 14 KB bf16 row
    # of DeepSeek-V3 is 7 rounds, its 7 KB fp8 row 5, gpt-oss' 5760-byte row 5 (2 full + 3 single).
    assert costmodel.copy_rounds(14336) == 7 and costmodel.copy_rounds(7168) == 5
    assert costmodel.copy_rounds(5760) == 5
    # Deeper policies: the tail predicated into the unrolled loop, rows in pairs.
    assert costmodel.copy_rounds(14336, loads=8) == 4 and costmodel.copy_rounds(7168, loads=16, rows=2) == 1
    assert costmodel.copy_rounds(14336, loads=8, rows=2) == 3.5
    assert costmodel.copy_rounds(14336, bulk=True) == pytest.approx(7 / 3 + 1)
    assert costmodel.copy_rounds(224, bulk=True) == 1  # short fields keep the vector copy
    assert costmodel.copy_rounds(0) == 0


def test_holders_of_uniform_routing():
    assert costmodel.expected_holders(256, 8, 8) == pytest.approx(5.29, abs=0.01)  # DeepSeek-V3, EP8
    assert costmodel.expected_holders(64, 1, 8) == 1.0 and costmodel.expected_holders(16, 16, 1) == 1.0
    workload = costmodel.Workload(100, 64, 2, 8, 4, rows=250.0)
    assert workload.holders == 2.5 and workload.received == 250.0 and workload.payload_bytes("dispatch") == 250 * 128


def test_model_mechanisms():
    ds = costmodel.Workload(4096, 7168, 8, 256, 4)
    base = Config(num_sms=4)
    at = lambda config, op="dispatch", **kw: costmodel.predict(op, ds, config, **kw)  # noqa: E731
    # Few SMs: the per-SM bound binds, and deeper copies shorten it; more SMs: memory binds.
    assert at(base).bound == "sm" and at(base, num_sms=4).gbps > 0
    assert at(base.with_variant("rows2-loads16")).time_us < 0.7 * at(base).time_us
    assert at(Config(num_sms=128)).bound == "memory"
    # Shallow rings starve the combine's workers; teams of warps use the few tokens landed.
    shallow = Config(num_sms=16, num_slots=2, chunk_tokens=1)
    assert (
        at(shallow, "combine").time_us > 1.5 * at(Config(num_sms=16, num_slots=64, chunk_tokens=16), "combine").time_us
    )
    assert at(shallow.with_variant("team4"), "combine").time_us < at(shallow, "combine").time_us
    # Ready flags lift the ring bound of a ring one chunk deep (the tail protocol's sender waits
    # for the whole chunk's room; flags let each warp go on as its own slot frees).
    ep4 = costmodel.Workload(4096, 7168, 8, 256, 4)
    one_chunk = Config(num_sms=16, num_slots=8, chunk_tokens=8)
    flagged = costmodel.predict("dispatch", ep4, one_chunk.with_variant("flags"))
    assert flagged.sm_us < 0.8 * costmodel.predict("dispatch", ep4, one_chunk).sm_us
    # Rings that fit in L2 with l2_discard halve the loopback's DRAM traffic.
    small = Config(num_sms=32, num_slots=2, chunk_tokens=1)
    discard = dataclasses.replace(small, l2_discard=True)
    assert at(discard).memory_us == pytest.approx(at(small).memory_us * 2 / 3)
    # A fresh dispatch: the host read, or the notify alone in budget mode.
    assert at(base, fresh="host").fixed_us > 10 * at(base, fresh="budget").fixed_us
    with pytest.raises(ValueError, match="op must be one of"):
        costmodel.predict("gather", ds, base)
    with pytest.raises(ValueError, match="fresh must be None, 'host' or 'budget'"):
        costmodel.predict("dispatch", ds, base, fresh="yes")
    # Internode: the fused pipeline's stage-1 copies, against the NIC on real nodes.
    two = costmodel.Workload(4096, 7168, 8, 256, 8, ranks_per_node=4)
    loop = costmodel.predict_internode("dispatch", two, Config(num_sms=48))
    real = costmodel.predict_internode("dispatch", two, Config(num_sms=48), loopback=False)
    assert loop.bound == "memory" and real.bound == "memory"  # HBM's copies in loopback, the NIC on real nodes
    assert costmodel.predict_internode("dispatch", two, Config(num_sms=6), loopback=False).bound == "sm"


def test_auto_chooses_from_the_model():
    # DeepSeek-V3 on an H200 node: more SMs than 16 pay, the cap (24) holds; a deep enough ring.
    auto = Config.auto(4096, 8)
    assert 16 <= auto.num_sms <= 24 and auto.chunk_tokens == 8 and auto.num_slots % 8 == 0
    # The chosen budget is within 10% of the best the cap allows, and the next smaller one is not.
    workload = costmodel.Workload(4096, 7168, 8, 256, 8)

    def total(num_sms):
        return sum(
            costmodel.predict(
                op, workload, dataclasses.replace(auto, num_slots=512), num_sms=num_sms, loopback=False
            ).time_us
            for op in costmodel.OPS
        )

    best = min(total(n) for n in range(2, 25, 2))
    assert total(auto.num_sms) <= 1.1 * best < total(auto.num_sms - 2)
    # A variant with more bytes in flight per SM reaches the same time with fewer SMs.
    assert Config.auto(4096, 8, loads_in_flight=16, rows_in_flight=2, register_cap=False).num_sms < auto.num_sms
    # Few tokens: chunks of 4; the cap is the caller's; several nodes: the fused budget of 3 per channel.
    assert Config.auto(32, 8).chunk_tokens == 4 and Config.auto(128, 8, max_sms=8).num_sms <= 8
    internode = Config.auto(4096, 16, num_nodes=2)
    assert internode.num_sms % 6 == 0 and internode.num_slots % internode.chunk_tokens == 0
    # Explicit fields win; the same arguments give the same Config (every rank derives the same).
    assert Config.auto(4096, 8, num_sms=24, num_slots=64).num_channels == 12
    assert Config.auto(4096, 8, num_slots=64).num_slots == 64 and Config.auto(4096, 8) == auto
    # A slower link needs fewer SMs to saturate it.
    slow = dataclasses.replace(costmodel.H200, nvlink_gbps=100.0)
    assert Config.auto(4096, 8, machine=slow).num_sms < auto.num_sms
    for bad, match in [
        (dict(num_tokens=-1), r"num_tokens must be an int >= 0, got -1"),
        (dict(num_nodes=3), r"num_nodes must divide world_size=8, got 3"),
        (dict(num_experts=12), r"num_experts must be a multiple of world_size=8"),
    ]:
        with pytest.raises(ValueError, match=match):
            Config.auto(**{"num_tokens": 4096, "world_size": 8, **bad})
