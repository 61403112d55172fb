"""A task defined here, in the test file alone, trains, evaluates and draws its grid through the
training loop: proof that a new task is one subclass (imggen.inpainting.tasks.Task) and no edits elsewhere."""
import math

import numpy as np
import pytest
import torch

import imggen
from imggen.config import Config, DataConfig, ModelConfig, TrainConfig
from imggen.errors import ConfigError
from imggen.inpainting.tasks import TASKS, Task
from imggen.tokens import tokenize
from imggen.training import train


class LowerHalf(Task):
    """Toy: learn the lower half of each image given its upper half (no context): the loss and the
    bits/dim cover the lower half's tokens only."""
    name = "toy_lower_half"

    def __init__(self):
        self.batches = 0

    @staticmethod
    def weights(x):
        w = torch.zeros_like(x, dtype=torch.float32)
        w[:, x.shape[1] // 2:] = 1
        return w

    def batch(self, cfg, model, splits, x, idx, step, part, world, augment=None):
        self.batches += 1
        w = self.weights(x)
        return x, None, w, float(w.sum())

    def eval_inputs(self, cfg, model, splits, split, n):
        return lambda x, rows: (None, self.weights(x))


def cfg_with(task: str) -> Config:
    model = ModelConfig(height=4, width=6, channels=1, bits=3, dim=16, layers=1, heads=2, attention="band", window=7)
    train_cfg = TrainConfig(steps=4, batch_size=4, lr=3e-3, warmup=1, eval_every=2, eval_images=4, ckpt_every=2,
                            log_every=1, sample_num=2, seed=1, task=task)
    return Config(preset="test", model=model, train=train_cfg, data=DataConfig(spec="synthetic"))


def test_a_task_defined_in_a_test_file_trains_and_scores_only_its_tokens(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="train.task must be one of"):
        cfg_with("toy_lower_half").validate()
    task = LowerHalf()
    monkeypatch.setitem(TASKS, task.name, task)
    cfg = cfg_with(task.name).validate()
    imgs = np.random.default_rng(0).integers(0, 8, (24, 1, 4, 6), dtype=np.uint8) * 32
    t = tokenize(imgs, cfg.model.bits).to(torch.uint8)
    data = {"train": t[:16], "val": t[16:20], "test": t[20:]}
    metrics = train(cfg, str(tmp_path / "run"), data=data, progress=False)
    assert task.batches == 4
    # the run's test bits/dim is the lower half's, under the saved final weights
    model = imggen.load_model(str(tmp_path / "run")).eval()
    x = data["test"].long()
    with torch.no_grad():
        nll = torch.nn.functional.cross_entropy(model(x).reshape(-1, cfg.model.vocab), x.reshape(-1),
                                                reduction="none").view(x.shape).double()
    lower = x.shape[1] // 2
    want = float((nll[:, lower:].mean(1) / math.log(2)).mean())
    whole = float((nll.mean(1) / math.log(2)).mean())
    assert metrics["test_bpd"] == pytest.approx(want, rel=1e-6)
    assert abs(want - whole) > 1e-3  # the task's weights change the score: the test can fail
    assert (tmp_path / "run" / "samples.png").exists()
