"""Decode-cache plans: which slot each position takes (`slot_plan`) and which slots each query
reads (`read_plan`), computed from the pattern object alone. imggen.decode's caches follow them;
native.c resolves a step's slot and read set from the same arrays."""
from __future__ import annotations

import functools
import heapq
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from imggen.attention.blocked import additive_mask
from imggen.errors import ConfigError
from imggen.patterns import Pattern


@dataclass(frozen=True)
class SlotPlan:
    capacity: int
    slots: np.ndarray  # (n,) slot of each position
    hi: np.ndarray     # (n,) slots [0, hi[t]) may hold something at step t
    last: np.ndarray   # (n,) last_reads of the pattern


@functools.lru_cache(maxsize=64)
def slot_plan(pattern: Pattern, n: int, heads: int, policy: str) -> SlotPlan:
    last = pattern.last_reads(n, heads)
    t = np.arange(n, dtype=np.int64)
    if policy == "all":
        return SlotPlan(n, t, t + 1, last)
    if policy == "ring":
        cap = int((last - t).max()) + 1
        return SlotPlan(cap, t % cap, np.minimum(t + 1, cap), last)
    if policy != "interval":
        raise ConfigError(f"slot_policy={policy!r}: unknown decode slot policy; choose one of all, ring, interval")
    # position t takes a slot freed by some j with last[j] < t (FIFO: a pure window becomes a ring)
    slots, hi = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
    live: list[tuple[int, int]] = []
    free: deque[int] = deque()
    used = 0
    for i in range(n):
        while live and live[0][0] < i:
            free.append(heapq.heappop(live)[1])
        if free:
            s = free.popleft()
        else:
            s, used = used, used + 1
        slots[i], hi[i] = s, used
        heapq.heappush(live, (int(last[i]), s))
    return SlotPlan(used, slots, hi, last)


def true_last_reads(pattern: Pattern, n: int, heads: int) -> np.ndarray:
    """`last_reads` from the definition (`pattern.mask`); O(n^2), for tests and debug mode."""
    m = pattern.masks(n, heads).any(0)
    rows = torch.arange(n)[:, None].expand(n, n)
    return rows.masked_fill(~m, -1).max(0).values.numpy().astype(np.int64)


@dataclass(frozen=True)
class ReadPlan:
    """What queries t0 <= t < t1 read: `index` (t1-t0, HL, K) slots (the readable held positions,
    padded with slot 0 under a -inf bias) or None = every slot [0, capacity); `bias`
    (t1-t0, HL, K or capacity) additive 0 / -inf."""
    t0: int
    t1: int
    index: torch.Tensor | None
    bias: torch.Tensor

    def nbytes(self) -> int:
        return sum(x.numel() * x.element_size() for x in (self.index, self.bias) if x is not None)

    def to(self, device, dtype) -> "ReadPlan":
        return ReadPlan(self.t0, self.t1, None if self.index is None else self.index.to(device),
                        self.bias.to(device, dtype))


GATHER_FRACTION = 0.5   # gather the readable slots when they are at most this part of the cache
PLAN_STEPS = 1024       # steps per read plan at most: its memory is bounded, whatever the image size
MIN_PLAN_STEPS = 16     # ... and at least (unless PLAN_STEPS is smaller)
EXTEND_BYTES = 8 << 20  # attention scores of one Cache.extend part at most


def read_plan(pattern: Pattern, n: int, heads: int, plan: SlotPlan, t0: int, t1: int, tables) -> ReadPlan:
    """The exact read sets of steps [t0, t1), from the positions each slot holds after step t."""
    cap, hl = plan.capacity, pattern.head_count(heads)
    held = np.full(cap, -1, dtype=np.int64)  # the newest position < t0 in each slot
    np.maximum.at(held, plan.slots[:t0], np.arange(t0))
    t = torch.arange(t0, t1)
    pos = torch.full((len(t), cap), -1, dtype=torch.long)
    pos[t - t0, torch.from_numpy(plan.slots[t0:t1])] = t
    pos = torch.cummax(torch.cat([torch.from_numpy(held)[None], pos]), 0).values[1:]
    h = torch.arange(hl)[None, :, None]
    ok = pattern.allowed(t[:, None, None], pos[:, None, :], h, tables) & (pos >= 0)[:, None, :]  # (T, HL, cap)
    k = int(ok.sum(-1).max())
    if k > GATHER_FRACTION * cap:
        return ReadPlan(t0, t1, None, additive_mask(ok))
    order = torch.sort((~ok).to(torch.int8), dim=-1, stable=True).indices[..., :k]  # readable slots first
    sel = torch.gather(ok, -1, order)
    return ReadPlan(t0, t1, order.masked_fill(~sel, 0), additive_mask(sel))
