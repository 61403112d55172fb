"""GPU check of imggen's sparse attention for a short slot; bench/gpu_check.sh runs it.

    bash bench/gpu_check.sh                  # one H200, <= 4 min with compiles; results under $OUT
    python bench/gpu_bench.py --dry-run      # CPU, tiny sizes, Triton interpreter (the CI test)
    python bench/gpu_bench.py --parts grid,selfcheck --budget 540   # the rest of the grid, longer slot

Everything is a *unit* run in priority order under one deadline (--budget seconds from start): the
rows that decide a target first, then the rest. Each unit is wrapped: an exception or its time slot
running out is recorded as a FAIL with the error text and the next unit runs; gpu_check.json and
gpu_check.md are rewritten after every unit, so a run killed from outside still leaves its results.
A broken CUDA context (e.g. an illegal address) stops the in-process GPU units only; the training
smoke runs in its own processes. What the numbers mean: CONVENTIONS in this file (also in gpu_check.md).
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

T0 = time.time()
ROOT = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
H200_HBM_GBPS = 4800.0  # datasheet
H200_BF16_DENSE_TFLOPS = 989.0  # datasheet, dense


def prepare_env(argv) -> None:
    """Before torch / Triton are imported: the dry run is CPU-only, interpreted and uncompiled."""
    os.environ.pop("IMGGEN_BACKEND", None)  # this script names every backend itself
    if "--dry-run" in argv:
        os.environ["TRITON_INTERPRET"] = "1"
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        # torch.compile off: FlexAttention then runs eagerly (CPU inductor compiles take ~20 s per shape)
        os.environ["TORCH_COMPILE_DISABLE"] = "1"
        os.environ["TORCHDYNAMO_DISABLE"] = "1"


if __name__ == "__main__":
    prepare_env(sys.argv[1:])

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(BENCH))
from gpu_smoke import ensure_imggen  # noqa: E402

IMGGEN_FROM = ensure_imggen()
import imggen  # noqa: E402

CONVENTIONS = [
    "Useful FLOPs count only the allowed (query, key) pairs of the pattern's mask (pattern.allowed, "
    "diagonal included), summed over B*H: forward 4*D per pair (QK^T and PV); backward 2.5x the forward "
    "(recomputed QK^T, dV, dP, dQ, dK), so forward+backward = 3.5x forward = 14*D per pair. TFLOP/s of "
    "the peers use the same useful count (the sparse pattern's pairs); 'SDPA dense TF/s' counts its own "
    "N(N+1)/2 causal pairs per head.",
    "x_peer = peer time / our time (> 1: ours is faster). Forward is timed with autograd recording (as "
    "in training); forward+backward = forward + torch.autograd.grad for q, k and v. Times: median over "
    "samples of back-to-back calls between CUDA events, after warm-up; first-call times (compile, "
    "autotune, plan building) are reported separately as 'first s'.",
    "Correctness: outputs and q/k/v gradients vs an fp32 reference computed from the same bf16 inputs, "
    "in query chunks straight from pattern.allowed (dense over the causal keys, never a block layout), "
    "on a few (batch, head) slices at the timed size; rel = ||x - ref|| / ||ref||, row = worst per-row "
    "||x - ref|| / max(||ref row||, median row norm). Ours vs flex compares full tensors.",
    "Diffuser 'one attention' = our kernels' single softmax attention over the same graph (the pattern "
    "with is_diffusion off); its target is diffuser time / one-attention time.",
    "Decode GB/s = K and V cache bytes (read once per call) / time per call, timed as replays of a CUDA "
    "graph holding R calls (no launch overhead); HBM reference = a measured device-to-device copy "
    "(bytes read + written) and the 4.8 TB/s datasheet figure.",
]


# ================================================================================== configuration
@dataclasses.dataclass
class Row:
    id: str
    label: str
    kind: str
    params: dict
    n: int
    decisive: bool = False

    def pattern(self):
        return imggen.make_pattern(self.kind, **self.params)


def _row(kind, params, n, label, decisive=False):
    short = "-".join(f"{k[0]}{v}" for k, v in params.items() if k in ("window", "height", "radius", "steps", "block"))
    return Row(f"{kind}-{short}-n{n}", label, kind, params, n, decisive)


def band(w, n, **kw):
    return _row("band", {"window": w}, n, f"band w={w}", **kw)


def local2d(side, n, r=3):
    return _row("local2d", {"height": side, "width": side, "channels": 1, "radius": r}, n,
                f"local2d {side}x{side} r={r}")


def bigbird(block, n):
    p = {"block": block, "window_blocks": 3, "global_blocks": 1, "random_blocks": 2}
    return _row("bigbird", p, n, f"bigbird b={block} w=3 g=1 r=2")


def diffuser(window, glob, rnd, block, n, **kw):
    p = {"window": window, "global_tokens": glob, "random_edges": rnd, "steps": 5, "alpha": 0.1, "block": block}
    return _row("diffuser", p, n, f"diffuser K=5 w={window} g={glob} r={rnd}", **kw)


def config(dry: bool) -> dict:
    if not dry:
        n1, n2 = 16384, 65536
        return dict(
            device="cuda", dtype=torch.bfloat16, D=64, H=16, B={n1: 8, n2: 2},
            decisive=[band(256, n1, decisive=True), diffuser(256, 64, 16, 64, n1, decisive=True)],
            grid=[band(1024, n1), band(4096, n1), local2d(128, n1), bigbird(64, n1),
                  band(256, n2), band(1024, n2), band(4096, n2), local2d(256, n2), bigbird(64, n2),
                  diffuser(256, 64, 16, 64, n2)],
            check_slices=4, chunk_elems=1 << 27,
            decode=dict(B=16, H=16, D=64, lengths=(4096, 8192, 16384, 32768, 65536), graph_calls=20),
            selfcheck=dict(dims=(64, 32), n=None, kinds=SELFCHECK_KINDS),
            smoke=dict(per_batch=64, steps=100, args=["--batch-size", "16", "--model.layers", "2",
                                                      "--train.warmup", "10", "--train.eval_images", "16"],
                       backends=("triton", "flex"), sample_num=4),
            tol={"rel": 2e-2, "row": 0.1}, diffuser_tol_factor=2.0, smoke_loss_tol=0.01,
            budget=220.0)
    n1 = 64  # one tiny length: the code paths do not depend on N
    return dict(
        device="cpu", dtype=torch.float32, D=32, H=2, B={n1: 1},
        decisive=[band(16, n1, decisive=True), diffuser(16, 4, 2, 16, n1, decisive=True)],
        grid=[band(32, n1), bigbird(16, n1), local2d(8, n1)],
        check_slices=2, chunk_elems=16 * 64,  # several query chunks even at tiny sizes
        decode=dict(B=1, H=2, D=32, lengths=(32, 64), graph_calls=0),
        selfcheck=dict(dims=(32,), n=48, kinds=SELFCHECK_KINDS_DRY),
        smoke=dict(per_batch=16, steps=2, args=["--batch-size", "4", "--model.layers", "2", "--model.height", "4",
                                                "--model.width", "4", "--model.dim", "32", "--model.heads", "2",
                                                "--train.warmup", "1", "--train.eval_images", "4", "--device", "cpu",
                                                "--threads", "1"],
                   backends=("cpu", "reference"), sample_num=4),
        tol={"rel": 1e-4, "row": 1e-3}, diffuser_tol_factor=2.0, smoke_loss_tol=0.01,
        budget=150.0)


SELFCHECK_KINDS = [
    ("full", {}), ("band", {"window": 256}),
    ("local2d", {"height": 16, "width": 16, "channels": 3, "radius": 3}),
    ("bigbird", {"block": 64, "window_blocks": 3, "global_blocks": 1, "random_blocks": 2}),
    ("diffuser", {"window": 64, "global_tokens": 16, "random_edges": 8, "steps": 5, "alpha": 0.1}),
    ("strided", {"stride": 32}), ("column", {"stride": 32}),
]
SELFCHECK_KINDS_DRY = [
    ("full", {}), ("band", {"window": 16}), ("local2d", {"height": 4, "width": 4, "channels": 3, "radius": 1}),
    ("bigbird", {"block": 16, "window_blocks": 2, "global_blocks": 1, "random_blocks": 1}),
    ("diffuser", {"window": 16, "global_tokens": 4, "random_edges": 2, "steps": 5, "alpha": 0.1, "block": 16}),
    ("strided", {"stride": 8}), ("column", {"stride": 8}),
]

# time slots (s): a unit starts only with `start` seconds left and is stopped after `cap` seconds
SLOTS = {"env": (5, 20), "ours": (15, 90), "flex": (25, 80), "diff": (20, 75), "decode": (6, 25),
         "profile": (6, 20), "data": (70, 15), "train": (30, 60), "sample": (8, 30), "selfcheck": (6, 25),
         "sdpa": (5, 30)}
RESERVE_S = 4.0  # kept for the final write


# ================================================================================== small helpers
class UnitTimeout(BaseException):
    """A unit ran past its time slot (BaseException so that library code does not swallow it)."""


class HardStop(BaseException):
    """SIGTERM from outside (gpu_check.sh's hard timeout)."""


class SkipUnit(Exception):
    """A unit that cannot run because an earlier one did not (recorded as 'not run')."""


def elapsed() -> float:
    return time.time() - T0


def log(msg: str) -> None:
    print(f"[{elapsed():6.1f}s] {msg}", flush=True)


def sync(device) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def short_error(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    first = text[0] if text else ""
    last = text[-1] if len(text) > 1 else ""
    msg = f"{type(e).__name__}: {first}" + (f" ... {last}" if last and last != first else "")
    return msg[:600]


def fmt(v, digits=3) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return str(v)
        if v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-3):
            return f"{v:.2e}"
        return f"{v:.{digits}g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def md_table(header: list[str], rows: list[list]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for r in rows:
        out.append("| " + " | ".join(fmt(c) if not isinstance(c, str) else c.replace("|", "/") for c in r) + " |")
    return "\n".join(out)


def time_call(fn, device, target_s: float = 0.6, warmup: int = 2, max_samples: int = 15) -> float:
    """Median milliseconds per call of fn(). CUDA: samples of k back-to-back calls between events
    (k so that a sample takes >= ~2 ms), after warm-up. CPU (dry run): one call (callers warm up)."""
    if not str(device).startswith("cuda"):
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    fn()
    e.record()
    e.synchronize()
    one = max(s.elapsed_time(e), 1e-3)
    k = max(1, min(50, int(2.0 / one)))
    samples = max(3, min(max_samples, int(target_s * 1e3 / (one * k))))
    times = []
    for _ in range(samples):
        s.record()
        for _ in range(k):
            fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / k)
    return statistics.median(times)


# ================================================================================== reference
def allowed_tables(pattern, n: int, heads: int, device) -> dict:
    return {k: t.to(device) for k, t in pattern.lookup_tables(n, pattern.head_count(heads)).items()}


def _chunk_rows(n_keys: int, chunk_elems: int) -> int:
    return max(1, min(n_keys, chunk_elems // max(1, n_keys)))


def count_pairs(pattern, n: int, heads: int, device, chunk_elems: int = 1 << 27) -> list[int]:
    """Allowed (query, key) pairs per head (length `heads`), from pattern.allowed in query chunks."""
    hl = pattern.head_count(heads)
    tables = allowed_tables(pattern, n, heads, device)
    idx = torch.arange(n, device=device)
    c = _chunk_rows(n, chunk_elems)
    counts = [sum(int(pattern.allowed(idx[a:a + c, None], idx[None, :a + c], h, tables).sum())
                  for a in range(0, n, c)) for h in range(1 if hl == 1 else heads)]
    return counts * heads if hl == 1 else counts


def ref_softmax_head(pattern, q, k, v, do, head: int, tables, chunk_elems: int):
    """fp32 softmax attention of one head (q, k, v, do: (N, D)) and its exact gradients, in query
    chunks over the causal keys, masked by pattern.allowed. Returns o, dq, dk, dv."""
    n, d = q.shape
    scale = d ** -0.5
    idx = torch.arange(n, device=q.device)
    o, dq = torch.empty_like(q), torch.empty_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    a = 0
    while a < n:
        b = min(n, a + _chunk_rows(n, chunk_elems))
        m = pattern.allowed(idx[a:b, None], idx[None, :b], head, tables)
        s = (q[a:b] @ k[:b].T) * scale
        p = torch.softmax(s.masked_fill(~m, float("-inf")), dim=-1)  # the diagonal is always allowed
        del s, m
        o[a:b] = p @ v[:b]
        g = do[a:b]
        dv[:b] += p.T @ g
        dp = g @ v[:b].T
        ds = p * (dp - (g * o[a:b]).sum(-1, keepdim=True))
        del dp, p
        dq[a:b] = (ds @ k[:b]) * scale
        dk[:b] += (ds.T @ q[a:b]) * scale
        del ds
        a = b
    return o, dq, dk, dv


def ref_diffuser_head(pattern, q, k, v, do, head: int, tables, chunk_elems: int):
    """fp32 diffuser of one head with exact gradients: A = row-softmax over the mask (dense N x N,
    built in query chunks), Z0 = V, Z(k+1) = (1 - a) A Z(k) + a V, output Z(K)."""
    n, d = q.shape
    scale, steps, al = d ** -0.5, pattern.steps, pattern.alpha
    idx = torch.arange(n, device=q.device)
    A = torch.zeros(n, n, device=q.device, dtype=q.dtype)
    a = 0
    while a < n:
        b = min(n, a + _chunk_rows(n, chunk_elems))
        m = pattern.allowed(idx[a:b, None], idx[None, :b], head, tables)
        s = (q[a:b] @ k[:b].T) * scale
        A[a:b, :b] = torch.softmax(s.masked_fill(~m, float("-inf")), dim=-1)
        del s, m
        a = b
    zs = [v]
    for _ in range(steps):
        zs.append((1 - al) * (A @ zs[-1]) + al * v)
    o = zs[-1]
    g = do                        # dL/dZ(K)
    dv = al * g
    dA = torch.zeros_like(A)
    for s_ in range(steps - 1, -1, -1):   # Z(s_+1) = (1-a) A Z(s_) + a V
        dA.addmm_(g, zs[s_].T, alpha=1 - al)
        g = (1 - al) * (A.T @ g)  # dL/dZ(s_)
        dv = dv + (al * g if s_ >= 1 else g)
    ds = dA.sub_((dA * A).sum(-1, keepdim=True)).mul_(A)  # in place: A (N x N) may be large
    del A
    dq = (ds @ k) * scale
    dk = (ds.T @ q) * scale
    return o, dq, dk, dv


def reference_head(pattern, q, k, v, do, head, tables, chunk_elems):
    fn = ref_diffuser_head if pattern.is_diffusion else ref_softmax_head
    return fn(pattern, q, k, v, do, head, tables, chunk_elems)


class ErrAcc:
    """rel = ||x - ref|| / ||ref|| over everything added; row = worst row error (see CONVENTIONS)."""

    def __init__(self):
        self.num = self.den = 0.0
        self.row = 0.0
        self.where = None  # flat index of the worst row in the tensor that held it
        self.nan = False

    def add(self, x, ref):
        x, ref = x.float().reshape(-1, x.shape[-1]), ref.float().reshape(-1, ref.shape[-1])
        if not torch.isfinite(x).all():
            self.nan = True
        diff = (x - ref).norm(dim=-1)
        rn = ref.norm(dim=-1)
        floor = rn.median().clamp(min=1e-12)
        self.num += float((diff ** 2).sum())
        self.den += float((rn ** 2).sum())
        worst = diff / torch.maximum(rn, floor)
        if float(worst.max()) >= self.row:
            self.row, self.where = float(worst.max()), int(worst.argmax())

    def result(self, tol: dict) -> dict:
        rel = math.inf if self.nan else math.sqrt(self.num) / max(math.sqrt(self.den), 1e-30)
        row = math.inf if self.nan else self.row
        return {"rel": rel, "row": row, "worst_row_index": self.where,
                "ok": bool(rel <= tol["rel"] and row <= tol["row"])}


NAMES = ("out", "dq", "dk", "dv")


def compare(xs, refs, tol) -> dict:
    res = {}
    for name, x, r in zip(NAMES, xs, refs):
        if x is None or r is None:
            continue
        acc = ErrAcc()
        acc.add(x, r)
        res[name] = acc.result(tol)
    res["ok"] = bool(res) and all(v["ok"] for k, v in res.items() if k in NAMES)
    return res


def check_vs_reference(pattern, inputs, outs, slices, tol, chunk_elems) -> dict:
    """outs (o, dq, dk, dv) of shape (B, H, N, D) vs the fp32 reference on the (b, h) slices."""
    q, k, v, do = inputs
    n, heads = q.shape[2], q.shape[1]
    tables = allowed_tables(pattern, n, heads, q.device)
    accs = {name: ErrAcc() for name in NAMES}
    for b, h in slices:
        ref = reference_head(pattern, *(t[b, h].detach().float() for t in (q, k, v, do)),
                             h if pattern.heads_differ else 0, tables, chunk_elems)
        for name, x, r in zip(NAMES, outs, ref):
            if x is not None:
                accs[name].add(x[b, h], r)
        del ref
    res = {name: acc.result(tol) for name, acc in accs.items() if outs[NAMES.index(name)] is not None}
    res["ok"] = all(v["ok"] for v in res.values())
    res["slices"] = [list(s) for s in slices]
    return res


def pick_slices(b: int, h: int, count: int) -> list[tuple[int, int]]:
    cand = [(0, 0), (b - 1, h - 1), (0, h // 2), (b // 2, 1 % h), (0, h - 1), (b - 1, 0)]
    out = []
    for s in cand:
        if s not in out:
            out.append(s)
    return out[:count]


# ================================================================================== profiler
CATEGORIES = [  # (category, substrings of the lower-cased kernel name), first match wins
    ("decode", ("decode",)),
    ("diffuser steps", ("diff", "spmm")),
    ("dK/dV", ("dkdv", "dk_dv", "dkv", "_dk")),
    ("dQ", ("dq",)),
    ("delta", ("delta", "preprocess", "bwd_pre")),
    ("backward (other)", ("bwd", "backward")),
    ("forward", ("fwd", "forward", "flash", "attn", "attention", "flex")),
    ("torch ops (reductions, casts, e.g. a delta computed by torch)",
     ("elementwise", "reduce", "vectorized", "at::native", "triton_", "cunn", "softmax")),
    ("copy/fill", ("memcpy", "memset", "copy", "fill")),
]


def classify(name: str) -> str:
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(s in low for s in keys):
            return cat
    return "other"


def kernel_events(prof, cuda: bool) -> list[tuple[str, float]]:
    """(name, microseconds) of every GPU kernel / memcpy in a torch.profiler run (CPU run: the
    top-level CPU ops instead)."""
    evs = prof.events()
    out = []
    if cuda:
        for e in evs:
            if "CUDA" in str(getattr(e, "device_type", "")):
                out.append((e.name, float(e.time_range.elapsed_us())))
        if not out:
            for e in evs:
                for kern in getattr(e, "kernels", None) or []:
                    out.append((kern.name, float(getattr(kern, "duration", 0.0))))
    else:
        for e in evs:
            if getattr(e, "cpu_parent", None) is None:
                out.append((e.name, float(e.time_range.elapsed_us())))
    return out


def breakdown(events: list[tuple[str, float]]) -> dict:
    by_name: dict[str, dict] = {}
    for name, us in events:
        r = by_name.setdefault(name, {"name": name, "calls": 0, "us": 0.0, "category": classify(name)})
        r["calls"] += 1
        r["us"] += us
    total = sum(r["us"] for r in by_name.values()) or 1.0
    cats: dict[str, dict] = {}
    for r in by_name.values():
        c = cats.setdefault(r["category"], {"category": r["category"], "calls": 0, "us": 0.0})
        c["calls"] += r["calls"]
        c["us"] += r["us"]
    for d in list(by_name.values()) + list(cats.values()):
        d["share"] = d["us"] / total
    return {"total_us": total, "kernels": sorted(by_name.values(), key=lambda r: -r["us"]),
            "categories": sorted(cats.values(), key=lambda r: -r["us"])}


# ================================================================================== targets
def evaluate_targets(res: dict) -> list[dict]:
    """PASS/FAIL per target (band speed vs flex and SDPA, diffuser cost, decode bandwidth); a target is PASS only if its configuration's correctness
    check passed. Missing data: NOT RUN (counts as a failure)."""
    t = []
    rows = res.get("rows", {})
    dec = [r for r in rows.values() if r.get("decisive")]
    band_row = next((r for r in dec if r["kind"] == "band"), None)
    diff_row = next((r for r in dec if r["kind"] == "diffuser"), None)

    def target(name, value, goal, op, gates, unit="", note=""):
        gate_fail = [g for g, ok in gates if not ok]
        if value is None or (isinstance(value, float) and math.isnan(value)):
            verdict, why = "NOT RUN", "no measurement" + ("" if note else " (see Errors / Not run)")
        elif gate_fail:
            verdict, why = "FAIL", "correctness gate failed: " + ", ".join(gate_fail)
        else:
            ok = value >= goal if op == ">=" else value <= goal
            verdict, why = ("PASS" if ok else "FAIL"), ""
        t.append({"target": name, "value": value, "goal": f"{op} {fmt(goal)}{unit}", "verdict": verdict,
                  "why": why, "gates": [g for g, _ in gates], "note": note})

    def gate(row, key, label):
        c = (row or {}).get("correct", {}).get(key)
        return (label, bool(c and c.get("ok")))

    if band_row is not None:
        lbl = f"{band_row['label']} fwd+bwd, N={band_row['n']}"
        g_ours = gate(band_row, "ours_vs_ref", "ours vs fp32 reference")
        flex_gate = [g_ours, gate(band_row, "ours_vs_flex", "ours vs flex (same mask)")]
        xf, note = band_row.get("x_flex_fb"), ""
        if xf is None and res.get("meta", {}).get("dry_run") and band_row.get("x_flex_fwd") is not None:
            xf, note = band_row["x_flex_fwd"], "dry run: forward ratio (FlexAttention has no CPU backward)"
        target(f"{lbl}: x FlexAttention", xf, 1.2, ">=", flex_gate, "x", note)
        target(f"{lbl}: x dense causal SDPA", band_row.get("x_sdpa_fb"), 12.0, ">=", [g_ours], "x")
        target(f"{lbl}: useful TFLOP/s", (band_row.get("ours") or {}).get("fb_TF"), 150.0, ">=", [g_ours],
               " TF/s")
    else:
        for name in ("x FlexAttention", "x dense causal SDPA", "useful TFLOP/s"):
            target(f"band decisive row: {name}", None, 0, ">=", [], note="row not configured")
    if diff_row is not None:
        target(f"{diff_row['label']} fwd+bwd, N={diff_row['n']}: time / one sparse attention on its graph",
               diff_row.get("diff_over_one"), 3.0, "<=",
               [gate(diff_row, "ours_vs_ref", "diffuser vs fp32 reference"),
                gate(diff_row, "one_vs_ref", "one attention vs fp32 reference")], "x")
    dec_rows = res.get("decode", {})
    copy = (res.get("env") or {}).get("copy_GBps")
    if dec_rows:
        measured = [d for d in dec_rows.values() if d.get("GBps") is not None]
        worst = min(measured, key=lambda d: d["GBps"]) if measured else None
        frac = worst["GBps"] / copy if worst and copy else None
        all_lengths = len(measured) == len(dec_rows)
        target("decode (CUDA graph), worst cache length: fraction of measured HBM copy bandwidth",
               frac, 0.5, ">=", [(f"decode vs reference at L={d['L']}", bool(d.get("correct", {}).get("ok")))
                                 for d in dec_rows.values()] + [("every cache length measured", all_lengths)],
               note=(f"worst L={worst['L']}: {worst['GBps']:.0f} GB/s = {100 * worst['GBps'] / H200_HBM_GBPS:.0f}% "
                     f"of the 4.8 TB/s datasheet; copy {copy:.0f} GB/s" if worst and copy else
                     "decode not measured" if not worst else "copy bandwidth not measured"))
    return t


# ================================================================================== the runner
@dataclasses.dataclass
class Unit:
    id: str
    part: str
    slot: str
    fn: object
    rec: dict
    gpu: bool = True
    what: str = ""


class Check:
    def __init__(self, args):
        self.args = args
        self.dry = args.dry_run
        self.cfg = config(self.dry)
        self.device = self.cfg["device"]
        self.cuda = self.device == "cuda"
        self.dtype = self.cfg["dtype"]
        self.budget = args.budget if args.budget is not None else self.cfg["budget"]
        self.deadline = T0 + self.budget
        self.out = Path(args.out or os.environ.get("OUT") or ROOT / "bench" / "results")
        self.out.mkdir(parents=True, exist_ok=True)
        self.parts = set(args.parts.split(",")) if args.parts else set(PARTS)
        self.cuda_broken = None
        self.stop = False
        self.slot_end = time.time()
        self.smoke_procs: dict = {}
        self.started: set = set()
        self.sdpa_cache: dict = {}
        self.work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
        self.res = {"meta": {}, "env": {}, "targets": [], "rows": {}, "decode": {}, "profile": {},
                    "smoke": {}, "selfcheck": {}, "timeline": [], "errors": [], "conventions": CONVENTIONS}

    # ---------------------------------------------------------------- bookkeeping
    def left(self) -> float:
        return self.deadline - time.time()

    def save(self) -> None:
        self.res["meta"]["elapsed_s"] = elapsed()
        self.res["targets"] = evaluate_targets(self.res)
        for name, text in (("gpu_check.json", json.dumps(self.res, indent=1, default=str)),
                           ("gpu_check.md", self.markdown())):
            tmp = self.out / (name + ".tmp")
            tmp.write_text(text)
            os.replace(tmp, self.out / name)

    def run_unit(self, u: Unit) -> None:
        rec = u.rec
        if self.stop:
            return
        if u.part not in self.parts:
            return
        if self.args.skip and re.search(self.args.skip, u.id):
            rec.setdefault("skipped", []).append(f"{u.id}: not run (--skip)")
            return
        start_need, cap = SLOTS[u.slot]
        if self.dry:
            start_need, cap = 0.0, max(cap, 60)
        if u.gpu and self.cuda_broken:
            rec.setdefault("skipped", []).append(f"{u.id}: not run (the CUDA context broke {self.cuda_broken})")
            log(f"skip {u.id}: CUDA context broken earlier")
            return
        left = self.left() - RESERVE_S
        if left < start_need:
            rec.setdefault("skipped", []).append(f"{u.id}: not run (time budget: {left:.0f} s left, needs ~{start_need} s)")
            self.res["timeline"].append({"unit": u.id, "part": u.part, "start_s": elapsed(), "seconds": 0.0,
                                         "status": "not run (budget)"})
            log(f"skip {u.id}: {left:.0f} s left of the budget, it needs ~{start_need} s")
            self.save()
            return
        slot = max(1.0, min(cap, left))
        t = time.time()
        self.slot_end = t + slot
        log(f">> {u.id}: {u.what} (slot {slot:.0f} s, {self.left():.0f} s left)")
        status = "ok"
        signal.signal(signal.SIGALRM, _alarm)
        signal.setitimer(signal.ITIMER_REAL, slot)
        try:
            if self.args.inject_failure and self.args.inject_failure in u.id:
                raise RuntimeError(f"injected failure in {u.id} (--inject-failure test hook)")
            u.fn(rec)
        except SkipUnit as e:
            status = f"not run: {e}"
            rec.setdefault("skipped", []).append(f"{u.id}: not run ({e})")
        except UnitTimeout:
            status = f"FAIL: timed out after {slot:.0f} s"
            self._record_error(rec, u, status, None)
        except HardStop:
            status = "FAIL: stopped by SIGTERM (hard timeout)"
            self._record_error(rec, u, status, None)
            self.stop = True
        except Exception as e:  # noqa: BLE001 - recorded as this unit's FAIL
            status = "FAIL: " + short_error(e)
            self._record_error(rec, u, status, traceback.format_exc())
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        gc.collect()
        if self.cuda:
            self._probe_cuda(u, status)
        self.res["timeline"].append({"unit": u.id, "part": u.part, "start_s": t - T0, "seconds": time.time() - t,
                                     "status": status})
        log(f"<< {u.id}: {status} ({time.time() - t:.1f} s)")
        self.save()

    def _record_error(self, rec, u, status, tb):
        rec.setdefault("errors", []).append(f"{u.id}: {status[6:]}")
        self.res["errors"].append({"unit": u.id, "error": status[6:]})
        if tb:
            print(tb, flush=True)

    def _probe_cuda(self, u, status):
        try:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            if status.startswith("FAIL"):
                x = torch.ones(4, device="cuda")
                assert float((x + 1).sum()) == 8.0
        except Exception as e:  # noqa: BLE001
            self.cuda_broken = f"after {u.id}: {short_error(e)}"
            log(f"!! CUDA context broken {self.cuda_broken}; in-process GPU units stop, the smoke still runs")

    # ---------------------------------------------------------------- plan
    def units(self) -> list[Unit]:
        c = self.cfg
        U = []
        env = self.res["env"]
        U.append(Unit("env/copy-bandwidth", "env", "env", self.unit_copy_bw, env, what="device-to-device copy"))
        rows = {}
        for r in c["decisive"] + c["grid"]:
            rows[r.id] = self.res["rows"].setdefault(r.id, {
                "id": r.id, "label": r.label, "kind": r.kind, "params": r.params, "n": r.n, "decisive": r.decisive,
                "B": c["B"][r.n], "H": c["H"], "D": c["D"], "dtype": str(self.dtype).replace("torch.", "")})
        band_d, diff_d = c["decisive"]
        U.append(Unit(f"decisive/{band_d.id}/ours+sdpa", "decisive", "ours",
                      lambda rec, r=band_d: self.unit_ours(r, rec), rows[band_d.id], what=band_d.label))
        U.append(Unit(f"decisive/{band_d.id}/flex", "decisive", "flex",
                      lambda rec, r=band_d: self.unit_flex(r, rec), rows[band_d.id], what=band_d.label + " vs flex"))
        U.append(Unit(f"decisive/{diff_d.id}/ours", "decisive", "diff",
                      lambda rec, r=diff_d: self.unit_ours(r, rec), rows[diff_d.id], what=diff_d.label))
        for L in c["decode"]["lengths"]:
            rec = self.res["decode"].setdefault(str(L), {"L": L})
            U.append(Unit(f"decode/L{L}", "decode", "decode", lambda rec, L=L: self.unit_decode(L, rec), rec,
                          what=f"decode, cache length {L}"))
        for r in (band_d,) if self.dry else (band_d, diff_d):  # dry run: one profiler pass is the plumbing
            rec = self.res["profile"].setdefault(r.id, {"label": r.label})
            U.append(Unit(f"profile/{r.id}", "profile", "profile", lambda rec, r=r: self.unit_profile(r, rec), rec,
                          what="profiler pass, fwd+bwd"))
        sm = self.res["smoke"]
        U.append(Unit("smoke/data", "smoke", "data", self.unit_smoke_data, sm.setdefault("data", {}), gpu=False,
                      what="fake CIFAR-10 pickles"))
        for be in c["smoke"]["backends"]:
            U.append(Unit(f"smoke/train-{be}", "smoke", "train", lambda rec, be=be: self.unit_train(be, rec),
                          sm.setdefault(f"train_{be}", {"backend": be}), gpu=False,
                          what=f"train.py cifar preset, {c['smoke']['steps']} steps, IMGGEN_BACKEND={be}"))
        U.append(Unit("smoke/sample", "smoke", "sample", self.unit_sample, sm.setdefault("sample", {}), gpu=False,
                      what=f"sample.py --num {c['smoke']['sample_num']}"))
        sc = c["selfcheck"]
        checks = {d: [] for d in sc["dims"]}
        for d in sc["dims"]:
            for kind, params in sc["kinds"]:
                key = f"{kind}/D{d}"
                rec = self.res["selfcheck"].setdefault(key, {"kind": kind, "params": params, "D": d,
                                                            "dtype": str(self.dtype).replace("torch.", "")})
                checks[d].append(Unit(f"selfcheck/{key}", "selfcheck", "selfcheck",
                                      lambda rec, k=kind, p=params, d=d: self.unit_selfcheck(k, p, d, rec), rec,
                                      what=f"triton_selfcheck {kind} D={d}"))
        dims = list(sc["dims"])
        ours = [Unit(f"grid/{r.id}/ours+sdpa", "grid", "diff" if r.kind == "diffuser" else "ours",
                     lambda rec, r=r: self.unit_ours(r, rec), rows[r.id], what=r.label) for r in c["grid"]]
        first_n = min(r.n for r in c["grid"])
        U += [u for u, r in zip(ours, c["grid"]) if r.n == first_n]  # the grid at the targets' N
        U += checks[dims[0]]
        # the diffuser at the larger N last: its dense fp32 reference outlasted its slot on the H200
        late = [u for u, r in zip(ours, c["grid"]) if r.n != first_n and r.kind == "diffuser"]
        U += [u for u, r in zip(ours, c["grid"]) if r.n != first_n and r.kind != "diffuser"]
        for r in [diff_d] + c["grid"]:
            U.append(Unit(f"grid/{r.id}/flex", "grid", "flex", lambda rec, r=r: self.unit_flex(r, rec), rows[r.id],
                          what=r.label + " vs flex"))
        for d in dims[1:]:
            U += checks[d]
        return U + late

    def run(self) -> int:
        meta = self.res["meta"]
        meta.update({"started": time.strftime("%Y-%m-%d %H:%M:%S"), "dry_run": self.dry, "budget_s": self.budget,
                     "torch": torch.__version__, "python": sys.version.split()[0], "imggen_import": IMGGEN_FROM,
                     "device": torch.cuda.get_device_name() if self.cuda else "cpu (dry run)",
                     "dtype": str(self.dtype).replace("torch.", ""), "D": self.cfg["D"], "parts": sorted(self.parts),
                     "out": str(self.out), "argv": sys.argv[1:]})
        try:
            import triton
            meta["triton"] = triton.__version__
        except Exception as e:  # noqa: BLE001
            meta["triton"] = f"unavailable: {short_error(e)}"
        if self.cuda:
            p = torch.cuda.get_device_properties(0)
            meta.update({"sms": p.multi_processor_count, "gpu_mem_GiB": round(p.total_memory / 2 ** 30, 1),
                         "capability": f"{p.major}.{p.minor}"})
            torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 references are fp32
            torch.backends.cudnn.allow_tf32 = False
        log(f"gpu_check: {meta['device']}, torch {meta['torch']}, triton {meta['triton']}, dtype {meta['dtype']}, "
            f"D={meta['D']}, budget {self.budget:.0f} s, parts {','.join(sorted(self.parts))}, out {self.out}")
        self.save()
        for u in self.units():
            try:
                self.run_unit(u)
            except UnitTimeout:  # the alarm landed outside the unit's own try (e.g. while recording)
                signal.setitimer(signal.ITIMER_REAL, 0)
                self.res["errors"].append({"unit": u.id, "error": "timed out (while recording its result)"})
            if self.stop:
                break
        log(f"done in {elapsed():.0f} s; {self.out / 'gpu_check.md'}")
        self.save()
        verdicts = [t["verdict"] for t in self.res["targets"]]
        log("targets: " + ", ".join(f"{t['verdict']} {t['target']}" for t in self.res["targets"]))
        if self.dry:
            return 0
        return 0 if verdicts and all(v == "PASS" for v in verdicts) else 1

    # ---------------------------------------------------------------- units: env
    def unit_copy_bw(self, rec):
        rec["device"] = self.res["meta"]["device"]
        nbytes = (1 << 30) if self.cuda else (16 << 20)
        x = torch.randn(nbytes // 2, device=self.device, dtype=torch.bfloat16)
        y = torch.empty_like(x)
        ms = time_call(lambda: y.copy_(x), self.device, target_s=0.3)
        rec["copy_bytes"] = 2 * nbytes
        rec["copy_GBps"] = 2 * nbytes / (ms * 1e-3) / 1e9
        rec["datasheet_GBps"] = H200_HBM_GBPS
        log(f"   copy {nbytes >> 20} MiB: {rec['copy_GBps']:.0f} GB/s (read + write)")

    # ---------------------------------------------------------------- units: attention rows
    def inputs(self, row: Row, seed: int = 0):
        b, h, d = self.cfg["B"][row.n], self.cfg["H"], self.cfg["D"]
        g = torch.Generator(device=self.device).manual_seed(seed)
        q, k, v, do = (torch.randn(b, h, row.n, d, device=self.device, dtype=self.dtype, generator=g)
                       for _ in range(4))
        for t in (q, k, v):
            t.requires_grad_(True)
        return q, k, v, do

    def tol(self, pattern) -> dict:
        f = self.cfg["diffuser_tol_factor"] if pattern.is_diffusion else 1.0
        return {k: v * f for k, v in self.cfg["tol"].items()}

    def measure(self, fn, q, k, v, do, backward: bool = True) -> dict:
        """First-call and steady times of fn (forward, forward+backward), and its outputs."""
        m = {}
        t = time.time()
        o = fn(q, k, v)
        sync(self.device)
        m["first_fwd_s"] = time.time() - t
        outs = [o.detach(), None, None, None]
        if backward:
            t = time.time()
            grads = torch.autograd.grad(o, (q, k, v), do)
            sync(self.device)
            m["first_bwd_s"] = time.time() - t
            outs[1:] = [g_.detach() for g_ in grads]
            del grads
        del o
        if not self.cuda:  # dry run: interpreted kernels; the first calls are the timings (no extra calls)
            m["fwd_ms"] = m["first_fwd_s"] * 1e3
            if backward:
                m["fb_ms"] = (m["first_fwd_s"] + m["first_bwd_s"]) * 1e3
            return m, outs
        m["fwd_ms"] = time_call(lambda: fn(q, k, v), self.device)
        if backward:
            m["fb_ms"] = time_call(lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), do), self.device)
        return m, outs

    def useful(self, row_rec, pattern, n, heads) -> int:
        if "pairs_total" not in row_rec:
            per_head = count_pairs(pattern, n, heads, self.device, self.cfg["chunk_elems"])
            row_rec["pairs_per_head"] = statistics.mean(per_head)
            row_rec["pairs_total"] = sum(per_head) * row_rec["B"]
            row_rec["density"] = statistics.mean(per_head) / (n * (n + 1) / 2)
        return row_rec["pairs_total"]

    def add_tf(self, m: dict, pairs: int) -> None:
        f = 4 * self.cfg["D"] * pairs
        if m.get("fwd_ms"):
            m["fwd_TF"] = f / (m["fwd_ms"] * 1e-3) / 1e12
        if m.get("fb_ms"):
            m["fb_TF"] = 3.5 * f / (m["fb_ms"] * 1e-3) / 1e12

    def unit_ours(self, row: Row, rec: dict):
        p = row.pattern()
        q, k, v, do = self.inputs(row)
        pairs = self.useful(rec, p, row.n, q.shape[1])
        ours = lambda a, b, c: imggen.sparse_attention(a, b, c, p, backend="triton")  # noqa: E731
        m, outs = self.measure(ours, q, k, v, do)
        self.add_tf(m, pairs)
        rec["ours"] = m
        log(f"   ours: fwd {m['fwd_ms']:.3f} ms, fwd+bwd {m['fb_ms']:.3f} ms"
            + (f" ({m['fb_TF']:.0f} useful TF/s)" if not p.is_diffusion else "")
            + f"; first call {m['first_fwd_s']:.1f} + {m['first_bwd_s']:.1f} s")
        count = self.cfg["check_slices"] if not (p.is_diffusion and row.n > 16384) else 2  # dense N x N A per slice
        slices = pick_slices(q.shape[0], q.shape[1], count)
        rec.setdefault("correct", {})["ours_vs_ref"] = c = check_vs_reference(
            p, (q, k, v, do), outs, slices, self.tol(p), self.cfg["chunk_elems"])
        log(f"   ours vs fp32 reference: {'ok' if c['ok'] else 'FAIL'} " + _errs(c))
        del outs
        if p.is_diffusion:
            self.one_attention(row, p, rec, q, k, v, do)
        self.sdpa(row, rec, q, k, v, do)
        self.ratios(rec)

    def one_attention(self, row, p, rec, q, k, v, do):
        """The diffuser's graph as a single softmax attention with our kernels (target denominator)."""
        last = None
        for how, twin in (("inherited kernel spec", softmax_twin(p, table=False)),
                          ("element-mask table (fallback)", softmax_twin(p, table=True))):
            try:
                fn = lambda a, b, c, t=twin: imggen.sparse_attention(a, b, c, t, backend="triton")  # noqa: E731
                m, outs = self.measure(fn, q, k, v, do)
                m["how"] = how
                self.add_tf(m, rec["pairs_total"])
                c = check_vs_reference(twin, (q, k, v, do), outs, pick_slices(q.shape[0], q.shape[1], 2),
                                       self.tol(twin), self.cfg["chunk_elems"])
                del outs
                rec["one"] = m
                rec["correct"]["one_vs_ref"] = c
                rec["diff_over_one"] = rec["ours"]["fb_ms"] / m["fb_ms"]
                log(f"   one attention on the graph ({how}): fwd+bwd {m['fb_ms']:.3f} ms, "
                    f"{'ok' if c['ok'] else 'FAIL'} vs reference; diffuser / one = {rec['diff_over_one']:.2f}")
                if c["ok"]:
                    return
                last = None
            except Exception as e:  # noqa: BLE001 - try the fallback twin
                last = e
                rec.setdefault("notes", []).append(f"one attention via {how} failed: {short_error(e)}")
                log(f"   one attention via {how} failed: {short_error(e)}")
        if last is not None:
            raise last

    def sdpa(self, row, rec, q, k, v, do):
        key = tuple(q.shape)
        if key not in self.sdpa_cache:
            m = {}
            if self.cuda:
                from torch.nn.attention import SDPBackend, sdpa_kernel

                def fn(a, b, c):
                    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                        return F.scaled_dot_product_attention(a, b, c, is_causal=True)
                m["backend"] = "flash"
            else:
                def fn(a, b, c):
                    return F.scaled_dot_product_attention(a, b, c, is_causal=True)
                m["backend"] = "cpu default"
            mm, outs = self.measure(fn, q, k, v, do)
            del outs
            m.update(mm)
            bh, n, d = q.shape[0] * q.shape[1], q.shape[2], q.shape[3]
            dense = bh * n * (n + 1) // 2
            m["dense_fwd_TF"] = 4 * d * dense / (m["fwd_ms"] * 1e-3) / 1e12
            m["dense_fb_TF"] = 14 * d * dense / (m["fb_ms"] * 1e-3) / 1e12
            self.sdpa_cache[key] = m
            log(f"   dense causal SDPA ({m['backend']}): fwd {m['fwd_ms']:.2f} ms, fwd+bwd {m['fb_ms']:.2f} ms "
                f"({m['dense_fb_TF']:.0f} dense TF/s)")
        rec["sdpa"] = dict(self.sdpa_cache[key])
        self.add_tf(rec["sdpa"], rec["pairs_total"])

    def ratios(self, rec):
        ours = rec.get("ours") or {}
        for peer in ("flex", "sdpa"):
            pm = rec.get(peer) or {}
            for ph in ("fwd", "fb"):
                a, b = pm.get(f"{ph}_ms"), ours.get(f"{ph}_ms")
                if a and b:
                    rec[f"x_{peer}_{ph}"] = a / b

    def unit_flex(self, row: Row, rec: dict):
        p = row.pattern()
        if self.dry and p.is_diffusion:
            raise SkipUnit("dry run: eager CPU FlexAttention runs the diffuser's steps densely (~10 s)")
        q, k, v, do = self.inputs(row)
        self.useful(rec, p, row.n, q.shape[1])
        flex = lambda a, b, c: imggen.sparse_attention(a, b, c, p, backend="flex")  # noqa: E731
        ours = lambda a, b, c: imggen.sparse_attention(a, b, c, p, backend="triton")  # noqa: E731
        backward = self.cuda  # FlexAttention has no CPU backward
        if not backward:
            q, k, v = (t.detach() for t in (q, k, v))
            rec.setdefault("notes", []).append("flex: forward only (no CPU backward; dry run)")
        m, fouts = self.measure(flex, q, k, v, do, backward=backward)
        self.add_tf(m, rec["pairs_total"])
        rec["flex"] = m
        log(f"   flex: fwd {m['fwd_ms']:.3f} ms" + (f", fwd+bwd {m['fb_ms']:.3f} ms" if backward else "")
            + f"; first call {m['first_fwd_s']:.1f}" + (f" + {m['first_bwd_s']:.1f} s" if backward else " s"))
        # same inputs through ours (already compiled by its own unit, or compiled now)
        if backward:
            o = ours(q, k, v)
            oo = [o.detach(), *(g_.detach() for g_ in torch.autograd.grad(o, (q, k, v), do))]
        else:
            oo = [ours(q, k, v).detach(), None, None, None]
        tol = {key: 2 * val for key, val in self.tol(p).items()}  # two low-precision implementations
        corr = rec.setdefault("correct", {})
        corr["ours_vs_flex"] = c = compare(oo, fouts, tol)
        corr["flex_vs_ref"] = check_vs_reference(p, (q, k, v, do), fouts, pick_slices(q.shape[0], q.shape[1], 2),
                                                 self.tol(p), self.cfg["chunk_elems"])
        log(f"   ours vs flex: {'ok' if c['ok'] else 'FAIL'} " + _errs(c)
            + f"; flex vs reference: {'ok' if corr['flex_vs_ref']['ok'] else 'FAIL'}")
        if backward and not c["ok"]:  # which of the two is off: both vs the reference on the worst row's slice
            name = max((k_ for k_ in NAMES if k_ in c), key=lambda k_: c[k_]["row"])
            b_, rest = divmod(c[name]["worst_row_index"], q.shape[1] * q.shape[2])
            h_, i_ = divmod(rest, q.shape[2])
            sl = [(int(b_), int(h_))]
            c["worst_slice"] = {"tensor": name, "b": int(b_), "h": int(h_), "row": int(i_)}
            for who, xs in (("ours", oo), ("flex", fouts)):
                corr[f"{who}_vs_ref_worst_slice"] = r_ = check_vs_reference(p, (q, k, v, do), xs, sl, self.tol(p),
                                                                            self.cfg["chunk_elems"])
                log(f"   {who} vs reference on (b, h) = {sl[0]} ({name} row {int(i_)}): "
                    f"{'ok' if r_['ok'] else 'FAIL'} " + _errs(r_))
        self.ratios(rec)

    # ---------------------------------------------------------------- units: decode
    def unit_decode(self, L: int, rec: dict):
        from imggen import kernels

        c = self.cfg["decode"]
        B, H, D = c["B"], c["H"], c["D"]
        rec.update({"B": B, "H": H, "D": D})
        g = torch.Generator(device=self.device).manual_seed(L)
        kc, vc = (torch.randn(B, H, L, D, device=self.device, dtype=self.dtype, generator=g) for _ in range(2))
        q = torch.randn(B, H, D, device=self.device, dtype=self.dtype, generator=g)
        bias = torch.zeros(1, 1, L, device=self.device)
        t = time.time()
        out = kernels.decode_attention(q, kc, vc, bias)
        sync(self.device)
        rec["first_s"] = time.time() - t
        half = bias.clone()
        half[..., L // 2:] = float("-inf")  # a ring that is half full
        nb = min(B, 2)
        checks = {}
        for name, bb in (("full", bias), ("half", half)):
            got = kernels.decode_attention(q[:nb], kc[:nb], vc[:nb], bb)
            ref = kernels.decode_attention_reference(q[:nb].float(), kc[:nb].float(), vc[:nb].float(), bb)
            acc = ErrAcc()
            acc.add(got, ref)
            checks[name] = acc.result(self.cfg["tol"])
        checks["ok"] = all(v["ok"] for v in checks.values())
        rec["correct"] = checks
        nbytes = 2 * kc.numel() * kc.element_size()
        rec["bytes"] = nbytes
        rec["eager_us"] = time_call(lambda: kernels.decode_attention(q, kc, vc, bias), self.device) * 1e3
        if self.cuda and c["graph_calls"]:
            R = c["graph_calls"]
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(3):
                    kernels.decode_attention(q, kc, vc, bias)
            torch.cuda.current_stream().wait_stream(s)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(R):
                    out = kernels.decode_attention(q, kc, vc, bias)
            graph.replay()
            torch.cuda.synchronize()
            ok_graph = ErrAcc()
            ok_graph.add(out[:nb], kernels.decode_attention_reference(q[:nb].float(), kc[:nb].float(),
                                                                      vc[:nb].float(), bias))
            rec["correct"]["graph"] = ok_graph.result(self.cfg["tol"])
            rec["correct"]["ok"] = rec["correct"]["ok"] and rec["correct"]["graph"]["ok"]
            rec["graph_us"] = time_call(graph.replay, self.device, target_s=0.3) * 1e3 / R
            rec["graph_calls"] = R
            rec["us"] = rec["graph_us"]
            del graph
        else:
            rec["us"] = rec["eager_us"]
            rec.setdefault("notes", []).append("no CUDA graph on CPU: eager time")
        rec["GBps"] = nbytes / (rec["us"] * 1e-6) / 1e9
        copy = self.res["env"].get("copy_GBps")
        rec["frac_copy"] = rec["GBps"] / copy if copy else None
        rec["frac_datasheet"] = rec["GBps"] / H200_HBM_GBPS
        log(f"   L={L}: {rec['us']:.1f} us/call ({'graph' if 'graph_us' in rec else 'eager'}; eager "
            f"{rec['eager_us']:.1f} us), {rec['GBps']:.0f} GB/s"
            + (f" = {100 * rec['frac_copy']:.0f}% of copy" if rec["frac_copy"] else "")
            + f"; correct {'ok' if checks['ok'] else 'FAIL'}")

    # ---------------------------------------------------------------- units: profiler
    def unit_profile(self, row: Row, rec: dict):
        from torch.profiler import ProfilerActivity, profile

        p = row.pattern()
        q, k, v, do = self.inputs(row, seed=1)
        fn = lambda: torch.autograd.grad(imggen.sparse_attention(q, k, v, p, backend="triton"), (q, k, v), do)  # noqa: E731
        fn()
        sync(self.device)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        t = time.time()
        with profile(activities=acts) as prof:
            fn()
            sync(self.device)
        rec["wall_ms"] = (time.time() - t) * 1e3
        rec.update(breakdown(kernel_events(prof, self.cuda)))
        rec["kernels"] = rec["kernels"][:25]
        if not self.cuda:
            rec.setdefault("notes", []).append("CPU profiler (dry run): top-level CPU ops; interpreted kernels "
                                               "do not appear as kernels")
        cats = ", ".join(f"{c['category']} {100 * c['share']:.0f}%" for c in rec["categories"][:6])
        log(f"   {len(rec['kernels'])} kernels, {rec['total_us'] / 1e3:.2f} ms of kernel time: {cats}")

    # ---------------------------------------------------------------- units: smoke
    def unit_smoke_data(self, rec):
        from gpu_smoke import write_fake_cifar

        d = write_fake_cifar(self.work / "cifar", self.cfg["smoke"]["per_batch"], seed=0)
        rec.update({"dir": str(d), "per_batch": self.cfg["smoke"]["per_batch"]})

    def start_wrapped(self, kind: str, backend: str, argv: list[str]) -> dict:
        """Start bench/gpu_smoke.py KIND (train.py / sample.py in a wrapper) with IMGGEN_BACKEND=backend."""
        result = self.work / f"{kind}_{backend}.json"
        logpath = self.work / f"{kind}_{backend}.log"
        cmd = [sys.executable, str(BENCH / "gpu_smoke.py"), kind, str(result), "--", *argv]
        env = dict(os.environ, IMGGEN_BACKEND=backend, PYTHONUNBUFFERED="1")
        lf = open(logpath, "w")
        lf.write(f"==== [{elapsed():.1f}s] IMGGEN_BACKEND={backend} {' '.join(cmd)}\n")
        lf.flush()
        # own process group (killpg reaches inductor's compile workers too), same session: whatever
        # reaps this run's session on a hard kill reaps these as well
        proc = subprocess.Popen(cmd, cwd=str(ROOT), env=env, stdout=lf, stderr=subprocess.STDOUT, process_group=0)
        return {"proc": proc, "kind": kind, "result": result, "log": logpath, "file": lf, "t": time.time()}

    def wait_wrapped(self, h: dict, rec: dict) -> dict:
        """Wait for a started wrapper until the end of this unit's slot (then kill its process group);
        its output is appended to $OUT/smoke.log and its result JSON merged into rec."""
        proc = h["proc"]
        try:
            rc = proc.wait(timeout=max(1.0, self.slot_end - time.time() - 1.5))
        except subprocess.TimeoutExpired:
            rc = "killed"
            rec["error"] = f"killed after {time.time() - h['t']:.0f} s (end of its time slot)"
        except BaseException:  # UnitTimeout, HardStop: kill, keep the log, re-raise
            rc = "killed"
            raise
        finally:
            if rc == "killed":
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            h["file"].close()
            text = h["log"].read_text(errors="replace")
            with open(self.out / "smoke.log", "a") as f:
                f.write(text + "\n")
            rec["rc"] = rc
            rec["wall_s"] = time.time() - h["t"]
            rec["log_tail"] = [ln[-300:] for ln in text.splitlines()[-6:]]
        if h["result"].exists():
            rec.update({k: v for k, v in json.loads(h["result"].read_text()).items() if k != "argv"})
        if rc != 0:
            raise RuntimeError(rec.get("error") or f"{h['kind']} exited {rc}: " + " / ".join(rec["log_tail"][-2:]))
        return rec

    def train_argv(self, backend: str) -> list[str]:
        sm = self.cfg["smoke"]
        data = self.res["smoke"].get("data", {}).get("dir")
        run = self.work / f"run_{backend}"
        return ["--preset", "cifar", "--data", f"cifar:{data}", "--out", str(run), "--overwrite", "--seed", "0",
                "--steps", str(sm["steps"]), "--train.log_every", "1", "--train.eval_every", str(sm["steps"]),
                "--train.ckpt_every", str(sm["steps"]), "--train.grid_time_frac", "0", "--no-progress", *sm["args"]]

    def unit_train(self, backend: str, rec: dict):
        """train.py in its own process. On the GPU the backends run one after the other (tokens/s and
        compile times are per backend); the CPU dry run starts them together (2 cores)."""
        sm = self.cfg["smoke"]
        if not self.res["smoke"].get("data", {}).get("dir"):
            raise SkipUnit("no smoke data: smoke/data did not run")
        if backend not in self.smoke_procs:
            for be in (sm["backends"] if self.dry else (backend,)):
                if be not in self.smoke_procs and f"train_{be}" not in self.started:
                    self.smoke_procs[be] = self.start_wrapped("train", be, self.train_argv(be))
                    self.started.add(f"train_{be}")
        argv = self.train_argv(backend)
        rec["argv"] = argv
        rec["run_dir"] = argv[argv.index("--out") + 1]
        try:
            self.wait_wrapped(self.smoke_procs.pop(backend), rec)
        finally:
            rec.update(parse_train_log(Path(rec["run_dir"]) / "log.jsonl", sm["steps"]))
        log(f"   train {backend}: rc {rec.get('rc')}, {rec.get('wall_s', 0):.1f} s, step-1 bpd {fmt(rec.get('step1_bpd'))}, "
            f"last bpd {fmt(rec.get('last_bpd'))}, {fmt(rec.get('tokens_per_s'))} tokens/s, peak "
            f"{fmt((rec.get('peak_mem_bytes') or 0) / 2 ** 30)} GiB")

    def unit_sample(self, rec: dict):
        sm = self.cfg["smoke"]
        runs = [self.res["smoke"].get(f"train_{be}", {}) for be in sm["backends"]]
        run = next((r for r in runs if r.get("rc") == 0), None)
        if run is None:
            raise SkipUnit("no trained checkpoint: no training smoke succeeded")
        png = self.out / "samples.png"
        argv = ["--checkpoint", run["run_dir"], "--num", str(sm["sample_num"]), "--out", str(png), "--seed", "0"]
        if self.dry:
            argv += ["--device", "cpu", "--threads", "1"]  # default threads on a busy 2-core box: ~75x slower
        rec.update({"argv": argv, "from": run["backend"]})
        self.wait_wrapped(self.start_wrapped("sample", run["backend"], argv), rec)
        rec["png"] = str(png) if png.exists() else None
        if not png.exists():
            raise RuntimeError(f"sample.py wrote no {png}")
        log(f"   sample: {rec.get('wall_s', 0):.1f} s, {png}")

    # ---------------------------------------------------------------- units: self-check
    def unit_selfcheck(self, kind, params, d, rec):
        from imggen.attention import triton_selfcheck

        p = imggen.make_pattern(kind, **params)
        n = self.cfg["selfcheck"]["n"]
        t = time.time()
        try:
            triton_selfcheck(p, self.dtype, d, self.device, **({"n": n} if n else {}))
            rec["ok"], rec["error"] = True, None
        except Exception as e:  # noqa: BLE001 - a failed self-check is a result
            rec["ok"], rec["error"] = False, short_error(e)
        rec["seconds"] = time.time() - t
        log(f"   {kind} D={d}: {'pass' if rec['ok'] else 'FAIL: ' + rec['error']} ({rec['seconds']:.1f} s)")

    # ---------------------------------------------------------------- report
    def markdown(self) -> str:
        r, meta = self.res, self.res["meta"]
        dry = " (DRY RUN on CPU: plumbing only, no measurement)" if self.dry else ""
        L = [f"# GPU check{dry}", "",
             f"{meta.get('device')} · torch {meta.get('torch')} · triton {meta.get('triton')} · "
             f"{meta.get('dtype')} D={meta.get('D')} · started {meta.get('started')} · "
             f"{meta.get('elapsed_s', 0):.0f} s of a {self.budget:.0f} s budget · parts {','.join(meta.get('parts', []))}",
             ""]
        tg = r["targets"]
        counts = {v: sum(t["verdict"] == v for t in tg) for v in ("PASS", "FAIL", "NOT RUN")}
        L += [f"**Targets: {counts['PASS']} PASS, {counts['FAIL']} FAIL, {counts['NOT RUN']} NOT RUN**"
              + (" (dry run: verdicts exercise the logic only)" if self.dry else ""), ""]
        L.append(md_table(["target", "measured", "goal", "verdict", "why / note"],
                          [[t["target"], t["value"], t["goal"], t["verdict"],
                            "; ".join(x for x in (t["why"], t["note"]) if x)] for t in tg]))
        L += ["", md_table(["check", "result"], summary_checks(r, self.cfg))]
        env = r["env"]
        if env.get("copy_GBps"):
            L += ["", f"HBM: measured device-to-device copy {env['copy_GBps']:.0f} GB/s (read + write); "
                      f"datasheet {H200_HBM_GBPS:.0f} GB/s."]
        # rows
        rows = list(r["rows"].values())
        L += ["", "## Sparse attention (fwd+bwd unless noted; ms; x = peer time / ours)", ""]
        L.append(md_table(
            ["row", "N", "BxH", "density", "ours fwd", "ours f+b", "fwd TF/s", "f+b TF/s", "flex f+b", "x flex f+b",
             "x flex fwd", "SDPA f+b", "x SDPA f+b", "x SDPA fwd", "correct", "first s ours / flex", "status"],
            [[x["label"] + (" **(target)**" if x.get("decisive") else ""), x["n"], f"{x['B']}x{x['H']}",
              x.get("density"), g(x, "ours", "fwd_ms"), g(x, "ours", "fb_ms"), g(x, "ours", "fwd_TF"),
              g(x, "ours", "fb_TF"),
              g(x, "flex", "fb_ms"), x.get("x_flex_fb"), x.get("x_flex_fwd"), g(x, "sdpa", "fb_ms"),
              x.get("x_sdpa_fb"), x.get("x_sdpa_fwd"), corr_text(x),
              f"{fmt(first(x, 'ours'))} / {fmt(first(x, 'flex'))}", row_status(x)] for x in rows]))
        diffs = [x for x in rows if x.get("one")]
        if diffs:
            L += ["", md_table(["diffuser row", "diffuser f+b ms", "one attention f+b ms", "ratio (target <= 3)",
                                "one attention via"],
                               [[x["label"] + f" N={x['n']}", g(x, "ours", "fb_ms"), g(x, "one", "fb_ms"),
                                 x.get("diff_over_one"), g(x, "one", "how")] for x in diffs])]
        sd = {(x["n"], x["B"]): x["sdpa"] for x in rows if x.get("sdpa")}
        if sd:
            L += ["", "Dense causal SDPA itself: " + "; ".join(
                f"N={n} B={b}: fwd {fmt(m['fwd_ms'])} ms ({fmt(m['dense_fwd_TF'])} TF/s), f+b {fmt(m['fb_ms'])} ms "
                f"({fmt(m['dense_fb_TF'])} TF/s), {m['backend']}" for (n, b), m in sd.items())]
        L += ["", "### Correctness detail (rel / worst row; tolerances in the JSON)", ""]
        cl = []
        for x in rows:
            for key, c in (x.get("correct") or {}).items():
                cl.append([x["label"] + f" N={x['n']}", key, "ok" if c.get("ok") else "FAIL"]
                          + [f"{fmt(c[nm]['rel'])} / {fmt(c[nm]['row'])}" if nm in c else "-" for nm in NAMES])
        if cl:
            L.append(md_table(["row", "check", "verdict", *NAMES], cl))
        # decode
        dec = list(r["decode"].values())
        if dec:
            L += ["", "## Decode (one query vs a KV cache; B x H x L x D; CUDA graph)", ""]
            L.append(md_table(["L", "BxH", "us/call (graph)", "us/call (eager)", "GB/s", "% copy", "% 4.8 TB/s",
                               "correct", "first s", "status"],
                              [[d["L"], f"{d.get('B')}x{d.get('H')}", d.get("graph_us"), d.get("eager_us"),
                                d.get("GBps"), pct(d.get("frac_copy")), pct(d.get("frac_datasheet")),
                                ok_text(d.get("correct")), d.get("first_s"), row_status(d)] for d in dec]))
        # profile
        for rid, pr in r["profile"].items():
            if not pr.get("categories") and not pr.get("errors") and not pr.get("skipped"):
                continue
            L += ["", f"## Kernel breakdown: {pr.get('label')} fwd+bwd (one profiler pass)", ""]
            if pr.get("categories"):
                L.append(md_table(["category", "calls", "us", "share"],
                                  [[c["category"], c["calls"], c["us"], pct(c["share"])] for c in pr["categories"]]))
                L += ["", md_table(["kernel", "category", "calls", "us", "share"],
                                   [[k["name"][:90], k["category"], k["calls"], k["us"], pct(k["share"])]
                                    for k in pr["kernels"][:12]])]
                L += ["", f"kernel time {fmt(pr['total_us'] / 1e3)} ms, wall {fmt(pr.get('wall_ms'))} ms "
                          "(profiler on)" + ("; " + "; ".join(pr["notes"]) if pr.get("notes") else "")]
            L.append(row_status(pr, long=True))
        # smoke
        sm = r["smoke"]
        trains = [v for k, v in sm.items() if k.startswith("train_")]
        if trains:
            L += ["", "## Training smoke (train.py --preset cifar on generated images; sample.py)", ""]
            L.append(md_table(["backend", "rc", "wall s", "step-1 bpd", "last bpd", "tokens/s (median)",
                               "peak GiB", "status"],
                              [[t["backend"], t.get("rc"), t.get("wall_s"), t.get("step1_bpd"), t.get("last_bpd"),
                                t.get("tokens_per_s"), (t.get("peak_mem_bytes") or 0) / 2 ** 30 if t.get(
                                    "peak_mem_bytes") else None, row_status(t)] for t in trains]))
            same = smoke_same_loss(sm, self.cfg["smoke"]["backends"], self.cfg["smoke_loss_tol"])
            if same:
                sm["same_loss_step1"] = same
                L += ["", f"Step-1 loss, {same['a']} vs {same['b']}: |diff| = {fmt(same['diff'])} bits/dim "
                          f"(tolerance {same['tol']}) -> **{'PASS' if same['ok'] else 'FAIL'}**"]
            s = sm.get("sample")
            if s:
                L += ["", f"sample.py ({s.get('from')}): rc {s.get('rc')}, {fmt(s.get('wall_s'))} s, "
                          f"png {s.get('png')}; " + row_status(s)]
            if trains and trains[0].get("argv"):
                L += ["", "train.py arguments: `" + " ".join(trains[0]["argv"]) + "`"]
        # selfcheck
        sc = list(r["selfcheck"].values())
        if any("ok" in s or s.get("errors") or s.get("skipped") for s in sc):
            L += ["", "## Triton self-check (imggen.attention.triton_selfcheck, as backend 'auto' runs it)", ""]
            L.append(md_table(["kind", "dtype", "D", "result", "s", "error"],
                              [[s["kind"], s["dtype"], s["D"],
                                "pass" if s.get("ok") else ("FAIL" if "ok" in s else "not run"), s.get("seconds"),
                                s.get("error") or row_status(s)] for s in sc]))
        # errors + timeline
        if r["errors"]:
            L += ["", "## Errors", ""] + [f"- `{e['unit']}`: {e['error']}" for e in r["errors"]]
        skipped = [s for grp in (r["rows"], r["decode"], r["profile"], r["selfcheck"], r["smoke"])
                   for v in grp.values() if isinstance(v, dict) for s in v.get("skipped", [])]
        if skipped:
            L += ["", "## Not run", ""] + [f"- {s}" for s in skipped]
            L += ["", "Run the rest in a longer slot: `bash bench/gpu_check.sh --parts grid,selfcheck --budget 540`"]
        L += ["", "## Timeline", ""]
        L.append(md_table(["unit", "start s", "seconds", "status"],
                          [[t["unit"], t["start_s"], t["seconds"], t["status"]] for t in r["timeline"]]))
        L += ["", "## Conventions", ""] + [f"- {c}" for c in CONVENTIONS] + [""]
        return "\n".join(L)


def _alarm(signum, frame):
    raise UnitTimeout()


def _term(signum, frame):
    raise HardStop()


def summary_checks(r: dict, cfg: dict) -> list[list[str]]:
    """One line per group of gates that are not targets: correctness of every row that ran, the
    training smoke, the self-checks."""
    out = []
    runs = [(x["label"] + f" N={x['n']}", key, c) for x in r["rows"].values()
            for key, c in (x.get("correct") or {}).items() if not key.startswith("flex_vs_ref")]
    bad = [f"{lbl} {key}" for lbl, key, c in runs if not c.get("ok")]
    out.append(["attention correctness (ours vs fp32 reference, ours vs flex)",
                f"{len(runs) - len(bad)}/{len(runs)} ok" + (": FAIL " + ", ".join(bad) if bad else "")])
    dec = [d for d in r["decode"].values() if d.get("correct")]
    bad = [str(d["L"]) for d in dec if not d["correct"].get("ok")]
    out.append(["decode correctness", f"{len(dec) - len(bad)}/{len(dec)} ok" + (": FAIL L=" + ",".join(bad) if bad else "")])
    sm = r["smoke"]
    trains = [(be, sm.get(f"train_{be}", {})) for be in cfg["smoke"]["backends"]]
    txt = ", ".join(f"{be} {'ok' if t.get('rc') == 0 else ('not run' if 'rc' not in t else 'FAIL')}" for be, t in trains)
    same = smoke_same_loss(sm, cfg["smoke"]["backends"], cfg["smoke_loss_tol"])
    if same:
        txt += f"; step-1 loss equal within {same['tol']} bpd: {'PASS' if same['ok'] else 'FAIL'} ({fmt(same['diff'])})"
    s = sm.get("sample", {})
    txt += f"; sample.py {'ok' if s.get('rc') == 0 else ('not run' if 'rc' not in s else 'FAIL')}"
    out.append(["training smoke (train.py, sample.py)", txt])
    sc = [v for v in r["selfcheck"].values() if "ok" in v]
    bad = [f"{v['kind']}/D{v['D']}" for v in sc if not v["ok"]]
    out.append(["triton_selfcheck", f"{len(sc) - len(bad)}/{len(sc)} pass" + (": FAIL " + ", ".join(bad) if bad else "")
                + (f" ({len(r['selfcheck']) - len(sc)} not run)" if len(sc) < len(r["selfcheck"]) else "")])
    return out


def g(rec, part, key):
    return (rec.get(part) or {}).get(key)


def first(rec, part):
    m = rec.get(part) or {}
    if "first_fwd_s" not in m:
        return None
    return m["first_fwd_s"] + m.get("first_bwd_s", 0.0)


def pct(x):
    return None if x is None else f"{100 * x:.0f}%"


def ok_text(c):
    if not c:
        return "-"
    return "ok" if c.get("ok") else "FAIL"


def corr_text(rec):
    c = rec.get("correct") or {}
    parts = []
    for key, lbl in (("ours_vs_ref", "ref"), ("one_vs_ref", "one"), ("ours_vs_flex", "flex")):
        if key in c:
            parts.append(f"{lbl} {'ok' if c[key].get('ok') else 'FAIL'}")
    return ", ".join(parts) or "-"


def row_status(rec, long=False):
    """'ok', or FAIL / not run with the unit (last part of its id) and the reason."""
    errs, skipped = rec.get("errors") or [], rec.get("skipped") or []
    unit = lambda text: text.split(": ", 1)[0].rsplit("/", 1)[-1] + ": " + text.split(": ", 1)[-1]  # noqa: E731
    out = []
    if errs:
        out.append("FAIL " + "; ".join(unit(e) for e in errs))
    if skipped:
        out.append("; ".join(unit(s) for s in skipped))
    if not out:
        return "" if long else "ok"
    return " / ".join(out)[: (600 if long else 240)]


def _errs(c):
    return ", ".join(f"{n} {fmt(c[n]['rel'])}/{fmt(c[n]['row'])}" for n in NAMES if n in c)


def softmax_twin(pattern, table: bool = False):
    """The same pattern (same graph) as a plain softmax attention: a subclass of its class with
    is_diffusion off (table=True also hands the kernels per-block element masks instead of the
    pattern's arithmetic rule)."""
    from imggen.patterns import KernelSpec

    cls = type(pattern)
    if (cls, table) not in _TWINS:  # one class per (pattern class, table): equal twins share caches
        ns = {"is_diffusion": False, "__module__": __name__,
              "__qualname__": cls.__qualname__ + ("SoftmaxTable" if table else "Softmax")}
        if table:
            ns["kernel_spec"] = lambda self, tile: KernelSpec()
        _TWINS[cls, table] = type(ns["__qualname__"], (cls,), ns)
    return _TWINS[cls, table](**{f.name: getattr(pattern, f.name) for f in dataclasses.fields(pattern)})


_TWINS: dict = {}


def parse_train_log(path: Path, steps: int) -> dict:
    """From train.py's log.jsonl (--train.log_every 1): step-1 and last train bits/dim, median
    tokens/s over steps > 10 (all but step 1 on short runs), steps logged."""
    out = {"steps_logged": 0}
    if not Path(path).exists():
        return out
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            d = json.loads(line)
        except ValueError:
            continue
        if isinstance(d, dict) and "train_bpd" in d:
            rows.append(d)
    if not rows:
        return out
    rows.sort(key=lambda d: d["step"])
    out["steps_logged"] = len(rows)
    s1 = next((d for d in rows if d["step"] == 1), None)
    out["step1_bpd"] = s1["train_bpd"] if s1 else None
    out["last_step"] = rows[-1]["step"]
    out["last_bpd"] = rows[-1]["train_bpd"]
    steady = [d["tokens_per_s"] for d in rows if d["step"] > 10 and d.get("tokens_per_s")]
    if len(steady) < 3:
        steady = [d["tokens_per_s"] for d in rows if d["step"] > 1 and d.get("tokens_per_s")] or \
                 [d["tokens_per_s"] for d in rows if d.get("tokens_per_s")]
    out["tokens_per_s"] = statistics.median(steady) if steady else None
    tail = [d["train_bpd"] for d in rows[-10:]]
    out["last10_mean_bpd"] = statistics.mean(tail)
    return out


def smoke_same_loss(sm: dict, backends, tol: float) -> dict | None:
    a, b = (sm.get(f"train_{be}", {}) for be in backends[:2])
    if a.get("step1_bpd") is None or b.get("step1_bpd") is None:
        return None
    diff = abs(a["step1_bpd"] - b["step1_bpd"])
    return {"a": backends[0], "b": backends[1], "diff": diff, "tol": tol, "ok": diff <= tol}


PARTS = ("env", "decisive", "decode", "profile", "smoke", "selfcheck", "grid")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, Triton interpreter, eager flex")
    ap.add_argument("--budget", type=float, help="seconds from start for everything (default 220; dry run 150)")
    ap.add_argument("--parts", help=f"comma list of parts to run (default all): {','.join(PARTS)}")
    ap.add_argument("--out", help="results folder (default $OUT, else bench/results)")
    ap.add_argument("--skip", metavar="REGEX", help="leave out the units whose id matches (e.g. 'n65536/flex')")
    ap.add_argument("--inject-failure", metavar="UNIT", help="test hook: raise inside every unit whose id contains UNIT")
    ap.add_argument("--keep-work", action="store_true", help="keep the temporary folder (smoke data, checkpoints)")
    args = ap.parse_args(argv)
    if args.parts:
        bad = set(args.parts.split(",")) - set(PARTS)
        if bad:
            ap.error(f"--parts: unknown {sorted(bad)}; choose from {','.join(PARTS)}")
        args.parts = ",".join(sorted(set(args.parts.split(",")) | {"env"}))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU visible to torch (torch.cuda.is_available() is False); run it on an H200, "
              "or use --dry-run for the CPU plumbing test", flush=True)
        return 2
    signal.signal(signal.SIGTERM, _term)
    check = Check(args)
    try:
        return check.run()
    except HardStop:
        log("stopped by SIGTERM; partial results written")
        return 1
    finally:
        for h in check.smoke_procs.values():  # started but never waited for (run stopped early)
            try:
                os.killpg(h["proc"].pid, signal.SIGKILL)
            except OSError:
                pass
        check.save()
        if args.keep_work:
            log(f"work folder kept: {check.work}")
        else:
            shutil.rmtree(check.work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
