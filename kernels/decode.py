"""Decode attention: one query per (batch, head) against a ring-buffer KV cache (flash-decoding).

`decode_attention(q, k_cache, v_cache, key_bias) -> out`
  q (B, H, D); k_cache, v_cache (B, H, L, D) with slots in any order; key_bias (B or 1, H or 1, L)
  float, additive (0 = readable, -inf = not). out (B, H, D) in q's dtype; scale 1/sqrt(D).
  A query with no readable slot gets zeros.
The cache is split along L; each program reduces one split to (max, sum, unnormalised output) and a
combine kernel merges the splits.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from imggen.errors import ShapeError

from . import tuning
from .sparse_kernels import LOG2E

COMBINE_CHUNK = 16  # splits merged per step of the combine kernel


def decode_attention_reference(q, k_cache, v_cache, key_bias):
    """PyTorch reference of decode_attention (same signature; any device and dtype): the
    function imggen's PyTorch decode path runs, computed in float32."""
    from imggen.attention import decode_attention_reference as ref

    _check(q, k_cache, v_cache, key_bias, need_kernel=False)
    return ref(q.float(), k_cache.float(), v_cache.float(), key_bias.float()).to(q.dtype)


def _check(q, k, v, bias, need_kernel=True):
    if q.dim() != 3 or k.dim() != 4 or k.shape != v.shape or k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[2]:
        raise ShapeError(f"decode_attention: need q (B, H, D) and k_cache, v_cache (B, H, L, D); got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    b, h, l, d = k.shape
    if bias.dim() != 3 or bias.shape[0] not in (1, b) or bias.shape[1] not in (1, h) or bias.shape[2] != l:
        raise ShapeError(f"decode_attention: key_bias must be (B or 1, H or 1, L) = ({b} or 1, {h} or 1, {l}); "
                         f"got {tuple(bias.shape)}")
    if not bias.is_floating_point():
        raise ShapeError(f"decode_attention: key_bias must be float (0 or -inf), got {bias.dtype}")
    if not (q.dtype == k.dtype == v.dtype) or not q.is_floating_point():
        raise ShapeError(f"decode_attention: q, k_cache, v_cache must share one float dtype; got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device == bias.device):
        raise ShapeError(f"decode_attention: tensors on different devices {q.device}, {k.device}, {v.device}, "
                         f"{bias.device}")
    if need_kernel:
        from .sparse_ops import DTYPES, HEAD_DIMS, check_device
        if q.dtype not in DTYPES:
            raise ShapeError(f"decode_attention: dtype {q.dtype} not supported; use float32, float16 or bfloat16")
        if d not in HEAD_DIMS:
            raise ShapeError(f"decode_attention: head dim D={d} must be one of {HEAD_DIMS}")
        check_device(q, "q")
        for name, t in (("q", q), ("k_cache", k), ("v_cache", v)):
            if t.stride(-1) != 1:
                raise ShapeError(f"decode_attention: {name} is not contiguous in its last dim (strides "
                                 f"{t.stride()}); call .contiguous() first")


@triton.jit
def _decode_split(Q, K, V, BIAS, PO, PM, PL, sqb, sqh, skb, skh, skl, svb, svh, svl, sbb, sbh, sbl,
                  H, L, SPLIT, NSPLIT, sm2, BL: tl.constexpr, D: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)
    sp = tl.program_id(1)
    b = bh // H
    h = bh % H
    dd = tl.arange(0, D)
    q = tl.load(Q + b * sqb + h * sqh + dd).to(tl.float32)
    m_i = tl.full([1], -1.0e30, tl.float32)
    l_i = tl.zeros([1], tl.float32)
    acc = tl.zeros([D], tl.float32)
    lo = sp * SPLIT
    hi = tl.minimum(lo + SPLIT, L)
    for start in range(lo, hi, BL):
        offs = start + tl.arange(0, BL)
        ok = offs < hi
        k = tl.load(K + b * skb + h * skh + offs[:, None] * skl + dd[None, :], mask=ok[:, None], other=0.0)
        bias = tl.load(BIAS + b * sbb + h * sbh + offs * sbl, mask=ok, other=float("-inf")).to(tl.float32)
        s = tl.sum(k.to(tl.float32) * q[None, :], 1) * sm2 + bias * LOG2E
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        p = tl.math.exp2(s - m_new)
        alpha = tl.math.exp2(m_i - m_new)
        v = tl.load(V + b * svb + h * svh + offs[:, None] * svl + dd[None, :], mask=ok[:, None], other=0.0)
        l_i = l_i * alpha + tl.sum(p, 0)
        acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), 0)
        m_i = m_new
    tl.store(PO + (bh * NSPLIT + sp) * D + dd, acc)
    tl.store(PM + bh * NSPLIT + sp + tl.arange(0, 1), m_i)
    tl.store(PL + bh * NSPLIT + sp + tl.arange(0, 1), l_i)


@triton.jit
def _decode_combine(PO, PM, PL, O, NSPLIT, CH: tl.constexpr, D: tl.constexpr):
    """Merge the splits' (max, sum, output) CH at a time with a running max (any NSPLIT, fixed registers)."""
    bh = tl.program_id(0).to(tl.int64)
    dd = tl.arange(0, D)
    m_run = tl.full([1], -1.0e30, tl.float32)
    den = tl.zeros([1], tl.float32)
    out = tl.zeros([D], tl.float32)
    for c in range(0, NSPLIT, CH):
        sp = c + tl.arange(0, CH)
        ok = sp < NSPLIT
        m = tl.load(PM + bh * NSPLIT + sp, mask=ok, other=-1.0e30)
        m_new = tl.maximum(m_run, tl.max(m, 0))
        w = tl.math.exp2(m - m_new)
        r = tl.math.exp2(m_run - m_new)
        den = den * r + tl.sum(tl.load(PL + bh * NSPLIT + sp, mask=ok, other=0.0) * w, 0)
        po = tl.load(PO + (bh * NSPLIT + sp[:, None]) * D + dd[None, :], mask=ok[:, None], other=0.0)
        out = out * r + tl.sum(po * w[:, None], 0)
        m_run = m_new
    den = tl.where(den == 0.0, 1.0, den)
    tl.store(O + bh * D + dd, (out / den).to(O.dtype.element_ty))


def _splits(bh: int, length: int, bl: int, sms: int) -> tuple[int, int]:
    """(split length, number of splits): enough programs to fill the GPU, splits a multiple of bl."""
    want = max(1, min(triton.cdiv(length, bl), triton.cdiv(4 * sms, bh)))
    split = triton.cdiv(triton.cdiv(length, want), bl) * bl
    return split, triton.cdiv(length, split)


def decode_attention(q, k_cache, v_cache, key_bias):
    """Triton flash-decoding; see the module docstring. Same result as decode_attention_reference."""
    _check(q, k_cache, v_cache, key_bias)
    from .sparse_ops import _empty, interpreted
    b, h, l, d = k_cache.shape
    bias = key_bias.float().expand(b, h, l)  # one compiled variant: the bias is read as fp32
    sms = 132 if interpreted() else torch.cuda.get_device_properties(q.device).multi_processor_count
    cfg = tuning.choose("decode", d, q.dtype, tuning.candidates("decode", d, q.dtype))
    split, nsplit = _splits(b * h, l, cfg.bm, sms)
    po = _empty((b * h, nsplit, d), torch.float32, q.device)
    pm = _empty((b * h, nsplit), torch.float32, q.device)
    pl = _empty((b * h, nsplit), torch.float32, q.device)
    out = _empty((b, h, d), q.dtype, q.device)
    kw = {} if interpreted() else cfg.launch()
    _decode_split[(b * h, nsplit)](
        q, k_cache, v_cache, bias, po, pm, pl, q.stride(0), q.stride(1), *k_cache.stride()[:3],
        *v_cache.stride()[:3], *bias.stride(), h, l, split, nsplit, LOG2E.value / math.sqrt(d), BL=cfg.bm, D=d, **kw)
    _decode_combine[(b * h,)](po, pm, pl, out, nsplit, CH=COMBINE_CHUNK, D=d, **kw)
    return out
