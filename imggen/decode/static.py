"""Static decode steps: the caches driven by a position held on the device (issue 48).

`Cache.attend` takes the position t as a Python int: its slot, its read plan and its mask come from
host-side tables, so every step is a new sequence of launches and a CUDA graph cannot replay it.
`StaticCache` drives the same buffers (the same slots, positions, k, v and diffusion states, at the
same addresses) from a position tensor t of shape (1,) on the cache's device:
* the slot of t is `plan.slots` indexed on the device;
* query t reads every slot, under the mask `pattern.allowed(t, positions)` computed on the device
  (the exact read set of the eager step, as an additive bias over the whole ring or interval
  layout: more keys per step than a gathered read plan, none of them readable that should not be);
* nothing depends on t on the host: no sync, no Python branch (tests: "static_step").

So a step built from these caches can be captured once and replayed per token (imggen.graphs), and
the eager caches' `prefill` and `extend` still work on the same buffers between replays. May
import what imggen.decode may.
"""
from __future__ import annotations

import torch

from imggen.attention import decode_attention
from imggen.attention.blocked import additive_mask


class StaticCache:
    """`cache` (an imggen.decode.Cache) stepped by a device position."""

    def __init__(self, cache):
        self.cache = cache
        dev = cache.k.device
        self.slots = torch.as_tensor(cache.plan.slots, dtype=torch.long, device=dev)
        self.head = torch.arange(cache.pattern.head_count(cache.heads), device=dev)[:, None]  # (HL, 1)

    def reset(self) -> None:
        """Empty, in place (the buffers keep their addresses)."""
        c = self.cache
        c.positions.fill_(-1)
        for buf in (c.k, c.v, *(() if c.z is None else (c.z,))):
            buf.zero_()
        c.reads = None

    def attend(self, q, k, v, t: torch.Tensor) -> torch.Tensor:
        """Store position t's k, v (B, H, D) in its slot and return its attention output (B, H, D);
        t: long (1,) on the device. Equal to `Cache.attend(q, k, v, int(t))`."""
        c = self.cache
        slot = self.slots.index_select(0, t)
        c.k.index_copy_(2, slot, k[:, :, None].to(c.k.dtype))
        c.v.index_copy_(2, slot, v[:, :, None].to(c.v.dtype))
        c.positions.index_copy_(0, slot, t)
        pos = c.positions[None, :]
        ok = c.pattern.allowed(t[:, None], pos, self.head, c.tables) & (pos >= 0) & (pos <= t[:, None])
        bias = c._per_head(additive_mask(ok, q.dtype))  # (H or 1, capacity)
        if c.z is None:
            return decode_attention(q, c.k, c.v, bias)
        return c.diffuse(q, v, lambda buf, z: buf.index_copy_(2, slot, z[:, :, None].to(buf.dtype)),
                         lambda buf: buf, bias)  # every slot read, under the bias


class StaticGroupCache:
    """A GroupCache (head groups, strided) stepped by a device position: one StaticCache per group."""

    def __init__(self, cache):
        dev = cache.caches[0].k.device
        self.cache = cache
        self.groups = [torch.as_tensor(idx, dtype=torch.long, device=dev) for idx in cache.groups]
        self.parts = [StaticCache(c) for c in cache.caches]

    def reset(self) -> None:
        for p in self.parts:
            p.reset()

    def attend(self, q, k, v, t):
        out = torch.empty_like(q)
        for idx, part in zip(self.groups, self.parts):
            out.index_copy_(1, idx, part.attend(q.index_select(1, idx), k.index_select(1, idx),
                                                v.index_select(1, idx), t))
        return out


def static_caches(caches) -> list:
    """The static view of each layer's cache of `caches` (imggen.decode.make_caches)."""
    return [StaticGroupCache(c) if hasattr(c, "groups") else StaticCache(c) for c in caches]
