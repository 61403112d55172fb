"""Training loop and the train.py CLI (single process, or DDP under torchrun).

Reads top to bottom: parse flags -> config -> data -> model -> loop (AdamW, warmup + cosine,
clipping, bf16 autocast on CUDA) with logging, validation bits/dim, sample grids and atomic
checkpoints; `--resume` restores weights, optimizer, RNG state and the data position exactly.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist
from tqdm import tqdm

from imggen.checkpoint import config_diff, load_weights, read_config, resolve, save_checkpoint
from imggen.config import PRESETS, Config, apply_override, preset
from imggen.errors import CheckpointError, ConfigError, ImggenError, TrainingError
from imggen.model import ImageTransformer
from imggen.tokens import tokenize

LN2 = math.log(2.0)


# ----------------------------------------------------------------------------------- helpers
def lr_at(step: int, cfg) -> float:
    t = cfg.train
    if step < t.warmup:
        return t.lr * (step + 1) / t.warmup
    frac = min(1.0, (step - t.warmup) / max(1, t.steps - t.warmup))
    return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


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


@torch.no_grad()
def evaluate_bpd(model, tokens: torch.Tensor, batch: int, device) -> float:
    """Exact mean bits/dim over `tokens` (uint8/long (N, L))."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(tokens), batch):
        x = tokens[i: i + batch].long().to(device)
        with _autocast(device):
            logits = model(x)
        nll = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x.reshape(-1),
                                                reduction="sum")
        total += float(nll)
        count += x.numel()
    model.train()
    return total / max(1, count) / LN2


def _autocast(device):
    dev = torch.device(device)
    return torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda")


class Logger:
    def __init__(self, out: str, enabled: bool):
        self.enabled, self.path, self.tb = enabled, os.path.join(out, "log.jsonl"), None
        if enabled:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(os.path.join(out, "tb"))
            except Exception:  # tensorboard is optional at run time
                self.tb = None

    def log(self, step: int, **scalars):
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **scalars}) + "\n")
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, step)
            self.tb.flush()


def build_model_and_optimizer(cfg: Config, device):
    """The seeded model and its AdamW (weight decay on matrices only), as training starts them."""
    t = cfg.train
    torch.manual_seed(t.seed)
    model = ImageTransformer(cfg.model).to(device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=t.lr, betas=(0.9, 0.95))
    return model, opt


def _dist_setup():
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1, None
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank, local = dist.get_rank(), int(os.environ.get("LOCAL_RANK", "0"))
    device = f"cuda:{local}" if torch.cuda.is_available() else "cpu"
    if torch.cuda.is_available():
        torch.cuda.set_device(local)
    return rank, world, device


def load_data(cfg: Config):
    from imggen.datasets import load_dataset

    m = cfg.model
    data = load_dataset(cfg.data.spec, height=m.height, width=m.width, channels=m.channels,
                        seed=cfg.train.seed, skip_bad=cfg.data.skip_bad)
    splits = {}
    for name in ("train", "val", "test"):
        imgs = data.split(name)
        if cfg.data.limit:
            imgs = imgs[: cfg.data.limit]
        if len(imgs) == 0:
            raise ConfigError(f"the {name} split of --data {cfg.data.spec} is empty; use more data")
        splits[name] = tokenize(imgs, m.bits, shape=m.shape).to(torch.uint8)
    return splits, data


# -------------------------------------------------------------------------------------- train
def train(cfg: Config, out: str, resume: bool = False, overwrite: bool = False, device: str | None = None,
          data: dict | None = None, progress: bool = True, hooks: dict | None = None) -> dict:
    """Train `cfg` into run directory `out`. Returns final metrics. `data` = pre-tokenised splits."""
    rank, world, dist_device = _dist_setup()
    device = dist_device or device or ("cuda" if torch.cuda.is_available() else "cpu")
    main_proc = rank == 0
    cfg.model.validate()
    t = cfg.train
    if t.batch_size % world:
        raise ConfigError(f"--batch-size {t.batch_size} must be divisible by the number of processes ({world})")
    os.makedirs(out, exist_ok=True)
    has_ckpt = os.path.exists(os.path.join(out, "checkpoints", "LATEST"))
    if has_ckpt and not (resume or overwrite):
        raise CheckpointError(f"{out} already holds a checkpoint; pass --resume to continue it or "
                              f"--overwrite to start again (or choose another --out)")

    model, opt = build_model_and_optimizer(cfg, device)
    step = 0
    if resume and has_ckpt:
        ckpt = resolve(out)
        diff = config_diff(read_config(ckpt), cfg) + config_diff(read_config(ckpt), cfg, "data")
        if diff:
            raise CheckpointError(f"cannot resume {out}: its config differs from the requested one:\n  "
                                  + "\n  ".join(diff))
        load_weights(model, ckpt, cfg)
        state = torch.load(os.path.join(ckpt, "state.pt"), map_location=device, weights_only=False)
        opt.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
        step = state["step"]
        if main_proc:
            print(f"resumed {out} at step {step}")
    if main_proc:
        with open(os.path.join(out, "config.json"), "w") as f:
            f.write(cfg.to_json())

    splits = data if data is not None else load_data(cfg)[0]
    train_tok = splits["train"]
    if main_proc:
        print(f"data {cfg.data.spec}: {len(train_tok)} train / {len(splits['val'])} val / "
              f"{len(splits['test'])} test images of {cfg.model.shape}; "
              f"model {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, "
              f"attention {cfg.model.attention}")
    ddp = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    logger = Logger(out, main_proc)
    model.train()
    bar = tqdm(total=t.steps, initial=step, desc="train", unit="step", disable=not (progress and main_proc),
               dynamic_ncols=True)
    last_good = resolve(out) if has_ckpt and resume else None
    tok_per_step = t.batch_size * cfg.model.seq_len
    t_last, s_last = time.time(), step
    metrics, data_time = {}, 0.0
    while step < t.steps:
        t_data = time.perf_counter()
        idx = batch_indices(step, t.batch_size, len(train_tok), t.seed)[rank::world]
        x = train_tok[idx].long().to(device)
        data_time += time.perf_counter() - t_data
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        with _autocast(device):
            logits = ddp(x)
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x.reshape(-1))
        if hooks and "loss" in hooks:
            loss = hooks["loss"](step, loss)
        if not torch.isfinite(loss):
            bar.close()
            where = f"the last good checkpoint is {last_good}" if last_good else "no checkpoint was saved yet"
            raise TrainingError(f"loss became {float(loss.detach())} at step {step}; training stopped and {where}. "
                                f"Lower --lr (now {t.lr}) or --train.grad_clip, then --resume")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        step += 1
        bpd = float(loss.detach()) / LN2
        bar.update(1)
        if step % t.log_every == 0 or step == t.steps:
            now = time.time()
            tps = tok_per_step * (step - s_last) / max(1e-9, now - t_last)
            data_frac = data_time / max(1e-9, now - t_last)
            t_last, s_last, data_time = now, step, 0.0
            bar.set_postfix(bpd=f"{bpd:.3f}", tok_s=f"{tps:.0f}")
            logger.log(step, train_bpd=bpd, lr=lr_at(step - 1, cfg), tokens_per_s=tps, data_wait_frac=data_frac)
        if main_proc and (step % t.eval_every == 0 or step == t.steps):
            val = evaluate_bpd(model, splits["val"][: t.eval_images], t.batch_size, device)
            logger.log(step, val_bpd=val)
            metrics["val_bpd"] = val
        if main_proc and t.sample_every and step % t.sample_every == 0 and step != t.steps:
            _sample_grid(model, cfg, out, step)
        if step % t.ckpt_every == 0 or step == t.steps:
            if main_proc:
                last_good = save_checkpoint(out, step, model, cfg, {
                    "optimizer": opt.state_dict(), "rng": torch.get_rng_state(), "step": step})
            if world > 1:
                dist.barrier()
    bar.close()
    if main_proc:
        test = evaluate_bpd(model, splits["test"], t.batch_size, device)
        uni = unigram_bpd(train_tok, cfg.model.vocab)
        metrics.update(test_bpd=test, unigram_bpd=uni, steps=step)
        logger.log(step, test_bpd=test)
        grid = _sample_grid(model, cfg, out, step)
        with open(os.path.join(out, "metrics.json"), "w") as f:
            json.dump(metrics, f, indent=2)
        print(f"test bits/dim {test:.3f} (unigram entropy of the data {uni:.3f} bits/dim); "
              f"checkpoint {out}; samples {grid}")
    if world > 1:
        dist.destroy_process_group()
    return metrics


def _sample_grid(model, cfg: Config, out: str, step: int) -> str:
    from imggen.images import save_grid
    from imggen.sampling import detokenize, sample

    model.eval()
    toks = sample(model, cfg.train.sample_num, seed=cfg.train.seed, top_k=None)
    model.train()
    imgs = detokenize(model, toks).numpy()
    path = os.path.join(out, "samples", f"step_{step:07d}.png")
    save_grid(imgs, path, scale=max(1, 128 // cfg.model.width))
    save_grid(imgs, os.path.join(out, "samples.png"), scale=max(1, 128 // cfg.model.width))
    return path


# ---------------------------------------------------------------------------------------- CLI
class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one clear line, exit code 2
        self.exit(2, f"{self.prog}: error: {message}\n")


PATTERN_FLAGS = {  # flag -> (model field, type, help)
    "window": (int, "band/diffuser window in tokens (default: two rows for band, one for diffuser)"),
    "radius": (int, "local2d neighbourhood radius in pixels"),
    "block": (int, "bigbird/diffuser block size in tokens (default 32 or 64; the GPU kernels take 16..128)"),
    "window_blocks": (int, "bigbird sliding-window blocks (current block included)"),
    "global_blocks": (int, "bigbird global (sink) blocks"),
    "random_blocks": (int, "bigbird random blocks per query block"),
    "global_tokens": (int, "diffuser global (sink) tokens"),
    "random_edges": (int, "diffuser random keys per query block"),
    "diffusion_steps": (int, "diffuser diffusion steps K"),
    "alpha": (float, "diffuser restart probability alpha"),
    "stride": (int, "strided pattern stride (default: row width W*C)"),
}


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="train.py", description="Train an imggen model. Extra settings: --model.NAME VALUE, "
                 "--train.NAME VALUE, --data.NAME VALUE (see imggen/config.py).")
    ap.add_argument("--preset", default="demo", choices=sorted(PRESETS), help="named preset (default demo)")
    ap.add_argument("--data", help="KIND[:PATH]: molecules[:file.csv|.smi|.sdf], brats:DIR, brats-demo, "
                                   "cifar:DIR, folder:DIR")
    ap.add_argument("--out", help="run directory for checkpoints, logs and samples (default runs/PRESET)")
    ap.add_argument("--steps", type=int, help="training steps")
    ap.add_argument("--batch-size", type=int, help="global batch size (split across processes)")
    ap.add_argument("--lr", type=float, help="peak learning rate")
    ap.add_argument("--seed", type=int, help="seed for initialisation and data order")
    ap.add_argument("--attention", help="pattern kind, or a comma list cycled over layers: full, band, "
                                        "local2d, bigbird, diffuser, strided")
    for name, (typ, help_) in PATTERN_FLAGS.items():
        ap.add_argument("--" + name.replace("_", "-"), type=typ, help=help_)
    ap.add_argument("--backend", choices=["auto", "cpu", "triton", "reference"], help="attention backend")
    ap.add_argument("--skip-bad", action="store_true", help="skip and count unreadable data items")
    ap.add_argument("--limit", type=int, help="use at most this many images per split")
    ap.add_argument("--resume", action="store_true", help="continue the run in --out exactly")
    ap.add_argument("--overwrite", action="store_true", help="start again even if --out holds a checkpoint")
    ap.add_argument("--device", help="torch device (default cuda when available)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    return ap


def config_from_args(argv=None) -> tuple[Config, argparse.Namespace]:
    ap = build_parser()
    args, rest = ap.parse_known_args(argv)
    cfg = preset(args.preset)
    simple = {"steps": ("train", "steps"), "batch_size": ("train", "batch_size"), "lr": ("train", "lr"),
              "seed": ("train", "seed"), "attention": ("model", "attention"), "backend": ("model", "backend"),
              "data": ("data", "spec"), "limit": ("data", "limit"),
              **{k: ("model", k) for k in PATTERN_FLAGS}}
    if args.attention:  # a new pattern kind: drop preset pattern parameters meant for another kind
        cfg.model.window = None
    for arg, (section, field) in simple.items():
        val = getattr(args, arg)
        if val is not None:
            setattr(getattr(cfg, section), field if field != "diffusion_steps" else "diffusion_steps", val)
    if args.skip_bad:
        cfg.data.skip_bad = True
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
        cfg.model.validate()
    except ConfigError as e:
        ap.error(str(e))
    return cfg, args


def main(argv=None) -> int:
    cfg, args = config_from_args(argv)
    out = args.out or os.path.join("runs", cfg.preset)
    try:
        train(cfg, out, resume=args.resume, overwrite=args.overwrite, device=args.device,
              progress=not args.no_progress)
    except ImggenError as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
