"""Benchmarks, run from the repository root: `python -m bench.bench_node ...` (or as a script)."""
