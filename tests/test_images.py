"""imggen.images: 16-bit images scaled (not clipped) to 8 bits by sample.py and the folder loader,
and atomic saves that leave no temp file behind."""
import numpy as np
import pytest
import torch
from PIL import Image

from imggen.checkpoint import save_checkpoint
from imggen.cli import sample_main
from imggen.config import Config, ModelConfig
from imggen.datasets import folder
from imggen.images import load_image, save_image, to_8bit
from imggen.model import ImageTransformer

torch.set_num_threads(1)
H, W = 6, 5
V16 = np.linspace(1685, 60930, H * W).round().astype(np.uint16).reshape(H, W)
EXPECT = np.array([[round(int(v) / 257) for v in row] for row in V16], dtype=np.uint8)


def _png16(tmp_path) -> str:
    path = str(tmp_path / "i16.png")
    Image.fromarray(V16).save(path)
    with Image.open(path) as im:
        assert im.mode.startswith("I")  # a real 16-bit PNG
    return path


def test_to_8bit_scales_16_bit_and_keeps_8_bit():
    assert np.array_equal(np.asarray(to_8bit(Image.fromarray(V16))), EXPECT)
    assert np.array_equal(np.asarray(to_8bit(Image.fromarray(V16.astype(np.int32)))), EXPECT)  # mode I
    small = np.arange(30, dtype=np.int32).reshape(H, W)  # mode I within 0..255: already 8-bit values
    assert np.array_equal(np.asarray(to_8bit(Image.fromarray(small))), small)
    gray = Image.fromarray(EXPECT)
    assert to_8bit(gray) is gray


@pytest.mark.parametrize("channels", [1, 3])
def test_load_image_16_bit_png(tmp_path, channels):
    a = load_image(_png16(tmp_path), channels)
    assert a.shape == (channels, H, W) and all(np.array_equal(c, EXPECT) for c in a)


def test_folder_loader_16_bit_png(tmp_path):
    _png16(tmp_path)
    x = folder.load(tmp_path, height=H, width=W, channels=1).train
    assert x.shape == (1, 1, H, W) and np.array_equal(x[0, 0], EXPECT)


def test_sample_inpaint_16_bit_keeps_known_pixels(tmp_path, capsys):
    cfg = ModelConfig(height=H, width=W, channels=1, bits=8, dim=16, layers=1, heads=2, attention="band",
                      window=7, backend="cpu")
    torch.manual_seed(0)
    run = str(tmp_path / "run")
    save_checkpoint(run, 1, ImageTransformer(cfg), Config(model=cfg))
    mask = np.zeros((H, W), dtype=np.uint8)
    mask[2:4, 1:3] = 255
    Image.fromarray(mask).save(tmp_path / "mask.png")
    out = tmp_path / "filled.png"
    rc = sample_main(["--checkpoint", run, "--inpaint", _png16(tmp_path), "--mask", str(tmp_path / "mask.png"),
                      "--out", str(out), "--scale", "1", "--device", "cpu", "--seed", "0"])
    assert rc == 0, capsys.readouterr().err
    with Image.open(out) as im:
        filled = np.asarray(im)
    known = mask == 0
    assert np.array_equal(filled[known], EXPECT[known])


def test_save_image_failure_leaves_no_temp_file(tmp_path):
    target = tmp_path / "dir"
    target.mkdir()
    with pytest.raises(OSError):
        save_image(np.zeros((2, 2, 1), np.uint8), str(target))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir"]
