"""Decoder-only Transformer over raster-order pixel tokens with per-layer sparse attention.

`model(tokens)` -> logits (B, N, 2**bits); logits[:, t] is the distribution of tokens[:, t] given
tokens[:, :t]. Internally the input at position t is the embedding of token t-1 (a learned start
vector at t = 0) plus factorised row/column/channel embeddings of position t, so the query at t
predicts subpixel t and reads positions the layer's pattern allows.

`model.step(prev, t, caches)` computes the logits at position t from the caches (decode path).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from imggen.config import ModelConfig
from imggen.errors import ShapeError
from imggen.patterns import Pattern
from imggen.sparse_attention import sparse_attention
from imggen.tokens import position_coords


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, pattern: Pattern):
        super().__init__()
        self.heads, self.head_dim = cfg.heads, cfg.dim // cfg.heads
        self.pattern, self.backend = pattern, cfg.backend
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.proj = nn.Linear(cfg.dim, cfg.dim)

    def _qkv(self, x):
        b, n, _ = x.shape
        return self.qkv(x).view(b, n, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)

    def forward(self, x, cache=None):
        b, n, c = x.shape
        q, k, v = self._qkv(x)
        o = sparse_attention(q, k, v, self.pattern, self.backend)
        if cache is not None:  # prefill: hand the cache every position's k, v (and diffusion states)
            cache.prefill(q, k, v)
        return self.proj(o.transpose(1, 2).reshape(b, n, c))

    def step(self, x, t: int, cache):
        """x (B, 1, dim) at position t -> (B, 1, dim), reading and updating `cache`."""
        q, k, v = (a[:, :, 0] for a in self._qkv(x))  # (B, H, D)
        o = cache.attend(q, k, v, t)
        return self.proj(o.reshape(x.shape[0], 1, -1))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, pattern: Pattern):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(cfg.dim), nn.LayerNorm(cfg.dim)
        self.attn = Attention(cfg, pattern)
        hidden = int(cfg.mlp_ratio * cfg.dim)
        self.mlp = nn.Sequential(nn.Linear(cfg.dim, hidden), nn.GELU(approximate="tanh"),
                                 nn.Linear(hidden, cfg.dim))
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x, cache=None):
        x = x + self.drop(self.attn(self.ln1(x), cache))
        return x + self.drop(self.mlp(self.ln2(x)))

    def step(self, x, t, cache):
        x = x + self.attn.step(self.ln1(x), t, cache)
        return x + self.mlp(self.ln2(x))


class ImageTransformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg.validate()
        self.patterns = cfg.patterns()
        d = cfg.dim
        self.tok_emb = nn.Embedding(cfg.vocab, d)
        self.start = nn.Parameter(torch.zeros(d))
        self.row_emb = nn.Embedding(cfg.height, d)
        self.col_emb = nn.Embedding(cfg.width, d)
        self.chan_emb = nn.Embedding(cfg.channels, d)
        self.blocks = nn.ModuleList(Block(cfg, p) for p in self.patterns)
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, cfg.vocab, bias=False)
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, std=0.02 / (2 * cfg.layers) ** 0.5)
        y, x, c = position_coords(cfg.seq_len, cfg.height, cfg.width, cfg.channels)
        self.register_buffer("pos_index", torch.stack([y, x, c]), persistent=False)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def pos_emb(self, t0: int, t1: int) -> torch.Tensor:
        y, x, c = self.pos_index[:, t0:t1]
        return self.row_emb(y) + self.col_emb(x) + self.chan_emb(c)

    def check_tokens(self, tokens: torch.Tensor) -> None:
        cfg = self.config
        if tokens.dim() != 2 or tokens.shape[1] > cfg.seq_len or tokens.dtype != torch.long:
            raise ShapeError(f"tokens must be long (B, N) with N <= {cfg.seq_len} (= H*W*C for "
                             f"{cfg.shape}); got {tuple(tokens.shape)} {tokens.dtype}")

    def embed_inputs(self, tokens: torch.Tensor) -> torch.Tensor:
        """Input vectors for positions 0..N-1: start, then embeddings of tokens 0..N-2."""
        b, n = tokens.shape
        start = self.start.expand(b, 1, -1)
        x = torch.cat([start, self.tok_emb(tokens[:, : n - 1])], dim=1) if n > 1 else start[:, :n]
        return x + self.pos_emb(0, n)

    def forward(self, tokens: torch.Tensor, caches=None) -> torch.Tensor:
        self.check_tokens(tokens)
        x = self.embed_inputs(tokens)
        for i, blk in enumerate(self.blocks):
            x = blk(x, None if caches is None else caches[i])
        return self.head(self.ln_f(x))

    @torch.no_grad()
    def step(self, prev: torch.Tensor | None, t: int, caches) -> torch.Tensor:
        """Logits (B, V) at position t given token t-1 (`prev`, (B,) long; None at t = 0)."""
        if t == 0:
            x = self.start.expand(caches[0].batch, 1, -1)
        else:
            x = self.tok_emb(prev.view(-1, 1))
        x = x + self.pos_emb(t, t + 1)
        for blk, cache in zip(self.blocks, caches):
            x = blk.step(x, t, cache)
        return self.head(self.ln_f(x))[:, 0]

    def nll(self, tokens: torch.Tensor) -> torch.Tensor:
        """Mean negative log-likelihood (nats) per subpixel."""
        logits = self(tokens)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens.reshape(-1))
