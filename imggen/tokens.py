"""Images (uint8, C x H x W) <-> token sequences in raster order, channels interleaved per pixel.

Token t of an image with C channels and width W is subpixel (y, x, c) with t = (y * W + x) * C + c.
With `bits` < 8 a subpixel keeps its top `bits` bits; `detokenize` spreads the levels back over
0..255 (level * 255 // (2**bits - 1)), so tokens -> image -> tokens is exact for every bit depth and
image -> tokens -> image is exact for 8 bits.
"""
from __future__ import annotations

import numpy as np
import torch

from imggen.errors import ShapeError


def _as_tensor(images) -> torch.Tensor:
    if isinstance(images, np.ndarray):
        images = torch.from_numpy(np.ascontiguousarray(images))
    if not isinstance(images, torch.Tensor):
        raise ShapeError(f"images must be a numpy array or torch tensor, got {type(images).__name__}")
    return images


def tokenize(images, bits: int = 8, shape: tuple[int, int, int] | None = None, dtype=torch.long) -> torch.Tensor:
    """uint8 images (B, C, H, W) or (C, H, W) -> long tokens (B, H*W*C); dtype=torch.uint8: the
    same tokens as uint8, with no long copy in between (a training set held in memory).

    `shape` = (C, H, W) expected by a model; a mismatch is a ShapeError naming both shapes.
    """
    check_bits(bits)
    x = _as_tensor(images)
    if x.dtype != torch.uint8:
        raise ShapeError(f"images must be uint8 (0..255), got dtype {x.dtype}; convert with "
                         f"np.clip(x, 0, 255).astype(np.uint8) if the values are already in range")
    if x.dim() == 3:
        x = x.unsqueeze(0)
    if x.dim() != 4 or x.shape[1] not in (1, 3):
        raise ShapeError(f"images must have shape (B, C, H, W) or (C, H, W) with C in (1, 3), got {tuple(x.shape)}")
    if shape is not None and tuple(x.shape[1:]) != tuple(shape):
        raise ShapeError(f"images have shape (C, H, W) = {tuple(x.shape[1:])} but the model expects "
                         f"{tuple(shape)}; resize the images or use a model trained at that size")
    b = x.shape[0]
    t = x.permute(0, 2, 3, 1).reshape(b, -1)
    return (t if dtype == torch.uint8 else t.to(dtype)) >> (8 - bits)


def detokenize_tokens(tokens: torch.Tensor, bits: int, shape: tuple[int, int, int]) -> torch.Tensor:
    """long tokens (B, H*W*C) -> uint8 images (B, C, H, W)."""
    check_bits(bits)
    c, h, w = shape
    tokens = _as_tensor(tokens)
    if tokens.dim() == 1:
        tokens = tokens.unsqueeze(0)
    if tokens.dim() != 2 or tokens.shape[1] != c * h * w:
        raise ShapeError(f"tokens must have shape (B, {c * h * w}) for images {shape}, got {tuple(tokens.shape)}")
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= 2 ** bits):
        raise ShapeError(f"token values must lie in [0, {2 ** bits - 1}] for bits={bits}, "
                         f"got [{int(tokens.min())}, {int(tokens.max())}]")
    vals = tokens.long() * 255 // (2 ** bits - 1)
    return vals.reshape(-1, h, w, c).permute(0, 3, 1, 2).contiguous().to(torch.uint8)


def check_bits(bits: int) -> None:
    if not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ShapeError(f"bits must be an integer in 1..8, got {bits!r}")


def position_coords(n: int, height: int, width: int, channels: int, device=None):
    """(row, col, channel) long tensors for token positions 0..n-1."""
    t = torch.arange(n, device=device)
    p = t // channels
    return p // width, p % width, t % channels
