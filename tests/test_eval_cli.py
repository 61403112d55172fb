"""`python -m imggen.eval` on a tiny run trained on brats-demo at 16x16: report, bpd, inpaint, fid,
and one-line errors with exit code 2."""
import argparse
import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from imggen.config import Config, DataConfig, ModelConfig, TrainConfig
from imggen.eval.__main__ import build_parser, main
from imggen.eval.bpd import bits_per_dim
from imggen.eval.run import load_run
from imggen.eval.runners import inpaint_batch, run_inpaint
from imggen.model import ImageTransformer
from imggen.tokens import tokenize
from imggen.training import train

torch.set_num_threads(1)
S = 16  # brats-demo slices are resized to the model size


@pytest.fixture(scope="module")
def brats():
    from imggen.datasets import load_dataset
    return load_dataset("brats-demo", height=S, width=S, channels=1)


@pytest.fixture(scope="module")
def run(tmp_path_factory, brats):
    """A run directory (config, log.jsonl, metrics.json, checkpoint) from a few training steps."""
    out = tmp_path_factory.mktemp("eval") / "run"
    cfg = Config(preset="test",
                 model=ModelConfig(height=S, width=S, channels=1, bits=8, dim=16, layers=2, heads=2, attention="full"),
                 train=TrainConfig(steps=4, batch_size=4, lr=3e-3, warmup=1, eval_every=2, eval_images=4,
                                   ckpt_every=4, log_every=1, sample_num=2, seed=0),
                 data=DataConfig(spec="brats-demo"))
    splits = {k: tokenize(brats.split(k), 8).to(torch.uint8) for k in ("train", "val", "test")}
    train(cfg, str(out), data=splits, progress=False)
    return str(out)


def _main(capsys, *argv):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _opens(path):
    with Image.open(path) as im:
        im.load()
        return im.size


def test_report_end_to_end(run, brats, tmp_path, capsys):
    out = tmp_path / "rep"
    rc, stdout, err = _main(capsys, "report", "--checkpoint", run, "--num", 2, "--bootstrap", 100,
                            "--inpaint-num", 2, "--out", out)
    assert rc == 0, err
    rep = json.loads((out / "report.json").read_text())
    for key in ("config", "bpd", "unigram_bpd", "train_metrics", "sampling", "training", "inpainting", "atoms",
                "fid", "files"):
        assert key in rep
    assert rep["config"]["shape"] == [1, S, S] and rep["config"]["bits"] == 8
    b = rep["bpd"]
    assert b["ci95"][0] <= b["bpd"] <= b["ci95"][1] and b["n_images"] == len(brats.test)
    assert "8-bit" in b["label"] and "NOT comparable" not in b["label"]
    model = load_run(run).model
    assert b["bpd"] == pytest.approx(bits_per_dim(model, brats.test), abs=1e-9)
    with open(f"{run}/metrics.json") as f:
        metrics = json.load(f)
    assert rep["unigram_bpd"] == pytest.approx(metrics["unigram_bpd"])
    assert rep["sampling"]["tokens_per_s"] > 0 and rep["sampling"]["num"] == 2
    ip = rep["inpainting"]
    assert ip["n_images"] == 2 and all(math.isfinite(ip[k]) for k in ("psnr", "ssim", "psnr_mask", "ssim_mask"))
    assert rep["atoms"] is None and rep["fid"] is None  # not molecules; no FID weights given
    md = (out / "report.md").read_text()
    for section in ("## Config", "## Bits/dim", "unigram", "## Speed", "## Inpainting", "|---|"):
        assert section in md
    for name in ("samples.png", "curves.png", "inpainting.png"):
        w, h = _opens(out / name)
        assert w > 0 and h > 0
    assert "bits/dim" in stdout


def test_bpd_json(run, brats, tmp_path, capsys):
    path = tmp_path / "bpd.json"
    rc, stdout, err = _main(capsys, "bpd", "--checkpoint", run, "--limit", 10, "--bootstrap", 200, "--json", path)
    assert rc == 0, err
    res = json.loads(path.read_text())
    assert res["n_images"] == 10 and len(res["per_image"]) == 10 and res["split"] == "test"
    assert res["data"] == "brats-demo" and res["bits"] == 8
    assert res["bpd"] == pytest.approx(bits_per_dim(load_run(run).model, brats.test[:10]), abs=1e-9)
    assert res["ci95"][0] <= res["bpd"] <= res["ci95"][1]
    assert f"{res['bpd']:.4f}" in stdout


def test_inpaint_keeps_known_pixels_and_scores(run, tmp_path, capsys):
    out = tmp_path / "inp"
    rc, stdout, err = _main(capsys, "inpaint", "--checkpoint", run, "--data", "brats-demo", "--limit", 2,
                            "--seed", 1, "--out", out)
    assert rc == 0, err
    res = json.loads((out / "inpaint.json").read_text())
    assert res["n_images"] == 2 and len(res["files"]["triplets"]) == 2
    for k in ("psnr", "ssim", "psnr_mask", "ssim_mask"):
        assert res[k] is not None and math.isfinite(res[k])
    for p in res["files"]["triplets"] + [res["files"]["grid"]]:
        _opens(p)
    r = run_inpaint(load_run(run), limit=2, seed=1)
    imgs, masks, filled = r["_arrays"]
    keep = np.broadcast_to(~masks, imgs.shape)
    assert masks.any() and np.array_equal(filled[keep], imgs[keep])
    assert r["psnr"] == pytest.approx(res["psnr"])  # same seed, same fills


def test_inpaint_low_bit_model_copies_original_pixels(brats):
    torch.manual_seed(0)
    model = ImageTransformer(ModelConfig(height=S, width=S, channels=1, bits=4, dim=16, layers=1, heads=2,
                                         attention="full")).eval()
    sel = np.flatnonzero(brats.masks["test"].reshape(len(brats.test), -1).any(1))[:2]
    imgs, masks = brats.test[sel], brats.masks["test"][sel]
    filled = inpaint_batch(model, imgs, masks, seed=0)
    assert np.array_equal(filled[np.broadcast_to(~masks, imgs.shape)], imgs[np.broadcast_to(~masks, imgs.shape)])
    assert filled.dtype == np.uint8 and filled.shape == imgs.shape


def test_fid_from_npz_and_folder_random_init(tmp_path, capsys):
    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, (3, 1, 16, 16), dtype=np.uint8)
    np.savez(tmp_path / "a.npz", images=a)
    folder = tmp_path / "b"
    folder.mkdir()
    for i in range(3):
        Image.fromarray(rng.integers(0, 256, (16, 16), dtype=np.uint8)).save(folder / f"{i}.png")
    rc, stdout, err = _main(capsys, "fid", "--images-a", tmp_path / "a.npz", "--images-b", folder,
                            "--random-init", "--device", "cpu", "--json", tmp_path / "fid.json")
    assert rc == 0, err
    res = json.loads((tmp_path / "fid.json").read_text())
    assert res["n_a"] == 3 and res["n_b"] == 3 and math.isfinite(res["fid"]) and "not FID" in res["note"]


@pytest.mark.parametrize("argv, msg", [
    (["bpd", "--checkpoint", "MISSING"], "does not exist"),
    (["report", "--checkpoint", "MISSING"], "does not exist"),
    (["fid", "--images-a", "x.npz"], "--images-b"),
    (["fid", "--checkpoint", "MISSING", "--weights", "MISSING.pth"], "not found"),
    (["report", "--checkpoint", "MISSING", "--fid-weights", "MISSING.pth"], "not found"),
    (["inpaint", "--checkpoint", "RUN", "--data", "cifar"], "cifar:PATH"),
    (["atoms", "--checkpoint", "RUN"], "SMILES"),
])
def test_errors_are_one_line_exit_2(run, capsys, argv, msg):
    rc, out, err = _main(capsys, *[run if a == "RUN" else a for a in argv])
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "error:" in lines[0] and msg in lines[0], err


@pytest.mark.parametrize("argv", [[], ["frobnicate"], ["bpd"], ["bpd", "--checkpoint", "x", "--limit", "0"],
                                  ["bpd", "--checkpoint", "x", "--bogus"], ["report", "--checkpoint", "x", "--num", "a"],
                                  ["bpd", "--checkpoint", "x", "--bootstrap", "1"]])
def test_bad_flags_exit_2_one_line(capsys, argv):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "error:" in err[0]


def test_module_entry_point_unknown_subcommand():
    r = subprocess.run([sys.executable, "-m", "imggen.eval", "frobnicate"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and "invalid choice" in r.stderr


def test_every_flag_has_help():
    ap = build_parser()
    subs = [a for a in ap._actions if isinstance(a, argparse._SubParsersAction)][0]
    assert set(subs.choices) == {"bpd", "inpaint", "fid", "atoms", "molecules", "report", "brats", "realism"}
    for name, p in subs.choices.items():
        for action in p._actions:
            assert action.help, f"{name} {action.option_strings} has no help"


def test_report_without_data_or_logs_still_writes(tmp_path, capsys):
    """A bare checkpoint whose data cannot be loaded: bits/dim is skipped with a note, the rest is written."""
    from imggen.checkpoint import save_checkpoint

    torch.manual_seed(0)
    cfg = Config(model=ModelConfig(height=8, width=8, channels=3, bits=4, dim=16, layers=1, heads=2,
                                   attention="full"), data=DataConfig(spec="synthetic"))
    ckpt = save_checkpoint(str(tmp_path / "bare"), 1, ImageTransformer(cfg.model), cfg)
    rc, stdout, err = _main(capsys, "report", "--checkpoint", ckpt, "--num", 2, "--out", tmp_path / "rep")
    assert rc == 0, err
    rep = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert rep["bpd"] is None and rep["inpainting"] is None and rep["unigram_bpd"] is None
    assert any("unavailable" in n for n in rep["notes"]) and "note:" in stdout
    for name in ("samples.png", "curves.png"):
        _opens(tmp_path / "rep" / name)
    assert "## Notes" in (tmp_path / "rep" / "report.md").read_text()


@pytest.mark.parametrize("spec", ["folder:/nonexistent", "cifar:/nonexistent"])
def test_report_with_named_data_that_cannot_load_is_an_error(tmp_path, capsys, spec):
    """--data names the evaluation data: when it cannot be loaded that is an error, not a note."""
    from imggen.checkpoint import save_checkpoint

    cfg = Config(model=ModelConfig(height=4, width=4, channels=1, bits=4, dim=16, layers=1, heads=2,
                                   attention="full"))
    ckpt = save_checkpoint(str(tmp_path / "bare"), 1, ImageTransformer(cfg.model), cfg)
    rc, stdout, err = _main(capsys, "report", "--checkpoint", ckpt, "--data", spec, "--out", tmp_path / "rep")
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "error:" in lines[0] and spec in lines[0], err
    assert not (tmp_path / "rep").exists()


def test_report_says_in_one_line_when_drawings_are_too_small_for_osra():
    from imggen.eval.atoms import readable_note
    from imggen.eval.report import report_markdown
    note = readable_note(32, 32)
    assert note and "160" in note and readable_note(500, 500) is None
    rep = {"run_dir": "r", "checkpoint": "c", "step": 1, "data": "molecules", "created": "now", "notes": [],
           "config": {"shape": [1, 32, 32]}, "bpd": None, "sampling": {"num": 1, "device": "cpu", "tokens_per_s": 1.0,
                                                                       "seconds": 1.0, "images_per_s": 1.0},
           "atoms": None, "atoms_note": note}
    md = report_markdown(rep)
    assert f"Not measured: {note}." in md and "| recognised |" not in md


# ------------------------------------------------------------------ checked up front, one line, exit 2
def _no_sampling(monkeypatch):
    import imggen.eval.runners as R

    def boom(*a, **k):
        raise AssertionError("sampled before the check")
    monkeypatch.setattr(R, "sample_images", boom)


def test_fid_with_fewer_than_2_images_fails_before_sampling(run, tmp_path, capsys, monkeypatch):
    _no_sampling(monkeypatch)
    with pytest.raises(SystemExit) as e:  # --num 1: no covariance, rejected by the parser
        main(["fid", "--checkpoint", run, "--num", "1", "--random-init", "--device", "cpu"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "--num" in err[0] and ">= 2" in err[0], err
    np.savez(tmp_path / "one.npz", images=np.zeros((1, 1, S, S), np.uint8))
    for argv, flag in ([["--checkpoint", run, "--images-b", tmp_path / "one.npz"], "--images-b"],
                       [["--images-a", tmp_path / "one.npz", "--images-b", tmp_path / "one.npz"], "--images-a"]):
        rc, out, err = _main(capsys, "fid", *argv, "--random-init", "--device", "cpu")
        lines = err.strip().splitlines()
        assert rc == 2 and len(lines) == 1 and f"{flag} {tmp_path / 'one.npz'} holds 1 image(s)" in lines[0], err


def test_inpaint_reduce_without_samples_is_an_error_before_loading(capsys):
    rc, out, err = _main(capsys, "inpaint", "--checkpoint", "MISSING", "--reduce", "median")
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "--reduce median" in lines[0] and "--samples" in lines[0], err
    assert "does not exist" not in err  # checked before the checkpoint is even looked for


def test_limit_beyond_the_split_prints_one_note_with_the_count(run, brats, capsys, monkeypatch):
    n = len(brats.test)
    rc, out, err = _main(capsys, "bpd", "--checkpoint", run, "--limit", 10_000, "--bootstrap", 0)
    notes = [line for line in err.splitlines() if line.startswith("note:")]
    assert rc == 0 and len(notes) == 1 and f"--limit 10000 is more than the {n} images of the test split" in notes[0]
    assert f"over {n} images" in out
    rc, out, err = _main(capsys, "bpd", "--checkpoint", run, "--limit", 2, "--bootstrap", 0)
    assert rc == 0 and "note:" not in err
    # inpaint: the count of images with a non-empty mask; no note for the default --limit
    import imggen.eval.runners as R
    fake = {"n_images": 3, "split": "test", "data": "brats-demo", "psnr": 1.0, "ssim": 0.5, "psnr_mask": 1.0,
            "ssim_mask": 0.5, "json": "x.json", "files": {"triplets": []}}
    monkeypatch.setattr(R, "run_inpaint", lambda *a, **k: fake)
    rc, out, err = _main(capsys, "inpaint", "--checkpoint", run, "--limit", 50)
    assert rc == 0 and "note: --limit 50 is more than the 3 images with a non-empty mask in the test split" in err
    rc, out, err = _main(capsys, "inpaint", "--checkpoint", run)
    assert rc == 0 and "note:" not in err


def test_bad_image_files_for_fid_name_the_problem(tmp_path, capsys):
    rng = np.random.default_rng(0)
    good = tmp_path / "good.npz"
    np.savez(good, images=rng.integers(0, 256, (3, 1, 16, 16), dtype=np.uint8))
    np.savez(tmp_path / "two.npz", labels=np.arange(3), pixels=rng.integers(0, 256, (3, 16, 16), dtype=np.uint8))
    (tmp_path / "notes.txt").write_text("these are not images\n")
    (tmp_path / "empty.npz").write_bytes(b"")
    for name, msg in [("two.npz", "has no 'images' array (arrays found: 'labels', 'pixels')"),
                      ("notes.txt", "notes.txt is not an .npz or .npy file"),
                      ("empty.npz", "empty.npz is an empty file")]:
        rc, out, err = _main(capsys, "fid", "--images-a", tmp_path / name, "--images-b", good, "--random-init",
                             "--device", "cpu")
        lines = err.strip().splitlines()
        assert rc == 2 and len(lines) == 1 and msg in lines[0], err
        assert "pickle" not in err


def test_bpd_of_a_model_whose_output_overflows_is_an_error(run, tmp_path, capsys):
    from imggen.checkpoint import save_checkpoint

    r = load_run(run)
    with torch.no_grad():
        r.model.head.weight[:, 0] = float("inf")  # logits +-inf: the cross-entropy is NaN
    bad = save_checkpoint(str(tmp_path / "overflow"), 1, r.model, r.cfg)
    rc, out, err = _main(capsys, "bpd", "--checkpoint", bad, "--limit", 2, "--bootstrap", 0, "--json",
                         tmp_path / "b.json")
    lines = [line for line in err.splitlines() if line.strip() and "batch/s]" not in line]  # not tqdm's bar
    assert rc == 2 and len(lines) == 1 and "non-finite bits/dim (nan) on 2 of 2 test images" in lines[0], err
    assert "nan" not in out and not (tmp_path / "b.json").exists()
