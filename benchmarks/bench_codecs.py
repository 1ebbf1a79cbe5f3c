"""Bytes held and batch throughput of every codec against a float32 gather (see memfit.bench.codecs).

Run: python benchmarks/bench_codecs.py [--device cuda] [--quick]
"""
import sys

from memfit.bench.codecs import main

if __name__ == "__main__":
    sys.exit(main())
