"""Key windows of blocked attention (imggen.attention.blocked, imggen.attention.tiles): the layout every window kind
shares (queries in blocks, keys in one padded buffer, work in chunks of slices x query blocks)
and the additive masks they add to scores."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

_MIN_CHUNK, _MAX_CHUNK = 1 << 18, 1 << 22  # scores per chunk (about as many as q holds elements, within these)


class Windows:
    """Key windows of the query blocks of one (pattern, n, heads) shape.

    All B*H slices share one layout: query block qb of slice c is global block g = c*nqb + qb
    (queries padded to nqb*Bq per slice); keys live in one buffer with `lpad` leading and `tail`
    trailing zero rows, slice c's position p at row lpad + c*nqb*Bq + p. `windows(buf, chunk)` is
    (G, span, D) for the chunk's G blocks, so one bmm serves every slice of a chunk; scores are
    (G, Bq, span), viewed as (slices, blocks, Bq, span) for masking. Band windows of a slice's first
    blocks reach into the previous slice's rows: those keys are masked (before position 0), so they
    add exact zeros to its gradients.
    """

    block: int   # Bq
    nqb: int     # query blocks per slice
    span: int    # keys per window
    lpad: int
    tail: int
    quantum = 1  # a chunk that splits a slice takes a multiple of this many query blocks

    def pad_queries(self, x: torch.Tensor) -> torch.Tensor:
        """(B, H, n, D) -> (B*H*nqb, Bq, D) contiguous."""
        b, h, n, d = x.shape
        return F.pad(x, (0, 0, 0, self.nqb * self.block - n)).reshape(-1, self.block, d)

    def unpad_queries(self, x: torch.Tensor, shape) -> torch.Tensor:
        b, h, n, d = shape
        return x.view(b, h, -1, d)[:, :, :n]

    def key_buffer(self, x: torch.Tensor | None, shape, dtype=None) -> torch.Tensor:
        """(B, H, n, D) -> the padded key buffer (zeros when x is None)."""
        b, h, n, d = shape
        rows = b * h * self.nqb * self.block
        if x is None:
            return torch.zeros(self.lpad + rows + self.tail, d, dtype=dtype)
        buf = torch.empty(self.lpad + rows + self.tail, d, dtype=dtype or x.dtype)  # only the padding zeroed
        buf[:self.lpad].zero_()
        buf[self.lpad + rows:].zero_()
        body = buf[self.lpad:self.lpad + rows].view(b, h, -1, d)
        body[:, :, n:].zero_()
        body[:, :, :n] = x
        return buf

    def unpad_keys(self, buf: torch.Tensor, shape) -> torch.Tensor:
        b, h, n, d = shape
        return self.query_rows(buf).reshape(b, h, -1, d)[:, :, :n]

    def query_rows(self, buf: torch.Tensor) -> torch.Tensor:
        """The buffer rows that hold positions, as (B*H*nqb, Bq, D)."""
        return buf[self.lpad:buf.shape[0] - self.tail].view(-1, self.block, buf.shape[-1])

    def chunks(self, slices: int, d: int) -> list[tuple[int, int, int, int]]:
        """(c0, c1, q0, q1): slices [c0, c1) x query blocks [q0, q1), whole slices or part of one,
        each holding about one chunk of scores."""
        limit = min(_MAX_CHUNK, max(_MIN_CHUNK, slices * self.nqb * self.block * d))
        per_slice = self.nqb * self.block * self.span
        if per_slice <= limit:
            step = max(1, limit // per_slice)
            return [(c, min(slices, c + step), 0, self.nqb) for c in range(0, slices, step)]
        step = max(1, limit // (self.block * self.span) // self.quantum) * self.quantum
        return [(c, c + 1, q, min(self.nqb, q + step)) for c in range(slices) for q in range(0, self.nqb, step)]

    def blocks(self, chunk) -> tuple[int, int]:
        c0, c1, q0, q1 = chunk
        return c0 * self.nqb + q0, (c1 - 1) * self.nqb + q1


def additive_mask(ok: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """0 where `ok`, -inf elsewhere, on ok's device: an attention mask to add to the scores (adding
    it costs a tenth of a masked_fill_)."""
    return torch.zeros(ok.shape, dtype=dtype, device=ok.device).masked_fill_(~ok, float("-inf"))


@functools.lru_cache(maxsize=64)
def in_dtype(bias: torch.Tensor, dtype) -> torch.Tensor:
    """A cached mask bias (0 / -inf, exact in any float dtype) in the scores' dtype: adding a float32
    bias to bfloat16 scores costs four times a same-dtype add."""
    return bias if bias.dtype == dtype else bias.to(dtype)
