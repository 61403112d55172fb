"""PSNR / SSIM (whole or masked) and the BraTS 2023 inpainting evaluation protocol.

Conventions for `psnr` / `ssim`
-------------------------------
* Inputs: numpy arrays or torch tensors of one shape, (H, W), (C, H, W) or (B, C, H, W); any
  numeric dtype (computed in float64). `data_range` is the value span (255 for uint8 images).
* Whole image (mask=None): exactly `skimage.metrics.peak_signal_noise_ratio` and
  `skimage.metrics.structural_similarity` with skimage's defaults: 7x7 uniform window,
  sample covariance, K1=0.01, K2=0.03, mean over the valid (uncropped-border) region;
  colour images use `channel_axis=0` (SSIM = mean over channels). Images must be >= 7x7.
* Batches (B, C, H, W): the metric is computed per image and averaged over the batch.
* Masked (mask given, bool, same shape or broadcastable to it, True = pixels to score):
  PSNR uses the MSE over mask pixels only; SSIM is the mean of skimage's *full* SSIM map
  (`full=True`, same window) over mask pixels (so an all-True mask differs slightly from
  mask=None, which crops the border as skimage does). Images whose mask is empty are left out
  of the batch mean; an empty mask overall is an error.
* Identical images: PSNR = float('inf') (no warning), SSIM = 1.0.
* Checked up front (ShapeError naming the argument, the value and the fix): `data_range` must be a
  finite number > 0; images must be finite; pred and target must be on one scale (a float image in
  [0, 1] against one with values above 1 is an error, as are float images in [0, 1] scored with a
  data_range above 1, e.g. the uint8 default 255); no value may lie outside a span of `data_range`.
  Mixed dtypes on one scale (uint8 against float 0..255) are fine.
"""
from __future__ import annotations

import math

import numpy as np
from skimage.metrics import peak_signal_noise_ratio, structural_similarity

from imggen.errors import ShapeError

__all__ = ["psnr", "ssim", "brats_inpainting_metrics", "volume_from_slices"]


def _np(x, name: str, image: bool = False) -> np.ndarray:
    if hasattr(x, "detach"):  # torch tensor
        x = x.detach().cpu().numpy()
    a = np.asarray(x)
    if a.dtype == bool:
        return a.astype(np.float64) if image else a
    if not np.issubdtype(a.dtype, np.number) or np.issubdtype(a.dtype, np.complexfloating):
        raise ShapeError(f"{name}: expected a real numeric array, got dtype {a.dtype}")
    return a.astype(np.float64)


def _dtype(x) -> str:
    """The dtype of an array / tensor as a short name (for messages and the scale check)."""
    d = getattr(x, "dtype", None)
    if d is None:
        d = np.asarray(x).dtype
    return str(d).removeprefix("torch.")


def _is_float(x) -> bool:
    d = getattr(x, "dtype", None)
    if d is not None and hasattr(d, "is_floating_point"):  # torch dtype
        return bool(d.is_floating_point)
    return np.issubdtype(np.asarray(x).dtype if d is None else d, np.floating)


def _check_data_range(data_range) -> float:
    """data_range as a float > 0, else a ShapeError naming the value and the fix."""
    hint = "the value span of the images: 255 for uint8 images, 1.0 for float images in [0, 1]"
    if isinstance(data_range, (bool, np.bool_, str, bytes)):
        raise ShapeError(f"data_range must be a number > 0 ({hint}), got {data_range!r}")
    try:
        dr = float(data_range)
    except (TypeError, ValueError):
        raise ShapeError(f"data_range must be a number > 0 ({hint}), got {data_range!r}") from None
    if not math.isfinite(dr) or dr <= 0:
        raise ShapeError(f"data_range must be a finite number > 0 ({hint}), got {data_range!r}")
    return dr


def _check_scale(p: np.ndarray, t: np.ndarray, pred, target, data_range: float) -> None:
    """pred / target finite, on one scale, and within a span of data_range (see module docstring)."""
    for a, name in ((p, "pred"), (t, "target")):
        if not np.isfinite(a).all():
            raise ShapeError(f"{name} holds {int((~np.isfinite(a)).sum())} NaN/inf values; "
                             f"PSNR/SSIM need finite images")
    lo_p, hi_p, lo_t, hi_t = p.min(), p.max(), t.min(), t.max()
    # "a float image in [0, 1]": an all-zero (black) float image is on every scale
    unit = {"pred": _is_float(pred) and lo_p >= 0 and 0 < hi_p <= 1,
            "target": _is_float(target) and lo_t >= 0 and 0 < hi_t <= 1}
    if unit["pred"] != unit["target"]:
        u, o = ("pred", "target") if unit["pred"] else ("target", "pred")
        o_hi = hi_t if o == "target" else hi_p
        if o_hi > 1:
            raise ShapeError(
                f"{u} is a float image in [0, 1] ({_dtype(pred if u == 'pred' else target)}) but {o} "
                f"({_dtype(target if o == 'target' else pred)}) has values up to {o_hi:g}: they are on "
                f"different scales; divide {o} by 255 and pass data_range=1.0, or multiply {u} by 255")
    if unit["pred"] and unit["target"] and data_range > 1:
        raise ShapeError(f"pred and target are float images in [0, 1] but data_range={data_range:g} "
                         f"(the span of uint8 images); pass data_range=1.0, or scale the images to 0..255")
    lo, hi = min(lo_p, lo_t), max(hi_p, hi_t)
    if hi - lo > data_range * (1 + 1e-9):
        raise ShapeError(f"pred/target values span {lo:g}..{hi:g}, wider than data_range={data_range:g}; "
                         f"pass the images' value span as data_range (255 for uint8, 1.0 for floats in [0, 1])")


def _as_batch(pred, target, mask, data_range: float | None = None):
    """-> float64 (B, C, H, W) pred/target and bool (B, C, H, W) mask (or None); with data_range
    (checked by `_check_data_range`), checks the images' scale against it too."""
    p, t = _np(pred, "pred", image=True), _np(target, "target", image=True)
    if p.shape != t.shape:
        raise ShapeError(f"pred shape {p.shape} != target shape {t.shape}; pass arrays of one shape")
    if p.ndim not in (2, 3, 4):
        raise ShapeError(f"expected (H, W), (C, H, W) or (B, C, H, W), got shape {p.shape}")
    if p.size == 0:
        raise ShapeError(f"pred/target of shape {p.shape} hold no pixels; pass at least one image")
    if data_range is not None:
        _check_scale(p, t, pred, target, data_range)
    lead = (1,) * (4 - p.ndim)
    p, t = p.reshape(lead + p.shape), t.reshape(lead + t.shape)
    m = None
    if mask is not None:
        m = _np(mask, "mask")
        if m.dtype != bool:
            m = m != 0
        m = m.reshape((1,) * (4 - m.ndim) + m.shape) if m.ndim <= 4 else m
        try:
            m = np.broadcast_to(m, p.shape)
        except ValueError:
            raise ShapeError(f"mask shape {np.shape(mask)} does not broadcast to images {np.shape(pred)}") from None
        if not m.any():
            raise ShapeError("mask is empty: no pixels to score")
    return p, t, m


def psnr(pred, target, mask=None, data_range=255) -> float:
    """Peak signal-to-noise ratio in dB (see module docstring); inf for identical images."""
    data_range = _check_data_range(data_range)
    p, t, m = _as_batch(pred, target, mask, data_range)
    vals = []
    for i in range(p.shape[0]):
        if m is None:
            if np.array_equal(p[i], t[i]):
                vals.append(math.inf)
                continue
            vals.append(peak_signal_noise_ratio(t[i], p[i], data_range=data_range))
        elif m[i].any():
            mse = float(np.mean((p[i][m[i]] - t[i][m[i]]) ** 2))
            vals.append(math.inf if mse == 0 else 10.0 * math.log10(data_range ** 2 / mse))
    return float(np.mean(vals))


def _ssim_one(t: np.ndarray, p: np.ndarray, data_range, full: bool, **kw):
    """skimage SSIM of one (C, H, W) image; C == 1 is treated as a 2-D image."""
    if min(t.shape[-2:]) < kw.get("win_size", 7):
        raise ShapeError(f"SSIM needs images of at least 7x7 pixels, got {t.shape[-2:]}")
    if t.shape[0] == 1:
        r = structural_similarity(t[0], p[0], data_range=data_range, full=full, **kw)
        return (r[0], r[1][None]) if full else r
    return structural_similarity(t, p, data_range=data_range, channel_axis=0, full=full, **kw)


def ssim(pred, target, mask=None, data_range=255) -> float:
    """Structural similarity (skimage defaults, 7x7 uniform window); see module docstring."""
    data_range = _check_data_range(data_range)
    p, t, m = _as_batch(pred, target, mask, data_range)
    vals = []
    for i in range(p.shape[0]):
        if m is None:
            vals.append(1.0 if np.array_equal(p[i], t[i]) else _ssim_one(t[i], p[i], data_range, False))
        elif m[i].any():
            _, smap = _ssim_one(t[i], p[i], data_range, True)
            vals.append(float(smap[m[i]].mean()))
    return float(np.mean(vals))


# --------------------------------------------------------------------------------------------
# BraTS 2023 "Local Synthesis of Healthy Brain Tissue via Inpainting"
# --------------------------------------------------------------------------------------------

def _percentile_normalise(x: np.ndarray, ref: np.ndarray, p_min=0.5, p_max=99.5) -> np.ndarray:
    lo, hi = np.percentile(ref, [p_min, p_max])
    lo = max(lo, 0.0)  # "strictly positive" as in the challenge code
    if hi <= lo:
        raise ShapeError(f"voided image has no intensity spread (percentiles {lo}..{hi}); cannot normalise")
    return (np.clip(x, lo, hi) - lo) / (hi - lo)


def brats_inpainting_metrics(pred, gt, healthy_mask, voided, slice_axis: int = 0) -> dict:
    """SSIM / PSNR / MSE of an inpainted 3-D volume, BraTS 2023 inpainting protocol.

    Follows `generate_metrics` of the official package (github.com/BraTS-inpainting/inpainting,
    `inpainting/challenge_metrics_2023.py`), which computed the 2023 ranking:

    1. prediction and ground truth (`-t1n`) are multiplied by the healthy mask (`-mask-healthy`);
    2. both are clipped to the 0.5 / 99.5 percentiles of the *voided* input image
       (`-t1n-voided`, percentiles over the whole volume incl. background, lower bound >= 0)
       and scaled to [0, 1];
    3. SSIM: full 2-D SSIM map with an 11x11 Gaussian window, sigma 1.5, population covariance,
       K1=0.01, K2=0.03, data_range = max(peak-to-peak of the two normalised volumes) (what
       torchmetrics does when no range is given), averaged over the mask voxels. The official
       code feeds the (1, X, Y, Z) array to torchmetrics, i.e. 2-D SSIM on the planes
       *perpendicular to the first array axis* (sagittal planes for the BraTS x,y,z storage) -
       that is `slice_axis=0` here (the default). Use `slice_axis=2` for axial planes.
       We use skimage (`gaussian_weights=True, sigma=1.5, use_sample_covariance=False`); it pads
       borders by symmetric reflection where torchmetrics reflects without repeating the edge
       voxel - identical whenever the 5 voxels next to the volume border are background.
    4. MSE over mask voxels; PSNR over mask voxels with data_range 1 ("psnr", reported as PSNR
       on the leaderboard: the organisers renamed PSNR_01 to PSNR), and "psnr_max" with the
       data range taken from the ground truth inside the mask (torchmetrics' automatic range,
       the package's "psnr" key).

    Reference (challenge paper, arXiv:2305.08992, Pix2Pix3D baseline): SSIM 0.788, PSNR 19.26,
    MSE 0.0151.

    pred, gt, voided: 3-D arrays of one shape (same voxel grid); healthy_mask: bool 3-D.
    Returns {"ssim", "psnr", "psnr_max", "mse"}.
    """
    pred, gt, voided = (_np(a, n) for a, n in ((pred, "pred"), (gt, "gt"), (voided, "voided")))
    mask = _np(healthy_mask, "healthy_mask")
    mask = mask if mask.dtype == bool else mask != 0
    shapes = {a.shape for a in (pred, gt, voided, mask)}
    if len(shapes) != 1 or pred.ndim != 3:
        raise ShapeError(f"pred, gt, healthy_mask, voided must be 3-D volumes of one shape, got "
                         f"{pred.shape}, {gt.shape}, {mask.shape}, {voided.shape}")
    if not mask.any():
        raise ShapeError("healthy_mask is empty: no voxels to score")
    p = _percentile_normalise(pred * mask, voided)
    g = _percentile_normalise(gt * mask, voided)
    data_range = max(np.ptp(p), np.ptp(g)) or 1.0
    pm, gm = np.moveaxis(p, slice_axis, 0), np.moveaxis(g, slice_axis, 0)
    if min(gm.shape[1:]) < 11:
        raise ShapeError(f"SSIM planes {gm.shape[1:]} (slice_axis={slice_axis}) are smaller than the 11x11 window")
    smap = np.stack([
        structural_similarity(gm[k], pm[k], data_range=data_range, gaussian_weights=True, sigma=1.5,
                              use_sample_covariance=False, full=True)[1]
        for k in range(gm.shape[0])])
    ssim_val = float(np.moveaxis(smap, 0, slice_axis)[mask].mean())
    mse = float(np.mean((p[mask] - g[mask]) ** 2))
    peak = float(g[mask].max() - min(g[mask].min(), 0.0))
    return {
        "ssim": ssim_val,
        "psnr": math.inf if mse == 0 else 10.0 * math.log10(1.0 / mse),
        "psnr_max": math.inf if mse == 0 else 10.0 * math.log10(peak ** 2 / mse),
        "mse": mse,
    }


def volume_from_slices(slices, shape_xy: tuple[int, int] | None = None) -> np.ndarray:
    """Rebuild a RAS volume (X, Y, Z) from axial image slices as produced by the BraTS adapter.

    slices: (Z, H, W) or (Z, 1, H, W), ordered inferior -> superior, in the adapter's image
    orientation (see `imggen.datasets.brats`: anterior at the top, patient left on the image
    right). `shape_xy` (X, Y) resizes each slice back (bilinear) to the original voxel grid.
    Returns float32 (X, Y, Z) in the slices' intensity units.
    """
    from imggen.datasets.brats import image_to_ras_slice  # local: keeps import of eval cheap

    s = _np(slices, "slices")
    if s.ndim == 4 and s.shape[1] == 1:
        s = s[:, 0]
    if s.ndim != 3:
        raise ShapeError(f"slices must be (Z, H, W) or (Z, 1, H, W), got {np.shape(slices)}")
    return np.stack([image_to_ras_slice(sl, shape_xy) for sl in s], axis=-1).astype(np.float32)
