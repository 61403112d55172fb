"""Block-sparse kernel benchmark: correctness at real sizes, timings vs FlexAttention and dense SDPA.

    python bench/gpu_bench.py                # H200: bf16, D=64, H=16, N in {4096, 16384, 65536}
    python bench/gpu_bench.py --dry-run      # CPU smoke test under TRITON_INTERPRET=1 (tiny sizes)

Useful TFLOP/s count only unmasked score entries: 4*D FLOPs per allowed (query, key) pair forward,
2.5x that backward (so fwd+bwd = 3.5x). Peer columns give peer_time / our_time (> 1: we are faster).
Timings: median of CUDA events after warm-up. Rows are printed as they finish; the final table
repeats them. A time budget (--budget) skips the remaining peers rather than overrunning.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

DRY = "--dry-run" in sys.argv
if DRY or not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import imggen  # noqa: E402
from imggen import kernels  # noqa: E402
from imggen.kernels import sparse as ks  # noqa: E402
from imggen.sparse_attention import reference_attention  # noqa: E402

H200_HBM_TBS = 4.8

T0 = time.time()
ROWS: list[dict] = []


def log(*a):
    print(*a, flush=True)


# ------------------------------------------------------------------------------------ timing
def bench(fn, warmup=3, reps=10):
    if torch.cuda.is_available():
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e) / 1e3)
        return statistics.median(times)
    fn()
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def fwd_bwd(f, q, k, v, do):
    def run():
        q.grad = k.grad = v.grad = None
        f(q, k, v).backward(do)
    return run


def fwd_only(f, q, k, v):
    def run():
        with torch.no_grad():
            f(q, k, v)
    return run


# ------------------------------------------------------------------------------ useful pairs
def useful_pairs(p, n: int, heads: int) -> int:
    """Allowed (query, key) pairs summed over heads, without an n x n mask."""
    i = torch.arange(n, dtype=torch.float64)
    if p.name == "full":
        return heads * n * (n + 1) // 2
    if p.name == "band":
        return heads * int(torch.clamp(i + 1, max=p.window).sum())
    if p.name == "diffuser":
        total = 0
        for h in range(heads):
            base = torch.clamp(i + 1, max=p.window) + torch.clamp(torch.clamp(i - p.window + 1, min=0), max=p.global_tokens)
            extra = 0
            for qb in range(math.ceil(n / p.block)):
                lo_q, hi_q = qb * p.block, min(n, (qb + 1) * p.block)
                for r in p.random_of(qb, h):
                    if r < p.global_tokens:
                        continue
                    qi = torch.arange(lo_q, hi_q)
                    extra += int(((qi - p.window + 1 > r)).sum())  # r outside the query's window
            total += int(base.sum()) + extra
        return total
    # local2d, bigbird, strided: evaluate the rule on the layout's blocks, chunked
    block = 64
    total = 0
    for h in range(heads if p.heads_differ else 1):
        lay = p.block_layout(n, block, h)
        ar = torch.arange(block)
        step = max(1, (1 << 21) // (lay.shape[1] * block * block))
        for a in range(0, lay.shape[0], step):
            qi = torch.arange(a, min(lay.shape[0], a + step))[:, None, None, None] * block + ar[:, None]
            kj = lay[a:a + step, :, None, None].clamp(min=0) * block + ar
            ok = p.allowed(qi, kj, h) & (qi < n) & (kj < n) & (lay[a:a + step, :, None, None] >= 0)
            total += int(ok.sum())
    return total * (1 if p.heads_differ else heads)


# ------------------------------------------------------------------------------------- peers
def flex_fn(p, n, heads, device):
    """FlexAttention with the same mask (mask_mod + block mask), compiled; None when unavailable."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except Exception:  # noqa: BLE001
        return None
    if p.name == "band":
        w = p.window

        def mask_mod(b, h, qi, kj):
            return (kj <= qi) & (qi - kj < w)
    elif p.name == "local2d":
        wd, c, r, s = p.width, p.channels, p.radius, p.shift

        def mask_mod(b, h, qi, kj):
            jj = kj - s
            pi, pj = qi // c, torch.clamp(jj, min=0) // c
            yi, xi, yj, xj = pi // wd, pi % wd, pj // wd, pj % wd
            near = (jj >= 0) & (jj < qi) & (yi - yj <= r) & ((xi - xj).abs() <= r)
            return (kj == qi) | ((kj < qi) & near)
    elif p.name == "bigbird":
        nqb = math.ceil(n / p.block)
        tbl = torch.stack([p._random_table(nqb, h) for h in range(heads)]).to(device)
        bs, wb, gb = p.block, p.window_blocks, p.global_blocks

        def mask_mod(b, h, qi, kj):
            qb, kb = qi // bs, kj // bs
            ok = (qb - kb < wb) | (kb < gb)
            for r in range(tbl.shape[-1]):
                ok = ok | (tbl[h, qb, r] == kb)
            return (kj <= qi) & ok
    elif p.name == "diffuser":
        nqb = math.ceil(n / p.block)
        tbl = torch.full((heads, nqb, max(1, p.random_edges)), -2, dtype=torch.long)
        for h in range(heads):
            for qb in range(nqb):
                rr = p.random_of(qb, h)
                tbl[h, qb, : len(rr)] = torch.tensor(rr, dtype=torch.long)
        tbl = tbl.to(device)
        bs, w, g = p.block, p.window, p.global_tokens

        def mask_mod(b, h, qi, kj):
            ok = (qi - kj < w) | (kj < g)
            for r in range(tbl.shape[-1]):
                ok = ok | (tbl[h, qi // bs, r] == kj)
            return (kj <= qi) & ok
    else:
        return None
    try:
        bm = create_block_mask(mask_mod, None, heads, n, n, device=device, _compile=device == "cuda")
        fa = torch.compile(flex_attention) if device == "cuda" else flex_attention
        return lambda q, k, v: fa(q, k, v, block_mask=bm)
    except Exception as e:  # noqa: BLE001
        log(f"  flex unavailable: {type(e).__name__}: {str(e)[:120]}")
        return None


def sdpa_causal(q, k, v):
    if q.is_cuda:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


# ------------------------------------------------------------------------------------- cases
def correctness(p, n, heads, d, device, dtype):
    """Relative error (||x - ref|| / ||ref||) of out and dq, dk, dv vs the fp32 dense reference."""
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v, do = (torch.randn(1, heads, n, d, device=device, generator=g) for _ in range(4))
    res = []
    for fn, dt in ((lambda a, b, c: reference_attention(a, b, c, p), torch.float32),
                   (lambda a, b, c: kernels.sparse_attention(a, b, c, p), dtype)):
        qq, kk, vv = (t.to(dt).requires_grad_() for t in (q, k, v))
        o = fn(qq, kk, vv)
        o.backward(do.to(dt))
        res.append([t.float() for t in (o.detach(), qq.grad, kk.grad, vv.grad)])
        del o, qq, kk, vv
    return max(((a - b).norm() / b.norm()).item() for a, b in zip(res[1], res[0]))


def run_case(name, p, b, heads, n, d, dtype, device, args, peers=True):
    row = {"case": name, "B": b, "N": n}
    if time.time() - T0 > args.budget + 40:
        row["note"] = "not run (time budget)"
        ROWS.append(row)
        log(f"  {name} N={n}: not run (time budget)")
        return
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(b, heads, n, d, device=device, dtype=dtype, generator=g).requires_grad_() for _ in range(3))
    do = torch.randn(b, heads, n, d, device=device, dtype=dtype, generator=g)
    pairs = useful_pairs(p, n, heads) * b
    if n <= 1024:  # check the pair count against the dense masks
        from imggen.sparse_attention import dense_masks
        assert pairs == b * int(dense_masks(p, n, heads, "cpu").sum()), f"useful_pairs wrong for {name}"
    flops_f = 4 * d * pairs
    ours = lambda a, bb, c: kernels.sparse_attention(a, bb, c, p)  # noqa: E731
    row["fwd_ms"] = bench(fwd_only(ours, q, k, v)) * 1e3
    row["fb_ms"] = bench(fwd_bwd(ours, q, k, v, do)) * 1e3
    key = ks._plan_key(p, n, heads, None, q.device)
    one = lambda a, bb, c: ks.bsa_fwd(a, bb, c, key)[0]  # noqa: E731  (softmax attention on p's graph)
    if p.is_diffusion:  # one block-sparse softmax attention over the same graph (our kernel)
        row["one_fb_ms"] = bench(fwd_bwd(one, q, k, v, do)) * 1e3
        row["diff/one"] = row["fb_ms"] / row["one_fb_ms"]
    else:
        row["fwd_TF"] = flops_f / row["fwd_ms"] * 1e-9
        row["fb_TF"] = 3.5 * flops_f / row["fb_ms"] * 1e-9
    over = time.time() - T0 > args.budget
    if peers and not over:
        f = flex_fn(p, n, heads, device)
        if f is not None:
            try:  # same mask? compare forward outputs (also the only flex check possible on CPU)
                qd, kd, vd = q.detach(), k.detach(), v.detach()
                mine = one if p.is_diffusion else ours  # flex does one softmax attention on the graph
                row["flex_maxdiff"] = (f(qd, kd, vd).float() - mine(qd, kd, vd).float()).abs().max().item()
                row["flex_fb_ms"] = bench(fwd_bwd(f, q, k, v, do)) * 1e3
                ref = row.get("one_fb_ms", row["fb_ms"])
                row["x_flex"] = row["flex_fb_ms"] / ref
            except Exception as e:  # noqa: BLE001
                log(f"  flex failed: {type(e).__name__}: {str(e)[:160]}")
    if not over and not p.is_diffusion:
        row["sdpa_fb_ms"] = bench(fwd_bwd(sdpa_causal, q, k, v, do)) * 1e3
        row["x_sdpa"] = row["sdpa_fb_ms"] / row["fb_ms"]
    if over:
        row["note"] = "peers skipped (time budget)"
    ROWS.append(row)
    log("  " + "  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    del q, k, v, do
    if device == "cuda":
        torch.cuda.empty_cache()


def decode_bench(b, heads, lengths, d, dtype, device):
    rows = []
    for length in lengths:
        g = torch.Generator(device=device).manual_seed(0)
        kc = torch.randn(b, heads, length, d, device=device, dtype=dtype, generator=g)
        vc = torch.randn_like(kc)
        q = torch.randn(b, heads, d, device=device, dtype=dtype, generator=g)
        for pos in (length // 2, length, 2 * length, 8 * length):  # ring fills at pos = length
            bias = torch.zeros(1, 1, length, device=device)
            if pos < length:
                bias[..., pos:] = float("-inf")
            t = bench(lambda: kernels.decode_attention(q, kc, vc, bias), warmup=5, reps=30)
            err = (kernels.decode_attention(q, kc, vc, bias).float()
                   - kernels.decode_attention_reference(q.float(), kc.float(), vc.float(), bias)).abs().max().item()
            gbs = 2 * kc.numel() * kc.element_size() / t * 1e-9
            rows.append({"L": length, "pos": pos, "us": t * 1e6, "GB/s": gbs,
                         "%HBM": 100 * gbs / (H200_HBM_TBS * 1e3), "maxerr": err})
            log("  decode " + "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in rows[-1].items()))
    return rows


def table(rows, keys):
    w = {k: max(len(k), *(len(fmt(r.get(k))) for r in rows)) for k in keys}
    out = ["| " + " | ".join(k.ljust(w[k]) for k in keys) + " |", "|" + "|".join("-" * (w[k] + 2) for k in keys) + "|"]
    for r in rows:
        out.append("| " + " | ".join(fmt(r.get(k)).ljust(w[k]) for k in keys) + " |")
    return "\n".join(out)


def fmt(v):
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1e4 else f"{v:.3e}"
    return str(v)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes on CPU under TRITON_INTERPRET=1")
    ap.add_argument("--budget", type=float, default=360.0, help="seconds after which peers are skipped")
    ap.add_argument("--no-correctness", action="store_true")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.dry_run
    device = "cuda" if cuda else "cpu"
    ks.POISON = False
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = False
        dtype, d, heads = torch.bfloat16, 64, 16
        ns, bsz = (4096, 16384, 65536), {4096: 4, 16384: 2, 65536: 1}
        band_w, side = (256, 1024), {4096: 64, 16384: 128, 65536: 256}
        blk, win, glob, rnd = 64, 64, 16, 8
        corr_n = 4096
        dec = dict(b=4, heads=16, lengths=(4096, 16384, 65536), d=64)
    else:
        dtype, d, heads = torch.float32, 32, 2
        ns, bsz = (64, 144), {64: 1, 144: 1}
        band_w, side = (16,), {64: 8, 144: 12}
        blk, win, glob, rnd = 16, 16, 4, 2
        corr_n = 64
        dec = dict(b=1, heads=2, lengths=(128,), d=32)
    log(f"device={device} dtype={dtype} D={d} H={heads} torch={torch.__version__}")

    pat = {
        "band": lambda w: imggen.make_pattern("band", window=w),
        "local2d": lambda s: imggen.make_pattern("local2d", height=s, width=s, channels=1, radius=3),
        "bigbird": lambda: imggen.make_pattern("bigbird", block=blk, window_blocks=3, global_blocks=1, random_blocks=2),
        "diffuser": lambda: imggen.make_pattern("diffuser", window=win, global_tokens=glob, random_edges=rnd,
                                                steps=5, alpha=0.1, block=blk),
    }
    corr = []
    if not args.no_correctness:
        log("== correctness (max rel. error of out, dq, dk, dv vs the fp32 dense reference, B=1)")
        for name, p in (("band w=%d" % band_w[0], pat["band"](band_w[0])), ("local2d r=3", pat["local2d"](side[corr_n])),
                        ("bigbird", pat["bigbird"]()), ("diffuser K=5", pat["diffuser"]())):
            r = {"case": name, "N": corr_n, "fp32": correctness(p, corr_n, heads, d, device, torch.float32)}
            if cuda:
                r["bf16"] = correctness(p, corr_n, heads, d, device, torch.bfloat16)
            corr.append(r)
            log("  " + str(r))

    log("== timings (fwd+bwd unless noted)")
    mid = ns[1] if len(ns) > 1 else ns[0]
    for n in ns:
        for w in band_w:
            run_case(f"band w={w}", pat["band"](w), bsz[n], heads, n, d, dtype, device, args,
                     peers=(n == mid) or not cuda)
    for n in ns:
        run_case(f"local2d {side[n]}x{side[n]} r=3", pat["local2d"](side[n]), bsz[n], heads, n, d, dtype, device,
                 args, peers=(n == mid) or not cuda)
    for n in ns:
        run_case("bigbird", pat["bigbird"](), bsz[n], heads, n, d, dtype, device, args, peers=(n == mid) or not cuda)
    for n in ns:
        run_case("diffuser K=5", pat["diffuser"](), bsz[n], heads, n, d, dtype, device, args,
                 peers=(n == mid) or not cuda)
    log("== decode (ring buffer, all slots read)")
    drows = decode_bench(dec["b"], dec["heads"], dec["lengths"], dec["d"], dtype, device)

    print("\n## Correctness\n")
    if corr:
        print(table(corr, ["case", "N", "fp32", "bf16"]))
    print("\n## Sparse attention (%s, D=%d, H=%d)\n" % (str(dtype).replace("torch.", ""), d, heads))
    print(table(ROWS, ["case", "B", "N", "fwd_ms", "fb_ms", "fwd_TF", "fb_TF", "flex_fb_ms", "x_flex", "flex_maxdiff",
                       "sdpa_fb_ms", "x_sdpa", "one_fb_ms", "diff/one", "note"]))
    print("\n## Decode\n")
    print(table(drows, ["L", "pos", "us", "GB/s", "%HBM", "maxerr"]))
    print("\n## Targets (H200)\n")
    tgt = []
    band = next((r for r in ROWS if r["case"] == "band w=%d" % band_w[0] and r["N"] == mid), None)
    if band:
        tgt.append(("band fwd+bwd N=%d w=%d >= 1.2x FlexAttention" % (mid, band_w[0]), band.get("x_flex"), 1.2))
        tgt.append(("  ... >= 12x dense SDPA", band.get("x_sdpa"), 12.0))
        tgt.append(("  ... >= 150 useful TFLOP/s", band.get("fb_TF"), 150.0))
    diff = [r["diff/one"] for r in ROWS if "diff/one" in r]
    if diff:
        tgt.append(("diffuser K=5 fwd+bwd <= 3x one attention (worst N)", max(diff), -3.0))
    full = [r["%HBM"] for r in drows if r["pos"] >= r["L"]]
    if full:
        tgt.append(("decode >= 50% HBM bandwidth (worst L, ring full)", min(full), 50.0))
    for label, val, goal in tgt:
        ok = val is not None and (val <= -goal if goal < 0 else val >= goal)
        verdict = ("PASS" if ok else "FAIL") if cuda else "not measured (dry run on CPU)"
        print(f"- {label}: {fmt(val)} -> {verdict}")
    print(f"\ntotal {time.time() - T0:.0f}s")


if __name__ == "__main__":
    main()
