"""CPU thread policy shared by the CLIs (train.py, sample.py, python -m imggen.eval).

Measured on the 2-core box (bench/threads.py, results in bench/RESULTS.md): see `DEFAULTS`.
`--threads N` overrides; OMP_NUM_THREADS, when set, is respected as the default.
"""
from __future__ import annotations

import os

import torch

# work kind -> default threads (None: all cores)
DEFAULTS = {"train": None, "sample": None, "eval": None}


def set_threads(n: int | None, kind: str) -> int:
    """Set torch's intra-op threads for `kind` of work; returns the number used. Prints one hint
    when the load average says the cores are busy."""
    cores = os.cpu_count() or 1
    if n is None and "OMP_NUM_THREADS" not in os.environ:
        n = DEFAULTS.get(kind) or cores
    if n is not None:
        torch.set_num_threads(n)
    used = torch.get_num_threads()
    busy = busy_cores()
    if busy is not None and busy >= 1 and used > 1 and not torch.cuda.is_available():
        print(f"note: the load average says about {busy:.0f} of {cores} cores are busy with other work; "
              f"if this runs slowly, try --threads 1")
    return used


def busy_cores() -> float | None:
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None
