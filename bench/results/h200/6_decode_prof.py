"""Warm GPU decode step time of a random-weight moses256 model (device-session helper)."""
import sys, time, torch
sys.path.insert(0, ".")
from imggen.config import preset
from imggen.model import ImageTransformer
from imggen.decode import make_caches
dev = "cuda" if torch.cuda.is_available() else "cpu"
cfg = preset("moses256").model
torch.manual_seed(0)
m = ImageTransformer(cfg).to(dev).eval()
def run(batch, t0, steps):
    caches = make_caches(m, batch)
    prev = None
    with torch.no_grad():
        for t in range(t0):  # fill the caches cheaply? no: decode from 0 so the caches are real
            pass
        ts = []
        for t in range(steps):
            if dev == "cuda": torch.cuda.synchronize()
            a = time.perf_counter()
            prev = m.step(prev, t, caches, None).argmax(-1)
            if dev == "cuda": torch.cuda.synchronize()
            ts.append(time.perf_counter() - a)
    return ts
run(16, 0, 300)  # compile + warm
for b in (16, 64):
    ts = run(b, 0, 2000)
    ts = sorted(ts[200:])
    print(f"batch {b}: median {1e3 * ts[len(ts) // 2]:.2f} ms/step, p90 {1e3 * ts[int(len(ts) * .9)]:.2f} (steps 200-2000)", flush=True)
from torch.profiler import profile, ProfilerActivity
caches = make_caches(m, 16); prev = None
acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
with torch.no_grad():
    for t in range(300):
        prev = m.step(prev, t, caches, None).argmax(-1)
    with profile(activities=acts) as p:
        for t in range(300, 320):
            prev = m.step(prev, t, caches, None).argmax(-1)
        if dev == "cuda": torch.cuda.synchronize()
ka = p.key_averages()
print(ka.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=45))
print("launches per step:", sum(e.count for e in ka if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx")) / 20)
