"""Files from outside, made to hurt: every reader gives one clear error, stays within a memory bound
and runs nothing from the file. Each case runs in its own process, whose peak memory (ru_maxrss)
is read when it exits; the CLIs must exit with 2 and one line on stderr."""
import gzip
import os
import pickle
import struct
import subprocess
import sys
import tempfile
import zlib

import numpy as np
import pytest
import torch

import imggen.checkpoint as ck
from imggen.config import Config, ModelConfig
from imggen.model import ImageTransformer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "IMGGEN_NATIVE": "0"}
GB = 1 << 30

# A library call in a fresh process: prints the error's class and message, exits 3 on success.
CALL = """
import sys
from imggen.errors import ImggenError
try:
    {call}
except ImggenError as e:
    print(type(e).__name__ + ": " + str(e))
    sys.exit(2)
sys.exit(3)
"""


# Runs a script or `-c` code as __main__ and, at exit, writes the process's peak resident memory
# (VmHWM: it belongs to the address space exec made, so unlike ru_maxrss it does not inherit the
# peak of the pytest process that forked it) to the file named by $HOSTILE_PEAK.
PEAK = """
import atexit, os, runpy, sys
def _peak():
    with open("/proc/self/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    with open(os.environ["HOSTILE_PEAK"], "w") as f:
        f.write(str(kb * 1024))
atexit.register(_peak)
sys.argv = sys.argv[1:]
if sys.argv[0] == "-c":
    code, sys.argv = sys.argv[1], ["-c"] + sys.argv[2:]
    exec(compile(code, "<hostile>", "exec"), {"__name__": "__main__"})
else:
    sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
    runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _child(argv, cwd=REPO):
    """(exit code, stdout, stderr, peak resident bytes) of `python ARGV...` in a fresh process."""
    fd, peak_file = tempfile.mkstemp(prefix="hostile-peak-")
    os.close(fd)
    p = subprocess.run([sys.executable, "-c", PEAK, *argv], cwd=cwd, capture_output=True, text=True,
                       env={**ENV, "HOSTILE_PEAK": peak_file}, timeout=300)
    with open(peak_file) as f:
        peak = int(f.read())
    os.remove(peak_file)
    return p.returncode, p.stdout, p.stderr, peak


def _library(call: str, tmp_path, error: str, says: str):
    rc, out, err, peak = _child(["-c", CALL.format(call=call)], cwd=tmp_path)
    assert "Traceback" not in err, err
    assert rc == 2, (rc, out, err)
    line = out.strip()
    assert "\n" not in line and line.startswith(error + ":"), line
    assert says in line, line
    assert peak < GB, f"peak memory {peak / 2**20:.0f} MiB"


def _cli(args, tmp_path, says: str, marker=None):
    rc, out, err, peak = _child(list(args), cwd=REPO)
    lines = [x for x in err.splitlines() if x.strip() and not x.startswith("warning:")]
    assert "Traceback" not in err, err
    assert rc == 2, (rc, out, err)
    assert len(lines) == 1 and says in lines[0], err
    assert peak < 1.5 * GB, f"peak memory {peak / 2**20:.0f} MiB"  # torch itself is ~0.5 GiB of it
    if marker is not None:
        assert not os.path.exists(marker), "the file's payload ran"


# ------------------------------------------------------------------------------------- files
def png_declaring(path, width, height):
    """A valid PNG signature and header declaring width x height 8-bit grey pixels, with a few
    kilobytes of zero rows: Pillow reads the header without decoding."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    rows = zlib.compress(b"\0" * (width + 1) * 4)
    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
                + chunk(b"IDAT", rows) + chunk(b"IEND", b""))
    return str(path)


def gzip_bomb(path, inflated: int):
    """A .smi.gz that inflates to `inflated` bytes of 'C' lines: one compressed 64 MiB member, repeated
    (a gzip file may hold several members; readers inflate them one after another)."""
    member = gzip.compress(b"C\n" * (32 << 20), compresslevel=9)
    with open(path, "wb") as f:
        for _ in range(inflated >> 26):
            f.write(member)
    return str(path)


class Payload:
    """Unpickling this calls os.system: what a hostile state.pt or CIFAR batch would carry."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def tiny_run(run) -> str:
    """A run folder with one real checkpoint (weights, config, optimizer and RNG state)."""
    cfg = Config(model=ModelConfig(height=4, width=4, channels=1, bits=4, dim=16, layers=1, heads=2,
                                   attention="band", backend="cpu"))
    model = ImageTransformer(cfg.model)
    opt = torch.optim.AdamW(model.parameters())
    state = {"optimizer": opt.state_dict(), "rng": torch.get_rng_state(), "step": 1}
    return ck.save_checkpoint(str(run), 1, model, cfg, state)


def rewrite(ckpt, name, data: bytes):
    """Replace a checkpoint file and its manifest entry, as whoever hands the folder over could."""
    with open(os.path.join(ckpt, name), "wb") as f:
        f.write(data)
    os.remove(os.path.join(ckpt, ck.MANIFEST))
    ck._write_manifest(ckpt)


def edit_config(ckpt, **model):
    import json
    with open(os.path.join(ckpt, "config.json")) as f:
        cfg = json.load(f)
    cfg["model"].update(model)
    rewrite(ckpt, "config.json", json.dumps(cfg).encode())


# ------------------------------------------------------------------------------ library readers
def test_png_declaring_100k_square_is_refused_before_decoding(tmp_path):
    png = png_declaring(tmp_path / "bomb.png", 100_000, 100_000)
    _library(f"from imggen.images import load_image; load_image({png!r}, 1)", tmp_path, "DataError",
             "declares more pixels than imggen reads")


def test_png_just_over_the_pixel_limit_and_garbage_png(tmp_path):
    png = png_declaring(tmp_path / "big.png", 7000, 7000)
    _library(f"from imggen.images import load_image; load_image({png!r}, 3)", tmp_path, "DataError", "declares")
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n" + os.urandom(200))
    _library(f"from imggen.images import load_image; load_image({str(bad)!r}, 1)", tmp_path, "DataError",
             "cannot read image")


def test_folder_of_images_with_a_bomb(tmp_path):
    (tmp_path / "imgs").mkdir()
    png_declaring(tmp_path / "imgs" / "a.png", 50_000, 50_000)
    _library(f"from imggen.datasets.folder import load; load({str(tmp_path / 'imgs')!r}, height=8, width=8, "
             f"channels=1)", tmp_path, "DataError", "declares more pixels")


def test_smiles_line_of_a_million_characters(tmp_path):
    smi = tmp_path / "long.smi"
    smi.write_text("CCO\n" + "C" * 1_000_000 + "\nCCN\n")
    _library(f"from imggen.datasets.molecules import read_smiles; read_smiles({str(smi)!r})", tmp_path,
             "DataError", "molecule 2 is a SMILES of 1,000,000 characters")
    csv = tmp_path / "long.csv"
    csv.write_text("smiles\nCCO\n" + "C" * 1_000_000 + "\n")
    _library(f"from imggen.datasets.molecules import read_smiles; read_smiles({str(csv)!r})", tmp_path,
             "DataError", "long.csv")


def test_gzipped_smiles_that_inflate_to_gigabytes(tmp_path):
    bomb = gzip_bomb(tmp_path / "bomb.smi.gz", GB)
    assert os.path.getsize(bomb) < 2 << 20
    _library(f"from imggen.datasets.molecules import read_smiles; read_smiles({bomb!r})", tmp_path,
             "DataError", "inflates to more than")


def cifar_with_payload(tmp_path):
    """(A CIFAR-10 folder whose batches would run code when unpickled, the file the code would create)."""
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    marker = tmp_path / "ran"
    for name in ["data_batch_1", "test_batch"]:
        (folder / name).write_bytes(pickle.dumps({b"data": Payload(marker), b"labels": [0]}))
    return folder, marker


def test_cifar_pickle_that_would_run_code(tmp_path):
    folder, marker = cifar_with_payload(tmp_path)
    _library(f"from imggen.datasets.cifar import load; load({str(folder)!r})", tmp_path, "DataError",
             "not a readable CIFAR-10 pickle")
    assert not marker.exists()


def nifti_declaring(path, shape, data=None):
    import nibabel as nib
    img = nib.Nifti1Image(np.zeros((2, 2, 2), np.int16) if data is None else data, np.eye(4))
    img.header.set_data_shape(shape)
    raw = img.header.binaryblock + b"\0" * 4 + b"\1" * 4096  # header, extension flag, a little data
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wb") as f:
        f.write(raw)
    return str(path)


@pytest.mark.parametrize("shape", [(30000, 30000, 100), (1000, 1000, 100)])
def test_nifti_header_declaring_a_huge_volume(tmp_path, shape):
    nii = nifti_declaring(tmp_path / "t1.nii.gz", shape)
    _library(f"from pathlib import Path; from imggen.datasets.brats import read_volume; read_volume(Path({nii!r}))",
             tmp_path, "DataError", "header declares")


def test_brats_case_with_volumes_of_different_shapes(tmp_path):
    import nibabel as nib
    case = tmp_path / "cases" / "BraTS-GLI-00001-000"
    case.mkdir(parents=True)
    rng = np.random.default_rng(0)
    nib.save(nib.Nifti1Image(rng.uniform(1, 100, (12, 12, 8)).astype(np.float32), np.eye(4)),
             str(case / "BraTS-GLI-00001-000-t1n.nii.gz"))
    nib.save(nib.Nifti1Image(np.ones((10, 12, 8), np.uint8), np.eye(4)),
             str(case / "BraTS-GLI-00001-000-mask-healthy.nii.gz"))
    _library(f"from imggen.datasets.brats import load; load({str(tmp_path / 'cases')!r}, height=8, width=8, "
             f"inpainting=True)", tmp_path, "DataError", "different shapes")


# --------------------------------------------------------------------------------- checkpoints
def test_state_pt_that_would_run_code_is_refused(tmp_path):
    run = tmp_path / "run"
    ckpt = tiny_run(run)
    marker = tmp_path / "ran"
    state = {"optimizer": Payload(marker), "rng": torch.get_rng_state(), "step": 1}
    import io
    buf = io.BytesIO()
    torch.save(state, buf)
    rewrite(ckpt, "state.pt", buf.getvalue())
    assert ck.verify(ckpt) is None  # the manifest matches: only the loader stands in the way
    with pytest.raises(ck.CheckpointError, match="holds more than training state"):
        ck.load_state(ckpt)
    assert not marker.exists()


def test_state_pt_of_another_layout_is_refused(tmp_path):
    ckpt = tiny_run(tmp_path / "run")
    import io
    buf = io.BytesIO()
    torch.save({"optimizer": {}, "rng": "abc", "step": 1}, buf)
    rewrite(ckpt, "state.pt", buf.getvalue())
    with pytest.raises(ck.CheckpointError, match="not imggen training state"):
        ck.load_state(ckpt)


def test_current_state_loads_and_restores_the_optimizer(tmp_path):
    ckpt = tiny_run(tmp_path / "run")
    state = ck.load_state(ckpt)
    assert state["step"] == 1 and state["rng"].dtype == torch.uint8
    model = ImageTransformer(ck.read_config(ckpt).model)
    torch.optim.AdamW(model.parameters()).load_state_dict(state["optimizer"])


@pytest.mark.parametrize("model, says", [
    (dict(height=10 ** 9), "model.height must be at most 8192"),
    (dict(height=4096, width=4096, dim=8192, heads=8, layers=8), "do not belong together"),
    (dict(dim=32), "do not belong together"),
    (dict(colour=True), "has no field 'colour'"),
])
def test_config_json_of_absurd_or_foreign_size(tmp_path, model, says):
    ckpt = tiny_run(tmp_path / "run")
    edit_config(ckpt, **model)
    _library(f"import imggen; imggen.load_model({ckpt!r})", tmp_path, "CheckpointError", says)


# ------------------------------------------------------------------------------------------ CLIs
@pytest.mark.slow
def test_cli_resume_with_a_state_pt_that_would_run_code(tmp_path):
    run = tmp_path / "run"
    rc = subprocess.run([sys.executable, "train.py", "--preset", "brats", "--data", "brats-demo", "--model.height", "8", "--model.width", "8",
                         "--model.dim", "16", "--model.layers", "1", "--model.heads", "2", "--attention", "band",
                         "--batch-size", "2", "--limit", "8", "--steps", "2", "--train.eval_images", "2",
                         "--train.grid_time_frac", "0", "--out", str(run), "--no-progress"],
                        cwd=REPO, env=ENV, capture_output=True, text=True)
    assert rc.returncode == 0, rc.stderr
    ckpt = ck.find_checkpoint(str(run))
    marker = tmp_path / "ran"
    import io
    good = torch.load(os.path.join(ckpt, "state.pt"), weights_only=True)
    buf = io.BytesIO()
    torch.save({**good, "optimizer": Payload(marker)}, buf)
    rewrite(ckpt, "state.pt", buf.getvalue())
    _cli(["train.py", "--out", str(run), "--resume", "--steps", "4", "--no-progress"], tmp_path,
         "holds more than training state", marker)


@pytest.mark.slow
def test_cli_inpaint_with_a_bomb_image_or_mask(tmp_path):
    ckpt = tiny_run(tmp_path / "run")
    bomb = png_declaring(tmp_path / "bomb.png", 100_000, 100_000)
    ok = tmp_path / "ok.png"
    from PIL import Image
    Image.fromarray(np.zeros((4, 4), np.uint8)).save(ok)
    _cli(["sample.py", "--checkpoint", ckpt, "--inpaint", bomb, "--mask", str(ok), "--out",
          str(tmp_path / "o.png")], tmp_path, "declares more pixels")
    _cli(["sample.py", "--checkpoint", ckpt, "--inpaint", str(ok), "--mask", bomb, "--out",
          str(tmp_path / "o.png")], tmp_path, "declares more pixels")


@pytest.mark.slow
def test_cli_sample_from_a_checkpoint_with_an_absurd_config(tmp_path):
    ckpt = tiny_run(tmp_path / "run")
    edit_config(ckpt, height=10 ** 9)
    _cli(["sample.py", "--checkpoint", ckpt, "--out", str(tmp_path / "o.png")], tmp_path,
         "model.height must be at most 8192")


@pytest.mark.slow
def test_cli_train_on_hostile_smiles_and_images(tmp_path):
    smi = tmp_path / "long.smi"
    smi.write_text("CCO\n" + "C" * 1_000_000 + "\n")
    _cli(["train.py", "--preset", "demo", "--data", f"molecules:{smi}", "--steps", "1", "--out",
          str(tmp_path / "r1")], tmp_path, "1,000,000 characters")
    (tmp_path / "imgs").mkdir()
    png_declaring(tmp_path / "imgs" / "a.png", 100_000, 100_000)
    _cli(["train.py", "--preset", "demo", "--data", f"folder:{tmp_path / 'imgs'}", "--steps", "1", "--out",
          str(tmp_path / "r2")], tmp_path, "declares more pixels")


@pytest.mark.slow
def test_cli_train_on_a_hostile_cifar_pickle_or_nifti_header(tmp_path):
    folder, marker = cifar_with_payload(tmp_path)
    _cli(["train.py", "--preset", "cifar", "--data", f"cifar:{folder}", "--steps", "1", "--out",
          str(tmp_path / "r1")], tmp_path, "not a readable CIFAR-10 pickle", marker)
    case = tmp_path / "cases" / "BraTS-GLI-00001-000"
    case.mkdir(parents=True)
    nifti_declaring(case / "BraTS-GLI-00001-000-t1n.nii.gz", (1000, 1000, 100))
    _cli(["train.py", "--preset", "brats", "--data", f"brats:{tmp_path / 'cases'}", "--steps", "1", "--out",
          str(tmp_path / "r2")], tmp_path, "header declares")
