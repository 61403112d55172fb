"""Memory-bounded decode caches: one per attention pattern, chosen from the pattern itself.

Every cache here is a `KVCache` (preallocated k/v[/z] buffers, updated in place, `positions[slot]`
bookkeeping) that overrides three things: how many slots it has, which slot position t goes to
(reusing the slot of a position no future query reads), and how the additive key bias of query t
is computed (position arithmetic on `positions`, never a per-step rebuild of pattern tables).

Eviction is decided from `last_read[j]`: the last query position (over all heads: caches keep the
union, the bias still masks per head) that may read key j. It is computed by arithmetic from the
pattern's parameters (and, for random edges, from the seeded tables, once) and, in debug mode
(`IMGGEN_CACHE_DEBUG=1` or `imggen.eviction.DEBUG = True`), checked against `pattern.mask`, with an
assertion on every slot reuse and every step that no position a future query reads was evicted.

Caches
* `full`     `FullCache`: every position (capacity n); reads slots [0, t] only.
* `band`     `RingCache`: ring of the last `window` positions; no bias needed at all.
* `local2d`  `RingCache`: ring of r rows + (r + 1) pixels (subpixels for RGB, minus `shift`):
             linear in width, constant in height; bias from (row, column) arithmetic.
* `bigbird`  `PlannedCache`: sink blocks, window blocks and each random block until its last reader;
             slots come from an interval plan computed once per (pattern, n); capacity = the
             largest number of simultaneously live positions.
* `diffuser` `PlannedCache` with diffusion states Z1..Z(K-1): band + global tokens + random keys
             until their last reader.
* `strided`  `StridedCache`: keeps every position. The odd (column) heads read the whole column
             above, i.e. every residue class mod `stride` stays readable until the last row, so no
             eviction rule can save more than the final `stride` keys. Instead the per-step compute
             is sparse: even heads read a contiguous view of the last `stride` slots, odd heads a
             strided view of their column -- O(stride + n / stride) keys per step, no bias.
"""
from __future__ import annotations

import functools
import heapq
import os
from collections import deque

import numpy as np
import torch

from imggen.cache import KVCache, decode_attention
from imggen.patterns import BigBird, Band, Diffuser, Full, Local2D, Pattern, Strided

DEBUG = os.environ.get("IMGGEN_CACHE_DEBUG", "") not in ("", "0")


# ------------------------------------------------------------------------ eviction arithmetic
def _heads(pattern: Pattern, heads: int) -> range:
    return range(heads) if pattern.heads_differ else range(1)


@functools.lru_cache(maxsize=64)
def last_reads(pattern: Pattern, n: int, heads: int) -> np.ndarray:
    """(n,) int64: the last query position < n (any head) that may read key j; >= j (diagonal)."""
    j = np.arange(n, dtype=np.int64)
    if isinstance(pattern, Full):
        last = np.full(n, n - 1)
    elif isinstance(pattern, Band):
        last = j + pattern.window - 1
    elif isinstance(pattern, Local2D):
        c, w, r = pattern.channels, pattern.width, pattern.radius
        jj = j - pattern.shift
        p = np.maximum(jj, 0) // c
        y = np.minimum(p // w + r, (n - 1) // (w * c))  # last row present (a partial one: over-estimate)
        x = np.minimum(p % w + r, w - 1)
        last = np.where(jj >= 0, (y * w + x) * c + c - 1, j)
    elif isinstance(pattern, BigBird):
        b = pattern.block
        kb = j // b
        last = np.where(kb < pattern.global_blocks, n - 1, (kb + pattern.window_blocks) * b - 1)
        nqb = -(-n // b)
        lastb = np.full(nqb, -1)
        for h in _heads(pattern, heads):
            for qb in range(nqb):
                for rb in pattern.random_of(qb, h):
                    lastb[rb] = max(lastb[rb], (qb + 1) * b - 1)
        last = np.maximum(last, lastb[kb])
    elif isinstance(pattern, Diffuser):
        last = np.where(j < pattern.global_tokens, n - 1, j + pattern.window - 1)
        nqb = -(-n // pattern.block)
        for h in _heads(pattern, heads):
            for qb in range(nqb):
                for k in pattern.random_of(qb, h):
                    if k < n:
                        last[k] = max(last[k], (qb + 1) * pattern.block - 1)
    elif isinstance(pattern, Strided):
        s, st = pattern.shift, pattern.stride
        last = j + st - 1  # even heads
        if heads > 1:  # odd heads: queries i = jj + m * stride, m >= 1
            jj = j - s
            col = jj + ((n - 1 - jj) // st) * st
            last = np.where((jj >= 0) & (col > jj), np.maximum(last, col), last)
    else:
        return true_last_reads(pattern, n, heads)
    return np.maximum(np.minimum(last, n - 1), j)


def true_last_reads(pattern: Pattern, n: int, heads: int) -> np.ndarray:
    """`last_reads` from the definition (`pattern.mask`); O(n^2), for tests and debug mode."""
    m = torch.zeros(n, n, dtype=torch.bool)
    for h in _heads(pattern, heads):
        m |= pattern.mask(n, h)
    rows = torch.arange(n)[:, None].expand(n, n)
    return rows.masked_fill(~m, -1).max(0).values.numpy().astype(np.int64)


@functools.lru_cache(maxsize=64)
def slot_plan(pattern: Pattern, n: int, heads: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Interval plan: (slot of each position, slots in use up to each t (exclusive bound), capacity).

    Position t takes a slot freed by a position j with last_read[j] < t (FIFO, so a pure window
    degenerates to a ring), else a new one; capacity = max number of simultaneously live positions.
    """
    last = last_reads(pattern, n, heads)
    slots, hi = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
    live: list[tuple[int, int]] = []
    free: deque[int] = deque()
    used = 0
    for t in range(n):
        while live and live[0][0] < t:
            free.append(heapq.heappop(live)[1])
        if free:
            s = free.popleft()
        else:
            s, used = used, used + 1
        slots[t], hi[t] = s, used
        heapq.heappush(live, (int(last[t]), s))
    return slots, hi, used


@functools.lru_cache(maxsize=64)
def random_table(pattern: Pattern, n: int, heads: int) -> torch.Tensor:
    """(H or 1, query blocks, R) long: random keys (diffuser) / key blocks (bigbird) of each query
    block, padded with -2; built once per (pattern, n) from the seeded layout."""
    nqb = -(-n // pattern.block)
    r = max(1, pattern.random_blocks if isinstance(pattern, BigBird) else pattern.random_edges)
    table = torch.full((len(_heads(pattern, heads)), nqb, r), -2, dtype=torch.long)
    for h in _heads(pattern, heads):
        for qb in range(nqb):
            rs = pattern.random_of(qb, h)
            table[h, qb, : len(rs)] = torch.tensor(rs, dtype=torch.long)
    return table


# ------------------------------------------------------------------------------------ caches
class EvictionCache(KVCache):
    """Shared machinery: slot table / ring arithmetic, fast reads of slots [0, hi), debug checks."""

    kind = "evict"

    def __init__(self, pattern, batch, heads, head_dim, n, device=None, dtype=torch.float32,
                 keep_all: bool = False):
        self.keep_all = keep_all
        super().__init__(pattern, batch, heads, head_dim, n, device, dtype,
                         capacity=n if keep_all else self._capacity(pattern, n, heads))
        self.debug = DEBUG
        if self.debug:
            self._true_last = true_last_reads(pattern, n, heads)
            bad = np.nonzero(last_reads(pattern, n, heads) < self._true_last)[0]
            assert len(bad) == 0, f"{pattern.name}: last_read underestimates keys {bad[:10].tolist()}"
            self._must_hold = torch.zeros(n, n, dtype=torch.bool)
            for h in _heads(pattern, heads):
                self._must_hold |= pattern.mask(n, h)

    # -- slot policy (subclasses) --------------------------------------------------------------
    def _capacity(self, pattern, n, heads) -> int:
        return n

    def slot_for(self, t: int) -> int:
        return t

    def slots_of(self, positions):
        return positions

    def hi(self, t: int) -> int:
        """Slots [0, hi) may be held at step t (a slice view; no reads of never-used slots)."""
        return t + 1

    def bias(self, pos: torch.Tensor, t: int):
        """Additive (H or 1, L) bias of query t over held positions `pos` (L,), or None = all."""
        ok = (pos >= 0) & self.rule(pos, t)
        return torch.zeros(ok.shape, dtype=self.k.dtype, device=pos.device).masked_fill_(~ok, float("-inf"))

    def rule(self, pos: torch.Tensor, t: int) -> torch.Tensor:
        """Bool (H or 1, L) or (L,): may query t read the held position (pos >= 0 is added)."""
        heads = _heads(self.pattern, self.heads)
        tt = torch.tensor(t, device=pos.device)
        return torch.stack([self.pattern.allowed(tt, pos, h) for h in heads])

    def retained_after(self, n0: int) -> torch.Tensor:
        return torch.arange(n0)

    def key_bias(self, t: int):
        return self.bias(self.positions[: self.hi(t)], t)

    # -- decode ---------------------------------------------------------------------------------
    def attend(self, q, k, v, t: int) -> torch.Tensor:
        slot = self.slot_for(t)
        if self.debug:
            self._check_step(slot, t)
        self.k[:, :, slot] = k
        self.v[:, :, slot] = v
        self.positions[slot] = t
        hi = self.hi(t)
        bias = self.bias(self.positions[:hi], t)
        if self.z is None:
            return decode_attention(q, self.k[:, :, :hi], self.v[:, :, :hi], bias, self.scale)
        return self._diffuse(q, v, slot, hi, bias)

    def nbytes(self) -> int:
        """k, v (+ z) and positions buffers, plus per-position bookkeeping tables (8 bytes/entry)."""
        return super().nbytes() + getattr(self, "_table_bytes", 0)

    # -- debug ----------------------------------------------------------------------------------
    def _check_step(self, slot: int, t: int) -> None:
        old = int(self.positions[slot])
        assert old < 0 or self._true_last[old] < t, (
            f"{self.pattern.name}: slot {slot} reused at t={t} evicts position {old}, "
            f"still read by query {self._true_last[old]}")
        assert int(self.positions.max()) < t, "cache holds a future position"
        held = set(self.positions.tolist()) | {t}
        need = set(torch.nonzero(self._must_hold[t, : t + 1]).view(-1).tolist())
        assert need <= held, f"{self.pattern.name}: query {t} reads evicted {sorted(need - held)[:10]}"

    def _check_prefill(self, n0, pos, slots) -> None:
        if not self.debug:
            return
        assert bool((self.positions < 0).all()), "prefill into a used cache"
        assert len(set(slots.tolist())) == len(slots), "prefill maps two positions to one slot"
        live = set(np.nonzero(self._true_last[:n0] >= n0)[0].tolist())
        assert live <= set(pos.tolist()), f"prefill drops live positions {sorted(live - set(pos.tolist()))[:10]}"
        if not self.keep_all and not isinstance(self, FullCache):
            dead = set(pos.tolist()) - live
            assert not dead, f"prefill writes positions no query >= {n0} reads: {sorted(dead)[:10]}"


class FullCache(EvictionCache):
    """Keeps every position; query t reads slots [0, t] (also the cache of unknown patterns, masked
    by the generic `pattern.allowed` rule)."""

    def bias(self, pos, t):
        if isinstance(self.pattern, Full) and not self.debug:
            return None  # slots [0, t] hold exactly positions 0..t, all readable
        return super().bias(pos, t)

    def rule(self, pos, t):
        return pos <= t if isinstance(self.pattern, Full) else super().rule(pos, t)


class RingCache(EvictionCache):
    """Ring buffer: position t goes to slot t % L with L = max_j (last_read[j] - j) + 1, so slot
    reuse only ever evicts a position whose last reader has passed."""

    def _capacity(self, pattern, n, heads):
        return int((last_reads(pattern, n, heads) - np.arange(n)).max()) + 1

    def retained_after(self, n0):
        """The live positions among the last `capacity` (the ring holds nothing older)."""
        if self.keep_all:
            return torch.arange(n0)
        j = np.arange(max(0, n0 - self.capacity), n0)
        return torch.from_numpy(j[last_reads(self.pattern, self.n, self.heads)[j] >= n0])

    def slot_for(self, t):
        return t if self.keep_all else t % self.capacity

    def slots_of(self, positions):
        return positions if self.keep_all else positions % self.capacity

    def hi(self, t):
        return t + 1 if self.keep_all else min(t + 1, self.capacity)


class BandCache(RingCache):
    """Band: ring of the last `window` positions. The ring holds exactly positions t-window+1..t,
    all readable by query t, so no bias at all."""

    def bias(self, pos, t):
        if self.keep_all:
            return super().bias(pos, t)
        if self.debug:
            assert bool((super().bias(pos, t) == 0).all()), "band ring holds a position query t may not read"
        return None

    def rule(self, pos, t):
        return t - pos < self.pattern.window


class Local2DCache(RingCache):
    """Local 2-D neighbourhood: ring of r rows + (r+1) pixels; bias from (row, column) arithmetic."""

    def rule(self, pos, t):
        p = self.pattern
        c, w, r = p.channels, p.width, p.radius
        jj = pos - p.shift
        pj = torch.div(jj.clamp(min=0), c, rounding_mode="floor")
        pt = t // c
        yt, xt = pt // w, pt % w
        ok = (jj >= 0) & (jj < t) & (yt - torch.div(pj, w, rounding_mode="floor") <= r) \
            & ((pj % w - xt).abs() <= r)
        return ok | (pos == t)


class PlannedCache(EvictionCache):
    """Slots from `slot_plan` (interval allocation over last_read), computed once per (pattern, n).
    Random tables are built once per cache as a (H, query blocks, R) tensor."""

    def __init__(self, pattern, batch, heads, head_dim, n, device=None, dtype=torch.float32,
                 keep_all: bool = False):
        super().__init__(pattern, batch, heads, head_dim, n, device, dtype, keep_all)
        if not keep_all:
            slots, hi, _ = slot_plan(pattern, n, heads)
            self._last = last_reads(pattern, n, heads)
            self._slots, self._hi = slots.tolist(), hi.tolist()
            self._slots_t = torch.from_numpy(slots).to(self.positions.device)
            self._table_bytes = 4 * n * 8  # last_read, slot (list + tensor), hi
        table = random_table(pattern, n, heads)
        self._random = table.to(self.positions.device)
        self._table_bytes = getattr(self, "_table_bytes", 0) + table.numel() * 8

    def _capacity(self, pattern, n, heads):
        return slot_plan(pattern, n, heads)[2]

    def retained_after(self, n0):
        j = torch.arange(n0)
        return j if self.keep_all else j[torch.from_numpy(self._last[:n0] >= n0)]

    def slot_for(self, t):
        return t if self.keep_all else self._slots[t]

    def slots_of(self, positions):
        return positions if self.keep_all else self._slots_t[positions]

    def hi(self, t):
        return t + 1 if self.keep_all else self._hi[t]

    def _in_random(self, keys: torch.Tensor, t: int) -> torch.Tensor:
        """(H, L) bool: keys (L,) among the random keys of query t's block, per head."""
        table = self._random[:, t // self.pattern.block]  # (H, R)
        return (keys[None, None, :] == table[:, :, None]).any(1)


class BigBirdCache(PlannedCache):
    def rule(self, pos, t):
        p = self.pattern
        qb = t // p.block
        kb = torch.div(pos, p.block, rounding_mode="floor")
        ok = ((qb - kb < p.window_blocks) | (kb < p.global_blocks)) & (pos <= t)
        return ok[None] | (self._in_random(kb, t) & (pos <= t)[None]) if p.random_blocks else ok[None]


class DiffuserCache(PlannedCache):
    """Diffuser: keys, values and diffusion states Z1..Z(K-1) of retained positions."""

    def rule(self, pos, t):
        p = self.pattern
        ok = ((t - pos < p.window) | (pos < p.global_tokens)) & (pos <= t)
        return ok[None] | (self._in_random(pos, t) & (pos <= t)[None]) if p.random_edges else ok[None]


class StridedCache(EvictionCache):
    """Strided (Sparse Transformer): every position kept (see the module docstring); even heads read
    the view of slots (t - stride, t], odd heads the column view j = t + shift - m * stride plus
    the diagonal: no bias, no gather. keep_all=True is the plain baseline (read slots [0, t], mask)."""

    def _capacity(self, pattern, n, heads):
        return n

    def retained_after(self, n0):
        j = torch.arange(n0)
        return j if self.keep_all else j[torch.from_numpy(last_reads(self.pattern, self.n, self.heads)[:n0] >= n0)]

    def rule(self, pos, t):
        p = self.pattern
        even = t - pos < p.stride
        jj = pos - p.shift
        odd = ((jj >= 0) & (jj < t) & ((t - jj) % p.stride == 0)) | (pos == t)
        return torch.stack([even if h % 2 == 0 else odd for h in range(self.heads)]) & (pos <= t)

    def attend(self, q, k, v, t):
        if self.keep_all or self.debug:
            ref = super().attend(q, k, v, t)  # writes slot t
            if self.keep_all:
                return ref
        else:
            self.k[:, :, t] = k
            self.v[:, :, t] = v
            self.positions[t] = t
        p = self.pattern
        out = torch.empty_like(q)
        lo = max(0, t - p.stride + 1)
        out[:, 0::2] = decode_attention(q[:, 0::2], self.k[:, 0::2, lo:t + 1], self.v[:, 0::2, lo:t + 1],
                                        None, self.scale)
        if self.heads > 1:
            start = (t + p.shift) % p.stride
            if start < p.shift:
                start += p.stride
            end = max(start, min(t, t + p.shift - p.stride + 1))
            ks = torch.cat([self.k[:, 1::2, start:end:p.stride], self.k[:, 1::2, t:t + 1]], 2)
            vs = torch.cat([self.v[:, 1::2, start:end:p.stride], self.v[:, 1::2, t:t + 1]], 2)
            out[:, 1::2] = decode_attention(q[:, 1::2], ks, vs, None, self.scale)
        if self.debug:
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        return out


CACHES: dict[type, type] = {Full: FullCache, Band: BandCache, Local2D: Local2DCache,
                            BigBird: BigBirdCache, Diffuser: DiffuserCache, Strided: StridedCache}


def cache_class(pattern: Pattern) -> type:
    for cls in type(pattern).__mro__:
        if cls in CACHES:
            return CACHES[cls]
    return FullCache  # unknown pattern: keep everything, generic rule from pattern.allowed


def make_eviction_cache(pattern: Pattern, batch: int, heads: int, head_dim: int, n: int,
                        device=None, dtype=torch.float32, keep_all: bool = False) -> KVCache:
    """The memory-bounded decode cache of `pattern` (keep_all=True: same code, nothing evicted)."""
    return cache_class(pattern)(pattern, batch, heads, head_dim, n, device, dtype, keep_all=keep_all)
