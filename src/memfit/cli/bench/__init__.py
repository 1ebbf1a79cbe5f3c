"""Benchmarks behind `memfit bench NAME`: each measures memfit side by side
with the baseline users have today, in one process, and prints ratios."""
