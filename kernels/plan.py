"""Host-side plans for the block-sparse kernels, built once per (pattern, n, heads, tiles, device)
from the pattern's own answers: `kernel_spec(lb)` (rule and layout kind with named parameters, for
the layout block `lb`) and `block_plan(n, heads, bm, bn)` (key tiles per query tile and which of
them need no element rule).

Tiles are decoupled from the layout block: queries are tiled by `bm`, keys by `bn` (the powers of two
in kernels.tuning.CONFIGS); table layouts are planned at that granularity, so 'full' flags are exact per tile. The
element rule is evaluated per element, which is tile-independent for every rule but CAUSAL on a
table layout (its block layout is exact only at `lb`) and DIFFUSER (random keys per block of `lb`
queries): there the tiles must divide `lb`, else the plan falls back to per-tile element masks
(the TABLE rule).

Tables (int32), one per head when the pattern's heads differ (else one shared table):
* forward    `lay[hl, qb, s]` = key tile; partial slots first, then full ones (ascending within
  each part); `cnt[hl, qb] = (partial, total)`. The kernels run partial slots with the element rule
  and full slots with none (split at compile time).
* transposed `tlay[hl, kb, t]` = forward slot f = qb * M + s of the query tiles reading key tile kb,
  partial first; `tcnt[hl, kb] = (partial, total)`.
* work items `items[hl, i] = (kb, t0, t1, part)`: the dK/dV and A^T programs. A key tile read by
  far more query tiles than average (a global block) is split into chunks; each chunk writes an
  fp32 partial result `part`, and `flush[hl, j] = (kb, p0, p1)` sums them (deterministic: no atomics).
* `emask[hl, qb, s]` (bm x bn int8): element masks of the partial slots (TABLE rule only).
Causal and band layouts need no tables: their tile ranges are arithmetic in the kernels.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from dataclasses import dataclass

import torch

from imggen.errors import ShapeError
from imggen.patterns import KernelLayout, KernelRule, KernelSpec, Pattern

BLOCKS = (16, 32, 64, 128)   # layout blocks a caller may ask for
DEFAULT_BLOCK = 64           # layout block of patterns whose rule is a table at every size
SPLIT_MIN = 8                # never split a transposed row into chunks shorter than this
SPLIT_FACTOR = 2.0           # split rows longer than this many times the mean row
_ARITHMETIC = {KernelLayout.CAUSAL: KernelRule.CAUSAL, KernelLayout.BAND: KernelRule.BAND}


@dataclass(frozen=True)
class Plan:
    spec: KernelSpec
    lb: int                  # layout block the spec was made for
    bm: int                  # query tile
    bn: int                  # key tile
    nqb: int                 # query tiles
    nkb: int                 # key tiles
    hl: int                  # distinct tables (1 or heads)
    m: int                   # forward table width (slots per query tile)
    mp: int                  # partial slots per query tile with element masks
    ni: int                  # transposed work items per head
    nparts: int              # fp32 partial results per head (split key tiles)
    ns: int                  # split key tiles per head
    lay: torch.Tensor        # (HL, nqb, M) int32
    cnt: torch.Tensor        # (HL, nqb, 2) int32
    tlay: torch.Tensor       # (HL, nkb, MT) int32
    tcnt: torch.Tensor       # (HL, nkb, 2) int32
    items: torch.Tensor      # (HL, NI, 4) int32
    flush: torch.Tensor      # (HL, NS, 3) int32
    rand: torch.Tensor       # (HL, ceil(n / lb), R) int32 random keys per layout block (diffuser)
    emask: torch.Tensor      # (HL, nqb, MP, bm, bn) int8

    def rule_args(self) -> dict:
        """The spec's named parameters as kernel arguments (see kernels.sparse_kernels._rule)."""
        s = self.spec
        return dict(LB=self.lb, R=s.random_keys, RSH=self.rand.stride(0), WINDOW=s.window, WIDTH=s.width,
                    CHANNELS=s.channels, RADIUS=s.radius, SHIFT=s.shift, GLOBAL=s.global_tokens, STRIDE=s.stride,
                    RULE=int(s.rule), LAYOUT=int(s.layout))


def layout_block(pattern: Pattern, block: int | None) -> int:
    """The layout block: the caller's `block`, else the largest size for which the pattern has an
    arithmetic rule (bigbird / diffuser: their own block), else DEFAULT_BLOCK."""
    if block is not None:
        if block not in BLOCKS:
            raise ShapeError(f"triton backend: block={block} must be one of {BLOCKS}")
        return block
    for t in sorted(BLOCKS, reverse=True):
        if pattern.kernel_spec(t).rule != KernelRule.TABLE:
            return t
    return DEFAULT_BLOCK


def tile_spec(pattern: Pattern, lb: int, bm: int, bn: int) -> KernelSpec:
    """The pattern's spec at layout block lb, made valid for bm x bn tiles (else element masks):
    arithmetic layouts only with their own rule (diffusion always keeps tables: its A blocks are
    stored per slot); rules stated per layout block need query tiles inside one block: CAUSAL on a
    table layout (the layout is exact only at lb, so key tiles must divide it too) and DIFFUSER
    (random keys per block of queries)."""
    spec = pattern.kernel_spec(lb)
    if spec.layout != KernelLayout.TABLE and (pattern.is_diffusion or _ARITHMETIC[spec.layout] != spec.rule):
        spec = dataclasses.replace(spec, layout=KernelLayout.TABLE)
    if spec.rule == KernelRule.CAUSAL and spec.layout == KernelLayout.TABLE and (lb % bm or lb % bn):
        spec = KernelSpec()
    if spec.rule == KernelRule.DIFFUSER and lb % bm:
        spec = KernelSpec()
    return spec


def launchable_kinds(diffusion: bool = False) -> list[tuple[KernelRule, KernelLayout]]:
    """Every (rule, layout) pair `tile_spec` can return (diffusion: table layouts only)."""
    table = [(r, KernelLayout.TABLE) for r in KernelRule]
    return table if diffusion else [(r, lay) for lay, r in _ARITHMETIC.items()] + table


def keeps_rule(pattern: Pattern, lb: int, bm: int, bn: int) -> bool:
    """Whether bm x bn tiles run the pattern's own rule (not the element-mask fallback)."""
    return tile_spec(pattern, lb, bm, bn).rule == pattern.kernel_spec(lb).rule


def _sort_partial_first(keys: torch.Tensor, full: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reorder each row's slots: partial slots first, then full ones (both ascending). -> (keys,
    full, counts (.., 2) = (partial, total))."""
    big = keys.max().clamp(min=0) + 1
    order = torch.where(keys < 0, 3 * big, keys + full.long() * big).argsort(-1)
    keys, full = keys.gather(-1, order), full.gather(-1, order)
    valid = keys >= 0
    return keys, full, torch.stack([(valid & ~full).sum(-1), valid.sum(-1)], -1)


def _transpose(keys: torch.Tensor, full: torch.Tensor, nkb: int) -> tuple[torch.Tensor, torch.Tensor]:
    """keys, full: (nqb, M) of one head, partial first -> (tlay (nkb, MT), tcnt (nkb, 2))."""
    nqb, m = keys.shape
    f = torch.arange(nqb * m).view(nqb, m)
    valid = keys >= 0
    kb, fs, fl = keys[valid], f[valid], full[valid].long()
    order = torch.argsort((kb * 2 + fl) * (nqb * m) + fs)
    kb, fs, fl = kb[order], fs[order], fl[order]
    total = torch.bincount(kb, minlength=nkb)
    partial = torch.bincount(kb[fl == 0], minlength=nkb)
    starts = torch.cumsum(total, 0) - total
    t = torch.full((nkb, max(1, int(total.max()) if len(kb) else 1)), -1, dtype=torch.long)
    t[kb, torch.arange(len(kb)) - starts[kb]] = fs
    return t, torch.stack([partial, total], -1)


def _work_items(total: torch.Tensor) -> tuple[list[tuple[int, int, int, int]], list[tuple[int, int, int]]]:
    """Split transposed rows much longer than average into chunks; longest work first."""
    busy = total[total > 0].float()
    chunk = max(SPLIT_MIN, math.ceil(SPLIT_FACTOR * busy.mean().item())) if len(busy) else SPLIT_MIN
    items, flush, parts = [], [], 0
    for kb, t in enumerate(total.tolist()):
        if t <= chunk:
            items.append((kb, 0, t, -1))
            continue
        starts = range(0, t, chunk)
        items += [(kb, a, min(t, a + chunk), parts + i) for i, a in enumerate(starts)]
        flush.append((kb, parts, parts + len(starts)))
        parts += len(starts)
    items.sort(key=lambda it: it[1] - it[2])
    return items, flush


def _element_masks(pattern: Pattern, keys: torch.Tensor, np_: torch.Tensor, bm: int, bn: int, n: int,
                   mp: int) -> torch.Tensor:
    """(HL, nqb, MP, bm, bn) int8: `allowed` on the partial slots (keys partial-first)."""
    hl, nqb, _ = keys.shape
    tables = pattern.lookup_tables(n, hl)
    out = torch.zeros(hl, nqb, mp, bm, bn, dtype=torch.int8)
    step = max(1, (1 << 20) // (mp * bm * bn))
    for h in range(hl):
        for a in range(0, nqb, step):
            kb = keys[h, a:a + step, :mp]
            live = (torch.arange(mp) < np_[h, a:a + step, None])[..., None, None]
            qi = torch.arange(a, a + kb.shape[0])[:, None, None, None] * bm + torch.arange(bm)[:, None]
            kj = kb[:, :, None, None].clamp(min=0) * bn + torch.arange(bn)
            out[h, a:a + step] = (pattern.allowed(qi, kj, h, tables) & live & (qi < n) & (kj < n)).to(torch.int8)
    return out


@contextlib.contextmanager
def splitting_rows():
    """Plans made inside split every transposed row longer than 2 into chunks with partial results,
    so that a small problem runs the split path and the flush kernel (tests, the first-use self-check).
    The plan cache is cleared on entry and on exit: no such plan outlives the block."""
    global SPLIT_MIN, SPLIT_FACTOR
    old = SPLIT_MIN, SPLIT_FACTOR
    make_plan.cache_clear()
    SPLIT_MIN, SPLIT_FACTOR = 2, 0.5
    try:
        yield
    finally:
        SPLIT_MIN, SPLIT_FACTOR = old
        make_plan.cache_clear()


@functools.lru_cache(maxsize=128)
def make_plan(pattern: Pattern, n: int, heads: int, lb: int, bm: int, bn: int, device: str) -> Plan:
    spec = tile_spec(pattern, lb, bm, bn)
    spec = dataclasses.replace(spec, window=min(spec.window, n))  # same rule (i - j < n), no int32 overflow
    nqb, nkb = math.ceil(n / bm), math.ceil(n / bn)
    i32 = lambda x: x.to(torch.int32).contiguous().to(device)  # noqa: E731
    dummy = torch.zeros(1, 1, 1, dtype=torch.int32, device=device)
    rand = dummy
    if spec.random_keys:
        rand = i32(pattern.lookup_tables(n, pattern.head_count(heads))["random"])
    if spec.layout != KernelLayout.TABLE:
        return Plan(spec, lb, bm, bn, nqb, nkb, 1, 1, 1, nkb, 0, 0, dummy, dummy, dummy, dummy, dummy, dummy,
                    rand, torch.zeros(1, 1, 1, 1, 1, dtype=torch.int8, device=device))
    bp = pattern.block_plan(n, heads, bm, bn)
    # 'full' also needs every query row < n, so full tiles load without bounds checks both ways
    full = bp.full & ((torch.arange(nqb) + 1) * bm <= n)[None, :, None]
    keys, full, cnt = _sort_partial_first(bp.keys, full)
    hl, _, m = keys.shape
    tls, tcs = zip(*(_transpose(keys[h], full[h], nkb) for h in range(hl)))
    mt = max(t.shape[1] for t in tls)
    tlay = torch.stack([torch.nn.functional.pad(t, (0, mt - t.shape[1]), value=-1) for t in tls])
    work = [_work_items(tc[:, 1]) for tc in tcs]
    ni, ns = max(len(w) for w, _ in work), max(len(f) for _, f in work)
    items = torch.tensor([w + [(-1, 0, 0, -1)] * (ni - len(w)) for w, _ in work]).view(hl, ni, 4)
    flush = torch.tensor([f + [(-1, 0, 0)] * (max(1, ns) - len(f)) for _, f in work]).view(hl, max(1, ns), 3)
    nparts = int(flush[..., 2].max())
    mp = max(1, int(cnt[..., 0].max()))
    emask = torch.zeros(1, 1, 1, 1, 1, dtype=torch.int8)
    if spec.rule == KernelRule.TABLE:
        emask = _element_masks(pattern, keys, cnt[..., 0], bm, bn, n, mp)
    return Plan(spec, lb, bm, bn, nqb, nkb, hl, m, mp, ni, nparts, ns, i32(keys), i32(cnt), i32(tlay),
                i32(torch.stack(tcs)), i32(items), i32(flush), rand, emask.to(device))
