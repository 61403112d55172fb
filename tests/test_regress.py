"""imggen.inpainting.regress: the regression-only inpainting baseline (context encoder + pixel head)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from imggen.inpainting.context import make_context
from imggen.errors import CheckpointError, ConfigError
from imggen.inpainting.regress import HoleRegressor, hole_loss, load, predict, save, train_regressor


def _data(n=16, h=16, w=16, seed=0):
    rng = np.random.default_rng(seed)
    # smooth images: a left-right ramp with a random offset, so the hole is predictable from its border
    ramp = np.linspace(40, 200, w)[None, None, None, :]
    images = np.clip(ramp + rng.uniform(-30, 30, (n, 1, 1, 1)) + np.zeros((n, 1, h, w)), 0, 255).astype(np.uint8)
    return images


def test_prediction_shape_and_known_pixels_kept():
    torch.manual_seed(0)
    model = HoleRegressor(1, 16, 16, width_features=8, hidden=8)
    images = _data(3)
    masks = np.zeros((3, 16, 16), bool)
    masks[:, 4:10, 5:11] = True
    raw = model(make_context(torch.from_numpy(images), torch.from_numpy(masks), model.shape))
    assert raw.shape == (3, 1, 16, 16)
    out = predict(model, images, masks)
    assert out.dtype == np.uint8 and out.shape == images.shape
    assert np.array_equal(out[:, :, ~masks[0]], images[:, :, ~masks[0]])
    # the head is not zero-initialised: a fresh regressor predicts something image-dependent
    assert raw.std() > 0


def test_hole_loss_counts_the_hole_only():
    images = torch.full((1, 1, 4, 4), 255, dtype=torch.uint8)
    masks = torch.zeros(1, 4, 4, dtype=torch.bool)
    masks[0, 0, :2] = True
    pred = torch.ones(1, 1, 4, 4)           # exactly the target (255 -> 1.0)
    pred[0, 0, 3, 3] = -1.0                # a wrong known pixel: not scored
    assert float(hole_loss(pred, images, masks)) == 0.0
    pred[0, 0, 0, 0] = 0.0                 # one hole pixel off by 1 of 2 hole pixels
    assert float(hole_loss(pred, images, masks, "mse")) == pytest.approx(0.5)
    assert float(hole_loss(pred, images, masks, "l1")) == pytest.approx(0.5)
    pred[0, 0, 0, 0] = -1.0
    assert float(hole_loss(pred, images, masks, "mse")) == pytest.approx(2.0)
    assert float(hole_loss(pred, images, masks, "l1")) == pytest.approx(1.0)
    with pytest.raises(ConfigError):
        hole_loss(pred, images, masks, "huber")


def test_training_lowers_the_hole_error():
    torch.manual_seed(0)
    images = _data(32)
    model = HoleRegressor(1, 16, 16, width_features=16, hidden=16)
    masks = np.zeros((8, 16, 16), bool)
    masks[:, 5:11, 4:12] = True
    test = _data(8, seed=1)

    def err():
        return np.abs(predict(model, test, masks).astype(float) - test)[:, :, masks[0]].mean()

    before = err()
    rows = []
    result = train_regressor(model, images, None, steps=150, batch_size=8, lr=3e-3, warmup=10, log=rows.append,
                             log_every=50)
    assert result["steps"] == 150 and [r["step"] for r in rows] == [50, 100, 150]
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert err() < 0.5 * before


def test_training_rejects_bad_settings():
    model = HoleRegressor(1, 16, 16, width_features=4, hidden=4)
    with pytest.raises(ConfigError):
        train_regressor(model, _data(4), None, steps=0)
    with pytest.raises(ConfigError):
        train_regressor(model, _data(4), None, steps=1, loss="huber")


def test_save_load_roundtrip(tmp_path):
    torch.manual_seed(0)
    model = HoleRegressor(1, 16, 16, width_features=8, hidden=8)
    save(model, tmp_path / "r.pt", steps=3, seconds=1.5)
    back, info = load(tmp_path / "r.pt")
    assert info == {"steps": 3, "seconds": 1.5}
    images, masks = _data(2), np.zeros((2, 16, 16), bool)
    masks[:, 3:9, 3:9] = True
    assert np.array_equal(predict(model, images, masks), predict(back, images, masks))
    (tmp_path / "bad.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError):
        load(tmp_path / "bad.pt")


def test_fill_and_augment_options(tmp_path):
    """The classic-fill channel (as model.context_fill) survives save / load; a regressor saved before
    the option existed loads without it; augmented training runs and differs from plain training."""
    torch.manual_seed(0)
    model = HoleRegressor(1, 16, 16, width_features=8, hidden=8, fill="biharmonic")
    assert model.encoder.inp.in_channels == 3
    images, masks = _data(2), np.zeros((2, 16, 16), bool)
    masks[:, 3:9, 3:9] = True
    save(model, tmp_path / "f.pt")
    back, _ = load(tmp_path / "f.pt")
    assert back.fill == "biharmonic" and np.array_equal(predict(model, images, masks), predict(back, images, masks))
    plain = HoleRegressor(1, 16, 16, width_features=8, hidden=8)
    blob = {"settings": {k: v for k, v in plain.settings.items() if k != "fill"}, "state": plain.state_dict()}
    torch.save(blob, tmp_path / "old.pt")
    old, _ = load(tmp_path / "old.pt")
    assert old.fill == "none" and old.encoder.inp.in_channels == 2
    data = _data(16)
    runs = []
    for aug in (False, True):
        torch.manual_seed(0)
        m = HoleRegressor(1, 16, 16, width_features=8, hidden=8)
        train_regressor(m, data, None, steps=3, batch_size=4, augment=aug)
        runs.append(m.state_dict())
    assert not all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])
