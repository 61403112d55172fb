"""bench/pixelcnn.py's Gated PixelCNN (the reference density model of issue 46) and bench/fashion.py's
parts on tiny data: causality against a perturbation test, imggen's bits/dim code scoring it, the time
budget's snapshots, and the codecs' figures against what the formats must give."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

import fashion  # noqa: E402
from pixelcnn import PixelCNNConfig, PixelCNNModel  # noqa: E402

from imggen.eval.bpd import per_image_bits_per_dim  # noqa: E402

torch.set_num_threads(1)


def _tiny(seed=0, **kw):
    torch.manual_seed(seed)
    cfg = dict(height=6, width=5, filters=8, layers=3, kernel=3, head=16)
    cfg.update(kw)
    return PixelCNNModel(PixelCNNConfig(**cfg)).double()


@pytest.mark.parametrize("kernel, layers", [(3, 3), (5, 2)])
def test_pixelcnn_reads_only_earlier_pixels_and_has_no_blind_spot(kernel, layers):
    m = _tiny(kernel=kernel, layers=layers)
    n, w = 30, 5
    x = torch.randint(0, 256, (2, n))
    base = m(x)
    for t in range(n):
        y = x.clone()
        y[:, t] = (y[:, t] + 101) % 256
        changed = (m(y) - base).abs().amax(dim=(0, 2)) > 0
        assert not changed[: t + 1].any(), f"logits at or before {t} read pixel {t}"
        r, c = divmod(t, w)
        if t + 1 < n and c + 1 < w:
            assert changed[t + 1], f"the next pixel does not read pixel {t}"
        if r + 1 < n // w:  # the pixel below and its right neighbour read it (the stacks together)
            assert changed[t + w]
            if c + 1 < w:
                assert changed[t + w + 1], f"blind spot: pixel {t + w + 1} misses {t}"


def test_pixelcnn_prefix_logits_match_and_bpd_code_scores_it():
    m = _tiny()
    x = torch.randint(0, 256, (3, 30))
    full = m(x)
    torch.testing.assert_close(m(x[:, :11]), full[:, :11])
    images = x.view(3, 1, 6, 5).to(torch.uint8)
    per = per_image_bits_per_dim(m.float(), images, batch_size=2)
    nll = torch.nn.functional.cross_entropy(m.float()(x).reshape(-1, 256), x.reshape(-1), reduction="none")
    np.testing.assert_allclose(per, (nll.view(3, 30).mean(1) / np.log(2)).detach().numpy(), rtol=1e-5)


def test_pixelcnn_samples_in_range_and_seeded():
    m = _tiny().float()
    a, b = m.sample(2, seed=3), m.sample(2, seed=3)
    assert a.shape == (2, 1, 6, 5) and a.dtype == torch.uint8 and torch.equal(a, b)


def test_time_budget_snapshots_load_and_learn(tmp_path):
    rng = np.random.default_rng(0)
    data = np.zeros((16, 1, 6, 5), np.uint8)
    data[:, :, :, 2:] = 200 + rng.integers(0, 2, (16, 1, 6, 3))  # easy to learn
    cfg = PixelCNNConfig(height=6, width=5, filters=8, layers=2, kernel=3, head=16)
    paths = fashion.train_pixelcnn(str(tmp_path), 0.05, [0.005], data=data, cfg=cfg, lr=1e-2,
                                   log=lambda s: None, warmup=1,
                                   precision="fp32")
    assert [os.path.basename(p) for p in paths] == ["pixelcnn_0.005min.pt", "pixelcnn_0.05min.pt"]
    first, s1 = fashion.load_pixelcnn(paths[0])
    last, s2 = fashion.load_pixelcnn(paths[1])
    assert s1["train_seconds"] >= 0.3 and s2["step"] > s1["step"] > 0
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]
    bpd = per_image_bits_per_dim(last, data).mean()
    assert bpd < 7.9, bpd  # it learns: a start near uniform is 8 bits


def test_lr_schedule_warms_up_then_decays_over_the_budget():
    assert fashion.lr_at(0, 0, 100, 1e-3) == pytest.approx(1e-5)
    assert fashion.lr_at(0, 200, 100, 1e-3) == pytest.approx(1e-3)
    assert fashion.lr_at(100, 500, 100, 1e-3) == pytest.approx(1e-4)


def test_codecs_on_known_images():
    const = np.full((20, 1, 28, 28), 7, np.uint8)
    bits = fashion.codec_bits(const)
    assert bits["order-0 entropy of the pixel values"] == 0
    assert all(v < 1.0 for v in bits.values())
    noise = np.random.default_rng(0).integers(0, 256, (20, 1, 28, 28), dtype=np.uint8)
    bits = fashion.codec_bits(noise)
    assert 7.9 < bits["order-0 entropy of the pixel values"] <= 8.0
    assert all(v > 7.5 for v in bits.values())  # noise does not compress


def test_paired_interval():
    d = fashion.paired([3.0, 2.0, 4.0, 3.5], [2.5, 1.5, 3.5, 3.0])
    assert d["mean"] == pytest.approx(0.5) and d["ci95"] == pytest.approx([0.5, 0.5])


def test_patterns_equal_time_table_reuses_scored_runs(tmp_path):
    from test_idx import write_idx

    write_idx(tmp_path / "idx", np.random.default_rng(0), n_train=40, n_test=6)
    out, work = tmp_path / "out", tmp_path / "work"
    argv = ["patterns", "--work", str(work), "--minutes", "0.001", "--limit", "4", "--reps", "1", "--threads", "1",
            "--data", f"fashion-mnist:{tmp_path / 'idx'}", "--out", str(out), "--only", "full", "band, 1 row (28)"]
    fashion.main(argv)
    data = __import__("json").loads((out / "fashion_patterns.json").read_text())
    assert [r[0] for r in data["rows"]] == ["full", "band, 1 row (28)"]
    assert all(r[2] == 1 for r in data["rows"])  # a budget below one step still trains one
    assert data["rows"][0][7] == "-" and data["rows"][1][7].startswith(("+", "-"))
    assert {k: len(v) for k, v in data["per_image"].items()} == {"full": 4, "band, 1 row (28)": 4}
    ckpt = work / "band_1_row" / "checkpoints"
    before = sorted(os.listdir(ckpt))
    mtimes = [os.path.getmtime(ckpt / c) for c in before]
    fashion.main(argv)  # scored runs are read back, not trained again
    assert sorted(os.listdir(ckpt)) == before and [os.path.getmtime(ckpt / c) for c in before] == mtimes
    assert "attention patterns at equal CPU time" in (out / "fashion_patterns.md").read_text()


def test_lever_rows_of_one_shape_share_one_timing_and_the_base_is_the_tables_own(tmp_path, monkeypatch):
    """Two rows that step the same model on the same batch (lr 4e-3, lr 1e-3) are timed once, so their
    budgets differ only by what they change; a row of another shape is timed on its own. The tables'
    base is the preset they were first measured with, whatever the preset is today."""
    import moses_patterns
    from test_idx import write_idx

    base = fashion.row_config({})
    assert (base.model.dim, base.model.layers, base.train.lr, base.train.ema) == (128, 6, 2e-3, 0.0)
    assert fashion.row_config({"train.lr": 4e-3}).train.lr == 4e-3
    assert "dim 128, 6 layers" in fashion.base_line()
    times = iter([0.5, 0.25, 9.0])
    monkeypatch.setattr(moses_patterns, "config_step_seconds", lambda *a: next(times))
    write_idx(tmp_path / "idx", np.random.default_rng(0), n_train=40, n_test=6)
    out, work = tmp_path / "out", tmp_path / "work"
    fashion.main(["levers", "--work", str(work), "--minutes", "0.004", "--limit", "4", "--reps", "1",
                  "--threads", "1", "--data", f"fashion-mnist:{tmp_path / 'idx'}", "--out", str(out),
                  "--only", "lr 4e-3", "lr 1e-3", "dim 96 x 8"])
    data = __import__("json").loads((out / "fashion_levers.json").read_text())
    assert data["step_s"] == {"lr 4e-3": 0.5, "lr 1e-3": 0.5, "dim 96 x 8": 0.25}
    assert [r[2] for r in data["rows"]] == [1, 1, 1]  # 0.24 s of budget: one step each


# ------------------------------------------------------------------------------------- PixelCNN++
def _tiny_pp(seed=0, **kw):
    from pixelcnnpp import PixelCNNPPConfig, PixelCNNPPModel

    torch.manual_seed(seed)
    cfg = dict(height=8, width=8, filters=8, resnets=1, scales=3, mixture=2)
    cfg.update(kw)
    return PixelCNNPPModel(PixelCNNPPConfig(**cfg)).double()


@pytest.mark.parametrize("scales", [1, 3])
def test_pixelcnnpp_reads_only_earlier_pixels_and_has_no_blind_spot(scales):
    m = _tiny_pp(scales=scales)
    n, w = 64, 8
    x = torch.randint(0, 256, (2, n))
    base = m.params(x)
    for t in range(n):
        y = x.clone()
        y[:, t] = (y[:, t] + 101) % 256
        changed = (m.params(y) - base).abs().amax(dim=(0, 2)) > 0
        assert not changed[: t + 1].any(), f"outputs at or before {t} read pixel {t}"
        r, c = divmod(t, w)
        if t + 1 < n and c + 1 < w:
            assert changed[t + 1], f"the next pixel does not read pixel {t}"
        if r + 1 < n // w:
            assert changed[t + w] and (c + 1 == w or changed[t + w + 1]), f"blind spot below {t}"


def test_pixelcnnpp_log_probs_and_its_loss_agree_and_bpd_code_scores_it():
    m = _tiny_pp()
    x = torch.randint(0, 256, (3, 64))
    lp = m(x)
    torch.testing.assert_close(lp.exp().sum(-1), torch.ones(3, 64, dtype=lp.dtype), rtol=0, atol=1e-5)
    nll = m(x, nll=True)
    torch.testing.assert_close(nll, -lp.gather(-1, x[..., None])[..., 0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(m(x[:, :20]), lp[:, :20])
    per = per_image_bits_per_dim(m.float(), x.view(3, 1, 8, 8).to(torch.uint8), batch_size=2)
    np.testing.assert_allclose(per, (nll.mean(1) / np.log(2)).detach().numpy(), rtol=1e-4)


def test_pixelcnnpp_budget_with_an_average_snapshots_the_average(tmp_path):
    from pixelcnnpp import PixelCNNPPConfig

    rng = np.random.default_rng(0)
    data = np.zeros((16, 1, 8, 8), np.uint8)
    data[:, :, :, 4:] = 200 + rng.integers(0, 2, (16, 1, 8, 4))
    cfg = PixelCNNPPConfig(height=8, width=8, filters=8, resnets=1, scales=2, mixture=2)
    paths = fashion.train_pixelcnn(str(tmp_path), 0.02, [], data=data, cfg=cfg, lr=1e-2, log=lambda s: None,
                                   warmup=1, precision="fp32", kind="pp", ema=0.9)
    assert [os.path.basename(p) for p in paths] == ["pixelcnnpp_0.02min.pt"]
    model, state = fashion.load_pixelcnn(paths[0])
    assert state["kind"] == "pp" and state["ema"] == 0.9 and state["step"] > 1
    assert type(model).__name__ == "PixelCNNPPModel"
    assert per_image_bits_per_dim(model, data).mean() < 8.0
    assert model.sample(2, seed=1).shape == (2, 1, 8, 8)


def test_score_reads_back_per_image_figures_only_when_newer_than_the_weights(tmp_path):
    snap = tmp_path / "pixelcnn_60min.pt"
    snap.write_bytes(b"weights")
    cache = str(snap) + ".test_bpd_4.npy"
    calls = []

    def compute():
        calls.append(1)
        return [2.0, 3.0, 4.0, 5.0 + len(calls)]

    first = fashion.scored(cache, str(snap), compute)
    assert calls == [1] and first.tolist() == [2.0, 3.0, 4.0, 6.0] and os.path.exists(cache)
    assert fashion.scored(cache, str(snap), compute).tolist() == first.tolist() and calls == [1]  # read back
    os.utime(snap, (os.path.getmtime(cache) + 10,) * 2)  # new weights: the figures are stale
    assert fashion.scored(cache, str(snap), compute).tolist() == [2.0, 3.0, 4.0, 7.0] and calls == [1, 1]
    run = tmp_path / "run"
    (run / "checkpoints" / "step_1").mkdir(parents=True)
    (run / "checkpoints" / "step_1" / "model.safetensors").write_bytes(b"w")
    cache = str(run / "test_bpd_4.npy")
    fashion.scored(cache, str(run / "checkpoints"), compute)
    os.utime(run / "checkpoints" / "step_1" / "model.safetensors", (os.path.getmtime(cache) + 10,) * 2)
    fashion.scored(cache, str(run / "checkpoints"), compute)  # a newer checkpoint inside the folder counts
    assert len(calls) == 4
