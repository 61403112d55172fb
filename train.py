"""Train an imggen model: python train.py --preset demo --steps 200 --out runs/demo (see --help)."""
import sys

from imggen.cli import train_main as main

if __name__ == "__main__":
    sys.exit(main())
