"""BraTS at the challenge's own resolution (issue 35): imggen against 2-D and 3-D biharmonic, scored
by the organisers' metrics on 240x240x155 volumes at 1 mm.

    python bench/brats_native.py --checkpoint RUN [--split test] [--cases 8] [--samples 8]
        [--variants [NAME ...]] [--compare RUN ...] [--work runs/brats_native] [--out bench/results]
        [--stem brats_native]

Cases (`make_cases`): the MNI152 (ICBM 2009a symmetric) T1 template that nilearn's wheel carries
(1 mm, read from the file, no download), padded to the challenge's 240x240x155 grid, one case folder
per hole in the challenge's layout: `-t1n` (the truth), `-t1n-voided`, `-mask` and `-mask-healthy`
(the same hole: the template has no tumour). Each hole is a lumpy tumour-shaped 3-D blob
(imggen.datasets.brats_masks.blob) of a given share of the brain, drawn inside one zone of the
template: the test zone DEMO_TEST_Z (z 61-108, 48 slices) or the val zone DEMO_VAL_Z (z 45-60). The
brats-demo training split keeps only slices at least 10 mm from both zones (54 of its 136 slices), so
no hole voxel has a training slice within 10 mm. All cases are one brain: the interval over cases is
over holes, not over patients.

Methods, each writing PRED/<method>/<case>-t1n-inference.nii.gz:
* biharmonic 2-D: every axial slice on its own (imggen.classic, skimage's equations);
* biharmonic 3-D: the whole volume at once, in its stored intensities;
* biharmonic 3-D, clipped: the same solve on the volume clipped to its brain's 0.5-99.5 percentiles
  (the intensities the model reads; imggen.volume_fill.fill_volume with weight 0): imggen's fill without
  its model, so the model's own part shows;
* imggen: the README's command, verbatim: `sample.py --checkpoint RUN --brats CASES --out PRED
  --samples K --reduce mean` (its default fill: the clipped 3-D fill plus the model's correction,
  smoothed across slices and weighed as bench/brats_correction.py chose on val cases);
* `--variants [unsmoothed replace slice]`: other fills of imggen.volume_fill.fill_volume through Python:
  the unsmoothed full correction (the default before), the model's fill upsampled in place of the
  hole (method "replace", the fill before that), and the correction with the slice's 2-D fill as
  the model's classic-fill channel (channel "slice");
* `--compare RUN ...`: other models through the same README command (row "imggen, NAME"), each paired
  with RUN's fill per case and per hole slice (e.g. the regression-channel model against the README's);
* the regression alone, for a model with a regression channel (model.context_fill regress, issue 55):
  the model's own regressor fills each hole slice once, scored through the same pipeline: its
  correction of the clipped 3-D fill at full weight (smoothed 2 mm across slices, tapered at the
  edge, as imggen's), and its fill upsampled in place of the hole. imggen is paired with both.

Scores: `python -m imggen.eval brats` (imggen.eval.brats_eval.evaluate: SSIM on the organisers'
sagittal planes, PSNR with data range 1, inside -mask-healthy, intensities by the voided input's
percentiles) per case; per hole slice (axial) the same normalisation, PSNR over the slice's hole
voxels and the mean of its axial SSIM map there. Each method's paired difference to 3-D biharmonic
with a 95% bootstrap interval over cases and over hole slices (slices of one case are correlated:
the slice interval is the narrower, less cautious one), each imggen fill's paired difference to the
clipped 3-D fill (the model's part), and seconds per case.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import command_line, cpu_model, md_table, write_results  # noqa: E402

SHAPE = (240, 240, 155)  # the challenge's grid (1 mm)
FRACTIONS = {"test": (0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.065, 0.08),  # of the brain's volume
             "val": (0.005, 0.0075, 0.01, 0.0125)}
BASELINE = "biharmonic 3-D"
CLIPPED = "biharmonic 3-D, clipped"  # imggen's fill without its model: the 3-D fill in the model's intensities


def template_file() -> Path:
    """nilearn's 1 mm MNI152 T1 template, found without importing nilearn.datasets (it needs pandas)."""
    import importlib.util

    spec = importlib.util.find_spec("nilearn")
    if spec is None:
        raise SystemExit("bench/brats_native.py needs the MNI152 template in nilearn's wheel: pip install --no-deps nilearn")
    return Path(spec.submodule_search_locations[0]) / "datasets" / "data" / \
        "mni_icbm152_t1_tal_nlin_sym_09a_converted.nii.gz"


def template_volume(file=None) -> np.ndarray:
    """The template (RAS, 197x233x189 at 1 mm) centred on the 240x240x155 grid, float32."""
    import nibabel as nib

    v = np.asarray(nib.as_closest_canonical(nib.load(str(file or template_file()))).get_fdata(), np.float32)
    out = np.zeros(SHAPE, np.float32)
    x, y = (SHAPE[0] - v.shape[0]) // 2, (SHAPE[1] - v.shape[1]) // 2
    out[x:x + v.shape[0], y:y + v.shape[1]] = v[:, :, :SHAPE[2]]
    return out


def zone_hole(brain: np.ndarray, zone: tuple[int, int], fraction: float, seed) -> np.ndarray:
    """A tumour-shaped 3-D blob of `fraction` of the whole brain's voxels, every voxel inside axial
    slices zone[0]..zone[1]."""
    from imggen.datasets.brats_masks import blob

    inside = brain.copy()
    inside[:, :, : zone[0]] = False
    inside[:, :, zone[1] + 1:] = False
    return blob(inside, np.random.default_rng(seed), fraction * brain.sum() / inside.sum())


def write_case(folder: Path, name: str, truth: np.ndarray, hole: np.ndarray) -> Path:
    import nibabel as nib

    case = folder / name
    case.mkdir(parents=True, exist_ok=True)
    affine = np.diag([1.0, 1.0, 1.0, 1.0])
    for suffix, arr in (("t1n", truth), ("t1n-voided", np.where(hole, 0, truth)), ("mask", hole),
                        ("mask-healthy", hole)):
        arr = arr.astype(np.uint8) if arr.dtype == bool else arr.astype(np.float32)
        nib.save(nib.Nifti1Image(arr, affine), str(case / f"{name}-{suffix}.nii.gz"))
    return case


def make_cases(folder, split: str = "test", n: int | None = None, seed: int = 0, volume=None) -> list[dict]:
    """Case folders mni-<split>-NN under `folder` (kept when already there); their holes' facts."""
    from imggen.datasets.brats_demo import DEMO_TEST_Z, DEMO_VAL_Z

    folder = Path(folder)
    truth = template_volume() if volume is None else volume
    brain = truth > 0
    zone = {"test": DEMO_TEST_Z, "val": DEMO_VAL_Z}[split]
    out = []
    for i, f in enumerate(FRACTIONS[split][:n]):
        name = f"mni-{split}-{i:02d}"
        hole = zone_hole(brain, zone, f, [seed, 35, i, split == "test"])
        if not (folder / name / f"{name}-mask.nii.gz").exists():
            write_case(folder, name, truth, hole)
        zs = np.flatnonzero(hole.any((0, 1)))
        out.append({"name": name, "brain_share": float(hole.sum() / brain.sum()), "voxels": int(hole.sum()),
                    "z": [int(zs[0]), int(zs[-1])]})
    return out


# ------------------------------------------------------------------------------------------ methods
def classic(cases_dir: Path, pred: Path, three_d: bool) -> list[float]:
    """Biharmonic fills of every case (imggen.classic); seconds per case."""
    from imggen.classic import biharmonic, biharmonic_slices
    from imggen.volumes import find_cases, read_case

    pred.mkdir(parents=True, exist_ok=True)
    secs = []
    for case in find_cases(cases_dir):
        vol, mask = read_case(case)
        t = time.perf_counter()
        v, m = vol.to_ras(vol.values), vol.to_ras(mask)
        f = vol.from_ras(biharmonic(v, m, vol.spacing_ras()) if three_d else biharmonic_slices(v, m, axis=2))
        secs.append(time.perf_counter() - t)
        vol.write(np.where(mask, vol.to_raw(f), vol.raw), pred / f"{case.name}-t1n-inference.nii.gz")
    return secs


def cli_fill(run: str, cases_dir: Path, pred: Path, samples: int) -> list[float]:
    """The README's command, verbatim; seconds per case (the whole command over the cases)."""
    cmd = [sys.executable, "sample.py", "--checkpoint", run, "--brats", str(cases_dir), "--out", str(pred),
           "--samples", str(samples), "--reduce", "mean", "--no-progress"]
    t = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    n = len(list(pred.glob("*-t1n-inference.nii.gz")))
    return [(time.perf_counter() - t) / max(n, 1)] * n


VARIANTS = (  # --variants: (key, row, folder, fill_volume options)
    ("unsmoothed", "imggen, unsmoothed full correction (before)", "unsmoothed", dict(weight=1.0, smooth_mm=0.0)),
    ("replace", "imggen, fill replaced (earlier)", "replace", dict(method="replace")),
    ("slice", "imggen, 2-D fill channel", "slice", dict(channel="slice")))


REGRESSION = (  # a context_fill regress model's regressor alone: (row, folder, fill_volume options)
    ("regression alone, full correction", "regress", dict(source="regressor", weight=1.0)),
    ("regression alone, fill replaced", "regress-replace", dict(source="regressor", method="replace")))


def python_fill(model, cases_dir: Path, pred: Path, samples: int, **kw) -> list[float]:
    """imggen.volumes.inpaint_case of every case with fill_volume options `kw`; seconds per case."""
    from imggen.volumes import find_cases, inpaint_case

    pred.mkdir(parents=True, exist_ok=True)
    secs = []
    for case in find_cases(cases_dir):
        t = time.perf_counter()
        inpaint_case(model, case, pred, progress=False, samples=samples, reduce="mean", **kw)
        secs.append(time.perf_counter() - t)
    return secs


# ------------------------------------------------------------------------------------------- scores
def slice_scores(pred: np.ndarray, truth: np.ndarray, hole: np.ndarray, voided: np.ndarray) -> dict:
    """Per axial slice with a hole: PSNR (data range 1) and SSIM (axial map, the organisers' window
    and range) in the organisers' normalisation (imggen.eval.metrics.brats_inpainting_metrics)."""
    from skimage.metrics import structural_similarity

    from imggen.eval.metrics import _percentile_normalise

    p, g = _percentile_normalise(pred * hole, voided), _percentile_normalise(truth * hole, voided)
    rng = max(np.ptp(p), np.ptp(g)) or 1.0
    out = {"z": [], "psnr": [], "ssim": []}
    for k in np.flatnonzero(hole.any((0, 1))):
        m = hole[:, :, k]
        mse = float(np.mean((p[:, :, k][m] - g[:, :, k][m]) ** 2))
        smap = structural_similarity(g[:, :, k], p[:, :, k], data_range=rng, gaussian_weights=True, sigma=1.5,
                                     use_sample_covariance=False, full=True)[1]
        out["z"].append(int(k))
        out["psnr"].append(10 * np.log10(1.0 / max(mse, 1e-12)))
        out["ssim"].append(float(smap[m].mean()))
    return out


def score(method_dirs: dict, cases_dir: Path) -> dict:
    from imggen.eval.brats_eval import _read, evaluate
    from imggen.volumes import find_cases

    res = {}
    for name, pred in method_dirs.items():
        ev = evaluate(pred, cases_dir, pred / "brats_scores.csv", progress=False)
        per_slice = {"psnr": [], "ssim": []}
        for case in find_cases(cases_dir):
            n = case.name
            s = slice_scores(_read(pred / f"{n}-t1n-inference.nii.gz"), _read(case / f"{n}-t1n.nii.gz"),
                             _read(case / f"{n}-mask-healthy.nii.gz") > 0, _read(case / f"{n}-t1n-voided.nii.gz"))
            for k in per_slice:
                per_slice[k] += s[k]
        res[name] = {"cases": ev["cases"], "mean": ev["mean"], "ci95": ev["ci95"], "slices": per_slice}
    return res


def paired(a, b, seed: int = 0) -> dict:
    from imggen.eval.bpd import bootstrap_ci

    d = np.asarray(a, np.float64) - np.asarray(b, np.float64)
    lo, hi = bootstrap_ci(d, 2000, seed)
    return {"mean": float(d.mean()), "ci95": [float(lo), float(hi)], "better": float((d > 0).mean())}


def pairs_to(r: dict, base: dict) -> dict:
    """Paired differences r - base (organisers' PSNR and SSIM) per case and per hole slice."""
    metrics = ("psnr", "ssim")
    return {"per_case": {m: paired([c[m] for c in r["cases"]], [c[m] for c in base["cases"]]) for m in metrics},
            "per_slice": {m: paired(r["slices"][m], base["slices"][m]) for m in metrics}}


def _d(p) -> str:
    return f"{p['mean']:+.3f} ({p['ci95'][0]:+.3f} to {p['ci95'][1]:+.3f})"


def _diff_cells(pr: dict) -> list[str]:
    return [_d(pr["per_case"]["psnr"]), _d(pr["per_case"]["ssim"]), _d(pr["per_slice"]["psnr"]),
            _d(pr["per_slice"]["ssim"])]


def report(res: dict, secs: dict, cases: list[dict], args, budget: str,
           contrasts: list[tuple[str, str]] = ()) -> tuple[str, dict]:
    """The tables: every method against 3-D biharmonic, each imggen fill against the clipped 3-D fill (the
    model's part) and each (a, b) of `contrasts` as a - b."""
    base = res[BASELINE]
    rows, pairs, model_rows = [], {}, []
    for name, r in res.items():
        pairs[name] = pairs_to(r, base)
        rows.append([name, r["mean"]["psnr"], r["mean"]["ssim"],
                     *(["-"] * 4 if name == BASELINE else _diff_cells(pairs[name])), float(np.mean(secs[name]))])
        if name.startswith(("imggen", "regression")) and CLIPPED in res:  # the part over the same fill without it
            pairs[name]["vs_clipped"] = pairs_to(r, res[CLIPPED])
            model_rows.append([name, *_diff_cells(pairs[name]["vs_clipped"])])
    n_sl = len(base["slices"]["psnr"])
    head = ["method", "PSNR", "SSIM", f"PSNR - 3-D, per case (n={len(cases)})", "SSIM - 3-D, per case",
            f"PSNR - 3-D, per hole slice (n={n_sl})", "SSIM - 3-D, per hole slice", "s / case"]
    model_head = ["method", "PSNR - clipped 3-D, per case", "SSIM - clipped 3-D, per case",
                  "PSNR - clipped 3-D, per hole slice", "SSIM - clipped 3-D, per hole slice"]
    contrast = {f"{a} - {b}": pairs_to(res[a], res[b]) for a, b in contrasts}
    contrast_table = ["Paired differences between fills (a - b):", "",
                      md_table(["a - b", "PSNR, per case", "SSIM, per case", "PSNR, per hole slice",
                                "SSIM, per hole slice"], [[k, *_diff_cells(v)] for k, v in contrast.items()]),
                      ""] if contrast else []
    case_rows = [[c["name"], f"{c['brain_share']:.1%}", c["voxels"], f"{c['z'][0]}-{c['z'][1]}"] for c in cases]
    md = "\n".join([
        f"# BraTS fills at native resolution ({args.split} zone)", "",
        f"`{command_line('brats_native.py')}` on {cpu_model()}.", "",
        f"Models: {budget}. Fill: `sample.py --brats --samples {args.samples} --reduce mean`.", "",
        md_table(head, rows), "",
        "Organisers' metrics (`python -m imggen.eval brats`: sagittal SSIM planes, PSNR with data range 1), mean "
        "over cases; paired differences to 3-D biharmonic with 95% bootstrap intervals over cases and over hole "
        "slices (axial, the organisers' normalisation).", "",
        f"The model's part: each imggen (and regression) fill against `{CLIPPED}` (the same fill without the model: "
        "the 3-D fill of the volume clipped to its brain's 0.5-99.5 percentiles, the intensities the model reads).",
        "",
        md_table(model_head, model_rows), "", *contrast_table,
        md_table(["case", "hole (share of the brain)", "voxels", "axial slices"], case_rows)])
    return md, {"results": res, "paired": pairs, "contrasts": contrast, "seconds": secs, "cases": cases}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True, help="run folder of a brats64 (context) model")
    ap.add_argument("--split", default="test", choices=("test", "val"))
    ap.add_argument("--cases", type=int, help="the first N cases of the split (default all)")
    ap.add_argument("--samples", type=int, default=8, help="K draws per slice, reduced by their mean")
    ap.add_argument("--variants", nargs="*", choices=[v[0] for v in VARIANTS],
                    help="also these fills of imggen.volumes (Python; no names: all)")
    ap.add_argument("--compare", nargs="+", default=[], metavar="RUN",
                    help="other models' run folders, each filled by the same command and paired with --checkpoint's")
    ap.add_argument("--work", default="runs/brats_native")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--stem", default="brats_native")
    args = ap.parse_args(argv)
    if args.variants == []:
        args.variants = [v[0] for v in VARIANTS]
    from imggen.checkpoint import load_model
    from imggen.eval.run import load_run

    work = Path(args.work)
    cases_dir = work / f"cases-{args.split}"
    cases = make_cases(cases_dir, args.split, args.cases)
    print(f"{len(cases)} cases in {cases_dir}: holes of "
          + ", ".join(f"{c['brain_share']:.1%}" for c in cases) + " of the brain", flush=True)
    pred = work / f"pred-{args.split}"
    dirs = {"biharmonic 2-D": pred / "bih2d", BASELINE: pred / "bih3d", CLIPPED: pred / "bih3d-clipped",
            "imggen": pred / "imggen"}
    secs = {"biharmonic 2-D": classic(cases_dir, dirs["biharmonic 2-D"], False),
            BASELINE: classic(cases_dir, dirs[BASELINE], True)}
    model = load_model(args.checkpoint)
    secs[CLIPPED] = python_fill(model, cases_dir, dirs[CLIPPED], 1, weight=0.0)
    print("baselines written", flush=True)
    secs["imggen"] = cli_fill(args.checkpoint, cases_dir, dirs["imggen"], args.samples)
    contrasts = []
    for i, other in enumerate(args.compare):
        name = f"imggen, {Path(other).name}"
        dirs[name] = pred / f"compare-{i}"
        secs[name] = cli_fill(other, cases_dir, dirs[name], args.samples)
        contrasts.append(("imggen", name))
    for key, name, folder, kw in VARIANTS:
        if key in (args.variants or ()):
            dirs[name] = pred / folder
            secs[name] = python_fill(model, cases_dir, dirs[name], args.samples, **kw)
    if model.config.context_fill == "regress":
        for name, folder, kw in REGRESSION:
            dirs[name] = pred / folder
            secs[name] = python_fill(model, cases_dir, dirs[name], 1, **kw)
            contrasts.append(("imggen", name))
    from inpaint import budget as run_budget
    budgets = "; ".join(f"{Path(r).name}: {run_budget(load_run(r))}" for r in [args.checkpoint, *args.compare])
    md, data = report(score(dirs, cases_dir), secs, cases, args, budgets, contrasts)
    write_results(args.out, args.stem, data, md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
