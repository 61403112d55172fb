"""Decode caches: eviction caches give the logits of the parallel forward, never evict a key a
future query reads (debug mode asserts it at every step), and stay within their memory bounds."""
import numpy as np
import pytest
import torch

import imggen.decode as dec
import imggen.model
import imggen.decode.native
import imggen.decode.panels
import imggen.sampling as sampling
from imggen.decode import make_cache, make_caches
from imggen.config import ModelConfig
from imggen.errors import ConfigError, ImggenError, ShapeError
from imggen.model import ImageTransformer
from imggen.decode.panels import panel_linear
from imggen.patterns import make_pattern
from imggen.sampling import generate, inpaint, sample, teacher_force

torch.set_num_threads(1)

# (attention, pattern parameters): blocks of 4 / 5 never divide the width 7 (or 21 subpixels)
CASES = {
    "full": dict(attention="full"),
    "band": dict(attention="band", window=6),
    "local2d": dict(attention="local2d", radius=1),
    "bigbird": dict(attention="bigbird", block=5, window_blocks=2, global_blocks=1, random_blocks=2),
    "diffuser": dict(attention="diffuser", window=5, global_tokens=3, random_edges=3, block=4,
                     diffusion_steps=3, alpha=0.2),
    "strided": dict(attention="strided"),
    "mixed": dict(attention="local2d,bigbird,band", radius=2, window=9, block=4),
}


@pytest.fixture(autouse=True)
def debug_caches(monkeypatch):
    monkeypatch.setattr(dec, "DEBUG", True)
    # these tiny models exercise the evicting layouts even where keeping everything would take fewer
    # bytes (where make_caches then keeps everything: tests/test_study.py checks that choice)
    monkeypatch.setattr(dec, "NEVER_LARGER", False)


def _model(channels, seed=0, height=5, width=7, **kw):
    torch.manual_seed(seed)
    cfg = ModelConfig(height=height, width=width, channels=channels, bits=4, dim=32, layers=2, heads=2,
                      backend="cpu", **kw)
    return ImageTransformer(cfg).eval()


def _native_or_debug(path, monkeypatch):
    """path "native": the debug checks off, so that steps run in imggen.decode.native's one-call step."""
    if path == "native":
        if not imggen.decode.native.available():
            pytest.skip("no native kernels here (no C compiler)")
        monkeypatch.setattr(dec, "DEBUG", False)


@pytest.mark.parametrize("linear", ["layers", "panels", "native"])
@pytest.mark.parametrize("channels", [1, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_teacher_force_parity(case, channels, linear, monkeypatch):
    """Decode steps give the forward's logits; "layers": the PyTorch layers; "panels": their
    linears through weight panels (imggen.decode.panels' PyTorch path), 12 columns wide so that most
    layers end in a padded panel; "native": imggen.decode.native's kernels (the caches' debug checks off,
    which keep a step on the PyTorch path)."""
    if linear == "native":
        if not imggen.decode.native.available():
            pytest.skip("no native kernels here (no C compiler)")
        monkeypatch.setattr(dec, "DEBUG", False)
    else:
        monkeypatch.setattr(imggen.decode.native, "available", lambda: False)
    if linear == "panels":
        monkeypatch.setattr(imggen.decode.panels, "MIN_BYTES", 0)
        monkeypatch.setattr(imggen.decode.panels, "PANEL", 12)
    model = _model(channels, **CASES[case])
    x = torch.randint(0, 16, (2, model.config.seq_len), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(x)
    caches = make_caches(model, 2, "evict")
    if case not in ("full", "strided", "bigbird"):
        assert all(c.capacity < model.config.seq_len for c in caches), [c.capacity for c in caches]
    out = teacher_force(model, x, cache="evict")
    assert (out - ref).abs().max() <= 1e-4
    caches = make_caches(model, 2, "evict")
    model.step(None, 0, caches)
    assert (model.head in caches.packed) == (linear != "layers")  # the path the test names ran
    fused = caches.packed.get("native") is not None
    assert fused == (linear == "native" and all(isinstance(c, dec.Cache) and c.z is None for c in caches))
    p = model.config.seq_len // 2 + 1  # prefill, then decode
    out = teacher_force(model, x, cache="evict", prefill=p)
    assert (out - ref).abs().max() <= 1e-4


@pytest.mark.parametrize("path", ["debug", "native"])
@pytest.mark.parametrize("parts", ["whole", "split"])
@pytest.mark.parametrize("cache", ["evict", "full"])
@pytest.mark.parametrize("case", list(CASES))
def test_extend_runs_equal_the_forward(case, cache, parts, path, monkeypatch):
    """model.extend (a run of known positions in one pass) mixed with decode steps gives the
    forward's logits and leaves the caches as the steps would (debug mode checks every slot; the
    native steps then read what extend stored); runs longer than a ring wrap around it; "split":
    the model passes each run in parts of 3 positions and the caches attend in parts of one."""
    _native_or_debug(path, monkeypatch)
    if parts == "split":
        monkeypatch.setattr(dec, "EXTEND_BYTES", 1)
        monkeypatch.setattr(imggen.model, "EXTEND_TOKENS", 6)
    model = _model(3, **CASES[case])
    n = model.config.seq_len
    g = torch.Generator().manual_seed(2)
    x = torch.randint(0, 16, (2, n), generator=g)
    with torch.no_grad():
        ref = model(x)
    caches = make_caches(model, 2, cache)
    out, t = [model.step(None, 0, caches)[:, None]], 1
    while t < n:
        u = min(n, t + int(torch.randint(1, 40, (1,), generator=g)))
        if torch.rand(1, generator=g) < 0.5:
            out.append(model.extend(x[:, t - 1:u - 1], t, caches))
        else:
            out += [model.step(x[:, i - 1], i, caches)[:, None] for i in range(t, u)]
        t = u
    assert (torch.cat(out, 1) - ref).abs().max() <= 1e-4
    with pytest.raises(ShapeError, match="t0 >= 1"):
        model.extend(x[:, :3], 0, caches)


@pytest.mark.parametrize("path", ["debug", "native"])
@pytest.mark.parametrize("case", ["local2d", "diffuser", "mixed"])
def test_sampling_known_runs_in_one_pass_equals_steps(case, path, monkeypatch):
    """Inpainting passes runs of positions known for every image through model.extend: greedy fills
    and log-likelihoods equal those of decoding every position by steps."""
    _native_or_debug(path, monkeypatch)
    model = _model(3, **CASES[case])
    n = model.config.seq_len
    known = torch.randint(0, 16, (2, n), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, n, dtype=torch.bool)
    mask[:, 20:26] = False
    mask[0, 40:43] = False
    mask[1, 60:61] = False
    fast = sample(model, 2, known, mask, top_k=1, return_logprob=True)
    calls = []

    def by_steps(prev, t0, caches, features=None):
        calls.append(t0)
        return torch.stack([model.step(prev[:, i], t0 + i, caches, features) for i in range(prev.shape[1])], 1)

    monkeypatch.setattr(model, "extend", by_steps)
    slow = sample(model, 2, known, mask, top_k=1, return_logprob=True)
    assert calls == [26, 43, 61]  # the runs after each hole; the prefix 0..19 is a prefill
    assert torch.equal(fast[0], slow[0])
    torch.testing.assert_close(fast[1], slow[1], atol=1e-4, rtol=1e-6)


@pytest.mark.parametrize("kind,params", [
    ("band", dict(window=5)),
    ("local2d", dict(height=5, width=7, channels=3, radius=2, shift=1)),
    ("local2d", dict(height=6, width=4, channels=1, radius=1, shift=0)),
    ("bigbird", dict(block=4, window_blocks=2, global_blocks=1, random_blocks=2, seed=3)),
    ("diffuser", dict(window=4, global_tokens=2, random_edges=3, block=5, seed=1)),
    ("strided", dict(stride=7, shift=1)),
    ("full", {}),
])
def test_last_reads_match_the_mask(kind, params):
    """The eviction arithmetic equals the definition (pattern.mask) exactly, for every head."""
    p = make_pattern(kind, **params).for_layer(1)
    full = params["height"] * params["width"] * params["channels"] if kind == "local2d" else 105
    np.testing.assert_array_equal(p.last_reads(full, 4), dec.true_last_reads(p, full, 4))
    # a shorter sequence (local2d: rows cut short) may only over-estimate: keys kept longer, never less
    short = min(50, full - 3)
    assert (p.last_reads(short, 4) >= dec.true_last_reads(p, short, 4)).all()


def test_debug_mode_catches_an_eviction_bug(monkeypatch):
    """A ring one slot too small evicts a key its last reader still needs: debug mode says so."""
    model = _model(1, **CASES["band"])
    real = dec.slot_plan

    def short_ring(pattern, n, heads, policy):
        plan = real(pattern, n, heads, policy)
        cap = plan.capacity - 1
        return dec.SlotPlan(cap, np.arange(n) % cap, np.minimum(np.arange(n) + 1, cap), plan.last)

    monkeypatch.setattr(dec, "slot_plan", short_ring)
    x = torch.randint(0, 16, (1, model.config.seq_len))
    with pytest.raises(AssertionError, match="evict"):
        teacher_force(model, x, cache="evict")


def test_cache_sizes(monkeypatch):
    monkeypatch.setattr(dec, "DEBUG", False)  # debug mode builds n x n masks
    n = 64 * 64
    band = make_pattern("band", window=256)
    sizes = [make_cache(band, 1, 4, 16, h * 64, keep_all=False).capacity for h in (16, 64, 128)]
    assert sizes == [256, 256, 256]
    # local2d: r rows + (r + 1) pixels of subpixels minus the shift; independent of the height
    for c in (1, 3):
        for h in (8, 64):
            p = make_pattern("local2d", height=h, width=32, channels=c, radius=3, shift=1)
            cache = make_cache(p, 1, 4, 16, h * 32 * c)
            assert cache.capacity == 3 * 32 * c + 4 * c - 1
    full = make_cache(make_pattern("full"), 2, 4, 16, n)
    small = make_cache(band, 2, 4, 16, n)
    assert full.nbytes() > 15 * small.nbytes()
    # diffuser caches carry Z1..Z(K-1) next to k, v
    d = make_pattern("diffuser", window=64, global_tokens=64, random_edges=8, steps=5, block=64)
    dc = make_cache(d, 1, 4, 16, n)
    assert dc.z.shape == (4, 1, 4, dc.capacity, 16) and dc.capacity < n
    # bigbird: planned capacity never exceeds the live maximum it was computed from
    b = make_pattern("bigbird", block=64, window_blocks=3, global_blocks=1, random_blocks=2)
    plan = dec.slot_plan(b, n, 4, "interval")
    assert plan.slots.max() == plan.capacity - 1 and plan.hi[-1] == plan.capacity


@pytest.mark.parametrize("case", ["local2d", "diffuser", "mixed"])
def test_greedy_eviction_equals_full_cache(case):
    model = _model(3 if case == "mixed" else 1, **CASES[case])
    a = sample(model, 2, top_k=1, cache="evict")
    b = sample(model, 2, top_k=1, cache="full")
    assert torch.equal(a, b)


def test_seeded_sampling_is_reproducible():
    model = _model(1, **CASES["band"])
    a, b = (sample(model, 2, seed=5) for _ in range(2))
    assert torch.equal(a, b) and not torch.equal(a, sample(model, 2, seed=6))


def test_seeded_images_depend_on_the_seed_and_their_index_only():
    """Image i of a seed is the same whatever the batch size or count, and nearby seeds share none."""
    model = _model(1, **CASES["local2d"])
    ref, lp = generate(model, 5, seed=3, batch_size=5)
    for batch in (1, 2, 3):
        toks, lps = generate(model, 5, seed=3, batch_size=batch)
        assert torch.equal(toks, ref) and torch.allclose(lps, lp, rtol=1e-5, atol=1e-4)
    assert torch.equal(generate(model, 2, seed=3)[0], ref[:2])
    other = generate(model, 5, seed=4)[0]
    assert not any(torch.equal(x, y) for x in other for y in ref)


def test_draws_follow_the_softmax_and_never_pick_what_top_k_drops():
    logits = torch.tensor([[0.0, 1.0, -1.0, 2.0, -30.0]]).expand(20000, -1)
    u = torch.rand(20000, generator=torch.Generator().manual_seed(0))
    freq = torch.bincount(sampling._pick(logits, 1.0, None, u), minlength=5) / 20000
    torch.testing.assert_close(freq, torch.softmax(logits[0], -1), atol=0.015, rtol=0)
    edges = torch.tensor([0.0, 0.5, 1 - 2 ** -24])
    assert set(sampling._pick(logits[:3], 1.0, 2, edges).tolist()) <= {1, 3}
    assert sampling._pick(logits[:3], 0.5, None, edges).tolist()[0] == 0  # u = 0: the first token
    assert sampling._pick(logits[:3], 0.0, None, edges).tolist() == [3, 3, 3]  # temperature 0: greedy


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_native_draws_equal_the_pytorch_draws(temperature, monkeypatch):
    """sample() draws through imggen.decode.native.draw where it can; the PyTorch draw (_pick, _loglik)
    gives the same images and log-likelihoods, unconditional and with known pixels."""
    if not imggen.decode.native.available():
        pytest.skip("no native kernels here (no C compiler)")
    model = _model(3, **CASES["local2d"])
    n = model.config.seq_len
    known = torch.randint(0, 16, (4, n), generator=torch.Generator().manual_seed(2))
    mask = torch.rand(4, n, generator=torch.Generator().manual_seed(3)) < 0.5
    calls = []
    monkeypatch.setattr(imggen.decode.native, "draw", lambda *a, _d=imggen.decode.native.draw: calls.append(1) or _d(*a))
    fast = [sample(model, 4, seed=1, temperature=temperature, return_logprob=True),
            sample(model, 4, known, mask, seed=1, temperature=temperature, return_logprob=True)]
    assert calls
    monkeypatch.setattr(sampling, "native", type("NoNative", (), {"available": staticmethod(lambda: False)}))
    slow = [sample(model, 4, seed=1, temperature=temperature, return_logprob=True),
            sample(model, 4, known, mask, seed=1, temperature=temperature, return_logprob=True)]
    for (tf, lf), (ts, ls) in zip(fast, slow):
        assert torch.equal(tf, ts)
        torch.testing.assert_close(lf, ls, rtol=1e-5, atol=1e-5)
    assert torch.equal(fast[1][0][mask], known[mask])


@pytest.mark.parametrize("temperature", [float("nan"), -1.0, float("inf")])
def test_bad_temperature_is_a_clear_error(temperature):
    with pytest.raises(ConfigError, match="temperature"):
        sample(_model(1, **CASES["band"]), 1, temperature=temperature)


def test_a_model_with_non_finite_weights_is_a_clear_error():
    model = _model(1, **CASES["band"])
    with torch.no_grad():
        model.head.weight[0, 0] = float("nan")
    with pytest.raises(ImggenError, match="not finite"):
        sample(model, 2, seed=0)


def test_logprob_covers_the_whole_image():
    """sample(..., return_logprob=True) equals the model's log-likelihood of every token, known
    tokens after the hole included."""
    model = _model(3, **CASES["mixed"])
    n = model.config.seq_len
    known = torch.randint(0, 16, (2, n))
    mask = torch.ones(2, n, dtype=torch.bool)
    mask[:, 30:50] = False
    mask[1, 70:80] = False
    toks, logp = sample(model, 2, known, mask, seed=0, return_logprob=True)
    assert torch.equal(toks[mask], known[mask])
    with torch.no_grad():
        ll = torch.log_softmax(model(toks), -1).gather(-1, toks[..., None]).sum((1, 2))
    torch.testing.assert_close(logp, ll, atol=1e-3, rtol=1e-5)


def test_inpaint_keeps_known_pixels_and_rank_picks_the_most_likely():
    model = _model(3, **CASES["local2d"])
    cfg = model.config
    image = torch.randint(0, 256, cfg.shape, dtype=torch.uint8)  # 8-bit values, 4-bit model
    mask = torch.zeros(cfg.height, cfg.width, dtype=torch.bool)
    mask[1:3, 2:5] = True
    filled, logp = inpaint(model, image, mask, num=2, seed=0)
    assert filled.shape == (2, *cfg.shape)
    assert torch.equal(filled[:, :, ~mask], image[None, :, ~mask].expand(2, -1, -1))
    # rank: the kept candidate is the max of the candidates drawn with the same seed
    best, best_lp = generate(model, 1, rank=4, batch_size=3, seed=7)
    cands, lps = generate(model, 4, seed=7, batch_size=3)  # the same four sequences, unranked
    assert len(set(lps.tolist())) == 4
    assert torch.isclose(best_lp[0], lps.max()) and torch.equal(best[0], cands[lps.argmax()])


@pytest.mark.parametrize("path", ["debug", "native"])
@pytest.mark.parametrize("case", ["band", "local2d", "bigbird", "diffuser", "strided"])
def test_keep_all_baseline_parity(case, path, monkeypatch):
    """The keep-everything baseline of bench/decode.py (same code, nothing evicted) is exact too
    (natively: masks computed at every step)."""
    _native_or_debug(path, monkeypatch)
    model = _model(1, **CASES[case])
    cfg = model.config
    x = torch.randint(0, 16, (2, cfg.seq_len))
    caches = [make_cache(p, 2, cfg.heads, cfg.dim // cfg.heads, cfg.seq_len, keep_all=True)
              for p in model.patterns]
    assert all(c.capacity == cfg.seq_len for c in caches)
    with torch.no_grad():
        ref = model(x)
        out = [model(x[:, :9], caches=caches)]
        out += [model.step(x[:, t - 1], t, caches)[:, None] for t in range(9, cfg.seq_len)]
    assert (torch.cat(out, 1) - ref).abs().max() <= 1e-4


def test_decode_attention_matches_the_kernel_reference():
    """The bias layout handed to imggen.kernels.decode_attention on CUDA matches its reference."""
    kernels = pytest.importorskip("imggen.kernels")
    from imggen.decode import decode_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 4, 16, generator=g), torch.randn(2, 4, 9, 16, generator=g), torch.randn(2, 4, 9, 16, generator=g)
    bias = torch.zeros(4, 9).masked_fill_(torch.rand(4, 9, generator=g) < 0.4, float("-inf"))
    bias[:, 0] = 0
    ref = kernels.decode_attention_reference(q, k, v, bias[None])
    torch.testing.assert_close(decode_attention(q, k, v, bias), ref)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_panel_linear_equals_the_layer(rows, bias):
    """Decode-step linears through weight panels (imggen.decode.panels) equal the layer and leave
    autograd and batches above the threads' share to the layer."""
    torch.manual_seed(rows)
    layer, store = torch.nn.Linear(37, 45, bias=bias), {}  # 45 outputs: the last panel is padded
    x = torch.randn(rows, 37)
    with torch.no_grad():
        torch.testing.assert_close(panel_linear(layer, x, store), layer(x), rtol=1e-5, atol=1e-6)
        assert layer in store  # the panel path ran
        big, fresh = torch.randn(imggen.decode.panels.ROWS_PER_THREAD * torch.get_num_threads() + 1, 37), {}
        torch.testing.assert_close(panel_linear(layer, big, fresh), layer(big))
        assert not fresh
    xg = x.clone().requires_grad_()
    panel_linear(layer, xg, store).sum().backward()
    torch.testing.assert_close(xg.grad, layer.weight.sum(0).expand(rows, -1))


def test_each_decoding_run_packs_the_weights_of_its_start(monkeypatch):
    """Panels belong to a run's caches: weights changed between runs, even through .data (which
    no version counter sees), are what the next run decodes with."""
    monkeypatch.setattr(imggen.decode.panels, "MIN_BYTES", 0)
    model = _model(1, attention="band", window=6)
    x = torch.randint(0, 16, (2, model.config.seq_len), generator=torch.Generator().manual_seed(1))
    for scale in (1.0, -3.0):
        for p in model.parameters():
            p.data.mul_(scale)
        with torch.no_grad():
            ref = model(x)
        assert (teacher_force(model, x) - ref).abs().max() <= 1e-4


@pytest.mark.parametrize("draw", range(6))
def test_random_configs_parity(draw):
    """Random small shapes and pattern parameters, prefilled at a random length."""
    rng = np.random.default_rng(100 + draw)
    kind = ["band", "local2d", "bigbird", "diffuser", "strided", "local2d,diffuser"][draw]
    kw = dict(attention=kind, window=int(rng.integers(1, 12)), radius=int(rng.integers(0, 3)),
              block=int(rng.integers(2, 7)), window_blocks=int(rng.integers(1, 3)),
              global_blocks=int(rng.integers(0, 2)), random_blocks=int(rng.integers(0, 3)),
              global_tokens=int(rng.integers(0, 5)), random_edges=int(rng.integers(0, 4)),
              diffusion_steps=int(rng.integers(1, 4)), stride=int(rng.integers(1, 9)), pattern_seed=draw)
    model = _model(int(rng.choice([1, 3])), seed=draw, height=int(rng.integers(2, 6)),
                   width=int(rng.integers(3, 10)), **kw)
    n = model.config.seq_len
    x = torch.randint(0, 16, (3, n), generator=torch.Generator().manual_seed(draw))
    with torch.no_grad():
        ref = model(x)
    for prefill in (0, int(rng.integers(1, n))):
        assert (teacher_force(model, x, cache="evict", prefill=prefill) - ref).abs().max() <= 1e-4, prefill


@pytest.mark.parametrize("path", ["debug", "native"])
@pytest.mark.parametrize("case", ["local2d", "bigbird", "diffuser", "strided", "mixed"])
def test_read_plans_in_short_windows(case, path, monkeypatch):
    """Read plans are computed PLAN_STEPS steps at a time (bounded memory): many windows, same logits
    (natively: layers whose plans end at different steps)."""
    monkeypatch.setattr(dec, "PLAN_STEPS", 7)
    monkeypatch.setattr(dec, "MIN_PLAN_STEPS", 5)
    _native_or_debug(path, monkeypatch)
    model = _model(3, **CASES[case])
    x = torch.randint(0, 16, (2, model.config.seq_len), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model(x)
    assert (teacher_force(model, x, prefill=11) - ref).abs().max() <= 1e-4


def test_panels_bench_runs(tmp_path):
    """bench/panels.py end to end at tiny sizes (its linears table checks panels against the layers)."""
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "panels.md"
    r = subprocess.run([sys.executable, "bench/panels.py", "--quick", "--threads", "1", "--out", str(out)],
                       cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    text = out.read_text()
    assert "| 4 |" in text and "| demo dim=32" in text, text


def test_out_of_range_tokens_and_empty_batches_are_clear_errors():
    model = _model(1, **CASES["band"])
    n = model.config.seq_len
    for bad in (torch.full((1, 5), 16), torch.full((1, 5), -1)):  # a 4-bit model: 0..15
        with pytest.raises(ShapeError, match="tokens must be in 0..15"):
            model(bad)
    known, mask = torch.zeros(1, n, dtype=torch.long), torch.zeros(1, n, dtype=torch.bool)
    known[0, 3], mask[0, 3] = 99, True
    with pytest.raises(ShapeError, match="tokens must be in 0..15"):
        sample(model, 1, known, mask)
    known[0, 3], known[0, 4] = 5, 99  # an unknown position may hold anything
    assert sample(model, 1, known, mask, seed=0)[0, 3] == 5
    with pytest.raises(ShapeError, match="batch_size must be >= 1"):
        sample(model, 0)
