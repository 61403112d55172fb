"""What a training run leaves and shows besides its checkpoints: log.jsonl and TensorBoard rows,
the stop signal (SIGINT / SIGTERM), the final metrics and the sample grids."""
from __future__ import annotations

import json
import math
import os
import signal

from imggen.storage import atomic_write_text, writing
from imggen.inpainting.tasks import TASKS

GRID_MIN_S = 5.0  # the end-of-run grid may always take this long


class Logger:
    """log.jsonl rows and TensorBoard scalars; rows and events after `step` (the resumed step, 0
    for a fresh start) are dropped, so a resumed or overwritten run has no duplicate steps."""

    def __init__(self, out: str, enabled: bool, step: int = 0):
        self.enabled, self.path, self.tb = enabled, os.path.join(out, "log.jsonl"), None
        if not enabled:
            return
        if os.path.exists(self.path):  # a fresh start (step 0) keeps nothing of an earlier run
            with open(self.path) as f:
                keep = [line for line in f if line.strip() and _row_step(line) <= step]
            atomic_write_text(self.path, "".join(keep))
        self.tb_dir = os.path.join(out, "tb")
        try:
            from torch.utils.tensorboard import SummaryWriter
        except Exception:  # tensorboard is optional at run time
            return
        with writing(self.tb_dir):
            self.tb = SummaryWriter(self.tb_dir, purge_step=step)

    def log(self, step: int, **scalars):
        """One log.jsonl row and its TensorBoard scalars; a full disk (or any storage failure) is one
        StorageError naming the file, and TensorBoard's writer is closed so that it writes no more."""
        if not self.enabled:
            return
        with writing(self.path):
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": step, **scalars}) + "\n")
        if self.tb is not None:
            with writing(self.tb_dir, self.drop_tb):
                for k, v in scalars.items():
                    self.tb.add_scalar(k, v, step)
                self.tb.flush()

    def drop_tb(self) -> None:
        """Stop TensorBoard's background writer after a failed write (it would fail again at exit)."""
        tb, self.tb = self.tb, None
        try:
            tb.close()
        except Exception:  # noqa: BLE001 - the write that failed fails again here
            pass


def _row_step(line: str) -> float:
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return math.inf  # a line cut by a killed run


class StopSignal:
    """SIGINT / SIGTERM set a flag; the loop saves and stops after the current step. A second
    signal gets the default behaviour (the checkpoint write is atomic either way)."""

    def __init__(self):
        self.requested, self._old = False, {}

    def _handle(self, signum, frame):
        self.requested = True
        signal.signal(signum, self._old.get(signum, signal.SIG_DFL))

    def __enter__(self):
        if threading_main():
            for s in (signal.SIGINT, signal.SIGTERM):
                self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc):
        for s, h in self._old.items():
            signal.signal(s, h)


def threading_main() -> bool:
    import threading
    return threading.current_thread() is threading.main_thread()


def final_metrics(out: str, step: int) -> dict | None:
    """The metrics of run `out` when it finished at `step` (its metrics.json, written by `finish`, says so)."""
    try:
        with open(os.path.join(out, "metrics.json")) as f:
            metrics = json.load(f)
        return metrics if metrics.get("steps") == step else None
    except (OSError, ValueError, AttributeError):
        return None


def final_grid(run, train_s: float) -> str:
    """The end-of-run grid: `sample_num` images, or as many as fit in `grid_time_frac` of the
    training time (at least GRID_MIN_S; estimated from a few decode steps); none when it is 0."""
    from imggen.sampling import decode_seconds_per_step

    t = run.cfg.train
    if t.grid_time_frac <= 0:
        return "(none: train.grid_time_frac is 0)"
    budget, num = max(GRID_MIN_S, t.grid_time_frac * train_s), t.sample_num
    while num >= 1:
        cost = decode_seconds_per_step(run.model, num) * run.cfg.model.seq_len
        if cost <= budget:
            return sample_grid(run, num)
        num = num // 2
    return (f"(none: one image would take about {cost:.0f} s, over {budget:.0f} s = {t.grid_time_frac:.0%} of "
            f"the training time; sample.py draws them)")


def sample_grid(run, num: int) -> str:
    """`num` samples, or where the run's task gives images to fill (inpainting), test images | voided |
    filled, a row each -> samples.png."""
    from imggen.eval.runners import triplets
    from imggen.images import image_scale, save_grid
    from imggen.sampling import detokenize, inpaint_images, sample

    cfg, model = run.cfg, run.model
    model.eval()
    given = TASKS[cfg.train.task].grid_inputs(cfg, model, run.splits, num)
    if given is not None:
        images, masks, context = given
        filled, _ = inpaint_images(model, images, masks, seed=cfg.train.seed, progress=run.progress, context=context)
        imgs, nrow = triplets(images.numpy(), masks.numpy()[:, None], filled[:, 0].numpy()), 3
    else:
        imgs, nrow = detokenize(model, sample(model, num, seed=cfg.train.seed, progress=run.progress)).numpy(), None
    model.train()
    path = os.path.join(run.out, "samples", f"step_{run.step:07d}.png")
    scale = image_scale(cfg.model.width)
    save_grid(imgs, path, nrow=nrow, scale=scale)
    save_grid(imgs, os.path.join(run.out, "samples.png"), nrow=nrow, scale=scale)
    return path
