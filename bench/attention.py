"""CPU attention benchmark: imggen `cpu` backend vs dense causal SDPA and FlexAttention, one run.

    python bench/attention.py                      # N in {4096, 16384}, H=4, D=32
    python bench/attention.py --n 4096 --reps 2    # quicker

Forward and forward+backward wall time (median over reps, after a warm-up) and peak memory of one
forward+backward (growth of the peak resident set of a fresh process, reset before the call, with
glibc's mmap threshold fixed so freed blocks leave; Linux only).
FlexAttention (imggen's flex backend: torch.compile'd, same mask) is timed forward only: it has no CPU
backward.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import subprocess
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import imggen  # noqa: E402
from harness import cpu_model, md_table, median_time, write_atomic  # noqa: E402


def patterns(n: int, window: int, radius: int) -> dict:
    side = int(round(n ** 0.5))
    return {
        "band": imggen.make_pattern("band", window=window),
        "local2d": imggen.make_pattern("local2d", height=side, width=n // side, channels=1, radius=radius),
    }


def inputs(n, h, d, seed=0, grad=True):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, h, n, d, generator=g).requires_grad_(grad) for _ in range(3)]


def run(method: str, pat, q, k, v, backward: bool):
    if method == "sdpa":
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        o = imggen.sparse_attention(q, k, v, pat, backend="cpu")
    if backward:
        o.backward(torch.ones_like(o))
    return o


def flex_forward(pat, n, h, d):
    """FlexAttention through imggen's flex backend (the pattern's own BlockMask and rule)."""
    q, k, v = inputs(n, h, d, grad=False)

    def fn():
        with torch.no_grad():
            imggen.sparse_attention(q, k, v, pat, backend="flex")
    return fn


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        return int(re.search(field + r":\s+(\d+)", f.read()).group(1)) / 1024


def _fixed_mmap_threshold():
    """Large blocks always come from mmap and go back to the OS when freed (glibc otherwise raises its
    mmap threshold after the first free and keeps later blocks in the heap, hiding their peaks)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 128 * 1024)  # M_TRIM_THRESHOLD
    except OSError:
        pass


def _peak_here(fn) -> float:
    """Peak resident-memory growth (MB) while fn runs: the kernel's high-water mark (VmHWM) is
    reset through /proc/self/clear_refs, so this counts every allocation, not only torch's."""
    _fixed_mmap_threshold()
    fn()  # warm-up: plans and lazily built tables are not attention memory
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _status_mb("VmRSS")
    fn()
    return _status_mb("VmHWM") - base


def peak_mb(method: str, kind: str, n: int, args) -> float:
    """Peak memory of one forward+backward, measured in a fresh process (the allocator setting it
    needs would slow the timings of this one)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--peak", method, kind, "--n", str(n),
           "--heads", str(args.heads), "--dim", str(args.dim), "--window", str(args.window),
           "--radius", str(args.radius)]
    return float(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.split()[-1])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--radius", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-flex", action="store_true", help="skip FlexAttention (saves compile time)")
    ap.add_argument("--json", help="also write the rows as JSON here")
    ap.add_argument("--peak", nargs=2, metavar=("METHOD", "KIND"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    h, d = args.heads, args.dim
    if args.peak:  # child process of peak_mb
        method, kind = args.peak
        n = args.n[0]
        pat = patterns(n, args.window, args.radius)[kind]
        print(_peak_here(lambda: run(method, pat, *inputs(n, h, d), True)))
        return
    rows = []
    for n in args.n:
        pats = patterns(n, args.window, args.radius)
        sd_f = median_time(lambda: run("sdpa", None, *inputs(n, h, d, grad=False), False), args.reps)
        sd_fb = median_time(lambda: run("sdpa", None, *inputs(n, h, d), True), args.reps)
        rows.append(dict(n=n, method="dense causal SDPA", fwd=sd_f, fwdbwd=sd_fb,
                         mem=peak_mb("sdpa", "band", n, args)))
        for kind, pat in pats.items():
            qkv_ng, qkv = inputs(n, h, d, grad=False), inputs(n, h, d)
            with torch.no_grad():
                f = median_time(lambda: run("cpu", pat, *qkv_ng, False), args.reps)
            fb = median_time(lambda: run("cpu", pat, *qkv, True), args.reps)
            flex = None if args.no_flex else median_time(flex_forward(pat, n, h, d), args.reps)
            rows.append(dict(n=n, method=f"imggen cpu {kind}", fwd=f, fwdbwd=fb, flex_fwd=flex,
                             mem=peak_mb("cpu", kind, n, args),
                             vs_sdpa_fwdbwd=sd_fb / fb, vs_sdpa_fwd=sd_f / f,
                             flex_over_ours_fwd=None if flex is None else f / flex))
    print(f"\nCPU attention, H={h}, D={d}, band window {args.window}, local2d radius {args.radius} "
          f"(square image of N pixels); {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"{cpu_model()}")

    def fmt(x, s="{:.2f}"):
        return "-" if x is None else s.format(x)
    print(md_table(["N", "method", "fwd ms", "fwd+bwd ms", "peak MB", "SDPA/ours fwd+bwd", "SDPA/ours fwd",
                    "Flex fwd ms", "ours/Flex fwd"],
                   [[str(r["n"]), r["method"], f"{r['fwd'] * 1e3:.1f}", f"{r['fwdbwd'] * 1e3:.1f}", f"{r['mem']:.0f}",
                     fmt(r.get("vs_sdpa_fwdbwd"), "{:.1f}x"), fmt(r.get("vs_sdpa_fwd"), "{:.1f}x"),
                     fmt(r.get("flex_fwd") and r["flex_fwd"] * 1e3, "{:.1f}"),
                     fmt(r.get("flex_over_ours_fwd"), "{:.2f}x")] for r in rows]))
    mems = {r["n"]: r["mem"] for r in rows if r["method"] == "imggen cpu band"}
    if len(mems) >= 2:
        lo, hi = min(mems), max(mems)
        print(f"band peak memory N={hi} / N={lo}: {mems[hi] / max(mems[lo], 1e-9):.2f}x (N ratio {hi / lo:.0f}x)")
    if args.json:
        write_atomic(args.json, json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
