"""Challenge-like inpainting masks (imggen.datasets.brats_masks) and the honest brats-demo split."""
from __future__ import annotations

import numpy as np
import pytest
from scipy import ndimage

from imggen.datasets import brats, brats_demo, load_dataset, parse_spec
from imggen.datasets.brats_masks import blob, challenge_masks, place, tumour_compartments
from imggen.errors import ConfigError

FULL = np.ones((3, 3, 3))


def n_components(m):
    return ndimage.label(m, structure=FULL)[1]


def ellipsoid_brain(shape=(60, 70, 50)):
    g = np.meshgrid(*[np.linspace(-1, 1, s) for s in shape], indexing="ij")
    return sum(x ** 2 for x in g) <= 0.9


def test_blobs_are_connected_inside_the_brain_and_of_the_asked_size():
    brain = ellipsoid_brain()
    rng = np.random.default_rng(0)
    for frac in (0.01, 0.05, 0.15):
        m = blob(brain, rng, frac)
        assert n_components(m) == 1
        assert not (m & ~brain).any()
        assert 0.8 * frac <= m.sum() / brain.sum() <= frac + 1e-9
    masks = challenge_masks(brain, rng, 6)
    assert len(masks) == 6
    fr = np.array([m.sum() / brain.sum() for m in masks])
    assert (fr >= 0.008).all() and (fr <= 0.15).all() and np.ptp(fr) > 0.02  # 1-15%, not one size
    assert len({m.tobytes() for m in masks}) == 6


def test_tumour_compartments_are_flipped_rotated_and_placed_in_healthy_tissue():
    brain = ellipsoid_brain()
    tumour = np.zeros(brain.shape, bool)
    tumour[20:32, 25:35, 15:25] = True          # 1200 voxels: a compartment
    tumour[40:44, 40:44, 30:33] = True          # 48 voxels: too small (< 800)
    comps = tumour_compartments(tumour)
    assert len(comps) == 1 and comps[0].shape == (12, 10, 10)
    rng = np.random.default_rng(1)
    allowed = brain & ~ndimage.binary_dilation(tumour, iterations=2)
    shapes = set()
    for _ in range(8):
        m = place(comps[0], allowed, rng)
        assert m is not None and m.sum() == 1200 and not (m & ~allowed).any() and n_components(m) == 1
        box = ndimage.find_objects(m.astype(int))[0]
        shapes.add(tuple(s.stop - s.start for s in box))
    assert shapes == {(12, 10, 10), (10, 12, 10)}  # rotated by 90 degrees in the axial plane (or not)
    masks = challenge_masks(brain & ~tumour, rng, 3, tumour=tumour)
    assert all(m.sum() == 1200 and not (m & tumour).any() for m in masks)
    assert place(np.ones((80, 5, 5), bool), allowed, rng) is None  # does not fit: None, not a clipped mask


def test_demo_masks_are_sections_of_3d_blobs_in_the_brain():
    bank, z = brats_demo.demo_mask_bank(64)
    brain = np.stack([brats._resize(b > 0, 64, 64, nearest=True) for b in np.load(brats_demo.DEMO_FILE)["images"]], -1)
    for m in bank:
        assert n_components(m) == 1 and not (m & ~brain).any()
        assert 0.008 <= m.sum() / brain.sum() <= 0.15
    assert all(any(m[:, :, i].any() for m in bank) for i in range(len(z)) if brain[:, :, i].any())
    s = load_dataset("brats-demo", height=32, width=32, channels=1, seed=0)
    s2 = load_dataset("brats-demo", height=32, width=32, channels=1, seed=0)
    assert np.array_equal(s.masks["test"], s2.masks["test"])  # fixed test masks
    x, m = s.test[:, 0], s.masks["test"][:, 0]
    # nearly every test slice has a hole (a blob's thin cap can vanish at 32 px: eval draws a random one there)
    assert m.any((1, 2)).mean() > 0.98 and (x[m] > 0).mean() > 0.97
    frac = m.sum((1, 2)) / np.maximum((x > 0).sum((1, 2)), 1)
    assert frac.max() > 0.1  # big, tumour-sized holes, not the old small ellipses
    old = load_dataset("brats-demo:masks=ellipses", height=32, width=32, channels=1, seed=0)
    assert np.array_equal(old.test, s.test) and not np.array_equal(old.masks["test"], s.masks["test"])
    assert parse_spec("brats-demo:masks=ellipses") == ("brats-demo", "masks=ellipses")
    with pytest.raises(ConfigError, match="masks='blobs'"):
        load_dataset("brats-demo:masks=blobs", height=8, width=8, channels=1)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_demo_split_keeps_10_slices_between_training_and_evaluation(seed):
    s = load_dataset("brats-demo:masks=ellipses", height=8, width=8, channels=1, seed=seed)
    train = np.array(sorted(set(s.meta["slice"]["train"])))
    for split in ("val", "test"):
        held = np.array(sorted(set(s.meta["slice"][split])))
        assert len(held) and np.abs(train[:, None] - held[None]).min() >= 10
    assert len(train) == 54  # the zones (val 45-60, test 61-108) leave 13-35 and 118-148, whatever the seed


def test_seg_cases_get_a_placed_tumour_compartment_and_a_voided_tumour(tmp_path):
    import nibabel as nib

    shape = (48, 48, 24)
    vol = np.zeros(shape, np.float32)
    vol[4:44, 4:44, 2:22] = np.random.default_rng(0).uniform(100, 200, size=(40, 40, 20))
    seg = np.zeros(shape, np.float32)
    seg[8:18, 8:18, 6:16] = 1  # 1000 voxels: one compartment
    vol[seg > 0] = 500.0  # a bright tumour
    d = tmp_path / "c" / "case1"
    d.mkdir(parents=True)
    nib.save(nib.Nifti1Image(vol, np.eye(4)), str(d / "case1_t1.nii.gz"))
    nib.save(nib.Nifti1Image(seg, np.eye(4)), str(d / "case1_seg.nii.gz"))
    s = brats.load(tmp_path / "c", height=48, width=48, inpainting=True)
    split = next(k for k in ("train", "val", "test") if len(s.split(k)))
    x, m, ks = s.split(split)[:, 0], s.masks[split][:, 0], s.meta["slice"][split]
    assert m.sum() == 1000  # the compartment's voxels, cut into axial slices (native size: no resize)
    assert (x[m] > 0).mean() > 0.97  # in brain tissue (where the truth is known)
    for img, k in zip(x, ks):  # the tumour (image rows / columns 30..39 of slices 6..15) is voided
        if 6 <= k < 16:
            assert (img[30:40, 30:40] == 0).all() and not m[ks.index(k)][28:42, 28:42].any()
    t = brats.load(tmp_path / "c", height=48, width=48, inpainting=True, masks="tumour")
    assert sum(t.masks[k].sum() for k in ("train", "val", "test")) == 1000
