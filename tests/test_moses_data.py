"""--data moses: the MOSES file locator, lazy drawing with its render cache, and training on it."""
import gzip
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from imggen.datasets import lazy, load_dataset, moses
from imggen.datasets import molecules as M
from imggen.errors import DataError

SAMPLE = M.read_smiles(M.SAMPLE)


def _write_gz(path, rows, header="SMILES"):
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt") as f:
        f.write(header + "\n" + "".join(r + "\n" for r in rows))


def fake_site(tmp_path, train=SAMPLE[:300], test=SAMPLE[300:400]):
    """A site-packages folder laid out like the molsets wheel: moses/dataset/data/*.csv.gz."""
    site = tmp_path / "site"
    (site / "moses").mkdir(parents=True)
    (site / "moses" / "__init__.py").write_text("raise ImportError('importing moses needs pandas')\n")
    data = site / "moses" / "dataset" / "data"
    _write_gz(data / "train.csv.gz", train)
    _write_gz(data / "test.csv.gz", test)
    _write_gz(data / "test_scaffolds.csv.gz", test[:10])
    return site, data


def test_locator_finds_fake_layout_without_importing(tmp_path):
    site, data = fake_site(tmp_path)
    assert moses.find_moses_data([site]) == data  # the package's __init__ raises: it was not imported
    assert moses.read_split(data, "train") == SAMPLE[:300]
    assert moses.read_split(data, "test") == SAMPLE[300:400]


def test_locator_via_distribution_metadata(tmp_path):
    site = tmp_path / "site"
    data = site / "moses" / "dataset" / "data"
    _write_gz(data / "train.csv.gz", SAMPLE[:5])
    _write_gz(data / "test.csv.gz", SAMPLE[5:8])
    info = site / "molsets-0.3.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: molsets\nVersion: 0.3.1\n")
    assert moses.find_moses_data([site]) == data


def test_locator_missing_says_how_to_install(tmp_path):
    with pytest.raises(DataError, match=r"pip install --no-deps molsets==0\.3\.1"):
        moses.find_moses_data([tmp_path])
    site = tmp_path / "half"
    (site / "moses" / "dataset" / "data").mkdir(parents=True)
    (site / "moses" / "__init__.py").write_text("")
    with pytest.raises(DataError, match="without train.csv.gz"):
        moses.find_moses_data([site])
    with pytest.raises(DataError, match="expected a folder holding train.csv.gz"):
        moses.data_folder(tmp_path)


def test_bad_moses_file(tmp_path):
    _write_gz(tmp_path / "train.csv.gz", ["CCO"], header="name,value")
    with pytest.raises(DataError, match="not a MOSES file"):
        moses.read_split(tmp_path, "train")
    (tmp_path / "test.csv.gz").write_bytes(b"not gzip")
    with pytest.raises(DataError, match="cannot read the MOSES test file"):
        moses.read_split(tmp_path, "test")


def test_render_cache_second_access_from_disk(tmp_path):
    style = M.style_for(64, 64)
    mols = [s for s in SAMPLE[:20] if M.draw_one(s, style)[0] == M.OK][:6]
    lm = lazy.LazyMolecules(mols, style, cache_dir=tmp_path)
    first = lm[np.arange(6)]
    assert lm.cache.misses == 6 and lm.cache.hits == 0
    fresh = lazy.LazyMolecules(mols, style, cache_dir=tmp_path)  # a new process would see the same files
    second = fresh[np.arange(6)]
    assert fresh.cache.misses == 0 and fresh.cache.hits == 6
    assert second.dtype == np.uint8 and np.array_equal(first, second)
    # the cached pixels are those of a fresh drawing
    assert np.array_equal(first[0, 0], M.draw_one(mols[0], style)[1])
    assert not list(tmp_path.rglob("*.tmp"))  # written atomically: no temp files left
    # a damaged entry is drawn again
    png = next(tmp_path.rglob("*.png"))
    png.write_bytes(b"broken")
    third = lazy.LazyMolecules(mols, style, cache_dir=tmp_path)[np.arange(6)]
    assert np.array_equal(first, third)


def test_threaded_batch_equals_serial(tmp_path):
    style = M.style_for(64, 64)
    idx = np.array([3, 1, 3, 0, 7, 5, 1, 2])  # repeats: two threads may draw and write one molecule at once
    par = lazy.LazyMolecules(SAMPLE[:8], style, cache_dir=tmp_path / "a", workers=4)[idx]
    ser = lazy.LazyMolecules(SAMPLE[:8], style, cache_dir=tmp_path / "b", workers=1)[idx]
    assert np.array_equal(par, ser)
    assert not list((tmp_path / "a").rglob("*.tmp"))


def test_cache_dir_env(tmp_path, monkeypatch):
    monkeypatch.setenv("IMGGEN_CACHE_DIR", str(tmp_path / "c"))
    assert lazy.cache_root() == tmp_path / "c"
    assert M.default_cache_dir() == tmp_path / "c"


def test_lazy_indexing_and_substitution(tmp_path):
    style = M.style_for(64, 64)
    big = "C" * 60  # never fits 64x64 at the fixed bond length
    lm = lazy.LazyMolecules(["CCO", big, "c1ccccc1"], style, cache_dir=tmp_path)
    assert len(lm) == 3 and lm.shape == (3, 1, 64, 64)
    one = lm[0]
    assert one.shape == (1, 64, 64)
    batch = lm[torch.tensor([1, 2])]
    assert np.array_equal(batch[0], batch[1])  # the undrawable molecule is replaced by the next one
    assert lm.smiles_drawn(1) == "c1ccccc1" and lm.stats["substituted"] == 1
    view = lm[1:]
    assert isinstance(view, lazy.LazyMolecules) and len(view) == 2
    assert np.array_equal(np.asarray(view), lm[np.array([1, 2])])  # e.g. eval bpd --split train --limit N
    assert (tmp_path.rglob("*.skip").__next__()).stat().st_size == 0
    with pytest.raises(IndexError):
        lm[np.array([3])]
    with pytest.raises(DataError, match="cannot be drawn"):
        lazy.LazyMolecules([big, "not smiles"], style, cache_dir=tmp_path)[0]


def test_lazy_tokens_equal_eager_tokenize(tmp_path):
    from imggen.tokens import tokenize
    lm = lazy.LazyMolecules(SAMPLE[:5], M.style_for(32, 32), cache_dir=tmp_path)
    tok = lm.tokens(8, (1, 32, 32))
    idx = torch.tensor([4, 0, 2])
    got = tok[idx]
    assert got.dtype == torch.uint8 and got.shape == (3, 1024)
    assert torch.equal(got, tokenize(torch.from_numpy(lm[idx]), 8, shape=(1, 32, 32)).to(torch.uint8))
    assert torch.equal(tok[4], got[0])
    assert len(tok[:2]) == 2 and tok.sample(3).shape == (3, 1024)


def test_load_fake_moses_splits(tmp_path):
    site, data = fake_site(tmp_path)
    s = load_dataset(f"moses:{data}", height=64, width=64, channels=1, cache_dir=tmp_path / "cache",
                     progress=False)
    assert getattr(s.train, "is_lazy", False) and len(s.train) == 300
    assert s.val.shape[1:] == (1, 64, 64) and len(s.val) + len(s.test) <= 100
    assert len(s.meta["smiles"]["val"]) == len(s.val) and len(s.meta["smiles"]["test"]) == len(s.test)
    assert s.meta["smiles"]["train"] == SAMPLE[:300]
    # val / test are the drawings of their SMILES
    st = M.style_for(64, 64)
    assert np.array_equal(s.test[0, 0], M.draw_one(s.meta["smiles"]["test"][0], st)[1])
    with pytest.raises(DataError, match="grayscale"):
        load_dataset(f"moses:{data}", height=64, width=64, channels=3)
    # evaluation on the lazy train split: a --limit of it, as an array
    from imggen.errors import ConfigError
    from imggen.eval.run import split_images
    part = split_images(s, "train", 3)
    assert isinstance(part, np.ndarray) and part.shape == (3, 1, 64, 64)
    with pytest.raises(ConfigError, match="--limit N"):
        split_images(s, "train", None)


def test_molecules_csv_gz(tmp_path):
    p = tmp_path / "mols.csv.gz"
    _write_gz(p, SAMPLE[:20], header="smiles")
    assert M.read_smiles(p) == SAMPLE[:20]
    s = load_dataset(f"molecules:{p}", height=32, width=32, channels=1, cache_dir=tmp_path, progress=False)
    assert len(s.train) + len(s.val) + len(s.test) >= 5


def moses_config(name: str, data, overrides: dict):
    """Preset `name` reading the MOSES folder `data`, with --model/--train/--data overrides."""
    from imggen.config import apply_override, preset
    cfg = preset(name)
    cfg.data.spec = f"moses:{data}"
    for k, v in overrides.items():
        apply_override(cfg, k, str(v))
    return cfg


def test_train_two_steps_on_fake_moses(tmp_path):
    """The training hook: lazy train split, tokenised per batch (tiny model, fake MOSES folder)."""
    from imggen.training import train
    site, data = fake_site(tmp_path)
    cfg = moses_config("moses", data, {"model.layers": 1, "model.dim": 16, "model.heads": 1, "model.height": 32,
                                       "model.width": 32, "train.steps": 2, "train.eval_images": 2,
                                       "train.grid_time_frac": 0})
    os.environ["IMGGEN_CACHE_DIR"] = str(tmp_path / "cache")
    try:
        m = train(cfg, str(tmp_path / "run"), progress=False, device="cpu")
    finally:
        del os.environ["IMGGEN_CACHE_DIR"]
    assert m["steps"] == 2 and np.isfinite(m["test_bpd"]) and np.isfinite(m["unigram_bpd"])
    assert list((tmp_path / "cache").rglob("*.png"))  # training drew (and cached) train molecules


@pytest.mark.slow
def test_train_moses_steps2_cold_cache(tmp_path):
    """python train.py --preset moses --data moses --steps 2 from a cold render cache (< 2 min)."""
    pytest.importorskip("rdkit")
    try:
        moses.find_moses_data()
    except DataError:
        pytest.skip("MOSES data files not installed (pip install --no-deps molsets==0.3.1)")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "IMGGEN_CACHE_DIR": str(tmp_path / "cache")}
    t0 = time.time()
    r = subprocess.run([sys.executable, os.path.join(root, "train.py"), "--preset", "moses", "--data", "moses",
                        "--steps", "2", "--out", str(tmp_path / "x"), "--no-progress"],
                       capture_output=True, text=True, env=env, timeout=600)
    took = time.time() - t0
    assert r.returncode == 0, r.stderr[-2000:]
    assert "1584663 train" in r.stdout
    assert took < 120, f"took {took:.0f} s"


def test_train_cli_without_moses_is_one_line(tmp_path, monkeypatch, capsys):
    """train.py --data moses with the files absent: one line naming the install command, exit 2."""
    from imggen.cli import train_main
    real = moses.find_moses_data
    monkeypatch.setattr(moses, "find_moses_data", lambda search_path=None: real([tmp_path]))
    rc = train_main(["--preset", "moses", "--data", "moses", "--steps", "1", "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "pip install --no-deps molsets==0.3.1" in err[0], err
