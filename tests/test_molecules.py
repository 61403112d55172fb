"""Molecule adapter: SMILES readers, fixed-scale drawing, skipping, caching, splits."""
import time
import warnings

import numpy as np
import pytest

from imggen.datasets import load_dataset
from imggen.datasets import molecules as M
from imggen.errors import DataError

SMILES = ["CCO", "c1ccccc1", "CC(=O)Nc1ccc(O)cc1", "CN1CCC[C@H]1c1cccnc1", "O=C(O)c1ccccc1O",
          "CC(C)Cc1ccc(C(C)C(=O)O)cc1", "Clc1ccc(Cl)cc1", "CCN(CC)CC", "C1CCNCC1", "OCC(O)CO"]
BIG = "C" * 60  # a long chain: never fits 64x64 at the fixed bond length


def test_read_csv_both_spellings(tmp_path):
    for col in ("smiles", "SMILES"):
        p = tmp_path / f"{col}.csv"
        p.write_text(f"id,{col}\n" + "".join(f"{i},{s}\n" for i, s in enumerate(SMILES[:3])))
        assert M.read_smiles(p) == SMILES[:3]


def test_read_csv_zinc_layout_trailing_newlines(tmp_path):
    p = tmp_path / "zinc.csv"
    p.write_text('smiles,logP,qed,SAS\n' + "".join(f'"{s}\n",1.0,0.5,2.0\n' for s in SMILES[:4]))
    assert M.read_smiles(p) == SMILES[:4]


def test_read_csv_moses_layout(tmp_path):
    p = tmp_path / "moses.csv"
    p.write_text("SMILES,SPLIT\n" + "".join(f"{s},train\n" for s in SMILES[:5]))
    assert M.read_smiles(p) == SMILES[:5]


def test_read_smi_with_header_and_names(tmp_path):
    p = tmp_path / "mols.smi"
    p.write_text("SMILES Name\n" + "".join(f"{s} mol{i}\n" for i, s in enumerate(SMILES[:4])) + "\n")
    assert M.read_smiles(p) == SMILES[:4]


def test_read_sdf(tmp_path):
    from rdkit import Chem
    p = tmp_path / "mols.sdf"
    w = Chem.SDWriter(str(p))
    for s in SMILES[:3]:
        w.write(Chem.MolFromSmiles(s))
    w.close()
    got = M.read_smiles(p)
    assert got == [Chem.MolToSmiles(Chem.MolFromSmiles(s)) for s in SMILES[:3]]


@pytest.mark.parametrize("name,text", [("empty.csv", ""), ("empty.smi", ""), ("nocol.csv", "a,b\n1,2\n"),
                                       ("header_only.csv", "smiles\n")])
def test_bad_files_raise_data_error_naming_file(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    with pytest.raises(DataError, match=name):
        M.read_smiles(p)


def test_missing_and_unknown_and_unreadable(tmp_path):
    with pytest.raises(DataError, match="nope.csv"):
        M.read_smiles(tmp_path / "nope.csv")
    (tmp_path / "x.txt").write_text("CCO\n")
    with pytest.raises(DataError, match="x.txt"):
        M.read_smiles(tmp_path / "x.txt")
    (tmp_path / "bin.csv").write_bytes(b"smiles\n\xff\xfe\x00\x81\n")
    with pytest.raises(DataError, match="bin.csv"):
        M.read_smiles(tmp_path / "bin.csv")


def test_render_shapes_dtype_background(tmp_path):
    imgs, kept = M.render_smiles(SMILES, 64, 64, workers=1, cache_dir=tmp_path, progress=False)
    assert imgs.dtype == np.uint8 and imgs.shape == (len(SMILES), 1, 64, 64)
    assert list(kept) == list(range(len(SMILES)))
    for im in imgs[:, 0]:
        assert im.min() < 100 and np.median(im) == 255          # dark drawing on white
        assert min(im[0].min(), im[-1].min(), im[:, 0].min(), im[:, -1].min()) >= 250  # white border


def test_fixed_scale_same_bond_length(tmp_path):
    """Ethane and propane share the drawing scale: the C-C line has the same length."""
    imgs, _ = M.render_smiles(["CC", "CCC#CC"], 128, 128, workers=1, cache_dir=tmp_path, progress=False)
    ink = (imgs[:, 0] < 128).sum(axis=(1, 2))
    assert ink[1] > 2 * ink[0]  # a longer molecule draws proportionally more ink, not rescaled


def test_invalid_and_too_large_skipped_one_clean_line(tmp_path, capfd):
    smiles = SMILES[:4] + ["not_a_smiles", "C1CC", BIG, ""]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # reported on stderr, not as a Python warning
        imgs, kept = M.render_smiles(smiles, 64, 64, workers=1, cache_dir=tmp_path, progress=False)
    assert list(kept) == [0, 1, 2, 3] and len(imgs) == 4
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err  # one line: no source line, no traceback-style context
    msg = lines[0]
    assert msg.startswith("molecules: kept 4 of 8; skipped 3 invalid SMILES; 1 (12%) too large")
    assert "never shrunk" in msg and "would not fit 64x64" in msg and "--preset mol128" in msg
    assert "render_smiles" not in err and "warn" not in err.lower()
    M.render_smiles(smiles[:4], 64, 64, workers=1, cache_dir=tmp_path, progress=False)
    M.render_smiles(smiles, 64, 64, workers=1, cache_dir=tmp_path, progress=False, report=False)
    assert capfd.readouterr().err == ""  # nothing skipped / report=False: silent


def test_shipped_sample_skip_message_explains_why(tmp_path, capfd):
    M.load(None, height=32, width=32, limit=200, cache_dir=tmp_path, workers=1, progress=False)
    err = capfd.readouterr().err.strip()
    assert "\n" not in err and err.startswith("molecules: kept ") and " of 200 from moses_sample.csv" in err
    assert "too large: every molecule is drawn at one bond length (3 px, style demo) and never shrunk" in err
    assert "--preset mol128 (128x128) keeps more" in err


def test_parallel_matches_serial_and_cache_hit(tmp_path):
    smiles = SMILES * 12
    t0 = time.perf_counter()
    a, ka = M.render_smiles(smiles, 64, 64, workers=2, cache_dir=tmp_path / "c", progress=False)
    t1 = time.perf_counter()
    b, kb = M.render_smiles(smiles, 64, 64, workers=2, cache_dir=tmp_path / "c", progress=False)
    t2 = time.perf_counter()
    c, kc = M.render_smiles(smiles, 64, 64, workers=1, cache_dir=tmp_path / "d", progress=False)
    assert np.array_equal(a, b) and np.array_equal(a, c) and np.array_equal(ka, kc)
    assert len(list((tmp_path / "c").glob("molecules-*.npz"))) == 1
    assert t2 - t1 < (t1 - t0)  # cached: no drawing


def test_cache_dir_from_env(tmp_path, monkeypatch):
    monkeypatch.setenv("IMGGEN_CACHE", str(tmp_path / "envcache"))
    M.render_smiles(SMILES[:2], 32, 32, workers=1, progress=False)
    assert list((tmp_path / "envcache").glob("molecules-*.npz"))


def test_style_for_named_and_scaled():
    assert M.style_for(32, 32).name == "demo"
    assert M.style_for(128, 128).name == "mol128" and M.style_for(256, 256).name == "mol256"
    s = M.style_for(96, 64)
    assert (s.height, s.width) == (96, 64) and s.bond_length > 0
    with pytest.raises(DataError):
        M.style_for(8, 8)


def test_load_splits_meta_deterministic(tmp_path, capfd):
    p = tmp_path / "m.csv"
    p.write_text("SMILES,SPLIT\n" + "".join(f"{s},train\n" for s in SMILES + ["bad(", BIG]))
    kw = dict(height=64, width=64, channels=1, cache_dir=tmp_path / "c", workers=1, progress=False)
    a = M.load(p, seed=3, **kw)
    assert "skipped 1 invalid SMILES; 1 (8%) too large" in capfd.readouterr().err
    b = M.load(p, seed=3, **kw)
    assert a.info["read"] == 12 and a.info["invalid"] == 1 and a.info["too_large"] == 1
    assert a.info["kept"] == 10
    total = sum(len(a.split(k)) for k in ("train", "val", "test"))
    assert total == 10 and len(a.val) >= 1 and len(a.test) >= 1
    for k in ("train", "val", "test"):
        assert np.array_equal(a.split(k), b.split(k)) and a.meta["smiles"][k] == b.meta["smiles"][k]
        assert len(a.meta["smiles"][k]) == len(a.split(k))
    # each image is the drawing of its SMILES
    s0 = a.meta["smiles"]["test"][0]
    ref, _ = M.render_smiles([s0], 64, 64, workers=1, cache_dir=tmp_path / "c", progress=False)
    assert np.array_equal(ref[0], a.test[0])
    c = M.load(p, seed=4, **kw)
    assert any(a.meta["smiles"][k] != c.meta["smiles"][k] for k in ("train", "val", "test"))


def test_load_channels_and_all_bad(tmp_path):
    p = tmp_path / "m.smi"
    p.write_text("xx(\nyy)\n")
    with pytest.raises(DataError, match="channels"):
        M.load(p, height=32, width=32, channels=3, cache_dir=tmp_path)
    with pytest.raises(DataError, match="m.smi"):
        M.load(p, height=32, width=32, channels=1, cache_dir=tmp_path, progress=False)


def test_shipped_sample_via_registry(tmp_path):
    smiles = M.read_smiles(M.SAMPLE)
    assert 4000 <= len(smiles) <= 5000 and M.SAMPLE.stat().st_size < 400_000
    assert (M.DATA_DIR / "MOSES_LICENSE.txt").is_file()
    s = load_dataset("molecules", height=32, width=32, channels=1, limit=300,
                     cache_dir=tmp_path, workers=2, progress=False)
    assert s.train.shape[1:] == (1, 32, 32) and s.info["read"] == 300
    assert s.info["kept"] + s.info["too_large"] + s.info["invalid"] == 300
    assert s.info["kept"] > 100  # the demo style keeps a usable share of MOSES molecules
    assert "MIT" in s.info["licence"]


def _record_bars(monkeypatch) -> list:
    """(desc, disable) of every tqdm bar created from now on."""
    import tqdm
    seen, orig = [], tqdm.tqdm

    class Recording(orig):
        def __init__(self, *a, **k):
            seen.append((k.get("desc"), k.get("disable")))
            super().__init__(*a, **k)
    monkeypatch.setattr(tqdm, "tqdm", Recording)
    return seen


@pytest.mark.parametrize("flags, disabled", [(["--no-progress"], True), ([], False)])
def test_train_no_progress_reaches_the_molecule_drawing_bar(tmp_path, monkeypatch, flags, disabled):
    """train.py --no-progress used to leave the 'drawing molecules' bar of the data loading on."""
    import imggen.training
    from imggen.cli import train_main

    p = tmp_path / "m.csv"
    p.write_text("smiles\n" + "".join(f"{s}\n" for s in SMILES * 3))
    monkeypatch.setenv("IMGGEN_CACHE", str(tmp_path / "cache"))  # empty cache: the molecules are drawn
    seen = _record_bars(monkeypatch)

    class Loaded(Exception):
        pass

    def stop(*a, **k):  # training builds its logger right after the data loads: stop there
        raise Loaded
    monkeypatch.setattr(imggen.training, "Logger", stop)
    with pytest.raises(Loaded):
        train_main(["--preset", "demo", "--data", f"molecules:{p}", "--out", str(tmp_path / "run"),
                    "--threads", "1", *flags])
    bars = [d for desc, d in seen if desc and desc.startswith("drawing molecules")]
    assert bars == [disabled]
