"""Training data: the splits as token tensors, the order the batches take and their inpainting
loss divisor. The order depends on (seed, step) only, so `--resume` continues the same stream."""
from __future__ import annotations

import numpy as np
import torch

from imggen.config import Config
from imggen.errors import ConfigError
from imggen.inpainting.tasks import TASKS
from imggen.tokens import tokenize


def load_data(cfg: Config, progress: bool = True):
    from imggen.datasets import load_dataset

    m = cfg.model
    opts = {"context_slices": m.context_slices} if m.context_slices else {}  # 2.5-D: each slice's neighbours
    if cfg.data.workers:
        opts["workers"] = cfg.data.workers
    if cfg.data.cache:
        opts["cache_dir"] = cfg.data.cache
    if TASKS[cfg.train.task].data_masks:
        opts["inpainting"] = True  # the data's own holes where it has them (BraTS mask files)
    if m.context_fill == "biharmonic3d":
        if cfg.data.spec.partition(":")[0] not in ("brats", "brats-demo"):
            raise ConfigError(f"model.context_fill biharmonic3d trains on the 3-D fills of volume data's holes "
                              f"(--data brats:DIR or brats-demo); --data {cfg.data.spec} has none: use "
                              f"--model.context_fill biharmonic")
        opts["fills3d"] = True
    data = load_dataset(cfg.data.spec, height=m.height, width=m.width, channels=m.channels,
                        seed=cfg.train.seed, skip_bad=cfg.data.skip_bad, progress=progress, **opts)
    if m.context_slices and not data.neighbours:
        raise ConfigError(f"model.context_slices {m.context_slices} (a 2.5-D context) needs volume data whose "
                          f"slices know their neighbours (--data brats:DIR or brats-demo); --data {cfg.data.spec} has none")
    splits = {}
    for name in ("train", "val", "test"):
        imgs = data.split(name)
        masks = data.masks.get(name)
        if m.context_slices:
            nbrs, nbr_masks = data.neighbours[name], data.neighbour_masks[name]
            if cfg.data.limit:
                nbrs, nbr_masks = nbrs[: cfg.data.limit], nbr_masks[: cfg.data.limit]
                nbrs = np.where(nbrs < cfg.data.limit, nbrs, -1)
            splits[name + "_nbrs"], splits[name + "_nbr_masks"] = nbrs, nbr_masks
        if name in data.fills:  # model.context_fill biharmonic3d: the holes' 3-D fills
            splits[name + "_fills"] = data.fills[name][: cfg.data.limit or None]
        if cfg.data.limit:
            imgs, masks = imgs[: cfg.data.limit], None if masks is None else masks[: cfg.data.limit]
        if len(imgs) == 0:
            raise ConfigError(f"the {name} split of --data {cfg.data.spec} is empty; use more data")
        # lazy data (imggen.datasets.lazy, e.g. --data moses): drawn and tokenised per batch
        splits[name] = imgs.tokens(m.bits, m.shape) if getattr(imgs, "is_lazy", False) else \
            tokenize(imgs, m.bits, shape=m.shape, dtype=torch.uint8)
        if masks is not None:
            splits[name + "_masks"] = np.asarray(masks).reshape(len(imgs), m.height, m.width).astype(bool, copy=False)
    return splits, data


def batch_indices(step: int, batch: int, n: int, seed: int) -> torch.Tensor:
    """Indices of the global batch at `step`: a stream of per-epoch permutations seeded by (seed, epoch)."""
    start, out = step * batch, []
    while len(out) < batch:
        epoch, off = divmod(start + len(out), n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100003 + epoch))
        out.extend(perm[off: off + batch - len(out)].tolist())
    return torch.tensor(out)


def unigram_bpd(tokens: torch.Tensor, vocab: int) -> float:
    """Entropy (bits per subpixel) of the marginal distribution of token values."""
    counts = torch.bincount(tokens.reshape(-1).long(), minlength=vocab).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log2()).sum())


def split_bits(cfg: Config, model, splits: dict, split: str, limit: int | None = None) -> np.ndarray:
    """Per-image bits/dim of a split's first `limit` images (inpainting: the unknown pixels under the split's
    fixed masks), in the caller's precision (evaluate's; bench/carry.py's for weights other than the run's)."""
    from imggen.eval.bpd import token_bits_per_dim

    tokens = splits[split][:limit]
    inputs = TASKS[cfg.train.task].eval_inputs(cfg, model, splits, split, len(tokens))
    return token_bits_per_dim(model, tokens, cfg.train.batch_size, inputs=inputs)
