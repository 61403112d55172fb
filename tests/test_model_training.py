"""Tokens, model causality, training, checkpoints and bad input."""
import json
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import imggen
from imggen.checkpoint import load_weights, resolve, save_checkpoint
from imggen.config import Config, ModelConfig, TrainConfig, DataConfig
from imggen.errors import CheckpointError, ShapeError, TrainingError
from imggen.model import ImageTransformer
from imggen.tokens import detokenize_tokens, tokenize
from imggen.cli import config_from_args
from imggen.training import train, unigram_bpd

ATTN = ["full", "band", "local2d", "bigbird", "diffuser", "strided", "local2d,band"]


def tiny(attention="band", **kw):
    base = dict(height=4, width=5, channels=1, bits=3, dim=16, layers=2, heads=2, attention=attention,
                window=7, block=6, random_blocks=1, global_tokens=2, random_edges=2, diffusion_steps=2)
    base.update(kw)
    return ModelConfig(**base)


# ------------------------------------------------------------------------------------ tokens
@pytest.mark.parametrize("bits", [1, 3, 8])
@pytest.mark.parametrize("channels", [1, 3])
def test_tokens_roundtrip_and_order(bits, channels):
    rng = np.random.default_rng(0)
    img = rng.integers(0, 256, (2, channels, 3, 4), dtype=np.uint8)
    t = tokenize(img, bits)
    assert t.shape == (2, 3 * 4 * channels) and int(t.max()) < 2 ** bits
    # raster order, channels interleaved per pixel: token (y*W + x)*C + c
    assert int(t[1, (2 * 4 + 3) * channels + channels - 1]) == img[1, -1, 2, 3] >> (8 - bits)
    back = detokenize_tokens(t, bits, (channels, 3, 4))
    assert torch.equal(tokenize(back, bits), t)
    if bits == 8:
        assert np.array_equal(back.numpy(), img)
    small = tokenize(img, bits, dtype=torch.uint8)  # a training set held in memory: no long copy
    assert small.dtype == torch.uint8 and torch.equal(small.long(), t)


def test_tokens_bad_input():
    with pytest.raises(ShapeError, match="uint8"):
        tokenize(np.zeros((1, 1, 4, 4), dtype=np.float32))
    with pytest.raises(ShapeError, match="shape"):
        tokenize(np.zeros((1, 2, 4, 4), dtype=np.uint8))
    with pytest.raises(ShapeError, match="model expects"):
        tokenize(np.zeros((1, 1, 4, 4), dtype=np.uint8), 8, shape=(1, 8, 8))
    with pytest.raises(ShapeError, match="bits"):
        tokenize(np.zeros((1, 1, 4, 4), dtype=np.uint8), 9)
    with pytest.raises(ShapeError, match="token values"):
        detokenize_tokens(torch.full((1, 16), 9), 3, (1, 4, 4))


# ------------------------------------------------------------------------------------- model
@pytest.mark.parametrize("attention", ATTN)
@pytest.mark.parametrize("channels", [1, 3])
def test_model_causal(attention, channels):
    torch.manual_seed(0)
    model = ImageTransformer(tiny(attention, channels=channels)).eval()
    n = model.config.seq_len
    x = torch.randint(0, 8, (2, n))
    with torch.no_grad():
        base = model(x)
        for t in (0, n // 3, n - 2):
            y = x.clone()
            y[:, t] = (y[:, t] + 1) % 8
            out = model(y)
            assert torch.equal(out[:, : t + 1], base[:, : t + 1])  # positions <= t unchanged
            assert not torch.allclose(out[:, t + 1:], base[:, t + 1:])
        assert torch.allclose(model(x[:, :7]), base[:, :7], atol=1e-6)  # any prefix length


def test_model_rejects_bad_tokens():
    model = ImageTransformer(tiny())
    with pytest.raises(ShapeError):
        model(torch.zeros(1, model.config.seq_len + 1, dtype=torch.long))


def test_teacher_force_and_sampling_plain_cache():
    torch.manual_seed(0)
    model = ImageTransformer(tiny("local2d,diffuser", channels=3)).eval()
    x = torch.randint(0, 8, (2, model.config.seq_len))
    with torch.no_grad():
        assert (imggen.teacher_force(model, x, cache="full") - model(x)).abs().max() < 1e-4
    a = imggen.sample(model, 3, seed=5, cache="full")
    assert torch.equal(a, imggen.sample(model, 3, seed=5, cache="full"))
    img = imggen.detokenize(model, a)
    assert img.dtype == torch.uint8 and img.shape == (3, 3, 4, 5)


# ---------------------------------------------------------------------------------- training
def synthetic_splits(cfg, n=24, seed=0):
    rng = np.random.default_rng(seed)
    imgs = rng.integers(0, 256, (n, cfg.channels, cfg.height, cfg.width), dtype=np.uint8)
    imgs[:, :, :, ::2] = 255  # some structure
    t = tokenize(imgs, cfg.bits).to(torch.uint8)
    return {"train": t[:16], "val": t[16:20], "test": t[20:]}


def run_cfg(steps=6, ckpt_every=3, **model_kw):
    return Config(preset="test", model=tiny(**model_kw),
                  train=TrainConfig(steps=steps, batch_size=4, lr=3e-3, warmup=2, eval_every=3, eval_images=4,
                                    ckpt_every=ckpt_every, log_every=1, sample_num=2, seed=1),
                  data=DataConfig(spec="synthetic"))


def test_train_improves_and_writes_run(tmp_path):
    cfg = run_cfg(steps=30, ckpt_every=30)
    splits = synthetic_splits(cfg.model)
    m = train(cfg, str(tmp_path / "run"), data=splits, progress=False)
    assert m["test_bpd"] < cfg.model.bits  # beats a uniform model
    run = tmp_path / "run"
    assert (run / "samples.png").exists() and (run / "config.json").exists()
    log = [json.loads(line) for line in open(run / "log.jsonl")]
    assert any("val_bpd" in r for r in log) and any("tokens_per_s" in r for r in log)
    model = imggen.load_model(str(run))
    assert model.config == cfg.model


def test_resume_is_exact(tmp_path):
    cfg = run_cfg(steps=6, ckpt_every=3)
    splits = synthetic_splits(cfg.model)
    train(cfg, str(tmp_path / "a"), data=splits, progress=False)
    half = run_cfg(steps=6, ckpt_every=3)
    half.train.steps = 3
    train(half, str(tmp_path / "b"), data=splits, progress=False)
    # continue b to 6 steps with the same schedule: the config must match the checkpoint's
    cont = run_cfg(steps=6, ckpt_every=3)
    with pytest.raises(CheckpointError, match="differs"):
        train(run_cfg(steps=6, ckpt_every=3, dim=32), str(tmp_path / "b"), resume=True, data=splits, progress=False)
    # run "b" used a 3-step schedule; an exact resume needs the first half of the 6-step run
    c = str(tmp_path / "c")
    _train_until(cont, c, splits, 3)
    train(cont, c, resume=True, data=splits, progress=False)
    wa = imggen.load_model(str(tmp_path / "a")).state_dict()
    wc = imggen.load_model(c).state_dict()
    assert all(torch.equal(wa[k], wc[k]) for k in wa)


def _stop_at(step):
    def hook(s, loss):
        if s == step:
            raise KeyboardInterrupt
        return loss
    return hook


def _train_until(cfg, out, splits, step):
    """Run cfg's schedule but get interrupted at `step` (after its checkpoint was written)."""
    with pytest.raises(KeyboardInterrupt):
        train(cfg, out, data=splits, progress=False, hooks={"loss": _stop_at(step)})
    assert resolve(out).endswith(f"step_{step:07d}")


def test_existing_run_needs_resume_or_overwrite(tmp_path):
    cfg = run_cfg(steps=3, ckpt_every=3)
    splits = synthetic_splits(cfg.model)
    train(cfg, str(tmp_path / "r"), data=splits, progress=False)
    with pytest.raises(CheckpointError, match="--resume"):
        train(cfg, str(tmp_path / "r"), data=splits, progress=False)


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tmp_path):
    cfg = run_cfg(steps=10, ckpt_every=2)
    splits = synthetic_splits(cfg.model)
    out = str(tmp_path / "nan")

    def poison(step, loss):
        return loss * float("nan") if step == 5 else loss

    with pytest.raises(TrainingError, match="step 5.*step_0000004"):
        train(cfg, out, data=splits, progress=False, hooks={"loss": poison})
    model = imggen.load_model(out)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_checkpoint_from_other_config_is_clear_error(tmp_path):
    cfg = run_cfg()
    model = ImageTransformer(cfg.model)
    save_checkpoint(str(tmp_path), 1, model, cfg)
    other = run_cfg(layers=3)
    with pytest.raises(CheckpointError, match="model.layers"):
        load_weights(ImageTransformer(other.model), resolve(str(tmp_path)), other)
    with pytest.raises(CheckpointError, match="does not exist"):
        imggen.load_model(str(tmp_path / "missing"))


def test_kill_while_saving_keeps_previous_checkpoint(tmp_path):
    cfg = run_cfg()
    model = ImageTransformer(cfg.model)
    save_checkpoint(str(tmp_path), 1, model, cfg)
    script = textwrap.dedent(f"""
        import time, imggen.checkpoint as ck
        from imggen.config import Config
        from imggen.model import ImageTransformer
        import json
        cfg = Config.from_dict(json.load(open({str(tmp_path / 'checkpoints' / 'step_0000001' / 'config.json')!r})))
        real = ck.save_file
        def slow(tensors, path, metadata=None):
            with open(path, "wb") as f:
                f.write(b"partial")
                f.flush()
            print("saving", flush=True)
            time.sleep(60)
        ck.save_file = slow
        ck.save_checkpoint({str(tmp_path)!r}, 2, ImageTransformer(cfg.model), cfg)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "saving"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert resolve(str(tmp_path)).endswith("step_0000001")
    loaded = imggen.load_model(str(tmp_path))
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))


def test_wrong_image_size_for_config_is_clear():
    cfg = tiny()
    with pytest.raises(ShapeError, match="model expects"):
        tokenize(np.zeros((2, 1, 8, 8), dtype=np.uint8), cfg.bits, shape=cfg.shape)


def test_unigram_entropy():
    t = torch.tensor([[0, 1, 0, 1]])
    assert unigram_bpd(t, 2) == pytest.approx(1.0)


# --------------------------------------------------------------------------------------- CLI
def test_cli_flags_and_overrides():
    cfg, _ = config_from_args(["--preset", "demo", "--attention", "band", "--window", "40",
                               "--model.layers", "3", "--steps", "7"])
    assert cfg.model.attention == "band" and cfg.model.window == 40 and cfg.model.layers == 3
    assert cfg.train.steps == 7


@pytest.mark.parametrize("argv,msg", [
    (["--preset", "nope"], "invalid choice"),
    (["--model.layerz", "3"], "no field"),
    (["--model.layers", "x"], "cannot read"),
    (["--attention", "dilated"], "unknown attention pattern"),
    (["--bogus"], "unrecognized"),
])
def test_cli_bad_flag_is_one_line_exit_2(argv, msg):
    r = subprocess.run([sys.executable, "train.py", *argv], capture_output=True, text=True,
                       cwd=os.path.dirname(os.path.dirname(__file__)))
    assert r.returncode == 2
    assert msg in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_torchrun_ddp_matches_single_process(tmp_path):
    """Two gloo processes with half the batch each end at the weights of one process."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    common = ["--data", "brats-demo", "--model.height", "8", "--model.width", "8", "--model.dim", "16",
              "--model.layers", "1", "--model.heads", "2", "--attention", "band", "--steps", "3",
              "--batch-size", "4", "--limit", "16", "--train.eval_images", "4", "--train.sample_num", "2",
              "--no-progress", "--train.precision", "fp32"]  # fp32: the comparison is to 1e-5
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    single = subprocess.run([sys.executable, "train.py", *common, "--out", str(tmp_path / "one")],
                            cwd=repo, capture_output=True, text=True, env=env)
    assert single.returncode == 0, single.stderr[-2000:]
    ddp = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                          "--master_port", "29517", "train.py", *common, "--out", str(tmp_path / "two")],
                         cwd=repo, capture_output=True, text=True, env=env)
    assert ddp.returncode == 0, ddp.stderr[-2000:]
    a = imggen.load_model(str(tmp_path / "one")).state_dict()
    b = imggen.load_model(str(tmp_path / "two")).state_dict()
    assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)
