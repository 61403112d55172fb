"""CPU thread policy shared by the CLIs (train.py, sample.py, python -m imggen.eval).

On 2 cores shared with another busy process, every OpenMP region waits for whichever of our threads
the scheduler has put aside, and many small regions add up to a collapse (measured: 3-30x slower
with 2 threads than with 1; bench/RESULTS.md section 8, shared cores). So every CLI runs a
`Governor`: every core while the machine is otherwise idle, 1 thread while other processes keep
cores busy (rechecked every CHECK_S seconds from the kernel's count of runnable threads, ours
subtracted), with a one-line note the first time. Decoding (imggen.sampling calls `decode_tick`
once per step) also rechecks, and in sample.py it uses a second core for batches of at least
DECODE_MIN_BATCH sequences and for every batch of a model large enough for imggen.decode.panels' weight
panels (measured on the idle box, bench/panels.py, three runs: demo steps at batch 1 and 4
0.93-1.11x as fast on two threads; brats-preset steps, whose panel GEMMs split over the cores,
1.05-1.28x at batch 1 and 1.29-1.38x at batch 4).
`--threads N` (or OMP_NUM_THREADS) fixes the count and switches the governor off.
"""
from __future__ import annotations

import os
import time

import torch

DECODE_MIN_BATCH = 8
CHECK_S = 15.0
_current: Governor | None = None  # the governor of the running CLI (set_threads)


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
    """Thread count: `idle` threads (all cores unless set) when the machine is otherwise idle, 1
    while others are busy."""

    def __init__(self, n: int | None, kind: str = "train"):
        self.fixed = n is not None or "OMP_NUM_THREADS" in os.environ
        self.kind = kind
        self.cores = self.idle = os.cpu_count() or 1
        self.last, self.noted = -CHECK_S, False
        if n is not None:
            torch.set_num_threads(n)

    def tick(self) -> None:
        now = time.monotonic()
        if self.fixed or self.cores < 2 or now - self.last < CHECK_S:
            return
        self.last = now
        others = runnable_others()
        want = self.idle if others is None or others < 0.5 else 1
        if want != torch.get_num_threads():
            if want == 1 and self.idle > 1 and not self.noted:
                print(f"note: other processes keep about {others:.1f} cores busy: using 1 thread while they do "
                      f"(--threads N fixes the count)", flush=True)
                self.noted = True
            torch.set_num_threads(want)

    def set_idle(self, n: int) -> None:
        """Threads to use while the machine is idle; a change is applied at the next tick."""
        if n != self.idle:
            self.idle, self.last = n, -CHECK_S


def set_threads(n: int | None, kind: str) -> Governor:
    """Apply the policy for `kind` ("train", "sample", "eval"); returns the governor to tick."""
    global _current
    gov = _current = Governor(n, kind)
    if kind == "sample":
        gov.set_idle(1)  # until decode_tick sees a batch large enough for a second core
    gov.tick()
    return gov


def decode_tick(batch: int, large: bool = False) -> None:
    """Once per decode step (imggen.sampling): keep the running CLI's governor current; sample.py
    decodes batches smaller than DECODE_MIN_BATCH on one thread unless the model is `large`
    (imggen.decode.panels.is_large)."""
    gov = _current
    if gov is None:
        return
    if gov.kind == "sample":
        gov.set_idle(gov.cores if batch >= DECODE_MIN_BATCH or large else 1)
    gov.tick()
