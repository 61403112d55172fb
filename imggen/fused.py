"""Memory-lean blocks for training: LayerNorm fused into the Linear that reads it, and the whole
MLP (LayerNorm -> Linear -> GELU -> Linear) as one autograd function. They save their input and
the per-row LayerNorm statistics (plus the MLP's pre-activation) and recompute the normalised
input and the GELU in the backward, instead of keeping them: a Transformer block then saves
about 2,560 numbers per token (dim 256) instead of about 4,350. Calls whose extra activations fit
imggen.memory's save limit (small problems) run the plain modules instead, which is faster. The
parameters stay nn.LayerNorm / nn.Linear modules, so checkpoints are unchanged; outside autograd
the modules run as usual. Under bf16 autocast the weights are cast once per call and x stays as
it comes (the float32 residual stream): LayerNorm statistics are float32, the matmuls bf16. The GELU
(tanh) is imggen.cpu_ops' in training and evaluation alike (C kernels on CPUs, equal to torch's to
float32 rounding; torch's elsewhere).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from imggen.cpu_ops import gelu, gelu_backward, gelu_forward
from imggen.memory import saves
from imggen.precision import compute_dtype


def wide(x: torch.Tensor) -> torch.Tensor:
    """x in at least float32 (half / bfloat16 / float32 -> float32, float64 kept): the precision of
    LayerNorm statistics here and of attention softmax in imggen.attention.blocked."""
    return x if x.dtype == torch.float64 else x.float()


def _norm(x, ln):
    """LayerNorm of x in at least float32, with its per-row mean and rstd."""
    return torch.native_layer_norm(wide(x), ln.normalized_shape, wide(ln.weight), wide(ln.bias), ln.eps)


def _norm_backward(dy, x, mean, rstd, ln):
    """Gradients of LayerNorm from d(output) dy: (dx, dweight, dbias)."""
    return torch.ops.aten.native_layer_norm_backward(wide(dy), wide(x), ln.normalized_shape, mean, rstd, wide(ln.weight),
                                                     wide(ln.bias), [True, True, True])


class _LNLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ln_w, ln_b, w, b, ln):
        y, mean, rstd = _norm(x, ln)
        ctx.save_for_backward(x, mean, rstd, w)
        ctx.ln, ctx.has_bias = ln, b is not None
        return F.linear(y.to(w.dtype), w, b)

    @staticmethod
    def backward(ctx, dout):
        x, mean, rstd, w = ctx.saved_tensors
        y = _norm(x, ctx.ln)[0].to(dout.dtype)
        dw = dout.flatten(0, -2).t() @ y.flatten(0, -2)
        db = dout.flatten(0, -2).sum(0) if ctx.has_bias else None
        dx, dlnw, dlnb = _norm_backward(dout @ w.to(dout.dtype), x, mean, rstd, ctx.ln)
        return dx.to(x.dtype), dlnw, dlnb, dw.to(w.dtype), db, None


class _LNMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ln_w, ln_b, w1, b1, w2, b2, ln):
        y, mean, rstd = _norm(x, ln)
        h = F.linear(y.to(w1.dtype), w1, b1)
        ctx.save_for_backward(x, mean, rstd, h, w1, w2)
        ctx.ln = ln
        return F.linear(gelu_forward(h), w2, b2)

    @staticmethod
    def backward(ctx, dout):
        x, mean, rstd, h, w1, w2 = ctx.saved_tensors
        ln = ctx.ln
        d2 = dout.flatten(0, -2)
        dw2, db2 = d2.t() @ gelu_forward(h).flatten(0, -2), d2.sum(0)
        dh = gelu_backward(dout @ w2.to(dout.dtype), h, inplace=True)
        y = _norm(x, ln)[0].to(dh.dtype)
        dh2 = dh.flatten(0, -2)
        dw1, db1 = dh2.t() @ y.flatten(0, -2), dh2.sum(0)
        dx, dlnw, dlnb = _norm_backward(dh @ w1.to(dh.dtype), x, mean, rstd, ln)
        return dx.to(x.dtype), dlnw, dlnb, dw1.to(w1.dtype), db1, dw2.to(w2.dtype), db2, None


def ln_linear(x, ln: torch.nn.LayerNorm, linear: torch.nn.Linear) -> torch.Tensor:
    """linear(ln(x)), saving x instead of ln(x) for the backward unless ln(x) fits the save limit."""
    if not torch.is_grad_enabled() or saves(x.numel() * x.element_size()):
        return linear(ln(x))
    dt = compute_dtype(x)  # autocast: the weights once in its dtype; x stays as is (fp32 statistics)
    w, b = linear.weight.to(dt), None if linear.bias is None else linear.bias.to(dt)
    return _LNLinear.apply(x, ln.weight, ln.bias, w, b, ln)


def ln_mlp(x, ln: torch.nn.LayerNorm, fc1: torch.nn.Linear, fc2: torch.nn.Linear) -> torch.Tensor:
    """fc2(gelu(fc1(ln(x)))), saving x and fc1's output only for the backward unless ln(x) and the
    GELU output fit the save limit."""
    if not torch.is_grad_enabled() or saves(x.numel() // x.shape[-1] * (x.shape[-1] + fc1.out_features)
                                            * x.element_size()):
        return fc2(gelu(fc1(ln(x))))
    dt = compute_dtype(x)
    w1, b1, w2, b2 = (t.to(dt) for t in (fc1.weight, fc1.bias, fc2.weight, fc2.bias))
    return _LNMLP.apply(x, ln.weight, ln.bias, w1, b1, w2, b2, ln)
