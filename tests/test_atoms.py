"""OSRA-based atom-bond accuracy: calibration ceiling, non-molecules, missing binary, metrics."""
import random
import shutil

import numpy as np
import pytest

from imggen.datasets import molecules as M
from imggen.eval import atoms as A

pytestmark = pytest.mark.skipif(shutil.which("osra") is None, reason="osra binary not installed")


@pytest.fixture(scope="module")
def fixed50():
    """A fixed, seeded set of 50 molecules from the shipped MOSES sample."""
    return random.Random(0).sample(M.read_smiles(M.SAMPLE), 50)


def test_calibration_500px_reads_back(fixed50):
    r = A.calibrate(fixed50, 500, 500, style=M.STYLES["osra500"])
    print(f"\nOSRA ceiling 500x500 (osra500): {r}")
    assert r["drawn"] == 50 and r["n"] == 50
    assert r["exact_match"] >= 0.9 and r["recognised"] >= 0.95
    assert r["sanitises"] >= 0.9 and r["bond_type_agreement"] >= 0.9


def test_ceiling_128_is_a_fraction(fixed50):
    r = A.calibrate(fixed50, 128, 128)
    print(f"\nOSRA ceiling 128x128 (mol128): {r}")
    for k in A.KEYS:
        assert 0.0 <= r[k] <= 1.0
    assert r["n"] == r["drawn"] > 30 and r["failures"] + r["timeouts"] <= r["n"]


def _non_molecules():
    from PIL import Image, ImageDraw
    blank = np.full((128, 128), 255, np.uint8)
    noise = np.random.default_rng(0).integers(0, 256, (128, 128), dtype=np.uint8)
    im = Image.new("L", (128, 128), 255)
    d = ImageDraw.Draw(im)
    d.ellipse((20, 20, 100, 100), outline=0, width=2)
    d.text((40, 55), "hello", fill=0)
    return np.stack([blank, noise, np.asarray(im)])[:, None]


def test_non_molecules_not_recognised():
    imgs = _non_molecules()
    r = A.atom_bond_accuracy(imgs, return_per_image=True)
    assert r["n"] == 3 and r["recognised"] == 0.0 and r["exact_match"] is None
    assert r["atom_valence_ok"] == 0.0 and r["bond_ok"] == 0.0 and r["sanitises"] == 0.0
    assert len(r["per_image"]) == 3 and r["failures"] == 3


def test_torch_input_and_references():
    import torch
    smiles = ["CC(=O)Nc1ccc(O)cc1", "c1ccc2ccccc2c1"]
    imgs, kept = M.render_smiles(smiles, 256, 256, workers=1, progress=False, use_cache=False)
    r = A.atom_bond_accuracy(torch.from_numpy(imgs), smiles, return_per_image=True)
    assert r["recognised"] == 1.0 and r["exact_match"] is not None
    assert 0.0 <= r["bond_type_agreement"] <= 1.0
    assert [p["reference"] for p in r["per_image"]] == smiles


def test_chemistry_checks_on_known_outputs():
    good = A._chem("c1ccccc1O")
    assert good["recognised"] == 1.0 and good["sanitises"] == 1.0 and good["atom_valence_ok"] == 1.0
    bad = A._chem("CC(C)(C)(C)C")  # pentavalent carbon
    assert bad["recognised"] == 1.0 and bad["sanitises"] == 0.0
    assert bad["atom_valence_ok"] == pytest.approx(5 / 6) and bad["bond_ok"] == 0.0
    assert A._chem("")["recognised"] == 0.0
    row = A._chem("OCC")
    A._compare(row, "CCO")
    assert row["exact_match"] == 1.0 and row["bond_type_agreement"] == 1.0
    row = A._chem("C=CC")
    A._compare(row, "CCC")
    assert row["exact_match"] == 0.0 and row["bond_type_agreement"] == pytest.approx(0.5)


def test_timeout_counted_not_raised():
    imgs, _ = M.render_smiles(["CCO"], 128, 128, workers=1, progress=False, use_cache=False)
    r = A.atom_bond_accuracy(imgs, ["CCO"], timeout=0.001)
    assert r["timeouts"] == 1 and r["recognised"] == 0.0 and r["exact_match"] == 0.0


def test_missing_osra_clear_error(monkeypatch):
    monkeypatch.setattr(A.shutil, "which", lambda name: None)
    with pytest.raises(A.OsraNotFound, match="osra"):
        A.atom_bond_accuracy(np.full((1, 1, 32, 32), 255, np.uint8))


def test_bad_shapes():
    from imggen.errors import ShapeError
    with pytest.raises(ShapeError):
        A.atom_bond_accuracy(np.zeros((2, 3, 32, 32), np.uint8))
    with pytest.raises(ShapeError):
        A.atom_bond_accuracy(np.zeros((2, 1, 32, 32), np.float32))
    with pytest.raises(ShapeError):
        A.atom_bond_accuracy(np.zeros((2, 1, 32, 32), np.uint8), smiles=["C"])


def test_public_api_and_report():
    from imggen import eval as ev
    smiles = ["CCO", "c1ccccc1"]
    imgs, _ = M.render_smiles(smiles, 128, 128, workers=1, progress=False, use_cache=False)
    r = ev.atom_bond_accuracy(imgs, smiles)
    assert {"recognised", "atom_valence_ok", "bond_ok", "exact_match"} <= set(r)
    rep = A.atoms_report(imgs, smiles, 128, 128)
    assert set(rep) == {"generated", "ceiling", "ratio"}
    assert rep["ratio"]["recognised"] in (None, pytest.approx(1.0))  # same images as the ceiling
