"""imggen.classic: the biharmonic fill against skimage's direct solver (holes inside the array, at its
edges and corners, channels), its spacing, its edge cases, and the per-slice fill."""
from __future__ import annotations

import numpy as np
import pytest

from imggen.classic import biharmonic, biharmonic_slices


def _inner_mask(rng, shape, p=0.15):
    m = rng.random(shape) < p
    m[(slice(3, 8),) * len(shape)] = True  # one big hole beside scattered small ones
    inner = np.zeros(shape, bool)
    inner[(slice(2, -2),) * len(shape)] = True
    return m & inner


def _edge_mask(rng, shape, p):
    """Scattered holes anywhere, a block in a random corner and a ragged band along a random side."""
    m = rng.random(shape) < p
    corner = tuple(slice(0, 3) if rng.random() < 0.5 else slice(-3, None) for _ in shape)
    m[corner] = True
    ax, side = rng.integers(len(shape)), slice(0, 2) if rng.random() < 0.5 else slice(-2, None)
    band = np.moveaxis(m, ax, 0)[side]
    band |= rng.random(band.shape) < 0.6
    np.moveaxis(m, ax, 0)[side] = band
    return m


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


@pytest.mark.parametrize("shape", [(20, 20), (17, 23), (6, 31), (12, 13, 14), (9, 16, 11), (5, 1, 12)])
@pytest.mark.parametrize("p", [0.05, 0.3])
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_skimage_at_edges_and_corners(shape, p, seed):
    """skimage's stencil near the array's edge is laplace(laplace(unit voxel)) in the neighbourhood
    clipped to the array (laplace's 'reflect' mode): equal on masks touching sides and corners."""
    from skimage.restoration import inpaint_biharmonic

    rng = np.random.default_rng([seed, int(p * 100), *shape])
    img, m = rng.random(shape), _edge_mask(rng, shape, p)
    ref = inpaint_biharmonic(img, m)
    assert np.abs(biharmonic(img, m) - ref).max() < 1e-6
    assert np.abs(biharmonic(img, m, spacing=np.ones(len(shape))) - ref).max() < 1e-6


@pytest.mark.parametrize("shape", [(15, 18, 3), (8, 9, 10, 2)])
def test_channels_match_skimage(shape):
    """Trailing channel axes: each channel filled (and clipped to its own known range) as skimage's
    channel_axis=-1 does."""
    from skimage.restoration import inpaint_biharmonic

    rng = np.random.default_rng(len(shape))
    img = rng.random(shape) * np.arange(1, shape[-1] + 1)  # channels of different ranges
    m = _edge_mask(rng, shape[:-1], 0.2)
    out = biharmonic(img, m)
    assert out.shape == img.shape
    assert np.abs(out - inpaint_biharmonic(img, m, channel_axis=-1)).max() < 1e-6
    assert np.array_equal(out[~m], img[~m])


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
    edge[0:3, 0:4] = True  # touches the corner: no slope across the array's sides
    out = biharmonic(img, edge)
    known = img[~edge]
    assert np.isfinite(out).all() and out[edge].min() >= known.min() and out[edge].max() <= known.max()
    # no slope across the sides (skimage's equations): the corner's fill levels off, not the ramp's
    from skimage.restoration import inpaint_biharmonic

    assert np.abs(out - inpaint_biharmonic(img, edge)).max() < 1e-6
    assert np.abs(out[edge] - img[edge]).max() < 10.0 and abs(out[0, 0] - img[0, 0]) > 5.0


def test_slices_are_filled_one_by_one():
    rng = np.random.default_rng(1)
    vol = rng.random((10, 11, 6))
    m = np.zeros(vol.shape, bool)
    m[3:7, 4:8, 1:5] = True
    out = biharmonic_slices(vol, m, axis=2)
    for k in range(6):
        assert np.allclose(out[:, :, k], biharmonic(vol[:, :, k], m[:, :, k]), atol=1e-9)
    assert np.array_equal(out[:, :, 0], vol[:, :, 0])
