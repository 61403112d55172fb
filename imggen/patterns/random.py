"""Patterns with seeded random edges: causal BigBird blocks and the Diffuser graph."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from .base import KernelRule, KernelSpec, Pattern, param, random_hit, random_table, rng

SEED = "seed of the random edges of bigbird / diffuser"
BLOCK = "bigbird/diffuser block size in tokens (default 32 or 64; the GPU kernels take 16..128)"


def default_block(width: int, channels: int) -> int:
    return 32 if width * channels < 64 else 64


class _RandomEdges(Pattern):
    """Shared by patterns whose rule reads a random table: (heads, query blocks, R)."""

    heads_differ = True
    random_width = 0  # R

    def lookup_tables(self, n, heads):
        return {"random": self._table(-(-n // self.block), heads)}

    @functools.lru_cache(maxsize=64)
    def _table(self, nqb: int, heads: int) -> torch.Tensor:
        return random_table(self, nqb, heads, self.random_width)

    def _random_hit(self, qb, key, head, tables):
        if tables is None:
            tables = {"random": self._table(int(qb.max()) + 1, int(torch.as_tensor(head).max()) + 1)}
        table = tables["random"].to(qb.device)
        return random_hit(table, qb, key, head)

    def _random_last(self, n: int, head: int, per_block: bool) -> np.ndarray:
        """Last query (< n) whose block drew each key (or key block), -1 if none."""
        b = self.block
        size = -(-n // b) if per_block else n
        last = np.full(size, -1, dtype=np.int64)
        for qb in range(-(-n // b)):
            for r in self.random_of(qb, head):
                if r < size:
                    last[r] = max(last[r], min(n - 1, (qb + 1) * b - 1))
        return last


@dataclass(frozen=True)
class BigBird(_RandomEdges):
    """Causal BigBird on blocks of `block` tokens.

    Query block b reads key blocks b-window_blocks+1..b (sliding window, current block included),
    blocks 0..global_blocks-1 (sinks) and `random_blocks` distinct random earlier blocks drawn from
    the rest by (seed, layer, head, b). Inside readable blocks the element rule is causal only.
    """

    name = "bigbird"
    block: int = param(64, BLOCK, auto=True, low=1)
    window_blocks: int = param(3, "bigbird sliding-window blocks (current block included)", low=1)
    global_blocks: int = param(1, "bigbird global (sink) blocks", low=0)
    random_blocks: int = param(2, "bigbird random blocks per query block", low=0)
    seed: int = param(0, SEED, config="pattern_seed", low=0)

    @property
    def random_width(self):
        return self.random_blocks

    @classmethod
    def image_defaults(cls, height, width, channels):
        return {"block": default_block(width, channels)}

    @functools.lru_cache(maxsize=4096)
    def random_of(self, qb, head):
        cands = np.arange(self.global_blocks, qb - self.window_blocks + 1)
        if len(cands) == 0 or self.random_blocks == 0:
            return ()
        pick = rng(self.seed, self.layer, head, qb).choice(cands, size=min(self.random_blocks, len(cands)),
                                                           replace=False)
        return tuple(sorted(int(x) for x in pick))

    def rule(self, i, j, head, tables=None):
        qb = torch.div(i, self.block, rounding_mode="floor")
        kb = torch.div(j, self.block, rounding_mode="floor")
        ok = (qb - kb < self.window_blocks) | (kb < self.global_blocks)
        return ok | self._random_hit(qb, kb, head, tables) if self.random_blocks else ok

    def key_ranges(self, q0, q1, head=0):
        b = self.block
        out = [(0, self.global_blocks * b)]
        for qb in range(q0 // b, (q1 - 1) // b + 1):
            out.append(((qb - self.window_blocks + 1) * b, (qb + 1) * b))
            out += [(r * b, (r + 1) * b) for r in self.random_of(qb, head)]
        return out

    def last_read(self, n, head=0):
        b = self.block
        kb = np.arange(n, dtype=np.int64) // b
        last = np.where(kb < self.global_blocks, n - 1, (kb + self.window_blocks) * b - 1)
        last = np.maximum(last, self._random_last(n, head, per_block=True)[kb])
        return np.maximum(np.minimum(last, n - 1), np.arange(n))

    def kernel_spec(self, tile):
        if tile != self.block:
            return KernelSpec()  # per-block element masks
        return KernelSpec(KernelRule.CAUSAL)  # the block layout is exact; only the diagonal block is causal


@dataclass(frozen=True)
class Diffuser(_RandomEdges):
    """Diffuser graph: local band of `window` + the first `global_tokens` tokens + `random_edges`
    random earlier keys per query block of `block` tokens (shared by the block's queries, drawn by
    (seed, layer, head, block)). Attention on it is `steps` personalised-PageRank diffusion steps:
    A = row-softmax of the scores on the graph; Z0 = V; Z(k+1) = (1 - alpha) A Z(k) + alpha V.
    """

    name = "diffuser"
    is_diffusion = True
    window: int = param(64, "band/diffuser window in tokens (default: two rows for band, one for diffuser)",
                        auto=True, low=1)
    global_tokens: int = param(16, "diffuser global (sink) tokens (default: one row)", auto=True, low=0)
    random_edges: int = param(8, "diffuser random keys per query block", low=0)
    steps: int = param(5, "diffuser diffusion steps K", config="diffusion_steps", low=1)
    alpha: float = param(0.1, "diffuser restart probability alpha", low=0.0, high=1.0)
    seed: int = param(0, SEED, config="pattern_seed", low=0)
    block: int = param(64, BLOCK, auto=True, low=1)

    @property
    def random_width(self):
        return self.random_edges

    @classmethod
    def image_defaults(cls, height, width, channels):
        row = width * channels
        return {"window": row, "global_tokens": row, "block": default_block(width, channels)}

    @functools.lru_cache(maxsize=4096)
    def random_of(self, qb, head):
        hi = qb * self.block
        if hi == 0 or self.random_edges == 0:
            return ()
        pick = rng(self.seed, self.layer, head, qb).choice(hi, size=min(self.random_edges, hi), replace=False)
        return tuple(sorted(int(x) for x in pick))

    def rule(self, i, j, head, tables=None):
        ok = (i - j < self.window) | (j < self.global_tokens)
        if self.random_edges:
            ok = ok | self._random_hit(torch.div(i, self.block, rounding_mode="floor"), j, head, tables)
        return ok

    def key_ranges(self, q0, q1, head=0):
        out = [(0, self.global_tokens), (q0 - self.window + 1, q1)]
        for qb in range(q0 // self.block, (q1 - 1) // self.block + 1):
            out += [(r, r + 1) for r in self.random_of(qb, head)]
        return out

    def last_read(self, n, head=0):
        j = np.arange(n, dtype=np.int64)
        last = np.where(j < self.global_tokens, n - 1, j + self.window - 1)
        last = np.maximum(last, self._random_last(n, head, per_block=False))
        return np.maximum(np.minimum(last, n - 1), j)

    def kernel_spec(self, tile):
        if tile != self.block:  # the random keys are drawn per block of `block` queries
            return KernelSpec()
        return KernelSpec(KernelRule.DIFFUSER, window=self.window, global_tokens=self.global_tokens,
                          random_keys=self.random_edges)
