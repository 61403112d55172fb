"""A checkpoint written by an older layout of the package (tests/fixtures/checkpoints: made with the
flat imggen/ of commit 27759b7 by tests/fixtures/make_checkpoints.py) still loads, gives the same
logits and samples the same tokens."""
import os
import sys

import numpy as np
import pytest

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
sys.path.insert(0, HERE)
from make_checkpoints import expected  # noqa: E402


@pytest.mark.parametrize("name", ["generate", "inpaint"])
def test_an_old_checkpoint_loads_and_samples_identically(name):
    ckpt = os.path.join(HERE, "checkpoints", name)
    want = np.load(os.path.join(HERE, "checkpoints", name + "_expected.npz"))
    got = expected(ckpt)
    assert sorted(got) == sorted(want.files)
    np.testing.assert_array_equal(got["tokens"], want["tokens"])
    np.testing.assert_allclose(got["logits"], want["logits"], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got["sample"], want["sample"])
