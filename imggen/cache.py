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

from imggen.errors import ShapeError
from imggen.patterns import Pattern
from imggen.sparse_attention import diffusion_states


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

    def slots_of(self, positions: torch.Tensor) -> torch.Tensor:
        """Vectorised `slot_for` over a LongTensor of positions."""
        return positions

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
        bias = self.key_bias(t)
        if self.z is None:
            return decode_attention(q, self.k, self.v, bias, self.scale)
        return self._diffuse(q, v, slot, self.capacity, bias)

    def _diffuse(self, q, v, slot: int, hi: int, bias) -> torch.Tensor:
        """Diffuser decode: A = softmax row of query t over slots [0, hi); Z0 = V; K steps.

        Stores Z1..Z(K-1) of position t in `slot` so that later queries can read them.
        """
        p = self.pattern
        a = decode_probs(q, self.k[:, :, :hi], bias, self.scale)  # (B, H, 1, hi)
        z_prev = self.v[:, :, :hi]  # Z0 = V over every held slot, including slot t
        for step in range(1, p.steps + 1):
            z = (1 - p.alpha) * torch.matmul(a, z_prev)[:, :, 0] + p.alpha * v
            if step < p.steps:
                self.z[step - 1][:, :, slot] = z
                z_prev = self.z[step - 1][:, :, :hi]
        return z

    # -- prefill --------------------------------------------------------------------------------
    def prefill(self, q, k, v) -> None:
        """Fill from a parallel forward over positions 0..n0-1 (k, v: (B, H, n0, D)).

        Only the positions some query >= n0 may still read (`retained_after`) are written, each to
        the slot the decode path would have given it, in one indexed copy per buffer.
        """
        n0 = k.shape[2]
        pos = self.retained_after(n0).to(self.positions.device)
        slots = self.slots_of(pos)
        self._check_prefill(n0, pos, slots)
        self.k[:, :, slots] = k[:, :, pos].to(self.k.dtype)
        self.v[:, :, slots] = v[:, :, pos].to(self.v.dtype)
        self.positions[slots] = pos
        if self.z is not None:
            for s, z in enumerate(diffusion_states(q, k, v, self.pattern)):
                self.z[s][:, :, slots] = z[:, :, pos].to(self.z.dtype)

    def retained_after(self, n0: int) -> torch.Tensor:
        """LongTensor of the positions < n0 that the cache holds after a prefill of n0 tokens."""
        return torch.arange(n0)

    def _check_prefill(self, n0, pos, slots) -> None:
        """Debug hook of the eviction caches."""


_KERNEL = None


def _decode_kernel():
    """imggen.kernels.decode_attention when it imports (CUDA), else None (PyTorch path)."""
    global _KERNEL
    if _KERNEL is None:
        try:
            from imggen.kernels import decode_attention as kernel
            _KERNEL = kernel
        except (ImportError, AttributeError):
            _KERNEL = False
    return _KERNEL or None


def decode_probs(q, k, bias, scale: float) -> torch.Tensor:
    """Softmax row of one query per (batch, head): q (B, H, D), k (B, H, L, D) -> (B, H, 1, L)."""
    s = torch.matmul(q.unsqueeze(2), k.transpose(-1, -2)) * scale
    if bias is not None:
        s = s + bias.unsqueeze(-2)
    return torch.softmax(s, dim=-1)


def decode_attention(q, k, v, bias, scale: float) -> torch.Tensor:
    """One query against held slots: q (B, H, D), k/v (B, H, L, D), bias None or additive 0/-inf
    broadcastable to (H, L) -> (B, H, D). Triton decode kernel on CUDA when available."""
    if q.is_cuda:
        kernel = _decode_kernel()
        if kernel is not None:
            kb = torch.zeros((1, 1, k.shape[2]), device=q.device, dtype=q.dtype) if bias is None else \
                bias.reshape(1, -1, k.shape[2]).to(q.dtype)
            try:
                return kernel(q, k, v, kb)
            except ShapeError:  # a dtype / head dim the kernel does not cover: PyTorch path
                pass
    return torch.matmul(decode_probs(q, k, bias, scale), v)[:, :, 0]


def make_caches(model, batch: int, cache: str = "full", device=None, dtype=None) -> list[KVCache]:
    """One cache per layer. cache='full' keeps everything (baseline); anything else ('evict') uses
    the memory-bounded cache each layer's pattern implies (imggen.eviction)."""
    cfg = model.config
    device = device or next(model.parameters()).device
    dtype = dtype or next(model.parameters()).dtype
    if cache != "full":
        from imggen.eviction import make_eviction_cache  # eviction caches (issue: decode)
        return [make_eviction_cache(p, batch, cfg.heads, cfg.dim // cfg.heads, cfg.seq_len, device, dtype)
                for p in model.patterns]
    return [KVCache(p, batch, cfg.heads, cfg.dim // cfg.heads, cfg.seq_len, device, dtype)
            for p in model.patterns]
