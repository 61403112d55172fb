"""model.context_fill regress (issue 55): a frozen hole regressor's fill as a context channel. The
channel is the regressor's fill of the hole and the image elsewhere, the checkpoint carries the
regressor (a run folder alone inpaints), training leaves it untouched, --resume continues exactly,
and a missing or ill-fitting regressor is one clear error."""
from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch

import imggen
from imggen.checkpoint import find_checkpoint
from imggen.config import Config, DataConfig, ModelConfig, TrainConfig
from imggen.errors import CheckpointError, ConfigError, ShapeError
from imggen.inpainting.context import context_channels, make_context
from imggen.inpainting.regress import HoleRegressor, pixel_values, predict, save, train_regressor
from imggen.model import ImageTransformer
from imggen.sampling import inpaint_images, teacher_force
from imggen.tokens import tokenize
from imggen.training import train

H, W = 4, 5


def _regressor(tmp_path, shape=(1, H, W), fill="none", name="regress.pt"):
    torch.manual_seed(0)
    reg = HoleRegressor(*shape, width_features=8, hidden=6, fill=fill)
    images = np.random.default_rng(0).integers(0, 256, (16, *shape), dtype=np.uint8)
    train_regressor(reg, images, None, steps=3, batch_size=4)
    save(reg, tmp_path / name)
    return reg.eval(), str(tmp_path / name)


def _cfg(regressor="", steps=4, **model_kw):
    model = ModelConfig(height=H, width=W, channels=1, bits=8, dim=16, layers=1, heads=2, attention="band", window=7,
                        context="unet", context_width=8, context_fill="regress", **model_kw)
    train_kw = dict(steps=steps, batch_size=4, lr=3e-3, warmup=2, eval_every=2, eval_images=4, ckpt_every=2,
                    log_every=1, sample_num=2, seed=1, task="inpaint", regressor=regressor, grid_time_frac=0.0)
    return Config(preset="test", model=model, train=TrainConfig(**train_kw), data=DataConfig(spec="synthetic"))


def _splits(n=24):
    imgs = np.random.default_rng(0).integers(0, 256, (n, 1, H, W), dtype=np.uint8)
    t = tokenize(imgs, 8).to(torch.uint8)
    return {"train": t[:16], "val": t[16:20], "test": t[20:]}


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (3, 1, H, W), dtype=torch.uint8, generator=g)
    masks = torch.zeros(3, H, W, dtype=torch.bool)
    masks[:, 1:3, 1:4] = True
    masks[2, 0, 0] = True
    return images, masks


@pytest.mark.parametrize("regress_fill", ["none", "biharmonic"])
def test_the_channel_is_the_regressors_fill(tmp_path, regress_fill):
    reg, _ = _regressor(tmp_path, fill=regress_fill)
    cfg = dataclasses.replace(_cfg().model, regress_width=8, regress_hidden=6, regress_fill=regress_fill)
    torch.manual_seed(0)
    m = ImageTransformer(cfg).eval()
    m.regressor.load_state_dict(reg.state_dict())
    torch.nn.init.normal_(m.context.out.weight, std=0.5)
    images, masks = _data()
    ctx = m.make_context(images, masks)
    assert ctx.shape == (3, context_channels(1, 0, "regress"), H, W) == (3, 3, H, W)
    want = torch.from_numpy(predict(reg, images, masks)).float() / 127.5 - 1.0  # the reference: a regressor's fill
    assert torch.allclose(ctx[:, 1:2], want, atol=1e-6)
    assert torch.equal(ctx[:, 0:1], (images.float() / 127.5 - 1.0).masked_fill(masks[:, None], 0.0))
    assert torch.equal(ctx[:, 2], masks.float())
    # a given fill wins where it is given; its NaN rows get the regressor's
    given = torch.full((3, 1, H, W), float("nan"))
    given[1] = 7.0
    ctx2 = m.make_context(images, masks, given)
    assert torch.equal(ctx2[0], ctx[0]) and torch.equal(ctx2[2], ctx[2])
    assert torch.allclose(ctx2[1, 1][masks[1]], torch.tensor(7.0 / 127.5 - 1.0))
    seen = []  # the regressor runs on the rows without a given fill only, and not at all when all are given
    hook = m.regressor.register_forward_hook(lambda mod, inp, out: seen.append(len(out)))
    m.make_context(images, masks, given)
    m.make_context(images, masks, torch.full((3, 1, H, W), 9.0))
    hook.remove()
    assert seen == [2]
    with pytest.raises(ShapeError, match="needs a fill for every image"):  # only the model can fill NaN rows
        make_context(images, masks, (1, H, W), fill="regress", fills=given)
    with torch.no_grad():  # cached decode equals the full forward with the regression channel
        tokens = torch.randint(0, 256, (3, cfg.seq_len))
        assert torch.allclose(teacher_force(m, tokens, context=ctx), m(tokens, context=ctx), atol=1e-4)
    filled, _ = inpaint_images(m, images, masks, context=ctx, seed=0)
    assert torch.equal(filled[:, 0][~masks[:, None]], images[~masks[:, None]])
    with pytest.raises(ShapeError, match="made by its model"):
        make_context(images, masks, (1, H, W), fill="regress")
    assert torch.equal(pixel_values(reg, images, masks), pixel_values(m.regressor, images, masks))


def test_config_rejects_what_cannot_work():
    for bad, msg in [(dict(context_slices=1), "cannot be combined with model.context_slices"),
                     (dict(regress_fill="regress"), "must be none or biharmonic"),
                     (dict(regress_width=0), "regress_width"),
                     (dict(context="none"), "needs model.context unet")]:
        with pytest.raises(ConfigError, match=msg):
            dataclasses.replace(_cfg().model, **bad).validate()


def test_training_keeps_the_regressor_and_the_folder_inpaints(tmp_path):
    reg, path = _regressor(tmp_path)
    data = _splits()
    train(_cfg(path, steps=2), str(tmp_path / "run"), data=data, progress=False)
    m = imggen.load_model(str(tmp_path / "run"))
    assert (m.config.regress_width, m.config.regress_hidden, m.config.regress_fill) == (8, 6, "none")
    for k, v in reg.state_dict().items():  # carried by the checkpoint, untouched by training
        assert torch.equal(m.regressor.state_dict()[k], v), k
    images, masks = _data()
    filled, _ = imggen.inpaint(m, images[0], masks[0], samples=2, reduce="mean")
    assert torch.equal(filled[0][:, ~masks[0]], images[0][:, ~masks[0]])
    # --resume continues exactly, with the regressor file gone: the checkpoint holds it
    train(_cfg(path, steps=4), str(tmp_path / "full"), data=data, progress=False)

    def stop_at_2(step, loss):
        if step == 2:
            raise RuntimeError("stopped")
        return loss

    with pytest.raises(RuntimeError, match="stopped"):
        train(_cfg(path, steps=4), str(tmp_path / "half"), data=data, progress=False, hooks={"loss": stop_at_2})
    os.remove(path)
    train(_cfg(path, steps=4), str(tmp_path / "half"), data=data, progress=False, resume=True)
    a, b = imggen.load_model(str(tmp_path / "full")), imggen.load_model(str(tmp_path / "half"))
    for (k, v), w in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(v, w), k
    assert find_checkpoint(str(tmp_path / "half")).endswith("step_0000004")


def test_a_missing_or_ill_fitting_regressor_is_one_clear_error(tmp_path, capsys):
    from imggen.cli import train_main

    rc = train_main(["--preset", "fashion-inpaint", "--data", "synthetic", "--model.context_fill", "regress",
                     "--steps", "1", "--out", str(tmp_path / "cli"), "--no-progress", "--device", "cpu"])
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line]
    assert rc == 2 and len(err) == 1 and "--train.regressor PATH" in err[0], err
    data = _splits()
    with pytest.raises(ConfigError, match="--train.regressor PATH"):
        train(_cfg(""), str(tmp_path / "a"), data=data, progress=False)
    with pytest.raises(CheckpointError, match="no such file"):
        train(_cfg(str(tmp_path / "nope.pt")), str(tmp_path / "b"), data=data, progress=False)
    _, other = _regressor(tmp_path, shape=(1, 6, 6), name="other.pt")
    with pytest.raises(ConfigError, match="fills 1-channel 6x6 images, but this model's are 1-channel 4x5"):
        train(_cfg(other), str(tmp_path / "c"), data=data, progress=False)
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="not a hole-regressor checkpoint"):
        train(_cfg(str(tmp_path / "junk.pt")), str(tmp_path / "d"), data=data, progress=False)
