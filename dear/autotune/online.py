"""Bayesian optimization of the fusion layout and the planned schedule's chunk size
(scikit-optimize's ask/tell `Optimizer`).

`FusionTuner` is the search: it proposes `FusionConfig`s and is told their iteration time. The
surrogate is skopt's default GP for ask/tell (Matern 5/2 kernel, `noise="gaussian"`: a fitted
white-noise term, so two timings of the same point that disagree are read as noise, not as a
cliff) with expected improvement, after 5 random points. It stops after `budget` trials, or
earlier once `patience` guided trials in a row failed to beat the best by `min_improvement`
(with the default budget of 12 and patience 6, only on a flat objective), then stays on the
best. Those defaults, and random initial points rather than a Latin hypercube, did best on a
synthetic pipeline model of iteration time. With the planned schedule the all-gather chunk size
is a fourth dimension (log-uniform CHUNK_MIN_BYTES to CHUNK_MAX_BYTES), which the same budget
tunes less closely than three (docs/benchmarks.md#the-online-tuners-budget).

`OnlineAutotuner` runs the search inside training: it times iterations from step() to step(),
drops `settle` iterations after every switch, takes the median of the next `window` as the
objective, and at the end of each window rank 0 decides and broadcasts the next config, so every
rank switches at the same iteration boundary. Every trial is appended to a JSON-lines log as it
finishes, and the best config is written to a file that `fusion_config=` reloads.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import time
from typing import Any, Callable, Optional

from ..comm.base import Communicator
from ..fusion import fusion_config
from ..fusion.fusion_config import FusionConfig

log = logging.getLogger("dear")

MIN_BYTES = 1 << 20           # 1 MB: below this, per-collective latency dominates everywhere
MAX_BYTES = 256 << 20         # 256 MB
# The planned schedule's all-gather chunk: below 256 KB a chunk is mostly latency (the link
# probe's alpha), above 16 MB it fits almost no gap in backward.
CHUNK_MIN_BYTES = 256 << 10
CHUNK_MAX_BYTES = 16 << 20


def _log2(nbytes: float) -> float:
    return math.log2(max(nbytes, 1.0))


class FusionTuner:
    """Proposes fusion layouts and learns from their measured iteration times."""

    def __init__(self, model_bytes: int, *, budget: int = 12, patience: int = 6,
                 min_improvement: float = 0.02, initial: Optional[FusionConfig] = None,
                 n_initial_points: int = 5, seed: int = 0,
                 chunk_bytes: Optional[int] = None) -> None:
        """`chunk_bytes`: the planned schedule's chunk size a config without one runs with
        (Config's); given, the chunk size is searched too. None (DeAR's order, where it does
        nothing): three sizes only, no trial spent on a knob without effect."""
        try:
            from skopt import Optimizer
            from skopt.space import Real
        except ImportError as exc:
            raise ImportError("autotuning needs scikit-optimize: pip install scikit-optimize "
                              "(or pip install 'dear[tune]')") from exc
        if budget < 1:
            raise ValueError(f"the autotune budget must be >= 1 trial, got {budget}")
        self.budget, self.patience, self.min_improvement = budget, patience, min_improvement
        hi = _log2(min(MAX_BYTES, max(model_bytes, 2 * MIN_BYTES)))
        lo = _log2(MIN_BYTES)
        self._bounds = (lo, hi)
        # Sizes are searched as log2(bytes), uniform: log-uniform in bytes.
        self._space = [Real(lo, hi, name="rs_threshold"), Real(lo, hi, name="ag_threshold"),
                       Real(lo, hi, name="first_bucket")]
        self._chunk_default = chunk_bytes
        if chunk_bytes is not None:            # a chunk above the model's size is one chunk
            top = min(CHUNK_MAX_BYTES, max(model_bytes, 2 * CHUNK_MIN_BYTES))
            self._chunk_bounds = (_log2(CHUNK_MIN_BYTES), _log2(top))
            self._space.append(Real(*self._chunk_bounds, name="chunk_bytes"))
        self._n_initial = max(1, min(n_initial_points, budget))
        self._opt = Optimizer(self._space, base_estimator="GP", acq_func="EI",
                              n_initial_points=self._n_initial, random_state=seed)
        self._initial = initial
        self.trials: list[tuple[FusionConfig, float]] = []
        self._since_improvement = 0

    # ----------------------------------------------------------------------------- search
    def suggest(self) -> Optional[FusionConfig]:
        """The next config to try, or None when the search is over."""
        if self.done:
            return None
        if not self.trials and self._initial is not None:
            return self._initial               # the default first: the baseline to beat
        return self._to_config(self._opt.ask())

    def observe(self, config: FusionConfig, seconds: float) -> None:
        if not (seconds > 0 and math.isfinite(seconds)):
            raise ValueError(f"iteration time must be a positive number, got {seconds!r}")
        best = self.best_time
        self.trials.append((config, seconds))
        self._opt.tell(self._to_point(config), seconds)
        if best is None or seconds < best * (1 - self.min_improvement):
            self._since_improvement = 0
        else:
            self._since_improvement += 1

    @property
    def done(self) -> bool:
        if len(self.trials) >= self.budget:
            return True
        # Patience counts only guided trials: random initial points are not expected to win.
        guided = len(self.trials) - self._n_initial - 1
        return guided >= self.patience and self._since_improvement >= self.patience

    @property
    def best(self) -> Optional[FusionConfig]:
        return min(self.trials, key=lambda t: t[1])[0] if self.trials else None

    @property
    def best_time(self) -> Optional[float]:
        return min(t for _, t in self.trials) if self.trials else None

    # ------------------------------------------------------------------------ conversion
    @property
    def dimensions(self) -> list[str]:
        """The searched knobs, in the order of a point."""
        return [d.name for d in self._space]

    def _to_config(self, point: list[float]) -> FusionConfig:
        rs, ag, first = (int(round(2.0 ** x)) for x in point[:3])
        chunk = int(round(2.0 ** point[3])) if len(point) > 3 else None
        return FusionConfig(rs_threshold=rs, ag_threshold=ag, first_bucket=first,
                            chunk_bytes=chunk)

    def _to_point(self, config: FusionConfig) -> list[float]:
        lo, hi = self._bounds
        first = config.first_bucket if config.first_bucket is not None else config.rs_threshold
        point = [min(hi, max(lo, _log2(v)))
                 for v in (config.rs_threshold, config.ag_threshold, first)]
        if self._chunk_default is not None:    # None: the chunk size it runs with, Config's
            lo, hi = self._chunk_bounds
            chunk = config.chunk_bytes or self._chunk_default
            point.append(min(hi, max(lo, _log2(chunk))))
        return point


class TrialTimer:
    """Times a trial from step() to step(): drops `settle` iterations after each switch, then
    gives the median of the next `window` (and starts over)."""

    def __init__(self, settle: int, window: int,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if settle < 0 or window < 1:
            raise ValueError(f"autotune needs settle >= 0 and window >= 1 iterations, got "
                             f"settle={settle}, window={window}")
        self.settle, self.window, self._clock = settle, window, clock
        self.restart()

    def restart(self) -> None:
        """After a switch: the switch itself is not timed, the next `settle` are dropped."""
        self._times: list[float] = []
        self._skip = self.settle
        self._last: Optional[float] = None

    def tick(self) -> Optional[float]:
        """Call once per step(); the window's median when it completes, else None."""
        now = self._clock()
        if self._last is not None:
            if self._skip > 0:
                self._skip -= 1
            else:
                self._times.append(now - self._last)
        self._last = now
        if len(self._times) < self.window:
            return None
        seconds = statistics.median(self._times)
        self.restart()
        return seconds


def sizes_mb(config: FusionConfig) -> dict[str, Optional[float]]:
    """A layout as a trial log line writes it."""
    return {"rs_threshold_mb": round(config.rs_threshold / 2**20, 3),
            "ag_threshold_mb": round(config.ag_threshold / 2**20, 3),
            "first_bucket_mb": (None if config.first_bucket is None
                                else round(config.first_bucket / 2**20, 3)),
            "chunk_mb": (None if config.chunk_bytes is None
                         else round(config.chunk_bytes / 2**20, 3))}


class TrialDriver:
    """What both autotuners share: time a trial's window, let rank 0 decide, switch every rank
    at the same step(), log each trial as a JSON line. Subclasses define _decide."""

    def __init__(self, comm: Communicator, start: FusionConfig, *, fingerprint: str,
                 settle: int, window: int, log_path: Optional[str], out_path: Optional[str],
                 clock: Callable[[], float]) -> None:
        self._timer = TrialTimer(settle, window, clock)
        self._comm = comm
        self.current = start
        self.finished = False
        self.samples_per_iteration: Optional[int] = None
        self._fingerprint = fingerprint
        self._log_path, self._out_path = log_path, out_path
        self._iteration = 0
        if comm.rank == 0 and log_path:
            open(log_path, "w").close()        # a fresh log per run

    def on_step(self) -> Optional[FusionConfig]:
        """Called by the optimizer's step() on every rank: the config to switch to now, the
        same on every rank, or None."""
        raise NotImplementedError

    def close(self) -> None:
        """Training ends (dear.shutdown()): release what tuning holds; nothing by default."""

    def _append_log(self, record: dict[str, Any]) -> None:
        if self._log_path:
            with open(self._log_path, "a") as f:  # one line per trial, flushed at once
                f.write(json.dumps(record) + "\n")

    def _samples_per_s(self, seconds: float) -> Optional[float]:
        samples = self.samples_per_iteration
        return None if not samples else round(samples / seconds, 2)

    def _decide(self, seconds: float) -> tuple[bool, FusionConfig]:
        """Rank 0: record the trial that took `seconds`; (is tuning over, next config)."""
        raise NotImplementedError

    def _timed_switch(self) -> Optional[FusionConfig]:
        seconds = self._timer.tick()
        if seconds is None:
            return None
        decision: Any = self._decide(seconds) if self._comm.rank == 0 else None
        # One small broadcast per trial, issued by every rank at the same step().
        self.finished, config = self._comm.broadcast_object(decision, 0)
        if config == self.current:
            return None
        self.current = config
        return config


class OnlineAutotuner(TrialDriver):
    """Drives a FusionTuner from the optimizer's step(): same decisions on every rank."""

    def __init__(self, tuner: FusionTuner, comm: Communicator, start: FusionConfig, *,
                 fingerprint: str, settle: int = 2, window: int = 5,
                 log_path: Optional[str] = None, out_path: Optional[str] = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        super().__init__(comm, start, fingerprint=fingerprint, settle=settle, window=window,
                         log_path=log_path, out_path=out_path, clock=clock)
        self.tuner = tuner

    def on_step(self) -> Optional[FusionConfig]:
        """Call at the end of every step() on every rank. Returns the config to switch to
        before the next iteration (the same on every rank, at the same call), or None."""
        if self.finished:
            return None
        self._iteration += 1
        return self._timed_switch()

    def _decide(self, seconds: float) -> tuple[bool, FusionConfig]:
        tuner = self.tuner
        tuner.observe(self.current, seconds)
        self._log_trial(seconds)
        nxt = tuner.suggest()
        if nxt is not None:
            return False, nxt
        best = tuner.best
        assert best is not None
        log.warning("dear autotune: done after %d trials; best %s at %.4f s/iteration",
                    len(tuner.trials), best.describe(), tuner.best_time)
        if self._out_path:
            fusion_config.save(self._out_path, best, self._fingerprint,
                               iteration_time_s=tuner.best_time, trials=len(tuner.trials),
                               world_size=self._comm.size)
        return True, best

    def _log_trial(self, seconds: float) -> None:
        config, k = self.current, len(self.tuner.trials)
        log.info("dear autotune trial %d: %s -> %.4f s/iteration", k, config.describe(),
                 seconds)
        self._append_log({"trial": k, "iteration": self._iteration, **sizes_mb(config),
                          "iteration_time_s": round(seconds, 6),
                          "samples_per_s": self._samples_per_s(seconds),
                          "best_so_far_s": round(self.tuner.best_time or seconds, 6)})
