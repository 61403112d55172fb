"""Reading many BraTS case folders: in worker processes, once (issue 47).

`read_cases` turns case folders into what a model trains on (imggen.datasets.brats._load_case: the
slices at the model's grid, their holes, kept slice indices and 3-D fills) with:
* a cache: one .npz per case under <cache>/brats-cases-v<VERSION>/<ab>/<key>.npz (cache: `cache_dir`,
  --data.cache; else imggen.storage.cache_root: $IMGGEN_CACHE_DIR or ~/.cache/imggen). The key hashes
  the case's name, each NIfTI file it reads (name, size, mtime) and the recipe (grid, channels,
  modalities, masks, fills, and the seed where the hole depends on it), so an edited case or another
  preset is read again. Entries are written through a temporary file and a rename (a killed load
  leaves whole entries or none); one that cannot be read back or whose arrays do not fit the recipe is
  read again from the NIfTI files with one note (imggen.storage.cached_npz). A warm load reads only
  the cache, in this process;
* worker processes (`workers`, --data.workers; default the cores) for the cases the cache lacks,
  each holding the native volumes of one case at a time, so the memory of the loaded set is that of
  the slices at the model's grid;
* a bad case (DataError: unreadable file, wrong shape, affines that disagree, no brain) is one line
  naming it, or skipped with skip_bad; a worker that dies (killed, out of memory) is one DataError
  naming the cases it was reading, never a hung pool.
"""
from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import numpy as np

from imggen.errors import DataError

VERSION = 1
FIELDS = ("imgs", "masks", "keep", "fills")
PER_WORKER = 4


def entry_path(case: Path, files: dict, recipe: dict, cache_dir=None) -> Path:
    from imggen.storage import cache_root

    stats = sorted((role, f.name, st.st_size, st.st_mtime_ns) for role, f in files.items() for st in [f.stat()])
    voided = recipe["mods"] == ["t1"] and "t1" not in files and "voided" in files
    # the seed places a challenge hole from a tumour segmentation; other cases' entries do not depend on it
    seeded = recipe["inpainting"] and recipe["masks"] == "challenge" and not voided and "mask-healthy" not in files \
        and "seg" in files
    key = json.dumps({"v": VERSION, "case": case.name, "files": stats, **recipe,
                      "seed": recipe["seed"] if seeded else None}, sort_keys=True, default=str)
    digest = hashlib.sha256(key.encode()).hexdigest()[:32]
    return cache_root(cache_dir) / f"brats-cases-v{VERSION}" / digest[:2] / f"{digest}.npz"


def _check(recipe: dict):
    """cached_npz's check: the arrays of one case at this recipe's grid (raises if not)."""
    def check(a: dict) -> None:
        imgs, keep = a["imgs"], a["keep"]
        c = len(recipe["mods"]) if len(recipe["mods"]) > 1 else recipe["channels"]
        want = (len(keep), c, recipe["height"], recipe["width"])
        if imgs.dtype != np.uint8 or imgs.shape != want:
            raise ValueError(f"images {imgs.dtype} {imgs.shape}, expected uint8 {want}")
        for name in ("masks", "fills"):
            if name in a and len(a[name]) != len(keep):
                raise ValueError(f"{name} of {len(a[name])} slices for {len(keep)} images")
        if recipe["inpainting"] and "masks" not in a:
            raise ValueError("no masks in an inpainting entry")
    return check


def _pack(result) -> dict:
    return {k: np.asarray(v) for k, v in zip(FIELDS, result) if v is not None}


def _unpack(a: dict):
    return tuple(a.get(k) if k != "keep" else a[k].astype(int).tolist() for k in FIELDS)


def _read(job):
    """One case in a worker (or in this process): (index, the arrays) through the cache."""
    from imggen.storage import cached_npz

    i, case, recipe, path, _load_case = job
    args = (case, recipe["mods"], recipe["height"], recipe["width"], recipe["channels"], recipe["inpainting"],
            recipe["masks"], recipe["seed"], recipe["fills3d"])
    if path is None:
        return i, _load_case(*args)
    return i, _unpack(cached_npz(path, lambda: _pack(_load_case(*args)), "BraTS case cache", _check(recipe)))


def _warm(path: Path | None, recipe: dict):
    """The cached arrays of a case, or None (absent or damaged: a worker reads the case again)."""
    if path is None or not path.is_file():
        return None
    from imggen.storage import read_npz

    try:
        return _unpack(read_npz(path, _check(recipe)))
    except Exception:  # noqa: BLE001 - the worker's cached_npz notes the damage and rebuilds the entry
        return None


def read_cases(cases: list[Path], files: list[dict], recipe: dict, load, *, workers: int | None = None, cache_dir=None,
               use_cache: bool = True, skip_bad: bool = False, progress: bool = True):
    """[(index, load(case, ...))] of the cases that read, in order, and the skipped cases' messages.
    load: imggen.datasets.brats._load_case (module-level: a worker imports it); `files[i]`: case i's
    NIfTI files by role ({} for a folder without any: load says so); `recipe`: load's settings (mods,
    height, width, channels, inpainting, masks, seed, fills3d)."""
    import warnings

    from tqdm import tqdm

    from imggen.datasets import SKIP_HINT, DataWarning

    paths = [entry_path(c, f, recipe, cache_dir) if use_cache and f else None for c, f in zip(cases, files)]
    done, skipped, todo = {}, [], []
    for i, p in enumerate(paths):
        hit = _warm(p, recipe)
        if hit is None:
            todo.append((i, cases[i], recipe, p, load))
        else:
            done[i] = hit
    # a spawned worker costs about one case's read to start: one per PER_WORKER cases to read
    workers = max(1, min(workers or os.cpu_count() or 1, -(-len(todo) // PER_WORKER)))
    bar = tqdm(total=len(cases), initial=len(done), desc="BraTS cases", unit="case", leave=False,
               disable=None if progress and todo else True)

    def bad(job, e: DataError) -> None:
        if not skip_bad:
            raise e
        skipped.append(str(e).removesuffix(SKIP_HINT))
    try:
        if workers == 1:
            for job in todo:
                try:
                    done.update([_read(job)])
                except DataError as e:
                    bad(job, e)
                bar.update(1)
        else:
            _pool(todo, workers, done, bad, bar)
    finally:
        bar.close()
    if skipped:
        warnings.warn(f"brats: skipped {len(skipped)} bad case(s); first: {skipped[0]}", DataWarning, stacklevel=3)
    return [(i, done[i]) for i in sorted(done)], skipped


def _pool(todo, workers, done, bad, bar) -> None:
    import multiprocessing as mp

    # spawn: a worker starts clean (no copy of the caller's threads or torch state)
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
        running = {pool.submit(_read, job): job for job in todo}
        try:
            while running:
                finished, _ = wait(running, return_when=FIRST_COMPLETED)
                for fut in finished:
                    job = running.pop(fut)
                    try:
                        done.update([fut.result()])
                    except DataError as e:
                        bad(job, e)
                    bar.update(1)
        except BrokenProcessPool:
            names = sorted(job[1].name for job in running.values())
            raise DataError(f"a worker process reading BraTS cases died (killed, or out of memory) while "
                            f"{len(names)} case(s) were unread, among them {', '.join(names[:5])}; cases read "
                            f"so far are cached: run again (fewer workers: --data.workers)") from None
        except BaseException:
            for fut in running:
                fut.cancel()
            raise
