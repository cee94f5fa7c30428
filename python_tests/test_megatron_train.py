"""Smoke test of ``benchmarks/train_megatron_moe.py`` (the real-client training run) at toy size:
both dispatchers train from the same seed in a CPU world, the curves are written and agree."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("megatron.core")
pytest.importorskip("matplotlib")
pytest.importorskip("rich")
pytestmark = pytest.mark.megatron


@pytest.mark.world
def test_training_script_runs_and_curves_agree(tmp_path):
    from benchmarks import train_megatron_moe as train

    rc = train.main(
        [
            "--steps",
            "4",
            "--seq-len",
            "16",
            "--micro-batch-size",
            "2",
            "--hidden",
            "32",
            "--layers",
            "1",
            "--heads",
            "2",
            "--ffn-hidden",
            "32",
            "--corpus-mb",
            "0.2",
            "--log-every",
            "2",
            "--warmup",
            "2",
            "--tolerance",
            "0",
            "--min-drop",
            "1.0",
            "--out",
            str(tmp_path),
        ]
    )
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert rc == 0, summary
    assert summary["bitwise_equal_curves"] and summary["max_abs_loss_diff"] == 0.0  # CPU, no padding
    assert summary["max_abs_smoothed_diff"] == 0.0
    assert summary["config"]["ep"] == 4 and summary["ranks"] == 4
    ratio = summary["step_ratio"]  # the two runs interleaved: seconds per step side by side
    assert set(summary["s_per_step"]) == {"alltoall", "custom"} and min(summary["s_per_step"].values()) > 0
    assert 0 < ratio["p10"] <= ratio["median"] <= ratio["p90"], ratio
    assert (tmp_path / "loss_curves.png").stat().st_size > 0
    assert len((tmp_path / "losses.csv").read_text().splitlines()) == 5  # header + 4 steps
