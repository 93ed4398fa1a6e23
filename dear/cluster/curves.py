"""Throughput-vs-workers curves: how fast one job runs on n workers (samples/s).

The scheduler sees a job only through its curve, so the curve is a small protocol: anything with
``throughput(n) -> float`` and ``max_workers`` (beyond which more workers do not help or are not
allowed). Three constructors cover the sources a user has: a table of measured or predicted points
(``TableCurve``: what ``dear.diagnose``'s scaling curve gives), a communication model of data
parallelism (``CommModelCurve``) and Pollux's fitted form (``PolluxCurve``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Protocol, Sequence, runtime_checkable


@runtime_checkable
class ThroughputCurve(Protocol):
    """A job's speed on n workers, samples/s. throughput(0) is 0; policies never ask for more
    than max_workers."""

    @property
    def max_workers(self) -> int: ...

    def throughput(self, n: int) -> float: ...


def speedup(curve: ThroughputCurve, n: int) -> float:
    """throughput(n) / throughput(1): the length-free measure Pollux-like allocation compares
    across jobs whose samples differ (an image is not a sentence)."""
    one = curve.throughput(1)
    return curve.throughput(n) / one if one > 0 else 0.0


@dataclass(frozen=True)
class LinearCurve:
    """n workers run n times as fast as one: a job whose work is exactly divisible, or (with
    max_workers=1) a job that runs on one worker, as in an M/M/c queue."""

    per_worker: float = 1.0
    max_workers: int = 1 << 30

    def __post_init__(self) -> None:
        _check_positive("per_worker", self.per_worker)
        _check_workers(self.max_workers)

    def throughput(self, n: int) -> float:
        return self.per_worker * min(max(n, 0), self.max_workers)


@dataclass(frozen=True)
class TableCurve:
    """Throughput at a few worker counts, linearly interpolated between them; flat beyond the
    last point (a job is not given workers it was never measured on: max_workers is the last
    point unless given smaller). throughput(0) = 0."""

    points: tuple[tuple[int, float], ...]
    max_workers: int = 0
    _xs: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _ys: tuple[float, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        pts = sorted((int(n), float(t)) for n, t in self.points)
        if not pts:
            raise ValueError("TableCurve needs at least one (workers, samples/s) point")
        if pts[0][0] < 1:
            raise ValueError(f"TableCurve: worker counts start at 1, got {pts[0][0]}")
        if any(a[0] == b[0] for a, b in zip(pts, pts[1:])):
            raise ValueError("TableCurve: a worker count appears twice; give one throughput "
                             "per worker count")
        if any(not math.isfinite(t) or t <= 0 for _, t in pts):
            raise ValueError("TableCurve: every throughput must be a positive finite number "
                             "(samples/s)")
        object.__setattr__(self, "points", tuple(pts))
        object.__setattr__(self, "_xs", tuple(n for n, _ in pts))
        object.__setattr__(self, "_ys", tuple(t for _, t in pts))
        last = pts[-1][0]
        cap = self.max_workers or last
        _check_workers(cap)
        object.__setattr__(self, "max_workers", min(cap, last))

    @classmethod
    def from_points(cls, points: Iterable[Sequence[float]] | Mapping[int, float],
                    max_workers: int = 0) -> "TableCurve":
        items = points.items() if isinstance(points, Mapping) else points
        return cls(tuple((int(p[0]), float(p[1])) for p in items), max_workers)

    def throughput(self, n: int) -> float:
        n = min(n, self.max_workers)
        if n <= 0:
            return 0.0
        xs, ys = self._xs, self._ys
        if n <= xs[0]:
            return ys[0] * n / xs[0]          # below the first point: proportional from 0
        for i in range(1, len(xs)):
            if n <= xs[i]:
                x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
                return y0 + (y1 - y0) * (n - x0) / (x1 - x0)
        return ys[-1]


@dataclass(frozen=True)
class CommModelCurve:
    """Synchronous data parallelism with a fixed per-worker batch: one iteration is
    t_iter(n) = t_compute + max(0, t_comm(n) - overlap * t_compute), with the all-reduce
    t_comm(n) = alpha * log2(n) + 2 * (n-1)/n * grad_bytes / bandwidth for n > 1 (a ring's
    bytes, a tree's latency), 0 at n = 1; throughput = n * batch / t_iter(n). overlap is the
    fraction of compute that communication hides (WFBP, DeAR)."""

    batch: float
    t_compute: float
    grad_bytes: float
    bandwidth: float
    alpha: float = 0.0
    overlap: float = 0.0
    max_workers: int = 1 << 30

    def __post_init__(self) -> None:
        for name in ("batch", "t_compute", "bandwidth"):
            _check_positive(name, getattr(self, name))
        if self.grad_bytes < 0 or self.alpha < 0:
            raise ValueError("CommModelCurve: grad_bytes and alpha must be >= 0")
        if not 0.0 <= self.overlap <= 1.0:
            raise ValueError(f"CommModelCurve: overlap is a fraction in [0, 1], got "
                             f"{self.overlap}")
        _check_workers(self.max_workers)

    def t_iter(self, n: int) -> float:
        comm = 0.0
        if n > 1:
            comm = self.alpha * math.log2(n) + 2.0 * (n - 1) / n * self.grad_bytes / self.bandwidth
        return self.t_compute + max(0.0, comm - self.overlap * self.t_compute)

    def throughput(self, n: int) -> float:
        n = min(n, self.max_workers)
        return 0.0 if n <= 0 else n * self.batch / self.t_iter(n)


@dataclass(frozen=True)
class PolluxCurve:
    """Pollux's throughput model (Qiao et al., OSDI 2021) at a fixed per-worker batch:
    T_iter(n) = (T_grad^gamma + T_sync(n)^gamma)^(1/gamma), T_sync(1) = 0,
    T_sync(n) = alpha_sync + beta_sync * (n - 2) for n >= 2; throughput = n * batch / T_iter."""

    batch: float
    t_grad: float
    alpha_sync: float
    beta_sync: float
    gamma: float = 1.0
    max_workers: int = 1 << 30

    def __post_init__(self) -> None:
        for name in ("batch", "t_grad", "gamma"):
            _check_positive(name, getattr(self, name))
        if self.alpha_sync < 0 or self.beta_sync < 0:
            raise ValueError("PolluxCurve: alpha_sync and beta_sync must be >= 0")
        _check_workers(self.max_workers)

    def throughput(self, n: int) -> float:
        n = min(n, self.max_workers)
        if n <= 0:
            return 0.0
        sync = 0.0 if n == 1 else self.alpha_sync + self.beta_sync * (n - 2)
        t = (self.t_grad ** self.gamma + sync ** self.gamma) ** (1.0 / self.gamma)
        return n * self.batch / t


def as_curve(source: Any, max_workers: int = 0) -> ThroughputCurve:
    """Any of: a curve (returned as is), {workers: samples/s}, [(workers, samples/s), ...], or
    an object with sequences `workers` and `throughput` (a scaling-curve result) -> a curve."""
    if isinstance(source, (LinearCurve, TableCurve, CommModelCurve, PolluxCurve)):
        return source
    workers = getattr(source, "workers", None)
    values = getattr(source, "throughput", None)
    if workers is not None and values is not None and not callable(values):
        return TableCurve.from_points(zip(workers, values), max_workers)
    if isinstance(source, (Mapping, list, tuple)):
        return TableCurve.from_points(source, max_workers)
    if isinstance(source, ThroughputCurve):
        return source
    raise ValueError(f"cannot make a throughput curve from {type(source).__name__}: give a "
                     "curve, a {workers: samples/s} mapping, a list of (workers, samples/s) "
                     "pairs, or an object with `workers` and `throughput` sequences")


def from_scaling_curve(scaling: Any, schedule: str = "dear", model: str = "replay",
                       max_workers: int = 0) -> TableCurve:
    """dear.diagnose.scale's ScalingCurve (a trace's predicted samples/s at each worker count,
    per schedule and model) -> the TableCurve of one schedule. Duck-typed: anything with
    `workers` and `samples_per_s(schedule, model)`; nothing of dear.diagnose is imported."""
    try:
        values = scaling.samples_per_s(schedule, model)
        workers = scaling.workers
    except AttributeError:
        raise ValueError("expected a ScalingCurve (dear.diagnose.scale.scaling_curve's "
                         "result): an object with `workers` and `samples_per_s(schedule, "
                         "model)`") from None
    return TableCurve.from_points(zip(workers, values), max_workers)


def curve_from_dict(spec: Mapping[str, Any]) -> ThroughputCurve:
    """The "curve" object of a jobs file (docs/sharing-a-cluster.md) -> a curve."""
    if not isinstance(spec, Mapping) or "kind" not in spec:
        raise ValueError(f"a curve is an object with a 'kind' (table, comm, pollux, linear), "
                         f"got {spec!r}")
    kind = spec["kind"]
    args = {k: v for k, v in spec.items() if k != "kind"}
    makers: dict[str, Any] = {"linear": LinearCurve, "comm": CommModelCurve,
                              "pollux": PolluxCurve}
    try:
        if kind == "table":
            if "points" not in args:
                raise ValueError("a table curve needs 'points': [[workers, samples/s], ...]")
            return TableCurve.from_points(args["points"], int(args.get("max_workers", 0)))
        if kind in makers:
            return makers[kind](**args)  # type: ignore[no-any-return]
    except TypeError as exc:
        raise ValueError(f"curve of kind {kind!r}: {exc}") from None
    raise ValueError(f"unknown curve kind {kind!r}: one of table, comm, pollux, linear")


def curve_to_dict(curve: ThroughputCurve) -> dict[str, Any]:
    """The inverse of curve_from_dict for the curves defined here (jobs files written back)."""
    if isinstance(curve, TableCurve):
        return {"kind": "table", "points": [list(p) for p in curve.points],
                "max_workers": curve.max_workers}
    names = {LinearCurve: "linear", CommModelCurve: "comm", PolluxCurve: "pollux"}
    for cls, kind in names.items():
        if isinstance(curve, cls):
            return {"kind": kind, **{k: v for k, v in vars(curve).items()
                                     if not k.startswith("_")}}
    raise ValueError(f"{type(curve).__name__} has no jobs-file form; sample it into a "
                     "TableCurve first")


def _check_positive(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive number, got {value!r}")


def _check_workers(n: int) -> None:
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"max_workers must be an integer >= 1, got {n!r}")
