"""Atom-bond accuracy of molecule images: OSRA reads each image back into a molecule.

Per image: array -> PNG (light-grey strokes stretched to black, upscaled) -> `osra -f can` ->
SMILES -> RDKit molecule, then chemistry checks (valence, bond types, sanitisation) and, given
reference SMILES, exact match and bond-type agreement. `calibrate` runs the same on ground-truth
drawings: the ceiling that generated images should be judged against.
"""
from __future__ import annotations

import io
import os
import shutil
import subprocess
import tempfile
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from imggen.errors import DataError, ImggenError, ShapeError

KEYS = ("recognised", "atom_valence_ok", "bond_ok", "sanitises", "exact_match", "bond_type_agreement")
# OSRA reads best with bonds ~40 px: smaller images are upscaled by an integer factor to about
# this side (128 -> x3, 256 -> x2); Lanczos beat bicubic/nearest
TARGET_SIDE = 400
# Grey strokes before OSRA (bench/results/osra_binarise.md): "stretch" brings light-grey strokes to
# full contrast and leaves black-and-white drawings as they are. Binarising (a fixed threshold or
# Otsu) was measured too and lost: it thickens or breaks thin strokes of black-and-white drawings.
INK = "stretch"
BORDER = 20          # white margin added around the image, px (after upscaling)
OSRA_ARGS = ("-f", "can")
# OSRA's exact match on true drawings (`calibrate`, 100 seeded MOSES molecules, the project's
# styles; bench/results/osra_binarise.md): below ~160 px it cannot read the atom labels
CEILINGS = {500: 0.97, 256: 0.81, 192: 0.37, 160: 0.15, 128: 0.04}
READABLE_SIDE = 160


class OsraNotFound(ImggenError, RuntimeError):
    """The `osra` binary is not installed or not on PATH."""


def find_osra() -> str:
    exe = shutil.which("osra")
    if exe is None:
        raise OsraNotFound("atom-bond accuracy needs the OSRA binary, but `osra` is not on PATH; "
                           "install it (Debian/Ubuntu: apt-get install osra) or add it to PATH")
    return exe


def stretch_ink(img: np.ndarray, light: int = 140, faint: int = 200, window: int = 5) -> np.ndarray:
    """uint8 (H, W) -> light-grey strokes at full contrast, everything else unchanged.

    m = the darkest value within `window` px of a pixel. Where light <= m <= faint (a light-grey
    stroke: RDKit's yellow S, cyan F or orange P turned grey, a faint stroke of a sample), the
    pixel's darkness (255 - v) is scaled by 255 / (255 - m): the stroke gets a black core and keeps
    its anti-aliased edge. Darker strokes (every stroke of a black-and-white drawing) and fainter
    specks are left as they are.
    """
    from scipy.ndimage import minimum_filter
    m = minimum_filter(img, size=window).astype(np.float32)
    stroke = (m >= light) & (m <= faint)
    scale = np.ones_like(m)
    scale[stroke] = 255.0 / (255.0 - m[stroke])
    return np.clip(255.0 - (255.0 - img) * scale, 0, 255).round().astype(np.uint8)


def binarise(img: np.ndarray, threshold) -> np.ndarray:
    """uint8 (H, W) -> 0 (ink) / 255 (paper): ink is darker than `threshold` (an int 1..255), or
    not above skimage's Otsu threshold of this image for "otsu". A blank image is returned unchanged."""
    if img.min() == img.max():
        return img
    if threshold == "otsu":
        from skimage.filters import threshold_otsu
        return np.where(img <= threshold_otsu(img), 0, 255).astype(np.uint8)
    return np.where(img < threshold, 0, 255).astype(np.uint8)


def _check_ink(ink) -> None:
    if ink in (None, "stretch", "otsu") or (isinstance(ink, (int, np.integer)) and not isinstance(ink, bool)
                                            and 1 <= ink <= 255):
        return
    raise ValueError(f"ink must be 'stretch', 'otsu', a threshold 1..255 or None, got {ink!r}")


def prepare(img: np.ndarray, ink=INK, target_side: int = TARGET_SIDE, border: int = BORDER,
            resample: str = "lanczos"):
    """uint8 (H, W) grey or (H, W, 3) colour -> PIL image OSRA reads well, padded with white.

    ink="stretch": light-grey strokes to full contrast (`stretch_ink`), then upscaled (Lanczos);
    "otsu" or an int: upscaled, then binarised; None: only upscaled. Colour images are only upscaled.
    """
    from PIL import Image, ImageOps
    _check_ink(ink)
    if img.ndim == 3:
        ink = None
    if ink == "stretch":
        img, ink = stretch_ink(img), None
    im = Image.fromarray(np.ascontiguousarray(img))
    scale = max(1, round(target_side / max(img.shape[:2])))
    if scale > 1:
        filt = {"lanczos": Image.LANCZOS, "bicubic": Image.BICUBIC, "nearest": Image.NEAREST}[resample]
        im = im.resize((img.shape[1] * scale, img.shape[0] * scale), filt)
    if ink is not None:
        im = Image.fromarray(binarise(np.asarray(im), ink))
    return ImageOps.expand(im, border=border, fill="white")


def _run_osra(exe: str, path: str, timeout: float) -> tuple[str, str]:
    """(status, smiles) of one image file: status 'ok', 'failed' (no output / error) or 'timeout'."""
    try:
        r = subprocess.run([exe, *OSRA_ARGS, path], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", ""
    except OSError:
        return "failed", ""
    out = ".".join(line.split()[0] for line in r.stdout.splitlines() if line.strip())
    return ("ok" if r.returncode == 0 and out else "failed"), out


def _osra(exe: str, img: np.ndarray, timeout: float, tmpdir: str, i: int, ink=INK) -> tuple[str, str]:
    path = os.path.join(tmpdir, f"img{i}.png")
    prepare(img, ink).save(path)
    try:
        return _run_osra(exe, path, timeout)
    finally:
        os.unlink(path)


# ----------------------------------------------------------------------------- chemistry
def _max_valence(z: int, charge: int):
    """Largest allowed valence (None = any), using the isoelectronic element for ions (N+ ~ C)."""
    from rdkit import Chem
    z_eff = z - charge if 0 < z - charge <= 118 else z
    vals = list(Chem.GetPeriodicTable().GetValenceList(z_eff))
    return None if -1 in vals else max(vals)


def _chem(smiles: str) -> dict:
    """Chemistry checks of one OSRA output: per-image fractions plus the sanitised molecule."""
    from rdkit import Chem, rdBase
    with rdBase.BlockLogs():
        mol = Chem.MolFromSmiles(smiles, sanitize=False) if smiles else None
        if mol is None or mol.GetNumAtoms() == 0:
            return {"recognised": 0.0, "atom_valence_ok": 0.0, "bond_ok": 0.0, "sanitises": 0.0, "mol": None}
        clean = Chem.Mol(mol)
        try:
            Chem.SanitizeMol(clean)
            sanitises = True
        except Exception:  # noqa: BLE001 - RDKit raises several sanitisation error types
            sanitises, clean = False, None
        bad_atoms = set()
        if not sanitises:  # lower-bound valence: aromatic bonds count 1, implicit H never overflow
            mol.UpdatePropertyCache(strict=False)
            for a in mol.GetAtoms():
                v = a.GetNumExplicitHs() + sum(1 if b.GetIsAromatic() else int(b.GetBondTypeAsDouble())
                                               for b in a.GetBonds())
                top = _max_valence(a.GetAtomicNum(), a.GetFormalCharge())
                if top is not None and v > top:
                    bad_atoms.add(a.GetIdx())
        # valid bond: a plain type, aromatic only inside a ring, no end atom over its valence
        scored = clean if sanitises else mol
        if not sanitises:
            Chem.FastFindRings(mol)
        ring = scored.GetRingInfo()
        ok_types = {Chem.BondType.SINGLE, Chem.BondType.DOUBLE, Chem.BondType.TRIPLE, Chem.BondType.AROMATIC}
        bonds_ok = [b.GetBondType() in ok_types
                    and not (b.GetIsAromatic() and not ring.NumBondRings(b.GetIdx()))
                    and b.GetBeginAtomIdx() not in bad_atoms and b.GetEndAtomIdx() not in bad_atoms
                    for b in scored.GetBonds()]
    n = mol.GetNumAtoms()
    return {"recognised": 1.0, "atom_valence_ok": 1.0 - len(bad_atoms) / n,
            "bond_ok": float(np.mean(bonds_ok)) if bonds_ok else 1.0,
            "sanitises": float(sanitises), "mol": clean if clean is not None else mol}


def _canon(mol) -> str | None:
    from rdkit import Chem
    try:
        return Chem.MolToSmiles(mol, isomericSmiles=False)
    except Exception:  # noqa: BLE001
        return None


def _bond_types(mol) -> Counter:
    return Counter(str(b.GetBondType()) for b in mol.GetBonds())


def _compare(row: dict, ref_smiles: str) -> None:
    """Add exact_match and bond_type_agreement against the reference SMILES (in place)."""
    from rdkit import Chem, rdBase
    with rdBase.BlockLogs():
        ref = Chem.MolFromSmiles(ref_smiles) if ref_smiles else None
    mol = row["mol"]
    if ref is None or mol is None:
        row["exact_match"], row["bond_type_agreement"] = 0.0, 0.0
        return
    row["exact_match"] = float(bool(row["sanitises"]) and _canon(mol) == _canon(ref))
    p, r = _bond_types(mol), _bond_types(ref)
    denom = max(sum(p.values()), sum(r.values()))
    row["bond_type_agreement"] = sum((p & r).values()) / denom if denom else 1.0


# ----------------------------------------------------------------------------- public
def _as_batch(images) -> np.ndarray:
    if hasattr(images, "detach"):
        images = images.detach().cpu().numpy()
    images = np.asarray(images)
    if images.ndim == 3:
        images = images[:, None]
    if images.ndim != 4 or images.shape[1] != 1:
        raise ShapeError(f"atom_bond_accuracy: images must be grayscale (B, 1, H, W), got shape {images.shape}")
    if images.dtype != np.uint8:
        raise ShapeError(f"atom_bond_accuracy: images must be uint8 0..255, got dtype {images.dtype}")
    if len(images) == 0:
        raise ShapeError(f"atom_bond_accuracy: got 0 images (shape {images.shape}); the metrics of no images "
                         f"are undefined, pass at least one (B, 1, H, W) image")
    return images


def atom_bond_accuracy(images, smiles=None, workers: int = 2, timeout: float = 30,
                       return_per_image: bool = False, ink=INK) -> dict:
    """OSRA-based chemistry metrics of molecule images uint8 (B, 1, H, W); fractions in [0, 1].

    Before OSRA reads an image, light-grey strokes are brought to full contrast (ink="stretch",
    `stretch_ink`) and small images are upscaled to ~400 px. Grey drawings read worse than black
    ones: RDKit's colour drawings turned grey read 22/40 exactly at 500 px against 38/40 in colour,
    36/40 after the stretch. Binarising was calibrated too and not chosen: a fixed threshold of
    190-200 (the best ones on those grey drawings: 35/40, 34/40) lowers the black-and-white
    ceilings from 0.97 to 0.75 at 500 px and from 0.81 to 0.12 at 256 px (at 200); Otsu does not fix
    grey labels (22/40) and lowers the 256 px ceiling to 0.43 (`calibrate_binarisation`,
    bench/results/osra_binarise.md).
    ink="otsu", an int threshold or None (as is) are there for such comparisons.

    recognised: OSRA gave a parseable molecule; atom_valence_ok / bond_ok: per-image fraction of
    atoms with an allowed valence / bonds of a valid type (unrecognised images count 0);
    sanitises: passes RDKit sanitisation; with reference `smiles`: exact_match (canonical SMILES,
    stereo ignored) and bond_type_agreement (multiset overlap of bond types / larger count).
    """
    images = _as_batch(images)  # bad input is reported before a missing OSRA
    exe = find_osra()
    if smiles is not None and len(smiles) != len(images):
        raise ShapeError(f"atom_bond_accuracy: {len(images)} images but {len(smiles)} reference SMILES")
    _check_ink(ink)
    with tempfile.TemporaryDirectory(prefix="imggen-osra-") as tmp, \
            ThreadPoolExecutor(max(1, workers)) as pool:
        outs = list(pool.map(lambda i: _osra(exe, images[i, 0], timeout, tmp, i, ink), range(len(images))))
    return _summarise(outs, smiles, return_per_image)


def _summarise(outs, smiles, return_per_image: bool) -> dict:
    """Metrics over OSRA outputs [(status, smiles)], optionally against reference `smiles`."""
    rows = []
    for i, (status, smi) in enumerate(outs):
        row = _chem(smi)
        row.update(osra_status=status, osra_smiles=smi)
        if smiles is not None:
            _compare(row, smiles[i])
            row["reference"] = smiles[i]
        rows.append(row)
    n = len(rows)
    if n == 0:
        raise ShapeError("atom-bond metrics of 0 images are undefined; pass at least one image")
    res = {k: float(np.mean([r[k] for r in rows])) for k in KEYS[:4]}
    for k in KEYS[4:]:
        res[k] = float(np.mean([r[k] for r in rows])) if smiles is not None else None
    res.update(n=n, failures=sum(r["osra_status"] == "failed" for r in rows),
               timeouts=sum(r["osra_status"] == "timeout" for r in rows))
    if return_per_image:
        res["per_image"] = [{k: v for k, v in r.items() if k != "mol"} for r in rows]
    return res


def calibrate(smiles, height: int, width: int, style=None, workers: int = 2, timeout: float = 30,
              ink=INK) -> dict:
    """The metrics on ground-truth drawings of `smiles` (the ceiling for generated images).

    Molecules that cannot be drawn at this size are left out; `drawn` counts the ones scored.
    Images are prepared for OSRA as in `atom_bond_accuracy` (same `ink`).
    """
    from imggen.datasets.molecules import render_smiles
    if len(smiles) == 0:
        raise DataError("calibrate: no reference SMILES given; pass at least one (e.g. the test split's)")
    images, kept = render_smiles(list(smiles), height, width, style=style, workers=1,
                                 progress=False, use_cache=False, report=False)
    if len(kept) == 0:
        raise DataError(f"calibrate: none of the {len(smiles)} reference SMILES can be drawn at {height}x{width} "
                        f"(invalid, or too large for the fixed bond length); use larger images or other SMILES")
    res = atom_bond_accuracy(images, [smiles[i] for i in kept], workers=workers, timeout=timeout,
                             ink=ink)
    res["drawn"] = len(kept)
    return res


def draw_default(smiles: str, size: int) -> np.ndarray:
    """RDKit's default drawing of `smiles` (colour atom labels, scaled to fit): uint8 (size, size, 3)."""
    from PIL import Image
    from rdkit import Chem
    from rdkit.Chem.Draw import rdMolDraw2D
    d = rdMolDraw2D.MolDraw2DCairo(size, size)
    rdMolDraw2D.PrepareAndDrawMolecule(d, Chem.MolFromSmiles(smiles))
    d.FinishDrawing()
    return np.asarray(Image.open(io.BytesIO(d.GetDrawingText())).convert("RGB"))


def to_grey(rgb: np.ndarray) -> np.ndarray:
    """uint8 (N, H, W, 3) -> (N, H, W) with PIL's ITU-R 601 luma (L = 0.299 R + 0.587 G + 0.114 B)."""
    from PIL import Image
    return np.stack([np.asarray(Image.fromarray(x).convert("L")) for x in rgb])


def calibrate_binarisation(smiles, sizes=(500, 256), inks=(None, "stretch", "otsu", 160, 180, 190, 200, 210, 230),
                           workers: int = 2, timeout: float = 30) -> list[dict]:
    """OSRA on RDKit's default colour drawings of `smiles`, in colour and turned grey, per size.

    Rows {size, input, ink, n, exact_match, recognised, ...}: input "colour" is the colour drawing
    (upscaled like the grey ones); input "grey" is its grayscale version through
    `atom_bond_accuracy` with each of `inks` (None = as is; an int = binarised at that threshold).
    """
    exe, rows = find_osra(), []
    for size in sizes:
        colour = np.stack([draw_default(s, size) for s in smiles])
        with tempfile.TemporaryDirectory(prefix="imggen-osra-") as tmp, \
                ThreadPoolExecutor(max(1, workers)) as pool:
            outs = list(pool.map(lambda i: _osra(exe, colour[i], timeout, tmp, i), range(len(smiles))))
        rows.append({"size": size, "input": "colour", "ink": None, **_summarise(outs, smiles, False)})
        grey = to_grey(colour)[:, None]
        for ink in inks:
            rows.append({"size": size, "input": "grey", "ink": ink,
                         **atom_bond_accuracy(grey, smiles, workers=workers, timeout=timeout, ink=ink)})
    return rows


def readable_note(height: int, width: int) -> str | None:
    """One line for reports on images too small for OSRA to read, else None."""
    if min(height, width) >= READABLE_SIDE:
        return None
    measured = ", ".join(f"{v:.2f} at {k} px" for k, v in CEILINGS.items())
    return (f"OSRA cannot read molecule drawings below ~{READABLE_SIDE} px, so atom-bond figures of "
            f"{height}x{width} images say little (exact match on true drawings: {measured})")


def atoms_report(images, smiles, height: int, width: int, style=None, workers: int = 2) -> dict:
    """{"generated": metrics, "ceiling": metrics on true drawings, "ratio": generated / ceiling}.

    `smiles` are reference molecules (e.g. the test split); they are paired with the images for
    exact_match only when there is one per image (completions), else generated images are unpaired.
    """
    paired = len(smiles) == len(images)
    gen = atom_bond_accuracy(images, smiles if paired else None, workers=workers)
    ceil = calibrate(smiles, height, width, style=style, workers=workers)
    ratio = {k: (gen[k] / ceil[k] if gen[k] is not None and ceil[k] else None) for k in KEYS}
    return {"generated": gen, "ceiling": ceil, "ratio": ratio}
