"""Tile configurations of every kernel: the one table the launchers, the autotuner and aot_check read.

`CONFIGS[(kernel, head dim, precision)]` lists the configurations a launcher may pick, best guess
first. Only configurations that compile for sm_90 without register spills in the hot loops and
within the shared-memory limit are listed (`python -m imggen.kernels.aot_check --json` proves it
for every entry), so nothing is left to fail at run time.

Choice: `choose` returns the first candidate (deterministic) unless IMGGEN_AUTOTUNE=1 is set on a
CUDA machine; then it times every candidate once per shape key and keeps the fastest. Tests force a
configuration with `forced(...)` to check each one under the interpreter.

Kernels and what (bm, bn) mean:
* fwd:      program = bm queries, inner loop over key tiles of bn.
* dq:       program = bm queries, inner loop over key tiles of bn (FlashAttention-2: long bm, short bn).
* dkdv:     program = bn keys, inner loop over query tiles of bm (short bm, long bn).
* diffuser: the A blocks (bm x bn) that the diffuser's forward stores and its products read; one
            configuration, since the stored layout must be known before tracing (no autotuning).
* pre:      rows per program of delta = rowsum(dO * O) (bn unused).
* flush:    sums the partial dK/dV (or A^T X) of key tiles whose query list was split (bm unused:
            the rows are the producer's bn).
* decode:   bm = cache slots per iteration of one query (bn unused).
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

HEAD_DIMS = (32, 64, 128)
HALF, FP32 = "half", "fp32"  # fp16/bf16 run tensor-core dots; fp32 runs IEEE dots (no TF32)
SMEM_LIMIT = 232448          # sm_90 shared memory per block (227 KB)


@dataclass(frozen=True)
class Config:
    bm: int
    bn: int
    warps: int
    stages: int

    def __str__(self) -> str:
        return f"{self.bm}x{self.bn}/w{self.warps}/s{self.stages}"

    def launch(self) -> dict:
        return {"num_warps": self.warps, "num_stages": self.stages}


C = Config
CONFIGS: dict[tuple[str, int, str], tuple[Config, ...]] = {
    # D=64 fp16/bf16 first entries: measured on an H200 (bench/gpu/gpu_tune.py; bench/results/h200/
    # 2_tile_sweep.md): 64-query tiles with 4 warps (one warpgroup) beat the 128 x 64 / 8-warp tiles
    # for band w=256 and w=1024, local2d and bigbird at N=16384 (forward 1.3-1.8x; band w=256: dQ
    # 1.8x, dK/dV 1.4x, fwd+bwd 4.81 -> 3.22 ms). D=32 (the presets' head dim), measured the same way
    # (bench/results/h200/5_tile_sweep_d32.md): 64-query / 4-warp tiles again beat the 128 x 64 /
    # 8-warp first guesses (fwd 1.15-1.98x, dQ 1.10-1.27x; dK/dV 32 x 64: 1.23-1.35x) for band
    # w=256 / w=1024 and local2d (bigbird: fwd only, 1.98x; its backward rows were cut by the budget).
    # D=128 entries are not measured on a GPU yet.
    # forward: 128-query tiles need 8 warps on sm_90 (4 warps spill at D >= 64), and 128 x 128 tiles
    # spill with the arithmetic element rules at D >= 64; the 64 x 64 entry keeps arithmetic rules
    # for patterns whose layout is exact only at 64 tokens (bigbird / diffuser with block 64)
    ("fwd", 32, HALF): (C(64, 64, 4, 3), C(64, 32, 4, 3), C(128, 64, 8, 3)),
    ("fwd", 64, HALF): (C(64, 32, 4, 3), C(64, 64, 4, 3), C(128, 64, 8, 3)),
    ("fwd", 128, HALF): (C(128, 64, 8, 3), C(128, 64, 8, 2), C(64, 64, 8, 3)),
    # dQ: long query tile, short key steps (FlashAttention-2 / the Triton tutorial: 128 x 32)
    ("dq", 32, HALF): (C(64, 64, 4, 3), C(64, 32, 4, 3), C(128, 64, 8, 3)),
    ("dq", 64, HALF): (C(64, 32, 4, 3), C(64, 64, 4, 3), C(128, 64, 8, 3)),
    ("dq", 128, HALF): (C(128, 32, 8, 3), C(64, 32, 4, 3), C(64, 64, 8, 3)),
    # dK/dV: long key tile, short query steps (the tutorial: 32 x 128)
    ("dkdv", 32, HALF): (C(32, 64, 4, 3), C(64, 64, 4, 3), C(32, 128, 8, 3)),
    ("dkdv", 64, HALF): (C(32, 64, 4, 3), C(64, 64, 4, 3), C(32, 128, 8, 3)),
    ("dkdv", 128, HALF): (C(32, 128, 8, 2), C(32, 64, 8, 3)),  # 64 x 64 spills with the local2d rule
    # fp32 runs IEEE dots on FMA units, whose operands hold the inner dimension in registers: 16 x 16
    # tiles and one stage, as FlexAttention does for fp32 (not a speed path). At D=128 every tile
    # shape spills on sm_90, so fp32 with D=128 has no entry: the launchers refuse it (`supported`)
    **{(k, d, FP32): (C(16, 16, 4, 1),) for k in ("fwd", "dq", "dkdv") for d in (32, 64)},
    # the diffuser: one A-block shape for its forward, diffusion products and dS/dQ kernel
    ("diffuser", 32, HALF): (C(64, 64, 4, 3),),
    ("diffuser", 64, HALF): (C(64, 64, 4, 3),),
    ("diffuser", 128, HALF): (C(64, 64, 8, 2),),
    ("diffuser", 32, FP32): (C(32, 32, 8, 2),),
    ("diffuser", 64, FP32): (C(32, 32, 8, 2),),
    **{("pre", d, p): (C(128, 0, 4, 1),) for d in HEAD_DIMS for p in (HALF, FP32) if (d, p) != (128, FP32)},
    **{("flush", d, p): (C(0, 0, 4, 2),) for d in HEAD_DIMS for p in (HALF, FP32) if (d, p) != (128, FP32)},
    **{("decode", d, p): (C(64 if d <= 64 else 32, 0, 4, 3),) for d in HEAD_DIMS for p in (HALF, FP32)},
}


def precision(dtype) -> str:
    return FP32 if dtype in (torch.float32, "fp32") else HALF


def candidates(kernel: str, d: int, dtype) -> tuple[Config, ...]:
    return CONFIGS[(kernel, d, precision(dtype))]


def supported(d: int, dtype) -> bool:
    """Whether the attention kernels have configurations for this head dim and dtype."""
    return ("fwd", d, precision(dtype)) in CONFIGS


# ----------------------------------------------------------------------------------- choice
_FORCED: dict[str, Config] = {}
_BEST: dict[tuple, Config] = {}


def autotuning() -> bool:
    return os.environ.get("IMGGEN_AUTOTUNE", "") == "1" and torch.cuda.is_available()


@contextlib.contextmanager
def forced(**configs: Config) -> Iterator[None]:
    """Make the launchers use these configurations (kernel name -> Config), e.g. in tests."""
    old = dict(_FORCED)
    _FORCED.update(configs)
    try:
        yield
    finally:
        _FORCED.clear()
        _FORCED.update(old)


def forced_config(kernel: str) -> Config | None:
    return _FORCED.get(kernel)


def choose(kernel: str, d: int, dtype, cands: tuple[Config, ...], key: tuple = (),
           bench: Callable[[Config], float] | None = None) -> Config:
    """The configuration to launch: forced, else autotuned per (kernel, d, dtype, key) when
    IMGGEN_AUTOTUNE=1 on CUDA and `bench` (seconds per run of a config) is given, else cands[0]."""
    if kernel in _FORCED:
        return _FORCED[kernel]
    if bench is None or len(cands) == 1 or not autotuning():
        return cands[0]
    k = (kernel, d, precision(dtype), *key)
    if k not in _BEST:
        _BEST[k] = min(cands, key=bench)
    return _BEST[k]
