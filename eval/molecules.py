"""`python -m imggen.eval molecules`: score drawings like a molecule generator.

Every drawing (sampled from a checkpoint, or the PNGs of a folder) is read back by OSRA with the
plumbing of imggen.eval.atoms (ink stretch, upscaling to ~400 px), then scored with MOSES's metrics
(imggen.eval.moses_metrics): validity, unique, novelty vs MOSES train, IntDiv, SNN / Frag / Scaf vs
MOSES test, and the atom-bond accuracy of the read-backs. Optionally the same on true drawings of
MOSES test molecules in the same style (the ceiling a generator of such drawings can reach).
Writes readback.png (each drawing beside the molecule read from it, redrawn by RDKit) and
readback.log (one line per drawing that does not read back as a valid molecule) to the output folder.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

from imggen.errors import DataError

SHOW = 32          # drawings in readback.png
PANEL = 128        # side of each panel in readback.png, px
REF_NUM = 10_000   # MOSES test molecules that SNN / Frag / Scaf compare with (MOSES: all 176,074)
ROWS = [("validity", "validity"), ("unique", "unique@k"), ("novelty", "novelty"), ("int_div", "IntDiv"),
        ("snn", "SNN/test"), ("frag", "Frag/test"), ("scaf", "Scaf/test"),
        ("atom_bond_accuracy", "atom-bond accuracy"), ("bond_ok", "valid bond types"),
        ("recognised", "OSRA recognised"), ("exact_match", "exact match"),
        ("bond_type_agreement", "bond-type agreement")]


def load_pngs(folder) -> tuple[list[str], list[np.ndarray]]:
    """(file names, uint8 (H, W) grey drawings) of the PNG files of `folder`, sorted by name."""
    from PIL import Image

    from imggen.images import to_8bit
    folder = Path(folder)
    if not folder.is_dir():
        raise DataError(f"--images {folder}: not a folder; pass a folder of PNG drawings")
    names = sorted(f for f in os.listdir(folder) if f.lower().endswith(".png"))
    if not names:
        raise DataError(f"--images {folder}: the folder holds no .png files; pass a folder of PNG drawings")
    imgs = []
    for n in names:
        try:
            with Image.open(folder / n) as im:
                im = to_8bit(im)
                if im.mode in ("RGBA", "LA", "P"):  # transparent paper is white paper
                    im = im.convert("RGBA")
                    bg = Image.new("RGBA", im.size, "white")
                    im = Image.alpha_composite(bg, im)
                imgs.append(np.asarray(im.convert("L")))
        except OSError as e:
            raise DataError(f"--images {folder / n}: cannot read this PNG ({e}); remove or replace it") from None
    return names, imgs


def read_back(images: list[np.ndarray], workers: int = 2, timeout: float = 30, references=None) -> list[dict]:
    """Per drawing: OSRA's SMILES and the chemistry rows of atoms.atom_bond_accuracy (grouped by size)."""
    from imggen.eval.atoms import atom_bond_accuracy
    rows: list = [None] * len(images)
    shapes = {}
    for i, im in enumerate(images):
        shapes.setdefault(im.shape, []).append(i)
    for shape, idx in shapes.items():
        batch = np.stack([images[i] for i in idx])[:, None]
        refs = None if references is None else [references[i] for i in idx]
        res = atom_bond_accuracy(batch, refs, workers=workers, timeout=timeout, return_per_image=True)
        for i, r in zip(idx, res["per_image"]):
            rows[i] = r
    return rows


def score(rows, train=None, ref=None, k=None) -> dict:
    """MOSES metrics of the read-backs plus the mean atoms metrics (over all drawings)."""
    from imggen.eval.moses_metrics import molecule_metrics
    res = molecule_metrics([r["osra_smiles"] for r in rows], train=train, ref=ref, k=k)
    for key in ("recognised", "atom_valence_ok", "bond_ok", "sanitises", "exact_match", "bond_type_agreement"):
        vals = [r[key] for r in rows if key in r]
        res[key] = float(np.mean(vals)) if len(vals) == len(rows) else None
    # an atom counts when its valence is allowed; a bond when its type is: the mean of the two shares
    res["atom_bond_accuracy"] = (res["atom_valence_ok"] + res["bond_ok"]) / 2
    res["intervals"] = intervals(rows)
    return res


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a proportion k/n (sensible at 0 and n, unlike the bootstrap)."""
    if n <= 0:
        raise ValueError("a proportion of 0 drawings has no interval")
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return float(max(0.0, centre - half)), float(min(1.0, centre + half))


def per_drawing(rows) -> dict[str, np.ndarray]:
    """Per drawing: valid (0/1) and its atom-bond accuracy (mean of its atom and bond shares)."""
    from imggen.eval.moses_metrics import is_valid
    return {"valid": np.array([float(is_valid(r["osra_smiles"])) for r in rows]),
            "atom_bond_accuracy": np.array([(r["atom_valence_ok"] + r["bond_ok"]) / 2 for r in rows])}


def intervals(rows, resamples: int = 2000, seed: int = 0) -> dict:
    """95% intervals over drawings: Wilson for validity, percentile bootstrap for atom-bond accuracy."""
    from imggen.eval.bpd import bootstrap_ci
    d = per_drawing(rows)
    out = {"validity": wilson(int(d["valid"].sum()), len(rows))}
    ab = d["atom_bond_accuracy"]
    out["atom_bond_accuracy"] = bootstrap_ci(ab, resamples, seed) if len(ab) > 1 else None
    return out


def log_invalid(names, rows, path=None) -> list[str]:
    """One line per drawing that is not a valid molecule (stderr, and the file `path`)."""
    from imggen.eval.moses_metrics import invalid_reason
    lines = []
    for n, r in zip(names, rows):
        why = invalid_reason(r["osra_smiles"])
        if why is not None:
            osra = f"OSRA {r['osra_status']}" + (f", read {r['osra_smiles']!r}" if r["osra_smiles"] else "")
            lines.append(f"unreadable drawing {n}: {why} ({osra})")
    for line in lines:
        print(line, file=sys.stderr)
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text("".join(line + "\n" for line in lines))
    return lines


def _redraw(smiles: str, side: int) -> np.ndarray:
    """RDKit's drawing of a read-back (grey), or a blank panel with a cross when there is none or
    RDKit cannot draw it (OSRA reads scribbles into atoms RDKit's drawer rejects, e.g. a charged `*`)."""
    import io

    from PIL import Image
    from rdkit import Chem, rdBase
    from rdkit.Chem.Draw import rdMolDraw2D

    from imggen.eval.moses_metrics import parse
    mol = parse(smiles) if smiles else None
    with rdBase.BlockLogs():
        if mol is None and smiles:
            mol = Chem.MolFromSmiles(smiles, sanitize=False)
        for prepare in (True, False) if mol is not None else ():
            d = rdMolDraw2D.MolDraw2DCairo(side, side)
            d.drawOptions().useBWAtomPalette()
            d.drawOptions().prepareMolsBeforeDrawing = prepare
            try:
                rdMolDraw2D.PrepareAndDrawMolecule(d, mol) if prepare else d.DrawMolecule(mol)
            except (RuntimeError, ValueError):
                continue
            d.FinishDrawing()
            return np.asarray(Image.open(io.BytesIO(d.GetDrawingText())).convert("L"))
    panel = np.full((side, side), 235, np.uint8)
    r = np.arange(side)
    panel[r, r] = panel[r, side - 1 - r] = 120
    return panel


def readback_picture(images, rows, path, show: int = SHOW, per_row: int = 4) -> str:
    """PNG: pairs [drawing | RDKit redraw of what OSRA read from it], `per_row` pairs a row."""
    from PIL import Image

    from imggen.images import save_image
    n = min(show, len(images))
    gap = 8
    w = per_row * (2 * PANEL + gap) - gap
    h = -(-n // per_row) * (PANEL + gap) - gap
    canvas = np.full((max(h, PANEL), w), 255, np.uint8)
    for i in range(n):
        y, x = (i // per_row) * (PANEL + gap), (i % per_row) * (2 * PANEL + gap)
        im = Image.fromarray(images[i])
        scale = PANEL / max(im.size)
        im = np.asarray(im.resize((max(1, round(im.width * scale)), max(1, round(im.height * scale))),
                                  Image.NEAREST if scale >= 1 else Image.LANCZOS))
        canvas[y:y + im.shape[0], x:x + im.shape[1]] = im
        canvas[y:y + PANEL, x + PANEL - 1] = 160  # a thin line between the pair
        canvas[y:y + PANEL, x + PANEL:x + 2 * PANEL] = _redraw(rows[i]["osra_smiles"], PANEL)
    save_image(canvas[..., None], str(path))
    return str(path)


def ceiling_smiles(num: int, height: int, width: int, max_tries: int | None = None) -> list[str]:
    """The first `num` molecules of MOSES test that can be drawn in the style of this size (looking
    at no more than max_tries, default 20 * num + 100; DataError when none of them can be drawn)."""
    from imggen.datasets.molecules import OK, draw_one, style_for
    from imggen.datasets.moses import data_folder, read_split
    style = style_for(height, width)
    tries = max_tries or 20 * num + 100
    out = []
    for s in read_split(data_folder(), "test")[:tries]:
        if draw_one(s, style)[0] == OK:
            out.append(s)
            if len(out) == num:
                break
    if not out:
        raise DataError(f"--ceiling: none of the first {tries} MOSES test molecules can be drawn at {height}x{width} "
                        f"(style {style.name}); use larger drawings or --ceiling 0")
    return out


def run_molecules(images, names, *, out, ceiling: int = 0, ref_num: int = REF_NUM, k: int | None = None,
                  workers: int = 2, timeout: float = 30, moses: bool = True) -> dict:
    """Score `images` (list of uint8 (H, W)); ceiling: read back this many true drawings too."""
    from imggen.eval.moses_metrics import BASELINES, reference_stats, train_set
    from imggen.datasets.moses import data_folder, read_split

    train = ref = None
    notes = []
    if moses:
        folder = data_folder()  # DataError naming the install command when absent
        train = train_set(folder)
        test = read_split(folder, "test")
        ref = reference_stats(test if not ref_num else test[:ref_num])
        notes.append(f"novelty vs {len(train):,} MOSES train molecules; SNN/Frag/Scaf vs {ref['n']:,} MOSES test "
                     f"molecules (MOSES uses all {len(test):,})")
    rows = read_back(images, workers, timeout)
    os.makedirs(out, exist_ok=True)
    lines = log_invalid(names, rows, Path(out) / "readback.log")
    res = score(rows, train, ref, k)
    flags = per_drawing(rows)
    res["per_image"] = [{"name": n, "osra_status": r["osra_status"], "osra_smiles": r["osra_smiles"],
                         "valid": bool(v), "atom_bond_accuracy": float(a)}
                        for n, r, v, a in zip(names, rows, flags["valid"], flags["atom_bond_accuracy"])]
    res.pop("canonical")
    res["unreadable"] = len(lines)
    res["picture"] = readback_picture(images, rows, Path(out) / "readback.png")
    res["log"] = str(Path(out) / "readback.log")
    if ceiling:
        sizes = {}  # the style of the most common drawing size
        for im in images:
            sizes[im.shape] = sizes.get(im.shape, 0) + 1
        h, w = max(sizes, key=sizes.get)
        from imggen.datasets.molecules import render_smiles
        refs = ceiling_smiles(ceiling, h, w)
        true, kept = render_smiles(refs, h, w, workers=1, progress=False, use_cache=True, report=False)
        crow = read_back([t[0] for t in true], workers, timeout, references=[refs[i] for i in kept])
        c = score(crow, train, ref, k)
        c.pop("canonical")
        c["size"] = [h, w]
        res["ceiling"] = c
        if c["n"] < ceiling:
            notes.append(f"ceiling: only {c['n']} of the first MOSES test molecules tried fit {h}x{w}")
    res["baselines"] = BASELINES
    res["notes"] = notes
    return res


def table(res: dict) -> str:
    """Markdown table: metric | drawings | ceiling | MOSES baselines."""
    from imggen.eval.moses_metrics import BASELINES

    def f(v):
        return "n/a" if v is None or (isinstance(v, float) and not np.isfinite(v)) else f"{v:.3f}"

    def ci(r, key):
        lohi = r.get("intervals", {}).get(key)
        return f" ({lohi[0]:.3f}-{lohi[1]:.3f})" if lohi else ""
    c = res.get("ceiling")
    head = ["metric", f"drawings (n={res['n']})"] + ([f"ceiling (n={c['n']})"] if c else []) + list(BASELINES)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key, label in ROWS:
        if key == "unique":
            label = f"unique@{res['unique_k']}"
        vals = [f(r.get(key)) + ci(r, key) for r in [res] + ([c] if c else [])]
        vals += [f(b.get(key)) for b in BASELINES.values()]
        lines.append(f"| {label} | " + " | ".join(vals) + " |")
    return "\n".join(lines)
