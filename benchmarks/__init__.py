"""Runnable benchmarks; `python -m benchmarks` runs them all (`make bench`)."""
