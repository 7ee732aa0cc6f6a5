"""Benchmark scripts; run them as modules, e.g. ``python -m benchmarks.bench_parallel``."""
