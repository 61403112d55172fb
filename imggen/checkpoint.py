"""Checkpoints: safetensors weights + JSON config + optimizer/RNG state, written atomically.

Layout of a run directory:
    RUN/config.json                     the run's full config
    RUN/checkpoints/step_000200/        model.safetensors, config.json, state.pt
    RUN/checkpoints/LATEST              name of the newest complete checkpoint (replaced atomically)

A checkpoint directory is written under a temporary name and renamed when complete; LATEST is
replaced only afterwards, so a process killed while saving leaves the previous checkpoint loadable.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile

import torch
from safetensors.torch import load_file, save_file

from imggen.config import Config
from imggen.errors import CheckpointError, ConfigError


def _atomic_write_text(path: str, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(run_dir: str, step: int, model, cfg: Config, state: dict | None = None, keep: int = 2) -> str:
    ckpts = os.path.join(run_dir, "checkpoints")
    os.makedirs(ckpts, exist_ok=True)
    name = f"step_{step:07d}"
    tmp = tempfile.mkdtemp(dir=ckpts, prefix=".tmp-")
    weights = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(weights, os.path.join(tmp, "model.safetensors"), metadata={"step": str(step)})
    with open(os.path.join(tmp, "config.json"), "w") as f:
        f.write(cfg.to_json())
    if state is not None:
        torch.save(state, os.path.join(tmp, "state.pt"))
    final = os.path.join(ckpts, name)
    if os.path.exists(final):
        shutil.rmtree(final)
    os.replace(tmp, final)
    _atomic_write_text(os.path.join(ckpts, "LATEST"), name)
    old = sorted(d for d in os.listdir(ckpts) if d.startswith("step_") and d != name)
    for d in old[: max(0, len(old) - (keep - 1))]:
        shutil.rmtree(os.path.join(ckpts, d), ignore_errors=True)
    return final


def resolve(path: str) -> str:
    """A run dir, a checkpoint dir or a model.safetensors file -> the checkpoint directory."""
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint {path} does not exist; pass a run directory written by train.py "
                              f"(e.g. runs/demo) or one of its checkpoints/step_* folders")
    if os.path.isfile(path):
        path = os.path.dirname(os.path.abspath(path))
    latest = os.path.join(path, "checkpoints", "LATEST")
    if os.path.exists(latest):
        with open(latest) as f:
            path = os.path.join(path, "checkpoints", f.read().strip())
    if not os.path.exists(os.path.join(path, "model.safetensors")):
        raise CheckpointError(f"no model.safetensors under {path}; is it a run directory that has saved a "
                              f"checkpoint yet?")
    return path


def read_config(ckpt_dir: str) -> Config:
    try:
        with open(os.path.join(ckpt_dir, "config.json")) as f:
            return Config.from_dict(json.load(f))
    except (OSError, json.JSONDecodeError, ConfigError) as e:
        raise CheckpointError(f"cannot read the config of checkpoint {ckpt_dir}: {e}") from None


def config_diff(a: Config, b: Config, section: str = "model") -> list[str]:
    da, db = a.to_dict()[section], b.to_dict()[section]
    return [f"{section}.{k}: checkpoint {da.get(k)!r} vs requested {db.get(k)!r}"
            for k in sorted(set(da) | set(db)) if da.get(k) != db.get(k)]


def load_weights(model, ckpt_dir: str, cfg: Config | None = None) -> None:
    """Load weights into `model`; a checkpoint from another model config is a CheckpointError."""
    saved = read_config(ckpt_dir)
    if cfg is not None:
        diff = config_diff(saved, cfg)
        if diff:
            raise CheckpointError(f"checkpoint {ckpt_dir} was trained with another model config:\n  "
                                  + "\n  ".join(diff) + "\nuse the same --model.* settings or a new --out")
    try:
        weights = load_file(os.path.join(ckpt_dir, "model.safetensors"))
    except Exception as e:  # safetensors raises several types on corrupt files
        raise CheckpointError(f"cannot read {ckpt_dir}/model.safetensors: {e}") from None
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {ckpt_dir} does not fit this model: missing {missing}, "
                              f"unexpected {unexpected}")


def load_model(path: str, device: str | torch.device = "cpu", backend: str | None = None):
    """Restore a model (config + weights) from a run dir, checkpoint dir or safetensors file."""
    from imggen.model import ImageTransformer

    ckpt = resolve(path)
    cfg = read_config(ckpt)
    if backend is not None:
        cfg.model.backend = backend
    model = ImageTransformer(cfg.model)
    load_weights(model, ckpt)
    return model.to(device).eval()
