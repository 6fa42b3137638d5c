"""Measurements run on purpose, not in CI; results and how to reproduce them in
docs/benchmarks.md. Run from the checkout's root: `python -m benchmarks.NAME`."""
