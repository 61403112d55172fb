"""imggen.classic: the biharmonic fill (conjugate gradients) against skimage's direct solver, its
spacing, its edge cases, and the per-slice fill."""
from __future__ import annotations

import numpy as np
import pytest

from imggen.classic import biharmonic, biharmonic_slices


def _inner_mask(rng, shape, p=0.15):
    m = rng.random(shape) < p
    m[(slice(3, 8),) * len(shape)] = True  # one big hole beside scattered small ones
    inner = np.zeros(shape, bool)
    inner[(slice(2, -2),) * len(shape)] = True  # skimage truncates its stencil at the array's edge
    return m & inner


@pytest.mark.parametrize("shape", [(20, 20), (17, 23), (12, 13, 14), (9, 16, 11)])
@pytest.mark.parametrize("smooth", [False, True])
def test_matches_skimage(shape, smooth):
    from skimage.restoration import inpaint_biharmonic

    rng = np.random.default_rng(sum(shape) + smooth)
    if smooth:
        g = np.meshgrid(*[np.linspace(0, 1, s) for s in shape], indexing="ij")
        img = np.sin(3 * g[0]) * np.cos(2 * g[-1]) + g[1] ** 2
    else:
        img = rng.random(shape)
    m = _inner_mask(rng, shape)
    ours, ref = biharmonic(img, m), inpaint_biharmonic(img, m)
    assert np.abs(ours - ref).max() < 1e-6
    assert np.array_equal(ours[~m], img[~m])


def test_spacing_gives_the_fill_of_physical_space():
    """A smooth field sampled at 1 x 2 (units per pixel): its fill with spacing (1, 2) is closer to the
    fill on the isotropic grid of twice the density (sampled back) than the spacing-blind fill."""
    f = lambda y, x: np.sin(y / 5.0) * np.cos(x / 7.0) + 0.02 * x * y  # noqa: E731
    yy, xx = np.mgrid[0:40, 0:80]
    fine = f(yy, xx).astype(np.float64)
    hole = (yy - 20) ** 2 / 100 + (xx - 40) ** 2 / 400 <= 1
    fine_fill = biharmonic(fine, hole)[:, ::2]
    coarse, ch = fine[:, ::2], hole[:, ::2]
    aware, blind = biharmonic(coarse, ch, spacing=(1.0, 2.0)), biharmonic(coarse, ch)
    err_aware = np.abs(aware - fine_fill)[ch].mean()
    err_blind = np.abs(blind - fine_fill)[ch].mean()
    assert err_aware < 0.5 * err_blind


def test_polynomials_are_filled_exactly_and_the_range_is_kept():
    yy, xx, zz = np.mgrid[0:14, 0:15, 0:16].astype(np.float64)
    ramp = 3 + 2 * xx - yy + 0.5 * zz + 0.1 * xx * yy
    m = np.zeros(ramp.shape, bool)
    m[4:10, 3:11, 5:12] = True
    assert np.abs(biharmonic(ramp, m) - ramp).max() < 1e-6
    spiky = np.zeros((20, 20))
    spiky[9, 9] = 1.0
    hole = np.zeros((20, 20), bool)
    hole[5:15, 10:15] = True
    out = biharmonic(spiky, hole)
    assert out.min() >= 0.0 and out.max() <= 1.0  # clipped to the known range, as skimage does


def test_empty_full_and_edge_holes():
    img = np.arange(64, dtype=np.float64).reshape(8, 8)
    assert np.array_equal(biharmonic(img, np.zeros((8, 8), bool)), img)
    with pytest.raises(ValueError, match="every voxel"):
        biharmonic(img, np.ones((8, 8), bool))
    with pytest.raises(ValueError, match="shape"):
        biharmonic(img, np.zeros((8, 7), bool))
    edge = np.zeros((8, 8), bool)
    edge[0:3, 0:4] = True  # touches the corner: the edge voxels repeat
    out = biharmonic(img, edge)
    known = img[~edge]
    assert np.isfinite(out).all() and out[edge].min() >= known.min() and out[edge].max() <= known.max()
    assert np.abs(out[edge] - img[edge]).max() < 5.0  # a ramp: close to itself


def test_slices_are_filled_one_by_one():
    rng = np.random.default_rng(1)
    vol = rng.random((10, 11, 6))
    m = np.zeros(vol.shape, bool)
    m[3:7, 4:8, 1:5] = True
    out = biharmonic_slices(vol, m, axis=2)
    for k in range(6):
        assert np.allclose(out[:, :, k], biharmonic(vol[:, :, k], m[:, :, k]), atol=1e-9)
    assert np.array_equal(out[:, :, 0], vol[:, :, 0])
