"""Context for inpainting: what a context-trained model sees of the voided image, on every side.

A context is the voided image (unknown pixels zeroed) plus a mask channel: float (B, C + 1, H, W).
`ContextEncoder` turns it into one feature vector per pixel with a small non-causal U-Net (strided
convolutions down to about 4 x 4, nearest upsampling back with skip connections), so a hole pixel
sees known tissue below and to the right of it as well as above and to the left (the receptive field
covers the image). The model adds
the feature of the pixel a position predicts to that position's input (conditional PixelCNN
style): patterns, kernels and decode caches stay as they are, and the target sequence stays
causal because the context depends on the known pixels only.

With `fill` = "biharmonic" (model.context_fill) the context also carries each voided image's classic
fill (biharmonic inpainting, imggen.classic; C more channels per slice): the encoder starts from the
smooth, boundary-continuous guess a user would otherwise take and learns what to add to it. With
"regress" that channel is a hole regressor's one-pass fill instead (imggen.inpainting.regress; the
model carries the frozen regressor and makes it, ImageTransformer.make_context): the model then
learns what the regression misses.

`random_masks` draws training masks: lesion-like blobs, rectangles and brush strokes of varying
size (the data's own masks are used too where it has them, see imggen.training).
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from imggen.errors import ShapeError

CONTEXTS = ("none", "unet")
# model.context_fill: a classic fill of the hole as more context channels: "biharmonic" the 2-D fill of
# each image; "biharmonic3d" the same channel, trained with the 3-D fills of volume data (brats-demo) and
# given the volume's 3-D fill by sample.py --brats (imggen.volumes); a lone 2-D image gets its 2-D fill;
# "regress" the fill of a frozen hole regressor inside the model (given here as `fills`)
FILLS = ("none", "biharmonic", "biharmonic3d", "regress")
MAX_CONTEXT_SLICES = 8  # model.context_slices: neighbouring slices on each side of a 2.5-D context


def _voided(images, masks, shape, what: str = "context") -> tuple[torch.Tensor, torch.Tensor]:
    """Checked uint8 images (B, C, H, W) and bool masks (B, H, W) (True = unknown)."""
    c, h, w = shape
    images, masks = torch.as_tensor(images), torch.as_tensor(masks)
    if images.dim() == 3:
        images = images[None]
    if masks.dim() == 2:
        masks = masks[None]
    if masks.dim() == 4 and masks.shape[1] == 1:
        masks = masks[:, 0]
    if images.dtype != torch.uint8 or images.dim() != 4 or tuple(images.shape[1:]) != (c, h, w):
        raise ShapeError(f"{what} images must be uint8 (B, {c}, {h}, {w}) for this model; got "
                         f"{tuple(images.shape)} {images.dtype}")
    if masks.dim() != 3 or tuple(masks.shape) != (images.shape[0], h, w):
        raise ShapeError(f"{what} masks must be (B, {h}, {w}) with B = {images.shape[0]} (True = unknown); got "
                         f"{tuple(masks.shape)}")
    return images, masks.bool()


def classic_fill(images: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """uint8 (B, C, H, W), bool (B, H, W) -> float (B, C, H, W) in [-1, 1]: the known pixels, and in
    the hole their biharmonic fill (imggen.classic; an image with no known pixel: 0)."""
    from imggen.classic import biharmonic

    x = images.double().numpy() / 255.0
    m = masks.numpy()
    out = x.copy()
    for i in range(len(x)):
        if m[i].all():
            out[i] = 0.5
        elif m[i].any():
            out[i] = np.moveaxis(biharmonic(np.moveaxis(x[i], 0, -1), m[i]), -1, 0)
    return torch.from_numpy(out).float() * 2.0 - 1.0


def _channels(images: torch.Tensor, masks: torch.Tensor, fill: str = "none", fills=None) -> torch.Tensor:
    scaled = images.float() / 127.5 - 1.0
    known = scaled.masked_fill(masks[:, None], 0.0)
    extra = []
    if fill == "regress" and fills is None:
        raise ShapeError("a regression-fill context (model.context_fill regress) is made by its model, which "
                         "carries the regressor: use model.make_context(images, masks)")
    if fill != "none" and fills is not None:  # given classic fills of the holes (a volume's 3-D fill)
        given = torch.as_tensor(fills).float().reshape(images.shape)
        missing = torch.isnan(given).flatten(1).any(1)  # an image without one: its 2-D fill
        classic = torch.where(masks[:, None], given.clamp(0, 255) / 127.5 - 1.0, scaled)
        if missing.any() and fill == "regress":  # only the model can fill them (make_context does)
            raise ShapeError("a regression-fill context needs a fill for every image (NaN rows given): use "
                             "model.make_context(images, masks, fills), which runs the model's regressor on them")
        if missing.any():
            classic[missing] = classic_fill(images[missing], masks[missing])
        extra = [classic]
    elif fill != "none":
        extra = [classic_fill(images, masks)]
    return torch.cat([known, *extra, masks[:, None].float()], 1)


def context_channels(channels: int, slices: int = 0, fill: str = "none") -> int:
    """The context's channels: per slice the voided image, its classic fill (if any) and the mask."""
    return (channels * (1 if fill == "none" else 2) + 1) * (2 * slices + 1)


def make_context(images, masks, shape: tuple[int, int, int], slices: int = 0, fill: str = "none",
                 fills=None) -> torch.Tensor:
    """uint8 images (B, C, H, W) and bool masks (B, H, W) (True = unknown) -> float (B, C+1, H, W):
    the voided image ([-1, 1], unknown pixels 0) and the mask channel; with `fill` "biharmonic"
    (B, 2C+1, H, W): the voided image, its biharmonic fill (classic_fill) and the mask.

    2.5-D (`slices` = s > 0, model.context_slices): images (B, 2s+1, C, H, W) and masks
    (B, 2s+1, H, W), the axial slices z-s..z+s of one volume with their holes, the middle one the
    slice to fill; a neighbour outside the volume is a slice whose mask is all True (its image is
    then voided entirely: zero image, all unknown) -> float (B, (2s+1)(C+1), H, W), [voided slice,
    mask] per slice in z order. Only the middle slice must have an unknown pixel."""
    if fill not in FILLS:
        raise ShapeError(f"context fill must be one of {', '.join(FILLS)}, got {fill!r}")
    if not slices:
        images, masks = _voided(images, masks, shape)
        if not bool(masks.flatten(1).any(1).all()):
            raise ShapeError("a context mask marks no pixel as unknown (True = unknown); nothing to inpaint")
        return _channels(images, masks, fill, fills)
    k = 2 * slices + 1
    images, masks = torch.as_tensor(images), torch.as_tensor(masks)
    if (images.dim() != 5 or images.shape[1] != k or masks.dim() != 4
            or tuple(masks.shape[:2]) != tuple(images.shape[:2])):
        c, h, w = shape
        raise ShapeError(f"this model has a 2.5-D context (model.context_slices = {slices}): it needs the {k} axial "
                         f"slices z-{slices}..z+{slices} of a volume, uint8 (B, {k}, {c}, {h}, {w}) with masks "
                         f"(B, {k}, {h}, {w}) (a neighbour outside the volume: mask all True); got images "
                         f"{tuple(images.shape)} and masks {tuple(masks.shape)}. A single 2-D image cannot be "
                         f"filled by it: fill a volume (sample.py --brats DIR)")
    mid = make_context(images[:, slices], masks[:, slices], shape, fill=fill, fills=fills)  # checks the slice to fill
    parts = [mid if d == slices else _channels(*_voided(images[:, d], masks[:, d], shape, "neighbour"), fill)
             for d in range(k)]
    return torch.cat(parts, 1)


def slice_stacks(images: torch.Tensor, neighbours, masks) -> tuple[torch.Tensor, torch.Tensor]:
    """The 2.5-D context's inputs from a set of slices: uint8 images (M, C, H, W), int `neighbours`
    (B, 2s+1) (indices into them of the slices z-s..z+s, -1 = outside the volume) and bool masks
    (B, 2s+1, H, W) -> (uint8 (B, 2s+1, C, H, W), bool (B, 2s+1, H, W)), a missing slice zero and
    all unknown."""
    nb = torch.as_tensor(np.asarray(neighbours), dtype=torch.long)
    missing = nb < 0
    stack = images[nb.clamp(min=0)].clone()
    stack[missing] = 0
    masks = torch.as_tensor(np.asarray(masks)).bool().clone()
    masks[missing] = True
    return stack, masks


class ContextEncoder(nn.Module):
    def __init__(self, channels: int, height: int, width: int, width_features: int, dim: int, slices: int = 0,
                 fill: str = "none"):
        super().__init__()
        w = width_features
        # halve until the coarsest grid is about 4 x 4: its 3 x 3 convolutions then see the whole image
        self.levels = max(1, min(4, math.ceil(math.log2(max(height, width) / 4))))
        self.inp = nn.Conv2d(context_channels(channels, slices, fill), w, 3, padding=1)
        self.down = nn.ModuleList(nn.Conv2d(w, w, 3, stride=2, padding=1) for _ in range(self.levels))
        self.mid = nn.Conv2d(w, w, 3, padding=1)
        self.up = nn.ModuleList(nn.Conv2d(2 * w, w, 3, padding=1) for _ in range(self.levels))
        self.out = nn.Conv2d(w, dim, 1)
        nn.init.zeros_(self.out.weight)  # a fresh context model starts as the unconditional one
        nn.init.zeros_(self.out.bias)

    def forward(self, ctx: torch.Tensor) -> torch.Tensor:
        """(B, context_channels(C, s, fill), H, W) -> (B, dim, H, W)."""
        x = F.gelu(self.inp(ctx))
        skips = []
        for conv in self.down:
            skips.append(x)
            x = F.gelu(conv(x))
        x = F.gelu(self.mid(x))
        for conv, skip in zip(self.up, reversed(skips)):
            x = F.interpolate(x, size=skip.shape[-2:], mode="nearest")
            x = F.gelu(conv(torch.cat([x, skip], 1)))
        return self.out(x)


# ------------------------------------------------------------------------------------------ masks
def _ellipse(h, w, rng, lo, hi):
    yy, xx = np.mgrid[:h, :w]
    cy, cx = rng.uniform(0, h), rng.uniform(0, w)
    a, b = rng.uniform(lo, hi, 2)
    th = rng.uniform(0, np.pi)
    dy, dx = yy - cy, xx - cx
    u, v = dx * np.cos(th) + dy * np.sin(th), -dx * np.sin(th) + dy * np.cos(th)
    return (u / a) ** 2 + (v / b) ** 2 <= 1


def _blob(h, w, rng):
    """1-3 overlapping ellipses with a wobbly edge: lesion-like."""
    s = min(h, w)
    m = np.zeros((h, w), bool)
    for _ in range(rng.integers(1, 4)):
        m |= _ellipse(h, w, rng, s / 16, s / 4)
    noise = rng.normal(size=(h // 4 + 1, w // 4 + 1))
    wobble = np.kron(noise, np.ones((4, 4)))[:h, :w] > 1.2
    return m ^ (wobble & _dilate(m, 2) & ~_erode(m, 2))


def _rect(h, w, rng):
    rh, rw = rng.integers(max(1, h // 8), max(2, h // 2) + 1), rng.integers(max(1, w // 8), max(2, w // 2) + 1)
    y, x = rng.integers(0, h - rh + 1), rng.integers(0, w - rw + 1)
    m = np.zeros((h, w), bool)
    m[y:y + rh, x:x + rw] = True
    return m


def _stroke(h, w, rng):
    m = np.zeros((h, w), bool)
    y, x = rng.uniform(0, h), rng.uniform(0, w)
    r = rng.uniform(0.5, max(1.0, min(h, w) / 16))
    yy, xx = np.mgrid[:h, :w]
    ang = rng.uniform(0, 2 * np.pi)
    for _ in range(rng.integers(4, 12)):
        ang += rng.normal(0, 0.8)
        length = rng.uniform(min(h, w) / 16, min(h, w) / 4)
        for t in np.linspace(0, 1, max(2, int(length))):
            cy, cx = y + t * length * np.sin(ang), x + t * length * np.cos(ang)
            m |= (yy - cy) ** 2 + (xx - cx) ** 2 <= r * r
        y, x = np.clip(y + length * np.sin(ang), 0, h - 1), np.clip(x + length * np.cos(ang), 0, w - 1)
    return m


def _dilate(m, k):
    t = torch.from_numpy(m.astype(np.float32))[None, None]
    return F.max_pool2d(t, 2 * k + 1, 1, k)[0, 0].numpy() > 0


def _erode(m, k):
    return ~_dilate(~m, k)


KINDS = {"blob": _blob, "rect": _rect, "stroke": _stroke}


def random_masks(n: int, h: int, w: int, rng: np.random.Generator) -> np.ndarray:
    """bool (n, h, w), True = unknown: lesion-like blobs, rectangles and strokes of varying size,
    each with at least one unknown and one known pixel."""
    out = np.zeros((n, h, w), bool)
    kinds = list(KINDS.values())
    for i in range(n):
        m = np.zeros((h, w), bool)
        while not m.any() or m.all():
            m = kinds[rng.integers(len(kinds))](h, w, rng)
        out[i] = m
    return out
