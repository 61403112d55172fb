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


def test_study_backends_include_flex():
    from imggen.attention import BACKENDS
    study = _study()
    ap = study.build_parser()
    choices = next(a.choices for a in ap._actions if a.dest == "backend")
    assert list(choices) == list(BACKENDS) and "flex" in choices
    if not study.torch.cuda.is_available():
        with pytest.raises(SystemExit, match="--backend flex cannot train on cpu"):
            study.resolve_args(["--quick", "--backend", "flex"])


def test_gpu_smoke_has_help():
    import subprocess
    import sys
    smoke = os.path.join(ROOT, "bench", "gpu", "gpu_smoke.py")
    for args in (["--help"], ["train", "--help"], ["data", "-h"]):
        r = subprocess.run([sys.executable, smoke, *args], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and r.stdout.startswith("usage: gpu_smoke.py"), (args, r.stderr)
    r = subprocess.run([sys.executable, smoke, "train", "res.json"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("gpu_smoke.py: error: train needs '--'")


def _quick_model(kind):
    from imggen.config import ModelConfig
    from imggen.model import ImageTransformer
    q = _study().QUICK
    side = int(q["settings"].removeprefix("brats"))
    return ImageTransformer(ModelConfig(height=side, width=side, channels=1, bits=8, dim=q["dim"], layers=q["layers"],
                                        heads=q["heads"], attention=kind, backend="cpu")).eval()


@pytest.mark.parametrize("kind", PATTERNS)
def test_quick_evict_cache_is_never_larger_than_the_full_cache(kind):
    """study --quick reported bigbird's evict cache above the keep-everything one: at 256 tokens its
    window, sink and random blocks keep 224-256 of 256 positions, and the interval slot plan and
    read plan came on top. An evicting layout that would outweigh the full cache is not used."""
    import torch
    from imggen.decode import make_caches
    from imggen.sampling import teacher_force
    model = _quick_model(kind)
    n = _study().QUICK["sample_num"]
    for evict, full in zip(make_caches(model, n, "evict"), make_caches(model, n, "full")):
        assert evict.capacity <= model.config.seq_len and evict.nbytes() <= full.nbytes(), \
            (kind, evict.capacity, evict.nbytes(), full.nbytes())
    if kind == "bigbird":
        x = torch.randint(0, 256, (1, model.config.seq_len), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            ref = model(x)
        assert (teacher_force(model, x, cache="evict") - ref).abs().max() <= 1e-4


@pytest.mark.parametrize("kind,params", [
    ("band", dict(window=256)), ("local2d", dict(height=4, width=6, channels=3, radius=3, shift=1)),
    ("bigbird", dict(block=8, window_blocks=3, global_blocks=1, random_blocks=2)),
    ("diffuser", dict(window=64, global_tokens=16, random_edges=8, steps=3, block=8)),
    ("full", {}), ("strided", dict(stride=9, shift=1)), ("column", dict(stride=9, shift=1))])
def test_caches_are_capped_at_the_sequence_length(kind, params):
    """Sequences shorter than a pattern's window / neighbourhood: no cache holds more slots than
    positions, and an evicting one (ring, interval) takes no more bytes than keeping everything.
    (Column heads keep every position by design, like the full cache, plus a small read index.)"""
    from imggen.decode import make_cache
    p = imggen_pattern(kind, params)
    for n in (1, 2, 7, 30, 72):
        for batch, heads, d in ((1, 1, 4), (2, 4, 16)):
            evict = make_cache(p, batch, heads, d, n)
            full = make_cache(p, batch, heads, d, n, keep_all=True)
            for c in getattr(evict, "caches", [evict]):
                assert c.capacity <= n and c.k.shape[2] <= n, (kind, n, c.capacity)
            if kind not in ("column", "strided"):
                assert evict.nbytes() <= full.nbytes(), (kind, n, batch, heads, evict.nbytes(), full.nbytes())


def imggen_pattern(kind, params):
    import imggen
    return imggen.make_pattern(kind, **params)
