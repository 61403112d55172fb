"""BraTS case folders read in worker processes and cached (imggen.datasets.brats_cases, issue 47): a warm
load reads only the cache, a killed load keeps what it cached, a damaged entry is never data, an edited
case is read again, a bad case or a dying worker is one line."""
from __future__ import annotations

import os
import warnings

import numpy as np
import pytest

from imggen.datasets import brats, brats_cases
from imggen.errors import DataError

from test_brats import _bad_root, make_case_2021, make_case_2023

KW = dict(height=16, width=16, inpainting=True)


def _root(tmp_path, n=5, seed=0):
    rng = np.random.default_rng(seed)
    root = tmp_path / "cases"
    for i in range(n):
        make_case_2023(root, f"BraTS-GLI-{i:05d}-000", rng, inpainting=True)
    return root


def _same(a, b):
    for s in ("train", "val", "test"):
        np.testing.assert_array_equal(a.split(s), b.split(s))
        np.testing.assert_array_equal(a.masks[s], b.masks[s])
        assert a.meta["case"][s] == b.meta["case"][s] and a.meta["slice"][s] == b.meta["slice"][s]


def _counting(monkeypatch):
    calls = []
    real = brats._load_case

    def load(case, *a, **k):
        calls.append(case.name)
        return real(case, *a, **k)
    monkeypatch.setattr(brats, "_load_case", load)
    return calls


def _entries(cache):
    return sorted(p for p in cache.rglob("*.npz"))


def test_second_load_reads_only_the_cache_and_equals_the_first(tmp_path, monkeypatch):
    root, cache = _root(tmp_path), tmp_path / "cache"
    cold = brats.load(root, cache_dir=cache, workers=1, **KW)
    assert len(_entries(cache)) == 5
    calls = _counting(monkeypatch)
    warm = brats.load(root, cache_dir=cache, workers=1, **KW)
    assert calls == []
    _same(cold, warm)
    _same(cold, brats.load(root, cache=False, workers=1, **KW))  # the cache changes nothing
    assert calls == [f"BraTS-GLI-{i:05d}-000" for i in range(5)]


def test_another_grid_or_an_edited_case_is_read_again(tmp_path, monkeypatch):
    root, cache = _root(tmp_path), tmp_path / "cache"
    brats.load(root, cache_dir=cache, workers=1, **KW)
    calls = _counting(monkeypatch)
    brats.load(root, cache_dir=cache, workers=1, **{**KW, "height": 12, "width": 12})
    assert len(calls) == 5
    f = next((root / "BraTS-GLI-00002-000").glob("*-t1n.nii.gz"))
    os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 10 ** 9))
    calls.clear()
    brats.load(root, cache_dir=cache, workers=1, **KW)
    assert calls == ["BraTS-GLI-00002-000"]


def test_a_killed_first_load_keeps_what_it_cached(tmp_path, monkeypatch):
    root, cache = _root(tmp_path), tmp_path / "cache"
    real = brats._load_case

    def dies_at_third(case, *a, **k):
        if case.name.startswith("BraTS-GLI-00002"):
            raise KeyboardInterrupt
        return real(case, *a, **k)
    monkeypatch.setattr(brats, "_load_case", dies_at_third)
    with pytest.raises(KeyboardInterrupt):
        brats.load(root, cache_dir=cache, workers=1, **KW)
    assert len(_entries(cache)) == 2 and not list(cache.rglob("*.tmp*"))
    monkeypatch.setattr(brats, "_load_case", real)
    calls = _counting(monkeypatch)
    brats.load(root, cache_dir=cache, workers=1, **KW)
    assert calls == [f"BraTS-GLI-{i:05d}-000" for i in (2, 3, 4)]


@pytest.mark.parametrize("damage", ["truncated", "garbage", "other arrays"])
def test_a_damaged_entry_is_rebuilt_never_read_as_data(tmp_path, capsys, damage):
    root, cache = _root(tmp_path), tmp_path / "cache"
    good = brats.load(root, cache_dir=cache, workers=1, **KW)
    entry = _entries(cache)[0]
    if damage == "truncated":
        entry.write_bytes(entry.read_bytes()[: entry.stat().st_size // 2])
    elif damage == "garbage":
        entry.write_bytes(b"\0" * 4096)
    else:  # a readable archive whose arrays do not fit the recipe
        np.savez(entry, imgs=np.zeros((3, 1, 8, 8), np.uint8), keep=np.arange(3))
    again = brats.load(root, cache_dir=cache, workers=1, **KW)
    _same(good, again)
    err = capsys.readouterr().err
    assert "BraTS case cache" in err and "is damaged" in err and "computing it again" in err
    with np.load(entry) as z:  # rebuilt in place
        assert z["imgs"].shape[2:] == (16, 16)


def test_workers_read_the_same_as_one_process(tmp_path):
    root = _root(tmp_path, n=9, seed=1)
    one = brats.load(root, cache=False, workers=1, **KW)
    many = brats.load(root, cache_dir=tmp_path / "c", workers=2, **KW)  # 9 cases: 2 spawned workers
    _same(one, many)
    _same(one, brats.load(root, cache_dir=tmp_path / "c", workers=2, **KW))


def _bad_many(tmp_path):
    """test_brats's four bad cases among eight good ones (two workers read them)."""
    root = _bad_root(tmp_path)
    rng = np.random.default_rng(2)
    for i in range(4, 8):
        make_case_2021(root, f"ok{i}", rng, mods=("t1",))
    return root


def test_a_bad_case_in_a_worker_is_one_line_and_skip_bad_goes_on(tmp_path):
    root = _bad_many(tmp_path)
    with pytest.raises(DataError, match="truncated|notnifti|missing|empty"):
        brats.load(root, height=16, width=16, cache_dir=tmp_path / "c", workers=2)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        s = brats.load(root, height=16, width=16, cache_dir=tmp_path / "c", workers=2, skip_bad=True)
    assert s.info["skipped"] == 4 and any("skipped 4 bad case" in str(x.message) for x in w)
    assert len(set(sum((s.meta["case"][k] for k in ("train", "val", "test")), []))) == 8


def dies(case, *args):
    """A case reader whose process dies on one case (as a worker killed for memory would)."""
    if case.name == "ok3":
        os._exit(9)
    return brats._load_case(case, *args)


def test_a_worker_that_dies_is_one_error_naming_cases_not_a_hang(tmp_path):
    root = _bad_many(tmp_path)
    cases = sorted(p for p in root.iterdir() if p.name.startswith("ok"))
    recipe = dict(mods=["t1"], height=16, width=16, channels=1, inpainting=False, masks="challenge", seed=0,
                  fills3d=False)
    with pytest.raises(DataError, match="worker process reading BraTS cases died"):
        brats_cases.read_cases(cases, [brats._case_files(c) for c in cases], recipe, dies, workers=2,
                               cache_dir=tmp_path / "c", progress=False)
    done, _ = brats_cases.read_cases(cases, [brats._case_files(c) for c in cases], recipe, brats._load_case,
                                     workers=1, cache_dir=tmp_path / "c", progress=False)
    assert len(done) == 8


def test_resume_may_change_how_the_data_is_read():
    from imggen.checkpoint import config_diff
    from imggen.config import preset

    a, b = preset("brats64"), preset("brats64")
    b.data.workers, b.data.cache = 7, "/somewhere"
    assert config_diff(a, b, "data") == []
    b.data.spec = "brats:/data"
    assert config_diff(a, b, "data") == ["data.spec: checkpoint 'brats-demo' vs requested 'brats:/data'"]


def test_train_cli_reads_cases_into_the_given_cache_and_resume_reads_only_it(tmp_path, monkeypatch):
    from imggen.cli import train_main

    root, cache, out = _root(tmp_path), tmp_path / "cache", tmp_path / "run"
    args = ["--preset", "brats-inpaint", "--data", f"brats:{root}", "--model.layers", "1", "--model.dim", "16",
            "--model.context_width", "8", "--train.eval_images", "2", "--train.grid_time_frac", "0", "--out", str(out),
            "--no-progress", "--device", "cpu", "--threads", "1", "--data.cache", str(cache), "--data.workers", "1"]
    assert train_main(args + ["--steps", "1"]) == 0
    assert len(_entries(cache)) == 5
    calls = _counting(monkeypatch)
    assert train_main(args[:-2] + ["--data.workers", "2", "--steps", "2", "--resume"]) == 0  # another worker count
    assert calls == []
