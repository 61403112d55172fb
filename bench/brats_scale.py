"""BraTS training folders at the challenge's scale (issue 47): generated cases, and how long they take to load.

    python bench/brats_scale.py make --n 400 --out /work/brats400             # challenge-format cases
    python bench/brats_scale.py load --data /work/brats400 --cases 100 400    # first and second loads
        [--preset brats64] [--workers N] [--work runs/brats_scale] [--out bench/results] [--stem brats_scale]

`make` writes N case folders `BraTS-GLI-<i>-000` in the 2023 inpainting training layout: `-t1n` (the
truth), `-mask-healthy` (the hole to fill) and `-mask-unhealthy` (the "tumour", void in the input),
as `.nii.gz` at the real 240x240x155 grid, 1 mm. Each case is the template imggen ships (the MNI152
T1 slices of brats-demo, `shipped_template`) under its own random affine warp (rotation about each
axis within 6 degrees, scale 0.92-1.08 per axis, shift within 6 voxels), intensity scale (x0.6-1.6)
and two lumpy blobs (imggen.datasets.brats_masks.blob): the unhealthy one 1-4% of the brain, the
healthy one 1-3%, away from it. `--dtype int16` stores the image as BraTS often ships it. Cases
already written are kept (a killed `make` goes on where it stopped); cases are written in parallel.

`load` times `imggen.training.batches.load_data` of the preset with `--data brats:<folder of the first
C cases>` in a fresh process, twice per C: the first load with an empty cache (--data.cache under
--work), the second with the cache the first wrote. Peak RSS is of the whole process tree (the
loader and its workers), sampled every 0.1 s from /proc. The table extrapolates the first load to
1,251 cases and to 16 cores, linearly in cases and in cores: an extrapolation, not a measurement.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import command_line, git_commit, machine, machine_line, md_table, out_dir, write_results  # noqa: E402

CHALLENGE_CASES = 1251


# --------------------------------------------------------------------------------------------- make
def warp(volume: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """The volume under a random affine map about its centre (linear interpolation, zero outside)."""
    from scipy import ndimage
    from scipy.spatial.transform import Rotation

    rot = Rotation.from_euler("xyz", rng.uniform(-6, 6, 3), degrees=True).as_matrix()
    m = rot @ np.diag(1 / rng.uniform(0.92, 1.08, 3))  # output -> input coordinates
    centre = (np.asarray(volume.shape) - 1) / 2
    offset = centre - m @ (centre + rng.uniform(-6, 6, 3))
    return ndimage.affine_transform(volume, m, offset, order=1, mode="constant", cval=0.0).astype(np.float32)


@functools.lru_cache(maxsize=1)
def shipped_template(shape=(240, 240, 155)) -> np.ndarray:
    """float32 (X, Y, Z) RAS at 1 mm: the MNI152 slices imggen ships for brats-demo (128 px for the
    template's 233 mm square, at their own z) back on the challenge's grid, centred."""
    from imggen.datasets.brats import image_to_ras_slice
    from imggen.datasets.brats_demo import DEMO_FILE, DEMO_SIDE_MM

    d, side = np.load(DEMO_FILE), int(round(DEMO_SIDE_MM))
    vol = np.zeros(shape, np.float32)
    x0, y0 = (shape[0] - side) // 2, (shape[1] - side) // 2
    for img, z in zip(d["images"], d["z"]):
        if 0 <= z < shape[2]:
            vol[x0:x0 + side, y0:y0 + side, z] = np.clip(image_to_ras_slice(img, (side, side)), 0, None)
    return vol


def make_case(folder: Path, i: int, template: np.ndarray | None = None, seed: int = 0, dtype: str = "float32") -> Path:
    """Case i (seeded by seed and i) under `folder`; `template`: the volume to warp (default: the MNI152
    template on the challenge's grid, read once per process)."""
    import nibabel as nib
    from scipy import ndimage

    from imggen.datasets.brats_masks import blob

    name = f"BraTS-GLI-{i:05d}-000"
    case = Path(folder) / name
    if (case / f"{name}-mask-unhealthy.nii.gz").is_file():  # written last: the case is whole
        return case
    template = shipped_template() if template is None else template
    rng = np.random.default_rng([seed, 47, i])
    t1 = warp(template, rng) * rng.uniform(0.6, 1.6)
    t1[t1 < 1e-3 * t1.max()] = 0
    brain = t1 > 0
    unhealthy = blob(brain, rng, rng.uniform(0.01, 0.04))
    healthy = blob(brain & ~ndimage.binary_dilation(unhealthy, iterations=3), rng, rng.uniform(0.01, 0.03))
    case.mkdir(parents=True, exist_ok=True)
    affine = np.diag([-1.0, -1.0, 1.0, 1.0])  # LPS as BraTS stores it
    image = np.round(t1).astype(np.int16) if dtype == "int16" else t1
    for suffix, arr in (("t1n", image), ("mask-healthy", healthy.astype(np.uint8)),
                        ("mask-unhealthy", unhealthy.astype(np.uint8))):
        tmp = case / f".{name}-{suffix}.nii.gz"
        nib.save(nib.Nifti1Image(arr, affine), str(tmp))
        os.replace(tmp, case / f"{name}-{suffix}.nii.gz")
    return case


def make_cases(folder, n: int, seed: int = 0, dtype: str = "float32", workers: int | None = None,
               template: np.ndarray | None = None, progress: bool = True) -> list[Path]:
    from concurrent.futures import ProcessPoolExecutor

    from tqdm import tqdm

    workers = workers or os.cpu_count() or 1
    if workers == 1 or n <= 1:
        return [make_case(folder, i, template, seed, dtype) for i in tqdm(range(n), disable=not progress)]
    import multiprocessing as mp
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
        futs = [pool.submit(make_case, folder, i, template, seed, dtype) for i in range(n)]
        return [f.result() for f in tqdm(futs, desc="cases", disable=not progress)]


# --------------------------------------------------------------------------------------------- load
def tree_rss(pid: int) -> int:
    """Bytes resident in process `pid` and all its descendants now (0 for those gone)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                total += next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
            for t in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{t}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (OSError, StopIteration, ValueError):
            continue
    return total


def timed(cmd: list[str], log) -> dict:
    """Run cmd; its wall seconds, the peak RSS of its process tree and its CPU seconds (the child's and
    those of the workers it waited for: getrusage of the children)."""
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    peak = [0]

    def sample():
        while proc.poll() is None:
            peak[0] = max(peak[0], tree_rss(proc.pid))
            time.sleep(0.1)
    th = threading.Thread(target=sample, daemon=True)
    th.start()
    rc = proc.wait()
    th.join()
    if rc:
        raise SystemExit(f"{' '.join(cmd[:6])} ... failed (exit {rc}); see {log.name}")
    wall, after = time.time() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return {"wall_s": wall, "peak_rss_gb": peak[0] / 2 ** 30, "cpu_s": cpu, "cores_busy": cpu / wall}


def _load_once(a) -> None:
    """(in the timed child) load_data of the preset on the folder, cache under a.cache."""
    from imggen.config import preset
    from imggen.training.batches import load_data

    cfg = preset(a.preset)
    cfg.data.spec, cfg.data.cache, cfg.data.workers = f"brats:{a.data}", a.cache, a.workers or 0
    t = time.time()
    splits, _ = load_data(cfg, progress=False)
    n = {s: len(splits[s]) for s in ("train", "val", "test")}
    print(json.dumps({"slices": n, "load_s": time.time() - t}), flush=True)


def subset(data: Path, work: Path, count: int) -> Path:
    """A folder of links to the first `count` cases of `data`."""
    cases = sorted(p for p in Path(data).iterdir() if p.is_dir() and not p.name.startswith("."))
    if len(cases) < count:
        raise SystemExit(f"{data} has {len(cases)} cases, fewer than {count}: run `make --n {count}` first")
    folder = work / f"cases{count}"
    folder.mkdir(parents=True, exist_ok=True)
    for c in cases[:count]:
        if not (folder / c.name).exists():
            (folder / c.name).symlink_to(c.resolve())
    return folder


def load(a, argv) -> None:
    import shutil

    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    rows, data = [], {"runs": []}
    with open(work / "load.log", "a") as log:
        for count in a.cases:
            folder, cache = subset(Path(a.data), work, count), work / f"cache{count}"
            shutil.rmtree(cache, ignore_errors=True)
            cmd = [sys.executable, os.path.abspath(__file__), "_load", "--data", str(folder), "--cache", str(cache),
                   "--preset", a.preset] + (["--workers", str(a.workers)] if a.workers else [])
            for which in ("first (cold cache)", "second (warm cache)"):
                log.write(f"$ {' '.join(cmd)}\n")
                log.flush()
                r = timed(cmd, log) | {"cases": count, "load": which}
                data["runs"].append(r)
                rows.append([count, which, f"{r['wall_s']:.1f}", f"{1000 * r['wall_s'] / count:.0f}",
                             f"{r['peak_rss_gb']:.2f}", f"{r['cores_busy']:.2f}"])
    cores = a.workers or os.cpu_count()
    first = [r for r in data["runs"] if r["load"].startswith("first")]
    per_case = max(r["wall_s"] / r["cases"] for r in first)
    extra = [[CHALLENGE_CASES, f"first, extrapolated ({cores} cores)", f"{per_case * CHALLENGE_CASES:.0f}", "", "", ""],
             [CHALLENGE_CASES, "first, extrapolated (16 cores)", f"{per_case * CHALLENGE_CASES * cores / 16:.0f}", "", "",
              ""]]
    m = machine(gpu=False)
    md = "\n".join([
        f"# BraTS folders at scale: `load_data` of `{a.preset}` on generated challenge-format cases", "",
        f"`{command_line('brats_scale.py', argv)}` at {git_commit()}, {time.strftime('%Y-%m-%d')}; {machine_line(m)}.", "",
        f"Each load runs in a fresh process; {cores} worker processes; peak RSS of the whole process tree; cores "
        f"busy = CPU seconds of the process and its workers / wall seconds. The "
        f"1,251-case rows extrapolate the slowest first load per case ({per_case:.2f} s) linearly in cases and "
        f"in cores: not measured.", "",
        md_table(["cases", "load", "wall s", "ms / case", "peak RSS GB", "cores busy"], rows + extra), ""])
    data.update(machine=m, commit=git_commit(), per_case_s=per_case, cores=cores)
    write_results(out_dir(a.out), a.stem, data, md)
    print(md)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="part", required=True)
    mk = sub.add_parser("make", help="write N generated challenge-format cases")
    mk.add_argument("--n", type=int, required=True)
    mk.add_argument("--out", required=True)
    mk.add_argument("--seed", type=int, default=0)
    mk.add_argument("--dtype", choices=("float32", "int16"), default="float32")
    mk.add_argument("--workers", type=int, default=None)
    ld = sub.add_parser("load", help="time the first and the second load of the first C cases")
    ld.add_argument("--data", required=True)
    ld.add_argument("--cases", type=int, nargs="+", default=[100, 400])
    ld.add_argument("--preset", default="brats64")
    ld.add_argument("--workers", type=int, default=None)
    ld.add_argument("--work", default="runs/brats_scale")
    ld.add_argument("--out", default=None)
    ld.add_argument("--stem", default="brats_scale")
    one = sub.add_parser("_load")  # the timed child
    for flag in ("--data", "--cache", "--preset"):
        one.add_argument(flag, required=True)
    one.add_argument("--workers", type=int, default=None)
    a = ap.parse_args(argv)
    if a.part == "make":
        make_cases(a.out, a.n, a.seed, a.dtype, a.workers)
    elif a.part == "load":
        load(a, argv)
    else:
        _load_once(a)


if __name__ == "__main__":
    main()
