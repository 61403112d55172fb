"""Build datasets/data/brats_demo.npz: real brain slices for the `brats-demo` data kind.

Source: the MNI152 ICBM 2009a symmetric T1 template (skull-stripped) that nilearn ships inside
its wheel (`nilearn.datasets.struct.MNI152_FILE_PATH`, read directly - no download). Slices go
through the same steps as real BraTS data (`imggen.datasets.brats`: RAS canonical, brain
percentile clip -> uint8, radiological axial orientation), are zero-padded to square (the
template is 197 x 233 mm in-plane) and resized to 128 x 128. Kept: every axial slice with >= 5%
brain pixels. Patients: consecutive slabs of 8 slices. Masks: 1-2 seeded random ellipses per
slice (semi-axes 4-14 px at 128 px), centred on a brain pixel and clipped to the brain.

    python datasets/make_brats_demo.py          # deterministic (seed 0); ~1 MB output
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

SIZE, SLAB, MIN_BRAIN, SEED = 128, 8, 0.05, 0


def ellipse_mask(rng, brain: np.ndarray) -> np.ndarray:
    h, w = brain.shape
    yy, xx = np.mgrid[:h, :w]
    mask = np.zeros_like(brain)
    ys, xs = np.nonzero(brain)
    for _ in range(rng.integers(1, 3)):
        i = rng.integers(len(ys))
        a, b = rng.uniform(4, 14, size=2)
        t = rng.uniform(0, np.pi)
        dy, dx = yy - ys[i], xx - xs[i]
        u, v = dx * np.cos(t) + dy * np.sin(t), -dx * np.sin(t) + dy * np.cos(t)
        mask |= (u / a) ** 2 + (v / b) ** 2 <= 1
    return mask & brain


def main(out: Path = Path(__file__).parent / "data" / "brats_demo.npz") -> None:
    from nilearn.datasets.struct import MNI152_FILE_PATH

    from imggen.datasets.brats import _resize, normalise_volume, ras_slice_to_image, read_volume

    vol = normalise_volume(read_volume(Path(MNI152_FILE_PATH)), MNI152_FILE_PATH)
    brain = vol > 0
    rng = np.random.default_rng(SEED)
    ks = [k for k in range(vol.shape[2]) if brain[:, :, k].mean() >= MIN_BRAIN]
    images, masks = [], []
    for k in ks:
        img = ras_slice_to_image(vol[:, :, k])
        h, w = img.shape
        n = max(h, w)
        sq = np.zeros((n, n), np.float32)
        sq[(n - h) // 2:(n - h) // 2 + h, (n - w) // 2:(n - w) // 2 + w] = img
        small = np.clip(np.round(_resize(sq, SIZE, SIZE)), 0, 255).astype(np.uint8)
        images.append(small)
        masks.append(ellipse_mask(rng, small > 0))
    images, masks = np.stack(images), np.stack(masks)
    patient = np.arange(len(ks)) // SLAB
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out, images=images, masks=np.packbits(masks, axis=-1), patient=patient,
                        z=np.array(ks), source=np.array(str(Path(MNI152_FILE_PATH).name)))
    print(f"wrote {out}: {len(ks)} slices, {patient.max() + 1} patients, {out.stat().st_size / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
