"""brats-demo: real brain slices that ship with imggen (axial slices of the MNI152 template), with
challenge-like 3-D holes, two held-out zones and their 3-D classic fills (`--data brats-demo`).

The slices are stored at 128 px (`data/brats_demo.npz`, built by `datasets/make_brats_demo.py`); every
model size resizes them as imggen.datasets.brats resizes BraTS slices, in the same orientation.
"""
from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import numpy as np

from imggen.datasets import ImageSplits
from imggen.datasets.brats import ORIENTATION, _resize, slice_neighbours
from imggen.errors import ConfigError, DataError

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


def _variants(images: np.ndarray) -> dict[str, np.ndarray]:
    """The 4 variants (DEMO_VARIANTS) of float images (N, H, W) in 0..255."""
    return {"orig": images, "flip": images[:, :, ::-1], "gamma0.8": 255.0 * (images / 255.0) ** 0.8,
            "gamma1.25": 255.0 * (images / 255.0) ** 1.25}


def demo_split_fills(base, bank, blob, splits, zs, height, width, channels) -> dict[str, np.ndarray]:
    """uint8 (N, C, H, W) per split: brats-demo's images with their holes' 3-D biharmonic fills
    (imggen.datasets.brats_fills), in load_demo's order (variant by variant). The fills are computed
    on the stored slices (128 px) and resized to the model's grid, as `sample.py --brats` resizes
    the fill it computes at native resolution (imggen.volume_fill): a fill solved on the coarse
    grid is a weaker channel than the one the model is given at inference (bench/RESULTS.md 14).
    `base`: the stored slices (N, 128, 128)."""
    from imggen.datasets.brats_fills import cached, demo_fills

    size = max(base.shape[-1], height, width)

    def compute():
        variants = _variants(np.stack([_resize(b.astype(np.float32), size, size) for b in base]))
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
    variants = _variants(np.stack([_resize(b.astype(np.float32), height, width) for b in base]))
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
        fills = demo_split_fills(base, bank, blob, splits, zs, height, width, channels)
    source = "challenge-like 3-D blob sections" if masks == "challenge" else "small random ellipses"
    return ImageSplits(**out, masks=masks_out, meta=meta, neighbours=nbrs, neighbour_masks=nbr_masks, fills=fills,
                       info={"source": f"MNI152 ICBM 2009a symmetric T1 template (nilearn), {source} as masks",
                             "licence": "see datasets/data/README_brats_demo.md", "orientation": ORIENTATION,
                             "skipped": 0, "masks": masks, "gap_slices": DEMO_GAP})
