"""BraTS volumes in and out: fill the hole of every case's `-t1n-voided` volume with a 2-D model.

`python sample.py --checkpoint RUN --brats CASES --out PRED [--samples K --reduce mean|median]
[--uncertainty]` writes `PRED/<case>-t1n-inference.nii.gz` for every case folder under CASES that
holds a `-t1n-voided` volume and a `-mask` (the challenge's inference layout; a folder with `-t1n`
instead of `-t1n-voided` works too: the mask's voxels are voided first).

Per case:
1. read the input in its stored voxel grid (raw on-disk values, dtype and scaling kept), and a RAS+
   view of it (`nibabel` orientation only: nothing is resampled; the voxel size is kept as the
   spacing of the 3-D fill), as the training adapter (imggen.datasets.brats) reads volumes;
2. intensities as in training: `normalise_volume` (brain percentiles -> [0, 255]), with the hole
   counted as void (it is 0 in the voided input);
3. the classic fill first: the volume's 3-D biharmonic fill at native resolution (imggen.classic),
   solved on those clipped intensities (so it cannot overshoot the brain's range);
4. every axial slice that intersects the mask: image orientation (`ras_slice_to_image`), resized
   to the model's H x W. Known pixels are a normalised convolution of the known voxels only (so the
   void never darkens the tissue next to the hole); a model pixel is unknown when more than half of
   it is hole. The slices are filled with `inpaint_images` (context model, or unconditional with
   --rank), K times; a model with a classic-fill context channel is given the 3-D fill on its grid
   (model.context_fill "biharmonic3d"; "biharmonic" models compute the slice's 2-D fill, as they
   were trained);
5. the native fill is the 3-D fill plus the model's correction of it: each draw minus the 3-D fill
   on the model's grid, resized back to the slice grid (bilinear); once every slice is drawn,
   smoothed across slices (`smooth_across_slices`, Gaussian sigma SMOOTH_MM along z, from hole
   voxels only: the slices are drawn independently, and the organisers' SSIM planes are sagittal,
   where that independence shows as stripes), times WEIGHT, weighted from 0 at the hole's edge to 1
   three voxels in (`edge_taper`: the fill joins the known tissue without a seam), mapped back to
   the volume's intensities (`lo + x / 255 * (hi - lo)`, the inverse of the percentile scaling) and
   reduced over the K samples (mean or median; `--uncertainty`: their per-voxel standard
   deviation). SMOOTH_MM and WEIGHT were chosen on val cases (bench/brats_correction.py).
   `fill_volume(method="replace")` writes the resized draws themselves (the fill before: it lost
   native detail next to the edge, 2-5 dB below biharmonic at 240x240x155);
6. written into the mask voxels only: every other voxel keeps the input's raw value bit for bit,
   and the output has the input's shape, affine, header and on-disk dtype.
A case that cannot be read (missing or corrupt file, mask of another shape) is one line naming the
file; the other cases go on and the command exits with status 1 at the end.
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from imggen.errors import ConfigError, DataError, ImggenError, StorageError
from imggen.storage import writing

OUT_SUFFIX = "-t1n-inference.nii.gz"
METHODS = ("correct", "replace")  # fill_volume: the 3-D biharmonic fill + the model's correction, or the model's fill
TAPER_MM = 3.0  # edge_taper: the correction reaches full weight this far inside the hole
SMOOTH_MM = 2.0  # fill_volume: the correction is smoothed across slices (Gaussian sigma, mm along z) ...
WEIGHT = 0.25  # ... and weighed (both chosen on 8 val cases at 240x240x155: bench/brats_correction.py)
STD_SUFFIX = "-t1n-std.nii.gz"


# ------------------------------------------------------------------------------------------ files
def find_cases(root) -> list[Path]:
    """Case folders under `root` (or `root` itself when it is one case folder)."""
    from imggen.datasets.brats import _find_cases

    return _find_cases(Path(root).expanduser())


def case_inputs(case: Path) -> tuple[Path, Path, bool]:
    """(image file, mask file, voided?) of a case folder; DataError naming the folder and the fix."""
    from imggen.datasets.brats import _case_files

    files = _case_files(case)
    src = files.get("voided") or files.get("t1")
    found = sorted(f.name for f in files.values()) or "no NIfTI files"
    if src is None:
        raise DataError(f"{case}: no <case>-t1n-voided.nii.gz (nor -t1n.nii.gz) to fill; found {found}")
    if "mask" not in files:
        raise DataError(f"{case}: no <case>-mask.nii.gz next to {src.name} (the hole to fill); found {found}")
    return src, files["mask"], "voided" in files


class Volume:
    """A NIfTI volume as stored: raw on-disk values, scaling, header; `values` = what they mean."""

    def __init__(self, file: Path):
        from imggen.datasets.brats import open_nifti

        self.file = file
        try:
            self.img = open_nifti(file)
            self.raw = np.asanyarray(self.img.dataobj.get_unscaled())
        except DataError:
            raise
        except Exception as e:
            raise DataError(f"{file}: not a readable NIfTI volume ({type(e).__name__}: {e}); re-download the "
                            f"case or remove it") from None
        if self.raw.ndim == 4 and self.raw.shape[-1] == 1:
            self.raw = self.raw[..., 0]
        if self.raw.ndim != 3:
            raise DataError(f"{file}: expected a 3-D volume, got shape {self.raw.shape}")
        slope, inter = self.img.dataobj.slope, self.img.dataobj.inter
        self.scaling = None if (slope, inter) == (1.0, 0.0) else (float(slope), float(inter))

    @property
    def values(self) -> np.ndarray:
        v = self.raw.astype(np.float64)
        if self.scaling:
            v = v * self.scaling[0] + self.scaling[1]
        return np.nan_to_num(v, nan=0.0, posinf=0.0, neginf=0.0)

    def to_raw(self, values: np.ndarray) -> np.ndarray:
        """Values -> raw values of the on-disk dtype (rounded and clipped for integer types)."""
        v = np.asarray(values, np.float64)
        if self.scaling:
            v = (v - self.scaling[1]) / self.scaling[0]
        dt = self.raw.dtype
        if np.issubdtype(dt, np.integer):
            info = np.iinfo(dt)
            v = np.clip(np.round(v), info.min, info.max)
        return v.astype(dt)

    def write(self, raw: np.ndarray, path: Path) -> None:
        """`raw` (this volume's dtype) with this volume's affine and header, scaling kept."""
        out = self.img.__class__(raw, self.img.affine, self.img.header.copy())
        if self.scaling:
            out.header.set_slope_inter(*self.scaling)
        _save(out, path)

    def write_float(self, values: np.ndarray, path: Path) -> None:
        """float32 `values` on this volume's grid (affine and header, dtype float32, no scaling)."""
        header = self.img.header.copy()
        header.set_data_dtype(np.float32)
        out = self.img.__class__(values.astype(np.float32), self.img.affine, header)
        out.header.set_slope_inter(1.0, 0.0)
        _save(out, path)

    def to_ras(self, a: np.ndarray) -> np.ndarray:
        from nibabel.orientations import apply_orientation, io_orientation

        return apply_orientation(a, io_orientation(self.img.affine))

    def spacing_ras(self) -> tuple[float, float, float]:
        """The voxel size (mm) along the RAS view's axes."""
        from nibabel.affines import voxel_sizes
        from nibabel.orientations import io_orientation

        out = [1.0, 1.0, 1.0]
        for size, (axis, _) in zip(voxel_sizes(self.img.affine), io_orientation(self.img.affine)):
            out[int(axis)] = float(size)
        return tuple(out)

    def from_ras(self, a: np.ndarray) -> np.ndarray:
        from nibabel.orientations import apply_orientation, axcodes2ornt, io_orientation, ornt_transform

        return apply_orientation(a, ornt_transform(axcodes2ornt("RAS"), io_orientation(self.img.affine)))


def _save(img, path: Path) -> None:
    import nibabel as nib

    tmp = path.with_name(".tmp-" + path.name)
    with writing(path, lambda: tmp.unlink(missing_ok=True)):  # storage failures: one StorageError, no temp file
        nib.save(img, str(tmp))
        os.replace(tmp, path)


def read_case(case: Path) -> tuple[Volume, np.ndarray]:
    """(the image to fill, the mask (bool, its stored grid)); with a -t1n image the mask is voided."""
    src, mask_file, voided = case_inputs(case)
    vol, mask_vol = Volume(src), Volume(mask_file)
    if mask_vol.raw.shape != vol.raw.shape:
        raise DataError(f"{case}: {mask_file.name} is {mask_vol.raw.shape} but {src.name} is {vol.raw.shape}; the "
                        f"mask must be on the image's voxel grid (re-export the case)")
    if not np.allclose(mask_vol.img.affine, vol.img.affine, atol=1e-2):
        raise DataError(f"{case}: {mask_file.name} and {src.name} have different affines (voxel-to-world maps); "
                        f"the mask must be on the image's voxel grid (re-export the case)")
    mask = mask_vol.values > 0
    if not voided:
        vol.raw = np.where(mask, vol.to_raw(np.zeros(1)), vol.raw)
    return vol, mask


# ------------------------------------------------------------------------------------- the filling
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
    box; draws: (K, box X, box Y, ks[0]..ks[-1]) per-draw corrections (method "replace": the draws)."""
    lo: float
    hi: float
    base: np.ndarray | None
    ks: list
    box: tuple
    draws: np.ndarray


def corrections(model, values_ras: np.ndarray, mask_ras: np.ndarray, *, samples: int = 1, rank: int = 1,
                seed: int = 0, batch_size: int = 16, progress: str | None = None, file="volume",
                method: str = "correct", spacing=(1.0, 1.0, 1.0), channel: str = "auto", **kw) -> Corrections:
    """The model's K draws for every hole slice of a RAS volume (X, Y, Z; a non-empty mask), resized to the
    slice grid: for method "correct", each draw minus the native 3-D fill (both on the model's grid, where
    the model filled); for "replace" the draws themselves. A 2.5-D context model (model.context_slices = s)
    sees each slice's voided neighbours z-s..z+s with their holes. `channel`, for a model with a
    classic-fill context channel: "volume" gives it the volume's native 3-D fill resized to its grid,
    "grid" the 3-D fill of the hole's slices resized to its grid (as its training fills are made;
    measured: no better, bench/brats_correction.py --channel grid), "slice" the 2-D fill of the
    slice; "auto" is "volume" for model.context_fill "biharmonic3d", else "slice"."""
    from imggen.classic import biharmonic
    from imggen.datasets.brats import image_to_ras_slice, intensity_range, ras_slice_to_image
    from imggen.sampling import inpaint_images

    if method not in METHODS:
        raise ConfigError(f"fill method {method!r}; use {' or '.join(METHODS)}")
    if channel == "auto":
        channel = "volume" if model.config.context_fill == "biharmonic3d" else "slice"
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
    return Corrections(lo, hi, base if method == "correct" else None, ks, box, out)


def apply_corrections(c: Corrections, mask_ras: np.ndarray, *, reduce: str = "mean", weight: float = WEIGHT,
                      smooth_mm: float = SMOOTH_MM, spacing=(1.0, 1.0, 1.0)) -> tuple[np.ndarray, np.ndarray]:
    """(fill, std) of fill_volume from its parts: base + edge_taper * weight * (the draws' corrections
    smoothed across slices), or (c.base None) the draws themselves; mapped back to the volume's
    intensities, reduced over the draws (mean / median) and their std, both zero outside the mask."""
    fill, std = np.zeros(mask_ras.shape), np.zeros(mask_ras.shape)
    bx, by = c.box
    hole = mask_ras[bx, by, c.ks[0]:c.ks[-1] + 1]
    if c.base is not None:
        taper = edge_taper(mask_ras, spacing)[bx, by, c.ks[0]:c.ks[-1] + 1]
        corr = weight * smooth_across_slices(c.draws, hole, smooth_mm / spacing[2]) * taper
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
    channel) and the sampler's."""
    if not mask_ras.any():
        return np.zeros(mask_ras.shape), np.zeros(mask_ras.shape)
    if method == "correct" and weight == 0:
        samples = 0  # the 3-D fill alone: no draws
    c = corrections(model, values_ras, mask_ras, samples=samples, method=method, spacing=spacing, **kw)
    return apply_corrections(c, mask_ras, reduce=reduce, weight=weight, smooth_mm=smooth_mm, spacing=spacing)


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


def inpaint_case(model, case: Path, out: Path, uncertainty: bool = False, progress: bool = True, **kw) -> Path:
    """Fill one case folder; writes out/<case>-t1n-inference.nii.gz (and -t1n-std.nii.gz)."""
    vol, mask = read_case(case)
    raw = vol.raw.copy()
    std = np.zeros(mask.shape)
    if mask.any():
        fill, std_ras = fill_volume(model, vol.to_ras(vol.values), vol.to_ras(mask), file=vol.file,
                                    spacing=vol.spacing_ras(),
                                    progress=case.name if progress else None, **kw)
        raw[mask] = vol.to_raw(vol.from_ras(fill)[mask])
        std = vol.from_ras(std_ras)
    else:
        print(f"note: {case}: the mask is empty; the input is written back unchanged", file=sys.stderr)
    path = out / f"{case.name}{OUT_SUFFIX}"
    vol.write(raw, path)
    if uncertainty:
        vol.write_float(std, out / f"{case.name}{STD_SUFFIX}")
    return path


# ------------------------------------------------------------------------------------ command line
BRATS_HELP = ("fill the hole of every BraTS case folder under DIR (<case>-t1n-voided + <case>-mask; -t1n works "
              "too) and write --out FOLDER/<case>-t1n-inference.nii.gz on the input's grid, affine and header; "
              "a case that cannot be read is one line and the others go on (exit status 1 at the end if any "
              "case failed)")
UNCERTAINTY_HELP = "with --brats: also write <case>-t1n-std.nii.gz, the per-voxel std of the --samples fills"


def check_brats_args(args) -> None:
    if not args.brats:
        if args.uncertainty:
            raise ConfigError("--uncertainty only applies with --brats DIR")
        return
    for flag in ("inpaint", "prefix", "mask", "triplet", "num", "prefix_rows"):
        if getattr(args, flag) is not None:
            raise ConfigError(f"--{flag.replace('_', '-')} does not apply with --brats (it fills every case folder)")
    if not args.out:
        raise ConfigError("--brats needs --out FOLDER for the <case>-t1n-inference.nii.gz volumes")
    if os.path.isfile(args.out):
        raise ConfigError(f"--out {args.out} is a file; with --brats give a folder for the output volumes")
    if args.rank < 1 or args.batch_size < 1:
        raise ConfigError("--batch-size and --rank must be >= 1")
    if args.top_k is not None and args.top_k < 1:
        raise ConfigError(f"--top-k must be >= 1, got {args.top_k}")


def brats_main(args: argparse.Namespace) -> int:
    """sample.py --brats (its flags parsed and --samples / --reduce checked by imggen.cli): 0 when
    every case was written, 1 when some failed, 2 on bad input."""
    from imggen.checkpoint import load_model

    try:
        check_brats_args(args)
        cases = find_cases(args.brats)
        model = load_model(args.checkpoint, device=args.device, backend=args.backend)
    except ImggenError as e:
        print(f"sample.py: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    out = Path(args.out)
    try:
        with writing(out):
            out.mkdir(parents=True, exist_ok=True)
    except StorageError as e:
        print(f"sample.py: error: {e}", file=sys.stderr)
        return 1
    kw = dict(samples=args.samples, reduce=args.reduce or "mean", rank=args.rank, batch_size=args.batch_size,
              seed=0 if args.seed is None else args.seed, temperature=args.temperature, top_k=args.top_k,
              cache=args.cache)
    failed = 0
    for i, case in enumerate(cases):
        try:
            path = inpaint_case(model, case, out, uncertainty=args.uncertainty, progress=not args.no_progress, **kw)
            print(f"wrote {path}", flush=True)
        except StorageError as e:  # the next case would fail alike: stop here
            print(f"sample.py: error: {e}; stopped with {i - failed} of {len(cases)} case(s) written",
                  file=sys.stderr, flush=True)
            return 1
        except ImggenError as e:
            failed += 1
            print(f"sample.py: error: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
    print(f"{len(cases) - failed} of {len(cases)} case(s) written to {out}" + (f"; {failed} failed" if failed else ""))
    return 1 if failed else 0
