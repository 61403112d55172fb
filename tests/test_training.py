"""Training stops: non-finite loss, gradients or weights name a loadable checkpoint; --resume at or past --steps."""
import json
import os
import re

import numpy as np
import pytest
import torch

import imggen
from imggen.checkpoint import resolve
from imggen.config import Config, DataConfig, ModelConfig, TrainConfig
from imggen.errors import ConfigError, TrainingError
from imggen.tokens import tokenize
from imggen.training import train


def run_cfg(steps=6, ckpt_every=3, **train_kw):
    model = ModelConfig(height=4, width=5, channels=1, bits=3, dim=16, layers=1, heads=2, attention="band", window=7)
    train_kw = dict(dict(steps=steps, batch_size=4, lr=3e-3, warmup=2, eval_every=3, eval_images=4,
                         ckpt_every=ckpt_every, log_every=1, sample_num=2, seed=1), **train_kw)
    return Config(preset="test", model=model, train=TrainConfig(**train_kw), data=DataConfig(spec="synthetic"))


def splits(cfg, n=24):
    imgs = np.random.default_rng(0).integers(0, 256, (n, 1, cfg.model.height, cfg.model.width), dtype=np.uint8)
    t = tokenize(imgs, cfg.model.bits).to(torch.uint8)
    return {"train": t[:16], "val": t[16:20], "test": t[20:]}


def named_checkpoint(err: pytest.ExceptionInfo) -> str:
    return re.search(r"last good checkpoint is (\S+step_\d+)", str(err.value)).group(1)


def finite_loss(ckpt: str, data: dict) -> bool:
    model = imggen.load_model(ckpt)
    x = data["train"].long()
    with torch.no_grad():
        logits = model(x)
    return bool(torch.isfinite(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                                 x.reshape(-1))))


# ------------------------------------------------------------------------------- non-finite stops
def test_huge_lr_stop_names_a_checkpoint_that_loads_with_finite_loss(tmp_path):
    cfg = run_cfg(steps=40, ckpt_every=1, lr=1e8, warmup=100000, eval_every=1000, grad_clip=1e30)
    data, out = splits(cfg), str(tmp_path / "run")
    with pytest.raises(TrainingError, match=r"became .* at step \d+; training stopped and the last good "
                                            r"checkpoint is .*Lower --lr .*then --resume") as err:
        train(cfg, out, data=data, progress=False)
    named = named_checkpoint(err)
    assert resolve(out) == named  # what --resume and load_model pick
    assert finite_loss(named, data)


def test_checkpoint_of_the_failing_step_is_set_aside(tmp_path):
    """The checkpoint of step 3 holds the weights whose gradients are NaN at step 3: it is not good."""
    cfg = run_cfg(steps=10, ckpt_every=1)
    data, out = splits(cfg), str(tmp_path / "run")

    def nan_grad(step, loss):  # adds 0 to the loss, but an infinite / NaN gradient
        return loss + (loss - loss.detach()).abs().sqrt() if step == 3 else loss

    with pytest.raises(TrainingError, match=r"gradient norm became nan at step 3; .*step_0000002 \(the weights that "
                                            r"gave it are set aside as step_0000003\.diverged\)") as err:
        train(cfg, out, data=data, progress=False, hooks={"loss": nan_grad})
    assert named_checkpoint(err).endswith("step_0000002") and resolve(out) == named_checkpoint(err)
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["LATEST", "step_0000002", "step_0000003.diverged"]
    train(cfg, out, resume=True, data=data, progress=False)  # the same run continues from step 2


def test_a_resume_that_fails_at_once_falls_back_to_the_checkpoint_before(tmp_path):
    data, out = splits(run_cfg()), str(tmp_path / "run")
    train(run_cfg(steps=3, ckpt_every=1), out, data=data, progress=False)  # keeps step_2 and step_3

    def poison(step, loss):
        return loss * float("nan") if step == 3 else loss

    with pytest.raises(TrainingError, match=r"at step 3; .*last good checkpoint is \S+step_0000002 \(the weights "
                                            r"that gave it are set aside as step_0000003\.diverged\)") as err:
        train(run_cfg(steps=6, ckpt_every=1), out, resume=True, data=data, progress=False, hooks={"loss": poison})
    assert resolve(out) == named_checkpoint(err)


def test_nonfinite_weights_are_never_saved(tmp_path, monkeypatch):
    cfg = run_cfg(steps=10, ckpt_every=1)
    data, out, real_step, calls = splits(cfg), str(tmp_path / "run"), torch.optim.AdamW.step, []

    def step(self, *args, **kw):  # the 3rd update leaves an infinite weight
        result = real_step(self, *args, **kw)
        calls.append(1)
        if len(calls) == 3:
            self.param_groups[0]["params"][0].data.fill_(float("inf"))
        return result

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    with pytest.raises(TrainingError, match="weights became non-finite at step 3; .*last good checkpoint is "
                                            r"\S+step_0000002\. Lower --lr"):
        train(cfg, out, data=data, progress=False)
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["LATEST", "step_0000001", "step_0000002"]
    assert finite_loss(resolve(out), data)


def test_stop_before_any_checkpoint_does_not_suggest_resume(tmp_path):
    cfg = run_cfg(steps=10, ckpt_every=100)
    data = splits(cfg)

    def poison(step, loss):
        return loss * float("nan") if step == 2 else loss

    with pytest.raises(TrainingError, match="loss became nan at step 2; training stopped before a good "
                                            r"checkpoint was saved\. .* start again") as err:
        train(cfg, str(tmp_path / "run"), data=data, progress=False, hooks={"loss": poison})
    assert "--resume" not in str(err.value)


def test_first_checkpoint_bad_leaves_none(tmp_path):
    cfg = run_cfg(steps=10, ckpt_every=2)
    data, out = splits(cfg), str(tmp_path / "run")

    def poison(step, loss):
        return loss * float("nan") if step == 2 else loss

    with pytest.raises(TrainingError, match=r"before a good checkpoint was saved \(the weights that gave it are "
                                            r"set aside as step_0000002\.diverged\)") as err:
        train(cfg, out, data=data, progress=False, hooks={"loss": poison})
    assert "--resume" not in str(err.value)
    train(cfg, out, data=data, progress=False)  # nothing to resume or overwrite


# ------------------------------------------------------------------------- --resume and --steps
def _records(out):
    return {name: open(os.path.join(out, name), "rb").read()
            for name in ("log.jsonl", "metrics.json", "config.json", "samples.png")}


def test_resume_of_a_finished_run_at_its_steps_changes_nothing(tmp_path, capsys):
    cfg = run_cfg(steps=3, ckpt_every=3)
    data, out = splits(cfg), str(tmp_path / "run")
    train(cfg, out, data=data, progress=False)
    before = _records(out)
    capsys.readouterr()
    metrics = train(run_cfg(steps=3, ckpt_every=3), out, resume=True, data=data, progress=False)
    assert "already complete at step 3" in capsys.readouterr().out
    assert _records(out) == before
    assert metrics == json.loads(before["metrics.json"]) and "val_bpd" in metrics


def test_resume_with_steps_below_the_saved_step_is_clear_error(tmp_path):
    cfg = run_cfg(steps=3, ckpt_every=3)
    data, out = splits(cfg), str(tmp_path / "run")
    train(cfg, out, data=data, progress=False)
    before = _records(out)
    with pytest.raises(ConfigError, match="already at step 3, past --steps 2; pass --steps above 3"):
        train(run_cfg(steps=2, ckpt_every=3), out, resume=True, data=data, progress=False)
    assert _records(out) == before


def test_resume_at_the_step_of_an_interrupted_run_finishes_it(tmp_path):
    cfg = run_cfg(steps=6, ckpt_every=3)
    data, out = splits(cfg), str(tmp_path / "run")

    def stop(step, loss):
        if step == 3:
            raise KeyboardInterrupt
        return loss

    with pytest.raises(KeyboardInterrupt):
        train(cfg, out, data=data, progress=False, hooks={"loss": stop})
    metrics = train(run_cfg(steps=3, ckpt_every=3), out, resume=True, data=data, progress=False)
    assert metrics["steps"] == 3 and {"val_bpd", "test_bpd"} <= set(metrics)
    rows = [json.loads(line) for line in open(os.path.join(out, "log.jsonl"))]
    assert [r["step"] for r in rows if "test_bpd" in r] == [3]


# ------------------------------------------------------------------------------- progress bar
def test_progress_bar_shows_no_token_rate_before_it_is_measured(tmp_path, capsys):
    """tok_s appears once the first log step has measured it (it used to read 0 until then)."""
    cfg = run_cfg(steps=3, ckpt_every=3, log_every=2, grid_time_frac=0)
    train(cfg, str(tmp_path / "run"), data=splits(cfg), progress=True)
    err = capsys.readouterr().err
    assert "bpd=" in err and re.search(r"tok_s=[1-9]", err)
    assert not re.search(r"tok_s=0\b", err)
