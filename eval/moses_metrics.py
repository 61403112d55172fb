"""MOSES's molecule-generation metrics (Polykovskiy et al. 2020, molsets 0.3.1), computed with RDKit.

The definitions follow moses/metrics/{metrics,utils}.py of the molsets wheel:
- validity: here stricter than MOSES (which only asks RDKit to parse and sanitise): one molecule
  (no '.' fragments) with no unknown atom (OSRA writes `*` for a label it cannot read);
- unique@k: distinct canonical SMILES among the first k valid molecules / k (of those present);
- novelty: share of the distinct valid canonical SMILES not in the training set;
- IntDiv (IntDiv1): 1 - mean Tanimoto over all ordered pairs (self pairs included) of the valid
  molecules' Morgan fingerprints (radius 2, 1024 bits);
- SNN: mean over generated molecules of the largest Tanimoto to a reference molecule (same fps);
- Frag / Scaf: cosine similarity of the count vectors of BRICS fragments / Bemis-Murcko scaffolds
  (scaffolds with >= 2 rings only, as MOSES), generated vs reference; NaN when either is empty.
Canonical SMILES are RDKit's `MolToSmiles` (isomeric, as MOSES's `canonic_smiles`); MOSES's train
csv is already in that form, so novelty compares strings.
"""
from __future__ import annotations

import hashlib
import json
from collections import Counter

import numpy as np

# MOSES's baselines on its test set, as issue 29 quotes them (MOSES README / paper, Table 2);
# the IntDiv of VAE and LatentGAN was not quoted there and is left out rather than guessed
BASELINES = {"CharRNN": {"validity": 0.975, "unique": 0.999, "novelty": 0.84, "int_div": 0.856},
             "VAE": {"validity": 0.977, "unique": 0.998, "novelty": 0.69},
             "LatentGAN": {"validity": 0.897, "unique": 0.997, "novelty": 0.95}}
FP_RADIUS, FP_BITS = 2, 1024


def parse(smiles: str):
    """Sanitised RDKit molecule of `smiles`, or None (unparseable, fails sanitisation, empty)."""
    from rdkit import Chem, rdBase
    if not smiles:
        return None
    with rdBase.BlockLogs():
        mol = Chem.MolFromSmiles(smiles)
    return mol if mol is not None and mol.GetNumAtoms() else None


def invalid_reason(smiles: str) -> str | None:
    """Why a read-back is not a valid molecule (None when it is): no output, does not parse or
    sanitise, several fragments, unknown atoms."""
    if not smiles:
        return "no molecule read"
    mol = parse(smiles)
    if mol is None:
        return "does not parse or sanitise in RDKit"
    from rdkit import Chem
    if len(Chem.GetMolFrags(mol)) > 1:
        return "several fragments"
    if any(a.GetAtomicNum() == 0 for a in mol.GetAtoms()):
        return "unknown atoms (*)"
    return None


def is_valid(smiles: str) -> bool:
    return invalid_reason(smiles) is None


def canonical(smiles: str) -> str | None:
    from rdkit import Chem
    mol = parse(smiles)
    return None if mol is None else Chem.MolToSmiles(mol)


def validity(smiles) -> float:
    smiles = list(smiles)
    if not smiles:
        raise ValueError("validity of 0 molecules is undefined")
    return sum(map(is_valid, smiles)) / len(smiles)


def unique_at_k(valid_canonical, k: int | None = None) -> float:
    """Distinct / total among the first k valid canonical SMILES (NaN for none)."""
    gen = list(valid_canonical)[:k] if k else list(valid_canonical)
    return len(set(gen)) / len(gen) if gen else float("nan")


def novelty(valid_canonical, train_set) -> float:
    """Share of the distinct valid canonical SMILES not in `train_set` (a set of canonical SMILES)."""
    gen = set(valid_canonical) - {None}
    return len(gen - train_set) / len(gen) if gen else float("nan")


def fingerprints(mols) -> np.ndarray:
    """uint8 (n, 1024) Morgan radius-2 bit vectors (MOSES's `fingerprint(..., 'morgan')`)."""
    from rdkit import DataStructs
    from rdkit.Chem import rdFingerprintGenerator
    gen = rdFingerprintGenerator.GetMorganGenerator(radius=FP_RADIUS, fpSize=FP_BITS)
    out = np.zeros((len(mols), FP_BITS), np.uint8)
    for i, m in enumerate(mols):
        DataStructs.ConvertToNumpyArray(gen.GetFingerprint(m), out[i])
    return out


def tanimoto(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(len(a), len(b)) Tanimoto similarities of bit-vector rows; 1 where both are all zero (as MOSES)."""
    a, b = a.astype(np.float32), b.astype(np.float32)
    inter = a @ b.T
    union = a.sum(1, keepdims=True) + b.sum(1)[None] - inter
    with np.errstate(invalid="ignore", divide="ignore"):
        sim = inter / union
    return np.where(union == 0, 1.0, sim)


def int_div(fps: np.ndarray) -> float:
    if len(fps) == 0:
        return float("nan")
    return float(1 - tanimoto(fps, fps).mean())


def snn(gen_fps: np.ndarray, ref_fps: np.ndarray, batch: int = 4096) -> float:
    if len(gen_fps) == 0 or len(ref_fps) == 0:
        return float("nan")
    best = np.zeros(len(gen_fps))
    for j in range(0, len(ref_fps), batch):
        best = np.maximum(best, tanimoto(gen_fps, ref_fps[j:j + batch]).max(1))
    return float(best.mean())


def fragments(mols) -> Counter:
    from rdkit import Chem
    out = Counter()
    for m in mols:  # MOSES: AllChem.FragmentOnBRICSBonds (= rdmolops)
        out.update(Chem.MolToSmiles(Chem.FragmentOnBRICSBonds(m)).split("."))
    return out


def scaffold(mol, min_rings: int = 2) -> str | None:
    from rdkit import Chem
    from rdkit.Chem.Scaffolds import MurckoScaffold
    try:
        sc = MurckoScaffold.GetScaffoldForMol(mol)
    except (ValueError, RuntimeError):
        return None
    smi = Chem.MolToSmiles(sc)
    return smi if smi and sc.GetRingInfo().NumRings() >= min_rings else None


def scaffolds(mols) -> Counter:
    out = Counter(scaffold(m) for m in mols)
    out.pop(None, None)
    return out


def cos_similarity(ref: Counter, gen: Counter) -> float:
    if not ref or not gen:
        return float("nan")
    keys = sorted(set(ref) | set(gen))
    r = np.array([ref.get(k, 0) for k in keys], float)
    g = np.array([gen.get(k, 0) for k in keys], float)
    return float(r @ g / (np.linalg.norm(r) * np.linalg.norm(g)))


# ----------------------------------------------------------------------------- references
def reference_stats(smiles, cache_dir=None) -> dict:
    """Fingerprints, fragment and scaffold counts of reference SMILES (e.g. MOSES test), cached on
    disk under a hash of the list (computing them for 10,000 molecules takes ~30 s)."""
    from rdkit import rdBase

    from imggen.storage import cache_root, cached_npz
    smiles = list(smiles)
    h = hashlib.sha256(json.dumps([1, rdBase.rdkitVersion, smiles]).encode()).hexdigest()[:24]

    def compute():
        mols = [m for m in map(parse, smiles) if m is not None]
        return {"fps": np.packbits(fingerprints(mols), axis=1), "n": np.int64(len(mols)),
                "frag": np.array(json.dumps(fragments(mols))), "scaf": np.array(json.dumps(scaffolds(mols)))}
    z = cached_npz(cache_root(cache_dir) / f"moses-ref-{h}.npz", compute, "MOSES reference statistics cache",
                   check=_unpack)
    return _unpack(z)


def _unpack(z: dict) -> dict:
    """reference_stats' arrays as stored (bits packed, counts as JSON) -> its statistics."""
    return {"fps": np.unpackbits(z["fps"], axis=1)[:, :FP_BITS], "n": int(z["n"]),
            "frag": Counter(json.loads(str(z["frag"]))), "scaf": Counter(json.loads(str(z["scaf"])))}


def train_set(folder=None) -> set:
    """Canonical SMILES of MOSES train (already canonical in its csv)."""
    from imggen.datasets.moses import data_folder, read_split
    return set(read_split(data_folder(folder), "train"))


# ----------------------------------------------------------------------------- all at once
def molecule_metrics(read_back, train: set | None = None, ref: dict | None = None, k: int | None = None) -> dict:
    """MOSES metrics of read-back SMILES (one per drawing; "" for none): validity over all of
    them, the rest over the valid ones (MOSES's protocol after `remove_invalid`)."""
    read_back = list(read_back)
    if not read_back:
        raise ValueError("molecule metrics of 0 drawings are undefined")
    valid = [s for s in read_back if is_valid(s)]
    mols = [parse(s) for s in valid]
    from rdkit import Chem
    canon = [Chem.MolToSmiles(m) for m in mols]
    nan = float("nan")
    fps = fingerprints(mols) if mols else np.zeros((0, FP_BITS), np.uint8)
    res = {"n": len(read_back), "n_valid": len(valid), "validity": len(valid) / len(read_back),
           "unique": unique_at_k(canon, k), "unique_k": min(k, len(canon)) if k else len(canon),
           "novelty": novelty(canon, train) if train is not None else nan,
           "int_div": int_div(fps), "snn": nan, "frag": nan, "scaf": nan}
    if ref is not None and mols:
        res.update(snn=snn(fps, ref["fps"]), frag=cos_similarity(ref["frag"], fragments(mols)),
                   scaf=cos_similarity(ref["scaf"], scaffolds(mols)))
    res["canonical"] = canon
    return res
