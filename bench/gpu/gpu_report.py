"""gpu_check.md from bench/gpu/gpu_bench.py's results: the targets and the other gates first, then one
table per measurement (sparse attention rows, decode, kernel breakdown, training smoke, self-check),
errors, what did not run, the timeline and the conventions.
"""
from __future__ import annotations

from gpu_readouts import smoke_same_loss
from gpu_reference import NAMES
from gpu_targets import CONVENTIONS, H200_HBM_GBPS
from harness import fmt, md_table


def markdown(r: dict, cfg: dict, budget: float, dry_run: bool) -> str:
    """The report of results r (gpu_bench's record) run with configuration cfg (gpu_targets.config)."""
    meta = r["meta"]
    dry = " (DRY RUN on CPU: plumbing only, no measurement)" if dry_run else ""
    L = [f"# GPU check{dry}", "",
         f"{meta.get('device')} · torch {meta.get('torch')} · triton {meta.get('triton')} · "
         f"{meta.get('dtype')} D={meta.get('D')} · started {meta.get('started')} · "
         f"{meta.get('elapsed_s', 0):.0f} s of a {budget:.0f} s budget · parts {','.join(meta.get('parts', []))}",
         ""]
    tg = r["targets"]
    counts = {v: sum(t["verdict"] == v for t in tg) for v in ("PASS", "FAIL", "NOT RUN")}
    L += [f"**Targets: {counts['PASS']} PASS, {counts['FAIL']} FAIL, {counts['NOT RUN']} NOT RUN**"
          + (" (dry run: verdicts exercise the logic only)" if dry_run else ""), ""]
    L.append(md_table(["target", "measured", "goal", "verdict", "why / note"],
                      [[t["target"], t["value"], t["goal"], t["verdict"],
                        "; ".join(x for x in (t["why"], t["note"]) if x)] for t in tg]))
    L += ["", md_table(["check", "result"], summary_checks(r, cfg))]
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
        same = smoke_same_loss(sm, cfg["smoke"]["backends"], cfg["smoke_loss_tol"])
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
        L += ["", "Run the rest in a longer slot: `bash bench/gpu/gpu_check.sh --parts grid,selfcheck --budget 540`"]
    L += ["", "## Timeline", ""]
    L.append(md_table(["unit", "start s", "seconds", "status"],
                      [[t["unit"], t["start_s"], t["seconds"], t["status"]] for t in r["timeline"]]))
    L += ["", "## Conventions", ""] + [f"- {c}" for c in CONVENTIONS] + [""]
    return "\n".join(L)



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

