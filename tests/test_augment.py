"""Training-time augmentation (imggen.augment, --train.augment): exact on the identity and the flip,
images and masks warped alike, DDP shares equal to the whole batch's rows, items that would lose
their hole unchanged, 2.5-D stacks warped as one volume, and training runs that resume exactly."""
import numpy as np
import pytest
import torch

import imggen
from imggen.augment import augment, augment_tokens, random_params, warp_images, warp_masks
from imggen.config import Config, DataConfig, ModelConfig, TrainConfig
from imggen.tokens import tokenize
from imggen.training import train

IDENTITY = torch.tensor([[[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]])
FLIP = torch.tensor([[[-1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]])


def images(b=6, c=1, h=16, w=16, seed=0):
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, (b, c, h, w), dtype=np.uint8))


def disc_masks(b=6, h=16, w=16, r=4.0):
    yy, xx = np.mgrid[:h, :w]
    return np.repeat(((yy - h / 2 + 0.5) ** 2 + (xx - w / 2 + 0.5) ** 2 <= r * r)[None], b, 0)


def test_identity_and_flip_are_exact():
    x = images(1, 3, 9, 11)
    assert torch.equal(warp_images(x, IDENTITY, torch.ones(1)), x)
    assert torch.equal(warp_images(x, FLIP, torch.ones(1)), x.flip(-1))
    m = torch.from_numpy(np.random.default_rng(1).random((1, 9, 11)) < 0.3)
    assert torch.equal(warp_masks(m, IDENTITY), m) and torch.equal(warp_masks(m, FLIP), m.flip(-1))
    # gamma alone, against a plain reference
    g = torch.tensor([0.8])
    want = np.round(255.0 * (x.numpy() / 255.0) ** 0.8)
    assert np.abs(warp_images(x, IDENTITY, g).numpy().astype(float) - want).max() <= 1


def test_parameters_lie_in_their_ranges_and_follow_the_seed():
    theta, gamma = random_params(500, np.random.default_rng(0))
    a = theta[:, :, :2]
    det = torch.linalg.det(a).abs()  # 1 / scale**2
    assert (det >= 1 / 1.1 ** 2 - 1e-5).all() and (det <= 1 / 0.9 ** 2 + 1e-5).all()
    assert theta[:, :, 2].abs().max() <= 0.1 + 1e-6
    assert (gamma >= 0.75 - 1e-6).all() and (gamma <= 1 / 0.75 + 1e-6).all()
    flips = (torch.linalg.det(a) < 0).float().mean()
    assert 0.4 < flips < 0.6
    t2, g2 = random_params(500, np.random.default_rng(0))
    assert torch.equal(theta, t2) and torch.equal(gamma, g2)


def test_image_and_mask_move_together():
    m = disc_masks(32, 32, 32, 7.0)
    x = torch.from_numpy(np.where(m, 200, 0).astype(np.uint8)[:, None])
    out, om, _ = augment(x, m, np.random.default_rng(3))
    assert not np.array_equal(om, m)  # something moved
    bright = out[:, 0].numpy() > 100
    assert (bright == om).mean() > 0.97  # bilinear and nearest differ at the rim only
    assert om.any((1, 2)).all()


def test_ddp_shares_equal_the_whole_batch_rows():
    x, m = images(8), disc_masks(8)
    whole, wm, _ = augment(x, m, np.random.default_rng(5))
    for rank in range(2):
        part = slice(rank, None, 2)
        got, gm, _ = augment(x[part], m, np.random.default_rng(5), rows=part)
        assert torch.equal(got, whole[part]) and np.array_equal(gm, wm)
        # generation (no masks): the share's maps are the whole batch's rows too
        plain, _, _ = augment(x, None, np.random.default_rng(5))
        got, _, _ = augment(x[part], None, np.random.default_rng(5), rows=part, batch=len(x))
        assert torch.equal(got, plain[part])


def test_an_item_that_would_lose_its_hole_is_unchanged():
    x = images(3, 1, 16, 16)
    m = np.zeros((3, 16, 16), bool)
    m[0, 0, 0] = True  # a corner pixel: almost every warp moves it off the image
    m[1:, 6:10, 6:10] = True
    rng_seed = next(s for s in range(100) if not warp_masks(m[:1], random_params(3, np.random.default_rng(s))[0][:1]).any())
    out, om, _ = augment(x, m, np.random.default_rng(rng_seed))
    assert torch.equal(out[0], x[0]) and np.array_equal(om[0], m[0])
    assert om[1:].any((1, 2)).all()


def test_a_stack_is_warped_as_one_volume_and_missing_neighbours_stay_unknown():
    x = images(4, 1, 16, 16)
    stack = x[:, None].repeat(1, 3, 1, 1, 1).clone()  # three equal slices
    masks = np.repeat(disc_masks(4)[:, None], 3, 1)
    masks[:, 0] = True  # z-1 outside the volume
    stack[:, 0] = 0
    out, om, st = augment(x, masks, np.random.default_rng(2), stack, middle=1)
    assert torch.equal(st[:, 1], out) and torch.equal(st[:, 2], out) and (st[:, 0] == 0).all()
    assert om[:, 0].all() and np.array_equal(om[:, 1], om[:, 2])


def test_augment_tokens_round_trip_keeps_the_bit_depth():
    cfg = ModelConfig(height=8, width=8, channels=1, bits=3, dim=16, layers=1, heads=2, attention="band", window=5)
    x = tokenize(images(4, 1, 8, 8).numpy(), 3)
    t, _, _, _ = augment_tokens(x, None, np.random.default_rng(0), cfg)
    assert t.shape == x.shape and t.dtype == x.dtype and int(t.max()) < 8


def test_given_fills_ride_along_with_their_image():
    """The holes' classic fills (model.context_fill biharmonic3d) get their image's warp and gamma; a
    NaN row (an image without a given fill) stays NaN."""
    cfg = ModelConfig(height=8, width=8, channels=1, bits=8, dim=16, layers=1, heads=2, attention="band", window=5)
    imgs = images(4, 1, 8, 8)
    masks = np.zeros((4, 8, 8), bool)
    masks[:, 2:6, 2:6] = True
    fills = imgs.float().clone()
    fills[1] = float("nan")
    t, m, stack, f = augment_tokens(tokenize(imgs.numpy(), 8), masks, np.random.default_rng(0), cfg, fills=fills)
    assert stack is None and torch.isnan(f[1]).all() and not torch.isnan(f[[0, 2, 3]]).any()
    warped = t.view(4, 8, 8, 1).permute(0, 3, 1, 2).float()
    assert torch.equal(f[[0, 2, 3]], warped[[0, 2, 3]])  # fill == image before, so after


def _cfg(task, augment, steps=4, **model):
    m = dict(height=8, width=8, channels=1, bits=4, dim=16, layers=1, heads=2, attention="local2d,band", radius=2,
             window=9)
    if task == "inpaint":
        m.update(context="unet", context_width=8)
    m.update(model)
    return Config(preset="test", model=ModelConfig(**m),
                  train=TrainConfig(steps=steps, batch_size=4, lr=3e-3, warmup=1, eval_every=2, eval_images=2,
                                    ckpt_every=2, log_every=1, sample_num=1, seed=1, task=task, augment=augment,
                                    grid_time_frac=0),
                  data=DataConfig(spec="synthetic"))


def _splits(cfg):
    rng = np.random.default_rng(0)
    imgs = rng.integers(0, 256, (12, 1, 8, 8), dtype=np.uint8)
    t = tokenize(imgs, cfg.model.bits).to(torch.uint8)
    return {"train": t[:8], "val": t[8:10], "test": t[10:]}


@pytest.mark.parametrize("task", ["generate", "inpaint"])
def test_training_with_augment_changes_the_run_and_resumes_exactly(tmp_path, task):
    def interrupt(s, loss):
        if s == 2:
            raise KeyboardInterrupt
        return loss

    cfg = _cfg(task, True)
    splits = _splits(cfg)
    train(cfg, str(tmp_path / "a"), data=splits, progress=False)
    with pytest.raises(KeyboardInterrupt):
        train(_cfg(task, True), str(tmp_path / "b"), data=splits, progress=False, hooks={"loss": interrupt})
    train(_cfg(task, True), str(tmp_path / "b"), resume=True, data=splits, progress=False)
    train(_cfg(task, False), str(tmp_path / "c"), data=splits, progress=False)
    wa, wb, wc = (imggen.load_model(str(tmp_path / r)).state_dict() for r in "abc")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not all(torch.equal(wa[k], wc[k]) for k in wa)
