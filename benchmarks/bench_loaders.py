"""Loaders vs torch DataLoader and a float32 gather over a grid of macro/micro sizes (see memfit.bench.loaders).

Run: python benchmarks/bench_loaders.py [--quick] [--plot loaders.png] [--data file.npy]
"""
import sys

from memfit.bench.loaders import main

if __name__ == "__main__":
    sys.exit(main())
