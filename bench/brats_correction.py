"""How much of the model's correction to keep at 240x240x155, chosen on val cases (issue 35).

    python bench/brats_correction.py --checkpoint RUN [--split val] [--seeds 0,1] [--samples 8]
        [--work runs/brats_native] [--out bench/results] [--stem brats_correction]

`sample.py --brats` fills a hole with the native 3-D biharmonic fill of the percentile-clipped volume
plus the model's correction, drawn slice by slice (imggen.volumes). This script draws the K
corrections of every case once (`imggen.volume_fill.corrections`) and scores every setting of the grid
below with the organisers' metrics (`imggen.eval.metrics.brats_inpainting_metrics`: SSIM on
sagittal planes, PSNR with data range 1) through `imggen.volume_fill.apply_corrections`:

* smoothing across slices: Gaussian sigma SMOOTH_GRID mm along z, from hole voxels only
  (`smooth_across_slices`; 0 = none, the fill before);
* weight of the correction: WEIGHT_GRID (weight 0 = the clipped 3-D fill alone: no model).

Cases: bench/brats_native.py's, one set per seed (`--seeds 0,1`: the 4 val holes of seed 0, which
brats_native.py scores, and 4 more of seed 1). The chosen setting, imggen.volumes' SMOOTH_MM and
WEIGHT, is the one with the highest mean val SSIM (ties: PSNR). Each setting's paired difference to
the clipped 3-D fill (weight 0) and to the unsmoothed full correction (before) comes with a 95%
bootstrap interval over cases. `--split test` reports the test zone the same way (not for choosing).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from brats_native import make_cases, paired  # noqa: E402
from harness import command_line, cpu_model, md_table, write_results  # noqa: E402

SMOOTH_GRID = (0.0, 1.0, 2.0, 3.0, 5.0)  # mm
WEIGHT_GRID = (0.25, 0.5, 0.75, 1.0)


def case_scores(model, case: Path, samples: int, settings, channel: str = "auto") -> tuple[dict, float]:
    """{(smooth_mm, weight): organisers' scores} of one case folder; seconds of its draws."""
    from imggen.eval.brats_eval import _read
    from imggen.eval.metrics import brats_inpainting_metrics
    from imggen.volume_fill import apply_corrections, corrections
    from imggen.volumes import read_case

    vol, mask = read_case(case)
    v, m, sp = vol.to_ras(vol.values), vol.to_ras(mask), vol.spacing_ras()
    t = time.perf_counter()
    c = corrections(model, v, m, samples=samples, spacing=sp, file=vol.file, channel=channel)
    secs = time.perf_counter() - t
    n = case.name
    gt, healthy = _read(case / f"{n}-t1n.nii.gz"), _read(case / f"{n}-mask-healthy.nii.gz") > 0
    voided = _read(case / f"{n}-t1n-voided.nii.gz")
    out = {}
    for smooth, weight in settings:
        fill = apply_corrections(c, m, weight=weight, smooth_mm=smooth)[0]
        pred = np.where(mask, vol.to_raw(vol.from_ras(fill)), vol.raw).astype(np.float64)
        if vol.scaling:
            pred = pred * vol.scaling[0] + vol.scaling[1]
        out[(smooth, weight)] = brats_inpainting_metrics(pred, gt, healthy, voided)
    out["grid"] = grid_psnr(model, c, vol.to_ras(gt), m)
    return out, secs


def grid_psnr(model, c, truth_ras: np.ndarray, m: np.ndarray) -> dict:
    """At the model's grid, over the pixels it fills (the hole slices resized as the model reads them): PSNR
    (peak 255, the model's intensities) of the clipped 3-D fill and of the mean of the K draws (the 3-D fill
    plus the draws' mean correction, resized back to the grid): does the model beat its own channel there?"""
    from imggen.datasets.brats import ras_slice_to_image
    from imggen.volume_fill import _down, slice_inputs

    cfg = model.config
    truth = np.clip((truth_ras - c.lo) / (c.hi - c.lo), 0.0, 1.0) * 255.0
    sse, n = {"base": 0.0, "model": 0.0}, 0
    for j, k in enumerate(c.ks):
        unknown = slice_inputs(model, truth[:, :, k], m[:, :, k])[1]
        corr = np.zeros(m.shape[:2])
        corr[c.box] = c.draws[..., j].mean(0)
        t, b, d = (_down(ras_slice_to_image(a), cfg.height, cfg.width) for a in (truth[:, :, k], c.base[:, :, k], corr))
        sse["base"] += float(((b - t)[unknown] ** 2).sum())
        sse["model"] += float(((b + d - t)[unknown] ** 2).sum())
        n += int(unknown.sum())
    return {k: 10 * np.log10(255.0 ** 2 * n / max(v, 1e-12)) for k, v in sse.items()}


def report(scores: dict, settings: list, names: list, secs: list, grid: list, args) -> tuple[str, dict]:
    """The markdown table of every setting (mean scores, paired differences) and the JSON data."""
    from imggen.volume_fill import SMOOTH_MM, WEIGHT

    def col(k, metric):
        return [s[metric] for s in scores[k]]

    def d(p):
        return f"{p['mean']:+.3f} ({p['ci95'][0]:+.3f} to {p['ci95'][1]:+.3f})"
    gb, gm = [g["base"] for g in grid], [g["model"] for g in grid]
    best = max(settings[1:], key=lambda k: (np.mean(col(k, "ssim")), np.mean(col(k, "psnr"))))
    rows = []
    for k in settings:
        vs0 = [paired(col(k, m), col((0.0, 0.0), m)) for m in ("psnr", "ssim")]
        vs1 = [paired(col(k, m), col((0.0, 1.0), m)) for m in ("psnr", "ssim")]
        label = "clipped 3-D fill (no model)" if k == (0.0, 0.0) else f"{k[0]:g} mm, weight {k[1]:g}"
        label += " (before)" if k == (0.0, 1.0) else ""
        label += " **chosen**" if args.split == "val" and k == best else ""
        label += " (default)" if k == (SMOOTH_MM, WEIGHT) else ""
        rows.append([label, f"{np.mean(col(k, 'psnr')):.2f}", f"{np.mean(col(k, 'ssim')):.4f}", d(vs0[0]), d(vs0[1]),
                     d(vs1[0]), d(vs1[1])])
    head = ["z smoothing, weight", "PSNR", "SSIM", "PSNR - clipped 3-D", "SSIM - clipped 3-D", "PSNR - before",
            "SSIM - before"]
    md = "\n".join([
        f"# How much of the model's correction to keep ({args.split}, {len(names)} cases at 240x240x155, "
        f"channel {args.channel})", "",
        f"`{command_line('brats_correction.py')}` on {cpu_model()}; K = {args.samples} draws per slice, drawn once "
        f"per case ({np.mean(secs):.0f} s a case), every setting scored with the organisers' metrics; paired 95% "
        f"bootstrap intervals over cases.", "",
        md_table(head, rows), "",
        (f"Chosen on val (highest mean SSIM): {best[0]:g} mm, weight {best[1]:g}; imggen.volume_fill uses "
         f"SMOOTH_MM = {SMOOTH_MM:g}, WEIGHT = {WEIGHT:g}." if args.split == "val" else
         f"imggen.volume_fill uses SMOOTH_MM = {SMOOTH_MM:g}, WEIGHT = {WEIGHT:g} (chosen on val)."), "",
        f"At the model's own grid (the pixels it fills, PSNR with peak 255 in its intensities): the clipped 3-D "
        f"fill resized {np.mean(gb):.2f} dB, the mean of the K draws {np.mean(gm):.2f} dB; draws - fill "
        f"{d(paired(gm, gb))} dB per case.", "",
        "Cases: " + ", ".join(names)])
    data = {"cases": names, "seconds": secs, "best": list(best), "grid": grid,
            "scores": {f"{k[0]:g},{k[1]:g}": scores[k] for k in settings}}
    return md, data


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True, help="run folder of a brats64 (context) model")
    ap.add_argument("--split", default="val", choices=("val", "test"))
    ap.add_argument("--seeds", default="0,1", help="case sets (brats_native.make_cases seeds)")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--channel", default="auto", choices=("auto", "volume", "grid", "slice"),
                    help="the model's classic-fill channel (imggen.volume_fill.corrections)")
    ap.add_argument("--work", default="runs/brats_native")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--stem", default="brats_correction")
    args = ap.parse_args(argv)
    from imggen.checkpoint import load_model
    from imggen.volumes import find_cases

    model = load_model(args.checkpoint)
    settings = [(0.0, 0.0)] + [(s, w) for s in SMOOTH_GRID for w in WEIGHT_GRID]
    scores, names, secs, grid = {k: [] for k in settings}, [], [], []
    for seed in (int(s) for s in args.seeds.split(",")):
        folder = Path(args.work) / (f"cases-{args.split}" + (f"-s{seed}" if seed else ""))
        make_cases(folder, args.split, seed=seed)
        for case in find_cases(folder):
            res, t = case_scores(model, case, args.samples, settings, args.channel)
            names.append(f"{case.name} (seed {seed})")
            secs.append(t)
            grid.append(res["grid"])
            for k in settings:
                scores[k].append(res[k])
            print(f"{names[-1]}: drawn in {t:.0f} s; clipped 3-D {res[(0.0, 0.0)]['psnr']:.2f} / "
                  f"{res[(0.0, 0.0)]['ssim']:.4f}, before {res[(0.0, 1.0)]['psnr']:.2f} / "
                  f"{res[(0.0, 1.0)]['ssim']:.4f}", flush=True)

    md, data = report(scores, settings, names, secs, grid, args)
    write_results(args.out, f"{args.stem}_{args.split}", data, md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
