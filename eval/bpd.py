"""Exact bits/dim of a model on uint8 images, with a per-image bootstrap CI and an honest label.

bits/dim = mean over every subpixel of -log2 p(subpixel | previous subpixels), computed from
`model(tokens)` logits, or a model's own `model(tokens, nll=True)` where it has `scores_tokens` (teacher forcing, one parallel forward per batch) in float32 under
torch.no_grad with the model in eval mode. Images are tokenised with the model's own bit depth,
so a 4-bit model is scored on its own 4-bit quantisation of the data: that number is NOT on the
scale of published 8-bit results (PixelCNN++, Image Transformer, Sparse Transformer, ...).
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from imggen.errors import ShapeError

__all__ = ["bits_per_dim", "per_image_bits_per_dim", "token_bits_per_dim", "bootstrap_ci", "bpd_label", "PUBLISHED_CIFAR10"]

LN2 = math.log(2.0)
# Test-set bits/dim on 8-bit CIFAR-10 as reported in the papers.
PUBLISHED_CIFAR10 = {"PixelCNN++": 2.92, "Image Transformer": 2.90, "PixelSNAIL": 2.85,
                     "Sparse Transformer": 2.80}


def bpd_label(bits: int, dataset: str | None = None) -> str:
    """What a bits/dim figure of a `bits`-bit model means, and what it may be compared with."""
    refs = ", ".join(f"{k} {v:.2f}" for k, v in PUBLISHED_CIFAR10.items())
    if bits < 8:
        return (f"bits/dim of the model's own {bits}-bit quantised data "
                f"(NOT comparable with 8-bit figures such as CIFAR-10 {refs})")
    if dataset is not None and dataset.split(":")[0] == "cifar":
        return f"bits/dim on 8-bit data (comparable with published CIFAR-10 test figures: {refs})"
    what = f"8-bit {dataset.split(':')[0]} data" if dataset else "8-bit data"
    return (f"bits/dim on {what} (same units as published 8-bit results, but comparable only "
            f"on the same dataset and split; CIFAR-10 references: {refs})")


def _device(model) -> torch.device:
    try:
        return next(model.parameters()).device
    except (StopIteration, AttributeError):
        return torch.device("cpu")


def per_image_bits_per_dim(model, images, batch_size: int = 16, progress: bool = False,
                           masks=None) -> np.ndarray:
    """float64 (B,) bits/dim of each uint8 image (B, C, H, W) under `model` (teacher forcing); an
    inpainting (context) model's of the unknown pixels of `masks` (B, H, W) given the rest."""
    from imggen.tokens import tokenize

    if len(images) == 0:
        raise ShapeError("no images to compute bits/dim on (got an empty batch)")
    if getattr(model, "context", None) is not None and masks is None:
        raise ShapeError("this model was trained for inpainting with a context: its bits/dim is that of the "
                         "unknown pixels given the known ones; pass masks (B, H, W), True = unknown")
    return token_bits_per_dim(model, tokenize(images, model.config.bits, shape=model.config.shape), batch_size,
                              masks=masks, progress=progress)


@torch.no_grad()
def token_bits_per_dim(model, tokens: torch.Tensor, batch_size: int = 16, masks=None,
                       progress: bool = False, neighbours=None, fills=None, inputs=None) -> np.ndarray:
    """float64 (B,) bits/dim of each token sequence (B, N) (uint8 or long) under `model`; the one
    place bits/dim is computed (training's validation and test figures call it too). With pixel
    masks (B, H, W) (True = unknown), an inpainting model's bits/dim of the unknown subpixels given
    the known ones (its context); a 2.5-D context model takes masks (B, 2s+1, H, W) and `neighbours`,
    the slices around each image (imggen.inpainting.tasks.split_masks); `fills`, the holes' given classic fills
    (imggen.inpainting.tasks.split_fills). Or, for any task, `inputs` (imggen.inpainting.tasks.Task.eval_inputs): a function
    (tokens (b, N), rows: a slice of the sequences) -> (context, token weights), None = all tokens."""
    from imggen.inpainting.tasks import rows_inputs

    if masks is not None:
        inputs = rows_inputs(model, masks, neighbours, fills)

    cfg = model.config
    if batch_size < 1:
        raise ShapeError(f"batch_size must be >= 1, got {batch_size}")
    device = _device(model)
    was_training = getattr(model, "training", False)
    model.eval()
    out = []
    try:
        for i in tqdm(range(0, len(tokens), batch_size), desc="bits/dim", unit="batch", disable=not progress,
                      leave=False):
            x = tokens[i: i + batch_size].long().to(device)
            context, weight = (None, None) if inputs is None else inputs(x, slice(i, i + batch_size))
            kw = {} if context is None else {"context": context}
            if getattr(model, "scores_tokens", False):  # the model's own -log p of each token (a mixture's: O(K))
                nll = model(x, nll=True, **kw).float()
            else:
                logits = model(x, **kw).float()
                if logits.shape != (*x.shape, cfg.vocab):
                    raise ShapeError(f"model returned logits of shape {tuple(logits.shape)}, expected "
                                     f"{(*x.shape, cfg.vocab)}")
                nll = F.cross_entropy(logits.reshape(-1, cfg.vocab), x.reshape(-1), reduction="none").view(x.shape)
            count = torch.full((len(x),), x.shape[1], dtype=torch.float64) if weight is None else weight.sum(1).double()
            if weight is not None:
                nll = nll * weight
            out.append(nll.double().sum(1).cpu() / count.cpu())  # nats per subpixel, summed in float64
    finally:
        model.train(was_training)
    return (torch.cat(out) / LN2).numpy()


def bootstrap_ci(values, resamples: int = 1000, seed: int = 0, level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap CI of the mean of `values` (resampling items with replacement)."""
    v = np.asarray(values, dtype=np.float64)
    if len(v) < 2 or resamples < 2:
        raise ShapeError(f"a bootstrap CI needs >= 2 values and >= 2 resamples, got {len(v)} and {resamples}")
    rng = np.random.default_rng(seed)
    means = np.empty(resamples)
    chunk = max(1, 2_000_000 // len(v))  # bound memory of the index matrix
    for s in range(0, resamples, chunk):
        e = min(resamples, s + chunk)
        means[s:e] = v[rng.integers(0, len(v), (e - s, len(v)))].mean(1)
    a = (1.0 - level) / 2.0
    lo, hi = np.percentile(means, [100 * a, 100 * (1 - a)])
    return float(lo), float(hi)


def bits_per_dim(model, images, batch_size: int = 16, return_per_image: bool = False, bootstrap: int = 0,
                 seed: int = 0, dataset: str | None = None, progress: bool = False, masks=None):
    """Mean bits/dim of uint8 images (B, C, H, W) under `model` (an inpainting model's: of the
    unknown pixels of `masks` (B, H, W) given the rest, as its training reports it).

    Returns a float, or with `return_per_image` / `bootstrap` > 0 a dict: bpd, per_image (list),
    ci95 ((lo, hi) percentile bootstrap over images with `bootstrap` (>= 2) resamples; None without
    resamples or with a single image), bits,
    n_images and label (what the number may be compared with; `dataset` = the data spec, if known).
    Every image has the same number of subpixels, so the mean over images is the mean over subpixels.
    """
    per = per_image_bits_per_dim(model, images, batch_size, progress, masks)
    bpd = float(per.mean())
    if not return_per_image and not bootstrap:
        return bpd
    bits = int(model.config.bits)
    return {"bpd": bpd, "per_image": per.tolist(),
            "ci95": list(bootstrap_ci(per, bootstrap, seed)) if bootstrap and len(per) > 1 else None,  # none of 1
            "bootstrap": int(bootstrap), "bits": bits, "n_images": int(len(per)),
            "label": bpd_label(bits, dataset) + ("" if masks is None else
                                                 "; of the unknown pixels of inpainting masks given the rest")}
