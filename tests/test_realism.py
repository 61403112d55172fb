"""imggen.eval.realism: the offline realism score (a classifier trained here, its Frechet distance,
confidence and class spread) on small generated labelled data."""
import gzip
import json

import numpy as np
import pytest
import torch

from imggen.datasets import idx
from imggen.errors import ConfigError, ShapeError
from imggen.eval import realism
from test_idx import _idx_bytes

torch.set_num_threads(1)


def classes_idx(folder, n_train=400, n_test=200, seed=0):
    """A labelled idx release whose 4 classes are bright squares in 4 places (learnable in seconds)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for split, n in (("train", n_train), ("test", n_test)):
        y = rng.integers(0, 4, n).astype(np.uint8)
        x = rng.integers(0, 40, (n, 28, 28)).astype(np.uint8)
        for i, c in enumerate(y):
            r, col = divmod(int(c), 2)
            x[i, 4 + 12 * r: 12 + 12 * r, 4 + 12 * col: 12 + 12 * col] = 220
        for name, a, magic in zip(idx.FILES[split], (x, y), (idx.MAGIC_IMAGES, idx.MAGIC_LABELS)):
            with gzip.open(folder / (name + ".gz"), "wb") as f:
                f.write(_idx_bytes(a, magic))


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
    root = tmp_path_factory.mktemp("realism")
    classes_idx(root / "idx")
    score, test = realism.realism_for(f"fashion-mnist:{root / 'idx'}", cache_dir=root / "cache")
    return root, score, test


@pytest.mark.parametrize("n", [50, 400])
def test_frechet_matches_the_sqrtm_reference(n):
    from imggen.eval.fid import frechet_distance

    rng = np.random.default_rng(n)
    a = rng.normal(size=(300, 16)) @ rng.normal(size=(16, 16))
    b = rng.normal(size=(n, 16)) @ rng.normal(size=(16, 16)) + 0.5
    ref = frechet_distance(b.mean(0), np.cov(b, rowvar=False), a.mean(0), np.cov(a, rowvar=False))
    assert realism.frechet(b, realism.reference_stats(a)) == pytest.approx(ref, rel=1e-6)


def test_real_images_score_near_the_floor_and_noise_far_above(scored):
    _, score, test = scored
    floor = score.floor()
    real = score.score(test["images"][100:], labels=test["labels"][100:])
    assert real["frechet"] == pytest.approx(floor["frechet"])
    assert real["accuracy"] > 0.9 and real["confidence"] > 0.8 and real["class_entropy"] > 1.8  # 4 classes: 2 bits
    noise = score.score(np.random.default_rng(1).integers(0, 256, (100, 1, 28, 28), dtype=np.uint8))
    assert noise["frechet"] > 5 * floor["frechet"] and noise["frechet_ci95"][0] > floor["frechet_ci95"][1]
    one_class = score.score(np.repeat(test["images"][test["labels"] == 0][:1], 100, axis=0))
    assert one_class["class_entropy"] == 0.0 and one_class["frechet"] > floor["frechet"]
    lo, hi = real["frechet_ci95"]
    assert 0 <= lo < real["frechet"] < hi
    f, p = realism.features(score.model, test["images"][100:])  # precomputed features score the same
    assert score.score_features(f, p, test["labels"][100:]) == real
    with pytest.raises(ShapeError, match="one class per image"):
        score.score_features(f, p, test["labels"][:3])


def test_the_classifier_is_cached_and_reproducible(scored):
    root, score, test = scored
    files = list((root / "cache" / "realism").glob("classifier-*.safetensors"))
    assert len(files) == 1
    again, _ = realism.realism_for(f"fashion-mnist:{root / 'idx'}", cache_dir=root / "cache")
    for a, b in zip(score.model.state_dict().values(), again.model.state_dict().values()):
        assert torch.equal(a, b)
    files[0].write_bytes(b"damaged")
    notes = []
    rebuilt, _ = realism.realism_for(f"fashion-mnist:{root / 'idx'}", cache_dir=root / "cache", log=notes.append)
    assert any("damaged" in n for n in notes)
    for a, b in zip(score.model.state_dict().values(), rebuilt.model.state_dict().values()):
        assert torch.equal(a, b)  # the same seed trains the same classifier


def test_bad_inputs_are_one_clear_error(scored, tmp_path):
    from PIL import Image

    _, score, _ = scored
    with pytest.raises(ShapeError, match="28x28"):
        score.score(np.zeros((4, 1, 32, 32), np.uint8))
    with pytest.raises(ShapeError, match="one class per image"):
        score.score(np.zeros((4, 1, 28, 28), np.uint8), labels=[1, 2])
    for i in range(12):
        Image.fromarray(np.full((28, 28), 20 * i, np.uint8)).save(tmp_path / f"{i}.png")
    with pytest.raises(ConfigError, match="labelled"):
        realism.realism_for(f"folder:{tmp_path}")


def test_the_eval_command_scores_image_sets(scored, tmp_path, capsys, monkeypatch):
    from imggen.eval.__main__ import main

    root, _, test = scored
    monkeypatch.setenv("IMGGEN_CACHE_DIR", str(root / "cache"))  # the classifier trained above
    np.savez(tmp_path / "real.npz", images=test["images"][:60])
    rc = main(["realism", "--images", str(tmp_path / "real.npz"), "--data", f"fashion-mnist:{root / 'idx'}",
               "--json", str(tmp_path / "r.json"), "--threads", "1"])
    assert rc == 0
    res = json.loads((tmp_path / "r.json").read_text())
    assert set(res) == {str(tmp_path / "real.npz"), "test images, real (60)"}
    assert "Frechet" in capsys.readouterr().out
    assert main(["realism", "--data", f"fashion-mnist:{root / 'idx'}"]) == 2
