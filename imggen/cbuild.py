"""Build imggen's C kernels (imggen/decode/native.c, imggen/cpu_ops.c) once per machine.

`build(source)` compiles a C file with the system C compiler (`cc -O3 -march=native -fopenmp`, the
headers next to it on the include path) into IMGGEN_CACHE_DIR (default ~/.cache/imggen), keyed by the
source, the headers it may include (imggen/*.h), the flags, the compiler and the CPU, and named by the
library's own sha256: a truncated or altered library is rebuilt, with one note line, before it is
loaded, and a concurrent process never sees a half-written one. Callers load the library with ctypes,
check it against their PyTorch reference, and fall back to PyTorch where any of this fails (`load`).
"""
from __future__ import annotations

import contextlib
import ctypes
import glob
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]


def cache_dir() -> str:
    return os.environ.get("IMGGEN_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "imggen")


def _cpu_key() -> str:
    """What a -march=native build depends on: the compiler target and the CPU's feature flags."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return platform.machine() + flags


def file_sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def build(source: str, name: str, compiler: str | None = None) -> str:
    """Path of the library compiled from `source` (built now unless cached), its file named
    imggen_{name}_*.so; raises RuntimeError naming the compiler's complaint."""
    cc = compiler or os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise RuntimeError("no C compiler found (cc / gcc; set CC)")
    text = b""
    for path in [source, *sorted(glob.glob(os.path.join(HERE, "*.h")))]:
        with open(path, "rb") as f:
            text += f.read()
    key = hashlib.sha256(text + " ".join(FLAGS).encode() + _cpu_key().encode() + cc.encode()).hexdigest()[:16]
    stem = os.path.join(cache_dir(), f"imggen_{name}_{key}-")
    for path in sorted(glob.glob(glob.escape(stem) + "*.so")):  # named by its own sha256: checked before loading
        if os.path.basename(path)[len(os.path.basename(stem)):-3] == file_sha256(path)[:16]:
            return path
        print(f"note: the cached {name} kernel library {path} is damaged (it does not match the sha256 in its "
              f"name); building it again", file=sys.stderr, flush=True)
        with contextlib.suppress(OSError):
            os.unlink(path)
    os.makedirs(cache_dir(), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache_dir())
    os.close(fd)
    try:
        res = subprocess.run([cc, *FLAGS, "-I", HERE, source, "-o", tmp, "-lm"], capture_output=True, text=True,
                             timeout=120)
        if res.returncode != 0:
            raise RuntimeError(f"{cc} failed: {(res.stderr or res.stdout).strip()[-500:]}")
        path = f"{stem}{file_sha256(tmp)[:16]}.so"
        os.replace(tmp, path)  # atomic: a concurrent process sees no half-written library
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def load(source: str, name: str, setup, what: str, fallback: str):
    """The library built from `source` after setup(lib) (argument types, the caller's self-check;
    it returns the library), or False: with IMGGEN_NATIVE=0, or after any failure, which warns once
    that `what` is unavailable and `fallback` happens instead. Never raises."""
    if os.environ.get("IMGGEN_NATIVE", "") == "0":
        return False
    try:
        return setup(ctypes.CDLL(build(source, name)))
    except Exception as e:  # noqa: BLE001 - any failure means the PyTorch path, never a crash
        warnings.warn(f"imggen's {what} are unavailable ({type(e).__name__}: {e}); {fallback}", RuntimeWarning,
                      stacklevel=3)
        return False
