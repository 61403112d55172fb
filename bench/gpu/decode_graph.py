"""The GPU at its speed (issue 48): a decode step eager against its CUDA graph, one 16-image grid, and
training eager against torch.compile of the blocks. One device call of at most 5 minutes:

    python bench/gpu/decode_graph.py                  # on the GPU (device tool: timeout_s 300)
    python bench/gpu/decode_graph.py --dry-run        # CPU plumbing: tiny models, the static step eagerly
        [--presets moses256,brats] [--batches 1,16,64] [--steps 256] [--train-steps 20] [--budget 270]
        [--no-grid] [--out bench/results] [--stem decode_graph]

Decode, per preset and batch: ms per step of today's eager step (`ImageTransformer.step` through the
evicting caches, `imggen.sampling._pick`) and of the static step replayed as a CUDA graph
(`imggen.graphs`), over the first --steps positions with the same uniforms; the two must draw the
same tokens. The models have random weights (a step's time does not depend on them), float32 as
checkpoints load. Grid: `imggen.sample`'s path for 16 images of the first preset with the graph,
whole seconds, when the measured step time says it fits the budget.

Training: --train-steps steps of the first preset's model at its batch size (bf16 autocast, AdamW,
random tokens), eager and with each block under torch.compile; tokens/s and 6*P*tokens/s as a fraction
of the card's dense bf16 peak (989 TFLOP/s for H100 SXM and H200). The first compiled step's loss
must match the eager one's (bf16: 1e-2). Writes STEM.md and STEM.json under --out.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, os.path.dirname(HERE))

from harness import command_line, fmt, git_commit, machine, machine_line, md_table, out_dir, sync, write_results  # noqa: E402

PEAK_BF16_TFLOPS = 989.0  # dense bf16, H100 SXM / H200 (NVIDIA datasheets)
TINY = dict(height=8, width=8, dim=32, layers=2, heads=2)  # --dry-run's models


def make_model(name: str, dev, dry: bool, train: bool = False):
    from imggen.config import preset
    from imggen.model import ImageTransformer

    cfg = preset(name)
    m = cfg.model
    if dry:
        for k, v in TINY.items():
            setattr(m, k, v)
        m.window, m.radius = m.window and min(m.window, 16), m.radius and min(m.radius, 2)
    m.backend = "auto" if dev.type == "cuda" else "cpu"
    torch.manual_seed(0)
    model = ImageTransformer(m).to(dev)
    return (model.train() if train else model.eval()), cfg


@torch.no_grad()
def decode_row(name, model, batch: int, steps: int, graph: bool) -> dict:
    """ms/step eager and static (graph on CUDA, the static step eagerly elsewhere), same tokens?"""
    from imggen import graphs
    from imggen.decode import make_caches
    from imggen.sampling import _pick, uniforms

    dev = next(model.parameters()).device
    n = model.config.seq_len
    steps = min(steps, n)
    draws = uniforms(batch, n, 0).to(dev)
    caches, prev, eager_tokens = make_caches(model, batch), None, []
    model.step(None, 0, caches)  # first use: kernel checks, caches' plans
    caches = make_caches(model, batch)
    sync(dev)
    t0 = time.perf_counter()
    for t in range(steps):
        prev = _pick(model.step(prev, t, caches), 1.0, None, draws[:, t])
        eager_tokens.append(prev)
    sync(dev)
    eager_ms = (time.perf_counter() - t0) / steps * 1e3
    t_cap = time.perf_counter()
    dec = graphs.decoder(model, batch, "evict", 1.0, None, False, False, graph, draws, pick=_pick)
    sync(dev)
    capture_s = time.perf_counter() - t_cap
    t0 = time.perf_counter()
    for _ in range(steps):
        dec.step()
    sync(dev)
    static_ms = (time.perf_counter() - t0) / steps * 1e3
    same = bool(torch.equal(torch.stack(eager_tokens, 1), dec.tokens[:, :steps]))
    return {"preset": name, "batch": batch, "steps": steps, "eager_ms": eager_ms, "static_ms": static_ms,
            "graph": dec.graph is not None, "capture_s": capture_s, "speedup": eager_ms / static_ms,
            "same_tokens": same}


def grid_seconds(model, graph: bool) -> float:
    from imggen.sampling import generate

    dev = next(model.parameters()).device
    sync(dev)
    t0 = time.perf_counter()
    generate(model, 16, batch_size=16, seed=0, graph="on" if graph else "eager")
    sync(dev)
    return time.perf_counter() - t0


def train_rows(name: str, dev, dry: bool, steps: int) -> list[dict]:
    """tokens/s of `steps` optimizer steps, eager and with torch.compile per block."""
    import torch.nn.functional as F

    rows, first_loss = [], {}
    for mode in ("eager", "compile"):
        model, cfg = make_model(name, dev, dry, train=True)
        if mode == "compile":
            for blk in model.blocks:  # in place: the state_dict keys (checkpoints) stay as they are
                blk.compile(backend="eager" if dry else "inductor")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        b, n = cfg.train.batch_size if not dry else 2, model.config.seq_len
        g = torch.Generator().manual_seed(0)
        batches = [torch.randint(0, model.config.vocab, (b, n), generator=g).to(dev) for _ in range(2)]

        def step(x):
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                logits = model(x)
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x.reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            return loss

        t0 = time.perf_counter()
        first_loss[mode] = float(step(batches[0]))
        first_s = time.perf_counter() - t0
        for _ in range(2):
            step(batches[1])
        sync(dev)
        t0 = time.perf_counter()
        for _ in range(steps):
            step(batches[1])
        sync(dev)
        sec = time.perf_counter() - t0
        params = sum(p.numel() for p in model.parameters())
        tok_s = b * n * steps / sec
        rows.append({"mode": mode, "batch": b, "steps": steps, "first_step_s": first_s, "tokens_per_s": tok_s,
                     "tflops": 6 * params * tok_s / 1e12, "peak_fraction": 6 * params * tok_s / 1e12 / PEAK_BF16_TFLOPS,
                     "params": params, "first_loss": first_loss[mode]})
    ok = abs(first_loss["compile"] - first_loss["eager"]) <= 1e-2 * max(1.0, abs(first_loss["eager"]))
    for r in rows:
        r["loss_parity"] = ok
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="moses256,brats")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--train-steps", type=int, default=20)
    ap.add_argument("--budget", type=float, default=270.0, help="seconds: parts that would not fit are skipped")
    ap.add_argument("--no-grid", action="store_true")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny models, the static step without a graph")
    ap.add_argument("--out")
    ap.add_argument("--stem", default="decode_graph")
    a = ap.parse_args(argv)
    start = time.perf_counter()
    cuda = torch.cuda.is_available() and not a.dry_run
    if not cuda and not a.dry_run:
        print("decode_graph.py: no CUDA device here; --dry-run checks the plumbing on the CPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda" if cuda else "cpu")
    presets, batches = a.presets.split(","), [int(b) for b in a.batches.split(",")]
    res = {"machine": machine(gpu=cuda), "command": command_line("bench/gpu/decode_graph.py", argv),
           "commit": git_commit(), "dry_run": a.dry_run, "decode": [], "grid": None, "train": [], "skipped": []}
    left = lambda: a.budget - (time.perf_counter() - start)  # noqa: E731
    for name in presets:
        model, _ = make_model(name, dev, a.dry_run)
        for b in batches:
            if left() < 20:
                res["skipped"].append(f"decode {name} batch {b}")
                continue
            res["decode"].append(decode_row(name, model, b, a.steps, cuda))
            print(res["decode"][-1], flush=True)
        if name == presets[0] and not a.no_grid:
            rows = [r for r in res["decode"] if r["preset"] == name and r["batch"] <= 16]  # the grid's batch or below
            ms = max(rows, key=lambda r: r["batch"])["static_ms"] if rows else None
            need = (ms or 1e9) * model.config.seq_len / 1e3
            if ms is not None and need < left() - 60:
                res["grid"] = {"preset": name, "images": 16, "seconds": grid_seconds(model, cuda)}
                print(res["grid"], flush=True)
            else:
                res["skipped"].append(f"grid {name} (needs ~{need:.0f} s)")
        del model
    if left() > 60:
        res["train"] = train_rows(presets[0], dev, a.dry_run, a.train_steps)
    else:
        res["skipped"].append("training")
    md = [f"# Decode steps eager vs CUDA graph; training eager vs torch.compile{' (dry run, CPU)' if a.dry_run else ''}",
          "", f"`{res['command']}` at {res['commit']}; {machine_line(res['machine'])}", "",
          md_table(["preset", "batch", "steps", "eager ms/step", "graph ms/step", "speedup", "same tokens", "capture s"],
                   [[r["preset"], r["batch"], r["steps"], fmt(r["eager_ms"]), fmt(r["static_ms"]) + ("" if r["graph"] else " (no graph)"),
                     fmt(r["speedup"]), r["same_tokens"], fmt(r["capture_s"])] for r in res["decode"]])]
    if res["grid"]:
        md += ["", f"One grid of {res['grid']['images']} {res['grid']['preset']} images with the graph: "
                   f"{res['grid']['seconds']:.1f} s."]
    if res["train"]:
        md += ["", md_table(["training", "batch", "steps", "first step s", "tokens/s", "TFLOP/s (6PT)", "of peak",
                             "loss parity"],
                            [[r["mode"], r["batch"], r["steps"], fmt(r["first_step_s"]), f"{r['tokens_per_s']:.4g}",
                              fmt(r["tflops"]), f"{100 * r['peak_fraction']:.1f}%", r["loss_parity"]] for r in res["train"]])]
    if res["skipped"]:
        md += ["", "Not run (budget): " + "; ".join(res["skipped"])]
    write_results(out_dir(a.out), a.stem, res, "\n".join(md) + "\n")
    print("\n".join(md))
    bad = [r for r in res["decode"] if not r["same_tokens"]] or [r for r in res["train"] if not r["loss_parity"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
