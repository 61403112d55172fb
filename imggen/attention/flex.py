"""The `flex` backend: torch's FlexAttention with a BlockMask built from the pattern's own block
plan (per head where heads differ; full blocks skip the mask) and a `mask_mod` that is the
pattern's rule (`Pattern.allowed`) in tensor ops, random edges read from lookup tensors.

The diffuser runs as its K steps of flex calls over the same BlockMask (values Z(k)), with
autograd through flex. Compiled once per (pattern, shape) by torch.compile and cached. CUDA:
forward and backward. CPU: forward only (prefill, evaluation); FlexAttention has no CPU backward,
so asking for one is a clear error, and so is float64 (its CPU lowering takes float32, float16 and
bfloat16); on CPU the sequence is zero-padded to whole blocks (torch's CPU kernel is wrong at some
other lengths). When torch.compile reaches its recompile limit (it then runs FlexAttention
un-compiled and only logs it), one RuntimeWarning says so.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import warnings

import torch

from imggen.errors import ConfigError, ShapeError
from imggen.patterns import Pattern

BLOCK = 128  # FlexAttention's sparse block size
CPU_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what FlexAttention's CPU lowering takes
_DYNAMO_LOG = "torch._dynamo.convert_frame"  # the logger that reports a recompile limit hit
_warned_limit = False


@functools.lru_cache(maxsize=1)
def _compiled():
    import torch._dynamo
    from torch.nn.attention.flex_attention import flex_attention

    # one compiled graph per (pattern, shape): every layer of a bigbird/diffuser model has its own
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return torch.compile(flex_attention, dynamic=False)


@functools.lru_cache(maxsize=64)
def block_mask(pattern: Pattern, n: int, heads: int, device: str, length: int | None = None):
    """The BlockMask of `pattern` over n tokens: (1, HL, ...) with HL = heads or 1; `length` >= n:
    the sequence length it is used at (inputs zero-padded to it; the same blocks, whose element rule
    keeps the queries < n off the padding, by causality)."""
    from torch.nn.attention.flex_attention import BlockMask

    plan = pattern.block_plan(n, heads, BLOCK)
    keys, full = plan.keys, plan.full
    valid = keys >= 0

    blocks = -(-n // BLOCK)

    def table(sel):  # key blocks where sel, moved to the front of each row
        order = torch.sort((~sel).to(torch.int8), dim=-1, stable=True).indices
        idx = torch.gather(keys.clamp(min=0), -1, order)
        # FlexAttention wants one column per key block (the plan keeps only as many as a row reads)
        idx = torch.nn.functional.pad(idx, (0, blocks - idx.shape[-1]))
        return sel.sum(-1).to(torch.int32)[None].to(device), idx.to(torch.int32)[None].to(device)

    tables = {k: t.to(device) for k, t in pattern.lookup_tables(n, keys.shape[0]).items()}

    def mask_mod(b, h, q_idx, kv_idx):
        return pattern.allowed(q_idx, kv_idx, h, tables)

    partial_n, partial_i = table(valid & ~full)
    full_n, full_i = table(valid & full)
    return BlockMask.from_kv_blocks(partial_n, partial_i, full_n, full_i, BLOCK_SIZE=BLOCK, mask_mod=mask_mod,
                                    seq_lengths=(length or n, length or n))


class _LimitHits(logging.Filter):
    """Notes dynamo's "hit config.recompile_limit" record while a flex call runs (the record is
    still logged as usual)."""

    def __init__(self):
        super().__init__()
        self.hit: str | None = None

    def filter(self, record):
        msg = record.getMessage()
        if "recompile_limit" in msg and self.hit is None:
            self.hit = msg.splitlines()[0].strip()
        return True


@contextlib.contextmanager
def _watch_recompile_limit(what: str):
    """When torch.compile gives up on FlexAttention inside the block (its recompile limit: the
    call then runs un-compiled, dense and slow, and torch says so only in its log), warn once."""
    global _warned_limit
    log = logging.getLogger(_DYNAMO_LOG)
    watch = _LimitHits()
    log.addFilter(watch)
    try:
        yield
    finally:
        log.removeFilter(watch)
    if watch.hit and not _warned_limit:
        _warned_limit = True
        import torch._dynamo
        warnings.warn(f"imggen: torch.compile stopped compiling FlexAttention ({watch.hit}; now at {what}): "
                      f"new (pattern, shape) combinations run un-compiled, much slower and with dense "
                      f"memory; raise torch._dynamo.config.recompile_limit (now "
                      f"{torch._dynamo.config.recompile_limit}) or use fewer distinct shapes / patterns",
                      RuntimeWarning, stacklevel=4)


def flex_attention(q, k, v, pattern: Pattern) -> torch.Tensor:
    b, h, n, d = q.shape
    if not q.is_cuda and q.dtype not in CPU_DTYPES:
        raise ShapeError(f"the flex backend on CPU takes q, k, v of dtype float32, float16 or bfloat16 "
                         f"(FlexAttention's CPU lowering), got {str(q.dtype).replace('torch.', '')}; use "
                         f"backend 'reference' or 'cpu' for it, or convert the inputs")
    if not q.is_cuda and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise ConfigError("the flex backend has no backward pass on CPU (FlexAttention is forward-only "
                          "there); train on CPU with backend 'cpu' (--backend cpu or IMGGEN_BACKEND=cpu)")
    # CPU: whole blocks. torch's compiled CPU FlexAttention returns wrong rows at some lengths that
    # are not a multiple of its block (seen with torch 2.14 at N = 40 and 104, head dim 16)
    what = f"{pattern.name} attention, layer {pattern.layer}, shape {tuple(q.shape)}, {q.dtype}"
    m = n if q.is_cuda else -(-n // BLOCK) * BLOCK
    if m != n:
        q, k, v = (torch.nn.functional.pad(t, (0, 0, 0, m - n)) for t in (q, k, v))
    bm = block_mask(pattern, n, h, str(q.device), m)
    fn = _compiled()
    with _watch_recompile_limit(what):
        if not pattern.is_diffusion:
            return _unpad(fn(q, k, v, block_mask=bm), n)
        z = v
        for _ in range(pattern.steps):
            z = (1 - pattern.alpha) * fn(q, k, z, block_mask=bm) + pattern.alpha * v
        return _unpad(z, n)


def _unpad(x: torch.Tensor, n: int) -> torch.Tensor:
    return x if x.shape[2] == n else x[:, :, :n].contiguous()
