"""Data errors name the command-line flag that applies (--skip-bad), the hint is dropped once
skipping is on, and the command lines print the skipped-items summary as one plain line."""
import warnings

import numpy as np
import pytest
from PIL import Image

from imggen.cli import plain_data_warnings
from imggen.datasets import DataWarning, folder, parse_spec
from imggen.errors import DataError


def _folder_with_a_bad_image(tmp_path):
    for i in range(4):
        Image.fromarray(np.full((4, 4), 40 * i, np.uint8)).save(tmp_path / f"{i}.png")
    (tmp_path / "bad.png").write_bytes(b"junk")
    return tmp_path


def test_bad_item_error_names_the_flag(tmp_path):
    with pytest.raises(DataError, match=r"bad\.png.*--skip-bad; skip_bad=True in Python"):
        folder.load(_folder_with_a_bad_image(tmp_path), height=4, width=4, channels=1)


def test_skipped_summary_is_one_plain_line_without_the_hint(tmp_path, capfd):
    root = _folder_with_a_bad_image(tmp_path)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        folder.load(root, height=4, width=4, channels=1, skip_bad=True)
    assert len(w) == 1 and issubclass(w[0].category, DataWarning)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        with plain_data_warnings():
            s = folder.load(root, height=4, width=4, channels=1, skip_bad=True)
    assert s.info["skipped"] == 1
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("folder: skipped 1 unreadable image(s); first: "), err
    assert "bad.png" in err[0] and "skip_bad" not in err[0] and "--skip-bad" not in err[0] and ".py:" not in err[0]


def test_molecules_path_that_is_a_directory(tmp_path):
    with pytest.raises(DataError, match="is a directory; expected a .csv, .smi or .sdf file"):
        parse_spec(f"molecules:{tmp_path}")


def test_brats_demo_takes_no_path():
    assert parse_spec("brats-demo") == ("brats-demo", None)
    with pytest.raises(DataError, match="brats-demo takes no path.*--data brats:PATH"):
        parse_spec("brats-demo:/x")
