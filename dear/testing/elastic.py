"""torchrun's elastic agent on one machine, for tests and measurements: agents started as
"nodes" (each `torchrun --nnodes MIN:MAX ... --rdzv-backend c10d` in a session of its own), a
worker or an agent killed, an agent added, each worker's output files collected, and a hard
deadline after which every process the cluster started is killed.

Every process the cluster starts carries DEAR_ELASTIC_HARNESS=<token> in its environment
(torchrun passes its environment on to the workers), so `close()` finds and kills them all,
workers whose agent died included. A worker script should call `die_with_parent()` first: a
worker then dies with its agent (as on a node that is lost) instead of running on as an orphan.

    with ElasticCluster([script, "--out", str(tmp)], nnodes="1:3") as cluster:
        a, b = cluster.start_agent(), cluster.start_agent()
        cluster.wait_for(lambda: (tmp / "step5").exists(), "step 5")
        cluster.kill_worker(b)
        codes = cluster.wait_agents()
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

from .ranks import free_port

#: In every process the cluster starts: how close() finds the workers.
TOKEN_VAR = "DEAR_ELASTIC_HARNESS"


class ElasticTimeout(AssertionError):
    """What a test waited for did not happen before the cluster's deadline: every process was
    killed; the message has the agents' logs."""


@dataclass
class Agent:
    """One torchrun agent ("node"): its process, its log, when it was started."""

    index: int
    proc: subprocess.Popen
    log: Path
    started: float = field(default_factory=time.monotonic)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def returncode(self) -> Optional[int]:
        return self.proc.poll()


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask Linux to send `sig` to this process when its parent (the torchrun agent) dies, so
    that a killed agent takes its worker with it (a lost node). No-op where prctl is missing."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, sig, 0, 0, 0)
    if os.getppid() == 1:               # the parent died before the call
        os.kill(os.getpid(), sig)


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        if int(fields[1]) == pid:
            out.append(int(entry))
    return sorted(out)


def _tagged(token: str) -> list[int]:
    """Every live process whose environment carries TOKEN_VAR=token."""
    needle = f"{TOKEN_VAR}={token}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                if needle in fh.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:
            continue
    return found


class ElasticCluster:
    """Agents of one torchrun elastic job on localhost (see the module's docstring).

    `command` is what follows torchrun's own options (a script and its arguments). The
    rendezvous runs on 127.0.0.1 at a free port with run id `run_id`; `rdzv_conf` goes to
    `--rdzv-conf` (e.g. {"last_call_timeout": 1}). With `own_store` (the default) the
    rendezvous store runs in a process of the cluster's own, as a stable endpoint on a real
    cluster would, and no agent hosts it (`is_host=0`): otherwise the first agent to bind the
    port hosts it, and losing that agent ends the job. `timeout` bounds the cluster's whole life:
    `wait_for` and `wait_agents` raise ElasticTimeout past it, and close() (also on leaving the
    `with` block) kills every process the cluster started.
    """

    def __init__(self, command: Sequence[str], *, nnodes: str = "1:3", nproc_per_node: int = 1,
                 max_restarts: int = 3, rdzv_conf: Optional[Mapping[str, object]] = None,
                 monitor_interval: Optional[float] = None, env: Optional[Mapping[str, str]] = None,
                 workdir: Optional[Path] = None, timeout: float = 120.0,
                 run_id: Optional[str] = None, python: str = sys.executable,
                 own_store: bool = True) -> None:
        self.command = list(command)
        self.nnodes = nnodes
        self.nproc_per_node = nproc_per_node
        self.max_restarts = max_restarts
        self.rdzv_conf = dict(rdzv_conf or {})
        self.monitor_interval = monitor_interval
        self.token = uuid.uuid4().hex[:12]
        self.run_id = run_id or f"dear-elastic-{self.token}"
        self.port = free_port()
        self.env = {**os.environ, **(env or {}), TOKEN_VAR: self.token}
        self.workdir = Path(workdir) if workdir is not None else Path(
            os.environ.get("TMPDIR", "/tmp")) / f"dear-elastic-{self.token}"
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.deadline = time.monotonic() + timeout
        self.timeout = timeout
        self.python = python
        self.agents: list[Agent] = []
        self.closed = False
        self.store: Optional[subprocess.Popen] = None
        if own_store:
            self.rdzv_conf.setdefault("is_host", 0)
            self._start_store()

    # ------------------------------------------------------------------------- agents
    def torchrun_args(self) -> list[str]:
        """torchrun's command line for one agent (the same for every agent)."""
        args = [self.python, "-m", "torch.distributed.run", "--nnodes", self.nnodes,
                "--nproc-per-node", str(self.nproc_per_node), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"127.0.0.1:{self.port}", "--rdzv-id", self.run_id,
                "--max-restarts", str(self.max_restarts)]
        if self.rdzv_conf:
            args += ["--rdzv-conf", ",".join(f"{k}={v}" for k, v in self.rdzv_conf.items())]
        if self.monitor_interval is not None:
            args += ["--monitor-interval", str(self.monitor_interval)]
        return args + self.command

    def start_agent(self, env: Optional[Mapping[str, str]] = None) -> Agent:
        """Start one more agent (a node joining): its own session, its log in the workdir."""
        self._check_open()
        index = len(self.agents)
        log = self.workdir / f"agent{index}.log"
        with open(log, "wb") as fh:
            proc = subprocess.Popen(self.torchrun_args(), env={**self.env, **(env or {}),
                                                               "DEAR_ELASTIC_AGENT": str(index)},
                                    stdout=fh, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        agent = Agent(index, proc, log)
        self.agents.append(agent)
        return agent

    def _start_store(self) -> None:
        """The rendezvous TCPStore in a process of its own; returns once it listens."""
        code = ("import sys, datetime, torch.distributed as d\n"
                f"s = d.TCPStore('127.0.0.1', {self.port}, is_master=True, multi_tenant=True, "
                "wait_for_workers=False, timeout=datetime.timedelta(seconds=60))\n"
                "print('ready', flush=True)\n"
                "sys.stdin.read()\n")
        self.store = subprocess.Popen([self.python, "-c", code], env=self.env,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, start_new_session=True)
        assert self.store.stdout is not None
        line = self.store.stdout.readline()          # bounded: the store exits on failure
        if b"ready" not in line:
            rest = self.store.stdout.read() if self.store.poll() is not None else b""
            self.close()
            raise RuntimeError("the rendezvous store did not start: "
                               f"{(line + rest).decode(errors='replace')}")

    def workers(self, agent: Agent) -> list[int]:
        """The pids of `agent`'s live workers (its child processes)."""
        return _children(agent.pid)

    def kill_worker(self, agent: Agent, sig: int = signal.SIGKILL, local_rank: int = 0) -> int:
        """Send `sig` to one of `agent`'s workers (the first child, by pid, unless local_rank
        says otherwise) once it has one; returns its pid. The agent sees a failed worker."""
        pids: list[int] = []

        def found() -> bool:
            pids[:] = self.workers(agent)
            return bool(pids)
        self.wait_for(found, f"a worker of agent {agent.index}")
        pid = pids[min(local_rank, len(pids) - 1)]
        os.kill(pid, sig)
        return pid

    def kill_agent(self, agent: Agent, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to the agent alone (SIGKILL: a lost node, its workers die with it if they
        called die_with_parent(); SIGTERM: the agent stops its workers and leaves)."""
        if agent.proc.poll() is None:
            os.kill(agent.pid, sig)

    # -------------------------------------------------------------------------- waiting
    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def wait_for(self, predicate: Callable[[], object], what: str, poll: float = 0.05) -> object:
        """Poll `predicate` until it returns something true (returned), or fail at the
        deadline (every process killed, logs in the message)."""
        while True:
            value = predicate()
            if value:
                return value
            if self.remaining() <= 0:
                self._fail(f"waited {self.timeout:.0f} s for {what}")
            time.sleep(poll)

    def wait_agents(self, agents: Optional[Sequence[Agent]] = None) -> list[int]:
        """Wait until the agents (all by default) have exited; their return codes."""
        chosen = list(self.agents if agents is None else agents)
        self.wait_for(lambda: all(a.proc.poll() is not None for a in chosen),
                      f"agents {[a.index for a in chosen]} to exit")
        return [int(a.proc.returncode) for a in chosen]

    def logs(self) -> str:
        parts = []
        for agent in self.agents:
            try:
                text = agent.log.read_text(errors="replace")
            except OSError:
                text = "(no log)"
            parts.append(f"--- agent {agent.index} (exit {agent.proc.poll()}) ---\n"
                         f"{text[-6000:]}")
        return "\n".join(parts)

    # -------------------------------------------------------------------------- cleanup
    def close(self) -> None:
        """Kill every process the cluster started (agents, their workers, orphans)."""
        if self.closed:
            return
        self.closed = True
        for agent in self.agents:
            if agent.proc.poll() is None:
                try:
                    os.killpg(agent.pid, signal.SIGKILL)
                except OSError:
                    pass
        if self.store is not None and self.store.poll() is None:
            self.store.kill()
            self.store.wait(5)
        for _ in range(3):                     # workers live in sessions of their own
            pids = _tagged(self.token)
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            time.sleep(0.1)
        for agent in self.agents:
            try:
                agent.proc.wait(5)
            except subprocess.TimeoutExpired:
                pass

    def leftovers(self) -> list[int]:
        """Processes of this cluster still alive (after close(): none, or a test fails)."""
        return _tagged(self.token)

    def _fail(self, message: str) -> None:
        logs = self.logs()
        self.close()
        raise ElasticTimeout(f"{message}; killed every process of the job.\n{logs}")

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this ElasticCluster is closed: create a new one")

    def __enter__(self) -> "ElasticCluster":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["Agent", "ElasticCluster", "ElasticTimeout", "TOKEN_VAR", "die_with_parent"]
