"""Measurements behind docs/benchmarks.md, each runnable as python -m tests.bench.NAME (not
collected by pytest)."""
