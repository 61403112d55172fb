"""imggen.eval.bits_per_dim: exact values for models with known distributions, bootstrap CI, labels."""
import math

import numpy as np
import pytest
import torch

import imggen.eval as ev
from imggen.config import ModelConfig
from imggen.errors import ShapeError
from imggen.eval.bpd import bits_per_dim, bootstrap_ci, bpd_label
from imggen.model import ImageTransformer

torch.set_num_threads(1)


class FixedLogits(torch.nn.Module):
    """Same logits at every position: an i.i.d. categorical model of the subpixels."""

    def __init__(self, cfg: ModelConfig, logits):
        super().__init__()
        self.config = cfg
        self.logits = torch.nn.Parameter(torch.as_tensor(logits, dtype=torch.float32))

    def forward(self, tokens):
        assert tokens.dtype == torch.long and not torch.is_grad_enabled()
        return self.logits.expand(*tokens.shape, -1)


def _cfg(bits=8, channels=1, h=4, w=4):
    return ModelConfig(height=h, width=w, channels=channels, bits=bits, dim=16, layers=1, heads=2,
                       attention="full")


def _images(rng, n, cfg, levels=None):
    """uint8 images whose tokens (top `bits` bits) are `levels` (or uniform random)."""
    shape = (n, cfg.channels, cfg.height, cfg.width)
    if levels is None:
        return rng.integers(0, 256, shape, dtype=np.uint8)
    low = rng.integers(0, 2 ** (8 - cfg.bits), shape)  # the dropped low bits must not matter
    return ((levels.reshape(shape) << (8 - cfg.bits)) | low).astype(np.uint8)


@pytest.mark.parametrize("bits", [8, 4, 1])
def test_uniform_model_scores_exactly_bits(bits):
    cfg = _cfg(bits, channels=3)
    model = FixedLogits(cfg, torch.zeros(2 ** bits))
    imgs = _images(np.random.default_rng(0), 5, cfg)
    assert bits_per_dim(model, imgs) == pytest.approx(bits, abs=1e-6)
    assert ev.bits_per_dim(model, torch.from_numpy(imgs), batch_size=2) == pytest.approx(bits, abs=1e-6)


def test_real_transformer_with_zero_head_is_uniform():
    torch.manual_seed(0)
    cfg = _cfg(8)
    model = ImageTransformer(cfg)
    with torch.no_grad():
        model.head.weight.zero_()
    model.train()
    imgs = _images(np.random.default_rng(1), 3, cfg)
    res = bits_per_dim(model, imgs, return_per_image=True)
    assert res["bpd"] == pytest.approx(8.0, abs=1e-6)
    assert res["per_image"] == pytest.approx([8.0] * 3, abs=1e-6)
    assert model.training  # the caller's mode is restored


def test_categorical_model_matches_entropy_exactly():
    """Data whose empirical distribution equals the model's categorical: bpd == entropy exactly."""
    p = np.array([0.5, 0.25, 0.125, 0.125])
    entropy = float(-(p * np.log2(p)).sum())  # 1.75 bits
    cfg = _cfg(bits=2, h=2, w=4)  # 8 subpixels per image
    rng = np.random.default_rng(0)
    levels = np.stack([rng.permutation([0, 0, 0, 0, 1, 1, 2, 3]) for _ in range(6)])
    model = FixedLogits(cfg, np.log(p))
    imgs = _images(rng, 6, cfg, levels)
    assert bits_per_dim(model, imgs) == pytest.approx(entropy, abs=1e-6)
    # a shifted model pays the cross-entropy, sum_k q_k * -log2 p'_k
    q = np.array([0.1, 0.2, 0.3, 0.4])
    cross = float(-(p * np.log2(q)).sum())
    assert bits_per_dim(FixedLogits(cfg, np.log(q) + 3.0), imgs) == pytest.approx(cross, abs=1e-5)


def test_categorical_model_on_sampled_data_within_sampling_error():
    rng = np.random.default_rng(2)
    cfg = _cfg(bits=3, channels=3, h=4, w=4)
    p = rng.dirichlet(np.ones(8))
    entropy = float(-(p * np.log2(p)).sum())
    n = 64
    levels = rng.choice(8, size=n * cfg.seq_len, p=p)
    model = FixedLogits(cfg, np.log(p))
    res = bits_per_dim(model, _images(rng, n, cfg, levels), return_per_image=True, bootstrap=500)
    sd = math.sqrt(float((p * np.log2(p) ** 2).sum()) - entropy ** 2) / math.sqrt(n * cfg.seq_len)
    assert abs(res["bpd"] - entropy) < 4 * sd
    assert res["ci95"][0] <= res["bpd"] <= res["ci95"][1]


def test_bootstrap_ci_contains_mean_and_is_reproducible():
    cfg = _cfg(8)
    torch.manual_seed(0)
    model = ImageTransformer(cfg)
    imgs = _images(np.random.default_rng(3), 12, cfg)
    a = bits_per_dim(model, imgs, bootstrap=300, seed=5)
    b = bits_per_dim(model, imgs, batch_size=5, bootstrap=300, seed=5)
    lo, hi = a["ci95"]
    assert lo <= a["bpd"] <= hi and lo < hi
    assert a["ci95"] == pytest.approx(b["ci95"], abs=1e-9)  # batch size does not change the numbers
    assert a["bpd"] == pytest.approx(float(np.mean(a["per_image"])), abs=1e-12)
    assert a["bits"] == 8 and a["n_images"] == 12 and len(a["per_image"]) == 12
    assert bits_per_dim(model, imgs) == pytest.approx(a["bpd"], abs=1e-9)
    # constant values: a degenerate interval at the value
    assert bootstrap_ci([2.0, 2.0, 2.0], 50) == pytest.approx((2.0, 2.0))
    for values, resamples in (([2.0], 50), ([1.0, 2.0], 1)):  # no interval from one value or one resample
        with pytest.raises(ShapeError, match="needs >= 2 values and >= 2 resamples"):
            bootstrap_ci(values, resamples)


def test_label_is_honest_about_bit_depth_and_dataset():
    low = bpd_label(4)
    assert "4-bit" in low and "NOT comparable" in low
    cfg = _cfg(bits=4)
    res = bits_per_dim(FixedLogits(cfg, torch.zeros(16)), _images(np.random.default_rng(0), 2, cfg),
                       return_per_image=True)
    assert res["label"] == low and res["ci95"] is None
    cifar = bpd_label(8, "cifar:cifar-10-batches-py")
    assert "comparable with published CIFAR-10" in cifar and "2.80" in cifar and "NOT" not in cifar
    other = bpd_label(8, "molecules")
    assert "molecules" in other and "only on the same dataset" in other


def test_bad_images_are_shape_errors():
    cfg = _cfg(8)
    model = FixedLogits(cfg, torch.zeros(256))
    with pytest.raises(ShapeError, match="model expects"):
        bits_per_dim(model, np.zeros((1, 1, 5, 5), np.uint8))
    with pytest.raises(ShapeError, match="uint8"):
        bits_per_dim(model, np.zeros((1, 1, 4, 4), np.float32))
    with pytest.raises(ShapeError, match="no images"):
        bits_per_dim(model, np.zeros((0, 1, 4, 4), np.uint8))
