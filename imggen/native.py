"""Native CPU decode kernels: imggen/native.c, compiled on first use, called through ctypes.

A decode step multiplies a few rows (one per sequence) by every weight of the model and reads a
few cache slots per head; in PyTorch that is MKL's small-M GEMMs (3-6 GB/s of weights on the test
box) and dozens of small ops per layer. `linear` (with the LayerNorm before it and the GELU /
residual after it fused) and `attend` (storing the new key and value first) do the same arithmetic
in one call each, and `Blocks` a whole stack of layers per step (float32, OpenMP on torch's own
thread pool): see bench/RESULTS.md section 8 for the figures.

The library is built once per machine with the system C compiler (`cc -O3 -march=native -fopenmp`;
building and checking took about a second on the test box) into IMGGEN_CACHE_DIR (default ~/.cache/imggen), keyed by the source and the
CPU, and checked against the PyTorch reference on first use. Where there is no compiler, the build
or the check fails, or IMGGEN_NATIVE=0, `available()` is False (one warning for a failure) and
callers use their PyTorch paths, which give the same results.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings

import torch

from imggen.errors import ShapeError

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native.c")
PANEL = 16  # the panel width native.c is compiled for (its P)
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
_lib: ctypes.CDLL | None | bool = None  # None: not tried yet; False: unavailable


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


def build(compiler: str | None = None) -> str:
    """Path of the compiled library (built now unless cached); raises RuntimeError naming the
    compiler's complaint."""
    cc = compiler or os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise RuntimeError("no C compiler found (cc / gcc; set CC)")
    with open(SOURCE, "rb") as f:
        src = f.read()
    key = hashlib.sha256(src + " ".join(FLAGS).encode() + _cpu_key().encode() + cc.encode()).hexdigest()[:16]
    path = os.path.join(cache_dir(), f"imggen_native_{key}.so")
    if os.path.exists(path):
        return path
    os.makedirs(cache_dir(), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache_dir())
    os.close(fd)
    try:
        res = subprocess.run([cc, *FLAGS, SOURCE, "-o", tmp, "-lm"], capture_output=True, text=True, timeout=120)
        if res.returncode != 0:
            raise RuntimeError(f"{cc} failed: {(res.stderr or res.stdout).strip()[-500:]}")
        os.replace(tmp, path)  # atomic: a concurrent process sees no half-written library
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _load(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    lib.imggen_linear.argtypes = [p, i64, i32, i64, p, p, f32, p, p, i32, i32, p, p]
    lib.imggen_attend.argtypes = [p, p, p, i64, i64, p, p, i32, i32, i64, i32, p, i32, i64, p, i32, p]
    lib.imggen_blocks.argtypes = [ctypes.POINTER(Layer), i32, p, i32, i32, i32]
    lib.imggen_linear.restype = lib.imggen_attend.restype = lib.imggen_blocks.restype = ctypes.c_int
    return lib


def available() -> bool:
    """Whether the native kernels can be used (built, loaded and checked once per process)."""
    global _lib
    if _lib is None:
        if os.environ.get("IMGGEN_NATIVE", "") == "0":
            _lib = False
            return False
        try:
            _lib = _load(build())
            selfcheck()
        except Exception as e:  # noqa: BLE001 - any failure means the PyTorch path, never a crash
            _lib = False
            warnings.warn(f"imggen's native CPU decode kernels are unavailable ({type(e).__name__}: {e}); "
                          f"decoding uses the PyTorch path (same results, slower)", RuntimeWarning, stacklevel=2)
    return bool(_lib)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _call(fn, *args) -> None:
    if fn(*args) != 0:
        raise MemoryError(f"{fn.__name__}: out of memory")


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x (M, K) float32 with unit column stride (rows may be any stride apart)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def linear(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, out_features: int,
           ln: torch.nn.LayerNorm | None = None, act: bool = False, add: torch.Tensor | None = None) -> torch.Tensor:
    """[add +] act(ln(x) @ W^T + bias) for x (M, in) float32, W^T as imggen.panels' panels (P, in, 16)
    and bias (P, 1, 16) zero-padded (or None); ln a LayerNorm over `in` (or None), act GELU (tanh),
    add (M, out_features) -> (M, out_features)."""
    x = _rows(x)
    m, k = x.shape
    ln_w = ln_b = None
    if ln is not None:
        ln_w, ln_b = ln.weight.detach().contiguous(), ln.bias.detach().contiguous()
    if add is not None:
        add = add.contiguous()
    y = torch.empty(m, out_features, dtype=torch.float32)
    _call(_lib.imggen_linear, x.data_ptr(), m, k, x.stride(0), _ptr(ln_w), _ptr(ln_b),
          ln.eps if ln is not None else 0.0, panels.data_ptr(), _ptr(bias), out_features, int(act), _ptr(add),
          y.data_ptr())
    return y


def _heads(t: torch.Tensor, h: int, d: int) -> torch.Tensor:
    """(B, H, D) with heads D apart and unit inner stride (batch rows any stride apart)."""
    return t if t.stride(2) == 1 and t.stride(1) == d else t.contiguous()


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor | None = None,
           bias: torch.Tensor | None = None, hi: int | None = None, store: tuple | None = None) -> torch.Tensor:
    """One query per (batch, head): q (B, H, D) float32, caches k, v (B, H, L, D) contiguous; the
    slots read are [0, hi) (index None; hi defaults to L) or index (1 or H, K) int64; bias None or
    additive (1 or H, K) -> (B, H, D), as imggen.decode.decode_attention_reference(q, read(k),
    read(v), bias). store = (slot, k_new, v_new) (each (B, H, D)) writes the new position into its
    slot first (q, k_new and v_new may be views into one qkv buffer)."""
    b, h, length, d = k.shape
    nread = (length if hi is None else hi) if index is None else index.shape[-1]
    q = _heads(q, h, d)
    ld, knew, vnew, slot = q.stride(0), None, None, 0
    if store is not None:
        slot, knew, vnew = store
        knew, vnew = _heads(knew, h, d), _heads(vnew, h, d)
        if not knew.stride(0) == vnew.stride(0) == ld:
            q, knew, vnew = q.contiguous(), knew.contiguous(), vnew.contiguous()
            ld = q.stride(0)
    if index is not None:
        index = index.reshape(-1, nread).to(torch.int64).contiguous()
    if bias is not None:
        bias = bias.reshape(-1, nread).to(torch.float32).contiguous()
    out = torch.empty(b, h, d, dtype=torch.float32)
    _call(_lib.imggen_attend, q.data_ptr(), _ptr(knew), _ptr(vnew), ld, slot, k.data_ptr(), v.data_ptr(), b, h,
          length, d, _ptr(index), 1 if index is None else index.shape[0], nread, _ptr(bias),
          1 if bias is None else bias.shape[0], out.data_ptr())
    return out


class Layer(ctypes.Structure):
    """imggen_layer in native.c: one Block's weights and its cache's reads at this step."""
    _fields_ = [(f, ctypes.c_void_p) for f in ("ln1_w", "ln1_b", "qkv", "qkv_b", "proj", "proj_b", "ln2_w", "ln2_b",
                                               "fc1", "fc1_b", "fc2", "fc2_b")] + \
        [("eps1", ctypes.c_float), ("eps2", ctypes.c_float), ("hidden", ctypes.c_int), ("k", ctypes.c_void_p),
         ("v", ctypes.c_void_p), ("length", ctypes.c_int64), ("slot", ctypes.c_int64), ("nread", ctypes.c_int64),
         ("index", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("index_heads", ctypes.c_int),
         ("bias_heads", ctypes.c_int)]


class Blocks:
    """Decode steps of a stack of layers in one native call each. `weights`: per layer a dict of
    float32 contiguous tensors ln1_w, ln1_b, qkv, qkv_b, proj, proj_b, ln2_w, ln2_b, fc1, fc1_b,
    fc2, fc2_b (linears as imggen.panels' panels and padded biases; a missing bias None) and floats
    eps1, eps2; `caches` the layers' imggen.decode.Cache objects (float32, on CPU)."""

    def __init__(self, weights: list[dict], caches, heads: int):
        self.keep = weights  # the tensors the structs point into
        self.caches, self.heads = list(caches), heads
        self.layers = (Layer * len(weights))()
        for lay, w, cache in zip(self.layers, weights, self.caches):
            for name, _ in Layer._fields_[:12]:
                setattr(lay, name, _ptr(w[name]))
            lay.eps1, lay.eps2 = w["eps1"], w["eps2"]
            lay.hidden = w["hidden"]
            lay.k, lay.v, lay.length = cache.k.data_ptr(), cache.v.data_ptr(), cache.k.shape[2]

    def step(self, x: torch.Tensor, t: int) -> torch.Tensor:
        """x (B, dim) float32 at position t -> the stack's output (B, dim); stores every layer's k, v."""
        b = self.caches[0].k.shape[0]
        if x.dim() != 2 or x.shape[0] != b or x.dtype != torch.float32:
            raise ShapeError(f"a decode step of these caches takes ({b}, dim) float32 inputs (one row per "
                             f"sequence they were made for); got {tuple(x.shape)} {x.dtype}")
        x = x.contiguous().clone()
        keep = []
        for lay, cache in zip(self.layers, self.caches):
            lay.slot, hi, index, bias = cache.begin(t)
            lay.nread = hi if index is None else index.shape[-1]
            if index is not None:
                index = index.reshape(-1, lay.nread).to(torch.int64).contiguous()
            if bias is not None:
                bias = bias.reshape(-1, lay.nread).contiguous()
            lay.index, lay.index_heads = _ptr(index), 1 if index is None else index.shape[0]
            lay.bias, lay.bias_heads = _ptr(bias), 1 if bias is None else bias.shape[0]
            keep.append((index, bias))
        _call(_lib.imggen_blocks, self.layers, len(self.layers), x.data_ptr(), x.shape[0], x.shape[1], self.heads)
        return x


def selfcheck() -> None:
    """The kernels against float64 PyTorch on random inputs (awkward sizes); AssertionError if off."""
    from imggen.decode import decode_attention_reference
    from imggen.panels import _pack

    g = torch.Generator().manual_seed(0)
    for m, inp, out in ((3, 40, 37), (21, 24, 16)):
        layer = torch.nn.Linear(inp, out)
        with torch.no_grad():
            layer.weight.copy_(torch.randn(out, inp, generator=g))
        x = torch.randn(m, inp, generator=g)
        panels, bias = _pack(layer)
        got = linear(x, panels, bias, out).double()
        want = torch.nn.functional.linear(x.double(), layer.weight.double(), layer.bias.double())
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), f"native linear off by {(got - want).abs().max():.3g}"
    q, k, v = torch.randn(2, 3, 20, generator=g), torch.randn(2, 3, 9, 20, generator=g), torch.randn(2, 3, 9, 20, generator=g)
    index = torch.randint(0, 9, (3, 5), generator=g)
    bias = torch.where(torch.rand(3, 5, generator=g) < 0.3, float("-inf"), 0.0)
    bias[:, 0] = 0.0
    got = attend(q, k, v, index, bias).double()
    gather = index[None, :, :, None].expand(2, -1, -1, 20)
    want = decode_attention_reference(q.double(), torch.gather(k.double(), 2, gather),
                                      torch.gather(v.double(), 2, gather), bias.double())
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), f"native attend off by {(got - want).abs().max():.3g}"
