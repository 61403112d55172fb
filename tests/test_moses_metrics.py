"""MOSES metrics (imggen.eval.moses_metrics) on tiny sets with hand-computed values, and against RDKit."""
import math
from collections import Counter

import numpy as np
import pytest

from imggen.eval import moses_metrics as mm


def test_validity_by_hand():
    gen = ["CCO", "C.C", "*C", "not a smiles", "", "c1ccccc1", "C1CC"]  # valid: CCO, benzene
    assert mm.validity(gen) == pytest.approx(2 / 7)
    assert mm.invalid_reason("C.C") == "several fragments"
    assert mm.invalid_reason("*C") == "unknown atoms (*)"
    assert mm.invalid_reason("") == "no molecule read"
    assert mm.invalid_reason("C(C)(C)(C)(C)C") == "does not parse or sanitise in RDKit"  # 5-valent carbon
    with pytest.raises(ValueError):
        mm.validity([])


def test_unique_and_novelty_by_hand():
    canon = ["CCO", "CCO", "c1ccccc1", "CCN"]
    assert mm.unique_at_k(canon) == pytest.approx(3 / 4)
    assert mm.unique_at_k(canon, 2) == pytest.approx(1 / 2)
    assert mm.unique_at_k(canon, 3) == pytest.approx(2 / 3)
    assert math.isnan(mm.unique_at_k([]))
    # novelty over the distinct molecules: {CCO, benzene, CCN} minus train {CCO} -> 2/3
    assert mm.novelty(canon, {"CCO", "CCCC"}) == pytest.approx(2 / 3)
    assert mm.novelty(canon, set()) == 1.0


def test_canonical_matches_moses_train_form():
    # MOSES train rows are RDKit canonical SMILES: a read-back written otherwise compares equal once canonical
    assert mm.canonical("OCC") == "CCO"
    assert mm.canonical("C1=CC=CC=C1") == "c1ccccc1"
    assert mm.canonical("xx") is None


def test_tanimoto_int_div_snn_by_hand():
    a, b, c = np.array([1, 1, 0, 0]), np.array([1, 0, 1, 0]), np.array([0, 0, 0, 1])
    fps = np.stack([a, b])
    sim = mm.tanimoto(fps, fps)
    assert sim == pytest.approx(np.array([[1, 1 / 3], [1 / 3, 1]]))
    # IntDiv1 = 1 - mean over all ordered pairs, self pairs included: 1 - (1 + 1/3 + 1/3 + 1) / 4
    assert mm.int_div(fps) == pytest.approx(1 / 3)
    # SNN: mean over generated of the best reference match: a -> max(1/3, 0) , c -> 1
    assert mm.snn(np.stack([a, c]), np.stack([b, c])) == pytest.approx((1 / 3 + 1) / 2)
    assert math.isnan(mm.int_div(np.zeros((0, 4))))


def test_fingerprints_and_tanimoto_agree_with_rdkit():
    from rdkit import Chem, DataStructs
    from rdkit.Chem import AllChem
    smi = ["CCO", "c1ccccc1O", "CC(=O)Nc1ccc(O)cc1", "CN1CCC[C@H]1c1cccnc1"]
    mols = [Chem.MolFromSmiles(s) for s in smi]
    ref = [AllChem.GetMorganFingerprintAsBitVect(m, 2, nBits=1024) for m in mols]  # MOSES's call
    fps = mm.fingerprints(mols)
    for row, bv in zip(fps, ref):
        assert set(np.flatnonzero(row)) == set(bv.GetOnBits())
    sim = mm.tanimoto(fps, fps)
    for i in range(len(mols)):
        assert sim[i] == pytest.approx(DataStructs.BulkTanimotoSimilarity(ref[i], ref), abs=1e-6)


def test_frag_and_scaf_by_hand():
    from rdkit import Chem
    par = Chem.MolFromSmiles("CC(=O)Nc1ccc(O)cc1")  # paracetamol: BRICS cuts both amide bonds
    assert mm.fragments([par]) == Counter({"[1*]C(C)=O": 1, "[16*]c1ccc(O)cc1": 1, "[5*]N[5*]": 1})
    # cosine of count vectors: ref (1, 1) vs gen (2, 0) over keys x, y
    assert mm.cos_similarity(Counter(x=1, y=1), Counter(x=2)) == pytest.approx(1 / math.sqrt(2))
    assert mm.cos_similarity(Counter(x=3), Counter(x=1)) == pytest.approx(1.0)
    assert math.isnan(mm.cos_similarity(Counter(), Counter(x=1)))
    # scaffolds with fewer than 2 rings are dropped (MOSES's min_rings=2)
    assert mm.scaffold(Chem.MolFromSmiles("CCc1ccccc1")) is None
    assert mm.scaffold(Chem.MolFromSmiles("CCc1ccc(Cc2ccccc2)cc1")) == "c1ccc(Cc2ccccc2)cc1"
    mols = [Chem.MolFromSmiles(s) for s in ("c1ccc(Cc2ccccc2)cc1", "Cc1ccc(Cc2ccccc2)cc1", "CCO")]
    assert mm.scaffolds(mols) == Counter({"c1ccc(Cc2ccccc2)cc1": 2})


def test_molecule_metrics_together(tmp_path):
    read = ["CCO", "OCC", "c1ccccc1", "C.C", "", "*C"]
    ref = mm.reference_stats(["CCO", "c1ccccc1O"], cache_dir=tmp_path)
    res = mm.molecule_metrics(read, train={"CCO"}, ref=ref)
    assert res["n"] == 6 and res["n_valid"] == 3 and res["validity"] == pytest.approx(0.5)
    assert res["unique"] == pytest.approx(2 / 3) and res["novelty"] == pytest.approx(1 / 2)
    fps = mm.fingerprints([mm.parse(s) for s in ("CCO", "CCO", "c1ccccc1")])
    assert res["int_div"] == pytest.approx(mm.int_div(fps))
    assert res["snn"] == pytest.approx(mm.snn(fps, ref["fps"]))
    # the reference statistics come back from the cache unchanged
    again = mm.reference_stats(["CCO", "c1ccccc1O"], cache_dir=tmp_path)
    assert (again["fps"] == ref["fps"]).all() and again["frag"] == ref["frag"] and again["scaf"] == ref["scaf"]
    assert len(list(tmp_path.glob("moses-ref-*.npz"))) == 1
    noise = mm.molecule_metrics(["", "", "C.C"], train={"CCO"})
    assert noise["validity"] == 0 and math.isnan(noise["novelty"])


def test_wilson_interval_by_hand():
    from imggen.eval.molecules import wilson
    lo, hi = wilson(5, 10)  # textbook value for 5 of 10
    assert lo == pytest.approx(0.2366, abs=1e-4) and hi == pytest.approx(0.7634, abs=1e-4)
    assert wilson(0, 10) == (0.0, pytest.approx(1.96 ** 2 / (10 + 1.96 ** 2)))
    lo, hi = wilson(10, 10)
    assert hi == 1.0 and lo == pytest.approx(10 / (10 + 1.96 ** 2))
    with pytest.raises(ValueError):
        wilson(0, 0)


def test_intervals_of_per_drawing_rows():
    """validity's interval counts valid read-backs; atom-bond accuracy's brackets the per-drawing mean."""
    from imggen.eval.molecules import intervals, per_drawing
    rows = [{"osra_smiles": "CCO", "atom_valence_ok": 1.0, "bond_ok": 1.0},
            {"osra_smiles": "", "atom_valence_ok": 0.0, "bond_ok": 0.0},
            {"osra_smiles": "C*C", "atom_valence_ok": 0.5, "bond_ok": 1.0},
            {"osra_smiles": "CC.O", "atom_valence_ok": 1.0, "bond_ok": 0.5}]
    d = per_drawing(rows)
    assert d["valid"].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert d["atom_bond_accuracy"].tolist() == [1.0, 0.0, 0.75, 0.75]
    ci = intervals(rows)
    from imggen.eval.molecules import wilson
    assert ci["validity"] == wilson(1, 4)
    lo, hi = ci["atom_bond_accuracy"]
    assert 0.0 <= lo <= 0.625 <= hi <= 1.0
