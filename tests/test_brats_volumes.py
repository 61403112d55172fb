"""sample.py --brats: BraTS case folders in, <case>-t1n-inference.nii.gz volumes out (imggen.volumes),
on tiny NIfTI cases written to tmp_path and tiny models (random, or trained a few steps)."""
from __future__ import annotations

import nibabel as nib
import numpy as np
import pytest
import torch

from imggen.checkpoint import load_model, save_checkpoint
from imggen.cli import sample_main
from imggen.config import Config, ModelConfig, TrainConfig
from imggen.model import ImageTransformer
from imggen.volume_fill import WEIGHT, edge_taper
from imggen.volumes import Volume, inpaint_case

torch.set_num_threads(1)
SHAPE = (24, 20, 12)
# stored axes: i = -x (left -> right), j = +z (superior), k = -y (posterior -> anterior): not RAS
AFFINE = np.array([[-1.0, 0, 0, 30], [0, 0, 1.0, -20], [0, -1.0, 0, 40], [0, 0, 0, 1]])


def _model_cfg(context="unet", size=8, fill="none"):
    return ModelConfig(height=size, width=size, channels=1, bits=8, dim=32, layers=2, heads=2,
                       attention="local2d,band", window=2 * size, radius=2, context=context, context_width=8,
                       context_fill=fill, backend="cpu")


def random_run(tmp_path, context="unet", fill="none"):
    torch.manual_seed(0)
    cfg = _model_cfg(context, fill=fill)
    if fill == "regress":  # a small regressor inside the model (issue 55 item 3)
        cfg.regress_width, cfg.regress_hidden = 8, 6
    m = ImageTransformer(cfg)
    if context != "none":  # a trained encoder: the fresh one is zero at its output
        torch.nn.init.normal_(m.context.out.weight, std=0.5)
    if m.regressor is not None:  # a non-trivial regression
        for p in m.regressor.parameters():
            torch.nn.init.normal_(p, std=0.3)
    run = tmp_path / (f"run-{context}" if fill == "none" else f"run-{context}-{fill}")
    task = "generate" if context == "none" else "inpaint"
    save_checkpoint(str(run), 1, m, Config(model=cfg, train=TrainConfig(task=task)))
    return str(run)


def constant_run(tmp_path, steps=40):
    """An unconditional model trained briefly on all-white (255) images: it fills with 255."""
    torch.manual_seed(0)
    cfg = _model_cfg("none")
    m = ImageTransformer(cfg)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    x = torch.full((4, cfg.seq_len), 255, dtype=torch.long)
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(m(x).flatten(0, 1), x.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    run = tmp_path / "run-const"
    save_checkpoint(str(run), steps, m.eval(), Config(model=cfg))
    return str(run)


def save(path, data, dtype=np.float32, affine=AFFINE, scaling=None):
    img = nib.Nifti1Image(np.asarray(data).astype(dtype), affine)
    if scaling:
        img.header.set_slope_inter(*scaling)
    nib.save(img, str(path))


def brain(rng):
    v = np.zeros(SHAPE, np.float32)
    v[3:21, 2:11, 1:11] = rng.uniform(300, 900, size=(18, 9, 10))
    return v


def hole():
    m = np.zeros(SHAPE, bool)
    m[8:14, 4:8, 4:8] = True
    return m


def make_case(root, name, rng, vol=None, mask=None, layout="inference", dtype=np.float32, scaling=None):
    d = root / name
    d.mkdir(parents=True)
    vol = brain(rng) if vol is None else vol
    mask = hole() if mask is None else mask
    if layout == "t1n":  # a folder with the ground truth only: voided by the mask on the way in
        save(d / f"{name}-t1n.nii.gz", vol, dtype, scaling=scaling)
    else:
        save(d / f"{name}-t1n-voided.nii.gz", np.where(mask, 0, vol), dtype, scaling=scaling)
    if mask is not False:
        save(d / f"{name}-mask.nii.gz", mask, np.uint8)
    return d


def run_cli(capsys, *argv):
    rc = sample_main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_output_grid_header_and_outside_voxels(tmp_path, capsys):
    rng = np.random.default_rng(0)
    cases = tmp_path / "cases"
    make_case(cases, "BraTS-GLI-00001-000", rng)
    make_case(cases, "BraTS-GLI-00002-000", rng, dtype=np.int16, scaling=(0.5, 10.0))
    make_case(cases, "BraTS-GLI-00003-000", rng, layout="t1n", dtype=np.int16)
    out = tmp_path / "pred"
    rc, stdout, err = run_cli(capsys, "--checkpoint", random_run(tmp_path), "--brats", cases, "--out", out,
                              "--no-progress", "--device", "cpu")
    assert rc == 0, err
    assert "3 of 3 case(s) written" in stdout
    for d in sorted(cases.iterdir()):
        src = next(d.glob("*-t1n*.nii.gz"))
        inp, pred = nib.load(str(src)), nib.load(str(out / f"{d.name}-t1n-inference.nii.gz"))
        assert pred.shape == inp.shape and np.array_equal(pred.affine, inp.affine)
        assert pred.get_data_dtype() == inp.get_data_dtype()
        assert pred.header.get_slope_inter() == inp.header.get_slope_inter()
        assert pred.header.binaryblock == inp.header.binaryblock
        m = np.asanyarray(nib.load(str(d / f"{d.name}-mask.nii.gz")).dataobj) > 0
        raw_in, raw_out = inp.dataobj.get_unscaled(), pred.dataobj.get_unscaled()
        assert raw_out.dtype == raw_in.dtype
        if src.name.endswith("-t1n.nii.gz"):
            raw_in = np.where(m, 0, raw_in)  # the ground-truth layout: the hole is voided first
        assert np.array_equal(raw_out[~m], raw_in[~m])  # bit-identical outside the mask
        filled = pred.get_fdata()[m]
        assert (filled != 0).mean() > 0.5  # the hole is filled (a random model draws mostly nonzero values)
        assert filled.min() >= 0 and filled.max() <= 1000  # in the volume's intensity range, not [0, 255]


def test_hole_in_a_constant_region_comes_back_at_its_intensity(tmp_path, capsys):
    c = 731.0  # not 255: the fill goes through the inverse of the percentile scaling
    vol = np.zeros(SHAPE, np.float32)
    vol[2:22, 1:15, 1:11] = c  # an off-centre box: a fill put on the wrong voxels would read background
    cases = tmp_path / "cases"
    make_case(cases, "const", None, vol=vol)
    out = tmp_path / "pred"
    rc, _, err = run_cli(capsys, "--checkpoint", constant_run(tmp_path), "--brats", cases, "--out", out,
                         "--temperature", "0", "--no-progress", "--device", "cpu")
    assert rc == 0, err
    pred = nib.load(str(out / "const-t1n-inference.nii.gz")).get_fdata()
    m = hole()
    assert np.abs(pred[m] - c).max() <= 0.01 * c
    assert np.array_equal(pred[~m], np.where(m, 0, vol)[~m])


@pytest.mark.parametrize("kind", ["ramp", "constant"])
def test_the_fill_joins_the_tissue_without_a_seam(tmp_path, capsys, kind):
    """The default fill (the 3-D biharmonic fill plus the model's tapered correction): a hole voxel
    next to known tissue differs from its known neighbour by no more than the volume's own step, even
    for a random model whose correction is large inside; voxels outside the mask stay bit-identical."""
    step = 30.0 if kind == "ramp" else 0.0
    vol = np.zeros(SHAPE, np.float32)
    vol[3:21, 2:11, 1:11] = (100.0 + step * np.arange(18))[:, None, None]  # a ramp along stored axis 0
    cases, out = tmp_path / "cases", tmp_path / "pred"
    make_case(cases, "seam", None, vol=vol)
    run = random_run(tmp_path)
    rc, _, err = run_cli(capsys, "--checkpoint", run, "--brats", cases, "--out", out, "--no-progress",
                         "--device", "cpu")
    assert rc == 0, err
    full = tmp_path / "full"  # the whole correction (weight 1, not smoothed): the seam must hold for it too
    full.mkdir()
    inpaint_case(load_model(run, device="cpu"), cases / "seam", full, progress=False, weight=1.0, smooth_mm=0.0)
    m = hole()
    inside = m & (edge_taper(m) > 0)
    for folder, weight in ((out, WEIGHT), (full, 1.0)):
        pred = nib.load(str(folder / "seam-t1n-inference.nii.gz")).get_fdata()
        assert np.array_equal(pred[~m], np.where(m, 0, vol)[~m])
        jumps = []
        for ax in range(3):
            for d in (-1, 1):
                nb_known = ~np.roll(m, d, ax)  # voxel i - d (along ax) is known
                edge = m & nb_known
                jumps.append(np.abs(pred - np.roll(pred, d, ax))[edge].max())
        assert max(jumps) <= step + 1e-3 * max(step, 1.0)
        # the random model does correct inside (its correction times the weight is that large): not a no-op
        assert np.abs(pred[inside] - vol[inside]).max() > weight * step


def test_a_sliver_of_hole_smaller_than_half_a_model_pixel_is_filled(tmp_path, capsys):
    """A slice whose hole covers no model pixel by half (one voxel here: the 8 x 8 model's pixels are
    2.5 x 3 voxels) is still filled: the pixels the hole touches become unknown."""
    rng = np.random.default_rng(5)
    m = np.zeros(SHAPE, bool)
    m[10, 5, 6] = True
    cases, out = tmp_path / "cases", tmp_path / "pred"
    make_case(cases, "sliver", rng, mask=m)
    rc, _, err = run_cli(capsys, "--checkpoint", random_run(tmp_path), "--brats", cases, "--out", out,
                         "--no-progress", "--device", "cpu")
    assert rc == 0, err
    assert nib.load(str(out / "sliver-t1n-inference.nii.gz")).get_fdata()[m][0] > 0


def test_bad_cases_are_one_line_each_and_the_others_go_on(tmp_path, capsys):
    rng = np.random.default_rng(1)
    cases = tmp_path / "cases"
    make_case(cases, "a-good", rng)
    make_case(cases, "b-nomask", rng, mask=False)
    bad = make_case(cases, "c-shapes", rng)
    save(bad / "c-shapes-mask.nii.gz", np.ones((10, 10, 10)), np.uint8)
    make_case(cases, "d-good", rng)
    flipped = make_case(cases, "dd-affine", rng)  # a mask of the right shape in another orientation
    save(flipped / "dd-affine-mask.nii.gz", hole(), np.uint8, affine=np.diag([1.0, 1.0, 1.0, 1.0]))
    (cases / "e-corrupt").mkdir()
    (cases / "e-corrupt" / "e-corrupt-t1n-voided.nii.gz").write_bytes(b"not a nifti file")
    save(cases / "e-corrupt" / "e-corrupt-mask.nii.gz", hole(), np.uint8)
    out = tmp_path / "pred"
    rc, stdout, err = run_cli(capsys, "--checkpoint", random_run(tmp_path, "none"), "--brats", cases, "--out", out,
                              "--no-progress", "--device", "cpu")
    assert rc == 1
    lines = err.strip().splitlines()
    assert len(lines) == 4, err
    assert "b-nomask" in lines[0] and "-mask.nii.gz" in lines[0]
    assert "c-shapes-mask.nii.gz" in lines[1] and "c-shapes-t1n-voided.nii.gz" in lines[1]
    assert "(10, 10, 10)" in lines[1]
    assert "dd-affine-mask.nii.gz" in lines[2] and "affines" in lines[2]
    assert "e-corrupt-t1n-voided.nii.gz" in lines[3]
    assert sorted(p.name for p in out.iterdir()) == ["a-good-t1n-inference.nii.gz", "d-good-t1n-inference.nii.gz"]
    assert "2 of 6 case(s) written" in stdout and "4 failed" in stdout


@pytest.mark.parametrize("k", [1, 3])
def test_uncertainty_volume(tmp_path, capsys, k):
    rng = np.random.default_rng(2)
    cases = tmp_path / "cases"
    make_case(cases, "case", rng)
    out = tmp_path / "pred"
    rc, _, err = run_cli(capsys, "--checkpoint", random_run(tmp_path), "--brats", cases, "--out", out, "--uncertainty",
                         "--samples", k, "--no-progress", "--device", "cpu")
    assert rc == 0, err
    std = nib.load(str(out / "case-t1n-std.nii.gz"))
    inp = nib.load(str(cases / "case" / "case-t1n-voided.nii.gz"))
    assert std.shape == inp.shape and np.array_equal(std.affine, inp.affine)
    s, m = std.get_fdata(), hole()
    assert (s[~m] == 0).all()
    if k == 1:
        assert (s == 0).all()
    else:  # a random model's draws disagree, where its correction has weight (imggen.volume_fill.edge_taper)
        inner = edge_taper(m) > 0
        assert inner.any() and (s[inner] > 0).mean() > 0.5 and (s >= 0).all()


def test_mean_of_k_draws_is_the_reported_fill(tmp_path, capsys):
    """--samples K --reduce mean: the fill is the mean of the K draws (draw i = the K=1 run's stream)."""
    rng = np.random.default_rng(3)
    cases = tmp_path / "cases"
    make_case(cases, "case", rng)
    run = random_run(tmp_path)
    outs = {}
    for reduce in ("mean", "median"):
        out = tmp_path / reduce
        rc, _, err = run_cli(capsys, "--checkpoint", run, "--brats", cases, "--out", out, "--samples", 3,
                             "--reduce", reduce, "--uncertainty", "--no-progress", "--device", "cpu")
        assert rc == 0, err
        outs[reduce] = nib.load(str(out / "case-t1n-inference.nii.gz")).get_fdata()
    m = hole()
    assert not np.allclose(outs["mean"][m], outs["median"][m])
    assert np.array_equal(outs["mean"][~m], outs["median"][~m])


def test_bad_flags_are_one_line(tmp_path, capsys):
    run = random_run(tmp_path)
    rc, _, err = run_cli(capsys, "--checkpoint", run, "--brats", tmp_path / "nowhere", "--out", tmp_path / "o")
    assert rc == 2 and "nowhere" in err and len(err.strip().splitlines()) == 1
    rc, _, err = run_cli(capsys, "--checkpoint", run, "--brats", tmp_path, "--num", 3, "--out", tmp_path / "o")
    assert rc == 2 and "--num" in err
    rc, _, err = run_cli(capsys, "--checkpoint", run, "--uncertainty", "--out", tmp_path / "x.png")
    assert rc == 2 and "--brats" in err


def test_ras_round_trip_of_a_non_canonical_volume(tmp_path):
    save(tmp_path / "v.nii.gz", np.arange(np.prod(SHAPE)).reshape(SHAPE))
    v = Volume(tmp_path / "v.nii.gz")
    ras = v.to_ras(v.values)
    assert np.array_equal(ras, np.asarray(nib.as_closest_canonical(nib.load(str(tmp_path / "v.nii.gz"))).dataobj))
    assert np.array_equal(v.from_ras(ras), v.values)


def test_two_commands_from_case_folders_to_scores(tmp_path, capsys):
    """README's BraTS section: sample.py --brats on training-layout folders, then eval brats."""
    from imggen.eval.__main__ import main as eval_main

    rng = np.random.default_rng(4)
    cases = tmp_path / "cases"
    for name in ("BraTS-GLI-00010-000", "BraTS-GLI-00011-000"):
        t1, m = brain(rng), hole()
        healthy = m.copy()
        healthy[8:14, 4:8, 6:8] = False
        d = make_case(cases, name, rng, vol=t1, mask=m)
        save(d / f"{name}-t1n.nii.gz", t1)
        save(d / f"{name}-mask-healthy.nii.gz", healthy, np.uint8)
        save(d / f"{name}-mask-unhealthy.nii.gz", m & ~healthy, np.uint8)
    out = tmp_path / "pred"
    rc, _, err = run_cli(capsys, "--checkpoint", random_run(tmp_path), "--brats", cases, "--out", out,
                         "--no-progress", "--device", "cpu")
    assert rc == 0, err
    assert eval_main(["brats", "--pred", str(out), "--data", str(cases)]) == 0
    text = capsys.readouterr().out
    assert "mean over 2 case(s)" in text
    rows = (out / "brats_scores.csv").read_text().strip().splitlines()
    assert len(rows) == 3 and rows[1].startswith("BraTS-GLI-00010-000,")


def test_25d_model_trains_fills_a_volume_and_refuses_one_png(tmp_path, capsys):
    """A 2.5-D context model (model.context_slices) trains 2 steps on brats-demo, fills a volume
    with each slice's neighbours (fill_volume, sample.py --brats), and sample.py --inpaint of one
    PNG is one clear error (it needs a volume)."""
    from PIL import Image

    from imggen.config import DataConfig
    from imggen.training import train
    from imggen.volume_fill import fill_volume

    cfg = Config(preset="brats64", model=_model_cfg(size=16), data=DataConfig(spec="brats-demo"),
                 train=TrainConfig(task="inpaint", steps=2, batch_size=2, eval_images=2, sample_num=1, warmup=1,
                                   grid_time_frac=0))
    cfg.model.context_slices = 2
    run = tmp_path / "run25"
    train(cfg, str(run), device="cpu", progress=False)
    import imggen
    m = imggen.load_model(str(run))
    assert m.config.context_slices == 2 and m.context.inp.in_channels == 10
    torch.nn.init.normal_(m.context.out.weight, std=0.5)  # 2 steps leave the encoder near zero: make it matter
    vol, mask = brain(np.random.default_rng(0)), hole()
    fill, std = fill_volume(m, vol, mask, samples=2, seed=0)
    assert (fill[~mask] == 0).all() and (std[~mask] == 0).all() and (fill[mask] != 0).mean() > 0.5
    # the neighbours are seen: change a slice next to the hole's end (outside the hole) and the fill moves
    vol2 = vol.copy()
    vol2[:, :, 3] = 0
    assert not np.array_equal(fill_volume(m, vol2, mask, samples=2, seed=0)[0], fill)
    cases = tmp_path / "cases"
    d = make_case(cases, "BraTS-GLI-00001-000", np.random.default_rng(1), dtype=np.int16)
    rc, stdout, err = run_cli(capsys, "--checkpoint", run, "--brats", cases, "--out", tmp_path / "pred", "--no-progress")
    assert rc == 0, err
    inp = nib.load(str(next(d.glob("*-t1n-voided.nii.gz"))))
    pred = nib.load(str(tmp_path / "pred" / "BraTS-GLI-00001-000-t1n-inference.nii.gz"))
    m3 = np.asanyarray(nib.load(str(next(d.glob("*-mask.nii.gz")))).dataobj) > 0
    assert np.array_equal(pred.dataobj.get_unscaled()[~m3], inp.dataobj.get_unscaled()[~m3])
    Image.fromarray(np.full((16, 16), 100, np.uint8)).save(tmp_path / "slice.png")
    Image.fromarray(np.pad(np.full((4, 4), 255, np.uint8), 6)).save(tmp_path / "mask.png")
    rc, stdout, err = run_cli(capsys, "--checkpoint", run, "--inpaint", tmp_path / "slice.png", "--mask",
                              tmp_path / "mask.png", "--out", tmp_path / "f.png")
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert "2.5-D context" in err and "--brats" in err


@pytest.mark.parametrize("sigma", [0.7, 2.0, 3.5])
def test_smoothing_across_slices_against_a_direct_sum(sigma):
    """smooth_across_slices: each hole voxel gets the Gaussian-weighted mean of the hole voxels of its column
    (z), every other voxel 0; a direct double loop over the taps is the reference."""
    from imggen.volume_fill import smooth_across_slices

    rng = np.random.default_rng(int(sigma * 10))
    c = rng.normal(size=(3, 5, 4, 11))
    hole = rng.random((5, 4, 11)) < 0.6
    got = smooth_across_slices(c, hole, sigma)
    r = int(4.0 * sigma + 0.5)  # scipy's taps: truncate 4 sigma
    want = np.zeros_like(c)
    for i, j, k in zip(*np.nonzero(hole)):
        num = den = 0.0
        for kk in range(max(k - r, 0), min(k + r, 10) + 1):
            if hole[i, j, kk]:
                g = np.exp(-0.5 * ((kk - k) / sigma) ** 2)
                num, den = num + g * c[:, i, j, kk], den + g
        want[:, i, j, k] = num / den
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
    const = smooth_across_slices(np.full(c.shape, 7.0), hole, sigma)
    assert np.allclose(const[:, hole], 7.0) and (const[:, ~hole] == 0).all()  # a constant correction stays
    assert smooth_across_slices(c, hole, 0.0) is c


def test_the_correction_is_weighed_linearly_and_weight_0_is_the_clipped_3d_fill(tmp_path):
    """fill_volume: weight 0 writes the 3-D biharmonic fill of the percentile-clipped volume, mapped back (no
    draws); the mean fill is linear in the weight (the same draws); smoothing across slices lowers the
    correction's slice-to-slice differences."""
    from imggen.checkpoint import load_model
    from imggen.classic import biharmonic
    from imggen.datasets.brats import intensity_range
    from imggen.volume_fill import fill_volume

    rng = np.random.default_rng(6)
    vol, m = brain(rng).astype(np.float64), hole()
    model = load_model(random_run(tmp_path), device="cpu")
    kw = dict(samples=2, seed=0)
    f0, s0 = fill_volume(model, vol, m, weight=0.0, **kw)
    lo, hi = intensity_range(np.where(m, 0.0, vol), "volume")
    norm = np.clip((vol - lo) / (hi - lo), 0, 1) * 255
    np.testing.assert_allclose(f0[m], (lo + biharmonic(norm, m) / 255 * (hi - lo))[m], rtol=1e-12)
    assert (s0 == 0).all() and (f0[~m] == 0).all()
    f1 = fill_volume(model, vol, m, weight=1.0, **kw)[0]
    fh = fill_volume(model, vol, m, weight=0.5, **kw)[0]
    np.testing.assert_allclose(fh[m] - f0[m], 0.5 * (f1[m] - f0[m]), rtol=1e-5, atol=1e-6 * hi)
    assert np.abs(f1[m] - f0[m]).max() > 1e-3 * hi
    raw = fill_volume(model, vol, m, weight=1.0, smooth_mm=0.0, **kw)[0]

    def z_steps(f):  # |difference| of the correction between neighbouring hole slices
        d = np.diff(np.where(m, f - f0, 0.0), axis=2)
        return np.abs(d)[m[:, :, 1:] & m[:, :, :-1]].mean()
    assert z_steps(f1) < 0.8 * z_steps(raw)


def test_grid_channel_is_the_3d_fill_of_the_resized_slices(tmp_path, monkeypatch):
    """corrections(channel="grid") gives a biharmonic3d model, as its classic-fill channel, the 3-D fill of the
    hole's slices resized to its grid (what BraTS folders' training fills are): on a volume
    linear in x, y and z the fill continues the plane, so the channel equals the resized slices without
    their hole; known pixels are the model's inputs."""
    from imggen.datasets.brats import intensity_range, ras_slice_to_image
    from imggen.volume_fill import _down, corrections, slice_inputs

    torch.manual_seed(0)
    model = ImageTransformer(_model_cfg(fill="biharmonic3d")).eval()
    seen = []
    make = model.make_context
    monkeypatch.setattr(model, "make_context", lambda im, m, fills: seen.append((im, m, fills)) or make(im, m, fills))
    x, y, z = np.meshgrid(np.arange(24), np.arange(20), np.arange(12), indexing="ij")
    vol = 200.0 + 10 * x + 6 * y + 15 * z
    m = hole()
    corrections(model, vol, m, samples=1, channel="grid", batch_size=64)
    (images, masks, fills), = seen
    ks = np.flatnonzero(m.any((0, 1)))
    lo, hi = intensity_range(np.where(m, 0.0, vol), "volume")
    norm = np.clip((vol - lo) / (hi - lo), 0, 1) * 255
    for i, k in enumerate(ks):
        unknown = masks[i].numpy()
        assert unknown.any()
        img, _ = slice_inputs(model, norm[:, :, k], m[:, :, k])
        f = fills[i, 0].numpy()
        assert np.array_equal(f[~unknown], img[0][~unknown].astype(np.float32))
        truth = _down(ras_slice_to_image(norm[:, :, k]), 8, 8)
        assert np.abs(f[unknown] - truth[unknown]).max() <= 1.5  # the channel is rounded to integers


def test_a_regression_channel_model_fills_volumes_and_its_regressor_alone_is_one_draw(tmp_path, capsys):
    """A context_fill regress model at native resolution: sample.py --brats fills a case from its run folder
    alone; corrections(source="regressor") is one draw per hole slice, the regressor's fill of the slice's
    model inputs (slice_inputs) minus the 3-D fill there, resized back (a reference built by hand); the
    combinations that cannot work are one ConfigError."""
    from imggen.classic import biharmonic
    from imggen.datasets.brats import image_to_ras_slice, intensity_range, ras_slice_to_image
    from imggen.errors import ConfigError
    from imggen.inpainting.regress import predict
    from imggen.volume_fill import _down, corrections, fill_volume, slice_inputs

    run = random_run(tmp_path, fill="regress")
    m = load_model(run, device="cpu")
    rng = np.random.default_rng(3)
    vol, mask = brain(rng).astype(np.float64), hole()
    c = corrections(m, vol, mask, samples=4, source="regressor")
    assert c.draws.shape[0] == 1  # deterministic: one draw whatever `samples` asks
    lo, hi = intensity_range(np.where(mask, 0.0, vol), "volume")
    norm = np.clip((vol - lo) / (hi - lo), 0, 1) * 255
    base = biharmonic(norm, mask)
    for k in c.ks:
        img, unknown = slice_inputs(m, norm[:, :, k], mask[:, :, k])
        pred = predict(m.regressor, img[None], unknown[None])[0, 0].astype(np.float32)
        low = _down(ras_slice_to_image(base[:, :, k]), 8, 8)
        want = image_to_ras_slice(np.where(unknown, pred - low, 0.0), vol.shape[:2])[c.box[0], c.box[1]]
        np.testing.assert_allclose(c.draws[0, ..., k - c.ks[0]], want, atol=1e-3)
    assert np.abs(c.draws).max() > 1.0
    f0 = fill_volume(m, vol, mask, weight=0.0)[0]
    f1, s1 = fill_volume(m, vol, mask, source="regressor", weight=1.0)
    assert np.abs(f1 - f0)[mask].max() > 1e-3 * hi and (s1 == 0).all() and (f1[~mask] == 0).all()
    for kw, msg in [(dict(channel="volume"), "use channel 'slice'"), (dict(source="regressor", channel="grid"),
                    "use channel 'slice'"), (dict(source="ensemble"), "fill source 'ensemble'")]:
        with pytest.raises(ConfigError, match=msg):
            corrections(m, vol, mask, **kw)
    with pytest.raises(ConfigError, match="context_fill regress model's regressor"):
        corrections(load_model(random_run(tmp_path), device="cpu"), vol, mask, source="regressor")
    make_case(tmp_path / "cases", "c1", rng, vol=vol.astype(np.float32), mask=mask)
    rc, _, err = run_cli(capsys, "--checkpoint", run, "--brats", tmp_path / "cases", "--out", tmp_path / "pred",
                         "--samples", 2, "--no-progress")
    assert rc == 0, err
    out = nib.load(str(tmp_path / "pred" / "c1-t1n-inference.nii.gz")).get_fdata()
    voided = nib.load(str(tmp_path / "cases" / "c1" / "c1-t1n-voided.nii.gz")).get_fdata()
    stored = nib.load(str(tmp_path / "cases" / "c1" / "c1-mask.nii.gz")).get_fdata() > 0
    assert np.isfinite(out).all() and np.allclose(out[~stored], voided[~stored])
    assert np.abs(out[stored]).min() > 0  # every hole voxel filled, none left at the voided zero
