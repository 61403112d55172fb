"""Decode-step linears through weight panels (imggen/decode/panels.py) vs the layers (MKL), on this CPU.

    python bench/panels.py [--threads 1,2] [--out bench/results/panels.md] [--quick]

* linears: the Linear layers of a brats/cifar-preset model (dim 256, 8 layers, 25 MB of fp32
  weights) applied to M rows, each weight once, as a decode step does: F.linear vs panel_linear;
  median of 15 passes;
* steps: model.step at batch 16 for models of growing weight size, panels on and off in turns of
  20 steps in one process (the machine's drift hits both alike); median step time;
* threads: model.step of the demo and brats presets at batch 1 and 4 on 1 vs 2 threads.
They choose imggen.decode.panels' constants ROWS_PER_THREAD (rows where panels stop winning) and
MIN_BYTES (model size where they start), and imggen.threads' second core for small batches.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import torch
import torch.nn as nn

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "bench"))

import imggen.decode.panels as panels  # noqa: E402
from imggen.config import preset  # noqa: E402
from imggen.decode import make_caches  # noqa: E402
from imggen.model import ImageTransformer  # noqa: E402
from harness import command_line, md_table, median_time, write_atomic  # noqa: E402


def linears(dim: int, layers: int, rows: list[int], reps: int) -> list[str]:
    mods = [nn.Linear(i, o) for _ in range(layers) for o, i in [(3 * dim, dim), (dim, dim), (4 * dim, dim), (dim, 4 * dim)]]
    mb = panels.linear_bytes(nn.ModuleList(mods)) / 1e6
    rows_out = []
    for m in rows:
        xs = {dim: torch.randn(m, dim), 4 * dim: torch.randn(m, 4 * dim)}
        store = {}
        with torch.no_grad():
            for mod in mods:
                torch.testing.assert_close(panels.panel_linear(mod, xs[mod.in_features], store), mod(xs[mod.in_features]))
            forced = panels.ROWS_PER_THREAD
            panels.ROWS_PER_THREAD = 1 << 30  # time the panels above their default range too
            try:
                a = median_time(lambda: [mod(xs[mod.in_features]) for mod in mods], reps, warmup=2)
                b = median_time(lambda: [panels.panel_linear(mod, xs[mod.in_features], store) for mod in mods], reps,
                                warmup=2)
            finally:
                panels.ROWS_PER_THREAD = forced
        rows_out.append([str(m), f"{a * 1e3:.2f}", f"{b * 1e3:.2f}", f"{a / b:.2f}x", ""])
    return md_table(["rows", "F.linear ms", "panels ms", "speed-up",
                     f"({mb:.0f} MB of weights, {torch.get_num_threads()} threads)"], rows_out).split("\n")


def steps(models: list[tuple[str, dict]], batches: list[int], modes: dict, rounds: int, per_round: int) -> list[str]:
    """Median decode-step time of each model and batch under two `modes` (label -> a function that
    applies it), taken in turns of `per_round` steps in one process."""
    (la, lb) = modes
    out = []
    limit, threads = panels.MIN_BYTES, torch.get_num_threads()
    for name, over in models:
        torch.manual_seed(0)
        cfg = dataclasses.replace(preset(name).model, **over)
        model = ImageTransformer(cfg).eval()
        mb = panels.linear_bytes(model) / 1e6
        for batch in batches:
            caches, prev, t = make_caches(model, batch), None, 0
            times = {la: [], lb: []}
            try:
                with torch.no_grad():
                    for _ in range(rounds):
                        for mode in times:
                            modes[mode]()
                            for i in range(per_round):
                                if t >= cfg.seq_len:
                                    caches, prev, t = make_caches(model, batch), None, 0
                                t1 = time.perf_counter()
                                prev = model.step(prev, t, caches).argmax(-1)
                                t += 1
                                if i >= 3:
                                    times[mode].append(time.perf_counter() - t1)
            finally:
                panels.MIN_BYTES = limit
                torch.set_num_threads(threads)
            a, b = (sorted(v)[len(v) // 2] for v in times.values())
            label = name + "".join(f" {k}={v}" for k, v in over.items())
            out.append([label, f"{mb:.1f} MB", str(batch), f"{a * 1e3:.2f}", f"{b * 1e3:.2f}", f"{a / b:.2f}x"])
    return md_table(["model", "linear weights", "batch", f"{la} ms/step", f"{lb} ms/step", "speed-up"], out).split("\n")


def _set(**kw):
    def apply():
        if "min_bytes" in kw:
            panels.MIN_BYTES = kw["min_bytes"]
        if "threads" in kw:
            torch.set_num_threads(kw["threads"])
    return apply


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--out", help="also write the tables to this markdown file")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test, not a measurement)")
    args = ap.parse_args(argv)
    if args.quick:
        dim, layers, rows, reps = 32, 1, [1, 4], 2
        models, rounds, per_round = [("demo", dict(dim=32, layers=1, heads=2, height=8, width=8))], 1, 5
        thread_models = models
    else:
        dim, layers, rows, reps = 256, 8, [1, 4, 16, 32, 64, 128], 15
        models = [("demo", {}), ("brats", dict(dim=128, layers=4, heads=4)), ("brats", dict(dim=192, layers=4, heads=6)),
                  ("brats", dict(dim=192, layers=8, heads=6)), ("brats", {}), ("cifar", {})]
        thread_models = [models[0], models[4]]  # demo, brats
        rounds, per_round = 12, 20
    lines = []
    for n in (int(x) for x in args.threads.split(",")):
        torch.set_num_threads(n)
        block = ([f"## {n} thread(s): linears", ""] + linears(dim, layers, rows, reps)
                 + ["", f"## {n} thread(s): decode steps, layers vs panels", ""]
                 + steps(models, [16], {"layers": _set(min_bytes=1 << 62), "panels": _set(min_bytes=0)}, rounds, per_round)
                 + [""])
        print("\n".join(block), flush=True)
        lines += block
    # sample.py's thread choice for small batches (imggen.threads.decode_tick), panels as chosen
    block = ["## decode steps, 1 vs 2 threads (panels where imggen.decode.panels picks them)", ""] + steps(
        thread_models, [1, 4], {"1 thread": _set(threads=1), "2 threads": _set(threads=2)}, rounds, per_round) + [""]
    print("\n".join(block), flush=True)
    lines += block
    if args.out:
        write_atomic(args.out, f"`{command_line('panels.py', argv)}`, {time.strftime('%Y-%m-%d %H:%M')}\n\n"
                     + "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
