"""--train.precision auto|fp32|bf16: the flag, its resolution per machine, and every layer's bf16
path (under autocast) against its float32 reference at bf16 tolerance."""
import json

import numpy as np
import pytest
import torch
from safetensors import safe_open

from imggen import precision
from imggen.attention import sparse_attention
from imggen.checkpoint import find_checkpoint, read_notes
from imggen.cli import config_from_args
from imggen.config import Config, PRESETS, preset
from imggen.inpainting.context import ContextEncoder
from imggen.errors import CheckpointError, ConfigError
from imggen.fused import ln_linear, ln_mlp
from imggen.patterns import make_pattern
from imggen.inpainting.regress import HoleRegressor, hole_loss, train_regressor
from imggen.training import train

from test_model_training import run_cfg, synthetic_splits

BF16_TOL = 2e-2  # largest error / largest reference value


def close(got, ref, tol=BF16_TOL):
    err = (got.double() - ref.double()).abs().max().item()
    scale = ref.double().abs().max().item()
    assert err <= tol * scale, f"error {err:.3g} vs scale {scale:.3g}"
    return err


def cpu_autocast():
    return torch.autocast("cpu", dtype=torch.bfloat16)


# ------------------------------------------------------------------------------------ the flag
def test_default_auto_in_every_preset_and_in_saved_config():
    for name in PRESETS:
        assert preset(name).train.precision == "auto"
    assert json.loads(preset("demo").to_json())["train"]["precision"] == "auto"


def test_old_config_without_the_field_loads_as_auto():
    d = preset("demo").to_dict()
    del d["train"]["precision"]
    assert Config.from_dict(d).validate().train.precision == "auto"


def test_cli_parses_the_flag_and_rejects_a_bad_value(tmp_path, capsys):
    cfg, _ = config_from_args(["--out", str(tmp_path / "r"), "--train.precision", "bf16"])
    assert cfg.train.precision == "bf16"
    with pytest.raises(SystemExit) as e:
        config_from_args(["--out", str(tmp_path / "r"), "--train.precision", "fp16"])
    assert e.value.code == 2
    assert "train.precision must be one of auto, fp32, bf16, got 'fp16'" in capsys.readouterr().err


def test_auto_follows_the_cpu(monkeypatch):
    monkeypatch.setattr(precision, "cpu_bf16_flags", lambda: ())
    assert precision.resolve("auto", "cpu")[0] == "fp32"
    assert precision.describe("auto", "cpu") == "precision: fp32 (auto: this CPU has no native bf16 arithmetic)"
    assert precision.resolve("fp32", "cpu")[0] == "fp32"
    with pytest.warns(RuntimeWarning, match="emulated"):
        assert precision.describe("bf16", "cpu").startswith("precision: bf16 autocast")
    with precision.autocast("cpu", "auto"):
        assert not torch.is_autocast_enabled("cpu")
    # a CPU with native bf16: auto is bf16 (within 0.02 bits/dim of fp32 at equal steps), fp32 on request
    monkeypatch.setattr(precision, "cpu_bf16_flags", lambda: ("avx512_bf16",))
    assert precision.resolve("auto", "cpu")[0] == "bf16"
    assert precision.describe("auto", "cpu") == (
        "precision: bf16 autocast (auto: this CPU computes bf16 natively (avx512_bf16); --train.precision fp32 "
        "for float32)")
    with precision.autocast("cpu", "auto"):
        assert torch.is_autocast_enabled("cpu")
    with precision.autocast("cpu", "fp32"):
        assert not torch.is_autocast_enabled("cpu")
    with precision.autocast("cpu", "bf16"):
        assert torch.is_autocast_enabled("cpu")
    assert precision.resolve("auto", "cuda") == ("bf16", "auto: this GPU computes bf16 natively")
    with pytest.raises(ConfigError, match="train.precision"):
        precision.resolve("half", "cpu")


# ----------------------------------------------------------------------------- attention paths
PATTERNS = {
    "band": dict(window=40),
    "local2d": dict(height=8, width=12, channels=1, radius=2),
    "bigbird": dict(block=16, window_blocks=3, global_blocks=1, random_blocks=1, seed=0),
    "diffuser": dict(window=24, global_tokens=4, random_edges=4, steps=2, alpha=0.1, seed=0),
    "full": dict(),
}


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("kind", sorted(PATTERNS))
def test_attention_bf16_matches_fp32(kind, backend):
    p = make_pattern(kind, **PATTERNS[kind])
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(2, 3, 96, 16, generator=g) for _ in range(4))

    def run(autocast):
        x = [t.clone().requires_grad_() for t in (q, k, v)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            o = sparse_attention(*x, p, backend=backend)
        o.backward(do.to(o.dtype))
        return o, [t.grad for t in x]

    o32, g32 = run(False)
    o16, g16 = run(True)
    assert o32.dtype == torch.float32 and not torch.equal(o16.float(), o32)  # bf16 really ran
    if backend == "cpu":  # the reference's diffusion steps mix in float32 v: a float32 result
        assert o16.dtype == torch.bfloat16
    assert all(t.dtype == torch.float32 for t in g16)  # gradients of the float32 inputs
    close(o16, o32)
    for a, b in zip(g16, g32):
        close(a, b)


def test_blocked_bf16_inputs_run_in_bf16():
    """q, k, v already bf16 (no autocast): bf16 out, near the fp32 result."""
    p = make_pattern("local2d", **PATTERNS["local2d"])
    q, k, v = (torch.randn(1, 2, 96, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    o = sparse_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), p, backend="cpu")
    assert o.dtype == torch.bfloat16
    close(o, sparse_attention(q, k, v, p, backend="cpu"))


# ------------------------------------------------------------------------ fused LN / MLP, context
@pytest.mark.parametrize("save_mb", ["0", "64"])  # 0: the fused autograd functions; 64: plain modules
def test_fused_ln_linear_and_mlp_bf16(monkeypatch, save_mb):
    monkeypatch.setenv("IMGGEN_SAVE_MB", save_mb)
    torch.manual_seed(0)
    ln, fc1, fc2 = torch.nn.LayerNorm(32), torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)
    with torch.no_grad():
        ln.weight.add_(torch.randn(32) * 0.3)
        ln.bias.add_(torch.randn(32) * 0.3)
    x0 = torch.randn(2, 50, 32) * 3 + 1
    params = [ln.weight, ln.bias, fc1.weight, fc1.bias, fc2.weight, fc2.bias]

    def run(autocast):
        for t in params:
            t.grad = None
        x = x0.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = ln_linear(x, ln, fc1).sum(-1, keepdim=True) * ln_mlp(x, ln, fc1, fc2)
        out.float().pow(2).mean().backward()
        return out, [x.grad] + [t.grad.clone() for t in params]

    o32, g32 = run(False)
    o16, g16 = run(True)
    assert o16.dtype == torch.bfloat16
    assert all(g.dtype == torch.float32 for g in g16)  # master weights' gradients stay fp32
    close(o16, o32)
    for a, b in zip(g16, g32):
        close(a, b, 3e-2)


def test_context_encoder_and_regressor_bf16():
    torch.manual_seed(0)
    enc = ContextEncoder(1, 16, 16, 8, 12)
    torch.nn.init.normal_(enc.out.weight, std=0.1)  # zero-initialised: give the check a signal
    reg = HoleRegressor(1, 16, 16, width_features=8, hidden=8)
    ctx0 = torch.randn(3, 2, 16, 16)
    images = torch.randint(0, 256, (3, 1, 16, 16), dtype=torch.uint8)
    masks = torch.zeros(3, 16, 16, dtype=torch.bool)
    masks[:, 4:10, 3:12] = True
    for model, loss in ((enc, lambda y: y.float().pow(2).mean()),
                        (reg, lambda y: hole_loss(y, images, masks))):
        def run(autocast):
            model.zero_grad()
            ctx = ctx0.clone().requires_grad_()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                y = model(ctx)
            loss(y).backward()
            return y, [ctx.grad] + [p.grad.clone() for p in model.parameters()]

        y32, g32 = run(False)
        y16, g16 = run(True)
        assert y16.dtype == torch.bfloat16
        close(y16, y32)
        for a, b in zip(g16, g32):
            close(a, b, 3e-2)


def test_train_regressor_precision():
    images = np.random.default_rng(0).integers(0, 256, (8, 1, 16, 16), dtype=np.uint8)
    runs = {}
    for prec in ("fp32", "bf16"):
        model = HoleRegressor(1, 16, 16, width_features=8, hidden=8)
        runs[prec] = train_regressor(model, images, None, steps=2, batch_size=4, warmup=1, log_every=1,
                                     precision=prec)["loss"]
        assert all(p.dtype == torch.float32 for p in model.parameters())
    assert runs["bf16"] != runs["fp32"] and abs(runs["bf16"] - runs["fp32"]) < 0.05 * runs["fp32"]


# ------------------------------------------------------------------------------------- training
def test_bf16_training_saves_fp32_weights_and_resume_keeps_precision(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(precision, "cpu_bf16_flags", lambda: ("avx512_bf16",))  # no warning on any CPU
    cfg = run_cfg(steps=2, ckpt_every=2, attention="local2d,band")
    cfg.train.precision = "bf16"
    splits = synthetic_splits(cfg.model)
    out = str(tmp_path / "run")
    train(cfg, out, data=splits, progress=False)
    assert "precision: bf16 autocast" in capsys.readouterr().out
    ckpt = find_checkpoint(out)
    with safe_open(f"{ckpt}/model.safetensors", "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float32}
    assert read_notes(ckpt)["precision"] == "bf16"
    # --resume continues from the run's own config: bf16 without the flag
    resumed, _ = config_from_args(["--resume", "--out", out, "--steps", "3"])
    assert resumed.train.precision == "bf16"
    # and another precision for the same run is refused, as another model is
    cfg.train.precision, cfg.train.steps = "fp32", 3
    with pytest.raises(CheckpointError, match="train.precision: checkpoint 'bf16' vs requested 'fp32'"):
        train(cfg, out, resume=True, data=splits, progress=False)


def test_bf16_step_is_close_to_fp32_step():
    """One training step's loss in bf16 is near the fp32 loss, and not identical (bf16 ran)."""
    from imggen.training import build_model_and_optimizer, train_step

    losses = {}
    for prec in ("fp32", "bf16"):
        cfg = run_cfg(attention="local2d,band")
        cfg.train.precision = prec
        model, opt = build_model_and_optimizer(cfg, "cpu")
        x = synthetic_splits(cfg.model)["train"][:4].long()
        losses[prec] = train_step(model, opt, x, 0, cfg, "cpu")
    assert losses["bf16"] != losses["fp32"] and abs(losses["bf16"] - losses["fp32"]) < 0.02 * losses["fp32"]


def test_logits_stay_fp32_under_bf16_autocast():
    """The output head computes in float32 under autocast (bf16-rounded logits cost bits/dim); the rest
    of the forward runs in bf16, and the logits equal head(ln_f(h)) in float32 of the same hidden state."""
    from imggen.model import ImageTransformer

    cfg = run_cfg(attention="local2d,band")
    torch.manual_seed(0)
    model = ImageTransformer(cfg.model)
    x = synthetic_splits(cfg.model)["train"][:2].long()
    seen = {}
    model.ln_f.register_forward_hook(lambda m, args, out: seen.update(h=args[0], out=out))
    with cpu_autocast():
        logits = model(x)
    assert logits.dtype == torch.float32 and seen["out"].dtype == torch.float32
    assert torch.equal(logits, model.head(model.ln_f(seen["h"].float())))
    with torch.no_grad():
        assert model(x).dtype == torch.float32  # and without autocast, as before


def test_validation_runs_in_the_training_precision_and_the_test_in_fp32(tmp_path, monkeypatch):
    """A bf16 run validates under bf16 autocast (cheaper validations inside a time budget) and scores
    its test split in float32; the bf16 figure is near the float32 one of the same weights."""
    import imggen.eval.bpd as bpd

    monkeypatch.setattr(precision, "cpu_bf16_flags", lambda: ("avx512_bf16",))
    real, seen = bpd.token_bits_per_dim, []

    def recorded(model, tokens, *a, **kw):
        out = real(model, tokens, *a, **kw)
        if torch.is_autocast_enabled("cpu"):
            with torch.autocast("cpu", enabled=False):
                ref = real(model, tokens, *a, **kw)
            assert abs(out.mean() - ref.mean()) < 1e-2 * ref.mean()
        seen.append((len(tokens), torch.is_autocast_enabled("cpu")))
        return out

    monkeypatch.setattr(bpd, "token_bits_per_dim", recorded)
    cfg = run_cfg(steps=3, ckpt_every=3, attention="local2d,band")
    cfg.train.precision = "bf16"
    splits = synthetic_splits(cfg.model)
    train(cfg, str(tmp_path / "run"), data=splits, progress=False)
    *vals, test = seen  # the validations (eval_every 3: the one at step 3), then the test
    assert vals and all(on for _, on in vals) and test == (len(splits["test"]), False)
    seen.clear()
    cfg.train.precision = "fp32"
    train(cfg, str(tmp_path / "fp32"), data=splits, progress=False)
    assert seen and not any(on for _, on in seen)
