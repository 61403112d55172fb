"""The built wheel holds every subpackage and file the checkout imports, and works outside the checkout.

The wheel is installed into a folder of its own and imported with `python -S` (no site-packages .pth
files): the checkout's editable install would otherwise supply any module the wheel lacks and hide
the loss (as it once hid a wheel without imggen/patterns)."""
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile

import pytest

from test_layout import ROOT, modules

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    # from a copy without build outputs: setuptools reuses an in-tree build/ folder, whose stale files
    # would stand in for the ones the package layout fails to name
    src = out / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", "build", "*.egg-info", "runs", "__pycache__",
                                                              ".pytest_cache", "dist"))
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                            "-w", str(out), str(src)], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-3000:]
    (whl,) = out.glob("imggen-*.whl")
    return whl


def test_wheel_holds_every_module_and_data_file(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for mod in modules():
        parts = mod.split(".")
        path = "/".join(parts) + ".py"
        assert path in names or "/".join(parts) + "/__init__.py" in names, f"{mod} missing from {wheel.name}"
    assert {"imggen/decode/native.c", "imggen/cpu_ops.c", "imggen/vmath.h"} <= set(names)
    shipped = os.listdir(os.path.join(ROOT, "datasets", "data"))
    assert shipped and all(f"imggen/datasets/data/{f}" in names for f in shipped)
    assert not any(n.startswith(("kernels/", "datasets/", "eval/", "tests/")) for n in names), \
        "the top-level folders must install inside the imggen namespace only"


def test_installed_wheel_imports_and_trains_outside_the_checkout(wheel, tmp_path):
    site = tmp_path / "site"
    inst = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site),
                           str(wheel)], capture_output=True, text=True)
    assert inst.returncode == 0, inst.stderr[-3000:]
    # -S: no .pth files (the editable install's finder lives in one); dependencies from the plain folder
    code = f"""
import importlib, sys
sys.path[:0] = [{str(site)!r}]
sys.path.append({sysconfig.get_paths()['purelib']!r})
import imggen
assert imggen.__file__.startswith({str(site)!r}), imggen.__file__
for m in {sorted(modules())!r}:
    importlib.import_module(m)
from imggen.cli import train_main
sys.exit(train_main(["--preset", "demo", "--steps", "2", "--out", "demo", "--train.eval_images", "8"]))
"""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    assert (tmp_path / "demo" / "checkpoints").is_dir()
