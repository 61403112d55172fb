"""OSRA read-back of true drawings per drawing style and size, on MOSES test molecules.

    python bench/osra_styles.py --num 20 --sizes 64,96,128,192,256 --out bench/results/osra_styles.md

Each cell draws the first --num molecules of a fixed seeded sample of MOSES test that can be drawn
in that style at that size (molecules too large for the fixed bond length are left out and counted),
reads them back with OSRA through imggen.eval.atoms (the same preparation as `eval molecules`) and
reports recognised / exact match / sanitises / valid (MOSES validity: sanitises, one fragment, no
`*`) / bond-type agreement. Styles (sizes scale with the canvas as in molecules.style_for):
  base      the project's style for that size (mol128 / mol256 at 128 / 256 px)
  bold      bond lines one px wider (x2 at >= 192 px)
  bigfont   atom labels 1.3x larger
  pad10     10% blank margin instead of 3%
  1bit      base drawing thresholded to black/white at 128 before OSRA sees it
  noup      base drawing not upscaled before OSRA (read at its own size, 20 px white border)
"""
from __future__ import annotations

import argparse
import gzip
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np

STYLES = ("base", "bold", "bigfont", "pad10", "1bit", "noup")


def style_of(name: str, size: int):
    from imggen.datasets.molecules import style_for
    s = style_for(size, size)
    if name == "bold":
        return replace(s, line_width=s.line_width + (2 if size >= 192 else 1), name=f"{s.name}+bold")
    if name == "bigfont":
        return replace(s, font_size=round(s.font_size * 1.3), name=f"{s.name}+bigfont")
    if name == "pad10":
        return replace(s, padding=0.10, name=f"{s.name}+pad10")
    return s


def moses_test(seed: int, pool: int) -> list[str]:
    from imggen.datasets.moses import FILES, find_moses_data
    with gzip.open(find_moses_data() / FILES["test"], "rt") as f:
        rows = [line.strip() for line in f][1:]
    rng = np.random.default_rng(seed)
    return [rows[i] for i in rng.choice(len(rows), size=min(pool, len(rows)), replace=False)]


def cell(smiles: list[str], name: str, size: int, num: int, workers: int) -> dict:
    from imggen.datasets.molecules import OK, draw_one
    from imggen.eval import atoms
    from imggen.eval.moses_metrics import is_valid
    style = style_of(name, size)
    drawn, refs, tried = [], [], 0
    for s in smiles:
        tried += 1
        status, img = draw_one(s, style)
        if status == OK:
            drawn.append(img)
            refs.append(s)
            if len(drawn) == num:
                break
    if not drawn:
        nan = float("nan")
        return dict(style=name, size=size, drawn=0, tried=tried, seconds=0.0, recognised=nan, exact_match=nan,
                    sanitises=nan, valid=nan, bond_type_agreement=nan)
    exe = atoms.find_osra()
    t0 = time.time()

    def one(i):
        img = drawn[i]
        if name == "1bit":
            img = np.where(img < 128, 0, 255).astype(np.uint8)
        target = img.shape[0] if name == "noup" else atoms.TARGET_SIDE
        path = os.path.join(tmp, f"i{i}.png")
        atoms.prepare(img, target_side=target).save(path)
        try:
            return atoms._run_osra(exe, path, 30)
        finally:
            os.unlink(path)

    with tempfile.TemporaryDirectory(prefix="osra-styles-") as tmp, ThreadPoolExecutor(workers) as pool:
        outs = list(pool.map(one, range(len(drawn))))
    res = atoms._summarise(outs, refs, return_per_image=False)
    res["valid"] = float(np.mean([is_valid(o[1]) for o in outs])) if outs else float("nan")
    res.update(style=name, size=size, drawn=len(drawn), tried=tried, seconds=time.time() - t0)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num", type=int, default=20, help="molecules per cell (default 20)")
    ap.add_argument("--sizes", default="64,96,128,192,256")
    ap.add_argument("--styles", default=",".join(STYLES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", help="also write the markdown table here")
    a = ap.parse_args(argv)
    from imggen.eval.molecules import wilson
    smiles = moses_test(a.seed, 20 * a.num)
    lines = [f"OSRA read-back of true drawings: first {a.num} drawable of a seeded (seed {a.seed}) sample of "
             f"MOSES test per cell; `python bench/osra_styles.py --num {a.num} --sizes {a.sizes} --styles {a.styles}`",
             "", "| style | size | drawn/tried | recognised | exact match | sanitises | valid (95% Wilson) | bond-type agreement | s |",
             "|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for size in map(int, a.sizes.split(",")):
        for name in a.styles.split(","):
            r = cell(smiles, name, size, a.num, a.workers)
            lo, hi = wilson(round(r["valid"] * r["drawn"]), r["drawn"]) if r["drawn"] else (0.0, 1.0)
            row = (f"| {name} | {size} | {r['drawn']}/{r['tried']} | {r['recognised']:.2f} | {r['exact_match']:.2f} | "
                   f"{r['sanitises']:.2f} | {r['valid']:.2f} ({lo:.2f}-{hi:.2f}) | {r['bond_type_agreement']:.2f} | "
                   f"{r['seconds']:.0f} |")
            lines.append(row)
            print(row, flush=True)
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
