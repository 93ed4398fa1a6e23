"""Throughput, speed-up and efficiency vs the number of workers, from one short trace.

    curve = scaling_curve("traces/", workers=[1, 2, 4, 8, 16, 32, 64, 128, 256],
                          topology=Topology(bandwidth_bps=25e9, gpus_per_node=8,
                                            intra_bandwidth_bps=600e9),
                          batch_size=32)
    curve.samples_per_s("planned")          # replay, per worker count
    curve.samples_per_s("planned", "queueing")

Each worker count N gets the collectives' cost on the topology (dear.diagnose.topology: flat
ring by default, hierarchical as an option) and two predictions of the iteration time: the
replay (dear.diagnose.simulate: the traced compute graph and the schedule's program, replayed
event by event) and the queueing model's closed form (dear.diagnose.queueing), each timed.
Throughput = N x batch / T(N); speed-up = throughput / throughput at 1 worker (no
communication, the same schedule); efficiency = speed-up / N. The traced compute per worker is
kept as is: the same per-worker batch at every N (weak scaling), the same accelerator.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from typing import Any, Optional, Sequence

from .chrome import Trace, load_trace
from .costmodel import CostModel
from .queueing import QueueModel
from .simulate import Schedule, Simulator
from .topology import Topology

DEFAULT_WORKERS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DEFAULT_SCHEDULES = ("planned", "dear", "ddp", "wfbp", "horovod")
MODELS = ("replay", "queueing")


@dataclasses.dataclass
class ScalingCurve:
    """Per schedule and model ("replay", "queueing"), seconds per iteration at each N."""

    workers: list[int]
    batch_size: float
    topology: Topology
    seconds: dict[str, dict[str, list[float]]]        # model -> schedule -> per N
    cost_s: dict[str, float]                          # model -> seconds it took to compute
    baseline: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)

    @property
    def schedules(self) -> list[str]:
        return list(self.seconds["replay"])

    def _pick(self, schedule: str, model: str) -> list[float]:
        if model not in self.seconds:
            raise ValueError(f"unknown model {model!r}; expected one of {list(self.seconds)}")
        if schedule not in self.seconds[model]:
            raise ValueError(f"schedule {schedule!r} is not in this curve; it has "
                             f"{self.schedules}")
        return self.seconds[model][schedule]

    def samples_per_s(self, schedule: str, model: str = "replay") -> list[float]:
        return [n * self.batch_size / t for n, t in zip(self.workers,
                                                         self._pick(schedule, model))]

    def speedup(self, schedule: str, model: str = "replay") -> list[float]:
        """Throughput over one worker's (same schedule and model, no communication)."""
        one = self.batch_size / self.baseline[model][schedule]
        return [x / one for x in self.samples_per_s(schedule, model)]

    def efficiency(self, schedule: str, model: str = "replay") -> list[float]:
        return [s / n for s, n in zip(self.speedup(schedule, model), self.workers)]

    def rows(self) -> list[dict[str, Any]]:
        """One row per (schedule, N): both models' iteration time, throughput, speed-up and
        efficiency."""
        out = []
        for schedule in self.schedules:
            cols = {m: (self._pick(schedule, m), self.samples_per_s(schedule, m),
                        self.speedup(schedule, m), self.efficiency(schedule, m))
                    for m in self.seconds}
            for i, n in enumerate(self.workers):
                row: dict[str, Any] = {"schedule": schedule, "workers": n}
                for m, (t, x, s, e) in cols.items():
                    row.update({f"{m}_iteration_s": t[i], f"{m}_samples_per_s": x[i],
                                f"{m}_speedup": s[i], f"{m}_efficiency": e[i]})
                out.append(row)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"workers": self.workers, "batch_size": self.batch_size,
                "topology": dataclasses.asdict(self.topology),
                "topology_text": self.topology.describe(), "seconds": self.seconds,
                "one_worker_s": self.baseline, "cost_s": self.cost_s, "rows": self.rows()}

    def table(self) -> str:
        """Markdown: per schedule and N, samples/s, speed-up and efficiency, replay and
        queueing side by side."""
        head = ["schedule", "workers", "iteration (ms)", "samples/s", "speed-up", "efficiency"]
        if "queueing" in self.seconds:
            head += ["queueing samples/s", "queueing efficiency"]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in self.rows():
            cells = [r["schedule"], str(r["workers"]), f"{r['replay_iteration_s'] * 1e3:.1f}",
                     f"{r['replay_samples_per_s']:.1f}", f"{r['replay_speedup']:.2f}",
                     f"{r['replay_efficiency']:.0%}"]
            if "queueing" in self.seconds:
                cells += [f"{r['queueing_samples_per_s']:.1f}",
                          f"{r['queueing_efficiency']:.0%}"]
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)

    def plot(self, path: str) -> str:
        """Samples/s vs workers (log-log), replay solid, queueing dashed, ideal dotted."""
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
        colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        for k, schedule in enumerate(self.schedules):
            c = colors[k % len(colors)]
            ax.plot(self.workers, self.samples_per_s(schedule), "-o", color=c, markersize=3,
                    label=schedule)
            ax2.plot(self.workers, self.efficiency(schedule), "-o", color=c, markersize=3,
                     label=schedule)
            if "queueing" in self.seconds:
                ax.plot(self.workers, self.samples_per_s(schedule, "queueing"), "--", color=c)
                ax2.plot(self.workers, self.efficiency(schedule, "queueing"), "--", color=c)
        best = max(self.baseline["replay"].values())
        ax.plot(self.workers, [n * self.batch_size / best for n in self.workers], ":",
                color="black", label="linear")
        for a in (ax, ax2):
            a.set_xscale("log", base=2)
            a.set_xlabel("workers")
        ax.set_yscale("log")
        ax.set_ylabel(f"samples/s (batch {self.batch_size:g} per worker)")
        ax2.set_ylabel("efficiency (speed-up / workers)")
        ax2.set_ylim(0, 1.05)
        ax.legend(fontsize=8)
        fig.suptitle(f"{self.topology.describe()}\nreplay (solid), queueing model (dashed)",
                     fontsize=9)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path


def at_cost(sim: Simulator, cost: CostModel) -> Simulator:
    """`sim` replaying with `cost` (any world size) in place of its fitted model; each traced
    iteration's link variation (its rate over the median) is kept on the new link."""
    out = copy.copy(sim)
    old = sim.fitted
    out.fitted = cost
    out.iteration_rates = {
        it: {k: r / old.rate[k] * cost.rate[k] for k, r in rates.items()
             if k in cost.rate and old.rate.get(k)}
        for it, rates in sim.iteration_rates.items()} if old is not None else {}
    return out


def scaling_curve(trace: "Trace | str | Simulator",
                  workers: Sequence[int] = DEFAULT_WORKERS,
                  schedules: Sequence["str | Schedule"] = DEFAULT_SCHEDULES, *,
                  topology: Optional[Topology] = None, batch_size: float = 1.0,
                  fusion_threshold: Optional[int] = None,
                  models: Sequence[str] = MODELS, compute_scale: float = 1.0) -> ScalingCurve:
    """The curve of `trace` (a directory, a loaded Trace or a Simulator) at each worker count
    on `topology` (default: the traced link, one GPU per node), for each schedule, by the
    replay and the queueing model (`models`). `compute_scale`: every traced compute time
    multiplied by it (e.g. 0.5: an accelerator twice as fast)."""
    ns = _check_workers(workers)
    if not batch_size > 0:
        raise ValueError(f"batch_size (samples per worker and iteration) must be > 0, got "
                         f"{batch_size}")
    names = [Schedule(s).value for s in schedules]      # ValueError names a bad one
    if not names:
        raise ValueError("give at least one schedule")
    bad = [m for m in models if m not in MODELS]
    if bad or "replay" not in models:
        raise ValueError(f"models must include 'replay' and be among {MODELS}, got "
                         f"{list(models)}")
    if not compute_scale > 0:
        raise ValueError(f"compute_scale must be > 0, got {compute_scale}")
    topo = topology or Topology()
    sim = trace if isinstance(trace, Simulator) else Simulator(
        load_trace(trace) if isinstance(trace, str) else trace)
    costs = {n: topo.cost(sim.fitted, n) for n in sorted(set(ns) | {1})}
    seconds: dict[str, dict[str, list[float]]] = {}
    baseline: dict[str, dict[str, float]] = {}
    spent: dict[str, float] = {}
    for model in models:
        started = time.perf_counter()
        fn = (_replay_fn(sim, fusion_threshold, compute_scale) if model == "replay"
              else _queue_fn(sim, fusion_threshold, compute_scale))
        seconds[model] = {s: [fn(s, costs[n]) for n in ns] for s in names}
        baseline[model] = {s: fn(s, costs[1]) for s in names}
        spent[model] = time.perf_counter() - started
    return ScalingCurve(ns, float(batch_size), topo, seconds, spent, baseline)


def _replay_fn(sim: Simulator, threshold: Optional[int], scale: float) -> Any:
    def predict(schedule: str, cost: CostModel) -> float:
        return at_cost(sim, cost).predict(schedule, fusion_threshold=threshold,
                                          world_size=cost.world_size,
                                          compute_scale=scale).iteration_time
    return predict


def _queue_fn(sim: Simulator, threshold: Optional[int], scale: float) -> Any:
    queue = QueueModel(sim.model, scale)

    def predict(schedule: str, cost: CostModel) -> float:
        return queue.iteration_time(schedule, cost, fusion_threshold=threshold)
    return predict


def _check_workers(workers: Sequence[int]) -> list[int]:
    ns = list(workers)
    if not ns:
        raise ValueError("give at least one worker count")
    for n in ns:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"worker counts must be integers >= 1, got {n!r}")
    if len(set(ns)) != len(ns):
        raise ValueError(f"worker counts repeat: {ns}")
    return sorted(ns)
