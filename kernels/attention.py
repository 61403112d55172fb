"""Block-sparse flash attention (forward, dQ, dK/dV) and the diffuser's block-sparse kernels.

One forward kernel and two backward kernels serve every softmax pattern; the pattern is the
constexpr KIND (see kernels.plan) and its element rule is computed arithmetically in `_rule`.
Scores are kept in base 2: s2 = q.k * scale * log2(e); LSE is saved in the same units.

Diffuser: `_fwd` with WRITE_P stores A = softmax on the layout's blocks ((B, H, nqb, M, T, T), fp32 for
fp32 inputs, else the input dtype: the diffusion steps are bound by reading A, and the same-precision
PyTorch computation rounds A to that dtype too);
`_spmm` multiplies by A or A^T (transposed layout) and mixes in a second operand; `_diff_ds`
forms dA from the saved diffusion states and the softmax backward dS = A * (dA - rowsum(A dA)).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .plan import BAND, BIGBIRD, DIFFUSER, FULL, LOCAL2D, STRIDED  # noqa: F401

LOG2E = 1.4426950408889634


@triton.jit
def _rule(i, j, qb, h, N, RAND, KIND: tl.constexpr, R: tl.constexpr, P0, P1, P2, P3):
    """Element rule on broadcastable query/key index tiles (mask(n, head) of imggen.patterns)."""
    valid = (i < N) & (j < N)
    causal = (j <= i) & valid
    if KIND == 1:  # band: P0 = window
        ok = causal & (i - j < P0)
    elif KIND == 2:  # local2d: P0 = width, P1 = channels, P2 = radius, P3 = shift
        jj = j - P3
        pi = i // P1
        pj = tl.maximum(jj, 0) // P1
        yi = pi // P0
        xi = pi - yi * P0
        yj = pj // P0
        xj = pj - yj * P0
        near = (jj >= 0) & (jj < i) & (yi - yj <= P2) & (xi - xj <= P2) & (xj - xi <= P2)
        ok = ((j == i) | ((j < i) & near)) & valid
    elif KIND == 4:  # diffuser: P0 = window, P1 = global tokens, RAND = random keys per query block
        hit = (i - j < P0) | (j < P1)
        for r in tl.static_range(R):
            hit = hit | (j == tl.load(RAND + qb * R + r))
        ok = causal & hit
    elif KIND == 5:  # strided: even heads band(P0); odd heads every P0-th key, shifted by P1
        jj = j - P1
        col = (jj >= 0) & (jj < i) & ((i - jj) % P0 == 0)
        odd = (h % 2) == 1
        ok = tl.where(odd, ((j == i) | ((j < i) & col)) & valid, causal & (i - j < P0))
    else:  # full, bigbird (bigbird's layout is exact at block level)
        ok = causal
    return ok


@triton.jit
def _kslot(s, qb, LAY, base, KIND: tl.constexpr, P0, BLOCK: tl.constexpr):
    """Key block and 'full' flag of forward slot s of query block qb."""
    if KIND == 0:
        kb = s
        full = (kb < qb).to(tl.int32)
    elif KIND == 1:
        lo = tl.maximum(qb * BLOCK - P0 + 1, 0) // BLOCK
        kb = lo + s
        full = ((kb < qb) & (qb * BLOCK + BLOCK - 1 - kb * BLOCK < P0)).to(tl.int32)
    else:
        e = tl.load(LAY + base + s)
        kb = e >> 1
        full = e & 1
    return kb, full


@triton.jit
def _nslots(qb, CNT, hl, NB, KIND: tl.constexpr, P0, BLOCK: tl.constexpr):
    if KIND == 0:
        n = qb + 1
    elif KIND == 1:
        n = qb - tl.maximum(qb * BLOCK - P0 + 1, 0) // BLOCK + 1
    else:
        n = tl.load(CNT + hl * NB + qb)
    return n


@triton.jit
def _qslot(t, kb, TLAY, base, M, NB, KIND: tl.constexpr, P0, BLOCK: tl.constexpr):
    """Query block, forward slot index (qb*M+s) and 'full' flag of transposed slot t of key block kb."""
    if KIND == 0:
        qb = kb + t
        f = qb
        full = (qb > kb).to(tl.int32)
    elif KIND == 1:
        qb = kb + t
        f = qb
        full = ((qb > kb) & (qb * BLOCK + BLOCK - 1 - kb * BLOCK < P0)).to(tl.int32)
    else:
        e = tl.load(TLAY + base + t)
        f = e >> 1
        qb = f // M
        full = e & 1
    return qb, f, full


@triton.jit
def _tslots(kb, TCNT, hl, NB, KIND: tl.constexpr, P0, BLOCK: tl.constexpr):
    if KIND == 0:
        n = NB - kb
    elif KIND == 1:
        n = tl.minimum(NB - 1, (kb * BLOCK + BLOCK + P0 - 2) // BLOCK) - kb + 1
    else:
        n = tl.load(TCNT + hl * NB + kb)
    return n


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _fwd(Q, K, V, O, LSE, PBUF, LAY, CNT, RAND,
         sqb, sqh, sqn, skb, skh, skn, svb, svh, svn,
         H, N, NB, M, MW, HDIFF, sm2, P0, P1, P2, P3,
         KIND: tl.constexpr, R: tl.constexpr, BLOCK: tl.constexpr, D: tl.constexpr,
         WRITE_O: tl.constexpr, WRITE_P: tl.constexpr, IEEE: tl.constexpr):
    qb = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)  # int64 offsets: B*H*N*D and the A blocks may pass 2**31
    b = bh // H
    h = bh % H
    hl = h * HDIFF
    rows = qb * BLOCK + tl.arange(0, BLOCK)
    cols0 = tl.arange(0, BLOCK)
    dd = tl.arange(0, D)
    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqn + dd[None, :], mask=rows[:, None] < N, other=0.0)
    kbase = K + b * skb + h * skh
    vbase = V + b * svb + h * svh
    rand = RAND + hl * NB * R
    lbase = (hl * NB + qb) * MW
    m_i = tl.full([BLOCK], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK], tl.float32)
    acc = tl.zeros([BLOCK, D], tl.float32)
    ns = _nslots(qb, CNT, hl, NB, KIND, P0, BLOCK)
    for s in range(0, ns):
        kb, full = _kslot(s, qb, LAY, lbase, KIND, P0, BLOCK)
        cols = kb * BLOCK + cols0
        k = tl.load(kbase + cols[:, None] * skn + dd[None, :], mask=cols[:, None] < N, other=0.0)
        sc = _dot(q, tl.trans(k), IEEE) * sm2
        if full == 0:
            ok = _rule(rows[:, None], cols[None, :], qb, h, N, rand, KIND, R, P0, P1, P2, P3)
            sc = tl.where(ok, sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        p = tl.math.exp2(sc - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if WRITE_O:
            v = tl.load(vbase + cols[:, None] * svn + dd[None, :], mask=cols[:, None] < N, other=0.0)
            acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
        m_i = m_new
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    lse = m_i + tl.math.log2(l_safe)
    tl.store(LSE + bh * N + rows, lse, mask=rows < N)
    if WRITE_O:
        o = acc / l_safe[:, None]
        tl.store(O + bh * N * D + rows[:, None] * D + dd[None, :], o.to(O.dtype.element_ty), mask=rows[:, None] < N)
    if WRITE_P:  # diffuser: store A on the layout's blocks (rows past N as zeros)
        pb = PBUF + (bh * NB + qb) * M * BLOCK * BLOCK
        for s in range(0, ns):
            kb, full = _kslot(s, qb, LAY, lbase, KIND, P0, BLOCK)
            cols = kb * BLOCK + cols0
            k = tl.load(kbase + cols[:, None] * skn + dd[None, :], mask=cols[:, None] < N, other=0.0)
            sc = _dot(q, tl.trans(k), IEEE) * sm2
            if full == 0:
                ok = _rule(rows[:, None], cols[None, :], qb, h, N, rand, KIND, R, P0, P1, P2, P3)
                sc = tl.where(ok, sc, float("-inf"))
            p = tl.math.exp2(sc - lse[:, None])
            p = tl.where(rows[:, None] < N, p, 0.0)
            tl.store(pb + s * BLOCK * BLOCK + cols0[:, None] * BLOCK + cols0[None, :], p.to(PBUF.dtype.element_ty))


@triton.jit
def _bwd_dq(Q, K, V, DO, LSE, DELTA, DQ, LAY, CNT, RAND,
            sqb, sqh, sqn, skb, skh, skn, svb, svh, svn,
            H, N, NB, MW, HDIFF, sm2, scale, P0, P1, P2, P3,
            KIND: tl.constexpr, R: tl.constexpr, BLOCK: tl.constexpr, D: tl.constexpr, IEEE: tl.constexpr):
    qb = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)  # int64 offsets: B*H*N*D and the A blocks may pass 2**31
    b = bh // H
    h = bh % H
    hl = h * HDIFF
    rows = qb * BLOCK + tl.arange(0, BLOCK)
    cols0 = tl.arange(0, BLOCK)
    dd = tl.arange(0, D)
    rmask = rows[:, None] < N
    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqn + dd[None, :], mask=rmask, other=0.0)
    do = tl.load(DO + bh * N * D + rows[:, None] * D + dd[None, :], mask=rmask, other=0.0)
    lse = tl.load(LSE + bh * N + rows, mask=rows < N, other=float("inf"))
    delta = tl.load(DELTA + bh * N + rows, mask=rows < N, other=0.0)
    kbase = K + b * skb + h * skh
    vbase = V + b * svb + h * svh
    rand = RAND + hl * NB * R
    lbase = (hl * NB + qb) * MW
    dq = tl.zeros([BLOCK, D], tl.float32)
    ns = _nslots(qb, CNT, hl, NB, KIND, P0, BLOCK)
    for s in range(0, ns):
        kb, full = _kslot(s, qb, LAY, lbase, KIND, P0, BLOCK)
        cols = kb * BLOCK + cols0
        k = tl.load(kbase + cols[:, None] * skn + dd[None, :], mask=cols[:, None] < N, other=0.0)
        v = tl.load(vbase + cols[:, None] * svn + dd[None, :], mask=cols[:, None] < N, other=0.0)
        sc = _dot(q, tl.trans(k), IEEE) * sm2
        if full == 0:
            ok = _rule(rows[:, None], cols[None, :], qb, h, N, rand, KIND, R, P0, P1, P2, P3)
            sc = tl.where(ok, sc, float("-inf"))
        p = tl.math.exp2(sc - lse[:, None])
        dp = _dot(do, tl.trans(v), IEEE)
        ds = p * (dp - delta[:, None])
        dq += _dot(ds.to(k.dtype), k, IEEE)
    tl.store(DQ + bh * N * D + rows[:, None] * D + dd[None, :], (dq * scale).to(DQ.dtype.element_ty), mask=rmask)


@triton.jit
def _bwd_dkdv(Q, K, V, DO, LSE, DELTA, DK, DV, TLAY, TCNT, RAND,
              sqb, sqh, sqn, skb, skh, skn, svb, svh, svn,
              H, N, NB, M, MTW, HDIFF, sm2, scale, P0, P1, P2, P3,
              KIND: tl.constexpr, R: tl.constexpr, BLOCK: tl.constexpr, D: tl.constexpr, IEEE: tl.constexpr):
    kb = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)  # int64 offsets: B*H*N*D and the A blocks may pass 2**31
    b = bh // H
    h = bh % H
    hl = h * HDIFF
    cols = kb * BLOCK + tl.arange(0, BLOCK)
    rows0 = tl.arange(0, BLOCK)
    dd = tl.arange(0, D)
    cmask = cols[:, None] < N
    k = tl.load(K + b * skb + h * skh + cols[:, None] * skn + dd[None, :], mask=cmask, other=0.0)
    v = tl.load(V + b * svb + h * svh + cols[:, None] * svn + dd[None, :], mask=cmask, other=0.0)
    qbase = Q + b * sqb + h * sqh
    rand = RAND + hl * NB * R
    tbase = (hl * NB + kb) * MTW
    dk = tl.zeros([BLOCK, D], tl.float32)
    dv = tl.zeros([BLOCK, D], tl.float32)
    nt = _tslots(kb, TCNT, hl, NB, KIND, P0, BLOCK)
    for t in range(0, nt):
        qb, f, full = _qslot(t, kb, TLAY, tbase, M, NB, KIND, P0, BLOCK)
        rows = qb * BLOCK + rows0
        rm = rows < N
        q = tl.load(qbase + rows[:, None] * sqn + dd[None, :], mask=rm[:, None], other=0.0)
        do = tl.load(DO + bh * N * D + rows[:, None] * D + dd[None, :], mask=rm[:, None], other=0.0)
        lse = tl.load(LSE + bh * N + rows, mask=rm, other=float("inf"))
        delta = tl.load(DELTA + bh * N + rows, mask=rm, other=0.0)
        st = _dot(k, tl.trans(q), IEEE) * sm2  # (keys, queries)
        if full == 0:
            ok = _rule(rows[None, :], cols[:, None], qb, h, N, rand, KIND, R, P0, P1, P2, P3)
            st = tl.where(ok, st, float("-inf"))
        pt = tl.math.exp2(st - lse[None, :])
        dv += _dot(pt.to(do.dtype), do, IEEE)
        dpt = _dot(v, tl.trans(do), IEEE)
        dst = pt * (dpt - delta[None, :])
        dk += _dot(dst.to(q.dtype), q, IEEE)
    tl.store(DK + bh * N * D + cols[:, None] * D + dd[None, :], (dk * scale).to(DK.dtype.element_ty), mask=cmask)
    tl.store(DV + bh * N * D + cols[:, None] * D + dd[None, :], dv.to(DV.dtype.element_ty), mask=cmask)


@triton.jit
def _spmm(P, X, Y, OUT, LAY, CNT, H, N, NB, M, MW, HDIFF, c1, c2,
          TRANS: tl.constexpr, HAS_Y: tl.constexpr, BLOCK: tl.constexpr, D: tl.constexpr, IEEE: tl.constexpr):
    """OUT[rb] = c1 * sum_slots A_blk @ X[src] + c2 * Y[rb];  A or A^T on the (transposed) layout.

    X, Y, OUT: contiguous (B, H, N, D); P: (B, H, NB, M, BLOCK, BLOCK) blocks of A (or of dS).
    """
    rb = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)  # int64 offsets: B*H*N*D and the A blocks may pass 2**31
    h = bh % H
    hl = h * HDIFF
    r0 = tl.arange(0, BLOCK)
    dd = tl.arange(0, D)
    rows = rb * BLOCK + r0
    base = bh * N * D
    pbase = P + bh * NB * M * BLOCK * BLOCK
    acc = tl.zeros([BLOCK, D], tl.float32)
    ns = tl.load(CNT + hl * NB + rb)
    for s in range(0, ns):
        e = tl.load(LAY + (hl * NB + rb) * MW + s) >> 1
        if TRANS:
            src = e // M
            blk = e
            a = tl.load(pbase + blk * BLOCK * BLOCK + r0[None, :] * BLOCK + r0[:, None])  # A^T block
        else:
            src = e
            blk = rb * M + s
            a = tl.load(pbase + blk * BLOCK * BLOCK + r0[:, None] * BLOCK + r0[None, :])
        srows = src * BLOCK + r0
        x = tl.load(X + base + srows[:, None] * D + dd[None, :], mask=srows[:, None] < N, other=0.0)
        acc += _dot(a.to(x.dtype), x, IEEE)
    out = acc * c1
    if HAS_Y:
        y = tl.load(Y + base + rows[:, None] * D + dd[None, :], mask=rows[:, None] < N, other=0.0)
        out += c2 * y.to(tl.float32)
    tl.store(OUT + base + rows[:, None] * D + dd[None, :], out.to(OUT.dtype.element_ty), mask=rows[:, None] < N)


@triton.jit
def _diff_ds(P, G, Z, DS, LAY, CNT, H, N, NB, M, MW, HDIFF, STEPS, sstep, c1,
             BLOCK: tl.constexpr, D: tl.constexpr, IEEE: tl.constexpr):
    """dA = c1 * sum_k G_k Z_k^T on the layout's blocks, then DS = A * (dA - rowsum(A * dA)).

    G, Z: (STEPS, B, H, N, D) contiguous (G_k = dL/dZ_(k+1), Z_k = Z_k); DS like P.
    """
    qb = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)  # int64 offsets: B*H*N*D and the A blocks may pass 2**31
    h = bh % H
    hl = h * HDIFF
    r0 = tl.arange(0, BLOCK)
    rows = qb * BLOCK + r0
    base = bh * N * D
    blk0 = (bh * NB + qb) * M * BLOCK * BLOCK
    tile = r0[:, None] * BLOCK + r0[None, :]
    rowdot = tl.zeros([BLOCK], tl.float32)
    ns = tl.load(CNT + hl * NB + qb)
    lay = LAY + (hl * NB + qb) * MW
    for s in range(0, ns):  # pass 1: rowsum(A * dA); dA is recomputed in pass 2 rather than stored
        da = _diff_da(G, Z, base, rows, (tl.load(lay + s) >> 1) * BLOCK + r0, N, STEPS, sstep, BLOCK, D, IEEE)
        a = tl.load(P + blk0 + s * BLOCK * BLOCK + tile).to(tl.float32)
        rowdot += tl.sum(a * da, 1)
    for s in range(0, ns):
        da = _diff_da(G, Z, base, rows, (tl.load(lay + s) >> 1) * BLOCK + r0, N, STEPS, sstep, BLOCK, D, IEEE)
        a = tl.load(P + blk0 + s * BLOCK * BLOCK + tile).to(tl.float32)
        ds = a * (da * c1 - rowdot[:, None] * c1)
        tl.store(DS + blk0 + s * BLOCK * BLOCK + tile, ds.to(DS.dtype.element_ty))


@triton.jit
def _diff_da(G, Z, base, rows, cols, N, STEPS, sstep, BLOCK: tl.constexpr, D: tl.constexpr, IEEE: tl.constexpr):
    """sum_k G_k[rows] @ Z_k[cols]^T (a dot with inner dimension STEPS * D)."""
    dd = tl.arange(0, D)
    da = tl.zeros([BLOCK, BLOCK], tl.float32)
    gp = G + base + rows[:, None] * D + dd[None, :]
    zp = Z + base + cols[:, None] * D + dd[None, :]
    for st in range(0, STEPS):
        g = tl.load(gp, mask=rows[:, None] < N, other=0.0)
        z = tl.load(zp, mask=cols[:, None] < N, other=0.0)
        da += _dot(g, tl.trans(z), IEEE)
        gp += sstep
        zp += sstep
    return da
