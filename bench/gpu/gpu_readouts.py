"""Reading what ran, for bench/gpu/gpu_bench.py: a torch.profiler pass into a per-kernel and per-category
breakdown (kernel names classified generically, so a renamed kernel still lands in its category),
and train.py's log.jsonl into the training smoke's numbers.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

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

