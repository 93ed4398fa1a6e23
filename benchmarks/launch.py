"""Start N local ranks for a benchmark and never leave one behind.

torch.multiprocessing starts the ranks; a deadline and the first failing rank end the run, and
every rank still alive is then killed, so a hang becomes an error message, not a stuck job.
"""

from __future__ import annotations

import socket
import sys
import time
from typing import Any, Callable

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_ranks(fn: Callable[..., Any], nproc: int, args: tuple, timeout: float) -> int:
    """Run fn(rank, *args) on `nproc` spawned ranks; return 0, or 1 after a failure/timeout."""
    ctx = mp.start_processes(fn, args=args, nprocs=nproc, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if ctx.join(timeout=1.0):
                return 0
        print(f"error: ranks did not finish within {timeout:.0f} s; killing them",
              file=sys.stderr)
        return 1
    except mp.ProcessRaisedException as exc:
        print(f"error: a rank failed:\n{exc}", file=sys.stderr)
        return 1
    except mp.ProcessExitedException as exc:
        print(f"error: a rank exited: {exc}", file=sys.stderr)
        return 1
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.kill()
            proc.join(5)
