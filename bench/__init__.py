"""Benchmarks: each runs as `python -m bench.NAME` and writes its raw JSON to bench/results/."""
