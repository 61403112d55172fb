"""bench/study.py --quick: every pattern trains, scores finite bits/dim, passes teacher-forcing parity
through the eviction caches, and a second run gives identical bits/dim (also for equal-time rows
replayed from the recorded step counts with --steps-from)."""
import importlib.util
import json
import math
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATTERNS = ["full", "band", "local2d", "strided", "bigbird", "diffuser"]


def _study():
    spec = importlib.util.spec_from_file_location("bench_study", os.path.join(ROOT, "bench", "study.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rows(out):
    with open(os.path.join(out, "study_grids", "study.json")) as f:
        return json.load(f)["rows"]


@pytest.mark.slow
def test_study_quick_is_complete_and_deterministic(tmp_path):
    study = _study()
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    # run 1 measures the equal-time step counts (study_steps.json); run 2 replays them
    assert study.main(["--quick", "--budgets", "steps,time", "--out", a]) == 0
    assert study.main(["--quick", "--budgets", "steps,time", "--out", b,
                       "--steps-from", os.path.join(a, "study_grids", "study_steps.json")]) == 0

    rows_a, rows_b = _rows(a), _rows(b)
    for budget in ("steps", "time"):
        assert sorted(r["pattern"] for r in rows_a if r["budget"] == budget) == sorted(PATTERNS)
    for r in rows_a:
        assert math.isfinite(r["bpd"]) and 0 < r["bpd"] < 8.5, r
        assert r["ci95"][0] <= r["bpd"] <= r["ci95"][1], r
        assert r["parity"] <= 1e-4, r
        assert r["sample_tok_s"] > 0 and r["train_tok_s"] > 0, r
        assert os.path.exists(r["grid"]), r["grid"]
    key = lambda r: (r["setting"], r["pattern"], r["budget"])  # noqa: E731
    assert {key(r): (r["steps"], r["bpd"]) for r in rows_a} == {key(r): (r["steps"], r["bpd"]) for r in rows_b}

    md = open(os.path.join(a, "study.md")).read()
    for p in PATTERNS:
        assert f"| {p} |" in md
    assert "commit at start:" in md and "python bench/study.py --quick" in md
    assert os.listdir(os.path.join(a, "study_grids"))
