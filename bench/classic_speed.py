"""Time imggen.classic.biharmonic on a challenge-sized volume (RESULTS section 14):

    python bench/classic_speed.py [--fraction 0.03] [--reps 2]

A 240x240x155 brain-sized ellipsoid (semi-axes 70/95/80 voxels, textured, with noise) and a
spherical hole of `fraction` of it, filled with rtol 1e-6 as imggen.volumes fills a case.
"""
import argparse
import time

import numpy as np

from imggen.classic import biharmonic


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fraction", type=float, default=0.03, help="hole size, a fraction of the brain")
    ap.add_argument("--reps", type=int, default=2)
    a = ap.parse_args()
    zz, yy, xx = np.mgrid[:155, :240, :240]
    brain = ((zz - 77) / 70) ** 2 + ((yy - 120) / 95) ** 2 + ((xx - 120) / 80) ** 2 < 1
    noise = np.random.default_rng(0).normal(0, 3, brain.shape)
    vol = np.where(brain, 100 + 20 * np.sin(xx / 7.0) + 10 * np.cos(yy / 5.0) + noise, 0).astype(np.float32)
    r = (a.fraction * brain.sum() * 3 / (4 * np.pi)) ** (1 / 3)
    hole = (zz - 70) ** 2 + (yy - 110) ** 2 + (xx - 130) ** 2 < r ** 2
    print(f"hole: {hole.sum()} voxels, {hole.sum() / brain.sum():.1%} of the brain")
    for _ in range(a.reps):
        t = time.perf_counter()
        biharmonic(vol, hole, rtol=1e-6)
        print(f"biharmonic: {time.perf_counter() - t:.1f} s")


if __name__ == "__main__":
    main()
