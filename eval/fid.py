"""Frechet Inception Distance, compatible with pytorch-fid (Heusel et al. 2017 / TF FID weights).

The network is pytorch-fid's `InceptionV3` (FID variant: `fid_inception_v3` with the patched
FIDInceptionA/C/E blocks, pool3 = 2048-d output of the final average pool). pytorch-fid would
download its weights on construction; we build the same architecture without downloading and
load `pt_inception-2015-12-05-6726825d.pth` from a local file instead:

    weights_path argument  >  $IMGGEN_FID_WEIGHTS

Get the file once (on a machine with internet) from
https://github.com/mseitzer/pytorch-fid/releases/download/fid_weights/pt_inception-2015-12-05-6726825d.pth
Preprocessing equals pytorch-fid's: uint8 -> [0, 1], bilinear resize to 299x299
(align_corners=False), scale to [-1, 1]; grayscale images are replicated to 3 channels.
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path
from unittest import mock

import numpy as np
import torch
from scipy import linalg

from imggen.errors import ConfigError, DataError, ShapeError

__all__ = ["frechet_distance", "InceptionFeatures", "activation_features", "activation_statistics",
           "fid_from_features", "fid", "FID_WEIGHTS_URL"]

FID_WEIGHTS_URL = ("https://github.com/mseitzer/pytorch-fid/releases/download/fid_weights/"
                   "pt_inception-2015-12-05-6726825d.pth")
WEIGHTS_ENV = "IMGGEN_FID_WEIGHTS"
MIN_IMAGES = 2048  # below this the 2048x2048 covariance is rank deficient; FID is biased upwards


def _check_covariance(s: np.ndarray, name: str) -> None:
    """DataError unless `s` is a symmetric positive semi-definite matrix (up to rounding)."""
    scale = max(float(np.abs(s).max()), np.finfo(np.float64).tiny)
    if not np.allclose(s, s.T, rtol=1e-5, atol=1e-8 * scale):
        raise DataError(f"frechet_distance: {name} is not symmetric (largest |{name} - {name}.T| = "
                        f"{float(np.abs(s - s.T).max()):.3g}); pass a covariance matrix such as "
                        f"np.cov(features, rowvar=False)")
    try:  # Cholesky of S + tol I succeeds iff every eigenvalue of S is > -tol (cheaper than eigvalsh)
        np.linalg.cholesky((s + s.T) / 2 + np.eye(len(s)) * (1e-6 * scale))
    except np.linalg.LinAlgError:
        low = float(np.linalg.eigvalsh((s + s.T) / 2)[0])
        raise DataError(f"frechet_distance: {name} is not positive semi-definite (smallest eigenvalue "
                        f"{low:.3g}); pass a covariance matrix such as np.cov(features, rowvar=False)") from None


def frechet_distance(mu1, sigma1, mu2, sigma2, eps: float = 1e-6) -> float:
    """||mu1 - mu2||^2 + Tr(S1 + S2 - 2 sqrt(S1 S2)) for Gaussians N(mu1, S1), N(mu2, S2).

    sqrt(S1 S2) via scipy.linalg.sqrtm; if the result is not finite (near-singular product) the
    computation is retried with eps * I added to both covariances. Imaginary parts from numerical
    error are dropped. Non-finite statistics, a covariance that is not symmetric positive
    semi-definite, a significant imaginary part (> 1e-3 on the diagonal) or a result that stays
    non-finite raise DataError (a ValueError) naming the argument.
    """
    mu1, mu2 = np.atleast_1d(np.asarray(mu1, np.float64)), np.atleast_1d(np.asarray(mu2, np.float64))
    s1, s2 = np.atleast_2d(np.asarray(sigma1, np.float64)), np.atleast_2d(np.asarray(sigma2, np.float64))
    if mu1.shape != mu2.shape or s1.shape != s2.shape or s1.shape != (mu1.size, mu1.size):
        raise ShapeError(f"mismatched statistics: mu {mu1.shape} vs {mu2.shape}, sigma {s1.shape} vs {s2.shape}")
    for a, name in ((mu1, "mu1"), (s1, "sigma1"), (mu2, "mu2"), (s2, "sigma2")):
        if not np.isfinite(a).all():
            raise DataError(f"frechet_distance: {name} holds {int((~np.isfinite(a)).sum())} NaN/inf values; "
                            f"compute the statistics from finite features")
    _check_covariance(s1, "sigma1")
    _check_covariance(s2, "sigma2")
    diff = mu1 - mu2
    covmean = linalg.sqrtm(s1.dot(s2))
    if not np.isfinite(covmean).all():
        offset = np.eye(s1.shape[0]) * eps
        covmean = linalg.sqrtm((s1 + offset).dot(s2 + offset))
    if not np.isfinite(covmean).all():
        raise DataError(f"frechet_distance: sqrtm(sigma1 sigma2) is not finite even with {eps:g} * I added "
                        f"to both covariances; the covariances are too ill-conditioned (pass a larger eps)")
    if np.iscomplexobj(covmean):
        if not np.allclose(np.diagonal(covmean).imag, 0, atol=1e-3):
            raise DataError(f"frechet_distance: sqrtm(sigma1 sigma2) has a significant imaginary part "
                            f"({np.max(np.abs(covmean.imag)):.3g}); covariances are not PSD")
        covmean = covmean.real
    return float(diff.dot(diff) + np.trace(s1) + np.trace(s2) - 2.0 * np.trace(covmean))


def _fid_inception_architecture():
    """pytorch-fid's FID Inception (same modules and state-dict keys), randomly initialised."""
    import torchvision
    from pytorch_fid import inception as pfi

    net = torchvision.models.inception_v3(num_classes=1008, aux_logits=False, weights=None,
                                          init_weights=False)
    net.Mixed_5b = pfi.FIDInceptionA(192, pool_features=32)
    net.Mixed_5c = pfi.FIDInceptionA(256, pool_features=64)
    net.Mixed_5d = pfi.FIDInceptionA(288, pool_features=64)
    net.Mixed_6b = pfi.FIDInceptionC(768, channels_7x7=128)
    net.Mixed_6c = pfi.FIDInceptionC(768, channels_7x7=160)
    net.Mixed_6d = pfi.FIDInceptionC(768, channels_7x7=160)
    net.Mixed_6e = pfi.FIDInceptionC(768, channels_7x7=192)
    net.Mixed_7b = pfi.FIDInceptionE_1(1280)
    net.Mixed_7c = pfi.FIDInceptionE_2(2048)
    return net


def _resolve_weights(weights_path) -> Path:
    path = weights_path or os.environ.get(WEIGHTS_ENV)
    if not path:
        raise ConfigError(
            f"FID needs the pytorch-fid Inception weights: download {FID_WEIGHTS_URL} and pass its "
            f"path as weights_path=... (CLI: --fid-weights) or set ${WEIGHTS_ENV}")
    path = Path(path).expanduser()
    if not path.is_file():
        raise DataError(f"FID weights file {path} not found; download {FID_WEIGHTS_URL} to that path "
                        f"(or point weights_path / ${WEIGHTS_ENV} at an existing copy)")
    return path


class InceptionFeatures(torch.nn.Module):
    """pool3 (2048-d) features of pytorch-fid's Inception-v3 for uint8 images (B, C, H, W), C in {1, 3}.

    random_init=True (tests only) builds the real architecture with random weights and needs no file.
    """

    def __init__(self, weights_path=None, random_init: bool = False):
        super().__init__()
        from pytorch_fid import inception as pfi

        net = _fid_inception_architecture()
        if random_init:  # He init keeps activations O(1) through the 94 conv layers (tests only)
            for mod in net.modules():
                if isinstance(mod, torch.nn.Conv2d):
                    torch.nn.init.kaiming_normal_(mod.weight, nonlinearity="relu")
        else:
            path = _resolve_weights(weights_path)
            try:
                state = torch.load(path, map_location="cpu", weights_only=True)
                net.load_state_dict(state)
            except Exception as e:  # corrupt download, wrong file
                raise DataError(f"cannot load FID Inception weights from {path} ({type(e).__name__}: {e}); "
                                f"re-download {FID_WEIGHTS_URL}") from e
        # pytorch-fid's wrapper (resize 299 bilinear, [0,1] -> [-1,1], blocks up to pool3) around
        # our network instead of the one it would download.
        with mock.patch.object(pfi, "fid_inception_v3", lambda: net):
            self.model = pfi.InceptionV3([pfi.InceptionV3.BLOCK_INDEX_BY_DIM[2048]],
                                         resize_input=True, normalize_input=True)
        self.eval()

    @torch.no_grad()
    def forward(self, images) -> torch.Tensor:
        x = torch.as_tensor(images)
        if x.ndim != 4 or x.shape[1] not in (1, 3):
            raise ShapeError(f"InceptionFeatures expects uint8 images (B, 1|3, H, W), got {tuple(x.shape)}")
        if x.dtype != torch.uint8:
            raise ShapeError(f"InceptionFeatures expects uint8 images, got {x.dtype}")
        dev = next(self.parameters()).device
        x = x.to(dev, torch.float32) / 255.0
        if x.shape[1] == 1:
            x = x.expand(-1, 3, -1, -1)
        return self.model(x)[0].flatten(1)


def activation_features(images, model: InceptionFeatures, batch_size: int = 50) -> np.ndarray:
    """float64 (N, 2048) pool3 features of uint8 images (N, C, H, W), in batches."""
    if len(images) == 0:
        raise ShapeError("no images to compute FID features for")
    return np.concatenate([model(images[i:i + batch_size]).cpu().numpy().astype(np.float64)
                           for i in range(0, len(images), batch_size)])


def _warn_small(n: int) -> None:
    if n < MIN_IMAGES:
        warnings.warn(f"FID on {n} < {MIN_IMAGES} images: covariance is rank deficient, FID is biased "
                      f"and not comparable to published numbers", stacklevel=3)


def activation_statistics(images, model: InceptionFeatures, batch_size: int = 50):
    """Mean (2048,) and covariance (2048, 2048) of pool3 features over uint8 images (N, C, H, W)."""
    if len(images) < 2:
        raise ShapeError(f"need at least 2 images for a covariance, got {len(images)}")
    _warn_small(len(images))
    feats = activation_features(images, model, batch_size)
    return feats.mean(axis=0), np.cov(feats, rowvar=False)


def fid_from_features(f1: np.ndarray, f2: np.ndarray) -> float:
    """FID between two feature sets (N1, D), (N2, D).

    With N >= D for both sets this is `frechet_distance` of their means / covariances (as
    pytorch-fid). With fewer samples than dimensions the covariances have rank < N, sqrtm of their
    singular product is ill-conditioned (and slow at D=2048), so the trace term is computed exactly
    in sample space: Tr sqrt(S1 S2) = ||A1 A2^T||_* / sqrt((N1-1)(N2-1)), A = centred features
    (the non-zero eigenvalues of S1 S2 are those of (A1 A2^T)(A1 A2^T)^T / ((N1-1)(N2-1))).
    """
    n1, n2, d = len(f1), len(f2), f1.shape[1]
    if min(n1, n2) < 2 or f2.shape[1] != d:
        raise ShapeError(f"need >= 2 feature vectors of one dimension per set, got {f1.shape} and {f2.shape}")
    mu1, mu2 = f1.mean(axis=0), f2.mean(axis=0)
    if min(n1, n2) >= d:
        return frechet_distance(mu1, np.cov(f1, rowvar=False), mu2, np.cov(f2, rowvar=False))
    a1, a2 = f1 - mu1, f2 - mu2
    tr_covmean = np.linalg.svd(a1 @ a2.T, compute_uv=False).sum() / np.sqrt((n1 - 1) * (n2 - 1))
    diff = mu1 - mu2
    return float(diff @ diff + (a1 ** 2).sum() / (n1 - 1) + (a2 ** 2).sum() / (n2 - 1) - 2 * tr_covmean)


def fid(images_a, images_b, weights_path=None, batch_size: int = 50, device=None,
        random_init: bool = False, model: InceptionFeatures | None = None) -> float:
    """FID between two sets of uint8 images (N, C, H, W) with pytorch-fid's Inception pool3 features.

    Pass `model` to reuse a loaded InceptionFeatures across calls. Warns once when either set has
    fewer than 2,048 images (FID is then biased upwards and not comparable to published values).
    """
    _warn_small(min(len(images_a), len(images_b)))
    if model is None:
        model = InceptionFeatures(weights_path, random_init=random_init)
        model.to(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return fid_from_features(activation_features(images_a, model, batch_size),
                             activation_features(images_b, model, batch_size))
