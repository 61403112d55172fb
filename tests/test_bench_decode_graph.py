"""bench/gpu/decode_graph.py (issue 48's GPU check) dry-runs on the CPU: tiny models, the static step
without a graph, training with torch.compile's eager backend; the tables it writes."""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "gpu"))

import decode_graph  # noqa: E402


def test_cuda_graph_bench_dry_run_writes_its_tables(tmp_path, capsys):
    rc = decode_graph.main(["--dry-run", "--out", str(tmp_path), "--batches", "1,2", "--steps", "6",
                            "--train-steps", "1", "--presets", "moses256"])
    assert rc == 0, capsys.readouterr().out
    res = json.loads((tmp_path / "decode_graph.json").read_text())
    assert [r["batch"] for r in res["decode"]] == [1, 2]
    assert all(r["same_tokens"] and r["steps"] == 6 and not r["graph"] for r in res["decode"])
    assert res["grid"]["images"] == 16 and res["grid"]["seconds"] > 0  # 16 tiny images fit the budget
    assert [r["mode"] for r in res["train"]] == ["eager", "compile"] and all(r["loss_parity"] for r in res["train"])
    md = (tmp_path / "decode_graph.md").read_text()
    assert "graph ms/step" in md and "(no graph)" in md and "tokens/s" in md and "dry run" in md


def test_cuda_graph_bench_says_no_cuda_in_one_line(capsys):
    if decode_graph.torch.cuda.is_available():
        return
    assert decode_graph.main([]) == 2
    err = capsys.readouterr().err
    assert "no CUDA" in err and len(err.strip().splitlines()) == 1
