"""Decode caches: one per layer, holding what the layer's future queries may still read.

A cache keeps keys, values (and, for diffuser layers, the diffusion states Z1..Z(K-1)) in
preallocated slots updated in place; `positions[slot]` records which token position a slot holds
(-1 = empty). Everything pattern-specific comes from the pattern object:
* which slot position t takes (`pattern.slot_policy`, from `pattern.last_reads`):
  - "ring": slot t % L with L = max_j (last_read[j] - j) + 1 (band: the window; local2d: r rows
    and r + 1 pixels), so reusing a slot only evicts a position whose last reader has passed;
  - "interval": interval allocation over last_read, planned once per (pattern, n) (bigbird,
    diffuser: sinks and random keys stay until their last reader);
  - "all": one slot per position (full, column heads); `keep_all=True` gives any pattern this
    full-cache baseline with the same code;
  - never more than that baseline: where a ring or interval layout would take more bytes than
    keeping everything (its slots + slot plan + read plan; e.g. bigbird on short sequences, whose
    window, sinks and random blocks cover nearly every position) the cache keeps everything
    (`NEVER_LARGER`); slot buffers never exceed the sequence length in any layout;
* what query t reads: every held slot when all are readable (a band ring); else a `ReadPlan`
  computed from `pattern.allowed` for the next steps at once (as many as fit in the bytes of the
  cache's own k and v, at most PLAN_STEPS): the exact readable slots,
  gathered (local2d reads ~(r+1)(2r+1) of its r*W+r+1 slots; column heads their column), or all
  slots under a mask; `pattern.read_mask` per step only for the keep-all baseline;
* runs of known positions (inpainting): `extend` takes positions t0..t0+m-1 in one call, each
  query reading the held slots and the new positions its pattern allows, and leaves the cache as m
  decode steps would;
* head groups (strided): one cache per group of heads.
Debug mode (`IMGGEN_CACHE_DEBUG=1` or `imggen.decode.DEBUG = True`) checks `last_reads` against
`pattern.mask`, every slot reuse, and that no query reads an evicted position.

The package: the caches (this module), their slot and read plans (`plans`), the weight panels of
one-token linears (`panels`) and the native C step kernels (`native`, `native.c`). May import:
imggen.attention, imggen.patterns and the base modules; the model and sampling import it, never the
reverse (tests/test_layout.py: LAYERS).
"""
from __future__ import annotations

import os

import numpy as np
import torch

from imggen.decode import native
# one query against a cache: the reference and the Triton kernel's dispatch live with attention's
from imggen.attention import (attention_probs, decode_attention, decode_attention_reference,  # noqa: F401
                              decode_probs, decode_selfcheck)
from imggen.attention.blocked import additive_mask
from imggen.errors import ConfigError
from imggen.patterns import Pattern
from imggen.decode.plans import (EXTEND_BYTES, MIN_PLAN_STEPS, PLAN_STEPS, ReadPlan, SlotPlan,  # noqa: F401 - see plans
                          read_plan, slot_plan, true_last_reads)

DEBUG = os.environ.get("IMGGEN_CACHE_DEBUG", "") not in ("", "0")
CACHE_KINDS = ("evict", "full", "auto")  # make_caches: memory-bounded, keep everything, the default (evict)
# an evicting cache whose layout (slots + slot plan + read plan) would take more bytes than keeping
# every position uses the keep-all layout instead (tests turn this off to exercise eviction on tiny models)
NEVER_LARGER = True


# ------------------------------------------------------------------------------------ caches
class Cache:
    def __init__(self, pattern: Pattern, batch: int, heads: int, head_dim: int, n: int, device=None,
                 dtype=torch.float32, keep_all: bool = False):
        self.pattern, self.batch, self.heads, self.n = pattern, batch, heads, n
        self.tables = {k: t.to(device) for k, t in pattern.lookup_tables(n, heads).items()}
        es = torch.empty((), dtype=dtype).element_size()
        self._layout("all" if keep_all else pattern.slot_policy, keep_all, batch, head_dim, es)
        full = self._buffer_nbytes(n, batch, head_dim, es)  # what the keep-all cache takes
        if NEVER_LARGER and not keep_all and self.policy != "all" and self._larger_than(full, batch, head_dim, es):
            # eviction saves nothing here (e.g. short sequences, where bigbird's window, sinks and
            # random blocks cover nearly every position) and its slot and read plans would make the
            # cache larger than keeping everything: keep everything, never more than the full cache
            self._layout("all", True, batch, head_dim, es)
        self.keep_all = self.policy == "all" and not self.planned  # the keep-all layout, asked for or chosen
        cap = self.capacity
        shape = (batch, heads, cap, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.z = torch.zeros((pattern.steps - 1, *shape), device=device, dtype=dtype) if pattern.is_diffusion else None
        self.positions = torch.full((cap,), -1, dtype=torch.long, device=device)
        self._slots, self._hi = self.plan.slots.tolist(), self.plan.hi.tolist()
        self.reads: ReadPlan | None = None
        self.debug = DEBUG
        # whether steps go through imggen.decode.native (begin(), then its kernel stores k, v and attends):
        # float32 on CPU, not diffusion, not debugging; else the PyTorch path
        self.fused = self.k.device.type == "cpu" and dtype == torch.float32 and self.z is None \
            and not self.debug and native.available()
        if self.debug:
            self._true_last = true_last_reads(pattern, n, heads)
            bad = np.nonzero(self.plan.last < self._true_last)[0]
            assert len(bad) == 0, f"{pattern.name}: last_reads underestimates keys {bad[:10].tolist()}"
            self._must_hold = pattern.masks(n, heads).any(0)

    def _layout(self, policy: str, keep_all: bool, batch: int, head_dim: int, es: int) -> None:
        """Slot plan, capacity and read mode of `policy`; keep_all: the keep-all baseline (policy
        "all", masks per step, no read plans)."""
        pattern, heads = self.pattern, self.heads
        self.policy = policy
        self.plan = slot_plan(pattern, self.n, heads, policy)
        self.capacity = cap = self.plan.capacity
        band = pattern.band()
        # a ring no longer than a band of period 1 holds only positions its query may read
        self.unmasked = policy == "ring" and band is not None and band.period == 1 and cap <= band.width
        self.planned = not (self.unmasked or keep_all)  # read plans (else: all slots, or masks per step)
        # a read plan costs up to (index + bias) bytes per step, head table and slot: hold no more
        # steps than fit in the bytes of k and v, so the plan never outweighs the cache it reads
        per_step = pattern.head_count(heads) * cap * (8 + es)
        self.plan_steps = min(PLAN_STEPS, max(MIN_PLAN_STEPS, 2 * batch * heads * cap * head_dim * es // per_step))
        self._reads_nbytes: int | None = None

    def _buffer_nbytes(self, cap: int, batch: int, head_dim: int, es: int) -> int:
        """k, v (+ Z1..Z(K-1)) of `cap` slots and their positions."""
        n_bufs = 2 + (self.pattern.steps - 1 if self.pattern.is_diffusion else 0)
        return n_bufs * batch * self.heads * cap * head_dim * es + cap * 8

    def _larger_than(self, limit: int, batch: int, head_dim: int, es: int) -> bool:
        """Whether `nbytes` of the current layout would exceed `limit` (decided before any buffer
        exists; the first read plan is built only when its upper bound does not decide)."""
        fixed = self._buffer_nbytes(self.capacity, batch, head_dim, es) + self._plan_nbytes()
        if fixed > limit or not self.planned:
            return fixed > limit
        bound = min(self.n, self.plan_steps) * self.pattern.head_count(self.heads) * self.capacity * (8 + 4)
        return fixed + bound > limit and fixed + self._first_reads_nbytes() > limit

    def _plan_nbytes(self) -> int:
        """The slot plan of an interval allocation (slots, hi, last: 8 bytes per position each)."""
        return 0 if self.policy != "interval" else 3 * self.n * 8

    def _first_reads_nbytes(self) -> int:
        """Bytes of the read plan of the first `plan_steps` steps (computed once)."""
        if self._reads_nbytes is None:
            self._reads_nbytes = read_plan(self.pattern, self.n, self.heads, self.plan, 0,
                                           min(self.n, self.plan_steps), self.tables).nbytes()
        return self._reads_nbytes

    def nbytes(self) -> int:
        """k, v (+ z) and positions buffers, the slot plan (8 bytes per position and table, interval
        plans) and one read plan (the first `plan_steps` steps). A ring or interval layout is never
        more than the keep-all cache of the same pattern and length (one that would be is not
        used); a pattern whose own policy is "all" (column heads) adds its read plan to the same slots."""
        bufs = [self.k, self.v, self.positions] + ([self.z] if self.z is not None else [])
        reads = self._first_reads_nbytes() if self.planned else 0
        return sum(b.numel() * b.element_size() for b in bufs) + self._plan_nbytes() + reads

    def key_bias(self, t: int, hi: int):
        """Additive (HL, hi) bias of query t over slots [0, hi), or None when all are readable."""
        if self.unmasked and not self.debug:
            return None
        ok = self.pattern.read_mask(t, self.positions[:hi], self.heads, self.tables) & (self.positions[:hi] <= t)
        if self.unmasked:
            assert bool(ok.all()), f"{self.pattern.name}: ring holds a position query {t} may not read"
            return None
        return additive_mask(ok, self.k.dtype)

    def begin(self, t: int):
        """Position t enters its slot: (slot, hi, index, bias) with `_spec`'s (hi, index, bias)."""
        slot = self._slots[t]
        if self.debug:
            self._check_step(slot, t)
        self.positions[slot] = t
        return (slot, *self._spec(t))

    def attend(self, q, k, v, t: int) -> torch.Tensor:
        """Store position t's k, v (B, H, D) and return its attention output (B, H, D)."""
        slot, hi, idx, bias = self.begin(t)
        if self.fused and q.dtype == torch.float32:
            return native.attend(q, self.k, self.v, idx, bias, hi, store=(slot, k, v))  # stores k, v too
        self.k[:, :, slot] = k
        self.v[:, :, slot] = v
        read = self._reader(hi, idx)
        if self.debug:
            self._check_read(t, read, bias)
        if self.z is None:
            return decode_attention(q, read(self.k), read(self.v), bias)
        return self.diffuse(q, v, lambda buf, z: buf[:, :, slot].copy_(z), read, bias)

    def _spec(self, t: int):
        """What query t reads: (hi, index, bias): the slots [0, hi) (index None) or index (1 or H,
        K) slots, with an additive bias over them (1 or H, ...) or None."""
        if self.unmasked:
            return self._hi[t], None, None
        if not self.planned:  # masks computed now: the keep-all baseline
            hi = self._hi[t]
            return hi, None, self._per_head(self.key_bias(t, hi))
        r = self.plan_at(t)
        bias = self._per_head(r.bias[t - r.t0])
        return self.capacity, None if r.index is None else self._per_head(r.index[t - r.t0]), bias

    def plan_at(self, t: int) -> ReadPlan:
        """The read plan that covers step t (built now for steps t.. if the held one does not)."""
        r = self.reads
        if r is None or not r.t0 <= t < r.t1:
            r = self.reads = read_plan(self.pattern, self.n, self.heads, self.plan, t, min(self.n, t + self.plan_steps),
                                       self.tables).to(self.k.device, self.k.dtype)
        return r

    @staticmethod
    def _reader(hi: int, idx):
        """read(buffer) -> the (B, H, L, D) slots of a `_spec`."""
        if idx is None:
            return lambda x: x[:, :, :hi]
        if idx.shape[0] == 1:
            return lambda x: x.index_select(-2, idx[0])
        return lambda x: torch.gather(x, -2, idx[:, :, None].expand(x.shape[0], -1, -1, x.shape[-1]))

    def _per_head(self, per_table):
        """(HL, ...) -> broadcastable to (H, ...) (HL is 1 or H; otherwise tables repeat over heads)."""
        hl = None if per_table is None else per_table.shape[0]
        if hl is None or hl in (1, self.heads):
            return per_table
        return per_table[torch.arange(self.heads, device=per_table.device) % hl]

    def diffuse(self, q, v, store, read, bias) -> torch.Tensor:
        """Diffuser decode: A = softmax row of query t over the slots it reads; Z0 = V; K steps.
        Stores Z1..Z(K-1) of position t in its slot (store(buffer, z): z (B, H, D) into the buffer's
        slot of t) so that later queries can read them."""
        p = self.pattern
        a = decode_probs(q, read(self.k), bias)  # (B, H, 1, L)
        z_prev = read(self.v)  # Z0 = V over the read slots, slot t included
        for step in range(1, p.steps + 1):
            z = (1 - p.alpha) * torch.matmul(a, z_prev)[:, :, 0] + p.alpha * v
            if step < p.steps:
                store(self.z[step - 1], z)
                z_prev = read(self.z[step - 1])
        return z

    def extend(self, q, k, v, t0: int) -> torch.Tensor:
        """Positions t0..t0+m-1 at once (q, k, v: (B, H, m, D)) into a cache that holds what decode
        holds after step t0-1 -> their attention outputs (B, H, m, D), equal to m decode steps'.
        Each query reads the held positions and the new ones its pattern allows (a slot that those
        steps would overwrite holds a position no query from t0 on may read), then the new
        positions are stored in the slots decode gives them. Long runs go in parts of at most
        EXTEND_BYTES of scores, each part reading what the earlier ones stored."""
        b, heads, m, _ = q.shape
        part = PLAN_STEPS
        while part > 1 and q.element_size() * b * heads * part * (self.capacity + part) > EXTEND_BYTES:
            part //= 2
        if m > part:
            return torch.cat([self.extend(q[:, :, i:i + part], k[:, :, i:i + part], v[:, :, i:i + part], t0 + i)
                              for i in range(0, m, part)], dim=2)
        held = self.positions.clone() if self.debug else None
        t = torch.arange(t0, t0 + m, device=self.positions.device)
        h = torch.arange(self.pattern.head_count(heads), device=t.device)[:, None, None]
        ok = self.pattern.allowed(t[None, :, None], torch.cat([self.positions, t])[None, None, :], h, self.tables)
        bias = self._per_head(additive_mask(ok, q.dtype))
        a = attention_probs(q, torch.cat([self.k, k], 2), bias)  # (B, H, m, capacity + m)
        z, states = torch.cat([self.v, v], 2), []
        if self.z is None:
            out = torch.matmul(a, z)
        else:  # diffusion: Z_s = (1 - alpha) A Z_(s-1) + alpha V over the held and the new positions
            p = self.pattern
            for s in range(1, p.steps + 1):
                out = (1 - p.alpha) * torch.matmul(a, z) + p.alpha * v
                if s < p.steps:
                    states.append(out)
                    z = torch.cat([self.z[s - 1], out], 2)
        # store: when the run wraps around a ring, a slot keeps the last position decode writes there
        slots = self.plan.slots[t0:t0 + m]
        keep = m - 1 - np.unique(slots[::-1], return_index=True)[1]
        idx, src = torch.from_numpy(slots[keep]).to(t.device), torch.from_numpy(keep).to(t.device)
        for buf, new in zip([self.k, self.v, *([] if self.z is None else self.z)], [k, v, *states]):
            buf[:, :, idx] = new[:, :, src].to(buf.dtype)
        self.positions[idx] = t[src]
        if self.debug:
            self._check_extend(t0, t0 + m, held)
        return out

    def prefill(self, q, k, v) -> None:
        """Fill from a parallel forward over positions 0..n0-1 (q, k, v: (B, H, n0, D)): only the
        positions some query >= n0 may still read, each to the slot decode would have given it."""
        n0 = k.shape[2]
        pos = torch.arange(n0) if self.keep_all else torch.from_numpy(np.flatnonzero(self.plan.last[:n0] >= n0))
        slots = torch.from_numpy(self.plan.slots[pos.numpy()]).to(self.positions.device)
        pos = pos.to(self.positions.device)
        if self.debug:
            self._check_prefill(n0, pos, slots)
        self.k[:, :, slots] = k[:, :, pos].to(self.k.dtype)
        self.v[:, :, slots] = v[:, :, pos].to(self.v.dtype)
        self.positions[slots] = pos
        if self.z is not None:
            from imggen.attention.blocked import diffusion_states
            for s, z in enumerate(diffusion_states(q, k, v, self.pattern)):
                self.z[s][:, :, slots] = z[:, :, pos].to(self.z.dtype)

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

    def _check_read(self, t: int, read, bias) -> None:
        """The read set equals every held position query t may read (per head)."""
        pos = read(self.positions.view(1, 1, -1, 1).expand(1, self.heads, -1, 1))[0, :, :, 0]  # (H, L)
        ok = torch.ones_like(pos, dtype=torch.bool) if bias is None else (bias.expand(pos.shape) == 0)
        held = self.positions[self.positions >= 0]
        for h in range(self.heads):
            want = held[self.pattern.allowed(torch.tensor(t), held, h)].sort().values
            got = pos[h][ok[h]].sort().values
            assert torch.equal(got, want), f"{self.pattern.name}: query {t} head {h} reads {got.tolist()}, " \
                                           f"should read {want.tolist()}"

    def _check_extend(self, t0: int, t1: int, held) -> None:
        """Queries t0..t1-1 found every earlier position they may read; the cache then holds every
        position a later query may read, in the slot decode gives it."""
        before = set(held.tolist())
        for t in range(t0, t1):
            need = set(torch.nonzero(self._must_hold[t, :t0]).view(-1).tolist())
            assert need <= before, f"{self.pattern.name}: query {t} reads evicted {sorted(need - before)[:10]}"
        live = np.flatnonzero(self._true_last[:t1] >= t1)
        assert (self.positions.cpu()[torch.from_numpy(self.plan.slots[live])].numpy() == live).all(), \
            f"{self.pattern.name}: extend to {t1} lost a position a later query reads"

    def _check_prefill(self, n0, pos, slots) -> None:
        assert bool((self.positions < 0).all()), "prefill into a used cache"
        assert len(set(slots.tolist())) == len(slots), "prefill maps two positions to one slot"
        live = set(np.nonzero(self._true_last[:n0] >= n0)[0].tolist())
        assert live <= set(pos.tolist()), f"prefill drops live positions {sorted(live - set(pos.tolist()))[:10]}"


class GroupCache:
    """Head groups (`pattern.head_groups`): one cache per group, each with its group's pattern."""

    def __init__(self, groups, caches):
        self.groups, self.caches = groups, caches
        self.capacity, self.batch = max(c.capacity for c in caches), caches[0].batch

    def nbytes(self) -> int:
        return sum(c.nbytes() for c in self.caches)

    def attend(self, q, k, v, t):
        out = torch.empty_like(q)
        for idx, c in zip(self.groups, self.caches):
            out[:, idx] = c.attend(q[:, idx], k[:, idx], v[:, idx], t)
        return out

    def extend(self, q, k, v, t0):
        out = torch.empty_like(q)
        for idx, c in zip(self.groups, self.caches):
            out[:, idx] = c.extend(q[:, idx], k[:, idx], v[:, idx], t0)
        return out

    def prefill(self, q, k, v):
        for idx, c in zip(self.groups, self.caches):
            c.prefill(q[:, idx], k[:, idx], v[:, idx])


def make_cache(pattern: Pattern, batch: int, heads: int, head_dim: int, n: int, device=None,
               dtype=torch.float32, keep_all: bool = False):
    """The memory-bounded decode cache of `pattern` (keep_all=True: same code, nothing evicted)."""
    groups = pattern.head_groups(heads)
    if groups:
        return GroupCache([idx for idx, _ in groups],
                          [make_cache(sub.for_layer(pattern.layer), batch, len(idx), head_dim, n, device, dtype, keep_all)
                           for idx, sub in groups])
    return Cache(pattern, batch, heads, head_dim, n, device, dtype, keep_all)


class Caches(list):
    """The caches of one decoding run, one per layer, and what the run packs once (`packed`:
    imggen.decode.panels' weight panels per Linear, and under "large" whether the model uses them)."""

    def __init__(self, caches):
        super().__init__(caches)
        self.packed: dict = {}


def make_caches(model, batch: int, cache: str = "evict", device=None, dtype=None) -> Caches:
    """One cache per layer: 'evict' (memory-bounded, the default) or 'full' (keep everything)."""
    if not isinstance(cache, str) or cache not in CACHE_KINDS:
        raise ConfigError(f"unknown cache kind {cache!r} (argument cache); choose one of {', '.join(CACHE_KINDS)} "
                          f"('auto' = 'evict')")
    cfg = model.config
    device = device or next(model.parameters()).device
    dtype = dtype or next(model.parameters()).dtype
    return Caches(make_cache(p, batch, cfg.heads, cfg.dim // cfg.heads, cfg.seq_len, device, dtype,
                             keep_all=cache == "full") for p in model.patterns)
