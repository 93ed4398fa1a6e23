"""The one alpha-beta model of the link, and its one measurement.

Ring algorithms over N ranks, S bytes (the full buffer), per-step latency a, rate B (bytes each
rank sends per second):
    reduce-scatter, all-gather:  (N-1) a + (N-1)/N S / B
    all-reduce:                 2(N-1) a + 2(N-1)/N S / B
    broadcast:                  (N-1) a + S / B
    send (one message):               a + S / B
Each kind has its own (a, B): backends differ per kind (Gloo's all-reduce vs dear's pairwise
reduce-scatter). The planned schedule (dear/fusion/plan.py) measures its reduce-scatters and
all-gathers with `measure_link`, dear.KFAC's placement (dear/kfac/costs.py) its all-reduce, and
dear.diagnose fits the same model to a trace's collectives (dear/diagnose/costmodel.py).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable, Mapping, Optional, Sequence, TypeVar

KINDS = ("reduce_scatter", "all_gather", "all_reduce", "broadcast", "send")

_Link = TypeVar("_Link", bound="LinkModel")


def latency_steps(kind: str, n: int) -> float:
    if kind == "send":
        return 1.0
    return (2 if kind == "all_reduce" else 1) * (n - 1)


def volume(kind: str, nbytes: float, n: int) -> float:
    """Bytes each rank sends for a collective of `nbytes` on `n` ranks."""
    if kind == "send":
        return float(nbytes)
    if n <= 1:
        return 0.0
    if kind == "broadcast":
        return float(nbytes)
    return (2 if kind == "all_reduce" else 1) * (n - 1) / n * nbytes


@dataclasses.dataclass(frozen=True)
class LinkModel:
    """Per kind: `alpha` seconds per latency step, `rate` bytes/s sent per rank (inf: free).
    `host_share`: CPU seconds this process spends per second of a collective (all its threads;
    0 where unmeasured): near 1 on loopback, where the "link" is the cores' own copying."""

    alpha: Mapping[str, float]
    rate: Mapping[str, float]
    world_size: int
    host_share: float = 0.0

    def time(self, kind: str, nbytes: float, world_size: Optional[int] = None) -> float:
        n = self.world_size if world_size is None else world_size
        if n <= 1 and kind != "send":
            return 0.0
        sent = volume(kind, nbytes, n)
        return latency_steps(kind, n) * self.alpha[kind] + (sent / self.rate[kind] if sent else 0.0)

    def reduce_scatter(self, nbytes: float) -> float:
        return self.time("reduce_scatter", nbytes)

    def all_gather(self, nbytes: float) -> float:
        return self.time("all_gather", nbytes)

    def bytes_in(self, kind: str, seconds: float) -> float:
        """The buffer size whose `kind` takes `seconds` (time()'s inverse)."""
        per_byte = volume(kind, 1.0, self.world_size) / self.rate[kind]
        return (seconds - self.latency(kind)) / per_byte if per_byte > 0 else 0.0

    def latency(self, kind: str) -> float:
        """Seconds of latency one collective of `kind` pays at this world size."""
        return latency_steps(kind, self.world_size) * self.alpha[kind]

    def slower(self: _Link, factor: float) -> _Link:
        """Every collective `factor` times as long (for the same host work)."""
        return dataclasses.replace(self, alpha={k: a * factor for k, a in self.alpha.items()},
                                   rate={k: r / factor for k, r in self.rate.items()},
                                   host_share=self.host_share / factor)

    @classmethod
    def ideal(cls: type[_Link], bandwidth_bps: float, latency_s: float = 0.0,
              world_size: int = 2) -> _Link:
        """Every kind at the link rate (bits/s) with per-step latency `latency_s`."""
        _check_positive(bandwidth_bps, "bandwidth")
        return cls({k: latency_s for k in KINDS}, {k: bandwidth_bps / 8 for k in KINDS},
                   world_size)

    @classmethod
    def uniform(cls: type[_Link], alpha: float, seconds_per_byte: float,
                world_size: int = 2) -> _Link:
        """Every kind with latency `alpha` per step and `seconds_per_byte` (0: free)."""
        rate = math.inf if seconds_per_byte <= 0 else 1.0 / seconds_per_byte
        return cls({k: alpha for k in KINDS}, {k: rate for k in KINDS}, world_size)

    def what_if(self: _Link, bandwidth_bps: Optional[float] = None,
                latency_s: Optional[float] = None, world_size: Optional[int] = None,
                traced_bandwidth_bps: Optional[float] = None) -> _Link:
        """This model at another link rate / latency / world size. A new rate keeps each
        kind's measured efficiency (rate / traced link rate) when the traced rate is known."""
        rate = dict(self.rate)
        if bandwidth_bps is not None:
            _check_positive(bandwidth_bps, "bandwidth")
            if traced_bandwidth_bps:
                rate = {k: r * bandwidth_bps / traced_bandwidth_bps for k, r in rate.items()}
            else:
                rate = {k: bandwidth_bps / 8 for k in rate}
        if latency_s is not None and latency_s < 0:
            raise ValueError(f"latency must be >= 0 seconds, got {latency_s}")
        alpha = dict(self.alpha) if latency_s is None else {k: latency_s for k in self.alpha}
        n = self.world_size if world_size is None else world_size
        if n < 1:
            raise ValueError(f"world size must be >= 1, got {n}")
        return dataclasses.replace(self, alpha=alpha, rate=rate, world_size=n)

    def describe(self) -> str:
        kinds = [k for k in ("reduce_scatter", "all_gather", "all_reduce") if k in self.rate]
        return ", ".join(f"{k} {self.rate[k] * 8 / 1e9:.2f} Gbit/s + {self.alpha[k] * 1e6:.0f} us"
                         f"/step" for k in kinds)


def fit_two_points(kind: str, n: int, small: tuple[float, float], large: tuple[float, float]
                   ) -> tuple[float, float]:
    """(alpha, rate) of `kind` through two timed sizes, (bytes, seconds) each; the latency
    is clamped at 0 (a fast small message must not make the rate negative)."""
    (b1, t1), (b2, t2) = small, large
    v1, v2 = volume(kind, b1, n), volume(kind, b2, n)
    rate = (v2 - v1) / max(t2 - t1, 1e-9)
    steps = latency_steps(kind, n)
    return max(t1 - v1 / rate, 0.0) / steps, rate


def measure_link(run: Callable[[str, int], None], kinds: Sequence[str], sizes: Sequence[int],
                 world_size: int, repeats: int = 3,
                 settle: Optional[Callable[[], None]] = None,
                 pick: Callable[[list[float]], float] = min,
                 clock: Callable[[], float] = time.perf_counter) -> LinkModel:
    """Time `run(kind, nbytes)` (one collective of `kind` on a buffer of `nbytes`, waited for;
    a collective: every rank calls this at the same point) at the two `sizes`, `repeats`
    times each (`settle()` before each: a barrier, a device synchronize), keep `pick` of the
    times (the best, by default), and fit each kind's (alpha, rate). Kinds not measured get
    the first measured kind's figures."""
    if len(sizes) != 2 or sizes[0] >= sizes[1]:
        raise ValueError(f"measure_link needs two sizes, small then large; got {sizes}")
    alpha: dict[str, float] = {}
    rate: dict[str, float] = {}
    for kind in kinds:
        points = []
        for nbytes in sizes:
            times = []
            for _ in range(repeats):
                if settle is not None:
                    settle()
                start = clock()
                run(kind, nbytes)
                times.append(clock() - start)
            points.append((float(nbytes), pick(times)))
        alpha[kind], rate[kind] = fit_two_points(kind, world_size, points[0], points[1])
    for kind in KINDS:
        alpha.setdefault(kind, alpha[kinds[0]])
        rate.setdefault(kind, rate[kinds[0]])
    return LinkModel(alpha, rate, world_size)


def _check_positive(value: float, what: str) -> None:
    if not value > 0:
        raise ValueError(f"{what} must be > 0, got {value}")
