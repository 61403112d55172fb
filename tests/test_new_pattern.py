"""A pattern defined here, in the test file alone, runs through every backend and the decode
cache: proof that adding a pattern is one subclass (its rule) and no edits elsewhere."""
from dataclasses import dataclass

import pytest
import torch

import imggen
from imggen.config import ModelConfig
from imggen.model import ImageTransformer
from imggen.patterns import Pattern
from imggen.sampling import sample, teacher_force


@dataclass(frozen=True)
class PreviousRow(Pattern):
    """Toy: query i reads the keys of the row above it only (rows of `width` tokens), and itself."""

    name = "toy_previous_row"
    width: int = 5

    @classmethod
    def image_defaults(cls, height, width, channels):
        return {"width": width * channels}

    def rule(self, i, j, head, tables=None):
        return torch.div(j, self.width, rounding_mode="floor") == torch.div(i, self.width, rounding_mode="floor") - 1


def _grads(fn, q, k, v, g, dtype):
    x = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    o = fn(*x)
    return [o.detach().double(), *(a.double() for a in torch.autograd.grad(o, x, g.to(dtype)))]


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_new_pattern_matches_the_reference(backend):
    if backend == "triton":
        pytest.importorskip("imggen.kernels")
    p = PreviousRow(width=7)
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(2, 2, 61, 32, generator=g, dtype=torch.float64) for _ in range(4))
    ref = _grads(lambda *a: imggen.sparse_attention(*a, p, backend="reference"), q, k, v, do, torch.float64)
    got = _grads(lambda *a: imggen.sparse_attention(*a, p, backend=backend, block=16), q, k, v, do, torch.float32)
    for r, x in zip(ref, got):
        assert ((x - r).abs().max() / r.abs().max()) <= 1e-5


def test_new_pattern_flex_forward():
    p = PreviousRow(width=7)
    q, k, v = (torch.randn(2, 2, 61, 32) for _ in range(3))
    with torch.no_grad():
        got = imggen.sparse_attention(q, k, v, p, backend="flex")
    torch.testing.assert_close(got, imggen.sparse_attention(q, k, v, p, backend="reference"), atol=1e-5, rtol=1e-5)


def test_new_pattern_in_a_model_with_the_decode_cache(monkeypatch):
    import imggen.decode as dec
    monkeypatch.setattr(dec, "DEBUG", True)  # every slot reuse checked against the mask
    torch.manual_seed(0)
    model = ImageTransformer(ModelConfig(height=4, width=6, channels=3, bits=4, dim=32, layers=2, heads=2,
                                         attention="toy_previous_row,band", window=5, backend="cpu")).eval()
    x = torch.randint(0, 16, (2, model.config.seq_len))
    with torch.no_grad():
        ref = model(x)
    assert (teacher_force(model, x) - ref).abs().max() <= 1e-4
    assert (teacher_force(model, x, prefill=30) - ref).abs().max() <= 1e-4
    caches = dec.make_caches(model, 1)
    assert caches[0].capacity < model.config.seq_len  # evicts: rows older than the previous one
    assert torch.equal(sample(model, 2, top_k=1), sample(model, 2, top_k=1, cache="full"))
