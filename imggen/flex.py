"""The `flex` backend: torch's FlexAttention with a BlockMask built from the pattern's own block
plan (per head where heads differ; full blocks skip the mask) and a `mask_mod` that is the
pattern's rule (`Pattern.allowed`) in tensor ops, random edges read from lookup tensors.

The diffuser runs as its K steps of flex calls over the same BlockMask (values Z(k)), with
autograd through flex. Compiled once per (pattern, shape) by torch.compile and cached. CUDA:
forward and backward. CPU: forward only (prefill, evaluation); FlexAttention has no CPU backward,
so asking for one is a clear error.
"""
from __future__ import annotations

import functools

import torch

from imggen.errors import ConfigError
from imggen.patterns import Pattern

BLOCK = 128  # FlexAttention's sparse block size


@functools.lru_cache(maxsize=1)
def _compiled():
    import torch._dynamo
    from torch.nn.attention.flex_attention import flex_attention

    # one compiled graph per (pattern, shape): every layer of a bigbird/diffuser model has its own
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return torch.compile(flex_attention, dynamic=False)


@functools.lru_cache(maxsize=64)
def block_mask(pattern: Pattern, n: int, heads: int, device: str):
    """The BlockMask of `pattern` over n tokens: (1, HL, ...) with HL = heads or 1."""
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
                                    seq_lengths=(n, n))


def flex_attention(q, k, v, pattern: Pattern) -> torch.Tensor:
    b, h, n, d = q.shape
    if not q.is_cuda and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise ConfigError("the flex backend has no backward pass on CPU (FlexAttention is forward-only "
                          "there); train on CPU with backend 'cpu' (--backend cpu or IMGGEN_BACKEND=cpu)")
    bm = block_mask(pattern, n, h, str(q.device))
    fn = _compiled()
    if not pattern.is_diffusion:
        return fn(q, k, v, block_mask=bm)
    z = v
    for _ in range(pattern.steps):
        z = (1 - pattern.alpha) * fn(q, k, z, block_mask=bm) + pattern.alpha * v
    return z
