"""Classic fills in 3-D: each hole's biharmonic fill computed on the slices around it (brats-demo's
split blocks, `demo_fills`; a BraTS case's slices, `case_fills`).

A context model with `model.context_fill = "biharmonic3d"` sees, as its classic-fill channel, what
`sample.py --brats` gives it on a real volume: the 3-D biharmonic fill of the hole (imggen.classic),
not the 2-D fill of the slice alone. For the shipped template slices this is `demo_fills`: per
variant and per 3-D blob of the mask bank, the blob's sections on one contiguous block of a split's
slices are filled at once (spacing: the pixel size in-plane, 1 mm between slices), so a training
slice's fill reads training slices only, and a test slice's the test zone only. brats-demo solves
them on its stored 128 px slices and resizes them to the model's grid, as sample.py --brats resizes
its native fill (imggen.datasets.brats_demo.demo_split_fills). That takes about 1.5 minutes on 2 cores,
so `cached` keeps them under the cache folder (imggen.storage: cache_root, cached_npz), keyed by
everything they depend on; a damaged file is computed again with one note. A BraTS case's
(`case_fills`) are still solved on the model's grid: solving each case at 240 x 240 costs seconds
per case (bench/RESULTS.md 14), not yet measured against the coarse fills on real cases.
"""
from __future__ import annotations

import hashlib
import json

import numpy as np

VERSION = 3  # of the fills' recipe: part of the cache key (2: imggen.classic as skimage at the array's edges;
#             3: brats-demo's solved on the stored 128 px slices, then resized)


def blocks(z: np.ndarray) -> list[np.ndarray]:
    """Indices of `z` grouped into runs of consecutive slices (each run in z order)."""
    order = np.argsort(z, kind="stable")
    return [b for b in np.split(order, np.flatnonzero(np.diff(z[order]) != 1) + 1) if len(b)]


def demo_fills(variants: dict, sections, blob: dict, sel: np.ndarray, z: np.ndarray, mm: float) -> dict:
    """{variant: float32 (len(sel), H, W)}: image sel[j] of each variant with the hole of its blob
    (blob[v][i], -1: none) filled in 3-D. `variants[v]`: float images (N, H, W), 0..255;
    `sections(b, i, v)`: bool (H, W), blob b cut at slice i in variant v; `mm`: the in-plane pixel size."""
    from imggen.classic import biharmonic

    where = {int(i): j for j, i in enumerate(sel)}
    out = {v: np.asarray(im[sel], np.float32).copy() for v, im in variants.items()}
    for block in blocks(np.asarray(z)[sel]):
        rows = sel[block]
        for v, images in variants.items():
            for b in np.unique(blob[v][rows]):
                if b < 0:
                    continue
                hole = np.stack([sections(b, i, v) for i in rows])
                if not hole.any():
                    continue
                f = biharmonic(images[rows], hole, spacing=(1.0, mm, mm), rtol=1e-6)
                for j, i in enumerate(rows):
                    if blob[v][i] == b:
                        out[v][where[int(i)]] = f[j]
    return out


def case_fills(imgs: np.ndarray, holes: np.ndarray, keep, spacing) -> np.ndarray:
    """uint8 like imgs (N, C, H, W): each slice's hole (holes: bool (N, H, W)) filled by the 3-D
    biharmonic fill of its run of consecutive slices (`keep`: their z; `spacing`: mm along z, rows,
    columns), as sample.py --brats fills a volume (imggen.classic)."""
    from imggen.classic import biharmonic

    out = imgs.copy()
    for block in blocks(np.asarray(keep)):
        if holes[block].any() and not holes[block].all():
            f = biharmonic(np.moveaxis(imgs[block].astype(np.float64), 1, -1), holes[block], spacing=spacing,
                           rtol=1e-6)
            out[block] = np.clip(np.round(np.moveaxis(f, -1, 1)), 0, 255).astype(np.uint8)
    return out


def cached(key: dict, compute) -> dict:
    """compute() -> {split: uint8 array}, kept in <cache>/brats-demo-fills-<sha of key>.npz."""
    from imggen.storage import cache_root, cached_npz

    digest = hashlib.sha256(json.dumps({"v": VERSION, **key}, sort_keys=True, default=str).encode()).hexdigest()
    return cached_npz(cache_root() / f"brats-demo-fills-{digest[:24]}.npz", compute, "brats-demo 3-D fills cache")
