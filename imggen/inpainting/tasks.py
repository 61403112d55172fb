"""What a training run learns: `generate` (every token, unconditionally) or `inpaint` (the unknown
pixels of a voided image, seeing its known pixels through the model's context).

Inpainting masks: the data's own masks where it has them (BraTS inpainting masks, the brats-demo
challenge-like sections of 3-D blobs, imggen.datasets.brats_masks), for half the images of a
batch, and random lesion-like blobs, rectangles and strokes (imggen.inpainting.context.random_masks) for the
rest and for data without masks. They are drawn from (seed, step) so `--resume` continues exactly;
evaluation uses fixed masks per split: the data's own for every image that has one.

The inpainting loss covers the unknown pixels only: the known ones are in the context, so scoring
them would reward copying and dilute the signal for the pixels that inpainting has to produce.
"""
from __future__ import annotations

import numpy as np
import torch

from imggen.inpainting.context import random_masks
from imggen.errors import ConfigError

DATA_MASK_FRACTION = 0.5


class Task:
    """What a run learns: the training loop, its evaluation and its sample grid ask the run's task
    (`TASKS[cfg.train.task]`) and never branch on its name. A new task is a subclass added with
    `register_task` (tests/test_new_task.py adds one in the test file alone)."""
    name = ""
    data_masks = False  # whether the run asks the data for its own holes (BraTS mask files)

    def check(self, cfg) -> None:
        """Raise ConfigError when cfg cannot learn this task (Config.validate asks)."""

    def configure(self, cfg) -> None:
        """`--task NAME`: set what the task needs in cfg (before the command line's overrides)."""

    def batch(self, cfg, model, splits: dict, x: torch.Tensor, idx: np.ndarray, step: int, part: slice,
              world: int, augment=None) -> tuple:
        """This process's share of training step `step`: (tokens, context, token loss mask, loss divisor),
        None for the last three = every token, no context. x: the tokens of splits["train"][idx[part]]
        (idx: the global batch); `augment(x, masks, stack, fills)` (imggen.augment.augment_tokens, None
        when train.augment is off) warps the tokens and the pixel-aligned inputs that go with them."""
        return (x if augment is None else augment(x)[0]), None, None, None

    def eval_inputs(self, cfg, model, splits: dict, split: str, n: int):
        """How the first n images of a split are scored, the same at every evaluation: None (every token,
        no context) or a function (tokens (b, N), rows: slice of the n) -> (context, token weights)
        (imggen.eval.bpd.token_bits_per_dim)."""
        return None

    def grid_inputs(self, cfg, model, splits: dict, num: int):
        """None (the sample grid shows unconditional samples), or (images uint8 (num, C, H, W), masks
        (num, H, W) True = unknown, context or None): the grid shows image | voided | filled rows."""
        return None


class Generate(Task):
    """Every token, unconditionally (no context)."""
    name = "generate"

    def check(self, cfg) -> None:
        if cfg.model.context != "none":
            raise ConfigError(f"train.task generate with model.context {cfg.model.context!r}: generation trains a "
                              f"model without a context (--task generate sets model.context none)")

    def configure(self, cfg) -> None:
        cfg.model.context = "none"


class Inpaint(Task):
    """The unknown pixels of a voided image, seen through the model's context (masks below)."""
    name = "inpaint"
    data_masks = True

    def check(self, cfg) -> None:
        if cfg.model.context == "none":
            raise ConfigError("train.task inpaint with model.context 'none': inpainting trains a context model "
                              "(--task inpaint sets model.context unet)")

    def configure(self, cfg) -> None:
        if cfg.model.context == "none":
            cfg.model.context = "unet"

    def batch(self, cfg, model, splits, x, idx, step, part, world, augment=None):
        m = cfg.model  # masks drawn for the global batch, so DDP sees what one process would
        masks, stack = split_masks(cfg, splits, "train", len(idx), step, idx)
        stack = None if stack is None else stack[part]
        fills = split_fills(splits, "train", idx, masks)
        fills = None if fills is None else fills[part]
        if augment is not None:
            x, masks, stack, fills = augment(x, masks, stack, fills)
        context, loss_mask = inpaint_inputs(model, x, masks[part], stack, fills)
        mid = masks[:, m.context_slices] if m.context_slices else masks  # the slices being filled
        return x, context, loss_mask, ddp_mask_norm(mid, m.channels, world)

    def eval_inputs(self, cfg, model, splits, split, n):
        masks, neighbours = split_masks(cfg, splits, split, n)
        return rows_inputs(model, masks, neighbours, split_fills(splits, split, np.arange(n), masks))

    def grid_inputs(self, cfg, model, splits, num):
        from imggen.tokens import detokenize_tokens

        m = cfg.model
        test = splits["test"][:num]
        masks, stack = split_masks(cfg, splits, "test", len(test))
        images = detokenize_tokens(test.long(), m.bits, m.shape)
        fills = split_fills(splits, "test", np.arange(len(test)), masks)
        context = None  # made by the sampler, unless a 2.5-D model's neighbours or 3-D fills are given
        if stack is not None or fills is not None:
            context = model.make_context(images if stack is None else stack, masks, fills)
        return images, torch.from_numpy(masks[:, m.context_slices] if m.context_slices else masks), context


TASKS: dict[str, Task] = {}


def register_task(task: Task) -> Task:
    """Make `task` available as train.task / --task task.name."""
    if not isinstance(task, Task) or not task.name:
        raise ConfigError(f"a task is an imggen.inpainting.tasks.Task with a name, got {task!r}")
    TASKS[task.name] = task
    return task


register_task(Generate())
register_task(Inpaint())


def token_mask(masks: torch.Tensor, channels: int) -> torch.Tensor:
    """Pixel masks (B, H, W) -> token masks (B, H*W*C) (every subpixel of an unknown pixel)."""
    b = masks.shape[0]
    return masks[..., None].expand(*masks.shape, channels).reshape(b, -1)


def draw_masks(rng: np.random.Generator, idx: np.ndarray, data_masks: np.ndarray | None, h: int, w: int,
               fraction: float = DATA_MASK_FRACTION, neighbour_masks: np.ndarray | None = None) -> np.ndarray:
    """bool (len(idx), h, w): the data's mask of image idx[i] (when it has a non-empty one) for about
    `fraction` of the images, random masks for the others.

    2.5-D (`neighbour_masks`: bool (len(idx), 2s+1, h, w), the data's hole at slices z-s..z+s of each
    image's volume) -> bool (len(idx), 2s+1, h, w): an image given its data mask gets the same 3-D
    hole's sections on its neighbours; one given a random 2-D mask gets that mask on every slice
    of the stack (a cylinder hole). The random draws, and so the middle slice's masks, are those
    without neighbours."""
    out = random_masks(len(idx), h, w, rng)
    if neighbour_masks is not None:
        out = np.repeat(out[:, None], neighbour_masks.shape[1], 1)
    if data_masks is not None:
        use = rng.random(len(idx)) < fraction
        for i in np.flatnonzero(use):
            m = np.asarray(data_masks[idx[i]]).reshape(h, w).astype(bool)
            if m.any() and not m.all():
                out[i] = m if neighbour_masks is None else neighbour_masks[i]
    return out


def training_masks(seed: int, step: int, idx, data_masks, h: int, w: int, neighbour_masks=None) -> np.ndarray:
    return draw_masks(np.random.default_rng([seed, step, 1]), np.asarray(idx), data_masks, h, w,
                      neighbour_masks=neighbour_masks)


def eval_masks(seed: int, split: str, n: int, data_masks, h: int, w: int, neighbour_masks=None) -> np.ndarray:
    """Fixed masks of the first n images of a split (the same every evaluation): the data's own mask
    for every image that has a non-empty one (BraTS inpainting masks, the brats-demo challenge-like
    sections), random ones for the others (2.5-D: with their neighbours', see draw_masks)."""
    tag = {"train": 0, "val": 1, "test": 2}[split]
    return draw_masks(np.random.default_rng([seed, 1 << 20, tag]), np.arange(n), data_masks, h, w, fraction=1.0,
                      neighbour_masks=neighbour_masks)


def split_masks(cfg, splits: dict, split: str, n: int, step: int | None = None, idx=None) -> tuple:
    """(masks, neighbours) of images `idx` (training, at `step`) or of the first n (evaluation) of a
    split of imggen.training.batches.load_data: bool (B, H, W) and None, or for a 2.5-D context model
    (cfg.model.context_slices = s) bool (B, 2s+1, H, W) and the uint8 slices z-s..z+s (B, 2s+1, C, H, W)
    (imggen.inpainting.context.slice_stacks: a slice outside the volume zero and all unknown)."""
    from imggen.inpainting.context import slice_stacks
    from imggen.tokens import detokenize_tokens

    m, s = cfg.model, cfg.model.context_slices
    given = splits.get(split + "_masks")
    idx = np.arange(n) if step is None else np.asarray(idx)
    nbrs = nbr_masks = None
    if s:
        if split + "_nbrs" not in splits:
            from imggen.errors import ConfigError
            raise ConfigError(f"model.context_slices {s} needs volume data whose slices know their neighbours "
                              f"(--data brats:DIR or brats-demo); --data {cfg.data.spec} has none")
        nbrs = splits[split + "_nbrs"][idx]
        nbr_masks = neighbour_masks(splits, split, idx, nbrs, m.height, m.width)
    if step is None:
        masks = eval_masks(cfg.train.seed, split, n, given, m.height, m.width, nbr_masks)
    else:
        masks = training_masks(cfg.train.seed, step, idx, given, m.height, m.width, nbr_masks)
    if not s:
        return masks, None
    rows = np.unique(nbrs[nbrs >= 0])
    images = detokenize_tokens(splits[split][torch.from_numpy(rows)].long(), m.bits, m.shape)
    local = np.where(nbrs >= 0, np.searchsorted(rows, nbrs), -1)
    stack, masks = slice_stacks(images, local, masks)
    return masks.numpy(), stack


def neighbour_masks(splits: dict, split: str, idx, nbrs, h: int, w: int) -> np.ndarray:
    """bool (B, 2s+1, h, w): the data's 3-D hole of images idx cut at their neighbouring slices (rows
    nbrs). Where the loader gives them (split_nbr_masks: brats-demo, whose slices draw their blobs
    one by one) those; else the neighbours' own masks (one 3-D mask per BraTS case); all True
    where a neighbour is missing; none (all False) without data masks."""
    if split + "_nbr_masks" in splits:
        return np.asarray(splits[split + "_nbr_masks"][idx])
    given = splits.get(split + "_masks")
    if given is None:
        return np.zeros((*nbrs.shape, h, w), bool)
    own = np.asarray(given).reshape(len(given), h, w)[np.clip(nbrs, 0, None)]
    return np.where((nbrs < 0)[..., None, None], True, own)


def split_fills(splits: dict, split: str, idx, masks) -> torch.Tensor | None:
    """The holes' given classic fills of images idx (model.context_fill biharmonic3d: their 3-D fills,
    imggen.training.batches.load_data) as float (B, C, H, W), a NaN row where an image was not given its data
    mask (a random mask: its 2-D fill is made with the context); None without given fills."""
    fills = splits.get(split + "_fills")
    if fills is None:
        return None
    idx = np.asarray(idx)
    own = np.asarray(splits[split + "_masks"])[idx]
    mid = np.asarray(masks)
    mid = mid[:, mid.shape[1] // 2] if mid.ndim == 4 else mid  # a 2.5-D stack's middle slice
    out = torch.from_numpy(np.asarray(fills)[idx]).float()
    out[torch.from_numpy(~(own.reshape(mid.shape) == mid).all((1, 2)))] = float("nan")
    return out


def inpaint_inputs(model, tokens: torch.Tensor, masks, neighbours=None, fills=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(context, token loss mask) for token sequences (B, N) and pixel masks (B, H, W); a 2.5-D model
    (model.context_slices = s) takes masks (B, 2s+1, H, W) and `neighbours`, the uint8 slices
    (B, 2s+1, C, H, W) around each image (split_masks); the loss covers the middle slice's hole.
    `fills`: the holes' given classic fills (split_fills)."""
    from imggen.tokens import detokenize_tokens

    cfg = model.config
    masks = torch.as_tensor(masks).bool()
    images = detokenize_tokens(tokens.cpu(), cfg.bits, cfg.shape)
    if cfg.context_slices and neighbours is not None:
        stack = torch.as_tensor(neighbours).clone()
        stack[:, cfg.context_slices] = images
        return (model.make_context(stack, masks, fills),
                token_mask(masks[:, cfg.context_slices], cfg.channels).to(tokens.device))
    return model.make_context(images, masks, fills), token_mask(masks, cfg.channels).to(tokens.device)



def rows_inputs(model, masks, neighbours=None, fills=None):
    """(tokens (b, N), rows: a slice of the images) -> inpaint_inputs of those rows: how a set of
    images with fixed masks (and 2.5-D neighbours, given fills) is scored (Task.eval_inputs)."""
    return lambda x, rows: inpaint_inputs(model, x, masks[rows], None if neighbours is None else neighbours[rows],
                                          None if fills is None else fills[rows])

def ddp_mask_norm(masks, channels: int, world: int) -> float:
    """train_step's divisor for this step under DDP: the token loss mask count of the global batch's
    pixel masks (B, H, W), over the number of processes (DDP averages their gradients)."""
    return float(token_mask(torch.as_tensor(masks).bool(), channels).sum()) / world
