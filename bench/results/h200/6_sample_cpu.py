"""Sample drawings of a run on the CPU, 32 at a time, writing each batch's PNGs as soon as it is drawn."""
import sys, time
from pathlib import Path
import torch
import imggen
from PIL import Image

run, out, n, bs = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
out.mkdir(parents=True, exist_ok=True)
model = imggen.load_model(run).eval()
for first in range(0, n, bs):
    if all((out / f"sample_{first + i:03d}.png").exists() for i in range(bs)):
        continue
    t = time.time()
    with torch.no_grad():
        tok = imggen.sample(model, bs, seed=0, first=first)
    imgs = imggen.detokenize(model, tok).numpy()
    for i, im in enumerate(imgs):
        Image.fromarray(im[0]).save(out / f"sample_{first + i:03d}.png")
    print(f"drawings {first}..{first + bs - 1}: {time.time() - t:.0f} s", flush=True)
