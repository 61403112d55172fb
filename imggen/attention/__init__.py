"""Sparse causal attention behind one call: `sparse_attention(q, k, v, pattern, backend)`.

q, k, v: (B, H, N, D); scale 1/sqrt(D); head h uses `pattern.mask(N, head=h)`.
Diffuser patterns: A = row-softmax of the scores over the mask, Z0 = V,
Z(k+1) = (1 - alpha) A Z(k) + alpha V, output Z(steps).

Backends
* `reference`: dense masked softmax (pass float64 for an exact oracle). Slow, obviously right.
* `cpu`: blocked PyTorch (imggen.attention.blocked), the default on CPU.
* `triton`: kernels in `imggen.kernels` (CUDA, or CPU tensors under TRITON_INTERPRET=1).
* `flex`: torch's FlexAttention with a BlockMask from the pattern's layout (imggen.attention.flex).
* `auto`: on CUDA the Triton kernels once a first-use self-check against the reference passes for
  that (pattern kind, dtype, head dim), flex otherwise (one warning); cpu on CPU.
`IMGGEN_BACKEND=triton|flex|cpu|reference` forces one backend everywhere (no self-check).
Patterns with `head_groups` (strided) run each group of heads as its own pattern.

Decoding reads one query against a cache: `decode_attention` (the Triton decode kernel on CUDA once
its first-use check passes, else `decode_attention_reference`), called by imggen.decode's caches.

The package: this dispatch and the references; the cpu backend (`blocked`, with `tiles` and `windows`:
local2d's 2-D query tiles and the band windows it reads); the flex backend (`flex`). The Triton backend
is imggen.kernels (kernels/), which reads `decode_attention_reference` back for its self-check, so the
two are one layer. May import: imggen.patterns, imggen.kernels and the base modules (errors, memory,
precision, fused); never decode, the model or anything above them (tests/test_layout.py: LAYERS).
"""
from __future__ import annotations

import math
import os
import warnings

import torch

from imggen.errors import ConfigError, ShapeError
from imggen.patterns import Pattern

BACKENDS = ("reference", "cpu", "triton", "flex", "auto")


def _check(q, k, v, pattern):
    if not isinstance(pattern, Pattern):
        raise TypeError(f"pattern must come from imggen.make_pattern, got {type(pattern).__name__}")
    if q.dim() != 4 or q.shape != k.shape or q.shape != v.shape:
        raise ShapeError(f"q, k, v must all be (B, H, N, D) of one shape; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or not q.is_floating_point():
        raise ShapeError(f"q, k, v must share one floating dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    pattern.check_length(q.shape[2])


def sparse_attention(q, k, v, pattern: Pattern, backend: str = "auto", **kw) -> torch.Tensor:
    _check(q, k, v, pattern)
    backend = resolve_backend(backend, q, pattern)
    groups = pattern.head_groups(q.shape[1]) if backend != "reference" else None
    if groups:
        outs = [_run(backend, q[:, idx], k[:, idx], v[:, idx], sub, kw) for idx, sub in groups]
        order = torch.cat([idx for idx, _ in groups]).argsort()
        return torch.cat(outs, 1)[:, order.to(q.device)]
    return _run(backend, q, k, v, pattern, kw)


def _run(backend, q, k, v, pattern, kw):
    if backend == "reference":
        return reference_attention(q, k, v, pattern)
    if backend == "cpu":
        from imggen.attention.blocked import cpu_attention
        return cpu_attention(q, k, v, pattern, **kw)
    if backend == "triton":
        from imggen import kernels
        return kernels.sparse_attention(q, k, v, pattern, **kw)
    if backend == "flex":
        from imggen.attention.flex import flex_attention
        return flex_attention(q, k, v, pattern)
    raise ConfigError(f"unknown backend {backend!r} (argument backend); choose one of {', '.join(BACKENDS)}")


def reference_attention(q, k, v, pattern: Pattern) -> torch.Tensor:
    n, d = q.shape[-2], q.shape[-1]
    mask = pattern.masks(n, q.shape[1], q.device)
    s = (q @ k.transpose(-1, -2)) / math.sqrt(d)
    a = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
    if not pattern.is_diffusion:
        return a @ v
    z = v
    for _ in range(pattern.steps):
        z = (1 - pattern.alpha) * (a @ z) + pattern.alpha * v
    return z


def attention_probs(q, k, bias=None) -> torch.Tensor:
    """Softmax rows of queries q (B, H, M, D) over keys k (B, H, L, D) -> (B, H, M, L); bias
    additive (0 or -inf), broadcastable to (B, H, M, L). Rows with nothing to read -> 0."""
    s = torch.matmul(q, k.transpose(-1, -2)).mul_(1.0 / math.sqrt(q.shape[-1]))
    if bias is not None:
        s.add_(bias.to(s.dtype))
    return torch.softmax(s, dim=-1).nan_to_num_(0.0)


def decode_probs(q, k, key_bias=None) -> torch.Tensor:
    """Softmax row of one query per (batch, head): q (B, H, D), k (B, H, L, D) -> (B, H, 1, L);
    key_bias additive (0 or -inf), broadcastable to (B, H, L)."""
    return attention_probs(q.unsqueeze(2), k, None if key_bias is None else key_bias.unsqueeze(-2))


def decode_attention_reference(q, k_cache, v_cache, key_bias=None) -> torch.Tensor:
    """One query per (batch, head) against cache slots in any order: q (B, H, D), k_cache, v_cache
    (B, H, L, D), key_bias None or additive float (B or 1, H or 1, L) -> (B, H, D). The reference
    of imggen.kernels.decode_attention, imggen.decode.native.attend and the PyTorch decode path."""
    return torch.matmul(decode_probs(q, k_cache, key_bias), v_cache)[:, :, 0]


# ------------------------------------------------------------------------------ backend choice
def forced_backend() -> str | None:
    env = os.environ.get("IMGGEN_BACKEND", "").strip()
    if env and env not in BACKENDS:
        raise ConfigError(f"IMGGEN_BACKEND={env!r}: choose one of {', '.join(BACKENDS)}")
    return env if env and env != "auto" else None


def on_gpu(q: torch.Tensor) -> bool:
    return q.is_cuda


def resolve_backend(backend: str, q: torch.Tensor, pattern: Pattern) -> str:
    """The backend a call runs on: IMGGEN_BACKEND, else `backend`, with `auto` resolved."""
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ConfigError(f"unknown backend {backend!r} (argument backend); choose one of {', '.join(BACKENDS)}")
    backend = forced_backend() or backend
    if backend != "auto":
        return backend
    if not on_gpu(q):
        return "cpu"
    return "triton" if triton_ok(pattern, q.dtype, q.shape[-1], q.device) else "flex"


_CHECKED: dict[tuple, bool] = {}


def triton_ok(pattern: Pattern, dtype, head_dim: int, device) -> bool:
    """First use per (pattern kind, dtype, head dim): `triton_selfcheck`; on a failure or a
    compile/launch error warn once and remember to use flex for that configuration."""
    return passes_once(_CHECKED, (type(pattern), dtype, head_dim),
                       lambda: triton_selfcheck(pattern, dtype, head_dim, device),
                       lambda: f"the Triton kernels for {pattern.name} attention, {str(dtype).replace('torch.', '')}, "
                               f"head dim {head_dim}",
                       "using FlexAttention for this configuration (set IMGGEN_BACKEND to choose yourself)")


def passes_once(cache: dict, key, check, what, instead: str, quiet: tuple = ()) -> bool:
    """`check()` on the first use of `key` only (a kernel's self-check). An exception means: do not
    trust the kernel for that key; one warning naming `what()` and what runs `instead` (none for
    the exception types in `quiet`). Later calls are one dict lookup (they sit on hot paths)."""
    if key not in cache:
        try:
            check()
            cache[key] = True
        except quiet:
            cache[key] = False
        except Exception as e:  # noqa: BLE001 - any failure means: do not trust the kernel here
            warnings.warn(f"imggen: {what()} failed the self-check ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}); {instead}", RuntimeWarning, stacklevel=4)
            cache[key] = False
    return cache[key]


# noise-floor tolerance of the kernel tests: error <= 2 x the reference's own error in `dtype` + eps
SELFCHECK_EPS = {torch.float32: 1e-5, torch.float16: 5e-4, torch.bfloat16: 4e-3}


def triton_selfcheck(pattern: Pattern, dtype, head_dim: int, device, n: int = 333) -> None:
    """Outputs and q/k/v gradients of the Triton kernels vs the fp64 reference at an awkward N;
    raises AssertionError naming what differs (or whatever the kernels raise)."""
    from imggen import kernels
    from imggen.kernels.plan import splitting_rows

    n = min(n, pattern.max_length() or n)
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v, do = (torch.randn(1, 2, n, head_dim, generator=g).to(dtype).double() for _ in range(4))

    def run(fn, dt, dev):
        x = [t.to(dev, dt).clone().requires_grad_() for t in (q, k, v)]
        o = fn(*x)
        o.backward(do.to(dev, dt))
        return [t.detach().double().cpu() for t in (o, *(y.grad for y in x))]

    exact = run(lambda *a: reference_attention(*a, pattern), torch.float64, "cpu")
    floor = run(lambda *a: reference_attention(*a, pattern), dtype, device)
    got = run(lambda *a: kernels.sparse_attention(*a, pattern), dtype, device)
    with splitting_rows():  # long rows at a large N: split, partial results, the flush kernel
        split = run(lambda *a: kernels.sparse_attention(*a, pattern), dtype, device)
    for how, res in (("", got), (" with split rows", split)):
        for name, e, f, x in zip(("output", "dq", "dk", "dv"), exact, floor, res):
            within_floor(name + how, x, e, f, dtype)


def within_floor(what: str, x, exact, floor, dtype) -> None:
    """Raise AssertionError unless x's largest error against `exact` is at most twice that of
    `floor` (the reference computed in `dtype`) plus SELFCHECK_EPS; NaN fails."""
    err, noise = (x - exact).abs().max().item(), (floor - exact).abs().max().item()
    if not err <= 2 * noise + SELFCHECK_EPS.get(dtype, 1e-5):
        raise AssertionError(f"{what} differs from the reference by {err:.3g} (noise floor {noise:.3g})")


# ------------------------------------------------------------------- one query against a cache
_KERNEL = None
_KERNEL_OK: dict[tuple, bool] = {}  # (dtype, head dim) -> the kernel passed its first-use check


def decode_selfcheck(kernel, dtype, head_dim: int, device, length: int = 333) -> None:
    """The decode kernel vs the float64 reference on random inputs (2 x 3 queries, `length` slots,
    about a third masked); raises AssertionError naming the error (or whatever the kernel raises).
    Tolerance as triton_selfcheck's: at most 2x the reference's own error in `dtype`, plus an eps."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, head_dim, generator=g).to(dtype)
    k, v = (torch.randn(2, 3, length, head_dim, generator=g).to(dtype) for _ in range(2))
    bias = torch.where(torch.rand(2, 3, length, generator=g) < 1 / 3, float("-inf"), 0.0)
    bias[..., 0] = 0.0  # every query reads at least one slot
    exact = decode_attention_reference(*(t.double() for t in (q, k, v, bias)))
    dev = [t.to(device) for t in (q, k, v)] + [bias.to(device, dtype)]
    within_floor("decode output", kernel(*dev).double().cpu(), exact,
                 decode_attention_reference(*dev).double().cpu(), dtype)


def _kernel_ok(kernel, q: torch.Tensor) -> bool:
    """First use per (dtype, head dim): `decode_selfcheck`. A dtype or head dim the kernel does not
    cover means the reference, silently; a failure or an error warns once."""
    dtype, d = q.dtype, q.shape[-1]
    return passes_once(_KERNEL_OK, (dtype, d), lambda: decode_selfcheck(kernel, dtype, d, q.device),
                       lambda: f"the Triton decode kernel for {str(dtype).replace('torch.', '')}, head dim {d}",
                       "sampling uses the PyTorch decode path for this configuration", quiet=(ShapeError,))


def decode_attention(q, k, v, key_bias=None) -> torch.Tensor:
    """The Triton decode kernel on CUDA (when it imports, covers the dtype / head dim, passed its
    first-use check and IMGGEN_BACKEND does not name another backend), else the PyTorch reference."""
    global _KERNEL
    forced = forced_backend() if on_gpu(q) else "cpu"  # CPU: no environment read per step
    if forced in (None, "triton"):
        if _KERNEL is None:
            try:
                from imggen.kernels import decode_attention as kernel
                _KERNEL = kernel
            except (ImportError, AttributeError):
                _KERNEL = False
        if _KERNEL and (forced == "triton" or _kernel_ok(_KERNEL, q)):  # forced: no check, as for attention
            bias = torch.zeros((1, 1, k.shape[2]), device=q.device, dtype=q.dtype) if key_bias is None \
                else key_bias.reshape(1, -1, k.shape[2]).to(q.dtype)
            try:
                return _KERNEL(q, k, v, bias)
            except ShapeError:  # a dtype / head dim the kernel does not cover
                pass
    return decode_attention_reference(q, k, v, key_bias)
