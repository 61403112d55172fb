"""Run I/O for the evaluation CLI: a run directory's model and config, its data, its log, image
files, and strict JSON output."""
from __future__ import annotations

import json
import math
import os
import warnings
import zipfile
from dataclasses import dataclass

import numpy as np
import torch

from imggen.errors import ConfigError, DataError


@dataclass
class Run:
    path: str          # what the user passed
    ckpt: str          # resolved checkpoint directory
    run_dir: str | None  # the run directory (holds log.jsonl / metrics.json) when there is one
    cfg: object        # imggen.config.Config
    model: torch.nn.Module
    step: int | None


def load_run(path: str, device: str = "cpu") -> Run:
    """Model + full config of a run dir / checkpoint dir (CheckpointError when missing)."""
    from imggen.checkpoint import load_model, read_config, resolve

    ckpt = resolve(path)
    cfg, model = read_config(ckpt), load_model(ckpt, device)
    run_dir = None
    for cand in (path, os.path.dirname(os.path.dirname(os.path.abspath(ckpt)))):
        if os.path.isdir(cand) and (os.path.exists(os.path.join(cand, "config.json"))
                                    and os.path.isdir(os.path.join(cand, "checkpoints"))):
            run_dir = cand
            break
    step = None
    base = os.path.basename(os.path.normpath(ckpt))
    if base.startswith("step_"):
        try:
            step = int(base[5:])
        except ValueError:
            pass
    return Run(path, ckpt, run_dir, cfg, model, step)


def load_data(cfg, spec: str | None = None):
    """The run's data (or `spec`) at the model's size; DataError naming --data on failure."""
    from imggen.datasets import load_dataset

    spec = spec or cfg.data.spec
    m = cfg.model
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return load_dataset(spec, height=m.height, width=m.width, channels=m.channels, seed=cfg.train.seed,
                                skip_bad=True, progress=False)
    except DataError as e:
        raise DataError(f"cannot load evaluation data {spec!r} ({e}); pass --data KIND[:PATH]") from None


def split_images(data, name: str, limit: int | None):
    imgs = data.split(name)
    if limit is not None:
        if limit < 1:
            raise ConfigError(f"--limit must be >= 1, got {limit}")
        imgs = imgs[:limit]
    if len(imgs) == 0:
        raise DataError(f"the {name} split of the evaluation data is empty")
    if getattr(imgs, "is_lazy", False):  # drawn on access (--data moses train): only a --limit of it
        if limit is None:
            raise ConfigError(f"the {name} split ({len(imgs):,} molecules) is drawn on access; evaluate a part "
                              f"of it with --limit N")
        imgs = np.asarray(imgs)
    return imgs


def jsonable(x):
    """Replace non-finite floats by None, numpy scalars/arrays by Python values (strict JSON)."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return jsonable(x.tolist())
    if isinstance(x, (np.floating, float)):
        return float(x) if math.isfinite(float(x)) else None
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.bool_):
        return bool(x)
    return x


def write_json(obj, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(jsonable(obj), f, indent=2, allow_nan=False)
        f.write("\n")


_NPZ_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")  # a zip archive (an empty one starts with the second)
_NPY_MAGIC = b"\x93NUMPY"


def _read_array(path: str) -> tuple[np.ndarray, str]:
    """(array, where) from an .npz (key 'images', else its only array) or an .npy file."""
    hint = "pass an .npz of uint8 images (np.savez(path, images=...)) or a folder of PNG/JPEG files"
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError as e:
        raise DataError(f"cannot read {path} ({e.strerror or e}); {hint}") from None
    if not (head.startswith(_NPZ_MAGIC) or head.startswith(_NPY_MAGIC)):
        what = "an empty file" if not head else "not an .npz or .npy file (no zip / NumPy header)"
        raise DataError(f"{path} is {what}; {hint}")
    try:
        if head.startswith(_NPY_MAGIC):
            return np.load(path, allow_pickle=False), path
        with np.load(path, allow_pickle=False) as z:
            keys = list(z.keys())
            key = "images" if "images" in keys else keys[0] if len(keys) == 1 else None
            arr = None if key is None else z[key]
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise DataError(f"cannot read {path} as .npz/.npy ({' '.join(str(e).split())}); {hint}") from None
    if key is None:
        found = ", ".join(repr(k) for k in keys) if keys else "none"
        raise DataError(f"{path} has no 'images' array (arrays found: {found}); save the images under the "
                        f"key 'images' (np.savez(path, images=...)) or as the file's only array")
    return arr, f"{path}[{key!r}]"


def load_images(path: str) -> np.ndarray:
    """uint8 (N, C, H, W) from an .npz (key 'images', else its only array), an .npy or a folder of images."""
    from imggen.images import load_image

    if not os.path.exists(path):
        raise DataError(f"{path} does not exist; pass an .npz of uint8 images or a folder of PNG/JPEG files")
    if os.path.isdir(path):
        names = sorted(f for f in os.listdir(path)
                       if f.lower().endswith((".png", ".jpg", ".jpeg", ".bmp", ".webp")))
        if not names:
            raise DataError(f"folder {path} holds no .png/.jpg images")
        arrs = [load_image(os.path.join(path, f), 3) for f in names]
        shapes = {a.shape for a in arrs}
        if len(shapes) > 1:
            raise DataError(f"images in {path} have different sizes {sorted(shapes)[:3]}...; resize them to one size")
        return np.stack(arrs)
    a, where = _read_array(path)
    if a.dtype != np.uint8:
        raise DataError(f"{where}: images must be uint8 0..255, got {a.dtype}")
    if a.ndim == 3:
        a = a[:, None]
    if a.ndim != 4:
        raise DataError(f"{where}: expected images (N, C, H, W), (N, H, W, C) or (N, H, W), got {a.shape}")
    if a.shape[1] not in (1, 3) and a.shape[-1] in (1, 3):
        a = a.transpose(0, 3, 1, 2)
    if a.shape[1] not in (1, 3):
        raise DataError(f"{where}: images need 1 or 3 channels, got shape {a.shape}")
    return np.ascontiguousarray(a)


def limit_note(limit: int | None, n: int, what: str, done: str) -> str | None:
    """The note when --limit asked for more than the `n` `what` there are (None otherwise)."""
    if limit is None or n >= limit:
        return None
    return f"--limit {limit} is more than the {n} {what}; {done} all {n}"


def check_fid_set(images: np.ndarray, what: str) -> np.ndarray:
    """`images` unless FID cannot use them (fewer than 2: no covariance); DataError naming `what`."""
    if len(images) < 2:
        raise DataError(f"{what} holds {len(images)} image(s); FID needs at least 2 per set for a covariance")
    return images


def read_log(run_dir: str | None) -> list[dict]:
    if not run_dir:
        return []
    path = os.path.join(run_dir, "log.jsonl")
    rows = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line:
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError:
                        continue  # a line cut by a killed run
    return rows
