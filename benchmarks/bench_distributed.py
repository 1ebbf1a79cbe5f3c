"""Distributed scaling: resident loader and exact evaluation with 1 and 2 processes (see memfit.bench.distributed).

Run: python benchmarks/bench_distributed.py [--quick]
"""
import sys

from memfit.bench.distributed import main

if __name__ == "__main__":
    sys.exit(main())
