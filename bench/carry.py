"""Does the weight average carry to the other presets? (issue 54 item 6)

    python bench/carry.py --preset demo --ema 0.99 --work /work/runs/carry --out bench/results

One training of the preset with `--train.ema D`: its checkpoint's model is the average and its
state.pt holds the trained weights of the same training, so the two are the preset with and
without the average at exactly equal steps (the average never feeds back into training). Both are
scored on the val split with the code that scores every run (imggen.eval.bpd.token_bits_per_dim,
float32, the task's own inputs), paired over images with a 95% bootstrap interval, and a grid of
samples is drawn from each with the same seed (generation presets), so the grids differ only by
the weights. Writes bench/results/carry_<preset>.{md,json} and carry_<preset>_{average,trained}.png.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH)
sys.path.insert(0, os.path.dirname(BENCH))

from harness import command_line, git_commit, machine, machine_line, md_table, out_dir, write_results  # noqa: E402


def preset_with_average(name: str, ema: float, steps: int | None = None):
    from imggen.config import apply_override, preset

    cfg = preset(name)
    apply_override(cfg, "train.ema", str(ema))
    if steps is not None:
        apply_override(cfg, "train.steps", str(steps))
    return cfg.validate()


def val_bits(model, cfg, splits, limit: int | None) -> np.ndarray:
    """Per-image val bits/dim of `model` by train.py's own scoring code, in float32."""
    from imggen.training.batches import split_bits

    return split_bits(cfg, model, splits, "val", limit)


def grid(model, cfg, path: str, num: int) -> str:
    """`num` samples from the run's seed -> path (generation presets only)."""
    from imggen.images import image_scale, save_grid
    from imggen.sampling import detokenize, sample

    imgs = detokenize(model, sample(model, num, seed=cfg.train.seed)).numpy()
    save_grid(imgs, path, scale=image_scale(cfg.model.width))
    return path


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", required=True)
    ap.add_argument("--ema", type=float, default=0.99, help="decay of the average (default 0.99)")
    ap.add_argument("--steps", type=int, default=None, help="override the preset's steps (default: its own)")
    ap.add_argument("--work", required=True, help="run folders go to WORK/<preset>")
    ap.add_argument("--val", type=int, default=None, help="val images scored (default all)")
    ap.add_argument("--num", type=int, default=16, help="samples in each grid")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import imggen
    from fashion import paired, trained_weights_model
    from imggen.eval.bpd import bootstrap_ci
    from imggen.training import train
    from imggen.training.batches import load_data

    cfg = preset_with_average(args.preset, args.ema, args.steps)
    run = os.path.join(args.work, args.preset)
    t0 = time.time()
    if not os.path.exists(os.path.join(run, "metrics.json")):
        train(cfg, run, overwrite=True, progress=False)
    wall = time.time() - t0
    splits, _ = load_data(cfg, progress=False)
    average, trained = imggen.load_model(run).eval(), trained_weights_model(run)
    per = {"trained weights": val_bits(trained, cfg, splits, args.val),
           f"average (EMA {args.ema:g})": val_bits(average, cfg, splits, args.val)}
    out = out_dir(args.out)
    grids = {}
    if cfg.train.task == "generate":
        for key, model in (("trained", trained), ("average", average)):
            grids[key] = grid(model, cfg, str(out / f"carry_{args.preset}_{key}.png"), args.num)
    ref = "trained weights"
    rows = []
    for name, v in per.items():
        d = "-" if name == ref else "{:+.4f} ({:+.4f} to {:+.4f})".format(
            (p := paired(v, per[ref]))["mean"], *p["ci95"])
        rows.append([name, cfg.train.steps, f"{v.mean():.4f}", "{:.4f} to {:.4f}".format(*bootstrap_ci(v, 2000)), d])
    m = machine(gpu=False)
    md = "\n".join([
        f"# `{args.preset}` with and without a weight average at equal steps", "",
        f"`{command_line('carry.py', argv)}` at {git_commit()}, {time.strftime('%Y-%m-%d')}; {machine_line(m)}; "
        f"training {wall / 60:.1f} min wall (0 when the run folder was already complete).", "",
        f"One run of `--preset {args.preset} --train.ema {args.ema:g}`: the average is its checkpoint's model, the "
        "trained weights its state.pt's, the same training. Val bits/dim (float32) on "
        f"{len(next(iter(per.values())))} val images; intervals: 95% bootstrap over images, paired for the difference.",
        "", md_table(["weights", "steps", "val bits/dim", "95% interval", f"paired vs {ref}"], rows), "",
        *([f"Grids ({args.num} samples, seed {cfg.train.seed}): " + ", ".join(f"{k}: `{os.path.basename(p)}`"
                                                                           for k, p in grids.items()), ""] if grids else [])])
    data = {"preset": args.preset, "ema": args.ema, "steps": cfg.train.steps, "wall_s": wall, "rows": rows,
            "per_image": {k: v.tolist() for k, v in per.items()}, "grids": grids, "machine": m, "commit": git_commit()}
    for p in write_results(out, f"carry_{args.preset}", data, md):
        print("wrote", p)
    print(md)
    print(json.dumps({k: float(v.mean()) for k, v in per.items()}))


if __name__ == "__main__":
    main()
