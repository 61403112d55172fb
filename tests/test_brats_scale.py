"""bench/brats_scale.py: generated challenge-format cases (layout, holes, determinism, resumable) and the
first/second-load benchmark on a few small ones (issue 47)."""
from __future__ import annotations

import json
import os
import sys

import nibabel as nib
import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

import brats_scale  # noqa: E402

from imggen.datasets import brats  # noqa: E402


def _template(shape=(40, 44, 24)):
    v = np.zeros(shape, np.float32)
    yy, xx, zz = np.mgrid[:shape[0], :shape[1], :shape[2]]
    ball = ((yy - 20) / 15) ** 2 + ((xx - 22) / 17) ** 2 + ((zz - 12) / 9) ** 2 <= 1
    v[ball] = 100 + 50 * np.sin(yy[ball] / 3.0)
    return v


def _read(case, suffix):
    return np.asarray(nib.load(str(case / f"{case.name}-{suffix}.nii.gz")).dataobj)


def test_cases_are_challenge_layout_deterministic_and_resumable(tmp_path):
    t = _template()
    cases = brats_scale.make_cases(tmp_path / "a", 3, seed=1, template=t, workers=1, progress=False)
    assert [c.name for c in cases] == [f"BraTS-GLI-{i:05d}-000" for i in range(3)]
    for c in cases:
        assert sorted(f.name for f in c.iterdir()) == [f"{c.name}-{s}.nii.gz" for s in
                                                       ("mask-healthy", "mask-unhealthy", "t1n")]
        t1, h, u = _read(c, "t1n"), _read(c, "mask-healthy") > 0, _read(c, "mask-unhealthy") > 0
        assert t1.shape == t.shape and t1.dtype == np.float32 and h.any() and u.any() and not (h & u).any()
        assert (t1[h] > 0).all() and (t1[u] > 0).all()  # both holes in the brain
    a, b = _read(cases[0], "t1n"), _read(cases[1], "t1n")
    assert not np.array_equal(a, b)  # each case its own warp and scale
    again = brats_scale.make_cases(tmp_path / "b", 1, seed=1, template=t, workers=1, progress=False)
    np.testing.assert_array_equal(_read(again[0], "t1n"), a)
    before = os.path.getmtime(cases[0] / f"{cases[0].name}-t1n.nii.gz")
    brats_scale.make_cases(tmp_path / "a", 3, seed=1, template=t, workers=1, progress=False)
    assert os.path.getmtime(cases[0] / f"{cases[0].name}-t1n.nii.gz") == before  # kept, not rewritten
    i16 = brats_scale.make_case(tmp_path / "c", 0, t, seed=1, dtype="int16")
    assert _read(i16, "t1n").dtype == np.int16


def test_generated_cases_load_with_their_holes_and_the_tumour_void(tmp_path):
    cases = brats_scale.make_cases(tmp_path / "a", 3, template=_template(), workers=1, progress=False)
    s = brats.load(tmp_path / "a", height=16, width=16, inpainting=True, cache=False, workers=1)
    masks = np.concatenate([s.masks[k] for k in ("train", "val", "test")])
    assert masks.any() and sum(len(s.split(k)) for k in ("train", "val", "test")) > 0
    assert len(cases) == 3


def test_tree_rss_counts_a_child():
    import subprocess
    p = subprocess.Popen([sys.executable, "-c", "import time; x = bytearray(200 << 20); time.sleep(3)"])
    import time
    time.sleep(1.5)
    try:
        assert brats_scale.tree_rss(os.getpid()) >= 200 << 20
    finally:
        p.wait()


def test_load_benchmark_first_and_second(tmp_path):
    brats_scale.make_cases(tmp_path / "data", 3, template=_template(), workers=1, progress=False)
    out, work = tmp_path / "out", tmp_path / "work"
    brats_scale.main(["load", "--data", str(tmp_path / "data"), "--cases", "3", "--work", str(work),
                      "--out", str(out), "--workers", "1"])
    d = json.loads((out / "brats_scale.json").read_text())
    assert [(r["cases"], r["load"]) for r in d["runs"]] == [(3, "first (cold cache)"), (3, "second (warm cache)")]
    assert all(r["wall_s"] > 0 and r["peak_rss_gb"] > 0.05 and r["cpu_s"] > 0.1 for r in d["runs"])
    assert all(abs(r["cores_busy"] - r["cpu_s"] / r["wall_s"]) < 1e-9 for r in d["runs"])
    assert len(list((work / "cache3").rglob("*.npz"))) == 3 and len(os.listdir(work / "cases3")) == 3
    assert "extrapolated (16 cores)" in (out / "brats_scale.md").read_text()


def test_timed_counts_the_cpu_of_a_busy_child(tmp_path):
    with open(tmp_path / "log", "w") as log:
        r = brats_scale.timed([sys.executable, "-c", "import time\nt = time.process_time()\n"
                               "while time.process_time() - t < 1.0: pass"], log)
    # the child's second of CPU is counted; its share of a core is that over the wall time (how much of a
    # core a busy box leaves it is not this test's business), and one thread is at most one core
    assert r["cpu_s"] >= 0.9 and r["wall_s"] >= 0.8 * r["cpu_s"]
    assert r["cores_busy"] == pytest.approx(r["cpu_s"] / r["wall_s"]) and r["cores_busy"] <= 1.2
