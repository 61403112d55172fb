"""Inpainting side by side: classic biharmonic inpainting vs an unconditional model (best of R by
likelihood) vs a context model (one sample, and the per-pixel mean of K), on the same masks.

    python bench/inpaint.py --uncond runs/brats-uncond --context runs/brats-inpaint [--data brats-demo]
        [--split test] [--rank 8] [--samples 8] [--limit N] [--out bench/results] [--threads N]

Scores masked PSNR and masked SSIM (imggen.eval.psnr / ssim: MSE and skimage's SSIM map over the
mask pixels) per image, with 95% percentile-bootstrap intervals over images, and seconds per image.
The masks are the data's own (brats-demo: its lesion-like masks). Writes inpaint.md (the table and
each model's training budget), inpaint.json and inpaint_grid.png (per image: voided | biharmonic |
unconditional | context | context mean | truth) under --out.
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

from harness import command_line, cpu_model, md_table, write_results  # noqa: E402

from imggen.eval import psnr, ssim  # noqa: E402
from imggen.eval.bpd import bootstrap_ci  # noqa: E402
from imggen.eval.run import load_data, load_run, read_log  # noqa: E402
from imggen.images import image_scale, save_grid  # noqa: E402
from imggen.sampling import inpaint_images  # noqa: E402


def biharmonic(images: np.ndarray, masks: np.ndarray) -> np.ndarray:
    from skimage.restoration import inpaint_biharmonic

    out = images.copy()
    for i, (img, m) in enumerate(zip(images, masks)):
        f = inpaint_biharmonic(img.transpose(1, 2, 0).astype(np.float64) / 255.0, m, channel_axis=-1)
        out[i] = np.clip(np.round(f.transpose(2, 0, 1) * 255.0), 0, 255).astype(np.uint8)
        out[i][:, ~m] = img[:, ~m]
    return out


def scores(filled: np.ndarray, truth: np.ndarray, masks: np.ndarray, seconds: float, seed: int) -> dict:
    p = np.array([psnr(f, t, mask=m[None]) for f, t, m in zip(filled, truth, masks)])
    s = np.array([ssim(f, t, mask=m[None]) for f, t, m in zip(filled, truth, masks)])
    return {"psnr": float(p.mean()), "psnr_ci": bootstrap_ci(p, 1000, seed), "ssim": float(s.mean()),
            "ssim_ci": bootstrap_ci(s, 1000, seed), "s_per_image": seconds / len(filled),
            "per_image_psnr": p.tolist(), "per_image_ssim": s.tolist()}


def budget(run) -> str:
    """Steps, wall time and throughput of a run, from its config and log."""
    log = read_log(run.run_dir)
    tps = [r["tokens_per_s"] for r in log if "tokens_per_s" in r and r["step"] <= run.step]  # up to this checkpoint
    cfg = run.cfg
    secs = sum(cfg.train.batch_size * cfg.model.seq_len * cfg.train.log_every / t for t in tps) if tps else None
    m = cfg.model
    return (f"{run.step} steps x batch {cfg.train.batch_size}, {m.height}x{m.width}, dim {m.dim}, {m.layers} layers, "
            f"attention {m.attention}, context {m.context}"
            + (f", about {secs / 60:.0f} min of training" if secs else ""))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--uncond", required=True, help="run directory of an unconditional model")
    ap.add_argument("--context", required=True, help="run directory of a context (--task inpaint) model")
    ap.add_argument("--data", help="data spec (default: the context model's)")
    ap.add_argument("--split", default="test")
    ap.add_argument("--rank", type=int, default=8, help="candidates per image for the unconditional model")
    ap.add_argument("--samples", type=int, default=8, help="samples averaged per image for the context mean")
    ap.add_argument("--limit", type=int, help="first N images with a non-empty mask")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--threads", type=int)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    ctx_run, unc_run = load_run(args.context), load_run(args.uncond)
    for run in (ctx_run, unc_run):
        run.step = run.step or run.cfg.train.steps
    if ctx_run.cfg.model.shape != unc_run.cfg.model.shape:
        raise SystemExit("the two models must share one image size")
    data = load_data(ctx_run.cfg, args.data)
    images, masks = data.split(args.split), np.asarray(data.masks[args.split]).astype(bool)[:, 0]
    keep = np.flatnonzero(masks.reshape(len(masks), -1).any(1))[: args.limit]
    images, masks = images[keep], masks[keep]
    print(f"{len(images)} {args.split} images, {masks.mean():.1%} of pixels masked on average", flush=True)

    methods, fills = {}, {}

    def run_method(name, fn):
        t0 = time.perf_counter()
        fills[name] = fn()
        methods[name] = scores(fills[name], images, masks, time.perf_counter() - t0, args.seed)
        print(f"{name}: masked PSNR {methods[name]['psnr']:.2f} dB, SSIM {methods[name]['ssim']:.4f}, "
              f"{methods[name]['s_per_image']:.2f} s/image", flush=True)

    ti, tm = torch.from_numpy(images), torch.from_numpy(masks)
    run_method("biharmonic", lambda: biharmonic(images, masks))
    run_method(f"unconditional, best of {args.rank}",
               lambda: inpaint_images(unc_run.model, ti, tm, rank=args.rank, seed=args.seed, progress=True)[0][:, 0].numpy())
    run_method("context, 1 sample",
               lambda: inpaint_images(ctx_run.model, ti, tm, seed=args.seed, progress=True)[0][:, 0].numpy())
    run_method(f"context, mean of {args.samples}",
               lambda: inpaint_images(ctx_run.model, ti, tm, samples=args.samples, reduce="mean", seed=args.seed,
                                      progress=True)[0][:, 0].numpy())

    os.makedirs(args.out, exist_ok=True)
    voided = images.copy()
    voided[np.broadcast_to(masks[:, None], images.shape)] = 128
    rows = [voided, *fills.values(), images]
    grid = np.stack(rows, 1)[:8].reshape(-1, *images.shape[1:])
    save_grid(grid, os.path.join(args.out, "inpaint_grid.png"), nrow=len(rows), scale=image_scale(images.shape[-1]))
    cmd = command_line("inpaint.py", argv)
    machine = f"{cpu_model()}, {os.cpu_count()} CPUs, torch {torch.__version__}"
    lines = [f"`{cmd}` ({time.strftime('%Y-%m-%d')}; {machine}; {torch.get_num_threads()} threads)", "",
             f"{len(images)} {args.split} images of {data.info.get('source', args.data)}, their own masks "
             f"({masks.mean():.1%} of pixels). Masked PSNR / SSIM with 95% bootstrap intervals over images.", "",
             md_table(["method", "masked PSNR (dB)", "masked SSIM", "s / image"],
                      [[name, f"{r['psnr']:.2f} ({r['psnr_ci'][0]:.2f}-{r['psnr_ci'][1]:.2f})",
                        f"{r['ssim']:.4f} ({r['ssim_ci'][0]:.4f}-{r['ssim_ci'][1]:.4f})", f"{r['s_per_image']:.2f}"]
                       for name, r in methods.items()])]
    ctx = methods[f"context, mean of {args.samples}"]
    lines += ["", "Paired per-image differences (context mean minus the other; 95% bootstrap interval; share of "
              "images where the context mean is better):", ""]
    for name in list(methods)[:2]:
        for metric in ("psnr", "ssim"):
            d = np.array(ctx[f"per_image_{metric}"]) - np.array(methods[name][f"per_image_{metric}"])
            lo, hi = bootstrap_ci(d, 1000, args.seed)
            lines.append(f"- vs {name}, {metric.upper()}: {d.mean():+.4g} ({lo:+.4g} to {hi:+.4g}), "
                         f"better on {(d > 0).mean():.0%}")
    lines += ["", f"- unconditional model: {budget(unc_run)} ({unc_run.path})",
              f"- context model: {budget(ctx_run)} ({ctx_run.path})",
              "", "Grid (inpaint_grid.png), per image: voided | " + " | ".join(methods) + " | truth"]
    write_results(args.out, "inpaint", {"command": cmd, "methods": methods, "n_images": len(images)},
                  "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
