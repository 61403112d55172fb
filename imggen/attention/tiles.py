"""2-D query tiles for raster neighbourhood patterns (local2d) on the `cpu` backend.

A query block is a patch of ty x tx pixels (ty * tx * C tokens, channels interleaved per pixel);
its keys are the patch grown by r rows above and r pixels on each side: (ty + r) x (tx + 2r)
pixels. A band window (imggen.attention.blocked.BandWindows) reads about r * W * C + Bq keys per query
block instead, so tiles do less work once an image row is long beside the tile.

Key layout: slice c's keys sit in one flat run of the buffer, position p at row
c * L + lead + p - shift (lead = r rows + r pixels of zeros), so the key held at flat raster cell f
(f = (y * W + x) * C + ch, possibly outside the image) is position f + shift. A tile's window is
then a strided view over that run (rows W * C apart) whose cells left / right of the image wrap
into the neighbouring rows: the rule masks them, and with shift = 1 the cell just left of a row's
first pixel holds the first query's own key (its diagonal). One reshape gathers each window.

Masks are exact, from `pattern.allowed` on (query position, key position held by each window
cell), one (Bq, span) additive bias per tile class: tiles touching the top rows or the left /
right image edge have their own, every other tile shares one (their rule is the same relative
pattern). A key position held by two cells of one window (images narrower than the window) counts
at its first cell only; query cells right of the image are padding (bias 0, dropped). The mask
does not depend on the sequence length n: no allowed key lies after its query.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from imggen.patterns import Pattern
from imggen.attention.windows import Windows, additive_mask, in_dtype


class TileWindows(Windows):
    """Windows of ty x tx pixel tiles; global block g = (slice, tile row, tile column)."""

    def __init__(self, pattern: Pattern, n: int, tile: tuple[int, int]):
        w, c, r, s = pattern.raster()
        ty, tx = tile
        if not fits(pattern, tile):
            raise ValueError(f"{pattern}: tile {tile} does not fit")
        self.row, self.ty, self.txc, self.shift = w * c, ty, tx * c, s
        self.tiles_x = math.ceil(w / tx)
        self.tiles_y = math.ceil(math.ceil(n / self.row) / ty)
        self.nqb, self.block, self.quantum = self.tiles_y * self.tiles_x, ty * tx * c, self.tiles_x
        self.kh, self.kw = ty + r, (tx + 2 * r) * c
        self.span = self.kh * self.kw
        self.lead = r * self.row + r * c
        self.slice_len = self.lead + self.tiles_y * ty * self.row + max(0, (self.tiles_x * tx + r) * c - self.row)
        self.top, self.bias, self.col_runs = _tile_bias(pattern, tile)

    # ---- queries: (B, H, n, D) <-> (B*H*nqb, Bq, D) -------------------------------------------
    def pad_queries(self, x):
        b, h, n, d = x.shape
        x = F.pad(x, (0, 0, 0, self.tiles_y * self.ty * self.row - n)).reshape(b * h, self.tiles_y, self.ty, self.row, d)
        x = F.pad(x, (0, 0, 0, self.tiles_x * self.txc - self.row))
        x = x.view(b * h, self.tiles_y, self.ty, self.tiles_x, self.txc, d).transpose(2, 3)
        return x.reshape(-1, self.block, d)

    def unpad_queries(self, x, shape):
        b, h, n, d = shape
        x = x.view(b * h, self.tiles_y, self.tiles_x, self.ty, self.txc, d).transpose(2, 3)
        x = x.reshape(b * h, self.tiles_y * self.ty, self.tiles_x * self.txc, d)[:, :, :self.row]
        return x.reshape(b, h, -1, d)[:, :, :n]

    # ---- keys: one flat run of slice_len rows per slice ----------------------------------------
    def key_buffer(self, x, shape, dtype=None):
        b, h, n, d = shape
        if x is None:
            return torch.zeros(b * h * self.slice_len, d, dtype=dtype)
        buf = torch.empty(b * h * self.slice_len, d, dtype=dtype or x.dtype)  # only the padding zeroed
        first = self.lead - self.shift
        runs = buf.view(b * h, self.slice_len, d)
        runs[:, :first].zero_()
        runs[:, first + n:].zero_()
        self.unpad_keys(buf, shape).copy_(x)
        return buf

    def unpad_keys(self, buf, shape):
        b, h, n, d = shape
        first = self.lead - self.shift
        return buf.view(b, h, self.slice_len, d)[:, :, first:first + n]

    def _view(self, buf, chunk, size, offset):
        """(slices, tile rows, tile columns, *size, D) strided view of the chunk's windows, cell
        (0, offset) of each window first."""
        c0, c1, q0, q1 = chunk
        y0, y1 = q0 // self.tiles_x, -(-q1 // self.tiles_x)
        d = buf.shape[-1]
        inner = (self.row * d, d, 1) if len(size) == 3 else (d, 1)
        return buf.as_strided((c1 - c0, y1 - y0, self.tiles_x, *size),
                              (self.slice_len * d, self.ty * self.row * d, self.txc * d, *inner),
                              buf.storage_offset() + (c0 * self.slice_len + y0 * self.ty * self.row + offset) * d)

    def windows(self, buf, chunk):
        """(G, span, D): one gather (a reshape of the strided window view)."""
        return self._view(buf, chunk, (self.kh, self.kw, buf.shape[-1]), 0).reshape(-1, self.span, buf.shape[-1])

    def fold(self, dw, buf, chunk):
        """Add window gradients onto the buffer: per window row, in column pieces at most one tile
        wide, so no buffer row is written twice by one add (`fits`)."""
        d = buf.shape[-1]
        dw = dw.view(-1, self._rows(chunk), self.tiles_x, self.kh, self.kw, d)
        for a in range(self.kh):
            for v0 in range(0, self.kw, self.txc):
                v1 = min(self.kw, v0 + self.txc)
                self._view(buf, chunk, (v1 - v0, d), a * self.row + v0).add_(dw[:, :, :, a, v0:v1])

    def _rows(self, chunk):
        c0, c1, q0, q1 = chunk
        assert q0 % self.tiles_x == 0 and (q1 % self.tiles_x == 0 or q1 == self.nqb)
        return -(-q1 // self.tiles_x) - q0 // self.tiles_x

    def mask_(self, s, chunk):
        c0, c1, q0, q1 = chunk
        y0 = q0 // self.tiles_x
        s5 = s.view(c1 - c0, self._rows(chunk), self.tiles_x, self.block, self.span)
        y1 = y0 + s5.shape[1]
        rows = [(y, y + 1, y) for y in range(y0, min(y1, self.top))] + [(max(y0, self.top), y1, self.top)]
        for ya, yb, yc in rows:
            if ya < yb:
                for xa, xb, xc in self.col_runs(self.tiles_x):
                    s5[:, ya - y0:yb - y0, xa:xb].add_(in_dtype(self.bias(yc, xc), s.dtype))
        return s


MIN_GAIN = 2.5  # tiles run when band windows would read this many times the keys per query


def choose_tile(pattern: Pattern, band_keys: int | None) -> tuple[int, int] | None:
    """The tile shape for the pattern when tiles pay, else None. `band_keys`: keys per query of the
    band windows the cpu backend would read instead (None: no band shape).

    Measured fwd+bwd on one core of a busy 2-core box (B=4, H=4, D=32, r=3,
    `bench/local2d_tiles.py --crossover`): tiles of 2 x 8 pixels (C = 1) or 3 x 4 (C > 1) lose to
    band windows up to 16 x 16 pixels, are about even from 24 x 24 to 32 x 32 (band windows then
    read 2-3x the keys per query; the runs there scatter by +-40%), and win from 40 x 40 on
    (1.4-2x at 64 x 64, 2.4-3.5x at 128 x 128). MIN_GAIN puts the switch at 32 x 32 (C = 1 and 3).
    """
    shape = pattern.raster()
    if shape is None:
        return None
    ty, tx = (2, 8) if shape.channels == 1 else (3, 4)
    tile = (ty, min(tx, shape.width))
    if not fits(pattern, tile):
        return None
    keys = (ty + shape.radius) * (tile[1] + 2 * shape.radius) * shape.channels
    return tile if band_keys is None or band_keys >= MIN_GAIN * keys else None


def fits(pattern: Pattern, tile: tuple[int, int]) -> bool:
    """Whether ty x tx tiles serve the pattern: a raster with radius >= 1, tx <= W, and tile rows
    that never overlap in the buffer (a row of tiles spans at most ty image rows)."""
    shape = pattern.raster()
    if shape is None or shape.radius < 1 or pattern.heads_differ:
        return False
    ty, tx = tile
    return tx <= shape.width and math.ceil(shape.width / tx) * tx <= ty * shape.width


@functools.lru_cache(maxsize=64)
def _tile_bias(pattern: Pattern, tile: tuple[int, int]):
    """(top, bias(tile-row class, tile-column class), col_runs(tiles_x)): tile rows below `top`
    each have their own class, the rest share class `top`; column classes come from col_runs."""
    w, c, r, s = pattern.raster()
    ty, tx = tile
    top = -(-r // ty)
    tiles_x = math.ceil(w / tx)
    left, right = -(-r // tx), max(0, (w - r) // tx)  # tiles xi in [left, right) are interior

    def col_class(xi):
        return "mid" if left <= xi < right else xi

    def col_runs(nx):
        runs = []
        for xi in range(nx):
            if runs and runs[-1][2] == col_class(xi) == "mid":
                runs[-1] = (runs[-1][0], xi + 1, "mid")
            else:
                runs.append((xi, xi + 1, col_class(xi)))
        return runs

    @functools.lru_cache(maxsize=None)
    def bias(yc, xc):
        xi = left if xc == "mid" else xc
        return additive_mask(_tile_mask(pattern, tile, yc, xi))

    if left < right and tiles_x > right:  # interior tiles share one relative pattern
        assert torch.equal(_tile_mask(pattern, tile, top, left), _tile_mask(pattern, tile, top + 1, right - 1))
    return top, bias, col_runs


def _tile_mask(pattern: Pattern, tile: tuple[int, int], yi: int, xi: int) -> torch.Tensor:
    """(Bq, span) bool: may query cell (a, u) of tile (yi, xi) read window cell (b, v)?"""
    w, c, r, s = pattern.raster()
    ty, tx = tile
    row = w * c
    u = torch.arange(tx * c)
    i = ((yi * ty + torch.arange(ty)[:, None]) * row + xi * tx * c + u).reshape(-1, 1)
    pad = (xi * tx + u // c >= w).repeat(ty)[:, None]
    f = (yi * ty + torch.arange(ty + r)[:, None] - r) * row + (xi * tx - r) * c + torch.arange((tx + 2 * r) * c)
    p = f.reshape(1, -1) + s
    again = (p.T == p).tril(-1).any(1)  # held by an earlier cell of the window too
    return (pattern.allowed(i, p) & ~again) | pad
