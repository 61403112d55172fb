"""Evaluation of a run directory: the work behind `python -m imggen.eval bpd|inpaint|fid|atoms|report`.

Each `run_*` function returns a JSON-ready dict (non-finite floats become None when written);
`make_report` combines them into RUN/report/{report.json, report.md, samples.png, curves.png,
inpainting.png}. Heavy imports (matplotlib, FID network, RDKit/OSRA) happen only when needed.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import time
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from imggen.errors import ConfigError, DataError, ShapeError

INPAINT_PROTOCOL = ("2-D per-slice PSNR / SSIM (skimage defaults: 7x7 uniform window, data_range 255), "
                    "whole image and inside the mask; not the BraTS 2023 3-D volume protocol "
                    "(imggen.eval.metrics.brats_inpainting_metrics)")


# ----------------------------------------------------------------------------------- helpers
@dataclass
class Run:
    path: str          # what the user passed
    ckpt: str          # resolved checkpoint directory
    run_dir: str | None  # the run directory (holds log.jsonl / metrics.json) when there is one
    cfg: object        # imggen.config.Config
    model: torch.nn.Module
    step: int | None


def load_run(path: str, device: str = "cpu") -> Run:
    """Model + full config of a run dir / checkpoint dir (CheckpointError when missing)."""
    from imggen.checkpoint import load_weights, read_config, resolve
    from imggen.model import ImageTransformer

    ckpt = resolve(path)
    cfg = read_config(ckpt)
    model = ImageTransformer(cfg.model)
    load_weights(model, ckpt)
    model = model.to(device).eval()
    run_dir = None
    for cand in (path, os.path.dirname(os.path.dirname(os.path.abspath(ckpt)))):
        if os.path.isdir(cand) and (os.path.exists(os.path.join(cand, "config.json"))
                                    and os.path.isdir(os.path.join(cand, "checkpoints"))):
            run_dir = cand
            break
    step = None
    base = os.path.basename(os.path.normpath(ckpt))
    if base.startswith("step_"):
        try:
            step = int(base[5:])
        except ValueError:
            pass
    return Run(path, ckpt, run_dir, cfg, model, step)


def load_data(cfg, spec: str | None = None):
    """The run's data (or `spec`) at the model's size; DataError naming --data on failure."""
    from imggen.datasets import load_dataset

    spec = spec or cfg.data.spec
    m = cfg.model
    opts = {"progress": False} if spec.split(":")[0] == "molecules" else {}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return load_dataset(spec, height=m.height, width=m.width, channels=m.channels, seed=cfg.train.seed,
                                skip_bad=True, **opts)
    except DataError as e:
        raise DataError(f"cannot load evaluation data {spec!r} ({e}); pass --data KIND[:PATH]") from None


def _split(data, name: str, limit: int | None):
    imgs = data.split(name)
    if limit is not None:
        if limit < 1:
            raise ConfigError(f"--limit must be >= 1, got {limit}")
        imgs = imgs[:limit]
    if len(imgs) == 0:
        raise DataError(f"the {name} split of the evaluation data is empty")
    return imgs


def jsonable(x):
    """Replace non-finite floats by None, numpy scalars/arrays by Python values (strict JSON)."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return jsonable(x.tolist())
    if isinstance(x, (np.floating, float)):
        return float(x) if math.isfinite(float(x)) else None
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.bool_):
        return bool(x)
    return x


def write_json(obj, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(jsonable(obj), f, indent=2, allow_nan=False)
        f.write("\n")


def _scale(width: int) -> int:
    return max(1, 128 // max(1, width))


# --------------------------------------------------------------------------------------- bpd
def run_bpd(run: Run, data=None, spec: str | None = None, split: str = "test", limit: int | None = None,
            bootstrap: int = 1000, batch_size: int = 16, seed: int = 0) -> dict:
    from imggen.eval.bpd import bits_per_dim

    spec = spec or run.cfg.data.spec
    data = data if data is not None else load_data(run.cfg, spec)
    imgs = _split(data, split, limit)
    t0 = time.time()
    res = bits_per_dim(run.model, imgs, batch_size=batch_size, return_per_image=True, bootstrap=bootstrap,
                       seed=seed, dataset=spec)
    res.update(checkpoint=run.ckpt, data=spec, split=split, seconds=time.time() - t0)
    return res


# ----------------------------------------------------------------------------------- sampling
def sample_images(run: Run, num: int, seed: int = 0, batch_size: int = 16, rank: int = 1) -> tuple[np.ndarray, dict]:
    """uint8 (num, C, H, W) samples and timing {num, seconds, tokens_per_s, images_per_s}."""
    from imggen.sampling import detokenize, generate

    if num < 1:
        raise ConfigError(f"--num must be >= 1, got {num}")
    t0 = time.time()
    toks, logp = generate(run.model, num, rank=rank, batch_size=batch_size, seed=seed)
    dt = max(time.time() - t0, 1e-9)
    imgs = detokenize(run.model, toks).numpy()
    n_tok = num * rank * run.cfg.model.seq_len
    return imgs, {"num": num, "rank": rank, "seconds": dt, "tokens_per_s": n_tok / dt, "images_per_s": num / dt,
                  "device": str(next(run.model.parameters()).device),
                  "mean_logp_nats": float(logp.mean())}


# ---------------------------------------------------------------------------------- inpainting
def inpaint_batch(model, images: np.ndarray, masks: np.ndarray, rank: int = 1, seed: int = 0,
                  batch_size: int = 16) -> np.ndarray:
    """Fill masks (True = unknown) of uint8 images (B, C, H, W); known pixels are copied exactly."""
    from imggen.sampling import detokenize, generate
    from imggen.tokens import tokenize

    cfg = model.config
    unknown = torch.as_tensor(np.asarray(masks)).bool()
    if unknown.dim() == 3:
        unknown = unknown[:, None]
    if unknown.shape != (len(images), 1, cfg.height, cfg.width):
        raise ShapeError(f"masks must be (B, 1, {cfg.height}, {cfg.width}) for images {np.shape(images)}, "
                         f"got {tuple(unknown.shape)}")
    known = tokenize(images, cfg.bits, shape=cfg.shape)
    known_mask = (~unknown[:, 0])[..., None].expand(-1, cfg.height, cfg.width, cfg.channels).reshape(len(images), -1)
    toks, _ = generate(model, len(images), known, known_mask, rank=rank, batch_size=batch_size, seed=seed)
    filled = detokenize(model, toks).numpy()
    keep = np.broadcast_to(~unknown.numpy(), filled.shape)
    filled[keep] = np.asarray(images)[keep]
    return filled


def triplets(images: np.ndarray, masks: np.ndarray, filled: np.ndarray, fill_value: int = 128) -> np.ndarray:
    """(3B, C, H, W): original, masked (mask pixels = fill_value), filled for each image."""
    m = np.broadcast_to(np.asarray(masks).astype(bool), images.shape)
    masked = images.copy()
    masked[m] = fill_value
    return np.stack([images, masked, filled], 1).reshape(-1, *images.shape[1:])


def run_inpaint(run: Run, data=None, spec: str | None = None, split: str = "test", limit: int | None = 16,
                rank: int = 1, seed: int = 0, out: str | None = None, batch_size: int = 16) -> dict:
    from imggen.eval.metrics import psnr, ssim
    from imggen.images import save_grid

    spec = spec or run.cfg.data.spec
    data = data if data is not None else load_data(run.cfg, spec)
    if split not in data.masks:
        raise DataError(f"data {spec!r} has no inpainting masks for the {split} split (only BraTS data "
                        f"does: --data brats:DIR or brats-demo)")
    imgs_all, masks_all = data.split(split), np.asarray(data.masks[split]).astype(bool)
    idx = np.flatnonzero(masks_all.reshape(len(masks_all), -1).any(1))
    if len(idx) == 0:
        raise DataError(f"every mask of the {split} split of {spec!r} is empty at "
                        f"{run.cfg.model.height}x{run.cfg.model.width}; nothing to inpaint")
    if limit is not None:
        if limit < 1:
            raise ConfigError(f"--limit must be >= 1, got {limit}")
        idx = idx[:limit]
    imgs, masks = imgs_all[idx], masks_all[idx]
    t0 = time.time()
    filled = inpaint_batch(run.model, imgs, masks, rank=rank, seed=seed, batch_size=batch_size)
    dt = time.time() - t0
    per = []
    for i in range(len(idx)):
        per.append({"index": int(idx[i]), "mask_pixels": int(masks[i].sum()),
                    "psnr": psnr(filled[i], imgs[i]), "ssim": ssim(filled[i], imgs[i]),
                    "psnr_mask": psnr(filled[i], imgs[i], mask=masks[i]),
                    "ssim_mask": ssim(filled[i], imgs[i], mask=masks[i])})

    def mean(k):
        v = np.array([p[k] for p in per], dtype=np.float64)
        return float(v.mean())

    res = {"checkpoint": run.ckpt, "data": spec, "split": split, "n_images": len(idx), "rank": rank, "seed": seed,
           "psnr": mean("psnr"), "ssim": mean("ssim"), "psnr_mask": mean("psnr_mask"),
           "ssim_mask": mean("ssim_mask"), "seconds": dt, "protocol": INPAINT_PROTOCOL, "per_image": per}
    if out:
        os.makedirs(out, exist_ok=True)
        sc = _scale(run.cfg.model.width)
        trip = triplets(imgs, masks, filled)
        files = []
        for i in range(len(idx)):
            p = os.path.join(out, f"triplet_{int(idx[i]):04d}.png")
            save_grid(trip[3 * i: 3 * i + 3], p, nrow=3, scale=sc)
            files.append(p)
        grid = os.path.join(out, "inpainting.png")
        save_grid(trip[: 3 * min(8, len(idx))], grid, nrow=3, scale=sc)
        res["files"] = {"triplets": files, "grid": grid}
        write_json(res, os.path.join(out, "inpaint.json"))
        res["json"] = os.path.join(out, "inpaint.json")
    res["_arrays"] = (imgs, masks, filled)
    return res


# ----------------------------------------------------------------------------------------- FID
def load_images(path: str) -> np.ndarray:
    """uint8 (N, C, H, W) from an .npz (key 'images', else its only / first array) or a folder of images."""
    from imggen.images import load_image

    if not os.path.exists(path):
        raise DataError(f"{path} does not exist; pass an .npz of uint8 images or a folder of PNG/JPEG files")
    if os.path.isdir(path):
        names = sorted(f for f in os.listdir(path)
                       if f.lower().endswith((".png", ".jpg", ".jpeg", ".bmp", ".webp")))
        if not names:
            raise DataError(f"folder {path} holds no .png/.jpg images")
        arrs = [load_image(os.path.join(path, f), 3) for f in names]
        shapes = {a.shape for a in arrs}
        if len(shapes) > 1:
            raise DataError(f"images in {path} have different sizes {sorted(shapes)[:3]}...; resize them to one size")
        return np.stack(arrs)
    try:
        with np.load(path) as z:
            keys = list(z.keys())
            if not keys:
                raise DataError(f"{path} holds no arrays")
            a = z["images"] if "images" in keys else z[keys[0]]
    except (OSError, ValueError) as e:
        raise DataError(f"cannot read {path} as .npz ({e})") from None
    if a.dtype != np.uint8:
        raise DataError(f"{path}: images must be uint8 0..255, got {a.dtype}")
    if a.ndim == 3:
        a = a[:, None]
    if a.ndim != 4:
        raise DataError(f"{path}: expected images (N, C, H, W), (N, H, W, C) or (N, H, W), got {a.shape}")
    if a.shape[1] not in (1, 3) and a.shape[-1] in (1, 3):
        a = a.transpose(0, 3, 1, 2)
    if a.shape[1] not in (1, 3):
        raise DataError(f"{path}: images need 1 or 3 channels, got shape {a.shape}")
    return np.ascontiguousarray(a)


def run_fid(images_a: np.ndarray, images_b: np.ndarray, weights: str | None = None, device: str = "cpu",
            random_init: bool = False, batch_size: int = 50) -> dict:
    from imggen.eval.fid import MIN_IMAGES, InceptionFeatures, activation_features, fid_from_features

    for name, a in (("A", images_a), ("B", images_b)):
        if len(a) < 2:
            raise DataError(f"FID needs >= 2 images per set; set {name} has {len(a)}")
    model = InceptionFeatures(weights, random_init=random_init).to(device)
    t0 = time.time()
    fa = activation_features(images_a, model, batch_size)
    fb = activation_features(images_b, model, batch_size)
    value = fid_from_features(fa, fb)
    n = min(len(images_a), len(images_b))
    note = ("random Inception weights: a smoke test, not FID" if random_init else
            (f"fewer than {MIN_IMAGES} images: biased upwards, not comparable with published FID"
             if n < MIN_IMAGES else "pytorch-fid compatible"))
    return {"fid": value, "n_a": len(images_a), "n_b": len(images_b), "seconds": time.time() - t0, "note": note}


# --------------------------------------------------------------------------------------- atoms
def _atoms_mod():
    from imggen.eval import atoms
    return atoms


def osra_available() -> bool:
    return shutil.which("osra") is not None


def atoms_compare(images: np.ndarray, ref_smiles: list, height: int, width: int, workers: int = 2) -> dict:
    """Generated (unpaired) vs calibration ceiling on the reference SMILES: {generated, ceiling, ratio}."""
    atoms = _atoms_mod()
    if not ref_smiles:
        raise DataError("no reference SMILES to calibrate the atom-bond metrics against")
    gen = atoms.atom_bond_accuracy(images, None, workers=workers)
    ceil = atoms.calibrate(list(ref_smiles), height, width, workers=workers)
    keys = getattr(atoms, "KEYS", ("recognised", "atom_valence_ok", "bond_ok", "exact_match"))
    ratio = {k: (gen[k] / ceil[k] if gen.get(k) is not None and ceil.get(k) else None) for k in keys}
    return {"generated": gen, "ceiling": ceil, "ratio": ratio, "keys": list(keys)}


def _smiles(data, split: str) -> list:
    sm = data.meta.get("smiles", {}).get(split) if data.meta else None
    if not sm:
        raise DataError(f"the {split} split carries no SMILES: atoms needs molecule data (--data molecules[:FILE])")
    return list(sm)


def run_atoms(run: Run, num: int = 16, seed: int = 0, num_ref: int | None = None, spec: str | None = None,
              data=None, images: np.ndarray | None = None, batch_size: int = 16) -> dict:
    spec = spec or run.cfg.data.spec
    if run.cfg.model.channels != 1:
        raise ConfigError("atoms needs a grayscale molecule model (channels = 1)")
    data = data if data is not None else load_data(run.cfg, spec)
    refs = _smiles(data, "test")[: (num_ref or num)]
    timing = None
    if images is None:
        images, timing = sample_images(run, num, seed=seed, batch_size=batch_size)
    m = run.cfg.model
    res = atoms_compare(images, refs, m.height, m.width)
    res.update(checkpoint=run.ckpt, data=spec, num=len(images), num_ref=len(refs), seed=seed, sampling=timing)
    return res


def run_calibrate(spec: str = "molecules", size: int = 128, num: int = 50, seed: int = 0) -> dict:
    from imggen.config import Config, ModelConfig

    cfg = Config(model=ModelConfig(height=size, width=size, channels=1))
    cfg.train.seed = seed
    data = load_data(cfg, spec)
    refs = _smiles(data, "test")[:num]
    atoms = _atoms_mod()
    res = atoms.calibrate(refs, size, size)
    return {"data": spec, "size": size, "num": len(refs), "ceiling": res}


def atoms_table(res: dict) -> str:
    keys = res.get("keys") or list(res["generated"])
    rows = ["| metric | generated | ceiling (true drawings) | generated / ceiling |", "|---|---|---|---|"]
    f = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
    for k in keys:
        if k in res["generated"] or k in res["ceiling"]:
            rows.append(f"| {k} | {f(res['generated'].get(k))} | {f(res['ceiling'].get(k))} | "
                        f"{f(res['ratio'].get(k))} |")
    return "\n".join(rows)


# -------------------------------------------------------------------------------------- curves
def read_log(run_dir: str | None) -> list[dict]:
    if not run_dir:
        return []
    path = os.path.join(run_dir, "log.jsonl")
    rows = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line:
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError:
                        continue  # a line cut by a killed run
    return rows


def plot_curves(log: list[dict], path: str, title: str = "") -> str:
    """Training / validation (and test) bits/dim vs step -> PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    for key, style in (("train_bpd", "-"), ("val_bpd", "o-"), ("test_bpd", "*")):
        pts = [(r["step"], r[key]) for r in log if key in r and r[key] is not None]
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, style, label=key.replace("_bpd", ""), markersize=6 if key != "train_bpd" else 2)
    if not log:
        ax.text(0.5, 0.5, "no log.jsonl entries", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("step")
    ax.set_ylabel("bits/dim")
    ax.set_title(title or "bits/dim during training")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, format="png")
    plt.close(fig)
    return path


# -------------------------------------------------------------------------------------- report
def _fmt(v, nd=3):
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.{nd}f}" if math.isfinite(v) else str(v)
    return str(v)


def make_report(path: str, out: str | None = None, num: int = 16, seed: int = 0, device: str = "cpu",
                spec: str | None = None, split: str = "test", limit: int | None = None, bootstrap: int = 1000,
                inpaint_num: int = 4, atoms: str = "auto", fid_weights: str | None = None,
                batch_size: int = 16) -> dict:
    """Evaluate a run directory and write report.json, report.md and PNGs under `out`."""
    from imggen.images import save_grid

    run = load_run(path, device)
    cfg, m = run.cfg, run.cfg.model
    base = run.run_dir or os.path.dirname(os.path.dirname(os.path.abspath(run.ckpt)))
    out = out or os.path.join(base, "report")
    os.makedirs(out, exist_ok=True)
    spec = spec or cfg.data.spec
    rep: dict = {"checkpoint": run.ckpt, "run_dir": run.run_dir, "step": run.step, "data": spec,
                 "created": time.strftime("%Y-%m-%d %H:%M:%S"), "files": {}, "notes": []}
    n_params = sum(p.numel() for p in run.model.parameters())
    rep["config"] = {"preset": cfg.preset, "data": cfg.data.spec, "shape": list(m.shape), "bits": m.bits,
                     "dim": m.dim, "layers": m.layers, "heads": m.heads, "attention": m.attention,
                     "params": n_params, "train_steps": cfg.train.steps, "batch_size": cfg.train.batch_size,
                     "lr": cfg.train.lr}
    metrics = {}
    if run.run_dir and os.path.exists(os.path.join(run.run_dir, "metrics.json")):
        with open(os.path.join(run.run_dir, "metrics.json")) as f:
            metrics = json.load(f)
    rep["train_metrics"] = metrics
    rep["unigram_bpd"] = metrics.get("unigram_bpd")
    log = read_log(run.run_dir)
    tps = [r["tokens_per_s"] for r in log if "tokens_per_s" in r]
    rep["training"] = {"tokens_per_s_median": float(np.median(tps)) if tps else None,
                       "last_train_bpd": next((r["train_bpd"] for r in reversed(log) if "train_bpd" in r), None),
                       "last_val_bpd": next((r["val_bpd"] for r in reversed(log) if "val_bpd" in r), None)}

    # data (the report still works when the data cannot be loaded: bits/dim is then skipped)
    data = None
    try:
        data = load_data(cfg, spec)
    except DataError as e:
        rep["notes"].append(f"evaluation data unavailable: {e}")

    # bits/dim
    rep["bpd"] = None
    if data is not None:
        r = run_bpd(run, data, spec, split, limit, bootstrap, batch_size, seed)
        r.pop("per_image", None)
        rep["bpd"] = r

    # samples + speed
    imgs, timing = sample_images(run, num, seed=seed, batch_size=batch_size)
    rep["sampling"] = timing
    sp = os.path.join(out, "samples.png")
    save_grid(imgs, sp, scale=_scale(m.width))
    rep["files"]["samples"] = sp

    # curves
    cp = plot_curves(log, os.path.join(out, "curves.png"), title=f"{cfg.preset}: {cfg.data.spec}")
    rep["files"]["curves"] = cp

    # inpainting (datasets with masks)
    rep["inpainting"] = None
    if data is not None and data.masks.get(split) is not None and inpaint_num > 0:
        try:
            r = run_inpaint(run, data, spec, split, inpaint_num, seed=seed, out=os.path.join(out, "inpainting"),
                            batch_size=batch_size)
            r.pop("_arrays", None)
            shutil.copyfile(r["files"]["grid"], os.path.join(out, "inpainting.png"))
            rep["files"]["inpainting"] = os.path.join(out, "inpainting.png")
            rep["inpainting"] = {k: v for k, v in r.items() if k not in ("per_image", "files", "json")}
        except DataError as e:
            rep["notes"].append(f"inpainting skipped: {e}")

    # atoms (molecules, when OSRA is installed)
    rep["atoms"] = None
    is_mol = spec.split(":")[0] == "molecules"
    if is_mol and atoms != "off":
        if not osra_available():
            rep["notes"].append("atoms skipped: `osra` is not on PATH (apt-get install osra)")
        elif data is not None:
            try:
                r = run_atoms(run, num, seed, num_ref=num, spec=spec, data=data, images=imgs)
                rep["atoms"] = r
            except Exception as e:  # noqa: BLE001 - OSRA/RDKit failures must not sink the report
                rep["notes"].append(f"atoms failed: {type(e).__name__}: {e}")

    # FID (only when weights are given: the network is slow on CPU and few samples bias it)
    rep["fid"] = None
    if fid_weights:
        if data is None:
            rep["notes"].append("FID skipped: no reference data")
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                rep["fid"] = run_fid(imgs, _split(data, split, limit), fid_weights, device)
    rep["report_md"] = os.path.join(out, "report.md")
    write_json(rep, os.path.join(out, "report.json"))
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(report_markdown(rep))
    rep["report_json"] = os.path.join(out, "report.json")
    return rep


def report_markdown(rep: dict) -> str:
    c = rep["config"]
    L = [f"# Evaluation report: {rep['run_dir'] or rep['checkpoint']}", "",
         f"checkpoint `{rep['checkpoint']}` (step {rep['step']}), data `{rep['data']}`, {rep['created']}", "",
         "## Config", "", "| setting | value |", "|---|---|"]
    for k in ("preset", "data", "shape", "bits", "dim", "layers", "heads", "attention", "params",
              "train_steps", "batch_size", "lr"):
        v = c.get(k)
        L.append(f"| {k} | {'x'.join(map(str, v)) if k == 'shape' else _fmt(v, 6) if isinstance(v, float) else v} |")
    L += ["", "## Bits/dim", "", "| quantity | bits/dim | note |", "|---|---|---|"]
    b = rep.get("bpd")
    if b:
        ci = b.get("ci95")
        ci_s = f" (95% CI {ci[0]:.3f} - {ci[1]:.3f}, {b['bootstrap']} bootstrap resamples)" if ci else ""
        L.append(f"| {b['split']} ({b['n_images']} images) | {b['bpd']:.3f}{ci_s} | {b['label']} |")
    else:
        L.append("| test | n/a | evaluation data unavailable |")
    tm = rep.get("train_metrics") or {}
    if tm.get("test_bpd") is not None:
        L.append(f"| test, at end of training (metrics.json) | {_fmt(tm['test_bpd'])} | |")
    if rep.get("unigram_bpd") is not None:
        L.append(f"| unigram baseline (entropy of training token values) | {_fmt(rep['unigram_bpd'])} | "
                 f"a model that ignores context: a useful model is below this |")
    tr = rep.get("training") or {}
    if tr.get("last_val_bpd") is not None:
        L.append(f"| last validation (log.jsonl) | {_fmt(tr['last_val_bpd'])} | |")
    s = rep["sampling"]
    L += ["", "## Speed", "", "| quantity | value |", "|---|---|",
          f"| sampling ({s['num']} images, {s['device']}) | {s['tokens_per_s']:.0f} tokens/s, "
          f"{s['seconds']:.2f} s total, {s['images_per_s']:.3f} images/s |"]
    if tr.get("tokens_per_s_median") is not None:
        L.append(f"| training (median of log.jsonl) | {tr['tokens_per_s_median']:.0f} tokens/s |")
    ip = rep.get("inpainting")
    if ip:
        L += ["", "## Inpainting", "", f"{ip['n_images']} {ip['split']} images, rank {ip['rank']}. {ip['protocol']}.",
              "", "| region | PSNR (dB) | SSIM |", "|---|---|---|",
              f"| whole image | {_fmt(ip['psnr'], 2)} | {_fmt(ip['ssim'])} |",
              f"| inside mask | {_fmt(ip['psnr_mask'], 2)} | {_fmt(ip['ssim_mask'])} |",
              "", "![inpainting](inpainting.png)"]
    at = rep.get("atoms")
    if at:
        L += ["", "## Molecules: atom-bond accuracy (OSRA)", "",
              f"{at['num']} generated images vs the ceiling on {at['num_ref']} true test drawings "
              f"(unpaired: exact_match needs paired references).", "", atoms_table(at)]
    fd = rep.get("fid")
    if fd:
        L += ["", "## FID", "", f"FID {fd['fid']:.2f} ({fd['n_a']} samples vs {fd['n_b']} reference images; "
              f"{fd['note']})"]
    L += ["", "## Figures", "", "![samples](samples.png)", "", "![curves](curves.png)"]
    if rep.get("notes"):
        L += ["", "## Notes", ""] + [f"- {n}" for n in rep["notes"]]
    return "\n".join(L) + "\n"
