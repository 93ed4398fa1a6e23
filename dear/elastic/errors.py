"""What ends a training function inside dear.elastic.run / hvd.elastic.run, with Horovod's
meaning: a failed collective (restore the last commit, then carry on with the workers that are
left) and a membership change seen at a commit (carry on from the state just committed)."""

from __future__ import annotations

import enum


class HostUpdateResult(enum.IntFlag):
    """What changed in the set of workers (Horovod's flags): nodes removed, added, or both."""

    no_update = 0
    removed = 1
    added = 2
    mixed = removed | added


class HostsUpdatedInterrupt(RuntimeError):
    """The set of workers changed: raised by `check_host_updates()` (so by `commit()`) on every
    rank at the same commit, after the state was committed, so nothing is rolled back.
    `skip_sync`: only workers were removed, so the survivors need not synchronize (Horovod's)."""

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("the set of workers changed" + (" (workers removed)" if skip_sync
                                                         else ""))
        self.skip_sync = skip_sync


#: Errors that mean "a collective failed" to the in-process loop of run() (Horovod restores the
#: last commit on these). dear.horovod.elastic adds HorovodInternalError. Under torchrun any
#: error ends the process and the agent restarts the workers, so the list does not matter there.
_recoverable: list[type[BaseException]] = []


def register_recoverable(error: type[BaseException]) -> None:
    """Treat `error` as a failed collective in run()'s in-process loop (restore, then retry)."""
    if error not in _recoverable:
        _recoverable.append(error)


def recoverable() -> tuple[type[BaseException], ...]:
    return tuple(_recoverable)


__all__ = ["HostUpdateResult", "HostsUpdatedInterrupt", "recoverable", "register_recoverable"]
