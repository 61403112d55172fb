"""imggen.cpu_ops: the C GELU (tanh) kernels against torch's GELU, forward and backward, float32 and
bfloat16, awkward sizes and strides; the autograd GELU; the fallback where the kernels are off."""
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from imggen import cpu_ops
from imggen.fused import ln_mlp

needs_c = pytest.mark.skipif(not cpu_ops.available(), reason="no C compiler: the C GELU is unavailable")


def ref(h, dy):
    """torch's GELU and its gradient in float64."""
    h64 = h.double().requires_grad_()
    y = F.gelu(h64, approximate="tanh")
    y.backward(dy.double())
    return y.detach(), h64.grad


@needs_c
@pytest.mark.parametrize("n", [1, 15, 16, 17, 250, 4099])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_match_torch(n, dtype):
    g = torch.Generator().manual_seed(n)
    h = (torch.randn(n, generator=g) * 4).to(dtype)
    h[0] = 0.0
    if n > 3:
        h[1], h[2] = 30.0, -30.0  # saturated both ways
    dy = torch.randn(n, generator=g).to(dtype)
    y, dx = cpu_ops.gelu_forward(h), cpu_ops.gelu_backward(dy, h)
    assert y.dtype == dx.dtype == dtype and y.shape == dx.shape == (n,)
    want_y, want_dx = ref(h, dy)
    if dtype == torch.float32:  # float32 rounding: at most a few units of 1e-7 relative to the scale
        assert torch.allclose(y.double(), want_y, rtol=1e-5, atol=1e-6)
        assert torch.allclose(dx.double(), want_dx, rtol=1e-5, atol=1e-5 * dy.abs().max().item())
    else:  # the float64 result rounded to bfloat16, give or take one unit in the last place
        for got, want in ((y, want_y), (dx, want_dx)):
            ulp = want.to(torch.bfloat16).double().abs().clamp_min(1e-30) * 2.0 ** -7
            assert ((got.double() - want).abs() <= ulp + 1e-6).all()
        # and torch's own bfloat16 GELU differs from it by at most one unit, too
        assert ((y.double() - F.gelu(h, approximate="tanh").double()).abs()
                <= F.gelu(h, approximate="tanh").double().abs() * 2.0 ** -7 + 1e-6).all()


@needs_c
def test_non_contiguous_inputs_and_2d_shapes():
    g = torch.Generator().manual_seed(1)
    h = torch.randn(33, 20, generator=g).t()  # (20, 33), not contiguous
    dy = torch.randn(33, 20, generator=g).t()
    y, dx = cpu_ops.gelu_forward(h), cpu_ops.gelu_backward(dy, h)
    want_y, want_dx = ref(h, dy)
    assert y.shape == dx.shape == (20, 33)
    assert torch.allclose(y.double(), want_y, atol=1e-6) and torch.allclose(dx.double(), want_dx, atol=1e-5)


@needs_c
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_autograd_gelu_runs_the_kernels_and_matches_torch(dtype, monkeypatch):
    calls = []
    lib = cpu_ops._lib

    def spy(name):
        def call(*args):
            calls.append(name)
            return getattr(lib, name)(*args)
        return call
    monkeypatch.setattr(cpu_ops, "_lib", SimpleNamespace(**{name: spy(name) for pair in cpu_ops._KERNELS.values()
                                                            for name in pair}))
    g = torch.Generator().manual_seed(2)
    h0 = (torch.randn(6, 37, generator=g) * 3).to(dtype)
    dy = torch.randn(6, 37, generator=g).to(dtype)
    h = h0.clone().requires_grad_()
    cpu_ops.gelu(h).backward(dy)
    t = h0.clone().requires_grad_()
    F.gelu(t, approximate="tanh").backward(dy)
    assert sorted(calls) == sorted(cpu_ops._KERNELS[dtype])  # one forward, one backward, in C
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(h.grad.double(), t.grad.double(), rtol=tol, atol=tol)


def test_fallback_is_torch_where_the_kernels_are_off(monkeypatch):
    monkeypatch.setattr(cpu_ops, "_lib", False)
    h = torch.randn(5, 7, requires_grad=True)
    y = cpu_ops.gelu(h)
    assert torch.equal(y, F.gelu(h, approximate="tanh"))
    dy = torch.randn(5, 7)
    assert torch.equal(cpu_ops.gelu_backward(dy, h.detach()), torch.ops.aten.gelu_backward(dy, h.detach(),
                                                                                           approximate="tanh"))
    h64 = torch.randn(4, dtype=torch.float64)  # float64 is never the kernels'
    assert torch.equal(cpu_ops.gelu_forward(h64), F.gelu(h64, approximate="tanh"))


def test_imggen_native_0_turns_them_off(monkeypatch):
    monkeypatch.setattr(cpu_ops, "_lib", None)
    monkeypatch.setenv("IMGGEN_NATIVE", "0")
    assert not cpu_ops.available()


@needs_c
def test_fused_mlp_with_the_c_gelu_matches_the_modules(monkeypatch):
    """ln_mlp's memory-lean path (its own backward, GELU recomputed) and its plain path against
    fc2(gelu(fc1(ln(x)))) of torch's modules, outputs and every gradient, float32."""
    import imggen.fused as fused
    torch.manual_seed(3)
    ln, fc1, fc2 = torch.nn.LayerNorm(24), torch.nn.Linear(24, 96), torch.nn.Linear(96, 24)
    params = [*ln.parameters(), *fc1.parameters(), *fc2.parameters()]
    x0 = torch.randn(2, 50, 24)

    def grads(f):
        for p in params:
            p.grad = None
        x = x0.clone().requires_grad_()
        out = f(x)
        out.pow(2).sum().backward()
        return [out, x.grad] + [p.grad.clone() for p in params]

    want = grads(lambda x: fc2(F.gelu(fc1(ln(x)), approximate="tanh")))
    for lean in (False, True):
        monkeypatch.setattr(fused, "saves", lambda nbytes, lean=lean: not lean)
        for a, b in zip(grads(lambda x: ln_mlp(x, ln, fc1, fc2)), want):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-5), (lean, (a - b).abs().max())


@needs_c
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_in_place_writes_over_dy(dtype):
    g = torch.Generator().manual_seed(4)
    h, dy = torch.randn(3, 41, generator=g).to(dtype), torch.randn(3, 41, generator=g).to(dtype)
    want = cpu_ops.gelu_backward(dy, h)
    buf = dy.clone()
    got = cpu_ops.gelu_backward(buf, h, inplace=True)
    assert got.data_ptr() == buf.data_ptr() and torch.equal(got, want)
    strided = torch.stack([dy, dy], -1)[..., 0]  # not contiguous: a new tensor, dy untouched
    got = cpu_ops.gelu_backward(strided, h, inplace=True)
    assert got.data_ptr() != strided.data_ptr() and torch.equal(strided, dy) and torch.equal(got, want)


def test_a_failed_build_warns_once_and_falls_back(monkeypatch):
    from imggen import cbuild

    def broken(*a, **k):
        raise RuntimeError("cc failed: no such compiler")
    monkeypatch.setattr(cpu_ops, "_lib", None)
    monkeypatch.delenv("IMGGEN_NATIVE", raising=False)
    monkeypatch.setattr(cbuild, "build", broken)
    with pytest.warns(RuntimeWarning, match="C GELU kernels are unavailable .*no such compiler.*torch's GELU"):
        assert not cpu_ops.available()
    assert not cpu_ops.available()  # tried once per process: no second warning
    h = torch.randn(6, requires_grad=True)
    assert torch.equal(cpu_ops.gelu(h), F.gelu(h, approximate="tanh"))


@needs_c
@pytest.mark.parametrize("n", [65536, 65536 - 5])
def test_bf16_tables_equal_the_vector_kernels_on_every_input(n):
    """The bfloat16 kernels look their results up: bit for bit what the vector kernels compute, for
    each of the 65,536 bfloat16 inputs (inf and NaN included), forward and backward, tail included."""
    h = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)[:n]
    dy = torch.randn(n, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    lib, (fwd, bwd), (fwd_d, bwd_d) = cpu_ops._lib, cpu_ops._KERNELS[torch.bfloat16], cpu_ops._DIRECT
    got, want = torch.empty_like(h), torch.empty_like(h)
    getattr(lib, fwd)(h.data_ptr(), got.data_ptr(), n)
    getattr(lib, fwd_d)(h.data_ptr(), want.data_ptr(), n)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    getattr(lib, bwd)(dy.data_ptr(), h.data_ptr(), got.data_ptr(), n)
    getattr(lib, bwd_d)(dy.data_ptr(), h.data_ptr(), want.data_ptr(), n)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    finite = h.isfinite()  # and the tables agree with torch's float64 GELU to one bfloat16 unit
    want_y = F.gelu(h[finite].double(), approximate="tanh")
    y = cpu_ops.gelu_forward(h)[finite].double()
    assert ((y - want_y).abs() <= want_y.to(torch.bfloat16).double().abs() * 2.0 ** -7 + 1e-6).all()
