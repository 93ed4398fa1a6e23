"""Run a command line as a user would, with a hard timeout that kills its whole process group."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
# The skip for a missing mpirun: "not installed" makes it a failure where CI requires every
# extra (tests/conftest.py, DEAR_REQUIRE_EXTRAS=1).
NO_MPIRUN = "mpirun is not installed (`make setup` installs the mpich wheel and mpi4py)"


def run(cmd: list[str], timeout: float, env: dict[str, str] | None = None,
        cwd: str = ROOT) -> subprocess.CompletedProcess:
    proc = subprocess.Popen(cmd, cwd=cwd, env={**os.environ, **(env or {})}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{' '.join(cmd)} did not finish within {timeout:.0f} s "
                             f"(hang?); killed it. Output:\n{out}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")
