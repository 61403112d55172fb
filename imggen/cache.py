"""Per-layer decode caches.

A cache holds keys, values (and, for diffuser layers, the diffusion states Z1..Z(K-1)) in
preallocated slots updated in place. `positions[slot]` records which token position a slot holds
(-1 = empty); the query at t reads every held position the pattern allows, so a cache only decides
*which slot* a position goes to and *when* a slot may be reused.

`KVCache` is the plain baseline: one slot per position, nothing evicted.
"""
from __future__ import annotations

import math

import torch

from imggen.patterns import Pattern


class KVCache:
    def __init__(self, pattern: Pattern, batch: int, heads: int, head_dim: int, n: int,
                 device=None, dtype=torch.float32, capacity: int | None = None):
        self.pattern, self.batch, self.heads, self.n = pattern, batch, heads, n
        self.capacity = capacity or n
        shape = (batch, heads, self.capacity, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.z = (torch.zeros((pattern.steps - 1, *shape), device=device, dtype=dtype)
                  if pattern.is_diffusion else None)
        self.positions = torch.full((self.capacity,), -1, dtype=torch.long, device=device)
        self.scale = 1.0 / math.sqrt(head_dim)

    # -- slot policy (overridden by eviction caches) ----------------------------------------
    def slot_for(self, t: int) -> int:
        return t

    def nbytes(self) -> int:
        bufs = [self.k, self.v, self.positions] + ([self.z] if self.z is not None else [])
        return sum(b.numel() * b.element_size() for b in bufs)

    # -- reading ------------------------------------------------------------------------------
    def key_bias(self, t: int) -> torch.Tensor:
        """(H or 1, capacity) additive bias: 0 where query t may read the slot, -inf elsewhere."""
        pos = self.positions
        heads = range(self.heads) if self.pattern.heads_differ else range(1)
        ok = torch.stack([self.pattern.allowed(torch.tensor(t, device=pos.device), pos, h) for h in heads])
        ok &= (pos >= 0) & (pos <= t)
        return torch.zeros(ok.shape, device=pos.device, dtype=self.k.dtype).masked_fill_(~ok, float("-inf"))

    def _write(self, slot, t, k, v):
        self.k[:, :, slot] = k
        self.v[:, :, slot] = v
        self.positions[slot] = t

    def attend(self, q, k, v, t: int) -> torch.Tensor:
        """Store position t's k, v and return its attention output (B, H, D)."""
        slot = self.slot_for(t)
        self._write(slot, t, k, v)
        s = torch.einsum("bhd,bhld->bhl", q, self.k) * self.scale + self.key_bias(t)
        a = torch.softmax(s, dim=-1)
        if self.z is None:
            return torch.einsum("bhl,bhld->bhd", a, self.v)
        p = self.pattern
        z_prev = self.v  # Z0 = V over every held slot, including slot t
        for step in range(1, p.steps + 1):
            z = (1 - p.alpha) * torch.einsum("bhl,bhld->bhd", a, z_prev) + p.alpha * v
            if step < p.steps:
                self.z[step - 1][:, :, slot] = z
                z_prev = self.z[step - 1]
        return z

    # -- prefill --------------------------------------------------------------------------------
    def prefill(self, q, k, v) -> None:
        """Fill from a parallel forward over positions 0..n0-1 (k, v: (B, H, n0, D))."""
        n0 = k.shape[2]
        zs = _diffusion_states(q, k, v, self.pattern) if self.z is not None else []
        for t in self.retained_after(n0):
            slot = self.slot_for(t)
            self._write(slot, t, k[:, :, t], v[:, :, t])
            for s, z in enumerate(zs):
                self.z[s][:, :, slot] = z[:, :, t]

    def retained_after(self, n0: int) -> list[int]:
        return list(range(n0))


def _diffusion_states(q, k, v, pattern) -> list[torch.Tensor]:
    """Z1..Z(K-1) of a diffuser layer for every position (blocked, no n x n tensor)."""
    from imggen.sparse_attention import DEFAULT_BLOCK, blocked_probs

    b, h, n, d = q.shape
    p, gather = blocked_probs(q.float(), k.float(), pattern, DEFAULT_BLOCK)
    z, out = v.float(), []
    for _ in range(pattern.steps - 1):
        az = (p @ gather(z)).reshape(b, h, -1, d)[:, :, :n]
        z = (1 - pattern.alpha) * az + pattern.alpha * v.float()
        out.append(z.to(v.dtype))
    return out


def make_caches(model, batch: int, cache: str = "full", device=None, dtype=None) -> list[KVCache]:
    """One cache per layer. cache='full' keeps everything (baseline)."""
    cfg = model.config
    device = device or next(model.parameters()).device
    dtype = dtype or next(model.parameters()).dtype
    if cache != "full":
        from imggen.eviction import make_eviction_cache  # eviction caches (issue: decode)
        return [make_eviction_cache(p, batch, cfg.heads, cfg.dim // cfg.heads, cfg.seq_len, device, dtype)
                for p in model.patterns]
    return [KVCache(p, batch, cfg.heads, cfg.dim // cfg.heads, cfg.seq_len, device, dtype)
            for p in model.patterns]
