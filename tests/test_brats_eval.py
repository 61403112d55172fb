"""python -m imggen.eval brats: the organisers' metrics per case folder, a CSV row per case, a mean table."""
from __future__ import annotations

import csv
import json
import math

import nibabel as nib
import numpy as np

from imggen.eval.__main__ import main
from imggen.eval.metrics import brats_inpainting_metrics

SHAPE = (16, 20, 18)


def save(path, data, dtype=np.float32):
    nib.save(nib.Nifti1Image(np.asarray(data).astype(dtype), np.eye(4)), str(path))


def make_case(root, name, rng):
    d = root / name
    d.mkdir(parents=True)
    t1 = np.zeros(SHAPE, np.float32)
    t1[2:14, 3:17, 2:16] = rng.uniform(200, 800, size=(12, 14, 14))
    healthy = np.zeros(SHAPE, bool)
    healthy[5:9, 6:11, 6:10] = True
    unhealthy = np.zeros(SHAPE, bool)
    unhealthy[9:12, 11:14, 10:13] = True
    mask = healthy | unhealthy
    save(d / f"{name}-t1n.nii.gz", t1)
    save(d / f"{name}-t1n-voided.nii.gz", np.where(mask, 0, t1))
    save(d / f"{name}-mask.nii.gz", mask, np.uint8)
    save(d / f"{name}-mask-healthy.nii.gz", healthy, np.uint8)
    save(d / f"{name}-mask-unhealthy.nii.gz", unhealthy, np.uint8)
    return t1, healthy, np.where(mask, 0, t1)


def test_perfect_predictions_score_perfectly_and_csv_has_a_row_per_case(tmp_path, capsys):
    rng = np.random.default_rng(0)
    data, pred = tmp_path / "cases", tmp_path / "pred"
    pred.mkdir()
    names = ["BraTS-GLI-00001-000", "BraTS-GLI-00002-000", "BraTS-GLI-00003-000"]
    for n in names:
        t1, _, _ = make_case(data, n, rng)
        save(pred / f"{n}-t1n-inference.nii.gz", t1)
    rc = main(["brats", "--pred", str(pred), "--data", str(data), "--json", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    assert rc == 0
    with open(pred / "brats_scores.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["case"] for r in rows] == names
    for r in rows:
        assert math.isclose(float(r["ssim"]), 1.0, abs_tol=1e-9)
        assert float(r["mse"]) == 0.0 and float(r["psnr"]) == math.inf
    res = json.loads((tmp_path / "r.json").read_text())
    assert res["n_cases"] == 3 and abs(res["mean"]["ssim"] - 1.0) < 1e-9 and res["mean"]["mse"] == 0.0
    assert "| ssim | 1.0000 | 1.0000 - 1.0000 |" in out and "| psnr | inf |" in out


def test_imperfect_predictions_missing_and_bad_cases(tmp_path, capsys):
    rng = np.random.default_rng(1)
    data, pred = tmp_path / "cases", tmp_path / "pred"
    pred.mkdir()
    expect = {}
    for i, n in enumerate(["a", "b", "c"]):
        t1, healthy, voided = make_case(data, n, rng)
        guess = voided + healthy * (400.0 + 50 * i)  # a flat fill of the hole
        save(pred / f"{n}-t1n-inference.nii.gz", guess)
        expect[n] = brats_inpainting_metrics(guess, t1, healthy, voided)
    make_case(data, "d-no-pred", rng)
    make_case(data, "e-bad-shape", rng)
    save(pred / "e-bad-shape-t1n-inference.nii.gz", np.zeros((4, 4, 4)))
    (data / "f-inference-only").mkdir()
    save(data / "f-inference-only" / "f-inference-only-t1n-voided.nii.gz", np.ones(SHAPE))
    rc = main(["brats", "--pred", str(pred), "--data", str(data), "--csv", str(tmp_path / "s.csv")])
    captured = capsys.readouterr()
    assert rc == 1  # a case failed
    assert "e-bad-shape-t1n-inference.nii.gz" in captured.err and len(captured.err.strip().splitlines()) == 1
    assert "1 case(s) without a prediction" in captured.out and "1 case(s) without -t1n" in captured.out
    with open(tmp_path / "s.csv") as f:
        rows = {r["case"]: r for r in csv.DictReader(f)}
    assert sorted(rows) == ["a", "b", "c"]
    for n, m in expect.items():
        for k, v in m.items():
            assert math.isclose(float(rows[n][k]), v, rel_tol=1e-9)
        assert 0 < m["ssim"] < 1 and math.isfinite(m["psnr"])
    mean_ssim = np.mean([m["ssim"] for m in expect.values()])
    assert f"| ssim | {mean_ssim:.4f} |" in captured.out


def test_nothing_to_score_is_one_line(tmp_path, capsys):
    rng = np.random.default_rng(2)
    make_case(tmp_path / "cases", "a", rng)
    (tmp_path / "pred").mkdir()
    rc = main(["brats", "--pred", str(tmp_path / "pred"), "--data", str(tmp_path / "cases")])
    err = capsys.readouterr().err
    assert rc == 2 and "without a prediction" in err and len(err.strip().splitlines()) == 1


def test_slice_axis_picks_the_ssim_planes(tmp_path):
    rng = np.random.default_rng(1)
    data, pred = tmp_path / "cases", tmp_path / "pred"
    pred.mkdir()
    t1, healthy, voided = make_case(data, "BraTS-GLI-00001-000", rng)
    noisy = t1 + rng.normal(0, 50, t1.shape).astype(np.float32)
    save(pred / "BraTS-GLI-00001-000-t1n-inference.nii.gz", noisy)
    got = {}
    for axis in (0, 2):
        rc = main(["brats", "--pred", str(pred), "--data", str(data), "--slice-axis", str(axis),
                   "--json", str(tmp_path / f"r{axis}.json")])
        assert rc == 0
        got[axis] = json.loads((tmp_path / f"r{axis}.json").read_text())["mean"]
        want = brats_inpainting_metrics(noisy, t1, healthy, voided, slice_axis=axis)
        assert math.isclose(got[axis]["ssim"], want["ssim"], rel_tol=1e-6)
    assert got[0]["ssim"] != got[2]["ssim"] and got[0]["psnr"] == got[2]["psnr"]  # planes change SSIM only
