"""Fashion-MNIST and MNIST from their four idx files (`--data fashion-mnist[:DIR]`, `--data mnist:DIR`).

Both data sets ship the same four files, gzipped or not: train-images-idx3-ubyte,
train-labels-idx1-ubyte, t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte. `fashion-mnist` without a
folder reads Debian's package `dataset-fashion-mnist` (/usr/share/datasets/fashion-mnist).

Splits: test = the official 10,000 test images; val = a fixed 5,000 of the official training images
(the same for every --train.seed, so runs of different seeds are scored on the same images; 10% when
fewer are present); train = the rest. `meta["labels"][split]` holds the class ids, `info["classes"]`
their names.

Size / colour: native 1x28x28, kept as is (published bits/dim are per 784 dims). Another
`height`/`width` is an antialiased bilinear resize; `channels=3` repeats the grey plane.

Every file is checked before anything is returned: the magic number (2051 images, 2049 labels), the
byte count its header promises, and that images and labels count the same. A bad file is one
DataError naming it.
"""
from __future__ import annotations

import gzip
import os
import zlib
from pathlib import Path

import numpy as np

from imggen.datasets import ImageSplits, resize_images
from imggen.errors import ConfigError, DataError

DEBIAN_DIR = "/usr/share/datasets/fashion-mnist"
FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
         "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}
MAGIC_IMAGES, MAGIC_LABELS = 2051, 2049
VAL_SIZE, VAL_SEED = 5000, 20261205  # the val holdout does not move with --train.seed
CLASSES = {"fashion-mnist": ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt",
                             "Sneaker", "Bag", "Ankle boot"],
           "mnist": [str(d) for d in range(10)]}
EXPECTED = ", ".join(f + "[.gz]" for pair in FILES.values() for f in pair)


def how_to_get(kind: str) -> str:
    get = ("apt-get install dataset-fashion-mnist (Debian/Ubuntu; the files land in "
           f"{DEBIAN_DIR}) or pass the folder of the files as --data fashion-mnist:DIR"
           if kind == "fashion-mnist" else "pass the folder of MNIST's files as --data mnist:DIR")
    return f"{get}; the folder must hold the four idx files {EXPECTED}"


def _find(folder: Path, name: str, kind: str) -> Path:
    for cand in (folder / name, folder / (name + ".gz")):
        if cand.is_file():
            return cand
    raise DataError(f"{kind}: {folder} has no {name} (or {name}.gz); {how_to_get(kind)}")


def _read_bytes(file: Path, kind: str) -> bytes:
    try:
        if file.suffix == ".gz":
            with gzip.open(file, "rb") as f:
                return f.read()
        return file.read_bytes()
    except (OSError, EOFError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
        raise DataError(f"{kind}: {file} cannot be read ({type(e).__name__}: {e}); the file is truncated or "
                        f"corrupt, fetch it again") from None


def read_idx(file: Path, magic: int, kind: str = "idx") -> np.ndarray:
    """The uint8 array of one idx file (images (N, rows, cols) or labels (N,)), after checking its
    magic number and that its size is what its header says."""
    raw = _read_bytes(file, kind)
    what = "images (idx3)" if magic == MAGIC_IMAGES else "labels (idx1)"
    ndim = magic & 0xFF
    if len(raw) < 4 + 4 * ndim:
        raise DataError(f"{kind}: {file} is {len(raw)} bytes, too short for an idx header; the file is truncated")
    found = int.from_bytes(raw[:4], "big")
    if found != magic:
        raise DataError(f"{kind}: {file} has magic number {found}, expected {magic} for {what}; is it the right "
                        f"file (or a gzip file without the .gz name)?")
    dims = [int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    need = 4 + 4 * ndim + int(np.prod(dims))
    if len(raw) != need:
        raise DataError(f"{kind}: {file} holds {len(raw)} bytes but its header ({' x '.join(map(str, dims))}) "
                        f"promises {need}; the file is truncated or corrupt, fetch it again")
    return np.frombuffer(raw, np.uint8, offset=4 + 4 * ndim).reshape(dims).copy()  # writable


def read_split(folder: Path, split: str, kind: str) -> tuple[np.ndarray, np.ndarray]:
    img_file, lab_file = (_find(folder, name, kind) for name in FILES[split])
    x = read_idx(img_file, MAGIC_IMAGES, kind)
    y = read_idx(lab_file, MAGIC_LABELS, kind)
    if len(x) != len(y):
        raise DataError(f"{kind}: {img_file} holds {len(x)} images but {lab_file} {len(y)} labels; the two "
                        f"files must come from the same release")
    if len(x) == 0:
        raise DataError(f"{kind}: {img_file} holds no images")
    return x, y.astype(np.int64)


def load(path, *, height: int = 28, width: int = 28, channels: int = 1, seed: int = 0, kind: str = "fashion-mnist",
         **_) -> ImageSplits:
    if channels not in (1, 3):
        raise ConfigError(f"{kind}: channels={channels} not supported; use 1 (grey, native) or 3 (grey repeated)")
    folder = Path(os.path.expanduser(path or DEBIAN_DIR))
    if not folder.is_dir():
        raise DataError(f"{kind}: folder {folder} does not exist; {how_to_get(kind)}")
    (pool_x, pool_y), (test_x, test_y) = read_split(folder, "train", kind), read_split(folder, "test", kind)
    n = len(pool_x)
    n_val = min(VAL_SIZE, max(1, round(0.1 * n))) if n > 1 else 0
    val_idx = np.sort(np.random.default_rng(VAL_SEED).permutation(n)[:n_val])
    keep = np.ones(n, bool)
    keep[val_idx] = False
    parts = {"train": (pool_x[keep], pool_y[keep]), "val": (pool_x[val_idx], pool_y[val_idx]),
             "test": (test_x, test_y)}
    out, labels = {}, {}
    for s, (x, y) in parts.items():
        x = resize_images(np.ascontiguousarray(x[:, None]), height, width)
        out[s] = np.ascontiguousarray(np.repeat(x, 3, axis=1) if channels == 3 else x)
        labels[s] = y.tolist()
    return ImageSplits(**out, meta={"labels": labels},
                       info={"source": f"{kind} ({folder})", "classes": CLASSES[kind], "skipped": 0,
                             "licence": "Fashion-MNIST: MIT (Zalando Research)" if kind == "fashion-mnist"
                             else "MNIST: CC BY-SA 3.0 (LeCun, Cortes, Burges)"})
