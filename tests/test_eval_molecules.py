"""`python -m imggen.eval molecules`: OSRA read-back of drawings scored with MOSES's metrics."""
import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from imggen.eval.__main__ import main

pytestmark = pytest.mark.skipif(shutil.which("osra") is None, reason="needs the osra binary")


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    """Drawings and MOSES reference statistics go to a cache of the test's own."""
    monkeypatch.setenv("IMGGEN_CACHE_DIR", str(tmp_path / "cache"))


def _moses_or_skip():
    from imggen.datasets.moses import find_moses_data
    from imggen.errors import DataError
    try:
        return find_moses_data()
    except DataError:
        pytest.skip("MOSES data files not installed (pip install --no-deps molsets==0.3.1)")


def _main(capsys, *argv):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_ground_truth_pngs_read_like_the_ceiling(tmp_path, capsys):
    """True drawings written as PNGs and read from disk score as the ceiling computed from SMILES."""
    _moses_or_skip()
    from imggen.datasets.molecules import render_smiles
    from imggen.eval.molecules import ceiling_smiles
    size, n = 256, 10
    smiles = ceiling_smiles(n, size, size)
    images, kept = render_smiles(smiles, size, size, workers=1, progress=False, use_cache=False, report=False)
    assert len(kept) == n
    folder = tmp_path / "drawings"
    folder.mkdir()
    for i, im in enumerate(images):
        Image.fromarray(im[0]).save(folder / f"mol{i:02d}.png")
    rc, out, err = _main(capsys, "molecules", "--images", folder, "--ceiling", n, "--ref-num", 200,
                         "--json", tmp_path / "r.json", "--out", tmp_path / "out")
    assert rc == 0, err
    res = json.loads((tmp_path / "r.json").read_text())
    for key in ("n", "validity", "unique", "novelty", "atom_bond_accuracy", "int_div", "snn", "frag", "scaf"):
        assert key in res
    assert res["n"] == n and res["ceiling"]["n"] == n
    assert abs(res["validity"] - res["ceiling"]["validity"]) <= 0.02
    assert res["validity"] >= 0.8  # 256 px: OSRA reads most true drawings (ceiling 0.81 exact match)
    assert res["novelty"] == 1.0  # MOSES test molecules are not in MOSES train
    assert res["ceiling"]["exact_match"] >= 0.7
    assert 0 < res["int_div"] < 1 and 0 < res["snn"] <= 1
    assert "| validity |" in out and "CharRNN" in out
    with Image.open(tmp_path / "out" / "readback.png") as pic:
        assert pic.width == 4 * 2 * 128 + 3 * 8
    unreadable = [line for line in err.splitlines() if line.startswith("unreadable drawing")]
    assert len(unreadable) == res["unreadable"] == round((1 - res["validity"]) * n)


def test_noise_images_validity_zero_one_line_each(tmp_path, capsys):
    _moses_or_skip()
    folder = tmp_path / "noise"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i in range(3):
        Image.fromarray(rng.integers(0, 256, (64, 64), dtype=np.uint8)).save(folder / f"n{i}.png")
    Image.fromarray(np.full((48, 48), 255, np.uint8)).save(folder / "blank.png")  # another size, blank
    rc, out, err = _main(capsys, "molecules", "--images", folder, "--ref-num", 50, "--json", tmp_path / "n.json")
    assert rc == 0, err
    res = json.loads((tmp_path / "n.json").read_text())
    assert res["n"] == 4 and res["validity"] == 0.0 and res["novelty"] is None
    lo, hi = res["intervals"]["validity"]  # Wilson: 0 of 4 is not "exactly 0" (upper bound 0.49)
    assert lo == 0.0 and hi == pytest.approx(1.96 ** 2 / (4 + 1.96 ** 2))
    assert [r["valid"] for r in res["per_image"]] == [False] * 4
    lines = [line for line in err.splitlines() if line.startswith("unreadable drawing")]
    assert len(lines) == 4 and sorted(line.split()[2] for line in lines) == ["blank.png:", "n0.png:", "n1.png:",
                                                                                "n2.png:"]
    log = (tmp_path / "noise-readback" / "readback.log").read_text().splitlines()
    assert log == lines
    assert (tmp_path / "noise-readback" / "readback.png").is_file()


def test_bad_input_one_line_exit_2(tmp_path, capsys):
    rc, out, err = _main(capsys, "molecules", "--images", tmp_path / "nope")
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "not a folder" in err
    rc, out, err = _main(capsys, "molecules")
    assert rc == 2 and "--checkpoint RUN" in err
    (tmp_path / "empty").mkdir()
    rc, out, err = _main(capsys, "molecules", "--images", tmp_path / "empty")
    assert rc == 2 and "no .png files" in err


def test_checkpoint_samples_are_read_back(tmp_path, capsys):
    """--checkpoint: drawings sampled from a (tiny, barely trained) molecule model are scored."""
    _moses_or_skip()
    from imggen.config import Config, DataConfig, ModelConfig, TrainConfig
    from imggen.datasets import load_dataset
    from imggen.tokens import tokenize
    from imggen.training import train
    torch.set_num_threads(1)
    s = 16
    data = load_dataset("molecules", height=s, width=s, channels=1, cache_dir=tmp_path, progress=False)
    cfg = Config(preset="test", model=ModelConfig(height=s, width=s, channels=1, dim=16, layers=1, heads=1,
                                                  attention="full"),
                 train=TrainConfig(steps=2, batch_size=2, warmup=1, eval_images=2, sample_num=1, grid_time_frac=0),
                 data=DataConfig(spec="molecules"))
    splits = {k: tokenize(data.split(k)[:4], 8).to(torch.uint8) for k in ("train", "val", "test")}
    train(cfg, str(tmp_path / "run"), data=splits, progress=False)
    rc, out, err = _main(capsys, "molecules", "--checkpoint", tmp_path / "run", "--num", 2, "--ref-num", 20,
                         "--json", tmp_path / "c.json", "--device", "cpu")
    assert rc == 0, err
    res = json.loads((tmp_path / "c.json").read_text())
    assert res["n"] == 2 and [p["name"] for p in res["per_image"]] == ["sample00000", "sample00001"]
    assert (tmp_path / "run" / "molecules" / "readback.png").is_file()


@pytest.mark.parametrize("smiles", ["CCO", "C1=CC=CC=C1N(", "",  # drawn, unparsable (a cross), none (a cross)
                                    # what OSRA read from a 256 px scribble of moses256 at 615 steps:
                                    # RDKit's drawer rejects the charged dummy atom (it stopped the read-back)
                                    "C[*+]123(*C)C[N+]43(=C)[C@@]32C1C43.IC[NH2+]CC*(=C)(*)*"])
def test_every_read_back_gets_a_panel(smiles):
    from imggen.eval.molecules import _redraw

    panel = _redraw(smiles, 64)
    assert panel.shape == (64, 64) and panel.dtype == np.uint8
    cross = panel[np.arange(64), np.arange(64)]
    assert (cross == 120).all() == (smiles != "CCO")
