"""Fashion-MNIST density, side by side: lossless codecs, a Gated PixelCNN and imggen, on the official
10,000 test images at 28x28 (issue 46; bench/RESULTS.md section 16).

    python bench/fashion.py codecs                                   # PNG, WebP, order-0, lzma
    python bench/fashion.py pixelcnn --minutes 60 --work /work/runs/pixelcnn   # snapshots at 15/30/60 min
    python bench/fashion.py score --imggen /work/runs/fashion --pixelcnn /work/runs/pixelcnn

`pixelcnn` trains bench/pixelcnn.py's Gated PixelCNN on the train split with the recipe of imggen's
`fashion` preset (batch 16, AdamW betas (0.9, 0.95), weight decay 0.01 on matrices, warmup 100 steps,
cosine to 0.1x, gradient clipping 1.0, bf16 autocast where imggen's `auto` picks it, the same batch
order), for a wall-clock budget: the cosine runs over the budget's time, and snapshots are saved when
the training time (saving excluded) passes each of --snapshots minutes. `score` computes every
model's per-image test bits/dim with imggen.eval.bpd (the code that scores imggen models; read back from
a test_bpd_N.npy beside the run or snapshot when it is newer than the weights) and paired
95% bootstrap intervals of each difference, and writes the table to bench/results/fashion.{md,json}.
"""
from __future__ import annotations

import argparse
import bz2
import io
import json
import lzma
import math
import os
import sys
import time
import zlib

import numpy as np

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH)
sys.path.insert(0, os.path.dirname(BENCH))

from harness import command_line, git_commit, machine, machine_line, md_table, out_dir, write_results  # noqa: E402


def test_images(limit: int | None = None, spec: str = "fashion-mnist") -> np.ndarray:
    from imggen.datasets import load_dataset

    return load_dataset(spec, height=28, width=28, channels=1).test[:limit]


# ------------------------------------------------------------------------------------------- codecs
def codec_bits(images: np.ndarray) -> dict:
    """Bits per pixel of uint8 images (N, 1, H, W) under lossless codecs, each as a user runs it."""
    from PIL import Image

    n_pix = images.size

    def per_image(fmt, **kw):
        total = 0
        for im in images[:, 0]:
            buf = io.BytesIO()
            Image.fromarray(im).save(buf, format=fmt, **kw)
            total += len(buf.getvalue())
        return 8 * total / n_pix

    counts = np.bincount(images.reshape(-1), minlength=256).astype(np.float64)
    p = counts[counts > 0] / n_pix
    raw = images.tobytes()
    return {"PNG level 9, per image": per_image("PNG", compress_level=9, optimize=True),
            "WebP lossless, per image": per_image("WEBP", lossless=True, quality=100, method=6),
            "order-0 entropy of the pixel values": float(-(p * np.log2(p)).sum()),
            "zlib -9 over the whole test set": 8 * len(zlib.compress(raw, 9)) / n_pix,
            "bzip2 -9 over the whole test set": 8 * len(bz2.compress(raw, 9)) / n_pix,
            "lzma -9e over the whole test set": 8 * len(lzma.compress(raw, preset=9 | lzma.PRESET_EXTREME)) / n_pix}


# ----------------------------------------------------------------------------------------- pixelcnn
def lr_at(elapsed: float, step: int, budget: float, lr: float, warmup: int = 100, min_ratio: float = 0.1):
    if step < warmup:
        return lr * (step + 1) / warmup
    frac = min(1.0, elapsed / budget)
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


KINDS = {"gated": "Gated PixelCNN", "pp": "PixelCNN++"}


def _pixelcnn_class(kind: str):
    if kind == "pp":
        from pixelcnnpp import PixelCNNPPConfig, PixelCNNPPModel
        return PixelCNNPPConfig, PixelCNNPPModel
    from pixelcnn import PixelCNNConfig, PixelCNNModel
    return PixelCNNConfig, PixelCNNModel


def train_pixelcnn(work: str, minutes: float, snapshots, lr: float = 1e-3, batch: int = 16, seed: int = 0,
                   cfg=None, data=None, log=print, warmup: int = 100,
                   precision: str = "auto", kind: str = "gated", ema: float = 0.0) -> list[str]:
    """Train a Gated PixelCNN (kind "gated") or a PixelCNN++ ("pp") for `minutes` of training time; a
    snapshot file at each of `snapshots` minutes (and at the end), of the weights' moving average when
    `ema` > 0 (Polyak averaging: imggen.training.average). Returns the snapshot paths."""
    import torch

    from imggen.precision import resolve
    from imggen.training.average import averaged, WeightAverage
    from imggen.training.batches import batch_indices

    config_cls, model_cls = _pixelcnn_class(kind)

    os.makedirs(work, exist_ok=True)
    if data is None:
        from imggen.datasets import load_dataset
        data = load_dataset("fashion-mnist", height=28, width=28, channels=1).train
    train = torch.from_numpy(np.ascontiguousarray(data)).reshape(len(data), -1)
    torch.manual_seed(seed)
    model = model_cls(cfg or config_cls())
    average = WeightAverage(model, ema) if ema else None
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95))
    bf16 = resolve(precision, "cpu")[0] == "bf16"
    budget, marks, paths = minutes * 60, sorted(set(list(snapshots) + [minutes])), []
    elapsed, step, history = 0.0, 0, []
    log(f"{KINDS[kind]}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, {'bf16' if bf16 else 'fp32'}, "
        f"{minutes} min, snapshots at {marks} min" + (f", weights averaged (decay {ema})" if ema else ""))
    while marks:
        t0 = time.perf_counter()
        x = train[batch_indices(step, batch, len(train), seed)].long()
        for g in opt.param_groups:
            g["lr"] = lr_at(elapsed, step, budget, lr, warmup)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(x, nll=True).float().mean()
        if not torch.isfinite(loss):
            raise RuntimeError(f"pixelcnn: loss {float(loss)} at step {step}")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if average is not None:
            average.update(step)
        step += 1
        elapsed += time.perf_counter() - t0
        history.append(float(loss.detach()) / math.log(2))
        if step % 100 == 0:
            log(f"step {step} {elapsed / 60:.1f} min train bpd {np.mean(history[-100:]):.3f}")
        if elapsed >= marks[0] * 60:
            m = marks.pop(0)
            path = os.path.join(work, f"{'pixelcnnpp' if kind == 'pp' else 'pixelcnn'}_{m:g}min.pt")
            with averaged(average):
                torch.save({**model.state(), "step": step, "minutes": m, "train_seconds": elapsed, "kind": kind,
                            "ema": ema}, path + ".tmp")
            os.replace(path + ".tmp", path)  # atomic: a snapshot is whole or absent
            paths.append(path)
            log(f"snapshot {path} at step {step}")
    return paths


def load_pixelcnn(path: str):
    import torch

    state = torch.load(path, map_location="cpu", weights_only=True)
    return _pixelcnn_class(state.get("kind", "gated"))[1].from_state(state).eval(), state


# -------------------------------------------------------------------------------------------- score
def paired(a, b, resamples: int = 2000, seed: int = 0) -> dict:
    """Mean of a - b over paired items with a 95% percentile bootstrap interval."""
    from imggen.eval.bpd import bootstrap_ci

    d = np.asarray(a, np.float64) - np.asarray(b, np.float64)
    return {"mean": float(d.mean()), "ci95": list(bootstrap_ci(d, resamples, seed))}


def scored(cache: str, source: str, compute) -> np.ndarray:
    """Per-image test bits/dim from `cache` (an .npy this code or the lever tables wrote) when it is newer than
    `source` (a snapshot file, or a run's checkpoints folder and everything in it), else compute() saved there."""
    files = [os.path.join(d, f) for d, _, fs in os.walk(source) for f in fs] or [source]  # a file walks to nothing
    if os.path.exists(cache) and os.path.getmtime(cache) > max(map(os.path.getmtime, files)):
        return np.load(cache)
    v = np.asarray(compute(), np.float64)
    np.save(cache + ".tmp.npy", v)
    os.replace(cache + ".tmp.npy", cache)
    return v


def score(args, argv=None) -> None:
    import torch

    import imggen
    from imggen.eval.bpd import bootstrap_ci, per_image_bits_per_dim

    torch.set_grad_enabled(False)
    images = test_images(args.limit)
    rows, per = [], {}
    for run in args.imggen:
        model = imggen.load_model(run).eval()
        name = f"imggen {os.path.basename(os.path.normpath(run))}"
        per[name] = scored(os.path.join(run, f"test_bpd_{len(images)}.npy"), os.path.join(run, "checkpoints"),
                           lambda: per_image_bits_per_dim(model, images, batch_size=64, progress=True))
        rows.append((name, model.config.attention, sum(p.numel() for p in model.parameters())))
    snapshots = [(path, *load_pixelcnn(path)) for path in args.pixelcnn_snapshots]
    for path, model, state in sorted(snapshots, key=lambda s: s[2]["minutes"]):
        name = f"{KINDS[state.get('kind', 'gated')]}, {state['minutes']:g} min ({state['step']} steps)"
        per[name] = scored(f"{path}.test_bpd_{len(images)}.npy", path,
                           lambda: per_image_bits_per_dim(model, images, batch_size=64, progress=True))
        rows.append((name, "-", sum(p.numel() for p in model.parameters())))
    codecs = codec_bits(images)
    ref = rows[0][0] if rows else None
    table = []
    for name, attn, params in rows:
        v = per[name]
        d = paired(v, per[ref]) if name != ref else None
        table.append([name, f"{params / 1e6:.2f}M", f"{v.mean():.3f}",
                      "{:.3f} to {:.3f}".format(*bootstrap_ci(v, 2000)),
                      "-" if d is None else "{:+.3f} ({:+.3f} to {:+.3f})".format(d["mean"], *d["ci95"])])
    for name, bits in codecs.items():
        table.append([name, "-", f"{bits:.3f}", "-", "-"])
    m = machine(gpu=False)
    md = "\n".join([
        f"# Fashion-MNIST density: {len(images)} official test images, 28x28, bits per dim (= per pixel)", "",
        f"`{command_line('fashion.py', argv)}` at {git_commit()}, {time.strftime('%Y-%m-%d')}; {machine_line(m)}.",
        "", md_table(["model / codec", "params", "bits/dim", "95% interval", f"paired vs {ref}"], table), ""])
    data = {"n_images": len(images), "codecs": codecs, "per_image": {k: v.tolist() for k, v in per.items()},
            "rows": table, "machine": m, "commit": git_commit()}
    for p in write_results(out_dir(args.out), args.stem, data, md):
        print("wrote", p)
    print(md)


# ------------------------------------------------------------------------- equal-time tables
# Rows: (label, overrides of the tables' base, TABLE_BASE below). The time rule, the same for every model here and in
# `score`: training-step time only. Each imggen row gets floor(budget / its step time) steps, the step
# time measured up front on one batch; the PixelCNNs train until their summed step time passes the
# budget. No model is charged for validation, checkpoints or sample grids.
PATTERNS = [("full", {"model.attention": "full"}),
            ("band, 1 row (28)", {"model.attention": "band", "model.window": 28}),
            ("band, 2 rows (56)", {"model.attention": "band", "model.window": 56}),
            ("local2d r3", {"model.attention": "local2d"}), ("strided 28", {"model.attention": "strided"}),
            ("local2d r3 + band 56 (preset)", {})]
# The recipe, lever by lever (issue 54). A run with --train.ema scores twice: its model (the average)
# and the trained weights of its state.pt (the row "... , trained weights"), which are those of the same
# run without the average (the average never feeds back into training).
LEVERS = [("preset + EMA 0.995", {"train.ema": 0.995}),
          ("mixture 10 + EMA 0.995", {"model.mixture": 10, "train.ema": 0.995}),
          # on the preset's softmax head (the mixture lost, RESULTS 18): the optimisation and the shape
          ("lr 4e-3", {"train.lr": 4e-3}),
          ("lr 1e-3", {"train.lr": 1e-3}),
          ("batch 32", {"train.batch_size": 32}),
          ("batch 8", {"train.batch_size": 8}),
          ("dim 160 x 5", {"model.dim": 160, "model.layers": 5}),
          ("dim 96 x 8", {"model.dim": 96, "model.layers": 8}),
          ("dim 160 x 5 + lr 4e-3 + EMA 0.999 (the preset since 2026-12-07)",
           {"model.dim": 160, "model.layers": 5, "train.lr": 4e-3, "train.ema": 0.999}),
          # twice the parameters for about 1.2x the step time on the 2-core Xeon (the step is not bound by width)
          ("dim 256 x 4 + lr 4e-3 + EMA 0.999",
           {"model.dim": 256, "model.layers": 4, "train.lr": 4e-3, "train.ema": 0.999})]
# Both tables' "preset" is the `fashion` preset as it was when they were first measured (RESULTS 16 / 18),
# so their rows mean what they meant then: these are its values where today's preset differs.
TABLE_BASE = {"model.dim": 128, "model.layers": 6, "train.lr": 2e-3, "train.ema": 0.0}


def row_config(overrides: dict, steps: int = 1, spec: str = "fashion-mnist"):
    from imggen.config import apply_override, preset

    cfg = preset("fashion")
    cfg.data.spec = cfg.data.spec if spec is None else spec
    for k, v in {**TABLE_BASE, **overrides}.items():
        apply_override(cfg, k, str(v))
    every = max(1, steps)
    cfg.train.steps, cfg.train.eval_every, cfg.train.ckpt_every = every, every, every
    cfg.train.warmup, cfg.train.eval_images, cfg.train.grid_time_frac = min(100, every // 10), 500, 0.0
    return cfg.validate()


def step_shape(cfg) -> str:
    """What a step's time depends on: the model, the batch size and the precision (not lr, EMA, seed)."""
    import dataclasses

    return json.dumps([dataclasses.asdict(cfg.model), cfg.train.batch_size, cfg.train.precision], sort_keys=True)


def base_line() -> str:
    """The tables' base model and recipe, in words."""
    c = row_config({})
    return (f"dim {c.model.dim}, {c.model.layers} layers, {c.model.heads} heads, batch {c.train.batch_size}, "
            f"lr {c.train.lr:g}{f', EMA {c.train.ema:g}' if c.train.ema else ''}")


def trained_weights_model(run: str):
    """The run's model with the trained weights of its state.pt (a --train.ema run), else None."""
    import imggen
    from imggen import checkpoint as ck
    from imggen.training.average import load_trained

    state = ck.load_state(ck.resolve(run))
    if "trained" not in state:
        return None
    model = imggen.load_model(run)
    load_trained(dict(model.named_parameters()), state["trained"])
    return model.eval()


def equal_time(args, argv, rows, title: str) -> None:
    """Each row trained for the same training-step time, then scored on the same test images, paired."""
    import torch

    from imggen.eval.bpd import bootstrap_ci, per_image_bits_per_dim
    from imggen.training import train
    from imggen.training.batches import load_data
    from moses_patterns import config_step_seconds

    chosen = [r for r in rows if not args.only or r[0] in args.only]
    os.makedirs(args.work, exist_ok=True)
    times_path = os.path.join(args.work, "step_seconds.json")
    step_s = json.load(open(times_path)) if os.path.exists(times_path) else {}
    shape = {label: step_shape(row_config(over)) for label, over in rows}
    for label, over in chosen:  # all timed up front, before any training
        if label not in step_s:  # rows that step the same model on the same batch share one timing
            same = [step_s[k] for k in step_s if shape.get(k) == shape[label]]
            step_s[label] = same[0] if same else config_step_seconds(row_config(over), args.threads, args.reps)
            print(f"{label}: {step_s[label]:.3f} s a step{' (timed with a row of the same shape)' if same else ''}",
                  flush=True)
            with open(times_path + ".tmp", "w") as f:
                json.dump(step_s, f, indent=1)
            os.replace(times_path + ".tmp", times_path)
    torch.set_num_threads(args.threads)
    splits = None
    images = test_images(args.limit, args.data)
    table_rows, per = [], {}
    for label, over in chosen:
        steps = max(1, int(args.minutes * 60 // step_s[label]))
        run = os.path.join(args.work, label.split(" (")[0].replace(" ", "_").replace(",", ""))
        cached = os.path.join(run, f"test_bpd_{len(images)}.npy")
        cached_trained = os.path.join(run, f"test_bpd_trained_{len(images)}.npy")
        if not os.path.exists(cached):
            if splits is None:
                splits, _ = load_data(row_config({}, spec=args.data), progress=False)
                splits["test"] = splits["test"][: len(images)]
            t0 = time.time()
            train(row_config(over, steps, args.data), run, overwrite=True, data=splits, progress=False)
            wall = time.time() - t0
            with torch.no_grad():
                trained = trained_weights_model(run)
                if trained is not None:
                    np.save(cached_trained, per_image_bits_per_dim(trained, images, batch_size=64))
                model = __import__("imggen").load_model(run).eval()
                np.save(cached, per_image_bits_per_dim(model, images, batch_size=64))
            with open(os.path.join(run, "wall_s.txt"), "w") as f:
                f.write(f"{wall:.0f}\n")
        metrics = json.load(open(os.path.join(run, "metrics.json")))
        wall = float(open(os.path.join(run, "wall_s.txt")).read())
        if os.path.exists(cached_trained):
            name = label.split(" + EMA")[0] if " + EMA" in label else f"{label}, trained weights"
            per[name] = np.load(cached_trained)
            table_rows.append((name, label, steps, wall, None))
        per[label] = np.load(cached)
        table_rows.append((label, label, steps, wall, metrics.get("val_bpd")))
    ref = table_rows[0][0]
    best = min(per, key=lambda k: per[k].mean())
    table = []
    for name, label, steps, wall, val in table_rows:
        v = per[name]

        def vs(other):
            if name == other:
                return "-"
            d = paired(v, per[other])
            return "{:+.3f} ({:+.3f} to {:+.3f})".format(d["mean"], *d["ci95"])
        table.append([name, f"{step_s[label]:.3f}", steps, f"{wall / 60:.1f}", "-" if val is None else f"{val:.3f}",
                      f"{v.mean():.3f}", "{:.3f} to {:.3f}".format(*bootstrap_ci(v, 2000)), vs(ref), vs(best)])
    m = machine(gpu=False)
    md = "\n".join([
        f"# Fashion-MNIST: {title} at equal CPU time ({args.minutes:g} min of training steps each)", "",
        f"`{command_line('fashion.py', argv)}` at {git_commit()}, {time.strftime('%Y-%m-%d')}; {machine_line(m)}.", "",
        f"The preset's model ({base_line()}, bf16 where `auto` picks it) "
        "with each row's changes. Time rule: training-step time only; each row gets floor(budget / its step time) "
        f"steps, the step time the best of {args.reps} steps on one random batch with {args.threads} threads (rows "
        "of the same model and batch share one timing), all measured before any training, so a busy box changes "
        "the wall time, not the budget. Warm-up steps/10 (at "
        "most 100), cosine to 0.1x. A row without its own step time is the trained weights of the EMA run above "
        f"it (the same training). Test bits/dim on the first {len(images)} official test images; intervals: 95% "
        "bootstrap (2,000 resamples) over images, paired for the differences (same images).", "",
        md_table(["row", "step s", "steps", "train wall min", "val bits/dim (500)", "test bits/dim",
                  "95% interval", f"paired vs {ref}", f"paired vs {best} (best)"], table), ""])
    data = {"n_images": len(images), "minutes": args.minutes, "step_s": step_s, "rows": table,
            "per_image": {k: v.tolist() for k, v in per.items()}, "machine": m, "commit": git_commit()}
    for p in write_results(out_dir(args.out), args.stem, data, md):
        print("wrote", p)
    print(md)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="part", required=True)
    c = sub.add_parser("codecs", help="bits per pixel of lossless codecs on the test images")
    c.add_argument("--limit", type=int, default=None)
    p = sub.add_parser("pixelcnn", help="train the Gated PixelCNN or the PixelCNN++ for a time budget")
    p.add_argument("--kind", choices=sorted(KINDS), default="gated", help="gated: Gated PixelCNN; pp: PixelCNN++")
    p.add_argument("--ema", type=float, default=None, help="Polyak averaging decay (default: 0.9995 for pp, none "
                   "for gated, as their papers)")
    p.add_argument("--work", required=True)
    p.add_argument("--minutes", type=float, default=60)
    p.add_argument("--snapshots", default="15,30", help="comma-separated minutes")
    p.add_argument("--lr", type=float, default=1e-3)
    s = sub.add_parser("score", help="per-image test bits/dim of imggen runs and PixelCNN snapshots, paired")
    s.add_argument("--imggen", nargs="*", default=[], help="imggen run folders (the first is the reference)")
    s.add_argument("--pixelcnn", dest="pixelcnn_snapshots", nargs="*", default=[], help="snapshot files")
    s.add_argument("--limit", type=int, default=None)
    s.add_argument("--out", default=None)
    s.add_argument("--stem", default="fashion")
    for part, what in (("patterns", "imggen's attention patterns"), ("levers", "the training recipe, lever by lever")):
        t = sub.add_parser(part, help=f"{what} at equal CPU time, paired test bits/dim")
        t.add_argument("--work", required=True, help="run folders (a row whose scores are there is not retrained)")
        t.add_argument("--minutes", type=float, default=15)
        t.add_argument("--limit", type=int, default=2000, help="test images scored (default the first 2000)")
        t.add_argument("--only", nargs="*", default=None, help="row labels (default all)")
        t.add_argument("--threads", type=int, default=2)
        t.add_argument("--data", default="fashion-mnist", help="data spec (default fashion-mnist)")
        t.add_argument("--reps", type=int, default=3)
        t.add_argument("--out", default=None)
        t.add_argument("--stem", default=f"fashion_{part}")
    args = ap.parse_args(argv)
    if args.part == "codecs":
        for k, v in codec_bits(test_images(args.limit)).items():
            print(f"{k:40s} {v:.3f}")
    elif args.part == "pixelcnn":
        ema = args.ema if args.ema is not None else (0.9995 if args.kind == "pp" else 0.0)
        train_pixelcnn(args.work, args.minutes, [float(m) for m in args.snapshots.split(",") if m], lr=args.lr,
                       kind=args.kind, ema=ema)
    elif args.part == "patterns":
        equal_time(args, argv, PATTERNS, "attention patterns")
    elif args.part == "levers":
        equal_time(args, argv, LEVERS, "the training recipe")
    else:
        score(args, argv)


if __name__ == "__main__":
    main()
