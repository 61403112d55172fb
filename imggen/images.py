"""Reading and writing images (PNG grids, single images) with clear errors."""
from __future__ import annotations

import math
import os

import numpy as np
from PIL import Image, UnidentifiedImageError

from imggen.errors import DataError
from imggen.storage import writing


def make_grid(images: np.ndarray, nrow: int | None = None, pad: int = 2, value: int = 128) -> np.ndarray:
    """uint8 (B, C, H, W) -> uint8 (H', W', C) grid with `pad` pixels of `value` between cells."""
    images = np.asarray(images)
    b, c, h, w = images.shape
    nrow = nrow or max(1, math.ceil(math.sqrt(b)))
    rows = math.ceil(b / nrow)
    grid = np.full((rows * (h + pad) + pad, nrow * (w + pad) + pad, c), value, dtype=np.uint8)
    for i in range(b):
        r, col = divmod(i, nrow)
        y, x = pad + r * (h + pad), pad + col * (w + pad)
        grid[y:y + h, x:x + w] = images[i].transpose(1, 2, 0)
    return grid


def image_scale(width: int) -> int:
    """Upscale factor that shows an image about 128 px wide (grids, fills, triplets)."""
    return max(1, 128 // max(1, width))


def save_image(array_hwc: np.ndarray, path: str, scale: int = 1) -> None:
    """Save uint8 (H, W, C) as PNG (atomically: temp file + rename; no temp file is left on failure;
    StorageError when storage fails)."""
    a = array_hwc[..., 0] if array_hwc.shape[-1] == 1 else array_hwc
    img = Image.fromarray(np.ascontiguousarray(a))
    if scale > 1:
        img = img.resize((img.width * scale, img.height * scale), Image.NEAREST)
    tmp = path + ".tmp"

    def remove():
        if os.path.isfile(tmp):
            os.remove(tmp)
    try:
        with writing(path):  # a full disk, a quota or a read-only folder: one StorageError
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            img.save(tmp, format="PNG")
            os.replace(tmp, path)
    except BaseException:  # the StorageError, any other failure, Ctrl-C: no temporary file left
        remove()
        raise


def save_grid(images, path: str, nrow: int | None = None, scale: int = 1) -> None:
    save_image(make_grid(np.asarray(images), nrow), path, scale)


def to_8bit(img: Image.Image) -> Image.Image:
    """16-bit grayscale (mode I;16*, or I holding values above 255) -> 8-bit 'L', scaled by 1/257 so
    that 65535 -> 255 (Pillow's convert would clip every value above 255); other images unchanged."""
    if not (img.mode.startswith("I;16") or img.mode == "I"):
        return img
    a = np.asarray(img, dtype=np.float64)
    if img.mode != "I" or a.max(initial=0) > 255:
        a = a / 257.0
    return Image.fromarray(np.clip(np.round(a), 0, 255).astype(np.uint8))


MAX_PIXELS = 40_000_000  # ~6300 x 6300: far above any image imggen models; bounds what a file can make us allocate


def decoded(path, mode: str) -> Image.Image:
    """The image at `path` decoded and converted to `mode` ("L" or "RGB"; 16-bit scaled to 8).

    The size the file declares is checked before a pixel is decoded, so a small file that declares
    100000 x 100000 pixels (a decompression bomb) is one DataError, not gigabytes of memory; so is
    any file Pillow cannot decode."""
    try:
        with Image.open(path) as img:
            w, h = img.size
            if w * h > MAX_PIXELS:
                raise DataError(f"image {path} declares {w} x {h} pixels, more than imggen reads "
                                f"({MAX_PIXELS:,}); resize it first")
            img.load()
            return to_8bit(img).convert(mode)
    except DataError:
        raise
    except Image.DecompressionBombError as e:  # Pillow's own check, at open, past ~179 M pixels
        raise DataError(f"image {path} declares more pixels than imggen reads ({MAX_PIXELS:,}; {e}); "
                        f"resize it first") from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as e:
        raise DataError(f"cannot read image {path}: {type(e).__name__}: {e}") from None


def load_image(path: str, channels: int) -> np.ndarray:
    """PNG/JPEG -> uint8 (C, H, W) with C = channels (grayscale or RGB conversion; 16-bit scaled)."""
    if not os.path.exists(path):
        raise DataError(f"image file {path} does not exist")
    a = np.asarray(decoded(path, "L" if channels == 1 else "RGB"), dtype=np.uint8)
    return a[None] if a.ndim == 2 else a.transpose(2, 0, 1).copy()
