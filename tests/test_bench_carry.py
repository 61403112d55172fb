"""bench/carry.py (issue 54 item 6): one run with a weight average gives the preset with and without it at
equal steps; both are scored on val by the training's own code and drawn from the same seed."""
from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

import carry  # noqa: E402

import imggen  # noqa: E402
from imggen.training.batches import load_data  # noqa: E402


def test_carry_scores_the_average_and_the_trained_weights_of_one_run(tmp_path):
    torch.set_num_threads(1)
    out, work = tmp_path / "results", tmp_path / "work"
    carry.main(["--preset", "demo", "--ema", "0.5", "--steps", "6", "--work", str(work), "--val", "12",
                "--num", "2", "--out", str(out)])
    data = json.loads((out / "carry_demo.json").read_text())
    trained, average = data["per_image"]["trained weights"], data["per_image"]["average (EMA 0.5)"]
    assert len(trained) == len(average) == 12 and data["steps"] == 6
    assert not np.allclose(trained, average)  # two different sets of weights, each scored
    # the average's figure is the run's own model's, recomputed here by the training's validation code
    cfg = carry.preset_with_average("demo", 0.5, 6)
    splits, _ = load_data(cfg, progress=False)
    model = imggen.load_model(str(work / "demo")).eval()
    np.testing.assert_allclose(carry.val_bits(model, cfg, splits, 12), average, rtol=1e-6)
    for key in ("trained", "average"):
        assert (out / f"carry_demo_{key}.png").stat().st_size > 0
    md = (out / "carry_demo.md").read_text()
    assert "paired vs trained weights" in md and "average (EMA 0.5)" in md
