"""What a training run learns: `generate` (every token, unconditionally) or `inpaint` (the unknown
pixels of a voided image, seeing its known pixels through the model's context).

Inpainting masks: the data's own masks where it has them (BraTS inpainting masks, the brats-demo
challenge-like sections of 3-D blobs, imggen.datasets.brats_masks), for half the images of a
batch, and random lesion-like blobs, rectangles and strokes (imggen.context.random_masks) for the
rest and for data without masks. They are drawn from (seed, step) so `--resume` continues exactly;
evaluation uses fixed masks per split: the data's own for every image that has one.

The inpainting loss covers the unknown pixels only: the known ones are in the context, so scoring
them would reward copying and dilute the signal for the pixels that inpainting has to produce.
"""
from __future__ import annotations

import numpy as np
import torch

from imggen.context import random_masks

TASKS = ("generate", "inpaint")
DATA_MASK_FRACTION = 0.5


def token_mask(masks: torch.Tensor, channels: int) -> torch.Tensor:
    """Pixel masks (B, H, W) -> token masks (B, H*W*C) (every subpixel of an unknown pixel)."""
    b = masks.shape[0]
    return masks[..., None].expand(*masks.shape, channels).reshape(b, -1)


def draw_masks(rng: np.random.Generator, idx: np.ndarray, data_masks: np.ndarray | None, h: int, w: int,
               fraction: float = DATA_MASK_FRACTION) -> np.ndarray:
    """bool (len(idx), h, w): the data's mask of image idx[i] (when it has a non-empty one) for about
    `fraction` of the images, random masks for the others."""
    out = random_masks(len(idx), h, w, rng)
    if data_masks is not None:
        use = rng.random(len(idx)) < fraction
        for i in np.flatnonzero(use):
            m = np.asarray(data_masks[idx[i]]).reshape(h, w).astype(bool)
            if m.any() and not m.all():
                out[i] = m
    return out


def training_masks(seed: int, step: int, idx, data_masks, h: int, w: int) -> np.ndarray:
    return draw_masks(np.random.default_rng([seed, step, 1]), np.asarray(idx), data_masks, h, w)


def eval_masks(seed: int, split: str, n: int, data_masks, h: int, w: int) -> np.ndarray:
    """Fixed masks of the first n images of a split (the same every evaluation): the data's own mask
    for every image that has a non-empty one (BraTS inpainting masks, the brats-demo challenge-like
    sections), random ones for the others."""
    tag = {"train": 0, "val": 1, "test": 2}[split]
    return draw_masks(np.random.default_rng([seed, 1 << 20, tag]), np.arange(n), data_masks, h, w, fraction=1.0)


def inpaint_inputs(model, tokens: torch.Tensor, masks) -> tuple[torch.Tensor, torch.Tensor]:
    """(context, token loss mask) for token sequences (B, N) and pixel masks (B, H, W)."""
    from imggen.tokens import detokenize_tokens

    cfg = model.config
    masks = torch.as_tensor(masks).bool()
    images = detokenize_tokens(tokens.cpu(), cfg.bits, cfg.shape)
    return model.make_context(images, masks), token_mask(masks, cfg.channels).to(tokens.device)
