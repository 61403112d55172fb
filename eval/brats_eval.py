"""`python -m imggen.eval brats --pred PRED --data CASES`: score inpainted BraTS volumes like the organisers.

Every case folder under CASES that holds the ground truth `-t1n` and `-mask-healthy` (the challenge's
training / validation layout) and whose prediction `PRED/<case>-t1n-inference.nii.gz` (or
`PRED/<case>/<case>-t1n-inference.nii.gz`) exists is scored with `brats_inpainting_metrics` (the
official `inpainting` package's SSIM / PSNR / MSE inside the healthy mask, intensities scaled by the
percentiles of the case's `-t1n-voided` input; without that file the `-t1n` voided by `-mask` stands
in). Volumes are compared in their stored voxel grid, as the organisers' script reads them.

Writes a CSV with one row per scored case and prints the mean of each metric with a 95% percentile
bootstrap interval over cases (PSNR is infinite for a perfect case; its mean is then infinite).
"""
from __future__ import annotations

import csv
import math
import sys
from pathlib import Path

import numpy as np

from imggen.errors import DataError, ImggenError

METRICS = ("ssim", "psnr", "psnr_max", "mse")
PRED_SUFFIX = "-t1n-inference.nii.gz"


def _read(file: Path) -> np.ndarray:
    import nibabel as nib

    try:
        return np.asarray(nib.load(str(file)).get_fdata(), np.float64)
    except Exception as e:
        raise DataError(f"{file}: not a readable NIfTI volume ({type(e).__name__}: {e})") from None


def find_prediction(pred_dir: Path, case: str) -> Path | None:
    for p in (pred_dir / f"{case}{PRED_SUFFIX}", pred_dir / case / f"{case}{PRED_SUFFIX}"):
        if p.is_file():
            return p
    return None


def score_case(case: Path, pred: Path, slice_axis: int = 0) -> dict:
    """The organisers' metrics of one case folder against prediction `pred` (DataError naming files);
    `slice_axis`: the SSIM planes (0 = the organisers' sagittal planes; 2 = axial, for thin slabs)."""
    from imggen.datasets.brats import _case_files
    from imggen.eval.metrics import brats_inpainting_metrics

    files = _case_files(case)
    gt, healthy = _read(files["t1"]), _read(files["mask-healthy"]) > 0
    if "voided" in files:
        voided = _read(files["voided"])
    elif "mask" in files:
        voided = np.where(_read(files["mask"]) > 0, 0.0, gt)
    else:
        raise DataError(f"{case}: no -t1n-voided (nor -mask) volume: the metrics scale intensities by the voided "
                        f"input's percentiles")
    p = _read(pred)
    shapes = {f.name: a.shape for f, a in ((files["t1"], gt), (files["mask-healthy"], healthy), (pred, p))}
    if len(set(shapes.values())) != 1 or voided.shape != gt.shape:
        raise DataError(f"{case}: volumes of different shapes {shapes}; the prediction must be on the case's "
                        f"voxel grid (write it with sample.py --brats)")
    if not healthy.any():
        raise DataError(f"{files['mask-healthy']}: the healthy mask is empty: no voxels to score")
    return brats_inpainting_metrics(p, gt, healthy, voided, slice_axis=slice_axis)


def interval(values: np.ndarray, resamples: int = 1000, seed: int = 0) -> tuple[float, float] | None:
    """95% percentile bootstrap interval of the mean over cases (None for fewer than 2 cases)."""
    v = np.asarray(values, np.float64)
    if len(v) < 2:
        return None
    idx = np.random.default_rng(seed).integers(0, len(v), size=(resamples, len(v)))
    with np.errstate(invalid="ignore"):  # a perfect case's PSNR is inf: no interpolation between bounds
        lo, hi = np.quantile(v[idx].mean(1), [0.025, 0.975], method="inverted_cdf")
    return float(lo), float(hi)


def evaluate(pred_dir, data_dir, csv_path=None, progress: bool = True, slice_axis: int = 0) -> dict:
    """Score every case; returns {"cases": [...], "mean": {...}, "ci95": {...}, "failed": [...], ...}."""
    from tqdm import tqdm

    from imggen.datasets.brats import _case_files, _find_cases

    pred_dir, data_dir = Path(pred_dir), Path(data_dir)
    if not pred_dir.is_dir():
        raise DataError(f"--pred {pred_dir} is not a folder; give the --out folder of sample.py --brats")
    cases = _find_cases(data_dir)
    rows, failed, no_truth, no_pred = [], [], [], []
    for case in tqdm(cases, desc="scoring", unit="case", disable=None if progress else True, leave=False):
        files = _case_files(case)
        if "t1" not in files or "mask-healthy" not in files:
            no_truth.append(case.name)
            continue
        pred = find_prediction(pred_dir, case.name)
        if pred is None:
            no_pred.append(case.name)
            continue
        try:
            rows.append({"case": case.name, **score_case(case, pred, slice_axis)})
        except ImggenError as e:
            failed.append(case.name)
            print(f"error: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
    if not rows:
        raise DataError(f"no case of {data_dir} could be scored: {len(no_truth)} without -t1n and -mask-healthy, "
                        f"{len(no_pred)} without a prediction <case>{PRED_SUFFIX} in {pred_dir}, {len(failed)} "
                        f"failed")
    csv_path = Path(csv_path) if csv_path else pred_dir / "brats_scores.csv"
    csv_path.parent.mkdir(parents=True, exist_ok=True)
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["case", *METRICS])
        w.writeheader()
        w.writerows(rows)
    mean = {m: float(np.mean([r[m] for r in rows])) for m in METRICS}
    ci = {m: interval([r[m] for r in rows]) for m in METRICS}
    return {"n_cases": len(rows), "mean": mean, "ci95": ci, "cases": rows, "csv": str(csv_path),
            "failed": failed, "without_truth": no_truth, "without_prediction": no_pred,
            "protocol": "BraTS 2023 inpainting (organisers' generate_metrics): SSIM / PSNR (data range 1) / MSE "
                        "inside -mask-healthy, percentiles of -t1n-voided; 95% CI: percentile bootstrap over cases"}


def table(res: dict) -> str:
    def fmt(x):
        return "inf" if x == math.inf else f"{x:.4f}"
    lines = [f"| metric | mean over {res['n_cases']} case(s) | 95% CI |", "|---|---|---|"]
    for m in METRICS:
        ci = res["ci95"][m]
        lines.append(f"| {m} | {fmt(res['mean'][m])} | {'n/a' if ci is None else f'{fmt(ci[0])} - {fmt(ci[1])}'} |")
    return "\n".join(lines)
