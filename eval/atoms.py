"""Atom-bond accuracy of molecule images: OSRA reads each image back into a molecule.

Per image: array -> preprocessed PNG -> `osra -f can` -> SMILES -> RDKit molecule, then
chemistry checks (valence, bond types, sanitisation) and, given reference SMILES, exact match
and bond-type agreement. `calibrate` runs the same on ground-truth drawings: the ceiling that
generated images should be judged against.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import warnings
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from imggen.errors import ImggenError, ShapeError

KEYS = ("recognised", "atom_valence_ok", "bond_ok", "sanitises", "exact_match", "bond_type_agreement")
# OSRA reads best with bonds ~40 px: smaller images are upscaled by an integer factor to about
# this side (128 -> x3, 256 -> x2); Lanczos beat bicubic/nearest, binarising (PBM) lost thin lines
TARGET_SIDE = 400
BORDER = 20          # white margin added around the image, px (after upscaling)
OSRA_ARGS = ("-f", "can")


class OsraNotFound(ImggenError, RuntimeError):
    """The `osra` binary is not installed or not on PATH."""


def find_osra() -> str:
    exe = shutil.which("osra")
    if exe is None:
        raise OsraNotFound("atom-bond accuracy needs the OSRA binary, but `osra` is not on PATH; "
                           "install it (Debian/Ubuntu: apt-get install osra) or add it to PATH")
    return exe


def prepare(img: np.ndarray, target_side: int = TARGET_SIDE, border: int = BORDER, resample: str = "lanczos"):
    """uint8 (H, W) grayscale -> PIL image OSRA reads well: upscaled (Lanczos), padded with white."""
    from PIL import Image, ImageOps
    im = Image.fromarray(np.ascontiguousarray(img))
    scale = max(1, round(target_side / max(img.shape)))
    if scale > 1:
        filt = {"lanczos": Image.LANCZOS, "bicubic": Image.BICUBIC, "nearest": Image.NEAREST}[resample]
        im = im.resize((img.shape[1] * scale, img.shape[0] * scale), filt)
    return ImageOps.expand(im, border=border, fill=255)


def _osra(exe: str, img: np.ndarray, timeout: float, tmpdir: str, i: int) -> tuple[str, str]:
    """(status, smiles): status 'ok', 'failed' (no output / error) or 'timeout'."""
    path = os.path.join(tmpdir, f"img{i}.png")
    prepare(img).save(path)
    try:
        r = subprocess.run([exe, *OSRA_ARGS, path], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", ""
    except OSError:
        return "failed", ""
    finally:
        os.unlink(path)
    out = ".".join(line.split()[0] for line in r.stdout.splitlines() if line.strip())
    return ("ok" if r.returncode == 0 and out else "failed"), out


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
    return images


def atom_bond_accuracy(images, smiles=None, workers: int = 2, timeout: float = 30,
                       return_per_image: bool = False) -> dict:
    """OSRA-based chemistry metrics of molecule images uint8 (B, 1, H, W); fractions in [0, 1].

    recognised: OSRA gave a parseable molecule; atom_valence_ok / bond_ok: per-image fraction of
    atoms with an allowed valence / bonds of a valid type (unrecognised images count 0);
    sanitises: passes RDKit sanitisation; with reference `smiles`: exact_match (canonical SMILES,
    stereo ignored) and bond_type_agreement (multiset overlap of bond types / larger count).
    """
    exe = find_osra()
    images = _as_batch(images)
    if smiles is not None and len(smiles) != len(images):
        raise ShapeError(f"atom_bond_accuracy: {len(images)} images but {len(smiles)} reference SMILES")
    with tempfile.TemporaryDirectory(prefix="imggen-osra-") as tmp, \
            ThreadPoolExecutor(max(1, workers)) as pool:
        outs = list(pool.map(lambda i: _osra(exe, images[i, 0], timeout, tmp, i), range(len(images))))
    rows = []
    for i, (status, smi) in enumerate(outs):
        row = _chem(smi)
        row.update(osra_status=status, osra_smiles=smi)
        if smiles is not None:
            _compare(row, smiles[i])
            row["reference"] = smiles[i]
        rows.append(row)
    n = len(rows)
    res = {k: (float(np.mean([r[k] for r in rows])) if n else 0.0) for k in KEYS[:4]}
    for k in KEYS[4:]:
        res[k] = (float(np.mean([r[k] for r in rows])) if n else 0.0) if smiles is not None else None
    res.update(n=n, failures=sum(r["osra_status"] == "failed" for r in rows),
               timeouts=sum(r["osra_status"] == "timeout" for r in rows))
    if return_per_image:
        res["per_image"] = [{k: v for k, v in r.items() if k != "mol"} for r in rows]
    return res


def calibrate(smiles, height: int, width: int, style=None, workers: int = 2, timeout: float = 30) -> dict:
    """The metrics on ground-truth drawings of `smiles` (the ceiling for generated images).

    Molecules that cannot be drawn at this size are left out; `drawn` counts the ones scored.
    """
    from imggen.datasets.molecules import render_smiles
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        images, kept = render_smiles(list(smiles), height, width, style=style, workers=1,
                                     progress=False, use_cache=False)
    res = atom_bond_accuracy(images, [smiles[i] for i in kept], workers=workers, timeout=timeout)
    res["drawn"] = len(kept)
    return res


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
