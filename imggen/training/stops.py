"""How a training run that stops says so: the last good checkpoint and the command that continues it,
a lost DDP peer, a non-finite stop (its checkpoint set aside). Part of imggen.training; imports the
checkpoint module and torch.distributed."""
from __future__ import annotations

import os

import torch.distributed as dist

from imggen import checkpoint as ck


def resume_hint(out: str, fix: str = "") -> str:
    """Where a stopped run can continue from: its newest complete checkpoint and the command."""
    found = ck.find_checkpoint(out) if os.path.isdir(out) else None
    fix = f"{fix}, then " if fix else ""
    if found is None:
        return f"no checkpoint was saved; {fix}start again"
    return f"the last good checkpoint is step {ck.step_of(found)} ({found}); {fix}continue with: python train.py " \
           f"--out {out} --resume"


def lost_peer(e: RuntimeError) -> bool:
    """Whether a collective failed because another process of the job died (gloo / NCCL)."""
    text = str(e)
    return isinstance(e, dist.DistError) or any(s in text for s in (
        "Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL", "gloo"))


def first_line(e: Exception) -> str:
    line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return line.split("] ", 1)[-1].split(". ")[0][:160]  # gloo's "[file.cc:561] " prefix and advice off


def stopped(run) -> str:
    """The end of the message of a non-finite stop at run.step: which checkpoint --resume continues.
    A checkpoint of this very step holds the weights that gave the non-finite values: it is set aside."""
    t, removed = run.cfg.train, ""
    if run.main and run.last_good and os.path.basename(run.last_good) == f"step_{run.step:07d}":
        aside, run.last_good = ck.set_aside(run.last_good)
        removed = f" (the weights that gave it are set aside as {os.path.basename(aside)})"
    fix = f"Lower --lr (now {t.lr:g}) or --train.grad_clip (now {t.grad_clip:g})"
    if run.last_good:
        return f"training stopped and the last good checkpoint is {run.last_good}{removed}. {fix}, then --resume"
    return f"training stopped before a good checkpoint was saved{removed}. {fix} and start again (--overwrite)"
