"""What a new user hits: Ctrl-C during training, --resume without a checkpoint, bad numbers on the
command line, sequences longer than a pattern's image, and activation checkpointing."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import imggen
from imggen.config import Config, DataConfig, ModelConfig, TrainConfig
from imggen.errors import ShapeError
from imggen.training import build_model_and_optimizer, train_step

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--preset", "brats", "--data", "brats-demo", "--model.height", "8", "--model.width", "8",
         "--model.dim", "16", "--model.layers", "1", "--model.heads", "2", "--attention", "band",
         "--batch-size", "2", "--limit", "8", "--train.eval_images", "2", "--train.sample_num", "1",
         "--train.log_every", "1", "--train.eval_every", "1000", "--train.ckpt_every", "1000", "--no-progress"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _train(args, **kw):
    return subprocess.run([sys.executable, "train.py", *SMALL, *args], cwd=REPO, capture_output=True, text=True,
                          env=ENV, **kw)


def _steps(run):
    return [json.loads(line)["step"] for line in open(os.path.join(run, "log.jsonl")) if "train_bpd" in line]


@pytest.mark.slow
def test_sigint_saves_and_resume_continues(tmp_path):
    run = str(tmp_path / "run")
    proc = subprocess.Popen([sys.executable, "train.py", *SMALL, "--steps", "100000", "--out", run], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    log = os.path.join(run, "log.jsonl")
    deadline = time.time() + 120
    while time.time() < deadline and not (os.path.exists(log) and len(open(log).readlines()) >= 3):
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("interrupted at step ") and last.endswith("saved; continue with --resume"), err[-2000:]
    assert "Traceback" not in err
    stopped = int(last.split()[3].rstrip(","))
    assert imggen.load_model(run) is not None
    assert _steps(run)[-1] == stopped
    r = _train(["--steps", str(stopped + 3), "--out", run, "--resume"])
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"resumed {run} at step {stopped}" in r.stdout
    steps = _steps(run)
    assert steps == sorted(set(steps)) and steps[-1] == stopped + 3  # no duplicate rows


def test_resume_without_checkpoint_is_one_line(tmp_path):
    r = _train(["--steps", "2", "--out", str(tmp_path / "empty"), "--resume"])
    assert r.returncode == 2 and "holds no checkpoint" in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_resume_drops_log_rows_after_the_checkpoint(tmp_path):
    run = str(tmp_path / "run")
    assert _train(["--steps", "4", "--out", run, "--train.ckpt_every", "2"]).returncode == 0
    with open(os.path.join(run, "log.jsonl"), "a") as f:  # as if killed after step 4, past its checkpoint
        f.write(json.dumps({"step": 5, "train_bpd": 1.0}) + "\n")
    assert _train(["--steps", "6", "--out", run, "--train.ckpt_every", "2", "--resume"]).returncode == 0
    assert _steps(run) == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("flag,value", [("--steps", "-5"), ("--steps", "0"), ("--batch-size", "0"),
                                        ("--lr", "0"), ("--lr", "-1e-3"), ("--limit", "0"), ("--threads", "0"),
                                        ("--train.eval_every", "0"), ("--train.sample_num", "-1"),
                                        ("--train.grad_clip", "0"), ("--window", "0"), ("--radius", "-1"),
                                        ("--model.dim", "0"), ("--model.dropout", "1.5")])
def test_bad_numbers_are_one_line_exit_2(flag, value, capsys):
    from imggen.cli import config_from_args
    with pytest.raises(SystemExit) as e:
        config_from_args([flag, value])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1 and "error" in err, err


def test_bad_number_from_the_shell():
    r = subprocess.run([sys.executable, "train.py", "--steps", "-5"], cwd=REPO, capture_output=True, text=True, env=ENV)
    assert r.returncode == 2 and r.stderr.strip() == "train.py: error: train.steps must be >= 1, got -5"


@pytest.mark.parametrize("n", [0, 65, 4096])
def test_patterns_with_geometry_reject_other_lengths(n):
    p = imggen.make_pattern("local2d", height=8, width=8, channels=1, radius=1)
    with pytest.raises(ShapeError, match="8x8x1"):
        p.mask(n)
    with pytest.raises(ShapeError, match="8x8x1"):
        imggen.sparse_attention(*(torch.randn(1, 1, max(n, 1), 8) for _ in range(3)), p, backend="cpu") if n \
            else p.check_length(n)


def test_band_rejects_empty_sequences():
    with pytest.raises(ShapeError, match="1.."):
        imggen.make_pattern("band", window=4).mask(0)


def test_activation_checkpointing_gives_the_same_step():
    cfg = Config(model=ModelConfig(height=6, width=6, channels=1, bits=4, dim=32, layers=3, heads=2,
                                   attention="local2d,band", backend="cpu"),
                 train=TrainConfig(steps=2, batch_size=2, warmup=1), data=DataConfig(spec="synthetic"))
    x = torch.randint(0, 16, (2, 36))
    states = []
    for ckpt in (False, True):
        cfg.train.activation_checkpointing = ckpt
        model, opt = build_model_and_optimizer(cfg, "cpu")
        assert model.checkpointing == ckpt
        losses = [train_step(model, opt, x, s, cfg, "cpu") for s in range(2)]
        states.append((losses, [p.detach().clone() for p in model.parameters()]))
    assert states[0][0] == pytest.approx(states[1][0], abs=1e-6)
    for a, b in zip(states[0][1], states[1][1]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.slow
def test_activation_checkpointing_is_in_the_config(tmp_path):
    run = str(tmp_path / "ac")
    assert _train(["--steps", "2", "--out", run, "--train.activation_checkpointing", "true"]).returncode == 0
    from imggen.checkpoint import read_config, resolve
    assert read_config(resolve(run)).train.activation_checkpointing is True
    r = _train(["--steps", "3", "--out", run, "--resume"])  # --resume continues from the run's own config
    assert r.returncode == 0, r.stderr[-2000:]
    assert read_config(resolve(run)).train.activation_checkpointing is True
    r = _train(["--steps", "4", "--out", run, "--resume", "--model.dim", "32"])
    assert r.returncode == 2 and "model.dim" in r.stderr


@pytest.mark.parametrize("save_mb", ["0", "64"])  # the recomputing autograd functions / the plain modules
def test_fused_layernorm_blocks_match_pytorch(save_mb, monkeypatch):
    """imggen.fused recomputes LayerNorm and GELU in the backward: same values and gradients (fp64)."""
    monkeypatch.setenv("IMGGEN_SAVE_MB", save_mb)
    import torch.nn as nn
    import torch.nn.functional as F
    from imggen.fused import ln_linear, ln_mlp
    torch.manual_seed(0)
    ln, lin = nn.LayerNorm(16).double(), nn.Linear(16, 48, bias=False).double()
    fc1, fc2 = nn.Linear(16, 64).double(), nn.Linear(64, 16).double()
    nn.init.normal_(ln.weight)
    nn.init.normal_(ln.bias)
    x = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True)
    params = [x, ln.weight, ln.bias, lin.weight, fc1.weight, fc1.bias, fc2.weight, fc2.bias]

    def loss(a, m):
        return (a * torch.linspace(-1, 1, 48, dtype=torch.float64)).sum() + (m ** 2).sum()

    ref = torch.autograd.grad(loss(lin(ln(x)), fc2(F.gelu(fc1(ln(x)), approximate="tanh"))), params)
    a, m = ln_linear(x, ln, lin), ln_mlp(x, ln, fc1, fc2)
    assert ("LNLinear" in type(a.grad_fn).__name__) == (save_mb == "0")
    assert ("LNMLP" in type(m.grad_fn).__name__) == (save_mb == "0")
    new = torch.autograd.grad(loss(a, m), params)
    for a, b in zip(ref, new):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


def test_thread_governor_drops_to_one_thread_while_others_are_busy(monkeypatch, capsys):
    import imggen.threads as T
    old = torch.get_num_threads()
    monkeypatch.setattr(T, "CHECK_S", 0.0)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert T.runnable_others(samples=2) is not None  # /proc is readable here
    busy = iter([2.0, 0.0, 2.0])
    monkeypatch.setattr(T, "runnable_others", lambda: next(busy))
    try:
        gov = T.Governor(None)
        gov.cores = 2
        gov.tick()
        assert torch.get_num_threads() == 1
        gov.tick()
        assert torch.get_num_threads() == 2
        gov.tick()
        assert torch.get_num_threads() == 1
        assert capsys.readouterr().out.count("note: other processes") == 1  # said once
        fixed = T.set_threads(2, "train")
        fixed.tick()
        assert torch.get_num_threads() == 2 and fixed.fixed
    finally:
        torch.set_num_threads(old)


def test_bad_save_limit_fails_before_the_data_loads(tmp_path):
    r = subprocess.run([sys.executable, "train.py", "--preset", "demo", "--steps", "1", "--out", str(tmp_path / "r")],
                       capture_output=True, text=True, timeout=120, cwd=os.path.dirname(os.path.dirname(__file__)),
                       env={**os.environ, "IMGGEN_SAVE_MB": "-3"})
    assert r.returncode == 2 and "IMGGEN_SAVE_MB must be a number of MiB >= 0" in r.stderr, r.stderr
    assert "molecules" not in r.stdout and len(r.stderr.strip().splitlines()) == 1


def test_sample_governor_uses_a_second_core_only_for_large_idle_batches_or_models(monkeypatch):
    """sample.py: 1 thread for small decode batches, every core for batches >= DECODE_MIN_BATCH
    and for models large enough for weight panels while idle, 1 thread while others are busy;
    imggen.sample ticks it once per step."""
    import imggen.threads as T
    old = torch.get_num_threads()
    monkeypatch.setattr(T, "CHECK_S", 3600.0)  # until below, only a change of the idle count rechecks
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    load = {"others": 0.0}
    monkeypatch.setattr(T, "runnable_others", lambda: load["others"])
    monkeypatch.setattr(T.os, "cpu_count", lambda: 2)
    try:
        T.set_threads(None, "sample")
        assert torch.get_num_threads() == 1
        T.decode_tick(1)
        assert torch.get_num_threads() == 1
        T.decode_tick(T.DECODE_MIN_BATCH)
        assert torch.get_num_threads() == 2
        T.decode_tick(1)
        assert torch.get_num_threads() == 1
        T.decode_tick(1, True)  # a model large enough for weight panels: every core at any batch
        assert torch.get_num_threads() == 2
        load["others"] = 2.0
        monkeypatch.setattr(T, "CHECK_S", 0.0)  # recheck the load at every tick from here on
        T.decode_tick(16)  # busy: back to one thread
        assert torch.get_num_threads() == 1
        ticks = []
        import imggen.sampling
        monkeypatch.setattr(imggen.sampling, "decode_tick", lambda *a: ticks.append(a))
        from imggen.config import ModelConfig
        from imggen.model import ImageTransformer
        cfg = ModelConfig(height=2, width=3, channels=1, bits=2, dim=8, layers=1, heads=1, attention="band", window=3)
        imggen.sampling.sample(ImageTransformer(cfg), 3)
        assert ticks == [(3, False)] * 6
        assert T.set_threads(1, "sample").fixed
    finally:
        T._current = None
        torch.set_num_threads(old)


# ---------------------------------------------------------------- pattern parameters, backends, caches
BAD_PATTERN_PARAMS = [
    ("band", dict(window=4.0), "window must be an integer >= 1, got 4.0"),
    ("band", dict(window="7"), "window must be an integer >= 1, got '7' (str)"),
    ("band", dict(window=True), "window must be an integer >= 1, got True (bool)"),
    ("band", dict(window=None), "window must be an integer >= 1, got None (NoneType)"),
    ("band", dict(window=0), "window must be an integer >= 1, got 0"),
    ("local2d", dict(height=8, width=8, radius=1.5), "radius must be an integer >= 0, got 1.5"),
    ("local2d", dict(height=8, width="8", radius=1), "width must be an integer >= 1, got '8' (str)"),
    ("local2d", dict(height=8, width=8, shift=2), "shift must be an integer in [0, 1], got 2"),
    ("bigbird", dict(block=32.0), "block must be an integer >= 1, got 32.0"),
    ("bigbird", dict(random_blocks=False), "random_blocks must be an integer >= 0, got False (bool)"),
    ("bigbird", dict(seed=-1), "seed (flag --pattern-seed) must be an integer >= 0, got -1"),
    ("diffuser", dict(steps=2.5), "steps (flag --diffusion-steps) must be an integer >= 1, got 2.5"),
    ("diffuser", dict(alpha="0.1"), "alpha must be a number in [0.0, 1.0], got '0.1' (str)"),
    ("diffuser", dict(alpha=float("nan")), "alpha must be a number in [0.0, 1.0], got nan"),
    ("diffuser", dict(global_tokens=[16]), "global_tokens must be an integer >= 0, got [16] (list)"),
    ("strided", dict(stride=3.0), "stride must be an integer >= 1, got 3.0"),
    ("column", dict(stride=0), "stride must be an integer >= 1, got 0"),
    ("full", dict(layer=1.0), "layer must be an integer >= 0, got 1.0"),
]


@pytest.mark.parametrize("kind,params,message", BAD_PATTERN_PARAMS)
def test_pattern_parameters_are_checked_up_front(kind, params, message):
    """A float / str / bool / None where a pattern wants an int (or a value out of range) is one
    ConfigError naming the pattern, the parameter, the value and what is accepted, raised when the
    pattern is built, not deep inside its rule."""
    from imggen.errors import ConfigError
    with pytest.raises(ConfigError) as e:
        imggen.make_pattern(kind, **params)
    assert str(e.value) == f"{kind} pattern: {message}"


def test_pattern_parameters_accept_what_configs_and_numpy_pass():
    import numpy as np
    assert imggen.make_pattern("band", window=np.int64(5)) == imggen.make_pattern("band", window=5)
    assert type(imggen.make_pattern("band", window=np.int32(5)).window) is int
    d = imggen.make_pattern("diffuser", alpha=1)  # JSON configs may hold 1 for 1.0
    assert d.alpha == 1.0 and type(d.alpha) is float
    # configs (flags are parsed to int, JSON ints stay int) build their patterns as before
    from imggen.cli import config_from_args
    cfg, _ = config_from_args(["--attention", "bigbird", "--block", "16", "--window-blocks", "2",
                               "--pattern-seed", "3", "--out", "unused"])
    assert [p.block for p in cfg.model.patterns()] == [16] * cfg.model.layers
    cfg = Config.from_dict({"model": {"height": 8, "width": 8, "attention": "diffuser", "alpha": 0, "window": 5}})
    assert cfg.validate().model.patterns()[0].alpha == 0.0
    from imggen.errors import ConfigError
    with pytest.raises(ConfigError, match="seed .flag --pattern-seed. must be an integer >= 0, got -2"):
        ModelConfig(height=8, width=8, attention="bigbird", pattern_seed=-2).validate()


def test_unknown_backend_and_cache_kind_are_config_errors():
    from imggen.decode import make_caches
    from imggen.errors import ConfigError
    from imggen.model import ImageTransformer
    q = torch.randn(1, 2, 8, 4)
    p = imggen.make_pattern("band", window=3)
    with pytest.raises(ConfigError, match=r"unknown backend 'gpu' .*choose one of reference, cpu, triton, flex, auto"):
        imggen.sparse_attention(q, q, q, p, backend="gpu")
    with pytest.raises(ConfigError, match="unknown backend None"):
        imggen.sparse_attention(q, q, q, p, backend=None)
    model = ImageTransformer(ModelConfig(height=4, width=4, channels=1, bits=4, dim=16, layers=1, heads=2,
                                         attention="band"))
    with pytest.raises(ConfigError, match=r"unknown cache kind 'evicted' .*choose one of evict, full, auto"):
        make_caches(model, 1, "evicted")


def test_flex_on_cpu_rejects_float64_in_one_line(monkeypatch):
    """FlexAttention's CPU lowering takes float32 / float16 / bfloat16: float64 is a ShapeError
    before anything is compiled (it used to fail inside Inductor with a long traceback)."""
    import imggen.attention.flex as F
    monkeypatch.setattr(F, "_compiled", lambda: pytest.fail("compiled before the dtype check"))
    q = torch.randn(1, 2, 40, 16, dtype=torch.float64)
    with pytest.raises(ShapeError) as e, torch.no_grad():
        imggen.sparse_attention(q, q, q, imggen.make_pattern("band", window=8), backend="flex")
    msg = str(e.value)
    assert "\n" not in msg and "float64" in msg and "float32, float16 or bfloat16" in msg and "reference" in msg


def test_flex_warns_once_when_torch_stops_compiling(monkeypatch):
    """torch.compile past its recompile limit runs FlexAttention un-compiled (dense, slow) and only
    logs it: the flex backend turns that log record into one RuntimeWarning."""
    import logging
    import warnings
    import imggen.attention.flex as F

    def fake_compiled_flex(q, k, v, block_mask):  # what dynamo does at the limit: log, run eagerly
        logging.getLogger(F._DYNAMO_LOG).warning("torch._dynamo hit config.%s (%s)\n   function: x",
                                                 "recompile_limit", 1)
        return v

    monkeypatch.setattr(F, "_compiled", lambda: fake_compiled_flex)
    monkeypatch.setattr(F, "_warned_limit", False)
    q = torch.randn(1, 2, 40, 16)
    with warnings.catch_warnings(record=True) as w, torch.no_grad():
        warnings.simplefilter("always")
        for window in (8, 9, 10):
            imggen.sparse_attention(q, q, q, imggen.make_pattern("band", window=window), backend="flex")
    ours = [str(x.message) for x in w if str(x.message).startswith("imggen:")]
    assert len(ours) == 1 and "recompile_limit" in ours[0] and "un-compiled" in ours[0], ours
    assert not logging.getLogger(F._DYNAMO_LOG).filters  # the watch is removed after each call


@pytest.mark.slow
def test_flex_recompile_limit_warning_from_real_torch_compile():
    """The real thing, in its own process (dynamo's limit is global): a limit of 1 and three band
    windows; the results stay right and one imggen warning says compiling stopped."""
    code = """if 1:
        import warnings, torch, torch._dynamo, imggen
        from imggen.attention import flex
        flex._compiled()
        torch._dynamo.config.recompile_limit = 1
        q = torch.randn(1, 2, 40, 16)
        with warnings.catch_warnings(record=True) as w, torch.no_grad():
            warnings.simplefilter("always")
            for win in (8, 9, 10):
                p = imggen.make_pattern("band", window=win)
                o = imggen.sparse_attention(q, q, q, p, backend="flex")
                ref = imggen.sparse_attention(q.double(), q.double(), q.double(), p, backend="reference")
                err = float((o.double() - ref).abs().max())
                assert err <= 1e-4, (win, err)
        print(sum(str(x.message).startswith("imggen: torch.compile stopped compiling FlexAttention") for x in w))
    """
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, env=ENV, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "1", r.stdout + r.stderr[-2000:]


def test_flex_on_cpu_is_right_at_lengths_torch_gets_wrong():
    """torch's compiled CPU FlexAttention returned wrong rows at N = 40 and 104 (head dim 16); the
    flex backend pads to whole blocks on CPU."""
    p = imggen.make_pattern("band", window=8)
    for n in (40, 104):
        q, k, v = (torch.randn(2, 3, n, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
        with torch.no_grad():
            got = imggen.sparse_attention(q, k, v, p, backend="flex")
        ref = imggen.sparse_attention(q.double(), k.double(), v.double(), p, backend="reference")
        assert got.shape == q.shape and got.is_contiguous()
        assert float((got.double() - ref).abs().max()) <= 1e-5, n


def test_bigbird_asking_more_random_blocks_than_exist_reads_every_earlier_block_at_table_cost():
    """--random-blocks 1000 at 64 query blocks: every earlier block is read (causal full attention),
    and the random table (whose columns the rules loop over) is as wide as the picks, not 1000."""
    p = imggen.make_pattern("bigbird", block=16, window_blocks=1, global_blocks=0, random_blocks=1000)
    table = p.lookup_tables(1024, 2)["random"]
    assert table.shape[-1] == 63
    mask = p.masks(200, 2)
    assert torch.equal(mask, torch.ones(200, 200, dtype=torch.bool).tril().expand_as(mask))
