"""Sparse causal attention behind one call: `sparse_attention(q, k, v, pattern, backend)`.

q, k, v: (B, H, N, D); scale 1/sqrt(D); head h uses `pattern.mask(N, head=h)`.
Diffuser patterns: A = row-softmax of the scores over the mask, Z0 = V,
Z(k+1) = (1 - alpha) A Z(k) + alpha V, output Z(steps).

Backends
* `reference`: dense masked softmax (pass float64 for an exact oracle). Slow, obviously right.
* `cpu`: blocked PyTorch. Queries in blocks of `block`; each query block gathers only the key
  blocks its layout names and applies the element rule as an additive bias. Memory is
  O(N * keys-per-row), never N x N. `full` maps to causal `scaled_dot_product_attention`.
* `triton`: kernels in `imggen.kernels` (CUDA, or CPU tensors under TRITON_INTERPRET=1).
* `auto`: triton for CUDA tensors, cpu otherwise.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from imggen.errors import ShapeError
from imggen.patterns import Pattern

BACKENDS = ("reference", "cpu", "triton", "auto")


def _check(q, k, v, pattern):
    if not isinstance(pattern, Pattern):
        raise TypeError(f"pattern must come from imggen.make_pattern, got {type(pattern).__name__}")
    if q.dim() != 4 or q.shape != k.shape or q.shape != v.shape:
        raise ShapeError(f"q, k, v must all be (B, H, N, D) of one shape; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or not q.is_floating_point():
        raise ShapeError(f"q, k, v must share one floating dtype; got {q.dtype}, {k.dtype}, {v.dtype}")


def sparse_attention(q, k, v, pattern: Pattern, backend: str = "auto", **kw) -> torch.Tensor:
    _check(q, k, v, pattern)
    if backend == "auto":
        backend = "triton" if q.is_cuda else "cpu"
    if backend == "reference":
        return reference_attention(q, k, v, pattern)
    if backend == "cpu":
        return blocked_attention(q, k, v, pattern, **kw)
    if backend == "triton":
        from imggen import kernels
        return kernels.sparse_attention(q, k, v, pattern, **kw)
    raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")


# --------------------------------------------------------------------------------- reference
def dense_masks(pattern: Pattern, n: int, heads: int, device) -> torch.Tensor:
    """(H, n, n) bool masks, one per head (shared when the pattern ignores the head)."""
    if not pattern.heads_differ:
        return pattern.mask(n, 0, device).expand(heads, n, n)
    return torch.stack([pattern.mask(n, h, device) for h in range(heads)])


def reference_attention(q, k, v, pattern: Pattern) -> torch.Tensor:
    n, d = q.shape[-2], q.shape[-1]
    mask = dense_masks(pattern, n, q.shape[1], q.device)
    s = (q @ k.transpose(-1, -2)) / math.sqrt(d)
    a = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
    if not pattern.is_diffusion:
        return a @ v
    z = v
    for _ in range(pattern.steps):
        z = (1 - pattern.alpha) * (a @ z) + pattern.alpha * v
    return z


# ----------------------------------------------------------------------------------- blocked
DEFAULT_BLOCK = 64


@functools.lru_cache(maxsize=128)
def _plan(pattern: Pattern, n: int, heads: int, block: int, device: str):
    """Gather indices and additive bias for the blocked backend (cached per shape).

    Returns (index (Hl*nqb*m,) into a (Hl*(nqb+1)) block table, bias (Hl, nqb, block, m*block),
    m, Hl). Hl = 1 when all heads share the layout. Index nqb of each head is an all-zero pad block.
    """
    hl = heads if pattern.heads_differ else 1
    layouts = [pattern.block_layout(n, block, h) for h in range(hl)]
    nqb = layouts[0].shape[0]
    m = max(lay.shape[1] for lay in layouts)
    lay = torch.full((hl, nqb, m), -1, dtype=torch.long)
    for h, l in enumerate(layouts):
        lay[h, :, : l.shape[1]] = l
    pad = lay < 0
    kb = lay.masked_fill(pad, nqb)
    index = (kb + torch.arange(hl)[:, None, None] * (nqb + 1)).reshape(-1)
    qi = torch.arange(nqb * block).view(1, nqb, block, 1)
    kj = (kb[..., None] * block + torch.arange(block)).reshape(hl, nqb, 1, m * block)
    ok = torch.stack([pattern.allowed(qi[0], kj[h], h) for h in range(hl)])
    ok &= ~pad.repeat_interleave(block, -1)[:, :, None, :]
    bias = torch.zeros(ok.shape).masked_fill_(~ok, float("-inf"))
    return index.to(device), bias.to(device), m, hl


def blocked_probs(q, k, pattern: Pattern, block: int = DEFAULT_BLOCK):
    """Row-softmax of the scores over each query block's gathered keys.

    Returns (P (B, H, nqb, block, m*block), gather(x) -> (B, H, nqb, m*block, D), n_pad).
    Differentiable with plain autograd.
    """
    b, h, n, d = q.shape
    nqb = math.ceil(n / block)
    index, bias, m, hl = _plan(pattern, n, h, block, str(q.device))

    def gather(x):
        xb = F.pad(x, (0, 0, 0, nqb * block - n + block)).view(b, h, nqb + 1, block, d)
        if hl == 1:
            g = xb.index_select(2, index)  # index only names blocks of head 0's table
            return g.view(b, h, nqb, m * block, d)
        g = xb.reshape(b, h * (nqb + 1), block, d).index_select(1, index)
        return g.view(b, h, nqb, m * block, d)

    qb = F.pad(q, (0, 0, 0, nqb * block - n)).view(b, h, nqb, block, d)
    s = torch.matmul(qb, gather(k).transpose(-1, -2)) * (1.0 / math.sqrt(d))
    p = torch.softmax(s + bias.to(s.dtype), dim=-1)
    return p, gather


def blocked_attention(q, k, v, pattern: Pattern, block: int = DEFAULT_BLOCK) -> torch.Tensor:
    b, h, n, d = q.shape
    if pattern.name == "full":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    p, gather = blocked_probs(q, k, pattern, block)
    if not pattern.is_diffusion:
        return (p @ gather(v)).reshape(b, h, -1, d)[:, :, :n]
    nqb = p.shape[2]
    z = v
    for _ in range(pattern.steps):
        az = (p @ gather(z)).reshape(b, h, nqb * block, d)[:, :, :n]
        z = (1 - pattern.alpha) * az + pattern.alpha * v
    return z
