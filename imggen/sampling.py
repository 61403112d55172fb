"""Sampling, teacher forcing through the decode caches, and the sample.py CLI."""
from __future__ import annotations

import argparse
import sys
import time

import torch
from tqdm import tqdm

from imggen.cache import make_caches
from imggen.errors import ImggenError, ShapeError
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
    bar = tqdm(range(start, n), desc="sampling", unit="tok", disable=not progress, leave=False)
    for t in bar:
        logits = model.step(tokens[:, t - 1] if t else None, t, caches)
        nxt = _pick(logits, temperature, top_k, gen)
        if known_mask is not None:
            nxt = torch.where(known_mask[:, t], known[:, t], nxt)
        logp += torch.log_softmax(logits.float(), -1).gather(-1, nxt[:, None])[:, 0]
        tokens[:, t] = nxt
    return (tokens, logp) if return_logprob else tokens


# --------------------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="sample.py", description="Sample images from a trained imggen model.")
    ap.add_argument("--checkpoint", required=True, help="run directory (e.g. runs/demo) or checkpoint folder")
    ap.add_argument("--num", type=int, default=16, help="number of images to draw (default 16)")
    ap.add_argument("--batch-size", type=int, default=16, help="images sampled in parallel (default 16)")
    ap.add_argument("--out", default="samples.png", help="output PNG grid (default samples.png)")
    ap.add_argument("--seed", type=int, default=None, help="random seed: same seed, same images")
    ap.add_argument("--temperature", type=float, default=1.0, help="softmax temperature (default 1.0)")
    ap.add_argument("--top-k", type=int, default=None, help="sample only from the k most likely values")
    ap.add_argument("--cache", choices=["auto", "full", "evict"], default="auto",
                    help="decode cache: evict (memory-bounded, default when available) or full")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device")
    ap.add_argument("--scale", type=int, default=4, help="upscale factor of the saved grid (default 4)")
    return ap


def main(argv=None) -> int:
    from imggen.checkpoint import load_model
    from imggen.images import save_grid

    args = build_parser().parse_args(argv)
    try:
        if args.num < 1 or args.batch_size < 1:
            raise ShapeError("--num and --batch-size must be >= 1")
        model = load_model(args.checkpoint, device=args.device)
        images, t0 = [], time.time()
        done = 0
        while done < args.num:
            b = min(args.batch_size, args.num - done)
            seed = None if args.seed is None else args.seed + done
            toks = sample(model, b, temperature=args.temperature, top_k=args.top_k, seed=seed,
                          cache=args.cache, progress=True)
            images.append(detokenize(model, toks))
            done += b
        imgs = torch.cat(images).numpy()
        save_grid(imgs, args.out, scale=args.scale)
        n_tok = args.num * model.config.seq_len
        print(f"wrote {args.out}: {args.num} images, {n_tok / (time.time() - t0):.0f} tokens/s")
    except ImggenError as e:
        print(f"sample.py: error: {e}", file=sys.stderr)
        return 2
    return 0
