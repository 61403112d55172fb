"""Training-time augmentation (`--train.augment`): a random rigid-ish warp and a gamma per image.

One brain template (brats-demo: 84 training slices in 4 fixed variants) is learnt, not brain
anatomy: without augmentation the held-out hole bits/dim stops falling after ~270 steps while the
training loss goes on down (bench/RESULTS.md section 10). Each training image therefore gets, drawn
from (seed, step) so `--resume` continues exactly:
- a rotation of up to +-15 degrees, an isotropic scale of 0.9-1.1, a shift of up to 5% of the side
  and a left-right flip with probability 1/2 (one affine map, bilinear for the image, nearest for
  its masks, zero outside: the background of a skull-stripped slice);
- a gamma of 0.75-1.33 (log-uniform) on the [0, 1] intensities (MRI contrast varies between
  scanners; brats-demo's fixed variants are gamma 0.8 and 1.25).
A 2.5-D stack (the slices z-s..z+s) gets its image's map and gamma on every slice, so the volume
stays one volume. An image whose warped hole (the middle slice's) would be empty or everything keeps
its original image and masks.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

MAX_ROTATION = 15.0  # degrees
SCALE = (0.9, 1.1)
MAX_SHIFT = 0.05     # of the side
GAMMA = (0.75, 1.0 / 0.75)


def random_params(n: int, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """n affine maps (n, 2, 3) (output -> input coordinates in [-1, 1], F.affine_grid's convention)
    and n gammas."""
    ang = np.deg2rad(rng.uniform(-MAX_ROTATION, MAX_ROTATION, n))
    scale = rng.uniform(*SCALE, n)
    flip = np.where(rng.random(n) < 0.5, -1.0, 1.0)
    shift = rng.uniform(-2 * MAX_SHIFT, 2 * MAX_SHIFT, (n, 2))  # [-1, 1] spans the side twice
    gamma = np.exp(rng.uniform(math.log(GAMMA[0]), math.log(GAMMA[1]), n))
    c, s = np.cos(ang) / scale, np.sin(ang) / scale
    theta = np.zeros((n, 2, 3))
    theta[:, 0, 0], theta[:, 0, 1], theta[:, 1, 0], theta[:, 1, 1] = c * flip, -s, s * flip, c
    theta[:, :, 2] = shift
    return torch.tensor(theta, dtype=torch.float32), torch.tensor(gamma, dtype=torch.float32)


def _warp(x: torch.Tensor, theta: torch.Tensor, mode: str) -> torch.Tensor:
    """float (B, K, H, W) warped by theta (B, 2, 3), one map per item for all its K planes."""
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    return F.grid_sample(x, grid, mode=mode, padding_mode="zeros", align_corners=False)


def warp_images(images: torch.Tensor, theta: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """uint8 (B, ..., H, W) (e.g. (B, C, H, W) or a stack (B, K, C, H, W)) -> uint8, each item warped
    by its map and raised to its gamma."""
    shape = images.shape
    x = images.reshape(shape[0], -1, *shape[-2:]).float() / 255.0
    x = _warp(x, theta, "bilinear").clamp(0.0, 1.0) ** gamma[:, None, None, None]
    return torch.round(x * 255.0).to(torch.uint8).reshape(shape)


def warp_masks(masks, theta: torch.Tensor) -> torch.Tensor:
    """bool (B, ..., H, W) -> bool, nearest neighbour (outside the image: known, the zero background),
    except that an all-unknown plane (a 2.5-D neighbour outside the volume) stays all unknown."""
    m = torch.as_tensor(np.asarray(masks)).bool()
    shape = m.shape
    planes = m.reshape(shape[0], -1, *shape[-2:])
    out = _warp(planes.float(), theta, "nearest") > 0.5
    out |= planes.flatten(2).all(2)[..., None, None]
    return out.reshape(shape)


def augment(images: torch.Tensor, masks, rng: np.random.Generator, stack: torch.Tensor | None = None,
            middle: int | None = None, rows=None, batch: int | None = None):
    """The augmented (images, masks, stack) of a batch of B items.

    masks: bool (B, H, W), or (B, 2s+1, H, W) with `middle` = s for a 2.5-D stack, or None
    (generation); images: uint8 (b, C, H, W), the items `rows` (a slice, default: all) of the batch;
    stack: uint8 (b, 2s+1, C, H, W) of the same items, or None. The maps are drawn for all B items,
    so every process of a DDP run draws the same ones and knows the global batch's masks (its loss
    divisor); images and stack are this process's share. Without masks, `batch` is B when `rows`
    picks a share. Returns the masks as a bool array."""
    b = int(np.asarray(masks).shape[0]) if masks is not None else len(images) if rows is None else batch
    theta, gamma = random_params(b, rng)
    if masks is not None:
        given = torch.as_tensor(np.asarray(masks)).bool()
        warped = warp_masks(given, theta)
        hole = (warped if middle is None else warped[:, middle]).flatten(1)
        ok = hole.any(1) & ~hole.all(1)
        theta[~ok] = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])  # the identity: the item unchanged
        gamma[~ok] = 1.0
        masks = torch.where(ok.reshape(-1, *[1] * (warped.dim() - 1)), warped, given).numpy()
    rows = slice(None) if rows is None else rows
    images = warp_images(torch.as_tensor(images), theta[rows], gamma[rows])
    if stack is not None:
        stack = warp_images(torch.as_tensor(stack), theta[rows], gamma[rows])
    return images, masks, stack


def augment_tokens(x: torch.Tensor, masks, rng: np.random.Generator, model_cfg, rows=None, stack=None,
                   batch: int | None = None, fills=None):
    """`augment` of token sequences (b, N) of a model config's images -> (tokens on x's device,
    masks, stack, fills); a 2.5-D stack's middle slice is the model's context_slices. `fills` (float
    (b, C, H, W), NaN rows: none; imggen.inpainting.tasks.split_fills), the holes' classic fills, get their
    image's warp and gamma (they ride along as one more slice of the stack)."""
    from imggen.tokens import detokenize_tokens, tokenize

    images = detokenize_tokens(x.cpu(), model_cfg.bits, model_cfg.shape)
    middle = model_cfg.context_slices if (masks is not None and model_cfg.context_slices) else None
    if fills is not None:
        missing = torch.isnan(fills).flatten(1).any(1)
        extra = torch.nan_to_num(fills).round().clamp(0, 255).to(torch.uint8)[:, None]
        stack = extra if stack is None else torch.cat([torch.as_tensor(stack), extra], 1)
    images, masks, stack = augment(images, masks, rng, stack, middle, rows, batch)
    if fills is not None:
        fills = stack[:, -1].float()
        fills[missing] = float("nan")
        stack = None if stack.shape[1] == 1 else stack[:, :-1]
    return tokenize(images, model_cfg.bits, model_cfg.shape).to(x.device), masks, stack, fills
