"""Any directory tree of PNG / JPEG images.

Every `*.png|*.jpg|*.jpeg` below `path` (sorted by relative path) is decoded with Pillow,
converted to `channels` (1: luma 'L', 3: 'RGB'; alpha dropped; 16-bit grayscale scaled to 8 bit),
centre-cropped to the target aspect ratio (square when height == width) and resized to
(height, width) with bilinear (antialiased) resampling. Splits: `split_indices` over images
(90/5/5, by `seed`); `meta["files"][split]` holds the relative paths.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from imggen.datasets import SKIP_HINT, ImageSplits, read_each, split_indices
from imggen.errors import ConfigError, DataError
from imggen.images import decoded

EXTENSIONS = {".png", ".jpg", ".jpeg"}


def _load_image(file: Path, height: int, width: int, channels: int) -> np.ndarray:
    try:
        im = decoded(file, "L" if channels == 1 else "RGB")
    except DataError as e:
        raise DataError(f"{e}; remove or replace the file{SKIP_HINT}") from None
    w, h = im.size
    target = width / height
    cw, ch = (w, round(w / target)) if w / h < target else (round(h * target), h)
    cw, ch = max(1, min(cw, w)), max(1, min(ch, h))
    left, top = (w - cw) // 2, (h - ch) // 2
    im = im.crop((left, top, left + cw, top + ch)).resize((width, height), Image.Resampling.BILINEAR)
    a = np.asarray(im, dtype=np.uint8)
    return a[None] if channels == 1 else a.transpose(2, 0, 1)


def load(path, *, height: int, width: int, channels: int, seed: int = 0, skip_bad: bool = False,
         progress: bool = True, **_) -> ImageSplits:
    if channels not in (1, 3):
        raise ConfigError(f"folder: channels={channels} not supported; use 1 (grayscale) or 3 (RGB)")
    root = Path(path).expanduser()
    if not root.is_dir():
        raise DataError(f"image folder {root} does not exist (or is not a directory); pass --data folder:DIR")
    files = sorted(f for f in root.rglob("*") if f.suffix.lower() in EXTENSIONS and f.is_file())
    if not files:
        raise DataError(f"image folder {root} contains no PNG/JPEG files ({', '.join(sorted(EXTENSIONS))})")
    done, skipped = read_each(files, lambda f: _load_image(f, height, width, channels), kind="folder",
                              what="unreadable image(s)", skip_bad=skip_bad, progress=f"images in {root.name}" if progress else None)
    names, images = [str(f.relative_to(root)) for f, _ in done], [a for _, a in done]
    if not images:
        raise DataError(f"image folder {root}: none of the {len(files)} image files could be read")
    x = np.stack(images)
    idx = split_indices(len(x), seed)
    return ImageSplits(**{s: x[i] for s, i in idx.items()},
                       meta={"files": {s: [names[j] for j in i] for s, i in idx.items()}},
                       info={"source": str(root), "skipped": len(skipped), "skipped_items": skipped})
