"""The command lines: train.py (`train_main`) and sample.py (`sample_main`). Thin: they read and
check flags, set the thread policy, call imggen.training / imggen.sampling, and turn bad input
into one clear line with exit code 2."""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import warnings

import numpy as np
import torch

from imggen.attention import forced_backend
from imggen.config import BACKENDS, PATTERN_PARAMS, PRESETS, Config, apply_override, preset
from imggen.errors import ConfigError, ImggenError, Interrupted, ShapeError, StorageError, WorkerLost
from imggen.memory import save_limit
from imggen.inpainting.tasks import TASKS
from imggen.threads import set_threads
from imggen.volumes import BRATS_HELP, UNCERTAINTY_HELP, brats_main


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors and exit code 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def int_at_least(lo: int, what: str):
    """argparse type: an integer >= lo, with a one-line message naming what it expects."""
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            v = lo - 1
        if v < lo:
            raise argparse.ArgumentTypeError(f"expected {what}, got {s!r}")
        return v
    return parse


positive_int = int_at_least(1, "a positive integer")


def device_arg(s: str) -> str:
    """argparse type: a torch device this machine has (cpu, cuda, cuda:1, ...), checked before any work."""
    try:
        d = torch.device(s)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"{s!r} is not a torch device; use e.g. cpu, cuda or cuda:0") from None
    if d.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{s}: CUDA is not available on this machine; use --device cpu")
    if d.type == "cuda" and d.index is not None and d.index >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{s}: this machine has {torch.cuda.device_count()} CUDA device(s) "
                                         f"(cuda:0 to cuda:{torch.cuda.device_count() - 1})")
    return s


@contextlib.contextmanager
def plain_data_warnings():
    """Print data warnings (skipped items, imggen.datasets.DataWarning) as one plain line on stderr,
    without the source line of a Python warning; other warnings show as usual."""
    from imggen.datasets import DataWarning

    with warnings.catch_warnings():
        show = warnings.showwarning

        def plain(message, category, *args, **kwargs):
            if issubclass(category, DataWarning):
                print(message, file=sys.stderr, flush=True)
            else:
                show(message, category, *args, **kwargs)
        warnings.showwarning = plain
        yield


def add_fill_flags(ap: argparse.ArgumentParser) -> None:
    """--samples / --reduce: point estimates of a hole (the per-pixel mean or median of K samples)."""
    ap.add_argument("--samples", type=positive_int, default=1,
                    help="fill each hole with the per-pixel --reduce of this many samples (default 1: one sample)")
    ap.add_argument("--reduce", choices=["mean", "median"],
                    help="how --samples K > 1 are combined (default mean: what PSNR / SSIM reward)")


def check_fill_args(args) -> None:
    """--reduce without --samples K > 1 has nothing to combine: a ConfigError, before any work."""
    if args.reduce and args.samples == 1:
        raise ConfigError(f"--reduce {args.reduce} combines --samples K > 1 fills; add --samples K")


def fill_args(args) -> dict:
    return {"samples": args.samples, "reduce": (args.reduce or "mean") if args.samples > 1 else None}


def add_threads_flag(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--threads", type=positive_int, help="CPU threads for torch (default: see README, 'Threads')")


# -------------------------------------------------------------------------------------- train.py
def train_parser() -> argparse.ArgumentParser:
    ap = Parser(prog="train.py", description="Train an imggen model. Extra settings: --model.NAME VALUE, "
                 "--train.NAME VALUE, --data.NAME VALUE (see imggen/config.py).")
    ap.add_argument("--preset", choices=sorted(PRESETS),
                    help="named preset (default demo; with --resume, the run's own config)")
    ap.add_argument("--data", help="KIND[:PATH]: molecules[:file.csv|.smi|.sdf], brats:DIR, brats-demo, "
                                   "cifar:DIR, folder:DIR")
    ap.add_argument("--out", help="run directory for checkpoints, logs and samples (default runs/PRESET)")
    ap.add_argument("--steps", type=int, help="training steps (>= 1)")
    ap.add_argument("--batch-size", type=int, help="global batch size (split across processes)")
    ap.add_argument("--lr", type=float, help="peak learning rate (> 0)")
    ap.add_argument("--seed", type=int, help="seed for initialisation and data order")
    ap.add_argument("--attention", help="pattern kind, or a comma list cycled over layers: "
                                        "full, band, local2d, bigbird, diffuser, strided, column")
    for name, entry in PATTERN_PARAMS.items():  # declared once, in the pattern classes
        ap.add_argument("--" + name.replace("_", "-"), type=entry["type"], help=entry["help"])
    ap.add_argument("--backend", choices=BACKENDS, help="attention backend (default auto)")
    ap.add_argument("--task", choices=TASKS, help="generate (default), or inpaint: a model with a context of the "
                                                "voided image learns to fill masked pixels (sets --model.context unet)")
    ap.add_argument("--skip-bad", action="store_true", help="skip and count unreadable data items")
    ap.add_argument("--limit", type=int, help="use at most this many images per split")
    ap.add_argument("--resume", action="store_true",
                    help="continue the run in --out exactly, from its own config (flags given now, e.g. --steps, "
                         "override it; model and data settings must not change)")
    ap.add_argument("--overwrite", action="store_true", help="start again even if --out holds a checkpoint")
    ap.add_argument("--device", type=device_arg, help="torch device (default cuda when available)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_threads_flag(ap)
    return ap


def config_from_args(argv=None) -> tuple[Config, argparse.Namespace]:
    ap = train_parser()
    args, rest = ap.parse_known_args(argv)
    args.out = args.out or os.path.join("runs", args.preset or "demo")
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0  # torchrun --max-restarts
    try:
        cfg = _checkpoint_config(args.out) if args.resume or restarted else None
    except ImggenError as e:
        ap.error(str(e))
    if restarted and cfg is not None and not args.resume:  # continue, never start again, from the last checkpoint
        args.resume, args.overwrite = True, False
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"note: torchrun restarted the workers (restart {os.environ['TORCHELASTIC_RESTART_COUNT']}); "
                  f"resuming {args.out} from its last good checkpoint", file=sys.stderr, flush=True)
    if cfg is not None and args.preset and args.preset != cfg.preset:
        ap.error(f"--resume: {args.out} was trained with --preset {cfg.preset}, not {args.preset}")
    cfg = cfg or preset(args.preset or "demo")
    simple = {"steps": ("train", "steps"), "batch_size": ("train", "batch_size"), "lr": ("train", "lr"),
              "seed": ("train", "seed"), "attention": ("model", "attention"), "backend": ("model", "backend"),
              "data": ("data", "spec"), "limit": ("data", "limit"), **{k: ("model", k) for k in PATTERN_PARAMS}}
    if args.attention:  # a new pattern kind: the preset's pattern parameters were meant for another
        cfg.model.reset_pattern_params()
    for arg, (section, name) in simple.items():
        if getattr(args, arg) is not None:
            setattr(getattr(cfg, section), name, getattr(args, arg))
    cfg.data.skip_bad = cfg.data.skip_bad or args.skip_bad
    if args.task:
        cfg.train.task = args.task
        TASKS[args.task].configure(cfg)
    if len(rest) % 2:
        ap.error(f"unrecognized or incomplete arguments: {' '.join(rest)}")
    for flag, value in zip(rest[::2], rest[1::2]):
        if not flag.startswith("--") or "." not in flag:
            ap.error(f"unrecognized argument {flag}")
        try:
            apply_override(cfg, flag[2:], value)
        except ConfigError as e:
            ap.error(str(e))
    try:
        cfg.validate()
    except ConfigError as e:
        ap.error(str(e))
    kinds = {k.strip() for k in cfg.model.attention.split(",")}
    for name, entry in PATTERN_PARAMS.items():  # a pattern flag given for patterns that have no use for it
        if getattr(args, name) is not None and not kinds & set(entry["fields"]):
            ap.error(f"--{name.replace('_', '-')} has no effect with --attention {cfg.model.attention}: it applies "
                     f"to {', '.join(sorted(entry['fields']))}")
    return cfg, args


def _checkpoint_config(out: str) -> Config | None:
    """The config of the run being resumed: the base that flags given now override."""
    from imggen.checkpoint import find_checkpoint, read_config

    found = find_checkpoint(out) if os.path.isdir(out) else None
    return read_config(found) if found else None


def check_train_backend(cfg: Config, device: str | None) -> None:
    """A backend that cannot train on the chosen device is a ConfigError before the data loads:
    triton needs CUDA (or the Triton interpreter, TRITON_INTERPRET=1: tests only); flex has no
    backward pass on CPU."""
    from imggen.training import train_device

    env = forced_backend()
    backend = env or cfg.model.backend
    where = f"IMGGEN_BACKEND={env}" if env else f"--backend {backend}"
    fix = "set IMGGEN_BACKEND=cpu (or unset it)" if env else "use --backend cpu (or auto)"
    if torch.device(train_device(device)).type == "cuda":
        return
    if backend == "triton" and os.environ.get("TRITON_INTERPRET", "") != "1":
        raise ConfigError(f"{where}: the triton kernels need a CUDA GPU and training runs on the CPU here; {fix}")
    if backend == "flex":
        raise ConfigError(f"{where}: the flex backend has no backward pass on CPU (FlexAttention is forward-only "
                          f"there), so it cannot train here; {fix}")


def train_main(argv=None) -> int:
    from imggen.training import train

    cfg, args = config_from_args(argv)
    governor = set_threads(args.threads, "train")
    out = args.out
    try:
        forced_backend()  # a bad IMGGEN_BACKEND or IMGGEN_SAVE_MB fails before the data loads
        check_train_backend(cfg, args.device)  # so does a backend that cannot train on this device
        save_limit()
        with plain_data_warnings():
            train(cfg, out, resume=args.resume, overwrite=args.overwrite, device=args.device,
                  progress=not args.no_progress, governor=governor)
    except Interrupted as e:
        print(str(e), file=sys.stderr)
        return 130
    except ImggenError as e:  # a full disk or a dead worker: 1; bad input and the rest: 2
        print(f"train.py: error: {e}", file=sys.stderr)
        return 1 if isinstance(e, (StorageError, WorkerLost)) else 2
    return 0


# ------------------------------------------------------------------------------------- sample.py
def sample_parser() -> argparse.ArgumentParser:
    ap = Parser(prog="sample.py", description="Sample images from a trained imggen model.")
    ap.add_argument("--checkpoint", required=True, help="run directory (e.g. runs/demo) or checkpoint folder")
    ap.add_argument("--num", type=int, default=None,
                    help="number of images to draw (default 16; 1 fill with --inpaint / --prefix)")
    ap.add_argument("--batch-size", type=int, default=16,
                    help="sequences sampled in parallel, --rank candidates included (default 16)")
    ap.add_argument("--out", help="output PNG (default samples.png): a grid, or the filled image for --inpaint / "
                                  "--prefix; with --brats the folder for the output volumes")
    ap.add_argument("--seed", type=int, default=None,
                    help="random seed: same seed, same images (image i depends on the seed and i only)")
    ap.add_argument("--temperature", type=float, default=1.0, help="softmax temperature (default 1.0; 0 = greedy)")
    ap.add_argument("--top-k", type=int, default=None, help="sample only from the k most likely values")
    ap.add_argument("--cache", choices=["auto", "full", "evict"], default="auto",
                    help="decode cache: evict (memory-bounded, default when available) or full")
    ap.add_argument("--device", type=device_arg, default="cuda" if torch.cuda.is_available() else "cpu",
                    help="torch device")
    ap.add_argument("--scale", type=int, default=None,
                    help="upscale factor of the saved images (default: about 128 px per image)")
    ap.add_argument("--rank", type=int, default=1, metavar="N",
                    help="draw N candidates per image, keep the one with the highest log-likelihood")
    ap.add_argument("--prefix", metavar="IMG", help="complete this image from its first --prefix-rows rows")
    ap.add_argument("--prefix-rows", type=int, metavar="R", help="rows of --prefix to keep")
    ap.add_argument("--inpaint", metavar="IMG", help="fill the unknown pixels of this image (needs --mask)")
    ap.add_argument("--mask", metavar="MASK", help="mask PNG of --inpaint's size: nonzero = unknown (fill)")
    ap.add_argument("--triplet", metavar="PATH",
                    help="with --inpaint / --prefix: also write original | masked | filled side by side")
    ap.add_argument("--backend", choices=BACKENDS,
                    help="attention backend of the forward passes (default: the checkpoint's; IMGGEN_BACKEND wins)")
    ap.add_argument("--brats", metavar="DIR", help=BRATS_HELP)
    ap.add_argument("--uncertainty", action="store_true", help=UNCERTAINTY_HELP)
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--no-graph", action="store_true",
                    help="on CUDA, take the eager decode step instead of replaying it as a CUDA graph (the default)")
    add_fill_flags(ap)
    add_threads_flag(ap)
    return ap


def _check_sample_args(args) -> None:
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
    check_fill_args(args)
    _check_out_path("--out", args.out)
    if args.triplet:
        _check_out_path("--triplet", args.triplet)


def _check_out_path(flag: str, path: str) -> None:
    """An output PNG name whose folder exists or can be created: checked before any sampling."""
    if os.path.isdir(path):
        raise ConfigError(f"{flag} {path} is a directory; give a PNG file name such as "
                          f"{os.path.join(path, 'samples.png')}")
    if os.path.splitext(path)[1].lower() != ".png":
        raise ConfigError(f"{flag} {path}: images are written as PNG; give a file name ending in .png")
    folder = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(folder):  # missing folders are created when the image is saved
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        raise ConfigError(f"{flag} {path}: {folder} is a file, not a folder")


def _load_input(path: str, channels: int) -> torch.Tensor:
    """Image file -> uint8 (C, H, W); a colour image for a grayscale model (or the reverse) is a
    ShapeError rather than a silent conversion."""
    from PIL import Image

    from imggen.images import load_image

    rgb = load_image(path, 3)  # DataError when missing or unreadable
    with Image.open(path) as im:
        gray_file = im.mode in ("1", "L", "LA", "I", "F") or im.mode.startswith("I;16")
    if channels == 1 and not ((rgb[0] == rgb[1]).all() and (rgb[1] == rgb[2]).all()):
        raise ShapeError(f"image {path} is a colour image but the checkpoint models grayscale (1 channel) images")
    if channels == 3 and gray_file:
        raise ShapeError(f"image {path} is grayscale but the checkpoint models RGB (3 channel) images")
    return torch.from_numpy(rgb[:1].copy() if channels == 1 else rgb)


def _load_mask(path: str) -> torch.Tensor:
    """Mask PNG -> (H, W) bool, True where any channel is nonzero (unknown)."""
    from imggen.images import load_image

    return torch.from_numpy(load_image(path, 3)).ne(0).any(0)


def sample_main(argv=None) -> int:
    from imggen.checkpoint import load_model
    from imggen.images import image_scale, save_grid, save_image
    from imggen.sampling import as_image, detokenize, generate, inpaint, prefix_mask

    args = sample_parser().parse_args(argv)
    set_threads(args.threads, "sample")
    if args.brats or args.uncertainty:  # volumes in and out: imggen.volumes
        try:
            check_fill_args(args)
        except ConfigError as e:
            print(f"sample.py: error: {e}", file=sys.stderr)
            return 2
        return brats_main(args)
    args.out = args.out or "samples.png"
    try:
        _check_sample_args(args)
        conditional = bool(args.inpaint or args.prefix)
        num = args.num or (1 if conditional else 16)
        model = load_model(args.checkpoint, device=args.device, backend=args.backend)
        cfg = model.config
        if cfg.context_slices:  # a 2.5-D context: the slice's neighbours, which one image does not have
            raise ConfigError(f"{args.checkpoint} has a 2.5-D context (model.context_slices = {cfg.context_slices}): it "
                              f"fills a slice from its neighbouring slices, so it needs a volume, not one image; "
                              f"use sample.py --checkpoint {args.checkpoint} --brats CASES --out PRED")
        if model.context is not None and not conditional:
            raise ConfigError("this model was trained for inpainting with a context: pass --inpaint IMAGE --mask MASK "
                              "(or --prefix IMAGE --prefix-rows R)")
        kw = dict(rank=args.rank, batch_size=args.batch_size, temperature=args.temperature, top_k=args.top_k,
                  seed=args.seed, cache=args.cache, progress=not args.no_progress,
                  graph="off" if args.no_graph else "auto")
        t0 = time.time()
        if conditional:
            image = as_image(model, _load_input(args.inpaint or args.prefix, cfg.channels))
            if args.inpaint:
                mask = _load_mask(args.mask)
                if tuple(mask.shape) != tuple(image.shape[1:]):
                    raise ShapeError(f"mask {args.mask} is {mask.shape[0]}x{mask.shape[1]} but image {args.inpaint} "
                                     f"is {image.shape[1]}x{image.shape[2]} (H x W); they must match")
            else:
                mask = prefix_mask(model, args.prefix_rows)
            imgs, logp = inpaint(model, image, mask, num=num, **kw, **fill_args(args))
            imgs = imgs.numpy()
            scale = args.scale or image_scale(cfg.width)
            if num == 1:
                save_image(imgs[0].transpose(1, 2, 0), args.out, scale=scale)
            else:
                save_grid(imgs, args.out, scale=scale)
            if args.triplet:
                masked = image.clone()
                masked[:, mask] = 128
                row = np.concatenate([image[None].numpy(), masked[None].numpy(), imgs])
                save_grid(row, args.triplet, nrow=len(row), scale=scale)
            n_tok = num * args.rank * args.samples * int(mask.sum()) * cfg.channels
        else:
            toks, logp = generate(model, num, **kw)
            save_grid(detokenize(model, toks).numpy(), args.out, scale=args.scale or image_scale(cfg.width))
            n_tok = num * args.rank * cfg.seq_len
        extra = f" and {args.triplet}" if args.triplet else ""
        print(f"wrote {args.out}{extra}: {num} image(s), mean log-likelihood {logp.mean().item():.1f} nats, "
              f"{n_tok / (time.time() - t0):.0f} sampled tokens/s")
    except ImggenError as e:
        print(f"sample.py: error: {e}", file=sys.stderr)
        return 1 if isinstance(e, StorageError) else 2
    return 0
