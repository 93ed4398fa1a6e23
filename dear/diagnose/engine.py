"""Replay: ranks run programs of compute, issue and wait; collectives share one FIFO link.

A program is a list of actions:
    ("compute", seconds, label)   the training thread works
    ("issue", key)                a collective is issued (non-blocking)
    ("wait", key)                 the thread blocks until that collective has completed
    ("mark", label)               a named instant (iteration boundaries)
Every rank issues the same collectives in the same order (as dear and DDP guarantee). Collective
number c starts when every rank has issued it and collective c-1 has finished, and lasts
`cost(key)`: one ring at a time on the link, as NCCL's stream, Horovod's background thread and
dear's Gloo exchange run them.

`slots` k > 1: up to k collectives run at once and share the link equally (processor sharing),
the next in issue order starting when one ends: torch's Gloo process group runs 2 at once on its
2 worker threads, so DDP's and WFBP's buckets finish later than one at a time would
(docs/benchmarks.md#gloo-runs-two-collectives-at-once).
Sharing delays only collectives already running, so a collective's end is final once the next
one cannot start before it (`_SharedLink`).

`post` (one link only): seconds of work after a collective leaves the link and before a wait
for it returns, on one thread shared by all of them in link order: a quantized bucket's
dequantizing on dear's decode thread (dear/fusion/quantized.py). The link is free meanwhile.

`contention` k: compute runs 1 + k times slower while a collective is on the link (the CPU
that computes also runs the transport, as on the emulated cluster's one core per rank).
`replay_contended` finds the link's busy time and the compute it slows together, by replaying
until they agree.
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Callable, Optional, Sequence

from .intervals import Interval, union

Action = tuple
Key = tuple                 # a collective: (kind, iteration, bucket or group, ...)


@dataclasses.dataclass
class Replay:
    compute: list[list[tuple[float, float, str]]]     # per rank: (start, end, label)
    waits: list[list[tuple[float, float, Key]]]       # per rank: blocked intervals
    marks: list[list[tuple[str, float]]]              # per rank
    issued: list[dict[Key, float]]                    # per rank: key -> issue time
    comm: dict[Key, tuple[float, float]]              # key -> (start, end) on the link
    order: list[Key]                                  # keys in link order
    #: key -> when a wait for it returns, where that is later than its end on the link
    #: (`post`: work after the transfer)
    done: dict[Key, float] = dataclasses.field(default_factory=dict)

    def mark_times(self, label: str) -> list[list[float]]:
        return [[t for name, t in marks if name == label] for marks in self.marks]


def stretched(start: float, work: float, busy: Sequence[Interval], contention: float) -> float:
    """Wall time of `work` seconds of compute from `start` when it runs 1 + contention times
    slower inside the (sorted, disjoint) `busy` intervals."""
    if contention <= 0 or not busy or work <= 0:
        return work
    t, left = start, work
    i = bisect.bisect_right(busy, t, key=lambda interval: interval[1])
    while i < len(busy):
        lo, hi = busy[i]
        if t < lo:                             # free until the next busy interval
            if left <= lo - t:
                break
            left -= lo - t
            t = lo
        if left * (1 + contention) <= hi - t:
            return t + left * (1 + contention) - start
        left -= (hi - t) / (1 + contention)
        t, i = hi, i + 1
    return t + left - start


def replay_contended(programs: Sequence[Sequence[Action]], cost: Callable[[Key], float],
                     contention: float = 0.0, passes: int = 8, slots: int = 1,
                     post: Optional[Callable[[Key], float]] = None) -> Replay:
    """`replay` with compute slowed while the link is busy: replayed with the previous pass's
    busy intervals until they stop moving (a few passes)."""
    out = replay(programs, cost, slots=slots, post=post)
    for _ in range(passes if contention > 0 else 0):
        busy = union(out.comm.values())
        nxt = replay(programs, cost, contention, busy, slots, post)
        if nxt.comm == out.comm:
            return nxt
        out = nxt
    return out


class _SharedLink:
    """Up to `slots` collectives on the link at once, sharing it equally; they start in issue
    order, each when every rank has issued it and a slot is free. Times are provisional until
    no later collective can start before them (`final`)."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.ready: list[float] = []           # per admitted collective: all ranks issued
        self.work: list[float] = []            # its duration alone on the link
        self._times: list[tuple[float, float]] = []

    def admit(self, ready: float, work: float) -> None:
        self.ready.append(ready)
        self.work.append(work)
        self._times = []

    def times(self) -> list[tuple[float, float]]:
        """(start, end) of every admitted collective, if no other were admitted."""
        if len(self._times) == len(self.work):
            return self._times
        n = len(self.work)
        start, end = [0.0] * n, [0.0] * n
        left: dict[int, float] = {}
        t, nxt = 0.0, 0
        while nxt < n or left:
            while nxt < n and len(left) < self.slots and self.ready[nxt] <= t:
                start[nxt], left[nxt] = t, self.work[nxt]
                nxt += 1
            if not left:
                t = self.ready[nxt]
                continue
            share = len(left)
            arrival = (self.ready[nxt] if nxt < n and len(left) < self.slots
                       else float("inf"))
            first = min(left.values())
            step = min(first * share, arrival - t)
            t += step
            for c in list(left):
                left[c] -= step / share
                if left[c] <= 1e-12 * max(1.0, self.work[c]):
                    end[c] = t
                    del left[c]
        self._times = list(zip(start, end))
        return self._times


def replay(programs: Sequence[Sequence[Action]], cost: Callable[[Key], float],
           contention: float = 0.0, busy: Sequence[Interval] = (), slots: int = 1,
           post: Optional[Callable[[Key], float]] = None) -> Replay:
    if slots < 1:
        raise ValueError(f"slots must be >= 1, got {slots}")
    if post is not None and slots > 1:
        raise ValueError("post= (work after a collective's transfer) is replayed with one "
                         "collective on the link at a time (slots=1)")
    ranks = len(programs)
    order: list[Key] = [a[1] for a in programs[0] if a[0] == "issue"]
    position = {key: c for c, key in enumerate(order)}
    if len(position) != len(order):
        raise ValueError("a collective key is issued twice in rank 0's program")
    for r, prog in enumerate(programs[1:], start=1):
        mine = [a[1] for a in prog if a[0] == "issue"]
        if mine != order:
            raise ValueError(f"rank {r} issues collectives in another order than rank 0: replay "
                             "(like dear and DDP) needs the same order on every rank")
    clock = [0.0] * ranks
    pc = [0] * ranks
    out = Replay([[] for _ in range(ranks)], [[] for _ in range(ranks)],
                 [[] for _ in range(ranks)], [{} for _ in range(ranks)], {}, order)
    issued_count = [0] * len(order)
    issue_time = [0.0] * len(order)
    issued_by = [0] * ranks                    # per rank: collectives it has issued
    next_on_link, link_free = 0, 0.0
    post_free = 0.0                            # the thread that runs `post` work
    shared = _SharedLink(slots) if slots > 1 else None

    def schedule() -> None:
        nonlocal next_on_link, link_free, post_free
        while next_on_link < len(order) and issued_count[next_on_link] == ranks:
            key = order[next_on_link]
            duration = cost(key)
            if duration < 0:
                raise ValueError(f"negative cost {duration} for collective {key!r}")
            if shared is not None:
                shared.admit(issue_time[next_on_link], duration)
            else:
                start = max(issue_time[next_on_link], link_free)
                out.comm[key] = (start, start + duration)
                link_free = start + duration
                after = 0.0 if post is None else post(key)
                if after < 0:
                    raise ValueError(f"negative post time {after} for collective {key!r}")
                if after > 0:
                    post_free = max(link_free, post_free) + after
                    out.done[key] = post_free
            next_on_link += 1

    def final_end(c: int) -> "float | None":
        """Shared link: collective c's end, if no collective still to start can move it (the
        next one starts no earlier than every rank's issue of it, and a rank that has not
        issued it yet does so after its clock and after the collective it waits for)."""
        assert shared is not None
        if c >= next_on_link:
            return None
        times = shared.times()
        end = times[c][1]
        if next_on_link == len(order):
            return end
        m = next_on_link
        earliest = issue_time[m]
        for s in range(ranks):
            if issued_by[s] > m:
                continue
            if pc[s] >= len(programs[s]):
                return end                     # never issued: replay ends in a deadlock error
            bound = clock[s]
            action = programs[s][pc[s]]
            if action[0] == "wait" and position.get(action[1], m) < m:
                bound = max(bound, times[position[action[1]]][1])
            earliest = max(earliest, bound)
        return end if end <= earliest else None

    while True:
        progress = False
        for r in range(ranks):
            prog = programs[r]
            while pc[r] < len(prog):
                action = prog[pc[r]]
                kind = action[0]
                if kind == "compute":
                    seconds = float(action[1])
                    if seconds < 0:
                        raise ValueError(f"negative compute time {seconds} ({action[2]})")
                    seconds = stretched(clock[r], seconds, busy, contention)
                    out.compute[r].append((clock[r], clock[r] + seconds, action[2]))
                    clock[r] += seconds
                elif kind == "issue":
                    c = position[action[1]]
                    issued_count[c] += 1
                    issue_time[c] = max(issue_time[c], clock[r])
                    issued_by[r] += 1
                    out.issued[r][action[1]] = clock[r]
                    schedule()
                elif kind == "wait":
                    if action[1] not in position:
                        raise ValueError(f"rank {r} waits for {action[1]!r}, never issued")
                    if shared is not None:
                        known = final_end(position[action[1]])
                    else:
                        known = (out.done.get(action[1], out.comm[action[1]][1])
                                 if action[1] in out.comm else None)
                    if known is None:
                        break                  # blocked: let the other ranks catch up
                    end = known
                    if end > clock[r]:
                        out.waits[r].append((clock[r], end, action[1]))
                        clock[r] = end
                elif kind == "mark":
                    out.marks[r].append((action[1], clock[r]))
                else:
                    raise ValueError(f"unknown action {action!r}")
                pc[r] += 1
                progress = True
        if all(pc[r] == len(programs[r]) for r in range(ranks)):
            if shared is not None:
                out.comm = {order[c]: t for c, t in enumerate(shared.times())}
            return out
        if not progress:
            stuck = {r: programs[r][pc[r]] for r in range(ranks) if pc[r] < len(programs[r])}
            raise ValueError(f"replay deadlock: ranks wait for collectives that are never "
                             f"issued by every rank: {stuck}")
