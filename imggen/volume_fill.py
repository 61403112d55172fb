"""The native fill of a BraTS volume (imggen.volumes reads and writes the case folders; this module fills).

A RAS volume's hole is filled with its 3-D biharmonic fill at native resolution, solved on the volume
clipped to its brain's 0.5-99.5 percentiles (the intensities the 2-D model reads), plus the model's
correction of it: every axial slice the hole meets is resized to the model's grid and filled K times
(`corrections`); each draw's difference to that fill, resized back, is smoothed across slices (the
slices are drawn independently, and the organisers' SSIM planes are sagittal), weighed, tapered to zero
at the hole's edge and mapped back to the volume's intensities (`apply_corrections`). SMOOTH_MM and
WEIGHT were chosen on 8 val cases at 240x240x155 (bench/brats_correction.py); `fill_volume` does both
steps.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

from imggen.errors import ConfigError

METHODS = ("correct", "replace")  # fill_volume: the 3-D biharmonic fill + the model's correction, or the model's fill
SOURCES = ("model", "regressor")  # corrections: the model's draws, or (context_fill regress) its regressor's one fill
TAPER_MM = 3.0  # edge_taper: the correction reaches full weight this far inside the hole
SMOOTH_MM = 2.0  # fill_volume: the correction is smoothed across slices (Gaussian sigma, mm along z) ...
WEIGHT = 0.25  # ... and weighed (both chosen on 8 val cases at 240x240x155: bench/brats_correction.py)


def _down(a: np.ndarray, h: int, w: int) -> np.ndarray:
    from imggen.datasets.brats import _resize

    return _resize(a.astype(np.float32), h, w)


def slice_inputs(model, norm: np.ndarray, hole: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One RAS axial slice (normalised to [0, 255]) and its hole (X, Y) -> the model's inputs:
    uint8 (C, H, W) and bool (H, W) (True = unknown: more than half of the pixel is hole, so the
    hole grows no more than the resize needs; in a slice where no pixel is, every pixel the hole
    touches; a known pixel averages its known voxels only)."""
    from imggen.datasets.brats import ras_slice_to_image

    cfg = model.config
    img, hole = ras_slice_to_image(norm), ras_slice_to_image(hole)
    known = (~hole).astype(np.float32)
    weight = _down(known, cfg.height, cfg.width)
    frac = _down(hole, cfg.height, cfg.width)
    unknown = frac > 0.5 if (frac > 0.5).any() else frac > 1e-3  # a sliver of hole: the pixels it touches
    low = _down(img * known, cfg.height, cfg.width) / np.maximum(weight, 1e-6)
    low = np.where(unknown, 0, np.clip(np.round(low), 0, 255)).astype(np.uint8)
    return np.repeat(low[None], cfg.channels, 0), unknown


def edge_taper(mask: np.ndarray, spacing=(1.0, 1.0, 1.0), width: float = TAPER_MM) -> np.ndarray:
    """Weight of the model's correction per voxel: 0 outside the hole and on the hole voxels next to
    known tissue, rising linearly to 1 at `width` mm further in (so the fill joins the tissue as the
    classic fill does: without a seam)."""
    from scipy import ndimage

    if not mask.any():
        return np.zeros(mask.shape)
    box = tuple(slice(max(s.start - 1, 0), s.stop + 1) for s in ndimage.find_objects(mask.astype(np.uint8))[0])
    out = np.zeros(mask.shape)
    d = ndimage.distance_transform_edt(mask[box], sampling=spacing)  # mm to the nearest known voxel
    out[box] = np.clip((d - min(spacing)) / width, 0.0, 1.0) * mask[box]
    return out


@dataclass
class Corrections:
    """A volume's native 3-D fill and the model's draws of its correction (fill_volume's parts).
    lo, hi: the percentile scaling (values = lo + x / 255 * (hi - lo)); base: the 3-D biharmonic fill of the
    scaled volume (X, Y, Z; None for method "replace"); ks: the hole's axial slices; box: the hole's (X, Y)
    box; draws: (K, box X, box Y, ks[0]..ks[-1]) per-draw corrections (method "replace": the draws);
    spacing: the voxel size (mm); taper: edge_taper of the hole on draws' grid (None for "replace")."""
    lo: float
    hi: float
    base: np.ndarray | None
    ks: list
    box: tuple
    draws: np.ndarray
    spacing: tuple
    taper: np.ndarray | None


def corrections(model, values_ras: np.ndarray, mask_ras: np.ndarray, *, samples: int = 1, rank: int = 1,
                seed: int = 0, batch_size: int = 16, progress: str | None = None, file="volume",
                method: str = "correct", spacing=(1.0, 1.0, 1.0), channel: str = "auto", source: str = "model",
                **kw) -> Corrections:
    """The model's K draws for every hole slice of a RAS volume (X, Y, Z; a non-empty mask), resized to the
    slice grid: for method "correct", each draw minus the native 3-D fill (both on the model's grid, where
    the model filled); for "replace" the draws themselves. A 2.5-D context model (model.context_slices = s)
    sees each slice's voided neighbours z-s..z+s with their holes. `channel`, for a model with a
    classic-fill context channel: "volume" gives it the volume's native 3-D fill resized to its grid,
    "grid" the 3-D fill of the hole's slices resized to its grid (as BraTS folders' training fills
    are made; measured: no better, bench/brats_correction.py --channel grid), "slice" the 2-D fill of the
    slice; "auto" is "volume" for model.context_fill "biharmonic3d", else "slice" (a context_fill regress
    model's channel is its regressor's fill of the slice: "slice" only). `source` "regressor" (context_fill
    regress models): the model's regressor alone fills each slice, one deterministic draw (samples 1),
    so the regression is scored through the same resize, correction and taper as the model."""
    from imggen.classic import biharmonic
    from imggen.datasets.brats import image_to_ras_slice, intensity_range, ras_slice_to_image
    from imggen.inpainting.regress import predict
    from imggen.sampling import inpaint_images

    if method not in METHODS:
        raise ConfigError(f"fill method {method!r}; use {' or '.join(METHODS)}")
    if source not in SOURCES:
        raise ConfigError(f"fill source {source!r}; use {' or '.join(SOURCES)}")
    regress = model.config.context_fill == "regress"
    if source == "regressor" and not regress:
        raise ConfigError("source 'regressor' fills with a context_fill regress model's regressor; this model has "
                          f"context_fill {model.config.context_fill!r}")
    if channel == "auto":
        channel = "volume" if model.config.context_fill == "biharmonic3d" else "slice"
    if regress and channel != "slice":
        raise ConfigError(f"channel {channel!r}: a context_fill regress model's fill channel is its regressor's fill of "
                          "each slice; use channel 'slice' (or 'auto')")
    if source == "regressor" and samples:
        samples = 1  # the regression is deterministic: one draw
    lo, hi = intensity_range(np.where(mask_ras, 0.0, values_ras), file)
    norm = np.clip((values_ras - lo) / (hi - lo), 0.0, 1.0) * 255.0
    base = biharmonic(norm, mask_ras, spacing) if method == "correct" or channel == "volume" else None
    ks = [k for k in range(mask_ras.shape[2]) if mask_ras[:, :, k].any()]
    x, y = values_ras.shape[:2]
    box = tuple(slice(int(i.min()), int(i.max()) + 1) for i in np.nonzero(mask_ras.any(2)))
    out = np.zeros((samples, box[0].stop - box[0].start, box[1].stop - box[1].start, ks[-1] - ks[0] + 1),
                   np.float32)
    cfg = model.config
    bar = tqdm(total=len(ks) if samples else 0, desc=progress, unit="slice", disable=progress is None)
    inputs = {}  # slice k -> its model inputs (a 2.5-D context reads each one for several slices)

    def at(k):
        if k not in inputs:
            inputs[k] = slice_inputs(model, norm[:, :, k], mask_ras[:, :, k])
        return inputs[k]

    def low_base(k):  # the 3-D fill of slice k on the model's grid, image orientation
        return _down(ras_slice_to_image(base[:, :, k]), cfg.height, cfg.width)

    if channel == "grid" and samples:  # the hole's 3-D fill on the model's grid, as brats-demo's training fills
        zs = list(range(max(ks[0] - 2, 0), min(ks[-1] + 3, mask_ras.shape[2])))
        stack = np.stack([at(k)[0][0] for k in zs]).astype(np.float64)
        grid = biharmonic(stack, np.stack([at(k)[1] for k in zs]),
                          (spacing[2], spacing[1] * y / cfg.height, spacing[0] * x / cfg.width), rtol=1e-6)
        grid = {k: np.clip(np.round(g), 0, 255).astype(np.float32) for k, g in zip(zs, grid)}
    s = cfg.context_slices
    for i in range(0, len(ks) if samples else 0, batch_size):  # samples 0: the 3-D fill alone
        chunk = ks[i:i + batch_size]
        ins = [at(k) for k in chunk]
        chunk_seed = int(np.random.SeedSequence([seed, chunk[0]]).generate_state(1, np.uint32)[0])
        images, masks = torch.from_numpy(np.stack([a for a, _ in ins])), torch.from_numpy(np.stack([m for _, m in ins]))
        lows = {k: low_base(k) for k in chunk} if base is not None else {}
        fills = None
        if channel in ("volume", "grid"):
            ch = lows if channel == "volume" else grid
            fills = torch.from_numpy(np.stack([np.repeat(ch[k][None], cfg.channels, 0) for k in chunk]))
        context = None
        if s:  # 2.5-D: the voided slices k-s..k+s with their holes; one outside the volume is zero, all unknown
            z = mask_ras.shape[2]
            near = [[at(k + d) if 0 <= k + d < z else None for d in range(-s, s + 1)] for k in chunk]
            zero = (np.zeros_like(ins[0][0]), np.ones_like(ins[0][1]))
            context = model.make_context(
                torch.from_numpy(np.stack([np.stack([(n or zero)[0] for n in row]) for row in near])),
                torch.from_numpy(np.stack([np.stack([(n or zero)[1] for n in row]) for row in near])), fills)
        elif fills is not None and model.context is not None:
            context = model.make_context(images, masks, fills)
        if source == "regressor":  # (B, 1, C, H, W): the regression's fill as the one draw
            filled = torch.from_numpy(predict(model.regressor, images, masks, batch_size))[:, None]
        else:
            filled, _ = inpaint_images(model, images, masks, num=samples, rank=rank, seed=chunk_seed,
                                       batch_size=batch_size, context=context, **kw)
        filled = filled.float().mean(2).numpy()  # (B, K, H, W): channels of a replicated slice averaged
        for k, draws, (_, unknown) in zip(chunk, filled, ins):
            if method == "correct":  # the draws' difference to the 3-D fill, where the model filled
                draws = np.where(unknown, draws - lows[k], 0.0)
            up = np.stack([image_to_ras_slice(d, (x, y)) for d in draws])
            out[..., k - ks[0]] = up[:, box[0], box[1]]
        bar.update(len(chunk))
    bar.close()
    correct = method == "correct"
    taper = edge_taper(mask_ras, spacing)[box[0], box[1], ks[0]:ks[-1] + 1] if correct else None
    return Corrections(lo, hi, base if correct else None, ks, box, out, tuple(spacing), taper)


def apply_corrections(c: Corrections, mask_ras: np.ndarray, *, reduce: str = "mean", weight: float = WEIGHT,
                      smooth_mm: float = SMOOTH_MM) -> tuple[np.ndarray, np.ndarray]:
    """(fill, std) of fill_volume from its parts: base + edge_taper * weight * (the draws' corrections
    smoothed across slices), or (c.base None) the draws themselves; mapped back to the volume's
    intensities, reduced over the draws (mean / median) and their std, both zero outside the mask."""
    fill, std = np.zeros(mask_ras.shape), np.zeros(mask_ras.shape)
    bx, by = c.box
    hole = mask_ras[bx, by, c.ks[0]:c.ks[-1] + 1]
    if c.base is not None and weight:
        corr = weight * smooth_across_slices(c.draws, hole, smooth_mm / c.spacing[2]) * c.taper
    for k in c.ks:
        if c.base is None:
            up = np.zeros((len(c.draws),) + mask_ras.shape[:2])
            up[:, bx, by] = c.draws[..., k - c.ks[0]]
        else:
            up = np.repeat(c.base[None, :, :, k], len(c.draws) if weight else 1, 0)
            if weight:
                up[:, bx, by] += corr[..., k - c.ks[0]]
        up = c.lo + up / 255.0 * (c.hi - c.lo)
        h = mask_ras[:, :, k]
        fill[:, :, k][h] = (up.mean(0) if reduce == "mean" else np.median(up, 0))[h]
        std[:, :, k][h] = up.std(0)[h]
    return fill, std


def fill_volume(model, values_ras: np.ndarray, mask_ras: np.ndarray, *, samples: int = 1, reduce: str = "mean",
                method: str = "correct", weight: float = WEIGHT, smooth_mm: float = SMOOTH_MM,
                spacing=(1.0, 1.0, 1.0), **kw) -> tuple[np.ndarray, np.ndarray]:
    """Fill the mask voxels of a RAS volume (X, Y, Z) slice by slice. Returns (fill, std): float64
    volumes in the input's intensities, the reduced fill (mean / median of `samples` draws) and
    the per-voxel std of the draws, both zero outside the mask.

    method "correct" (the default): the volume's 3-D biharmonic fill at native resolution
    (imggen.classic, `spacing` in mm) plus the model's correction of it, upsampled: the draws minus
    that fill, both on the model's grid, smoothed across slices (Gaussian sigma `smooth_mm` along z),
    times `weight`, tapered to zero at the hole's edge (edge_taper), then reduced. Weight 0: the 3-D
    fill alone, in the percentile-clipped intensities the model reads (no draws). method "replace":
    the upsampled draws themselves. `kw`: `corrections`' (rank, seed, batch_size, progress, file,
    channel, source) and the sampler's."""
    if not mask_ras.any():
        return np.zeros(mask_ras.shape), np.zeros(mask_ras.shape)
    if method == "correct" and weight == 0:
        samples = 0  # the 3-D fill alone: no draws
    c = corrections(model, values_ras, mask_ras, samples=samples, method=method, spacing=spacing, **kw)
    return apply_corrections(c, mask_ras, reduce=reduce, weight=weight, smooth_mm=smooth_mm)


def smooth_across_slices(c: np.ndarray, hole: np.ndarray, sigma: float) -> np.ndarray:
    """c (..., X, Y, Z) smoothed along Z by a Gaussian of `sigma` voxels from the hole's voxels only (a
    normalised convolution: a voxel outside `hole` (X, Y, Z) neither gives nor receives; each hole voxel
    gets the weighted mean of the hole voxels in its column). sigma <= 0: c unchanged."""
    from scipy import ndimage

    if sigma <= 0:
        return c
    w = hole.astype(np.float64)
    num = ndimage.gaussian_filter1d(c * w, sigma, axis=-1, mode="constant")
    den = ndimage.gaussian_filter1d(w, sigma, axis=-1, mode="constant")
    return np.where(hole, num / np.maximum(den, 1e-12), 0.0)
