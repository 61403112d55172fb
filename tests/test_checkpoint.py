"""Checkpoints are verified when read: manifest checks, fallback past corrupt or stale ones, old style."""
import json
import os
import shutil

import pytest
import torch

import imggen.checkpoint as ck
from imggen.config import Config, ModelConfig
from imggen.errors import CheckpointError
from imggen.model import ImageTransformer


def tiny_cfg() -> Config:
    return Config(model=ModelConfig(height=4, width=4, channels=1, bits=4, dim=16, layers=1, heads=2, backend="cpu"))


def save(run, step, seed):
    """A checkpoint of a freshly seeded tiny model (different weights per seed); returns its weights."""
    torch.manual_seed(seed)
    cfg = tiny_cfg()
    model = ImageTransformer(cfg.model)
    opt = torch.optim.AdamW(model.parameters())
    ck.save_checkpoint(str(run), step, model, cfg,
                       {"optimizer": opt.state_dict(), "rng": torch.get_rng_state(), "step": step}, keep=3)
    return model.state_dict()


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def step_dir(run, step):
    return os.path.join(str(run), "checkpoints", f"step_{step:07d}")


def stderr_lines(capfd):
    return [line for line in capfd.readouterr().err.splitlines() if line.strip()]


def test_manifest_records_size_and_sha256(tmp_path):
    save(tmp_path, 1, 0)
    d = step_dir(tmp_path, 1)
    with open(os.path.join(d, ck.MANIFEST)) as f:
        files = json.load(f)["files"]
    assert set(files) == {"model.safetensors", "config.json", "state.pt"}
    for name, meta in files.items():
        assert meta["size"] == os.path.getsize(os.path.join(d, name))
        assert meta["sha256"] == ck._sha256(os.path.join(d, name))
    assert ck.verify(d) is None and ck.find_checkpoint(str(tmp_path)) == d


def test_truncated_newest_warns_once_and_previous_loads(tmp_path, capfd):
    w1 = save(tmp_path, 1, 0)
    save(tmp_path, 2, 1)
    path = os.path.join(step_dir(tmp_path, 2), "model.safetensors")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    model = ck.load_model(str(tmp_path))
    assert same(model.state_dict(), w1)
    assert ck.find_checkpoint(str(tmp_path)) == step_dir(tmp_path, 1)
    assert ck.resolve(str(tmp_path)) == step_dir(tmp_path, 1)
    lines = stderr_lines(capfd)
    assert len(lines) == 1, lines  # one warning, however often the run is resolved
    assert "step_0000002 is corrupt: model.safetensors has" in lines[0] and "using step_0000001" in lines[0]
    with pytest.raises(CheckpointError, match="step_0000002 is corrupt"):  # named directly: no fallback
        ck.resolve(step_dir(tmp_path, 2))


def test_flipped_byte_same_size_is_caught(tmp_path):
    save(tmp_path, 1, 0)
    save(tmp_path, 2, 1)
    path = os.path.join(step_dir(tmp_path, 2), "state.pt")
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(path, "wb").write(bytes(data))
    assert "state.pt does not match its sha256" in ck.verify(step_dir(tmp_path, 2))
    assert ck.find_checkpoint(str(tmp_path)) == step_dir(tmp_path, 1)
    with pytest.raises(CheckpointError, match="state.pt does not match"):
        ck.load_state(step_dir(tmp_path, 2))
    assert ck.load_state(step_dir(tmp_path, 1))["step"] == 1


def test_latest_pointing_at_removed_folder_falls_back(tmp_path, capfd):
    w1 = save(tmp_path, 1, 0)
    save(tmp_path, 2, 1)
    shutil.rmtree(step_dir(tmp_path, 2))  # LATEST still says step_0000002
    assert same(ck.load_model(str(tmp_path)).state_dict(), w1)
    assert ck.find_checkpoint(str(tmp_path)) == step_dir(tmp_path, 1)
    lines = stderr_lines(capfd)
    assert len(lines) == 1 and "LATEST names 'step_0000002'" in lines[0]


@pytest.mark.parametrize("latest", [None, b"\xff\xfe garbage", b"step_0000001"])
def test_missing_or_corrupt_latest_scans_newest_step_first(tmp_path, latest):
    save(tmp_path, 1, 0)
    w3 = save(tmp_path, 3, 1)
    lpath = os.path.join(str(tmp_path), "checkpoints", "LATEST")
    os.remove(lpath)
    if latest is not None:
        open(lpath, "wb").write(latest)
    expect = 1 if latest == b"step_0000001" else 3  # an intact LATEST is followed
    assert ck.find_checkpoint(str(tmp_path)) == step_dir(tmp_path, expect)
    if expect == 3:
        assert same(ck.load_model(str(tmp_path)).state_dict(), w3)


def test_no_checkpoint_is_clear_error(tmp_path):
    assert ck.find_checkpoint(str(tmp_path)) is None
    with pytest.raises(CheckpointError, match="no model.safetensors under"):
        ck.resolve(str(tmp_path))
    os.makedirs(tmp_path / "checkpoints" / ".tmp-killed")  # a save killed before its rename
    assert ck.find_checkpoint(str(tmp_path)) is None
    with pytest.raises(CheckpointError, match="no intact checkpoint under .*has this run saved one yet"):
        ck.load_model(str(tmp_path))
    with pytest.raises(CheckpointError, match="does not exist"):
        ck.resolve(str(tmp_path / "missing"))


def test_all_corrupt_is_clear_error(tmp_path, capfd):
    save(tmp_path, 1, 0)
    os.remove(os.path.join(step_dir(tmp_path, 1), "config.json"))
    assert ck.find_checkpoint(str(tmp_path)) is None
    assert "no intact checkpoint left" in capfd.readouterr().err
    with pytest.raises(CheckpointError, match="no intact checkpoint .*step_0000001 is corrupt: config.json is missing"):
        ck.resolve(str(tmp_path))


def test_old_style_checkpoint_without_manifest_loads(tmp_path, capfd):
    w1 = save(tmp_path, 1, 0)
    w2 = save(tmp_path, 2, 1)
    for step in (1, 2):
        os.remove(os.path.join(step_dir(tmp_path, step), ck.MANIFEST))
    assert same(ck.load_model(str(tmp_path)).state_dict(), w2)
    assert ck.load_state(ck.resolve(str(tmp_path)))["step"] == 2
    assert stderr_lines(capfd) == []
    # what can be checked without a manifest still is: a cut safetensors file, a broken state.pt
    path = os.path.join(step_dir(tmp_path, 2), "model.safetensors")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 10)
    assert "model.safetensors is unreadable" in ck.verify(step_dir(tmp_path, 2))
    assert same(ck.load_model(str(tmp_path)).state_dict(), w1)
    state = os.path.join(step_dir(tmp_path, 1), "state.pt")
    with open(state, "r+b") as f:
        f.truncate(os.path.getsize(state) // 2)
    assert "state.pt is unreadable" in ck.verify(step_dir(tmp_path, 1))


def test_load_weights_refuses_corrupt_dir(tmp_path):
    save(tmp_path, 1, 0)
    path = os.path.join(step_dir(tmp_path, 1), "config.json")
    with open(path, "a") as f:
        f.write(" ")
    with pytest.raises(CheckpointError, match="config.json has .* bytes"):
        ck.load_weights(ImageTransformer(tiny_cfg().model), step_dir(tmp_path, 1))


def test_save_removes_steps_left_by_an_overwritten_run(tmp_path):
    save(tmp_path, 5, 0)
    save(tmp_path, 2, 1)  # a new run in the same folder (--overwrite) starts again at a lower step
    names = sorted(os.listdir(tmp_path / "checkpoints"))
    assert names == ["LATEST", "step_0000002"]


@pytest.mark.parametrize("config", [{"model": {"dim": "abc"}}, [1, 2], {"model": {"dim": 0}}, "x"])
def test_malformed_config_is_checkpoint_error_naming_the_file(tmp_path, config):
    save(tmp_path, 1, 0)
    d = step_dir(tmp_path, 1)
    os.remove(os.path.join(d, ck.MANIFEST))  # an old-style checkpoint: its config is not covered by a sha256
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(config, f)
    path = os.path.join(d, "config.json")
    with pytest.raises(CheckpointError, match=f"cannot read the config of checkpoint {path}: "):
        ck.load_model(str(tmp_path))
    with pytest.raises(CheckpointError, match="config.json: "):
        ck.read_config(d)


def test_set_aside_points_latest_at_the_newest_checkpoint_left(tmp_path):
    w1 = save(tmp_path, 1, 0)
    save(tmp_path, 2, 1)
    aside, latest = ck.set_aside(step_dir(tmp_path, 2))
    assert aside.endswith("step_0000002.diverged") and latest == step_dir(tmp_path, 1)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["LATEST", "step_0000001", "step_0000002.diverged"]
    assert same(ck.load_model(str(tmp_path)).state_dict(), w1)
    save(tmp_path, 2, 2)  # the run goes on past it; a later failure at the same step replaces the old one
    assert ck.set_aside(step_dir(tmp_path, 2))[1] == step_dir(tmp_path, 1)
    assert ck.set_aside(step_dir(tmp_path, 1))[1] is None
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_0000001.diverged", "step_0000002.diverged"]
    assert ck.find_checkpoint(str(tmp_path)) is None


@pytest.mark.parametrize("bad", [None, 3, b"runs/demo", ["runs/demo"]])
def test_load_model_of_a_non_path_is_checkpoint_error(bad):
    with pytest.raises(CheckpointError, match=r"checkpoint path must be a str or os.PathLike, got .* run directory"):
        ck.load_model(bad)


def test_load_model_accepts_run_checkpoints_latest_step_and_safetensors(tmp_path):
    import pathlib
    save(tmp_path, 1, 0)
    w2 = save(tmp_path, 2, 1)
    ckpts = tmp_path / "checkpoints"
    for path in (tmp_path, pathlib.Path(tmp_path), ckpts, str(ckpts) + os.sep, ckpts / "LATEST",
                 step_dir(tmp_path, 2), os.path.join(step_dir(tmp_path, 2), "model.safetensors")):
        assert ck.resolve(path) == step_dir(tmp_path, 2), path
        assert same(ck.load_model(path).state_dict(), w2), path


def test_load_model_of_a_wrong_path_names_that_path(tmp_path):
    save(tmp_path, 1, 0)
    other = tmp_path / "notes.txt"
    other.write_text("hello")
    with pytest.raises(CheckpointError) as e:
        ck.load_model(str(other))
    msg = str(e.value)
    assert msg.startswith(f"checkpoint {other} is a file, not a run or checkpoint folder; pass a run directory")
    assert "\n" not in msg and "model.safetensors" in msg
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match=f"no model.safetensors under {empty} and no checkpoints folder"):
        ck.load_model(str(empty))
    with pytest.raises(CheckpointError, match="checkpoint path is empty"):
        ck.load_model("")
    with pytest.raises(CheckpointError, match=f"checkpoint {tmp_path / 'missing'} does not exist; pass a run"):
        ck.load_model(tmp_path / "missing")


def test_a_save_removes_temporary_files_and_folders_left_by_a_kill(tmp_path):
    """kill -9 can stop a save in its weights folder (.tmp-XXXX/) or in LATEST's rename (a .tmp-XXXX
    file); the next save removes both kinds."""
    cfg, model = Config(), torch.nn.Linear(2, 2)
    ck.save_checkpoint(str(tmp_path), 1, model, cfg)
    ckpts = tmp_path / "checkpoints"
    (ckpts / ".tmp-latest").write_text("step_0000001")
    (ckpts / ".tmp-folder").mkdir()
    ck.save_checkpoint(str(tmp_path), 2, model, cfg)
    assert sorted(os.listdir(ckpts)) == ["LATEST", "step_0000001", "step_0000002"]
