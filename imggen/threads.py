"""CPU thread policy shared by the CLIs (train.py, sample.py, python -m imggen.eval).

On 2 cores shared with another busy process, every OpenMP region waits for whichever of our threads
the scheduler has put aside, and many small regions add up to a collapse (measured: 3-30x slower
with 2 threads than with 1; bench/RESULTS.md, 'Threads'). So:
* decode-heavy work (sample.py) uses 1 thread by default: its ops are too small for a second one
  to pay, alone or not;
* training and evaluation use every core while the machine is otherwise idle and drop to 1 thread
  while other processes keep cores busy (`Governor`, rechecked every CHECK_S seconds from the
  kernel's count of runnable threads, ours subtracted), with a one-line note the first time.
`--threads N` (or OMP_NUM_THREADS) fixes the count and switches the governor off.
"""
from __future__ import annotations

import os
import time

import torch

DECODE_THREADS = 1
CHECK_S = 15.0


def runnable_others(samples: int = 5) -> float | None:
    """Average number of runnable threads of other processes (None where /proc is missing)."""
    total = 0.0
    try:
        for _ in range(samples):
            with open("/proc/loadavg") as f:
                running = int(f.read().split()[3].split("/")[0])
            ours = 0
            for tid in os.listdir("/proc/self/task"):
                try:
                    with open(f"/proc/self/task/{tid}/stat") as f:
                        ours += f.read().rsplit(")", 1)[1].split()[0] == "R"
                except OSError:
                    continue
            total += max(0, running - ours)
            time.sleep(0.002)
    except (OSError, ValueError, IndexError):
        return None
    return total / samples


class Governor:
    """Thread count for training / evaluation: all cores when idle, 1 while others are busy."""

    def __init__(self, n: int | None):
        self.fixed = n is not None or "OMP_NUM_THREADS" in os.environ
        self.cores = os.cpu_count() or 1
        self.last, self.noted = -CHECK_S, False
        if n is not None:
            torch.set_num_threads(n)

    def tick(self) -> None:
        now = time.monotonic()
        if self.fixed or self.cores < 2 or now - self.last < CHECK_S:
            return
        self.last = now
        others = runnable_others()
        want = self.cores if others is None or others < 0.5 else 1
        if want != torch.get_num_threads():
            if want == 1 and not self.noted:
                print(f"note: other processes keep about {others:.1f} cores busy: using 1 thread while they do "
                      f"(--threads N fixes the count)", flush=True)
                self.noted = True
            torch.set_num_threads(want)


def set_threads(n: int | None, kind: str) -> Governor:
    """Apply the policy for `kind` ("train", "sample", "eval"); returns the governor to tick."""
    if n is None and kind == "sample" and "OMP_NUM_THREADS" not in os.environ:
        n = DECODE_THREADS
    gov = Governor(n)
    gov.tick()
    return gov
