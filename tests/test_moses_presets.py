"""Presets moses (CPU) and moses256: valid configs, data spec moses, decode caches bounded by eviction."""
import time

import pytest
import torch

from imggen.config import preset


@pytest.mark.parametrize("name,side", [("moses", 64), ("moses256", 256)])
def test_presets(name, side):
    cfg = preset(name).validate()
    assert cfg.data.spec == "moses" and cfg.model.height == cfg.model.width == side and cfg.model.channels == 1


def test_moses256_decode_caches_are_bounded():
    """Every layer's decode cache of moses256 holds a small ring, not the 65,536-token sequence."""
    from imggen.decode import make_cache
    m = preset("moses256").validate().model
    kinds = set()
    for p in m.patterns():
        c = make_cache(p, 1, m.heads, m.dim // m.heads, m.seq_len)
        kinds.add(type(p).__name__)
        assert c.capacity <= 2048 < m.seq_len
        full = make_cache(p, 1, m.heads, m.dim // m.heads, m.seq_len, keep_all=True)
        assert c.nbytes() * 16 < full.nbytes()
    assert kinds == {"Local2D", "Band"}


@pytest.mark.slow
def test_moses256_smoke_two_steps_and_one_drawing(tmp_path, monkeypatch):
    """moses256 with a tiny model on CPU: 2 training steps on (fake) MOSES, then one sampled drawing
    (65,536 decode steps, ~2-3 min on a shared 2-core CPU)."""
    from test_moses_data import fake_site, moses_config

    import imggen
    from imggen.training import train
    torch.set_num_threads(1)
    _, data = fake_site(tmp_path)
    monkeypatch.setenv("IMGGEN_CACHE_DIR", str(tmp_path / "cache"))
    cfg = moses_config("moses256", data, {"model.layers": 1, "model.dim": 32, "model.heads": 1, "train.steps": 2,
                                          "train.batch_size": 1, "train.eval_images": 1,
                                          "train.grid_time_frac": 0, "data.limit": 2})
    m = train(cfg, str(tmp_path / "run"), progress=False, device="cpu")
    assert m["steps"] == 2
    model = imggen.load_model(str(tmp_path / "run"))
    t0 = time.time()
    img = imggen.detokenize(model, imggen.sample(model, 1, seed=0))
    assert img.shape == (1, 1, 256, 256) and img.dtype == torch.uint8
    print(f"one 256x256 drawing in {time.time() - t0:.0f} s")
