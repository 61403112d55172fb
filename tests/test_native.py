"""imggen.decode.native's C decode kernels against their PyTorch references (fresh random inputs, awkward
sizes), and the fallback when they cannot be built."""
import os
import subprocess
import sys

import pytest
import torch

import imggen.decode.native as native
from imggen.decode import decode_attention_reference
from imggen.decode.panels import _pack, reference_linear

pytestmark = pytest.mark.skipif(not native.available(), reason="no native kernels here (no C compiler)")


@pytest.mark.parametrize("m", [1, 5, 16, 23, 40])
@pytest.mark.parametrize("inp,out", [(32, 48), (40, 37), (256, 16), (24, 1000)])
@pytest.mark.parametrize("fuse", ["plain", "ln", "act", "add", "all"])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_matches_the_reference(m, inp, out, fuse, bias):
    g = torch.Generator().manual_seed(m * 1000 + inp + out)
    layer = torch.nn.Linear(inp, out, bias=bias)
    ln = torch.nn.LayerNorm(inp)
    with torch.no_grad():
        for p in (*layer.parameters(), *ln.parameters()):
            p.copy_(torch.randn(p.shape, generator=g))
    x = torch.randn(m, inp, generator=g) * 3 + 1
    kw = dict(ln=ln if fuse in ("ln", "all") else None, act=fuse in ("act", "all"),
              add=torch.randn(m, out, generator=g) if fuse in ("add", "all") else None)
    panels, b = _pack(layer)
    with torch.no_grad():
        got = native.linear(x, panels, b, out, **kw)
        want = reference_linear(layer, x, **kw)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("threads", [1, 3, 5])
@pytest.mark.parametrize("inp", [8, 24, 40, 1000])
def test_linear_splits_its_input_over_any_thread_count(threads, inp):
    """Each thread normalises and transposes its own range of the input's columns (whole 16-column
    tiles; a thread may get none): the result is the same for any thread count."""
    g = torch.Generator().manual_seed(inp + threads)
    layer, ln = torch.nn.Linear(inp, 33), torch.nn.LayerNorm(inp)
    with torch.no_grad():
        for p in (*layer.parameters(), *ln.parameters()):
            p.copy_(torch.randn(p.shape, generator=g))
    x = torch.randn(21, inp, generator=g)
    panels, b = _pack(layer)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            got = native.linear(x, panels, b, 33, ln=ln, act=True)
            want = reference_linear(layer, x, ln=ln, act=True)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_linear_reads_strided_rows():
    """x rows any stride apart (a view into a wider buffer), as the decode step passes them."""
    layer = torch.nn.Linear(32, 20)
    wide = torch.randn(7, 96)
    x = wide[:, 32:64]
    panels, b = _pack(layer)
    with torch.no_grad():
        torch.testing.assert_close(native.linear(x, panels, b, 20), layer(x), rtol=1e-5, atol=1e-6)


def _ref(q, k, v, index, bias):
    if index is not None:
        gather = index.expand(q.shape[1], -1)[None, :, :, None].expand(q.shape[0], -1, -1, q.shape[-1])
        k, v = torch.gather(k, 2, gather), torch.gather(v, 2, gather)
    return decode_attention_reference(q.double(), k.double(), v.double(), None if bias is None else bias[None].double())


@pytest.mark.parametrize("d", [16, 32, 20, 64])
@pytest.mark.parametrize("read", ["prefix", "shared", "per-head"])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("nread", [1, 15, 16, 40, 129])
def test_attend_matches_the_reference(d, read, masked, nread):
    g = torch.Generator().manual_seed(d * 7 + nread)
    b, h, length = 3, 4, 130
    q, k, v = (torch.randn(s, generator=g) for s in ((b, h, d), (b, h, length, d), (b, h, length, d)))
    index = None
    if read != "prefix":
        index = torch.randint(0, length, (1 if read == "shared" else h, nread), generator=g)
    bias = None
    if masked:
        bias = torch.where(torch.rand(h, nread, generator=g) < 0.4, float("-inf"), 0.0)
        bias[:, nread // 2] = 0.0  # every row reads something
    got = native.attend(q, k, v, index, bias, hi=nread)
    want = _ref(q, k[:, :, :nread] if index is None else k, v[:, :, :nread] if index is None else v, index, bias)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_attend_stores_then_reads_the_new_slot():
    """store=(slot, k, v) from views into one qkv buffer writes the slot before it is read."""
    g = torch.Generator().manual_seed(3)
    b, h, length, d = 2, 3, 9, 32
    k, v = torch.randn(b, h, length, d, generator=g), torch.randn(b, h, length, d, generator=g)
    qkv = torch.randn(b, 3, h, d, generator=g)
    q, kn, vn = qkv.unbind(1)
    want_k, want_v = k.clone(), v.clone()
    want_k[:, :, 4], want_v[:, :, 4] = kn, vn
    want = _ref(q, want_k[:, :, :6], want_v[:, :, :6], None, None)
    got = native.attend(q, k, v, hi=6, store=(4, kn, vn))
    assert torch.equal(k, want_k) and torch.equal(v, want_v)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_attend_row_with_nothing_to_read_is_zero():
    q, k, v = torch.randn(1, 2, 16), torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16)
    bias = torch.zeros(2, 5)
    bias[1] = float("-inf")
    out = native.attend(q, k, v, None, bias)
    assert torch.equal(out[0, 1], torch.zeros(16))
    torch.testing.assert_close(out[0, 0].double(), _ref(q, k, v, None, bias)[0, 0], rtol=1e-5, atol=1e-5)


_FALLBACK = """
import warnings, torch, imggen.decode.native as native
from imggen.model import ImageTransformer
from imggen.config import ModelConfig
from imggen.sampling import teacher_force
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    ok = native.available()
print("available", ok, "warnings", [str(x.message)[:60] for x in w])
torch.manual_seed(0)
m = ImageTransformer(ModelConfig(height=4, width=5, channels=1, bits=4, dim=32, layers=2, heads=2)).eval()
x = torch.randint(0, 16, (2, 20))
with torch.no_grad():
    print("parity", float((teacher_force(m, x) - m(x)).abs().max()) <= 1e-4)
"""


@pytest.mark.parametrize("env", [{"CC": "/nonexistent/cc"}, {"IMGGEN_NATIVE": "0"}])
def test_unavailable_kernels_fall_back(env, tmp_path):
    """A compiler that fails is one warning and the PyTorch path; IMGGEN_NATIVE=0 is no warning."""
    run = subprocess.run([sys.executable, "-c", _FALLBACK], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "IMGGEN_CACHE_DIR": str(tmp_path), **env})
    assert run.returncode == 0, run.stderr
    assert "available False" in run.stdout and "parity True" in run.stdout, run.stdout
    warned = "unavailable" in run.stdout
    assert warned == ("CC" in env), run.stdout


def test_build_is_cached_per_source(tmp_path, monkeypatch):
    monkeypatch.setenv("IMGGEN_CACHE_DIR", str(tmp_path))
    path = native.build()
    mtime = os.path.getmtime(path)
    assert native.build() == path and os.path.getmtime(path) == mtime
    assert [p.name for p in tmp_path.iterdir()] == [os.path.basename(path)]  # no temporary left behind



def test_model_step_rejects_another_batch_a_bad_position_or_token():
    """A step with more sequences than the caches hold, past the last position or with a token
    outside the vocabulary is a clear error, not a read or write past the buffers."""
    from imggen.config import ModelConfig
    from imggen.decode import make_caches
    from imggen.errors import ShapeError
    from imggen.model import ImageTransformer

    model = ImageTransformer(ModelConfig(height=4, width=5, channels=1, bits=4, dim=32, layers=2, heads=2)).eval()
    caches = make_caches(model, 2)
    with torch.no_grad():
        model.step(None, 0, caches)
        assert isinstance(caches.packed.get("native"), native.ModelStep)
        with pytest.raises(ShapeError, match="decode step"):
            model.step(torch.zeros(3, dtype=torch.long), 1, caches)
        with pytest.raises(ShapeError, match="decode step"):
            model.step(None, 1, caches)
        with pytest.raises(ShapeError, match="decode step"):
            model.step(torch.zeros(2, dtype=torch.long), 20, caches)
        with pytest.raises(ShapeError, match="0..15"):
            model.step(torch.tensor([3, 16]), 1, caches)
        assert int(caches[0].positions.max()) == 0  # nothing was stored by the refused steps


@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.5, 0.0])
@pytest.mark.parametrize("known", [False, True])
def test_draw_matches_pick_and_loglik(temperature, known):
    """native.draw against imggen.sampling's _pick and _loglik on fresh random logits, strided
    columns in and out: the same tokens (a draw may flip only where u lies within float rounding
    of a CDF step) and log-likelihoods to 1e-5."""
    from imggen.sampling import _loglik, _pick

    g = torch.Generator().manual_seed(int(temperature * 10) + known)
    b, v, n, t = 64, 256, 9, 4
    logits = torch.randn(b, v, generator=g) * 3
    logits[:, :40] -= 30  # a tail of tiny probabilities
    draws = torch.rand(b, n, generator=g)
    draws[:3, t] = torch.tensor([0.0, 0.5, 1 - 2 ** -24])
    known_t = torch.randint(0, v, (b, n), generator=g)
    mask = torch.rand(b, n, generator=g) < 0.3 if known else None
    want = _pick(logits, temperature, None, draws[:, t])
    if known:
        want = torch.where(mask[:, t], known_t[:, t], want)
    tokens, logp = torch.zeros(b, n, dtype=torch.long), torch.full((b,), 0.5)
    native.draw(logits, draws[:, t], temperature, tokens[:, t], logp,
                *((known_t[:, t], mask[:, t]) if known else ()))
    got = tokens[:, t]
    cdf = torch.softmax(logits.double() / max(temperature, 1e-9), -1).cumsum(-1)
    near = (cdf - draws[:, t, None].double() * cdf[:, -1:]).abs().min(-1).values < 1e-5
    assert torch.equal(got[~near], want[~near]) and int(near.sum()) <= 5  # the edge rows 0 and 2, a few others
    assert (tokens[:, [i for i in range(n) if i != t]] == 0).all()  # only column t written
    torch.testing.assert_close(logp - 0.5, _loglik(logits[:, None], got[:, None]), rtol=1e-5, atol=1e-5)
