"""Training precision (`--train.precision auto|fp32|bf16`): which dtype the forward computes in.

`bf16` runs the training forward under `torch.autocast(dtype=torch.bfloat16)`: matrix products
(linears, convolutions, the attention's batched matmuls) in bfloat16, while the master weights, the
optimizer state, the loss, the softmax statistics and the LayerNorm statistics stay float32 (the
layers in imggen.fused, imggen.attention.blocked compute those in float32 themselves). Checkpoints stay
float32, and so do the logits (imggen.model: the output head). `auto` is bf16 on CUDA and on CPUs
that compute bfloat16 natively (AVX-512 BF16 or AMX; the flags are read once), fp32 elsewhere: on an
AVX-512 BF16 CPU default training ran 1.5x (demo) to 2.05x (moses, brats64) the steps/s of
float32 before this flag, and at equal steps bf16 cost +0.015 and +0.018 bits/dim on demo (600
steps, val, two seeds, paired intervals up to +0.017 and +0.020) and -0.014 on brats64 (200 steps,
val), within the 0.02 a default may give up (bench/RESULTS.md section 13). `--train.precision fp32`
keeps float32 throughout. `bf16` on a CPU without native bfloat16 (emulated, slower than float32) is
honoured with one warning. Evaluation and sampling run in float32.
"""
from __future__ import annotations

import functools
import warnings

import torch

from imggen.errors import ConfigError

PRECISIONS = ("auto", "fp32", "bf16")
NATIVE_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags of CPUs with bfloat16 arithmetic


@functools.lru_cache(maxsize=1)
def _cpuinfo_flags() -> frozenset:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def cpu_bf16_flags() -> tuple[str, ...]:
    """The flags of this CPU that mean native bfloat16 arithmetic (empty: none, or not readable).
    Tests monkeypatch this function to stand for another CPU."""
    flags = _cpuinfo_flags()
    found = tuple(f for f in NATIVE_FLAGS if f in flags)
    if not found and torch.backends.cpu.get_cpu_capability() == "AVX512_BF16":  # no /proc (macOS, ...)
        found = ("avx512_bf16",)
    return found


def resolve(precision: str, device) -> tuple[str, str]:
    """(the precision a run on `device` uses, "fp32" or "bf16"; why, in a few words)."""
    if precision not in PRECISIONS:
        raise ConfigError(f"train.precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    kind = torch.device(device).type
    native = "CUDA" if kind == "cuda" else ", ".join(cpu_bf16_flags()) if kind == "cpu" else ""
    if precision != "auto":
        return precision, f"asked for{'' if native or precision == 'fp32' else '; not native here, slow'}"
    if kind == "cuda":
        return "bf16", "auto: this GPU computes bf16 natively"
    if native:
        return "bf16", f"auto: this CPU computes bf16 natively ({native}); --train.precision fp32 for float32"
    return "fp32", f"auto: this {kind.upper()} has no native bf16 arithmetic"


def describe(precision: str, device) -> str:
    """The start-up line: which precision a run uses and why. Warns once when bf16 is asked for
    where it is emulated."""
    used, why = resolve(precision, device)
    if precision == "bf16" and "slow" in why:
        warnings.warn(f"--train.precision bf16 on a {torch.device(device).type.upper()} without native bf16 "
                      f"arithmetic (no {' / '.join(NATIVE_FLAGS)}): it runs, emulated, slower than fp32",
                      RuntimeWarning, stacklevel=2)
    return f"precision: {'bf16 autocast' if used == 'bf16' else 'fp32'} ({why})"


def autocast(device, precision: str = "auto"):
    """The training forward's autocast context: enabled when `precision` resolves to bf16 on `device`."""
    kind = torch.device(device).type
    return torch.autocast(kind, dtype=torch.bfloat16, enabled=resolve(precision, device)[0] == "bf16")


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype matrix products with x run in: autocast's for a float32 x while autocast is on
    for x's device, else x's own."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if x.dtype == torch.float32 and torch.is_autocast_enabled(kind) else x.dtype
