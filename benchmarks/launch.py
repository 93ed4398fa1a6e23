"""Kept for the benchmarks' imports: the helpers live in dear/testing/ranks.py (shared with the
tests)."""

from dear.testing.ranks import free_port, run_ranks

__all__ = ["free_port", "run_ranks"]
