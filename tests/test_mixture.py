"""The discretized logistic mixture head (imggen.mixture) against its definition, and in the model."""
import math

import pytest
import torch

import imggen
from imggen import mixture
from imggen.config import ModelConfig
from imggen.model import ImageTransformer


def reference_probs(params, vocab):
    """The definition, in float64: sum_k w_k (CDF_k(upper edge) - CDF_k(lower edge)), edges at +-inf at the ends."""
    k = params.shape[-1] // 3
    logit, mean, log_scale = params.double().split(k, -1)
    w, s = torch.softmax(logit, -1), torch.exp(log_scale.clamp(min=mixture.MIN_LOG_SCALE))
    c = torch.linspace(-1, 1, vocab, dtype=torch.float64)
    up = torch.where(torch.arange(vocab) == vocab - 1, math.inf, c + 1 / (vocab - 1))
    lo = torch.where(torch.arange(vocab) == 0, -math.inf, c - 1 / (vocab - 1))
    cdf = lambda e: torch.sigmoid((e - mean[..., None]) / s[..., None])  # noqa: E731
    return ((cdf(up) - cdf(lo)) * w[..., None]).sum(-2)


@pytest.mark.parametrize("k,vocab", [(1, 256), (5, 256), (10, 256), (3, 16), (2, 2)])
@pytest.mark.parametrize("scale", [0.05, 1.0, 4.0])
def test_log_probs_are_the_cdf_differences_and_sum_to_one(k, vocab, scale):
    g = torch.Generator().manual_seed(k * vocab)
    params = torch.randn(3, 7, 3 * k, generator=g) * scale
    params[..., 2 * k:] -= 2.0  # scales of a trained model: bins 2/255 wide need small ones too
    lp = mixture.log_probs(params, vocab)
    assert lp.shape == (3, 7, vocab) and lp.dtype == torch.float32
    ref = reference_probs(params, vocab)
    torch.testing.assert_close(lp.double().exp().sum(-1), torch.ones(3, 7, dtype=torch.float64), rtol=0, atol=1e-5)
    torch.testing.assert_close(lp.double().exp(), ref, rtol=1e-4, atol=1e-7)


def test_log_probs_stay_finite_for_sharp_components_far_from_a_bin():
    params = torch.tensor([[0.0, -0.9, mixture.MIN_LOG_SCALE]])  # K=1: a spike near value 13
    lp = mixture.log_probs(params, 256)
    assert torch.isfinite(lp).all() and int(lp.argmax()) == round((1 - 0.9) / 2 * 255)
    assert float(lp[0, 255]) < -1000  # tiny, yet finite: no log(0)


@pytest.mark.parametrize("k", [1, 4])
def test_token_nll_is_minus_the_log_prob_of_the_token(k):
    g = torch.Generator().manual_seed(k)
    params = torch.randn(2, 50, 3 * k, generator=g, requires_grad=True)
    tokens = torch.randint(0, 256, (2, 50), generator=g)
    tokens[0, :3] = torch.tensor([0, 255, 128])  # both edge bins
    nll = mixture.token_nll(params, tokens, 256)
    ref = -mixture.log_probs(params, 256).gather(-1, tokens[..., None])[..., 0]
    torch.testing.assert_close(nll, ref, rtol=1e-5, atol=1e-5)
    g1, = torch.autograd.grad(nll.sum(), params)
    g2, = torch.autograd.grad(ref.sum(), params)
    torch.testing.assert_close(g1, g2, rtol=1e-4, atol=1e-5)


def tiny(mix=3, **kw):
    cfg = ModelConfig(height=6, width=5, channels=1, dim=32, layers=2, heads=2, attention="local2d,band",
                      radius=1, window=8, mixture=mix, **kw)
    torch.manual_seed(0)
    return ImageTransformer(cfg).eval()


def test_model_with_a_mixture_head():
    model = tiny()
    assert model.head.out_features == 9
    x = torch.randint(0, 256, (3, 30))
    logits = model(x)
    assert logits.shape == (3, 30, 256)
    torch.testing.assert_close(logits.exp().sum(-1), torch.ones(3, 30), rtol=0, atol=1e-5)
    nll = model(x, nll=True)
    torch.testing.assert_close(nll, -logits.log_softmax(-1).gather(-1, x[..., None])[..., 0], rtol=1e-5, atol=1e-5)
    with pytest.raises(imggen.errors.ConfigError, match="mixture"):
        ModelConfig(mixture=-1).validate()


@pytest.mark.parametrize("mix", [0, 3])
def test_decode_steps_of_a_mixture_model_give_its_logits(mix):
    """The native C step (the head's 3K outputs), the Python step and forward agree."""
    from imggen.decode import make_caches

    model = tiny(mix)
    x = torch.randint(0, 256, (2, 30))
    with torch.no_grad():
        full = model(x)
        caches = make_caches(model, 2)
        steps = torch.stack([model.step(None if t == 0 else x[:, t - 1], t, caches) for t in range(30)], 1)
    torch.testing.assert_close(steps, full, rtol=1e-4, atol=1e-4)


def test_a_mixture_model_samples_and_round_trips_a_checkpoint(tmp_path):
    from imggen.checkpoint import load_model, save_checkpoint
    from imggen.config import Config

    model = tiny()
    cfg = Config(model=model.config)
    save_checkpoint(str(tmp_path), 1, model, cfg)
    back = load_model(str(tmp_path))
    x = torch.randint(0, 256, (2, 30))
    with torch.no_grad():
        torch.testing.assert_close(back(x), model(x))
    imgs = imggen.sample(back, 2, seed=0)
    assert imgs.shape == (2, 30) and int(imgs.min()) >= 0 and int(imgs.max()) <= 255


def test_teacher_forcing_through_the_caches_with_a_prefill_matches_forward():
    from imggen.sampling import teacher_force

    model = tiny()
    x = torch.randint(0, 256, (2, 30))
    with torch.no_grad():
        torch.testing.assert_close(teacher_force(model, x, prefill=11), model(x), rtol=1e-4, atol=1e-4)
