"""Issue 35's pieces on small inputs: brats-demo's held-out zones and 3-D fills (and their cache),
the given classic fills through the context, and bench/brats_native.py's cases and per-slice scores."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from imggen.classic import biharmonic
from imggen.datasets import brats, brats_demo
from imggen.datasets.brats_fills import blocks, cached, demo_fills

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import brats_native  # noqa: E402


def test_the_demo_split_holds_out_two_zones_and_keeps_training_10_mm_away():
    d = brats_demo.load_demo(height=16, width=16)
    z = {s: np.unique(d.meta["slice"][s]) for s in ("train", "val", "test")}
    assert z["val"].min() >= brats_demo.DEMO_VAL_Z[0] - 7 and z["val"].max() <= brats_demo.DEMO_VAL_Z[1] + 7  # whole slabs
    assert set(range(brats_demo.DEMO_TEST_Z[0], brats_demo.DEMO_TEST_Z[1] + 1)) <= set(z["test"])  # the zone, every slice
    held = np.concatenate([z["val"], z["test"]])
    assert np.abs(z["train"][:, None] - held[None]).min() >= brats_demo.DEMO_GAP
    assert len(z["train"]) == 54 and not set(z["train"]) & set(held)


def test_blocks_are_runs_of_consecutive_slices():
    out = blocks(np.array([5, 3, 4, 10, 11, 20]))
    assert [list(b) for b in out] == [[1, 2, 0], [3, 4], [5]]


def _toy():
    rng = np.random.default_rng(0)
    n, h, w = 12, 10, 10
    yy, xx = np.mgrid[:h, :w]
    imgs = np.stack([100 + 5 * k + 3 * yy + 2 * xx + rng.normal(0, 1, (h, w)) for k in range(n)]).astype(np.float32)
    variants = {"orig": imgs, "flip": imgs[:, :, ::-1]}
    cube = np.zeros((h, w, n), bool)
    cube[3:7, 2:6, 2:10] = True  # one 3-D blob through slices 2-9

    def sections(b, i, v):
        m = cube[:, :, i]
        return m[:, ::-1] if v == "flip" else m
    blob = {v: np.where(cube.any((0, 1)), 0, -1) for v in variants}
    return variants, sections, blob, np.arange(n) + 40


def test_demo_fills_are_3d_on_the_split_slices_only():
    variants, sections, blob, z = _toy()
    sel = np.array([0, 1, 2, 3, 4, 5, 9, 10, 11])  # two blocks: slices 40-45 and 49-51
    out = demo_fills(variants, sections, blob, sel, z, mm=2.0)
    first = sel[:6]
    hole = np.stack([sections(0, i, "orig") for i in first])
    want = biharmonic(variants["orig"][first], hole, spacing=(1.0, 2.0, 2.0))
    assert np.abs(out["orig"][:6] - want).max() < 1e-3
    assert np.array_equal(out["orig"][~np.stack([sections(0, i, "orig") for i in sel])],
                          variants["orig"][sel][~np.stack([sections(0, i, "orig") for i in sel])])
    changed = {v: im.copy() for v, im in variants.items()}
    for im in changed.values():
        im[6:9] = 0.0  # slices outside the split: the split's fills must not read them
    again = demo_fills(changed, sections, blob, sel, z, mm=2.0)
    assert all(np.array_equal(out[v], again[v]) for v in variants)
    assert np.abs(out["flip"] - out["orig"][:, :, ::-1]).max() < 1e-3  # a flipped variant's fill is the flip


def test_demo_split_fills_are_solved_on_the_stored_slices_then_resized(tmp_path, monkeypatch):
    """As sample.py --brats fills at native resolution and resizes: brats-demo's training fills are
    solved on the stored 128 px slices (pixel 233/128 mm, holes cut at 128 px) and resized to the
    model's grid; the cache key names where they were solved."""
    from imggen.datasets import brats_fills

    monkeypatch.setenv("IMGGEN_CACHE_DIR", str(tmp_path))
    seen, keys = {}, []

    def fake_fills(variants, sections, blob, sel, z, mm):
        if len(sel):
            seen.update(size=variants["orig"].shape[-1], mm=mm, hole=sections(0, int(sel[0]), "orig").shape)
        ramp = np.broadcast_to(np.linspace(0, 255, 128, dtype=np.float32), (128, 128))
        return {v: np.zeros((len(sel), 128, 128), np.float32) + ramp for v in variants}
    monkeypatch.setattr(brats_fills, "demo_fills", fake_fills)
    real_cached = brats_fills.cached
    monkeypatch.setattr(brats_fills, "cached", lambda key, compute: keys.append(key) or real_cached(key, compute))
    base = np.load(brats_demo.DEMO_FILE)["images"]
    n = len(base)
    bank = [np.ones((64, 64, n), bool)]
    blob = {v: np.zeros(n, int) for v in brats_demo.DEMO_VARIANTS}
    out = brats_demo.demo_split_fills(base, bank, blob, {"train": np.array([3, 4]), "val": np.array([], int)},
                                      np.arange(n), 16, 16, 1)
    assert seen == {"size": 128, "mm": brats_demo.DEMO_SIDE_MM / 128, "hole": (128, 128)}
    assert keys[0]["solved_at"] == 128 and keys[0]["size"] == (16, 16)
    assert out["train"].shape == (8, 1, 16, 16) and out["train"].dtype == np.uint8 and out["val"].shape == (0, 1, 16, 16)
    want = np.clip(np.round(brats._resize(np.broadcast_to(np.linspace(0, 255, 128, dtype=np.float32), (128, 128)),
                                          16, 16)), 0, 255)
    assert (out["train"][:, 0] == want).all()


def test_the_fills_cache_is_kept_and_a_damaged_file_is_computed_again(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("IMGGEN_CACHE_DIR", str(tmp_path))
    calls = []

    def compute():
        calls.append(1)
        return {"train": np.arange(6, dtype=np.uint8).reshape(2, 3)}
    a = cached({"k": 1}, compute)
    b = cached({"k": 1}, compute)
    assert len(calls) == 1 and np.array_equal(a["train"], b["train"])
    (f,) = tmp_path.glob("brats-demo-fills-*.npz")
    f.write_bytes(f.read_bytes()[:40])
    c = cached({"k": 1}, compute)
    assert len(calls) == 2 and np.array_equal(c["train"], a["train"])
    assert "damaged" in capsys.readouterr().err


def test_given_fills_reach_the_context_and_nan_rows_get_their_2d_fill():
    from imggen.inpainting.context import classic_fill, make_context
    from imggen.inpainting.tasks import split_fills

    rng = np.random.default_rng(1)
    images = torch.from_numpy(rng.integers(0, 256, (3, 1, 8, 8), dtype=np.uint8))
    masks = np.zeros((3, 8, 8), bool)
    masks[:, 2:6, 3:7] = True
    own = masks.copy()
    own[2, 0, 0] = True  # image 2 is given another (random) mask: no given fill for it
    splits = {"train_fills": np.full((3, 1, 8, 8), 77, np.uint8), "train_masks": own}
    fills = split_fills(splits, "train", np.arange(3), masks)
    assert torch.isnan(fills[2]).all() and (fills[:2] == 77).all()
    ctx = make_context(images, masks, (1, 8, 8), fill="biharmonic3d", fills=fills)
    m = torch.from_numpy(masks)
    assert torch.allclose(ctx[:2, 1][m[:2]], torch.tensor(77 / 127.5 - 1.0))
    assert torch.allclose(ctx[2:, 1], classic_fill(images[2:], m[2:])[:, 0])
    assert torch.equal(ctx[:, 1][~m], (images[:, 0].float() / 127.5 - 1.0)[~m])  # known pixels as they are


def test_biharmonic3d_needs_brats_demo():
    from imggen.training.batches import load_data
    from imggen.config import preset
    from imggen.errors import ConfigError

    cfg = preset("brats64")
    cfg.data.spec = "molecules"
    with pytest.raises(ConfigError, match="biharmonic3d"):
        load_data(cfg, progress=False)


def test_native_cases_put_every_hole_voxel_in_its_zone(tmp_path):
    nib = pytest.importorskip("nibabel")
    vol = np.zeros((40, 44, 120), np.float32)
    vol[5:35, 6:38, 2:118] = np.linspace(20, 200, 116)[None, None]
    cases = brats_native.make_cases(tmp_path, "val", 2, volume=vol)
    for c in cases:
        d = tmp_path / c["name"]
        hole = np.asarray(nib.load(str(d / f"{c['name']}-mask.nii.gz")).dataobj) > 0
        zs = np.flatnonzero(hole.any((0, 1)))
        assert brats_demo.DEMO_VAL_Z[0] <= zs.min() and zs.max() <= brats_demo.DEMO_VAL_Z[1]
        assert 0.7 * c["voxels"] <= hole.sum() <= c["voxels"] and c["brain_share"] > 0.003
        voided = np.asarray(nib.load(str(d / f"{c['name']}-t1n-voided.nii.gz")).dataobj)
        assert (voided[hole] == 0).all() and np.array_equal(voided[~hole], vol[~hole])


def test_slice_scores_are_perfect_for_the_truth_and_fall_with_error():
    rng = np.random.default_rng(2)
    truth = rng.uniform(50, 200, (30, 30, 6))
    hole = np.zeros(truth.shape, bool)
    hole[10:20, 8:22, 1:5] = True
    voided = np.where(hole, 0, truth)
    perfect = brats_native.slice_scores(truth, truth, hole, voided)
    assert perfect["z"] == [1, 2, 3, 4] and min(perfect["ssim"]) > 0.999 and min(perfect["psnr"]) > 100
    noisy = brats_native.slice_scores(truth + hole * rng.normal(0, 20, truth.shape), truth, hole, voided)
    assert max(noisy["psnr"]) < 30 and max(noisy["ssim"]) < 0.99


def test_paired_intervals_and_report_name_the_baseline():
    p = brats_native.paired([2.0, 3.0, 4.0], [1.0, 1.0, 1.0])
    assert p["mean"] == pytest.approx(2.0) and p["ci95"][0] > 0 and p["better"] == 1.0


def test_report_gives_the_models_part_against_the_clipped_3d_fill():
    """brats_native.report: every method against 3-D biharmonic, and each imggen row against the clipped
    3-D fill (the same fill without the model) in a second table."""
    from types import SimpleNamespace

    rng = np.random.default_rng(3)

    def res(shift):
        cases = [{"psnr": 15 + shift + rng.normal(0, 0.1), "ssim": 0.6 + shift / 100} for _ in range(5)]
        sl = {"psnr": list(15 + shift + rng.normal(0, 0.1, 20)), "ssim": list(0.6 + shift / 100 + np.zeros(20))}
        return {"cases": cases, "mean": {"psnr": 15 + shift, "ssim": 0.6 + shift / 100}, "slices": sl}
    r = {brats_native.BASELINE: res(0), brats_native.CLIPPED: res(1), "imggen": res(1.5)}
    cases = [{"name": f"c{i}", "brain_share": 0.01, "voxels": 10, "z": [1, 2]} for i in range(5)]
    md, data = brats_native.report(r, {k: [1.0] for k in r}, cases, SimpleNamespace(split="test", samples=2), "toy")
    p = data["paired"]
    assert p["imggen"]["per_case"]["psnr"]["mean"] == pytest.approx(1.5, abs=0.2)
    assert p["imggen"]["vs_clipped"]["per_case"]["psnr"]["mean"] == pytest.approx(0.5, abs=0.2)
    assert "vs_clipped" not in p[brats_native.CLIPPED]
    assert "PSNR - clipped 3-D, per case" in md and md.count("| imggen |") == 2
    assert data["contrasts"] == {} and "a - b" not in md
    # contrasts (--compare, the regression alone): a - b on the same cases and slices
    r["regression alone, full correction"] = res(0.75)
    md, data = brats_native.report(r, {k: [1.0] for k in r}, cases, SimpleNamespace(split="test", samples=2), "toy",
                                   [("imggen", "regression alone, full correction")])
    c = data["contrasts"]["imggen - regression alone, full correction"]
    assert c["per_case"]["psnr"]["mean"] == pytest.approx(0.75, abs=0.2) and c["per_case"]["psnr"]["ci95"][0] > 0
    assert c["per_slice"]["ssim"]["mean"] == pytest.approx(0.0075)
    assert "| imggen - regression alone, full correction |" in md
    assert data["paired"]["regression alone, full correction"]["vs_clipped"]["per_case"]["psnr"]["mean"] < 0


def test_correction_sweep_scores_every_setting_of_one_case(tmp_path):
    """bench/brats_correction.py's per-case scoring: weight 0 is the clipped 3-D fill whatever the smoothing,
    every setting gets the organisers' scores, and the model's grid gets both fills' PSNR."""
    pytest.importorskip("nibabel")
    import brats_correction

    from imggen.checkpoint import load_model, save_checkpoint
    from imggen.config import Config, ModelConfig, TrainConfig
    from imggen.model import ImageTransformer

    torch.manual_seed(0)
    cfg = ModelConfig(height=8, width=8, channels=1, bits=8, dim=32, layers=2, heads=2, attention="local2d,band",
                      window=16, radius=2, context="unet", context_width=8, context_fill="biharmonic3d", backend="cpu")
    save_checkpoint(str(tmp_path / "run"), 1, ImageTransformer(cfg),
                    Config(model=cfg, train=TrainConfig(task="inpaint")))
    rng = np.random.default_rng(4)
    vol = np.zeros((40, 44, 120), np.float32)
    vol[5:35, 6:38, 2:118] = rng.uniform(20, 200, (30, 32, 116))
    brats_native.make_cases(tmp_path / "cases", "val", 1, volume=vol)
    settings = [(0.0, 0.0), (2.0, 0.0), (0.0, 1.0), (2.0, 0.5)]
    out, secs = brats_correction.case_scores(load_model(str(tmp_path / "run"), device="cpu"),
                                             tmp_path / "cases" / "mni-val-00", 2, settings)
    grid = out.pop("grid")
    assert set(out) == set(settings) and secs > 0
    assert out[(0.0, 0.0)] == out[(2.0, 0.0)]
    assert all(np.isfinite(v["psnr"]) and 0 < v["ssim"] <= 1 for v in out.values())
    assert set(grid) == {"base", "model"} and all(np.isfinite(v) for v in grid.values())
    assert grid["base"] != grid["model"]  # the random model's draws move the fill
    assert out[(0.0, 1.0)]["psnr"] != out[(0.0, 0.0)]["psnr"]
