"""local2d in 2-D query tiles (imggen.attention.tiles) on the cpu backend against the dense reference."""
import math

import pytest
import torch

import imggen
from imggen.attention import windows
from imggen.attention.blocked import BandWindows, cpu_attention, make_windows
from imggen.attention.tiles import TileWindows, choose_tile, fits


def local2d(h, w, c, r, s=1):
    return imggen.make_pattern("local2d", height=h, width=w, channels=c, radius=r, shift=s)


def run(q, k, v, p, backend, **kw):
    """Output and gradients of q, k, v under one random output gradient (float64 for the reference)."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    o = imggen.sparse_attention(*leaves, p, backend=backend, **kw)
    o.backward(run.do.to(o.dtype))
    return [o.detach(), *(t.grad for t in leaves)]


def check(p, n, b=2, h=3, d=8, tile="auto", dtype=torch.float32, rtol=1e-5, atol=1e-5):
    """Fresh random inputs; cpu (with `tile`) against the float64 reference, output and grads."""
    q, k, v = (torch.randn(b, h, n, d, dtype=torch.float64) for _ in range(3))
    run.do = torch.randn(b, h, n, d, dtype=torch.float64)
    ref = run(q, k, v, p, "reference")
    got = run(q.to(dtype), k.to(dtype), v.to(dtype), p, "cpu", tile=tile)
    for name, x, y in zip("o q k v".split(), got, ref):
        assert x.dtype == dtype
        torch.testing.assert_close(x.double(), y, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


GEOMETRY = [  # (height, width, channels, radius, shift, tile)
    (6, 16, 1, 1, 1, (2, 8)),
    (7, 13, 1, 2, 1, (2, 8)),     # width not a multiple of the tile
    (9, 20, 1, 3, 1, (4, 8)),     # H != W, tile rows of 4 over 9 rows
    (10, 11, 1, 5, 1, (2, 8)),    # radius wider than the tile
    (12, 12, 1, 3, 0, (3, 4)),    # shift 0
    (5, 6, 3, 1, 1, (3, 4)),      # RGB
    (6, 9, 3, 2, 1, (2, 8)),      # RGB, width not a multiple of the tile
    (7, 8, 3, 3, 1, (3, 4)),
    (8, 10, 3, 5, 0, (2, 4)),
    (3, 3, 1, 1, 1, (2, 3)),      # tiny: one tile wide, window wider than the image
    (2, 2, 3, 2, 1, (1, 2)),      # tiny RGB, one tile row per image row
    (4, 5, 1, 3, 1, (1, 5)),
]


@pytest.mark.parametrize("h, w, c, r, s, tile", GEOMETRY)
def test_tiles_match_reference_full_and_prefix_lengths(h, w, c, r, s, tile):
    p = local2d(h, w, c, r, s)
    full = h * w * c
    for n in sorted({full, full - 1, full - w * c + 1, full // 2 + 1, w * c, 2, 1}):
        if n >= 1:
            check(p, n, tile=tile)


@pytest.mark.parametrize("c", [1, 3])
@pytest.mark.parametrize("r", [1, 2, 3, 5])
def test_tile_shapes_and_radii(c, r):
    p = local2d(9, 14, c, r)
    for tile in [(2, 8), (3, 4), (4, 8), (8, 8), (1, 7), (5, 14)]:
        check(p, 9 * 14 * c, b=1, h=2, tile=tile)


def test_chunks_that_split_a_slice_and_save_modes(monkeypatch):
    """One tile row per chunk (masks and folds per chunk), recomputed and kept probabilities."""
    p = local2d(11, 19, 3, 2)
    monkeypatch.setattr(windows, "_MIN_CHUNK", 1)
    monkeypatch.setattr(windows, "_MAX_CHUNK", 1)
    for mb in ("0", "64"):
        monkeypatch.setenv("IMGGEN_SAVE_MB", mb)
        win = TileWindows(p, 11 * 19 * 3 - 5, (2, 8))
        assert len(win.chunks(4, 8)) == 4 * win.tiles_y
        check(p, 11 * 19 * 3 - 5, tile=(2, 8))


def test_float64_gradcheck():
    p = local2d(5, 7, 1, 2)
    q, k, v = (torch.randn(1, 2, 33, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    assert torch.autograd.gradcheck(lambda a, b, c: cpu_attention(a, b, c, p, tile=(2, 4)), (q, k, v))


@pytest.mark.parametrize("c", [1, 3])
def test_bfloat16_inputs_and_autocast(c):
    p = local2d(10, 13, c, 3)
    n = 10 * 13 * c - 4
    check(p, n, tile=(2, 8), dtype=torch.bfloat16, rtol=2e-2, atol=2e-2)
    q, k, v = (torch.randn(2, 2, n, 16, requires_grad=True) for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o = cpu_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), p, tile=(2, 8))
    assert o.dtype == torch.bfloat16
    o.float().sum().backward()
    ref = imggen.sparse_attention(q.detach(), k.detach(), v.detach(), p, backend="reference")
    torch.testing.assert_close(o.float(), ref, rtol=2e-2, atol=2e-2)
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_auto_dispatch_and_crossover():
    """Tiles where band windows would read at least MIN_GAIN times the keys; band windows for
    small images; patterns without a raster never tile."""
    assert isinstance(make_windows(local2d(64, 64, 1, 3), 4096, 4), TileWindows)
    assert isinstance(make_windows(local2d(64, 64, 3, 3), 100, 4), BandWindows)  # short prefix: short band
    assert isinstance(make_windows(local2d(8, 8, 1, 3), 64, 4), BandWindows)
    assert isinstance(make_windows(local2d(64, 64, 1, 3), 4096, 4, tile=None), BandWindows)
    assert choose_tile(imggen.make_pattern("band", window=9), 10**6) is None
    assert choose_tile(local2d(64, 64, 1, 0), 10**6) is None  # radius 0: no tiles
    assert choose_tile(local2d(64, 64, 1, 3), 10**6) == (2, 8)
    assert choose_tile(local2d(64, 64, 3, 3), 10**6) == (3, 4)
    assert choose_tile(local2d(64, 64, 1, 3), 40) is None
    assert not fits(local2d(8, 12, 1, 2), (1, 8))  # a tile row would overlap the next in the buffer
    check(local2d(40, 40, 1, 3), 1600 - 17, b=1, h=2, d=8)  # auto picks tiles here
    assert isinstance(make_windows(local2d(40, 40, 1, 3), 1600 - 17, 2), TileWindows)


def test_model_prefix_lengths_through_the_cpu_backend():
    """The model's attention path (sparse_attention, cpu) on a tiled geometry, every row boundary."""
    p = local2d(34, 34, 1, 2)
    assert isinstance(make_windows(p, 34 * 34, 2), TileWindows)
    for n in (34 * 34, 34 * 20 + 1, 34 * 5):
        check(p, n, b=1, h=2, d=4, tile="auto")


def test_tile_memory_is_order_n_d(monkeypatch):
    """Recompute mode keeps q, k, v buffers only: the saved tensors hold O(N * D) numbers."""
    monkeypatch.setenv("IMGGEN_SAVE_MB", "0")
    p = local2d(32, 48, 1, 3)
    n, d = 32 * 48, 8
    q, k, v = (torch.randn(1, 2, n, d, requires_grad=True) for _ in range(3))
    o = cpu_attention(q, k, v, p, tile=(2, 8))
    saved = sum(t.numel() for t in o.grad_fn.saved_tensors)
    assert saved <= 3 * 2 * math.ceil(1.3 * n) * d
