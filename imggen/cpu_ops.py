"""CPU training kernels in C (imggen/cpu_ops.c): the MLP's GELU (approximate="tanh") forward and backward.

torch 2.14's CPU GELU with the tanh approximation runs at about 1 G elements/s on the test box in
float32 and bfloat16 alike, about 13% of a bf16 `demo` training step; the C kernels compute the
same function 2-2.5x faster (`python bench/cpu_ops.py`; bench/RESULTS.md section 13). `gelu(h)` is
the autograd-aware GELU the MLP uses (imggen.fused): the C kernels for contiguous CPU float32 /
bfloat16 tensors, torch's own GELU elsewhere (CUDA, float64, no compiler, IMGGEN_NATIVE=0, or a
failed build or check: one warning). Results agree with torch's to float32 rounding (bfloat16: one
unit in the last place); tests/test_cpu_ops.py compares them, forward and backward. bfloat16 runs by
table (65,536 inputs): the vector kernels' own results looked up, bit for bit, 2.5x faster again
(demo's hidden size: 2.98 -> 1.17 ms forward, 2.93 -> 1.12 ms backward, 2 threads).
"""
from __future__ import annotations

import ctypes
import os

import torch
import torch.nn.functional as F

from imggen import cbuild

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_ops.c")
_KERNELS = {torch.float32: ("imggen_gelu_f32", "imggen_gelu_backward_f32"),
            torch.bfloat16: ("imggen_gelu_bf16", "imggen_gelu_backward_bf16")}
_DIRECT = ("imggen_gelu_bf16_direct", "imggen_gelu_backward_bf16_direct")  # bf16 computed, not looked up (tests)
_lib: ctypes.CDLL | None | bool = None  # None: not tried yet; False: unavailable


def _setup(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Argument types, then the self-check (which calls through the module's library)."""
    global _lib
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    for fwd, bwd in [*_KERNELS.values(), _DIRECT]:
        getattr(lib, fwd).argtypes = [p, p, i64]
        getattr(lib, bwd).argtypes = [p, p, p, i64]
        getattr(lib, fwd).restype = getattr(lib, bwd).restype = None
    lib.imggen_gelu_init.argtypes, lib.imggen_gelu_init.restype = [], None
    lib.imggen_gelu_init()  # the bfloat16 tables, before any call
    _lib = lib
    selfcheck()
    return lib


def available() -> bool:
    """Whether the C kernels can be used (built, loaded and checked once per process)."""
    global _lib
    if _lib is None:
        _lib = cbuild.load(SOURCE, "cpu_ops", _setup, "C GELU kernels", "training uses torch's GELU (same results, "
                                                                     "slower)")
    return bool(_lib)


def _native(*ts: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype in _KERNELS for t in ts) and available()


def gelu_forward(h: torch.Tensor) -> torch.Tensor:
    """torch.nn.functional.gelu(h, approximate="tanh"), no autograd."""
    if not _native(h):
        return F.gelu(h, approximate="tanh")
    h = h.contiguous()
    out = torch.empty_like(h)
    getattr(_lib, _KERNELS[h.dtype][0])(h.data_ptr(), out.data_ptr(), h.numel())
    return out


def gelu_backward(dy: torch.Tensor, h: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """aten's gelu_backward(dy, h, approximate="tanh"): d gelu(h) / dh * dy, no autograd. inplace:
    the C kernels may write the result over dy (a temporary of the caller's: one large buffer fewer;
    a non-contiguous dy is copied first, and the copy is written over)."""
    if not _native(dy, h) or dy.dtype != h.dtype or dy.shape != h.shape:
        return torch.ops.aten.gelu_backward(dy, h, approximate="tanh")
    dy, h = dy.contiguous(), h.contiguous()
    out = dy if inplace else torch.empty_like(h)
    getattr(_lib, _KERNELS[h.dtype][1])(dy.data_ptr(), h.data_ptr(), out.data_ptr(), h.numel())
    return out


class _GELU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h):
        ctx.save_for_backward(h)
        return gelu_forward(h)

    @staticmethod
    def backward(ctx, dy):
        return gelu_backward(dy, ctx.saved_tensors[0])


def gelu(h: torch.Tensor) -> torch.Tensor:
    """GELU (approximate="tanh") of h with autograd: the C kernels where they apply, else torch's."""
    if not _native(h):
        return F.gelu(h, approximate="tanh")
    return _GELU.apply(h) if torch.is_grad_enabled() and h.requires_grad else gelu_forward(h.detach())


def selfcheck() -> None:
    """The kernels against float64 torch on random inputs of awkward sizes; AssertionError if off."""
    g = torch.Generator().manual_seed(0)
    for n in (37, 16 * 5 + 3):
        h, dy = torch.randn(n, generator=g, dtype=torch.float64) * 4, torch.randn(n, generator=g, dtype=torch.float64)
        want, want_dx = F.gelu(h, approximate="tanh"), torch.ops.aten.gelu_backward(dy, h, approximate="tanh")
        for dt, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
            got = gelu_forward(h.to(dt)).double()
            got_dx = gelu_backward(dy.to(dt), h.to(dt)).double()
            assert torch.allclose(got, want, rtol=tol, atol=tol), f"C GELU ({dt}) off by {(got - want).abs().max():.3g}"
            assert torch.allclose(got_dx, want_dx, rtol=tol, atol=tol), \
                f"C GELU backward ({dt}) off by {(got_dx - want_dx).abs().max():.3g}"
