"""train.py end to end on CPU with every data adapter (small model overrides keep it quick)."""
import os
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

import imggen
from test_cifar_folder import write_cifar

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--model.dim", "32", "--model.layers", "2", "--model.heads", "1", "--batch-size", "4",
         "--train.eval_images", "4", "--train.sample_num", "2", "--steps", "20", "--no-progress"]


def write_folder(root):
    rng = np.random.default_rng(0)
    os.makedirs(root / "sub", exist_ok=True)
    for i in range(12):
        arr = rng.integers(0, 256, (20, 24, 3), dtype=np.uint8)
        Image.fromarray(arr).save(root / ("sub" if i % 2 else ".") / f"img{i}.png")
    return str(root)


def run_train(args, out):
    r = subprocess.run([sys.executable, "train.py", *args, *SMALL, "--out", str(out)], cwd=REPO,
                       capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "test bits/dim" in r.stdout
    return imggen.load_model(str(out))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["brats-demo", "molecules", "cifar", "folder"])
def test_train_each_adapter_end_to_end(kind, tmp_path):
    if kind == "brats-demo":
        args = ["--preset", "brats", "--data", "brats-demo", "--model.height", "16", "--model.width", "16"]
    elif kind == "molecules":
        smi = tmp_path / "mols.smi"
        smi.write_text("SMILES\n" + "\n".join(["CCO", "c1ccccc1", "CC(=O)O", "CCN", "not_a_smiles",
                                               "C1CCCCC1", "CCCl", "OCCO", "CC#N", "CCOC"] * 2) + "\n")
        args = ["--preset", "demo", "--data", f"molecules:{smi}"]
    elif kind == "cifar":
        d, _ = write_cifar(tmp_path, np.random.default_rng(0))
        args = ["--preset", "cifar", "--data", f"cifar:{d}", "--model.height", "8", "--model.width", "8"]
    else:
        args = ["--preset", "cifar", "--data", f"folder:{write_folder(tmp_path / 'imgs')}",
                "--model.height", "8", "--model.width", "8"]
    model = run_train(args, tmp_path / "run")
    assert (tmp_path / "run" / "samples.png").exists()
    assert model.config.channels == (3 if kind in ("cifar", "folder") else 1)


def test_missing_data_is_one_clear_line(tmp_path):
    r = subprocess.run([sys.executable, "train.py", "--preset", "cifar", "--data", f"cifar:{tmp_path}/nope",
                        *SMALL, "--out", str(tmp_path / "run")], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.startswith("train.py: error:") and "nope" in r.stderr
