"""Ranks with deadlines, for tests and benchmarks: run a function on N local processes
(spawned, Gloo on loopback), and never leave one behind.

`run_distributed` (tests): ranks are forked from a server process that has imported torch and
dear once (multiprocessing's forkserver), not spawned: a spawned rank spends seconds importing
torch, and the suite starts hundreds of ranks. The server also imports torch._dynamo, which
torch.optim loads on a process's first optimizer: 1.0 of the 1.2 CPU-seconds a forked rank
spent on init, three Adam steps and shutdown (2026-11-27), in every rank. Each rank gets the
caller's environment of the moment, as a spawned one would. Each rank's return value comes back
through a file (torch.save), so tensors survive the rank's exit; the first rank that fails or the
deadline ends the run, every rank still alive is killed, and the caller gets the failing rank's
traceback or a 'hung' message.
`run_ranks` (benchmarks): fn(rank, *args) on N ranks started by torch.multiprocessing, 0 or 1.
"""

from __future__ import annotations

import copy
import multiprocessing as mp
import os
import socket
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Optional

import torch
import torch.multiprocessing as torch_mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _rank_main(fn: Callable[..., Any], rank: int, world_size: int, port: int, outdir: str,
               env: dict[str, str], args: tuple, kwargs: dict,
               parent_env: Optional[dict[str, str]] = None) -> None:
    if parent_env is not None:        # forked from the server: the caller's environment, now
        os.environ.clear()
        os.environ.update(parent_env)
    os.environ.update({
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
        "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
    })
    os.environ.update(env)
    # The arguments arrive in memory the caller and every rank share (torch's multiprocessing):
    # a rank that keeps one (load_state_dict, say) must not share it with the others.
    args, kwargs = copy.deepcopy(args), copy.deepcopy(kwargs)
    torch.set_num_threads(1)
    try:
        result = fn(*args, **kwargs)
        torch.save(result, os.path.join(outdir, f"{rank}.pt"))
    except BaseException:
        with open(os.path.join(outdir, f"{rank}.err"), "w") as fh:
            fh.write(traceback.format_exc())
        os._exit(1)
    finally:
        import torch.distributed as dist
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass
    os._exit(0)


class RankFailure(AssertionError):
    """A rank raised, crashed or did not finish in time."""


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0,
                    env: Optional[dict[str, str]] = None, expect_failure: bool = False,
                    **kwargs: Any) -> list[Any]:
    """Run `fn(*args, **kwargs)` on `world_size` ranks; return each rank's result by rank.

    With `expect_failure`, return each rank's outcome instead: its result, or the traceback text
    (str) of a rank that failed; a rank that was killed at the deadline still fails the test.
    """
    ctx = _rank_context()
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="dear-ranks-") as outdir:
        procs = [ctx.Process(target=_rank_main, daemon=True,
                             args=(fn, r, world_size, port, outdir, dict(env or {}), args, kwargs,
                                   dict(os.environ)))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                codes = [p.exitcode for p in procs]
                failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
                if failed and not expect_failure:
                    raise RankFailure(_failure_message(outdir, failed, codes))
                if all(c is not None for c in codes):
                    break
                time.sleep(0.05)
            else:
                alive = [r for r, p in enumerate(procs) if p.exitcode is None]
                raise RankFailure(
                    f"ranks {alive} of {world_size} did not finish within {timeout:.0f} s "
                    f"(hang or deadlock?); killed them.\n"
                    + _failure_message(outdir, [r for r in range(world_size) if r not in alive],
                                       [p.exitcode for p in procs]))
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(5)
        results: list[Any] = []
        for r in range(world_size):
            path = os.path.join(outdir, f"{r}.pt")
            if os.path.exists(path):
                results.append(torch.load(path, weights_only=False))
            else:
                results.append(_read(os.path.join(outdir, f"{r}.err")) or
                               f"rank {r} exited with code {procs[r].exitcode} and no traceback")
        return results


def wait_for_file(path: str, seconds: float) -> bool:
    """Wait until `path` exists or `seconds` pass; whether it exists. For a rank that must stay
    alive (its exit would end a peer's collective early) until the peer says it is done."""
    end = time.monotonic() + seconds
    while not os.path.exists(path):
        if time.monotonic() >= end:
            return False
        time.sleep(0.05)
    return True


def _rank_context() -> Any:
    """Forkserver with torch and dear imported in the server (where the platform has it: else
    spawn). The server holds no thread and no process group, so forking it is safe."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "dear"])
    return ctx


def _read(path: str) -> str:
    try:
        with open(path) as fh:
            return fh.read()
    except OSError:
        return ""


def _failure_message(outdir: str, ranks: list[int], codes: list[Optional[int]]) -> str:
    parts = []
    for r in ranks:
        text = _read(os.path.join(outdir, f"{r}.err"))
        parts.append(f"--- rank {r} (exit code {codes[r]}) ---\n{text or '(no traceback)'}")
    return "\n".join(parts)


def run_ranks(fn: Callable[..., Any], nproc: int, args: tuple, timeout: float) -> int:
    """Run fn(rank, *args) on `nproc` spawned ranks; return 0, or 1 after a failure/timeout."""
    ctx = torch_mp.start_processes(fn, args=args, nprocs=nproc, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if ctx.join(timeout=1.0):
                return 0
        print(f"error: ranks did not finish within {timeout:.0f} s; killing them",
              file=sys.stderr)
        return 1
    except torch_mp.ProcessRaisedException as exc:
        print(f"error: a rank failed:\n{exc}", file=sys.stderr)
        return 1
    except torch_mp.ProcessExitedException as exc:
        print(f"error: a rank exited: {exc}", file=sys.stderr)
        return 1
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.kill()
            proc.join(5)
