"""Generated MOSES drawings, pattern against pattern at equal wall time (issue 29, item 4).

For every attention pattern (default: full, band, local2d, strided and the `moses` preset's own
local2d,band) the `moses` preset is trained on the full MOSES set (`--data moses`) for the same
training time, then `--num` drawings are sampled from it and read back by OSRA with
`python -m imggen.eval molecules` (validity, atom-bond accuracy, unique, novelty, ...).

Equal time is made deterministic the way bench/study.py does it: each pattern's step time is
measured once, up front, on the same random batch (the best of `--reps` timed steps after a warm-up:
other processes only add time), and turned into a step count floor(minutes * 60 / step time). The
runs then train for those steps, so a busy box changes their wall time but not their budget.

    python bench/moses_patterns.py --minutes 8 --num 48 --out bench/results --work runs/moses_patterns
    python bench/moses_patterns.py --minutes 0.2 --num 4 --patterns full band   # a smoke run

Validity gets a 95% Wilson interval (a proportion, often 0 here), atom-bond accuracy a percentile
bootstrap interval over drawings, and each pattern's difference to full an unpaired bootstrap
interval (independent samples). The ceiling row is the read-back of true 64 px drawings of MOSES
test molecules in the preset's style.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from harness import command_line, fmt, machine, machine_line, md_table, out_dir, write_results  # noqa: E402

from imggen.config import preset  # noqa: E402
from imggen.eval.bpd import bootstrap_ci  # noqa: E402

PATTERNS = ["full", "band", "local2d", "strided", "local2d,band"]


def step_seconds(attention: str, threads: int, reps: int, batch: int | None = None) -> float:
    """Best-of-`reps` seconds of one training step of the `moses` preset with this attention."""
    cfg = preset("moses")
    cfg.model.attention = attention
    if batch:
        cfg.train.batch_size = batch
    return config_step_seconds(cfg, threads, reps)


def config_step_seconds(cfg, threads: int, reps: int) -> float:
    """Best-of-`reps` seconds of one training step of `cfg` on one random batch, after a warm-up step
    (other processes only add time, so the best is the machine's own)."""
    from imggen.training import build_model_and_optimizer, train_step
    torch.set_num_threads(threads)
    cfg.validate()
    torch.manual_seed(0)
    model, opt = build_model_and_optimizer(cfg, "cpu")
    x = torch.randint(0, cfg.model.vocab, (cfg.train.batch_size, cfg.model.seq_len))
    train_step(model, opt, x, 0, cfg, "cpu")  # warm-up
    best = math.inf
    for i in range(reps):
        t = time.perf_counter()
        train_step(model, opt, x, i + 1, cfg, "cpu")
        best = min(best, time.perf_counter() - t)
    return best


def diff_interval(a: np.ndarray, b: np.ndarray, resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% percentile bootstrap interval of mean(a) - mean(b), a and b independent samples."""
    rng = np.random.default_rng(seed)
    da = a[rng.integers(0, len(a), (resamples, len(a)))].mean(1)
    db = b[rng.integers(0, len(b), (resamples, len(b)))].mean(1)
    lo, hi = np.percentile(da - db, [2.5, 97.5])
    return float(lo), float(hi)


def _run(cmd: list[str], log: str) -> float:
    """Run cmd with its output appended to `log`; wall seconds. A failure names the log."""
    t = time.time()
    with open(log, "a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT).returncode
    if rc:
        raise SystemExit(f"{' '.join(cmd[:4])} ... failed (exit {rc}); see {log}")
    return time.time() - t


def train_and_score(a, attention: str, steps: int, work: str, ceiling: int) -> dict:
    run = os.path.join(work, attention.replace(",", "+"))
    os.makedirs(run, exist_ok=True)
    log = os.path.join(work, attention.replace(",", "+") + ".log")
    warmup = max(1, steps // 10)
    every = str(steps)
    train_s = _run([sys.executable, "train.py", "--preset", "moses", "--data", "moses", "--model.attention",
                    attention, "--steps", str(steps), "--out", run, "--overwrite", "--no-progress", "--threads",
                    str(a.threads), "--train.warmup", str(warmup), "--train.eval_every", every,
                    "--train.ckpt_every", every, "--train.grid_time_frac", "0", "--train.log_every", "5"], log)
    js = os.path.join(run, "molecules.json")
    cmd = [sys.executable, "-m", "imggen.eval", "molecules", "--checkpoint", run, "--num", str(a.num),
           "--ref-num", str(a.ref_num), "--seed", "0", "--json", js, "--out", os.path.join(run, "molecules")]
    if ceiling:
        cmd += ["--ceiling", str(ceiling)]
    eval_s = _run(cmd, log)
    return {"attention": attention, "steps": steps, "train_s": train_s, "eval_s": eval_s} | scores(a, run, log)


def scores(a, run: str, log: str) -> dict:
    """The read-back metrics of a scored run and its test bits/dim per image (computed when absent)."""
    bpd_js = os.path.join(run, "bpd.json")
    if not os.path.exists(bpd_js):
        _run([sys.executable, "-m", "imggen.eval", "bpd", "--checkpoint", run, "--split", "test", "--threads",
              str(a.threads), "--json", bpd_js], log)
    with open(os.path.join(run, "molecules.json")) as f:
        res = json.load(f)
    with open(bpd_js) as f:
        bpd = json.load(f)
    return {"res": res, "test_bpd": bpd["bpd"], "bpd_ci": bpd.get("ci95"), "bpd_per_image": bpd["per_image"]}


def report(rows: list[dict], a, step_s: dict, budget_s: float, m: dict, argv) -> str:
    full = next((r for r in rows if r["attention"] == "full"), None)

    def per(r, key):
        return np.array([p[key] for p in r["res"]["per_image"]], float)

    def ci(r, key):
        lo_hi = r["res"]["intervals"].get(key)
        return f"{r['res'][key]:.3f} ({lo_hi[0]:.3f}-{lo_hi[1]:.3f})" if lo_hi else fmt(r["res"][key])

    def vs_full(r, key):
        if full is None or r is full:
            return "-"
        lo, hi = diff_interval(per(r, key), per(full, key))
        return f"{per(r, key).mean() - per(full, key).mean():+.3f} ({lo:+.3f} to {hi:+.3f})"

    def bpd(r):
        lo_hi = r.get("bpd_ci")
        return f"{r['test_bpd']:.3f} ({lo_hi[0]:.3f}-{lo_hi[1]:.3f})" if lo_hi else fmt(r["test_bpd"])

    def bpd_vs_full(r):  # paired: the same test images
        if full is None or r is full:
            return "-"
        d = np.array(r["bpd_per_image"]) - np.array(full["bpd_per_image"])
        lo, hi = bootstrap_ci(d, 2000, 0)
        return f"{d.mean():+.3f} ({lo:+.3f} to {hi:+.3f})"

    head = ["pattern", "step s", "steps", "train wall s", "test bits/dim (95%)", "bits/dim - full (paired)",
            "OSRA recognised",
            "validity (95% Wilson)", "atom-bond accuracy (95% bootstrap)", "validity - full",
            "atom-bond - full", "unique", "novelty"]
    body = [[r["attention"], f"{step_s[r['attention']]:.2f}", r["steps"], f"{r['train_s']:.0f}",
             bpd(r), bpd_vs_full(r), fmt(r["res"]["recognised"]), ci(r, "validity"), ci(r, "atom_bond_accuracy"),
             vs_full(r, "valid"), vs_full(r, "atom_bond_accuracy"), fmt(r["res"]["unique"]),
             fmt(r["res"]["novelty"])] for r in rows]
    c = rows[0]["res"].get("ceiling")
    if c:
        body.append([f"ceiling: true drawings (n={c['n']})", "", "", "", "", "", fmt(c["recognised"]),
                     ci({"res": c}, "validity"), ci({"res": c}, "atom_bond_accuracy"), "", "",
                     fmt(c["unique"]), fmt(c["novelty"])])
    return "\n".join([
        f"# MOSES drawings at equal training time ({a.minutes:g} min a pattern)", "",
        f"`{command_line('moses_patterns.py', argv)}`", "", machine_line(m), "",
        f"Preset `moses` (64x64, 1 channel, dim 64, 4 layers, 2 heads, batch 8), `--data moses`; each "
        f"pattern gets floor({budget_s:.0f} s / its step time) steps (step time: best of {a.reps} steps on one "
        f"random batch, {a.threads} threads, measured before any training); warm-up steps/10, cosine to 0.1x. "
        f"{a.num} drawings sampled per model (seed 0, temperature 1) and read back by OSRA.", "",
        md_table(head, body), ""])


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=8.0, help="training time budget per pattern (default 8)")
    ap.add_argument("--patterns", nargs="+", default=PATTERNS, help=f"attention values (default {PATTERNS})")
    ap.add_argument("--num", type=int, default=48, help="drawings sampled and read back per model (default 48)")
    ap.add_argument("--ceiling", type=int, default=48, help="true drawings read back for the ceiling (default 48)")
    ap.add_argument("--ref-num", type=int, default=2000, help="MOSES test molecules for SNN/Frag/Scaf (default 2000)")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads for timing and training (default 2)")
    ap.add_argument("--reps", type=int, default=3, help="timed steps per pattern (default 3)")
    ap.add_argument("--out", help="results folder (default $OUT or bench/results)")
    ap.add_argument("--stem", default="moses_patterns", help="results file stem (default moses_patterns)")
    ap.add_argument("--work", default="runs/moses_patterns", help="run folders (default runs/moses_patterns)")
    ap.add_argument("--report-only", action="store_true",
                    help="train nothing: rebuild the tables from the runs and the results JSON of an earlier run")
    return ap


def write(a, rows, step_s, budget_s, m, argv) -> str:
    md = report(rows, a, step_s, budget_s, m, argv)
    data = {"machine": m, "budget_s": budget_s, "step_s": step_s,
            "rows": [{k: v for k, v in r.items() if k != "res"} | {"metrics": r["res"]} for r in rows]}
    write_results(out_dir(a.out), a.stem, data, md)
    return md


def report_only(a, argv) -> int:
    with open(out_dir(a.out) / f"{a.stem}.json") as f:
        old = json.load(f)
    rows = []
    for r in old["rows"]:
        name = r["attention"].replace(",", "+")
        keep = {k: r[k] for k in ("attention", "steps", "train_s", "eval_s")}
        rows.append(keep | scores(a, os.path.join(a.work, name), os.path.join(a.work, name + ".log")))
    print(write(a, rows, old["step_s"], old["budget_s"], old["machine"], argv))
    return 0


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    if a.report_only:
        return report_only(a, argv)
    budget_s = a.minutes * 60
    m = machine(gpu=False)
    step_s = {}
    for p in a.patterns:
        step_s[p] = step_seconds(p, a.threads, a.reps)
        print(f"{p}: {step_s[p]:.2f} s/step -> {max(1, int(budget_s // step_s[p]))} steps", flush=True)
    os.makedirs(a.work, exist_ok=True)
    rows = []
    for i, p in enumerate(a.patterns):
        steps = max(1, int(budget_s // step_s[p]))
        rows.append(train_and_score(a, p, steps, a.work, a.ceiling if i == 0 else 0))
        print(f"{p}: {steps} steps in {rows[-1]['train_s']:.0f} s, validity {rows[-1]['res']['validity']:.3f}, "
              f"atom-bond {rows[-1]['res']['atom_bond_accuracy']:.3f}", flush=True)
        md = write(a, rows, step_s, budget_s, m, argv)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
