"""One generation of workers under torchrun, inside run(): which commit to resume from, where
the next commit goes, whether the agent asked this worker to stop.

Every decision that changes what a rank does next is agreed in one small all-gather, so every
rank takes the same branch: which commit every rank sees complete (the newest of those), the
next commit's number, whether this generation follows a restart.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Optional

from .agent import Launch, Rendezvous, TermWatch, agent_alive
from .commit import CommitDir, default_directory, pack
from .ops import Ops

if TYPE_CHECKING:
    from .state import BaseState

log = logging.getLogger("dear")

_RANK_KEY = "rank"


class Session:
    """See the module's docstring. `scope` names the commits of one decorated function."""

    def __init__(self, launch: Launch, term: TermWatch, scope: str, ops: Ops,
                 rendezvous: Optional[Rendezvous] = None) -> None:
        self.launch = launch
        self.term = term
        self.ops = ops
        self.rendezvous = rendezvous
        self.agent = os.getppid()
        self.directory = CommitDir(default_directory(launch.run_id), scope)
        self.next_commit = 0
        self.resumed_from: Optional[int] = None
        self.finished = False
        self.agreed_waiting: Optional[int] = None     # what the last host check agreed
        self.commit_seconds: list[float] = []

    # ------------------------------------------------------------------------ resuming
    def resume(self, state: "BaseState") -> bool:
        """Every rank: load the newest commit that every rank sees complete (resharded to
        this world size); returns whether this generation follows a reset (a commit exists
        or some agent restarted its workers)."""
        seen, complete = self.directory.listed()
        rows = self.ops.allgather_object((seen[-1] if seen else -1, complete,
                                          self.directory.finished(),
                                          self.launch.restart_count))
        sets = [set(row[1]) for row in rows]
        common = set.intersection(*sets)
        if set.union(*sets) and not common or len({row[2] for row in rows}) > 1:
            listing = "; ".join(f"rank {r}: complete commits {sorted(s)}"
                                for r, s in enumerate(sets))
            raise RuntimeError(
                f"dear.elastic: the ranks do not see the same commits in {self.directory.path} "
                f"({listing}): DEAR_ELASTIC_DIR must be one directory that every node reads "
                "and writes (a shared file system), not a local one")
        self.next_commit = max(row[0] for row in rows) + 1
        self.finished = bool(rows[0][2])
        newest = max(common) if common else None
        if newest is not None:
            self.load(state, newest)
        return newest is not None or any(row[3] > 0 for row in rows)

    def load(self, state: "BaseState", n: int) -> None:
        keys = self.directory.keys(n)
        old_world = sum(1 for k in keys if k.startswith(_RANK_KEY) and k[4:].isdigit())
        rank, world = self.ops.rank(), self.ops.size()
        template = state.commit_template(keys, old_world, rank, world)
        loaded = self.directory.read(n, template)
        state.apply_commit(loaded, old_world, rank, world)
        state.save()                            # restore() inside this process comes back here
        self.resumed_from = n
        log.info("dear.elastic: rank %d of %d resumed from commit %d (made on %d ranks) in %s",
                 rank, world, n, old_world, self.directory.path)

    # ------------------------------------------------------------------------ commits
    def persist(self, state: "BaseState") -> None:
        """Every rank: write the state as the next commit; rank 0 then prunes old ones."""
        start = time.perf_counter()
        rank, world = self.ops.rank(), self.ops.size()
        n = self.next_commit
        items = state.commit_items(rank)
        items[f"{_RANK_KEY}{rank}"] = pack({"rank": rank, "world": world, "commit": n})
        self.directory.write(n, items)
        self.next_commit = n + 1
        if rank == 0:
            self.directory.prune()
        self.commit_seconds.append(time.perf_counter() - start)

    def finish(self, state: "BaseState") -> None:
        """The function returned on every rank: a last commit, marked finished, so that a
        restart after this point (a node joining at the very end) does not train again."""
        state.save()
        self.persist(state)
        if self.ops.rank() == 0:
            self.directory.mark_finished()

    # ------------------------------------------------------------------ host updates
    def host_update(self) -> tuple[bool, Optional[int]]:
        """(stop: SIGTERM came, or this node was dropped from the rendezvous; nodes waiting
        to join, None where the rendezvous cannot be read)."""
        stop = self.term.requested.is_set()
        if not agent_alive(self.agent):
            log.warning("dear.elastic: torchrun's agent of this node died: stopping at this "
                        "commit")
            stop = True
        if self.rendezvous is None:
            return stop, None
        waiting, member = self.rendezvous.read()
        if not member and not stop:
            log.warning("dear.elastic: this node's agent is no longer in torchrun's rendezvous "
                        "(its heartbeat was late; the others go on without it): stopping")
        return stop or not member, waiting


__all__ = ["Session"]
