"""The flex backend against the reference, the self-checking `auto` choice on CUDA (its fallback
exercised by a failing check), and IMGGEN_BACKEND in the library and the CLIs."""
import os
import subprocess
import sys

import pytest
import torch

import imggen
from imggen import attention as A
from imggen.errors import ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATTERNS = {
    "full": {},
    "band": dict(window=37),
    "local2d": dict(height=5, width=30, channels=3, radius=2, shift=1),
    "bigbird": dict(block=16, window_blocks=1, global_blocks=1, random_blocks=2, seed=3),
    "diffuser": dict(window=10, global_tokens=3, random_edges=3, steps=3, alpha=0.2, seed=1, block=16),
    "strided": dict(stride=9, shift=1),
}


@pytest.mark.parametrize("kind", list(PATTERNS))
def test_flex_forward_equals_reference(kind):
    """Compiled FlexAttention on CPU, awkward N, B > 1, H > 1, per-head random edges."""
    p = imggen.make_pattern(kind, **PATTERNS[kind]).for_layer(1)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 227, 32, generator=g) for _ in range(3))
    with torch.no_grad():
        got = imggen.sparse_attention(q, k, v, p, backend="flex")
    ref = imggen.sparse_attention(q.double(), k.double(), v.double(), p, backend="reference")
    assert (got.double() - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_flex_when_rows_read_fewer_blocks_than_there_are():
    """A band over many blocks: the plan lists 2 key blocks per row, FlexAttention wants one column per
    key block (its CPU lowering refused the short table at N=4096)."""
    p = imggen.make_pattern("band", window=20)
    q, k, v = (torch.randn(1, 1, 700, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    with torch.no_grad():
        got = imggen.sparse_attention(q, k, v, p, backend="flex")
    ref = imggen.sparse_attention(q.double(), k.double(), v.double(), p, backend="reference")
    assert (got.double() - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_flex_block_mask_matches_the_pattern():
    """The BlockMask's blocks cover the mask exactly; its full blocks need no mask_mod."""
    from imggen.attention.flex import block_mask
    p = imggen.make_pattern("bigbird", block=32, window_blocks=2, random_blocks=2).for_layer(2)
    n, h = 300, 2
    bm = block_mask(p, n, h, "cpu")
    for head in range(h):
        mask = p.mask(n, head)
        dense = bm.to_dense()[0, head].repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :n].bool()
        assert not (mask & ~dense).any()  # every allowed pair lies in a listed block
        full = torch.zeros_like(dense)
        for qb in range(bm.full_kv_num_blocks.shape[-1]):
            for kb in bm.full_kv_indices[0, head, qb, : bm.full_kv_num_blocks[0, head, qb]].tolist():
                full[qb * 128:(qb + 1) * 128, kb * 128:(kb + 1) * 128] = True
        assert mask[full[:n, :n]].all()


def test_flex_has_no_cpu_backward():
    q = torch.randn(1, 2, 40, 16, requires_grad=True)
    with pytest.raises(ConfigError, match="cpu"):
        imggen.sparse_attention(q, q, q, imggen.make_pattern("band", window=8), backend="flex")


def test_auto_falls_back_to_flex_with_one_warning(monkeypatch):
    monkeypatch.setattr(A, "on_gpu", lambda q: True)  # pretend: a CUDA tensor
    monkeypatch.setattr(A, "_CHECKED", {})

    def broken(*a, **kw):
        raise RuntimeError("out of resources: shared memory")

    monkeypatch.setattr(A, "triton_selfcheck", broken)
    p = imggen.make_pattern("band", window=9)
    q, k, v = (torch.randn(1, 2, 50, 16) for _ in range(3))
    with pytest.warns(RuntimeWarning, match="band attention, float32, head dim 16.*shared memory.*FlexAttention") as rec:
        with torch.no_grad():
            a = imggen.sparse_attention(q, k, v, p, backend="auto")
            b = imggen.sparse_attention(q, k, v, p, backend="auto")  # cached: no second check, no warning
    # ours only: torch.compile of flex may add RuntimeWarnings of its own (newer torch on Python 3.13)
    assert len([w for w in rec if str(w.message).startswith("imggen:")]) == 1
    ref = imggen.sparse_attention(q, k, v, p, backend="reference")
    torch.testing.assert_close(a, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(b, ref, atol=1e-5, rtol=1e-5)


def test_auto_uses_triton_when_its_check_passes(monkeypatch):
    monkeypatch.setattr(A, "on_gpu", lambda q: True)
    monkeypatch.setattr(A, "_CHECKED", {})
    calls = []
    monkeypatch.setattr(A, "triton_selfcheck", lambda *a, **kw: calls.append(a))
    p = imggen.make_pattern("band", window=9)
    q = torch.randn(1, 2, 50, 32)
    assert A.resolve_backend("auto", q, p) == "triton" and A.resolve_backend("auto", q, p) == "triton"
    assert len(calls) == 1


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter")
def test_selfcheck_passes_on_the_interpreter_and_catches_a_wrong_kernel(monkeypatch):
    p = imggen.make_pattern("local2d", height=4, width=9, channels=1, radius=1, shift=1)
    A.triton_selfcheck(p, torch.float32, 32, "cpu", n=36)
    from imggen import kernels
    real = kernels.sparse_attention
    monkeypatch.setattr(kernels, "sparse_attention", lambda q, k, v, pat: real(q, k, v, pat) * 1.001)
    with pytest.raises(AssertionError, match="output differs"):
        A.triton_selfcheck(p, torch.float32, 32, "cpu", n=36)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter")
def test_selfcheck_runs_the_split_row_path(monkeypatch):
    """Large N splits long transposed rows (a global block's) and sums the parts in a flush kernel;
    the self-check forces that path at its small N, so a broken flush fails it."""
    from imggen.kernels import sparse_ops
    p = imggen.make_pattern("bigbird", block=16, window_blocks=1, global_blocks=1, random_blocks=1, seed=3)
    A.triton_selfcheck(p, torch.float32, 32, "cpu", n=120)
    monkeypatch.setattr(sparse_ops, "_flush", lambda plan, parts, out: None)
    with pytest.raises(AssertionError, match="with split rows differs"):
        A.triton_selfcheck(p, torch.float32, 32, "cpu", n=120)


def _decode_inputs(d=32, length=40):
    q, k, v = torch.randn(2, 3, d), torch.randn(2, 3, length, d), torch.randn(2, 3, length, d)
    bias = torch.where(torch.rand(1, 3, length) < 0.3, float("-inf"), 0.0)
    bias[..., -1] = 0.0
    return q, k, v, bias


@pytest.mark.parametrize("how", ["raises", "wrong"])
def test_decode_kernel_that_fails_its_check_is_not_used(monkeypatch, how):
    """A decode kernel that fails to compile or computes something else on the user's GPU: one
    warning, then the PyTorch decode path (the same answer), never a crash."""
    from imggen import decode as Dm
    monkeypatch.setattr(A, "on_gpu", lambda q: True)  # pretend: a CUDA tensor
    monkeypatch.setattr(A, "_KERNEL_OK", {})
    calls = []

    def kernel(q, k, v, bias):
        calls.append(k.shape[2])
        if how == "raises":
            raise RuntimeError("out of resources: shared memory")
        return Dm.decode_attention_reference(q, k, v, bias) * 1.01

    monkeypatch.setattr(A, "_KERNEL", kernel)
    q, k, v, bias = _decode_inputs()
    with pytest.warns(RuntimeWarning, match="decode kernel for float32, head dim 32 failed the self-check") as rec:
        a = Dm.decode_attention(q, k, v, bias)
        b = Dm.decode_attention(q, k, v, bias)  # remembered: no second check, no warning
    assert len([w for w in rec if str(w.message).startswith("imggen:")]) == 1
    assert calls == [333]  # only the self-check's call
    ref = Dm.decode_attention_reference(q, k, v, bias)
    torch.testing.assert_close(a, ref)
    torch.testing.assert_close(b, ref)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter")
def test_decode_kernel_that_passes_its_check_is_used(monkeypatch):
    from imggen import decode as Dm
    from imggen import kernels
    monkeypatch.setattr(A, "on_gpu", lambda q: True)
    monkeypatch.setattr(A, "_KERNEL_OK", {})
    calls = []

    def kernel(*a):
        calls.append(a[1].shape[2])
        return kernels.decode_attention(*a)

    monkeypatch.setattr(A, "_KERNEL", kernel)
    q, k, v, bias = _decode_inputs()
    got = Dm.decode_attention(q, k, v, bias)
    assert calls == [333, 40]  # the self-check, then the call itself
    torch.testing.assert_close(got, Dm.decode_attention_reference(q, k, v, bias), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("env", ["reference", "cpu", "flex", "triton"])
def test_imggen_backend_forces_one_everywhere(monkeypatch, env):
    monkeypatch.setenv("IMGGEN_BACKEND", env)
    q = torch.randn(1, 1, 4, 8)
    assert A.resolve_backend("auto", q, imggen.make_pattern("full")) == env
    assert A.resolve_backend("cpu", q, imggen.make_pattern("full")) == env


def _cli(args, env):
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "IMGGEN_BACKEND": env})


@pytest.mark.slow
def test_clis_honour_imggen_backend(tmp_path):
    small = ["--preset", "brats", "--data", "brats-demo", "--model.height", "8", "--model.width", "8",
             "--model.dim", "16", "--model.layers", "1", "--model.heads", "2", "--attention", "band",
             "--steps", "2", "--batch-size", "2", "--limit", "8", "--train.eval_images", "2",
             "--train.sample_num", "1", "--no-progress", "--out", str(tmp_path / "run")]
    r = _cli(["train.py", *small], "flex")  # flex cannot train on CPU: the forced backend was used
    assert r.returncode == 2 and "flex backend has no backward pass on CPU" in r.stderr
    assert _cli(["train.py", *small], "reference").returncode == 0
    for args in (["sample.py", "--checkpoint", str(tmp_path / "run"), "--num", "1", "--out", str(tmp_path / "s.png")],
                 ["-m", "imggen.eval", "bpd", "--checkpoint", str(tmp_path / "run"), "--limit", "2"]):
        r = _cli(args, "bogus")
        assert r.returncode == 2 and "IMGGEN_BACKEND='bogus'" in r.stderr, r.stderr
        assert _cli(args, "reference").returncode == 0


@pytest.mark.parametrize("name, kw", [
    ("band", dict(window=4)), ("local2d", dict(height=4, width=4, radius=1)),
    ("bigbird", dict(block=4, window_blocks=2, global_blocks=1, random_blocks=1)),
    ("diffuser", dict(window=4, global_tokens=2, random_edges=2, steps=3, alpha=0.2))])
def test_cpu_backend_keeps_float64_precision(name, kw):
    """float64 in, float64 math: gradcheck passes (softmax is not narrowed to float32)."""
    p = imggen.make_pattern(name, **kw)
    q, k, v = (torch.randn(1, 2, 16, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out = imggen.sparse_attention(q, k, v, p, backend="cpu")
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, imggen.sparse_attention(q, k, v, p, backend="reference"), rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(lambda a, b, c: imggen.sparse_attention(a, b, c, p, backend="cpu"), (q, k, v))
