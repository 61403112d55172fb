"""The presets on this CPU: sampling, training memory, and shared cores, for one checkout or two.

    python bench/presets.py [--before /path/to/old/checkout] [--parts grid,inpaint,memory,shared]
                            [--repeat N] [--out bench/results/presets.md]

Every measurement runs in a fresh process that imports imggen from the checkout being measured, with
that checkout's default thread behaviour (what a user of it gets), so a `--before` checkout (e.g. a
`git worktree` of an older commit) gives the before column:
* grid: seconds to sample a 16-image grid (batch 16, eviction caches, random weights: the speed does
  not depend on them) for the brats and cifar presets, and decode tokens/s; `--repeat N` runs each
  checkout N times, taking turns, with the speed-up of each pair and their median;
* inpaint: seconds to fill the holes of 2 images, best of 8 candidates each (one batch of 16:
  `generate(..., rank=8)`, as bench/inpaint.py's unconditional column), random weights and tokens,
  for two mask kinds: "lesions" (three discs per image, ~2% of the pixels, like brats-demo's masks)
  and "centre" (the centre square of half the side, 25% of the pixels);
* memory: peak resident memory of one training step (forward, backward, AdamW) of the demo, cifar
  and brats presets at their batch sizes (random data), and with activation checkpointing where
  the checkout has it;
* shared: a demo training step and one demo sample (32x32) alone, then with a second demo training
  running beside them (train.py of the same checkout, default settings): median step time and
  sample time, and their ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(HERE, "bench"))
from harness import command_line, md_row, md_table, repeat, use_checkout, write_atomic  # noqa: E402

STEPS_MEASURED = 6


# ------------------------------------------------------------------------------------ workers
def _new_api(repo: str) -> bool:
    return os.path.exists(os.path.join(repo, "imggen", "threads.py"))


def _policy(repo: str, kind: str):
    """The checkout's own default thread behaviour: a governor to tick (new) or torch's default."""
    if _new_api(repo):
        from imggen.threads import set_threads
        return set_threads(None, kind)
    return None


def _train_step(model, opt, x) -> None:
    """Forward, loss, backward, AdamW: the same in every checkout (no imggen training API needed)."""
    import torch

    logits = model(x)
    loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x.reshape(-1))
    opt.zero_grad()
    loss.backward()
    opt.step()


def worker_grid(repo: str, preset: str) -> dict:
    import torch
    from imggen.config import preset as get
    from imggen.model import ImageTransformer
    from imggen.sampling import sample

    _policy(repo, "sample")
    cfg = get(preset).model
    torch.manual_seed(0)
    model = ImageTransformer(cfg).eval()
    t0 = time.perf_counter()
    sample(model, 16, seed=0)
    dt = time.perf_counter() - t0
    return {"seconds": dt, "tokens_per_s": 16 * cfg.seq_len / dt, "threads": torch.get_num_threads()}


def hole_masks(kind: str, height: int, width: int, seed: int = 0):
    """(2, H, W) bool holes (True = unknown): "lesions" = three discs per image, "centre" = the
    centre square of half the side."""
    import numpy as np

    y, x = np.mgrid[:height, :width]
    masks = np.zeros((2, height, width), dtype=bool)
    if kind == "centre":
        masks[:, height // 4: height // 4 + height // 2, width // 4: width // 4 + width // 2] = True
        return masks
    rng = np.random.default_rng(seed)
    r = max(1.0, 0.05 * min(height, width))
    for m in masks:
        for cy, cx in rng.uniform(0.2, 0.8, (3, 2)) * (height, width):
            m |= (y - cy) ** 2 + (x - cx) ** 2 <= r * r
    return masks


def worker_inpaint(repo: str, preset: str, kind: str) -> dict:
    import torch
    from imggen.config import preset as get
    from imggen.model import ImageTransformer
    from imggen.sampling import generate

    _policy(repo, "sample")
    cfg = get(preset).model
    torch.manual_seed(0)
    model = ImageTransformer(cfg).eval()
    holes = torch.from_numpy(hole_masks(kind, cfg.height, cfg.width))
    known_mask = ~holes[..., None].expand(-1, -1, -1, cfg.channels).reshape(2, -1)
    known = torch.randint(0, cfg.vocab, (2, cfg.seq_len))
    t0 = time.perf_counter()
    generate(model, 2, known, known_mask, rank=8, batch_size=16, seed=0)
    dt = time.perf_counter() - t0
    return {"seconds": dt, "hole_frac": float(holes.float().mean()), "threads": torch.get_num_threads()}


def worker_memory(repo: str, preset: str, checkpointing: bool) -> dict:
    import resource

    import torch
    from imggen.config import preset as get
    from imggen.model import ImageTransformer

    cfg = get(preset)
    torch.manual_seed(0)
    model = ImageTransformer(cfg.model)
    if checkpointing:
        if not hasattr(model, "checkpointing"):
            return {"error": "no activation checkpointing in this checkout"}
        model.checkpointing = True
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, cfg.model.vocab, (cfg.train.batch_size, cfg.model.seq_len))
    t0 = time.perf_counter()
    _train_step(model, opt, x)
    return {"peak_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "step_s": time.perf_counter() - t0,
            "batch": cfg.train.batch_size, "threads": torch.get_num_threads()}


def worker_demo(repo: str) -> dict:
    """Median demo training step (default threads, governed where the checkout has that) and one
    demo sample, as a user of the checkout gets them."""
    import torch
    from imggen.config import preset as get
    from imggen.model import ImageTransformer
    from imggen.sampling import sample

    gov = _policy(repo, "train")
    cfg = get("demo")
    torch.manual_seed(0)
    model = ImageTransformer(cfg.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, cfg.model.vocab, (cfg.train.batch_size, cfg.model.seq_len))
    step = repeat(lambda: _train_step(model, opt, x), STEPS_MEASURED, warmup=1,
                  before=gov.tick if gov is not None else None)  # the first step (allocations) untimed
    train_threads = torch.get_num_threads()
    _policy(repo, "sample")
    model.eval()
    t0 = time.perf_counter()
    sample(model, 1, seed=0)
    return {"step_s": step.median, "sample_s": time.perf_counter() - t0,
            "train_threads": train_threads, "sample_threads": torch.get_num_threads()}


# ------------------------------------------------------------------------------------ driver
def run_worker(repo: str, *args: str, timeout: float = 3600) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", repo, *args]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"did not finish in {timeout:.0f} s"}
    if r.returncode != 0:
        tail = (r.stderr.strip().splitlines() or ["killed"])[-1]
        return {"error": "out of memory (killed)" if r.returncode in (-9, 137) else tail[:200]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def shared(repo: str) -> dict:
    alone = run_worker(repo, "demo")
    with tempfile.TemporaryDirectory() as tmp:
        env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
        env["PYTHONPATH"] = repo
        other = subprocess.Popen([sys.executable, os.path.join(repo, "train.py"), "--preset", "demo", "--steps",
                                  "100000", "--out", os.path.join(tmp, "other"), "--no-progress"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=repo)
        try:
            time.sleep(20)  # the other training is past its data loading and busy
            if other.poll() is not None:
                return {"alone": alone, "beside": {"error": f"the second training exited ({other.returncode})"}}
            beside = run_worker(repo, "demo")
        finally:
            other.kill()
            other.wait()
    return {"alone": alone, "beside": beside}


def fmt(r: dict, key: str, unit: str = "", nd: int = 2) -> str:
    if "error" in r:
        return r["error"]
    return f"{r[key]:.{nd}f}{unit}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", help="another checkout (e.g. a git worktree of an older commit)")
    ap.add_argument("--parts", default="grid,inpaint,memory,shared")
    ap.add_argument("--repeat", type=int, default=1, help="grid runs per preset and checkout, taking turns (default 1)")
    ap.add_argument("--out", default=os.path.join(HERE, "bench", "results", "presets.md"))
    ap.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        repo, kind, *rest = args.worker
        use_checkout(repo)
        fn = {"grid": lambda: worker_grid(repo, rest[0]),
              "inpaint": lambda: worker_inpaint(repo, rest[0], rest[1]),
              "memory": lambda: worker_memory(repo, rest[0], rest[1] == "1"),
              "demo": lambda: worker_demo(repo)}[kind]
        print(json.dumps(fn()))
        return 0
    repos = {"after": HERE} if not args.before else {"before": os.path.abspath(args.before), "after": HERE}
    parts, lines = args.parts.split(","), []
    cols = list(repos)
    if "grid" in parts:
        two = len(cols) == 2
        lines += ["## Sampling a 16-image grid (batch 16, random weights)", "",
                  md_table(["preset", "run", *(f"{c}: s (tokens/s, threads)" for c in cols)]
                           + ["speed-up"] * two, [])]
        for preset in ("brats", "cifar"):
            ratios = []
            for i in range(args.repeat):
                # the checkouts take turns at going first: a drift of the machine's speed within a
                # run (this box: up to 1.5x) then falls on both columns alike
                res = {c: run_worker(repos[c], "grid", preset) for c in (cols if i % 2 == 0 else cols[::-1])}
                ratio = []
                if two:
                    ok = not any("error" in r for r in res.values())
                    ratios += [res["before"]["seconds"] / res["after"]["seconds"]] if ok else []
                    ratio = [f"{ratios[-1]:.2f}x" if ok else "-"]
                lines.append(md_row([preset, str(i + 1)] + [
                    res[c].get("error") or f"{res[c]['seconds']:.1f} ({res[c]['tokens_per_s']:.0f}, "
                    f"{res[c]['threads']})" for c in cols] + ratio))
                print(lines[-1], flush=True)
            if len(ratios) > 1:
                lines.append(md_row([preset, f"median (min-max) of {len(ratios)}", *[""] * len(cols),
                                     f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}x)"]))
                print(lines[-1], flush=True)
        lines.append("")
    if "inpaint" in parts:
        lines += ["## Inpainting 2 images, best of 8 each (one batch of 16, random weights)", "",
                  md_table(["preset", "holes", *(f"{c}: s (threads)" for c in cols)]
                           + ["speed-up"] * (len(cols) == 2), [])]
        for preset in ("brats", "cifar"):
            for kind in ("lesions", "centre"):
                res = [run_worker(repos[c], "inpaint", preset, kind) for c in cols]
                frac = next((f" ({r['hole_frac']:.0%})" for r in res if "hole_frac" in r), "")
                ratio = []  # the speed-up column exists only with a before column
                if len(cols) == 2:
                    ok = not any("error" in r for r in res)
                    ratio = [f"{res[0]['seconds'] / res[1]['seconds']:.1f}x" if ok else "-"]
                lines.append(md_row([preset, f"{kind}{frac}"]
                                    + [r.get("error") or f"{r['seconds']:.1f} ({r['threads']})" for r in res] + ratio))
                print(lines[-1], flush=True)
        lines.append("")
    if "memory" in parts:
        lines += ["## Peak memory of one training step at the preset's batch size", "",
                  md_table(["preset (batch)", *(f"{c}: peak GB (step s)" for c in cols),
                            "after, activation checkpointing"], [])]
        for preset in ("demo", "cifar", "brats"):
            res = [run_worker(repos[c], "memory", preset, "0") for c in cols]
            ac = run_worker(HERE, "memory", preset, "1")
            batch = next((r["batch"] for r in res + [ac] if "batch" in r), "?")
            lines.append(md_row([f"{preset} ({batch})"]
                                + [r.get("error") or f"{r['peak_gb']:.2f} ({r['step_s']:.0f})" for r in res + [ac]]))
            print(lines[-1], flush=True)
        lines.append("")
    if "shared" in parts:
        lines += ["## Shared cores: demo step and demo sample, alone vs beside a second demo training", "",
                  md_table(["checkout", "step alone s", "step beside s", "ratio", "sample alone s", "sample beside s",
                            "ratio"], [])]
        for c in cols:
            r = shared(repos[c])
            a, b = r["alone"], r["beside"]
            ok = "error" not in a and "error" not in b
            ratio = lambda key: f"{(b[key] / a[key]) if ok else float('nan'):.1f}x"  # noqa: E731
            lines.append(md_row([c, fmt(a, "step_s"), fmt(b, "step_s"), ratio("step_s"), fmt(a, "sample_s"),
                                 fmt(b, "sample_s"), ratio("sample_s")]))
            print(lines[-1], flush=True)
        lines.append("")
    head = [f"`{command_line('presets.py', argv)}` ({time.strftime('%Y-%m-%d %H:%M')}; {os.cpu_count()} CPUs)", ""]
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    write_atomic(args.out, "\n".join(head + lines))
    print("\n".join(head + lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
