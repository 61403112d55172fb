"""Molecule data loading benchmark and OSRA calibration table.

    python bench/data_loading.py render --data moses_test.csv --num 10000 --workers 2
    python bench/data_loading.py osra --num 100

`render` times drawing N molecules at 128x128 and at the demo size (32x32), cold (fresh cache dir)
and cached; `osra` scores OSRA read-back of ground-truth drawings (the ceiling) per style. Both
print a markdown table; --out appends it to a results file.
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import md_row, md_table  # noqa: E402


def bench_render(smiles, sizes, workers) -> str:
    from imggen.datasets import molecules as M
    rows = []
    for h in sizes:
        tmp = tempfile.mkdtemp(prefix="imggen-bench-")
        try:
            t0 = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                _, status = M._render(smiles, h, h, None, workers, tmp, True, True)
                t1 = time.perf_counter()
                M.render_smiles(smiles, h, h, workers=workers, cache_dir=tmp, progress=False)
            t2 = time.perf_counter()
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        c = M._counts(status)
        rows.append([f"{h}x{h}", M.style_for(h, h).name, len(smiles), c["kept"], c["too_large"], c["invalid"],
                     f"{t1 - t0:.1f}", f"{len(smiles) / (t1 - t0):.0f}", f"{t2 - t1:.2f}"])
    return md_table(["size", "style", "molecules", "kept", "too large", "invalid", "cold (s)", "mol/s", "cached (s)"],
                    rows)


def bench_osra(smiles, workers) -> str:
    from imggen.datasets import molecules as M
    from imggen.eval.atoms import calibrate
    rows = []
    for name in ("osra500", "mol256", "mol128", "demo"):
        s = M.STYLES[name]
        t = time.perf_counter()
        r = calibrate(smiles, s.height, s.width, style=s, workers=workers)
        rows.append([name, f"{s.height}x{s.width}", f"{r['drawn']}/{len(smiles)}", f"{r['recognised']:.2f}",
                     f"{r['exact_match']:.2f}", f"{r['sanitises']:.2f}", f"{r['atom_valence_ok']:.2f}",
                     f"{r['bond_ok']:.2f}", f"{r['bond_type_agreement']:.2f}", r["failures"] + r["timeouts"],
                     f"{time.perf_counter() - t:.0f}"])
        print(md_row(rows[-1]), flush=True)
    return md_table(["style", "size", "drawn", "recognised", "exact match", "sanitises", "atom valence ok", "bond ok",
                     "bond-type agreement", "OSRA failures", "time (s)"], rows)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["render", "osra"], help="rendering speed or OSRA calibration table")
    ap.add_argument("--data", default=None, help="SMILES file (default: the shipped MOSES sample)")
    ap.add_argument("--num", type=int, default=None, help="number of molecules (render: first N, repeated "
                    "if the file is shorter; osra: a seeded sample of N, default 50)")
    ap.add_argument("--workers", type=int, default=2, help="worker processes / OSRA threads (default 2)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the osra molecule sample")
    ap.add_argument("--out", default=None, help="append the table to this markdown file")
    a = ap.parse_args(argv)
    from imggen.datasets import molecules as M
    smiles = M.read_smiles(a.data or M.SAMPLE)
    if a.what == "render":
        n = a.num or len(smiles)
        smiles = (smiles * (n // len(smiles) + 1))[:n]
        table = bench_render(smiles, (128, 32), a.workers)
    else:
        smiles = random.Random(a.seed).sample(smiles, a.num or 50)
        table = bench_osra(smiles, a.workers)
    print(table)
    if a.out:
        with open(a.out, "a") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
