"""Decoder-only Transformer over raster-order pixel tokens with per-layer sparse attention.

`model(tokens)` -> logits (B, N, 2**bits); logits[:, t] is the distribution of tokens[:, t] given
tokens[:, :t] (and, for inpainting models, `context=model.make_context(images, masks)`: the known
pixels on every side; see imggen.inpainting.context). Internally the input at position t is the embedding of token t-1 (a learned start
vector at t = 0) plus factorised row/column/channel embeddings of position t, so the query at t
predicts subpixel t and reads positions the layer's pattern allows.

`model.step(prev, t, caches)` computes the logits at position t from the caches (decode path);
`model.extend(prev, t0, caches)` those of a run of positions with known inputs, in one pass.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.utils.checkpoint

from imggen.config import ModelConfig
from imggen.inpainting.context import ContextEncoder, context_channels, make_context
from imggen.inpainting.regress import HoleRegressor, pixel_values
from imggen.errors import ShapeError
from imggen.fused import ln_linear, ln_mlp
from imggen import mixture
from imggen.decode.panels import native_step, step_linear
from imggen.patterns import Pattern
from imggen.attention import forced_backend, sparse_attention
from imggen.tokens import position_coords


EXTEND_TOKENS = 1024  # batch x positions per pass of ImageTransformer.extend (measured: bench/RESULTS.md 8)


def check_range(tokens: torch.Tensor, vocab: int) -> None:
    """ShapeError unless every token is in 0..vocab-1 (one min and max, not a traceback from the embedding)."""
    if not tokens.numel():
        return
    lo, hi = (int(v) for v in torch.aminmax(tokens))
    if lo < 0 or hi >= vocab:
        raise ShapeError(f"tokens must be in 0..{vocab - 1} ({vocab.bit_length() - 1}-bit values); "
                         f"got values {lo}..{hi}")


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, pattern: Pattern):
        super().__init__()
        self.heads, self.head_dim = cfg.heads, cfg.dim // cfg.heads
        self.pattern, self.backend = pattern, cfg.backend
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.proj = nn.Linear(cfg.dim, cfg.dim)

    def _qkv(self, qkv):
        b, n, _ = qkv.shape
        return qkv.view(b, n, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)

    def forward(self, qkv, cache=None, t0: int | None = None):
        """qkv = self.qkv(normalised x), (B, N, 3*dim) -> (B, N, dim); with t0, positions
        t0..t0+N-1 through `cache` (Cache.extend), else positions 0..N-1 (prefilling `cache`)."""
        b, n, c = qkv.shape[0], qkv.shape[1], qkv.shape[2] // 3
        q, k, v = self._qkv(qkv)
        if t0 is not None:
            o = cache.extend(q, k, v, t0)
        else:
            o = sparse_attention(q, k, v, self.pattern, self.backend)
            if cache is not None:  # prefill: hand the cache every position's k, v (and diffusion states)
                cache.prefill(q, k, v)
        return self.proj(o.transpose(1, 2).reshape(b, n, c))

    def step(self, x, t: int, cache, linear, ln):
        """x + attention(ln(x)) for x (B, dim) at position t, reading and updating `cache`;
        linear as imggen.decode.panels.step_linear gives it."""
        qkv = linear(self.qkv, x, ln=ln).view(x.shape[0], 3, self.heads, self.head_dim)
        q, k, v = qkv.unbind(1)  # (B, H, D) each
        return linear(self.proj, cache.attend(q, k, v, t).reshape(x.shape[0], -1), add=x)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, pattern: Pattern):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(cfg.dim), nn.LayerNorm(cfg.dim)
        self.attn = Attention(cfg, pattern)
        hidden = int(cfg.mlp_ratio * cfg.dim)
        self.mlp = nn.Sequential(nn.Linear(cfg.dim, hidden), nn.GELU(approximate="tanh"),
                                 nn.Linear(hidden, cfg.dim))
        self.drop = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()  # p=0 saves no mask

    def forward(self, x, cache=None, t0=None):
        # LayerNorms fused into the layers that read them (imggen.fused): the backward recomputes them
        x = x + self.drop(self.attn(ln_linear(x, self.ln1, self.attn.qkv), cache, t0))
        return x + self.drop(ln_mlp(x, self.ln2, self.mlp[0], self.mlp[2]))

    def step(self, x, t, cache, linear):
        x = self.attn.step(x, t, cache, linear, self.ln1)
        return linear(self.mlp[2], linear(self.mlp[0], x, ln=self.ln2, act=True), add=x)


class ImageTransformer(nn.Module):
    scores_tokens = True  # forward(tokens, nll=True) gives -log p of each token (imggen.eval.bpd reads it)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg.validate()
        forced_backend()  # a bad IMGGEN_BACKEND is a clear error before any work
        self.patterns = cfg.patterns()
        self.checkpointing = False  # activation checkpointing per block (set by training)
        d = cfg.dim
        self.tok_emb = nn.Embedding(cfg.vocab, d)
        self.start = nn.Parameter(torch.zeros(d))
        self.row_emb = nn.Embedding(cfg.height, d)
        self.col_emb = nn.Embedding(cfg.width, d)
        self.chan_emb = nn.Embedding(cfg.channels, d)
        self.blocks = nn.ModuleList(Block(cfg, p) for p in self.patterns)
        self.context = None if cfg.context == "none" else ContextEncoder(
            cfg.channels, cfg.height, cfg.width, cfg.context_width, d, cfg.context_slices, cfg.context_fill)
        self.regressor = None  # model.context_fill regress: the frozen regressor whose fill is a context channel
        if cfg.context_fill == "regress":
            self.regressor = HoleRegressor(cfg.channels, cfg.height, cfg.width, cfg.regress_width,
                                           cfg.regress_hidden, cfg.regress_fill).requires_grad_(False)
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, mixture.head_width(cfg.mixture, cfg.vocab), bias=False)
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
        check_range(tokens, cfg.vocab)

    def embed_inputs(self, tokens: torch.Tensor) -> torch.Tensor:
        """Input vectors for positions 0..N-1: start, then embeddings of tokens 0..N-2."""
        b, n = tokens.shape
        start = self.start.expand(b, 1, -1)
        x = torch.cat([start, self.tok_emb(tokens[:, : n - 1])], dim=1) if n > 1 else start[:, :n]
        return x + self.pos_emb(0, n)

    # ---- context (inpainting models) -------------------------------------------------------
    def make_context(self, images, masks, fills=None) -> torch.Tensor:
        """uint8 images (B, C, H, W) and bool masks (B, H, W) (True = unknown) -> the context tensor (a
        2.5-D model, model.context_slices = s: the slices z-s..z+s, (B, 2s+1, C, H, W) and (B, 2s+1, H, W)).
        `fills` (float (B, C, H, W), 0..255, NaN: none): the holes' classic fills, for models with a
        context_fill (default: the 2-D biharmonic fill of each image; context_fill regress: the fill of the
        model's regressor)."""
        if self.context is None:
            raise ShapeError("this model was trained without a context (model.context = 'none'); inpaint with "
                             "imggen.inpaint(model, image, mask) or train one with --task inpaint")
        cfg = self.config
        if self.regressor is not None:  # a given fill wins; the regressor fills the images without one
            images, masks = torch.as_tensor(images), torch.as_tensor(masks).bool()
            fills = (torch.full(images.shape, float("nan")) if fills is None
                     else torch.as_tensor(fills).float().reshape(images.shape).clone())
            missing = torch.isnan(fills).flatten(1).any(1)
            if missing.any():
                made = pixel_values(self.regressor, images[missing], masks[missing])
                fills[missing] = torch.where(torch.isnan(fills[missing]), made, fills[missing])
        return make_context(images, masks, cfg.shape, cfg.context_slices, cfg.context_fill,
                            fills).to(self.start.device)

    def context_features(self, context: torch.Tensor | None, batch: int) -> torch.Tensor | None:
        """Per-position context features (B, N, dim) (None for models without a context)."""
        cfg = self.config
        if self.context is None:
            if context is not None:
                raise ShapeError("context= given to a model trained without a context (model.context = 'none')")
            return None
        if context is None:
            raise ShapeError("this model was trained for inpainting with a context: call model(tokens, "
                             "context=model.make_context(images, masks))")
        c = context_channels(cfg.channels, cfg.context_slices, cfg.context_fill)
        if tuple(context.shape) != (batch, c, cfg.height, cfg.width):
            raise ShapeError(f"context must be ({batch}, {c}, {cfg.height}, {cfg.width}) "
                             f"(model.make_context); got {tuple(context.shape)}")
        f = self.context(context.to(self.start.dtype)).flatten(2).transpose(1, 2)  # (B, H*W, dim)
        y, x, _ = self.pos_index
        return f[:, y * cfg.width + x]

    def forward(self, tokens: torch.Tensor, caches=None, context: torch.Tensor | None = None,
                nll: bool = False) -> torch.Tensor:
        """Logits (B, N, V) (a mixture model's: its log-probabilities); `context` (model.make_context) for
        context-trained models. With nll=True, -log p(tokens) (B, N) in nats instead (training's loss:
        a mixture model scores each token's own bin alone, imggen.mixture.token_nll)."""
        self.check_tokens(tokens)
        x = self.embed_inputs(tokens)
        feats = self.context_features(context, tokens.shape[0])
        if feats is not None:
            x = x + feats[:, : tokens.shape[1]]
        for i, blk in enumerate(self.blocks):
            if self.checkpointing and caches is None and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(blk, x, use_reentrant=False)
            else:
                x = blk(x, None if caches is None else caches[i])
        out = self.head_out(x)
        if not nll:
            return self.to_logits(out)
        if self.config.mixture:
            return mixture.token_nll(out, tokens, self.config.vocab)
        return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), tokens.reshape(-1),
                                           reduction="none").view(tokens.shape)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The logits of hidden states x (..., dim)."""
        return self.to_logits(self.head_out(x))

    def head_out(self, x: torch.Tensor) -> torch.Tensor:
        """head(ln_f(x)), in float32 even under bf16 autocast: logits rounded to bfloat16 (8 bits of
        mantissa, errors of 0.03-0.06 at logits of 10-20) cost bits/dim (bench/RESULTS.md section 13)."""
        kind = x.device.type
        if not torch.is_autocast_enabled(kind):
            return self.head(self.ln_f(x))
        with torch.autocast(kind, enabled=False):
            return self.head(self.ln_f(x.float()))

    def to_logits(self, out: torch.Tensor) -> torch.Tensor:
        """The head's outputs (..., head width) -> logits (..., V): themselves, or the mixture's V
        log-probabilities (imggen.mixture.log_probs)."""
        return mixture.log_probs(out, self.config.vocab) if self.config.mixture else out

    @torch.no_grad()
    def step(self, prev: torch.Tensor | None, t: int, caches, features: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, V) at position t given token t-1 (`prev`, (B,) long; None at t = 0);
        `features` = context_features(context) of a context-trained model, computed once."""
        fused = native_step(self, caches)
        if fused is not None:  # imggen.decode.native: the whole step in one call
            return self.to_logits(fused.step(prev, t, self._features(features, t)))
        if t == 0:
            x = self.start.expand(caches[0].batch, -1)
        else:
            x = self.tok_emb(prev.view(-1))
        x = self._add_features(x + self.pos_emb(t, t + 1), features, t)  # (B, dim): 2-D throughout
        linear = step_linear(self, caches)
        for blk, cache in zip(self.blocks, caches):
            x = blk.step(x, t, cache, linear)
        return self.to_logits(linear(self.head, x, ln=self.ln_f))

    @torch.no_grad()
    def extend(self, prev: torch.Tensor, t0: int, caches, features: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, m, V) at positions t0..t0+m-1 (t0 >= 1) given tokens t0-1..t0+m-2 (`prev`,
        (B, m) long), as m calls of step() would give them and leaving the caches as they would: one
        pass for a run of known tokens (inpainting: imggen.sampling.sample)."""
        if t0 < 1 or prev.dim() != 2 or t0 + prev.shape[1] > self.config.seq_len:
            raise ShapeError(f"extend takes t0 >= 1 and tokens (B, m) with t0 + m <= {self.config.seq_len}; "
                             f"got t0={t0}, {tuple(prev.shape)}")
        step = max(1, EXTEND_TOKENS // prev.shape[0])
        if prev.shape[1] > step:  # in parts: small intermediates stay in the allocator's reused memory
            return torch.cat([self.extend(prev[:, i:i + step], t0 + i, caches, features)
                              for i in range(0, prev.shape[1], step)], dim=1)
        t1 = t0 + prev.shape[1]
        x = self._add_features(self.tok_emb(prev) + self.pos_emb(t0, t1), features, slice(t0, t1))
        for blk, cache in zip(self.blocks, caches):
            x = blk(x, cache, t0)
        return self.to_logits(self.head(self.ln_f(x)))

    def _add_features(self, x, features, at):
        f = self._features(features, at)
        return x if f is None else x + f

    def _features(self, features, at):
        """features[:, at] of a context model (ShapeError if missing); None for a model without a context."""
        if self.context is None:
            return None
        if features is None:
            raise ShapeError("this model was trained for inpainting with a context: pass features="
                             "model.context_features(context, batch) to step() / extend()")
        return features[:, at]
