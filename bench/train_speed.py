"""Training speed per CPU hour, side by side with another checkout, and the precision parity runs (issue 36).

    python bench/train_speed.py --before /path/to/old/checkout [--parts speed,local2d,parity]
                                [--presets demo,moses,brats64] [--steps 12] [--repeat 2]
                                [--parity demo=600,brats64=200] [--out bench/results/train_speed.md]

* speed: each preset's real `train.py` (its data, its batch, its context; default settings, i.e. what a
  user of that checkout gets, plus --after-args for this checkout, e.g. `--train.precision bf16`) runs --steps steps
  in a fresh process per run, the two checkouts taking turns (which goes first alternates between
  repeats), each with an empty render cache. Step seconds = the median over the logged steps after
  the first two (log_every 1: batch tokens / tokens_per_s); peak memory = the process's VmHWM.
* local2d: the local2d pattern (r=3, C=1, B=1, H=4, D=32) forward+backward through the cpu backend
  at N=4096 (64x64) and 16384 (128x128) against dense causal SDPA forward+backward in the same
  process, per checkout (fp32; the median of 5 after a warm-up).
* parity: this checkout's `train.py --preset P --steps S` in fp32 and in bf16 (same seed and data
  order), then per-image bits/dim of both models on the same val and test images (fp32 evaluation;
  inpainting presets: bits/dim of the hole pixels), with the paired bootstrap 95% interval of the
  bf16 - fp32 difference.
Every run imports imggen from its own checkout (the editable install's finder is removed), so a
`git worktree` of main gives the before column. Run it on an otherwise idle machine.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(HERE, "bench"))
from harness import command_line, machine, machine_line, md_table, use_checkout, write_atomic  # noqa: E402

WARM_STEPS = 2


# ------------------------------------------------------------------------------------ workers
def peak_rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def worker_train(repo: str, argv: list[str]) -> dict:
    use_checkout(repo)
    from imggen.cli import train_main

    t0 = time.time()
    code = train_main(argv)
    return {"exit": code, "wall_s": time.time() - t0, "peak_mib": peak_rss_mib()}


def worker_local2d(repo: str, side: int) -> dict:
    use_checkout(repo)
    import torch
    import torch.nn.functional as F

    import imggen

    torch.manual_seed(0)
    p = imggen.make_pattern("local2d", height=side, width=side, channels=1, radius=3)
    shape = (1, 4, side * side, 32)

    def timed(fn) -> float:
        q, k, v = (torch.randn(shape, requires_grad=True) for _ in range(3))
        g = torch.randn(shape)
        fn(q, k, v).backward(g)  # warm-up
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn(q, k, v).backward(g)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    ours = timed(lambda q, k, v: imggen.sparse_attention(q, k, v, p, backend="cpu"))
    sdpa = timed(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    return {"ours_s": ours, "sdpa_s": sdpa, "x_sdpa": sdpa / ours, "threads": torch.get_num_threads()}


def spawn(kind: str, repo: str, *args, env=None) -> dict:
    with tempfile.NamedTemporaryFile("r", suffix=".json") as res:
        cmd = [sys.executable, __file__, "--worker", kind, res.name, repo, *map(str, args)]
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if r.returncode != 0:
            raise SystemExit(f"{kind} worker failed in {repo}:\n{(r.stdout + r.stderr)[-3000:]}")
        return json.load(open(res.name))


# ------------------------------------------------------------------------------------ parts
def train_argv(preset: str, out: str, steps: int, extra=()) -> list[str]:
    return ["--preset", preset, "--out", out, "--steps", str(steps), "--no-progress", "--overwrite",
            "--train.log_every", "1", "--train.eval_every", str(10 ** 6), "--train.eval_images", "1",
            "--train.ckpt_every", str(10 ** 6), "--train.sample_every", "0", *extra]


def step_seconds(out: str, tokens_per_step: int) -> list[float]:
    rows = [json.loads(line) for line in open(os.path.join(out, "log.jsonl"))]
    return [tokens_per_step / r["tokens_per_s"] for r in rows if "tokens_per_s" in r and r["step"] > WARM_STEPS]


def run_speed(repos: dict, presets: list[str], steps: int, repeat: int, after_args=()) -> list[dict]:
    sys.path.insert(0, HERE)
    from imggen.config import preset as get

    rows = []
    for rep in range(repeat):
        order = list(repos.items()) if rep % 2 == 0 else list(repos.items())[::-1]
        for name in presets:
            cfg = get(name)
            per_step = cfg.train.batch_size * cfg.model.seq_len
            for label, repo in order:
                with tempfile.TemporaryDirectory() as tmp:
                    env = dict(os.environ, IMGGEN_CACHE_DIR=os.path.join(tmp, "cache"))
                    extra = after_args if label == "after" else ()
                    res = spawn("train", repo, *train_argv(name, os.path.join(tmp, "run"), steps, extra), env=env)
                    secs = step_seconds(os.path.join(tmp, "run"), per_step)
                rows.append({"preset": name, "checkout": label, "rep": rep, "step_s": statistics.median(secs),
                             "steps": len(secs), "peak_mib": res["peak_mib"], "wall_s": res["wall_s"]})
                print(f"speed {name} {label} rep {rep}: {rows[-1]['step_s']:.3f} s/step, "
                      f"peak {res['peak_mib']:.0f} MiB", flush=True)
    return rows


def run_local2d(repos: dict) -> list[dict]:
    rows = []
    for side in (64, 128):
        for label, repo in repos.items():
            r = spawn("local2d", repo, side)
            rows.append({"N": side * side, "checkout": label, **r})
            print(f"local2d N={side * side} {label}: {r['ours_s'] * 1e3:.1f} ms, {r['x_sdpa']:.1f}x SDPA", flush=True)
    return rows


def run_parity(spec: dict, work: str, seed: int = 0) -> list[dict]:
    import numpy as np
    import torch

    sys.path.insert(0, HERE)
    from imggen.training.batches import load_data
    from imggen.checkpoint import load_model, read_config, resolve
    from imggen.eval.bpd import bootstrap_ci, token_bits_per_dim
    from imggen.inpainting.tasks import TASKS

    rows = []
    for name, steps in spec.items():
        runs = {}
        for prec in ("fp32", "bf16"):
            out = os.path.join(work, f"parity_{name}_{prec}" + (f"_seed{seed}" if seed else ""))
            stamp = os.path.join(out, "parity_train_s.json")  # a finished run of this spec is reused
            done = os.path.exists(stamp) and json.load(open(stamp)).get("steps") == steps
            if not done:
                t0 = time.time()
                spawn("train", HERE, "--preset", name, "--out", out, "--steps", str(steps), "--no-progress",
                      "--overwrite", "--train.precision", prec, "--train.seed", str(seed))
                with open(stamp, "w") as f:
                    json.dump({"steps": steps, "seconds": time.time() - t0}, f)
            runs[prec] = (out, json.load(open(stamp))["seconds"])
            print(f"parity {name} {prec}: {steps} steps in {runs[prec][1] / 60:.1f} min"
                  + (" (reused)" if done else ""), flush=True)
        cfg = read_config(resolve(runs["fp32"][0]))
        splits, _ = load_data(cfg, progress=False)
        for split in ("val", "test"):
            n = min(len(splits[split]), 256)
            per = {}
            for prec, (out, _) in runs.items():
                torch.manual_seed(0)
                model = load_model(out).eval()  # scored as training scores it (its task's masks and fills)
                inputs = TASKS[cfg.train.task].eval_inputs(cfg, model, splits, split, n)
                per[prec] = np.asarray(token_bits_per_dim(model, splits[split][:n], 16, inputs=inputs),
                                       dtype=np.float64)
            d = per["bf16"] - per["fp32"]
            lo, hi = bootstrap_ci(d, 2000, 0)
            rows.append({"preset": name, "steps": steps, "seed": seed, "split": split, "n": n,
                         "fp32": float(per["fp32"].mean()), "bf16": float(per["bf16"].mean()),
                         "diff": float(d.mean()), "lo": lo, "hi": hi,
                         "fp32_min": runs["fp32"][1] / 60, "bf16_min": runs["bf16"][1] / 60})
            print(f"parity {name} {split}: bf16 - fp32 = {d.mean():+.4f} ({lo:+.4f} to {hi:+.4f})", flush=True)
    return rows


# ------------------------------------------------------------------------------------ report
def report(a, speed, local2d, parity, argv) -> str:
    lines = ["# Training speed per CPU hour (issue 36)", "", f"`{command_line('train_speed.py', argv)}`", "",
             machine_line(machine(gpu=False)), ""]
    if speed:
        out = []
        for name in dict.fromkeys(r["preset"] for r in speed):
            by = {lab: [r for r in speed if r["preset"] == name and r["checkout"] == lab] for lab in ("before", "after")}
            med = {lab: statistics.median(r["step_s"] for r in rs) for lab, rs in by.items()}
            pairs = [b["step_s"] / a_["step_s"] for b, a_ in zip(by["before"], by["after"])]
            peak = {lab: max(r["peak_mib"] for r in rs) for lab, rs in by.items()}
            out.append([name, f"{med['before']:.3f}", f"{med['after']:.3f}", f"**{med['before'] / med['after']:.2f}x**",
                        " / ".join(f"{x:.2f}" for x in pairs), f"{peak['before']:.0f}", f"{peak['after']:.0f}"])
        how = f"default settings; after: {' '.join(a.after_args.split())}" if a.after_args.strip() else "default settings"
        lines += [f"## Training steps at the preset batch (real train.py, {how})", "",
                  md_table(["preset", "before s/step", "after s/step", "steps/s after / before",
                            "per repeat", "peak MiB before", "peak MiB after"], out), ""]
    if local2d:
        out = [[r["N"], r["checkout"], f"{r['ours_s'] * 1e3:.1f}", f"{r['sdpa_s'] * 1e3:.1f}", f"**{r['x_sdpa']:.1f}x**",
                r["threads"]] for r in local2d]
        lines += ["## local2d r=3 forward+backward, cpu backend vs dense causal SDPA (B=1, H=4, D=32, fp32)", "",
                  md_table(["N", "checkout", "local2d ms", "SDPA ms", "SDPA / local2d", "threads"], out), ""]
    if parity:
        out = [[r["preset"], r["steps"], r.get("seed", 0), r["split"], r["n"], f"{r['fp32']:.4f}", f"{r['bf16']:.4f}",
                f"{r['diff']:+.4f} ({r['lo']:+.4f} to {r['hi']:+.4f})", f"{r['fp32_min']:.1f} / {r['bf16_min']:.1f}"]
               for r in parity]
        lines += ["## bf16 vs fp32 at equal steps (same seed and data order; evaluated in fp32)", "",
                  md_table(["preset", "steps", "seed", "split", "images", "fp32 bits/dim", "bf16 bits/dim",
                            "bf16 - fp32 (paired 95%)", "train min fp32 / bf16"], out), ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        kind, result, repo, *rest = argv[1:]
        res = worker_train(repo, rest) if kind == "train" else worker_local2d(repo, int(rest[0]))
        with open(result, "w") as f:
            json.dump(res, f)
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", help="the checkout to compare with (a git worktree of main)")
    ap.add_argument("--parts", default="speed,local2d,parity")
    ap.add_argument("--presets", default="demo,moses,brats64")
    ap.add_argument("--steps", type=int, default=12, help="training steps per speed run (the first 2 are not timed)")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--after-args", default="", help="extra train.py arguments for this checkout's speed runs, "
                                                     "e.g. '--train.precision bf16'")
    ap.add_argument("--parity", default="demo=600,brats64=200", help="PRESET=STEPS,... for the parity part")
    ap.add_argument("--seed", type=int, default=0, help="train.seed of both parity runs (weights and data order)")
    ap.add_argument("--work", default=os.path.join(HERE, "runs", "train_speed"))
    ap.add_argument("--out", default=os.path.join(HERE, "bench", "results", "train_speed.md"))
    a = ap.parse_args(argv)
    parts = set(a.parts.split(","))
    if parts & {"speed", "local2d"} and not a.before:
        ap.error("--before CHECKOUT is needed for the speed and local2d parts")
    repos = {"before": os.path.abspath(a.before), "after": HERE} if a.before else {}
    speed = run_speed(repos, a.presets.split(","), a.steps, a.repeat, a.after_args.split()) if "speed" in parts else []
    local2d = run_local2d(repos) if "local2d" in parts else []
    parity = run_parity({k: int(v) for k, v in (p.split("=") for p in a.parity.split(","))}, a.work, a.seed) \
        if "parity" in parts else []
    text = report(a, speed, local2d, parity, argv)
    write_atomic(a.out, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
