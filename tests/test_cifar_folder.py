"""CIFAR-10 pickles and image-folder adapters on tiny synthetic data in the real formats."""
from __future__ import annotations

import hashlib
import pickle
import warnings

import numpy as np
import pytest
from PIL import Image

from imggen.datasets import cifar, folder, load_dataset
from imggen.errors import ConfigError, DataError

PER_BATCH = 20


def write_cifar(root, rng, per_batch=PER_BATCH):
    d = root / "cifar-10-batches-py"
    d.mkdir(parents=True)
    batches = {}
    for name in cifar.TRAIN_FILES + [cifar.TEST_FILE]:
        data = rng.integers(0, 256, size=(per_batch, 3072), dtype=np.uint8)
        labels = rng.integers(0, 10, size=per_batch).tolist()
        batches[name] = (data, labels)
        with open(d / name, "wb") as f:
            pickle.dump({b"batch_label": b"x", b"labels": labels, b"data": data, b"filenames": []}, f, protocol=2)
    with open(d / "batches.meta", "wb") as f:
        pickle.dump({b"label_names": [n.encode() for n in "abcdefghij"]}, f, protocol=2)
    return d, batches


def test_cifar_splits_shapes_labels(tmp_path):
    d, batches = write_cifar(tmp_path, np.random.default_rng(0))
    s = load_dataset(f"cifar:{tmp_path}", height=32, width=32, channels=3, seed=0)  # parent folder works
    n = 5 * PER_BATCH
    assert len(s.val) == 10 and len(s.train) == n - 10 and len(s.test) == PER_BATCH
    assert s.train.dtype == np.uint8 and s.train.shape[1:] == (3, 32, 32)
    data, labels = batches["test_batch"]
    np.testing.assert_array_equal(s.test, data.reshape(-1, 3, 32, 32))
    assert s.meta["labels"]["test"] == labels
    assert s.info["classes"] == list("abcdefghij")
    # train + val is exactly the pool of data batches; labels stay attached to their image
    pool = np.concatenate([batches[f][0] for f in cifar.TRAIN_FILES]).reshape(-1, 3, 32, 32)
    pool_labels = sum((batches[f][1] for f in cifar.TRAIN_FILES), [])
    got = np.concatenate([s.train, s.val])
    assert sorted(map(bytes, got)) == sorted(map(bytes, pool))
    idx = {bytes(x): i for i, x in enumerate(pool)}
    for x, y in zip(s.val, s.meta["labels"]["val"]):
        assert pool_labels[idx[bytes(x)]] == y
    # deterministic, seed-dependent holdout
    s2 = cifar.load(d, seed=0)
    np.testing.assert_array_equal(s.val, s2.val)
    assert not np.array_equal(cifar.load(d, seed=1).val, s.val)


def test_cifar_resize_and_gray(tmp_path):
    d, batches = write_cifar(tmp_path, np.random.default_rng(1))
    s = cifar.load(d, height=16, width=24, channels=1)
    assert s.train.shape[1:] == (1, 16, 24) and s.train.dtype == np.uint8
    with pytest.raises(ConfigError):
        cifar.load(d, channels=4)


def test_cifar_missing_folder_says_how_to_get_it(tmp_path):
    with pytest.raises(DataError, match="cifar-10-python.tar.gz"):
        cifar.load(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"https://www\.cs\.toronto\.edu"):
        cifar.load(tmp_path / "empty")


def test_cifar_bad_pickles(tmp_path):
    d, _ = write_cifar(tmp_path, np.random.default_rng(2))
    with open(d / "data_batch_2", "wb") as f:  # wrong shape
        pickle.dump({b"data": np.zeros((4, 100), np.uint8), b"labels": [0] * 4}, f)
    with pytest.raises(DataError, match="data_batch_2.*shape"):
        cifar.load(d)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        s = cifar.load(d, skip_bad=True)
    assert s.info["skipped"] == 1 and len(w) == 1 and len(s.train) + len(s.val) == 4 * PER_BATCH
    (d / "data_batch_3").write_bytes(b"\x80\x02garbage")  # corrupt pickle
    with pytest.raises(DataError, match="data_batch_3.*not a readable"):
        cifar._read_batch(d / "data_batch_3", verify_md5=False)
    with pytest.warns(UserWarning, match="skipped 2 bad file"):
        assert cifar.load(d, skip_bad=True).info["skipped"] == 2
    # a pickle that would run code is refused, not executed
    with open(d / "data_batch_4", "wb") as f:
        pickle.dump({b"data": print}, f)
    with pytest.raises(DataError, match="data_batch_4.*builtins.print"):
        cifar._read_batch(d / "data_batch_4", verify_md5=False)


def test_cifar_md5(tmp_path, monkeypatch):
    d, _ = write_cifar(tmp_path, np.random.default_rng(3))
    with pytest.raises(DataError, match="MD5"):  # synthetic files differ from the official ones
        cifar.load(d, verify_md5=True)
    real = {f.name: hashlib.md5(f.read_bytes()).hexdigest() for f in d.iterdir()}
    monkeypatch.setattr(cifar, "MD5", real)
    assert len(cifar.load(d, verify_md5=True).test) == PER_BATCH


# ------------------------------------------------------------------ image folders
def write_folder(root, rng):
    (root / "a" / "b").mkdir(parents=True)
    Image.fromarray(rng.integers(0, 256, (40, 60, 3), dtype=np.uint8)).save(root / "a" / "wide.png")
    Image.fromarray(rng.integers(0, 256, (50, 30), dtype=np.uint8)).save(root / "a" / "b" / "tall.jpg")
    Image.fromarray(rng.integers(0, 256, (20, 20, 4), dtype=np.uint8), "RGBA").save(root / "rgba.PNG")
    Image.fromarray(rng.integers(0, 65535, (16, 16), dtype=np.uint16)).save(root / "deep16.png")
    for i in range(4):
        Image.fromarray(rng.integers(0, 256, (33, 33, 3), dtype=np.uint8)).save(root / f"x{i}.jpeg")
    (root / "notes.txt").write_text("ignored")


@pytest.mark.parametrize("channels", [1, 3])
def test_folder_shapes_and_split_determinism(tmp_path, channels):
    write_folder(tmp_path, np.random.default_rng(0))
    s = folder.load(tmp_path, height=12, width=12, channels=channels, seed=3)
    n = len(s.train) + len(s.val) + len(s.test)
    assert n == 8 and len(s.val) >= 1 and len(s.test) >= 1
    assert s.train.dtype == np.uint8 and s.train.shape[1:] == (channels, 12, 12)
    files = sum(s.meta["files"].values(), [])
    assert sorted(files) == sorted(["a/wide.png", "a/b/tall.jpg", "rgba.PNG", "deep16.png"]
                                   + [f"x{i}.jpeg" for i in range(4)])
    s2 = folder.load(tmp_path, height=12, width=12, channels=channels, seed=3)
    assert s.meta == s2.meta and np.array_equal(s.test, s2.test)


def test_folder_centre_crop(tmp_path):
    a = np.zeros((10, 30), np.uint8)
    a[:, 10:20] = 255  # the centre square is white, the sides black
    Image.fromarray(a).save(tmp_path / "w.png")
    s = folder.load(tmp_path, height=10, width=10, channels=1)
    x = np.concatenate([s.train, s.val, s.test])
    assert x.shape == (1, 1, 10, 10) and (x == 255).all()


def test_folder_corrupt_and_empty(tmp_path):
    write_folder(tmp_path, np.random.default_rng(1))
    good = (tmp_path / "x0.jpeg").read_bytes()
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 40)
    (tmp_path / "half.jpeg").write_bytes(good[: len(good) // 3])
    with pytest.raises(DataError, match="broken.png"):
        folder.load(tmp_path, height=8, width=8, channels=3)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        s = folder.load(tmp_path, height=8, width=8, channels=3, skip_bad=True)
    assert s.info["skipped"] == 2 and len(w) == 1
    assert len(s.train) + len(s.val) + len(s.test) == 8
    (tmp_path / "none").mkdir()
    with pytest.raises(DataError, match="no PNG/JPEG"):
        folder.load(tmp_path / "none", height=8, width=8, channels=3)
    with pytest.raises(DataError, match="does not exist"):
        folder.load(tmp_path / "missing", height=8, width=8, channels=3)
