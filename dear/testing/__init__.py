"""What tests and benchmarks of dear (and of code built on it) share: ranks with deadlines."""

from .ranks import RankFailure, free_port, run_distributed, run_ranks

__all__ = ["RankFailure", "free_port", "run_distributed", "run_ranks"]
