"""Host-side plans for the block-sparse kernels: pattern kind, element-rule parameters and the
forward / transposed block layouts, built once per (pattern, n, heads, block, device) and cached.

Layout tables (int32), one per head when `pattern.heads_differ` (else one shared table):
* forward  `lay[hl, qb, s]`  = kb * 2 + full   (ascending kb; `cnt[hl, qb]` valid slots)
* transposed `tlay[hl, kb, t]` = (qb * M + s) * 2 + full   (query blocks that read key block kb,
  ascending; `(qb, s)` names the forward slot, i.e. the block of the diffuser's stored A)
`full` = every (query < n, key) pair of the block is allowed, so the kernel skips the element rule.
Band and full patterns need no tables: their layouts are arithmetic in the kernels.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from imggen.errors import ShapeError
from imggen.patterns import Pattern

# pattern kinds (constexpr in the kernels)
FULL, BAND, LOCAL2D, BIGBIRD, DIFFUSER, STRIDED = range(6)
KINDS = {"full": FULL, "band": BAND, "local2d": LOCAL2D, "bigbird": BIGBIRD, "diffuser": DIFFUSER,
         "strided": STRIDED}
BLOCKS = (16, 32, 64, 128)


@dataclass(frozen=True)
class Plan:
    kind: int
    params: tuple[int, int, int, int]   # P0..P3 of the element rule (see kernels.attention._rule)
    block: int
    nqb: int
    m: int                              # width of the forward table (slots per query block)
    hdiff: int                          # 1 when tables are per head
    lay: torch.Tensor                   # (HL, nqb, M) int32 or a dummy
    cnt: torch.Tensor                   # (HL, nqb) int32
    tlay: torch.Tensor                  # (HL, nqb, MT) int32
    tcnt: torch.Tensor                  # (HL, nqb) int32
    rand: torch.Tensor                  # (HL, nqb, R) int32 random keys per query block (diffuser)
    r: int                              # R (0 when unused)


def pick_block(pattern: Pattern, block: int | None, device) -> int:
    if pattern.name in ("bigbird", "diffuser"):
        b = pattern.block
        if b not in BLOCKS:
            raise ShapeError(f"triton backend: {pattern.name} pattern block={b} must be one of {BLOCKS} "
                             f"(its random edges are drawn per block, the kernel tiles by it); "
                             f"use make_pattern({pattern.name!r}, block=64, ...) or backend='cpu'")
        if block is not None and block != b:
            raise ShapeError(f"triton backend: block={block} must equal the {pattern.name} pattern's block={b}")
        return b
    if block is None:
        return 64
    if block not in BLOCKS:
        raise ShapeError(f"triton backend: block={block} must be one of {BLOCKS}")
    return block


def _params(p: Pattern) -> tuple[int, int, int, int]:
    if p.name == "band":
        return (p.window, 0, 0, 0)
    if p.name == "local2d":
        return (p.width, p.channels, p.radius, p.shift)
    if p.name == "diffuser":
        return (p.window, p.global_tokens, 0, 0)
    if p.name == "strided":
        return (p.stride, p.shift, 0, 0)
    return (0, 0, 0, 0)


def _full_flags(p: Pattern, lay: torch.Tensor, n: int, block: int, head: int) -> torch.Tensor:
    """(nqb, M) bool: layout block needs no element rule. Conservative where exactness is costly."""
    nqb, m = lay.shape
    qb = torch.arange(nqb)[:, None].expand(nqb, m)
    kb = lay
    inside = (kb >= 0) & ((kb + 1) * block <= n)
    if p.name == "bigbird":  # layout is exact at block level; only the diagonal block is causal
        return inside & (kb < qb)
    if p.name == "diffuser":  # blocks wholly inside the window or wholly global
        q_last = torch.clamp((qb + 1) * block, max=n) - 1
        return inside & (kb < qb) & ((q_last - kb * block < p.window) | ((kb + 1) * block <= p.global_tokens))
    out = torch.zeros(nqb, m, dtype=torch.bool)
    ar = torch.arange(block)
    step = max(1, (1 << 22) // (m * block * block))
    for a in range(0, nqb, step):  # exact, by evaluating the rule on chunks of blocks
        qi = (torch.arange(a, min(nqb, a + step))[:, None, None, None] * block + ar[:, None])  # (c,1,B,1)
        kj = kb[a:a + step, :, None, None].clamp(min=0) * block + ar  # (c,M,1,B)
        ok = p.allowed(qi, kj, head) | (qi >= n)  # rows past n do not matter
        out[a:a + step] = ok.all(-1).all(-1)
    return out & inside


def _transpose(lay: torch.Tensor, full: torch.Tensor, nqb: int) -> tuple[torch.Tensor, torch.Tensor]:
    m = lay.shape[1]
    qb = torch.arange(nqb)[:, None].expand(nqb, m)
    valid = lay >= 0
    kb, f, fl = lay[valid], (qb * m + torch.arange(m))[valid], full[valid].long()
    order = torch.argsort(kb * (nqb * m) + f)
    kb, f, fl = kb[order], f[order], fl[order]
    counts = torch.bincount(kb, minlength=nqb)
    starts = torch.cumsum(counts, 0) - counts
    pos = torch.arange(len(kb)) - starts[kb]
    mt = max(1, int(counts.max()) if len(kb) else 1)
    t = torch.full((nqb, mt), -1, dtype=torch.long)
    t[kb, pos] = f * 2 + fl
    return t, counts


@functools.lru_cache(maxsize=64)
def make_plan(pattern: Pattern, n: int, heads: int, block: int, device: str) -> Plan:
    kind = KINDS.get(pattern.name)
    if kind is None:
        raise ShapeError(f"triton backend has no kernel for pattern {pattern.name!r}")
    nqb = math.ceil(n / block)
    dummy = torch.zeros(1, 1, 1, dtype=torch.int32, device=device)
    if kind in (FULL, BAND):
        return Plan(kind, _params(pattern), block, nqb, 1, 0, dummy, dummy[0], dummy, dummy[0], dummy, 0)
    hl = heads if pattern.heads_differ else 1
    lays, fulls = [], []
    for h in range(hl):
        lay = pattern.block_layout(n, block, h)
        lays.append(lay)
        fulls.append(_full_flags(pattern, lay, n, block, h))
    m = max(l.shape[1] for l in lays)
    lay_t = torch.full((hl, nqb, m), -1, dtype=torch.long)
    cnt = torch.zeros(hl, nqb, dtype=torch.long)
    tl_list, tc = [], torch.zeros(hl, nqb, dtype=torch.long)
    for h, (lay, full) in enumerate(zip(lays, fulls)):
        lay = torch.nn.functional.pad(lay, (0, m - lay.shape[1]), value=-1)
        full = torch.nn.functional.pad(full, (0, m - full.shape[1]), value=False)
        lay_t[h] = torch.where(lay >= 0, lay * 2 + full.long(), -1)
        cnt[h] = (lay >= 0).sum(1)
        t, c = _transpose(lay, full, nqb)
        tl_list.append(t)
        tc[h] = c
    mt = max(t.shape[1] for t in tl_list)
    tlay = torch.stack([torch.nn.functional.pad(t, (0, mt - t.shape[1]), value=-1) for t in tl_list])
    r = 0
    rand = dummy
    if kind == DIFFUSER and pattern.random_edges:
        r = pattern.random_edges
        rand_t = torch.full((hl, nqb, r), -2, dtype=torch.long)
        for h in range(hl):
            for qb in range(nqb):
                ks = pattern.random_of(qb, h)
                rand_t[h, qb, : len(ks)] = torch.tensor(ks, dtype=torch.long)
        rand = rand_t.to(torch.int32).to(device)
    i32 = lambda x: x.to(torch.int32).contiguous().to(device)  # noqa: E731
    return Plan(kind, _params(pattern), block, nqb, m, int(pattern.heads_differ), i32(lay_t), i32(cnt),
                i32(tlay), i32(tc), rand, r)
