"""sample.py CLI (imggen.cli.sample_main) on a tiny checkpoint: sampling, prefix completion,
inpainting with ranking and triplets, and one-line errors with exit code 2."""
import numpy as np
import pytest
import torch
from PIL import Image

from imggen.checkpoint import save_checkpoint
from imggen.config import Config, ModelConfig
from imggen.images import image_scale
from imggen.model import ImageTransformer
from imggen.cli import sample_main as main

torch.set_num_threads(1)
H, W = 6, 5


def _ckpt(tmp_path, channels=1):
    torch.manual_seed(0)
    cfg = ModelConfig(height=H, width=W, channels=channels, bits=8, dim=16, layers=2, heads=2,
                      attention="local2d,band", window=7, radius=1, backend="cpu")
    run = tmp_path / f"run{channels}"
    save_checkpoint(str(run), 1, ImageTransformer(cfg), Config(model=cfg))
    return str(run)


def _png(path, array):
    Image.fromarray(np.asarray(array, dtype=np.uint8)).save(path)
    return str(path)


def _run(capsys, *argv):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_sample_grid_is_reproducible(tmp_path, capsys):
    run = _ckpt(tmp_path)
    a, b = tmp_path / "a.png", tmp_path / "b.png"
    for out in (a, b):
        rc, stdout, _ = _run(capsys, "--checkpoint", run, "--num", 3, "--batch-size", 2, "--seed", 1,
                             "--top-k", 20, "--temperature", 0.9, "--out", out, "--device", "cpu")
        assert rc == 0 and "tokens/s" in stdout
    assert np.array_equal(_read(a), _read(b))


def _read(path) -> np.ndarray:
    with Image.open(path) as im:
        return np.asarray(im)


@pytest.mark.parametrize("channels", [1, 3])
def test_inpaint_keeps_known_pixels(tmp_path, capsys, channels):
    run = _ckpt(tmp_path, channels)
    rng = np.random.default_rng(0)
    shape = (H, W) if channels == 1 else (H, W, 3)
    img = rng.integers(0, 256, shape)
    mask = np.zeros((H, W), dtype=np.uint8)
    mask[2:4, 1:4] = 255
    out, trip = tmp_path / "filled.png", tmp_path / "triplet.png"
    rc, stdout, err = _run(capsys, "--checkpoint", run, "--inpaint", _png(tmp_path / "img.png", img),
                           "--mask", _png(tmp_path / "mask.png", mask), "--rank", 3, "--seed", 0,
                           "--out", out, "--triplet", trip, "--device", "cpu", "--scale", 1)
    assert rc == 0, err
    filled = _read(out)
    assert filled.shape == shape
    known = mask == 0
    assert np.array_equal(filled[known], img[known])
    assert _read(trip).shape[1] > 3 * W  # original | masked | filled
    rc, _, err = _run(capsys, "--checkpoint", run, "--inpaint", tmp_path / "img.png", "--mask", tmp_path / "mask.png",
                      "--out", tmp_path / "big.png", "--device", "cpu")  # fills are scaled like grids by default
    assert rc == 0, err
    assert _read(tmp_path / "big.png").shape[:2] == (H * image_scale(W), W * image_scale(W))


def test_prefix_completion(tmp_path, capsys):
    run = _ckpt(tmp_path)
    img = np.random.default_rng(1).integers(0, 256, (H, W))
    out = tmp_path / "done.png"
    rc, _, err = _run(capsys, "--checkpoint", run, "--prefix", _png(tmp_path / "p.png", img),
                      "--prefix-rows", 2, "--num", 1, "--seed", 3, "--out", out, "--device", "cpu", "--scale", 1)
    assert rc == 0, err
    assert np.array_equal(_read(out)[:2], img[:2])


def test_bad_inputs_are_one_line_errors(tmp_path, capsys):
    run = _ckpt(tmp_path)
    img = _png(tmp_path / "img.png", np.zeros((H, W)))
    cases = {
        "mask": ["--inpaint", img, "--mask", _png(tmp_path / "m.png", np.full((H + 1, W), 255))],
        "expects": ["--inpaint", _png(tmp_path / "big.png", np.zeros((H + 2, W))),
                    "--mask", _png(tmp_path / "m2.png", np.full((H + 2, W), 255))],
        "colour": ["--prefix", _png(tmp_path / "rgb.png", np.random.default_rng(0).integers(0, 256, (H, W, 3))),
                   "--prefix-rows", 1],
        "nothing to inpaint": ["--inpaint", img, "--mask", _png(tmp_path / "m3.png", np.zeros((H, W)))],
        "nothing to complete": ["--prefix", img, "--prefix-rows", H],
        "does not exist": ["--inpaint", str(tmp_path / "missing.png"), "--mask", img],
    }
    for needle, args in cases.items():
        rc, _, err = _run(capsys, "--checkpoint", run, "--out", tmp_path / "x.png", "--device", "cpu", *args)
        assert rc == 2, (needle, err)
        assert needle in err and err.count("\n") == 1, err
    rc, _, err = _run(capsys, "--checkpoint", tmp_path / "nope", "--device", "cpu")
    assert rc == 2 and "does not exist" in err and err.count("\n") == 1


def test_no_progress_silences_the_sampling_bar(tmp_path, capsys):
    run = _ckpt(tmp_path)
    for flags, shown in (([], True), (["--no-progress"], False)):
        rc, _, err = _run(capsys, "--checkpoint", run, "--num", 1, "--seed", 0, "--out", tmp_path / "s.png",
                          "--device", "cpu", *flags)
        assert rc == 0 and ("sampling" in err) == shown, err[-500:]


def test_backend_flag_reaches_the_model(tmp_path, capsys, monkeypatch):
    import imggen.checkpoint
    seen = []
    real = imggen.checkpoint.load_model

    def spy(path, device="cpu", backend=None):
        seen.append(backend)
        return real(path, device, backend)
    monkeypatch.setattr(imggen.checkpoint, "load_model", spy)
    run = _ckpt(tmp_path)
    for flags in ([], ["--backend", "reference"]):
        rc, _, err = _run(capsys, "--checkpoint", run, "--num", 1, "--out", tmp_path / "s.png", "--device", "cpu",
                          "--no-progress", *flags)
        assert rc == 0, err
    assert seen == [None, "reference"]
    with pytest.raises(SystemExit) as e:
        _run(capsys, "--checkpoint", run, "--backend", "bogus")
    assert e.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_no_graph_flag_reaches_the_sampler_cuda_graph(tmp_path, capsys, monkeypatch):
    """--no-graph: the eager step; default: "auto" (a CUDA graph on CUDA; the CPU keeps its step)."""
    import imggen.graphs
    seen = []
    real = imggen.graphs.use_static

    def spy(graph, device):
        seen.append(graph)
        return real(graph, device)
    monkeypatch.setattr(imggen.graphs, "use_static", spy)
    run = _ckpt(tmp_path)
    outs = []
    for flags in ([], ["--no-graph"]):
        out = tmp_path / f"s{len(flags)}.png"
        rc, _, err = _run(capsys, "--checkpoint", run, "--num", 2, "--seed", 3, "--out", out, "--device", "cpu",
                          "--no-progress", *flags)
        assert rc == 0, err
        outs.append(_read(out))
    assert seen == ["auto", "off"] and np.array_equal(*outs)
