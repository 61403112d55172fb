"""Fashion-MNIST inpainting on held-out test images with big holes (issue 46, item 4).

    python bench/fashion_inpaint.py --context runs/fashion-inpaint --regress runs/fashion-regress/regress.pt
        [--num 300] [--samples 8] [--means 8 32] [--realism] [--seed 0] [--out bench/results] [--stem fashion_inpaint]

Holes (`garment_holes`): fixed by --seed, one per test image, alternately lumpy blobs and rectangles
(imggen.inpainting.context's training shapes, unioned until they cover 25-45% of the garment, i.e.
of the pixels above 8 grey levels); never shown to any model in training (the test split).

Methods: 2-D biharmonic (imggen.classic, skimage's equations: the classic fill a user would pick);
the regression baseline (imggen.inpainting.regress: the context encoder with a pixel head, one
forward pass), when --regress is given; the context model (`--task inpaint`): one sample and the
per-pixel mean of K samples (the same K draws; --means k1 k2 ...: the mean of the first k of them, a row each).

Scores: PSNR and SSIM inside the hole per image (imggen.eval.psnr / ssim with the mask), each
method's paired difference to biharmonic with a 95% bootstrap interval over images. --realism adds how real
the filled images look (imggen.eval.realism, the classifier trained on the training split): the Frechet
distance of each method's filled images to test images that are not among the scored ones (the truth's row
is then the real-against-real floor at this many images), the classifier's accuracy on them against the true
labels, its confidence, and the sharpness inside the holes (gradient magnitude over the truth's); one sample
against each other fill paired (the same bootstrap resamples of images). Writes STEM.md,
STEM.json and STEM_grid.png (voided | biharmonic | the last regression | one sample | the last mean | truth)
under --out.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import command_line, git_commit, machine, machine_line, md_table, out_dir, write_results  # noqa: E402
from inpaint import biharmonic, paired, sharpness  # noqa: E402  (2-D biharmonic per image; paired bootstrap)

from imggen.eval import psnr, ssim  # noqa: E402

BASELINE = "biharmonic 2-D"
COVER = (0.25, 0.45)
GARMENT = 8  # grey levels above which a pixel is garment (the background is 0)


def garment_holes(images: np.ndarray, seed: int = 0, cover=COVER) -> np.ndarray:
    """bool (N, H, W): image i's hole, blobs for even i and rectangles for odd i, each shape drawn
    anywhere and added until the hole covers `cover`[0] of the garment; a union that overshoots
    cover[1] is drawn again (the last try is kept when 200 fail)."""
    from imggen.inpainting.context import KINDS

    n, _, h, w = images.shape
    rng = np.random.default_rng([seed, 46])
    out = np.zeros((n, h, w), bool)
    for i in range(n):
        garment = images[i].max(0) > GARMENT
        area = max(1, int(garment.sum()))
        for _ in range(200):
            m = np.zeros((h, w), bool)
            while (m & garment).sum() < cover[0] * area:
                m |= KINDS["blob" if i % 2 == 0 else "rect"](h, w, rng)
            if (m & garment).sum() <= cover[1] * area and not m.all():
                break
        out[i] = m
    return out


def regression(path: str, images: np.ndarray, masks: np.ndarray) -> tuple[np.ndarray, str]:
    """The regressor's fills and its training budget, "S steps, M min" (saved with it)."""
    from imggen.inpainting.regress import load, predict

    model, info = load(path)
    with torch.no_grad():
        return predict(model, images, masks), f"{info['steps']} steps, {info['seconds'] / 60:.0f} min"


def context_fills(run: str, images: np.ndarray, masks: np.ndarray, k: int, seed: int) -> np.ndarray:
    """uint8 (N, K, C, H, W): K samples of each hole from the context model (known pixels exact)."""
    import imggen
    from imggen.sampling import inpaint_images

    model = imggen.load_model(run).eval()
    with torch.no_grad():
        out = [inpaint_images(model, torch.from_numpy(images[i:i + 16]), torch.from_numpy(masks[i:i + 16]),
                              num=k, seed=seed + i)[0].numpy() for i in range(0, len(images), 16)]
    return np.concatenate(out)


def scores(filled: np.ndarray, truth: np.ndarray, masks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """PSNR and SSIM inside each image's hole."""
    p = np.array([psnr(f, t, mask=m[None]) for f, t, m in zip(filled, truth, masks)])
    s = np.array([ssim(f, t, mask=m[None]) for f, t, m in zip(filled, truth, masks)])
    return p, s


def fill_realism(fills: dict, truth: np.ndarray, masks: np.ndarray, data: str, pairs: list,
                 resamples: int = 200, seed: int = 0) -> tuple[dict, dict, list]:
    """({method: realism row}, {"a - b": paired Frechet difference}, [start, stop) of the reference images) of
    the filled images, the first N test images, against the first half of the test images after them."""
    from imggen.eval.realism import RealismScore, features, frechet, realism_for

    base, test = realism_for(data, seed)
    score = RealismScore(base.model, test["images"][len(truth):])
    labels = test["labels"][: len(truth)]
    both = {k: features(base.model, v) for k, v in fills.items()}  # (features, class probabilities), once a set
    rows = {k: {**score.score_features(*both[k], labels, resamples, seed), "sharpness": sharpness(v, truth, masks)}
            for k, v in fills.items()}
    feats = {k: f for k, (f, _) in both.items()}
    rng, diffs = np.random.default_rng(seed), {}
    idx = [rng.integers(0, len(truth), len(truth)) for _ in range(resamples)]
    for a, b in pairs:  # one set of resamples for every pair: the difference's spread, not each one's
        est = frechet(feats[a], score.ref) - frechet(feats[b], score.ref)
        sd = float(np.std([frechet(feats[a][i], score.ref) - frechet(feats[b][i], score.ref) for i in idx], ddof=1))
        diffs[f"{a} - {b}"] = {"mean": est, "ci95": [est - 1.96 * sd, est + 1.96 * sd]}
    rest = len(test["images"]) - len(truth)
    return rows, diffs, [len(truth), len(truth) + rest // 2]


def grid(path: str, columns: list[np.ndarray], rows: int = 8, scale: int = 4) -> None:
    """PNG: one row per image, one column per array (uint8 (N, C, H, W), grey), 2 px gaps."""
    from PIL import Image

    n, h, w = min(rows, len(columns[0])), columns[0].shape[2], columns[0].shape[3]
    canvas = np.full((n * (h + 2), len(columns) * (w + 2)), 255, np.uint8)
    for c, col in enumerate(columns):
        for r in range(n):
            canvas[r * (h + 2): r * (h + 2) + h, c * (w + 2): c * (w + 2) + w] = col[r, 0]
    Image.fromarray(canvas).resize((canvas.shape[1] * scale, canvas.shape[0] * scale), Image.NEAREST).save(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", required=True, help="the context model's run folder (--task inpaint)")
    ap.add_argument("--regress", nargs="+", default=[],
                    help="regression baselines' regress.pt (bench/train_regress.py): a row each, named by its budget")
    ap.add_argument("--data", default="fashion-mnist")
    ap.add_argument("--num", type=int, default=300, help="test images (the first N; default 300)")
    ap.add_argument("--samples", type=int, default=8, help="K draws per hole (default 8)")
    ap.add_argument("--means", type=int, nargs="+", default=None,
                    help="rows for the mean of the first k draws, for each k (each <= K; default: K)")
    ap.add_argument("--realism", action="store_true",
                    help="score how real the filled images look (imggen.eval.realism; needs the data's labels)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--stem", default="fashion_inpaint")
    a = ap.parse_args(argv)
    means = sorted(set(a.means or [a.samples]))
    if means[0] < 2 or means[-1] > a.samples:
        ap.error(f"--means takes k from 2 to --samples ({a.samples}); got {' '.join(map(str, a.means))}")
    from imggen.datasets import load_dataset

    truth = np.ascontiguousarray(load_dataset(a.data, height=28, width=28, channels=1).test[: a.num])
    masks = garment_holes(truth, a.seed)
    voided = np.where(masks[:, None], 0, truth).astype(np.uint8)
    fills, secs = {}, {}
    t = time.time()
    fills[BASELINE], secs[BASELINE] = biharmonic(truth, masks), time.time() - t
    for path in a.regress:
        t = time.time()
        filled, budget = regression(path, voided, masks)
        name = f"regression (one pass), {budget}"
        fills[name], secs[name] = filled, time.time() - t
    t = time.time()
    draws = context_fills(a.context, voided, masks, a.samples, a.seed)
    took = time.time() - t
    one = "context model, 1 sample"
    fills[one], secs[one] = draws[:, 0], took / a.samples
    for k in means:
        name = f"context model, mean of {k}"
        fills[name] = np.clip(np.round(draws[:, :k].astype(np.float64).mean(1)), 0, 255).astype(np.uint8)
        secs[name] = took * k / a.samples
    mean = f"context model, mean of {means[-1]}"
    per = {k: scores(v, truth, masks) for k, v in fills.items()}
    base_p, base_s = per[BASELINE]
    table, data = [], {"n_images": len(truth), "samples": a.samples, "hole_cover": [], "methods": {}}
    garment = truth.max(1) > GARMENT
    cover = (masks & garment).sum((1, 2)) / np.maximum(1, garment.sum((1, 2)))
    for name, (p, s) in per.items():
        dp = paired(p, base_p) if name != BASELINE else None
        ds = paired(s, base_s) if name != BASELINE else None
        ci = lambda d, f: "-" if d is None else f.format(d["mean"], *d["ci95"])  # noqa: E731
        table.append([name, f"{p.mean():.2f}", ci(dp, "{:+.2f} ({:+.2f} to {:+.2f})"),
                      f"{s.mean():.3f}", ci(ds, "{:+.3f} ({:+.3f} to {:+.3f})"),
                      "-" if dp is None else f"{dp['better']:.0%}", f"{secs[name] / len(truth) * 1000:.1f}"])
        data["methods"][name] = {"psnr": p.tolist(), "ssim": s.tolist(), "vs_biharmonic_psnr": dp,
                                 "vs_biharmonic_ssim": ds, "seconds": secs[name]}
    data["hole_cover"] = cover.tolist()
    versus = []  # each mean of k against each regression baseline, paired over the same images
    for mk, name in ((m, r) for m in per if m.startswith("context model, mean") for r in per if r.startswith("regr")):
        dp, ds = paired(per[mk][0], per[name][0]), paired(per[mk][1], per[name][1])
        data["methods"][mk][f"vs {name}"] = {"psnr": dp, "ssim": ds}
        versus.append([f"{mk} - {name}", "{:+.2f} ({:+.2f} to {:+.2f})".format(dp["mean"], *dp["ci95"]),
                       "{:+.3f} ({:+.3f} to {:+.3f})".format(ds["mean"], *ds["ci95"]), f"{dp['better']:.0%}"])
    real = []
    if a.realism:
        fills["truth"] = truth
        rows, diffs, ref = fill_realism(fills, truth, masks, a.data, [(one, k) for k in fills if k != one])
        data["realism"], data["realism_paired"], data["realism_reference"] = rows, diffs, ref
        real = [md_table(["filled images", "Frechet (95%)", "accuracy", "confidence", "class entropy bits",
                          "sharpness"],
                         [[k, "{:.2f} ({:.2f}-{:.2f})".format(r["frechet"], *r["frechet_ci95"]), f"{r['accuracy']:.1%}",
                           f"{r['confidence']:.3f}", f"{r['class_entropy']:.2f}", f"{r['sharpness']:.2f}"]
                          for k, r in rows.items()]), "",
                md_table(["paired Frechet difference", "mean (95%)"],
                         [[k, "{:+.2f} ({:+.2f} to {:+.2f})".format(d["mean"], *d["ci95"])] for k, d in diffs.items()]),
                ""]
    m = machine(gpu=False)
    md = "\n".join([
        f"# Fashion-MNIST inpainting: {len(truth)} official test images, holes over 25-45% of the garment", "",
        f"`{command_line('fashion_inpaint.py', argv)}` at {git_commit()}, {time.strftime('%Y-%m-%d')}; "
        f"{machine_line(m)}.", "",
        f"Holes: blobs (even images) and rectangles (odd), covering {cover.mean():.0%} of the garment on average "
        f"({cover.min():.0%}-{cover.max():.0%}) and {masks.mean():.0%} of the image. PSNR / SSIM inside the hole "
        "per image; paired differences to biharmonic with 95% bootstrap intervals over images.", "",
        md_table(["method", "PSNR dB", "- biharmonic (paired)", "SSIM", "- biharmonic (paired)",
                  "images better", "ms / image"], table), "",
        *([md_table(["paired difference", "PSNR dB", "SSIM", "images better (PSNR)"], versus), ""] if versus else []),
        *([f"Realism of the {len(truth)} filled images (imggen.eval.realism): the Frechet distance in the classifier's "
           f"features to test images {ref[0]}-{ref[1] - 1} (not among the scored "
           "ones; the truth's row is the real-against-real floor at this size), the classifier's accuracy against "
           "the true labels, its confidence and the spread of its classes; sharpness = the mean gradient magnitude "
           "in the holes over the truth's. Paired differences use the same bootstrap resamples of images.", "",
           *real] if real else [])])
    out = out_dir(a.out)
    write_results(out, a.stem, data, md)
    regs = [fills[k] for k in fills if k.startswith("regression")][-1:]  # the longest-trained, listed last
    grid(str(out / f"{a.stem}_grid.png"), [voided, fills[BASELINE], *regs, fills[one], fills[mean], truth])
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
