"""Tile sweep of the attention kernels on a GPU: which (bm, bn, warps, stages) each kernel should try first.

    python3 bench/gpu/gpu_tune.py --budget 200        # one H200: 2 min at D=64, compiles included; results under $OUT
    python3 bench/gpu/gpu_tune.py --head-dim 32       # the presets' head dim (swept 12-04: RESULTS section 6)
    python3 bench/gpu/gpu_tune.py --dry-run           # CPU plumbing check (Triton interpreter, tiny shapes)

For every row (pattern at N=16384, B=8, H=16, bf16, D=64 by default: the sizes of bench/gpu/gpu_check.sh)
and every kernel (fwd, dq, dkdv), each candidate configuration (the launcher's own for that D, then
EXTRA) is forced (kernels.tuning.forced) while the other kernels keep their defaults, and timed: fwd = one forward without autograd; dq / dkdv = one backward (delta, dQ, dK/dV,
flushes) of a saved forward, so the differences between candidates of one kernel are that kernel's.
Each candidate's result is compared with the launcher's own choice (rel = ||x - default|| / ||default||):
a fast tile that computes something else is marked, never chosen. Candidates beyond kernels.tuning.CONFIGS
may spill registers: promote one only after `python -m imggen.kernels.aot_check` passes with it listed.
Writes gpu_tune.md and gpu_tune.json (rewritten after every row) under $OUT, else bench/results/.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

T0 = time.time()
if "--dry-run" in sys.argv:
    os.environ.update(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")

import torch  # noqa: E402

GPU = Path(__file__).resolve().parent  # bench/gpu: gpu_smoke.py; bench/: harness.py
sys.path[:0] = [str(GPU), str(GPU.parent)]
from gpu_smoke import ensure_imggen  # noqa: E402
from harness import machine, md_table, out_dir, sync, time_call, write_results  # noqa: E402

ensure_imggen()
import imggen  # noqa: E402
from imggen.kernels import tuning  # noqa: E402
from imggen.kernels.tuning import Config as C  # noqa: E402

# tried after the launcher's own candidates for the head dim (kernels.tuning, in its order)
EXTRA = {
    "fwd": [C(128, 64, 8, 3), C(128, 64, 8, 4), C(128, 64, 4, 3), C(128, 128, 8, 3), C(128, 128, 8, 2),
            C(64, 64, 4, 3), C(64, 64, 4, 4), C(64, 128, 4, 3), C(128, 32, 4, 3), C(64, 32, 4, 3)],
    "dq": [C(128, 64, 8, 3), C(128, 32, 8, 3), C(128, 64, 4, 3), C(128, 32, 4, 3), C(64, 64, 4, 3),
           C(64, 32, 4, 3), C(64, 64, 4, 4), C(128, 128, 8, 2)],
    "dkdv": [C(32, 128, 8, 3), C(64, 128, 8, 2), C(64, 128, 8, 3), C(32, 128, 4, 3), C(64, 64, 8, 3),
             C(64, 64, 4, 3), C(32, 64, 4, 3), C(16, 128, 4, 3), C(128, 128, 8, 2)],
}
ROWS = [("band w=256", "band", {"window": 256}),
        ("band w=1024", "band", {"window": 1024}),
        ("local2d 128x128 r=3", "local2d", {"height": 128, "width": 128, "channels": 1, "radius": 3}),
        ("bigbird b=64 w=3 g=1 r=2", "bigbird", {"block": 64, "window_blocks": 3, "global_blocks": 1,
                                                 "random_blocks": 2})]


def rel(x, ref) -> float:
    return float((x.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


def candidates(kernel: str, d: int) -> list:
    """The launcher's candidates for head dim d (bf16) first, then the extra tiles."""
    return list(dict.fromkeys(tuning.candidates(kernel, d, torch.bfloat16) + tuple(EXTRA[kernel])))


def sweep_row(label, kind, params, d, deadline, dry) -> dict:
    dev = "cpu" if dry else "cuda"
    n, b, h = (64, 1, 2) if dry else (16384, 8, 16)
    p = imggen.make_pattern(kind, **params)
    g = torch.Generator(device=dev).manual_seed(0)
    dtype = torch.float32 if dry else torch.bfloat16
    q, k, v, do = (torch.randn(b, h, n, d, device=dev, dtype=dtype, generator=g) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(True)
    attn = lambda: imggen.sparse_attention(q, k, v, p, backend="triton")  # noqa: E731
    o = attn()
    default = [o.detach(), *torch.autograd.grad(o, (q, k, v), do)]
    rec = {"row": label, "N": n, "BxH": f"{b}x{h}", "D": d, "results": []}
    for kernel in EXTRA:
        cands = candidates(kernel, d)
        for cfg in (cands[:2] if dry else cands):
            r = {"kernel": kernel, "config": str(cfg)}
            rec["results"].append(r)
            if time.time() > deadline:
                r["error"] = "not run (budget)"
                continue
            try:
                with tuning.forced(**{kernel: cfg}):
                    t = time.time()
                    if kernel == "fwd":
                        with torch.no_grad():
                            x = [attn()]
                        fn = lambda: attn()  # noqa: E731
                        ref = default[:1]
                    else:
                        o = attn()
                        x = list(torch.autograd.grad(o, (q, k, v), do, retain_graph=True))
                        x, ref = (x[:1], default[1:2]) if kernel == "dq" else (x[1:], default[2:])
                        fn = lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True)  # noqa: E731
                    sync(dev)
                    r["first_s"] = time.time() - t
                    r["rel"] = max(rel(xi, ri) for xi, ri in zip(x, ref))
                    if kernel == "fwd":
                        with torch.no_grad():
                            r["ms"] = time_call(fn, dev)
                    else:
                        r["ms"] = time_call(fn, dev)
            except Exception as e:  # a config that fails to compile or launch is a result, not the end
                r["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            print(f"{label:28s} {kernel:5s} {str(cfg):14s} " + (f"{r['ms']:8.3f} ms  rel {r['rel']:.1e}"
                  f"  first {r['first_s']:.1f} s" if "ms" in r else r["error"]), flush=True)
    return rec


def markdown(recs, args, m: dict) -> str:
    lines = [f"# Kernel tile sweep\n\n{m['gpu'] or 'cpu (dry run)'} · torch {m['torch']} · triton {m['triton']} · "
             f"commit {m['commit']} · `python3 bench/gpu/gpu_tune.py --budget {args.budget} "
             f"--head-dim {args.head_dim}` · {time.strftime('%F %T')}\n",
             "ms: fwd = forward alone; dq / dkdv = whole backward with that kernel's tile forced (the others as "
             "the launcher picks them). x first: the kernel's first candidate's time / this one's. rel: vs the result "
             "with every tile as the launcher picks it (kernels.tuning order, own-rule tiles first).\n"]
    for rec in recs:
        base, rows = {}, []
        for r in rec["results"]:
            base.setdefault(r["kernel"], r.get("ms"))
            if "ms" in r:
                x = base[r["kernel"]] / r["ms"] if base[r["kernel"]] else float("nan")
                rows.append([r["kernel"], r["config"], f"{r['ms']:.3f}", f"{x:.2f}", f"{r['rel']:.1e}",
                             f"{r['first_s']:.1f}"])
            else:
                rows.append([r["kernel"], r["config"], "-", "-", "-", r["error"]])
        lines += [f"## {rec['row']} (N={rec['N']}, BxH={rec['BxH']}, D={rec.get('D', 64)})\n",
                  md_table(["kernel", "config", "ms", "x first", "rel", "first s"], rows), ""]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=float, default=200.0, help="seconds from start; later candidates are skipped")
    ap.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, tiny shapes, 2 candidates")
    ap.add_argument("--rows", default="", help="comma-separated row numbers (0-based) to run; default all")
    ap.add_argument("--head-dim", type=int, default=64, choices=tuning.HEAD_DIMS,
                    help="D of q, k, v (every preset uses 32: dim 256 / 8 heads)")
    args = ap.parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_tune.py: no CUDA device; use --dry-run for the CPU plumbing check")
        return 2
    out = out_dir()
    m = machine()
    deadline = T0 + args.budget
    rows = [ROWS[int(i)] for i in args.rows.split(",")] if args.rows else ROWS
    recs = []
    for label, kind, params in rows:
        recs.append(sweep_row(label, kind, params, 32 if args.dry_run else args.head_dim, deadline, args.dry_run))
        write_results(out, "gpu_tune", recs, markdown(recs, args, m))
    print(markdown(recs, args, m))
    print(f"gpu_tune.py: {time.time() - T0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
