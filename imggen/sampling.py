"""Sampling, teacher forcing through the decode caches, ranking, prefix completion and inpainting."""
from __future__ import annotations

import math
import time

import numpy as np
import torch
from tqdm import tqdm

from imggen import graphs
from imggen.decode import native
from imggen.decode import make_caches
from imggen.errors import ConfigError, ImggenError, ShapeError
from imggen.model import check_range
from imggen.decode.panels import is_large
from imggen.threads import decode_tick
from imggen.tokens import detokenize_tokens


def detokenize(model, tokens: torch.Tensor) -> torch.Tensor:
    """Tokens (B, N) of a model -> uint8 images (B, C, H, W)."""
    cfg = model.config
    return detokenize_tokens(tokens.cpu(), cfg.bits, cfg.shape)


@torch.no_grad()
def teacher_force(model, tokens: torch.Tensor, cache: str = "evict", prefill: int = 0,
                  context: torch.Tensor | None = None) -> torch.Tensor:
    """Logits (B, N, V) computed token by token through the decode caches (parity with
    model(tokens, context=context)). `prefill` = p runs positions 0..p-1 in one parallel forward
    that fills the caches first."""
    model.check_tokens(tokens)
    b, n = tokens.shape
    caches = make_caches(model, b, cache)
    feats = model.context_features(context, b)
    out = []
    if prefill:
        out.append(model(tokens[:, :prefill], caches=caches, context=context))
    for t in range(prefill, n):
        out.append(model.step(tokens[:, t - 1] if t else None, t, caches, feats)[:, None])
    return torch.cat(out, dim=1)


def uniforms(batch: int, n: int, seed: int | None, first: int = 0) -> torch.Tensor:
    """(batch, n) uniforms in [0, 1) that drive the draws of `batch` sequences of n tokens. With a
    seed, sequence j's come from its own generator, keyed by (seed, first + j): a sequence depends
    on the seed and its index only, not on the batch it is drawn in, and nearby seeds share no
    sequence. Without one, the global RNG."""
    if seed is None:
        return torch.rand(batch, n)
    rows = []
    for j in range(first, first + batch):
        key = np.random.SeedSequence([seed % 2 ** 63, j]).generate_state(1, np.uint64)[0]
        rows.append(torch.rand(n, generator=torch.Generator().manual_seed(int(key) >> 1)))
    return torch.stack(rows)


def _pick(logits: torch.Tensor, temperature: float, top_k: int | None, u: torch.Tensor) -> torch.Tensor:
    """A token per row of logits (B, V): the argmax when greedy (temperature 0 or top_k 1), else the
    inverse CDF of the tempered (top-k) softmax at u (B,)."""
    logits = logits.float()
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if temperature == 0 or top_k == 1:
        return logits.argmax(-1)
    cdf = torch.softmax(logits / temperature, dim=-1).cumsum_(-1)
    total = cdf[:, -1:]
    x = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))  # below the top
    return torch.searchsorted(cdf, x, right=True).view(-1)  # the first token whose cdf exceeds x


def _loglik(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Log-likelihood (nats) per sequence of tokens (B, m) under logits (B, m, V)."""
    return torch.log_softmax(logits.float(), -1).gather(-1, tokens[..., None]).sum((1, 2))


@torch.no_grad()
def sample(model, batch_size: int, known=None, known_mask=None, temperature: float = 1.0,
           top_k: int | None = None, seed: int | None = None, cache: str = "evict",
           progress: bool = False, return_logprob: bool = False, context: torch.Tensor | None = None,
           first: int = 0, graph: str = "auto"):
    """Draw token sequences (B, N) long. Positions where known_mask is True keep `known`;
    `context` (model.make_context) for context-trained models. temperature 0 = greedy. With a seed,
    sequence j is drawn from the stream (seed, first + j) (`uniforms`).

    The longest prefix known for every image is processed in one parallel forward (prefill), and
    each later run of positions known for every image in one pass through the caches (extend).
    With return_logprob=True also returns each sequence's total log-likelihood (nats).

    graph (imggen.graphs.GRAPH_MODES): "auto" replays each decode step as a CUDA graph on CUDA and
    takes the eager step elsewhere (the native C step on CPU); "on" requires the graph; "eager"
    takes the static step without one (the graph's arithmetic, for checks); "off" the eager step.
    """
    cfg = model.config
    n = cfg.seq_len
    device = next(model.parameters()).device
    if batch_size < 1:
        raise ShapeError(f"batch_size must be >= 1, got {batch_size}")
    if top_k is not None and top_k < 1:
        raise ConfigError(f"top_k must be >= 1 (or None), got {top_k}")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ConfigError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature}")
    if known is not None or known_mask is not None:
        if known is None or known_mask is None:
            raise ShapeError("pass both known and known_mask (or neither)")
        known, known_mask = torch.as_tensor(known).long().to(device), torch.as_tensor(known_mask).bool().to(device)
        if known.shape != (batch_size, n) or known_mask.shape != (batch_size, n):
            raise ShapeError(f"known and known_mask must be ({batch_size}, {n}); got {tuple(known.shape)} "
                             f"and {tuple(known_mask.shape)}")
        check_range(known[known_mask], cfg.vocab)
    draws = uniforms(batch_size, n, seed, first).to(device)
    feats = model.context_features(context, batch_size)
    static = None
    if graphs.use_static(graph, device):  # the step at fixed addresses, replayed as a CUDA graph on CUDA
        static = graphs.decoder(model, batch_size, cache, temperature, top_k, known is not None, feats is not None,
                                graph != "eager" and device.type == "cuda", draws, known, known_mask, feats, _pick)
        caches, tokens, logp = static.caches, static.tokens, static.logp
    else:
        caches = make_caches(model, batch_size, cache)
        tokens = torch.zeros(batch_size, n, dtype=torch.long, device=device)
        logp = torch.zeros(batch_size, device=device)
    run_end = [0] * n  # u > t: positions t..u-1 are known for every image; 0: t is not
    if known_mask is not None:
        end = n
        for t, every in reversed(list(enumerate(known_mask.all(0).tolist()))):
            if every:
                run_end[t] = end
            else:
                end = t
    start = run_end[0]
    if start:
        tokens[:, :start] = known[:, :start]
        logits = model(tokens[:, :start], caches=caches, context=context)
        logp += _loglik(logits, tokens[:, :start])
    # one step decodes batch_size tokens: unit_scale makes the bar's rate tokens/s
    bar = tqdm(total=n - start, desc="sampling", unit="tok", unit_scale=batch_size, disable=not progress,
               leave=False)
    t, large = start, is_large(model)
    fast = device.type == "cpu" and top_k is None and draws.dtype == torch.float32 and native.available()
    first_draw = next((i for i in range(start, n) if not run_end[i]), n)
    while t < n:
        decode_tick(batch_size, large)
        if static is not None and not run_end[t]:  # a run of steps at fixed addresses, t on the device
            u = next((i for i in range(t, n) if run_end[i]), n)
            static.seek(t)
            for i in range(t, u):
                static.step()
                if i == first_draw:  # fail early on a broken model
                    _check_finite(static.logits)
                bar.update(1)
            t = u
            continue
        if run_end[t]:  # known for every image: one pass for the run
            u = run_end[t]
            tokens[:, t:u] = known[:, t:u]
            logits = model.extend(tokens[:, t - 1:u - 1], t, caches, feats)
            logp += _loglik(logits, tokens[:, t:u])
        else:
            u = t + 1
            logits = model.step(tokens[:, t - 1] if t else None, t, caches, feats)
            if t == first_draw:  # fail early on a broken model
                _check_finite(logits)
            if fast and logits.dtype == torch.float32:  # the same draw in one native call
                native.draw(logits, draws[:, t], temperature, tokens[:, t], logp,
                            *(() if known_mask is None else (known[:, t], known_mask[:, t])))
            else:
                nxt = _pick(logits, temperature, top_k, draws[:, t])
                if known_mask is not None:
                    nxt = torch.where(known_mask[:, t], known[:, t], nxt)
                tokens[:, t] = nxt
                logp += _loglik(logits[:, None], tokens[:, t:u])
        bar.update(u - t)
        t = u
    bar.close()
    if static is not None:  # the decoder's buffers serve its next run
        tokens, logp = tokens.clone(), logp.clone()
    _check_finite(logp)
    return (tokens, logp) if return_logprob else tokens


def _check_finite(x: torch.Tensor) -> None:
    if not bool(torch.isfinite(x).all()):
        raise ImggenError("the model's outputs are not finite (NaN or inf): its weights are corrupt or its training "
                          "diverged; sample from an earlier checkpoint")


@torch.no_grad()
def decode_seconds_per_step(model, batch: int, steps: int = 8) -> float:
    """Seconds one decode step of `batch` sequences takes (timed over a few steps, fresh caches)."""
    caches = make_caches(model, batch)
    cfg = model.config
    feats = None if model.context is None else torch.zeros(batch, cfg.seq_len, cfg.dim, device=model.start.device)
    prev = None
    t0 = time.perf_counter()
    for t in range(min(steps, cfg.seq_len)):
        prev = model.step(prev, t, caches, feats).argmax(-1)
    return (time.perf_counter() - t0) / min(steps, model.config.seq_len)


# ------------------------------------------------------------------- ranking, completion, inpainting
def generate(model, num: int, known=None, known_mask=None, rank: int = 1, batch_size: int = 16,
             temperature: float = 1.0, top_k: int | None = None, seed: int | None = None,
             cache: str = "evict", progress: bool = False, context: torch.Tensor | None = None,
             graph: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """`num` sequences; with rank = R each is the most likely (whole-image log-likelihood, known
    positions included) of R candidates. known / known_mask: (N,) or (num, N) as in `sample`;
    context: (1 or num, C+1, H, W) for context-trained models.

    Sequences are drawn in chunks of `batch_size`; with a seed, sequence i (candidate i of
    num * rank) is drawn from the stream (seed, i) (`uniforms`), whatever the batch size. Returns
    (tokens (num, N), logp (num,)).
    """
    if num < 1 or rank < 1 or batch_size < 1:
        raise ShapeError(f"num, rank and batch size must be >= 1; got {num}, {rank}, {batch_size}")
    n = model.config.seq_len
    total = num * rank
    if known is not None:
        known = torch.as_tensor(known).long().reshape(-1, n)
        known_mask = torch.as_tensor(known_mask).bool().reshape(-1, n)
        if len(known) not in (1, num) or len(known_mask) != len(known):
            raise ShapeError(f"known / known_mask must hold 1 or {num} sequences of {n} tokens")
        known = known.expand(num, n).repeat_interleave(rank, 0)
        known_mask = known_mask.expand(num, n).repeat_interleave(rank, 0)
    if context is not None:
        context = context.expand(num, *context.shape[1:]).repeat_interleave(rank, 0)
    toks, logps = [], []
    for i in range(0, total, batch_size):
        j = min(total, i + batch_size)
        t, lp = sample(model, j - i, None if known is None else known[i:j], None if known is None else known_mask[i:j],
                       temperature=temperature, top_k=top_k, seed=seed, first=i, cache=cache,
                       progress=progress, return_logprob=True, context=None if context is None else context[i:j],
                       graph=graph)
        toks.append(t.cpu())
        logps.append(lp.cpu())
    tokens, logp = torch.cat(toks).view(num, rank, n), torch.cat(logps).view(num, rank)
    best = logp.argmax(1)
    idx = torch.arange(num)
    return tokens[idx, best], logp[idx, best]


def as_image(model, image) -> torch.Tensor:
    """uint8 (C, H, W) or (1, C, H, W) -> (C, H, W), checked against the model (ShapeError)."""
    from imggen.tokens import tokenize

    image = torch.as_tensor(image)
    if image.dim() == 4 and image.shape[0] == 1:
        image = image[0]
    tokenize(image, model.config.bits, shape=model.config.shape)  # raises a ShapeError naming both shapes
    return image


def inpaint_images(model, images, masks, num: int = 1, samples: int = 1, reduce: str | None = None,
                   rank: int = 1, seed: int | None = 0, context: torch.Tensor | None = None,
                   **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """Fill the unknown pixels of each image: uint8 images (B, C, H, W), masks (B, H, W) (True =
    unknown) -> (filled uint8 (B, num, C, H, W), log-likelihoods (B, num)). Known pixels are
    teacher-forced and copied exactly; a context-trained model also sees them through its context,
    on every side of each hole pixel. `samples` = K > 1 with `reduce` = "mean" / "median" makes each
    fill the per-pixel mean / median of K samples (the point estimate PSNR and SSIM reward; its
    log-likelihood is then the mean of the K samples'). `context` = model.make_context(...) of the
    images, made here when None (a 2.5-D model, model.context_slices > 0, needs it made from each
    slice's neighbours: imggen.volumes). Other keywords go to `generate`."""
    from imggen.tokens import tokenize

    cfg = model.config
    images, masks = torch.as_tensor(images), torch.as_tensor(masks).bool()
    if masks.dim() == 4 and masks.shape[1] == 1:
        masks = masks[:, 0]
    if masks.dim() != 3 or tuple(masks.shape) != (len(images), cfg.height, cfg.width):
        raise ShapeError(f"masks must be ({len(images)}, {cfg.height}, {cfg.width}) (True = unknown) for images of "
                         f"shape {tuple(images.shape)}; got {tuple(masks.shape)}")
    if not bool(masks.flatten(1).any(1).all()):
        raise ShapeError("the mask marks no pixel as unknown (nonzero = fill); nothing to inpaint")
    if samples < 1 or (samples > 1) != (reduce in ("mean", "median")):
        raise ConfigError(f"samples={samples} with reduce={reduce!r}: use samples=1 (one sample), or samples > 1 "
                          f"with reduce 'mean' or 'median'")
    known = tokenize(images, cfg.bits, shape=cfg.shape)
    known_mask = (~masks)[..., None].expand(-1, -1, -1, cfg.channels).reshape(len(images), -1)
    if context is None and model.context is not None:
        context = model.make_context(images, masks)
    k = num * samples  # sequences per image, drawn together in batches across images
    tokens, logp = generate(model, len(images) * k, known.repeat_interleave(k, 0), known_mask.repeat_interleave(k, 0),
                            rank=rank, seed=seed, context=None if context is None else context.repeat_interleave(k, 0),
                            **kw)
    x = detokenize(model, tokens).float().view(len(images), num, samples, *cfg.shape)
    filled = x[:, :, 0] if samples == 1 else (x.mean(2) if reduce == "mean" else x.median(2).values)
    filled = filled.round_().clamp_(0, 255).to(torch.uint8)
    logps = logp.view(len(images), num, samples).mean(2)
    keep = (~masks)[:, None, None].expand_as(filled)
    filled[keep] = images[:, None].expand_as(filled)[keep]  # known subpixels exactly
    return filled, logps


def inpaint(model, image, mask, num: int = 1, rank: int = 1, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """Fill the unknown pixels of one image: `num` fills, uint8 (num, C, H, W), and their log-likelihoods.

    image: uint8 (C, H, W); mask: (H, W) (or (1, H, W)), nonzero / True = unknown (to fill). A
    context-trained model uses its context automatically. See `inpaint_images` for samples / reduce;
    other keywords go to `generate` (temperature, top_k, seed, ...).
    """
    cfg = model.config
    image = as_image(model, image)
    mask = torch.as_tensor(mask)
    if mask.dim() == 3 and mask.shape[0] == 1:
        mask = mask[0]
    if mask.dim() != 2 or tuple(mask.shape) != (cfg.height, cfg.width):
        raise ShapeError(f"mask has shape {tuple(mask.shape)} but the image is {cfg.height}x{cfg.width} "
                         f"(H x W); the mask must be one value per pixel of the image")
    filled, logp = inpaint_images(model, image[None], (mask != 0)[None], num=num, rank=rank, **kw)
    return filled[0], logp[0]


def prefix_mask(model, rows: int) -> torch.Tensor:
    """(H, W) bool mask for prefix completion: rows >= `rows` unknown."""
    h, w = model.config.height, model.config.width
    if not 0 <= rows < h:
        raise ShapeError(f"--prefix-rows must be in 0..{h - 1} for {h}-row images, got {rows}"
                         + ("; with every row known there is nothing to complete" if rows >= h else ""))
    m = torch.zeros(h, w, dtype=torch.bool)
    m[rows:] = True
    return m
