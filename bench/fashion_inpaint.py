"""Fashion-MNIST inpainting on held-out test images with big holes (issue 46, item 4).

    python bench/fashion_inpaint.py --context runs/fashion-inpaint --regress runs/fashion-regress/regress.pt
        [--num 300] [--samples 8] [--seed 0] [--out bench/results] [--stem fashion_inpaint]

Holes (`garment_holes`): fixed by --seed, one per test image, alternately lumpy blobs and rectangles
(imggen.inpainting.context's training shapes, unioned until they cover 25-45% of the garment, i.e.
of the pixels above 8 grey levels); never shown to any model in training (the test split).

Methods: 2-D biharmonic (imggen.classic, skimage's equations: the classic fill a user would pick);
the regression baseline (imggen.inpainting.regress: the context encoder with a pixel head, one
forward pass), when --regress is given; the context model (`--task inpaint`): one sample and the
per-pixel mean of K samples (the same K draws).

Scores: PSNR and SSIM inside the hole per image (imggen.eval.psnr / ssim with the mask), each
method's paired difference to biharmonic with a 95% bootstrap interval over images. Writes STEM.md,
STEM.json and STEM_grid.png (voided | biharmonic | one sample | mean of K | truth) under --out.
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
from inpaint import biharmonic, paired  # noqa: E402  (2-D biharmonic per image; paired bootstrap)

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
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--stem", default="fashion_inpaint")
    a = ap.parse_args(argv)
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
    one, mean = "context model, 1 sample", f"context model, mean of {a.samples}"
    fills[one], secs[one] = draws[:, 0], took / a.samples
    fills[mean], secs[mean] = np.clip(np.round(draws.astype(np.float64).mean(1)), 0, 255).astype(np.uint8), took
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
    versus = []  # the mean of K against each regression baseline, paired over the same images
    for name in (k for k in per if k.startswith("regression")):
        dp, ds = paired(per[mean][0], per[name][0]), paired(per[mean][1], per[name][1])
        data["methods"][mean][f"vs {name}"] = {"psnr": dp, "ssim": ds}
        versus.append([f"{mean} - {name}", "{:+.2f} ({:+.2f} to {:+.2f})".format(dp["mean"], *dp["ci95"]),
                       "{:+.3f} ({:+.3f} to {:+.3f})".format(ds["mean"], *ds["ci95"]), f"{dp['better']:.0%}"])
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
        *([md_table(["paired difference", "PSNR dB", "SSIM", "images better (PSNR)"], versus), ""] if versus else [])])
    out = out_dir(a.out)
    write_results(out, a.stem, data, md)
    grid(str(out / f"{a.stem}_grid.png"), [voided, fills[BASELINE], fills[one], fills[mean], truth])
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
