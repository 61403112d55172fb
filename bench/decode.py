"""Decode benchmark (CPU): eviction caches vs the full cache vs no-cache recomputation.

    python bench/decode.py [--batch 8] [--steps 256] [--sizes 32,64,128] [--out bench/results/decode.md]

One fixed small grayscale model per pattern (dim 64, 2 layers, 4 heads, 8 bits; band window 256,
other patterns at their per-size defaults: one row for blocks / windows / strides, local2d radius 3).
For every pattern and image size:
* evict:  the pattern's eviction cache (imggen.decode). The prefix 0..n-steps-1 is written into the
          cache by `prefill` from random q/k/v (values do not change the cost), then the last `steps`
          positions are decoded with `model.step`.
* full:   the same pattern with every position kept (keep_all=True): reads slots [0, t], masked by
          the same position arithmetic. The plain full KV cache.
* recompute: no cache, `model(tokens[:, :t + 1])` for each new token (batch 1, a few steps only,
          at t = n - steps/2, after one warm-up forward of that length).
Tokens/s = batch * steps / seconds (best of 4 chunks, to damp other processes on a shared CPU).
Cache bytes = k, v (+ diffusion states), positions and slot tables over all layers (preallocated, so
peak = allocated).
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import command_line, cpu_model, md_row, md_table, repeat, write_atomic  # noqa: E402
from imggen.config import ModelConfig  # noqa: E402
from imggen.decode import make_cache  # noqa: E402
from imggen.model import ImageTransformer  # noqa: E402

PATTERNS = ["full", "band", "local2d", "bigbird", "diffuser", "strided"]


def model_for(kind: str, size: int) -> ImageTransformer:
    torch.manual_seed(0)
    cfg = ModelConfig(height=size, width=size, channels=1, bits=8, dim=64, layers=2, heads=4,
                      attention=kind, window=256 if kind == "band" else None, backend="cpu")
    return ImageTransformer(cfg).eval()


def caches_for(model, batch: int, keep_all: bool):
    cfg = model.config
    return [make_cache(p, batch, cfg.heads, cfg.dim // cfg.heads, cfg.seq_len, keep_all=keep_all)
            for p in model.patterns]


def fill(caches, model, n0: int, gen: torch.Generator) -> None:
    """What a prefill of n0 tokens writes (retained positions into their slots), from random q, k, v."""
    cfg = model.config
    for c in caches:
        shape = (c.batch, cfg.heads, n0, cfg.dim // cfg.heads)
        c.prefill(*(torch.randn(shape, generator=gen) for _ in range(3)))


def decode_rate(model, batch: int, steps: int, keep_all: bool, chunks: int = 4) -> tuple[float, int]:
    n = model.config.seq_len
    gen = torch.Generator().manual_seed(0)
    caches = caches_for(model, batch, keep_all)
    fill(caches, model, n - steps, gen)
    prev = torch.randint(0, model.config.vocab, (batch,), generator=gen)
    per, t = steps // chunks, n - steps

    def chunk():
        nonlocal prev, t
        for _ in range(per):
            prev = model.step(prev, t, caches).argmax(-1)
            t += 1
    return batch * per / repeat(chunk, chunks, warmup=0).best, sum(c.nbytes() for c in caches)


@torch.no_grad()
def recompute_rate(model, steps: int, at: int) -> float:
    """No cache: the next token at position `at` costs a forward over tokens 0..at. One untimed run
    first, so the blocked backend's per-length plan is cached and not charged to the timed steps."""
    tokens = torch.randint(0, model.config.vocab, (1, at + 1), generator=torch.Generator().manual_seed(0))
    return 1 / repeat(lambda: model(tokens)[:, -1].argmax(-1), steps, warmup=1).best


def recompute_plan_bytes(model, n: int) -> int:
    """Bytes of the blocked CPU backend's masks for a forward of n tokens (largest layer)."""
    from imggen.attention.blocked import make_windows

    worst = 0
    for p in model.patterns:
        groups = p.head_groups(model.config.heads) or [(range(model.config.heads), p)]
        for heads, sub in groups:
            if sub.columns() is not None or (sub.band() and sub.band().width >= n):
                continue  # column attention / SDPA: no masks
            w = make_windows(sub, n, len(heads))
            masks = [w.first, w.steady] if hasattr(w, "steady") else [w.bias]
            worst = max(worst, sum(m.numel() * m.element_size() for m in masks))
    return worst


def fmt_bytes(b: int) -> str:
    return f"{b / 2**20:.2f} MiB" if b >= 2**20 else f"{b / 2**10:.1f} KiB"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=8, help="images decoded in parallel (default 8)")
    ap.add_argument("--steps", type=int, default=256, help="decode steps timed at the end of the image (default 256)")
    ap.add_argument("--recompute-steps", type=int, default=2, help="no-cache steps timed (default 2)")
    ap.add_argument("--sizes", default="32,64,128", help="image sizes (default 32,64,128)")
    ap.add_argument("--patterns", default=",".join(PATTERNS))
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: stable on a shared CPU)")
    ap.add_argument("--max-plan-gib", type=float, default=1.0,
                    help="skip no-cache recomputation when the blocked backend's plan exceeds this (default 1)")
    ap.add_argument("--out", default=None, help="also write the table to this markdown file")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    sizes = [int(s) for s in args.sizes.split(",")]
    header = ["pattern", "image", "evict tok/s", "full-cache tok/s", "recompute tok/s", "evict / full",
              "evict / recompute", "evict cache", "full cache", "full / evict bytes"]
    rows = []
    print(md_table(header, []), flush=True)
    t_start = time.time()
    results = {}
    for kind in args.patterns.split(","):
        for size in sizes:
            model = model_for(kind, size)
            ev_rate, ev_bytes = decode_rate(model, args.batch, args.steps, keep_all=False)
            full_rate, full_bytes = decode_rate(model, args.batch, args.steps, keep_all=True)
            at = model.config.seq_len - args.steps // 2
            plan = recompute_plan_bytes(model, at + 1)
            if plan <= args.max_plan_gib * 2**30:
                rc_rate = recompute_rate(model, args.recompute_steps, at)
                rc, ratio = f"{rc_rate:,.2f}", f"{ev_rate / rc_rate:,.0f}x"
            else:  # the blocked backend's plan alone would not fit: not run
                rc, ratio = f"not run (plan {plan / 2**30:.0f} GiB)", "-"
            row = [kind, f"{size}x{size}", f"{ev_rate:,.0f}", f"{full_rate:,.0f}", rc, f"{ev_rate / full_rate:.1f}x",
                   ratio, fmt_bytes(ev_bytes), fmt_bytes(full_bytes), f"{full_bytes / ev_bytes:.1f}x"]
            rows.append(row)
            results[(kind, size)] = dict(ev=ev_rate, full=full_rate, rc=rc_rate if rc[0].isdigit() else None,
                                         ev_bytes=ev_bytes, full_bytes=full_bytes)
            print(md_row(row), flush=True)
    took = time.time() - t_start
    meta = (f"- command: `{command_line('decode.py', argv)}`\n"
            f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}\n"
            f"- CPU: {cpu_model()}, {os.cpu_count()} logical CPUs; torch {torch.__version__}, {args.threads} "
            f"thread(s); run took {took:.0f} s\n"
            f"- batch {args.batch}; last {args.steps} positions decoded after a prefix fill; "
            f"recompute: batch 1, forward over the first n - steps/2 positions, best of "
            f"{args.recompute_steps} timed runs after one warm-up run")
    checks = targets(results)
    print(meta + "\n" + checks)
    if args.out:
        notes = ""
        if os.path.exists(args.out):
            with open(args.out) as f:
                old = f.read()
            if "\n## Notes" in old:
                notes = old[old.index("\n## Notes"):]
        write_atomic(args.out, "# Decode benchmark (CPU)\n\nWritten by `bench/decode.py`; the Notes section is kept "
                     "across runs.\n\n" + md_table(header, rows) + "\n\n" + meta + "\n\n## Targets (band w=256)\n\n"
                     + checks + "\n" + notes)
    return 0


def targets(r: dict) -> str:
    """The decode targets, checked on this run's numbers (band window 256)."""
    out = []

    def line(ok, text):
        out.append(f"- {'met' if ok else 'MISSED'}: {text}")

    if ("band", 64) in r and ("band", 128) in r:
        a, b = r[("band", 64)]["ev_bytes"], r[("band", 128)]["ev_bytes"]
        line(a == b, f"band cache bytes constant from 64x64 to 128x128 ({a:,} -> {b:,} bytes)")
    if ("band", 128) in r:
        x = r[("band", 128)]
        red = x["full_bytes"] / x["ev_bytes"]
        line(red >= 30, f"band cache >= 30x smaller than the full cache at 128x128 ({red:.1f}x)")
        sp = x["ev"] / x["full"]
        line(sp >= 3, f"band decode >= 3x full-cache decode tokens/s at 128x128 ({sp:.1f}x)")
        if x["rc"]:
            sp = x["ev"] / x["rc"]
            line(sp >= 50, f"band decode >= 50x no-cache recomputation at 128x128 ({sp:,.0f}x)")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
