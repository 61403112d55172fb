"""The BraTS inpainting winners' recipe, as a baseline: the context encoder alone, regressing the hole.

`HoleRegressor` is the inpainting model's `ContextEncoder` (the same non-causal U-Net over the
voided image + mask, and with `fill` "biharmonic" the hole's classic fill, imggen.inpainting.context) with a
small head (GELU, 1x1 convolution) that predicts every pixel's value directly, in the context's
units ([-1, 1]). It is trained with an L1 or MSE loss on the hole pixels only (`hole_loss`), on the
masks the context model trains on (imggen.inpainting.tasks.training_masks: the data's own for half a batch,
random blobs / rectangles / strokes for the rest; with `augment`, the training warps of
imggen.augment), and fills a hole in one forward pass (`predict`): a point estimate (MSE: the
conditional mean; L1: the conditional median), no samples, no uncertainty.

`train_regressor` runs the optimisation (AdamW, linear warm-up then cosine decay); `save` / `load`
keep the weights with the settings that built them.
"""
from __future__ import annotations

import math
import os
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from imggen.augment import augment as augment_batch
from imggen.inpainting.context import ContextEncoder, make_context
from imggen.errors import CheckpointError, ConfigError
from imggen.precision import autocast
from imggen.inpainting.tasks import training_masks

LOSSES = ("mse", "l1")


class HoleRegressor(nn.Module):
    def __init__(self, channels: int, height: int, width: int, width_features: int = 64, hidden: int = 64,
                 fill: str = "none"):
        super().__init__()
        self.settings = dict(channels=channels, height=height, width=width, width_features=width_features,
                             hidden=hidden, fill=fill)
        self.shape, self.fill = (channels, height, width), fill
        self.encoder = ContextEncoder(channels, height, width, width_features, hidden, fill=fill)
        self.encoder.out.reset_parameters()  # the context model zero-inits it; a regressor needs a signal
        self.head = nn.Conv2d(hidden, channels, 1)

    def forward(self, ctx: torch.Tensor) -> torch.Tensor:
        """context (B, C+1, H, W) (with a fill: (B, 2C+1, H, W)) -> pixels (B, C, H, W) in [-1, 1] units."""
        return self.head(F.gelu(self.encoder(ctx)))

    def context(self, images, masks) -> torch.Tensor:
        return make_context(images, masks, self.shape, fill=self.fill)


def hole_loss(pred: torch.Tensor, images: torch.Tensor, masks: torch.Tensor, loss: str = "mse") -> torch.Tensor:
    """Mean L1 / squared error over the hole pixels (every channel) of uint8 images (B, C, H, W) and
    bool masks (B, H, W)."""
    if loss not in LOSSES:
        raise ConfigError(f"regression loss {loss!r}; use {' or '.join(LOSSES)}")
    target = images.float() / 127.5 - 1.0
    m = masks[:, None].expand_as(target)
    diff = (pred - target)[m]
    return diff.abs().mean() if loss == "l1" else (diff ** 2).mean()


@torch.no_grad()
def pixel_values(model: HoleRegressor, images, masks) -> torch.Tensor:
    """uint8 images (B, C, H, W) (CPU) + bool masks (B, H, W) -> float (B, C, H, W) on the CPU: every
    pixel's prediction in 0..255, rounded (run on the regressor's device, in the caller's autocast)."""
    device = next(model.parameters()).device
    p = model(model.context(images, masks).to(device)).float()
    return torch.clamp(torch.round((p + 1.0) * 127.5), 0, 255).cpu()


@torch.no_grad()
def predict(model: HoleRegressor, images, masks, batch_size: int = 64) -> np.ndarray:
    """uint8 images (B, C, H, W) + bool masks (B, H, W) -> uint8 (B, C, H, W): the known pixels as
    given, the hole pixels predicted (rounded, clipped to 0..255)."""
    images, masks = torch.as_tensor(np.asarray(images)), torch.as_tensor(np.asarray(masks)).bool()
    model.eval()
    out = images.clone()
    for i in range(0, len(images), batch_size):
        x, m = images[i:i + batch_size], masks[i:i + batch_size]
        p = pixel_values(model, x, m).to(torch.uint8)
        mm = m[:, None].expand_as(x)
        out[i:i + batch_size][mm] = p[mm]
    return out.numpy()


def lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, steps - warmup))
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def train_regressor(model: HoleRegressor, images: np.ndarray, data_masks: np.ndarray | None, *, steps: int,
                    batch_size: int = 8, lr: float = 2e-3, warmup: int = 30, seed: int = 0, loss: str = "mse",
                    augment: bool = False, log=None, log_every: int = 50, precision: str = "fp32") -> dict:
    """Train on uint8 images (N, C, H, W) with the context model's training masks (`data_masks`: the
    data's own (N, 1, H, W) or None) and, with `augment`, its warps (imggen.augment, as
    --train.augment; `precision` as --train.precision: bf16 autocast of the forward, the loss and
    the weights float32). `log(dict)` receives {step, loss, lr, seconds} every `log_every` steps.
    Returns {"steps", "seconds", "loss"} (the last logged mean loss)."""
    if steps < 1 or batch_size < 1 or lr <= 0:
        raise ConfigError(f"regression training needs steps >= 1, batch_size >= 1, lr > 0; got {steps}, "
                          f"{batch_size}, {lr}")
    if loss not in LOSSES:
        raise ConfigError(f"regression loss {loss!r}; use {' or '.join(LOSSES)}")
    torch.manual_seed(seed)
    _, h, w = model.shape
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    images = torch.as_tensor(np.asarray(images))
    order = np.random.default_rng([seed, 7])
    t0, running, last = time.perf_counter(), [], float("nan")
    model.train()
    for step in range(steps):
        idx = order.integers(0, len(images), batch_size)
        masks = torch.from_numpy(training_masks(seed, step, idx, data_masks, h, w))
        x = images[idx]
        if augment:
            x, masks, _ = augment_batch(x, masks, np.random.default_rng([seed, step, 3]))
            masks = torch.from_numpy(masks)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, lr, warmup)
        with autocast("cpu", precision):
            pred = model(model.context(x, masks))
        value = hole_loss(pred.float(), x, masks, loss)
        opt.zero_grad(set_to_none=True)
        value.backward()
        opt.step()
        running.append(float(value.detach()))
        if (step + 1) % log_every == 0 or step + 1 == steps:
            last = float(np.mean(running))
            running = []
            if log:
                log({"step": step + 1, "loss": last, "lr": opt.param_groups[0]["lr"],
                     "seconds": time.perf_counter() - t0})
    return {"steps": steps, "seconds": time.perf_counter() - t0, "loss": last}


def save(model: HoleRegressor, path, **info) -> None:
    torch.save({"settings": model.settings, "state": model.state_dict(), "info": info}, path)


def load(path) -> tuple[HoleRegressor, dict]:
    """(model, the info saved with it); CheckpointError naming the file when it is not a regressor."""
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
        model = HoleRegressor(**blob["settings"])
        model.load_state_dict(blob["state"])
    except Exception as e:
        raise CheckpointError(f"{path}: not a hole-regressor checkpoint ({type(e).__name__}: {e}); train one with "
                              f"bench/train_regress.py") from None
    return model.eval(), blob.get("info", {})


def load_for(path: str, shape: tuple[int, int, int]) -> HoleRegressor:
    """The regressor at `path` for a context model of image shape (C, H, W) (model.context_fill regress,
    --train.regressor): ConfigError when none is named or it was trained for other images,
    CheckpointError when the file is missing or not a regressor."""
    if not path:
        raise ConfigError("model.context_fill regress needs the regressor whose fill it learns from: pass "
                          "--train.regressor PATH (a regress.pt of bench/train_regress.py)")
    if not os.path.isfile(path):
        raise CheckpointError(f"--train.regressor {path}: no such file; train one with bench/train_regress.py")
    model, _ = load(path)
    if model.shape != tuple(shape):
        c, h, w = model.shape
        raise ConfigError(f"--train.regressor {path} fills {c}-channel {h}x{w} images, but this model's are "
                          f"{shape[0]}-channel {shape[1]}x{shape[2]}; train a regressor at the model's size")
    return model


def adopt(model_cfg, path: str) -> HoleRegressor:
    """load_for(path) for a ModelConfig with context_fill regress, its regress_* settings set from the file
    (the checkpoint then builds the same regressor and carries its weights)."""
    model = load_for(path, model_cfg.shape)
    model_cfg.regress_width, model_cfg.regress_hidden = model.settings["width_features"], model.settings["hidden"]
    model_cfg.regress_fill = model.settings["fill"]
    return model
