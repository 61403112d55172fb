"""Frechet distance vs closed forms; pytorch-fid Inception path end to end on random weights."""
from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from imggen import eval as ev
from imggen.errors import ConfigError, DataError
from imggen.eval import fid as fidmod
from imggen.eval.fid import (InceptionFeatures, activation_statistics, fid, fid_from_features,
                             frechet_distance)


def test_frechet_diagonal_closed_form():
    rng = np.random.default_rng(0)
    mu1, mu2 = rng.normal(size=16), rng.normal(size=16)
    s1, s2 = rng.uniform(0.1, 3, 16), rng.uniform(0.1, 3, 16)
    ref = np.sum((mu1 - mu2) ** 2) + np.sum(s1 + s2 - 2 * np.sqrt(s1 * s2))
    assert frechet_distance(mu1, np.diag(s1), mu2, np.diag(s2)) == pytest.approx(ref, rel=1e-10)
    assert ev.frechet_distance(mu1, np.diag(s1), mu1, np.diag(s1)) == pytest.approx(0, abs=1e-10)
    # 1-D: (m1 - m2)^2 + (sd1 - sd2)^2
    assert frechet_distance([1.0], [[4.0]], [3.0], [[9.0]]) == pytest.approx(4 + 1)


def test_frechet_full_covariance_rotation_invariant():
    rng = np.random.default_rng(1)
    q, _ = np.linalg.qr(rng.normal(size=(8, 8)))
    s1, s2 = rng.uniform(0.5, 2, 8), rng.uniform(0.5, 2, 8)
    mu1, mu2 = rng.normal(size=8), rng.normal(size=8)
    ref = frechet_distance(mu1, np.diag(s1), mu2, np.diag(s2))
    # commuting covariances rotated together, means rotated too: same distance
    got = frechet_distance(q @ mu1, q @ np.diag(s1) @ q.T, q @ mu2, q @ np.diag(s2) @ q.T)
    assert got == pytest.approx(ref, rel=1e-8)


def test_frechet_retry_and_imaginary(monkeypatch):
    calls = []
    real_sqrtm = fidmod.linalg.sqrtm

    def flaky(a):
        calls.append(a.copy())
        return np.full_like(a, np.nan) if len(calls) == 1 else real_sqrtm(a)

    monkeypatch.setattr(fidmod.linalg, "sqrtm", flaky)
    s = np.diag([1.0, 2.0])
    assert frechet_distance([0, 0], s, [0, 0], s, eps=1e-6) == pytest.approx(0, abs=1e-5)
    assert len(calls) == 2 and np.allclose(calls[1], (s + 1e-6 * np.eye(2)) @ (s + 1e-6 * np.eye(2)))
    monkeypatch.setattr(fidmod.linalg, "sqrtm", lambda a: np.eye(2) * (1 + 1j))
    with pytest.raises(ValueError, match="imaginary"):
        frechet_distance([0, 0], s, [0, 0], s)
    monkeypatch.setattr(fidmod.linalg, "sqrtm", lambda a: np.eye(2) * (1 + 1e-9j))
    assert frechet_distance([0, 0], s, [0, 0], s) == pytest.approx(3 + 3 - 4)


@pytest.mark.parametrize("arg, value, msg", [
    ("sigma1", np.diag([-1.0, 1.0]), "sigma1 is not positive semi-definite .smallest eigenvalue -1"),
    ("sigma2", np.array([[1.0, 2.0], [0.0, 1.0]]), "sigma2 is not symmetric"),
    ("sigma2", np.diag([np.nan, 1.0]), "sigma2 holds 1 NaN/inf"),
    ("sigma1", np.diag([np.inf, 1.0]), "sigma1 holds 1 NaN/inf"),
    ("mu1", np.array([np.nan, 0.0]), "mu1 holds 1 NaN/inf"),
])
def test_frechet_rejects_bad_statistics_with_data_error(arg, value, msg):
    """These used to give nan / 0.0 / a plain ValueError from inside sqrtm; now a DataError naming the argument."""
    kw = {"mu1": np.zeros(2), "sigma1": np.eye(2), "mu2": np.zeros(2), "sigma2": np.eye(2), arg: value}
    with pytest.raises(DataError, match=msg):
        frechet_distance(**kw)
    with pytest.raises(DataError, match=msg):
        ev.frechet_distance(**kw)


def test_frechet_accepts_singular_psd_and_fails_clearly_when_sqrtm_stays_non_finite(monkeypatch):
    rng = np.random.default_rng(3)
    f = rng.normal(size=(5, 8))  # 5 samples in 8-D: a rank-4 covariance with eigenvalues ~ -1e-16
    s = np.cov(f, rowvar=False)
    assert np.linalg.eigvalsh(s)[0] < 1e-12
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert frechet_distance(f.mean(0), s, f.mean(0), s) == pytest.approx(0, abs=1e-5)
    monkeypatch.setattr(fidmod.linalg, "sqrtm", lambda a: np.full_like(a, np.nan))
    with pytest.raises(DataError, match="not finite even with 1e-06"):
        frechet_distance([0, 0], np.eye(2), [0, 0], np.eye(2))
    monkeypatch.setattr(fidmod.linalg, "sqrtm", lambda a: np.eye(2) * (1 + 1j))
    with pytest.raises(DataError, match="imaginary"):
        frechet_distance([0, 0], np.eye(2), [0, 0], np.eye(2))


def test_fid_from_features_equals_frechet_of_statistics():
    rng = np.random.default_rng(2)
    for n1, n2, d in [(10, 12, 32), (80, 90, 16)]:  # rank-deficient path and full-rank path
        f1 = rng.normal(size=(n1, d))
        f2 = rng.normal(size=(n2, d)) * 1.5 + 0.3
        ref = frechet_distance(f1.mean(0), np.cov(f1, rowvar=False), f2.mean(0), np.cov(f2, rowvar=False))
        assert fid_from_features(f1, f2) == pytest.approx(ref, rel=1e-6)


def test_missing_weights_message(tmp_path, monkeypatch):
    monkeypatch.delenv("IMGGEN_FID_WEIGHTS", raising=False)
    with pytest.raises(ConfigError, match="pt_inception-2015-12-05"):
        InceptionFeatures()
    with pytest.raises(DataError, match="not found.*download"):
        InceptionFeatures(tmp_path / "nope.pth")
    bad = tmp_path / "bad.pth"
    bad.write_bytes(b"not a checkpoint")
    monkeypatch.setenv("IMGGEN_FID_WEIGHTS", str(bad))
    with pytest.raises(DataError, match="bad.pth"):
        InceptionFeatures()


@pytest.mark.slow  # ~20 s on 2 shared CPU cores: six 299x299 Inception forwards
def test_inception_path_end_to_end_random_init(tmp_path, monkeypatch):
    """Real pytorch-fid architecture, random weights, a few 32x32 images (~10-15 s on 2 CPU cores)."""
    torch.manual_seed(0)
    model = InceptionFeatures(random_init=True)
    rng = np.random.default_rng(0)
    rgb = torch.from_numpy(rng.integers(0, 256, size=(3, 3, 32, 32), dtype=np.uint8))
    feats = model(rgb)
    assert feats.shape == (3, 2048) and torch.isfinite(feats).all() and feats.std() > 0
    # preprocessing is pytorch-fid's: [0,1] -> bilinear 299 -> [-1,1] -> blocks up to pool3
    x = F.interpolate(rgb[:1].float() / 255, size=(299, 299), mode="bilinear", align_corners=False) * 2 - 1
    with torch.no_grad():
        for block in model.model.blocks:
            x = block(x)
    torch.testing.assert_close(feats[:1], x.flatten(1), rtol=1e-4, atol=1e-5)
    # grayscale is replicated to 3 channels
    gray = rgb[:1, :1]
    torch.testing.assert_close(model(gray), model(gray.expand(-1, 3, -1, -1).contiguous()))
    # weights load from a local file (argument or env var) into the same architecture
    path = tmp_path / "w.pth"
    torch.save(fidmod._fid_inception_architecture().state_dict(), path)  # another random net
    state = torch.load(path, weights_only=True)
    monkeypatch.setenv("IMGGEN_FID_WEIGHTS", str(path))
    loaded = InceptionFeatures()
    assert torch.equal(loaded.model.blocks[0][0].conv.weight, state["Conv2d_1a_3x3.conv.weight"])
    # statistics + FID: one warning line below 2,048 images; FID(a, a) = 0, FID(a, b) > 0
    with pytest.warns(UserWarning, match="2048"):
        mu, sigma = activation_statistics(rgb[:2], model, batch_size=1)
    assert mu.shape == (2048,) and sigma.shape == (2048, 2048)
    f = feats.double().numpy()
    assert fid_from_features(f, f) == pytest.approx(0, abs=1e-6)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        other = fid(rgb, torch.flip(rgb, dims=[2]) // 2, model=model, batch_size=3)
    assert len(w) == 1 and "\n" not in str(w[0].message)
    assert other > 0


@pytest.mark.skipif(not os.path.isfile(os.environ.get("IMGGEN_FID_WEIGHTS", "")),
                    reason="real Inception weights not present (set IMGGEN_FID_WEIGHTS to pt_inception-2015-12-05-*.pth)")
def test_real_weights_fid_of_a_set_against_itself_is_zero():
    rng = np.random.default_rng(0)
    imgs = torch.from_numpy(rng.integers(0, 256, size=(8, 3, 32, 32), dtype=np.uint8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert fid(imgs, imgs) == pytest.approx(0, abs=1e-3)
