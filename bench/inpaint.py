"""Inpainting side by side on held-out test volumes with tumour-sized 3-D holes (issue 28).

    python bench/inpaint.py --context runs/b64ctx --regress runs/b64reg/regress.pt [MORE.pt] [--uncond RUN --rank 8]
        [--context25 RUN] [--data brats-demo] [--samples 8] [--out bench/results] [--stem inpaint64]
        [--work runs/inpaint64] [--seed 0] [--threads N]

Test volumes: the test split's slices grouped by case (brats-demo: the held-out slab, >= 10 slices
from every training slice) and variant, stacked in z order; the hole of each volume is one of the
data's seeded challenge-like 3-D blobs (`demo_mask_bank`: 1-15% of the brain) that meets every slice
of the slab, cut to it, so the hole is one coherent 3-D region as in the challenge (`test_volumes`).

Methods: biharmonic slice by slice (2-D) and on the whole volume at once (3-D; both imggen.classic,
skimage's equations); the regression-only encoder (imggen.inpainting.regress: the challenge winners'
recipe); the context model, one sample and the per-pixel mean of K draws (the same K draws: the
1-sample time is their time / K); optionally the unconditional model, best of R by likelihood, and
a 2.5-D context model (`--context25`, model.context_slices = s: each slice also sees the voided slices
z-s..z+s of its volume with their holes, a slice outside the volume zero and all unknown), one sample
and the mean of K, with its paired difference to the 2-D context model per slice.

Scores: masked PSNR / SSIM per hole slice (imggen.eval.psnr / ssim), each method's paired
difference to 3-D biharmonic with a 95% bootstrap interval over slices; the organisers' 3-D
protocol per volume (case folders + predictions in the challenge layout under --work, scored by
imggen.eval.brats_eval.evaluate, i.e. `python -m imggen.eval brats`; SSIM on axial planes: the
slab is thinner than the 11-voxel window across the organisers' sagittal planes); seconds per
volume; for the context model, whether the spread of its draws tracks its error (per-slice std vs
per-slice RMSE, and per pixel), and the sharpness of each fill (mean gradient magnitude in the hole
over the truth's). Writes STEM.md, STEM.json and STEM_grid.png (voided | biharmonic 3-D |
regression | context 1 sample | context mean | truth) under --out.
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

BASELINE = "biharmonic 3-D"


# ------------------------------------------------------------------------------------ test volumes
def test_volumes(data, bank: list[np.ndarray], bank_z: np.ndarray, split: str = "test", seed: int = 0) -> list[dict]:
    """The split's slices grouped by (case, variant) into volumes: {"name", "images" uint8 (Z, C, H, W),
    "masks" bool (Z, H, W), "z"}; each hole is one 3-D bank mask (image orientation (H, W, Zbank),
    slice i at z = bank_z[i]) cut to the volume's slices, drawn at random among those meeting every
    one of them (else the one meeting most); flipped with a left-right flipped variant."""
    meta = data.meta
    cases, zs = np.asarray(meta["case"][split]), np.asarray(meta["slice"][split])
    variants = np.asarray(meta.get("variant", {}).get(split, ["orig"] * len(cases)))
    images = data.split(split)
    out = []
    for n, (case, var) in enumerate(dict.fromkeys(zip(cases.tolist(), variants.tolist()))):
        sel = np.flatnonzero((cases == case) & (variants == var))
        sel = sel[np.argsort(zs[sel])]
        at = [int(np.flatnonzero(bank_z == z)[0]) for z in zs[sel]]
        meets = np.array([sum(m[:, :, i].any() for i in at) for m in bank])
        ok = np.flatnonzero(meets == len(at))
        pick = ok[np.random.default_rng([seed, 28, 2, n]).integers(len(ok))] if len(ok) else int(meets.argmax())
        masks = np.stack([bank[pick][:, :, i] for i in at])
        if var == "flip":
            masks = masks[:, :, ::-1]
        out.append({"name": f"{case}-{var}", "images": images[sel], "masks": np.ascontiguousarray(masks),
                    "z": zs[sel].tolist(), "blob": int(pick)})
    return out


# ----------------------------------------------------------------------------------------- methods
def biharmonic(images: np.ndarray, masks: np.ndarray, three_d: bool = False) -> np.ndarray:
    """Slice by slice (imggen.classic): uint8 (B, C, H, W), bool (B, H, W) -> uint8 (B, C, H, W);
    `three_d`: the slices as one volume (biharmonic_3d)."""
    from imggen.classic import biharmonic as fill, biharmonic_slices

    vol = np.moveaxis(images, 1, -1) / 255.0  # (Z, H, W, C)
    f = fill(vol, masks) if three_d else biharmonic_slices(vol, masks, axis=0)
    out = np.clip(np.round(np.moveaxis(f, -1, 1) * 255.0), 0, 255).astype(np.uint8)
    keep = np.broadcast_to(~masks[:, None], images.shape)
    out[keep] = images[keep]
    return out


def biharmonic_3d(images: np.ndarray, masks: np.ndarray) -> np.ndarray:
    """The whole volume at once (voxel grid taken as isotropic): uint8 (Z, C, H, W), bool (Z, H, W)."""
    return biharmonic(images, masks, three_d=True)


def point_fills(x: np.ndarray, has: np.ndarray, draws: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The volume with its hole slices filled by the first draw, and by the rounded mean of the draws."""
    f1, fm = x.copy(), x.copy()
    f1[has] = draws[:, 0]
    fm[has] = np.clip(np.round(draws.astype(np.float64).mean(1)), 0, 255).astype(np.uint8)
    return f1, fm


def volume_context(model, images: np.ndarray, masks: np.ndarray) -> torch.Tensor:
    """A 2.5-D context model's context of every slice of a volume, uint8 (Z, C, H, W) with holes
    (Z, H, W): the voided slices z-s..z+s with their holes, one outside the volume zero and all unknown."""
    from imggen.inpainting.context import slice_stacks

    s, z = model.config.context_slices, len(images)
    nbrs = np.arange(z)[:, None] + np.arange(-s, s + 1)[None]
    nbrs = np.where((nbrs >= 0) & (nbrs < z), nbrs, -1)
    stack, stack_masks = slice_stacks(torch.from_numpy(images), nbrs, masks[np.clip(nbrs, 0, None)])
    return model.make_context(stack, stack_masks)


# ------------------------------------------------------------------------------------------ scores
def slice_scores(filled: np.ndarray, truth: np.ndarray, masks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Masked PSNR and SSIM of every slice with a hole."""
    has = masks.reshape(len(masks), -1).any(1)
    p = np.array([psnr(f, t, mask=m[None]) for f, t, m in zip(filled[has], truth[has], masks[has])])
    s = np.array([ssim(f, t, mask=m[None]) for f, t, m in zip(filled[has], truth[has], masks[has])])
    return p, s


def paired(a, b, seed: int = 0) -> dict:
    """Mean of a - b per item, its 95% bootstrap interval over items, and the share where a > b."""
    d = np.asarray(a, np.float64) - np.asarray(b, np.float64)
    lo, hi = bootstrap_ci(d, 1000, seed)
    return {"mean": float(d.mean()), "ci95": [float(lo), float(hi)], "better": float((d > 0).mean())}


def sharpness(filled: np.ndarray, truth: np.ndarray, masks: np.ndarray) -> float:
    """Mean gradient magnitude inside the holes of the fills over the truth's (1 = as sharp as the truth)."""
    def grad(x):
        x = x.astype(np.float64).mean(1)
        gy, gx = np.gradient(x, axis=(1, 2))
        return np.hypot(gy, gx)[masks].mean()
    return float(grad(filled) / max(grad(truth), 1e-12))


def uncertainty_tracking(draws: np.ndarray, truth: np.ndarray, masks: np.ndarray) -> dict:
    """draws uint8 (B, K, C, H, W): does the spread of the K draws track the error of their mean?
    Per slice (with a hole): mean per-pixel std vs RMSE of the mean, Pearson and Spearman; per hole
    pixel: std vs |error|, Pearson."""
    from scipy.stats import pearsonr, spearmanr

    d = draws.astype(np.float64)
    mean, std = d.mean(1), d.std(1)
    err = np.abs(mean - truth.astype(np.float64))
    m = np.broadcast_to(masks[:, None], err.shape)
    has = masks.reshape(len(masks), -1).any(1)
    s_std = np.array([std[i][m[i]].mean() for i in np.flatnonzero(has)])
    s_err = np.array([np.sqrt((err[i][m[i]] ** 2).mean()) for i in np.flatnonzero(has)])
    return {"slice_pearson": float(pearsonr(s_std, s_err)[0]), "slice_spearman": float(spearmanr(s_std, s_err)[0]),
            "pixel_pearson": float(pearsonr(std[m], err[m])[0]), "mean_std": float(std[m].mean()),
            "mean_abs_error": float(err[m].mean())}


# ---------------------------------------------------------------------------- the official protocol
def write_case(folder, name: str, truth: np.ndarray, masks: np.ndarray) -> None:
    """A challenge-layout case folder from image-orientation slices: <name>-t1n, -t1n-voided, -mask,
    -mask-healthy (RAS, voxels 233/64 mm in-plane at 64 px, 1 mm apart)."""
    import nibabel as nib

    from imggen.eval.metrics import volume_from_slices

    os.makedirs(os.path.join(folder, name), exist_ok=True)
    mm = 233.0 / truth.shape[-1]
    affine = np.diag([mm, mm, 1.0, 1.0])
    t = volume_from_slices(truth[:, :1].astype(np.float32))
    m = volume_from_slices(masks.astype(np.float32)) > 0.5
    for suffix, arr in (("t1n", t), ("t1n-voided", np.where(m, 0.0, t)), ("mask", m), ("mask-healthy", m)):
        dtype = np.uint8 if arr.dtype == bool else np.float32
        nib.save(nib.Nifti1Image(arr.astype(dtype), affine), os.path.join(folder, name, f"{name}-{suffix}.nii.gz"))


def write_prediction(folder, name: str, filled: np.ndarray) -> None:
    import nibabel as nib

    from imggen.eval.metrics import volume_from_slices

    os.makedirs(folder, exist_ok=True)
    mm = 233.0 / filled.shape[-1]
    nib.save(nib.Nifti1Image(volume_from_slices(filled[:, :1].astype(np.float32)), np.diag([mm, mm, 1.0, 1.0])),
             os.path.join(folder, f"{name}-t1n-inference.nii.gz"))


def budget(run) -> str:
    """Steps, batch, size and wall time of a training run, from its config and log."""
    from imggen.eval.run import read_log

    log = read_log(run.run_dir)
    tps = [r["tokens_per_s"] for r in log if "tokens_per_s" in r and r["step"] <= run.step]
    cfg, m = run.cfg, run.cfg.model
    every = max(1, cfg.train.log_every)
    secs = sum(cfg.train.batch_size * m.seq_len * every / t for t in tps) if tps else None
    return (f"{run.step} steps x batch {cfg.train.batch_size}, lr {cfg.train.lr}, {m.height}x{m.width}, dim {m.dim}, "
            f"{m.layers} layers, attention {m.attention}, context {m.context} (width {m.context_width}"
            + (f", {m.context_fill} fill" if m.context_fill != "none" else "") + ")"
            + (", augmented (--train.augment)" if cfg.train.augment else "")
            + (f", about {secs / 60:.0f} min of training steps" if secs else ""))


def ci_text(v, lo, hi, digits=2) -> str:
    return f"{v:.{digits}f} ({lo:.{digits}f} to {hi:.{digits}f})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", required=True, help="run directory of a context (--task inpaint) model")
    ap.add_argument("--regress", nargs="+", default=[],
                    help="regress.pt file(s) of bench/train_regress.py (the regression-only encoder; the first is "
                         "the one in the grid)")
    ap.add_argument("--uncond", help="run directory of an unconditional model (optional)")
    ap.add_argument("--context25", help="run directory of a 2.5-D context model (model.context_slices > 0; optional)")
    ap.add_argument("--data", help="data spec (default: the context model's)")
    ap.add_argument("--split", default="test")
    ap.add_argument("--rank", type=int, default=8, help="candidates per slice for the unconditional model")
    ap.add_argument("--samples", type=int, default=8, help="K draws per slice of the context model")
    ap.add_argument("--batch-size", type=int, default=16, help="sequences decoded together")
    ap.add_argument("--volumes", type=int, help="the first N test volumes only (a quick check)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--stem", default="inpaint64")
    ap.add_argument("--work", default="runs/inpaint64", help="case folders and predictions (challenge layout)")
    ap.add_argument("--threads", type=int)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from imggen.datasets.brats_demo import demo_mask_bank
    from imggen.eval.brats_eval import evaluate
    from imggen.eval.run import load_data, load_run
    from imggen.images import image_scale, save_grid
    from imggen.inpainting.regress import load as load_regressor
    from imggen.inpainting.regress import predict
    from imggen.sampling import inpaint_images

    ctx_run = load_run(args.context)
    ctx_run.step = ctx_run.step or ctx_run.cfg.train.steps
    cfg = ctx_run.cfg.model
    c25 = load_run(args.context25) if args.context25 else None
    if cfg.context_slices or (c25 is not None and not c25.cfg.model.context_slices):
        ap.error("--context takes a 2-D context model (model.context_slices 0), --context25 a 2.5-D one (> 0)")
    data = load_data(ctx_run.cfg, args.data)
    bank, bank_z = demo_mask_bank(64 if max(cfg.height, cfg.width) <= 64 else 128)
    vols = test_volumes(data, bank, bank_z, args.split, args.seed)[: args.volumes]
    n_slices = sum(int(v["masks"].any((1, 2)).sum()) for v in vols)
    frac = np.mean([v["masks"][v["masks"].any((1, 2))].mean() for v in vols])
    print(f"{len(vols)} volumes, {n_slices} slices with a hole ({frac:.1%} of a slice on average)", flush=True)

    def on_holes(fn):  # a 2-D model fills only the slices that have a hole
        def run(images, masks):
            has = masks.any((1, 2))
            out = images.copy()
            out[has] = fn(images[has], masks[has])
            return out
        return run

    regs = {}
    for path in args.regress:
        model, info = load_regressor(path)
        extra = (", biharmonic fill" if model.fill != "none" else "") + (", augmented" if info.get("augment") else "")
        regs[f"regression, {info.get('steps')} steps{extra}"] = (model, info, path)
    unc = load_run(args.uncond) if args.uncond else None
    K = args.samples
    methods = {"biharmonic 2-D": biharmonic, BASELINE: biharmonic_3d}
    for name, (model, _, _) in regs.items():
        methods[name] = on_holes(lambda x, m, model=model: predict(model, x, m))
    reg_grid = next(iter(regs), None)
    if unc is not None:
        unc.step = unc.step or unc.cfg.train.steps
        methods[f"unconditional, best of {args.rank}"] = on_holes(
            lambda x, m: inpaint_images(unc.model, torch.from_numpy(x), torch.from_numpy(m), rank=args.rank,
                                        seed=args.seed, batch_size=args.batch_size)[0][:, 0].numpy())
    one, mean_k = "context, 1 sample", f"context, mean of {K}"
    one25, mean25 = "2.5-D context, 1 sample", f"2.5-D context, mean of {K}"
    fills = {name: [] for name in [*methods, one, mean_k] + ([one25, mean25] if c25 is not None else [])}
    seconds = {name: 0.0 for name in fills}
    all_draws, draws25 = [], []
    for v in vols:
        x, m = v["images"], v["masks"]
        for name, fn in methods.items():
            t0 = time.perf_counter()
            fills[name].append(fn(x, m))
            seconds[name] += time.perf_counter() - t0
        has = m.any((1, 2))
        t0 = time.perf_counter()
        context = None  # a "biharmonic3d" model is given the volume's 3-D fill, as sample.py --brats gives it
        if cfg.context_fill == "biharmonic3d":
            context = ctx_run.model.make_context(torch.from_numpy(x[has]), torch.from_numpy(m[has]),
                                                 torch.from_numpy(fills[BASELINE][-1][has]).float())
        draws, _ = inpaint_images(ctx_run.model, torch.from_numpy(x[has]), torch.from_numpy(m[has]), num=K,
                                  seed=args.seed, batch_size=args.batch_size, context=context)
        dt = time.perf_counter() - t0
        draws = draws.numpy()
        seconds[mean_k] += dt
        seconds[one] += dt / K
        for name, f in zip((one, mean_k), point_fills(x, has, draws)):
            fills[name].append(f)
        all_draws.append(draws)
        msg = f"{v['name']}: {int(has.sum())} slices, context {dt:.0f} s for {K} draws"
        if c25 is not None:
            t0 = time.perf_counter()
            d25, _ = inpaint_images(c25.model, torch.from_numpy(x[has]), torch.from_numpy(m[has]), num=K,
                                    seed=args.seed, batch_size=args.batch_size,
                                    context=volume_context(c25.model, x, m)[torch.from_numpy(has)])
            dt = time.perf_counter() - t0
            seconds[mean25] += dt
            seconds[one25] += dt / K
            for name, f in zip((one25, mean25), point_fills(x, has, d25.numpy())):
                fills[name].append(f)
            draws25.append(d25.numpy())
            msg += f", 2.5-D context {dt:.0f} s"
        print(msg, flush=True)

    truth = np.concatenate([v["images"] for v in vols])
    masks = np.concatenate([v["masks"] for v in vols])
    has = masks.any((1, 2))
    res = {}
    for name in fills:
        filled = np.concatenate(fills[name])
        p, s = slice_scores(filled, truth, masks)
        res[name] = {"psnr": float(p.mean()), "psnr_ci": list(bootstrap_ci(p, 1000, args.seed)),
                     "ssim": float(s.mean()), "ssim_ci": list(bootstrap_ci(s, 1000, args.seed)),
                     "s_per_volume": seconds[name] / len(vols), "sharpness": sharpness(filled, truth, masks),
                     "per_slice_psnr": p.tolist(), "per_slice_ssim": s.tolist()}
    for name in res:
        if name != BASELINE:
            for metric in ("psnr", "ssim"):
                res[name][f"{metric}_vs_3d"] = paired(res[name][f"per_slice_{metric}"],
                                                      res[BASELINE][f"per_slice_{metric}"], args.seed)
    vs_reg = {name: {m: paired(res[mean_k][f"per_slice_{m}"], res[name][f"per_slice_{m}"], args.seed)
                     for m in ("psnr", "ssim")} for name in regs}
    vs_2d = {} if c25 is None else {
        f"{a} minus {b}": {m: paired(res[a][f"per_slice_{m}"], res[b][f"per_slice_{m}"], args.seed) for m in ("psnr", "ssim")}
        for a, b in ((mean25, mean_k), (one25, one))}
    draws = np.concatenate(all_draws)
    unc_track = uncertainty_tracking(draws, truth[has], masks[has])
    unc25 = uncertainty_tracking(np.concatenate(draws25), truth[has], masks[has]) if draws25 else None

    # the organisers' protocol: case folders + predictions, scored as `python -m imggen.eval brats` does
    cases_dir = os.path.join(args.work, "cases")
    for v in vols:
        write_case(cases_dir, v["name"], v["images"], v["masks"])
    official = {}
    for j, name in enumerate(fills):
        pred_dir = os.path.join(args.work, f"pred{j}")
        for v, f in zip(vols, fills[name]):
            write_prediction(pred_dir, v["name"], f)
        r = evaluate(pred_dir, cases_dir, progress=False, slice_axis=2)
        official[name] = {"mean": r["mean"], "ci95": r["ci95"], "cases": r["cases"], "pred": pred_dir}

    os.makedirs(args.out, exist_ok=True)
    voided = truth.copy()
    voided[np.broadcast_to(masks[:, None], truth.shape)] = 128
    shown = [n for n in (BASELINE, reg_grid, one, mean_k, mean25) if n in fills]
    cols = [voided] + [np.concatenate(fills[n]) for n in shown] + [truth]
    rows = np.flatnonzero(has)
    rows = rows[np.linspace(0, len(rows) - 1, min(8, len(rows))).round().astype(int)]
    grid = np.stack([c[rows] for c in cols], 1).reshape(-1, *truth.shape[1:])
    save_grid(grid, os.path.join(args.out, f"{args.stem}_grid.png"), nrow=len(cols), scale=image_scale(truth.shape[-1]))

    cmd = command_line("inpaint.py", argv)
    machine = f"{cpu_model()}, {os.cpu_count()} CPUs (shared), torch {torch.__version__}"
    lines = [f"`{cmd}` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {machine}; "
             f"{torch.get_num_threads()} threads)", "",
             f"{len(vols)} test volumes ({', '.join(v['name'] for v in vols)}; slices z = {vols[0]['z'][0]}-"
             f"{vols[0]['z'][-1]}), {n_slices} slices with a hole ({frac:.1%} of a slice on average): one "
             f"challenge-like 3-D blob per volume cut to the slab. Per-slice masked PSNR / SSIM with 95% bootstrap "
             f"intervals over slices; paired difference to {BASELINE} per slice.", "",
             md_table(["method", "masked PSNR (dB)", "masked SSIM", f"PSNR - {BASELINE}", f"SSIM - {BASELINE}",
                       "sharpness", "s / volume"],
                      [[name, ci_text(r["psnr"], *r["psnr_ci"]), ci_text(r["ssim"], *r["ssim_ci"], digits=4),
                        "-" if name == BASELINE else ci_text(r["psnr_vs_3d"]["mean"], *r["psnr_vs_3d"]["ci95"]),
                        "-" if name == BASELINE else ci_text(r["ssim_vs_3d"]["mean"], *r["ssim_vs_3d"]["ci95"], 4),
                        f"{r['sharpness']:.2f}", f"{r['s_per_volume']:.1f}"] for name, r in res.items()]),
             "", f"Sharpness: mean gradient magnitude in the holes over the truth's. The 1-sample time is the K-draw "
             f"time / {K}.", "",
             "Organisers' 3-D protocol per volume (`imggen.eval.brats_eval.evaluate` on challenge-layout case "
             f"folders under {args.work}; SSIM on axial planes, `--slice-axis 2`, since a {len(vols[0]['z'])}-slice "
             "slab is thinner than the 11-voxel window of the sagittal planes); mean over volumes (95% bootstrap "
             "interval over volumes):", "",
             md_table(["method", "PSNR (range 1)", "SSIM", "MSE"],
                      [[name, ci_text(o["mean"]["psnr"], *(o["ci95"]["psnr"] or (np.nan, np.nan))),
                        ci_text(o["mean"]["ssim"], *(o["ci95"]["ssim"] or (np.nan, np.nan)), 4),
                        f"{o['mean']['mse']:.5f}"] for name, o in official.items()]),
             "", *[f"{mean_k} minus {name}, per slice: PSNR {ci_text(d['psnr']['mean'], *d['psnr']['ci95'])} dB "
                   f"(better on {d['psnr']['better']:.0%}), SSIM {ci_text(d['ssim']['mean'], *d['ssim']['ci95'], 4)} "
                   f"(better on {d['ssim']['better']:.0%})." for name, d in vs_reg.items()],
             *[f"{name}, per slice (paired): PSNR {ci_text(d['psnr']['mean'], *d['psnr']['ci95'])} dB (better on "
               f"{d['psnr']['better']:.0%}), SSIM {ci_text(d['ssim']['mean'], *d['ssim']['ci95'], 4)} (better on "
               f"{d['ssim']['better']:.0%})." for name, d in vs_2d.items()],
             "", f"Context model's draws (K = {K}): per-slice std vs per-slice RMSE of the mean, Pearson "
             f"{unc_track['slice_pearson']:.2f}, Spearman {unc_track['slice_spearman']:.2f}; per hole pixel std vs "
             f"|error|, Pearson {unc_track['pixel_pearson']:.2f} (mean std {unc_track['mean_std']:.1f}, mean |error| "
             f"{unc_track['mean_abs_error']:.1f} grey levels)." + ("" if unc25 is None else
             f" 2.5-D context model's draws: Pearson {unc25['slice_pearson']:.2f}, Spearman "
             f"{unc25['slice_spearman']:.2f}; per pixel {unc25['pixel_pearson']:.2f} (mean std {unc25['mean_std']:.1f}, "
             f"mean |error| {unc25['mean_abs_error']:.1f})."), "",
             f"- context model: {budget(ctx_run)} ({ctx_run.path})"]
    for name, (_, i, path) in regs.items():
        lines.append(f"- {name}: {i.get('steps')} steps x batch {i.get('batch_size')}, lr {i.get('lr')}, "
                     f"{i.get('loss_kind')} loss on the hole, {i.get('params', 0) / 1e6:.2f}M params, "
                     f"{i.get('seconds', 0) / 60:.1f} min ({i.get('machine')}, {i.get('threads')} threads) ({path})")
    if unc is not None:
        lines.append(f"- unconditional model: {budget(unc)} ({unc.path})")
    if c25 is not None:
        lines.append(f"- 2.5-D context model: {budget(c25)}, {c25.cfg.model.context_slices} slices on each side "
                     f"({c25.path})")
    lines += ["", f"Grid ({args.stem}_grid.png), per slice: voided | " + " | ".join(shown) + " | truth"]
    write_results(args.out, args.stem, {"command": cmd, "volumes": [{k: v[k] for k in ("name", "z", "blob")} for v in vols],
                                        "n_slices": n_slices, "methods": res, "official": official,
                                        "uncertainty": unc_track, "samples": K, "context_mean_vs_regression": vs_reg,
                                        "context25_vs_context": vs_2d, "uncertainty25": unc25}, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
