"""BraTS adapter on tiny synthetic NIfTI cases written in the real on-disk layouts."""
from __future__ import annotations

import gzip
import warnings

import nibabel as nib
import numpy as np
import pytest

from imggen.datasets import load_dataset
from imggen.datasets import brats, brats_demo
from imggen.errors import DataError

SHAPE = (20, 24, 8)  # stored voxel grid (i, j, k)
LPS = np.array([[-1.0, 0, 0, 30], [0, -1.0, 0, 40], [0, 0, 1.0, -5], [0, 0, 0, 1]])  # flipped x, y


def save(path, data, affine=LPS):
    nib.save(nib.Nifti1Image(np.asarray(data, np.float32), affine), str(path))


def brain_volume(rng, shape=SHAPE, lo_k=1, hi_k=7):
    """Random 'tissue' in a box, zero background; slices outside [lo_k, hi_k) have no brain."""
    v = np.zeros(shape, np.float32)
    v[3:-3, 4:-4, lo_k:hi_k] = rng.uniform(50, 150, size=(shape[0] - 6, shape[1] - 8, hi_k - lo_k))
    return v


def seg_volume(shape=SHAPE):
    s = np.zeros(shape, np.float32)
    s[5:10, 6:12, 2:6] = 2
    return s


def make_case_2021(root, name, rng, mods=("t1", "t1ce", "t2", "flair"), ext=".nii.gz", seg=True):
    d = root / name
    d.mkdir(parents=True)
    for m in mods:
        save(d / f"{name}_{m}{ext}", brain_volume(rng))
    if seg:
        save(d / f"{name}_seg{ext}", seg_volume())
    return d


def make_case_2023(root, name, rng, inpainting=False, with_gt=True):
    d = root / name
    d.mkdir(parents=True)
    t1 = brain_volume(rng)
    if inpainting:
        healthy = np.zeros(SHAPE, np.float32)
        healthy[12:16, 12:18, 3:5] = 1
        unhealthy = seg_volume() > 0
        mask = (healthy > 0) | unhealthy
        if with_gt:
            save(d / f"{name}-t1n.nii.gz", t1)
        save(d / f"{name}-t1n-voided.nii.gz", t1 * ~mask)
        save(d / f"{name}-mask.nii.gz", mask)
        save(d / f"{name}-mask-healthy.nii.gz", healthy)
        save(d / f"{name}-mask-unhealthy.nii.gz", unhealthy)
    else:
        for m in ("t1n", "t1c", "t2w", "t2f"):
            save(d / f"{name}-{m}.nii.gz", brain_volume(rng))
        save(d / f"{name}-seg.nii.gz", seg_volume())
    return d


# ------------------------------------------------------------------ orientation
@pytest.mark.parametrize("affine", [
    LPS,
    # axes permuted and flipped: stored i runs along -y (posterior), j along +x (right)
    np.array([[0, 1.0, 0, -12], [-1.0, 0, 0, 9], [0, 0, 1.0, 0], [0, 0, 0, 1]]),
])
def test_marker_voxel_lands_where_ras_puts_it(tmp_path, affine):
    vol = np.zeros(SHAPE, np.float32)
    vol[2:-2, 2:-2, 1:7] = 100.0  # constant 'brain' -> 255 after normalisation
    marker = (5, 17, 4)            # a dark hole inside the brain
    vol[marker] = 0.0
    d = tmp_path / "cases" / "P0"
    d.mkdir(parents=True)
    save(d / "P0_t1.nii.gz", vol, affine)
    # expected position from world coordinates only (1 mm voxels):
    ijk = np.stack(np.meshgrid(*[np.arange(n) for n in SHAPE], indexing="ij"), -1).reshape(-1, 3)
    world = ijk @ affine[:3, :3].T + affine[:3, 3]
    wm = affine[:3, :3] @ np.array(marker) + affine[:3, 3]
    row = int(round(world[:, 1].max() - wm[1]))  # row 0 = most anterior (largest y)
    col = int(round(world[:, 0].max() - wm[0]))  # col 0 = patient right (largest x)
    k = int(round(wm[2] - world[:, 2].min()))    # axial index, inferior -> superior
    ny = int(round(np.ptp(world[:, 1]))) + 1
    nx = int(round(np.ptp(world[:, 0]))) + 1
    s = brats.load(tmp_path / "cases", height=ny, width=nx, seed=0)
    imgs = np.concatenate([s.train, s.val, s.test])
    slices = sum((s.meta["slice"][x] for x in ("train", "val", "test")), [])
    img = imgs[slices.index(k), 0]
    brain = img > 0
    holes = np.argwhere(~brain[3:-3, 3:-3]) + 3  # dark pixels away from the border of the box
    assert holes.tolist() == [[row, col]]
    assert img.max() == 255


def test_orientation_helpers_roundtrip():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)  # (X, Y)
    img = brats.ras_slice_to_image(a)
    assert img.shape == (4, 3)
    assert img[0, 0] == a[2, 3]  # top-left = most right (x max), most anterior (y max)
    np.testing.assert_array_equal(brats.image_to_ras_slice(img), a)


# ------------------------------------------------------------------ layouts, masks, splits
def test_2021_layout_shapes_masks_and_patient_splits(tmp_path):
    rng = np.random.default_rng(0)
    root = tmp_path / "BraTS2021"
    for i in range(7):
        make_case_2021(root, f"BraTS2021_{i:05d}", rng, ext=".nii" if i == 3 else ".nii.gz")
    kw = dict(height=16, width=12, seed=1, modality="t1ce", inpainting=True)
    s = load_dataset(f"brats:{root}", channels=1, **kw)
    for split in ("train", "val", "test"):
        x, m = s.split(split), s.masks[split]
        assert x.dtype == np.uint8 and x.shape[1:] == (1, 16, 12)
        assert m.dtype == bool and m.shape == (len(x), 1, 16, 12)
        assert len(s.meta["case"][split]) == len(s.meta["slice"][split]) == len(x)
    assert s.train.max() > 150 and s.train.min() == 0  # random tissue, averaged by the resize
    cases = {k: set(v) for k, v in s.meta["case"].items()}
    assert not (cases["train"] & cases["val"]) and not (cases["train"] & cases["test"])
    assert not (cases["val"] & cases["test"])
    assert sum(len(c) for c in cases.values()) == 7 and len(cases["val"]) >= 1 and len(cases["test"]) >= 1
    # brain only on axial slices 1..6 of the 8
    assert set(s.meta["slice"]["train"]) <= set(range(1, 7))
    # determinism, and another seed gives another (still patient-level) split
    s2 = brats.load(root, channels=1, **kw)
    np.testing.assert_array_equal(s.train, s2.train)
    np.testing.assert_array_equal(s.masks["test"], s2.masks["test"])
    assert s.meta == s2.meta
    s3 = brats.load(root, channels=3, **{**kw, "seed": 5})
    assert s3.train.shape[1] == 3 and (s3.train[:, 0] == s3.train[:, 2]).all()


def test_mask_aligned_with_image_after_resize(tmp_path):
    vol = np.zeros(SHAPE, np.float32)
    vol[2:-2, 2:-2, :] = 10.0
    seg = seg_volume()
    vol[seg > 0] = 200.0  # bright 'tumour' exactly where seg > 0
    d = tmp_path / "c" / "case1"
    d.mkdir(parents=True)
    save(d / "case1_flair.nii.gz", vol)
    save(d / "case1_seg.nii.gz", seg)
    s = brats.load(tmp_path / "c", height=48, width=40, modality="t2f", inpainting=True, masks="tumour")
    x, m = s.train[:, 0], s.masks["train"][:, 0]
    for xi, mi in zip(x, m):
        bright = xi > 128
        if mi.any() or bright.any():
            iou = (bright & mi).sum() / (bright | mi).sum()
            assert iou > 0.8, iou


def test_2023_layout_modality_aliases(tmp_path):
    rng = np.random.default_rng(1)
    root = tmp_path / "BraTS2023"
    for i in range(3):
        make_case_2023(root, f"BraTS-GLI-{i:05d}-000", rng)
    a = brats.load(root, height=24, width=20, modality="flair")
    b = brats.load(root, height=24, width=20, modality="t2f")
    np.testing.assert_array_equal(a.train, b.train)
    c = brats.load(root, height=24, width=20, modality="t1,t1ce,t2", channels=3)
    assert c.train.shape[1] == 3 and not np.array_equal(c.train[:, 0], c.train[:, 1])
    # `limit` takes the first cases; a single case folder can be passed directly
    one = brats.load(root, height=24, width=20, limit=1)
    assert set(sum(one.meta["case"].values(), [])) == {"BraTS-GLI-00000-000"}
    direct = brats.load(root / "BraTS-GLI-00000-000", height=24, width=20)
    np.testing.assert_array_equal(direct.train, one.train)


def test_2023_time_points_of_one_patient_stay_in_one_split(tmp_path):
    rng = np.random.default_rng(6)
    root = tmp_path / "BraTS2023"
    for i in range(6):
        for tp in ("000", "001"):
            make_case_2023(root, f"BraTS-GLI-{i:05d}-{tp}", rng)
    assert brats.patient_id("BraTS-GLI-00004-001") == "BraTS-GLI-00004"
    assert brats.patient_id("BraTS2021_00004") == "BraTS2021_00004"
    for seed in range(4):
        s = brats.load(root, height=8, width=8, seed=seed)
        pats = {k: {brats.patient_id(c) for c in v} for k, v in s.meta["case"].items()}
        assert not (pats["train"] & pats["val"]) and not (pats["train"] & pats["test"])
        assert not (pats["val"] & pats["test"]) and pats["test"] and pats["val"]
        assert s.info["patients"]["test"] == sorted(pats["test"])


def test_2023_inpainting_files_use_healthy_mask(tmp_path):
    rng = np.random.default_rng(2)
    root = tmp_path / "BraTS2023_Dataset_Local_Synthesis"
    for i in range(3):
        make_case_2023(root, f"BraTS-GLI-{i:05d}-000", rng, inpainting=True)
    s = brats.load(root, height=24, width=20, inpainting=True)  # native size: no resize
    m = np.concatenate([s.masks[k] for k in ("train", "val", "test")])[:, 0]
    sl = sum((s.meta["slice"][k] for k in ("train", "val", "test")), [])
    healthy = np.zeros(SHAPE, bool)
    healthy[12:16, 12:18, 3:5] = True
    canon = nib.as_closest_canonical(nib.Nifti1Image(healthy.astype(np.uint8), LPS)).get_fdata() > 0
    for mi, k in zip(m, sl):
        np.testing.assert_array_equal(mi, brats.ras_slice_to_image(canon[:, :, k]))
    assert m.sum() == 3 * healthy.sum()  # the healthy mask, not the voided / tumour region
    # the image is the ground-truth t1n (no void inside the mask)
    x = np.concatenate([s.train, s.val, s.test])[:, 0]
    assert (x[m] > 0).mean() > 0.95  # only the 0.5-percentile tail clips to 0
    # the tumour (-mask-unhealthy) is void in the context, as in the challenge's voided input
    tumour = nib.as_closest_canonical(nib.Nifti1Image((seg_volume() > 0).astype(np.uint8), LPS)).get_fdata() > 0
    t_img = np.stack([brats.ras_slice_to_image(tumour[:, :, k]) for k in sl])
    assert t_img.any() and (x[t_img] == 0).all()



def test_2023_training_cases_give_their_holes_3d_fills(tmp_path):
    """fills3d: each slice's healthy-mask hole filled by the 3-D biharmonic fill of its case's slices
    (1 mm apart; in-plane pixel = the volume's side / the image's), the image elsewhere."""
    from imggen.classic import biharmonic

    rng = np.random.default_rng(2)
    root = tmp_path / "BraTS2023_Dataset_Local_Synthesis"
    for i in range(3):
        make_case_2023(root, f"BraTS-GLI-{i:05d}-000", rng, inpainting=True)
    s = brats.load(root, height=12, width=10, inpainting=True, fills3d=True)
    for split in ("train", "val", "test"):
        x, m, f = s.split(split), s.masks[split][:, 0], s.fills[split]
        assert f.shape == x.shape and f.dtype == np.uint8
        np.testing.assert_array_equal(f[:, 0][~m], x[:, 0][~m])
        for case in set(s.meta["case"][split]):  # the case's slices, consecutive here: one solve
            rows = [i for i, c in enumerate(s.meta["case"][split]) if c == case]
            assert np.all(np.diff([s.meta["slice"][split][i] for i in rows]) == 1)
            want = biharmonic(x[rows, 0].astype(float), m[rows], spacing=(1.0, 24 / 12, 20 / 10), rtol=1e-9)
            np.testing.assert_allclose(f[rows, 0], np.clip(np.round(want), 0, 255), atol=1)
    assert any(s.masks[k].any() for k in ("train", "val", "test"))
    assert not brats.load(root, height=12, width=10, inpainting=True).fills  # only when asked


def test_inpainting_on_brats_folders_trains_on_their_masks_and_3d_fills(tmp_path):
    """--task inpaint with --data brats:DIR reads the cases' own holes, and model.context_fill
    biharmonic3d their 3-D fills (once brats-demo only)."""
    from imggen.config import preset
    from imggen.training.batches import load_data

    rng = np.random.default_rng(5)
    root = tmp_path / "cases"
    for i in range(4):
        make_case_2023(root, f"BraTS-GLI-{i:05d}-000", rng, inpainting=True)
    cfg = preset("brats64")
    cfg.data.spec = f"brats:{root}"
    cfg.model.height, cfg.model.width = 12, 10
    splits, _ = load_data(cfg.validate(), progress=False)
    assert {"train_masks", "train_fills", "test_masks", "test_fills"} <= set(splits)
    assert np.asarray(splits["train_masks"]).any()
    cfg.train.task, cfg.model.context, cfg.model.context_fill = "generate", "none", "none"
    splits, _ = load_data(cfg.validate(), progress=False)
    assert "train_masks" not in splits and "train_fills" not in splits


def test_2023_inference_set_uses_voided_image_and_mask(tmp_path):
    rng = np.random.default_rng(3)
    root = tmp_path / "val"
    make_case_2023(root, "BraTS-GLI-00009-000", rng, inpainting=True, with_gt=False)
    s = brats.load(root, height=24, width=20, inpainting=True)
    x, m = s.train[:, 0], s.masks["train"][:, 0]
    assert m.any() and (x[m] == 0).all()  # voided region is black and is what gets inpainted


# ------------------------------------------------------------------ bad input
def _bad_root(tmp_path):
    rng = np.random.default_rng(4)
    root = tmp_path / "bad"
    for i in range(4):
        make_case_2021(root, f"ok{i}", rng, mods=("t1",))
    d = make_case_2021(root, "truncated", rng, mods=("t1",))
    f = d / "truncated_t1.nii.gz"
    f.write_bytes(f.read_bytes()[:300])
    d = make_case_2021(root, "notnifti", rng, mods=())
    (d / "notnifti_t1.nii.gz").write_bytes(gzip.compress(b"this is not a NIfTI file" * 20))
    make_case_2021(root, "missing", rng, mods=("t2",))
    (root / "empty").mkdir()
    return root


@pytest.mark.parametrize("case,needle", [("truncated", "truncated_t1.nii.gz"),
                                         ("notnifti", "notnifti_t1.nii.gz"),
                                         ("missing", "no t1 file"), ("empty", "no BraTS NIfTI files")])
def test_each_bad_case_raises_naming_it(tmp_path, case, needle):
    rng = np.random.default_rng(5)
    root = _bad_root(tmp_path)
    only = tmp_path / "only"
    only.mkdir()
    (root / case).rename(only / case)
    make_case_2021(only, "fine", rng, mods=("t1",))
    with pytest.raises(DataError) as e:
        brats.load(only, height=16, width=16)
    assert needle in str(e.value) and case in str(e.value)


def test_skip_bad_counts_and_warns_once(tmp_path):
    root = _bad_root(tmp_path)
    with pytest.raises(DataError):
        brats.load(root, height=16, width=16)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        s = brats.load(root, height=16, width=16, skip_bad=True)
    assert len(w) == 1 and "skipped 4 bad case" in str(w[0].message)
    assert s.info["skipped"] == 4
    loaded = set(sum((s.meta["case"][k] for k in ("train", "val", "test")), []))
    assert loaded == {"ok0", "ok1", "ok2", "ok3"}


def test_empty_or_missing_dataset_folder(tmp_path):
    with pytest.raises(DataError, match="no case sub-folders"):
        brats.load(tmp_path, height=8, width=8)
    with pytest.raises(DataError, match="does not exist"):
        brats.load(tmp_path / "nope", height=8, width=8)


# ------------------------------------------------------------------ shipped demo
def test_demo_slices():
    assert brats_demo.DEMO_FILE.stat().st_size < 3e6
    s = load_dataset("brats-demo", height=32, width=32, channels=1, seed=0)
    n = 0
    for k in ("train", "val", "test"):
        x, m = s.split(k), s.masks[k]
        assert x.dtype == np.uint8 and x.shape[1:] == (1, 32, 32) and m.shape == (len(x), 1, 32, 32)
        assert m.any(axis=(1, 2, 3)).mean() > 0.9
        n += len(x)
    zs = {k: set(v) for k, v in s.meta["slice"].items()}
    assert n == 4 * sum(len(z) for z in zs.values())  # every kept slice in its 4 variants
    assert 4 * 90 <= n < 4 * 136  # training slices next to val / test slices are left out (honest split)
    cases = {k: set(v) for k, v in s.meta["case"].items()}
    assert not (cases["train"] & cases["test"]) and not (cases["val"] & cases["test"])
    assert not (cases["train"] & cases["val"])
    # masks lie (almost) inside the brain: nearest-resized mask vs bilinear image
    x, m = s.train[:, 0], s.masks["train"][:, 0]
    assert (x[m] > 0).mean() > 0.97


def test_slice_neighbours_by_volume_and_z():
    # two volumes; slice z=3 of "a" is missing (dropped), so its neighbours read -1 there
    vol, z = ["a", "a", "a", "b", "b", "a"], [1, 2, 4, 1, 2, 5]
    n = brats.slice_neighbours(vol, z, 1)
    assert n.tolist() == [[-1, 0, 1], [0, 1, -1], [-1, 2, 5], [-1, 3, 4], [3, 4, -1], [2, 5, -1]]
    assert brats.slice_neighbours(vol, z, 0).tolist() == [[i] for i in range(6)]


def test_demo_neighbours_same_volume_honest_and_one_blob():
    s = 2
    d = load_dataset("brats-demo", height=32, width=32, channels=1, seed=0, context_slices=s)
    base = load_dataset("brats-demo", height=32, width=32, channels=1, seed=0)
    zs = {k: np.asarray(v) for k, v in d.meta["slice"].items()}
    held = np.concatenate([zs["val"], zs["test"]])
    bank, _ = brats_demo.demo_mask_bank(64)
    for k in ("train", "val", "test"):
        assert np.array_equal(d.split(k), base.split(k)) and np.array_equal(d.masks[k], base.masks[k])
        nb, nm = d.neighbours[k], d.neighbour_masks[k]
        case, var, z = np.asarray(d.meta["case"][k]), np.asarray(d.meta["variant"][k]), zs[k]
        assert nb.shape == (len(z), 2 * s + 1) and nm.shape == (len(z), 2 * s + 1, 32, 32)
        assert np.array_equal(nb[:, s], np.arange(len(z))) and np.array_equal(nm[:, s], d.masks[k][:, 0])
        for i in range(len(z)):
            for j, dz in enumerate(range(-s, s + 1)):
                same = np.flatnonzero((case == case[i]) & (var == var[i]) & (z == z[i] + dz))
                assert nb[i, j] == (same[0] if len(same) else -1)  # same slab and variant, z + d; else -1
        assert (nb[:, 0] == -1).any()  # slab edges
        if k == "train":  # no training slice's neighbour comes near a held-out slice (gap 10 - s)
            near = z[np.clip(nb, 0, None)][nb >= 0]
            assert np.abs(near[:, None] - held[None]).min() >= brats_demo.DEMO_GAP
        # a slice's neighbour masks are sections of one 3-D blob (flipped with a flipped variant)
        for i in range(0, len(z), 7):
            if not nm[i, s].any():
                continue
            t = int(np.flatnonzero(np.load(brats_demo.DEMO_FILE)["z"] == z[i])[0])
            cuts = [np.stack([brats._resize(b[:, :, t + dz], 32, 32, nearest=True) if 0 <= t + dz < b.shape[2]
                              else np.zeros((32, 32), bool) for dz in range(-s, s + 1)]) for b in bank]
            cuts = [c[:, :, ::-1] if var[i] == "flip" else c for c in cuts]
            assert any(np.array_equal(nm[i], c) for c in cuts)


def test_25d_training_masks_keep_the_2d_draw_and_cut_cylinders():
    from imggen.training.batches import load_data
    from imggen.config import preset
    from imggen.inpainting.tasks import split_masks

    cfg2, cfg25 = preset("brats-inpaint"), preset("brats-inpaint")
    cfg25.model.context_slices = 1
    two, _ = load_data(cfg2, progress=False)
    sp, _ = load_data(cfg25, progress=False)
    idx = np.arange(40, 56)
    m2, none = split_masks(cfg2, two, "train", 16, step=3, idx=idx)
    m25, stack = split_masks(cfg25, sp, "train", 16, step=3, idx=idx)
    assert none is None and m25.shape == (16, 3, 32, 32) and stack.shape == (16, 3, 1, 32, 32)
    assert np.array_equal(m25[:, 1], m2)  # the slices being filled get the masks a 2-D model gets
    own = (m2 == sp["train_masks"][idx]).all((1, 2))
    nb = sp["train_nbrs"][idx]
    for i in range(16):
        for d in (0, 2):
            if nb[i, d] < 0:  # outside the volume: all unknown, zero image
                assert m25[i, d].all() and not stack[i, d].any()
            elif not own[i]:  # a random 2-D mask: the same on the neighbours (a cylinder)
                assert np.array_equal(m25[i, d], m2[i])
            else:  # the data's 3-D blob, cut at the neighbour
                assert np.array_equal(m25[i, d], sp["train_nbr_masks"][idx[i], d])


def test_real_brats_neighbours_are_the_case_slices_and_their_own_masks(tmp_path):
    from imggen.inpainting.tasks import neighbour_masks

    rng = np.random.default_rng(0)
    root = tmp_path / "BraTS2021"
    for i in range(4):
        make_case_2021(root, f"BraTS2021_{i:05d}", rng)
    s = brats.load(root, height=16, width=12, channels=1, seed=1, modality="t1", inpainting=True, context_slices=1)
    assert not s.neighbour_masks  # one 3-D mask per case: the neighbours' own masks are its sections
    nb, case, z = s.neighbours["train"], s.meta["case"]["train"], s.meta["slice"]["train"]
    for i in range(len(z)):
        for j, dz in enumerate((-1, 0, 1)):
            same = [k for k in range(len(z)) if case[k] == case[i] and z[k] == z[i] + dz]
            assert nb[i, j] == (same[0] if same else -1)
    assert (nb == -1).any()  # slices 1 and 6 are the ends of each case's brain
    splits = {"train_masks": s.masks["train"][:, 0]}
    got = neighbour_masks(splits, "train", np.arange(len(z)), nb, 16, 12)
    for i in range(len(z)):
        for j in range(3):
            assert np.array_equal(got[i, j], s.masks["train"][nb[i, j], 0] if nb[i, j] >= 0 else np.ones((16, 12), bool))
