"""Train the regression-only inpainting baseline (imggen.inpainting.regress: the context encoder + a pixel head,
L1 / MSE loss on the hole), on the training split of a data spec at the context model's size.

    python bench/train_regress.py --data brats-demo --size 64 --steps 3000 --out runs/b64reg
        [--batch-size 8] [--lr 2e-3] [--loss mse|l1] [--width 64] [--hidden 64] [--fill biharmonic]
        [--augment] [--precision auto|fp32|bf16] [--threads N]

Writes OUT/regress.pt (weights, settings and the training budget: steps, seconds, machine) and
OUT/log.jsonl (step, mean loss, lr, seconds). The masks are the context model's training masks
(imggen.inpainting.tasks.training_masks with the same seed): the data's own for half a batch, random shapes for
the rest.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import command_line, cpu_model  # noqa: E402

from imggen.datasets import load_dataset  # noqa: E402
from imggen.precision import PRECISIONS, describe, resolve  # noqa: E402
from imggen.inpainting.regress import LOSSES, HoleRegressor, save, train_regressor  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="brats-demo")
    ap.add_argument("--size", type=int, default=64, help="image height = width")
    ap.add_argument("--channels", type=int, default=1)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--loss", choices=LOSSES, default="mse")
    ap.add_argument("--width", type=int, default=64, help="the encoder's feature width (brats64: context_width 64)")
    ap.add_argument("--hidden", type=int, default=64, help="features per pixel fed to the head")
    ap.add_argument("--fill", choices=("none", "biharmonic"), default="none",
                    help="the context's classic fill channel (as --model.context_fill)")
    ap.add_argument("--augment", action="store_true", help="random warps + gamma per image (as --train.augment)")
    ap.add_argument("--precision", choices=PRECISIONS, default="auto",
                    help="as --train.precision: bf16 autocast where the CPU computes bf16 natively (auto)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    ap.add_argument("--threads", type=int)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    data = load_dataset(args.data, height=args.size, width=args.size, channels=args.channels, seed=args.seed)
    images = data.split("train")
    masks = data.masks.get("train") if data.masks else None
    model = HoleRegressor(args.channels, args.size, args.size, args.width, args.hidden, args.fill)
    n_params = sum(p.numel() for p in model.parameters())
    print(describe(args.precision, "cpu"), flush=True)
    print(f"{len(images)} training images of {tuple(images.shape[1:])}; regressor {n_params / 1e6:.2f}M params",
          flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "log.jsonl"), "w") as logf:
        def log(row):
            logf.write(json.dumps(row) + "\n")
            logf.flush()
            print(f"step {row['step']}: loss {row['loss']:.4f} ({row['seconds']:.0f} s)", flush=True)

        result = train_regressor(model, images, masks, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                                 warmup=args.warmup, seed=args.seed, loss=args.loss,
                                 augment=args.augment, log=log, precision=args.precision)
    info = {**result, "precision": resolve(args.precision, "cpu")[0], "batch_size": args.batch_size, "lr": args.lr, "loss_kind": args.loss, "augment": args.augment,
            "data": args.data, "params": n_params, "threads": torch.get_num_threads(),
            "machine": f"{cpu_model()}, {os.cpu_count()} CPUs",
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": command_line("train_regress.py", argv)}
    save(model, os.path.join(args.out, "regress.pt"), **info)
    print(f"saved {os.path.join(args.out, 'regress.pt')}: {result['steps']} steps in {result['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
