"""Which attention pattern wins? One reproducible study.

Trains the same small model (same width, depth, heads, optimiser, data order and seed) once per
attention pattern -- full, band, local2d, strided, bigbird, diffuser -- on real shipped data
(molecule drawings at 32x32 and 64x64, MNI152 brain slices "brats-demo" at 64x64) under two budgets:

* ``steps``: every pattern gets the same number of optimiser steps;
* ``time``:  every pattern gets the same wall-clock training time. The time budget of a setting is
  the training time of ``full`` at equal steps (its step time x steps); each pattern's step time is
  measured over its equal-steps run (20th percentile of the per-step times: load from other
  processes only adds time) and converted ONCE into a step count,
  ``floor(budget / step time)``. The counts are written to ``study_grids/study_steps.json``; pass that file
  back with ``--steps-from`` and the equal-time runs are deterministic too.

For every trained model: test bits/dim with a 95% percentile bootstrap interval over test images
(``imggen.eval.bpd.bits_per_dim``), training tokens/s, peak memory (process VmHWM reset before
training via /proc/self/clear_refs, and the bytes of tensors autograd saves for one training step,
which does not depend on the allocator), sampling tokens/s through the eviction cache
(``imggen.sample(..., cache="evict")``) and its size, a sample grid PNG, and the parity
max |teacher_force(model, x) - model(x)| on a test batch (must be <= 1e-4).

Ablations (one setting, equal steps): diffuser K in {1, 2, 5} x alpha in {0.1, 0.3}; band window in
{W/2, W, 2W}. Runs that coincide with a main run (diffuser K=5 alpha=0.1, band 2W) are reused.

    python bench/study.py                      # the default CPU study (<= 45 min on 2 cores)
    python bench/study.py --quick              # CI smoke run (equal steps only, < 5 min)
    python bench/study.py --device cuda --dim 256 --layers 8 --heads 8 --steps mol32=5000,mol64=5000,brats64=5000

The loop below is the one in ``imggen.training.train`` (same AdamW groups, betas, warmup + cosine
``lr_at``, clipping, ``batch_indices`` data order, bf16 autocast as --train.precision) without checkpoints,
periodic evaluation or sample grids, so that each step can be timed and nothing else is.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import sys
import time
from contextlib import nullcontext

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from harness import cpu_model, git_commit, write_atomic  # noqa: E402

from imggen.attention import BACKENDS  # noqa: E402
from imggen.decode import make_caches  # noqa: E402
from imggen.config import Config, DataConfig, ModelConfig, TrainConfig  # noqa: E402
from imggen.errors import TrainingError  # noqa: E402
from imggen.eval.bpd import bits_per_dim  # noqa: E402
from imggen.images import save_grid  # noqa: E402
from imggen.sampling import detokenize, sample, teacher_force  # noqa: E402
from imggen.tokens import tokenize  # noqa: E402
from imggen.training import batch_indices, build_model_and_optimizer, train_step  # noqa: E402

PATTERNS = ["full", "band", "local2d", "strided", "bigbird", "diffuser"]
KINDS = {"mol": "molecules", "brats": "brats-demo"}
PARITY_TOL = 1e-4
LN2 = math.log(2.0)

DEFAULTS = dict(settings="mol32,mol64,brats64", dim=64, layers=2, heads=4, lr=3e-3, warmup=10,
                steps="mol32=60,mol64=24,brats64=24", batch_size="mol32=8,mol64=2,brats64=2",
                test_images="mol32=64,mol64=24,brats64=24", train_limit=0, sample_num=4, parity_batch=2, bootstrap=1000,
                budgets="steps,time", ablations="mol32", threads=0)
QUICK = dict(settings="brats16", dim=32, layers=2, heads=4, lr=3e-3, warmup=2, steps="6", batch_size="4",
             test_images="8", train_limit=64, sample_num=2, parity_batch=1, bootstrap=200, budgets="steps",
             ablations="", threads=1)


# ------------------------------------------------------------------------------------- options
def parse_setting(name: str) -> dict:
    m = re.fullmatch(r"(mol|brats)(\d+)", name)
    if not m:
        raise SystemExit(f"study.py: error: unknown setting {name!r}; use molN or bratsN (e.g. mol32, brats64)")
    size = int(m.group(2))
    return dict(name=name, spec=KINDS[m.group(1)], height=size, width=size)


def per_setting(value: str, settings: list[str], what: str) -> dict[str, int]:
    """'100' -> same for all; 'mol32=100,mol64=40' -> per setting (every setting must be named)."""
    value = str(value)
    if "=" not in value:
        return {s: int(value) for s in settings}
    out = {}
    for part in value.split(","):
        k, _, v = part.partition("=")
        out[k.strip()] = int(v)
    missing = [s for s in settings if s not in out]
    if missing:
        raise SystemExit(f"study.py: error: --{what} names no value for {', '.join(missing)}")
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="study.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny CI settings (brats-demo 16x16, 6 steps, equal steps)")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"),
                    help="folder for study.md and study_grids/ (PNG grids, study.json rows, study_steps.json)")
    ap.add_argument("--settings", help=f"comma list of molN / bratsN (default {DEFAULTS['settings']})")
    ap.add_argument("--patterns", default=",".join(PATTERNS), help="comma list of patterns")
    ap.add_argument("--budgets", help="steps, time or steps,time (default steps,time; --quick: steps)")
    ap.add_argument("--steps", help=f"equal-steps count: N or SETTING=N,... (default {DEFAULTS['steps']})")
    ap.add_argument("--batch-size", help=f"N or SETTING=N,... (default {DEFAULTS['batch_size']})")
    ap.add_argument("--steps-from", help="study_steps.json of an earlier run: reuse its equal-time step counts")
    ap.add_argument("--dim", type=int)
    ap.add_argument("--layers", type=int)
    ap.add_argument("--heads", type=int)
    ap.add_argument("--lr", type=float)
    ap.add_argument("--warmup", type=int)
    ap.add_argument("--bits", type=int, default=8, help="bits per subpixel (default 8)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--test-images", help="first N test images scored (bootstrap over them): N or SETTING=N,... "
                                          f"(default {DEFAULTS['test_images']})")
    ap.add_argument("--train-limit", type=int, help="use the first N training images (0 = all)")
    ap.add_argument("--sample-num", type=int, help="images sampled per model (grid, sampling tok/s)")
    ap.add_argument("--parity-batch", type=int, help="test images in the teacher-forcing parity check")
    ap.add_argument("--bootstrap", type=int, help="bootstrap resamples for the 95%% interval")
    ap.add_argument("--ablations", help="setting for the ablations ('' = none; default mol32)")
    ap.add_argument("--report-only", action="store_true",
                    help="rewrite study.md from OUT/study_grids/study.json (same other flags as the run) without training")
    ap.add_argument("--device", default=None, help="torch device (default cuda when available)")
    ap.add_argument("--backend", default="auto", choices=BACKENDS,
                    help="attention backend (default auto: triton on CUDA after its self-check, else flex; cpu on "
                         "CPU). flex trains on CUDA only: FlexAttention has no CPU backward")
    ap.add_argument("--threads", type=int, help="torch CPU threads (0 = torch default; --quick: 1). On a CPU shared "
                    "with other busy processes use 1: oversubscribed OpenMP threads can run 100x slower")
    return ap


def resolve_args(argv=None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    base = QUICK if args.quick else DEFAULTS
    for k, v in base.items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    args.settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    args.patterns = [p.strip() for p in args.patterns.split(",") if p.strip()]
    bad = [p for p in args.patterns if p not in PATTERNS]
    if bad:
        raise SystemExit(f"study.py: error: unknown pattern(s) {bad}; choose from {PATTERNS}")
    args.budgets = [b.strip() for b in args.budgets.split(",") if b.strip()]
    if not set(args.budgets) <= {"steps", "time"} or not args.budgets:
        raise SystemExit("study.py: error: --budgets must be steps, time or steps,time")
    if "time" in args.budgets and "full" not in args.patterns and not args.steps_from:
        raise SystemExit("study.py: error: the time budget is full's equal-steps time: include full or pass --steps-from")
    every = args.settings + ([args.ablations] if args.ablations else [])
    args.steps_map = per_setting(args.steps, every, "steps")
    args.batch_map = per_setting(args.batch_size, every, "batch-size")
    args.test_map = per_setting(args.test_images, every, "test-images")
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.backend == "flex" and not args.device.startswith("cuda") and not args.report_only:
        raise SystemExit(f"study.py: error: --backend flex cannot train on {args.device}: FlexAttention has no CPU "
                         f"backward; use --backend cpu (or auto) on CPU, or --device cuda")
    return args


# ----------------------------------------------------------------------------------- measuring
def _vm_hwm_reset() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _vm_hwm_mib() -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


class SavedBytes:
    """Bytes of the distinct storages autograd saves for backward (activation memory of one step)."""

    def __init__(self):
        self.seen, self.total = set(), 0

    def pack(self, t):
        try:
            st = t.untyped_storage()
            key = (st.data_ptr(), st.nbytes())
            if key not in self.seen:
                self.seen.add(key)
                self.total += st.nbytes()
        except Exception:  # noqa: BLE001 (a tensor without storage: count nothing)
            pass
        return t

    @staticmethod
    def unpack(t):
        return t


def model_config(args, setting: dict, kind: str, **pattern) -> ModelConfig:
    return ModelConfig(height=setting["height"], width=setting["width"], channels=1, bits=args.bits,
                       dim=args.dim, layers=args.layers, heads=args.heads, attention=kind,
                       backend=args.backend, pattern_seed=args.seed, **pattern)


def train_model(cfg: Config, train_tok: torch.Tensor, device: str):
    """imggen.training.train's loop, timed per step. Returns (model, stats)."""
    t = cfg.train
    model, opt = build_model_and_optimizer(cfg, device)
    model.train()
    saved = SavedBytes()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    _vm_hwm_reset()
    stamps, losses = [time.perf_counter()], []
    for step in range(t.steps):
        x = train_tok[batch_indices(step, t.batch_size, len(train_tok), t.seed)].long().to(device)
        hooks = torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack) if step == 0 else nullcontext()
        try:
            with hooks:  # step 0: count the bytes autograd saves
                losses.append(train_step(model, opt, x, step, cfg, device))  # synchronises CUDA too
        except TrainingError as e:
            raise RuntimeError(f"{e} ({cfg.model.attention})") from None
        stamps.append(time.perf_counter())
    dts = np.diff(stamps)
    steady = dts[1:] if len(dts) > 1 else dts  # step 0 builds the attention plans
    # other processes on a shared machine only ever add time: a low percentile of the step times
    # estimates the uncontended step time (used for tokens/s and for the equal-time step counts)
    step_s = float(np.percentile(steady, 20))
    tok_step = t.batch_size * cfg.model.seq_len
    peak = (torch.cuda.max_memory_allocated() / 2**20 if device.startswith("cuda") else _vm_hwm_mib())
    model.eval()
    return model, dict(train_s=float(dts.sum()), step_s=step_s, step_s_median=float(np.median(steady)),
                       train_tok_s=tok_step / max(1e-9, step_s),
                       peak_mib=peak, act_mib=saved.total / 2**20, final_train_bpd=losses[-1])


@torch.no_grad()
def measure_model(model, args, setting, test_imgs: np.ndarray, grid_path: str) -> dict:
    test_tok = tokenize(test_imgs, model.config.bits, shape=model.config.shape)
    r = bits_per_dim(model, test_imgs, batch_size=8, return_per_image=True, bootstrap=args.bootstrap,
                     seed=args.seed, dataset=setting["spec"])
    x = test_tok[: args.parity_batch].long().to(next(model.parameters()).device)
    parity = float((teacher_force(model, x, cache="evict").float() - model(x).float()).abs().max())
    n = args.sample_num
    caches = make_caches(model, n, "evict")
    cache_kib = sum(c.nbytes() for c in caches) / 1024
    full_kib = sum(c.nbytes() for c in make_caches(model, n, "full")) / 1024
    del caches
    t0 = time.perf_counter()
    toks = sample(model, n, seed=args.seed, cache="evict")
    dt = time.perf_counter() - t0
    imgs = detokenize(model, toks).numpy()
    save_grid(imgs, grid_path, scale=max(1, 128 // setting["width"]))
    return dict(bpd=r["bpd"], ci95=r["ci95"], n_test=r["n_images"], parity=parity,
                sample_tok_s=n * model.config.seq_len / dt, cache_kib=cache_kib, full_cache_kib=full_kib,
                grid=grid_path)


# ----------------------------------------------------------------------------------------- run
def load_setting(args, setting: dict) -> tuple[torch.Tensor, np.ndarray]:
    from imggen.datasets import load_dataset

    kw = {"progress": False} if setting["spec"] == "molecules" else {}
    data = load_dataset(setting["spec"], height=setting["height"], width=setting["width"], channels=1,
                        seed=args.seed, **kw)
    train_imgs = data.split("train")
    if args.train_limit:
        train_imgs = train_imgs[: args.train_limit]
    test_imgs = data.split("test")[: args.test_map[setting["name"]]]
    shape = (1, setting["height"], setting["width"])
    return tokenize(train_imgs, args.bits, shape=shape).to(torch.uint8), test_imgs


def run_warmup(args, setting, train_tok) -> None:
    cfg = Config(preset="study", model=model_config(args, setting, "full"),
                 train=TrainConfig(steps=2, batch_size=args.batch_map[setting["name"]], lr=args.lr, warmup=1,
                                   seed=args.seed))
    train_model(cfg, train_tok, args.device)


def run_one(args, setting, kind, budget, steps, train_tok, test_imgs, grids, label=None, **pattern) -> dict:
    name = setting["name"]
    cfg = Config(preset="study", model=model_config(args, setting, kind, **pattern),
                 train=TrainConfig(steps=steps, batch_size=args.batch_map[name], lr=args.lr,
                                   warmup=min(args.warmup, max(1, steps // 2)), seed=args.seed),
                 data=DataConfig(spec=setting["spec"]))
    label = label or kind
    model, st = train_model(cfg, train_tok, args.device)
    slug = re.sub(r"[^A-Za-z0-9_.=-]+", "_", f"{name}_{label}_{budget}")
    ms = measure_model(model, args, setting, test_imgs, os.path.join(grids, slug + ".png"))
    row = dict(setting=name, pattern=label, kind=kind, budget=budget, steps=steps,
               batch_size=cfg.train.batch_size, tokens=cfg.model.seq_len, params=pattern, **st, **ms)
    print(f"  {name:8s} {label:22s} {budget:5s} steps {steps:4d}  bpd {ms['bpd']:.3f} "
          f"[{ms['ci95'][0]:.3f}, {ms['ci95'][1]:.3f}]  train {st['train_tok_s']:.0f} tok/s "
          f"({st['train_s']:.0f}s)  sample {ms['sample_tok_s']:.0f} tok/s  parity {ms['parity']:.1e}", flush=True)
    return row


def raw_path(out: str) -> str:
    """Raw rows (JSON) live next to the grids so that the study writes only study.md and study_grids/."""
    return os.path.join(out, "study_grids", "study.json")


def steps_path(out: str) -> str:
    return os.path.join(out, "study_grids", "study_steps.json")


def run_study(args, on_progress=None) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    grids = os.path.join(args.out, "study_grids")
    os.makedirs(grids, exist_ok=True)
    started = dict(commit=git_commit(), date=f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
                   threads=torch.get_num_threads())
    steps_from = None
    if args.steps_from:
        with open(args.steps_from) as f:
            steps_from = json.load(f)
    plan: dict = {}
    rows: list[dict] = []
    t_start = time.time()
    for name in args.settings:
        setting = parse_setting(name)
        train_tok, test_imgs = load_setting(args, setting)
        print(f"{name}: {setting['spec']} {setting['height']}x{setting['width']}, {len(train_tok)} train / "
              f"{len(test_imgs)} test images", flush=True)
        by_kind = {}
        # untimed warm-up (thread pools, allocator, kernel selection) so the first timed pattern pays nothing extra
        run_warmup(args, setting, train_tok)
        if "steps" in args.budgets or "time" in args.budgets and steps_from is None:
            for kind in args.patterns:
                by_kind[kind] = run_one(args, setting, kind, "steps", args.steps_map[name], train_tok, test_imgs, grids)
                if "steps" in args.budgets:
                    rows.append(by_kind[kind])
        if "time" in args.budgets:
            if steps_from is not None:
                if name not in steps_from:
                    raise SystemExit(f"study.py: error: {args.steps_from} has no step counts for {name}")
                plan[name] = steps_from[name]
            else:
                budget_s = by_kind["full"]["step_s"] * args.steps_map[name]
                plan[name] = {"budget_s": budget_s, "patterns": {
                    k: {"step_s": r["step_s"], "steps": max(1, int(budget_s // r["step_s"]))}
                    for k, r in by_kind.items()}}
            for kind in args.patterns:
                n = int(plan[name]["patterns"][kind]["steps"])
                prev = by_kind.get(kind)
                if prev is not None and prev["steps"] == n:  # same run (always so for full)
                    rows.append(dict(prev, budget="time"))
                    continue
                rows.append(run_one(args, setting, kind, "time", n, train_tok, test_imgs, grids))
        if on_progress:  # partial report after each setting
            on_progress(dict(rows=rows, plan=plan, seconds=time.time() - t_start, **started))
    if args.ablations:
        rows += run_ablations(args, rows)
    if "time" in args.budgets and steps_from is None:
        write_atomic(steps_path(args.out), json.dumps(plan, indent=2))
    return dict(rows=rows, plan=plan, seconds=time.time() - t_start, **started)


def run_ablations(args, rows) -> list[dict]:
    name = args.ablations
    setting = parse_setting(name)
    w = setting["width"]
    train_tok, test_imgs = load_setting(args, setting)
    grids = os.path.join(args.out, "study_grids")
    steps = args.steps_map[name]
    main = {r["kind"]: r for r in rows if r["setting"] == name and r["budget"] == "steps"}
    default = model_config(args, setting, "full")
    out = []
    print(f"ablations on {name} (equal steps, {steps})", flush=True)
    for k in (1, 2, 5):
        for a in (0.1, 0.3):
            label = f"diffuser K={k} a={a}"
            if k == default.diffusion_steps and a == default.alpha and "diffuser" in main:
                out.append(dict(main["diffuser"], pattern=label, budget="ablation"))
                continue
            out.append(run_one(args, setting, "diffuser", "ablation", steps, train_tok, test_imgs, grids,
                               label=label, diffusion_steps=k, alpha=a))
    for frac, tag in ((0.5, "W/2"), (1, "W"), (2, "2W")):
        win = max(1, int(frac * w))
        label = f"band window={win} ({tag})"
        if win == 2 * w and "band" in main:  # the model's default band window is two rows
            out.append(dict(main["band"], pattern=label, budget="ablation"))
            continue
        out.append(run_one(args, setting, "band", "ablation", steps, train_tok, test_imgs, grids,
                           label=label, window=win))
    return out


# -------------------------------------------------------------------------------------- report
def _f(x, fmt):
    return "-" if x is None else format(x, fmt)


def results_table(rows) -> str:
    head = ("| setting | pattern | budget | steps | train s | test bits/dim [95% CI] | train tok/s | "
            "peak RSS MiB | saved act MiB | sample tok/s | evict cache KiB (full) | parity |")
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        lines.append(
            f"| {r['setting']} | {r['pattern']} | {r['budget']} | {r['steps']} | {r['train_s']:.0f} | "
            f"{r['bpd']:.3f} [{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}] | {r['train_tok_s']:.0f} | "
            f"{_f(r['peak_mib'], '.0f')} | {r['act_mib']:.1f} | {r['sample_tok_s']:.0f} | "
            f"{r['cache_kib']:.0f} ({r['full_cache_kib']:.0f}) | "
            f"{r['parity']:.1e}{'' if r['parity'] <= PARITY_TOL else ' FAIL'} |")
    return "\n".join(lines)


def summary_table(rows) -> str:
    """README table: bits/dim per pattern (rows) x (setting, budget) (columns), best per column in bold."""
    cols = [(s, b) for s in dict.fromkeys(r["setting"] for r in rows if r["budget"] != "ablation")
            for b in ("steps", "time") if any(r["setting"] == s and r["budget"] == b for r in rows)]
    kinds = list(dict.fromkeys(r["pattern"] for r in rows if r["budget"] != "ablation"))
    get = {(r["setting"], r["budget"], r["pattern"]): r for r in rows}
    best = {c: min(get[(c[0], c[1], k)]["bpd"] for k in kinds if (c[0], c[1], k) in get) for c in cols}
    lines = ["| pattern | " + " | ".join(f"{s} equal-{b}" for s, b in cols) + " |",
             "|---|" + "---|" * len(cols)]
    for k in kinds:
        cells = []
        for c in cols:
            r = get.get((c[0], c[1], k))
            if r is None:
                cells.append("-")
                continue
            v = f"{r['bpd']:.3f}" + (f" ({r['steps']} st)" if c[1] == "time" else "")
            cells.append(f"**{v}**" if r["bpd"] == best[c] else v)
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def criterion(rows) -> tuple[bool | None, list[str]]:
    """On 64x64 settings at equal time: does some sparse pattern reach lower test bits/dim than full?"""
    notes, held = [], None
    for s in dict.fromkeys(r["setting"] for r in rows):
        if not s.endswith("64"):
            continue
        tr = {r["pattern"]: r for r in rows if r["setting"] == s and r["budget"] == "time"}
        if "full" not in tr:
            continue
        full = tr["full"]
        win = sorted((r for k, r in tr.items() if k != "full" and r["bpd"] < full["bpd"]), key=lambda r: r["bpd"])
        held = bool(held) or bool(win)
        if win:
            sig = [r["pattern"] for r in win if r["ci95"][1] < full["ci95"][0]]
            wins = ", ".join(f"{r['pattern']} {r['bpd']:.3f} ({r['steps']} steps)" for r in win)
            notes.append(f"{s}: HELD -- {wins} "
                         f"< full {full['bpd']:.3f} ({full['steps']} steps)"
                         + (f"; 95% intervals disjoint for {', '.join(sig)}" if sig else
                            "; the 95% intervals overlap, so the ordering is not significant"))
        else:
            fast = sorted(((r["train_tok_s"] / full["train_tok_s"], k) for k, r in tr.items() if k != "full"),
                          reverse=True)
            notes.append(f"{s}: NOT held -- full {full['bpd']:.3f} is lowest; throughput relative to full: "
                         + ", ".join(f"{k} x{x:.2f}" for x, k in fast))
    return held, notes


def findings(rows) -> list[str]:
    """Plain statements about where sparse patterns lose, from the numbers."""
    out = []
    for s in dict.fromkeys(r["setting"] for r in rows if r["budget"] != "ablation"):
        st = {r["pattern"]: r for r in rows if r["setting"] == s and r["budget"] == "steps"}
        if "full" not in st:
            continue
        f = st["full"]
        worse = [f"{k} (+{r['bpd'] - f['bpd']:.3f})" for k, r in st.items() if k != "full" and r["bpd"] > f["bpd"]]
        better = [f"{k} ({r['bpd'] - f['bpd']:+.3f})" for k, r in st.items() if k != "full" and r["bpd"] <= f["bpd"]]
        speed = ", ".join(f"{k} x{r['train_tok_s'] / f['train_tok_s']:.2f}" for k, r in st.items() if k != "full")
        same = " All are within each other's 95% intervals: too little training to separate them." \
            if _overlap(list(st.values())) else ""
        out.append(f"- **{s}, equal steps**: worse than full: {', '.join(worse) or 'none'}; "
                   f"at least as good: {', '.join(better) or 'none'}.{same} Training throughput relative to "
                   f"full: {speed}.")
    return out


def _overlap(rows) -> bool:
    return max(r["ci95"][0] for r in rows) <= min(r["ci95"][1] for r in rows)


def ablation_notes(rows) -> list[str]:
    ab = [r for r in rows if r["budget"] == "ablation"]
    if not ab:
        return []
    band = [r for r in ab if r["kind"] == "band"]
    diff = [r for r in ab if r["kind"] == "diffuser"]
    out = []
    if band:
        out.append("- **band window** (" + ab[0]["setting"] + ", equal steps): " + ", ".join(
            f"{r['pattern'].split(' ', 1)[1]} {r['bpd']:.3f} ({r['train_tok_s']:.0f} tok/s)" for r in band)
            + ("; the 95% intervals all overlap: at this budget the window makes no measurable difference"
               if _overlap(band) else ""))
    if diff:
        best = min(diff, key=lambda r: r["bpd"])
        out.append("- **diffuser K x alpha** (" + ab[0]["setting"] + ", equal steps): " + ", ".join(
            f"{r['pattern'].split(' ', 1)[1]} {r['bpd']:.3f} ({r['train_tok_s']:.0f} tok/s)" for r in diff)
            + f"; best {best['pattern'].split(' ', 1)[1]}"
            + ("; the 95% intervals all overlap" if _overlap(diff) else ""))
    return out


def time_notes(rows) -> list[str]:
    out = []
    for s in dict.fromkeys(r["setting"] for r in rows if r["budget"] == "time"):
        tr = sorted((r for r in rows if r["setting"] == s and r["budget"] == "time"), key=lambda r: r["bpd"])
        out.append(f"- **{s}, equal time**: ranking " + " < ".join(
            f"{r['pattern']} {r['bpd']:.3f} ({r['steps']} steps)" for r in tr))
    return out


def why_notes(rows) -> str:
    speed = {}
    for s in dict.fromkeys(r["setting"] for r in rows if r["budget"] == "steps"):
        st = {r["pattern"]: r for r in rows if r["setting"] == s and r["budget"] == "steps"}
        if "full" in st:
            speed[s] = ", ".join(f"{k} x{r['train_tok_s'] / st['full']['train_tok_s']:.2f}"
                                 for k, r in st.items() if k != "full")
    rel = "; ".join(f"{s}: {v}" for s, v in speed.items()) or "n/a"
    return f"""\
- **Throughput decides equal-time results.** Training tokens/s relative to `full` ({rel}). On CPU,
  `full` runs PyTorch's fused causal `scaled_dot_product_attention`. In the blocked `cpu` backend
  of `imggen.sparse_attention`, `band` reads its keys as a strided view (no copy) and `strided` runs
  as a band plus dense attention down each image column; the other sparse patterns gather their
  layout's key blocks with `index_select` and fold the key/value gradients back with `index_add_`.
  `local2d` touches few blocks (r + 1 rows) so it stays fast; `bigbird` (window + global + random
  blocks) and `diffuser` touch many, and where that makes them slower than dense `full` although
  they read fewer keys, they get fewer steps at equal time and lose.
- **diffuser's extra steps cost time:** K diffusion steps re-apply the sparse attention matrix K times
  (forward and backward), so its step time grows with K (see the K x alpha ablation); with K = 5 it is
  among the slowest patterns and at equal time gets correspondingly few steps.
- **band windows shorter than a row cannot see the pixel above:** the query predicting token t reads
  the previous `window` tokens; the pixel directly above is W tokens back, so a window of W or 2W
  sees it in every layer, while with W/2 even two stacked layers reach back only W - 1 tokens: the
  pixel above (the strongest predictor in raster order) is never visible.
- **Short budgets favour local patterns.** With tens of steps the models mostly learn local statistics
  (background, stroke edges, the pixel above); a pattern's long-range reach only pays off with longer
  training. These are statements about short CPU budgets, not about converged models.
"""


def write_report(args, res, argv) -> str:
    rows = res["rows"]
    cmd = "python bench/study.py" + (" " + " ".join(argv) if argv else "")
    held, notes = criterion(rows)
    lines = [
        "# Which pattern wins?", "",
        f"- command: `{cmd}`",
        f"- commit at start: `{res['commit']}` (plus any uncommitted edits in the working tree); started "
        f"{res['date']}; wall time {res['seconds'] / 60:.1f} min",
        f"- machine: {cpu_model()}, {os.cpu_count()} CPUs, torch {torch.__version__} "
        f"({res['threads']} threads), device {args.device}",
        f"- model: dim {args.dim}, {args.layers} layers, {args.heads} heads, {args.bits}-bit tokens "
        f"(bits/dim on {args.bits}-bit data), AdamW lr {args.lr}, warmup {args.warmup}, cosine, seed {args.seed}; "
        f"steps {args.steps_map}, batch {args.batch_map}; test images {args.test_map} "
        f"(bootstrap {args.bootstrap} resamples); train images {'all' if not args.train_limit else args.train_limit}",
        "- equal-time budget = full's training time at equal steps (step time x steps); each "
        "pattern's step time (20th percentile of its per-step wall times in its equal-steps run, since load "
        "from other processes only adds time; train tok/s uses the same estimate) -> floor(budget / step time) steps, recorded in "
        "`study_grids/study_steps.json` (`--steps-from` replays it deterministically).",
        "- peak RSS = process VmHWM during training (reset via /proc/self/clear_refs; includes the Python "
        "process and data, so differences between rows matter more than levels); saved act = bytes of the tensors "
        "autograd saves for one training step; evict cache = decode cache bytes for "
        f"{args.sample_num} sequences with eviction (in brackets: keep-everything cache); "
        "parity = max |teacher_force(model, x) - model(x)| on test images (must be <= 1e-4).", "",
        "## Summary (test bits/dim; lower is better; best per column in bold)", "",
        summary_table(rows), "",
        "## Equal-time criterion (64x64, CPU)", "",
        *(f"- {n}" for n in notes or ["no 64x64 equal-time rows in this run"]), "",
        "## Findings", "", *findings(rows), *time_notes(rows), *ablation_notes(rows), "",
        "## Where and why sparse patterns lose", "", why_notes(rows),
        "## All runs", "", results_table(rows), "",
    ]
    if res["plan"]:
        lines += ["## Equal-time step counts", "", "```json", json.dumps(res["plan"], indent=1), "```", ""]
    text = "\n".join(lines)
    write_atomic(os.path.join(args.out, "study.md"), text)
    write_atomic(raw_path(args.out), json.dumps(dict(rows=rows, plan=res["plan"], criterion_held=held, criterion=notes,
                                                     command=cmd, seconds=res["seconds"], commit=res["commit"],
                                                     date=res["date"], threads=res["threads"]), indent=1, default=str))
    return text


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = resolve_args(argv)
    if args.report_only:
        argv = [a for a in argv if a != "--report-only"]
        with open(raw_path(args.out)) as f:
            old = json.load(f)
        text = write_report(args, dict(rows=old["rows"], plan=old["plan"], seconds=old["seconds"],
                                       commit=old["commit"], date=old["date"], threads=old["threads"]), argv)
        print(text)
        return 0
    res = run_study(args, on_progress=lambda partial: write_report(args, partial, argv))
    text = write_report(args, res, argv)
    print(text)
    bad = [r for r in res["rows"] if not (r["parity"] <= PARITY_TOL and math.isfinite(r["bpd"]))]
    if bad:
        print(f"study.py: {len(bad)} run(s) failed parity or gave non-finite bits/dim", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
