"""PSNR / SSIM against scikit-image and direct computations; BraTS 2023 inpainting protocol."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import ndimage
from skimage.metrics import peak_signal_noise_ratio, structural_similarity

from imggen import eval as ev
from imggen.datasets.brats import ras_slice_to_image
from imggen.errors import ShapeError
from imggen.eval.metrics import brats_inpainting_metrics, psnr, ssim, volume_from_slices


def pair(shape, seed=0):
    rng = np.random.default_rng(seed)
    t = rng.integers(0, 256, size=shape, dtype=np.uint8)
    p = np.clip(t.astype(int) + rng.integers(-40, 41, size=shape), 0, 255).astype(np.uint8)
    return p, t


def test_whole_image_equals_skimage():
    p, t = pair((24, 20))
    assert psnr(p, t) == pytest.approx(peak_signal_noise_ratio(t, p, data_range=255), rel=1e-12)
    assert ssim(p, t) == pytest.approx(structural_similarity(t, p, data_range=255), rel=1e-12)
    p, t = pair((3, 24, 20), 1)
    assert ssim(p, t) == pytest.approx(structural_similarity(t, p, data_range=255, channel_axis=0), rel=1e-12)
    assert psnr(p, t) == pytest.approx(peak_signal_noise_ratio(t, p, data_range=255), rel=1e-12)
    # batches: mean over images; torch tensors accepted
    p, t = pair((4, 3, 16, 16), 2)
    ref_s = np.mean([structural_similarity(t[i], p[i], data_range=255, channel_axis=0) for i in range(4)])
    ref_p = np.mean([peak_signal_noise_ratio(t[i], p[i], data_range=255) for i in range(4)])
    assert ssim(torch.from_numpy(p), torch.from_numpy(t)) == pytest.approx(ref_s, rel=1e-12)
    assert psnr(torch.from_numpy(p), t) == pytest.approx(ref_p, rel=1e-12)
    # (1, H, W) is the same as (H, W)
    assert ssim(p[0, :1], t[0, :1]) == pytest.approx(ssim(p[0, 0], t[0, 0]))
    # float images with their own data range; public wrappers in imggen.eval
    pf, tf = p / 255.0, t / 255.0
    assert ev.ssim(pf, tf, data_range=1.0) == pytest.approx(ref_s, rel=1e-9)
    assert ev.psnr(pf, tf, data_range=1.0) == pytest.approx(ref_p, rel=1e-9)


def direct_ssim_map(x, y, data_range, win=7):
    """Textbook SSIM map (uniform window, sample covariance, symmetric border) in plain numpy/scipy."""
    x, y = x.astype(np.float64), y.astype(np.float64)
    f = lambda a: ndimage.uniform_filter(a, size=win, mode="reflect")  # noqa: E731
    n = win * win
    mx, my = f(x), f(y)
    vx = (f(x * x) - mx * mx) * n / (n - 1)
    vy = (f(y * y) - my * my) * n / (n - 1)
    cxy = (f(x * y) - mx * my) * n / (n - 1)
    c1, c2 = (0.01 * data_range) ** 2, (0.03 * data_range) ** 2
    return (2 * mx * my + c1) * (2 * cxy + c2) / ((mx ** 2 + my ** 2 + c1) * (vx + vy + c2))


def test_masked_metrics_by_direct_computation():
    p, t = pair((2, 1, 20, 24), 3)
    mask = np.zeros(p.shape, bool)
    mask[0, 0, 5:12, 3:20] = True
    mask[1, 0, 0:4, 0:24] = True  # includes the image border
    per_img_psnr, per_img_ssim = [], []
    for i in range(2):
        d = (p[i, 0].astype(float) - t[i, 0])[mask[i, 0]]
        per_img_psnr.append(10 * math.log10(255 ** 2 / np.mean(d ** 2)))
        per_img_ssim.append(direct_ssim_map(t[i, 0], p[i, 0], 255)[mask[i, 0]].mean())
    assert psnr(p, t, mask=mask) == pytest.approx(np.mean(per_img_psnr), rel=1e-12)
    assert ssim(p, t, mask=mask) == pytest.approx(np.mean(per_img_ssim), rel=1e-9)
    # an (H, W) mask broadcasts over channels / batch
    p3, t3 = pair((3, 20, 24), 4)
    m2 = mask[0, 0]
    maps = [direct_ssim_map(t3[c], p3[c], 255) for c in range(3)]
    assert ssim(p3, t3, mask=m2) == pytest.approx(np.mean([mp[m2] for mp in maps]), rel=1e-9)
    d = (p3.astype(float) - t3)[:, m2]
    assert psnr(p3, t3, mask=m2) == pytest.approx(10 * math.log10(255 ** 2 / np.mean(d ** 2)), rel=1e-12)


def test_identical_images():
    _, t = pair((3, 16, 16), 5)
    assert psnr(t, t) == math.inf and ssim(t, t) == 1.0
    m = np.zeros((16, 16), bool)
    m[4:9, 4:9] = True
    assert psnr(t, t, mask=m) == math.inf and ssim(t, t, mask=m) == pytest.approx(1.0)


def test_bad_shapes():
    p, t = pair((16, 16))
    with pytest.raises(ShapeError):
        psnr(p, t[:15])
    with pytest.raises(ShapeError, match="empty"):
        ssim(p, t, mask=np.zeros((16, 16), bool))
    with pytest.raises(ShapeError, match="7x7"):
        ssim(p[:5, :5], t[:5, :5])


# ------------------------------------------------------------------ BraTS 2023 inpainting protocol
def tiny_case(seed=0, shape=(12, 40, 36)):
    rng = np.random.default_rng(seed)
    gt = np.zeros(shape)
    gt[2:10, 8:32, 8:28] = rng.uniform(100, 1000, size=(8, 24, 20))
    healthy = np.zeros(shape, bool)
    healthy[4:7, 14:24, 13:22] = True
    voided = gt * ~healthy
    pred = gt + rng.normal(0, 80, size=shape) * healthy
    return pred, gt, healthy, voided


def direct_brats(pred, gt, mask, voided):
    lo, hi = np.percentile(voided, [0.5, 99.5])
    lo = max(lo, 0)
    p = (np.clip(pred * mask, lo, hi) - lo) / (hi - lo)
    g = (np.clip(gt * mask, lo, hi) - lo) / (hi - lo)
    dr = max(p.max() - p.min(), g.max() - g.min())
    f = lambda a: ndimage.gaussian_filter(a, sigma=1.5, truncate=3.5, mode="reflect")  # noqa: E731
    maps = []
    for k in range(p.shape[0]):  # slices along the first array axis, as the challenge code
        x, y = g[k], p[k]
        mx, my = f(x), f(y)
        vx, vy, cxy = f(x * x) - mx ** 2, f(y * y) - my ** 2, f(x * y) - mx * my
        c1, c2 = (0.01 * dr) ** 2, (0.03 * dr) ** 2
        maps.append((2 * mx * my + c1) * (2 * cxy + c2) / ((mx ** 2 + my ** 2 + c1) * (vx + vy + c2)))
    mse = np.mean((p[mask] - g[mask]) ** 2)
    return {"ssim": np.stack(maps)[mask].mean(), "mse": mse, "psnr": 10 * np.log10(1 / mse),
            "psnr_max": 10 * np.log10(g[mask].max() ** 2 / mse)}


def test_brats_protocol_matches_direct_numpy():
    pred, gt, mask, voided = tiny_case()
    got = brats_inpainting_metrics(pred, gt, mask, voided)
    ref = direct_brats(pred, gt, mask, voided)
    for k in ("ssim", "mse", "psnr", "psnr_max"):
        assert got[k] == pytest.approx(ref[k], rel=1e-7), k
    assert 0 < got["ssim"] < 1 and got["mse"] > 0
    perfect = brats_inpainting_metrics(gt, gt, mask, voided)
    assert perfect["ssim"] == pytest.approx(1.0) and perfect["mse"] == 0 and perfect["psnr"] == math.inf
    axial = brats_inpainting_metrics(pred, gt, mask, voided, slice_axis=2)
    assert axial["mse"] == got["mse"] and axial["ssim"] != got["ssim"]


def test_brats_protocol_matches_torchmetrics_reference_code():
    """Same numbers as the challenge's torchmetrics-based computation (structure re-typed here)."""
    tm = pytest.importorskip("torchmetrics.functional.image")
    pred, gt, mask, voided = tiny_case(1)
    lo, hi = np.percentile(voided, [0.5, 99.5])
    lo = max(lo, 0)
    norm = lambda a: torch.from_numpy((np.clip(a * mask, lo, hi) - lo) / (hi - lo))[None]  # noqa: E731
    p, g = norm(pred), norm(gt)  # (1, X, Y, Z): torchmetrics sees X as channels -> 2-D SSIM per X-plane
    _, full = tm.structural_similarity_index_measure(p, g, return_full_image=True)
    ref_ssim = full[torch.from_numpy(mask)[None]].mean().item()
    got = brats_inpainting_metrics(pred, gt, mask, voided)
    assert got["ssim"] == pytest.approx(ref_ssim, abs=1e-6)


def test_volume_from_slices_roundtrip():
    vol = np.random.default_rng(0).uniform(size=(7, 9, 4)).astype(np.float32)
    slices = np.stack([ras_slice_to_image(vol[:, :, k]) for k in range(4)])[:, None]
    np.testing.assert_array_equal(volume_from_slices(slices), vol)
    big = volume_from_slices(np.repeat(np.repeat(slices, 2, axis=2), 2, axis=3), shape_xy=(7, 9))
    assert big.shape == vol.shape


# ------------------------------------------------------------------ nonsense input is a clear error
@pytest.mark.parametrize("metric", [psnr, ssim, ev.psnr, ev.ssim])
@pytest.mark.parametrize("data_range", [0, -1, -255.0, float("nan"), float("inf"), "255", None, True])
def test_data_range_must_be_a_positive_number(metric, data_range):
    p, t = pair((16, 16))
    with pytest.raises(ShapeError, match="data_range must be a .*number > 0.*255 for uint8"):
        metric(p, t, data_range=data_range)


@pytest.mark.parametrize("metric", [psnr, ssim])
def test_images_on_the_wrong_scale_are_errors(metric):
    p, t = pair((2, 1, 16, 16), 6)
    pf, tf = p / 255.0, t / 255.0
    # float images in [0, 1] with the uint8 default data_range=255
    with pytest.raises(ShapeError, match=r"float images in \[0, 1\] but data_range=255.*data_range=1.0"):
        metric(pf, tf)
    with pytest.raises(ShapeError, match=r"data_range=255"):
        metric(torch.from_numpy(pf).float(), torch.from_numpy(tf).float())
    # one image in [0, 1], the other 0..255 (either way round, numpy or torch)
    with pytest.raises(ShapeError, match=r"pred is a float image in \[0, 1\].*target \(uint8\).*different scales"):
        metric(pf, t)
    with pytest.raises(ShapeError, match=r"target is a float image in \[0, 1\].*pred \(uint8\).*different scales"):
        metric(p, tf, data_range=1.0)
    with pytest.raises(ShapeError, match="different scales"):
        metric(torch.from_numpy(pf).float(), torch.from_numpy(t))
    # uint8 images scored with a float data range
    with pytest.raises(ShapeError, match=r"span 0\.\.255, wider than data_range=1"):
        metric(p, t, data_range=1.0)
    # non-finite pixels
    bad = pf.copy()
    bad[0, 0, 3, 3] = np.nan
    with pytest.raises(ShapeError, match="pred holds 1 NaN/inf"):
        metric(bad, tf, data_range=1.0)
    # no images at all
    with pytest.raises(ShapeError, match="no pixels"):
        metric(p[:0], t[:0])


def test_legitimate_mixed_dtypes_and_ranges_still_work():
    p, t = pair((2, 3, 16, 16), 7)
    # uint8 against float on the same 0..255 scale (e.g. a mean of samples): same numbers as uint8
    assert psnr(p.astype(np.float32), t) == pytest.approx(psnr(p, t), rel=1e-12)
    assert ssim(p, t.astype(np.float64)) == pytest.approx(ssim(p, t), rel=1e-12)
    assert psnr(torch.from_numpy(p).float(), torch.from_numpy(t)) == pytest.approx(psnr(p, t), rel=1e-12)
    # float images in [0, 1] with data_range=1 (a numpy scalar too); a data_range wider than the values
    assert ev.psnr(p / 255.0, t / 255.0, data_range=np.float64(1.0)) == pytest.approx(psnr(p, t), rel=1e-9)
    dark_p, dark_t = p // 4, t // 4  # uint8 images that use only part of 0..255
    assert psnr(dark_p, dark_t) == pytest.approx(peak_signal_noise_ratio(dark_t[0], dark_p[0], data_range=255) / 2
                                                 + peak_signal_noise_ratio(dark_t[1], dark_p[1], data_range=255) / 2)
    # bool images (binary masks) are images too
    assert psnr(p > 127, t > 127, data_range=1) == pytest.approx(
        np.mean([peak_signal_noise_ratio((t[i] > 127).astype(float), (p[i] > 127).astype(float), data_range=1)
                  for i in range(2)]))
    # an all-black float prediction is on every scale (a blank fill scored against 0..255 floats)
    black = np.zeros_like(t, dtype=np.float64)
    assert psnr(black, t.astype(np.float64)) == pytest.approx(psnr(np.zeros_like(t), t), rel=1e-12)


def test_atom_bond_accuracy_of_no_images_is_an_error():
    """0 images used to give 0.0 for every metric (as if all failed); now a ShapeError, before OSRA runs."""
    from imggen.eval import atoms
    from imggen.errors import DataError
    with pytest.raises(ShapeError, match="got 0 images"):
        ev.atom_bond_accuracy(np.zeros((0, 1, 32, 32), np.uint8))
    with pytest.raises(ShapeError, match="got 0 images"):
        atoms.atom_bond_accuracy(np.zeros((0, 32, 32), np.uint8), smiles=[])
    with pytest.raises(ShapeError, match="0 images"):
        atoms._summarise([], None, False)
    with pytest.raises(DataError, match="no reference SMILES"):
        atoms.calibrate([], 32, 32)
