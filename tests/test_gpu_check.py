"""bench/gpu/gpu_check.sh + bench/gpu/gpu_bench.py: the CPU dry run end to end (the same units as on an H200
at tiny sizes: JSON/MD writing, PASS/FAIL logic, exception capture, training smoke), the no-CUDA
exit, and the pieces the GPU run trusts (fp32 references with exact gradients, pair counts, kernel
classification, train-log parsing, target gating)."""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import imggen
from imggen.attention import reference_attention

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench" / "gpu"), str(ROOT / "bench")]
import gpu_readouts as gro  # noqa: E402
import gpu_reference as gr  # noqa: E402
import gpu_targets as gt  # noqa: E402
import harness  # noqa: E402

INJECT = "grid/band-w32-n64/ours+sdpa"  # a grid unit that the dry run makes raise (--inject-failure)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    env = dict(os.environ, OUT=str(out))
    env.pop("IMGGEN_BACKEND", None)
    t = time.time()
    r = subprocess.run(["bash", "bench/gpu/gpu_check.sh", "--dry-run", "--inject-failure", INJECT], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=400)
    return r, out, time.time() - t


@pytest.mark.slow
def test_dry_run_writes_everything(dry_run):
    r, out, took = dry_run
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    for name in ("gpu_check.json", "gpu_check.md", "gpu_check.log", "smoke.log", "samples.png"):
        assert (out / name).is_file(), name
    res = json.loads((out / "gpu_check.json").read_text())
    assert res["meta"]["dry_run"] is True
    log = (out / "gpu_check.log").read_text()
    assert "gpu_check.sh: exit 0" in log and "[" in log and "s] >> decisive/" in log  # timestamped progress
    # well under a minute on a quiet 2-core machine (generous bound: CI machines may be busy)
    assert took < 150, f"dry run took {took:.0f} s"


@pytest.mark.slow
def test_dry_run_rows_and_targets(dry_run):
    _, out, _ = dry_run
    res = json.loads((out / "gpu_check.json").read_text())
    rows = res["rows"]
    band_row = next(x for x in rows.values() if x["decisive"] and x["kind"] == "band")
    diff_row = next(x for x in rows.values() if x["decisive"] and x["kind"] == "diffuser")
    for row in (band_row, diff_row):
        assert not row.get("errors"), row.get("errors")
        assert row["ours"]["fb_ms"] > 0 and row["sdpa"]["fb_ms"] > 0
        assert row["correct"]["ours_vs_ref"]["ok"], row["correct"]
        assert row["pairs_total"] > 0
    assert band_row["flex"]["fwd_ms"] > 0 and band_row["correct"]["ours_vs_flex"]["ok"]
    assert "x_flex_fwd" in band_row and "x_sdpa_fb" in band_row and band_row["ours"]["fb_TF"] > 0
    assert diff_row["diff_over_one"] > 0 and diff_row["correct"]["one_vs_ref"]["ok"]
    for d in res["decode"].values():
        assert d["GBps"] > 0 and d["correct"]["ok"], d
    for pr in res["profile"].values():
        assert pr["categories"], pr
    sm = res["smoke"]
    for key in ("train_cpu", "train_reference"):
        assert sm[key]["rc"] == 0 and sm[key]["steps_logged"] == 2 and sm[key]["step1_bpd"] > 0, sm[key]
    assert sm["same_loss_step1"]["ok"], sm["same_loss_step1"]
    assert sm["sample"]["rc"] == 0 and sm["sample"]["png"]
    assert res["selfcheck"] and all("ok" in s for s in res["selfcheck"].values())
    verdicts = {t["target"]: t["verdict"] for t in res["targets"]}
    assert len(verdicts) == 5 and all(v in ("PASS", "FAIL") for v in verdicts.values()), verdicts
    md = (out / "gpu_check.md").read_text()
    assert md.index("Targets:") < md.index("## Sparse attention") < md.index("## Decode") < md.index("## Timeline")
    assert "DRY RUN" in md and "## Training smoke" in md and "## Kernel breakdown" in md


@pytest.mark.slow
def test_dry_run_exception_is_captured(dry_run):
    _, out, _ = dry_run
    res = json.loads((out / "gpu_check.json").read_text())
    assert [e["unit"] for e in res["errors"]] == [INJECT], res["errors"]
    row = res["rows"]["band-w32-n64"]
    assert any("injected failure" in e for e in row["errors"])
    units = [t["unit"] for t in res["timeline"]]
    i = units.index(INJECT)
    assert res["timeline"][i]["status"].startswith("FAIL: RuntimeError: injected failure")
    after = res["timeline"][i + 1:]
    assert after and all(t["status"] == "ok" or t["status"].startswith("not run") for t in after)
    assert "grid/band-w32-n64/flex" in units[i + 1:]  # the same row's next unit still ran
    assert "injected failure" in (out / "gpu_check.md").read_text()


@pytest.mark.skipif(torch.cuda.is_available() or shutil.which("nvidia-smi") is not None,
                    reason="a CUDA machine would start the real check")
def test_without_cuda_exits_at_once_with_one_line(tmp_path):
    t = time.time()
    r = subprocess.run(["bash", "bench/gpu/gpu_check.sh"], cwd=ROOT, env=dict(os.environ, OUT=str(tmp_path / "o")),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and time.time() - t < 5
    lines = (r.stdout + r.stderr).strip().splitlines()
    assert len(lines) == 1 and "no CUDA GPU" in lines[0] and "--dry-run" in lines[0]
    r = subprocess.run([sys.executable, "bench/gpu/gpu_bench.py"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    lines = (r.stdout + r.stderr).strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "no CUDA GPU" in lines[0]


@pytest.mark.slow
def test_tile_sweep_dry_run(tmp_path):
    """bench/gpu/gpu_tune.py end to end on one row: every forced tile is timed and agrees with the
    launcher's own result (fp32 under the interpreter: rounding-level differences only)."""
    r = subprocess.run([sys.executable, "bench/gpu/gpu_tune.py", "--dry-run", "--rows", "0"], cwd=ROOT,
                       env=dict(os.environ, OUT=str(tmp_path)), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (rec,) = json.loads((tmp_path / "gpu_tune.json").read_text())
    kernels = {x["kernel"] for x in rec["results"]}
    assert kernels == {"fwd", "dq", "dkdv"} and all("error" not in x for x in rec["results"]), rec["results"]
    assert all(x["ms"] > 0 and x["rel"] < 1e-5 for x in rec["results"])
    assert "| fwd |" in (tmp_path / "gpu_tune.md").read_text()


# ------------------------------------------------------------------------ pieces the GPU run trusts
PATTERNS = [
    ("band", {"window": 7}),
    ("local2d", {"height": 5, "width": 8, "channels": 1, "radius": 2}),
    ("bigbird", {"block": 8, "window_blocks": 2, "global_blocks": 1, "random_blocks": 1}),
    ("diffuser", {"window": 6, "global_tokens": 3, "random_edges": 2, "steps": 3, "alpha": 0.2, "block": 8}),
    ("strided", {"stride": 8}),
]


@pytest.mark.parametrize("kind,params", PATTERNS, ids=[k for k, _ in PATTERNS])
def test_chunked_reference_matches_autograd(kind, params):
    p = imggen.make_pattern(kind, **params)
    n, heads, d = 40, 2, 8
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, heads, n, d, generator=g, dtype=torch.float64) for _ in range(4))
    x = [t.clone().requires_grad_() for t in (q, k, v)]
    o = reference_attention(*x, p)
    want = [o.detach(), *torch.autograd.grad(o, x, do)]
    tables = gr.allowed_tables(p, n, heads, "cpu")
    for h in range(heads):
        got = gr.reference_head(p, q[0, h], k[0, h], v[0, h], do[0, h], h, tables, chunk_elems=7 * n)
        for name, a, b in zip(gr.NAMES, got, want):
            torch.testing.assert_close(a, b[0, h], rtol=1e-9, atol=1e-9, msg=f"{kind} head {h} {name}")


@pytest.mark.parametrize("kind,params", PATTERNS, ids=[k for k, _ in PATTERNS])
def test_pair_count_is_the_mask(kind, params):
    p = imggen.make_pattern(kind, **params)
    counts = gr.count_pairs(p, 40, 3, "cpu", chunk_elems=100)
    assert counts == [int(m.sum()) for m in p.masks(40, 3)]


def test_softmax_twin_is_one_attention_on_the_same_graph():
    p = imggen.make_pattern("diffuser", window=6, global_tokens=3, random_edges=2, steps=4, alpha=0.1, block=8)
    for table in (False, True):
        t = gr.softmax_twin(p, table=table)
        assert not t.is_diffusion and p.is_diffusion and t != p
        assert torch.equal(t.masks(30, 2), p.masks(30, 2))
        q, k, v = (torch.randn(1, 2, 30, 4, dtype=torch.float64) for _ in range(3))
        a = torch.softmax((q @ k.transpose(-1, -2) / 2).masked_fill(~p.masks(30, 2), float("-inf")), -1)
        torch.testing.assert_close(reference_attention(q, k, v, t), a @ v)


def test_error_metrics_catch_one_bad_row_and_nan():
    ref = torch.randn(4, 1000, 16)
    x = ref + 1e-4 * torch.randn_like(ref)
    tol = {"rel": 2e-2, "row": 0.1}
    assert gr.compare([x], [ref], tol)["ok"]
    bad = x.clone()
    bad[2, 17] += 1.0  # one wrong row hides in the global norm but not in the row metric
    c = gr.compare([bad], [ref], tol)
    assert c["out"]["rel"] < 2e-2 and not c["ok"]
    assert divmod(c["out"]["worst_row_index"], 1000) == (2, 17)  # where the worst-slice check looks
    bad[0, 0, 0] = float("nan")
    assert math.isinf(gr.compare([bad], [ref], tol)["out"]["rel"])


def test_kernel_names_are_classified_generically():
    cases = {"_fwd": "forward", "_attn_fwd_inner": "forward", "bsa_flash_forward": "forward",
             "_bwd_dq": "dQ", "_attn_bwd_dq_kernel": "dQ", "_bwd_dkdv": "dK/dV", "attn_bwd_dk_dv": "dK/dV",
             "_bwd_preprocess": "delta", "_delta_kernel": "delta", "_spmm": "diffuser steps",
             "_diff_ds": "diffuser steps", "_decode_split": "decode", "_decode_combine": "decode",
             "Memcpy DtoD (Device -> Device)": "copy/fill",
             "void at::native::reduce_kernel<512, 1>(...)": gro.CATEGORIES[7][0], "mystery": "other"}
    for name, cat in cases.items():
        assert gro.classify(name) == cat, name
    b = gro.breakdown([("_fwd", 10.0), ("_fwd", 20.0), ("_bwd_dq", 70.0)])
    assert b["total_us"] == 100 and b["kernels"][0]["name"] == "_bwd_dq"
    assert {c["category"]: c["calls"] for c in b["categories"]} == {"dQ": 1, "forward": 2}


def test_train_log_parsing(tmp_path):
    rows = [{"step": s, "train_bpd": 8.0 - 0.01 * s, "lr": 1e-3, "tokens_per_s": 100.0 if s == 1 else 1000.0 + s}
            for s in range(1, 101)]
    rows.insert(50, {"step": 50, "val_bpd": 7.0})
    (tmp_path / "log.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n{\"step\": 10")  # cut line
    r = gro.parse_train_log(tmp_path / "log.jsonl", 100)
    assert r["steps_logged"] == 100 and r["step1_bpd"] == pytest.approx(7.99) and r["last_bpd"] == pytest.approx(7.0)
    assert r["tokens_per_s"] == pytest.approx(1055.5)  # median over steps 11..100, compile-heavy step 1 left out
    assert gro.parse_train_log(tmp_path / "missing.jsonl", 100) == {"steps_logged": 0}
    same = gro.smoke_same_loss({"train_a": {"step1_bpd": 8.0}, "train_b": {"step1_bpd": 8.004}}, ("a", "b"), 0.01)
    assert same["ok"] and not gro.smoke_same_loss({"train_a": {"step1_bpd": 8.0}, "train_b": {"step1_bpd": 8.1}},
                                                 ("a", "b"), 0.01)["ok"]


def _targets(band_ok=True, flex_ok=True, x_flex=1.5, x_sdpa=13.0, tf=160.0, ratio=2.5, dec=(2500.0, 2300.0),
             dec_ok=True):
    ok = lambda b: {"ok": b}  # noqa: E731
    res = {"env": {"copy_GBps": 4300.0},
           "rows": {"b": {"decisive": True, "kind": "band", "label": "band w=256", "n": 16384, "x_flex_fb": x_flex,
                          "x_sdpa_fb": x_sdpa, "ours": {"fb_TF": tf},
                          "correct": {"ours_vs_ref": ok(band_ok), "ours_vs_flex": ok(flex_ok)}},
                    "d": {"decisive": True, "kind": "diffuser", "label": "diffuser K=5", "n": 16384,
                          "diff_over_one": ratio, "correct": {"ours_vs_ref": ok(True), "one_vs_ref": ok(True)}}},
           "decode": {str(i): {"L": 4096 << i, "GBps": gb_s, "correct": ok(dec_ok)} for i, gb_s in enumerate(dec)}}
    return [t["verdict"] for t in gt.evaluate_targets(res)]


def test_targets_are_gated_on_correctness():
    assert _targets() == ["PASS"] * 5
    assert _targets(x_flex=1.1, tf=140.0, ratio=3.2, dec=(2500.0, 2000.0)) == ["FAIL", "PASS", "FAIL", "FAIL", "FAIL"]
    assert _targets(band_ok=False) == ["FAIL", "FAIL", "FAIL", "PASS", "PASS"]
    assert _targets(flex_ok=False) == ["FAIL", "PASS", "PASS", "PASS", "PASS"]
    assert _targets(dec_ok=False)[4] == "FAIL"
    assert _targets(x_flex=None, tf=None)[0::2][:2] == ["NOT RUN", "NOT RUN"]
    assert [t["verdict"] for t in gt.evaluate_targets({"rows": {}, "decode": {}})] == ["NOT RUN"] * 3


def test_cuda_timing_branch_with_a_fake_clock(monkeypatch):
    """time_call's CUDA branch (events, back-to-back samples, median) on a fake event clock."""
    clock = {"t": 0.0}

    class FakeEvent:
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self):
            self.t = clock["t"]

        def synchronize(self):
            pass

        def elapsed_time(self, other):  # milliseconds
            return other.t - self.t

    calls = []

    def fn():
        calls.append(1)
        clock["t"] += 0.25  # 0.25 ms per call

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    ms = harness.time_call(fn, "cuda", target_s=0.1, warmup=2)
    assert ms == pytest.approx(0.25)
    # 2 warm-up + 1 estimate + samples of k = 8 calls (>= 2 ms each), 0.1 s / 2 ms -> 15 samples at most
    assert len(calls) == 3 + 8 * 15


def test_cuda_profiler_events_are_read():
    class Ev:
        def __init__(self, name, us, dev):
            self.name, self.device_type = name, dev
            self.time_range = type("R", (), {"elapsed_us": lambda self_: us})()

    evs = [Ev("aten::mm", 50.0, "DeviceType.CPU"), Ev("_fwd", 30.0, "DeviceType.CUDA"),
           Ev("_bwd_dkdv", 60.0, "DeviceType.CUDA"), Ev("_bwd_dq", 40.0, "DeviceType.CUDA")]
    prof = type("P", (), {"events": lambda self_: evs})()
    b = gro.breakdown(gro.kernel_events(prof, cuda=True))
    assert b["total_us"] == 130 and [c["category"] for c in b["categories"]] == ["dK/dV", "dQ", "forward"]
