"""Kept for the tests' imports: the helpers live in dear/testing/ranks.py (shared with the
benchmarks)."""

from dear.testing.ranks import RankFailure, free_port, run_distributed

__all__ = ["RankFailure", "free_port", "run_distributed"]
