"""What every bench/ script needs and none of them is about: timing, markdown tables, the machine a
run ran on, and writing results (JSON + markdown) atomically under $OUT or a given folder.

Import it with bench/ on sys.path,

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # in a script under bench/
    from harness import md_table, median_time, write_results

(the GPU check's scripts under bench/gpu/ put both bench/gpu/ and bench/ on sys.path).

It imports torch only inside the functions that need it (a driver whose measurements run in child
processes, e.g. presets.py, stays light), and nothing of imggen.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
RESULTS = BENCH / "results"


# ====================================================================================== timing
def is_cuda(device) -> bool:
    return str(device).startswith("cuda")


def sync(device) -> None:
    """Wait for the GPU's queued work (nothing to wait for on a CPU device)."""
    if is_cuda(device):
        import torch

        torch.cuda.synchronize()


@dataclasses.dataclass
class Timing:
    """Seconds of each timed run, in the order they ran."""
    samples: list

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def best(self) -> float:
        return min(self.samples)

    @property
    def worst(self) -> float:
        return max(self.samples)

    @property
    def spread(self) -> float:
        """(worst - best) / median: how much the runs disagree."""
        return (self.worst - self.best) / self.median if self.median > 0 else math.inf

    def as_dict(self) -> dict:
        return {"median_s": self.median, "best_s": self.best, "worst_s": self.worst, "spread": self.spread,
                "runs": len(self.samples)}


def repeat(fn, reps: int, warmup: int = 1, device=None, before=None, clock=time.perf_counter) -> Timing:
    """fn() `warmup` times untimed, then `reps` timed runs. `before()` (if given) runs untimed ahead
    of every call, warm-up included; on a CUDA device each timed run is synchronised at both ends."""
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    for _ in range(warmup):
        if before is not None:
            before()
        fn()
    samples = []
    for _ in range(reps):
        if before is not None:
            before()
        sync(device)
        t = clock()
        fn()
        sync(device)
        samples.append(clock() - t)
    return Timing(samples)


def median_time(fn, reps: int, warmup: int = 1, device=None) -> float:
    """Median seconds of `reps` timed runs of fn() after `warmup` untimed ones."""
    return repeat(fn, reps, warmup, device).median


def time_call(fn, device, target_s: float = 0.6, warmup: int = 2, max_samples: int = 15) -> float:
    """Median milliseconds per call of fn(). CUDA: samples of k back-to-back calls between events
    (k so that a sample takes >= ~2 ms), after warm-up. CPU (dry run): one call (callers warm up)."""
    if not is_cuda(device):
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    fn()
    e.record()
    e.synchronize()
    one = max(s.elapsed_time(e), 1e-3)
    k = max(1, min(50, int(2.0 / one)))
    samples = max(3, min(max_samples, int(target_s * 1e3 / (one * k))))
    times = []
    for _ in range(samples):
        s.record()
        for _ in range(k):
            fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / k)
    return statistics.median(times)


def first_call(fn, device):
    """(fn(), seconds) of one call, synchronised: a first call's compile, autotune or plan building."""
    t = time.time()
    out = fn()
    sync(device)
    return out, time.time() - t


def cuda_graph(fn, calls: int, warmup: int = 3):
    """A CUDA graph holding `calls` calls of fn() (after `warmup` calls on a side stream, as capture
    needs), replayed once; returns (graph, the last call's output). Time it as
    time_call(graph.replay, device) / calls: no launch overhead."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            out = fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph, out


class Stopwatch:
    """Seconds since `start` (default: now), and progress lines stamped with them."""

    def __init__(self, start: float | None = None):
        self.start = time.time() if start is None else start

    def elapsed(self) -> float:
        return time.time() - self.start

    def log(self, msg: str) -> None:
        print(f"[{self.elapsed():6.1f}s] {msg}", flush=True)


# ====================================================================================== tables
def fmt(v, digits: int = 3) -> str:
    """A table cell: None '-', booleans yes/no, floats to `digits` significant digits (scientific
    outside 1e-3..1e5), everything else as str()."""
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return str(v)
        if v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-3):
            return f"{v:.2e}"
        return f"{v:.{digits}g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def md_row(cells) -> str:
    """One markdown table row: strings as they are ('|' made '/'), other values through fmt()."""
    return "| " + " | ".join(c.replace("|", "/") if isinstance(c, str) else fmt(c) for c in cells) + " |"


def md_table(header, rows) -> str:
    """A markdown table: the header, its rule, then md_row() of every row."""
    return "\n".join([md_row(list(header)), "|" + "|".join("---" for _ in header) + "|", *(md_row(r) for r in rows)])


# ====================================================================================== the machine
def _run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception:  # noqa: BLE001 - a description, never the reason a benchmark fails
        return ""


def cpu_model() -> str:
    """The CPU's model name (lscpu), else what platform knows, else 'unknown'."""
    for line in _run(["lscpu"]).splitlines():
        if line.startswith("Model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown"


def git_commit() -> str:
    """The checkout's short commit (uncommitted edits not included), or 'unknown'."""
    return _run(["git", "rev-parse", "--short", "HEAD"]) or "unknown"


def use_checkout(repo: str) -> None:
    """Import imggen from checkout `repo` (e.g. a `git worktree` of an older commit), not from an
    installed (editable) copy: the editable finders are removed and the checkout's top-level kernels/,
    datasets/ and eval/ folders serve as imggen.kernels / .datasets / .eval, as the install maps them."""
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
    sys.path.insert(0, repo)
    import imggen

    imggen.__path__.append(repo)


def machine(gpu: bool = True) -> dict:
    """What a run ran on: CPU model and logical CPUs, Python, torch (version, threads), Triton and the
    GPU where there are, and the commit."""
    import torch

    m = {"cpu": cpu_model(), "cpus": os.cpu_count(), "python": sys.version.split()[0], "torch": torch.__version__,
         "threads": torch.get_num_threads(), "commit": git_commit()}
    if gpu:
        try:
            import triton

            m["triton"] = triton.__version__
        except Exception as e:  # noqa: BLE001
            m["triton"] = f"unavailable: {short_error(e)}"
        m["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return m


def machine_line(m: dict) -> str:
    """machine() in one line for a report's head."""
    parts = [f"{m['cpu']}, {m['cpus']} logical CPUs", f"torch {m['torch']} ({m['threads']} threads)"]
    if "triton" in m:
        parts.append(f"triton {m['triton']}")
    if m.get("gpu"):
        parts.append(m["gpu"])
    parts.append(f"commit {m['commit']}")
    return " · ".join(parts)


def command_line(script: str, argv=None) -> str:
    """How this run was called: 'python bench/<script> <args>'."""
    args = list(sys.argv[1:] if argv is None else argv)
    return " ".join(["python", f"bench/{script}", *args])


def short_error(e: BaseException) -> str:
    """An exception in one line: its type, its first line and (if different) its last, <= 600 chars."""
    text = str(e).strip().splitlines()
    first = text[0] if text else ""
    last = text[-1] if len(text) > 1 else ""
    msg = f"{type(e).__name__}: {first}" + (f" ... {last}" if last and last != first else "")
    return msg[:600]


# ====================================================================================== writing results
def out_dir(given=None, default=RESULTS) -> Path:
    """The results folder: `given`, else $OUT, else `default` (bench/results); created."""
    d = Path(given or os.environ.get("OUT") or default)
    d.mkdir(parents=True, exist_ok=True)
    return d


def write_atomic(path, text: str) -> Path:
    """Write text to path through a temporary file in the same folder and a rename: a reader (or a
    run killed half-way) sees the old file or the new one, never a part."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


def write_results(folder, stem: str, data=None, markdown: str | None = None) -> list[Path]:
    """`stem`.json (data; values JSON cannot hold as their str()) and `stem`.md, each atomically."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    if data is not None:
        out.append(write_atomic(folder / f"{stem}.json", json.dumps(data, indent=1, default=str)))
    if markdown is not None:
        out.append(write_atomic(folder / f"{stem}.md", markdown))
    return out
