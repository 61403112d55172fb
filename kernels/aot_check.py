"""Compile the kernels for a GPU target on a machine without one (no driver needed).

The Triton interpreter runs the kernels' Python, not the compiler, so type or layout errors that
only the compiler sees would first show up on a GPU. This compiles each kernel variant to a cubin
for sm_90 (H100/H200) with Triton's bundled ptxas.

    python -m imggen.kernels.aot_check            # every pattern kind, dtype, head dim (~5 min, 2 cores)
    python -m imggen.kernels.aot_check --quick    # one variant of each kernel (seconds)

Must run without TRITON_INTERPRET=1 (the kernels are decorated for the interpreter otherwise).
"""
from __future__ import annotations

import argparse
import os
import sys
import time


def _compile(fn, types: dict, consts: dict, num_warps: int, arch: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {n: ("constexpr" if n in consts else types.get(n, "i32")) for n in fn.arg_names}
    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps, "num_stages": 2})


def variants(quick: bool):
    from . import attention as A
    from . import decode as Dm

    dtypes = ("bf16",) if quick else ("bf16", "fp16", "fp32")
    dims = (64,) if quick else (64, 128)
    kinds = (1, 4) if quick else range(6)
    for dt in dtypes:
        p = "*" + dt
        ieee = dt == "fp32"
        ty = {**{n: "fp32" for n in ("sm2", "scale", "c1", "c2")},
              **{n: p for n in ("Q", "K", "V", "O", "DO", "DQ", "DK", "DV", "X", "Y", "OUT", "G", "Z")},
              **{n: "*fp32" for n in ("LSE", "DELTA", "BIAS", "PO", "PM", "PL")},
              **{n: p for n in ("PBUF", "P", "DS")},  # the diffuser's A / dS blocks: input dtype
              **{n: "*i32" for n in ("LAY", "CNT", "RAND", "TLAY", "TCNT")}}
        for d in dims:
            nw = 8 if d == 128 else 4
            for kind in kinds:
                base = dict(KIND=kind, R=3 if kind == 4 else 0, BLOCK=64, D=d, IEEE=ieee)
                yield f"_fwd {dt} D={d} kind={kind}", A._fwd, ty, {**base, "WRITE_O": True, "WRITE_P": False}, nw
                if kind == 4:
                    yield f"_fwd(P) {dt} D={d}", A._fwd, ty, {**base, "WRITE_O": False, "WRITE_P": True}, nw
                yield f"_bwd_dq {dt} D={d} kind={kind}", A._bwd_dq, ty, base, nw
                yield f"_bwd_dkdv {dt} D={d} kind={kind}", A._bwd_dkdv, ty, base, nw
            for tr in (False, True):
                yield f"_spmm {dt} D={d} trans={tr}", A._spmm, ty, dict(TRANS=tr, HAS_Y=not tr, BLOCK=64, D=d, IEEE=ieee), 4
            yield f"_diff_ds {dt} D={d}", A._diff_ds, ty, dict(BLOCK=64, D=d, IEEE=ieee), 4
            yield f"_decode_split {dt} D={d}", Dm._decode_split, ty, dict(BL=64 if d <= 64 else 32, D=d), 4
            yield f"_decode_combine {dt} D={d}", Dm._decode_combine, ty, dict(S2=64, D=d), 4


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one variant of each kernel")
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability as an int (default 90)")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("aot_check: unset TRITON_INTERPRET first", file=sys.stderr)
        return 2
    n = 0
    for name, fn, ty, consts, nw in variants(args.quick):
        t = time.time()
        k = _compile(fn, ty, consts, nw, args.arch)
        n += 1
        print(f"ok {name:32s} {time.time() - t:5.1f}s shared={k.metadata.shared}", flush=True)
    print(f"aot_check: {n} kernels compiled for sm_{args.arch}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
