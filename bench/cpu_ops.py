"""The MLP's GELU (tanh) on a CPU: torch's kernels against imggen.cpu_ops' C kernels, forward and
backward, float32 and bfloat16, at the hidden sizes of the CPU presets' training batches.

    python bench/cpu_ops.py [--threads 2] [--reps 20] [--out bench/results]

Both run in this process on the same tensors; each time is the median of --reps calls.
Writes cpu_ops.md and cpu_ops.json. Run it on an otherwise idle machine.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import command_line, machine, machine_line, md_table, median_time, out_dir, write_results  # noqa: E402

# (preset, tokens of a batch = batch x H x W, MLP hidden width)
SHAPES = [("demo", 16 * 32 * 32, 384), ("moses", 8 * 64 * 64, 256), ("brats64", 8 * 64 * 64, 512)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    import torch
    import torch.nn.functional as F

    from imggen import cpu_ops

    torch.set_num_threads(a.threads)
    if not cpu_ops.available():
        print("the C kernels are unavailable here (no compiler, or IMGGEN_NATIVE=0)")
        return 1
    rows, data = [], []
    for name, tokens, hidden in SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            g = torch.Generator().manual_seed(0)
            h = (torch.randn(tokens, hidden, generator=g) * 2).to(dtype)
            dy = torch.randn(tokens, hidden, generator=g).to(dtype)
            t = {"torch fwd": lambda: F.gelu(h, approximate="tanh"),
                 "C fwd": lambda: cpu_ops.gelu_forward(h),
                 "torch bwd": lambda: torch.ops.aten.gelu_backward(dy, h, approximate="tanh"),
                 "C bwd": lambda: cpu_ops.gelu_backward(dy, h)}
            ms = {k: median_time(f, a.reps, warmup=2) * 1e3 for k, f in t.items()}
            d = str(dtype).split(".")[1]
            rows.append([name, f"{tokens} x {hidden}", d, f"{ms['torch fwd']:.2f}", f"{ms['C fwd']:.2f}",
                         f"**{ms['torch fwd'] / ms['C fwd']:.2f}x**", f"{ms['torch bwd']:.2f}", f"{ms['C bwd']:.2f}",
                         f"**{ms['torch bwd'] / ms['C bwd']:.2f}x**"])
            data.append({"preset": name, "tokens": tokens, "hidden": hidden, "dtype": d, **ms})
            print(" | ".join(rows[-1]), flush=True)
    text = "\n".join(["# GELU (tanh) on the CPU: torch vs imggen.cpu_ops", "", f"`{command_line('cpu_ops.py', argv)}`",
                      "", machine_line(machine(gpu=False)) + f", {a.threads} threads", "",
                      md_table(["preset", "elements", "dtype", "torch fwd ms", "C fwd ms", "fwd speed-up",
                                "torch bwd ms", "C bwd ms", "bwd speed-up"], rows), ""])
    write_results(out_dir(a.out), "cpu_ops", data, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
