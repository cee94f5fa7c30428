"""Smoke test of ``benchmarks/train_megatron_moe.py`` (the real-client training run) at toy size,
in its default configuration (Megatron-Bridge's EP-overlap guidance: PP 2 x VPP 2, EP 2,
``overlap_moe_expert_parallel_comm``, ``delay_wgrad_compute``, bf16): both dispatchers train
from the same seed in a CPU world, the curves are written and agree, the combined-1F1B schedule
ran on every rank and "custom"'s expert wgrads were deferred to ``MoELayer.backward_dw()``."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("megatron.core")
pytest.importorskip("matplotlib")
pytest.importorskip("rich")
pytestmark = pytest.mark.megatron

STEPS = 4


@pytest.mark.world
def test_training_script_runs_and_curves_agree(tmp_path):
    from benchmarks import train_megatron_moe as train

    rc = train.main(
        [
            *("--steps", str(STEPS), "--seq-len", "16", "--hidden", "32", "--heads", "2", "--ffn-hidden", "32"),
            *("--corpus-mb", "0.2", "--log-every", "2", "--warmup", "2", "--min-drop", "1.0"),
            *("--tolerance", "0.01", "--out", str(tmp_path)),
        ]
    )
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert rc == 0, summary
    config = summary["config"]
    assert (config["pp"], config["vpp"], config["ep"], summary["ranks"]) == (2, 2, 2, 4)
    assert config["ep_overlap"] and config["delay_wgrad"] and config["dtype"] == "bf16"
    # bf16: the dispatchers sum a token's expert outputs in different orders (a few ulps per layer)
    assert summary["max_abs_loss_diff"] < 1e-2 and summary["curves_agree"], summary["max_abs_loss_diff"]
    ratio = summary["step_ratio"]  # the two runs interleaved: seconds per step side by side
    assert set(summary["s_per_step"]) == {"alltoall", "custom"} and min(summary["s_per_step"].values()) > 0
    assert 0 < ratio["p10"] <= ratio["median"] <= ratio["p90"], ratio

    counts = summary["counts"]
    for dispatcher, c in counts.items():
        # every rank's interleaved schedule ran its forwards and backwards through the combined-1F1B step
        assert len(c["combined_1f1b_calls"]) == 4 and min(c["combined_1f1b_calls"]) > 0, (dispatcher, c)
        # the schedule's mlp node called MoELayer.backward_dw once per layer and micro-batch
        # (1 layer per chunk x 2 chunks x 4 micro-batches x STEPS per rank)
        assert c["backward_dw_calls"] == [2 * 4 * STEPS] * 4, (dispatcher, c)
    custom, alltoall = counts["custom"], counts["alltoall"]
    assert custom["backward_dw_changed_expert_grads"] == custom["backward_dw_calls"], custom  # deferred, all
    assert alltoall["backward_dw_changed_expert_grads"] == [0] * 4, alltoall  # non-TE experts: Megatron defers none
    assert summary["ep_overlap_ran"] and summary["custom_wgrads_deferred"]
    assert (tmp_path / "loss_curves.png").stat().st_size > 0
    assert len((tmp_path / "losses.csv").read_text().splitlines()) == STEPS + 1  # header + steps
