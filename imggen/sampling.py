"""Sampling, teacher forcing through the decode caches, and the sample.py CLI."""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch
from tqdm import tqdm

from imggen.cache import make_caches
from imggen.errors import ConfigError, ImggenError, ShapeError
from imggen.tokens import detokenize_tokens


def detokenize(model, tokens: torch.Tensor) -> torch.Tensor:
    """Tokens (B, N) of a model -> uint8 images (B, C, H, W)."""
    cfg = model.config
    return detokenize_tokens(tokens.cpu(), cfg.bits, cfg.shape)


@torch.no_grad()
def teacher_force(model, tokens: torch.Tensor, cache: str = "auto", prefill: int = 0) -> torch.Tensor:
    """Logits (B, N, V) computed token by token through the decode caches (parity with model(tokens)).

    `prefill` = p runs positions 0..p-1 in one parallel forward that fills the caches first.
    """
    model.check_tokens(tokens)
    b, n = tokens.shape
    caches = make_caches(model, b, _cache_kind(cache))
    out = []
    if prefill:
        out.append(model(tokens[:, :prefill], caches=caches))
    for t in range(prefill, n):
        out.append(model.step(tokens[:, t - 1] if t else None, t, caches)[:, None])
    return torch.cat(out, dim=1)


def _cache_kind(cache: str) -> str:
    if cache == "auto":
        try:
            import imggen.eviction  # noqa: F401
            return "evict"
        except ImportError:
            return "full"
    return cache


def _pick(logits: torch.Tensor, temperature: float, top_k: int | None, gen) -> torch.Tensor:
    logits = logits.float()
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if temperature <= 0 or top_k == 1:
        return logits.argmax(-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    return torch.multinomial(probs.cpu(), 1, generator=gen).view(-1).to(logits.device)


@torch.no_grad()
def sample(model, batch_size: int, known=None, known_mask=None, temperature: float = 1.0,
           top_k: int | None = None, seed: int | None = None, cache: str = "auto",
           progress: bool = False, return_logprob: bool = False):
    """Draw token sequences (B, N) long. Positions where known_mask is True keep `known`.

    The longest prefix known for every image is processed in one parallel forward (prefill).
    With return_logprob=True also returns each sequence's total log-likelihood (nats).
    """
    cfg = model.config
    n = cfg.seq_len
    device = next(model.parameters()).device
    if top_k is not None and top_k < 1:
        raise ConfigError(f"top_k must be >= 1 (or None), got {top_k}")
    if known is not None or known_mask is not None:
        if known is None or known_mask is None:
            raise ShapeError("pass both known and known_mask (or neither)")
        known, known_mask = torch.as_tensor(known).long().to(device), torch.as_tensor(known_mask).bool().to(device)
        if known.shape != (batch_size, n) or known_mask.shape != (batch_size, n):
            raise ShapeError(f"known and known_mask must be ({batch_size}, {n}); got {tuple(known.shape)} "
                             f"and {tuple(known_mask.shape)}")
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    caches = make_caches(model, batch_size, _cache_kind(cache))
    tokens = torch.zeros(batch_size, n, dtype=torch.long, device=device)
    logp = torch.zeros(batch_size, device=device)
    start = 0
    if known_mask is not None:
        unknown = (~known_mask).any(0).nonzero()
        start = int(unknown[0]) if len(unknown) else n
        tokens[:, :start] = known[:, :start]
        if start:
            logits = model(tokens[:, :start], caches=caches)
            logp += torch.log_softmax(logits.float(), -1).gather(-1, tokens[:, :start, None]).sum((1, 2))
    # one step decodes batch_size tokens: unit_scale makes the bar's rate tokens/s
    bar = tqdm(range(start, n), desc="sampling", unit="tok", unit_scale=batch_size, disable=not progress,
               leave=False)
    for t in bar:
        logits = model.step(tokens[:, t - 1] if t else None, t, caches)
        nxt = _pick(logits, temperature, top_k, gen)
        if known_mask is not None:
            nxt = torch.where(known_mask[:, t], known[:, t], nxt)
        logp += torch.log_softmax(logits.float(), -1).gather(-1, nxt[:, None])[:, 0]
        tokens[:, t] = nxt
    return (tokens, logp) if return_logprob else tokens


# ------------------------------------------------------------------- ranking, completion, inpainting
def generate(model, num: int, known=None, known_mask=None, rank: int = 1, batch_size: int = 16,
             temperature: float = 1.0, top_k: int | None = None, seed: int | None = None,
             cache: str = "auto", progress: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`num` sequences; with rank = R each is the most likely (whole-image log-likelihood, known
    positions included) of R candidates. known / known_mask: (N,) or (num, N) as in `sample`.

    Sequences are drawn in chunks of `batch_size`; chunk i is seeded with seed + (index of its first
    sequence), so the same seed gives the same images. Returns (tokens (num, N), logp (num,)).
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
    toks, logps = [], []
    for i in range(0, total, batch_size):
        j = min(total, i + batch_size)
        t, lp = sample(model, j - i, None if known is None else known[i:j], None if known is None else known_mask[i:j],
                       temperature=temperature, top_k=top_k, seed=None if seed is None else seed + i,
                       cache=cache, progress=progress, return_logprob=True)
        toks.append(t.cpu())
        logps.append(lp.cpu())
    tokens, logp = torch.cat(toks).view(num, rank, n), torch.cat(logps).view(num, rank)
    best = logp.argmax(1)
    idx = torch.arange(num)
    return tokens[idx, best], logp[idx, best]


def _as_image(model, image) -> torch.Tensor:
    """uint8 (C, H, W) or (1, C, H, W) -> (C, H, W), checked against the model (ShapeError)."""
    from imggen.tokens import tokenize

    image = torch.as_tensor(image)
    if image.dim() == 4 and image.shape[0] == 1:
        image = image[0]
    tokenize(image, model.config.bits, shape=model.config.shape)  # raises a ShapeError naming both shapes
    return image


def inpaint(model, image, mask, num: int = 1, rank: int = 1, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """Fill the unknown pixels of one image: `num` fills, uint8 (num, C, H, W), and their log-likelihoods.

    image: uint8 (C, H, W); mask: (H, W) (or (1, H, W)), nonzero / True = unknown (to fill). Known
    pixels are teacher-forced and copied exactly into the result; every subpixel of an unknown pixel
    is sampled. Other keyword arguments go to `generate` (rank, temperature, top_k, seed, ...).
    """
    from imggen.tokens import tokenize

    cfg = model.config
    image = _as_image(model, image)
    mask = torch.as_tensor(mask)
    if mask.dim() == 3 and mask.shape[0] == 1:
        mask = mask[0]
    if mask.dim() != 2 or tuple(mask.shape) != (cfg.height, cfg.width):
        raise ShapeError(f"mask has shape {tuple(mask.shape)} but the image is {cfg.height}x{cfg.width} "
                         f"(H x W); the mask must be one value per pixel of the image")
    unknown = mask != 0
    if not bool(unknown.any()):
        raise ShapeError("the mask marks no pixel as unknown (nonzero = fill); nothing to inpaint")
    known = tokenize(image, cfg.bits, shape=cfg.shape)[0]
    known_mask = (~unknown)[..., None].expand(cfg.height, cfg.width, cfg.channels).reshape(-1)
    tokens, logp = generate(model, num, known, known_mask, rank=rank, **kw)
    filled = detokenize(model, tokens)
    keep = (~unknown)[None, None].expand_as(filled)
    filled[keep] = image[None].expand_as(filled)[keep].to(filled.dtype)  # known subpixels exactly
    return filled, logp


def prefix_mask(model, rows: int) -> torch.Tensor:
    """(H, W) bool mask for prefix completion: rows >= `rows` unknown."""
    h, w = model.config.height, model.config.width
    if not 0 <= rows < h:
        raise ShapeError(f"--prefix-rows must be in 0..{h - 1} for {h}-row images, got {rows}"
                         + ("; with every row known there is nothing to complete" if rows >= h else ""))
    m = torch.zeros(h, w, dtype=torch.bool)
    m[rows:] = True
    return m


# --------------------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="sample.py", description="Sample images from a trained imggen model.")
    ap.add_argument("--checkpoint", required=True, help="run directory (e.g. runs/demo) or checkpoint folder")
    ap.add_argument("--num", type=int, default=None,
                    help="number of images to draw (default 16; 1 fill with --inpaint / --prefix)")
    ap.add_argument("--batch-size", type=int, default=16,
                    help="sequences sampled in parallel, --rank candidates included (default 16)")
    ap.add_argument("--out", default="samples.png",
                    help="output PNG (default samples.png): a grid, or the filled image for --inpaint / --prefix")
    ap.add_argument("--seed", type=int, default=None, help="random seed: same seed, same images")
    ap.add_argument("--temperature", type=float, default=1.0, help="softmax temperature (default 1.0)")
    ap.add_argument("--top-k", type=int, default=None, help="sample only from the k most likely values")
    ap.add_argument("--cache", choices=["auto", "full", "evict"], default="auto",
                    help="decode cache: evict (memory-bounded, default when available) or full")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device")
    ap.add_argument("--scale", type=int, default=None,
                    help="upscale factor of the saved image (default 4 for sample grids, 1 for fills)")
    ap.add_argument("--rank", type=int, default=1, metavar="N",
                    help="draw N candidates per image, keep the one with the highest log-likelihood")
    ap.add_argument("--prefix", metavar="IMG", help="complete this image from its first --prefix-rows rows")
    ap.add_argument("--prefix-rows", type=int, metavar="R", help="rows of --prefix to keep")
    ap.add_argument("--inpaint", metavar="IMG", help="fill the unknown pixels of this image (needs --mask)")
    ap.add_argument("--mask", metavar="MASK", help="mask PNG of --inpaint's size: nonzero = unknown (fill)")
    ap.add_argument("--triplet", metavar="PATH",
                    help="with --inpaint / --prefix: also write original | masked | filled side by side")
    return ap


def _check_args(args) -> None:
    if args.inpaint and args.prefix:
        raise ConfigError("use either --inpaint or --prefix, not both")
    if args.inpaint and not args.mask:
        raise ConfigError("--inpaint needs --mask MASK (a PNG of the image's size, nonzero = unknown)")
    if args.mask and not args.inpaint:
        raise ConfigError("--mask only applies with --inpaint IMG")
    if args.prefix and args.prefix_rows is None:
        raise ConfigError("--prefix needs --prefix-rows R (rows of the image to keep)")
    if args.prefix_rows is not None and not args.prefix:
        raise ConfigError("--prefix-rows only applies with --prefix IMG")
    if args.triplet and not (args.inpaint or args.prefix):
        raise ConfigError("--triplet only applies with --inpaint or --prefix")
    if (args.num is not None and args.num < 1) or args.batch_size < 1 or args.rank < 1:
        raise ConfigError("--num, --batch-size and --rank must be >= 1")
    if args.top_k is not None and args.top_k < 1:
        raise ConfigError(f"--top-k must be >= 1, got {args.top_k}")
    if args.scale is not None and args.scale < 1:
        raise ConfigError("--scale must be >= 1")


def _load_input(path: str, channels: int) -> torch.Tensor:
    """Image file -> uint8 (C, H, W); a colour image for a grayscale model (or the reverse) is a
    ShapeError rather than a silent conversion."""
    from PIL import Image

    from imggen.images import load_image

    rgb = load_image(path, 3)  # DataError when missing or unreadable
    with Image.open(path) as im:
        gray_file = im.mode in ("1", "L", "LA", "I", "I;16", "F")
    if channels == 1 and not ((rgb[0] == rgb[1]).all() and (rgb[1] == rgb[2]).all()):
        raise ShapeError(f"image {path} is a colour image but the checkpoint models grayscale (1 channel) images")
    if channels == 3 and gray_file:
        raise ShapeError(f"image {path} is grayscale but the checkpoint models RGB (3 channel) images")
    return torch.from_numpy(rgb[:1].copy() if channels == 1 else rgb)


def _load_mask(path: str) -> torch.Tensor:
    """Mask PNG -> (H, W) bool, True where any channel is nonzero (unknown)."""
    from imggen.images import load_image

    return torch.from_numpy(load_image(path, 3)).ne(0).any(0)


def main(argv=None) -> int:
    from imggen.checkpoint import load_model
    from imggen.images import save_grid, save_image

    args = build_parser().parse_args(argv)
    try:
        _check_args(args)
        conditional = bool(args.inpaint or args.prefix)
        num = args.num or (1 if conditional else 16)
        model = load_model(args.checkpoint, device=args.device)
        cfg = model.config
        kw = dict(rank=args.rank, batch_size=args.batch_size, temperature=args.temperature, top_k=args.top_k,
                  seed=args.seed, cache=args.cache, progress=True)
        t0 = time.time()
        if conditional:
            image = _as_image(model, _load_input(args.inpaint or args.prefix, cfg.channels))
            if args.inpaint:
                mask = _load_mask(args.mask)
                if tuple(mask.shape) != tuple(image.shape[1:]):
                    raise ShapeError(f"mask {args.mask} is {mask.shape[0]}x{mask.shape[1]} but image {args.inpaint} "
                                     f"is {image.shape[1]}x{image.shape[2]} (H x W); they must match")
            else:
                mask = prefix_mask(model, args.prefix_rows)
            imgs, logp = inpaint(model, image, mask, num=num, **kw)
            imgs = imgs.numpy()
            scale = args.scale or 1
            if num == 1:
                save_image(imgs[0].transpose(1, 2, 0), args.out, scale=scale)
            else:
                save_grid(imgs, args.out, scale=scale)
            if args.triplet:
                masked = image.clone()
                masked[:, mask] = 128
                row = np.concatenate([image[None].numpy(), masked[None].numpy(), imgs])
                save_grid(row, args.triplet, nrow=len(row), scale=scale)
            n_tok = num * args.rank * int(mask.sum()) * cfg.channels
        else:
            toks, logp = generate(model, num, **kw)
            save_grid(detokenize(model, toks).numpy(), args.out, scale=args.scale or 4)
            n_tok = num * args.rank * cfg.seq_len
        extra = f" and {args.triplet}" if args.triplet else ""
        print(f"wrote {args.out}{extra}: {num} image(s), mean log-likelihood {logp.mean().item():.1f} nats, "
              f"{n_tok / (time.time() - t0):.0f} sampled tokens/s")
    except ImggenError as e:
        print(f"sample.py: error: {e}", file=sys.stderr)
        return 2
    return 0
