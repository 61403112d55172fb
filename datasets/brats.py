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

import functools
import hashlib
import re
from pathlib import Path

import numpy as np
from PIL import Image

from imggen.datasets import SKIP_HINT, ImageSplits, read_each, split_indices
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
         masks: str = "challenge", context_slices: int = 0, fills3d: bool = False, **_) -> ImageSplits:
    """masks (inpainting cases with a tumour `_seg`): "challenge" (default) = a tumour compartment
    placed in healthy tissue, the tumour voided (`_challenge_hole`); "tumour" = the tumour itself.
    fills3d (with inpainting): also `fills`, each slice with its hole filled in 3-D on its case's
    slices (imggen.datasets.brats_fills.case_fills: model.context_fill biharmonic3d).
    context_slices = s > 0 (a 2.5-D context): `neighbours` of every slice, its case's slices z-s..z+s
    (`slice_neighbours`; a neighbour dropped for too little brain is missing); their masks are the
    neighbours' own (one 3-D mask per case), so no `neighbour_masks` are stored."""
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
    done, skipped = read_each(list(enumerate(cases)), lambda ic: _load_case(ic[1], mods, height, width, channels,
                                                                          inpainting, masks, seed, fills3d),
                              kind="brats", what="bad case(s)", skip_bad=skip_bad, progress="BraTS cases" if progress else None)
    for (i, case), (imgs, masks, keep, fills) in done:
        p = parts[split_of[i]]
        p["img"].append(imgs)
        p["mask"].append(masks)
        p["fill"].append(fills)
        p["case"] += [case.name] * len(keep)
        p["slice"] += keep
    if len(skipped) == len(cases):
        raise DataError(f"BraTS folder {path}: none of the {len(cases)} cases could be loaded")
    out, masks, fills = {}, {}, {}
    for s, p in parts.items():
        out[s] = np.concatenate(p["img"]) if p["img"] else np.zeros((0, channels, height, width), np.uint8)
        if inpainting:
            masks[s] = np.concatenate(p["mask"]) if p["mask"] else np.zeros((0, 1, height, width), bool)
        if inpainting and fills3d:
            fills[s] = np.concatenate(p["fill"]) if p["fill"] else out[s].copy()
    meta = {"case": {s: p["case"] for s, p in parts.items()}, "slice": {s: p["slice"] for s, p in parts.items()}}
    nbrs = {s: slice_neighbours(p["case"], p["slice"], context_slices) for s, p in parts.items()} if context_slices else {}
    info = {"source": f"BraTS ({path})", "modality": mods, "orientation": ORIENTATION,
            "skipped": len(skipped), "skipped_items": skipped,
            "cases": {s: sorted(set(p["case"])) for s, p in parts.items()},
            "patients": {s: sorted({patient_id(c) for c in p["case"]}) for s, p in parts.items()}}
    return ImageSplits(**out, masks=masks, meta=meta, info=info, neighbours=nbrs, fills=fills)


# ---------------------------------------------------------------- shipped demo
DEMO_FILE = Path(__file__).parent / "data" / "brats_demo.npz"
DEMO_VARIANTS = ("orig", "flip", "gamma0.8", "gamma1.25")
DEMO_MASKS = ("challenge", "ellipses")
DEMO_SIDE_MM = 233.0  # the template's 197 x 233 mm axial plane, zero-padded to a square, is the stored 128 px
DEMO_GAP = 10         # slices (1 mm each) between every training slice and every val / test slice
DEMO_VAL_Z = (45, 60)    # template z (1 mm axial slices) of the val zone: slabs 4-5 (16 slices)
DEMO_TEST_Z = (61, 108)  # the test zone: slabs 6-11 (48 slices), where the native benchmark's holes lie
DEMO_BANK = 24        # 3-D challenge-like masks drawn on the template (at least one meets every slice)
MASK_SEED = 0         # the 3-D masks are the same for every run: evaluation masks stay fixed


@functools.lru_cache(maxsize=2)
def demo_mask_bank(size: int, seed: int = MASK_SEED) -> tuple[list[np.ndarray], np.ndarray]:
    """(3-D challenge-like masks (size, size, Z) in image orientation, z of each stored slice): lumpy
    blobs of 1-15% of the template brain's volume (imggen.datasets.brats_masks), at `size` px a side."""
    from imggen.datasets.brats_masks import challenge_masks

    d = np.load(DEMO_FILE)
    brain = np.stack([_resize(b > 0, size, size, nearest=True) for b in d["images"]], axis=-1)
    mm = DEMO_SIDE_MM / size
    bank = challenge_masks(brain, np.random.default_rng([seed, 28]), DEMO_BANK, spacing=(mm, mm, 1.0),
                           cover_slices=True)
    return bank, d["z"]


def _demo_sections(bank, b: int, i: int, s: int, height: int, width: int, flip: bool) -> np.ndarray:
    """bool (2s+1, height, width): bank mask b cut at stored slices i-s..i+s (empty outside the stack
    or without a mask, b = -1), flipped left-right with a flipped variant."""
    out = np.zeros((2 * s + 1, height, width), bool)
    for j, k in enumerate(range(i - s, i + s + 1)):
        if b >= 0 and 0 <= k < bank[b].shape[2]:
            m = _resize(bank[b][:, :, k], height, width, nearest=True)
            out[j] = m[:, ::-1] if flip else m
    return out


def honest_split(patient: np.ndarray, z: np.ndarray, seed: int = 0, gap: int = DEMO_GAP) -> dict[str, np.ndarray]:
    """Slice indices per split: the slabs (patients) of the val zone (DEMO_VAL_Z) and of the test
    zone (DEMO_TEST_Z), two fixed contiguous zones of the template thick enough for real 3-D holes;
    training gets every other slice at least `gap` slices (mm) from both, so no evaluation slice,
    and no native-resolution test hole (bench/brats_native.py), has a training slice within
    `gap` mm. `seed` is kept for the loaders' signature: the zones do not move with it."""
    held = {name: np.flatnonzero(np.isin(patient, np.unique(patient[(z >= lo) & (z <= hi)])))
            for name, (lo, hi) in (("val", DEMO_VAL_Z), ("test", DEMO_TEST_Z))}
    far = np.abs(z[:, None] - z[np.concatenate(list(held.values()))][None]).min(1) >= gap
    return {"train": np.flatnonzero(far), **held}


def demo_split_fills(bank, blob, splits, zs, height, width, channels) -> dict[str, np.ndarray]:
    """uint8 (N, C, H, W) per split: brats-demo's images with their holes' 3-D biharmonic fills
    (imggen.datasets.brats_fills), in load_demo's order (variant by variant). The fills are computed
    on the stored slices (128 px) and resized to the model's grid, as `sample.py --brats` resizes
    the fill it computes at native resolution (imggen.volume_fill): a fill solved on the coarse
    grid is a weaker channel than the one the model is given at inference (bench/RESULTS.md 14)."""
    from imggen.datasets.brats_fills import cached, demo_fills

    base = np.load(DEMO_FILE)["images"].astype(np.float32)
    size = max(base.shape[-1], height, width)
    stored = np.stack([_resize(b, size, size) for b in base])
    variants = {"orig": stored, "flip": stored[:, :, ::-1], "gamma0.8": 255.0 * (stored / 255.0) ** 0.8,
                "gamma1.25": 255.0 * (stored / 255.0) ** 1.25}

    def compute():
        out = {}
        for s, sel in splits.items():
            f = demo_fills(variants, lambda b, i, v: _demo_sections(bank, b, i, 0, size, size, v == "flip")[0],
                           blob, sel, zs, DEMO_SIDE_MM / size)
            low = [_resize(a, height, width) for v in DEMO_VARIANTS for a in f[v]]
            out[s] = np.clip(np.round(np.stack(low) if low else np.zeros((0, height, width))), 0,
                             255).astype(np.uint8)[:, None]
        return out

    key = {"demo": hashlib.sha256(DEMO_FILE.read_bytes()).hexdigest(), "size": (height, width), "solved_at": size,
           "zones": (DEMO_VAL_Z, DEMO_TEST_Z, DEMO_GAP), "masks": (MASK_SEED, DEMO_BANK)}
    return {s: np.repeat(f, channels, axis=1) if channels == 3 else f for s, f in cached(key, compute).items()}


def slice_neighbours(volume, z, s: int) -> np.ndarray:
    """int (N, 2s+1) for slices of one split, slice i being axial index z[i] of volume volume[i]: the
    index in the split of slice z[i] + d of the same volume, d = -s..s (column s is i itself), -1 where
    the split has no such slice (outside the volume, dropped, or in another split)."""
    at = {(v, int(k)): i for i, (v, k) in enumerate(zip(volume, z))}
    return np.array([[at.get((v, int(k) + d), -1) for d in range(-s, s + 1)] for v, k in zip(volume, z)],
                    np.int64).reshape(len(z), 2 * s + 1)


def load_demo(*, height: int, width: int, channels: int = 1, seed: int = 0, masks: str = "challenge",
              context_slices: int = 0, fills3d: bool = False, **_) -> ImageSplits:
    """Shipped real brain slices: axial slices of the MNI152 (ICBM 2009a sym) T1 template.

    Built by `datasets/make_brats_demo.py` (see data/README_brats_demo.md for source and licence).
    A "patient" is a slab of 8 neighbouring axial slices; each slice appears in 4 variants
    (original, left-right flip, gamma 0.8, gamma 1.25) that belong to its slab's patient. The val
    and test splits are two fixed zones (DEMO_VAL_Z: z 45-60, DEMO_TEST_Z: z 61-108, thick enough for
    3-D holes at native resolution, bench/brats_native.py); training keeps the 54 slices at least
    DEMO_GAP (10) slices away from both (`honest_split`): no evaluation slice has a training slice
    less than 10 mm away. `fills3d`: also `fills`, each image with its hole filled by the 3-D
    biharmonic fill of its split's slices, solved on the stored 128 px slices and resized
    (`demo_split_fills`; imggen.datasets.brats_fills; model.context_fill "biharmonic3d").
    Masks (always returned, the inpainting targets), `masks=`:
    * "challenge" (default; `--data brats-demo`): axial sections of fixed, seeded 3-D lumpy blobs
      of 1-15% of the template brain's volume (`demo_mask_bank`), one blob per (slice, variant)
      among those that meet the slice, as the challenge's tumour-shaped holes;
    * "ellipses" (`--data brats-demo:masks=ellipses`): the stored small holes, 1-2 seeded random
      ellipses per slice inside the brain.
    context_slices = s > 0 (a 2.5-D context): `neighbours`, the slices z-s..z+s of the same volume (a
    volume = one slab = patient, in one variant: neighbours never cross a slab, so never a split; a
    slice the gap dropped is missing), and `neighbour_masks`, the slice's own 3-D blob cut at those
    slices (challenge; the ellipses are 2-D: the slice's own on every neighbour).
    Same orientation as `load`.
    """
    if channels not in (1, 3):
        raise ConfigError(f"brats-demo: channels={channels}; use 1 (or 3 = replicated)")
    if masks not in DEMO_MASKS:
        raise ConfigError(f"brats-demo: masks={masks!r}; use {' or '.join(DEMO_MASKS)}")
    if not DEMO_FILE.exists():
        raise DataError(f"{DEMO_FILE} missing; rebuild it with `python datasets/make_brats_demo.py`")
    d = np.load(DEMO_FILE)
    base, patient, zs = d["images"], d["patient"], d["z"]
    imgs = np.stack([_resize(b.astype(np.float32), height, width) for b in base])
    variants = {"orig": imgs, "flip": imgs[:, :, ::-1],
                "gamma0.8": 255.0 * (imgs / 255.0) ** 0.8, "gamma1.25": 255.0 * (imgs / 255.0) ** 1.25}
    if masks == "ellipses":
        bmask = np.unpackbits(d["masks"], axis=-1, count=base.shape[-1]).astype(bool)
        msk = np.stack([_resize(m, height, width, nearest=True) for m in bmask])
        vmasks = {"orig": msk, "flip": msk[:, :, ::-1], "gamma0.8": msk, "gamma1.25": msk}
    else:
        bank, _ = demo_mask_bank(64 if max(height, width) <= 64 else base.shape[-1])
        rng = np.random.default_rng([MASK_SEED, 28, 1])
        vmasks = {v: np.zeros((len(base), height, width), bool) for v in DEMO_VARIANTS}
        blob = {v: np.full(len(base), -1) for v in DEMO_VARIANTS}  # the bank mask each (slice, variant) cuts
        for i in range(len(base)):
            meets = [b for b, m in enumerate(bank) if m[:, :, i].any()]
            for v in DEMO_VARIANTS:
                if meets:
                    blob[v][i] = b = meets[rng.integers(len(meets))]
                    m = _resize(bank[b][:, :, i], height, width, nearest=True)
                    vmasks[v][i] = m[:, ::-1] if v == "flip" else m  # flipped with its image: stays in the brain
    out, masks_out, meta = {}, {}, {"case": {}, "slice": {}, "variant": {}}
    nbrs, nbr_masks, fills = {}, {}, {}
    splits = honest_split(patient, zs, seed)
    for s, sel in splits.items():
        x = np.concatenate([variants[v][sel] for v in DEMO_VARIANTS]) if len(sel) else np.zeros((0, height, width))
        m = np.concatenate([vmasks[v][sel] for v in DEMO_VARIANTS]) if len(sel) else np.zeros((0, height, width), bool)
        x = np.clip(np.round(x), 0, 255).astype(np.uint8)[:, None]
        out[s] = np.repeat(x, channels, axis=1) if channels == 3 else x
        masks_out[s] = m[:, None].copy()
        meta["case"][s] = [f"mni152-slab{patient[i]:02d}" for v in DEMO_VARIANTS for i in sel]
        meta["slice"][s] = [int(zs[i]) for v in DEMO_VARIANTS for i in sel]
        meta["variant"][s] = [v for v in DEMO_VARIANTS for _ in sel]
        if context_slices:
            vol = [f"{c}/{v}" for c, v in zip(meta["case"][s], meta["variant"][s])]
            nbrs[s] = slice_neighbours(vol, meta["slice"][s], context_slices)
            nbr_masks[s] = np.stack([
                np.stack([vmasks[v][i]] * (2 * context_slices + 1)) if masks == "ellipses" else
                _demo_sections(bank, blob[v][i], i, context_slices, height, width, v == "flip")
                for v in DEMO_VARIANTS for i in sel]) if len(sel) else np.zeros((0, 2 * context_slices + 1,
                                                                                    height, width), bool)
    if fills3d and masks == "challenge":  # each hole's 3-D classic fill on its split's slices (cached)
        fills = demo_split_fills(bank, blob, splits, zs, height, width, channels)
    source = "challenge-like 3-D blob sections" if masks == "challenge" else "small random ellipses"
    return ImageSplits(**out, masks=masks_out, meta=meta, neighbours=nbrs, neighbour_masks=nbr_masks, fills=fills,
                       info={"source": f"MNI152 ICBM 2009a symmetric T1 template (nilearn), {source} as masks",
                             "licence": "see datasets/data/README_brats_demo.md", "orientation": ORIENTATION,
                             "skipped": 0, "masks": masks, "gap_slices": DEMO_GAP})
