"""Sample from a trained model: python sample.py --checkpoint runs/demo --num 16 --out grid.png (see --help)."""
import sys

from imggen.cli import sample_main as main

if __name__ == "__main__":
    sys.exit(main())
