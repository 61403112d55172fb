"""Molecule domain: SMILES files -> grayscale 2D depictions drawn at a fixed scale with RDKit.

Every molecule is drawn with the same bond length in pixels (no per-molecule zoom), black on
white, so pixel statistics are comparable across the data set. Molecules that would have to be
shrunk (or clipped) to fit the canvas are skipped and counted, as are invalid SMILES.
"""
from __future__ import annotations

import csv
import gzip
import hashlib
import io
import json
import multiprocessing as mp
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from imggen.datasets import ImageSplits, split_indices
from imggen.errors import DataError
from imggen.storage import cache_root, cached_npz

DATA_DIR = Path(__file__).parent / "data"
SAMPLE = DATA_DIR / "moses_sample.csv"
SAMPLE_INFO = {"source": "MOSES benchmark (molsets 0.3.1), first rows of the test split; "
                         "molecules derive from ZINC Clean Leads",
               "licence": "MIT (Copyright 2018 Insilico Medicine), see datasets/data/MOSES_LICENSE.txt"}
_CACHE_VERSION = 1
OK, INVALID, TOO_LARGE = 0, 1, 2


# ----------------------------------------------------------------------------- reading
MAX_SMILES_CHARS = 1000  # MOSES' longest is 57, ZINC's ~120: longer lines are not molecules we can draw


class _Budget(io.RawIOBase):
    """A decompressing reader that stops with a DataError after `limit` bytes: a small .gz that
    inflates to gigabytes (a gzip bomb) is refused instead of filling memory with its lines."""

    def __init__(self, path: Path, limit: int):
        self._f, self._left, self._path, self._limit = gzip.open(path, "rb"), limit, path, limit

    def readable(self):
        return True

    def readinto(self, b):
        n = self._f.readinto(b)
        self._left -= n
        if self._left < 0:
            raise DataError(f"{self._path} inflates to more than {self._limit >> 20} MiB (16x its compressed "
                            f"size + 16 MiB); it is not a plain SMILES file")
        return n

    def close(self):
        self._f.close()
        super().close()


def _open_text(path: Path):
    if path.suffix == ".gz":
        raw = io.BufferedReader(_Budget(path, 16 * path.stat().st_size + (16 << 20)))
        return io.TextIOWrapper(raw, encoding="utf-8", newline="")
    return open(path, newline="", encoding="utf-8")


def _read_csv(path: Path) -> list[str]:
    with _open_text(path) as f:
        rows = csv.reader(f)
        header = next(rows, None)
        if header is None:
            raise DataError(f"{path}: empty file, expected a CSV with a 'smiles' or 'SMILES' column")
        names = [h.strip().lower() for h in header]
        if "smiles" not in names:
            raise DataError(f"{path}: no SMILES column (columns: {', '.join(header)}); "
                            "name the column 'smiles' or 'SMILES'")
        col = names.index("smiles")
        # values may carry trailing newlines (ZINC-250k layout): strip them
        return [row[col].strip() for row in rows if len(row) > col and row[col].strip()]


def _read_smi(path: Path) -> list[str]:
    out = []
    with _open_text(path) as f:
        for i, line in enumerate(f):
            tok = line.split()
            if not tok or tok[0].startswith("#"):
                continue
            if i == 0 and tok[0].lower() == "smiles":  # optional header
                continue
            out.append(tok[0])
    return out


def _read_sdf(path: Path) -> list[str]:
    from rdkit import Chem, rdBase
    out = []
    with rdBase.BlockLogs():
        for mol in Chem.SDMolSupplier(str(path)):
            # unparseable records become "" so they are counted as invalid downstream
            out.append(Chem.MolToSmiles(mol) if mol is not None else "")
    return out


def read_smiles(path) -> list[str]:
    """SMILES strings from a .csv (column 'smiles'/'SMILES'), .smi or .sdf file (optionally .gz)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file; pass a .csv, .smi or .sdf file of molecules")
    ext = path.suffixes[-2] if path.suffix == ".gz" and len(path.suffixes) > 1 else path.suffix
    readers = {".csv": _read_csv, ".smi": _read_smi, ".sdf": _read_sdf}
    if ext.lower() not in readers:
        raise DataError(f"{path}: unknown molecule file type {ext!r}; use .csv, .smi or .sdf")
    try:
        smiles = readers[ext.lower()](path)
    except DataError:
        raise
    except (OSError, UnicodeDecodeError, csv.Error, RuntimeError, EOFError) as e:
        raise DataError(f"{path}: cannot read molecule file ({type(e).__name__}: {e})") from e
    if not smiles:
        raise DataError(f"{path}: no SMILES found (empty file?)")
    long = next((i for i, s in enumerate(smiles) if len(s) > MAX_SMILES_CHARS), None)
    if long is not None:
        raise DataError(f"{path}: molecule {long + 1} is a SMILES of {len(smiles[long]):,} characters, more than "
                        f"{MAX_SMILES_CHARS} (no drawable molecule is that long); remove it")
    return smiles


# ----------------------------------------------------------------------------- styles
@dataclass(frozen=True)
class MolStyle:
    """How a molecule is drawn: sizes in pixels (padding: fraction of the canvas)."""

    height: int
    width: int
    bond_length: float     # fixed bond length, px
    line_width: int        # bond line width, px
    font_size: int         # atom label size, px
    padding: float = 0.03  # blank margin, fraction of the canvas side
    bond_offset: float = 0.15  # gap between the lines of a double bond, fraction of bond length
    name: str = "custom"


# Tuned for OSRA read-back (bench/results/molecules.md): thin lines, labels ~0.6-0.8 bond length,
# wider double-bond gaps at small sizes so the two lines stay apart.
STYLES = {
    "demo": MolStyle(32, 32, bond_length=3.0, line_width=1, font_size=5, padding=0.08, bond_offset=0.25,
                     name="demo"),
    "mol128": MolStyle(128, 128, bond_length=11.0, line_width=1, font_size=9, bond_offset=0.2, name="mol128"),
    "mol256": MolStyle(256, 256, bond_length=22.0, line_width=1, font_size=14, bond_offset=0.25, name="mol256"),
    "osra500": MolStyle(500, 500, bond_length=40.0, line_width=2, font_size=22, padding=0.05, name="osra500"),
}


def style_for(height: int, width: int) -> MolStyle:
    """The named style for this canvas size, else one scaled from the canvas's shorter side."""
    for s in STYLES.values():
        if (s.height, s.width) == (height, width):
            return s
    side = min(height, width)
    if side < 16:
        raise DataError(f"image size {height}x{width} is too small to draw molecules (need >= 16 px)")
    return MolStyle(height, width, bond_length=round(side * 0.088, 1), line_width=max(1, round(side / 256)),
                    font_size=max(5, round(side * 0.065)), padding=0.03 if side >= 64 else 0.08,
                    bond_offset=0.2, name=f"scaled{height}x{width}")


# ----------------------------------------------------------------------------- drawing
def draw_one(smiles: str, style: MolStyle) -> tuple[int, np.ndarray | None]:
    """(status, uint8 (H, W) image or None); status is OK, INVALID or TOO_LARGE."""
    from PIL import Image
    from rdkit import Chem, rdBase
    from rdkit.Chem.Draw import rdMolDraw2D

    with rdBase.BlockLogs():
        mol = Chem.MolFromSmiles(smiles) if smiles else None
        if mol is None or mol.GetNumAtoms() == 0:
            return INVALID, None
        d = rdMolDraw2D.MolDraw2DCairo(style.width, style.height)
        o = d.drawOptions()
        o.useBWAtomPalette()
        o.fixedBondLength = style.bond_length
        o.bondLineWidth = style.line_width
        o.scaleBondWidth = False
        o.fixedFontSize = o.minFontSize = o.maxFontSize = style.font_size
        o.padding = style.padding
        o.multipleBondOffset = style.bond_offset
        o.addStereoAnnotation = False
        try:
            rdMolDraw2D.PrepareAndDrawMolecule(d, mol)
        except (RuntimeError, ValueError):
            return INVALID, None
        d.FinishDrawing()
        img = np.asarray(Image.open(io.BytesIO(d.GetDrawingText())).convert("L"))
        # too large: RDKit shrank the drawing below the fixed bond length, or it touches the border
        lengths = [(d.GetDrawCoords(b.GetBeginAtomIdx()) - d.GetDrawCoords(b.GetEndAtomIdx())).Length()
                   for b in mol.GetBonds()]
    if lengths and np.median(lengths) < 0.97 * style.bond_length:
        return TOO_LARGE, None
    if min(img[0].min(), img[-1].min(), img[:, 0].min(), img[:, -1].min()) < 250:
        return TOO_LARGE, None
    return OK, img


def _draw_chunk(args):
    smiles, style = args
    status = np.zeros(len(smiles), np.int8)
    imgs = []
    for i, s in enumerate(smiles):
        status[i], img = draw_one(s, style)
        if img is not None:
            imgs.append(img)
    imgs = np.stack(imgs) if imgs else np.zeros((0, style.height, style.width), np.uint8)
    return status, imgs


def default_cache_dir() -> Path:
    """$IMGGEN_CACHE_DIR, else $IMGGEN_CACHE (older name), else ~/.cache/imggen (imggen.storage.cache_root)."""
    return cache_root()


def _cache_key(smiles: list[str], style: MolStyle) -> str:
    from rdkit import rdBase
    h = hashlib.sha256()
    h.update(json.dumps({"v": _CACHE_VERSION, "rdkit": rdBase.rdkitVersion, "style": asdict(style)},
                        sort_keys=True).encode())
    for s in smiles:
        h.update(s.encode() + b"\n")
    return h.hexdigest()[:24]


def render_smiles(smiles, height: int, width: int, style: MolStyle | None = None, workers: int = 2,
                  cache_dir=None, progress: bool = True, use_cache: bool = True, report: bool = True):
    """Draw SMILES -> (uint8 images (N, 1, H, W), kept indices into `smiles`).

    Invalid SMILES and molecules too large for the fixed scale are skipped; with `report`, one line
    on stderr gives the counts and the reason (`skipped_message`). Results are cached on disk under a
    hash of (SMILES list, style, size).
    """
    style = replace(style or style_for(height, width), height=height, width=width)
    images, status = _render(smiles, height, width, style, workers, cache_dir, progress, use_cache)
    if report:
        _report_skipped(status, style)
    return images, np.flatnonzero(status == OK)


def _render(smiles, height, width, style, workers, cache_dir, progress, use_cache):
    """(images of the drawable molecules, per-input status array), cached."""
    smiles = [str(s) for s in smiles]
    style = replace(style or style_for(height, width), height=height, width=width)

    def draw():
        return _draw_all(smiles, height, width, style, workers, progress)

    def check(z):  # a file of another count or size of drawings is damaged too
        images, status = z["images"], z["status"]
        if status.shape != (len(smiles),) or images.shape != (int((status == OK).sum()), 1, height, width):
            raise ValueError(f"{images.shape[0]} images of {images.shape[1:]} for {len(status)} molecules")
    z = cached_npz(cache_root(cache_dir) / f"molecules-{_cache_key(smiles, style)}.npz", draw,
                   "molecule render cache", check) if use_cache else draw()
    return z["images"], z["status"]


def _draw_all(smiles, height, width, style, workers, progress) -> dict:
    """{"images": the drawable molecules' images, "status": per input}, drawn in `workers` processes."""
    from tqdm import tqdm
    chunk = int(min(256, max(16, len(smiles) // (max(workers, 1) * 8) + 1)))
    jobs = [(smiles[i:i + chunk], style) for i in range(0, len(smiles), chunk)]
    bar = tqdm(total=len(smiles), desc=f"drawing molecules {height}x{width}", unit="mol",
               disable=not progress, leave=False)
    results = []
    if workers <= 1 or len(jobs) == 1:
        for j in jobs:
            results.append(_draw_chunk(j))
            bar.update(len(j[0]))
    else:
        ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else mp.get_context()
        with ctx.Pool(workers) as pool:
            for r in pool.imap(_draw_chunk, jobs):  # ordered, so indices line up
                results.append(r)
                bar.update(len(r[0]))
    bar.close()
    status = np.concatenate([r[0] for r in results]) if results else np.zeros(0, np.int8)
    images = np.concatenate([r[1] for r in results])[:, None] if results else \
        np.zeros((0, 1, height, width), np.uint8)
    return {"images": images, "status": status}


def _counts(status) -> dict:
    return {"read": len(status), "invalid": int((status == INVALID).sum()),
            "too_large": int((status == TOO_LARGE).sum()), "kept": int((status == OK).sum())}


def skipped_message(status, style: MolStyle, source=None) -> str | None:
    """One line saying how many molecules were skipped and why, or None when all were drawn."""
    c = _counts(status)
    if not (c["invalid"] or c["too_large"]):
        return None
    src = f" from {Path(source).name}" if source is not None else ""
    why = [f"{c['invalid']} invalid SMILES"] if c["invalid"] else []
    if c["too_large"]:
        bigger = "--preset mol128 (128x128)" if min(style.height, style.width) < 128 else \
            "a larger --model.height/--model.width"
        why.append(f"{c['too_large']} ({c['too_large'] / c['read']:.0%}) too large: every molecule is drawn at "
                   f"one bond length ({style.bond_length:g} px, style {style.name}) and never shrunk, so one "
                   f"whose drawing would not fit {style.height}x{style.width} is left out; {bigger} keeps more")
    return f"molecules: kept {c['kept']} of {c['read']}{src}; skipped " + "; ".join(why)


def _report_skipped(status, style: MolStyle, source=None) -> None:
    msg = skipped_message(status, style, source)
    if msg:  # one plain line on stderr: warnings.warn would also print a source line
        print(msg, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- adapter
def load(path=None, *, height: int, width: int, channels: int = 1, seed: int = 0,
         skip_bad: bool = False, style: MolStyle | str | None = None, limit: int | None = None,
         cache_dir=None, workers: int = 2, progress: bool = True, **_) -> ImageSplits:
    """Molecule images with train/val/test splits; path=None -> the shipped MOSES sample.

    Invalid or too-large molecules are always skipped and counted (skip_bad is accepted for the
    common adapter signature); meta["smiles"][split][i] is the molecule drawn in split[i].
    """
    if channels != 1:
        raise DataError(f"molecule images are grayscale: channels must be 1, got {channels} "
                        "(use a preset with channels=1)")
    if isinstance(style, str):
        if style not in STYLES:
            raise DataError(f"unknown molecule style {style!r}; choose one of {', '.join(STYLES)}")
        style = STYLES[style]
    src = SAMPLE if path is None else Path(path)
    smiles = read_smiles(src)
    if limit is not None:
        smiles = smiles[:int(limit)]
    style = replace(style or style_for(height, width), height=height, width=width)
    images, status = _render(smiles, height, width, style, workers, cache_dir, progress, True)
    _report_skipped(status, style, src)
    kept = np.flatnonzero(status == OK)
    if len(kept) == 0:
        raise DataError(f"{src}: none of the {len(smiles)} molecules could be drawn at {height}x{width} "
                        f"(invalid SMILES or too large for style {style.name!r})")
    kept_smiles = [smiles[i] for i in kept]
    idx = split_indices(len(kept), seed)
    counts = _counts(status)
    info = {**counts, "style": asdict(style), "source": str(src),
            "licence": SAMPLE_INFO["licence"] if path is None else "see the source of " + str(src)}
    if path is None:
        info["source"] = f"{src} ({SAMPLE_INFO['source']})"
    return ImageSplits(train=images[idx["train"]], val=images[idx["val"]], test=images[idx["test"]],
                       meta={"smiles": {k: [kept_smiles[i] for i in v] for k, v in idx.items()}},
                       info=info)
