"""The static decode step (imggen.graphs, imggen.decode.static; issue 48): the position on the device,
every buffer at a fixed address, no host sync. Run eagerly here on the CPU, it must give today's
step's logits and tokens for every pattern's evicting cache and for inpainting; the CUDA-graph
replays of the same step are checked on a GPU (-m gpu)."""
import contextlib

import pytest
import torch

import imggen.decode as dec
import imggen.graphs as graphs
from imggen.config import ModelConfig
from imggen.errors import ConfigError
from imggen.model import ImageTransformer
from imggen.sampling import _pick, generate, inpaint_images, sample, teacher_force

torch.set_num_threads(1)

from test_decode import CASES  # noqa: E402  (attention, pattern parameters): the decode tests' patterns


@pytest.fixture(autouse=True)
def evicting(monkeypatch):
    # the tiny models' caches take the evicting layouts (rings, intervals) even where keeping
    # everything would take fewer bytes, so the static step is checked against eviction
    monkeypatch.setattr(dec, "NEVER_LARGER", False)


def _model(channels=1, seed=0, context="none", **kw):
    torch.manual_seed(seed)
    cfg = ModelConfig(height=5, width=7, channels=channels, bits=4, dim=32, layers=2, heads=2, backend="cpu",
                      context=context, **({"context_width": 8} if context != "none" else {}), **kw)
    model = ImageTransformer(cfg).eval()
    if context != "none":  # a trained context's features are not zero: perturb the encoder's zero inits
        with torch.no_grad():
            for p in model.context.parameters():
                p.add_(0.05 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("channels", [1, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_static_step_logits_equal_the_eager_step(case, channels):
    """Teacher-forced: the static step's logits at every position equal today's step's (fp32, 1e-5)."""
    model = _model(channels, **CASES[case])
    n = model.config.seq_len
    x = torch.randint(0, 16, (2, n), generator=torch.Generator().manual_seed(1))
    ref = teacher_force(model, x)
    d = graphs.StaticDecoder(model, 2, "evict", 1.0, None, known=False, context=False)
    d.load(torch.zeros(2, n))
    with torch.no_grad():
        got = []
        for t in range(n):
            d.seek(t)
            d.prev.copy_(x[:, t - 1] if t else d.prev)
            got.append(d.forward(d.prev, d.t))
    torch.testing.assert_close(torch.stack(got, 1), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("temperature,top_k", [(0.0, None), (1.0, None), (0.8, 5)])
@pytest.mark.parametrize("case", list(CASES))
def test_static_step_draws_the_same_tokens(case, temperature, top_k):
    model = _model(3, **CASES[case])
    kw = dict(temperature=temperature, top_k=top_k, seed=7, return_logprob=True)
    ref, ref_lp = sample(model, 3, graph="off", **kw)
    got, lp = sample(model, 3, graph="eager", **kw)
    assert torch.equal(got, ref)
    torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=1e-4)
    again, _ = sample(model, 3, graph="eager", **kw)  # the held decoder, loaded afresh
    assert torch.equal(again, ref)


@pytest.mark.parametrize("case", ["band", "local2d", "diffuser", "strided", "mixed"])
def test_static_step_inpainting_forces_known_pixels(case):
    """Holes that differ per image (steps forcing known pixels), a first row known for all (prefill)
    and a later run known for all (extend): the same fills and log-likelihoods as today's sampler."""
    model = _model(1, context="unet", **CASES[case])
    g = torch.Generator().manual_seed(3)
    images = torch.randint(0, 256, (3, 1, 5, 7), generator=g, dtype=torch.uint8)
    masks = torch.zeros(3, 5, 7, dtype=torch.bool)
    masks[0, 1:3, 2:5] = True
    masks[1, 3:, :4] = True
    masks[2, 1, :] = True
    masks[:, 2, 6] = False  # rows 2.. of image 2 and (2, 6) of all: runs known for every image
    out = {}
    for graph in ("off", "eager"):
        out[graph] = inpaint_images(model, images, masks, num=2, seed=5, graph=graph, batch_size=4)
    assert torch.equal(out["eager"][0], out["off"][0])
    torch.testing.assert_close(out["eager"][1], out["off"][1], rtol=1e-5, atol=1e-4)
    keep = ~masks[:, None, None].expand_as(out["eager"][0])
    assert torch.equal(out["eager"][0][keep], images[:, None].expand_as(out["eager"][0])[keep])


@contextlib.contextmanager
def no_host_sync(monkeypatch):
    """Any device-to-host read (what syncs a CUDA stream) raises."""
    def fail(name):
        def f(*a, **k):
            raise AssertionError(f"host sync in the static step: Tensor.{name}")
        return f
    with monkeypatch.context() as m:
        for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"):
            m.setattr(torch.Tensor, name, fail(name))
        yield


@pytest.mark.parametrize("case", list(CASES))
def test_static_step_makes_no_host_sync(case, monkeypatch):
    model = _model(1, context="unet", **CASES[case])
    n = model.config.seq_len
    d = graphs.StaticDecoder(model, 2, "evict", 0.9, 4, known=True, context=True, pick=_pick)
    feats = model.context_features(torch.zeros(2, 2, 5, 7), 2)
    d.load(torch.rand(2, n), torch.randint(0, 16, (2, n)), torch.rand(2, n) < 0.3, feats)
    with torch.no_grad(), no_host_sync(monkeypatch):
        for _ in range(n):
            d.step()
    assert int(d.t) == n and bool((d.tokens < 16).all())
    with no_host_sync(monkeypatch), pytest.raises(AssertionError, match="host sync"):
        torch.ones(1).item()  # the guard itself bites


def test_static_step_generate_reuses_its_decoder_across_chunks():
    model = _model(1, attention="local2d", radius=1)
    ref = generate(model, 5, batch_size=2, seed=3, graph="off")
    got = generate(model, 5, batch_size=2, seed=3, graph="eager")
    assert torch.equal(got[0], ref[0])
    assert len(model._static_decoders) == 2  # batch 2 and the last chunk's batch 1, held


def test_static_step_graph_modes():
    model = _model(1, attention="band", window=6)
    with pytest.raises(ConfigError, match="CUDA"):
        sample(model, 1, graph="on")
    with pytest.raises(ConfigError, match="graph="):
        sample(model, 1, graph="sometimes")
    assert graphs.use_static("auto", torch.device("cpu")) is False  # the CPU keeps its native step


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", list(CASES))
def test_cuda_graph_replays_the_eager_step(case):
    model = _model(3, **CASES[case]).cuda()
    kw = dict(temperature=1.0, seed=11)
    ref = sample(model, 4, graph="eager", **kw)
    assert torch.equal(sample(model, 4, graph="on", **kw), ref)
    assert torch.equal(sample(model, 4, graph="on", **kw), ref)  # replayed from the held graph
    small = sample(model, 3, graph="on", **kw)  # a second capture at another batch size
    assert torch.equal(small, sample(model, 3, graph="eager", **kw))
    assert not any(v is False for v in graphs._CHECKED.values())
