"""Compile every kernel variant the launchers can pick for a GPU target, on a machine without one.

The Triton interpreter runs the kernels' Python, not the compiler, so type or layout errors, register
spills and shared-memory overruns would first show up on a GPU. This compiles each variant to a
cubin for sm_90 (H100/H200) with Triton's bundled ptxas and reports, per variant, registers per
thread, spill stores/loads (ptxas -v) and the shared memory Triton requests at launch.

Variants = every configuration in kernels.tuning.CONFIGS x head dim 32/64/128 x fp16/bf16/fp32 x
every (rule, layout) kind kernels.plan.tile_spec can produce (the launchers read the same table).

    python -m imggen.kernels.aot_check --json            # every variant, JSON on stdout
    python -m imggen.kernels.aot_check --quick           # each configuration once (bf16/fp32, one kind)
    python -m imggen.kernels.aot_check --markdown FILE   # also write the table as markdown

Exit status 1 when a variant fails to compile, a hot kernel (one with a loop over tiles) spills, or
shared memory exceeds the sm_90 limit (227 KB). Must run without TRITON_INTERPRET=1 (the kernels
are decorated for the interpreter otherwise).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

from imggen.patterns import KernelLayout, KernelRule

from . import tuning
from .plan import launchable_kinds
from .tuning import FP32, HALF, SMEM_LIMIT, Config

DTYPES = {HALF: ("bf16", "fp16"), FP32: ("fp32",)}
ELEMENT = ("Q", "K", "V", "O", "DO", "DQ", "DK", "DV", "X", "Y", "OUT", "G", "ZS", "ZK", "P", "DS")
FP32_PTRS = ("LSE", "DELTA", "DKP", "DVP", "PART", "PO", "PM", "PL", "BIAS")
INT_PTRS = ("LAY", "CNT", "TLAY", "TCNT", "ITEMS", "RAND", "FLUSH")
FLOATS = ("sm2", "scale", "c1", "c2", "alpha")
# integer arguments that are multiples of 16 at run time (strides of D-contiguous rows), as Triton
# specialises them when it launches
ALIGNED = ("sqb", "sqh", "sqn", "skb", "skh", "skn", "svb", "svh", "svn", "sxb", "sxh", "sxn", "syb", "syh",
           "syn", "syk", "sob", "soh", "son", "skl", "svl")


@dataclass(frozen=True)
class Variant:
    kernel: str           # the Triton function (module attribute)
    dtype: str
    d: int
    kind: str             # pattern kind / mode
    config: Config
    hot: bool             # loops over tiles: must not spill
    consts: tuple         # constexpr (name, value) pairs
    overrides: tuple = ()  # argument types that differ from the defaults (name, type)


def _kind(rule, layout) -> str:
    return f"{KernelRule(rule).name.lower()}/{KernelLayout(layout).name.lower()}"


QUICK_D = 64
# quick: an arithmetic layout and the rule with the most registers
QUICK_KINDS = [(KernelRule.BAND, KernelLayout.BAND), (KernelRule.LOCAL2D, KernelLayout.TABLE)]


def variants(quick: bool = False) -> list[Variant]:
    """Every kernel variant the launchers in kernels.sparse_ops / kernels.decode can launch (quick: the
    default configuration of each kernel at D=64 in bf16 and fp32, band and local2d kinds)."""
    out = []
    for (kernel, d, prec), configs in tuning.CONFIGS.items():
        if quick and d != QUICK_D:
            continue
        for dt in DTYPES[prec][:1] if quick else DTYPES[prec]:
            for cfg in configs[:1] if quick else configs:
                out += _variants_of(kernel, d, dt, prec, cfg, quick)
    return out


def _variants_of(kernel: str, d: int, dt: str, prec: str, cfg: Config, quick: bool) -> list[Variant]:
    def v(fn, kind, consts, hot=True, overrides=()):
        return Variant(fn, dt, d, kind, cfg, hot, tuple(consts.items()), tuple(overrides))

    tiles = dict(BM=cfg.bm, BN=cfg.bn, D=d, IEEE=prec == FP32)
    kinds = QUICK_KINDS if quick else launchable_kinds()
    if kernel == "fwd":
        return [v("_fwd", _kind(r, lay), dict(RULE=int(r), LAYOUT=int(lay), **tiles, WRITE_O=True, WRITE_P=False),
                  overrides=(("P", "*fp32"),)) for r, lay in kinds]
    if kernel in ("dq", "dkdv"):
        fn = "_bwd_dq" if kernel == "dq" else "_bwd_dkdv"
        return [v(fn, _kind(r, lay), dict(RULE=int(r), LAYOUT=int(lay), **tiles)) for r, lay in kinds]
    if kernel == "diffuser":
        dkinds = [(KernelRule.DIFFUSER, KernelLayout.TABLE)] if quick else launchable_kinds(diffusion=True)
        out = [v("_fwd", "A " + _kind(r, lay), dict(RULE=int(r), LAYOUT=int(lay), **tiles, WRITE_O=False,
                                                     WRITE_P=True), overrides=(("O", "*fp32"),)) for r, lay in dkinds]
        out += [v("_spmm", ("A^T" if t else "A") + (" X + Y" if y else " X"), dict(TRANS=t, HAS_Y=y, **tiles))
                for t, y in ((False, True), (True, False), (True, True))]
        return out + [v("_diff_ds", "dS", tiles)]
    if kernel == "pre":
        return [v("_bwd_pre", "delta", dict(BM=cfg.bm, D=d), hot=False)]
    if kernel == "flush":  # rows = the key tile of its producers (dK/dV, A^T products)
        bns = sorted({c.bn for k, cs in tuning.CONFIGS.items() if k[0] in ("dkdv", "diffuser") and k[1:] == (d, prec)
                      for c in (cs[:1] if quick else cs)})
        return [v("_flush", f"rows={bn}", dict(BN=bn, D=d), hot=False) for bn in bns]
    if kernel == "decode":
        from .decode import COMBINE_CHUNK
        return [v("_decode_split", "split", dict(BL=cfg.bm, D=d)),
                v("_decode_combine", "combine", dict(CH=COMBINE_CHUNK, D=d), hot=False)]
    raise ValueError(f"aot_check: no variants for kernel {kernel!r}")


def _function(name: str):
    from . import decode, sparse_kernels
    return getattr(sparse_kernels, name, None) or getattr(decode, name)


def _ptxas_stats(ptx: str, arch: int) -> dict:
    """Registers and spills from ptxas -v, run with the flags Triton uses for the cubin."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        cmd = [get_ptxas(arch).path, "-lineinfo", "-v", "--regAllocOptLevel=2",
               f"--gpu-name={sm_arch_from_capability(arch)}", src, "-o", os.path.join(tmp, "k.o")]
        log = subprocess.run(cmd, check=True, capture_output=True, text=True).stderr
    num = lambda pat: int(re.search(pat, log).group(1))  # noqa: E731
    return {"registers": num(r"Used (\d+) registers"), "spill_stores": num(r"(\d+) bytes spill stores"),
            "spill_loads": num(r"(\d+) bytes spill loads"), "stack": num(r"(\d+) bytes stack frame")}


def compile_variant(var: Variant, arch: int = 90) -> dict:
    """Compile one variant; -> its fields plus registers, spills, shared memory, seconds (or error)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = _function(var.kernel)
    consts = dict(var.consts)
    types = {**{n: "*" + var.dtype for n in ELEMENT}, **{n: "*fp32" for n in FP32_PTRS},
             **{n: "*i32" for n in INT_PTRS}, "EMASK": "*i8", **{n: "fp32" for n in FLOATS}, **dict(var.overrides)}
    sig = {n: ("constexpr" if n in consts else types.get(n, "i32")) for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if n not in consts and (sig[n].startswith("*") or n in ALIGNED)}
    row = {**asdict(var), "config": str(var.config)}
    del row["consts"], row["overrides"]
    t = time.time()
    try:
        k = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", arch, 32),
                           options=var.config.launch())
        row.update(_ptxas_stats(k.asm["ptx"], arch), shared=k.metadata.shared)
    except Exception as e:  # noqa: BLE001 - reported per variant; the run fails
        row["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    row["seconds"] = round(time.time() - t, 2)
    return row


def violations(row: dict) -> list[str]:
    if "error" in row:
        return [row["error"]]
    out = []
    if row["hot"] and (row["spill_stores"] or row["spill_loads"]):
        out.append(f"spills {row['spill_stores']}/{row['spill_loads']} bytes")
    if row["shared"] > SMEM_LIMIT:
        out.append(f"shared memory {row['shared']} > {SMEM_LIMIT}")
    return out


def markdown(rows: list[dict], command: str, seconds: float) -> str:
    bad = [r for r in rows if violations(r)]
    ok = [r for r in rows if "error" not in r]
    lines = [
        "# Kernel variants compiled for sm_90 without a GPU", "",
        f"`{command}` (TRITON_INTERPRET unset), {datetime.date.today().isoformat()}: {len(rows)} variants in "
        f"{seconds / 60:.1f} min with {os.cpu_count()} CPU cores, Triton's bundled ptxas; "
        f"**{len(bad)} violations** (compile error, spill in a hot kernel, shared memory > {SMEM_LIMIT} B).", "",
        "Variants: every configuration in `kernels/tuning.py` (`CONFIGS`, BMxBN / warps / stages) x head dim x "
        "fp16/bf16/fp32 x every (rule / layout) kind `kernels.plan.tile_spec` can produce; the launchers read the "
        "same table. Registers and spills from `ptxas -v`, shared memory as Triton requests it at launch. "
        "Hot = loops over tiles (must not spill).", "",
        "| kernel | variants | registers (max) | spill bytes (max) | shared memory (max B) |", "|---|---|---|---|---|"]
    for name in dict.fromkeys(r["kernel"] for r in rows):
        mine = [r for r in ok if r["kernel"] == name]
        lines.append(f"| {name} | {len([r for r in rows if r['kernel'] == name])} | "
                     f"{max((r['registers'] for r in mine), default='-')} | "
                     f"{max((r['spill_stores'] + r['spill_loads'] for r in mine), default='-')} | "
                     f"{max((r['shared'] for r in mine), default='-')} |")
    lines += ["", "| kernel | dtype | D | kind | config | hot | registers | spill st/ld (B) | shared (B) | status |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        stats = "- | - | -" if "error" in r else \
            f"{r['registers']} | {r['spill_stores']}/{r['spill_loads']} | {r['shared']}"
        lines.append(f"| {r['kernel']} | {r['dtype']} | {r['d']} | {r['kind']} | {r['config']} | "
                     f"{'yes' if r['hot'] else 'no'} | {stats} | {'; '.join(violations(r)) or 'ok'} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="each configuration once (bf16 / fp32, one pattern kind)")
    ap.add_argument("--json", action="store_true", help="print one JSON list of per-variant results")
    ap.add_argument("--markdown", metavar="FILE", help="also write the table as markdown")
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability as an int (default 90)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel compiles (default: CPU count)")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("aot_check: unset TRITON_INTERPRET first", file=sys.stderr)
        return 2
    t0 = time.time()
    todo = variants(args.quick)
    with concurrent.futures.ProcessPoolExecutor(args.jobs) as pool:
        rows = []
        for row in pool.map(compile_variant, todo, [args.arch] * len(todo)):
            rows.append(row)
            if not args.json:
                stats = row.get("error") or (f"regs {row['registers']:3d} spill {row['spill_stores']}/"
                                             f"{row['spill_loads']} shared {row['shared']}")
                print(f"{'FAIL' if violations(row) else 'ok  '} {row['kernel']:15s} {row['dtype']} D={row['d']:<3d} "
                      f"{row['kind']:18s} {row['config']:14s} {stats} ({row['seconds']}s)", flush=True)
    seconds = time.time() - t0
    bad = [r for r in rows if violations(r)]
    if args.json:
        print(json.dumps(rows, indent=1))
    if args.markdown:
        cmd = " ".join(["python -m imggen.kernels.aot_check", *(sys.argv[1:] if argv is None else argv)])
        with open(args.markdown, "w") as f:
            f.write(markdown(rows, cmd, seconds))
    print(f"aot_check: {len(rows)} variants compiled for sm_{args.arch} in {seconds:.0f}s; {len(bad)} violations",
          file=sys.stderr)
    for r in bad:
        print(f"  {r['kernel']} {r['dtype']} D={r['d']} {r['kind']} {r['config']}: {'; '.join(violations(r))}",
              file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
