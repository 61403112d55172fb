"""Pattern definitions and the cpu backend against the dense reference."""
import math
import os
import subprocess
import sys

import pytest
import torch

import imggen
from imggen.errors import ConfigError, ShapeError

CASES = [
    ("full", {}),
    ("band", dict(window=7)),
    ("band", dict(window=1)),
    ("local2d", dict(height=6, width=7, channels=1, radius=2)),
    ("local2d", dict(height=5, width=6, channels=3, radius=1, shift=1)),
    ("bigbird", dict(block=8, window_blocks=2, global_blocks=1, random_blocks=2, seed=3)),
    ("diffuser", dict(window=6, global_tokens=3, random_edges=3, block=8, steps=3, alpha=0.2, seed=1)),
    ("strided", dict(stride=7, shift=1)),
    ("strided", dict(stride=5, shift=0)),
]


def rows(mask):
    return {i: mask[i].nonzero().flatten().tolist() for i in range(mask.shape[0])}


def test_local2d_5x5_radius1_exact_neighbours():
    m = imggen.make_pattern("local2d", height=5, width=5, channels=1, radius=1).mask(25)
    r = rows(m)
    assert r[12] == [6, 7, 8, 11, 12]          # (2,2): three above, one left, itself
    assert r[10] == [5, 6, 10]                 # (2,0): no wrap to (1,4)
    assert r[14] == [8, 9, 13, 14]             # (2,4): no (1,5) -> no wrap to (2,0)
    assert r[5] == [0, 1, 5]                   # (1,0)
    assert r[4] == [3, 4]                      # (0,4) first row: left part only
    assert r[0] == [0]


def test_local2d_rgb_channel_aware_and_shift():
    p = imggen.make_pattern("local2d", height=3, width=3, channels=3, radius=1)
    r = rows(p.mask(27))
    # pixel (1,1) channel 1 = token 13: pixels (0,0..2) all channels, (1,0) all, (1,1) c<=1
    assert r[13] == list(range(0, 9)) + [9, 10, 11, 12, 13]
    # shift=1: the query reads positions holding tokens of its neighbourhood (position p holds token p-1)
    ps = imggen.make_pattern("local2d", height=3, width=3, channels=1, radius=1, shift=1)
    rs = rows(ps.mask(9))
    assert rs[5] == [2, 3, 5]                  # pixel (1,2): tokens 1, 2 (above-left, above), 4 (left) + itself
    assert rs[3] == [1, 2, 3]                  # pixel (1,0): tokens 0, 1 above + diagonal


def test_band_definition():
    m = imggen.make_pattern("band", window=3).mask(6)
    assert rows(m)[5] == [3, 4, 5] and rows(m)[1] == [0, 1]


@pytest.mark.parametrize("kind,kw", CASES)
def test_mask_causal_diagonal_and_layout_covers(kind, kw):
    p = imggen.make_pattern(kind, **kw)
    n = min(77, p.max_length() or 77)
    for h in range(3):
        m = p.mask(n, h)
        assert m.dtype == torch.bool and m.shape == (n, n)
        assert torch.equal(m, m.tril()) and bool(m.diagonal().all())
        assert torch.equal(p.mask(30, h), m[:30, :30])  # prefix-consistent
        for block in (4, 16):
            lay = p.block_layout(n, block, h)
            cover = torch.zeros(n, n, dtype=torch.bool)
            for qb in range(lay.shape[0]):
                for kb in lay[qb][lay[qb] >= 0].tolist():
                    cover[qb * block:(qb + 1) * block, kb * block:(kb + 1) * block] = True
            assert not (m & ~cover).any()
        for t in range(1, n):  # eviction rule keeps everything a future query reads
            need = set(m[t:, :t].any(0).nonzero().flatten().tolist())
            assert need <= set(p.retained(t, n, h))


@pytest.mark.parametrize("kind", ["bigbird", "diffuser"])
def test_random_edges_deterministic_and_differ_by_head(kind):
    kw = dict(CASES[5][1] if kind == "bigbird" else CASES[6][1])
    p = imggen.make_pattern(kind, **kw)
    n = 128
    assert torch.equal(p.mask(n, 0), imggen.make_pattern(kind, **kw).mask(n, 0))
    assert not torch.equal(p.mask(n, 0), p.mask(n, 1))
    assert not torch.equal(p.mask(n, 0), p.for_layer(1).mask(n, 0))
    assert not torch.equal(p.mask(n, 0), imggen.make_pattern(kind, **{**kw, "seed": 99}).mask(n, 0))


def test_make_pattern_errors():
    with pytest.raises(ConfigError, match="unknown attention pattern"):
        imggen.make_pattern("dilated")
    with pytest.raises(ConfigError, match="takes no parameter"):
        imggen.make_pattern("band", radius=3)
    with pytest.raises(ConfigError):
        imggen.make_pattern("band", window=0)


def _rel(a, b):
    return float(((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).detach())


@pytest.mark.parametrize("kind,kw", CASES)
@pytest.mark.parametrize("block", [8, 32])
@pytest.mark.parametrize("save_mb", ["0", "64"])  # recompute the probabilities / save them (imggen.memory)
def test_cpu_matches_reference_fp32(kind, kw, block, save_mb, monkeypatch):
    monkeypatch.setenv("IMGGEN_SAVE_MB", save_mb)
    torch.manual_seed(hash((kind, block)) % 1000)
    p = imggen.make_pattern(kind, **kw)
    b, h, n, d = 2, 3, min(90, p.max_length() or 90), 16  # n not a multiple of the block
    q, k, v = (torch.randn(b, h, n, d, dtype=torch.float64) for _ in range(3))
    g = torch.randn(b, h, n, d, dtype=torch.float64)
    exact = [t.requires_grad_() for t in (q.clone(), k.clone(), v.clone())]
    o_ref = imggen.sparse_attention(*exact, p, backend="reference")
    grads_ref = torch.autograd.grad(o_ref, exact, g)
    fast = [t.float().requires_grad_() for t in (q, k, v)]
    o = imggen.sparse_attention(*fast, p, backend="cpu", block=block)
    grads = torch.autograd.grad(o, fast, g.float())
    assert _rel(o.double(), o_ref) <= 1e-5
    for a, r in zip(grads, grads_ref):
        assert _rel(a.double(), r) <= 1e-5


def test_cpu_saves_probabilities_only_within_the_limit(monkeypatch):
    """Small calls keep their probabilities for the backward, larger ones recompute them; the
    limit is IMGGEN_SAVE_MB (0 = always recompute), and a bad value is a clear error."""
    p = imggen.make_pattern("band", window=16)
    q = torch.randn(2, 2, 200, 8, requires_grad=True)

    def saved():
        return len(imggen.sparse_attention(q, q, q, p, backend="cpu", block=16).grad_fn.saved_tensors)

    monkeypatch.delenv("IMGGEN_SAVE_MB", raising=False)
    kept = saved()
    assert kept > 3  # q, k, v buffers and at least one chunk of probabilities
    monkeypatch.setenv("IMGGEN_SAVE_MB", "0")
    assert saved() == 3
    monkeypatch.setenv("IMGGEN_SAVE_MB", str(2 * 2 * 208 * 32 * 4 / 2**20 - 0.001))  # one byte short
    assert saved() == 3
    monkeypatch.setenv("IMGGEN_SAVE_MB", "lots")
    with torch.no_grad():  # nothing to keep without a gradient: the limit is not even read
        imggen.sparse_attention(q, q, q, p, backend="cpu", block=16)
    with pytest.raises(ConfigError, match="IMGGEN_SAVE_MB"):
        saved()


def test_diffuser_reference_closed_form():
    torch.manual_seed(0)
    K, a = 4, 0.3
    p = imggen.make_pattern("diffuser", window=5, global_tokens=2, random_edges=2, block=8, steps=K, alpha=a)
    b, h, n, d = 1, 2, 40, 8
    q, k, v = (torch.randn(b, h, n, d, dtype=torch.float64) for _ in range(3))
    out = imggen.sparse_attention(q, k, v, p, backend="reference")
    for head in range(h):
        s = (q[0, head] @ k[0, head].T) / math.sqrt(d)
        A = torch.softmax(s.masked_fill(~p.mask(n, head), float("-inf")), -1)
        Ak = torch.linalg.matrix_power(A, K)
        series = sum((1 - a) ** i * torch.linalg.matrix_power(A, i) for i in range(K))
        expect = ((1 - a) ** K * Ak + a * series) @ v[0, head]
        assert torch.allclose(out[0, head], expect, atol=1e-12)


def test_sparse_attention_input_errors():
    p = imggen.make_pattern("band", window=4)
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(ShapeError):
        imggen.sparse_attention(q, q[:, :, :4], q, p)
    with pytest.raises(ShapeError):
        imggen.sparse_attention(q.long(), q.long(), q.long(), p)
    with pytest.raises(ValueError, match="unknown backend"):
        imggen.sparse_attention(q, q, q, p, backend="gpu")


def test_cpu_backend_masks_are_not_quadratic():
    """The blocked backend's masks hold n * keys-per-row entries (gather) or a few tiles (band), not n * n."""
    from imggen.attention.blocked import make_windows
    band = make_windows(imggen.make_pattern("band", window=64), 4096, 2, 64)
    assert band.first.numel() + band.steady.numel() <= 3 * 64 * 128
    gather = make_windows(imggen.make_pattern("bigbird", block=64, window_blocks=2, random_blocks=1), 4096, 2, 64)
    assert gather.bias.numel() <= 2 * 4096 * 5 * 64


@pytest.mark.parametrize("kind,kw", CASES[1:])
def test_cpu_bf16_within_1e2(kind, kw):
    torch.manual_seed(1)
    p = imggen.make_pattern(kind, **kw)
    n = min(70, p.max_length() or 70)
    q, k, v = (torch.randn(1, 2, n, 16, dtype=torch.float64) for _ in range(3))
    g = torch.randn(1, 2, n, 16, dtype=torch.float64)
    exact = [t.clone().requires_grad_() for t in (q, k, v)]
    o_ref = imggen.sparse_attention(*exact, p, backend="reference")
    grads_ref = torch.autograd.grad(o_ref, exact, g)
    low = [t.bfloat16().requires_grad_() for t in (q, k, v)]
    o = imggen.sparse_attention(*low, p, backend="cpu", block=16)
    grads = torch.autograd.grad(o, low, g.bfloat16())
    assert o.dtype == torch.bfloat16
    assert _rel(o.double(), o_ref) <= 1e-2
    for a, r in zip(grads, grads_ref):
        assert _rel(a.double(), r) <= 2e-2


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc peak-RSS counters")
def test_cpu_attention_peak_memory_is_linear_in_n():
    """One forward+backward of the cpu backend (band), in fresh processes: peak resident-memory growth
    (bench/attention.py --peak) stays within a fixed number of q-sized tensors and grows ~linearly in
    N (a saved N x window probability matrix or an N x N one would break either bound)."""
    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "attention.py")
    heads, dim = 2, 16

    def peak_mb(n):
        r = subprocess.run([sys.executable, bench, "--peak", "cpu", "band", "--n", str(n), "--heads", str(heads),
                            "--dim", str(dim), "--window", "256"], capture_output=True, text=True, timeout=300,
                           env={**os.environ, "OMP_NUM_THREADS": "1", "IMGGEN_SAVE_MB": "0"})
        assert r.returncode == 0, r.stderr[-2000:]
        return float(r.stdout.split()[-1])

    small, big = peak_mb(4096), peak_mb(16384)
    q_mb = 16384 * heads * dim * 4 / 2**20  # one (B, H, N, D) fp32 tensor at the larger N
    assert big <= 24 * q_mb, f"peak {big:.1f} MB is more than 24 q-sized tensors ({q_mb:.1f} MB each)"
    assert big / small <= 5.0, f"peak grew {big / small:.1f}x for 4x the tokens"
