"""CIFAR-10 from the official python pickles (`cifar-10-batches-py`).

Splits: train = data_batch_1..5 minus a deterministic validation holdout (5,000 images for the
full 50,000; 10% when fewer images are present), chosen by `seed`; test = the official test_batch.
`meta["labels"][split]` holds the class ids (0..9), `info["classes"]` the names (batches.meta).

Size / colour: the native format is 3x32x32. Other `height`/`width` are produced by bilinear
resizing with antialiasing; `channels=1` converts to luma (ITU-R 601: 0.299 R + 0.587 G +
0.114 B). Any other channel count is a ConfigError.

The pickles are read with a restricted unpickler that only accepts numpy arrays, lists, str/bytes
and numbers, so a tampered file cannot run code.
"""
from __future__ import annotations

import hashlib
import io
import pickle
from pathlib import Path

import numpy as np

from imggen.datasets import ImageSplits, read_each, resize_images
from imggen.errors import ConfigError, DataError

URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
FOLDER = "cifar-10-batches-py"
TRAIN_FILES = ["data_batch_1", "data_batch_2", "data_batch_3", "data_batch_4", "data_batch_5"]
TEST_FILE = "test_batch"
MD5 = {  # official checksums (as published with the tarball, also in torchvision)
    "data_batch_1": "c99cafc152244af753f735de768cd75f",
    "data_batch_2": "d4bba439e000b95fd0a9bffe97cbabec",
    "data_batch_3": "54ebc095f3ab1f0389bbae665268c751",
    "data_batch_4": "634d18415352ddfa80567beed471001a",
    "data_batch_5": "482c414d41f54cd18b22e5b47cb7c3cb",
    "test_batch": "40351d587109b95175f43aff81a1287e",
    "batches.meta": "5ff9c542aee3614f3951f8cda6e48888",
}
HOW_TO_GET = (f"download {URL} and extract it (tar xzf cifar-10-python.tar.gz); pass the extracted "
              f"'{FOLDER}' folder (or its parent) as --data cifar:PATH")


class _SafeUnpickler(pickle.Unpickler):
    _ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
                ("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "scalar"),
                ("numpy._core.multiarray", "scalar"), ("numpy.core.numeric", "_frombuffer"),
                ("numpy._core.numeric", "_frombuffer"), ("_codecs", "encode")}

    def find_class(self, module, name):
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"unexpected object {module}.{name} (not a CIFAR batch)")


def _find_folder(path) -> Path:
    p = Path(path).expanduser()
    for cand in (p, p / FOLDER):
        if (cand / TEST_FILE).exists() or (cand / TRAIN_FILES[0]).exists():
            return cand
    if not p.exists():
        raise DataError(f"CIFAR-10 folder {p} does not exist; {HOW_TO_GET}")
    raise DataError(f"{p} holds no CIFAR-10 batches (expected {FOLDER}/data_batch_1..5, test_batch); {HOW_TO_GET}")


def _read_batch(file: Path, verify_md5: bool):
    if not file.is_file():
        raise DataError(f"missing CIFAR-10 file {file}; {HOW_TO_GET}")
    raw = file.read_bytes()
    if verify_md5 and file.name in MD5 and hashlib.md5(raw).hexdigest() != MD5[file.name]:
        raise DataError(f"{file}: MD5 {hashlib.md5(raw).hexdigest()} != official {MD5[file.name]}; "
                        f"the file is corrupt or modified, re-download {URL}")
    try:
        d = _SafeUnpickler(io.BytesIO(raw), encoding="bytes").load()
    except Exception as e:
        raise DataError(f"{file}: not a readable CIFAR-10 pickle ({type(e).__name__}: {e}); "
                        f"re-download {URL}") from e
    if not isinstance(d, dict) or b"data" not in d or b"labels" not in d:
        raise DataError(f"{file}: pickle lacks the keys b'data' and b'labels' of a CIFAR-10 batch; "
                        f"is this CIFAR-100 or another file? {HOW_TO_GET}")
    data, labels = np.asarray(d[b"data"]), np.asarray(d[b"labels"])
    if data.ndim != 2 or data.shape[1] != 3072 or len(labels) != len(data) or data.dtype != np.uint8:
        raise DataError(f"{file}: b'data' has shape {data.shape} dtype {data.dtype} with {len(labels)} labels; "
                        f"a CIFAR-10 batch has uint8 (N, 3072) and N labels. {HOW_TO_GET}")
    return data.reshape(-1, 3, 32, 32), labels.astype(np.int64)


def _convert(x: np.ndarray, height: int, width: int, channels: int) -> np.ndarray:
    if channels == 1:
        y = np.tensordot(np.array([0.299, 0.587, 0.114]), x.astype(np.float64), axes=([0], [1]))
        x = np.clip(np.round(y), 0, 255).astype(np.uint8)[:, None]
    return np.ascontiguousarray(resize_images(x, height, width))


def load(path, *, height: int = 32, width: int = 32, channels: int = 3, seed: int = 0,
         skip_bad: bool = False, verify_md5: bool = False, **_) -> ImageSplits:
    if channels not in (1, 3):
        raise ConfigError(f"cifar: channels={channels} not supported; use 3 (RGB) or 1 (grayscale)")
    if height < 1 or width < 1:
        raise ConfigError(f"cifar: bad image size {height}x{width}")
    folder = _find_folder(path)
    files = [("train", name) for name in TRAIN_FILES] + [("test", TEST_FILE)]
    done, skipped = read_each(files, lambda f: _read_batch(folder / f[1], verify_md5), kind="cifar",
                              what="bad file(s)", skip_bad=skip_bad)
    parts = {split: [batch for (s, _), batch in done if s == split] for split in ("train", "test")}
    if not parts["train"]:
        raise DataError(f"{folder}: no readable training batch; {HOW_TO_GET}")

    def cat(ps):
        if not ps:
            return np.zeros((0, 3, 32, 32), np.uint8), np.zeros(0, np.int64)
        return np.concatenate([p[0] for p in ps]), np.concatenate([p[1] for p in ps])

    pool_x, pool_y = cat(parts["train"])
    test_x, test_y = cat(parts["test"])
    n = len(pool_x)
    n_val = min(5000, max(1, round(0.1 * n)))
    val_idx = np.sort(np.random.default_rng(seed).permutation(n)[:n_val])
    keep = np.ones(n, bool)
    keep[val_idx] = False
    labels_meta = {}
    try:
        m = _SafeUnpickler(io.BytesIO((folder / "batches.meta").read_bytes()), encoding="bytes").load()
        classes = [c.decode() for c in m[b"label_names"]]
    except Exception:
        classes = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    splits = {"train": (pool_x[keep], pool_y[keep]), "val": (pool_x[val_idx], pool_y[val_idx]),
              "test": (test_x, test_y)}
    out = {}
    for s, (x, y) in splits.items():
        out[s] = _convert(x, height, width, channels)
        labels_meta[s] = y.tolist()
    return ImageSplits(**out, meta={"labels": labels_meta},
                       info={"source": f"CIFAR-10 ({folder})", "classes": classes, "skipped": len(skipped),
                             "skipped_items": skipped,
                             "licence": "CIFAR-10, Krizhevsky 2009; no explicit licence, cite the tech report"})
