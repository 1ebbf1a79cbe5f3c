"""Kept for tests written before the spawner moved: import `run_ranks` from `memfit.testing.ranks` (the one
rank spawner of the tests and the benchmarks). Remove once no test imports this module."""
from memfit.testing.ranks import free_port, run_ranks

__all__ = ["free_port", "run_ranks"]
