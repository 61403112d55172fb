"""The `cpu` backend: blocked attention in PyTorch, batched over every (batch, head) slice.

Queries run in blocks of Bq; each query block reads one window of key rows:
* `BandWindows` for patterns with a `band()` shape (band, local2d): contiguous windows of the
  left-padded keys (strided views, no copy), Bq a multiple of the pattern's period so that one
  (Bq, span) mask serves every block after the first few (whose masks are exact).
* `TileWindows` (imggen.attention.tiles) for raster neighbourhoods (local2d) where they pay: query blocks
  are 2-D pixel tiles reading the tile grown by r rows above and r pixels either side; band
  windows remain for small images (`imggen.attention.tiles.choose_tile` says where the crossover is).
* `GatherWindows` for any pattern: the key blocks its `block_plan` names, gathered per block,
  with a (HL, nqb, Bq, span) mask from the rule.
Masks are additive float biases (0 / -inf): adding one costs a tenth of a masked_fill_. In bf16
(inputs in bf16, or cast once under autocast) bmm's, scores and probabilities stay bf16; the CPU
softmax keeps its row statistics in float32. Other dtypes: scores in at least float32.
Dense causal patterns go to `scaled_dot_product_attention`; `columns()` patterns (the strided
pattern's odd heads) run as dense attention down each column.

Softmax patterns keep q, k, v and the output; the backward recomputes each chunk's probabilities
(each query row's whole window lies in one chunk, so the same fused softmax gives the forward's
probabilities exactly), so attention memory is O(N * D) per slice plus one chunk of scores. When
the probabilities of the whole call fit imggen.memory's save limit (small problems) and a gradient
is wanted, the forward keeps them and the backward skips the recomputation. Work runs in chunks of
(slices, query blocks) holding about as many scores as q holds elements (256K to 4M): a few large
batched matmuls per layer, not one per slice (a quarter as many made bf16 demo / moses steps 3-6%
slower: more, smaller ops), and the backward's few chunk-sized temporaries stay O(N * D).
The diffuser keeps A (O(N * span)) and its K states: its backward reuses them K times.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from imggen.fused import wide
from imggen.memory import saves
from imggen.patterns import Pattern
from imggen.precision import compute_dtype
from imggen.attention.tiles import TileWindows, choose_tile
from imggen.attention.windows import Windows, additive_mask, in_dtype  # noqa: F401  (additive_mask: imported from here)

DEFAULT_BLOCK = 64


class BandWindows(Windows):
    def __init__(self, pattern: Pattern, n: int, block: int):
        self.block, self.m = bq, m = band_blocks(pattern, n, block)
        self.nqb = math.ceil(n / bq)
        self.span, self.lpad, self.tail = m * bq, (m - 1) * bq, 0
        self.first, self.steady = _band_bias(pattern, n, bq, self.m)

    def windows(self, buf, chunk):
        """Window of global block g = rows [g*Bq, g*Bq + span) of the buffer: a strided view."""
        g0, g1 = self.blocks(chunk)
        d = buf.shape[-1]
        return buf.as_strided((g1 - g0, self.span, d), (self.block * d, d, 1), buf.storage_offset() + g0 * self.block * d)

    def mask_(self, s: torch.Tensor, chunk) -> torch.Tensor:
        c0, c1, q0, q1 = chunk
        s4 = s.view(c1 - c0, q1 - q0, self.block, self.span)
        f = max(0, min(len(self.first), q1) - q0)  # blocks among each slice's first ones
        if f:
            s4[:, :f].add_(in_dtype(self.first, s.dtype)[q0:q0 + f])
        s4[:, f:].add_(in_dtype(self.steady, s.dtype))
        return s

    def fold(self, dw: torch.Tensor, buf: torch.Tensor, chunk) -> None:
        """Add window gradients dw (G, span, D) onto the buffer rows they were read from."""
        g0, g1 = self.blocks(chunk)
        bq, d = self.block, buf.shape[-1]
        for t in range(self.m):
            buf[(g0 + t) * bq:(g1 + t) * bq].view(g1 - g0, bq, d).add_(dw[:, t * bq:(t + 1) * bq])


def band_blocks(pattern: Pattern, n: int, block: int) -> tuple[int, int]:
    """(Bq, m): band windows of m query blocks of Bq (a multiple of the band's period)."""
    width, period = pattern.band()
    bq = period * max(1, block // period)
    return bq, math.ceil((min(width, n) - 1) / bq) + 1


@functools.lru_cache(maxsize=64)
def _band_bias(pattern: Pattern, n: int, bq: int, m: int):
    """Exact masks (additive biases) of the first m blocks of a slice (their windows reach before
    position 0), and one mask for every later block, checked against the exact mask of the last."""
    span = m * bq

    def exact(qb):
        i = qb * bq + torch.arange(bq)[:, None]
        j = (qb - m + 1) * bq + torch.arange(span)[None, :]
        return ~pattern.allowed(i, j)

    nqb = math.ceil(n / bq)
    first = torch.stack([exact(qb) for qb in range(min(m, nqb))])
    steady = exact(m)
    if nqb - 1 > m and not torch.equal(exact(nqb - 1), steady):
        raise AssertionError(f"{pattern}: band() period {bq} does not match its rule")
    return additive_mask(~first), additive_mask(~steady)


class GatherWindows(Windows):
    def __init__(self, pattern: Pattern, n: int, heads: int, block: int):
        plan = pattern.block_plan(n, heads, block)
        self.block, self.nqb, self.hl = block, plan.nqb, plan.keys.shape[0]
        self.span, self.lpad, self.tail = plan.keys.shape[2] * block, 0, block
        self.keys = plan.keys
        self.bias = _gather_bias(pattern, n, heads, block)
        self.heads = heads

    def _index(self, chunk, buf):
        """(G, M) buffer blocks of the chunk's windows (padding -> the trailing zero block)."""
        c0, c1, q0, q1 = chunk
        c = torch.arange(c0, c1)
        keys = self.keys[(c % self.heads) % self.hl][:, q0:q1]  # (C, Q, M)
        idx = (c[:, None, None] * self.nqb + keys).masked_fill_(keys < 0, buf.shape[0] // self.block - 1)
        return idx.reshape(-1, keys.shape[-1])

    def windows(self, buf, chunk):
        idx = self._index(chunk, buf)
        blocks = buf.view(-1, self.block, buf.shape[-1])
        return blocks[idx].view(idx.shape[0], self.span, buf.shape[-1])

    def mask_(self, s, chunk):
        c0, c1, q0, q1 = chunk
        s4 = s.view(c1 - c0, q1 - q0, self.block, self.span)
        if self.hl == 1:
            return s4.add_(in_dtype(self.bias, s.dtype)[0, q0:q1]).view(s.shape)
        c = torch.arange(c0, c1)
        return s4.add_(in_dtype(self.bias, s.dtype)[(c % self.heads) % self.hl][:, q0:q1]).view(s.shape)

    def fold(self, dw, buf, chunk):
        d = buf.shape[-1]
        buf.view(-1, self.block, d).index_add_(0, self._index(chunk, buf).reshape(-1), dw.reshape(-1, self.block, d))


@functools.lru_cache(maxsize=64)
def _gather_bias(pattern: Pattern, n: int, heads: int, block: int) -> torch.Tensor:
    """(HL, nqb, Bq, M*Bq) additive mask: -inf where the rule forbids a gathered key (and on padding blocks)."""
    plan = pattern.block_plan(n, heads, block)
    hl, nqb, m = plan.keys.shape
    tables = pattern.lookup_tables(n, hl)
    qi = torch.arange(nqb * block).view(nqb, block, 1)
    kj = (plan.keys.clamp(min=0)[..., None] * block + torch.arange(block)).view(hl, nqb, 1, m * block)
    pad = (plan.keys < 0).repeat_interleave(block, -1).view(hl, nqb, 1, m * block)
    return additive_mask(torch.stack([pattern.allowed(qi, kj[h], h, tables) for h in range(hl)]) & ~pad)


def make_windows(pattern: Pattern, n: int, heads: int, block: int = DEFAULT_BLOCK, tile="auto") -> Windows:
    """Tiles (imggen.attention.tiles) for raster patterns where they pay (`tile`: "auto", a (ty, tx) shape,
    or None for band / gathered windows), else band windows, else gathered key blocks."""
    if tile == "auto":
        tile = choose_tile(pattern, math.prod(band_blocks(pattern, n, block)) if pattern.band() else None)
    if tile is not None:
        return TileWindows(pattern, n, tile)
    if pattern.band() is not None and not pattern.heads_differ:
        return BandWindows(pattern, n, block)
    return GatherWindows(pattern, n, heads, block)


def _acc(x: torch.Tensor) -> torch.Tensor:
    """Scores in the softmax's dtype: bf16 kept (no round trip; the CPU kernels' statistics are
    float32), else at least float32 (float16 scores could overflow)."""
    return x if x.dtype == torch.bfloat16 else wide(x)


def _scores(win: Windows, qp, kwin, chunk):
    """Masked scores (G, Bq, span) of a chunk against its key windows kwin (G, span, D): bfloat16 for
    bfloat16 inputs, else float32 (float64 for float64 inputs); q is pre-scaled by 1/sqrt(D)."""
    g0, g1 = win.blocks(chunk)
    s = _acc(torch.bmm(qp[g0:g1], kwin.transpose(1, 2)))
    return win.mask_(s, chunk)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, win: Windows, grad: bool):
        b, h, n, d = q.shape
        qp = win.pad_queries(q).mul_(1.0 / math.sqrt(d))
        kb, vb = win.key_buffer(k, q.shape), win.key_buffer(v, q.shape)
        op = torch.empty_like(qp)
        keep = grad and saves(qp.shape[0] * win.block * win.span * (2 if q.dtype == torch.bfloat16 else 4))
        probs = []
        for chunk in win.chunks(b * h, d):
            g0, g1 = win.blocks(chunk)
            p = torch.softmax(_scores(win, qp, win.windows(kb, chunk), chunk), -1)
            torch.bmm(p.to(q.dtype), win.windows(vb, chunk), out=op[g0:g1])
            if keep:
                probs.append(p)
        o = win.unpad_queries(op, q.shape).transpose(1, 2).contiguous()  # (B, N, H, D): the output
        ctx.save_for_backward(qp, kb, vb, *probs)                        # projection reads it as is
        ctx.win, ctx.shape = win, q.shape
        return o.transpose(1, 2)

    @staticmethod
    def backward(ctx, do):
        qp, kb, vb, *probs = ctx.saved_tensors
        win, shape = ctx.win, ctx.shape
        b, h, n, d = shape
        dop = win.pad_queries(do)
        dq = torch.empty_like(qp)
        dk, dv = torch.zeros_like(kb), torch.zeros_like(vb)
        for i, chunk in enumerate(win.chunks(b * h, d)):
            g0, g1 = win.blocks(chunk)
            qb, kw = qp[g0:g1], win.windows(kb, chunk)
            p = probs[i] if probs else torch.softmax(_scores(win, qp, kw, chunk), -1)
            g = dop[g0:g1]
            win.fold(torch.bmm(p.to(g.dtype).transpose(1, 2), g), dv, chunk)
            dp = _acc(torch.bmm(g, win.windows(vb, chunk).transpose(1, 2)))
            ds = torch._softmax_backward_data(dp, p, -1, p.dtype).to(g.dtype)  # p * (dp - rowsum(p * dp))
            torch.bmm(ds, kw, out=dq[g0:g1])
            win.fold(torch.bmm(ds.transpose(1, 2), qb), dk, chunk)  # qb carries the 1/sqrt(D)
        return (win.unpad_queries(dq.mul_(1.0 / math.sqrt(d)), shape), win.unpad_keys(dk, shape),
                win.unpad_keys(dv, shape), None, None)


def _diffusion_forward(q, k, v, pattern: Pattern, win: Windows):
    """A (G, Bq, span) once, then Z0 = V, Z(k+1) = (1 - alpha) A Z(k) + alpha V.
    Returns (qp, key buffer, A, [Z0 .. Z(steps)] as key buffers)."""
    b, h, n, d = q.shape
    alpha = pattern.alpha
    qp = win.pad_queries(q).mul_(1.0 / math.sqrt(d))
    kb, vb = win.key_buffer(k, q.shape), win.key_buffer(v, q.shape)
    chunks = win.chunks(b * h, d)
    a = q.new_empty(qp.shape[0], win.block, win.span)
    for chunk in chunks:
        g0, g1 = win.blocks(chunk)
        a[g0:g1] = torch.softmax(_scores(win, qp, win.windows(kb, chunk), chunk), -1)
    zs = [vb]
    for _ in range(pattern.steps):
        z = vb * alpha
        zq = win.query_rows(z)
        for chunk in chunks:
            g0, g1 = win.blocks(chunk)
            zq[g0:g1] += torch.bmm(a[g0:g1], win.windows(zs[-1], chunk)).mul_(1 - alpha)
        zs.append(z)
    return qp, kb, a, zs


class _Diffusion(torch.autograd.Function):
    """Diffuser: the backward runs the steps in reverse with A^T (the window fold) for the
    gradients G_k = dL/dZ_k, then per chunk dA = (1 - alpha) sum_k G_(k+1) Z_k^T and the softmax
    backward dS = A * (dA - rowsum(A * dA))."""

    @staticmethod
    def forward(ctx, q, k, v, pattern, win: Windows):
        qp, kb, a, zs = _diffusion_forward(q, k, v, pattern, win)
        ctx.save_for_backward(qp, kb, a, *zs[:-1])
        ctx.win, ctx.shape, ctx.alpha = win, q.shape, pattern.alpha
        return win.unpad_keys(zs[-1], q.shape)

    @staticmethod
    def backward(ctx, dz):
        qp, kb, a, *zs = ctx.saved_tensors
        win, shape, alpha = ctx.win, ctx.shape, ctx.alpha
        b, h, n, d = shape
        chunks = win.chunks(b * h, d)

        def transpose_fold(g):  # A^T g, both in the key buffer layout
            out = torch.zeros_like(g)
            gq = win.query_rows(g)
            for chunk in chunks:
                g0, g1 = win.blocks(chunk)
                win.fold(torch.bmm(a[g0:g1].transpose(1, 2), gq[g0:g1]), out, chunk)
            return out

        gs = [win.key_buffer(dz, shape)]  # G_K, then G_(K-1) .. G_1
        dv = torch.zeros_like(gs[0])
        for _ in range(len(zs) - 1):
            dv.add_(gs[-1], alpha=alpha)
            gs.append(transpose_fold(gs[-1]).mul_(1 - alpha))
        dv.add_(gs[-1], alpha=alpha).add_(transpose_fold(gs[-1]), alpha=1 - alpha)  # Z1 = (1-a) A V + a V
        gs = gs[::-1]  # G_1 .. G_K
        dq = torch.empty_like(qp)
        dk = torch.zeros_like(kb)
        for chunk in chunks:
            g0, g1 = win.blocks(chunk)
            da = sum(wide(torch.bmm(win.query_rows(g)[g0:g1], win.windows(z, chunk).transpose(1, 2)))
                     for g, z in zip(gs, zs))
            p = wide(a[g0:g1])
            ds = da.mul_(1 - alpha).sub_((p * da).sum(-1, keepdim=True)).mul_(p).to(qp.dtype)
            torch.bmm(ds, win.windows(kb, chunk), out=dq[g0:g1])
            win.fold(torch.bmm(ds.transpose(1, 2), qp[g0:g1]), dk, chunk)
        return (win.unpad_queries(dq.mul_(1.0 / math.sqrt(d)), shape), win.unpad_keys(dk, shape),
                win.unpad_keys(dv, shape), None, None)


def diffusion_states(q, k, v, pattern: Pattern, block: int = DEFAULT_BLOCK) -> list[torch.Tensor]:
    """Z1..Z(steps-1) of a diffuser layer at every position, each (B, H, N, D) (cache prefill)."""
    win = make_windows(pattern, q.shape[2], q.shape[1], block)
    with torch.no_grad():
        zs = _diffusion_forward(q, k, v, pattern, win)[3]
    return [win.unpad_keys(z, q.shape) for z in zs[1:-1]]


def cpu_attention(q, k, v, pattern: Pattern, block: int = DEFAULT_BLOCK, tile="auto") -> torch.Tensor:
    """Blocked attention of one head-uniform (or per-head-table) pattern; see the module docstring
    (`tile`: see make_windows)."""
    b, h, n, d = q.shape
    band = pattern.band()
    if band is not None and band.width >= n and band.period == 1 and not pattern.is_diffusion:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)  # dense causal
    if pattern.columns() is not None:
        return column_attention(q, k, v, *pattern.columns())
    dt = compute_dtype(q)  # autocast on: q, k, v cast once, every bmm below in its dtype
    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    win = make_windows(pattern, n, h, block, tile)
    if pattern.is_diffusion:
        return _Diffusion.apply(q, k, v, pattern, win)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    return _Attention.apply(q, k, v, win, grad)


def column_attention(q, k, v, stride: int, shift: int) -> torch.Tensor:
    """Query i reads keys j = i + shift - m*stride (m >= 1) and itself: one column of a grid with
    `stride` columns in which query i sits at cell i + shift. Dense strictly-causal attention down
    each column (O(N * N/stride) scores) with the diagonal key appended to each row."""
    b, h, n, d = q.shape
    rows = math.ceil((n + shift) / stride)

    def grid(x, lead):  # (B, H, n, D) -> (B, H, stride, rows, D), position p at cell p + lead
        x = F.pad(x, (0, 0, lead, rows * stride - n - lead))
        return x.view(b, h, rows, stride, x.shape[-1]).transpose(2, 3)

    scale = 1.0 / math.sqrt(d)
    qc, kc, vc = grid(q, shift), grid(k, 0), grid(v, 0)
    s = torch.matmul(qc, kc.transpose(-1, -2)) * scale  # (B, H, stride, rows, rows)
    r = torch.arange(rows, device=q.device)
    key = r[None, None, :] * stride + torch.arange(stride, device=q.device)[:, None, None]
    ok = (r[None, :, None] > r[None, None, :]) & (key >= shift) & (key < n)
    s = s.masked_fill(~ok, float("-inf"))
    diag = grid((q * k).sum(-1, keepdim=True) * scale, shift)  # own key, at the query's cell
    p = torch.softmax(torch.cat([s, diag], dim=-1), dim=-1)
    o = torch.matmul(p[..., :rows], vc) + p[..., rows:] * grid(v, shift)
    return o.transpose(2, 3).reshape(b, h, rows * stride, d)[:, :, shift:shift + n]
