"""local2d forward+backward on the cpu backend: 2-D query tiles vs band windows vs dense causal SDPA.

    python bench/local2d_tiles.py                  # 64x64, 128x128 (C=1), 64x64x3; fp32 and bf16
    python bench/local2d_tiles.py --reps 3 --no-peak
    python bench/local2d_tiles.py --crossover      # tiles vs band windows over image sizes (B=4)

One thread (torch.set_num_threads(1)) unless --threads. Each repeat times every method once, in
turn, so a busy machine slows them alike; the table gives medians and the ratios of medians.
"tiles" and "band" are imggen's cpu backend with its local2d tile path forced on / off (`tile=`);
the backend picks tiles by itself where they pay (imggen.attention.tiles.choose_tile). Dense causal SDPA is
`F.scaled_dot_product_attention(is_causal=True)`. Peak MB: growth of the resident set during one
forward+backward in a fresh process (bench/attention.py's method).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import imggen  # noqa: E402
from attention import _peak_here  # noqa: E402
from harness import cpu_model, md_table  # noqa: E402
from imggen.attention.blocked import cpu_attention, make_windows  # noqa: E402
from imggen.attention.tiles import TileWindows, choose_tile  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SIZES = [(64, 1), (128, 1), (64, 3)]  # (image side, channels)


def pattern(side, c, r):
    return imggen.make_pattern("local2d", height=side, width=side, channels=c, radius=r, shift=1)


def tile_of(p):
    return choose_tile(p, None)


def step(method, p, q, k, v):
    """One forward+backward."""
    if method == "sdpa":
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        o = cpu_attention(q, k, v, p, tile=tile_of(p) if method == "tiles" else None)
    o.backward(torch.ones_like(o))


def inputs(b, h, n, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, n, d, generator=g).to(dtype).requires_grad_() for _ in range(3)]


def medians(methods, p, qkv, reps):
    """{method: median seconds}, each repeat timing every method once (after one warm-up each)."""
    times = {m: [] for m in methods}
    for m in methods:
        step(m, p, *qkv)
    for _ in range(reps):
        for m in methods:
            t = time.perf_counter()
            step(m, p, *qkv)
            times[m].append(time.perf_counter() - t)
    return {m: statistics.median(ts) for m, ts in times.items()}


def peak_mb(method, side, c, dtype, args):
    cmd = [sys.executable, os.path.abspath(__file__), "--peak-child", method, str(side), str(c), dtype,
           "--radius", str(args.radius), "--heads", str(args.heads), "--dim", str(args.dim)]
    return float(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.split()[-1])


def table(args):
    rows = []
    for side, c in SIZES:
        p = pattern(side, c, args.radius)
        n = side * side * c
        for dname, dtype in DTYPES.items():
            qkv = inputs(1, args.heads, n, args.dim, dtype)
            t = medians(["tiles", "band", "sdpa"], p, qkv, args.reps)
            for m in ("tiles", "band", "sdpa"):
                mem = None if args.no_peak else peak_mb(m, side, c, dname, args)
                rows.append([f"{side}x{side}x{c}", str(n), dname, m + (f" {tile_of(p)}" if m == "tiles" else ""),
                             f"{t[m] * 1e3:.1f}", f"{t['sdpa'] / t[m]:.1f}x", f"{t['band'] / t[m]:.2f}x",
                             "-" if mem is None else f"{mem:.0f}"])
            print(md_table(["image", "N", "dtype", "method", "fwd+bwd ms", "SDPA / this", "band / this", "peak MB"],
                           rows[-3:]).split("\n", 2)[-1], flush=True)
    print(f"\nlocal2d fwd+bwd, r={args.radius}, B=1, H={args.heads}, D={args.dim}, shift=1; median of "
          f"{args.reps} repeats; {torch.get_num_threads()} thread(s), torch {torch.__version__}, {cpu_model()}")
    print(md_table(["image", "N", "dtype", "method", "fwd+bwd ms", "SDPA / this", "band / this", "peak MB"], rows))


def crossover(args):
    """Tiles vs band windows (B=4, H=4) over square image sides: where tiles start to pay."""
    rows = []
    for c in (1, 3):
        for side in (8, 16, 24, 32, 40, 48, 64):
            p = pattern(side, c, args.radius)
            tile = (2, 8) if c == 1 else (3, 4)
            tile = (tile[0], min(tile[1], side))
            qkv = inputs(4, args.heads, side * side * c, args.dim, torch.float32)
            t = {}
            for m, tl in (("tiles", tile), ("band", None)):
                def fn(a, b, v, tl=tl):
                    o = cpu_attention(a, b, v, p, tile=tl)
                    o.backward(torch.ones_like(o))
                fn(*qkv)
                ts = []
                for _ in range(args.reps):
                    s = time.perf_counter()
                    fn(*qkv)
                    ts.append(time.perf_counter() - s)
                t[m] = statistics.median(ts)
            auto = "tiles" if isinstance(make_windows(p, side * side * c, args.heads), TileWindows) else "band"
            rows.append([f"{side}x{side}x{c}", str(tile), f"{t['tiles'] * 1e3:.2f}", f"{t['band'] * 1e3:.2f}",
                         f"{t['band'] / t['tiles']:.2f}x", auto])
            print(" | ".join(rows[-1]), flush=True)
    print(md_table(["image", "tile", "tiles ms", "band ms", "band / tiles", "auto picks"], rows))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--radius", type=int, default=3)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-peak", action="store_true", help="skip the peak-memory column (one process per cell)")
    ap.add_argument("--crossover", action="store_true", help="tiles vs band windows over image sizes")
    ap.add_argument("--peak-child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.peak_child:
        method, side, c, dname = args.peak_child
        p = pattern(int(side), int(c), args.radius)
        n = int(side) ** 2 * int(c)
        print(_peak_here(lambda: step(method, p, *inputs(1, args.heads, n, args.dim, DTYPES[dname]))))
    elif args.crossover:
        crossover(args)
    else:
        table(args)


if __name__ == "__main__":
    main()
