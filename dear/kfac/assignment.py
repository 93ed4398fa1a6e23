"""Who computes what: greedy longest-processing-time (SPD-KFAC's load balance) and PAD-KFAC's
contiguous block partition that minimises the maximum load (dynamic programming).

Both are pure functions of costs, so every rank can check a plan, and tests can compare them
with brute force. Ties go to the lowest index / rank, so the result is deterministic.
"""

from __future__ import annotations

from collections.abc import Sequence

EVERYWHERE = -1   # owner of an item computed redundantly on every rank


def lpt(costs: Sequence[float], ranks: int) -> list[int]:
    """Owner of each item: largest first, each to the least-loaded rank so far."""
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    loads = [0.0] * ranks
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(ranks), key=lambda r: (loads[r], r))
        owners[i] = r
        loads[r] += costs[i]
    return owners


def lpt_with_redundancy(costs: Sequence[float], ranks: int,
                        redundant: Sequence[bool]) -> list[int]:
    """LPT over the items not marked redundant; redundant ones get EVERYWHERE."""
    shared = [i for i in range(len(costs)) if not redundant[i]]
    owners = [EVERYWHERE] * len(costs)
    for i, r in zip(shared, lpt([costs[i] for i in shared], ranks)):
        owners[i] = r
    return owners


def contiguous_partition(costs: Sequence[float], ranks: int) -> list[int]:
    """Owner of each item such that every rank owns one contiguous block (possibly empty) and
    the largest block's total cost is minimal. Rank r owns the r-th block in item order."""
    n = len(costs)
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    if n == 0:
        return []
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: minimal max-load of the first i items on k ranks; cut[k][i]: start of block k.
    best = [[inf] * (n + 1) for _ in range(ranks + 1)]
    cut = [[0] * (n + 1) for _ in range(ranks + 1)]
    best[0][0] = 0.0
    for k in range(1, ranks + 1):
        for i in range(n + 1):
            for t in range(i + 1):            # block k holds items t..i-1 (empty when t == i)
                value = max(best[k - 1][t], prefix[i] - prefix[t])
                if value < best[k][i] - 1e-15 * max(1.0, abs(value)):
                    best[k][i], cut[k][i] = value, t
    owners = [0] * n
    i = n
    for k in range(ranks, 0, -1):
        t = cut[k][i]
        for j in range(t, i):
            owners[j] = k - 1
        i = t
    return owners


def max_load(costs: Sequence[float], owners: Sequence[int], ranks: int) -> float:
    """The busiest rank's total (items owned EVERYWHERE count on every rank)."""
    loads = [0.0] * ranks
    for c, r in zip(costs, owners):
        if r == EVERYWHERE:
            loads = [x + c for x in loads]
        else:
            loads[r] += c
    return max(loads) if loads else 0.0


def kaisa_groups(ranks: int, grad_workers: int) -> list[list[int]]:
    """KAISA's gradient-worker groups: the columns of a grad_workers x (ranks / grad_workers)
    grid of the ranks in row-major order ([[0, 4], [1, 5], [2, 6], [3, 7]] for 8 and 2), in the
    order kfac-pytorch iterates them (a set of frozensets, so ties go where they go there)."""
    if ranks % grad_workers != 0:
        raise ValueError(f"{ranks} ranks cannot form groups of {grad_workers} gradient workers")
    columns = ranks // grad_workers
    return [list(group) for group in {frozenset(range(i, ranks, columns))
                                      for i in range(columns)}]


def kaisa_greedy(work: Sequence[tuple[float, float]], groups: Sequence[Sequence[int]],
                 ranks: int, colocate: bool) -> list[tuple[int, int]]:
    """(A owner, G owner) of each layer as kfac-pytorch's KAISAAssignment assigns them: layers
    by their summed cost, largest first (ties in layer order), each to the least-loaded group,
    and within it both factors to its least-loaded rank (colocate) or each factor, the larger
    first, to the least-loaded rank at that moment."""
    loads = [0.0] * ranks
    owners = [(-1, -1)] * len(work)
    for i in sorted(range(len(work)), key=lambda i: -(work[i][0] + work[i][1])):
        group_loads = [sum(loads[r] for r in g) for g in groups]
        group = groups[group_loads.index(min(group_loads))]

        def least() -> int:
            within = [loads[r] for r in group]
            return group[within.index(min(within))]
        if colocate:
            r = least()
            loads[r] += work[i][0] + work[i][1]
            owners[i] = (r, r)
            continue
        chosen = {}
        for which, cost in sorted((("A", work[i][0]), ("G", work[i][1])),
                                  key=lambda x: (x[1], x[0]), reverse=True):
            r = least()
            loads[r] += cost
            chosen[which] = r
        owners[i] = (chosen["A"], chosen["G"])
    return owners
