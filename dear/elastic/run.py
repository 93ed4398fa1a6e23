"""run(func): the elastic training loop around `func(state, ...)`.

Under torchrun (TORCHELASTIC_RUN_ID set), where every change of the workers restarts every
process:
1. resume: every rank loads the newest commit every rank sees complete (resharded to the new
   size), then the reset callbacks run (after a restart, or when a commit was loaded), then
   `state.sync()`;
2. `func(state, ...)` trains, committing as it goes;
3. a failure (a collective that failed because a worker died or stalled, DEAR_TIMEOUT, a
   Gloo error, HorovodInternalError, any exception) ends the process with exit code 1 at once:
   the agent restarts the workers, which resume from the last commit; torchrun's
   --max-restarts is the reset limit;
4. HostsUpdatedInterrupt (SIGTERM from the agent, or a node waiting in the rendezvous, seen
   at a commit by any rank, agreed by all) ends the process after that commit: nothing lost;
5. when `func` returns on every rank, a last commit is marked finished (a restart after that
   point does not train again: run() then returns None).

Elsewhere (no torchrun: one process, or a launcher that does not restart) Horovod's
in-process loop: sync, run; on a failed collective restore the last commit, reset, sync, run
again; on HostsUpdatedInterrupt reset (no restore) and run again.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Optional, TypeVar

from .agent import (
    Launch,
    PeerWatch,
    Rendezvous,
    TermWatch,
    agent_args,
    elastic_launch,
    exit_after_failure,
    exit_for_change,
)
from .errors import HostsUpdatedInterrupt, recoverable
from .session import Session
from .state import BaseState

log = logging.getLogger("dear")

R = TypeVar("R")

_active: list[TermWatch] = []          # the TermWatch of the run() in progress (torchrun)


def stop_requested() -> bool:
    """Whether torchrun's agent asked this worker to stop (SIGTERM) inside run(): the next
    commit ends the process. A loop may commit at once, or stop waiting for something."""
    return bool(_active) and _active[-1].requested.is_set()


def run_fn(func: Callable[..., R], reset: Callable[[], None]) -> Callable[..., Optional[R]]:
    """The decorator's body: `reset` re-initializes communication in the in-process loop
    (dear.horovod: hvd.shutdown(); hvd.init())."""

    @functools.wraps(func)
    def wrapper(state: BaseState, *args: Any, **kwargs: Any) -> Optional[R]:
        if not isinstance(state, BaseState):
            raise TypeError("the function run() decorates takes the elastic state as its first "
                            f"argument (dear.elastic.State, hvd.elastic.TorchState, ...), got "
                            f"{type(state).__name__}")
        launch = Launch.detect()
        if launch is None:
            return _in_process(func, reset, state, args, kwargs)
        return _under_torchrun(func, launch, state, args, kwargs)

    return wrapper


def run(func: Callable[..., R]) -> Callable[..., Optional[R]]:
    """Run `func(state, ...)` elastically: under torchrun's elastic agent (`--nnodes MIN:MAX
    --max-restarts N --rdzv-backend c10d`) it resumes from the last commit at whatever size
    the job has now and leaves cleanly when the workers change (docs/elastic.md). The state is
    the first argument; `func` must not run a collective before it reads the state (a new
    worker synchronizes first)."""
    return run_fn(func, _no_reset)


def _no_reset() -> None:
    """dear's communicator needs nothing between attempts in one process."""


def _in_process(func: Callable[..., R], reset: Callable[[], None], state: BaseState,
                args: tuple, kwargs: dict) -> R:
    skip_sync = False
    while True:
        try:
            if not skip_sync:
                state.sync()
            return func(state, *args, **kwargs)
        except HostsUpdatedInterrupt as exc:
            skip_sync = exc.skip_sync
        except recoverable():
            state.restore()
            skip_sync = False
        reset()
        state.on_reset()


def _under_torchrun(func: Callable[..., R], launch: Launch, state: BaseState, args: tuple,
                    kwargs: dict) -> Optional[R]:
    launch.check(elastic_launch(launch, agent_args()))
    term = TermWatch()
    term.install()
    _active.append(term)
    session = Session(launch, term, getattr(func, "__qualname__", "run"), state.ops,
                      Rendezvous.of_parent(launch.run_id))
    state.attach(session)
    result: Optional[R] = None
    try:
        try:
            restarted = session.resume(state)
            if session.finished:
                log.warning("dear.elastic: %s already returned on every rank in this job (its "
                            "last commit in %s is marked finished): the state is that commit, "
                            "and %s is not called again. To train again from the start, "
                            "remove that directory or give torchrun another --rdzv-id",
                            getattr(func, "__qualname__", func), session.directory.path,
                            getattr(func, "__qualname__", func))
                return None
            if restarted:
                state.on_reset()
            state.sync()
            peers = Rendezvous.of_parent(launch.run_id)    # a store connection of its own
            watch = PeerWatch(peers, term) if peers is not None else None
            if watch is not None:
                watch.start()
            try:
                result = func(state, *args, **kwargs)
            finally:
                if watch is not None:
                    watch.stop()
            session.finish(state)
        except HostsUpdatedInterrupt:
            exit_for_change(term, session.agreed_waiting)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:           # noqa: BLE001 - every failure restarts
            exit_after_failure(exc, f"rank {state.ops.rank()} failed")
        if term.requested.is_set():            # asked to stop after the last commit
            exit_for_change(term, session.agreed_waiting)
    finally:
        _active.remove(term)
        term.leaving.set()
        term.uninstall()
        state.attach(None)
    return result


__all__ = ["run", "run_fn", "stop_requested"]
