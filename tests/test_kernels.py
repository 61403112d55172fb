"""Triton kernels vs the float64 reference (CPU: TRITON_INTERPRET=1, set by conftest; tiny shapes).

Tolerance from a noise floor: the kernel's error against the float64 reference may be at most
2x (plus a tiny absolute epsilon) the error of the reference backend run in the same precision.
Every tile configuration the launchers may pick (kernels.tuning.CONFIGS) is run at least once.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

import imggen
from imggen.attention import reference_attention, triton_selfcheck
from imggen.errors import ShapeError
from imggen.patterns import KernelRule

kernels = pytest.importorskip("imggen.kernels")
from imggen.kernels import plan as kplan  # noqa: E402
from imggen.kernels import sparse_ops as ksparse  # noqa: E402
from imggen.kernels import tuning  # noqa: E402
from imggen.kernels.plan import keeps_rule, layout_block, make_plan  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
PRINT_MARGINS = False
EPS = {torch.float32: 1e-6, torch.float16: 5e-4, torch.bfloat16: 4e-3}

PATTERNS = {
    "full": lambda: imggen.make_pattern("full"),
    "band": lambda: imggen.make_pattern("band", window=20),
    "local2d_rgb": lambda: imggen.make_pattern("local2d", height=5, width=6, channels=3, radius=1, shift=1),
    "local2d": lambda: imggen.make_pattern("local2d", height=8, width=9, channels=1, radius=2, shift=0),
    "bigbird": lambda: imggen.make_pattern("bigbird", block=16, window_blocks=1, global_blocks=1,
                                           random_blocks=1, seed=3),
    "diffuser": lambda: imggen.make_pattern("diffuser", window=10, global_tokens=3, random_edges=3, steps=3,
                                            alpha=0.2, seed=1, block=16),
    "strided": lambda: imggen.make_pattern("strided", stride=9, shift=1),  # per-head element masks
    "column": lambda: imggen.make_pattern("column", stride=9, shift=1),  # the COLUMN rule (strided's odd heads)
}


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    """Every kernel output buffer starts as NaN, so an unwritten element fails the comparison."""
    monkeypatch.setattr(ksparse, "POISON", True)


def _inputs(b, h, n, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, n, d, generator=g, dtype=torch.float64) for _ in range(4)]


def _run(fn, q, k, v, do, dtype, device):
    qq, kk, vv = (t.detach().to(device=device, dtype=dtype).clone().requires_grad_() for t in (q, k, v))
    o = fn(qq, kk, vv)
    o.backward(do.to(device=device, dtype=dtype))
    return [t.detach().double().cpu() for t in (o, qq.grad, kk.grad, vv.grad)]


def _check_against_floor(pattern, dtype, b=2, h=2, n=70, d=32, block=None, device=DEV):
    # inputs rounded to `dtype` first, so the noise floor measures arithmetic, not input rounding
    q, k, v, do = (t.to(dtype).double() for t in _inputs(b, h, n, d))
    ref = _run(lambda *a: reference_attention(*a, pattern), q, k, v, do, torch.float64, "cpu")
    floor_dev = device if dtype != torch.float16 or device == "cuda" else "cpu"
    floor = _run(lambda *a: reference_attention(*a, pattern), q, k, v, do, dtype, floor_dev)
    got = _run(lambda *a: kernels.sparse_attention(*a, pattern, block=block), q, k, v, do, dtype, device)
    for name, r, f, g in zip(("out", "dq", "dk", "dv"), ref, floor, got):
        assert torch.isfinite(g).all(), f"{name}: non-finite values (unwritten output?)"
        err, noise = (g - r).abs().max().item(), (f - r).abs().max().item()
        if PRINT_MARGINS:
            print(f"{pattern.name} {dtype} {name}: err {err:.2e} noise {noise:.2e}")
        assert err <= 2 * noise + EPS[dtype], f"{pattern.name} {dtype} {name}: error {err:.3g} > 2 x {noise:.3g} + eps"


@pytest.mark.parametrize("name", list(PATTERNS))
@pytest.mark.parametrize("dtype,d", [(torch.float32, 32), (torch.float16, 64)])
def test_matches_reference(name, dtype, d):
    _check_against_floor(PATTERNS[name](), dtype, d=d)


@pytest.mark.parametrize("block,n", [(32, 100), (16, 16), (16, 1)])
def test_band_blocks_and_tails(block, n):
    _check_against_floor(imggen.make_pattern("band", window=37), torch.float32, n=n, block=block)


# ------------------------------------------------------------------------- tile configurations
def _tiles(kernel):
    """Distinct (bm, bn) of `kernel` over every head dim and precision (warps and stages do not
    change what the interpreter computes; aot_check compiles each of them)."""
    return sorted({(c.bm, c.bn) for (k, _, _), cs in tuning.CONFIGS.items() if k == kernel for c in cs})


def _tile_patterns(size):
    """A band with full tiles, masked far edges and diagonals; bigbird (a table layout: partial and
    full slot lists; its CAUSAL rule with 16-token tiles, element masks with larger ones) whose
    global block is read by every query tile."""
    return {"band": imggen.make_pattern("band", window=size // 2 + 3),
            "bigbird": imggen.make_pattern("bigbird", block=16, window_blocks=2, global_blocks=1, random_blocks=1,
                                           seed=5)}


@pytest.fixture
def split_rows():
    """Plans that split every transposed row longer than 2 into chunks with partial results."""
    with kplan.splitting_rows():
        yield


@pytest.mark.parametrize("kernel,bm,bn", [(k, bm, bn) for k in ("fwd", "dq", "dkdv") for bm, bn in _tiles(k)])
@pytest.mark.parametrize("name", ["band", "bigbird"])
def test_tile_configs(kernel, bm, bn, name, split_rows):
    """Each tile shape of each kernel on about two tiles' worth of tokens plus a ragged tail."""
    n = 2 * max(bm, bn) + 24
    with tuning.forced(**{kernel: tuning.Config(bm, bn, 4, 2)}):  # fp16: the other kernels run large tiles
        _check_against_floor(_tile_patterns(n)[name], torch.float16, b=1, h=2, n=n, d=32)


def _diffuser_64(n):
    """Random keys per block of 64 queries: every diffuser tile keeps the DIFFUSER rule."""
    return imggen.make_pattern("diffuser", window=n // 3, global_tokens=5, random_edges=4, steps=4, alpha=0.15,
                               seed=2, block=64)


@pytest.mark.parametrize("bm,bn", _tiles("diffuser"))
def test_diffuser_tile_configs(bm, bn, split_rows):
    n = 2 * max(bm, bn) + 40
    with tuning.forced(diffuser=tuning.Config(bm, bn, 4, 2)):
        _check_against_floor(_diffuser_64(n), torch.float16, b=1, h=2, n=n, d=32)


@pytest.mark.parametrize("kernel", ["fwd", "dq", "dkdv"])
def test_softmax_on_a_diffuser_graph(kernel, split_rows):
    """One softmax attention over the diffuser's graph (the bench's peer of the diffuser): the
    DIFFUSER rule in the softmax kernels, each kernel at a tile shape that keeps it."""
    n = 100
    p = _diffuser_64(n)
    q, k, v, do = _inputs(1, 2, n, 32)
    mask = p.masks(n, 2)
    want = _run(lambda a, b, c: torch.softmax((a @ b.transpose(-1, -2) / 32 ** 0.5).masked_fill(~mask, -torch.inf), -1)
                @ c, q, k, v, do, torch.float64, "cpu")
    key = ksparse._plan_key(p, n, 2, None, DEV)
    tile = next(c for c in tuning.candidates(kernel, 64, torch.float16) if keeps_rule(p, 64, c.bm, c.bn))
    with tuning.forced(**{kernel: tile}):
        got = _run(lambda a, b, c: ksparse.bsa_fwd(a, b, c, key)[0], q, k, v, do, torch.float32, DEV)
    assert make_plan(p, n, 2, 64, tile.bm, tile.bn, DEV).spec.rule == KernelRule.DIFFUSER
    for w, g in zip(want, got):
        assert (w - g).abs().max() < 1e-5


def test_plans_split_tiles_and_rows():
    """Partial slots come first and 'full' slots are exactly the all-allowed tiles; a key tile read
    by every query tile (bigbird's global block) is split into chunks with partial results."""
    p = imggen.make_pattern("bigbird", block=32, window_blocks=2, global_blocks=1, random_blocks=1, seed=5)
    n, bm, bn = 700, 16, 32
    plan = make_plan(p, n, 2, 32, bm, bn, "cpu")
    assert plan.spec.rule == KernelRule.CAUSAL and plan.ns > 0 and plan.nparts > 0
    masks = p.masks(n, 2)
    for h in range(2):
        for qb in range(plan.nqb):
            npart, total = plan.cnt[h, qb].tolist()
            for s in range(total):
                kb = int(plan.lay[h, qb, s])
                tile = masks[h, qb * bm:(qb + 1) * bm, kb * bn:(kb + 1) * bn]
                full = tile.all().item() and (qb + 1) * bm <= n and tile.shape[1] == bn
                assert full == (s >= npart), (h, qb, s)
        items = plan.items[h][plan.items[h, :, 0] >= 0]
        for kb in range(plan.nkb):  # the items of each key tile cover its transposed row once
            mine = items[items[:, 0] == kb]
            covered = sorted(t for _, a, b, _ in mine.tolist() for t in range(a, b))
            assert covered == list(range(int(plan.tcnt[h, kb, 1])))


def test_layout_block_and_rule_fallback():
    bb = imggen.make_pattern("bigbird", block=64)
    assert layout_block(bb, None) == 64 and layout_block(PATTERNS["band"](), None) == 128
    assert layout_block(imggen.make_pattern("bigbird", block=12), None) == kplan.DEFAULT_BLOCK
    assert keeps_rule(bb, 64, 64, 32) and not keeps_rule(bb, 64, 128, 64)  # CAUSAL needs tiles dividing 64
    assert keeps_rule(PATTERNS["band"](), 128, 128, 64)
    with pytest.raises(ShapeError, match="block"):
        layout_block(bb, 48)


def test_bigbird_heads_have_their_own_random_blocks():
    p = PATTERNS["bigbird"]()
    plan = make_plan(p, 130, 2, 16, 16, 16, "cpu")
    assert plan.hl == 2 and not torch.equal(plan.lay[0], plan.lay[1])
    _check_against_floor(p, torch.float32, n=130)


def test_dispatch_from_imggen():
    q, k, v, _ = (t.float() for t in _inputs(1, 2, 40, 32))
    p = PATTERNS["band"]()
    out = imggen.sparse_attention(q, k, v, p, backend="triton", block=16)
    assert torch.allclose(out, reference_attention(q, k, v, p), atol=1e-5)


def test_strided_view_inputs():
    """q, k, v as transposed views of a (B, N, H, D) tensor (contiguous only in the last dim)."""
    x = torch.randn(2, 40, 2, 3 * 32)
    q, k, v = (t.transpose(1, 2) for t in x.split(32, dim=-1))
    for p in (PATTERNS["local2d"](), PATTERNS["diffuser"]()):
        out = kernels.sparse_attention(q, k, v, p)
        assert torch.allclose(out, reference_attention(q, k, v, p), atol=1e-5)


@pytest.mark.parametrize("name", ["band", "diffuser"])
def test_torch_compile(name):
    """The custom ops trace (fake impls) and keep their autograd under torch.compile."""
    p = PATTERNS[name]()
    q, k, v, do = (t.float() for t in _inputs(1, 2, 40, 32))
    f = lambda a, b, c: kernels.sparse_attention(a, b, c, p)  # noqa: E731
    got = _run(torch.compile(f, backend="aot_eager"), q, k, v, do, torch.float32, DEV)
    want = _run(f, q, k, v, do, torch.float32, DEV)
    for g, w in zip(got, want):
        assert torch.allclose(g, w, atol=1e-6)


# ---------------------------------------------------------------------------------- decode
@pytest.mark.parametrize("dtype,d,bias_shape,length", [(torch.float32, 64, "b1l", 150), (torch.float16, 32, "1hl", 150),
                                                       (torch.float32, 128, "bhl", 150),
                                                       (torch.float32, 32, "b1l", 2000)])
def test_decode_matches_reference(dtype, d, bias_shape, length):
    b, h = (2, 3) if length < 1000 else (1, 1)  # one (b, h) and a long ring: more splits than one combine step
    g = torch.Generator().manual_seed(1)
    q = torch.randn(b, h, d, generator=g)
    kc = torch.randn(b, h, length, d, generator=g)
    vc = torch.randn(b, h, length, d, generator=g)
    shape = {"b1l": (b, 1, length), "1hl": (1, h, length), "bhl": (b, h, length)}[bias_shape]
    bias = torch.where(torch.rand(shape, generator=g) < 0.4, 0.0, float("-inf"))
    if bias_shape == "bhl":
        bias[1, 2] = float("-inf")  # a query with nothing to read -> zeros
    ref = kernels.decode_attention_reference(q.double(), kc.double(), vc.double(), bias.double())
    floor = kernels.decode_attention_reference(q.to(dtype), kc.to(dtype), vc.to(dtype), bias)
    got = kernels.decode_attention(*(t.to(device=DEV, dtype=dtype) for t in (q, kc, vc)), bias.to(DEV)).cpu()
    assert torch.isfinite(got).all()
    err, noise = (got.double() - ref).abs().max().item(), (floor.double() - ref).abs().max().item()
    assert err <= 2 * noise + EPS[dtype]
    if bias_shape == "bhl":
        assert (got[1, 2] == 0).all()


def test_decode_ring_order_is_arbitrary():
    """Permuting the ring's slots (with their bias) does not change the result."""
    b, h, length, d = 1, 2, 70, 32
    q, kc, vc = torch.randn(b, h, d), torch.randn(b, h, length, d), torch.randn(b, h, length, d)
    bias = torch.zeros(1, 1, length)
    bias[..., 5:20] = float("-inf")
    perm = torch.randperm(length)
    a = kernels.decode_attention(q, kc, vc, bias)
    c = kernels.decode_attention(q, kc[:, :, perm], vc[:, :, perm], bias[..., perm])
    assert torch.allclose(a, c, atol=1e-5)


# ---------------------------------------------------------------------------------- errors
def _qkv(*shape, dtype=torch.float32):
    return [torch.randn(*shape, dtype=dtype) for _ in range(3)]


@pytest.mark.parametrize("case,match", [
    ("dtype", "dtype"), ("headdim", "head dim"), ("shape", "one shape"), ("stride", "contiguous"),
    ("mixed", "dtype"), ("rank", r"\(B, H, N, D\)"), ("fp32_d128", "no kernel configuration")])
def test_launcher_errors(case, match):
    p = PATTERNS["band"]()
    q, k, v = _qkv(1, 2, 20, 32)
    if case == "fp32_d128":  # IEEE fp32 dots spill at every tile shape on sm_90: refused, not launched
        q, k, v = _qkv(1, 2, 20, 128)
    elif case == "dtype":
        q, k, v = _qkv(1, 2, 20, 32, dtype=torch.float64)
    elif case == "headdim":
        q, k, v = _qkv(1, 2, 20, 48)
    elif case == "shape":
        k = torch.randn(1, 2, 21, 32)
    elif case == "stride":
        q = torch.randn(1, 2, 32, 20).transpose(-1, -2)
    elif case == "mixed":
        v = v.half()
    elif case == "rank":
        q, k, v = _qkv(2, 20, 32)
    with pytest.raises(ShapeError, match=match):
        kernels.sparse_attention(q, k, v, p)


def test_tile_errors_and_any_pattern_block():
    q, k, v = _qkv(1, 2, 20, 32)
    with pytest.raises(ShapeError, match="block"):
        kernels.sparse_attention(q, k, v, PATTERNS["band"](), block=48)
    # a bigbird block that is no tile size runs on per-tile element masks
    _check_against_floor(imggen.make_pattern("bigbird", block=12, window_blocks=2, random_blocks=1), torch.float32,
                         n=60, block=16)


@pytest.mark.parametrize("case", ["bias_shape", "bias_dtype", "cache_shape", "headdim"])
def test_decode_errors(case):
    q, kc, vc, bias = torch.randn(2, 2, 32), torch.randn(2, 2, 10, 32), torch.randn(2, 2, 10, 32), torch.zeros(2, 2, 10)
    if case == "bias_shape":
        bias = torch.zeros(2, 2, 11)
    elif case == "bias_dtype":
        bias = torch.zeros(2, 2, 10, dtype=torch.bool)
    elif case == "cache_shape":
        vc = torch.randn(2, 2, 9, 32)
    elif case == "headdim":
        q, kc, vc = torch.randn(2, 2, 40), torch.randn(2, 2, 10, 40), torch.randn(2, 2, 10, 40)
    with pytest.raises(ShapeError):
        kernels.decode_attention(q, kc, vc, bias)


# ---------------------------------------------------------------------------------- GPU only
gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA (bf16 is not supported by the Triton interpreter)")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("name", list(PATTERNS))
@pytest.mark.parametrize("dtype,d", [(torch.bfloat16, 64), (torch.float16, 128)])
def test_gpu_matches_reference(name, dtype, d):
    p = PATTERNS[name]()
    if name in ("bigbird", "diffuser"):  # blocks of 64 on the GPU
        params = {k: v for k, v in p.params().items() if k != "kind"}
        p = imggen.make_pattern(p.name, **{**params, "block": 64})
    n = min(1000, p.max_length() or 1000)  # local2d patterns are made for one image size
    _check_against_floor(p, dtype, b=2, h=4, n=n, d=d, device="cuda")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["fwd", "dq", "dkdv"])
def test_gpu_every_config(kernel):
    """Each configuration the autotuner may pick, bf16 D=64, band and bigbird (a split global row)."""
    for cfg in tuning.candidates(kernel, 64, torch.bfloat16):
        with tuning.forced(**{kernel: cfg}):
            for p in _tile_patterns(2000).values():
                _check_against_floor(p, torch.bfloat16, b=2, h=4, n=2000, d=64, device="cuda")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("d", [32, 64])
def test_gpu_diffuser_bf16_selfcheck(d):
    """The self-check backend 'auto' runs, at the case an H200 failed (dQ 3.3x the dense bf16
    reference's error at D=32) while dS's row sums came from the bf16-rounded diffusion states."""
    p = imggen.make_pattern("diffuser", window=64, global_tokens=16, random_edges=8, steps=5, alpha=0.1)
    triton_selfcheck(p, torch.bfloat16, d, "cuda")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype,d", [(torch.bfloat16, 32), (torch.bfloat16, 64), (torch.float16, 128), (torch.float32, 64)])
def test_gpu_decode_selfcheck(dtype, d):
    """The first-use check sampling runs before it trusts the decode kernel."""
    from imggen.decode import decode_selfcheck
    decode_selfcheck(kernels.decode_attention, dtype, d, "cuda")


@gpu
@pytest.mark.gpu
def test_gpu_decode_bf16():
    q, kc, vc = torch.randn(2, 4, 64), torch.randn(2, 4, 5000, 64), torch.randn(2, 4, 5000, 64)
    bias = torch.zeros(2, 1, 5000)
    ref = kernels.decode_attention_reference(q.double(), kc.double(), vc.double(), bias.double())
    got = kernels.decode_attention(*(t.cuda().bfloat16() for t in (q, kc, vc)), bias.cuda()).double().cpu()
    assert (got - ref).abs().max() < 2e-2


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["band", "diffuser"])
def test_gpu_torch_compile_inductor(name):
    p = PATTERNS[name]()
    if name == "diffuser":
        params = {k: v for k, v in p.params().items() if k != "kind"}
        p = imggen.make_pattern(p.name, **{**params, "block": 64})
    q, k, v, do = (t.float() for t in _inputs(1, 2, 300, 64))
    f = lambda a, b, c: kernels.sparse_attention(a, b, c, p)  # noqa: E731
    got = _run(torch.compile(f), q, k, v, do, torch.bfloat16, "cuda")
    want = _run(f, q, k, v, do, torch.bfloat16, "cuda")
    for g, w in zip(got, want):
        assert torch.allclose(g, w, atol=1e-2, rtol=1e-2)


# ---------------------------------------------------------------------------------- sm_90 build
@pytest.mark.slow
def test_kernels_compile_for_sm90():
    """The interpreter never runs the compiler: compile the quick subset of kernel variants for sm_90
    (no GPU needed) and hold them to the limits (no spills in hot kernels, shared memory <= 227 KB).
    The full set (`python -m imggen.kernels.aot_check`) runs as its own step in .ci/run."""
    pytest.importorskip("triton.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "imggen.kernels.aot_check", "--quick", "--json", "--jobs", "2"], env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    rows = json.loads(r.stdout)
    assert rows and all("error" not in x for x in rows)
    assert all(x["shared"] <= tuning.SMEM_LIMIT for x in rows)
    assert all(x["spill_stores"] == 0 == x["spill_loads"] for x in rows if x["hot"])
