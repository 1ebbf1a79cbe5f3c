"""Training: the training-step memory model vs real steps, accumulate vs a plain step (see memfit.bench.train).

Run: python benchmarks/bench_train.py [--quick]
"""
import sys

from memfit.bench.train import main

if __name__ == "__main__":
    sys.exit(main())
