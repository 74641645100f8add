"""Benchmarks: measured speed and memory, recorded in docs/BENCHMARKS.md (never timed unit tests)."""
