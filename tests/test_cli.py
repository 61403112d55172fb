"""train.py / sample.py flags checked before any work: --device, --out, --reduce, and a context
(inpainting) model sampled without --inpaint; each a one-line error with exit code 2."""
import os

import pytest
import torch

from imggen.checkpoint import save_checkpoint
from imggen.cli import sample_main, train_main
from imggen.config import Config, ModelConfig, TrainConfig
from imggen.model import ImageTransformer

torch.set_num_threads(1)


def _ckpt(tmp_path, context="none"):
    torch.manual_seed(0)
    cfg = ModelConfig(height=4, width=4, channels=1, bits=8, dim=16, layers=1, heads=2, attention="band",
                      window=5, backend="cpu", context=context)
    run = tmp_path / f"run_{context}"
    save_checkpoint(str(run), 1, ImageTransformer(cfg),
                    Config(model=cfg, train=TrainConfig(task="generate" if context == "none" else "inpaint")))
    return str(run)


def _one_line_error(capsys, main, argv) -> str:
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and ": error: " in err[0], err
    return err[0]


@pytest.mark.parametrize("main", [train_main, sample_main])
@pytest.mark.parametrize("device, msg", [("bogus", "not a torch device"), ("cuda", "CUDA is not available"),
                                         ("cuda:7", "CUDA is not available")])
def test_bad_device_is_one_line(tmp_path, capsys, monkeypatch, main, device, msg):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    argv = ["--device", device, "--out", tmp_path / "x.png" if main is sample_main else tmp_path / "run"]
    if main is sample_main:
        argv += ["--checkpoint", tmp_path / "missing"]
    assert msg in _one_line_error(capsys, main, argv)
    assert not os.listdir(tmp_path)


def test_cuda_index_beyond_device_count(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    err = _one_line_error(capsys, sample_main, ["--checkpoint", tmp_path, "--device", "cuda:1"])
    assert "1 CUDA device(s)" in err


@pytest.mark.parametrize("out, msg", [("DIR", "is a directory"), ("x.jpg", "ending in .png"),
                                      ("FILE/x.png", "is a file, not a folder")])
def test_bad_out_fails_before_sampling(tmp_path, capsys, out, msg):
    run = _ckpt(tmp_path)
    (tmp_path / "DIR").mkdir()
    (tmp_path / "FILE").write_text("")
    before = sorted(os.listdir(tmp_path))
    err = _one_line_error(capsys, sample_main, ["--checkpoint", run, "--device", "cpu", "--out", tmp_path / out])
    assert msg in err
    assert sorted(os.listdir(tmp_path)) == before and not os.listdir(tmp_path / "DIR")  # no .tmp left


def test_out_in_missing_folders_is_created(tmp_path, capsys):
    out = tmp_path / "a" / "b" / "grid.png"
    assert sample_main(["--checkpoint", _ckpt(tmp_path), "--device", "cpu", "--num", "1", "--out", str(out)]) == 0
    assert os.listdir(out.parent) == ["grid.png"]


def test_reduce_without_samples_is_an_error(tmp_path, capsys):
    err = _one_line_error(capsys, sample_main, ["--checkpoint", tmp_path, "--reduce", "median", "--device", "cpu"])
    assert "--samples" in err


def test_context_model_without_inpaint_says_which_flags(tmp_path, capsys):
    run = _ckpt(tmp_path, context="unet")
    err = _one_line_error(capsys, sample_main, ["--checkpoint", run, "--device", "cpu", "--out", tmp_path / "s.png"])
    assert "trained for inpainting with a context: pass --inpaint IMAGE --mask MASK" in err
    assert not (tmp_path / "s.png").exists()


def _no_data(monkeypatch):
    import imggen.datasets

    def boom(*a, **k):
        raise AssertionError("data loaded before the backend check")
    monkeypatch.setattr(imggen.datasets, "load_dataset", boom)


@pytest.mark.parametrize("backend, msg", [("triton", "--backend triton: the triton kernels need a CUDA GPU"),
                                          ("flex", "--backend flex: the flex backend has no backward pass on CPU")])
def test_backend_that_cannot_train_on_cpu_fails_before_the_data_loads(tmp_path, capsys, monkeypatch, backend, msg):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("IMGGEN_BACKEND", raising=False)
    _no_data(monkeypatch)
    for device in ([], ["--device", "cpu"]):
        err = _one_line_error(capsys, train_main, ["--backend", backend, "--out", tmp_path / "run", *device])
        assert msg in err and "--backend cpu" in err
    assert not (tmp_path / "run").exists()


def test_forced_flex_backend_on_cpu_fails_before_the_data_loads(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("IMGGEN_BACKEND", "flex")
    _no_data(monkeypatch)
    err = _one_line_error(capsys, train_main, ["--out", tmp_path / "run"])
    assert "IMGGEN_BACKEND=flex: the flex backend has no backward pass on CPU" in err and "IMGGEN_BACKEND=cpu" in err
    assert not (tmp_path / "run").exists()


def test_backend_check_lets_through_what_can_train(monkeypatch):
    from imggen.cli import check_train_backend
    from imggen.config import preset

    monkeypatch.delenv("IMGGEN_BACKEND", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cfg = preset("demo")
    for backend in ("auto", "cpu", "reference"):
        cfg.model.backend = backend
        check_train_backend(cfg, "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for backend in ("triton", "flex"):  # on CUDA both train
        cfg.model.backend = backend
        check_train_backend(cfg, None)
        check_train_backend(cfg, "cuda:0")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the Triton interpreter runs the kernels on CPU tensors (tests)
    cfg.model.backend = "triton"
    check_train_backend(cfg, "cpu")


def test_a_pattern_flag_that_the_attention_does_not_use_is_an_error(capsys):
    from imggen.cli import config_from_args
    with pytest.raises(SystemExit):
        config_from_args(["--attention", "full", "--window", "4", "--out", "x"])
    assert "--window has no effect with --attention full: it applies to band, diffuser" in capsys.readouterr().err
    cfg, _ = config_from_args(["--attention", "band,local2d", "--window", "4", "--radius", "2", "--out", "x"])
    assert cfg.model.window == 4 and cfg.model.radius == 2
