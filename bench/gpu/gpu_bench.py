"""GPU check of imggen's sparse attention for a short slot; bench/gpu/gpu_check.sh runs it.

    bash bench/gpu/gpu_check.sh                  # one H200, <= 4 min with compiles; results under $OUT
    python bench/gpu/gpu_bench.py --dry-run      # CPU, tiny sizes, Triton interpreter (the CI test)
    python bench/gpu/gpu_bench.py --parts grid,selfcheck --budget 540   # the rest of the grid, longer slot

Everything is a *unit* run in priority order under one deadline (--budget seconds from start): the
rows that decide a target first, then the rest. Each unit is wrapped: an exception or its time slot
running out is recorded as a FAIL with the error text and the next unit runs; gpu_check.json and
gpu_check.md are rewritten after every unit, so a run killed from outside still leaves its results.
A broken CUDA context (e.g. an illegal address) stops the in-process GPU units only; the training
smoke runs in its own processes. What the numbers mean: CONVENTIONS in gpu_targets.py (also in gpu_check.md).

This file is the attention, decode, profiler and self-check measurements and their order; around
it: gpu_targets.py (rows, sizes, targets), gpu_reference.py (fp32 references, error metrics),
gpu_training.py (the training smoke), gpu_readouts.py (profiler and train-log reading),
gpu_report.py (gpu_check.md), gpu_runner.py (units, slots, deadline) and harness.py (timing,
tables, machine, writing).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

T0 = time.time()  # the budget counts from here, before torch's import
GPU = Path(__file__).resolve().parent  # bench/gpu: the sibling modules; bench/: harness.py


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

sys.path[:0] = [str(GPU), str(GPU.parent)]
from gpu_smoke import ensure_imggen  # noqa: E402

IMGGEN_FROM = ensure_imggen()
import imggen  # noqa: E402
import gpu_report  # noqa: E402
from gpu_readouts import breakdown, kernel_events  # noqa: E402
from gpu_reference import (NAMES, ErrAcc, check_vs_reference, compare, count_pairs, errs,  # noqa: E402
                           pick_slices, softmax_twin)
from gpu_runner import HardStop, Runner, SkipUnit, Unit, stop_on_sigterm  # noqa: E402
from gpu_training import TrainingSmoke  # noqa: E402
from gpu_targets import (CONVENTIONS, H200_HBM_GBPS, PARTS, RESERVE_S, SLOTS, Row, config,  # noqa: E402
                         evaluate_targets)
from harness import (Stopwatch, cuda_graph, first_call, machine, out_dir, short_error, sync,  # noqa: E402
                     time_call)

CLOCK = Stopwatch(T0)
log = CLOCK.log


class Check(TrainingSmoke, Runner):
    """The GPU check: plans the units (units()) and measures (unit_*) into self.res."""

    slots, reserve_s = SLOTS, RESERVE_S

    def __init__(self, args):
        dry = args.dry_run
        cfg = config(dry)
        super().__init__(args, CLOCK, out_dir(args.out), args.budget if args.budget is not None else cfg["budget"],
                         dry, cfg["device"] == "cuda", set(args.parts.split(",")) if args.parts else set(PARTS),
                         "gpu_check", Path(tempfile.mkdtemp(prefix="gpu_check_")))
        self.cfg, self.device, self.dtype = cfg, cfg["device"], cfg["dtype"]
        self.smoke_procs: dict = {}
        self.started: set = set()
        self.sdpa_cache: dict = {}
        self.res = {"meta": {}, "env": {}, "targets": [], "rows": {}, "decode": {}, "profile": {},
                    "smoke": {}, "selfcheck": {}, "timeline": [], "errors": [], "conventions": CONVENTIONS}

    def evaluate(self, res: dict) -> list[dict]:
        return evaluate_targets(res)

    def markdown(self) -> str:
        return gpu_report.markdown(self.res, self.cfg, self.budget, self.dry)

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
        m = machine()
        meta.update({"started": time.strftime("%Y-%m-%d %H:%M:%S"), "dry_run": self.dry, "budget_s": self.budget,
                     "torch": m["torch"], "python": m["python"], "imggen_import": IMGGEN_FROM,
                     "device": torch.cuda.get_device_name() if self.cuda else "cpu (dry run)",
                     "dtype": str(self.dtype).replace("torch.", ""), "D": self.cfg["D"], "parts": sorted(self.parts),
                     "out": str(self.out), "argv": sys.argv[1:], "triton": m["triton"], "cpu": m["cpu"],
                     "cpus": m["cpus"], "commit": m["commit"]})
        if self.cuda:
            p = torch.cuda.get_device_properties(0)
            meta.update({"sms": p.multi_processor_count, "gpu_mem_GiB": round(p.total_memory / 2 ** 30, 1),
                         "capability": f"{p.major}.{p.minor}"})
            torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 references are fp32
            torch.backends.cudnn.allow_tf32 = False
        log(f"gpu_check: {meta['device']}, torch {meta['torch']}, triton {meta['triton']}, dtype {meta['dtype']}, "
            f"D={meta['D']}, budget {self.budget:.0f} s, parts {','.join(sorted(self.parts))}, out {self.out}")
        self.save()
        self.run_units()
        log(f"done in {CLOCK.elapsed():.0f} s; {self.out / 'gpu_check.md'}")
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
        o, m["first_fwd_s"] = first_call(lambda: fn(q, k, v), self.device)
        outs = [o.detach(), None, None, None]
        if backward:
            grads, m["first_bwd_s"] = first_call(lambda o=o: torch.autograd.grad(o, (q, k, v), do), self.device)
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
        log(f"   ours vs fp32 reference: {'ok' if c['ok'] else 'FAIL'} " + errs(c))
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
        log(f"   ours vs flex: {'ok' if c['ok'] else 'FAIL'} " + errs(c)
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
                    f"{'ok' if r_['ok'] else 'FAIL'} " + errs(r_))
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
        out, rec["first_s"] = first_call(lambda: kernels.decode_attention(q, kc, vc, bias), self.device)
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
            graph, out = cuda_graph(lambda: kernels.decode_attention(q, kc, vc, bias), R)
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
    stop_on_sigterm()
    check = Check(args)
    try:
        return check.run()
    except HardStop:
        log("stopped by SIGTERM; partial results written")
        return 1
    finally:
        for h in check.smoke_procs.values():  # started but never waited for (run stopped early)
            check.kill_wrapped(h)
        check.save()
        if args.keep_work:
            log(f"work folder kept: {check.work}")
        else:
            shutil.rmtree(check.work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
