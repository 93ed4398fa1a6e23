"""The link model fitted to a trace: `CostModel` is dear/comm/link.py's `LinkModel` (the one
alpha-beta model, ring costs per kind) with `fit`, its parameters from a trace's collectives: per
kind, least squares on the traced service times; a kind the trace lacks is derived from the
others (all-reduce = reduce-scatter + all-gather, and back). A what-if bandwidth keeps each
kind's measured efficiency (fitted rate / traced link rate) when the traced link rate is known,
else assumes the ideal rate.
"""

from __future__ import annotations

import statistics

from ..comm.link import KINDS, LinkModel, latency_steps, volume

__all__ = ["CostModel", "KINDS", "iteration_rates", "latency_steps", "volume"]


class CostModel(LinkModel):
    """Per kind: `alpha` seconds per latency step, `rate` bytes/s sent per rank."""

    @classmethod
    def fit(cls, samples: list[dict], world_size: int) -> "CostModel":
        """From collective_samples(trace), per kind: the latency from a line through the
        collectives that had the link to themselves (concurrent ones share time, which blurs
        their own durations), then the rate that keeps the kind's total time on the link."""
        alpha: dict[str, float] = {}
        rate: dict[str, float] = {}
        for kind in KINDS:
            mine = [s for s in samples if s["kind"] == kind]
            if not mine:
                continue
            steps = latency_steps(kind, world_size)
            alone = [(volume(kind, s["bytes"], world_size), s["seconds"])
                     for s in mine if s.get("alone", True)]
            a = _intercept(alone) / steps if steps > 0 and alone else 0.0
            sent = sum(volume(kind, s["bytes"], world_size) for s in mine)
            busy = sum(s["seconds"] for s in mine)
            if busy - len(mine) * steps * a <= 0:
                a = 0.0
            alpha[kind], rate[kind] = a, sent / (busy - len(mine) * steps * a)
            per_it = _rates_per_iteration(mine, kind, world_size, steps * a)
            if len(per_it) >= 3:
                rate[kind] = statistics.median(per_it)
        if not rate:
            raise ValueError("the trace has no completed collective to fit a cost model on; "
                             "give --bandwidth (and --latency)")
        _derive_missing(alpha, rate)
        return cls(alpha, rate, world_size)


def iteration_rates(samples: list[dict], cost: "CostModel") -> dict[int, dict[str, float]]:
    """Per traced iteration, each kind's rate in it (bytes sent / its busy time, `cost`'s
    latency taken off): how the link ran in that iteration. Kinds an iteration lacks are left
    out."""
    n = cost.world_size
    acc: dict[tuple[int, str], list[float]] = {}
    for s in samples:
        kind = s["kind"]
        if s.get("iteration") is None or kind not in cost.rate:
            continue
        a = acc.setdefault((int(s["iteration"]), kind), [0.0, 0.0])
        a[0] += volume(kind, s["bytes"], n)
        a[1] += s["seconds"] - latency_steps(kind, n) * cost.alpha[kind]
    out: dict[int, dict[str, float]] = {}
    for (it, kind), (sent, busy) in acc.items():
        if sent > 0 and busy > 0:
            out.setdefault(it, {})[kind] = sent / busy
    return out


def _rates_per_iteration(samples: list[dict], kind: str, n: int, latency: float
                         ) -> list[float]:
    """The kind's rate in each traced iteration (bytes sent / its busy time). Their median,
    not the pooled rate, is the fit when there are 3 or more: on a shared machine one iteration
    whose transport threads lost their cores otherwise slows every replayed iteration
    (docs/benchmarks.md#the-link-rate-a-median-of-iterations)."""
    by_it: dict[int, list[float]] = {}
    for s in samples:
        if s.get("iteration") is None:
            return []
        acc = by_it.setdefault(int(s["iteration"]), [0.0, 0.0])
        acc[0] += volume(kind, s["bytes"], n)
        acc[1] += s["seconds"] - latency
    return [sent / busy for sent, busy in by_it.values() if busy > 0 and sent > 0]


def _intercept(pts: list[tuple[float, float]]) -> float:
    """Intercept of the least-squares line of seconds on bytes; 0 without two sizes or when
    the line is not physical (negative intercept or slope)."""
    xs = [x for x, _ in pts]
    if len(set(xs)) < 2:
        return 0.0
    mx, my = statistics.mean(xs), statistics.mean(y for _, y in pts)
    slope = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x in xs)
    intercept = my - slope * mx
    return intercept if slope > 0 and intercept > 0 else 0.0


def _derive_missing(alpha: dict[str, float], rate: dict[str, float]) -> None:
    """Ring identities: all-reduce = reduce-scatter + all-gather of the same buffer."""
    rs, ag, ar = "reduce_scatter", "all_gather", "all_reduce"
    if not any(k in rate for k in (rs, ag, ar)):      # broadcasts only
        for k in (rs, ag, ar):
            alpha[k], rate[k] = alpha["broadcast"], rate["broadcast"]
    for a, b in ((rs, ag), (ag, rs)):
        if a not in rate and b in rate:
            alpha[a], rate[a] = alpha[b], rate[b]
    if ar not in rate and rs in rate:
        rate[ar] = 2 / (1 / rate[rs] + 1 / rate[ag])
        alpha[ar] = (alpha[rs] + alpha[ag]) / 2
    if rs not in rate and ar in rate:
        for k in (rs, ag):
            alpha[k], rate[k] = alpha[ar], rate[ar]
    if "broadcast" not in rate:
        alpha["broadcast"], rate["broadcast"] = alpha[ar], rate[ar]
