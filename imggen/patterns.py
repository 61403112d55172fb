"""Causal attention patterns over raster-order token sequences.

Every pattern answers the same questions, so every backend and every cache reads them from here:

* `allowed(i, j, head)` -- the element rule on broadcastable index tensors. `mask(n, head)` is this
  rule on a grid and is the **definition** of the pattern: lower-triangular, diagonal always True.
* `key_ranges(q0, q1, head)` -- half-open key ranges covering every key that a query in [q0, q1)
  may read (a superset is fine). Block layouts for the blocked CPU backend and the kernels are
  built from it.
* `oldest_key(t, head)` -- the smallest key position that any query >= t may still read
  (eviction rule of the decode caches); patterns with sink/random keys add `kept_keys(t, head)`.

Random edges (bigbird, diffuser) are drawn from (seed, layer, head, query block) only, so a prefix
of length n sees exactly the edges of the full sequence, and training, sampling and caches agree.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import numpy as np
import torch

from imggen.errors import ConfigError

Ranges = list[tuple[int, int]]


def _merge(ranges: Ranges, hi: int) -> Ranges:
    out: Ranges = []
    for a, b in sorted((max(0, a), min(hi, b)) for a, b in ranges):
        if a >= b:
            continue
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


@dataclass(frozen=True)
class Pattern:
    name = "pattern"
    layer: int = dataclasses.field(default=0, kw_only=True)

    # ---- to implement -------------------------------------------------------------------
    def _rule(self, i: torch.Tensor, j: torch.Tensor, head: int) -> torch.Tensor:
        """Element rule for j <= i (causality and the diagonal are added by `allowed`)."""
        raise NotImplementedError

    def key_ranges(self, q0: int, q1: int, head: int = 0) -> Ranges:
        raise NotImplementedError

    def oldest_key(self, t: int, head: int = 0) -> int:
        """Smallest key position any query >= t may read, ignoring `kept_keys`."""
        return 0

    def kept_keys(self, t: int, n: int, head: int = 0) -> list[int]:
        """Key positions < oldest_key(t) that some query in [t, n) may read (sinks, random edges)."""
        return []

    heads_differ = False  # True when the rule depends on the head (random edges, strided)
    is_diffusion = False

    # ---- shared -------------------------------------------------------------------------
    def for_layer(self, layer: int) -> "Pattern":
        return dataclasses.replace(self, layer=layer)

    def allowed(self, i: torch.Tensor, j: torch.Tensor, head: int = 0) -> torch.Tensor:
        i, j = torch.broadcast_tensors(torch.as_tensor(i), torch.as_tensor(j))
        return (i == j) | ((j < i) & (j >= 0) & self._rule(i, j, head))

    def mask(self, n: int, head: int = 0, device=None) -> torch.Tensor:
        idx = torch.arange(n, device=device)
        return self.allowed(idx[:, None], idx[None, :], head)

    def params(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("layer")
        return {"kind": self.name, **d}

    @functools.lru_cache(maxsize=64)
    def block_layout(self, n: int, block: int, head: int = 0) -> torch.Tensor:
        """(ceil(n/block), m) long: key blocks each query block touches, ascending, padded with -1."""
        nb = math.ceil(n / block)
        rows = []
        for qb in range(nb):
            q0, q1 = qb * block, min(n, (qb + 1) * block)
            blocks: set[int] = set()
            for a, b in _merge(self.key_ranges(q0, q1, head), q1):
                blocks.update(range(a // block, (b - 1) // block + 1))
            rows.append(sorted(blocks))
        m = max(len(r) for r in rows)
        out = torch.full((nb, m), -1, dtype=torch.long)
        for qb, r in enumerate(rows):
            out[qb, : len(r)] = torch.tensor(r, dtype=torch.long)
        return out

    def retained(self, t: int, n: int, head: int = 0) -> list[int]:
        """Sorted past positions (< t) that some query in [t, n) may still read."""
        lo = self.oldest_key(t, head)
        return sorted({k for k in self.kept_keys(t, n, head) if k < lo} | set(range(lo, t)))

    def random_of(self, qb: int, head: int) -> tuple[int, ...]:
        """Random keys (diffuser) or key blocks (bigbird) drawn for query block qb."""
        return ()

    @functools.lru_cache(maxsize=256)
    def _random_table(self, nqb: int, head: int) -> torch.Tensor:
        """(nqb, r) table of random_of(qb, head), padded with -2 (matches nothing)."""
        rows = [self.random_of(qb, head) for qb in range(nqb)]
        table = torch.full((nqb, max([1] + [len(r) for r in rows])), -2, dtype=torch.long)
        for qb, r in enumerate(rows):
            table[qb, : len(r)] = torch.tensor(r, dtype=torch.long)
        return table

    def _random_hit(self, qb: torch.Tensor, key: torch.Tensor, head: int) -> torch.Tensor:
        """Whether `key` is among the random picks of query block `qb` (broadcast tensors)."""
        nqb = int(qb.max()) + 1 if qb.numel() else 1
        return (self._random_table(nqb, head).to(qb.device)[qb] == key[..., None]).any(-1)


@dataclass(frozen=True)
class Full(Pattern):
    name = "full"

    def _rule(self, i, j, head):
        return torch.ones_like(i, dtype=torch.bool)

    def key_ranges(self, q0, q1, head=0):
        return [(0, q1)]


@dataclass(frozen=True)
class Band(Pattern):
    """Each token reads itself and the previous `window - 1` tokens (i - j < window).

    In the model the input at position t carries token t-1, so the query that predicts token t
    reads exactly the previous `window` tokens. A band narrower than a row does not see the pixel
    above.
    """

    name = "band"
    window: int = 256

    def __post_init__(self):
        if self.window < 1:
            raise ConfigError(f"band window must be >= 1, got {self.window}")

    def _rule(self, i, j, head):
        return i - j < self.window

    def key_ranges(self, q0, q1, head=0):
        return [(q0 - self.window + 1, q1)]

    def oldest_key(self, t, head=0):
        return max(0, t - self.window + 1)


@dataclass(frozen=True)
class Local2D(Pattern):
    """Causal 2-D neighbourhood on a (height, width, channels) raster.

    Query (y, x, c) reads (y', x', c') with y - radius <= y' <= y and |x' - x| <= radius (no
    wrap-around across row ends), all channels of pixels above and to the left, and channels
    c' <= c of its own pixel. In the flattened matrix: one diagonal stripe per row offset.

    `shift` = s moves every key by s positions (query t reads positions p with p - s in its
    neighbourhood, plus p = t). The model uses s = 1: its input at position p carries token p - 1,
    so the query that predicts pixel (y, x, c) then reads exactly the tokens of that pixel's causal
    neighbourhood, including the pixel straight above in the last column.
    """

    name = "local2d"
    height: int = 32
    width: int = 32
    channels: int = 1
    radius: int = 3
    shift: int = 0

    def __post_init__(self):
        if min(self.height, self.width, self.channels) < 1 or self.radius < 0 or self.shift not in (0, 1):
            raise ConfigError(f"local2d needs height, width, channels >= 1, radius >= 0 and shift in (0, 1); got {self}")

    def _coords(self, t):
        p = torch.div(t, self.channels, rounding_mode="floor")
        return torch.div(p, self.width, rounding_mode="floor"), p % self.width

    def _rule(self, i, j, head):
        j = j - self.shift
        yi, xi = self._coords(i)
        yj, xj = self._coords(j.clamp(min=0))
        return (j >= 0) & (j < i) & (yi - yj <= self.radius) & ((xi - xj).abs() <= self.radius)

    def key_ranges(self, q0, q1, head=0):
        row, r, c, s = self.width * self.channels, self.radius, self.channels, self.shift
        return [(q0 - k * row - r * c - c + s, q1 - k * row + r * c + c + s) for k in range(r + 1)]

    def oldest_key(self, t, head=0):
        row = self.width * self.channels
        y = t // row
        x = (t % row) // self.channels
        return max(0, (y - self.radius) * row + max(0, x - self.radius) * self.channels + self.shift)


def _rng(seed: int, layer: int, head: int, qb: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, layer, head, qb])))


@dataclass(frozen=True)
class BigBird(Pattern):
    """Causal BigBird on blocks of `block` tokens.

    Query block b reads key blocks b-window_blocks+1..b (sliding window, current block included),
    blocks 0..global_blocks-1 (sinks) and `random_blocks` distinct random earlier blocks drawn from
    the rest by (seed, layer, head, b). Inside readable blocks the element rule is causal only.
    """

    name = "bigbird"
    block: int = 64
    window_blocks: int = 3
    global_blocks: int = 1
    random_blocks: int = 2
    seed: int = 0
    heads_differ = True

    def __post_init__(self):
        if self.block < 1 or self.window_blocks < 1 or self.global_blocks < 0 or self.random_blocks < 0:
            raise ConfigError(f"bigbird needs block >= 1, window_blocks >= 1, global/random_blocks >= 0; got {self}")

    @functools.lru_cache(maxsize=4096)
    def random_of(self, qb: int, head: int) -> tuple[int, ...]:
        cands = np.arange(self.global_blocks, qb - self.window_blocks + 1)
        if len(cands) == 0 or self.random_blocks == 0:
            return ()
        pick = _rng(self.seed, self.layer, head, qb).choice(cands, size=min(self.random_blocks, len(cands)), replace=False)
        return tuple(sorted(int(x) for x in pick))

    def _rule(self, i, j, head):
        qb = torch.div(i, self.block, rounding_mode="floor")
        kb = torch.div(j, self.block, rounding_mode="floor")
        ok = (qb - kb < self.window_blocks) | (kb < self.global_blocks)
        if self.random_blocks:
            ok = ok | self._random_hit(qb, kb, head)
        return ok

    def key_ranges(self, q0, q1, head=0):
        b = self.block
        out = [(0, self.global_blocks * b)]
        for qb in range(q0 // b, (q1 - 1) // b + 1):
            out.append(((qb - self.window_blocks + 1) * b, (qb + 1) * b))
            out += [(r * b, (r + 1) * b) for r in self.random_of(qb, head)]
        return out

    def oldest_key(self, t, head=0):
        return max(0, (t // self.block - self.window_blocks + 1) * self.block)

    def kept_keys(self, t, n, head=0):
        b = self.block
        keys = set(range(min(t, self.global_blocks * b)))
        for qb in range(t // b, (n - 1) // b + 1):  # random blocks live until their last reader
            for r in self.random_of(qb, head):
                keys.update(range(r * b, min(t, (r + 1) * b)))
        return sorted(keys)


@dataclass(frozen=True)
class Diffuser(Pattern):
    """Diffuser graph: local band of `window` + the first `global_tokens` tokens + `random_edges`
    random earlier keys per query block of `block` tokens (shared by the block's queries, drawn by
    (seed, layer, head, block)). Attention on it is `steps` personalised-PageRank diffusion steps:
    A = row-softmax of the scores on the graph; Z0 = V; Z(k+1) = (1 - alpha) A Z(k) + alpha V.
    """

    name = "diffuser"
    window: int = 64
    global_tokens: int = 16
    random_edges: int = 8
    steps: int = 5
    alpha: float = 0.1
    seed: int = 0
    block: int = 64
    heads_differ = True
    is_diffusion = True

    def __post_init__(self):
        if self.window < 1 or self.global_tokens < 0 or self.random_edges < 0 or self.steps < 1 \
                or not 0.0 <= self.alpha <= 1.0 or self.block < 1:
            raise ConfigError(f"diffuser needs window >= 1, global_tokens >= 0, random_edges >= 0, steps >= 1, "
                              f"0 <= alpha <= 1, block >= 1; got {self}")

    @functools.lru_cache(maxsize=4096)
    def random_of(self, qb: int, head: int) -> tuple[int, ...]:
        hi = qb * self.block
        if hi == 0 or self.random_edges == 0:
            return ()
        pick = _rng(self.seed, self.layer, head, qb).choice(hi, size=min(self.random_edges, hi), replace=False)
        return tuple(sorted(int(x) for x in pick))

    def _rule(self, i, j, head):
        ok = (i - j < self.window) | (j < self.global_tokens)
        if self.random_edges:
            ok = ok | self._random_hit(torch.div(i, self.block, rounding_mode="floor"), j, head)
        return ok

    def key_ranges(self, q0, q1, head=0):
        out = [(0, self.global_tokens), (q0 - self.window + 1, q1)]
        for qb in range(q0 // self.block, (q1 - 1) // self.block + 1):
            out += [(r, r + 1) for r in self.random_of(qb, head)]
        return out

    def oldest_key(self, t, head=0):
        return max(0, t - self.window + 1)

    def kept_keys(self, t, n, head=0):
        keys = set(range(min(t, self.global_tokens)))
        for qb in range(t // self.block, (n - 1) // self.block + 1):
            keys.update(r for r in self.random_of(qb, head) if r < t)
        return sorted(keys)


@dataclass(frozen=True)
class Strided(Pattern):
    """Sparse Transformer's factorised pattern, split across heads: even heads read the previous
    `stride` tokens (i - j < stride); odd heads read every stride-th earlier key
    ((i - (j - shift)) % stride == 0). With stride = row width (W*C) and shift = 1 (the model's
    convention) the odd heads read the whole column above the predicted subpixel.
    """

    name = "strided"
    stride: int = 32
    shift: int = 0
    heads_differ = True

    def __post_init__(self):
        if self.stride < 1 or self.shift not in (0, 1):
            raise ConfigError(f"strided needs stride >= 1 and shift in (0, 1); got {self}")

    def _rule(self, i, j, head):
        if head % 2 == 0:
            return i - j < self.stride
        jj = j - self.shift
        return (jj >= 0) & (jj < i) & ((i - jj) % self.stride == 0)

    def key_ranges(self, q0, q1, head=0):
        if head % 2 == 0:
            return [(q0 - self.stride + 1, q1)]
        s = self.stride
        return [(q0 - k * s + self.shift, q1 - k * s + self.shift) for k in range(q1 // s + 2)] + [(q0, q1)]

    def oldest_key(self, t, head=0):
        return max(0, t - self.stride + 1) if head % 2 == 0 else 0


PATTERNS = {cls.name: cls for cls in (Full, Band, Local2D, BigBird, Diffuser, Strided)}


def make_pattern(kind: str, **params) -> Pattern:
    """Build a pattern by name: full, band, local2d, bigbird, diffuser, strided."""
    if kind not in PATTERNS:
        raise ConfigError(f"unknown attention pattern {kind!r}; choose one of {', '.join(PATTERNS)}")
    cls = PATTERNS[kind]
    names = {f.name for f in dataclasses.fields(cls)}
    bad = sorted(set(params) - names)
    if bad:
        raise ConfigError(f"pattern {kind!r} takes no parameter(s) {bad}; it takes {sorted(names - {'layer'})}")
    return cls(**params)
