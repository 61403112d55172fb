"""bench/fashion_inpaint.py: the held-out holes' sizes and shapes, and the whole comparison end to end on
tiny idx files with a tiny context model and regressor (issue 46, item 4)."""
from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

import fashion_inpaint as fi  # noqa: E402

from imggen.cli import train_main  # noqa: E402


def _garments(n=12, seed=0):
    rng = np.random.default_rng(seed)
    imgs = np.zeros((n, 1, 28, 28), np.uint8)
    for i in range(n):  # a garment-like block of varying size on a black background
        h, w = rng.integers(10, 24, 2)
        y, x = rng.integers(0, 28 - h), rng.integers(0, 28 - w)
        imgs[i, 0, y:y + h, x:x + w] = rng.integers(40, 256, (h, w))
    return imgs


def test_holes_cover_a_quarter_to_nearly_half_of_the_garment_fixed_by_seed():
    imgs = _garments()
    m = fi.garment_holes(imgs, seed=0)
    garment = imgs[:, 0] > fi.GARMENT
    cover = (m & garment).sum((1, 2)) / garment.sum((1, 2))
    assert ((cover >= 0.25) & (cover <= 0.45)).all(), cover
    assert m.shape == (12, 28, 28) and not m.reshape(12, -1).all(1).any()
    np.testing.assert_array_equal(m, fi.garment_holes(imgs, seed=0))
    assert not np.array_equal(m, fi.garment_holes(imgs, seed=1))
    assert any(_not_boxes(m[i]) for i in range(0, 12, 2))  # even images: blobs, not boxes


def _not_boxes(mask):
    """True if the mask is not its own bounding box (a blob or an irregular union)."""
    ys, xs = np.nonzero(mask)
    return mask[ys.min():ys.max() + 1, xs.min():xs.max() + 1].size != len(ys)


def test_biharmonic_keeps_known_pixels_and_fills_smoothly():
    imgs = np.tile(np.linspace(0, 255, 28).astype(np.uint8), (2, 1, 28, 1))
    m = np.zeros((2, 28, 28), bool)
    m[:, 8:16, 8:16] = True
    f = fi.biharmonic(imgs, m)
    np.testing.assert_array_equal(f[:, :, ~m[0]], imgs[:, :, ~m[0]])
    assert np.abs(f.astype(int) - imgs).max() <= 1  # a linear ramp is biharmonic: filled exactly


def test_fashion_inpaint_end_to_end_on_tiny_models(tmp_path, monkeypatch):
    from test_idx import write_idx

    monkeypatch.setenv("IMGGEN_CACHE_DIR", str(tmp_path / "cache"))  # the realism classifier
    write_idx(tmp_path / "d", np.random.default_rng(3), n_train=24, n_test=12)
    spec = f"fashion-mnist:{tmp_path / 'd'}"
    run = tmp_path / "ctx"
    assert train_main(["--preset", "fashion-inpaint", "--data", spec, "--steps", "2", "--model.layers", "1",
                       "--model.dim", "16", "--model.heads", "2", "--model.context_width", "8",
                       "--train.eval_images", "2", "--train.grid_time_frac", "0", "--out", str(run), "--no-progress",
                       "--device", "cpu", "--threads", "1"]) == 0
    import train_regress
    assert train_regress.main(["--data", spec, "--size", "28", "--steps", "2", "--width", "8", "--hidden", "8",
                               "--precision", "fp32", "--out", str(tmp_path / "reg"), "--threads", "1"]) == 0
    out = tmp_path / "out"
    assert fi.main(["--context", str(run), "--regress", str(tmp_path / "reg" / "regress.pt"), "--data", spec,
                    "--num", "4", "--samples", "3", "--means", "2", "3", "--realism", "--out", str(out)]) == 0
    data = json.loads((out / "fashion_inpaint.json").read_text())
    reg = "regression (one pass), 2 steps, 0 min"
    assert list(data["methods"]) == ["biharmonic 2-D", reg, "context model, 1 sample", "context model, mean of 2",
                                     "context model, mean of 3"]
    for name, m in data["methods"].items():
        assert len(m["psnr"]) == 4 and all(np.isfinite(m["psnr"]))
        assert (m["vs_biharmonic_psnr"] is None) == (name == "biharmonic 2-D")
    assert all(0.25 <= c <= 0.45 for c in data["hole_cover"])
    from PIL import Image
    assert Image.open(out / "fashion_inpaint_grid.png").size == (6 * 30 * 4, 4 * 30 * 4)  # with the regression
    md = (out / "fashion_inpaint.md").read_text()
    assert "holes over 25-45% of the garment" in md and "context model, mean of 3 - regression (one pass)" in md
    for k in (2, 3):
        vs = data["methods"][f"context model, mean of {k}"][f"vs {reg}"]
        assert set(vs) == {"psnr", "ssim"} and vs["psnr"]["ci95"][0] <= vs["psnr"]["mean"] <= vs["psnr"]["ci95"][1]
    # realism: every fill and the truth, scored against test images 4-7 (not the 4 scored ones)
    assert data["realism_reference"] == [4, 8]
    assert list(data["realism"]) == [*data["methods"], "truth"]
    for name, r in data["realism"].items():
        assert r["n"] == 4 and 0 <= r["accuracy"] <= 1 and r["frechet_ci95"][0] <= r["frechet"] <= r["frechet_ci95"][1]
    assert data["realism"]["truth"]["sharpness"] == 1.0
    one = "context model, 1 sample"
    assert set(data["realism_paired"]) == {f"{one} - {k}" for k in data["realism"] if k != one}
    d = data["realism_paired"][f"{one} - truth"]
    assert np.isclose(d["mean"], data["realism"][one]["frechet"] - data["realism"]["truth"]["frechet"])
    assert "Realism of the 4 filled images" in md and "test images 4-7" in md

