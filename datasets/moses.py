"""The full MOSES benchmark (Polykovskiy et al. 2020) from the data files of the `molsets` wheel.

`pip install --no-deps molsets==0.3.1` installs them offline: moses/dataset/data/{train,test,
test_scaffolds}.csv.gz (1,584,663 train SMILES, 176,074 test, 176,225 scaffold test; MIT licence).
They are found without importing `moses` (that needs pandas, torch versions of its own, ...).

`--data moses` trains on all of MOSES train, drawn lazily (imggen.datasets.lazy: on access, with
an on-disk render cache); val and test are fixed modest subsets of MOSES test drawn up front
(64 each: test bits/dim at the end of a CPU run stays cheap).
`--data moses:DIR` reads the same files from a folder of your own.
"""
from __future__ import annotations

import gzip
import importlib.machinery
import importlib.metadata
import sys
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

from imggen.datasets import ImageSplits
from imggen.errors import DataError

FILES = {"train": "train.csv.gz", "test": "test.csv.gz", "test_scaffolds": "test_scaffolds.csv.gz"}
INSTALL = "pip install --no-deps molsets==0.3.1"
LICENCE = "MIT (Copyright 2018 Insilico Medicine), the molsets wheel's LICENSE"
VAL_NUM, TEST_NUM = 64, 64  # drawable molecules of MOSES test in the val / test splits


def find_moses_data(search_path=None) -> Path:
    """The folder holding MOSES's train/test csv.gz files of the installed molsets wheel.

    Looks for the `moses` package on `search_path` (default sys.path) without importing it, then in
    the files of the `molsets` distribution; DataError naming the install command when absent.
    """
    paths = list(sys.path if search_path is None else map(str, search_path))
    cands = []
    spec = importlib.machinery.PathFinder.find_spec("moses", paths)
    if spec is not None and spec.submodule_search_locations:
        cands += [Path(p) / "dataset" / "data" for p in spec.submodule_search_locations]
    try:
        for dist in importlib.metadata.distributions(name="molsets", path=paths):
            cands.append(Path(dist.locate_file("moses/dataset/data")))
    except Exception:  # noqa: BLE001 - broken metadata elsewhere on the path must not hide the files
        pass
    for d in cands:
        if all((d / FILES[k]).is_file() for k in ("train", "test")):
            return d
    where = f" (found {cands[0]}, but without {FILES['train']} / {FILES['test']})" if cands else ""
    raise DataError(f"--data moses: the MOSES data files are not installed{where}; install them with "
                    f"`{INSTALL}` (offline from the wheel), or pass --data moses:DIR with a folder holding "
                    f"{FILES['train']} and {FILES['test']}")


def read_split(folder, split: str) -> list[str]:
    """SMILES of one MOSES split file (first column, header 'SMILES'), in file order."""
    path = Path(folder) / FILES[split]
    try:
        with gzip.open(path, "rb") as f:
            lines = f.read().decode("utf-8").splitlines()
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: cannot read the MOSES {split} file ({type(e).__name__}: {e}); reinstall it "
                        f"with `{INSTALL} --force-reinstall`") from e
    if not lines or lines[0].split(",")[0].strip().lower() != "smiles":
        raise DataError(f"{path}: not a MOSES file (first line should be the header SMILES[,SPLIT]); reinstall "
                        f"it with `{INSTALL} --force-reinstall`")
    out = [line.split(",", 1)[0].strip() for line in lines[1:]]
    out = [s for s in out if s]
    if not out:
        raise DataError(f"{path}: holds no SMILES; reinstall it with `{INSTALL} --force-reinstall`")
    return out


def data_folder(path=None) -> Path:
    if path is None:
        return find_moses_data()
    p = Path(path)
    if not p.is_dir() or not all((p / FILES[k]).is_file() for k in ("train", "test")):
        raise DataError(f"--data moses:{path}: expected a folder holding {FILES['train']} and {FILES['test']} "
                        f"(MOSES's files; `{INSTALL}` installs them, then use plain --data moses)")
    return p


def load(path=None, *, height: int, width: int, channels: int = 1, seed: int = 0, skip_bad: bool = False,
         style=None, cache_dir=None, workers: int = 2, progress: bool = True, val_num: int = VAL_NUM,
         test_num: int = TEST_NUM, **_) -> ImageSplits:
    """MOSES train (lazy: drawn on access) + val/test (the first val_num / next test_num drawable
    molecules of MOSES test, drawn now). meta["smiles"]["train"] is the whole train list (the
    canonical SMILES novelty is judged against); info counts what was read and skipped."""
    from imggen.datasets.lazy import LazyMolecules
    from imggen.datasets.molecules import STYLES, _render, skipped_message, style_for

    if channels != 1:
        raise DataError(f"molecule images are grayscale: channels must be 1, got {channels} (use a preset "
                        f"with channels=1)")
    if isinstance(style, str):
        if style not in STYLES:
            raise DataError(f"unknown molecule style {style!r}; choose one of {', '.join(STYLES)}")
        style = STYLES[style]
    style = replace(style or style_for(height, width), height=height, width=width)
    folder = data_folder(path)
    train_smiles, test_smiles = read_split(folder, "train"), read_split(folder, "test")
    # val / test: draw a prefix of MOSES test large enough for the drawable ones wanted
    want, take = val_num + test_num, val_num + test_num
    while True:
        head = test_smiles[:take]
        images, status = _render(head, height, width, style, workers, cache_dir, progress, True)
        kept = np.flatnonzero(status == 0)
        if len(kept) >= want or take >= len(test_smiles):
            break
        take = min(len(test_smiles), int(take * 1.5 * want / max(1, len(kept))) + 16)
    if len(kept) < 2:
        raise DataError(f"{folder / FILES['test']}: fewer than 2 of its molecules can be drawn at {height}x{width} "
                        f"(style {style.name}); use a larger image size")
    used = kept[:want]
    n_val = max(1, min(val_num, len(used) // 2))
    msg = skipped_message(status[: used[-1] + 1], style, folder / FILES["test"])
    if msg and progress is not False:
        print(msg + " (val/test)", file=sys.stderr, flush=True)
    pick = {"val": np.arange(n_val), "test": np.arange(n_val, len(used))}  # rows of `images` (drawable only)
    train = LazyMolecules(train_smiles, style, cache_dir=cache_dir)
    info = {"source": str(folder), "licence": LICENCE, "style": asdict(style), "train_read": len(train_smiles),
            "train": "lazy: drawn on access with an on-disk render cache; an undrawable molecule is replaced "
                     "by the next drawable one",
            "test_read": len(test_smiles), "val_test_drawn_from": int(used[-1] + 1), "kept": int(len(used))}
    return ImageSplits(train=train, val=images[pick["val"]], test=images[pick["test"]],
                       meta={"smiles": {"train": train_smiles,
                                        **{k: [head[i] for i in kept[v]] for k, v in pick.items()}}},
                       info=info)
