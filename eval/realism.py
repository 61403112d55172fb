"""A realism score for grey 28x28 images that needs no download: a small classifier trained here.

FID needs Inception weights that cannot be fetched everywhere, and bits/dim says nothing about how
samples look. So this module trains (once, from a seed, cached) a small CNN on the training split
of a labelled data set (Fashion-MNIST or MNIST: the labels are in its idx files) and reports, for a
set of images:
- `frechet`: the Frechet distance between the Gaussians of the classifier's 128-d penultimate
  features of the images and of the first half of the test split (with a 95% interval from a
  bootstrap over the images, the estimate +- 1.96 standard deviations: the reference half stays fixed);
- `floor`: the same distance for the second half of the test split, real against real: what a set
  of that size scores when it is drawn from the data itself;
- `confidence`: the mean top-class probability; `class_entropy`: the entropy (bits) of the
  histogram of predicted classes (log2 10 = 3.32 when the classes are used evenly, as in the data);
- `accuracy`, when the images' true classes are known (filled test images, say).

Lower Frechet distance and a confidence and class entropy near the real images' are more realistic.
The classifier is a measuring stick only: its figures compare image sets scored with the same one
(same data, seed and recipe: the cache key holds them).
"""
from __future__ import annotations

import hashlib

import numpy as np
import torch
import torch.nn as nn

from imggen.errors import ShapeError

RECIPE = "realism-cnn-v1: 2 epochs (at least 100 steps), batch 128, Adam 1e-3 then 3e-4, 16/32-channel convs, 128-d features"
FEATURES = 128


class Classifier(nn.Module):
    def __init__(self, classes: int = 10):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(32 * 7 * 7, FEATURES), nn.ReLU())
        self.out = nn.Linear(FEATURES, classes)

    def forward(self, images: torch.Tensor):
        """uint8 (B, 1, 28, 28) -> (features (B, 128), class logits (B, classes))."""
        f = self.body(images.float() / 127.5 - 1.0)
        return f, self.out(f)


def _check(images: np.ndarray, what: str) -> np.ndarray:
    images = np.asarray(images)
    if images.ndim == 3:
        images = images[:, None]
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[1:] != (1, 28, 28):
        raise ShapeError(f"{what}: the realism score reads uint8 grey 28x28 images (N, 1, 28, 28), got "
                         f"{images.dtype} {images.shape}")
    return images


def train_classifier(images: np.ndarray, labels: np.ndarray, seed: int = 0, epochs: int = 2,
                     log=None) -> Classifier:
    images, labels = _check(images, "training images"), np.asarray(labels, np.int64)
    epochs = max(epochs, -(-100 * 128 // len(images)))  # small data sets: at least 100 steps
    torch.manual_seed(seed)
    model = Classifier(int(labels.max()) + 1)
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    x, y = torch.from_numpy(images), torch.from_numpy(labels)
    g = torch.Generator().manual_seed(seed)
    for epoch in range(epochs):
        for group in opt.param_groups:
            group["lr"] = 1e-3 if epoch < epochs - 1 else 3e-4
        for idx in torch.randperm(len(x), generator=g).split(128):
            loss = nn.functional.cross_entropy(model(x[idx])[1], y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        if log:
            log(f"realism classifier: epoch {epoch + 1}/{epochs}, last batch loss {float(loss.detach()):.3f}")
    return model.eval()


def cached_classifier(images: np.ndarray, labels: np.ndarray, seed: int = 0, cache_dir=None, log=None) -> Classifier:
    """The classifier of (images, labels, seed, RECIPE), trained once and kept in the cache folder."""
    from safetensors.torch import load_file, save_file

    from imggen.storage import cache_root

    images, labels = _check(images, "training images"), np.asarray(labels, np.int64)
    key = hashlib.sha256(images.tobytes() + labels.tobytes() + f"{seed}|{RECIPE}".encode()).hexdigest()[:24]
    path = cache_root(cache_dir) / "realism" / f"classifier-{key}.safetensors"
    model = Classifier(int(labels.max()) + 1)
    if path.is_file():
        try:
            model.load_state_dict(load_file(str(path)))
            return model.eval()
        except Exception as e:  # noqa: BLE001 - a damaged file is trained again
            if log:
                log(f"realism classifier {path} is damaged ({type(e).__name__}); training it again")
    model = train_classifier(images, labels, seed, log=log)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp))
        tmp.replace(path)
    except OSError as e:
        if log:
            log(f"cannot keep the realism classifier in {path.parent} ({e.strerror or e})")
    return model


@torch.no_grad()
def features(model: Classifier, images: np.ndarray, batch: int = 512) -> tuple[np.ndarray, np.ndarray]:
    """(features (N, 128) float64, class probabilities (N, classes) float64) of uint8 images."""
    images = _check(images, "images")
    f, p = [], []
    for i in range(0, len(images), batch):
        a, logits = model(torch.from_numpy(images[i:i + batch]))
        f.append(a.double().numpy())
        p.append(torch.softmax(logits.double(), -1).numpy())
    return np.concatenate(f), np.concatenate(p)


def reference_stats(f: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """(mean, symmetric square root R of the covariance, its trace) of reference features (N, d)."""
    w, v = np.linalg.eigh(np.cov(f, rowvar=False))
    root = (v * np.sqrt(np.clip(w, 0, None))) @ v.T
    return f.mean(0), root, float(np.clip(w, 0, None).sum())


def frechet(f: np.ndarray, ref) -> float:
    """The Frechet distance of N(mean, cov) of features f (N, d) to the reference (reference_stats):
    |m1 - m2|^2 + Tr(S1) + Tr(S2) - 2 Tr((S1 S2)^(1/2)), where (S1 S2)^(1/2) has the eigenvalues' square roots
    of R S2 R (S1 = R R: the same eigenvalues), which are real and >= 0: one symmetric eigensolve, no sqrtm
    (imggen.eval.fid.frechet_distance computes the same with sqrtm; tests compare them)."""
    mean, root, trace = ref
    s2 = np.cov(f, rowvar=False)
    ev = np.linalg.eigvalsh(root @ s2 @ root)
    return float(((f.mean(0) - mean) ** 2).sum() + trace + np.trace(s2) - 2 * np.sqrt(np.clip(ev, 0, None)).sum())


class RealismScore:
    """Scores image sets against a labelled data set's test split (halves A and B) with its classifier."""

    def __init__(self, model: Classifier, test_images: np.ndarray):
        test = _check(test_images, "test images")
        if len(test) < 4:
            raise ShapeError(f"the realism score needs at least 4 test images (two halves), got {len(test)}")
        self.model = model
        half = len(test) // 2
        self.ref = reference_stats(features(model, test[:half])[0])
        self.floor_set = test[half:2 * half]

    def score(self, images: np.ndarray, labels=None, resamples: int = 200, seed: int = 0) -> dict:
        return self.score_features(*features(self.model, _check(images, "images")), labels, resamples, seed)

    def score_features(self, f: np.ndarray, p: np.ndarray, labels=None, resamples: int = 200, seed: int = 0) -> dict:
        """`score` of images whose `features` (f, p) are already computed."""
        if len(f) < 2:
            raise ShapeError(f"the realism score needs at least 2 images, got {len(f)}")
        if labels is not None and np.shape(labels) != (len(f),):
            raise ShapeError(f"labels must be one class per image ({len(f)}), got shape {np.shape(labels)}")
        rng = np.random.default_rng(seed)
        boot = [frechet(f[rng.integers(0, len(f), len(f))], self.ref) for _ in range(resamples)]
        counts = np.bincount(p.argmax(1), minlength=p.shape[1]) / len(p)
        nz = counts[counts > 0]
        # a resample repeats images, which biases the distance upward (its percentiles can miss the
        # estimate itself): the interval is the estimate +- 1.96 bootstrap standard deviations, at least 0
        est, sd = frechet(f, self.ref), float(np.std(boot, ddof=1))
        out = {"n": int(len(f)), "frechet": est,
               "frechet_ci95": [max(0.0, est - 1.96 * sd), est + 1.96 * sd],
               "confidence": float(p.max(1).mean()), "class_entropy": float(-(nz * np.log2(nz)).sum())}
        if labels is not None:
            out["accuracy"] = float((p.argmax(1) == np.asarray(labels)).mean())
        return out

    def floor(self, n: int | None = None) -> dict:
        """The score of real test images (the second half, or its first n) against the first half."""
        return self.score(self.floor_set[:n])


def realism_for(spec: str = "fashion-mnist", seed: int = 0, cache_dir=None, log=None) -> tuple[RealismScore, dict]:
    """The RealismScore of a labelled grey 28x28 data set (fashion-mnist[:DIR] or mnist:DIR), and its
    test split's images and labels ({"images", "labels"})."""
    from imggen.datasets import load_dataset

    from imggen.errors import ConfigError

    data = load_dataset(spec, height=28, width=28, channels=1)
    if "labels" not in (data.meta or {}):
        raise ConfigError(f"the realism score trains its classifier on a labelled data set (fashion-mnist[:DIR] or "
                          f"mnist:DIR); {spec!r} has no labels")
    model = cached_classifier(data.train, np.asarray(data.meta["labels"]["train"]), seed, cache_dir, log)
    test = {"images": data.test, "labels": np.asarray(data.meta["labels"]["test"])}
    return RealismScore(model, data.test), test
