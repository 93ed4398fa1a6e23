"""Launch a script on N Horovod ranks over Gloo as plain subprocesses (what horovodrun does,
without its launcher), with a hard timeout that kills every rank's process group."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from tests.subprocesses import ROOT

# The skip for a missing Horovod: "not installed" makes it a failure where CI requires every
# extra (tests/conftest.py, DEAR_REQUIRE_EXTRAS=1).
NO_HOROVOD = "Horovod with its torch extension is not installed (make horovod)"


def horovod_available() -> bool:
    try:
        import horovod.torch as hvd
    except ImportError:
        return False
    return hasattr(hvd, "init")


def run_horovod(args: list[str], np: int = 2, timeout: float = 180.0) -> list[str]:
    """Run `python <args>` on `np` ranks; return each rank's output; fail on error or hang."""
    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
    from horovod.runner.http.http_server import RendezvousServer

    server = RendezvousServer(verbose=0)
    port = server.start()
    plan = get_host_assignments(parse_hosts(f"localhost:{np}"), np)
    server.init(plan)
    procs = []
    try:
        for slot in plan:
            env = {**os.environ, "PYTHONPATH": ROOT,
                   "HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1",
                   "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port), "HOROVOD_CONTROLLER": "gloo",
                   "HOROVOD_CPU_OPERATIONS": "gloo", "HOROVOD_GLOO_IFACE": "lo",
                   "HOROVOD_HOSTNAME": "localhost", "HOROVOD_RANK": str(slot.rank),
                   "HOROVOD_SIZE": str(slot.size), "HOROVOD_LOCAL_RANK": str(slot.local_rank),
                   "HOROVOD_LOCAL_SIZE": str(slot.local_size),
                   "HOROVOD_CROSS_RANK": str(slot.cross_rank),
                   "HOROVOD_CROSS_SIZE": str(slot.cross_size), "OMP_NUM_THREADS": "1",
                   # Horovod's default, explicit: a test's short DEAR_TIMEOUT (dear's fault
                   # tests) would otherwise shorten Horovod's rendezvous to DEAR_TIMEOUT + 3 s,
                   # less than two ranks' start-ups may differ on a busy machine
                   "HOROVOD_GLOO_TIMEOUT_SECONDS": os.environ.get(
                       "HOROVOD_GLOO_TIMEOUT_SECONDS", "30")}
            procs.append(subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, text=True,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          start_new_session=True))
        deadline = time.monotonic() + timeout
        outputs = []
        for rank, proc in enumerate(procs):
            try:
                out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"Horovod rank {rank} did not finish within {timeout:.0f} s "
                                     "(hang?); killed every rank") from None
            if proc.returncode != 0:
                raise AssertionError(f"Horovod rank {rank} failed (exit {proc.returncode}):\n{out}")
            outputs.append(out)
        return outputs
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        server.stop()
