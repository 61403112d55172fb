"""Fashion-MNIST / MNIST idx files (imggen.datasets.idx) on small files the tests write in the real
format: splits, labels, gz or not, and every bad file as one line (exit 2 from train.py, no run folder)."""
from __future__ import annotations

import gzip
import os

import numpy as np
import pytest

from imggen.cli import train_main
from imggen.datasets import idx, load_dataset, parse_spec
from imggen.errors import DataError


def _idx_bytes(a: np.ndarray, magic: int) -> bytes:
    return magic.to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in a.shape) + a.astype(np.uint8).tobytes()


def write_idx(folder, rng, n_train=40, n_test=12, gz=True, size=28):
    """The four files of a tiny Fashion-MNIST / MNIST release; returns the arrays written."""
    folder.mkdir(parents=True, exist_ok=True)
    arrays = {}
    for split, n in (("train", n_train), ("test", n_test)):
        x = rng.integers(0, 256, (n, size, size), dtype=np.uint8)
        y = rng.integers(0, 10, n, dtype=np.uint8)
        arrays[split] = (x, y)
        for name, a, magic in zip(idx.FILES[split], (x, y), (idx.MAGIC_IMAGES, idx.MAGIC_LABELS)):
            raw = _idx_bytes(a, magic)
            if gz:
                with gzip.open(folder / (name + ".gz"), "wb") as f:
                    f.write(raw)
            else:
                (folder / name).write_bytes(raw)
    return arrays


@pytest.mark.parametrize("gz", [True, False])
@pytest.mark.parametrize("kind", ["fashion-mnist", "mnist"])
def test_splits_labels_native_size(tmp_path, gz, kind):
    arrays = write_idx(tmp_path / "d", np.random.default_rng(0), gz=gz)
    s = load_dataset(f"{kind}:{tmp_path / 'd'}", height=28, width=28, channels=1, seed=3)
    assert s.train.shape == (36, 1, 28, 28) and s.val.shape == (4, 1, 28, 28) and s.test.shape == (12, 1, 28, 28)
    assert s.train.dtype == np.uint8 and s.train.flags.writeable
    x, y = arrays["test"]
    np.testing.assert_array_equal(s.test[:, 0], x)  # test = the official test files, in order
    assert s.meta["labels"]["test"] == y.tolist()
    pool_x, pool_y = arrays["train"]
    lookup = {bytes(a): int(b) for a, b in zip(pool_x, pool_y)}
    got = np.concatenate([s.train, s.val])[:, 0]
    assert sorted(map(bytes, got)) == sorted(map(bytes, pool_x))  # train + val = the training files
    for split in ("train", "val"):
        assert [lookup[bytes(a)] for a in s.split(split)[:, 0]] == s.meta["labels"][split]
    assert s.info["classes"] == idx.CLASSES[kind]
    # val does not move with the seed: runs of any seed are scored on the same images
    np.testing.assert_array_equal(idx.load(tmp_path / "d", seed=7, kind=kind).val, s.val)


def test_resize_and_rgb(tmp_path):
    write_idx(tmp_path, np.random.default_rng(1))
    s = idx.load(tmp_path, height=32, width=32, channels=3)
    assert s.train.shape[1:] == (3, 32, 32)
    np.testing.assert_array_equal(s.train[:, 0], s.train[:, 2])


def test_default_folder_is_debians(monkeypatch, tmp_path):
    assert parse_spec("fashion-mnist") == ("fashion-mnist", None)
    with pytest.raises(DataError, match="needs a path"):
        parse_spec("mnist")
    monkeypatch.setattr(idx, "DEBIAN_DIR", str(tmp_path / "absent"))
    with pytest.raises(DataError) as e:
        load_dataset("fashion-mnist", height=28, width=28, channels=1)
    msg = str(e.value)
    assert "apt-get install dataset-fashion-mnist" in msg and "\n" not in msg
    assert all(name in msg for pair in idx.FILES.values() for name in pair)


def _corrupt(folder, how):
    name = folder / (idx.FILES["train"][0] + ".gz")
    raw = gzip.decompress(name.read_bytes())
    if how == "truncated-gz":
        name.write_bytes(name.read_bytes()[:-200])
    elif how == "not-gzip":
        name.write_bytes(b"this is not a gzip file at all")
    elif how == "truncated-data":
        name.write_bytes(gzip.compress(raw[:-100]))
    elif how == "magic":
        name.write_bytes(gzip.compress((2049).to_bytes(4, "big") + raw[4:]))
    elif how == "header":
        name.write_bytes(gzip.compress(raw[:10]))
    elif how == "counts":
        lab = folder / (idx.FILES["train"][1] + ".gz")
        y = gzip.decompress(lab.read_bytes())[8:]
        lab.write_bytes(gzip.compress(_idx_bytes(np.frombuffer(y[:-3], np.uint8), idx.MAGIC_LABELS)))
    elif how == "missing":
        name.unlink()
    return name


BAD = {"truncated-gz": "truncated or corrupt", "not-gzip": "cannot be read", "truncated-data": "promises",
       "magic": "magic number 2049, expected 2051", "header": "too short", "counts": "40 images but",
       "missing": "has no train-images-idx3-ubyte"}


@pytest.mark.parametrize("how", list(BAD))
def test_bad_file_is_one_line(tmp_path, how):
    write_idx(tmp_path, np.random.default_rng(2))
    _corrupt(tmp_path, how)
    with pytest.raises(DataError) as e:
        idx.load(tmp_path, kind="mnist")
    assert BAD[how] in str(e.value) and "\n" not in str(e.value) and str(tmp_path) in str(e.value)


@pytest.mark.parametrize("how", ["truncated-gz", "magic", "counts"])
def test_train_cli_bad_file_exit_2_writes_nothing(tmp_path, capsys, how):
    write_idx(tmp_path / "d", np.random.default_rng(3))
    _corrupt(tmp_path / "d", how)
    out = tmp_path / "run"
    rc = train_main(["--preset", "fashion", "--data", f"fashion-mnist:{tmp_path / 'd'}", "--steps", "1",
                     "--out", str(out), "--no-progress", "--device", "cpu"])
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line]
    assert rc == 2 and len(err) == 1 and BAD[how] in err[0], err
    assert not out.exists()


def test_fashion_preset_trains_on_idx_files(tmp_path):
    write_idx(tmp_path / "d", np.random.default_rng(4), n_train=24, n_test=4)
    out = tmp_path / "run"
    rc = train_main(["--preset", "fashion", "--data", f"fashion-mnist:{tmp_path / 'd'}", "--steps", "2",
                     "--model.layers", "2", "--model.dim", "32", "--train.eval_images", "2", "--train.grid_time_frac", "0",
                     "--out", str(out), "--no-progress", "--device", "cpu", "--threads", "1"])
    assert rc == 0 and os.path.exists(out / "metrics.json")
