"""BraTS brain MRI -> 2-D axial slices (uint8), with optional inpainting masks.

Layouts (one folder per case = patient/time point, directly under `path`; a single wrapper
folder such as `MICCAI_BraTS2020_TrainingData/` is descended into):
* BraTS 2020/2021: `<case>_t1.nii.gz`, `_t1ce`, `_t2`, `_flair`, `_seg` (also `.nii`).
* BraTS 2023:      `<case>-t1n.nii.gz`, `-t1c`, `-t2w`, `-t2f`, `-seg`.
* BraTS 2023 Local Synthesis (inpainting): `<case>-t1n-voided`, `-mask`, `-mask-healthy`,
  `-mask-unhealthy` (+ `-t1n`, the ground truth, in the training set).
File names are matched case-insensitively by their suffix; `_` and `-` are interchangeable.
`modality` accepts both schemes: t1/t1n, t1ce/t1c, t2/t2w, flair/t2f; a comma list
("t1,t2,flair") stacks modalities as channels (then channels must equal their number); one
modality with channels=3 is replicated.

Pipeline per case: nibabel load -> `nib.as_closest_canonical` (RAS+: array axes point to patient
Right, Anterior, Superior; the voxel grid is not resampled - BraTS is 1 mm isotropic) ->
intensity per volume: clip to the 0.5 / 99.5 percentiles of the brain voxels (> 0), scale to
[0, 255] -> axial slices (last RAS axis, inferior to superior), slices where < 1% of the pixels
are brain are dropped -> resize to (height, width): images bilinear (PIL, antialiased), masks
nearest, on the same pixel grid -> uint8 (rounded).

Image orientation (radiological convention, as clinical viewers show axial MRI):
    row 0 = most anterior, last row = most posterior;
    column 0 = patient RIGHT, last column = patient LEFT.
i.e. image[r, c] = ras_slice[X-1-c, Y-1-r]; see `ras_slice_to_image` / `image_to_ras_slice`.

Inpainting (`inpainting=True`): masks[split] bool (N, 1, H, W), True = to inpaint. Source:
`-mask-healthy` (2023 inpainting training data, image = `-t1n` with the `-mask-unhealthy` tumour
region set to 0 exactly as in the challenge input `-t1n-voided`, so the ground truth is known
inside the mask and the tumour is never context), else `_seg`: with masks="challenge" (default)
the challenge's recipe - a tumour compartment (>= 800 voxels) flipped, rotated and placed in
healthy tissue, the tumour voided (imggen.datasets.brats_masks) - or with masks="tumour" the
tumour itself (`_seg` > 0), else `-mask` (with
the `-t1n-voided` image when no `-t1n` exists: the inference set). Slices
with an empty mask are kept (filter with masks[s].any((1, 2, 3)) if needed).

Splits are by patient (`split_indices` over all discovered patients, so a skipped bad case never
moves another case between splits): a patient is a case folder, except that BraTS 2023 time
points of one patient (`BraTS-GLI-00000-000`, `-001`) are grouped. No patient contributes slices
to two splits.
meta = {"case": {split: [...]}, "slice": {split: [axial index k in the RAS volume]}}.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
from PIL import Image

from imggen.datasets import SKIP_HINT, ImageSplits, split_indices
from imggen.datasets.brats_cases import read_cases
from imggen.errors import ConfigError, DataError

MODALITIES = {"t1": "t1", "t1n": "t1", "t1ce": "t1ce", "t1c": "t1ce", "t1gd": "t1ce",
              "t2": "t2", "t2w": "t2", "flair": "flair", "t2f": "flair"}
# file-name suffix (lower case, '_' -> '-') -> role; first match wins
SUFFIXES = [("t1n-voided", "voided"), ("t1-voided", "voided"), ("mask-healthy", "mask-healthy"),
            ("healthy-mask", "mask-healthy"), ("mask-unhealthy", "mask-unhealthy"),
            ("unhealthy-mask", "mask-unhealthy"), ("t1ce", "t1ce"), ("t1gd", "t1ce"), ("t1c", "t1ce"),
            ("t1n", "t1"), ("t2w", "t2"), ("t2f", "flair"), ("flair", "flair"), ("seg", "seg"),
            ("segm", "seg"), ("mask", "mask"), ("t1", "t1"), ("t2", "t2")]
MIN_BRAIN_FRACTION = 0.01
ORIENTATION = ("axial slices (last RAS axis, inferior->superior); row 0 = anterior, "
               "column 0 = patient right (radiological)")
HOW_TO_GET = ("BraTS data: register at https://www.synapse.org/brats (2021: syn25829067; 2023 inpainting: "
              "syn51522870) and pass the folder holding one sub-folder per case")


# ---------------------------------------------------------------- orientation
def ras_slice_to_image(sl: np.ndarray) -> np.ndarray:
    """RAS axial slice (X, Y) -> image (Y, X): anterior at the top, patient left on the right."""
    return np.ascontiguousarray(sl[::-1, ::-1].T)


def image_to_ras_slice(img: np.ndarray, shape_xy: tuple[int, int] | None = None) -> np.ndarray:
    """Inverse of `ras_slice_to_image`; optionally resize (bilinear) back to the (X, Y) voxel grid."""
    img = np.asarray(img, np.float32)
    if shape_xy is not None:
        img = _resize(img, shape_xy[1], shape_xy[0])
    return np.ascontiguousarray(img.T[::-1, ::-1])


def _resize(a: np.ndarray, h: int, w: int, nearest: bool = False) -> np.ndarray:
    if a.shape == (h, w):
        return a
    if nearest:
        im = Image.fromarray(a.astype(np.uint8) * 255).resize((w, h), Image.Resampling.NEAREST)
        return np.asarray(im) > 127
    im = Image.fromarray(a.astype(np.float32)).resize((w, h), Image.Resampling.BILINEAR)
    return np.asarray(im)


# ---------------------------------------------------------------- files
def _role(file: Path) -> str | None:
    name = file.name.lower()
    for ext in (".nii.gz", ".nii"):
        if name.endswith(ext):
            stem = name[: -len(ext)].replace("_", "-")
            for suffix, role in SUFFIXES:
                if stem.endswith("-" + suffix) or stem == suffix:
                    return role
            return "unknown"
    return None


def _case_files(case: Path) -> dict[str, Path]:
    files = {}
    for f in sorted(case.iterdir()):
        role = _role(f) if f.is_file() else None
        if role and role != "unknown":
            files.setdefault(role, f)
    return files


MAX_VOXELS = 2 ** 26  # 512 x 512 x 256: bounds the memory a NIfTI header can make the reader allocate


def open_nifti(file: Path):
    """nibabel's lazy image of `file`, its header's size checked before any voxel is read (a small
    file that declares a huge volume is one DataError, not gigabytes of memory)."""
    import nibabel as nib

    img = nib.load(str(file))
    shape = tuple(int(d) for d in img.shape)
    if np.prod(shape, dtype=np.float64) > MAX_VOXELS:
        raise DataError(f"{file}: its header declares {' x '.join(map(str, shape))} voxels, more than "
                        f"imggen reads ({MAX_VOXELS:,}; a BraTS volume has 8.9 million); the file is "
                        f"corrupt or not a brain MRI volume")
    return img


def read_volume(file: Path) -> np.ndarray:
    """float32 (X, Y, Z) in RAS+ orientation; DataError naming the file if it cannot be read."""
    import nibabel as nib

    try:
        img = nib.as_closest_canonical(open_nifti(file))
        data = np.asarray(img.dataobj, dtype=np.float32)
    except DataError:
        raise
    except Exception as e:
        raise DataError(f"{file}: not a readable NIfTI volume ({type(e).__name__}: {e}); re-download the "
                        f"case or remove it{SKIP_HINT}") from None
    if data.ndim == 4 and data.shape[-1] == 1:
        data = data[..., 0]
    if data.ndim != 3:
        raise DataError(f"{file}: expected a 3-D volume, got shape {data.shape}")
    return np.nan_to_num(data, nan=0.0, posinf=0.0, neginf=0.0)


def intensity_range(vol: np.ndarray, file="volume") -> tuple[float, float]:
    """(lo, hi) of `normalise_volume`: the 0.5/99.5 percentiles of the brain voxels (> 0); a
    (nearly) constant brain gives (0, its intensity), so the brain maps to 255 and background to 0.
    `lo + x / 255 * (hi - lo)` maps a normalised value x back to the volume's intensities."""
    brain = vol > 0
    if brain.sum() < 10:
        raise DataError(f"{file}: volume has no brain voxels (all values <= 0)")
    lo, hi = np.percentile(vol[brain], [0.5, 99.5])
    if hi <= lo:
        lo, hi = 0.0, max(hi, 1e-6)
    return lo, hi  # numpy float64: the scaling runs in float64 as before


def normalise_volume(vol: np.ndarray, file="volume") -> np.ndarray:
    """Robust per-volume scaling: clip to the 0.5/99.5 percentiles of brain voxels (> 0) -> [0, 255]."""
    lo, hi = intensity_range(vol, file)
    return np.clip((vol - lo) / (hi - lo), 0.0, 1.0) * 255.0


_TIMEPOINT = re.compile(r"^(brats-[a-z]+-\d+)-\d{3}$", re.IGNORECASE)


def patient_id(case: str) -> str:
    """BraTS 2023 folders are <patient>-<time point> (BraTS-GLI-00000-000 / -001): both time points
    are one patient. Older layouts have one folder per patient."""
    m = _TIMEPOINT.match(case)
    return m.group(1) if m else case


def _find_cases(root: Path) -> list[Path]:
    if not root.is_dir():
        raise DataError(f"BraTS folder {root} does not exist; {HOW_TO_GET}")
    subdirs = sorted(d for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    if not subdirs and any(_role(f) for f in root.iterdir() if f.is_file()):
        return [root]  # the path is a single case folder
    if len(subdirs) == 1 and not any(_role(f) for f in subdirs[0].iterdir() if f.is_file()):
        return _find_cases(subdirs[0])  # wrapper folder, e.g. MICCAI_BraTS2020_TrainingData/
    if not subdirs:
        raise DataError(f"BraTS folder {root} has no case sub-folders (one folder per case with "
                        f"<case>_t1.nii.gz ... or <case>-t1n.nii.gz ...); {HOW_TO_GET}")
    return subdirs


def _parse_modalities(modality, channels: int) -> list[str]:
    names = [m.strip().lower() for m in (modality.split(",") if isinstance(modality, str) else modality)]
    bad = [m for m in names if m not in MODALITIES]
    if bad or not names:
        raise ConfigError(f"brats: unknown modality {bad or modality!r}; use {', '.join(MODALITIES)}")
    mods = [MODALITIES[m] for m in names]
    if len(mods) > 1 and len(mods) != channels:
        raise ConfigError(f"brats: {len(mods)} modalities {mods} need channels={len(mods)}, got {channels}")
    if len(mods) == 1 and channels not in (1, 3):
        raise ConfigError(f"brats: channels={channels} with one modality; use 1 (or 3 = replicated)")
    return mods


def _challenge_hole(case: Path, vols: list[np.ndarray], tumour: np.ndarray, seed: int):
    """As the challenge builds `-mask-healthy` from a case with a tumour segmentation: the tumour is
    voided (not context), and the hole is one of its compartments (>= 800 voxels) flipped, rotated
    and placed in healthy brain tissue (a lumpy blob of 1-15% of the brain when none fits)."""
    import zlib

    from imggen.datasets.brats_masks import challenge_masks

    shapes = {v.shape for v in vols} | {tumour.shape}
    if len(shapes) != 1:
        raise DataError(f"{case}: volumes have different shapes {sorted(shapes)} after RAS reorientation")
    rng = np.random.default_rng([seed, zlib.crc32(case.name.encode()), 28])
    brain = np.any([v > 0 for v in vols], axis=0) & ~tumour
    if brain.sum() < 100:
        raise DataError(f"{case}: too little brain tissue outside the tumour to place an inpainting hole")
    holes = challenge_masks(brain, rng, 1, tumour=tumour) or challenge_masks(brain, rng, 1)
    return [np.where(tumour, 0.0, v) for v in vols], holes[0]


def _load_case(case: Path, mods: list[str], height: int, width: int, channels: int, inpainting: bool,
               masks: str = "challenge", seed: int = 0, fills3d: bool = False):
    files = _case_files(case)
    if not files:
        raise DataError(f"{case}: case folder has no BraTS NIfTI files (*_t1.nii.gz, *-t1n.nii.gz, ...); "
                        f"remove the folder{SKIP_HINT}")
    roles = list(mods)
    voided = False
    if mods == ["t1"] and "t1" not in files and "voided" in files:
        roles, voided = ["voided"], True  # 2023 inpainting inference set: only the voided T1
    missing = [r for r in roles if r not in files]
    if missing:
        raise DataError(f"{case}: no {'/'.join(missing)} file (looked for *_{missing[0]}.nii[.gz] and the "
                        f"2023 names); found {sorted(f.name for f in files.values())}. Choose another "
                        f"modality=...{SKIP_HINT}")
    vols = [read_volume(files[r]) for r in roles]
    mask = None
    if inpainting:
        order = ["mask"] if voided else ["mask-healthy", "seg", "mask"]
        src = next((r for r in order if r in files), None)
        if src is None:
            raise DataError(f"{case}: inpainting=True needs a mask file (-mask-healthy, _seg or -mask); "
                            f"found {sorted(f.name for f in files.values())}")
        mask = read_volume(files[src]) > 0
        if src == "seg" and masks == "challenge":
            vols, mask = _challenge_hole(case, vols, mask, seed)
        elif src == "mask-healthy" and "mask-unhealthy" in files:
            # as in the challenge input (-t1n-voided): the tumour region is void, not context
            unhealthy = read_volume(files["mask-unhealthy"]) > 0
            if unhealthy.shape == vols[0].shape:
                vols = [np.where(unhealthy, 0.0, v) for v in vols]
    shapes = {v.shape for v in vols} | ({mask.shape} if mask is not None else set())
    if len(shapes) != 1:
        raise DataError(f"{case}: volumes have different shapes {sorted(shapes)} after RAS reorientation")
    vols = [normalise_volume(v, files[r]) for v, r in zip(vols, roles)]
    brain = np.any([v > 0 for v in vols], axis=0)
    if mask is not None:
        brain |= mask
    keep = [k for k in range(brain.shape[2]) if brain[:, :, k].mean() >= MIN_BRAIN_FRACTION]
    imgs = np.zeros((len(keep), len(vols), height, width), np.uint8)
    masks = np.zeros((len(keep), 1, height, width), bool) if mask is not None else None
    for i, k in enumerate(keep):
        for c, v in enumerate(vols):
            s = _resize(ras_slice_to_image(v[:, :, k]), height, width)
            imgs[i, c] = np.clip(np.round(s), 0, 255).astype(np.uint8)
        if masks is not None:
            masks[i, 0] = _resize(ras_slice_to_image(mask[:, :, k]), height, width, nearest=True)
    if len(vols) == 1 and channels == 3:
        imgs = np.repeat(imgs, 3, axis=1)
    fills = None
    if fills3d and masks is not None:  # 1 mm voxels (BraTS): the in-plane pixel is the volume's side / the image's
        from imggen.datasets.brats_fills import case_fills

        fills = case_fills(imgs, masks[:, 0], keep, (1.0, brain.shape[1] / height, brain.shape[0] / width))
    return imgs, masks, keep, fills


def load(path, *, height: int, width: int, channels: int = 1, seed: int = 0, skip_bad: bool = False,
         modality="t1", inpainting: bool = False, limit: int | None = None, progress: bool = True,
         masks: str = "challenge", context_slices: int = 0, fills3d: bool = False, workers: int | None = None,
         cache_dir=None, cache: bool = True, **_) -> ImageSplits:
    """masks (inpainting cases with a tumour `_seg`): "challenge" (default) = a tumour compartment
    placed in healthy tissue, the tumour voided (`_challenge_hole`); "tumour" = the tumour itself.
    fills3d (with inpainting): also `fills`, each slice with its hole filled in 3-D on its case's
    slices (imggen.datasets.brats_fills.case_fills: model.context_fill biharmonic3d).
    context_slices = s > 0 (a 2.5-D context): `neighbours` of every slice, its case's slices z-s..z+s
    (`slice_neighbours`; a neighbour dropped for too little brain is missing); their masks are the
    neighbours' own (one 3-D mask per case), so no `neighbour_masks` are stored.
    workers, cache_dir, cache: the cases are read in `workers` processes (default: the cores) and
    kept in an on-disk cache (`cache_dir`, default ~/.cache/imggen; cache=False: none), so a second
    load reads only the cache (imggen.datasets.brats_cases)."""
    if masks not in ("challenge", "tumour"):
        raise ConfigError(f"brats: masks={masks!r}; use challenge or tumour")
    mods = _parse_modalities(modality, channels)
    cases = _find_cases(Path(path).expanduser())
    if limit is not None:
        cases = cases[: int(limit)]
    patients = sorted({patient_id(c.name) for c in cases})
    split_of_patient = {patients[int(i)]: s for s, idx in split_indices(len(patients), seed).items() for i in idx}
    split_of = [split_of_patient[patient_id(c.name)] for c in cases]
    parts = {s: {"img": [], "mask": [], "fill": [], "case": [], "slice": []} for s in ("train", "val", "test")}
    recipe = dict(mods=mods, height=height, width=width, channels=channels, inpainting=inpainting, masks=masks,
                  seed=seed, fills3d=fills3d)
    done, skipped = read_cases(cases, [_case_files(c) for c in cases], recipe, _load_case, workers=workers, cache_dir=cache_dir,
                               use_cache=cache, skip_bad=skip_bad, progress=progress)
    for i, (imgs, masks, keep, fills) in done:
        case = cases[i]
        p = parts[split_of[i]]
        p["img"].append(imgs)
        p["mask"].append(masks)
        p["fill"].append(fills)
        p["case"] += [case.name] * len(keep)
        p["slice"] += keep
    del done  # the parts hold the slices now
    if len(skipped) == len(cases):
        raise DataError(f"BraTS folder {path}: none of the {len(cases)} cases could be loaded")
    out, masks, fills = {}, {}, {}
    for s, p in parts.items():  # each list freed once joined: the peak holds the slices about once, not twice
        out[s] = np.concatenate(p.pop("img")) if p["img"] else np.zeros((0, channels, height, width), np.uint8)
        if inpainting:
            masks[s] = np.concatenate(p.pop("mask")) if p["mask"] else np.zeros((0, 1, height, width), bool)
        if inpainting and fills3d:
            fills[s] = np.concatenate(p.pop("fill")) if p["fill"] else out[s].copy()
    meta = {"case": {s: p["case"] for s, p in parts.items()}, "slice": {s: p["slice"] for s, p in parts.items()}}
    nbrs = {s: slice_neighbours(p["case"], p["slice"], context_slices) for s, p in parts.items()} if context_slices else {}
    info = {"source": f"BraTS ({path})", "modality": mods, "orientation": ORIENTATION,
            "skipped": len(skipped), "skipped_items": skipped,
            "cases": {s: sorted(set(p["case"])) for s, p in parts.items()},
            "patients": {s: sorted({patient_id(c) for c in p["case"]}) for s, p in parts.items()}}
    return ImageSplits(**out, masks=masks, meta=meta, info=info, neighbours=nbrs, fills=fills)


# ---------------------------------------------------------------- shipped demo
def slice_neighbours(volume, z, s: int) -> np.ndarray:
    """int (N, 2s+1) for slices of one split, slice i being axial index z[i] of volume volume[i]: the
    index in the split of slice z[i] + d of the same volume, d = -s..s (column s is i itself), -1 where
    the split has no such slice (outside the volume, dropped, or in another split)."""
    at = {(v, int(k)): i for i, (v, k) in enumerate(zip(volume, z))}
    return np.array([[at.get((v, int(k) + d), -1) for d in range(-s, s + 1)] for v, k in zip(volume, z)],
                    np.int64).reshape(len(z), 2 * s + 1)
