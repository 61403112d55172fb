"""The brats64 preset, and a BraTS slice at its native 240 x 240 (57,600 tokens, local2d,band): a tiny
context model trained 2 steps by train.py fills a hole of a 240 x 240 volume through sample.py --brats,
with no resize on the way (model size = slice size)."""
from __future__ import annotations

import nibabel as nib
import numpy as np
import pytest
import torch

from imggen.checkpoint import load_model
from imggen.cli import sample_main, train_main
from imggen.config import preset
from imggen.volume_fill import slice_inputs


def test_brats64_preset_is_a_64px_inpainting_model():
    cfg = preset("brats64").validate()
    m = cfg.model
    assert (m.height, m.width, m.channels) == (64, 64, 1) and m.context == "unet" and cfg.train.task == "inpaint"
    assert "local2d" in m.attention and cfg.data.spec == "brats-demo"
    assert m.context_fill == "biharmonic3d" and cfg.train.augment  # the measured recipe (bench/RESULTS.md 14)


@pytest.mark.timeout(300)
def test_native_240_train_two_steps_and_fill_one_slice(tmp_path, capsys):
    torch.set_num_threads(1)
    run = tmp_path / "run"
    rc = train_main(["--preset", "brats64", "--model.height", "240", "--model.width", "240", "--model.dim", "16",
                     "--model.layers", "2", "--model.heads", "2", "--model.context_width", "8", "--radius", "1",
                     "--model.context_fill", "biharmonic",  # brats-demo's 3-D fills at 240 px would take minutes
                     "--window", "241", "--steps", "2", "--batch-size", "1", "--limit", "1",
                     "--train.grid_time_frac", "0", "--out", str(run), "--no-progress", "--device", "cpu",
                     "--backend", "cpu", "--threads", "1"])
    assert rc == 0, capsys.readouterr().err
    model = load_model(str(run))
    assert model.config.seq_len == 57_600 and model.config.attention == "local2d,band"

    rng = np.random.default_rng(0)
    vol = np.zeros((240, 240, 3), np.float32)
    vol[20:220, 30:210, :] = rng.uniform(200, 600, size=(200, 180, 3))
    hole = np.zeros(vol.shape, bool)
    hole[100:108, 120:126, 1] = True  # 48 voxels in the middle slice only
    d = tmp_path / "cases" / "BraTS-GLI-00042-000"
    d.mkdir(parents=True)
    nib.save(nib.Nifti1Image(np.where(hole, 0, vol), np.eye(4)), str(d / f"{d.name}-t1n-voided.nii.gz"))
    nib.save(nib.Nifti1Image(hole.astype(np.uint8), np.eye(4)), str(d / f"{d.name}-mask.nii.gz"))
    # at native size the model's hole is the volume's hole, pixel for pixel (radiological orientation)
    _, unknown = slice_inputs(model, vol[:, :, 1], hole[:, :, 1])
    assert unknown.sum() == 48
    out = tmp_path / "pred"
    rc = sample_main(["--checkpoint", str(run), "--brats", str(tmp_path / "cases"), "--out", str(out),
                      "--no-progress", "--device", "cpu", "--threads", "1"])
    assert rc == 0, capsys.readouterr().err
    pred = nib.load(str(out / f"{d.name}-t1n-inference.nii.gz")).get_fdata()
    assert np.array_equal(pred[~hole], np.where(hole, 0, vol)[~hole])
    assert (pred[hole] != 0).any() and (pred[hole] <= vol.max() + 1).all()
