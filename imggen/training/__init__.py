"""Training loop and the train.py CLI (single process, or DDP under torchrun).

Reads top to bottom: `setup` (config, data, model, optimizer, `--resume`) -> `train_step` (one
AdamW step: bf16 autocast as --train.precision says, clipping, a clear error on a non-finite loss) -> `periodic`
(log, validation bits/dim, sample grids, atomic checkpoints) -> `finish` (test bits/dim, final
grid). `--resume` restores weights, optimizer, RNG state and the data position exactly; SIGINT /
SIGTERM finish the current step, save a checkpoint and exit with code 130. What differs between
tasks (generate, inpaint) is asked of the run's task (imggen.inpainting.tasks).

The package: the loop (this module), the data and the order of the batches (`batches`), the run log,
the stop signal and the sample grids (`runlog`), and the run folder's lock (`runlock`). May import
everything below it (config, model, checkpoint, sampling, imggen.eval, imggen.inpainting, datasets, the
base modules); only the CLIs import it (tests/test_layout.py: LAYERS).
"""
from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from imggen import checkpoint as ck
from imggen.augment import augment_tokens
from imggen.config import Config
from imggen.errors import CheckpointError, ConfigError, DataError, Interrupted, StorageError, TrainingError, WorkerLost
from imggen.inpainting.tasks import TASKS
from imggen.inpainting.regress import adopt as adopt_regressor
from imggen.model import ImageTransformer
from imggen.precision import autocast, describe, resolve
from imggen.storage import atomic_write_text
from imggen.training.average import WeightAverage, averaged, load_trained
from imggen.training.batches import batch_indices, load_data, split_bits, unigram_bpd
from imggen.training.runlock import RunLock
from imggen.training.runlog import Logger, StopSignal, final_grid, final_metrics, sample_grid
from imggen.training.stops import first_line as _first_line, lost_peer as _lost_peer, resume_hint as _resume_hint, \
    stopped as _stopped

LN2 = math.log(2.0)


# ----------------------------------------------------------------------------------- helpers
def lr_at(step: int, cfg) -> float:
    t = cfg.train
    if step < t.warmup:
        return t.lr * (step + 1) / t.warmup
    frac = min(1.0, (step - t.warmup) / max(1, t.steps - t.warmup))
    return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def build_model_and_optimizer(cfg: Config, device, regressor=None):
    """The seeded model and its AdamW (weight decay on matrices only), as training starts them; a
    model.context_fill regress model gets `regressor`'s weights (frozen: not in the optimizer)."""
    t = cfg.train
    torch.manual_seed(t.seed)
    model = ImageTransformer(cfg.model).to(device)
    if regressor is not None:
        model.regressor.load_state_dict(regressor.state_dict())
    model.checkpointing = t.activation_checkpointing
    trained = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in trained if p.dim() >= 2]
    no_decay = [p for p in trained if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=t.lr, betas=(0.9, 0.95))
    return model, opt


def train_step(model, opt, x: torch.Tensor, step: int, cfg: Config, device, loss_hook=None,
               context: torch.Tensor | None = None, loss_mask: torch.Tensor | None = None,
               mask_norm: float | None = None) -> float:
    """One optimiser step on token batch x (with a context and a token loss mask for inpainting);
    returns the loss in bits/dim (TrainingError if the loss or the gradient norm is not finite).

    The masked loss is the sum of the masked NLL over `mask_norm`: by default this batch's mask count
    (its mean). Under DDP, which averages the processes' gradients, pass the global batch's
    `imggen.inpainting.tasks.ddp_mask_norm` (its mask count / the number of processes): the
    gradient is then that of the global batch's mean, as one process would compute it, whatever
    each process's own share of the mask; the returned values, averaged over the processes, are
    the global batch's loss."""
    for g in opt.param_groups:
        g["lr"] = lr_at(step, cfg)
    with autocast(device, cfg.train.precision):  # -log p of each token (ImageTransformer.forward, nll=True)
        nll = model(x, context=context, nll=True).float().reshape(-1)
    if loss_mask is None:
        loss = nll.mean()
    else:  # a batch (or a process's share) without unknown pixels has loss 0, not 0/0
        norm = float(loss_mask.sum()) if mask_norm is None else float(mask_norm)
        loss = (nll * loss_mask.reshape(-1)).sum() / max(norm, 1e-12)
    if loss_hook is not None:
        loss = loss_hook(step, loss)
    value = float(loss.detach())
    if not math.isfinite(value):
        raise TrainingError(f"loss became {value} at step {step}")
    opt.zero_grad(set_to_none=True)
    loss.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip))
    if not math.isfinite(norm):  # checked before the update, which would spread it to every weight
        raise TrainingError(f"the gradient norm became {norm} at step {step}")
    opt.step()
    return value / LN2


# -------------------------------------------------------------------------------------- train
@dataclass
class Run:
    cfg: Config
    out: str
    device: str
    rank: int
    world: int
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    splits: dict
    step: int = 0
    last_good: str | None = None   # the newest checkpoint (good once the step after it trained)
    complete: bool = False         # --resume of a run that already finished at --steps
    metrics: dict = field(default_factory=dict)
    progress: bool = True  # progress bars (train.py --no-progress turns all of them off)
    average: WeightAverage | None = None  # --train.ema: the weights' average, the run's model

    @property
    def main(self) -> bool:
        return self.rank == 0


def train_device(device: str | None) -> str:
    """Where training runs: under torchrun the process's local GPU (else the CPU); else `device`,
    else cuda when available."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if torch.cuda.is_available() else "cpu"
    return device or ("cuda" if torch.cuda.is_available() else "cpu")


def _dist_setup():
    """Join the process group (under torchrun). torchrun serves one store to every group it starts
    (--master_port and --rdzv-backend c10d alike), and a group restarted by --max-restarts found the keys
    of the group before it there: gloo read a dead process's address, and the restart was refused or hung
    with each rank waiting for the other (issue 37). Each restart gets keys of its own."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1
    rank = int(os.environ["RANK"])
    store = next(dist.rendezvous("env://", rank, world))[0]
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", rank=rank, world_size=world,
                            store=dist.PrefixStore(f"imggen/attempt_{attempt}/", store))
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return dist.get_rank(), world


def setup(cfg: Config, out: str, resume: bool, overwrite: bool, device: str | None, data: dict | None,
          progress: bool = True) -> Run:
    """Config checks, run directory, model + optimizer (restored with --resume), data."""
    rank, world = _dist_setup()
    device = train_device(device)
    cfg.validate()
    if cfg.train.batch_size % world:
        raise ConfigError(f"--batch-size {cfg.train.batch_size} must be divisible by the number of processes ({world})")
    os.makedirs(out, exist_ok=True)
    found = ck.find_checkpoint(out)
    if resume and found is None:
        raise CheckpointError(f"--resume: {out} holds no checkpoint to continue; run without --resume to start fresh")
    if found and not (resume or overwrite):
        raise CheckpointError(f"{out} already holds a checkpoint; pass --resume to continue it or "
                              f"--overwrite to start again (or choose another --out)")
    regressor = None
    if resume:
        saved = ck.read_config(found)
        if cfg.model.context_fill == saved.model.context_fill == "regress":  # the regressor's, from its file
            for f in ("regress_width", "regress_hidden", "regress_fill"):
                setattr(cfg.model, f, getattr(saved.model, f))
        diff = ck.config_diff(saved, cfg) + ck.config_diff(saved, cfg, "data")
        if saved.train.precision != cfg.train.precision:  # a property of the run, as the model is
            diff.append(f"train.precision: checkpoint {saved.train.precision!r} vs requested {cfg.train.precision!r}")
        if diff:
            raise CheckpointError(f"cannot resume {out}: its config differs from the requested one:\n  "
                                  + "\n  ".join(diff))
        ck.check_fits(found, cfg)  # the weights file bounds the model a run folder can make us build
        was, now = ck.read_notes(found).get("precision"), resolve(cfg.train.precision, device)[0]
        if was and was != now and rank == 0:  # `auto` on another machine
            print(f"note: {out} trained in {was} so far and continues in {now} here (--train.precision "
                  f"{cfg.train.precision}); the continuation is not bit-exact")
    elif cfg.model.context_fill == "regress":
        regressor = adopt_regressor(cfg.model, cfg.train.regressor)
    model, opt = build_model_and_optimizer(cfg, device, regressor)
    run = Run(cfg, out, device, rank, world, model, opt, {})
    run.average = WeightAverage(model, cfg.train.ema) if cfg.train.ema else None
    if resume:
        ck.load_weights(model, found, cfg)
        state = ck.load_state(found, device)
        if run.average is None:  # the trained weights, where the checkpoint holds an average
            load_trained(dict(model.named_parameters()), state.get("trained"))
        else:
            run.average.restore(state.get("trained"))
        opt.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
        run.step, run.last_good = state["step"], found
        if cfg.train.steps < run.step:
            raise ConfigError(f"--resume: {out} is already at step {run.step}, past --steps {cfg.train.steps}; "
                              f"pass --steps above {run.step} to train further")
        if cfg.train.steps == run.step and (done := final_metrics(out, run.step)):
            run.metrics, run.complete = done, True  # nothing to train or to record again
            return run
        if run.main:
            print(f"resumed {out} at step {run.step} from {found}")
    if run.main:
        atomic_write_text(os.path.join(out, "config.json"), cfg.to_json())
        print(describe(cfg.train.precision, device))
    run.splits = data if data is not None else load_data(cfg, progress)[0]
    if run.main:
        print(f"data {cfg.data.spec}: {len(run.splits['train'])} train / {len(run.splits['val'])} val / "
              f"{len(run.splits['test'])} test images of {cfg.model.shape}; "
              f"model {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, attention {cfg.model.attention}")
    return run


def periodic(run: Run, logger: Logger, rate: dict) -> None:
    """After each step: log, validate, sample, checkpoint, as the config's intervals say."""
    t, step = run.cfg.train, run.step
    if step % t.log_every == 0 or step == t.steps:
        now = time.time()
        tps = t.batch_size * run.cfg.model.seq_len * (step - rate["step"]) / max(1e-9, now - rate["time"])
        rate.update(step=step, time=now, tokens_per_s=tps)
        logger.log(step, train_bpd=rate["bpd"], lr=lr_at(step - 1, run.cfg), tokens_per_s=tps)
    with averaged(run.average if run.main else None):
        if run.main and (step % t.eval_every == 0 or step == t.steps):
            run.metrics["val_bpd"] = val = evaluate(run, "val", t.eval_images)
            logger.log(step, val_bpd=val)
        if run.main and t.sample_every and step % t.sample_every == 0 and step != t.steps:
            sample_grid(run, t.sample_num)
    if step % t.ckpt_every == 0 or step == t.steps:
        save(run)


def save(run: Run) -> None:
    """A checkpoint of the current step (its model the weights' average, with --train.ema); TrainingError
    instead when a weight is not finite."""
    if not torch.stack([p.detach().isfinite().all() for p in run.model.parameters()]).all():
        raise TrainingError(f"the weights became non-finite at step {run.step}")
    state = {"optimizer": run.opt.state_dict(), "rng": torch.get_rng_state(), "step": run.step}
    if run.main and run.average is not None:
        state["trained"] = run.average.trained()
    with averaged(run.average if run.main else None):
        if run.main:
            run.last_good = ck.save_checkpoint(run.out, run.step, run.model, run.cfg, state,
                                               notes={"precision": resolve(run.cfg.train.precision, run.device)[0]})
    if run.world > 1:
        dist.barrier()


def evaluate(run: Run, split: str, limit: int | None = None) -> float:
    """Bits/dim of a split as the task scores it (split_bits); validation in the training's precision (bf16
    autocast: 2.5x faster on the Xeon of RESULTS 18), the test figure always in float32."""
    with autocast(run.device, run.cfg.train.precision if split == "val" else "fp32"):
        return float(split_bits(run.cfg, run.model, run.splits, split, limit).mean())


def train(cfg: Config, out: str, resume: bool = False, overwrite: bool = False, device: str | None = None,
          data: dict | None = None, progress: bool = True, hooks: dict | None = None, governor=None) -> dict:
    """Train `cfg` into run directory `out`. Returns final metrics. `data` = pre-tokenised splits;
    `governor` (imggen.threads) adapts the CPU thread count as other processes come and go.

    The process that writes `out` (rank 0) holds its lock (imggen.training.runlock) from before the first
    write to the end: a folder another live run holds is RunBusy. A write that fails for want of
    storage is one StorageError naming the path, the last good checkpoint and the --resume command."""
    fresh, lock = not os.path.exists(out), RunLock(out).acquire() if int(os.environ.get("RANK", "0")) == 0 else None
    try:
        return _train(cfg, out, resume, overwrite, device, data, progress, hooks, governor)
    except StorageError as e:
        raise StorageError(f"{e}; {_resume_hint(out, 'free space (or make the folder writable)')}", e.errno) from None
    except DataError:  # data that cannot be read leaves no new run folder behind
        if fresh and lock is not None and ck.find_checkpoint(out) is None:
            shutil.rmtree(out, ignore_errors=True)
        raise
    finally:
        if lock is not None:
            lock.release()


def _train(cfg, out, resume, overwrite, device, data, progress, hooks, governor) -> dict:
    run = setup(cfg, out, resume, overwrite, device, data, progress)
    run.progress = progress
    t = cfg.train
    if run.complete:
        if run.main:
            print(f"{out} is already complete at step {run.step}; pass --steps above {run.step} to train further")
        if run.world > 1:
            dist.destroy_process_group()
        return run.metrics
    net = torch.nn.parallel.DistributedDataParallel(run.model) if run.world > 1 else run.model
    logger = Logger(out, run.main, run.step)
    bar = tqdm(total=t.steps, initial=run.step, desc="train", unit="step", dynamic_ncols=True,
               disable=not (progress and run.main))
    rate = {"step": run.step, "time": time.time(), "bpd": math.nan}
    t_start = time.time()
    run.model.train()
    with StopSignal() as stop:
        while run.step < t.steps:
            if governor is not None:
                governor.tick()
            x, context, loss_mask, norm = next_batch(run)
            try:
                rate["bpd"] = train_step(net, run.opt, x, run.step, cfg, run.device, (hooks or {}).get("loss"),
                                         context, loss_mask, norm)
                if run.average is not None:
                    run.average.update(run.step)
                run.step += 1
                stopping, rate["bpd"] = _sync_step(run, stop, rate["bpd"])
                bar.update(1)
                shown = {"bpd": f"{rate['bpd']:.3f}"}
                if "tokens_per_s" in rate:  # measured at the first log step; none shown before it
                    shown["tok_s"] = f"{rate['tokens_per_s']:.0f}"
                bar.set_postfix(shown)
                periodic(run, logger, rate)
                if stopping and run.step < t.steps:
                    bar.close()
                    if run.step % t.ckpt_every:  # not saved by periodic() already
                        save(run)
                    raise Interrupted(f"interrupted at step {run.step}, saved; continue with --resume")
            except TrainingError as e:
                bar.close()
                raise TrainingError(f"{e}; {_stopped(run)}") from None
            except RuntimeError as e:
                if run.world == 1 or not _lost_peer(e):
                    raise
                bar.close()
                raise WorkerLost(f"rank {run.rank}: another process of this run is gone ({_first_line(e)}), so "
                                 f"training stopped at step {run.step}; {_resume_hint(out)}") from None
    bar.close()
    return finish(run, logger, time.time() - t_start)


def next_batch(run: Run):
    """This process's part of the step's global batch, as the run's task makes it: tokens, and (None
    when the task scores every token) the context, the token loss mask and the loss divisor."""
    t, m = run.cfg.train, run.cfg.model
    idx = batch_indices(run.step, t.batch_size, len(run.splits["train"]), t.seed)
    part = slice(run.rank, None, run.world)
    x = run.splits["train"][idx[part]].long().to(run.device)
    rng = np.random.default_rng([t.seed, run.step, 3])  # train.augment's warps: (seed, step) as the masks

    def augment(x, masks=None, stack=None, fills=None):
        return augment_tokens(x, masks, rng, m, part, stack, batch=t.batch_size, fills=fills)

    return TASKS[t.task].batch(run.cfg, run.model, run.splits, x, idx.numpy(), run.step, part, run.world,
                               augment if t.augment else None)


def _sync_step(run: Run, stop: StopSignal, bpd: float) -> tuple[bool, float]:
    """(Whether any process was asked to stop, the step's loss averaged over the processes): under
    DDP the one collective per step, right after it, so the logged and shown loss is the global
    batch's, not rank 0's share. The processes' losses weigh the same: equal token counts for
    generation, and train_step's global `mask_norm` for inpainting. (A signal that arrives during
    the step's periodic() work stops the run after the next step.)"""
    if run.world == 1:
        return stop.requested, bpd
    both = torch.tensor([float(stop.requested), bpd], dtype=torch.float64,
                        device=run.device if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(both)
    return bool(both[0].item() > 0), both[1].item() / run.world


def finish(run: Run, logger: Logger, train_s: float) -> dict:
    with averaged(run.average if run.main else None):
        _finish_main(run, logger, train_s)
    if run.world > 1:
        dist.destroy_process_group()
    return run.metrics


def _finish_main(run: Run, logger: Logger, train_s: float) -> None:
    cfg = run.cfg
    if run.main:
        test = evaluate(run, "test")
        train = run.splits["train"]  # lazy data: the unigram entropy of a fixed sample of it
        uni = unigram_bpd(train.sample() if getattr(train, "is_lazy", False) else train, cfg.model.vocab)
        if "val_bpd" not in run.metrics:  # a --resume that only finishes the run (--steps at its step)
            run.metrics["val_bpd"] = evaluate(run, "val", cfg.train.eval_images)
        run.metrics.update(test_bpd=test, unigram_bpd=uni, steps=run.step)
        logger.log(run.step, test_bpd=test)
        grid = final_grid(run, train_s)
        atomic_write_text(os.path.join(run.out, "metrics.json"), json.dumps(run.metrics, indent=2))
        print(f"test bits/dim {test:.3f} (unigram entropy of the data {uni:.3f} bits/dim); "
              f"checkpoint {run.last_good}; samples {grid}")
