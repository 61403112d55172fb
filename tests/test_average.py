"""--train.ema: the weights' moving average is the run's model; the trained weights resume exactly."""
import os

import pytest
import torch
from safetensors.torch import load_file

import imggen
from imggen import checkpoint as ck
from imggen.errors import CheckpointError, ConfigError
from imggen.training import train
from imggen.training.average import WeightAverage
from test_training import run_cfg, splits


def test_the_average_follows_its_formula_and_swaps_back():
    lin = torch.nn.Linear(3, 2)
    avg = WeightAverage(lin, 0.9)
    ref = [p.detach().clone() for p in lin.parameters()]
    for step in range(5):
        with torch.no_grad():
            for p in lin.parameters():
                p.add_(torch.randn_like(p))
        avg.update(step)
        d = min(0.9, (1 + step) / (10 + step))
        ref = [d * r + (1 - d) * p.detach() for r, p in zip(ref, lin.parameters())]
    trained = [p.detach().clone() for p in lin.parameters()]
    with avg.applied():
        for p, r in zip(lin.parameters(), ref):
            torch.testing.assert_close(p.detach(), r)
    for p, t in zip(lin.parameters(), trained):
        assert torch.equal(p.detach(), t)


def weights(path):
    return load_file(f"{ck.resolve(path)}/model.safetensors")


def test_the_averaged_weights_are_saved_and_training_is_unchanged(tmp_path):
    data = splits(run_cfg())
    plain, avg = str(tmp_path / "plain"), str(tmp_path / "avg")
    train(run_cfg(), plain, data=data, progress=False)
    metrics = train(run_cfg(ema=0.5), avg, data=data, progress=False)
    state = ck.load_state(ck.resolve(avg))
    # the optimiser saw the same weights: the trained weights are the plain run's model
    for name, w in weights(plain).items():
        assert torch.equal(state["trained"][name], w), name
    saved = weights(avg)
    assert any(not torch.equal(saved[n], state["trained"][n]) for n in state["trained"])
    # what was saved (the average) is what the run's figures score
    model = imggen.load_model(avg)
    from imggen.eval.bpd import token_bits_per_dim
    test = float(token_bits_per_dim(model, data["test"], 4).mean())
    assert test == pytest.approx(metrics["test_bpd"], rel=1e-6)


def test_resume_with_an_average_continues_exactly(tmp_path):
    cfg = run_cfg(steps=6, ckpt_every=3, ema=0.7)
    data = splits(cfg)
    straight, cut = str(tmp_path / "straight"), str(tmp_path / "cut")
    train(cfg, straight, data=data, progress=False)

    def stop(step, loss):
        if step == 3:
            raise KeyboardInterrupt
        return loss

    with pytest.raises(KeyboardInterrupt):
        train(cfg, cut, data=data, progress=False, hooks={"loss": stop})
    train(run_cfg(steps=6, ckpt_every=3, ema=0.7), cut, resume=True, data=data, progress=False)
    a, b = weights(straight), weights(cut)
    assert all(torch.equal(a[n], b[n]) for n in a)
    sa, sb = ck.load_state(ck.resolve(straight)), ck.load_state(ck.resolve(cut))
    assert all(torch.equal(sa["trained"][n], sb["trained"][n]) for n in sa["trained"])


def test_bad_ema_and_bad_trained_weights_are_one_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="train.ema"):
        run_cfg(ema=1.0).validate()
    cfg = run_cfg(steps=3, ckpt_every=3, ema=0.5)
    data, out = splits(cfg), str(tmp_path / "run")
    train(cfg, out, data=data, progress=False)
    found = ck.resolve(out)
    state = torch.load(f"{found}/state.pt", weights_only=True)
    state["trained"] = {"nothing": torch.zeros(1)}
    torch.save(state, f"{found}/state.pt")
    os.remove(f"{found}/manifest.json")
    ck._write_manifest(found)  # a manifest that matches: only the state's layout stands in the way
    with pytest.raises(CheckpointError, match="trained weights"):
        train(run_cfg(steps=6, ckpt_every=3, ema=0.5), out, resume=True, data=data, progress=False)
