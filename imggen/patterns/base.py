"""The `Pattern` base class: what every attention pattern answers, with generic answers that any
new pattern inherits (a new pattern only has to define its element `rule`).

Definition
* `rule(i, j, head)`: may query i read key j (0 <= j < i)? On broadcastable long tensors; `head`
  is an int or a long tensor. `allowed` adds causality and the diagonal; `mask(n, head)` is
  `allowed` on an n x n grid and is the **definition** every fast path is tested against.

Structure (each has a generic, slower answer derived from the rule)
* `key_ranges(q0, q1, head)`: key ranges covering what queries [q0, q1) read -> `block_layout`
  and `block_plan` (key blocks per query block, which blocks need no element rule).
* `band()`: `BandShape(width, period)` when every allowed pair has i - j < width and the rule
  repeats with that period (band: period 1; local2d: one image row). Backends then read
  contiguous key windows instead of gathering blocks.
* `raster()`: `RasterShape(width, channels, radius, shift)` when query t reads only itself and keys
  p whose position p - shift lies at most radius rows above and radius pixels either side of t's
  pixel on a raster of `width` pixels x `channels` tokens (local2d). Backends then read 2-D tiles.
* `columns()`: `(stride, shift)` when query i reads exactly the keys j = i + shift - m * stride.
* `head_groups(heads)`: split heads into groups that each follow one head-independent pattern.
* `last_read(n, head)`: the last query that reads each key (decode-cache eviction), and
  `slot_policy`: how a cache reuses slots ("ring", "interval" or "all").
* `kernel_spec(tile)`: the named parameters the Triton kernels need for an arithmetic rule; the
  default (`KernelRule.TABLE`) hands the kernels per-block element masks built from `allowed`.

Random edges are drawn from (seed, layer, head, query block) only, so a prefix of length n sees
exactly the edges of the full sequence, and training, sampling and caches agree.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import math
import numbers
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import numpy as np
import torch

from imggen.errors import ConfigError, ShapeError

Ranges = list[tuple[int, int]]
PATTERNS: dict[str, type["Pattern"]] = {}


class KernelRule(enum.IntEnum):
    """Element rules the Triton kernels evaluate arithmetically (constexpr there)."""
    TABLE = 0     # per-block element masks from `allowed` (any pattern)
    CAUSAL = 1    # the block layout is exact; only causality inside blocks
    BAND = 2      # i - j < window
    LOCAL2D = 3   # 2-D neighbourhood (width, channels, radius, shift)
    DIFFUSER = 4  # band + first global_tokens keys + random keys per query block
    COLUMN = 5    # j = i + shift - m * stride


class KernelLayout(enum.IntEnum):
    """How the kernels find the key blocks of a query block."""
    TABLE = 0   # from the plan's tables
    CAUSAL = 1  # every earlier block
    BAND = 2    # the blocks within `window`


@dataclass(frozen=True)
class KernelSpec:
    """Named parameters of a pattern's kernel rule (unused fields keep their defaults)."""
    rule: KernelRule = KernelRule.TABLE
    layout: KernelLayout = KernelLayout.TABLE
    window: int = 0
    width: int = 1
    channels: int = 1
    radius: int = 0
    shift: int = 0
    global_tokens: int = 0
    stride: int = 1
    random_keys: int = 0   # random keys per query block (diffuser), from `lookup_tables`


class BandShape(NamedTuple):
    width: int   # every allowed pair has i - j < width
    period: int  # allowed(i + period, j + period) == allowed(i, j) for j >= 0


class RasterShape(NamedTuple):
    width: int     # pixels per image row
    channels: int  # tokens per pixel
    radius: int    # rows above and pixels either side
    shift: int     # keys sit `shift` positions after their pixel


class BlockPlan(NamedTuple):
    """Block layout of one sequence length, one table per head when heads differ (HL = H or 1).

    keys (HL, nqb, M): key blocks each query block touches, ascending, padded with -1 (key blocks
    may be smaller or larger than query blocks: see `Pattern.block_plan`).
    full (HL, nqb, M): every (query < n, key) pair of the block is allowed (no element rule).
    """
    block: int
    n: int
    keys: torch.Tensor
    full: torch.Tensor

    @property
    def nqb(self) -> int:
        return self.keys.shape[1]


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


def param(default, help: str, config: str | None = None, auto: bool = False, low=None, high=None):
    """A pattern parameter: `help` for --help, `config` = its ModelConfig / flag name when it
    differs, `auto` = its default depends on the image size (see `image_defaults`), `low` /
    `high` = the accepted range (inclusive; checked with the type when the pattern is built)."""
    return dataclasses.field(default=default, metadata={"help": help, "config": config, "auto": auto,
                                                        "low": low, "high": high})


def geometry(default=0, low=None, high=None):
    """A parameter the model derives from the image (height, width, ...): not a config field."""
    return dataclasses.field(default=default, metadata={"geometry": True, "low": low, "high": high})


def _field_type(f: dataclasses.Field) -> str:
    """'int', 'float' or another name: the annotation of a pattern field (a string under
    `from __future__ import annotations`, else the type)."""
    return f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")


def _accepted(typ: str, low, high) -> str:
    what = "an integer" if typ == "int" else "a number"
    if low is not None and high is not None:
        return f"{what} in [{low}, {high}]"
    if low is not None:
        return f"{what} >= {low}"
    return what if high is None else f"{what} <= {high}"


def check_params(pattern: "Pattern") -> None:
    """Type and range of every int / float field of `pattern`, before anything uses them: a bool,
    a float for an int (4.0 too), a string, NaN or a value outside the field's `low`..`high` is a
    one-line ConfigError naming the pattern, the parameter (and its config flag), the value and
    what is accepted. Integral numbers (numpy ints) become int, reals become float."""
    for f in dataclasses.fields(pattern):
        typ = _field_type(f)
        if typ not in ("int", "float"):
            continue
        v = getattr(pattern, f.name)
        low, high = f.metadata.get("low"), f.metadata.get("high")
        if typ == "int":
            ok = isinstance(v, numbers.Integral) and not isinstance(v, bool)
        else:
            ok = isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)
        if ok:
            v = int(v) if typ == "int" else float(v)
            ok = (low is None or v >= low) and (high is None or v <= high)
        if not ok:
            flag = f.metadata.get("config") or (None if f.metadata.get("geometry") else f.name)
            where = f" (flag --{flag.replace('_', '-')})" if flag and flag != f.name else ""
            got = f"{v!r}" + ("" if isinstance(v, (int, float)) and not isinstance(v, bool)
                              else f" ({type(v).__name__})")
            raise ConfigError(f"{pattern.name or type(pattern).__name__} pattern: {f.name}{where} must be "
                              f"{_accepted(typ, low, high)}, got {got}")
        object.__setattr__(pattern, f.name, v)  # frozen dataclass: normalise numpy ints etc.


@dataclass(frozen=True)
class Pattern:
    name: ClassVar[str] = ""
    heads_differ: ClassVar[bool] = False     # True when the rule depends on the head
    is_diffusion: ClassVar[bool] = False     # diffuser semantics (see imggen.attention)
    slot_policy: ClassVar[str] = "interval"  # decode caches: "ring", "interval" or "all"
    layer: int = dataclasses.field(default=0, kw_only=True, metadata={"geometry": True, "low": 0})

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        if cls.__dict__.get("name"):
            PATTERNS[cls.name] = cls

    def __post_init__(self):
        check_params(self)  # types and ranges first: `validate` and every method may rely on them
        self.validate()

    def validate(self) -> None:
        """Raise ConfigError on bad parameters beyond the types and `low` / `high` ranges of the
        fields (which `check_params` checks first)."""

    # ---- definition ---------------------------------------------------------------------
    def rule(self, i: torch.Tensor, j: torch.Tensor, head, tables=None) -> torch.Tensor:
        """May query i read key j, for 0 <= j < i (causality and the diagonal come from `allowed`)."""
        raise NotImplementedError(f"{type(self).__name__} must define rule(i, j, head)")

    def allowed(self, i, j, head=0, tables=None) -> torch.Tensor:
        """Element rule on broadcastable index tensors; `tables` = `lookup_tables(n, heads)`
        (built on demand when None)."""
        i, j = torch.broadcast_tensors(torch.as_tensor(i), torch.as_tensor(j))
        return (i == j) | ((j < i) & (j >= 0) & self.rule(i, j.clamp(min=0), head, tables))

    def mask(self, n: int, head: int = 0, device=None) -> torch.Tensor:
        self.check_length(n)
        idx = torch.arange(n, device=device)
        return self.allowed(idx[:, None], idx[None, :], head)

    def masks(self, n: int, heads: int, device=None) -> torch.Tensor:
        """(H, n, n) bool, one mask per head (expanded when heads share one)."""
        if not self.heads_differ:
            return self.mask(n, 0, device).expand(heads, n, n)
        return torch.stack([self.mask(n, h, device) for h in range(heads)])

    def max_length(self) -> int | None:
        """The longest sequence the pattern is defined for (None: any)."""
        return None

    def check_length(self, n: int) -> None:
        hi = self.max_length()
        if n < 1 or (hi is not None and n > hi):
            raise ShapeError(f"{self.name} pattern{self.geometry_note()}: cannot attend over {n} positions; "
                             f"use 1..{hi if hi is not None else 'any'}")

    def geometry_note(self) -> str:
        return ""

    def lookup_tables(self, n: int, heads: int) -> dict[str, torch.Tensor]:
        """Tensors the rule reads (random edges), for sequences of length <= n and `heads` heads."""
        return {}

    def for_layer(self, layer: int) -> "Pattern":
        return dataclasses.replace(self, layer=layer)

    def params(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("layer")
        return {"kind": self.name, **d}

    def head_count(self, heads: int) -> int:
        """Number of distinct per-head layouts (HL)."""
        return heads if self.heads_differ else 1

    @classmethod
    def image_defaults(cls, height: int, width: int, channels: int) -> dict:
        """Parameters derived from the image: geometry, and defaults of `auto` parameters."""
        return {}

    # ---- structure ----------------------------------------------------------------------
    def key_ranges(self, q0: int, q1: int, head: int = 0) -> Ranges:
        """Key ranges covering every key a query in [q0, q1) reads (generic: from the rule)."""
        ok = self.allowed(torch.arange(q0, q1)[:, None], torch.arange(q1)[None, :], head).any(0)
        idx = ok.nonzero().flatten().tolist()
        return _merge([(k, k + 1) for k in idx], q1)

    def band(self) -> BandShape | None:
        return None

    def raster(self) -> RasterShape | None:
        return None

    def columns(self) -> tuple[int, int] | None:
        return None

    def head_groups(self, heads: int) -> list[tuple[torch.Tensor, "Pattern"]] | None:
        return None

    @functools.lru_cache(maxsize=64)
    def block_layout(self, n: int, block: int, head: int = 0, key_block: int | None = None) -> torch.Tensor:
        """(ceil(n/block), m) long: the key blocks (of `key_block` tokens, default `block`) each
        query block of `block` tokens touches, ascending, padded with -1."""
        self.check_length(n)
        kblock = key_block or block
        nb = math.ceil(n / block)
        rows = []
        for qb in range(nb):
            q0, q1 = qb * block, min(n, (qb + 1) * block)
            blocks: set[int] = set()
            for a, b in _merge(self.key_ranges(q0, q1, head), q1):
                blocks.update(range(a // kblock, (b - 1) // kblock + 1))
            rows.append(sorted(blocks))
        m = max(len(r) for r in rows)
        out = torch.full((nb, m), -1, dtype=torch.long)
        for qb, r in enumerate(rows):
            out[qb, : len(r)] = torch.tensor(r, dtype=torch.long)
        return out

    @functools.lru_cache(maxsize=64)
    def block_plan(self, n: int, heads: int, block: int, key_block: int | None = None) -> BlockPlan:
        """Layouts of every distinct head, padded to one width, with exact 'full' flags (query
        blocks of `block`, key blocks of `key_block`, default `block`)."""
        kblock = key_block or block
        hl = self.head_count(heads)
        lays = [self.block_layout(n, block, h, key_block) for h in range(hl)]
        m = max(lay.shape[1] for lay in lays)
        keys = torch.stack([torch.nn.functional.pad(lay, (0, m - lay.shape[1]), value=-1) for lay in lays])
        tables = self.lookup_tables(n, hl)
        full = torch.zeros(keys.shape, dtype=torch.bool)
        qa, ka = torch.arange(block), torch.arange(kblock)
        step = max(1, (1 << 21) // (m * block * kblock))
        for h in range(hl):
            for a in range(0, keys.shape[1], step):  # the rule on chunks of query blocks
                kb = keys[h, a:a + step]
                qi = torch.arange(a, a + kb.shape[0])[:, None, None, None] * block + qa[:, None]
                kj = kb[:, :, None, None].clamp(min=0) * kblock + ka
                ok = self.allowed(qi, kj, h, tables) | (qi >= n)  # rows past n do not matter
                full[h, a:a + step] = ok.all(-1).all(-1) & (kb >= 0) & ((kb + 1) * kblock <= n)
        return BlockPlan(block, n, keys, full)

    # ---- decode caches --------------------------------------------------------------------
    def last_read(self, n: int, head: int = 0) -> np.ndarray:
        """(n,) int64: the last query < n that may read key j (>= j: the diagonal). Generic: from
        the mask (O(n^2)); patterns override it with arithmetic."""
        m = self.mask(n, head)
        rows = torch.arange(n)[:, None].expand(n, n)
        return rows.masked_fill(~m, -1).max(0).values.numpy().astype(np.int64)

    @functools.lru_cache(maxsize=64)
    def last_reads(self, n: int, heads: int) -> np.ndarray:
        """`last_read` over every head (caches hold the union; the read mask still masks per head)."""
        return np.max([self.last_read(n, h) for h in range(self.head_count(heads))], axis=0)

    def retained(self, t: int, n: int, head: int = 0) -> list[int]:
        """Sorted past positions (< t) that some query in [t, n) may still read."""
        return np.flatnonzero(self.last_read(n, head)[:t] >= t).tolist()

    def read_mask(self, t: int, pos: torch.Tensor, heads: int, tables=None) -> torch.Tensor:
        """(HL, L) bool: may query t read the held positions `pos` (L,) (-1 = empty slot)."""
        h = torch.arange(self.head_count(heads), device=pos.device)[:, None]
        return self.allowed(torch.tensor(t, device=pos.device), pos[None, :], h, tables) & (pos >= 0)

    # ---- kernels --------------------------------------------------------------------------
    def kernel_spec(self, tile: int) -> KernelSpec:
        """Kernel parameters for query/key tiles of `tile` tokens."""
        return KernelSpec()

    def random_of(self, qb: int, head: int) -> tuple[int, ...]:
        """Random keys (diffuser) or key blocks (bigbird) drawn for query block qb."""
        return ()


def rng(seed: int, layer: int, head: int, qb: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, layer, head, qb])))


def random_table(pattern: Pattern, nqb: int, heads: int, width: int) -> torch.Tensor:
    """(heads, nqb, w) long: `random_of(qb, head)` padded with -2 (matches nothing); w = `width`, or
    fewer where no query block has that many earlier blocks to pick (e.g. --random-blocks 1000: the
    rules loop over the columns)."""
    picks = [[pattern.random_of(qb, h) for qb in range(nqb)] for h in range(heads)]
    width = min(width, max((len(r) for row in picks for r in row), default=0))
    table = torch.full((heads, nqb, max(1, width)), -2, dtype=torch.long)
    for h, row in enumerate(picks):
        for qb, r in enumerate(row):
            table[h, qb, : len(r)] = torch.tensor(r, dtype=torch.long)
    return table


def random_hit(table: torch.Tensor, qb, key, head) -> torch.Tensor:
    """Whether `key` is among the random picks of query block `qb` under `head` (broadcast;
    unrolled over the table's width so it also traces inside FlexAttention's mask_mod)."""
    hit = torch.zeros_like(torch.as_tensor(key), dtype=torch.bool)
    qb = torch.as_tensor(qb).clamp(max=table.shape[1] - 1)  # query rows past the table's n (padding)
    for r in range(table.shape[-1]):
        hit = hit | (table[head, qb, r] == key)
    return hit
