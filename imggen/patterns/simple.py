"""Full causal attention, the diagonal band, and the Sparse Transformer's column / strided heads."""
from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np
import torch

from .base import BandShape, KernelLayout, KernelRule, KernelSpec, Pattern, geometry, param


@dataclass(frozen=True)
class Full(Pattern):
    """Every earlier token (the lower triangle)."""

    name = "full"
    slot_policy = "ring"  # a ring as long as the sequence: nothing is ever evicted

    def rule(self, i, j, head, tables=None):
        return torch.ones_like(i, dtype=torch.bool)

    def key_ranges(self, q0, q1, head=0):
        return [(0, q1)]

    def band(self):
        return BandShape(sys.maxsize, 1)

    def last_read(self, n, head=0):
        return np.full(n, n - 1, dtype=np.int64)

    def kernel_spec(self, tile):
        return KernelSpec(KernelRule.CAUSAL, KernelLayout.CAUSAL)


@dataclass(frozen=True)
class Band(Pattern):
    """Each token reads itself and the previous `window - 1` tokens (i - j < window).

    In the model the input at position t carries token t-1, so the query that predicts token t
    reads exactly the previous `window` tokens. A band narrower than a row does not see the pixel
    above.
    """

    name = "band"
    slot_policy = "ring"
    window: int = param(256, "band/diffuser window in tokens (default: two rows for band, one for diffuser)",
                        auto=True, low=1)

    @classmethod
    def image_defaults(cls, height, width, channels):
        return {"window": 2 * width * channels}

    def rule(self, i, j, head, tables=None):
        return i - j < self.window

    def key_ranges(self, q0, q1, head=0):
        return [(q0 - self.window + 1, q1)]

    def band(self):
        return BandShape(self.window, 1)

    def last_read(self, n, head=0):
        return np.minimum(np.arange(n, dtype=np.int64) + self.window - 1, n - 1)

    def kernel_spec(self, tile):
        return KernelSpec(KernelRule.BAND, KernelLayout.BAND, window=self.window)


@dataclass(frozen=True)
class Column(Pattern):
    """Every stride-th earlier key: query i reads j with (i - (j - shift)) % stride == 0, j - shift
    >= 0 (and itself). With stride = row width (W*C) and shift = 1 (the model's convention) the
    query predicting a subpixel reads the whole column above it."""

    name = "column"
    slot_policy = "all"  # a column is read until the last row
    stride: int = param(32, "strided pattern stride (default: row width W*C)", auto=True, low=1)
    shift: int = geometry(0, low=0, high=1)

    @classmethod
    def image_defaults(cls, height, width, channels):
        return {"stride": width * channels, "shift": 1}

    def rule(self, i, j, head, tables=None):
        jj = j - self.shift
        return (jj >= 0) & (jj < i) & ((i - jj) % self.stride == 0)

    def key_ranges(self, q0, q1, head=0):
        s = self.stride
        return [(q0 - k * s + self.shift, q1 - k * s + self.shift) for k in range(q1 // s + 2)] + [(q0, q1)]

    def columns(self):
        return (self.stride, self.shift)

    def last_read(self, n, head=0):
        j = np.arange(n, dtype=np.int64)
        jj = j - self.shift
        last = jj + ((n - 1 - jj) // self.stride) * self.stride  # the column's last query < n
        return np.where((jj >= 0) & (last > jj), last, j)

    def kernel_spec(self, tile):
        return KernelSpec(KernelRule.COLUMN, stride=self.stride, shift=self.shift)


@dataclass(frozen=True)
class Strided(Pattern):
    """Sparse Transformer's factorised pattern, split across heads: even heads are a band of
    `stride` (the previous row), odd heads a column of `stride` (the column above)."""

    name = "strided"
    heads_differ = True
    slot_policy = "all"
    stride: int = param(32, "strided pattern stride (default: row width W*C)", auto=True, low=1)
    shift: int = geometry(0, low=0, high=1)

    image_defaults = Column.image_defaults

    def _parts(self):
        return Band(window=self.stride), Column(stride=self.stride, shift=self.shift)

    def head_groups(self, heads):
        band, column = self._parts()
        return [(torch.arange(0, heads, 2), band), (torch.arange(1, heads, 2), column)]

    def rule(self, i, j, head, tables=None):
        band, column = self._parts()
        even = torch.as_tensor(head) % 2 == 0
        return torch.where(even, band.rule(i, j, 0), column.rule(i, j, 0))

    def key_ranges(self, q0, q1, head=0):
        return self._parts()[head % 2].key_ranges(q0, q1)

    def last_read(self, n, head=0):
        return self._parts()[head % 2].last_read(n)

    def head_count(self, heads):
        return min(heads, 2)  # two distinct layouts: even and odd heads
