"""bench/inpaint.py helpers on tiny inputs: test volumes, 3-D biharmonic, paired intervals, sharpness,
uncertainty tracking, and the challenge-layout round trip through the organisers' scorer."""
from __future__ import annotations

import math
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import inpaint  # noqa: E402


def _ramp(z=5, h=16, w=16):
    zz, yy, xx = np.mgrid[:z, :h, :w]
    return (40 + 10 * zz + 4 * yy + 3 * xx).astype(np.uint8)[:, None]  # (Z, 1, H, W), linear, <= 255


def test_biharmonic_3d_fills_a_linear_volume_and_keeps_known_voxels():
    vol = _ramp()
    masks = np.zeros((5, 16, 16), bool)
    masks[1:4, 5:11, 4:12] = True
    out = inpaint.biharmonic_3d(np.where(masks[:, None], 0, vol).astype(np.uint8), masks)
    assert out.dtype == np.uint8 and out.shape == vol.shape
    assert np.abs(out.astype(int) - vol)[:, 0][masks].max() <= 3  # biharmonic nearly reproduces linear fields
    assert np.array_equal(out[:, 0][~masks], vol[:, 0][~masks])
    flat = inpaint.biharmonic(np.where(masks[:, None], 0, vol).astype(np.uint8), masks)
    assert np.abs(flat.astype(int) - vol)[:, 0][masks].max() <= 3
    assert np.array_equal(flat[0], vol[0])  # a slice without a hole is left as it is


def test_biharmonic_3d_uses_the_neighbouring_slices():
    # every slice is constant in-plane, the slices differ: a 2-D fill sees only its own slice's ring,
    # which is right; but a bump in the middle slice only (the hole's ring in that slice is the bump
    # level) makes 2-D exact and 3-D blend with the neighbours: the two really differ
    vol = np.zeros((3, 1, 16, 16), np.uint8) + np.array([50, 150, 50], np.uint8)[:, None, None, None]
    masks = np.zeros((3, 16, 16), bool)
    masks[:, 4:12, 4:12] = True
    voided = np.where(masks[:, None], 0, vol).astype(np.uint8)
    two, three = inpaint.biharmonic(voided, masks), inpaint.biharmonic_3d(voided, masks)
    assert np.abs(two.astype(int) - vol)[:, 0][masks].max() <= 1
    assert three[1, 0][masks[1]].mean() < 140


def test_paired_and_sharpness():
    r = inpaint.paired([2.0, 3.0, 5.0], [1.0, 2.0, 4.0])
    assert r["mean"] == pytest.approx(1.0) and r["ci95"] == pytest.approx([1.0, 1.0]) and r["better"] == 1.0
    r = inpaint.paired([1.0, 0.0, 1.0, 0.0], [0.0, 1.0, 0.0, 1.0])
    assert r["mean"] == 0.0 and r["ci95"][0] < 0 < r["ci95"][1] and r["better"] == 0.5
    rng = np.random.default_rng(0)
    truth = rng.integers(0, 256, (2, 1, 16, 16)).astype(np.uint8)
    masks = np.zeros((2, 16, 16), bool)
    masks[:, 4:12, 4:12] = True
    assert inpaint.sharpness(truth, truth, masks) == pytest.approx(1.0)
    flat = truth.copy()
    flat[:, 0][masks] = 128
    assert inpaint.sharpness(flat, truth, masks) < 0.5


def test_uncertainty_tracking_sees_a_spread_that_follows_the_error():
    rng = np.random.default_rng(0)
    truth = np.full((6, 1, 8, 8), 100, np.uint8)
    masks = np.ones((6, 8, 8), bool)
    scale = np.arange(1, 7, dtype=float) * 5  # slice i: draws spread and mean error both grow with i
    draws = 100 + scale[:, None, None, None, None] * (1 + rng.standard_normal((6, 16, 1, 8, 8)))
    r = inpaint.uncertainty_tracking(np.clip(draws, 0, 255).astype(np.uint8), truth, masks)
    assert r["slice_pearson"] > 0.9 and r["slice_spearman"] > 0.9 and r["pixel_pearson"] > 0.3
    assert r["mean_std"] > 0 and r["mean_abs_error"] > 0


def test_test_volumes_group_sort_and_cut_one_blob():
    images = np.arange(6, dtype=np.uint8)[:, None, None, None] + np.zeros((6, 1, 8, 8), np.uint8)
    meta = {"case": {"test": ["a"] * 6}, "slice": {"test": [12, 10, 11, 10, 11, 12]},
            "variant": {"test": ["orig", "orig", "orig", "flip", "flip", "flip"]}}
    data = SimpleNamespace(meta=meta, split=lambda s: images)
    bank_z = np.array([9, 10, 11, 12])
    partial = np.zeros((8, 8, 4), bool)
    partial[2:4, 2:4, 1] = True              # meets one of the three slices
    full = np.zeros((8, 8, 4), bool)
    full[1:3, 0:2, 1:4] = True               # meets all three, off the image's left-right centre
    vols = inpaint.test_volumes(data, [partial, full], bank_z)
    assert [v["name"] for v in vols] == ["a-orig", "a-flip"]
    assert vols[0]["z"] == [10, 11, 12] and vols[0]["images"][:, 0, 0, 0].tolist() == [1, 2, 0]
    assert all(v["blob"] == 1 for v in vols)
    assert np.array_equal(vols[0]["masks"], np.moveaxis(full[:, :, 1:], -1, 0))
    assert np.array_equal(vols[1]["masks"], vols[0]["masks"][:, :, ::-1])


def test_official_protocol_round_trip(tmp_path):
    from imggen.eval.brats_eval import evaluate

    vol = _ramp(4, 16, 16)
    masks = np.zeros((4, 16, 16), bool)
    masks[:, 5:11, 4:12] = True
    inpaint.write_case(tmp_path / "cases", "c1", vol, masks)
    inpaint.write_prediction(tmp_path / "perfect", "c1", vol)
    res = evaluate(tmp_path / "perfect", tmp_path / "cases", progress=False, slice_axis=2)
    assert res["n_cases"] == 1 and res["mean"]["psnr"] == math.inf and res["mean"]["ssim"] == pytest.approx(1.0)
    wrong = vol.copy()
    wrong[:, 0][masks] = 0
    inpaint.write_prediction(tmp_path / "wrong", "c1", wrong)
    res = evaluate(tmp_path / "wrong", tmp_path / "cases", progress=False, slice_axis=2)
    assert res["mean"]["psnr"] < 10 and res["mean"]["ssim"] < 0.5
    # the organisers' sagittal planes are 16 x 4 here: thinner than the SSIM window
    from imggen.errors import DataError

    with pytest.raises(DataError, match="1 failed"):
        evaluate(tmp_path / "perfect", tmp_path / "cases", progress=False)


def test_volume_context_of_a_25d_model():
    import torch

    from imggen.config import ModelConfig
    from imggen.inpainting.context import make_context
    from imggen.model import ImageTransformer

    m = ImageTransformer(ModelConfig(height=8, width=8, dim=16, layers=1, heads=2, attention="band", window=8,
                                     context="unet", context_width=4, context_slices=1, backend="cpu"))
    vol = _ramp(3, 8, 8)
    masks = np.zeros((3, 8, 8), bool)
    masks[:, 2:5, 3:6] = True
    ctx = inpaint.volume_context(m, vol, masks)
    assert ctx.shape == (3, 6, 8, 8)
    full = np.ones((8, 8), bool)
    for z in range(3):  # slices z-1, z, z+1; outside the 3-slice volume: zero image, all unknown
        imgs = np.stack([vol[k] if 0 <= k < 3 else np.zeros_like(vol[0]) for k in (z - 1, z, z + 1)])
        ms = np.stack([masks[k] if 0 <= k < 3 else full for k in (z - 1, z, z + 1)])
        want = make_context(torch.from_numpy(imgs)[None], torch.from_numpy(ms)[None], (1, 8, 8), slices=1)
        assert torch.equal(ctx[z: z + 1], want)
