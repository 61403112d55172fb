"""Context-conditioned inpainting: the hole sees known pixels on every side, the target stays
causal, cached decode equals the full forward, clear errors, and --task inpaint end to end."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import imggen
from imggen.config import ModelConfig
from imggen.decode import make_caches
from imggen.errors import ConfigError, ShapeError
from imggen.model import ImageTransformer
from imggen.sampling import inpaint_images, teacher_force

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ATTN = ["full", "band", "local2d", "bigbird", "diffuser", "strided", "local2d,band"]


def model(attention="local2d,band", context="unet", channels=1, seed=0):
    torch.manual_seed(seed)
    m = ImageTransformer(ModelConfig(height=6, width=7, channels=channels, bits=4, dim=32, layers=2, heads=2,
                                     attention=attention, context=context, window=9, block=5, random_blocks=1,
                                     global_tokens=2, random_edges=2, diffusion_steps=2, backend="cpu")).eval()
    if context != "none":  # a trained encoder: the fresh one is zero at its output
        torch.nn.init.normal_(m.context.out.weight, std=0.5)
    return m


def data(m, seed=0):
    cfg = m.config
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (2, *cfg.shape), dtype=torch.uint8, generator=g)
    masks = torch.zeros(2, cfg.height, cfg.width, dtype=torch.bool)
    masks[:, 1:4, 2:5] = True
    return images, masks


def test_hole_sees_known_pixels_below_and_to_the_right():
    for context, should_change in (("unet", True), ("none", False)):
        m = model(context=context)
        images, masks = data(m)
        x = torch.randint(0, 16, (1, m.config.seq_len))
        hole = 1 * 7 + 2  # pixel (1, 2): the hole's top-left
        below = images.clone()
        below[0, :, 5, 6] ^= 0xF0  # a known pixel below and to the right of the hole
        with torch.no_grad():
            if context == "none":
                a = m(x)
                x2 = x.clone()
                x2[0, 5 * 7 + 6] = (x2[0, 5 * 7 + 6] + 5) % 16  # the same pixel, as a token after the hole
                b = m(x2)
            else:
                a = m(x, context=m.make_context(images[:1], masks[:1]))
                b = m(x, context=m.make_context(below[:1], masks[:1]))
        changed = not torch.allclose(a[0, hole], b[0, hole])
        assert changed == should_change, context


@pytest.mark.parametrize("attention", ATTN)
def test_target_stays_causal_and_decode_equals_forward(attention):
    m = model(attention, channels=3 if attention == "local2d,band" else 1)
    images, masks = data(m)
    ctx = m.make_context(images, masks)
    n = m.config.seq_len
    x = torch.randint(0, 16, (2, n))
    with torch.no_grad():
        base = m(x, context=ctx)
        t = n // 2
        y = x.clone()
        y[:, t + 1:] = (y[:, t + 1:] + 3) % 16
        assert torch.equal(m(y, context=ctx)[:, : t + 1], base[:, : t + 1])  # nothing after t is read
    assert (teacher_force(m, x, context=ctx) - base).abs().max() <= 1e-4
    assert (teacher_force(m, x, prefill=n // 3, context=ctx) - base).abs().max() <= 1e-4
    caches, feats = make_caches(m, 2), m.context_features(ctx, 2)  # a known run in one pass (extend)
    out = [m.step(None, 0, caches, feats)[:, None], m.extend(x[:, :n // 2 - 1], 1, caches, feats)]
    out += [m.step(x[:, i - 1], i, caches, feats)[:, None] for i in range(n // 2, n)]
    assert (torch.cat(out, 1) - base).abs().max() <= 1e-4
    with pytest.raises(ShapeError, match="features="):
        m.extend(x[:, :3], 1, caches)


def test_known_pixels_come_back_exactly_and_point_estimates():
    m = model(channels=3)
    images, masks = data(m)
    filled, logp = inpaint_images(m, images, masks, num=2, seed=1)
    assert filled.shape == (2, 2, *m.config.shape) and logp.shape == (2, 2)
    keep = (~masks)[:, None, None].expand_as(filled)
    assert torch.equal(filled[keep], images[:, None].expand_as(filled)[keep])
    mean, _ = inpaint_images(m, images, masks, samples=4, reduce="mean", seed=1)
    med, _ = inpaint_images(m, images, masks, samples=4, reduce="median", seed=1)
    draws, _ = inpaint_images(m, images, masks, num=4, seed=1)  # the same four samples, kept apart
    assert torch.equal(mean[:, 0], draws.float().mean(1).round().to(torch.uint8))
    assert torch.equal(med[:, 0], draws.float().median(1).values.round().to(torch.uint8))
    with pytest.raises(ConfigError, match="samples"):
        inpaint_images(m, images, masks, samples=4)


def test_clear_errors():
    m = model()
    images, masks = data(m)
    with pytest.raises(ShapeError, match="context masks"):
        m.make_context(images, masks[:, :5])
    with pytest.raises(ShapeError, match="context images"):
        m.make_context(images[:, :, :5], masks)
    with pytest.raises(ShapeError, match="no pixel as unknown"):
        m.make_context(images, torch.zeros_like(masks))
    x = torch.randint(0, 16, (2, m.config.seq_len))
    with pytest.raises(ShapeError, match="make_context"):
        m(x)
    with pytest.raises(ShapeError, match="context must be"):
        m(x, context=m.make_context(images, masks)[:1])
    with pytest.raises(ShapeError, match="without a context"):
        model(context="none").make_context(images, masks)


@pytest.mark.slow
def test_inpaint_task_end_to_end_with_folder_images(tmp_path):
    from PIL import Image
    rng = np.random.default_rng(0)
    (tmp_path / "imgs").mkdir()
    for i in range(12):
        Image.fromarray(rng.integers(0, 256, (10, 10, 3), dtype=np.uint8)).save(tmp_path / "imgs" / f"{i}.png")
    run = tmp_path / "run"
    r = subprocess.run([sys.executable, "train.py", "--preset", "cifar", "--data", f"folder:{tmp_path / 'imgs'}",
                        "--task", "inpaint", "--model.height", "8", "--model.width", "8", "--model.dim", "16",
                        "--model.layers", "1", "--model.heads", "2", "--model.context_width", "8", "--steps", "2",
                        "--batch-size", "2", "--train.eval_images", "2", "--train.sample_num", "1", "--no-progress",
                        "--out", str(run)], cwd=REPO, capture_output=True, text=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    m = imggen.load_model(str(run))
    assert m.config.context == "unet" and (run / "samples.png").exists()
    images = torch.randint(0, 256, (1, 3, 8, 8), dtype=torch.uint8)
    mask = torch.zeros(8, 8, dtype=torch.bool)
    mask[2:5, 3:6] = True
    filled, _ = imggen.inpaint(m, images[0], mask, samples=2, reduce="median")
    assert torch.equal(filled[0][:, ~mask], images[0][:, ~mask])
    # evaluation of the run: bits/dim of the unknown pixels under training's test masks (it used to be
    # refused with a message for Python callers); the report leaves out what needs unconditional samples
    eval_cmd = [sys.executable, "-m", "imggen.eval"]
    r = subprocess.run(eval_cmd + ["bpd", "--checkpoint", str(run), "--bootstrap", "0", "--json",
                                   str(tmp_path / "b.json")], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads((tmp_path / "b.json").read_text())
    assert "unknown pixels" in got["label"]
    assert got["bpd"] == pytest.approx(json.loads((run / "metrics.json").read_text())["test_bpd"], rel=1e-5)
    r = subprocess.run(eval_cmd + ["report", "--checkpoint", str(run), "--bootstrap", "0", "--num", "2"],
                       cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.loads((run / "report" / "report.json").read_text())
    assert rep["bpd"]["bpd"] == pytest.approx(got["bpd"]) and rep["sampling"] is None
    assert any("trained for inpainting" in n for n in rep["notes"])
    assert "![samples]" not in (run / "report" / "report.md").read_text()


# ------------------------------------------------------------------ 2.5-D context (issue 28, item 4)
def test_context_slices_against_a_plain_reference():
    from imggen.inpainting.context import make_context, slice_stacks

    s, shape = 2, (1, 6, 7)
    g = torch.Generator().manual_seed(1)
    vol = torch.randint(0, 256, (4, *shape), dtype=torch.uint8, generator=g)  # a 4-slice volume
    holes = torch.rand(4, 6, 7, generator=g) < 0.3
    nbrs = np.array([[-1, -1, 0, 1, 2], [0, 1, 2, 3, -1]])  # slices 0 and 2: edges of the volume
    stack, masks = slice_stacks(vol, nbrs, holes[np.clip(nbrs, 0, None)])
    ctx = make_context(stack, masks, shape, slices=s)
    assert ctx.shape == (2, 2 * (2 * s + 1), 6, 7)
    for b in range(2):
        for d in range(2 * s + 1):
            j = nbrs[b, d]
            if j < 0:  # outside the volume: zero image, every pixel unknown
                want_img, want_mask = np.zeros((6, 7)), np.ones((6, 7))
            else:
                h = holes[j].numpy()
                want_img = np.where(h, 0.0, vol[j, 0].numpy() / 127.5 - 1.0)
                want_mask = h.astype(float)
            np.testing.assert_allclose(ctx[b, 2 * d].numpy(), want_img, atol=1e-6)
            np.testing.assert_array_equal(ctx[b, 2 * d + 1].numpy(), want_mask)
    # the middle slice is the 2-D context; only it must have an unknown pixel
    assert torch.equal(ctx[:, 2 * s: 2 * s + 2], make_context(stack[:, s], masks[:, s], shape))
    none = masks.clone()
    none[:, 0] = False
    make_context(stack, none, shape, slices=s)
    none[:, s] = False
    with pytest.raises(ShapeError, match="no pixel as unknown"):
        make_context(stack, none, shape, slices=s)


def test_context_slices_model_config_and_old_configs(tmp_path):
    from imggen.checkpoint import save_checkpoint
    from imggen.config import Config, TrainConfig

    cfg = ModelConfig(height=6, width=7, channels=1, bits=4, dim=32, layers=1, heads=2, attention="band",
                      window=9, context="unet", context_slices=1, backend="cpu")
    torch.manual_seed(0)
    m = ImageTransformer(cfg).eval()
    assert m.context.inp.in_channels == 2 * 3
    images, masks = data(m)
    with pytest.raises(ShapeError, match="2.5-D context .* needs a volume|fill a volume"):
        m.make_context(images, masks)  # one 2-D image: a clear error
    ctx = m.make_context(images[:, None].repeat(1, 3, 1, 1, 1), masks[:, None].repeat(1, 3, 1, 1))
    filled, _ = inpaint_images(m, images, masks, context=ctx, seed=0)
    assert torch.equal(filled[:, 0][:, :, ~masks[0]], images[:, :, ~masks[0]])
    for bad, msg in [(dict(context_slices=9), "0..8"), (dict(context_slices=-1), "0..8"),
                     (dict(context="none", context_slices=2), "needs model.context unet")]:
        with pytest.raises(ConfigError, match=msg):
            ModelConfig(height=6, width=7, **{"context": "unet", **bad}).validate()
    with pytest.raises(ConfigError, match="needs volume data"):
        Config(model=cfg, train=TrainConfig(task="inpaint")).validate()  # molecules: no volumes
    Config(model=cfg, train=TrainConfig(task="inpaint")).to_dict()
    # a checkpoint written before the field existed loads as a 2-D context model
    m2 = model()
    save_checkpoint(str(tmp_path / "old"), 1, m2, Config(model=m2.config, train=TrainConfig(task="inpaint")))
    from imggen.checkpoint import MANIFEST, _write_manifest
    for cfg_file in (tmp_path / "old").rglob("config.json"):
        d = json.loads(cfg_file.read_text())
        del d["model"]["context_slices"]
        cfg_file.write_text(json.dumps(d))
        if (cfg_file.parent / MANIFEST).exists():  # as an old version wrote it
            os.remove(cfg_file.parent / MANIFEST)
            _write_manifest(str(cfg_file.parent))
    old = imggen.load_model(str(tmp_path / "old"))
    assert old.config.context_slices == 0 and old.context.inp.in_channels == 2


# ------------------------------------------------------- the classic fill as context (model.context_fill)
def test_classic_fill_channel_against_skimage():
    from skimage.restoration import inpaint_biharmonic

    from imggen.inpainting.context import classic_fill, context_channels, make_context

    g = torch.Generator().manual_seed(3)
    images = torch.randint(0, 256, (3, 1, 9, 10), dtype=torch.uint8, generator=g)
    masks = torch.zeros(3, 9, 10, dtype=torch.bool)
    masks[0, 2:5, 3:7] = True
    masks[1, 6:, :4] = True
    masks[2] = True  # nothing known: the fill is 0 (mid-grey)
    fill = classic_fill(images, masks)
    for i in range(2):
        want = inpaint_biharmonic(images[i, 0].double().numpy() / 255.0, masks[i].numpy())
        np.testing.assert_allclose(fill[i, 0].numpy(), np.clip(want, 0, 1) * 2 - 1, atol=1e-6)
        known = ~masks[i]
        np.testing.assert_allclose(fill[i, 0][known].numpy(), images[i, 0][known].numpy() / 127.5 - 1, atol=1e-6)
    assert (fill[2] == 0).all()
    ctx = make_context(images[:2], masks[:2], (1, 9, 10), fill="biharmonic")
    assert ctx.shape == (2, 3, 9, 10) and context_channels(1, 0, "biharmonic") == 3
    assert torch.equal(ctx[:, [0, 2]], make_context(images[:2], masks[:2], (1, 9, 10)))
    assert torch.equal(ctx[:, 1:2], fill[:2])
    # 2.5-D: [voided, fill, mask] per slice; an RGB image fills every channel
    stack = images[:2, None].repeat(1, 3, 1, 1, 1)
    smasks = masks[:2, None].repeat(1, 3, 1, 1)
    assert make_context(stack, smasks, (1, 9, 10), slices=1, fill="biharmonic").shape == (2, 9, 9, 10)
    rgb = torch.randint(0, 256, (1, 3, 9, 10), dtype=torch.uint8, generator=g)
    assert make_context(rgb, masks[:1], (3, 9, 10), fill="biharmonic").shape == (1, 7, 9, 10)
    assert context_channels(3, 2, "biharmonic") == 35 and context_channels(1, 2) == 10
    with pytest.raises(ShapeError, match="none, biharmonic"):
        make_context(images[:2], masks[:2], (1, 9, 10), fill="mean")


def test_context_fill_model_config_and_old_configs(tmp_path):
    from imggen.checkpoint import save_checkpoint
    from imggen.config import Config, TrainConfig

    cfg = ModelConfig(height=6, width=7, channels=1, bits=4, dim=32, layers=1, heads=2, attention="local2d,band",
                      window=9, context="unet", context_fill="biharmonic", backend="cpu")
    torch.manual_seed(0)
    m = ImageTransformer(cfg).eval()
    torch.nn.init.normal_(m.context.out.weight, std=0.5)
    assert m.context.inp.in_channels == 3
    images, masks = data(m)
    ctx = m.make_context(images, masks)
    assert ctx.shape == (2, 3, 6, 7)
    filled, _ = inpaint_images(m, images, masks, context=ctx, seed=0)
    assert torch.equal(filled[:, 0][:, :, ~masks[0]], images[:, :, ~masks[0]])
    with torch.no_grad():  # cached decode equals the full forward with the fill channel too
        tokens = torch.randint(0, 16, (2, cfg.seq_len))
        assert torch.allclose(teacher_force(m, tokens, context=ctx), m(tokens, context=ctx), atol=1e-4)
    with pytest.raises(ShapeError, match=r"context must be \(2, 3, 6, 7\)"):
        m(tokens, context=ctx[:, [0, 2]])  # a context made without the fill
    for bad, msg in [(dict(context_fill="mean"), "none, biharmonic"),
                     (dict(context="none", context_fill="biharmonic"), "needs model.context unet")]:
        with pytest.raises(ConfigError, match=msg):
            ModelConfig(height=6, width=7, **{"context": "unet", **bad}).validate()
    m2 = model()  # a checkpoint written before the field existed loads without the fill
    save_checkpoint(str(tmp_path / "old"), 1, m2, Config(model=m2.config, train=TrainConfig(task="inpaint")))
    from imggen.checkpoint import MANIFEST, _write_manifest
    for cfg_file in (tmp_path / "old").rglob("config.json"):
        d = json.loads(cfg_file.read_text())
        del d["model"]["context_fill"]
        del d["train"]["augment"]
        cfg_file.write_text(json.dumps(d))
        if (cfg_file.parent / MANIFEST).exists():
            os.remove(cfg_file.parent / MANIFEST)
            _write_manifest(str(cfg_file.parent))
    old = imggen.load_model(str(tmp_path / "old"))
    assert old.config.context_fill == "none" and old.context.inp.in_channels == 2
