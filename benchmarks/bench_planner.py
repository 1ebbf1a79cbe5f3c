"""Activation arena of a model zoo: naive, eager peak, planned, lower bound, latency (see memfit.bench.planner).

Run: python benchmarks/bench_planner.py [--quick] [--json]
"""
import sys

from memfit.bench.planner import main

if __name__ == "__main__":
    sys.exit(main())
