"""Causal 2-D neighbourhood on a raster: one diagonal stripe per row offset."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .base import BandShape, KernelRule, KernelSpec, Pattern, RasterShape, geometry, param


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
    slot_policy = "ring"
    height: int = geometry(32, low=1)
    width: int = geometry(32, low=1)
    channels: int = geometry(1, low=1)
    radius: int = param(3, "local2d neighbourhood radius in pixels", low=0)
    shift: int = geometry(0, low=0, high=1)

    @classmethod
    def image_defaults(cls, height, width, channels):
        return {"height": height, "width": width, "channels": channels, "shift": 1}

    def max_length(self):
        return self.height * self.width * self.channels

    def geometry_note(self):
        return f" made for {self.height}x{self.width}x{self.channels} images ({self.max_length()} tokens)"

    @property
    def row(self) -> int:
        return self.width * self.channels

    def _coords(self, t):
        p = torch.div(t, self.channels, rounding_mode="floor")
        return torch.div(p, self.width, rounding_mode="floor"), p % self.width

    def rule(self, i, j, head, tables=None):
        j = j - self.shift
        yi, xi = self._coords(i)
        yj, xj = self._coords(j.clamp(min=0))
        return (j >= 0) & (j < i) & (yi - yj <= self.radius) & ((xi - xj).abs() <= self.radius)

    def key_ranges(self, q0, q1, head=0):
        row, r, c, s = self.row, self.radius, self.channels, self.shift
        return [(q0 - k * row - r * c - c + s, q1 - k * row + r * c + c + s) for k in range(r + 1)]

    def band(self):
        # farthest key: r rows up, r pixels left, from the last channel to the first, minus the shift
        r, c = self.radius, self.channels
        return BandShape(max(1, r * self.row + r * c + c - self.shift), self.row)

    def raster(self):
        return RasterShape(self.width, self.channels, self.radius, self.shift)

    def last_read(self, n, head=0):
        c, w, r = self.channels, self.width, self.radius
        j = np.arange(n, dtype=np.int64)
        jj = j - self.shift
        p = np.maximum(jj, 0) // c
        y = np.minimum(p // w + r, (n - 1) // (w * c))  # last row present (a partial one: over-estimate)
        x = np.minimum(p % w + r, w - 1)
        return np.maximum(np.minimum(np.where(jj >= 0, (y * w + x) * c + c - 1, j), n - 1), j)

    def kernel_spec(self, tile):
        return KernelSpec(KernelRule.LOCAL2D, width=self.width, channels=self.channels, radius=self.radius,
                          shift=self.shift)
