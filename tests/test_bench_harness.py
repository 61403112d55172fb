"""bench/harness.py: the table text to the character, timing statistics on a fake clock, the results
folder, and atomic writing (no temporary file left, the old file kept when a write fails)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import harness  # noqa: E402


def test_md_table_exact_text():
    text = harness.md_table(["name", "ms", "ok", "ratio"],
                            [["band | w=256", 1.23456, True, None], ["local2d", 123456.0, False, 0.0001234],
                             ["bigbird", 2048.4, 7, float("nan")]])
    assert text == ("| name | ms | ok | ratio |\n"
                    "|---|---|---|---|\n"
                    "| band / w=256 | 1.23 | yes | - |\n"
                    "| local2d | 1.23e+05 | no | 1.23e-04 |\n"
                    "| bigbird | 2048 | 7 | nan |")
    assert harness.md_row(["a", 0.5]) == "| a | 0.5 |"
    assert harness.md_table(["only"], []) == "| only |\n|---|"


def test_fmt_digits():
    assert harness.fmt(3.14159, 2) == "3.1" and harness.fmt(0.0) == "0" and harness.fmt(float("inf")) == "inf"
    assert harness.fmt("x|y") == "x|y"  # fmt leaves strings alone; md_row guards the column bars


def test_repeat_on_a_fake_clock():
    clock = {"t": 0.0}
    durations = iter([5.0, 5.0, 1.0, 3.0, 2.0, 9.0])  # two warm-ups, then four timed runs
    calls, hooks = [], []

    def fn():
        calls.append(1)
        clock["t"] += next(durations)

    t = harness.repeat(fn, 4, warmup=2, before=lambda: hooks.append(1), clock=lambda: clock["t"])
    assert t.samples == [1.0, 3.0, 2.0, 9.0] and len(calls) == 6 and len(hooks) == 6
    assert (t.median, t.best, t.worst) == (2.5, 1.0, 9.0)
    assert t.spread == pytest.approx(8.0 / 2.5)
    assert t.as_dict() == {"median_s": 2.5, "best_s": 1.0, "worst_s": 9.0, "spread": pytest.approx(3.2), "runs": 4}
    with pytest.raises(ValueError):
        harness.repeat(fn, 0)


def test_median_time_with_a_sleep():
    import time

    s = harness.median_time(lambda: time.sleep(0.01), reps=3, warmup=1)
    assert 0.009 <= s < 0.5
    assert harness.time_call(lambda: time.sleep(0.01), "cpu") >= 9.0  # CPU branch: one call, milliseconds


def test_stopwatch_log(capsys):
    sw = harness.Stopwatch(start=0.0)
    assert sw.elapsed() > 1e9  # seconds since the epoch
    harness.Stopwatch().log("hello")
    out = capsys.readouterr().out
    assert out.startswith("[") and out.endswith("s] hello\n")


def test_write_results_atomic(tmp_path):
    paths = harness.write_results(tmp_path / "new", "run", {"x": 1.5, "p": Path("/a")}, "# run\n")
    assert [p.name for p in paths] == ["run.json", "run.md"]
    assert json.loads((tmp_path / "new" / "run.json").read_text()) == {"x": 1.5, "p": "/a"}
    assert (tmp_path / "new" / "run.md").read_text() == "# run\n"
    harness.write_results(tmp_path / "new", "run", {"x": 2}, "# again\n")  # replaced, not appended
    assert json.loads((tmp_path / "new" / "run.json").read_text()) == {"x": 2}
    assert sorted(p.name for p in (tmp_path / "new").iterdir()) == ["run.json", "run.md"]  # no temporary left


def test_failed_write_keeps_the_old_file_and_no_temp(tmp_path):
    target = tmp_path / "r.md"
    harness.write_atomic(target, "old")

    with pytest.raises(TypeError):
        harness.write_atomic(target, 12345)  # not text: the write fails after the temporary file exists
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["r.md"]


def test_out_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path / "env"))
    assert harness.out_dir() == tmp_path / "env" and (tmp_path / "env").is_dir()
    assert harness.out_dir(tmp_path / "given") == tmp_path / "given"
    monkeypatch.delenv("OUT")
    assert harness.out_dir(default=tmp_path / "d") == tmp_path / "d"


def test_machine_description():
    m = harness.machine(gpu=False)
    assert m["cpus"] >= 1 and m["cpu"] and m["torch"] and m["commit"]
    line = harness.machine_line(m)
    assert f"{m['cpus']} logical CPUs" in line and f"torch {m['torch']}" in line and m["commit"] in line
    assert harness.command_line("x.py", ["--a", "1"]) == "python bench/x.py --a 1"
    try:
        raise ValueError("first\nmiddle\nlast")
    except ValueError as e:
        assert harness.short_error(e) == "ValueError: first ... last"


def test_first_call_returns_the_result_and_its_seconds():
    import time

    out, s = harness.first_call(lambda: (time.sleep(0.01), 42)[1], "cpu")
    assert out == 42 and 0.009 <= s < 0.5


def test_cuda_graph_capture_order_with_fakes(monkeypatch):
    """cuda_graph's sequence without a GPU: warm-up calls on a side stream, `calls` calls captured,
    one replay; the output is the last captured call's."""
    import contextlib

    import torch

    trace = []

    class FakeStream:
        def wait_stream(self, other):
            trace.append("wait")

    class FakeGraph:
        def replay(self):
            trace.append("replay")

    @contextlib.contextmanager
    def ctx(name):
        trace.append(f"<{name}")
        yield
        trace.append(f"{name}>")

    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: ctx("side"))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", lambda g: ctx("capture"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: trace.append("sync"))
    n = iter(range(100))
    graph, out = harness.cuda_graph(lambda: trace.append("call") or next(n), calls=4, warmup=2)
    assert isinstance(graph, FakeGraph) and out == 5  # calls 0, 1 warm up; 2..5 captured
    assert trace == ["wait", "<side", "call", "call", "side>", "wait", "sync",
                     "<capture", "call", "call", "call", "call", "capture>", "replay", "sync"]
