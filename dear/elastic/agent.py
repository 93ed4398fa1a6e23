"""The worker's side of torchrun's elastic agent: is this process one of its workers, did the
agent ask it to stop, does a node wait to join, and how to leave so that the agent restarts
the group at its new size.

The agent (torch/distributed/elastic/agent/server/api.py) checks its workers every
`--monitor-interval` seconds. A worker that exited non-zero makes it restart its workers,
spending one of `--max-restarts`; a node waiting in the rendezvous (`num_nodes_waiting() > 0`)
makes it restart them without spending one. Either way it stops the live workers with SIGTERM
and, 30 s later, SIGKILL, then rendezvouses and starts new workers with the new RANK and
WORLD_SIZE. So every membership change restarts every worker.

A worker under dear.elastic.run therefore (1) takes SIGTERM as "stop at the next commit"
(`TermWatch`: the commit completes, `check_host_updates()` raises HostsUpdatedInterrupt on
every rank at once, and the process exits), bounded by DEAR_ELASTIC_GRACE seconds after which
it exits anyway; (2) reads the rendezvous itself at each commit (`Rendezvous`: the agent's
`--rdzv-endpoint` and `--rdzv-id`, from the agent's command line, since torchrun does not pass
them on), so that a node waiting to join interrupts training at a commit even before the agent
acts; (3) after a failed collective exits non-zero at once, writing torchrun's error file.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, NoReturn, Optional

from ..comm import launch
from ..config import Config

log = logging.getLogger("dear")

#: exit codes: after SIGTERM (as a process killed by it), after a failure or a change the
#: agent must restart us for
EXIT_TERM = 143
EXIT_RESTART = 1

_LEAVE_WAIT = 5.0               # for the agent's SIGTERM, where the rendezvous is unreadable


@dataclass(frozen=True)
class Launch:
    """What torchrun told this worker (its environment)."""

    run_id: str
    restart_count: int
    max_restarts: int
    agent_store: bool            # TORCHELASTIC_USE_AGENT_STORE

    @staticmethod
    def detect() -> Optional["Launch"]:
        """This process's launch by torchrun's agent, or None (not under torchrun)."""
        given = launch.torchelastic()
        if given is None:
            return None
        run_id, restart_count, max_restarts = given
        return Launch(run_id=run_id, restart_count=restart_count, max_restarts=max_restarts,
                      agent_store=launch.agent_store())

    def check(self, elastic: bool = True) -> None:
        """Refuse a launch whose restarts cannot work (clear error, what to set). A job whose
        workers are never restarted (`elastic` False: fixed --nnodes, --max-restarts 0) needs
        nothing."""
        if self.agent_store and elastic:
            raise RuntimeError(
                "dear.elastic under torchrun needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in "
                "torchrun's environment (export it before torchrun, on every node). Without "
                "it torch's agent lends its own store to the workers and keeps it across "
                "restarts, so the restarted workers can read the previous workers' addresses "
                "and fail to connect (pytorch/pytorch#135712); with it each restart gets a "
                "fresh store")


# ---------------------------------------------------------------------------------- SIGTERM
def agent_alive(agent: int) -> bool:
    """Whether the agent that started this worker is still its parent (a worker whose agent
    died is re-parented: its node left the job, and it must stop at the next commit)."""
    return os.getppid() == agent


class TermWatch:
    """SIGTERM as a request to stop at the next commit. The C-level handler wakes a thread
    through `signal.set_wakeup_fd` even while the main thread is blocked in a collective, so
    the grace period runs from the signal itself: past DEAR_ELASTIC_GRACE seconds (default 25,
    below the agent's 30 s before SIGKILL) without a commit, the process exits and only the
    work since the last commit is lost."""

    def __init__(self, grace: Optional[float] = None) -> None:
        self.grace = grace if grace is not None else Config.from_env().elastic_grace
        self.requested = threading.Event()
        self.received_at: Optional[float] = None
        self.leaving = threading.Event()       # the process is on its way out: no timer exit
        self._thread: Optional[threading.Thread] = None
        self._previous: Any = None
        self._sockets: Optional[tuple[socket.socket, socket.socket]] = None
        self._old_fd = -1

    def install(self) -> bool:
        """Catch SIGTERM (main thread only); False where it cannot (not the main thread)."""
        if threading.current_thread() is not threading.main_thread():
            return False
        reader, writer = socket.socketpair()
        writer.setblocking(False)
        try:
            old_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        except ValueError:
            reader.close()
            writer.close()
            return False
        if old_fd != -1:                       # someone else's (asyncio): give it back
            signal.set_wakeup_fd(old_fd)
            reader.close()
            writer.close()
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)
            return True
        self._sockets = (reader, writer)
        self._previous = signal.signal(signal.SIGTERM, self._on_signal)
        self._thread = threading.Thread(target=self._watch, name="dear-elastic-sigterm",
                                        daemon=True)
        self._thread.start()
        return True

    def uninstall(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
        if self._sockets is not None:
            signal.set_wakeup_fd(-1)
            for sock in self._sockets:
                sock.close()
            self._sockets = None

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._requested()

    def _watch(self) -> None:
        assert self._sockets is not None
        reader = self._sockets[0]
        while True:
            try:
                data = reader.recv(64)
            except OSError:
                return
            if not data:
                return
            if signal.SIGTERM in data:
                self._requested()

    def _requested(self) -> None:
        if self.requested.is_set():
            return
        self.received_at = time.monotonic()
        self.requested.set()
        log.warning("dear.elastic: SIGTERM (torchrun's agent is restarting the workers or "
                    "this node is leaving): stopping at the next commit, within %.0f s "
                    "(DEAR_ELASTIC_GRACE)", self.grace)
        timer = threading.Timer(self.grace, self._expire)
        timer.daemon = True
        timer.start()

    def _expire(self) -> None:
        if self.leaving.is_set():
            return
        _say(f"dear.elastic: no commit within {self.grace:.0f} s of SIGTERM "
             "(DEAR_ELASTIC_GRACE): exiting now; the work since the last commit is lost. "
             "Commit more often than that to resize without losing any")
        os._exit(EXIT_TERM)

    def wait(self, seconds: float) -> bool:
        return self.requested.wait(seconds)


# ------------------------------------------------------------------------------ rendezvous
class Rendezvous:
    """The rendezvous of the agent that started this worker, read from its c10d store: how
    many nodes wait to join. The endpoint and run id come from the agent's command line (the
    parent process), parsed by torchrun's own parser; None where that fails (another
    launcher, another backend), and the worker then relies on SIGTERM alone."""

    def __init__(self, endpoint: str, run_id: str, timeout: float = 5.0) -> None:
        self.agent = os.getppid()
        self.endpoint = endpoint
        self.run_id = run_id
        self.timeout = timeout
        self._backend: Any = None
        self.failed = False

    @staticmethod
    def of_parent(run_id: str) -> Optional["Rendezvous"]:
        parsed = agent_args()
        if parsed is None or parsed.rdzv_backend != "c10d" or not parsed.rdzv_endpoint:
            return None
        if parsed.rdzv_id != run_id:
            return None
        return Rendezvous(parsed.rdzv_endpoint, run_id)

    def state(self) -> Any:
        """The rendezvous state (torch's _RendezvousState), or None on any failure."""
        if self.failed:
            return None
        try:
            if self._backend is None:
                import datetime

                import torch.distributed as dist
                from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
                    C10dRendezvousBackend,
                )
                from torch.distributed.elastic.rendezvous.utils import (
                    parse_rendezvous_endpoint,
                )
                host, port = parse_rendezvous_endpoint(self.endpoint, default_port=29400)
                store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                                      timeout=datetime.timedelta(seconds=self.timeout))
                self._backend = C10dRendezvousBackend(store, self.run_id)
            got = self._backend.get_state()
            return None if got is None else pickle.loads(got[0])
        except Exception as exc:               # noqa: BLE001 - only an optimisation
            self.failed = True
            log.info("dear.elastic: cannot read the rendezvous at %s (%s); relying on "
                     "the agent's SIGTERM alone", self.endpoint, exc)
            return None

    def read(self) -> tuple[Optional[int], bool]:
        """(nodes waiting for the next round, as the agent's num_nodes_waiting() reads it;
        whether this worker's agent is still a participant of the round). An agent that is no
        longer a participant was declared dead (its heartbeat late by more than
        keep_alive_interval x keep_alive_max_attempt) while it lives: the other nodes go on
        without it, and its workers must stop before they commit over the others' commits."""
        state = self.state()
        if state is None:
            return None, True
        member = not state.complete or any(node.pid == self.agent
                                           for node in state.participants)
        return len(state.wait_list), member


class PeerWatch:
    """Exit at once when torchrun's rendezvous declares a node of this worker's round dead (its
    agent's heartbeat late past keep_alive_interval x keep_alive_max_attempt) while the worker
    trains. A collective with a dead peer mostly fails at once (a reset connection), but one
    already waiting to receive from it can wait the whole DEAR_TIMEOUT; the rendezvous knows
    within the heartbeat expiry. A daemon thread reads the round every `interval` seconds over
    a store connection of its own; it stands aside once the round moves on (a resize the agent
    announces with SIGTERM), after SIGTERM, and once stopped."""

    def __init__(self, rendezvous: Rendezvous, term: TermWatch, interval: float = 1.0) -> None:
        self.rendezvous = rendezvous
        self.term = term
        self.interval = interval
        self.stopped = threading.Event()

    def start(self) -> bool:
        """Watch this round's nodes; False where the rendezvous cannot be read."""
        state = self.rendezvous.state()
        if state is None or not state.complete or state.closed:
            return False
        threading.Thread(target=self._watch, args=(state.round, set(state.participants)),
                         name="dear-elastic-peers", daemon=True).start()
        return True

    def stop(self) -> None:
        self.stopped.set()

    def _watch(self, round_: int, nodes: set) -> None:
        while not self.stopped.wait(self.interval):
            state = self.rendezvous.state()
            if state is None or state.closed or state.round != round_ or not state.complete:
                return                         # unreadable, or the agents moved on
            gone = nodes - set(state.participants)
            if not gone or self.stopped.is_set() or self.term.requested.is_set():
                continue
            _say(f"dear.elastic: torchrun's rendezvous declared {len(gone)} node(s) of this "
                 f"round dead ({', '.join(sorted(str(n) for n in gone))}): exiting with code "
                 f"{EXIT_RESTART} so that torchrun's agent restarts the workers at the new "
                 "size; they resume from the last commit")
            os._exit(EXIT_RESTART)


def agent_args() -> Any:
    """The agent's (the parent process's) torchrun arguments, parsed by torchrun's own parser
    (an argparse.Namespace), or None where the parent is not torchrun."""
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as fh:
            argv = [a.decode(errors="replace") for a in fh.read().split(b"\0") if a]
    except OSError:
        return None
    args = _torchrun_args(argv)
    if args is None:
        return None
    try:
        from torch.distributed.run import get_args_parser
        parsed, _ = get_args_parser().parse_known_args(args)
    except SystemExit:
        return None
    return parsed


def elastic_launch(launch: "Launch", parsed: Any) -> bool:
    """Whether this job's workers can be restarted: --max-restarts > 0, or --nnodes MIN:MAX
    with MIN < MAX (a node joining restarts them). Unknown (another parent): assume so."""
    if launch.max_restarts > 0 or parsed is None:
        return True
    low, _, high = str(getattr(parsed, "nnodes", "1")).partition(":")
    return bool(high) and high != low


def _torchrun_args(argv: list[str]) -> Optional[list[str]]:
    """torchrun's own arguments out of the agent's command line (`torchrun ...`,
    `python -m torch.distributed.run ...`, `python .../torchrun ...`), or None."""
    for i, arg in enumerate(argv):
        if arg == "-m" and i + 1 < len(argv) and argv[i + 1] in ("torch.distributed.run",
                                                                  "torch.distributed.launch"):
            return argv[i + 2:]
        if os.path.basename(arg) == "torchrun":
            return argv[i + 1:]
    return None


# ------------------------------------------------------------------------------- leaving
def _say(message: str) -> None:
    try:
        sys.stdout.flush()
    except Exception:                          # noqa: BLE001
        pass
    try:
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
    except Exception:                          # noqa: BLE001
        pass


def _record_error(exc: BaseException) -> None:
    """torchrun's error file (TORCHELASTIC_ERROR_FILE), which its failure summary prints."""
    try:
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler
        ErrorHandler().record_exception(exc)
    except Exception:                          # noqa: BLE001 - the exit matters more
        pass


def exit_after_failure(exc: BaseException, where: str) -> NoReturn:
    """A collective failed (a worker died or stalled) or the function raised: say so, write
    torchrun's error file, exit non-zero at once (the agent restarts the workers, spending one
    of --max-restarts; they resume from the last commit). os._exit: tearing down Python
    could wait on the dead peer."""
    launch = Launch.detect()
    restarts = (f" (restart {launch.restart_count + 1} of --max-restarts "
                f"{launch.max_restarts})" if launch is not None else "")
    _say("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
    first = str(exc).splitlines()[0] if str(exc) else ""
    _say(f"dear.elastic: {where}: {type(exc).__name__}: {first}"
         f"\ndear.elastic: exiting with code {EXIT_RESTART} so that torchrun's agent restarts "
         f"the workers{restarts}; they resume from the last commit")
    _record_error(exc)
    os._exit(EXIT_RESTART)


def exit_for_change(term: TermWatch, nodes_waiting: Optional[int]) -> NoReturn:
    """After HostsUpdatedInterrupt (the state is committed): leave so that the agent restarts
    the group at its new size. Asked by SIGTERM: exit at once. A node waits to join: the agent
    sends SIGTERM within its monitor interval (and spends no restart): wait for it. Otherwise
    another node is leaving and this node's agent knows nothing: exit non-zero, which makes it
    restart the workers (one of --max-restarts)."""
    term.leaving.set()
    if not term.requested.is_set():
        if nodes_waiting:
            term.wait(term.grace)
        elif nodes_waiting is None:            # the rendezvous is unreadable: wait a little
            term.wait(_LEAVE_WAIT)
    if term.requested.is_set():
        _say("dear.elastic: state committed; exiting for torchrun's agent to restart the "
             "workers at the new size")
        os._exit(EXIT_TERM)
    _say("dear.elastic: state committed; the set of workers changed (a node is leaving): "
         f"exiting with code {EXIT_RESTART} so that torchrun's agent restarts this node's "
         "workers at the new size (one of --max-restarts)")
    os._exit(EXIT_RESTART)


__all__ = ["EXIT_RESTART", "EXIT_TERM", "Launch", "PeerWatch", "Rendezvous", "TermWatch",
           "agent_alive", "agent_args", "elastic_launch", "exit_after_failure",
           "exit_for_change"]
