"""What bench/gpu/gpu_bench.py measures and what passes: the rows (pattern, length, batch) against their
peers, the sizes of the dry run, the time slots, and the targets with their correctness gates.

    band w=256, N=16384 fwd+bwd:  >= 1.2x FlexAttention, >= 12x dense causal SDPA, >= 150 useful TFLOP/s
    diffuser K=5, N=16384 fwd+bwd: <= 3x one sparse softmax attention over the same graph
    decode (CUDA graph), worst cache length: >= 0.5 of the measured HBM copy bandwidth

A target is PASS only if its row's correctness checks passed; a target without a measurement is
NOT RUN (a failure for the exit code). CONVENTIONS says what the numbers mean.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from harness import fmt

H200_HBM_GBPS = 4800.0  # datasheet
H200_BF16_DENSE_TFLOPS = 989.0  # datasheet, dense

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


# ================================================================================== the rows
@dataclasses.dataclass
class Row:
    id: str
    label: str
    kind: str
    params: dict
    n: int
    decisive: bool = False

    def pattern(self):
        import imggen

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

# what --parts picks from
PARTS = ("env", "decisive", "decode", "profile", "smoke", "selfcheck", "grid")


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

