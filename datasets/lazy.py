"""Molecule images drawn on access, with an on-disk render cache: for SMILES sets too large to draw
up front (MOSES train: 1.6M molecules, about an hour at ~500 mol/s).

`LazyMolecules(smiles, style)` indexes like a uint8 array (N, 1, H, W): an int gives one image, an
index array (numpy, list or torch) a stacked batch, a slice a lazy view. Each drawing is cached as
a PNG (lossless, so a cached image has the pixels of a fresh one) under

    <cache>/molrender-v2-<hash of style, size and RDKit version>/<ab>/<hash of the SMILES>.png

written to a temporary file and renamed (atomic: concurrent readers and workers never see half a
file), with the sha256 of its pixels in a PNG text chunk: an entry that is truncated, does not
decode or decodes to other pixels (a flipped byte that PNG decoders let through) is drawn again,
with one note line on stderr per cache. A molecule that cannot be drawn (invalid, or too large for the fixed bond length) gets a
`.skip` marker and is replaced by the next drawable one (index i+1, i+2, ...); `stats` counts the
substitutions. A batch is drawn by `workers` threads (RDKit releases the GIL while it draws). `LazyTokens` is the same, tokenised per batch for training (imggen.training.load_data).
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

import numpy as np

from imggen.errors import DataError
from imggen.storage import cache_root, note_once  # cache_root: the render cache's folder

CACHE_VERSION = 2  # 2: entries carry the sha256 of their pixels
DIGEST = "imggen-sha256"
MAX_SUBSTITUTE = 256  # undrawable molecules in a row before giving up
# threads drawing one batch: RDKit's drawing releases the GIL (160 molecules at 64 px: 0.91 s on one
# thread, 0.48 s on two, on the 2-core box)
WORKERS = min(4, os.cpu_count() or 1)


def style_dir(style, cache_dir=None) -> Path:
    from rdkit import rdBase
    key = json.dumps({"v": CACHE_VERSION, "rdkit": rdBase.rdkitVersion, "style": asdict(style)}, sort_keys=True)
    return cache_root(cache_dir) / f"molrender-v{CACHE_VERSION}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


class RenderCache:
    """One style's drawings on disk: get(smiles) -> uint8 (H, W) image or None (undrawable)."""

    def __init__(self, style, cache_dir=None, use_cache: bool = True):
        self.style, self.use_cache = style, use_cache
        self.root = style_dir(style, cache_dir)
        self.hits = self.misses = self.damaged = 0
        self._lock = threading.Lock()

    def _count(self, hit: bool) -> None:
        with self._lock:
            if hit:
                self.hits += 1
            else:
                self.misses += 1

    def _path(self, smiles: str) -> Path:
        h = hashlib.sha256(smiles.encode()).hexdigest()[:32]
        return self.root / h[:2] / h

    def get(self, smiles: str) -> np.ndarray | None:
        from imggen.datasets.molecules import OK, draw_one
        base = self._path(smiles)
        png, skip = base.with_suffix(".png"), base.with_suffix(".skip")
        if self.use_cache:
            img = self._read(png)
            if img is not None:
                self._count(True)
                return img
            if skip.is_file():
                self._count(True)
                return None
        self._count(False)
        status, img = draw_one(smiles, self.style)
        if self.use_cache:
            self._write(png if status == OK else skip, img)
        return img if status == OK else None

    def _read(self, png: Path) -> np.ndarray | None:
        """The cached drawing, or None when absent or damaged (then it is drawn again)."""
        from PIL import Image
        try:
            with Image.open(png) as im:
                img = np.asarray(im.convert("L"))
                digest = getattr(im, "text", {}).get(DIGEST)
        except FileNotFoundError:
            return None
        except Exception as e:  # noqa: BLE001 - a damaged file: Pillow raises several types
            return self._damaged(png, f"{type(e).__name__}: {e}")
        if img.shape != (self.style.height, self.style.width):
            return self._damaged(png, f"{img.shape[1]}x{img.shape[0]} px, not {self.style.width}x{self.style.height}")
        if digest != hashlib.sha256(img.tobytes()).hexdigest():
            return self._damaged(png, "its pixels do not match the checksum written with them")
        return img

    def _damaged(self, png: Path, why: str) -> None:
        with self._lock:
            first, self.damaged = not self.damaged, self.damaged + 1
        if first:
            note_once(f"render cache entry {png} is damaged ({why}); drawing it again (other damaged "
                      f"entries of this cache are redrawn without a note)")

    def _write(self, path: Path, img) -> None:
        from PIL import Image
        from PIL.PngImagePlugin import PngInfo
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if img is None:
                tmp.write_bytes(b"")
            else:
                info = PngInfo()
                info.add_text(DIGEST, hashlib.sha256(np.ascontiguousarray(img).tobytes()).hexdigest())
                Image.fromarray(img).save(tmp, format="PNG", pnginfo=info)
            os.replace(tmp, path)
        except OSError:  # a read-only or full cache only costs speed
            tmp.unlink(missing_ok=True)


def _indices(key, n: int) -> np.ndarray:
    if hasattr(key, "detach"):
        key = key.detach().cpu().numpy()
    idx = np.asarray(key)
    if idx.dtype == bool:
        idx = np.flatnonzero(idx)
    if idx.ndim != 1 or (idx.size and not np.issubdtype(idx.dtype, np.integer)):
        raise IndexError(f"lazy molecules take an int, a slice or a 1-D integer index array, got {key!r}")
    if idx.size and (idx.max() >= n or idx.min() < -n):
        raise IndexError(f"index {int(idx.max() if idx.max() >= n else idx.min())} out of range for {n} molecules")
    return np.where(idx < 0, idx + n, idx)


class LazyMolecules:
    """uint8 drawings (N, 1, H, W) of `smiles` in `style`, drawn (or read from the cache) on access."""

    is_lazy = True

    def __init__(self, smiles, style, cache_dir=None, use_cache: bool = True, workers: int = WORKERS,
                 _cache=None, _stats=None):
        self.smiles = smiles if isinstance(smiles, list) else list(smiles)
        self.style, self.workers = style, workers
        self.cache = _cache or RenderCache(style, cache_dir, use_cache)
        self.stats = _stats if _stats is not None else {"substituted": 0}
        self._lock = threading.Lock()

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (len(self.smiles), 1, self.style.height, self.style.width)

    dtype = np.dtype(np.uint8)
    ndim = 4

    def __len__(self) -> int:
        return len(self.smiles)

    def __repr__(self) -> str:
        return f"LazyMolecules({len(self)} molecules, style {self.style.name} {self.style.height}x{self.style.width})"

    def drawn(self, i: int, count: bool = True) -> tuple[int, np.ndarray]:
        """(index of the molecule drawn for i, its image): i, or the next drawable one (counted in
        stats["substituted"] when `count`)."""
        n = len(self.smiles)
        for k in range(min(n, MAX_SUBSTITUTE)):
            j = (i + k) % n
            img = self.cache.get(self.smiles[j])
            if img is not None:
                if k and count:
                    with self._lock:
                        self.stats["substituted"] += 1
                return j, img
        raise DataError(f"{MAX_SUBSTITUTE if n > MAX_SUBSTITUTE else n} molecules in a row from index {i} cannot be "
                        f"drawn at {self.style.height}x{self.style.width} (style {self.style.name}): invalid SMILES "
                        f"or too large for the fixed bond length; use a larger image size or other molecules")

    def __getitem__(self, key):
        n = len(self.smiles)
        if isinstance(key, slice):
            return LazyMolecules(self.smiles[key], self.style, workers=self.workers, _cache=self.cache,
                                 _stats=self.stats)
        if isinstance(key, (int, np.integer)):
            if not -n <= key < n:
                raise IndexError(f"index {key} out of range for {n} molecules")
            return self.drawn(int(key) % n)[1][None]
        idx = _indices(key, n)
        out = np.empty((len(idx), 1, self.style.height, self.style.width), np.uint8)

        def fill(r):
            out[r, 0] = self.drawn(int(idx[r]))[1]
        if self.workers > 1 and len(idx) > 1:
            with ThreadPoolExecutor(min(self.workers, len(idx))) as pool:
                list(pool.map(fill, range(len(idx))))
        else:
            for r in range(len(idx)):
                fill(r)
        return out

    def __array__(self, dtype=None, copy=None):
        """All drawings as one array (np.asarray of a view, e.g. `eval bpd --split train --limit 8`)."""
        out = self[np.arange(len(self))]
        return out if dtype is None else out.astype(dtype)

    def smiles_drawn(self, i: int) -> str:
        return self.smiles[self.drawn(i, count=False)[0]]

    def tokens(self, bits: int, shape) -> "LazyTokens":
        return LazyTokens(self, bits, tuple(shape))


class LazyTokens:
    """Training tokens (N, seq_len) uint8 of a LazyMolecules, tokenised per batch."""

    is_lazy = True

    def __init__(self, images: LazyMolecules, bits: int, shape):
        self.images, self.bits, self.shape_chw = images, bits, tuple(shape)

    def __len__(self) -> int:
        return len(self.images)

    def __repr__(self) -> str:
        return f"LazyTokens({self.images!r}, bits {self.bits})"

    def __getitem__(self, key):
        import torch

        from imggen.tokens import tokenize
        if isinstance(key, slice):
            return LazyTokens(self.images[key], self.bits, self.shape_chw)
        single = isinstance(key, (int, np.integer))
        imgs = self.images[np.array([key]) if single else key]
        tok = tokenize(torch.from_numpy(imgs), self.bits, shape=self.shape_chw).to(torch.uint8)
        return tok[0] if single else tok

    def sample(self, num: int = 256, seed: int = 0):
        """Tokens of a fixed seeded subset of `num` molecules (e.g. for the unigram entropy of the data)."""
        rng = np.random.default_rng(seed)
        n = len(self)
        idx = np.sort(rng.choice(n, size=min(num, n), replace=False))
        return self[idx]
