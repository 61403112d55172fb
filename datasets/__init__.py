"""Domain adapters: turn on-disk data into uint8 image arrays (N, C, H, W) with fixed splits.

`load_dataset("KIND[:PATH]", height=, width=, channels=)` is the single entry point used by
train.py (`--data KIND:PATH`), sample.py and the evaluation CLI. Each adapter module exposes
`load(path, *, height, width, channels, seed, skip_bad, **opts) -> ImageSplits`.
"""
from __future__ import annotations

import importlib
import os
import warnings
from dataclasses import dataclass, field

import numpy as np

from imggen.errors import DataError

# ends the message of a DataError that skip_bad would skip (read_each drops it once skipping is on)
SKIP_HINT = " (or pass --skip-bad; skip_bad=True in Python)"


class DataWarning(UserWarning):
    """Unreadable data items that were skipped; the command lines print it as one plain line."""


# kind -> (module, needs_path)
ADAPTERS = {
    "molecules": ("imggen.datasets.molecules", False),  # no path: the shipped MOSES sample
    "moses": ("imggen.datasets.moses", False),  # full MOSES from the molsets wheel (train drawn lazily)
    "brats": ("imggen.datasets.brats", True),
    "brats-demo": ("imggen.datasets.brats_demo", False),  # shipped MNI152 slices + challenge-like masks
    "cifar": ("imggen.datasets.cifar", True),
    "folder": ("imggen.datasets.folder", True),
    "fashion-mnist": ("imggen.datasets.idx", False),  # no path: Debian's dataset-fashion-mnist folder
    "mnist": ("imggen.datasets.idx", True),  # the same four idx files
}


@dataclass
class ImageSplits:
    """uint8 images (N, C, H, W) per split; optional per-split extras.

    masks: bool (N, 1, H, W) per split, True = region to inpaint (BraTS inpainting data).
    meta:  per-split lists, e.g. meta["smiles"]["test"][i] is the SMILES drawn in test[i].
    neighbours, neighbour_masks (volume data asked for context_slices=s, a 2.5-D context): int
      (N, 2s+1), the index in the same split of slice z+d of image i's volume, d = -s..s (-1: not in
      the split: outside the volume, or dropped), and bool (N, 2s+1, H, W), image i's 3-D hole cut at
      those slices (the middle one is masks[i]).
    fills (volume data asked for fills3d=True): uint8 (N, C, H, W) per split, image i with its data
      mask's hole filled by the 3-D biharmonic fill of its volume (the context's classic channel of a
      model with model.context_fill "biharmonic3d").
    """

    train: np.ndarray
    val: np.ndarray
    test: np.ndarray
    masks: dict[str, np.ndarray] = field(default_factory=dict)
    meta: dict[str, dict[str, list]] = field(default_factory=dict)
    info: dict = field(default_factory=dict)  # free-form: counts of skipped items, source, licence
    neighbours: dict[str, np.ndarray] = field(default_factory=dict)
    neighbour_masks: dict[str, np.ndarray] = field(default_factory=dict)
    fills: dict[str, np.ndarray] = field(default_factory=dict)

    def split(self, name: str) -> np.ndarray:
        if name not in ("train", "val", "test"):
            raise DataError(f"unknown split {name!r}; use train, val or test")
        return getattr(self, name)


def parse_spec(spec: str) -> tuple[str, str | None]:
    kind, _, path = spec.partition(":")
    if kind not in ADAPTERS:
        raise DataError(f"unknown data kind {kind!r} in --data {spec!r}; choose one of {', '.join(ADAPTERS)}")
    needs_path = ADAPTERS[kind][1]
    if needs_path and not path:
        raise DataError(f"--data {kind} needs a path: --data {kind}:PATH")
    if kind == "brats-demo" and path and not path.startswith("masks="):
        raise DataError(f"--data {spec}: brats-demo takes no path (its slices ship with imggen; the one option is "
                        f"brats-demo:masks=challenge|ellipses); for BraTS cases of your own use --data brats:PATH")
    if kind == "molecules" and path and os.path.isdir(path):
        raise DataError(f"--data {spec}: {path} is a directory; expected a .csv, .smi or .sdf file of molecules")
    return kind, (path or None)


def load_dataset(spec: str, *, height: int, width: int, channels: int, seed: int = 0,
                 skip_bad: bool = False, **opts) -> ImageSplits:
    kind, path = parse_spec(spec)
    module = importlib.import_module(ADAPTERS[kind][0])
    if kind == "brats-demo":  # brats-demo:masks=ellipses -> the old small holes (default: challenge-like)
        if path:
            opts["masks"] = path.partition("=")[2]
        return module.load_demo(height=height, width=width, channels=channels, seed=seed, **opts)
    if kind in ("fashion-mnist", "mnist"):
        opts["kind"] = kind
    return module.load(path, height=height, width=width, channels=channels, seed=seed,
                       skip_bad=skip_bad, **opts)


def resize_images(x: np.ndarray, height: int, width: int) -> np.ndarray:
    """uint8 (N, C, h, w) resized to (height, width): antialiased bilinear, rounded; unchanged at its size."""
    if x.shape[-2:] == (height, width) or not len(x):
        return x
    import torch
    import torch.nn.functional as F
    t = F.interpolate(torch.from_numpy(x).float(), size=(height, width), mode="bilinear", align_corners=False,
                      antialias=True)
    return np.ascontiguousarray(t.round().clamp(0, 255).to(torch.uint8).numpy())


def read_each(items, read, *, kind: str, what: str, skip_bad: bool, progress: str | None = None):
    """[(item, read(item))] for the items that read; a DataError skips the item when skip_bad
    (else it propagates), and one warning line counts what was skipped. Returns (read, skipped)."""
    from tqdm import tqdm

    done, skipped = [], []
    for item in tqdm(items, desc=progress, disable=None if progress else True, leave=False):
        try:
            done.append((item, read(item)))
        except DataError as e:
            if not skip_bad:
                raise
            skipped.append(str(e).removesuffix(SKIP_HINT))
    if skipped:
        warnings.warn(f"{kind}: skipped {len(skipped)} {what}; first: {skipped[0]}", DataWarning, stacklevel=3)
    return done, skipped


def split_indices(n: int, seed: int, fractions=(0.9, 0.05, 0.05)) -> dict[str, np.ndarray]:
    """Deterministic shuffled split of range(n) into train/val/test (val/test get >= 1 item when n >= 3)."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(n)
    n_val = max(1 if n >= 3 else 0, int(round(n * fractions[1])))
    n_test = max(1 if n >= 3 else 0, int(round(n * fractions[2])))
    return {"val": np.sort(order[:n_val]), "test": np.sort(order[n_val:n_val + n_test]),
            "train": np.sort(order[n_val + n_test:])}
