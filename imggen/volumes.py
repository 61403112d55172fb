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
5. (imggen.volume_fill) the native fill is the 3-D fill plus the model's correction of it: each draw minus the 3-D fill
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
from pathlib import Path

import numpy as np

from imggen.errors import ConfigError, DataError, ImggenError, StorageError
from imggen.storage import writing
from imggen.volume_fill import fill_volume

OUT_SUFFIX = "-t1n-inference.nii.gz"
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
              cache=args.cache, graph="off" if args.no_graph else "auto")
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
