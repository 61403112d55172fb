"""How bench/gpu/gpu_bench.py runs its units in a short GPU slot, whatever they measure.

Every unit runs in priority order under one deadline: it starts only if its time slot's minimum
still fits the budget, and is stopped (SIGALRM) at the end of its slot. An exception or a timeout
is recorded as that unit's FAIL with the error text and the next unit runs; the results (JSON +
markdown) are rewritten atomically after every unit, so a run killed from outside still leaves
them. A broken CUDA context stops the in-process GPU units only; work in child processes (the
training smoke) goes on, each in its own process group, killed at the end of its slot.
"""
from __future__ import annotations

import dataclasses
import gc
import json
import os
import re
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

from harness import ROOT, Stopwatch, short_error, write_results


class UnitTimeout(BaseException):
    """A unit ran past its time slot (BaseException so that library code does not swallow it)."""


class HardStop(BaseException):
    """SIGTERM from outside (gpu_check.sh's hard timeout)."""


class SkipUnit(Exception):
    """A unit that cannot run because an earlier one did not (recorded as 'not run')."""


def _alarm(signum, frame):
    raise UnitTimeout()


def _term(signum, frame):
    raise HardStop()


def stop_on_sigterm() -> None:
    """SIGTERM (the hard timeout) raises HardStop wherever the run is."""
    signal.signal(signal.SIGTERM, _term)


@dataclasses.dataclass
class Unit:
    id: str
    part: str
    slot: str
    fn: object
    rec: dict
    gpu: bool = True
    what: str = ""


class Runner:
    """Runs units (a subclass plans them: units()) into self.res and writes `stem`.json / .md under out.

    A subclass sets slots ({slot: (seconds needed to start, cap)}) and reserve_s, and provides
    units(), evaluate(res) (the targets) and markdown()."""

    slots: dict = {}
    reserve_s = 4.0

    def __init__(self, args, clock: Stopwatch, out: Path, budget: float, dry: bool, cuda: bool, parts: set,
                 stem: str, work: Path):
        self.args, self.clock, self.out, self.budget, self.dry, self.cuda = args, clock, out, budget, dry, cuda
        self.parts, self.stem, self.work = parts, stem, work
        self.deadline = clock.start + budget
        self.cuda_broken = None
        self.stop = False
        self.slot_end = time.time()
        self.res = {"meta": {}, "env": {}, "targets": [], "timeline": [], "errors": []}

    def log(self, msg: str) -> None:
        self.clock.log(msg)

    def units(self) -> list[Unit]:
        raise NotImplementedError

    def evaluate(self, res: dict) -> list[dict]:
        raise NotImplementedError

    def markdown(self) -> str:
        raise NotImplementedError

    # ---------------------------------------------------------------- bookkeeping
    def left(self) -> float:
        return self.deadline - time.time()

    def save(self) -> None:
        self.res["meta"]["elapsed_s"] = self.clock.elapsed()
        self.res["targets"] = self.evaluate(self.res)
        write_results(self.out, self.stem, self.res, self.markdown())

    def run_units(self) -> None:
        for u in self.units():
            try:
                self.run_unit(u)
            except UnitTimeout:  # the alarm landed outside the unit's own try (e.g. while recording)
                signal.setitimer(signal.ITIMER_REAL, 0)
                self.res["errors"].append({"unit": u.id, "error": "timed out (while recording its result)"})
            if self.stop:
                break

    def run_unit(self, u: Unit) -> None:
        rec, log, t0 = u.rec, self.log, self.clock.start
        if self.stop:
            return
        if u.part not in self.parts:
            return
        if self.args.skip and re.search(self.args.skip, u.id):
            rec.setdefault("skipped", []).append(f"{u.id}: not run (--skip)")
            return
        start_need, cap = self.slots[u.slot]
        if self.dry:
            start_need, cap = 0.0, max(cap, 60)
        if u.gpu and self.cuda_broken:
            rec.setdefault("skipped", []).append(f"{u.id}: not run (the CUDA context broke {self.cuda_broken})")
            log(f"skip {u.id}: CUDA context broken earlier")
            return
        left = self.left() - self.reserve_s
        if left < start_need:
            rec.setdefault("skipped", []).append(f"{u.id}: not run (time budget: {left:.0f} s left, needs ~{start_need} s)")
            self.res["timeline"].append({"unit": u.id, "part": u.part, "start_s": self.clock.elapsed(), "seconds": 0.0,
                                         "status": "not run (budget)"})
            log(f"skip {u.id}: {left:.0f} s left of the budget, it needs ~{start_need} s")
            self.save()
            return
        slot = max(1.0, min(cap, left))
        t = time.time()
        self.slot_end = t + slot
        log(f">> {u.id}: {u.what} (slot {slot:.0f} s, {self.left():.0f} s left)")
        status = "ok"
        signal.signal(signal.SIGALRM, _alarm)
        signal.setitimer(signal.ITIMER_REAL, slot)
        try:
            if self.args.inject_failure and self.args.inject_failure in u.id:
                raise RuntimeError(f"injected failure in {u.id} (--inject-failure test hook)")
            u.fn(rec)
        except SkipUnit as e:
            status = f"not run: {e}"
            rec.setdefault("skipped", []).append(f"{u.id}: not run ({e})")
        except UnitTimeout:
            status = f"FAIL: timed out after {slot:.0f} s"
            self._record_error(rec, u, status, None)
        except HardStop:
            status = "FAIL: stopped by SIGTERM (hard timeout)"
            self._record_error(rec, u, status, None)
            self.stop = True
        except Exception as e:  # noqa: BLE001 - recorded as this unit's FAIL
            status = "FAIL: " + short_error(e)
            self._record_error(rec, u, status, traceback.format_exc())
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        gc.collect()
        if self.cuda:
            self._probe_cuda(u, status)
        self.res["timeline"].append({"unit": u.id, "part": u.part, "start_s": t - t0, "seconds": time.time() - t,
                                     "status": status})
        log(f"<< {u.id}: {status} ({time.time() - t:.1f} s)")
        self.save()

    def _record_error(self, rec, u, status, tb):
        rec.setdefault("errors", []).append(f"{u.id}: {status[6:]}")
        self.res["errors"].append({"unit": u.id, "error": status[6:]})
        if tb:
            print(tb, flush=True)

    def _probe_cuda(self, u, status):
        import torch

        try:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            if status.startswith("FAIL"):
                x = torch.ones(4, device="cuda")
                assert float((x + 1).sum()) == 8.0
        except Exception as e:  # noqa: BLE001
            self.cuda_broken = f"after {u.id}: {short_error(e)}"
            self.log(f"!! CUDA context broken {self.cuda_broken}; in-process GPU units stop, the smoke still runs")

    # ---------------------------------------------------------------- child processes
    def start_wrapped(self, script: Path, kind: str, backend: str, argv: list[str]) -> dict:
        """Start `script` KIND RESULT.json -- argv (bench/gpu/gpu_smoke.py: train.py / sample.py in a
        wrapper) with IMGGEN_BACKEND=backend, its output into a log in the work folder."""
        result = self.work / f"{kind}_{backend}.json"
        logpath = self.work / f"{kind}_{backend}.log"
        cmd = [sys.executable, str(script), kind, str(result), "--", *argv]
        env = dict(os.environ, IMGGEN_BACKEND=backend, PYTHONUNBUFFERED="1")
        lf = open(logpath, "w")
        lf.write(f"==== [{self.clock.elapsed():.1f}s] IMGGEN_BACKEND={backend} {' '.join(cmd)}\n")
        lf.flush()
        # own process group (killpg reaches inductor's compile workers too), same session: whatever
        # reaps this run's session on a hard kill reaps these as well
        proc = subprocess.Popen(cmd, cwd=str(ROOT), env=env, stdout=lf, stderr=subprocess.STDOUT, process_group=0)
        return {"proc": proc, "kind": kind, "result": result, "log": logpath, "file": lf, "t": time.time()}

    def wait_wrapped(self, h: dict, rec: dict) -> dict:
        """Wait for a started wrapper until the end of this unit's slot (then kill its process group);
        its output is appended to $OUT/smoke.log and its result JSON merged into rec."""
        proc = h["proc"]
        try:
            rc = proc.wait(timeout=max(1.0, self.slot_end - time.time() - 1.5))
        except subprocess.TimeoutExpired:
            rc = "killed"
            rec["error"] = f"killed after {time.time() - h['t']:.0f} s (end of its time slot)"
        except BaseException:  # UnitTimeout, HardStop: kill, keep the log, re-raise
            rc = "killed"
            raise
        finally:
            if rc == "killed":
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            h["file"].close()
            text = h["log"].read_text(errors="replace")
            with open(self.out / "smoke.log", "a") as f:
                f.write(text + "\n")
            rec["rc"] = rc
            rec["wall_s"] = time.time() - h["t"]
            rec["log_tail"] = [ln[-300:] for ln in text.splitlines()[-6:]]
        if h["result"].exists():
            rec.update({k: v for k, v in json.loads(h["result"].read_text()).items() if k != "argv"})
        if rc != 0:
            raise RuntimeError(rec.get("error") or f"{h['kind']} exited {rc}: " + " / ".join(rec["log_tail"][-2:]))
        return rec

    @staticmethod
    def kill_wrapped(h: dict) -> None:
        """Kill a wrapper that was started but never waited for (the run stopped early)."""
        try:
            os.killpg(h["proc"].pid, signal.SIGKILL)
        except OSError:
            pass
