"""Kept for the tests' imports: the helpers live in dear/testing/ranks.py (shared with the
benchmarks)."""

from dear.testing.ranks import RankFailure, free_port, run_distributed, wait_for_file

__all__ = ["RankFailure", "free_port", "run_distributed", "wait_for_file"]
