"""Chunked evaluation: auto chunk vs the largest that really fits, OOMs, throughput (see memfit.bench.evaluate).

Run: python benchmarks/bench_evaluate.py [--quick]
"""
import sys

from memfit.bench.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
