"""Replay: ranks run programs of compute, issue and wait; collectives share one FIFO link.

A program is a list of actions:
    ("compute", seconds, label)   the training thread works
    ("issue", key)                a collective is issued (non-blocking)
    ("wait", key)                 the thread blocks until that collective has completed
    ("mark", label)               a named instant (iteration boundaries)
Every rank issues the same collectives in the same order (as dear and DDP guarantee). Collective
number c starts when every rank has issued it and collective c-1 has finished, and lasts
`cost(key)`: one ring at a time on the link, as Gloo and NCCL's default stream run them.

`contention` k: compute runs 1 + k times slower while a collective is on the link (the CPU
that computes also runs the transport, as on the emulated cluster's one core per rank).
`replay_contended` finds the link's busy time and the compute it slows together, by replaying
until they agree.
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Callable, Hashable, Sequence

from .intervals import Interval, union

Action = tuple


@dataclasses.dataclass
class Replay:
    compute: list[list[tuple[float, float, str]]]     # per rank: (start, end, label)
    waits: list[list[tuple[float, float, Hashable]]]  # per rank: blocked intervals
    marks: list[list[tuple[str, float]]]              # per rank
    issued: list[dict[Hashable, float]]               # per rank: key -> issue time
    comm: dict[Hashable, tuple[float, float]]         # key -> (start, end) on the link
    order: list[Hashable]                             # keys in link order

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


def replay_contended(programs: Sequence[Sequence[Action]], cost: Callable[[Hashable], float],
                     contention: float = 0.0, passes: int = 8) -> Replay:
    """`replay` with compute slowed while the link is busy: replayed with the previous pass's
    busy intervals until they stop moving (a few passes)."""
    out = replay(programs, cost)
    for _ in range(passes if contention > 0 else 0):
        busy = union(out.comm.values())
        nxt = replay(programs, cost, contention, busy)
        if nxt.comm == out.comm:
            return nxt
        out = nxt
    return out


def replay(programs: Sequence[Sequence[Action]], cost: Callable[[Hashable], float],
           contention: float = 0.0, busy: Sequence[Interval] = ()) -> Replay:
    ranks = len(programs)
    order: list[Hashable] = [a[1] for a in programs[0] if a[0] == "issue"]
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
    next_on_link, link_free = 0, 0.0

    def schedule() -> None:
        nonlocal next_on_link, link_free
        while next_on_link < len(order) and issued_count[next_on_link] == ranks:
            key = order[next_on_link]
            start = max(issue_time[next_on_link], link_free)
            duration = cost(key)
            if duration < 0:
                raise ValueError(f"negative cost {duration} for collective {key!r}")
            out.comm[key] = (start, start + duration)
            link_free = start + duration
            next_on_link += 1

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
                    out.issued[r][action[1]] = clock[r]
                    schedule()
                elif kind == "wait":
                    if action[1] not in position:
                        raise ValueError(f"rank {r} waits for {action[1]!r}, never issued")
                    if action[1] not in out.comm:
                        break                  # blocked: let the other ranks catch up
                    end = out.comm[action[1]][1]
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
            return out
        if not progress:
            stuck = {r: programs[r][pc[r]] for r in range(ranks) if pc[r] < len(programs[r])}
            raise ValueError(f"replay deadlock: ranks wait for collectives that are never "
                             f"issued by every rank: {stuck}")
