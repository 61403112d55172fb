"""Native CPU decode kernels: imggen/decode/native.c, compiled on first use, called through ctypes.

A decode step multiplies a few rows (one per sequence) by every weight of the model and reads a
few cache slots per head; in PyTorch that is MKL's small-M GEMMs (3-6 GB/s of weights on the test
box) and dozens of small ops per layer. `linear` (with the LayerNorm before it and the GELU /
residual after it fused) and `attend` (storing the new key and value first) do the same arithmetic
in one call each, `ModelStep` a whole decode step of a model (embedding, every layer with its
cache's read plan, final LayerNorm and head) and `draw` sampling's draw of the next tokens (float32,
OpenMP on torch's own thread pool): see bench/RESULTS.md section 8 for the figures.

The library is built once per machine by imggen.cbuild (`cc -O3 -march=native -fopenmp`, cached and
checked by its sha256; building and checking took about a second on the test box) and checked
against the PyTorch reference on first use. Where there is no compiler, the build or the check
fails, or IMGGEN_NATIVE=0, `available()` is False (one warning for a failure) and callers use their
PyTorch paths, which give the same results.
"""
from __future__ import annotations

import ctypes
import os

import torch

from imggen import cbuild
from imggen.errors import ShapeError

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native.c")
PANEL = 16  # the panel width native.c is compiled for (its P)
_lib: ctypes.CDLL | None | bool = None  # None: not tried yet; False: unavailable


def build(compiler: str | None = None) -> str:
    """Path of the compiled decode library (imggen.cbuild; built now unless cached)."""
    return cbuild.build(SOURCE, "native", compiler)


def _setup(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Argument types, then the self-check (which calls through the module's library)."""
    global _lib
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    lib.imggen_linear.argtypes = [p, i64, i32, i64, p, p, f32, p, p, i32, i32, p, p]
    lib.imggen_attend.argtypes = [p, p, p, i64, i64, p, p, i32, i32, i64, i32, p, i32, i64, p, i32, p]
    lib.imggen_step.argtypes = [ctypes.POINTER(Layer), i32, ctypes.POINTER(Model), i64, p, i64, p, i64, p, p, i32,
                                i32, i32]
    lib.imggen_draw.argtypes = [p, i32, i32, p, i64, f32, i32, p, p, i64, p, i64, p]
    lib.imggen_linear.restype = lib.imggen_attend.restype = lib.imggen_step.restype = ctypes.c_int
    lib.imggen_draw.restype = ctypes.c_int
    _lib = lib
    selfcheck()
    return lib


def available() -> bool:
    """Whether the native kernels can be used (built, loaded and checked once per process)."""
    global _lib
    if _lib is None:
        _lib = cbuild.load(SOURCE, "native", _setup, "native CPU decode kernels",
                           "decoding uses the PyTorch path (same results, slower)")
    return bool(_lib)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _call(fn, *args) -> None:
    if fn(*args) != 0:
        raise MemoryError(f"{fn.__name__}: out of memory")


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x (M, K) float32 with unit column stride (rows may be any stride apart)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def pack(weight: torch.Tensor, bias: torch.Tensor | None, width: int = PANEL):
    """(panels (P, in, width), bias (P, 1, width) or None): W^T (weight (out, in)) cut into column
    panels of `width` columns, zero-padded: the layout `linear` and native.c read."""
    out, inp = weight.shape
    p = -(-out // width)
    panels = weight.new_zeros(p * width, inp)
    panels[:out] = weight
    panels = panels.view(p, width, inp).transpose(1, 2).contiguous()
    if bias is not None:
        padded = weight.new_zeros(p * width)
        padded[:out] = bias
        bias = padded.view(p, 1, width)
    return panels, bias


def linear(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, out_features: int,
           ln: torch.nn.LayerNorm | None = None, act: bool = False, add: torch.Tensor | None = None) -> torch.Tensor:
    """[add +] act(ln(x) @ W^T + bias) for x (M, in) float32, W^T as imggen.decode.panels' panels (P, in, 16)
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
    """imggen_layer in native.c: one Block's weights and its cache's slots and read plan."""
    _fields_ = [(f, ctypes.c_void_p) for f in ("ln1_w", "ln1_b", "qkv", "qkv_b", "proj", "proj_b", "ln2_w", "ln2_b",
                                               "fc1", "fc1_b", "fc2", "fc2_b")] + \
        [("eps1", ctypes.c_float), ("eps2", ctypes.c_float), ("hidden", ctypes.c_int), ("k", ctypes.c_void_p),
         ("v", ctypes.c_void_p), ("length", ctypes.c_int64), ("slots", ctypes.c_void_p), ("hi", ctypes.c_void_p),
         ("positions", ctypes.c_void_p), ("t0", ctypes.c_int64), ("t1", ctypes.c_int64), ("nread", ctypes.c_int64),
         ("index", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("index_heads", ctypes.c_int),
         ("bias_heads", ctypes.c_int)]


class Model(ctypes.Structure):
    """imggen_model in native.c: the embeddings, positions, final LayerNorm and head around the layers."""
    _fields_ = [(f, ctypes.c_void_p) for f in ("tok", "start", "row", "col", "chan", "pos")] + \
        [("n", ctypes.c_int64), ("lnf_w", ctypes.c_void_p), ("lnf_b", ctypes.c_void_p), ("eps", ctypes.c_float),
         ("head", ctypes.c_void_p), ("head_b", ctypes.c_void_p), ("vocab", ctypes.c_int),
         ("out", ctypes.c_int)]


class ModelStep:
    """Decode steps of a whole model (imggen.model.ImageTransformer.step) in one native call each:
    the embedding, every layer, the final LayerNorm and the head. `model`: float32 contiguous
    tensors tok, start, row, col, chan (embedding tables), pos ((3, n) int64 row, column, channel
    of each position), lnf_w, lnf_b, head, head_b (the head as imggen.decode.panels' panels, head_b None
    or padded) and the float eps; `layers`: per layer ln1_w, ln1_b, qkv, qkv_b, proj, proj_b, ln2_w,
    ln2_b, fc1, fc1_b, fc2, fc2_b (linears as panels and padded biases; a missing bias None), floats
    eps1, eps2 and int hidden; `caches` the layers' imggen.decode.Cache objects (float32, on CPU).

    The kernel finds each layer's slot and reads from its cache's plans: an unmasked ring's prefix
    for every step, or the rows of the read plan (Cache.plan_at) that covers the step, so Python
    visits a layer only when a plan runs out; a cache whose reads are computed per step (the
    keep-all baseline's masks) is asked at every step (Cache.begin)."""

    def __init__(self, model: dict, layers: list[dict], caches, heads: int):
        self.keep = (model, layers)  # the tensors the structs point into
        self.caches, self.heads = list(caches), heads
        self.batch, self.dim, self.n = self.caches[0].k.shape[0], model["tok"].shape[1], model["pos"].shape[1]
        self.vocab, self.out = model["tok"].shape[0], model["out"]  # token values; the head's outputs
        self.model = Model(**{f: _ptr(model[f]) for f, _ in Model._fields_ if f not in ("n", "eps", "vocab", "out")},
                           n=self.n, eps=model["eps"], vocab=self.vocab, out=self.out)
        self.layers = (Layer * len(layers))()
        self.reads = [None] * len(layers)  # the plan tensors each layer points into
        for lay, w, cache in zip(self.layers, layers, self.caches):
            for name, _ in Layer._fields_[:12]:
                setattr(lay, name, _ptr(w[name]))
            lay.eps1, lay.eps2, lay.hidden = w["eps1"], w["eps2"], w["hidden"]
            lay.k, lay.v, lay.length = cache.k.data_ptr(), cache.v.data_ptr(), cache.k.shape[2]
            lay.slots, lay.positions = cache.plan.slots.ctypes.data, cache.positions.data_ptr()
            if cache.unmasked:  # the same rule at every step: slots [0, hi[t])
                lay.hi, lay.t0, lay.t1 = cache.plan.hi.ctypes.data, 0, cache.n
        self.lo = self.hi = 0  # the steps every layer's plan covers: [lo, hi)
        self.x = torch.empty(self.batch, self.dim)  # the kernel's scratch row per sequence

    def _plan(self, t: int) -> None:
        """Point every layer whose plan does not cover step t at one that does."""
        for i, (lay, cache) in enumerate(zip(self.layers, self.caches)):
            if lay.t0 <= t < lay.t1:
                continue
            if cache.planned and cache.pattern.head_count(self.heads) in (1, self.heads):
                r = cache.plan_at(t)  # index (steps, 1 or H, K) or None, bias (steps, 1 or H, K or capacity)
                index, bias, nread = r.index, r.bias, cache.capacity if r.index is None else r.index.shape[-1]
                lay.t0, lay.t1 = r.t0, r.t1
            else:  # this step's reads, computed now: index, bias (1 or H, K) or None
                _, hi, index, bias = cache.begin(t)
                nread = hi if index is None else index.shape[-1]
                lay.t0, lay.t1 = t, t + 1
            index, bias = (None if x is None else x.reshape(-1, x.shape[-2], nread).to(dtype).contiguous()
                           for x, dtype in ((index, torch.int64), (bias, torch.float32)))
            lay.nread = nread
            lay.index, lay.index_heads = _ptr(index), 1 if index is None else index.shape[1]
            lay.bias, lay.bias_heads = _ptr(bias), 1 if bias is None else bias.shape[1]
            self.reads[i] = (index, bias)
        self.lo, self.hi = max(lay.t0 for lay in self.layers), min(lay.t1 for lay in self.layers)

    def step(self, prev: torch.Tensor | None, t: int, features: torch.Tensor | None = None) -> torch.Tensor:
        """The head's outputs (B, out) (logits, or a mixture's parameters) at position t given token t-1
        (prev, (B,) int64; None at t = 0) and a context model's features (B, dim) of position t (None
        without a context); stores every layer's key and value of position t."""
        b = self.batch
        if not 0 <= t < self.n or (t > 0 and (prev is None or prev.dim() != 1 or prev.shape[0] != b)):
            got = "no token" if prev is None else f"tokens {tuple(prev.shape)}"
            raise ShapeError(f"a decode step of these caches takes a position in 0..{self.n - 1} and, after 0, the "
                             f"previous token of each of the {b} sequences they were made for; got t={t}, {got}")
        if not self.lo <= t < self.hi:
            self._plan(t)
        prev_ptr, prev_stride = None, 0
        if t > 0:
            prev = prev if prev.dtype == torch.int64 else prev.long()
            prev_ptr, prev_stride = prev.data_ptr(), prev.stride(0)
        ldf = 0
        if features is not None:
            features = features if features.stride(-1) == 1 else features.contiguous()
            ldf = features.stride(0)
        logits = torch.empty(b, self.out)  # fresh: callers keep each step's logits
        rc = _lib.imggen_step(self.layers, len(self.layers), ctypes.byref(self.model), t, prev_ptr, prev_stride,
                              _ptr(features), ldf, self.x.data_ptr(), logits.data_ptr(), b, self.dim, self.heads)
        if rc == -2:
            raise ShapeError(f"tokens must be in 0..{self.vocab - 1}; got {prev.min().item()}..{prev.max().item()}")
        if rc != 0:
            raise MemoryError("imggen_step: out of memory")
        return logits


def draw(logits: torch.Tensor, u: torch.Tensor, temperature: float, tokens: torch.Tensor, logp: torch.Tensor,
         known: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> None:
    """imggen.sampling's draw of one position for logits (B, V) float32: tokens (B,) int64 (a
    column view) <- the argmax when temperature is 0, else the inverse CDF of the tempered softmax
    at u (B,) float32; known (B,) int64 where mask (B,) bool; logp (B,) float32 += the tokens'
    log-probabilities under softmax(logits). Views may be strided (columns of (B, N) tensors)."""
    logits = logits.contiguous()
    b, v = logits.shape
    ks = 0 if mask is None else mask.stride(0)
    if mask is not None and known.stride(0) != ks:
        known, mask = known.contiguous(), mask.contiguous()
        ks = 1
    _call(_lib.imggen_draw, logits.data_ptr(), b, v, u.data_ptr(), u.stride(0), float(temperature),
          int(temperature == 0), _ptr(known), _ptr(mask), ks, tokens.data_ptr(), tokens.stride(0), logp.data_ptr())


def selfcheck() -> None:
    """The kernels against float64 PyTorch on random inputs (awkward sizes); AssertionError if off."""
    from imggen.attention import decode_attention_reference

    g = torch.Generator().manual_seed(0)
    for m, inp, out in ((3, 40, 37), (21, 24, 16)):
        layer = torch.nn.Linear(inp, out)
        with torch.no_grad():
            layer.weight.copy_(torch.randn(out, inp, generator=g))
        x = torch.randn(m, inp, generator=g)
        panels, bias = pack(layer.weight.detach(), layer.bias.detach())
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
