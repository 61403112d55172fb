"""The training smoke of the GPU check (bench/gpu/gpu_bench.py): train.py --preset cifar on generated
CIFAR-10 pickles, once per attention backend, then sample.py from the first checkpoint that trained,
each through bench/gpu/gpu_smoke.py in its own process (a crash, hang or broken CUDA context stays there).
The numbers come from train.py's own log (gpu_readouts.parse_train_log).
"""
from __future__ import annotations

from pathlib import Path

from gpu_readouts import parse_train_log
from gpu_runner import SkipUnit
from harness import fmt

SMOKE = Path(__file__).resolve().parent / "gpu_smoke.py"  # train.py / sample.py in a wrapper that records time and memory


class TrainingSmoke:
    """Units of the smoke, mixed into gpu_bench.Check (a gpu_runner.Runner with cfg["smoke"], res["smoke"])."""

    def unit_smoke_data(self, rec):
        from gpu_smoke import write_fake_cifar

        d = write_fake_cifar(self.work / "cifar", self.cfg["smoke"]["per_batch"], seed=0)
        rec.update({"dir": str(d), "per_batch": self.cfg["smoke"]["per_batch"]})

    def train_argv(self, backend: str) -> list[str]:
        sm = self.cfg["smoke"]
        data = self.res["smoke"].get("data", {}).get("dir")
        run = self.work / f"run_{backend}"
        return ["--preset", "cifar", "--data", f"cifar:{data}", "--out", str(run), "--overwrite", "--seed", "0",
                "--steps", str(sm["steps"]), "--train.log_every", "1", "--train.eval_every", str(sm["steps"]),
                "--train.ckpt_every", str(sm["steps"]), "--train.grid_time_frac", "0", "--no-progress", *sm["args"]]

    def unit_train(self, backend: str, rec: dict):
        """train.py in its own process. On the GPU the backends run one after the other (tokens/s and
        compile times are per backend); the CPU dry run starts them together (2 cores)."""
        sm = self.cfg["smoke"]
        if not self.res["smoke"].get("data", {}).get("dir"):
            raise SkipUnit("no smoke data: smoke/data did not run")
        if backend not in self.smoke_procs:
            for be in (sm["backends"] if self.dry else (backend,)):
                if be not in self.smoke_procs and f"train_{be}" not in self.started:
                    self.smoke_procs[be] = self.start_wrapped(SMOKE, "train", be, self.train_argv(be))
                    self.started.add(f"train_{be}")
        argv = self.train_argv(backend)
        rec["argv"] = argv
        rec["run_dir"] = argv[argv.index("--out") + 1]
        try:
            self.wait_wrapped(self.smoke_procs.pop(backend), rec)
        finally:
            rec.update(parse_train_log(Path(rec["run_dir"]) / "log.jsonl", sm["steps"]))
        self.log(f"   train {backend}: rc {rec.get('rc')}, {rec.get('wall_s', 0):.1f} s, step-1 bpd {fmt(rec.get('step1_bpd'))}, "
            f"last bpd {fmt(rec.get('last_bpd'))}, {fmt(rec.get('tokens_per_s'))} tokens/s, peak "
            f"{fmt((rec.get('peak_mem_bytes') or 0) / 2 ** 30)} GiB")

    def unit_sample(self, rec: dict):
        sm = self.cfg["smoke"]
        runs = [self.res["smoke"].get(f"train_{be}", {}) for be in sm["backends"]]
        run = next((r for r in runs if r.get("rc") == 0), None)
        if run is None:
            raise SkipUnit("no trained checkpoint: no training smoke succeeded")
        png = self.out / "samples.png"
        argv = ["--checkpoint", run["run_dir"], "--num", str(sm["sample_num"]), "--out", str(png), "--seed", "0"]
        if self.dry:
            argv += ["--device", "cpu", "--threads", "1"]  # default threads on a busy 2-core box: ~75x slower
        rec.update({"argv": argv, "from": run["backend"]})
        self.wait_wrapped(self.start_wrapped(SMOKE, "sample", run["backend"], argv), rec)
        rec["png"] = str(png) if png.exists() else None
        if not png.exists():
            raise RuntimeError(f"sample.py wrote no {png}")
        self.log(f"   sample: {rec.get('wall_s', 0):.1f} s, {png}")
