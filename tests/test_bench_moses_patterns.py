"""bench/moses_patterns.py: the equal-time table from scored runs (no training here)."""
import os
import sys
from types import SimpleNamespace

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

import moses_patterns as mp  # noqa: E402


def _row(attention, valid, ab, bpd):
    per = [{"valid": bool(v), "atom_bond_accuracy": float(x)} for v, x in zip(valid, ab)]
    res = {"validity": float(np.mean(valid)), "atom_bond_accuracy": float(np.mean(ab)), "recognised": 0.5,
           "unique": 1.0, "novelty": 1.0, "per_image": per,
           "intervals": {"validity": [0.0, 0.5], "atom_bond_accuracy": [0.1, 0.2]}}
    return {"attention": attention, "steps": 10, "train_s": 60.0, "test_bpd": float(np.mean(bpd)),
            "bpd_ci": [0.9, 1.1], "bpd_per_image": list(bpd), "res": res}


def test_diff_interval_of_constant_samples_is_the_difference():
    lo, hi = mp.diff_interval(np.full(10, 0.75), np.full(7, 0.25))
    assert lo == pytest.approx(0.5) and hi == pytest.approx(0.5)


def test_report_pairs_bits_per_dim_and_compares_with_full():
    full = _row("full", [0, 0, 0, 0], [0, 0, 0, 0], [2.0, 2.0, 3.0, 3.0])
    band = _row("band", [1, 0, 0, 0], [1, 0, 0, 0], [1.5, 1.5, 2.5, 2.5])  # every image 0.5 lower: paired
    a = SimpleNamespace(minutes=1.0, reps=1, threads=1, num=4)
    md = mp.report([full, band], a, {"full": 2.0, "band": 1.0}, 60.0,
                    {"cpu": "x", "cpus": 2, "torch": "2", "threads": 1, "commit": "abc"}, [])
    band_line = next(line for line in md.splitlines() if line.startswith("| band"))
    assert "-0.500 (-0.500 to -0.500)" in band_line  # bits/dim - full, paired per image
    assert "+0.250" in band_line  # validity - full
    assert "0.250 (0.000-0.500)" in band_line  # validity with its interval
