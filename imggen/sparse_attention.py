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


class _Windows:
    """Per-query-block key windows of one (batch, head) slice, and their transpose (fold).

    Band: window of block b = rows [b*Bq - P, b*Bq + Bq) of the left-padded keys, a strided view
    (no copy); the band rule is one relative bias shared by every block (the first m-1 blocks also
    mask the left padding). Other patterns: the layout's key blocks gathered with index_select and
    a per-block bias; the fold is index_add_.
    """

    def __init__(self, pattern: Pattern, n: int, heads: int, block: int, dtype, device):
        self.block, self.nqb = block, math.ceil(n / block)
        self.band = pattern.name == "band"
        if self.band:
            self.m = math.ceil((pattern.window - 1) / block) + 1
            self.lpad, self.rows = (self.m - 1) * block, (self.nqb + self.m - 1) * block
            rel, self.first = _band_bias(pattern.window, block, self.m, dtype, str(device))
            self.bias = lambda head: rel  # broadcast over blocks; `first` patches blocks < m-1
        else:
            index, bias, self.m, self.hl = _plan(pattern, n, heads, block, str(device))
            self.index = index.view(self.hl, self.nqb * self.m) % (self.nqb + 1)
            self.lpad, self.rows = 0, (self.nqb + 1) * block
            self._bias = bias.to(dtype)
            self.bias = lambda head: self._bias[head % self.hl]
        self.span = self.m * block

    def pad(self, x):
        """(B, H, n, D) -> (B*H, rows, D) with the padding the windows expect."""
        b, h, n, d = x.shape
        return F.pad(x, (0, 0, self.lpad, self.rows - self.lpad - n)).reshape(b * h, self.rows, -1)

    def unpad(self, x, shape):
        b, h, n, d = shape
        return x.view(b, h, self.rows, d)[:, :, self.lpad:self.lpad + n]

    def __call__(self, x, head):
        """(rows, D) -> (nqb, span, D)."""
        d = x.shape[-1]
        if self.band:
            return x.as_strided((self.nqb, self.span, d), (self.block * d, d, 1))
        return x.view(-1, self.block, d).index_select(0, self.index[head % self.hl]).view(self.nqb, self.span, d)

    def fold(self, dw, out, head):
        """Add window gradients dw (nqb, span, D) back onto out (rows, D)."""
        d = dw.shape[-1]
        blocks = out.view(-1, self.block, d)
        if self.band:
            dw = dw.view(self.nqb, self.m, self.block, d)
            for j in range(self.m):
                blocks[j:j + self.nqb] += dw[:, j]
        else:
            blocks.index_add_(0, self.index[head % self.hl], dw.reshape(-1, self.block, d))


def _pad_queries(x, nqb, block):
    b, h, n, d = x.shape
    return F.pad(x, (0, 0, 0, nqb * block - n)).reshape(b * h, nqb, block, d)


def _probs(w: _Windows, q, kp, head, scale, out):
    s = torch.baddbmm(w.bias(head), q, w(kp, head).transpose(1, 2), alpha=scale)
    if w.band:
        f = min(w.m - 1, w.nqb)
        s[:f] += w.first[:f]
    return torch.softmax(s, dim=-1, out=out)


class _BlockedAttention(torch.autograd.Function):
    """Softmax attention over each query block's key windows; probabilities saved for backward
    (memory O(N * span), never N x N). Loops over (batch, head) slices."""

    @staticmethod
    def forward(ctx, q, k, v, pattern, block):
        b, h, n, d = q.shape
        w = _Windows(pattern, n, h, block, q.dtype, q.device)
        scale = 1.0 / math.sqrt(d)
        qp = _pad_queries(q, w.nqb, block)
        kp, vp = w.pad(k), w.pad(v)
        training = any(ctx.needs_input_grad[:3])  # inference reuses one probability buffer
        probs = q.new_empty(b * h if training else 1, w.nqb, block, w.span)
        out = q.new_empty(b * h, w.nqb, block, d)
        for i in range(b * h):
            p = probs[i if training else 0]
            _probs(w, qp[i], kp[i], i % h, scale, out=p)
            torch.bmm(p, w(vp[i], i % h), out=out[i])
        ctx.save_for_backward(qp, kp, vp, probs)
        ctx.w, ctx.dims = w, (b, h, n, d, scale)
        return out.view(b, h, -1, d)[:, :, :n]

    @staticmethod
    def backward(ctx, dout):
        qp, kp, vp, probs = ctx.saved_tensors
        w, (b, h, n, d, scale) = ctx.w, ctx.dims
        do = _pad_queries(dout, w.nqb, w.block)
        dq, dk, dv = torch.empty_like(qp), torch.zeros_like(kp), torch.zeros_like(vp)
        for i in range(b * h):
            p, kw = probs[i], w(kp[i], i % h)
            dp = torch.bmm(do[i], w(vp[i], i % h).transpose(1, 2))
            ds = torch._softmax_backward_data(dp, p, -1, p.dtype)
            torch.bmm(ds, kw, out=dq[i])
            w.fold(torch.bmm(ds.transpose(1, 2), qp[i]), dk[i], i % h)
            w.fold(torch.bmm(p.transpose(1, 2), do[i]), dv[i], i % h)
        dq.mul_(scale)
        dk.mul_(scale)
        shape = (b, h, n, d)
        return dq.view(b, h, -1, d)[:, :, :n], w.unpad(dk, shape), w.unpad(dv, shape), None, None


def _diffusion_forward(q, k, v, pattern: Pattern, block: int):
    """Edge softmax A once per (batch, head), then Z0 = V, Z(k+1) = (1 - alpha) A Z(k) + alpha V.
    Returns (windows, padded q, padded k, A, [Z0 .. Z(steps)] in the padded key layout)."""
    b, h, n, d = q.shape
    w = _Windows(pattern, n, h, block, q.dtype, q.device)
    scale, alpha = 1.0 / math.sqrt(d), pattern.alpha
    qp = _pad_queries(q, w.nqb, block)
    kp, vp = w.pad(k), w.pad(v)
    probs = q.new_empty(b * h, w.nqb, block, w.span)
    for i in range(b * h):
        _probs(w, qp[i], kp[i], i % h, scale, out=probs[i])
    zs = [vp]
    for _ in range(pattern.steps):
        z = zs[-1]
        nz = vp * alpha
        for i in range(b * h):
            az = torch.bmm(probs[i], w(z[i], i % h)).view(-1, d)
            nz[i, w.lpad:w.lpad + az.shape[0]].add_(az, alpha=1 - alpha)
        zs.append(nz)
    return w, qp, kp, probs, zs


def diffusion_states(q, k, v, pattern: Pattern, block: int = DEFAULT_BLOCK) -> list[torch.Tensor]:
    """Z1..Z(steps-1) of a diffuser layer at every position, each (B, H, N, D) (cache prefill)."""
    with torch.no_grad():
        w, *_, zs = _diffusion_forward(q.contiguous(), k.contiguous(), v.contiguous(), pattern, block)
    return [w.unpad(z, q.shape) for z in zs[1:-1]]


class _BlockedDiffusion(torch.autograd.Function):
    """Diffuser: A = softmax on the sparse graph once (kept block-sparse, O(N * span) memory), then
    Z(k+1) = (1 - alpha) A Z(k) + alpha V for `steps` steps, each a block-sparse product reusing A.
    The backward runs the steps in reverse with A^T (the window fold) and ends in the softmax
    backward. Z lives in the padded key layout so each step reads its windows directly."""

    @staticmethod
    def forward(ctx, q, k, v, pattern, block):
        b, h, n, d = q.shape
        w, qp, kp, probs, zs = _diffusion_forward(q, k, v, pattern, block)
        ctx.save_for_backward(qp, kp, probs, *zs[:-1])
        ctx.w, ctx.dims = w, (b, h, n, d, 1.0 / math.sqrt(d), pattern.alpha)
        return w.unpad(zs[-1], (b, h, n, d))

    @staticmethod
    def backward(ctx, dout):
        qp, kp, probs, *zs = ctx.saved_tensors
        w, (b, h, n, d, scale, alpha) = ctx.w, ctx.dims
        g = w.pad(dout.contiguous())
        dvp = torch.zeros_like(g)
        da = torch.zeros_like(probs)
        rows = w.nqb * w.block
        for z in reversed(zs):  # Z(k+1) = alpha V + (1 - alpha) A Z(k)
            dvp.add_(g, alpha=alpha)
            g_prev = torch.zeros_like(g)
            for i in range(b * h):
                gq = g[i, w.lpad:w.lpad + rows].view(w.nqb, w.block, d)
                da[i].baddbmm_(gq, w(z[i], i % h).transpose(1, 2), alpha=1 - alpha)
                w.fold(torch.bmm(probs[i].transpose(1, 2), gq), g_prev[i], i % h)
            g = g_prev.mul_(1 - alpha)
        dvp += g  # Z0 = V
        dq, dk = torch.empty_like(qp), torch.zeros_like(kp)
        for i in range(b * h):
            ds = torch._softmax_backward_data(da[i], probs[i], -1, probs.dtype)
            torch.bmm(ds, w(kp[i], i % h), out=dq[i])
            w.fold(torch.bmm(ds.transpose(1, 2), qp[i]), dk[i], i % h)
        dq.mul_(scale)
        dk.mul_(scale)
        shape = (b, h, n, d)
        return dq.view(b, h, -1, d)[:, :, :n], w.unpad(dk, shape), w.unpad(dvp, shape), None, None


@functools.lru_cache(maxsize=32)
def _band_bias(window: int, block: int, m: int, dtype, device: str):
    """Relative band bias (1, Bq, m*Bq) shared by all blocks, and the left-padding fix for the first m-1."""
    pad = (m - 1) * block
    a = torch.arange(block)[:, None]
    c = torch.arange(m * block)[None, :]
    dist = a + pad - c  # i - j
    rel = torch.zeros(block, m * block).masked_fill_((dist < 0) | (dist >= window), float("-inf"))
    qb = torch.arange(max(m - 1, 1))[:, None, None]
    first = torch.zeros(qb.shape[0], block, m * block).masked_fill_(c[None] < pad - qb * block, float("-inf"))
    return rel[None].to(device, dtype), first.to(device, dtype)


def blocked_attention(q, k, v, pattern: Pattern, block: int = DEFAULT_BLOCK) -> torch.Tensor:
    b, h, n, d = q.shape
    if pattern.name == "full":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if pattern.name == "strided":
        return _strided_attention(q, k, v, pattern, block)
    fn = _BlockedDiffusion if pattern.is_diffusion else _BlockedAttention
    return fn.apply(q, k, v, pattern, block)


def _strided_attention(q, k, v, pattern: Pattern, block: int) -> torch.Tensor:
    """Sparse Transformer heads without a block layout: even heads are a band of `stride`; odd heads
    read keys j = i + shift - m*stride (m >= 1) plus their own position, i.e. one column of a grid
    with `stride` columns in which query i sits at cell i + shift. The odd heads run as dense
    strictly-causal attention down each column (O(N * N/stride) scores) with the diagonal key
    appended to each row."""
    from imggen.patterns import Band

    b, h, n, d = q.shape
    st, sh = pattern.stride, pattern.shift
    out = torch.empty_like(q)
    out[:, 0::2] = blocked_attention(q[:, 0::2], k[:, 0::2], v[:, 0::2], Band(window=st), block)
    if h < 2:
        return out
    qo, ko, vo = q[:, 1::2], k[:, 1::2], v[:, 1::2]
    rows = math.ceil((n + sh) / st)

    def grid(x, lead):  # (B, Ho, n, D) -> (B, Ho, stride, rows, D), position p at cell p + lead
        x = F.pad(x, (0, 0, lead, rows * st - n - lead))
        return x.view(b, -1, rows, st, x.shape[-1]).transpose(2, 3)

    scale = 1.0 / math.sqrt(d)
    qc, kc, vc = grid(qo, sh), grid(ko, 0), grid(vo, 0)
    s = torch.matmul(qc, kc.transpose(-1, -2)) * scale  # (B, Ho, stride, rows, rows)
    r = torch.arange(rows, device=q.device)
    key = r[None, None, :] * st + torch.arange(st, device=q.device)[:, None, None]  # (stride, 1, rows)
    ok = (r[None, :, None] > r[None, None, :]) & (key >= sh) & (key < n)
    s = s.masked_fill(~ok, float("-inf"))
    diag = grid((qo * ko).sum(-1, keepdim=True) * scale, sh)  # own key, at the query's cell
    p = torch.softmax(torch.cat([s, diag], dim=-1), dim=-1)
    o = torch.matmul(p[..., :rows], vc) + p[..., rows:] * grid(vo, sh)
    out[:, 1::2] = o.transpose(2, 3).reshape(b, -1, rows * st, d)[:, :, sh:sh + n]
    return out
