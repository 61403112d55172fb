"""Training/sampling smoke for bench/gpu/gpu_check.sh: the real CLIs, wrapped to record time and peak memory.

    python bench/gpu/gpu_smoke.py data DIR [--per-batch N] [--seed S]     # fake CIFAR-10 in the real pickle format
    python bench/gpu/gpu_smoke.py train RESULT.json -- <train.py arguments>   # runs train.py
    python bench/gpu/gpu_smoke.py sample RESULT.json -- <sample.py arguments> # runs sample.py

`train` / `sample` run train.py / sample.py in this process exactly as `python train.py ...` would
(runpy; the attention backend comes from IMGGEN_BACKEND, set by the caller) and write RESULT.json: exit code, wall seconds (process start
included), peak GPU memory allocated / reserved (torch.cuda.max_memory_*; None on CPU) and the
error, if any. gpu_check.sh runs each in its own process so that a crash, a hang (killed by its
timeout) or a broken CUDA context stays there.

`ensure_imggen()` makes `import imggen.kernels` (and .datasets, .eval) work from a plain checkout
that was never `pip install -e`d, e.g. a fresh GPU machine: those packages live at the top level
of the repository and are mapped into the `imggen` namespace by the install.
"""
from __future__ import annotations

import importlib.util
import json
import os
import pickle
import runpy
import sys
import time
import traceback
from pathlib import Path

T_START = time.time()
ROOT = Path(__file__).resolve().parents[2]
CIFAR_TRAIN = ["data_batch_1", "data_batch_2", "data_batch_3", "data_batch_4", "data_batch_5"]
CIFAR_TEST = "test_batch"


def ensure_imggen() -> str:
    """Import imggen from this checkout; returns how: 'installed' or 'checkout path'."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import imggen

    if importlib.util.find_spec("imggen.kernels") is None:  # not installed: map the top-level packages
        imggen.__path__.append(str(ROOT))
        return "checkout path"
    return "installed"


# ------------------------------------------------------------------------------------ fake data
def fake_images(n: int, rng):
    """(n, 3, 32, 32) uint8: smooth colour patterns (a few random plane waves per channel), so a
    model has something to learn; deterministic for a given rng."""
    import numpy as np

    yy, xx = np.meshgrid(np.arange(32), np.arange(32), indexing="ij")
    freq = rng.uniform(-0.35, 0.35, size=(n, 3, 3, 2))
    phase = rng.uniform(0, 2 * np.pi, size=(n, 3, 3))
    amp = rng.uniform(20, 60, size=(n, 3, 3))
    arg = freq[..., 0, None, None] * yy + freq[..., 1, None, None] * xx + phase[..., None, None]
    img = 128 + (amp[..., None, None] * np.cos(arg)).sum(2)
    return np.clip(np.round(img), 0, 255).astype(np.uint8)


def write_fake_cifar(root, per_batch: int = 64, seed: int = 0) -> Path:
    """A `cifar-10-batches-py` folder under root (5 training batches, test_batch, batches.meta) in
    the official python-pickle format, with generated images; returns the folder."""
    import numpy as np

    rng = np.random.default_rng(seed)
    d = Path(root) / "cifar-10-batches-py"
    d.mkdir(parents=True, exist_ok=True)
    for name in CIFAR_TRAIN + [CIFAR_TEST]:
        data = fake_images(per_batch, rng).reshape(per_batch, 3072)
        labels = rng.integers(0, 10, size=per_batch).tolist()
        with open(d / name, "wb") as f:
            pickle.dump({b"batch_label": name.encode(), b"labels": labels, b"data": data,
                         b"filenames": [f"{name}_{i}.png".encode() for i in range(per_batch)]}, f, protocol=2)
    with open(d / "batches.meta", "wb") as f:
        pickle.dump({b"label_names": [f"class{i}".encode() for i in range(10)], b"num_cases_per_batch": per_batch,
                     b"num_vis": 3072}, f, protocol=2)
    return d


# ------------------------------------------------------------------------------------ wrappers
def run_cli(kind: str, result_path: str, argv: list[str]) -> int:
    how = ensure_imggen()
    import torch

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    rc, err = None, None
    t = time.time()
    script = ROOT / f"{kind}.py"
    saved = sys.argv
    sys.argv = [str(script), *argv]
    try:
        runpy.run_path(str(script), run_name="__main__")  # the CLI exactly as `python train.py ...` runs it
    except SystemExit as e:  # the scripts end with sys.exit(main()); argparse errors exit 2
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if rc:
            err = f"exit code {rc}" + (f": {e.code}" if isinstance(e.code, str) else "")
    except BaseException as e:  # noqa: BLE001 - recorded, then the process exits non-zero
        traceback.print_exc()
        rc, err = 1, f"{type(e).__name__}: {e}"
    finally:
        sys.argv = saved
    rc = 0 if rc is None else rc
    res = {"kind": kind, "rc": rc, "error": err, "main_s": time.time() - t, "process_s": time.time() - T_START,
           "backend": os.environ.get("IMGGEN_BACKEND"), "imggen": how, "argv": argv,
           "peak_mem_bytes": torch.cuda.max_memory_allocated() if cuda else None,
           "peak_reserved_bytes": torch.cuda.max_memory_reserved() if cuda else None,
           "device": torch.cuda.get_device_name() if cuda else "cpu"}
    Path(result_path).write_text(json.dumps(res, indent=2))
    return rc


def build_parser():
    import argparse

    ap = argparse.ArgumentParser(prog="gpu_smoke.py", description=__doc__.split("\n\n")[0],
                                 epilog="train / sample take their CLI's arguments after a '--', e.g. "
                                        "gpu_smoke.py train res.json -- --preset cifar --steps 10 --out runs/smoke")
    sub = ap.add_subparsers(dest="kind", metavar="{data,train,sample}", required=True)
    d = sub.add_parser("data", help="write a fake CIFAR-10 folder (cifar-10-batches-py) in the real pickle format",
                       description="Write DIR/cifar-10-batches-py: 5 training batches, test_batch and batches.meta "
                                   "of generated 32x32 images in the official python-pickle format.")
    d.add_argument("dir", help="folder to write cifar-10-batches-py into")
    d.add_argument("--per-batch", type=int, default=64, help="images per batch file (default 64)")
    d.add_argument("--seed", type=int, default=0, help="seed of the generated images (default 0)")
    for kind in ("train", "sample"):
        p = sub.add_parser(kind, help=f"run {kind}.py in this process and record time and peak GPU memory",
                           description=f"Run {kind}.py with the arguments after '--' (exactly as python {kind}.py "
                                       f"... would; IMGGEN_BACKEND picks the backend) and write RESULT.json: exit "
                                       f"code, wall seconds, peak GPU memory and the error, if any.",
                           usage=f"gpu_smoke.py {kind} [-h] RESULT.json -- [{kind}.py arguments ...]")
        p.add_argument("result", metavar="RESULT.json", help="where to write the JSON record")
    return ap


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = build_parser()
    # train / sample: everything after the first '--' belongs to train.py / sample.py
    head, rest = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, None)
    a = ap.parse_args(head)  # --help, unknown commands and missing arguments: argparse, exit code 2
    if a.kind == "data":
        if rest is not None:
            ap.error("data takes no '--' arguments")
        if a.per_batch < 1:
            ap.error(f"argument --per-batch: must be >= 1, got {a.per_batch}")
        print(write_fake_cifar(a.dir, a.per_batch, a.seed))
        return 0
    if rest is None:
        ap.error(f"{a.kind} needs '--' and then the {a.kind}.py arguments: "
                 f"gpu_smoke.py {a.kind} RESULT.json -- [{a.kind}.py arguments]")
    return run_cli(a.kind, a.result, rest)


if __name__ == "__main__":
    sys.exit(main())
