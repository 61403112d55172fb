"""Inpainting masks like the BraTS 2023-2025 Local Synthesis challenge's: tumour-shaped 3-D compartments.

The challenge's holes (`-mask-healthy`) are compartments of real tumours (connected components of at
least 800 voxels), flipped, rotated and placed in healthy brain tissue: up to ~22% of the brain
volume, most under ~12%, bounding boxes ~46-103 voxels a side. Here:

* `tumour_compartments` + `place`: the same from a volume's own tumour mask (BraTS `_seg`, or
  `-mask-unhealthy`): each component >= 800 voxels is flipped along random axes, rotated by a random
  multiple of 90 degrees in the axial plane and moved to a random place where it lies entirely in
  brain tissue away from the tumour.
* `blob`: where there is no tumour (the brats-demo MNI152 template), a lumpy 3-D blob of a given
  fraction of the brain volume (1-15% by default): the brain voxels where a smooth random field
  plus a radial fall-off is highest, kept as the one connected component that holds its centre.
Training and evaluation cut the 3-D masks into axial slices (the slices they intersect).
"""
from __future__ import annotations

import numpy as np
from scipy import ndimage

MIN_COMPONENT = 800      # voxels, as the challenge's generator
BLOB_FRACTION = (0.01, 0.15)


def tumour_compartments(tumour: np.ndarray, min_voxels: int = MIN_COMPONENT) -> list[np.ndarray]:
    """Connected components (26-neighbourhood) of a bool 3-D mask with >= min_voxels voxels, each
    cropped to its bounding box."""
    labels, n = ndimage.label(tumour, structure=np.ones((3, 3, 3)))
    out = []
    for i, box in enumerate(ndimage.find_objects(labels), start=1):
        comp = labels[box] == i
        if comp.sum() >= min_voxels:
            out.append(comp)
    return out


def place(comp: np.ndarray, allowed: np.ndarray, rng: np.random.Generator, tries: int = 100) -> np.ndarray | None:
    """`comp` (bool, cropped) flipped along random axes and rotated by k * 90 degrees in the axial
    plane (axes 0, 1; the last axis is axial), at a random position where every voxel of it is
    `allowed`. Returns a bool volume of allowed's shape, or None when no try fitted."""
    for ax in range(3):
        if rng.random() < 0.5:
            comp = np.flip(comp, ax)
    comp = np.rot90(comp, int(rng.integers(4)), axes=(0, 1))
    if any(c > s for c, s in zip(comp.shape, allowed.shape)):
        return None
    for _ in range(tries):
        at = [int(rng.integers(0, s - c + 1)) for c, s in zip(comp.shape, allowed.shape)]
        box = tuple(slice(a, a + c) for a, c in zip(at, comp.shape))
        if allowed[box][comp].all():
            out = np.zeros(allowed.shape, bool)
            out[box] = comp
            return out
    return None


def blob(brain: np.ndarray, rng: np.random.Generator, fraction: float, centre=None,
         spacing=(1.0, 1.0, 1.0), tries: int = 20) -> np.ndarray:
    """A lumpy connected 3-D blob inside `brain` (bool (X, Y, Z)) holding about `fraction` of its
    voxels (within 80-100% of that), centred on a brain voxel (`centre`, default random).
    `spacing`: the voxel size per axis (mm), so the blob is round in space on an anisotropic grid."""
    total = int(brain.sum())
    target = max(1, int(round(fraction * total)))
    idx = np.argwhere(brain)
    sp = np.asarray(spacing, np.float64)
    radius = (3 * target * np.prod(sp) / (4 * np.pi)) ** (1 / 3)  # mm, of a ball of the target volume
    for _ in range(tries):
        c = np.asarray(centre if centre is not None else idx[rng.integers(len(idx))])
        half = np.ceil(1.7 * radius / sp).astype(int) + 1
        lo, hi = np.maximum(c - half, 0), np.minimum(c + half + 1, brain.shape)
        box = tuple(slice(a, b) for a, b in zip(lo, hi))
        grids = np.meshgrid(*[(np.arange(a, b) - ci) * s for a, b, ci, s in zip(lo, hi, c, sp)], indexing="ij")
        d2 = sum(g ** 2 for g in grids) / radius ** 2
        noise = ndimage.gaussian_filter(rng.normal(size=d2.shape), sigma=np.maximum(radius / 3 / sp, 1.0))
        noise /= noise.std() + 1e-12
        score = np.where(brain[box], -d2 + 0.35 * noise, -np.inf)
        n = min(target, int(np.isfinite(score).sum()))
        thr = np.partition(score.ravel(), -n)[-n]
        labels, _ = ndimage.label(score >= thr, structure=np.ones((3, 3, 3)))
        here = labels[tuple(c - lo)]
        if here == 0:
            continue
        comp = labels == here
        if comp.sum() >= 0.8 * target:
            out = np.zeros(brain.shape, bool)
            out[box] = comp
            return out
    raise ValueError(f"no blob of {fraction:.1%} of the brain fitted in {tries} tries")


def challenge_masks(brain: np.ndarray, rng: np.random.Generator, n: int, tumour: np.ndarray | None = None,
                    fraction=BLOB_FRACTION, spacing=(1.0, 1.0, 1.0), cover_slices: bool = False) -> list[np.ndarray]:
    """n challenge-like 3-D masks (bool, brain's shape) in `brain`: placed copies of the tumour's
    compartments when `tumour` has any (>= 800 voxels), else blobs of `fraction` (lo, hi) of the brain.
    cover_slices: draw at least enough blobs that every axial slice with brain meets one (the blob
    centres go to slices no mask meets yet)."""
    comps = tumour_compartments(tumour) if tumour is not None and tumour.any() else []
    allowed = brain & ~ndimage.binary_dilation(tumour, iterations=2) if comps else brain
    out: list[np.ndarray] = []
    covered = np.zeros(brain.shape[2], bool)
    has_brain = brain.any((0, 1))
    for _ in range(n * 20):
        uncovered = np.flatnonzero(has_brain & ~covered)
        if len(out) >= n and not (cover_slices and len(uncovered)):
            break
        if comps:
            m = place(comps[rng.integers(len(comps))], allowed, rng)
            if m is None:
                continue
        else:
            centre = None
            if cover_slices and len(uncovered):
                z = uncovered[rng.integers(len(uncovered))]
                xy = np.argwhere(brain[:, :, z])
                centre = (*xy[rng.integers(len(xy))], z)
            m = blob(brain, rng, rng.uniform(*fraction), centre=centre, spacing=spacing)
        out.append(m)
        covered |= m.any((0, 1))
    return out
