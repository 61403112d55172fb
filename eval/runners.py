"""Metric runners behind `python -m imggen.eval`: each `run_*` returns a JSON-ready dict."""
from __future__ import annotations

import os
import shutil
import time

import numpy as np
import torch

from imggen.errors import CheckpointError, ConfigError, DataError
from imggen.eval.run import Run, load_data, split_images, write_json
from imggen.images import image_scale

INPAINT_PROTOCOL = ("2-D per-slice PSNR / SSIM (skimage defaults: 7x7 uniform window, data_range 255), "
                    "whole image and inside the mask; not the BraTS 2023 3-D volume protocol "
                    "(imggen.eval.metrics.brats_inpainting_metrics)")


def run_bpd(run: Run, data=None, spec: str | None = None, split: str = "test", limit: int | None = None,
            bootstrap: int = 1000, batch_size: int = 16, seed: int = 0) -> dict:
    from imggen.eval.bpd import bits_per_dim

    spec = spec or run.cfg.data.spec
    data = data if data is not None else load_data(run.cfg, spec)
    imgs = split_images(data, split, limit)
    masks = None
    if run.model.context is not None:  # an inpainting model: under the fixed masks of training's evaluation
        from imggen.inpainting.tasks import eval_masks
        m, given = run.cfg.model, data.masks.get(split)
        masks = eval_masks(run.cfg.train.seed, split, len(imgs), None if given is None else given[:len(imgs)],
                           m.height, m.width)
    t0 = time.time()
    res = bits_per_dim(run.model, imgs, batch_size=batch_size, return_per_image=True, bootstrap=bootstrap,
                       seed=seed, dataset=spec, progress=True, masks=masks)
    bad = [i for i, v in enumerate(res["per_image"]) if not np.isfinite(v)]
    if bad:
        raise CheckpointError(f"checkpoint {run.ckpt} gives a non-finite bits/dim ({res['per_image'][bad[0]]}) on "
                              f"{len(bad)} of {len(imgs)} {split} images (first: image {bad[0]}): its logits "
                              f"overflow or are NaN; the weights are corrupt or training diverged - evaluate an "
                              f"earlier checkpoint (RUN/checkpoints/step_*)")
    res.update(checkpoint=run.ckpt, data=spec, split=split, seconds=time.time() - t0)
    return res


def sample_images(run: Run, num: int, seed: int = 0, batch_size: int = 16, rank: int = 1) -> tuple[np.ndarray, dict]:
    """uint8 (num, C, H, W) samples and timing {num, seconds, tokens_per_s, images_per_s}."""
    from imggen.sampling import detokenize, generate

    if num < 1:
        raise ConfigError(f"--num must be >= 1, got {num}")
    t0 = time.time()
    toks, logp = generate(run.model, num, rank=rank, batch_size=batch_size, seed=seed, progress=True)
    dt = max(time.time() - t0, 1e-9)
    imgs = detokenize(run.model, toks).numpy()
    n_tok = num * rank * run.cfg.model.seq_len
    return imgs, {"num": num, "rank": rank, "seconds": dt, "tokens_per_s": n_tok / dt, "images_per_s": num / dt,
                  "device": str(next(run.model.parameters()).device),
                  "mean_logp_nats": float(logp.mean())}


def inpaint_batch(model, images: np.ndarray, masks: np.ndarray, rank: int = 1, seed: int = 0,
                  batch_size: int = 16, samples: int = 1, reduce: str | None = None) -> np.ndarray:
    """Fill masks (True = unknown) of uint8 images (B, C, H, W); known pixels are copied exactly."""
    from imggen.sampling import inpaint_images

    m = np.asarray(masks).astype(bool)
    filled, _ = inpaint_images(model, torch.as_tensor(np.asarray(images)), torch.as_tensor(m.reshape(len(m), *m.shape[-2:])),
                               samples=samples, reduce=reduce, rank=rank, seed=seed, batch_size=batch_size,
                               progress=True)
    return filled[:, 0].numpy()


def triplets(images: np.ndarray, masks: np.ndarray, filled: np.ndarray, fill_value: int = 128) -> np.ndarray:
    """(3B, C, H, W): original, masked (mask pixels = fill_value), filled for each image."""
    m = np.broadcast_to(np.asarray(masks).astype(bool), images.shape)
    masked = images.copy()
    masked[m] = fill_value
    return np.stack([images, masked, filled], 1).reshape(-1, *images.shape[1:])


def run_inpaint(run: Run, data=None, spec: str | None = None, split: str = "test", limit: int | None = 16,
                rank: int = 1, seed: int = 0, out: str | None = None, batch_size: int = 16, samples: int = 1,
                reduce: str | None = None) -> dict:
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
    filled = inpaint_batch(run.model, imgs, masks, rank=rank, seed=seed, batch_size=batch_size, samples=samples,
                           reduce=reduce)
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
           "samples": samples, "reduce": reduce, "context": run.cfg.model.context,
           "psnr": mean("psnr"), "ssim": mean("ssim"), "psnr_mask": mean("psnr_mask"),
           "ssim_mask": mean("ssim_mask"), "seconds": dt, "protocol": INPAINT_PROTOCOL, "per_image": per}
    if out:
        os.makedirs(out, exist_ok=True)
        sc = image_scale(run.cfg.model.width)
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
