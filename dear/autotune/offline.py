"""Offline fusion tuning: dear.diagnose's simulator as a zero-cost objective, then a few real
iterations to confirm.

    candidates = tune_offline(Simulator("traces/"), model_bytes)   # [(config, predicted s)]

Why: each online trial costs `settle + window` training iterations, so the online tuner affords
about 12 trials. A replay of a traced iteration costs no training iteration at all, so the
Bayesian search can afford 40 trials on predicted times; real iterations are then spent only
on the few layouts the simulator ranks best, which also guards against its errors.

`autotune="offline"` (DEAR_AUTOTUNE=offline) runs this from the optimizer's step(), in phases:
1. settle: `settle` iterations untouched, then every rank starts dear.diagnose's tracer at the
   same step() (the tracer aligns clocks with a collective);
2. trace: iteration 0 is traced so that its all-gathers (waited for in iteration 1) are, and
   iterations 1..window are the profile; at the end of the window the tracer's hooks are
   removed, every rank's collectives are all-gathered to fit the network (a collective lasts
   from the last rank's issue), and rank 0 builds the simulator from its own trace, in memory
   (the optimizer's parameter order; the PLANNED schedule with each candidate's chunk size
   where the optimizer can run a plan, else DEAR), runs FusionTuner on predicted times and
   broadcasts the plan: the current layout plus the `confirm` best predicted distinct layouts;
3. confirm: each planned layout is timed for `settle + window` iterations as the online tuner
   times a trial (rank 0 decides, broadcast, every rank switches at the same step()); the
   fastest measured is kept and saved with fusion_config.save.
Every simulated trial (`predicted_s`) and every confirmed one (`predicted_s`,
`iteration_time_s`) is a line of the JSON-lines log. If the trace cannot be simulated (e.g.
two forward passes per step), every rank keeps the current layout and a warning says why.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable, Optional

from ..comm import runtime
from ..comm.base import Communicator
from ..fusion import fusion_config
from ..fusion.fusion_config import FusionConfig
from .online import FusionTuner, TrialDriver, sizes_mb

if TYPE_CHECKING:
    from ..diagnose.simulate import Simulator

log = logging.getLogger("dear")

SIMULATED_TRIALS = 40
CONFIRM = 3


def tune_offline(sim: "Simulator", model_bytes: int, *, budget: int = SIMULATED_TRIALS,
                 top_k: int = CONFIRM, initial: Optional[FusionConfig] = None, seed: int = 0,
                 on_trial: Optional[Callable[[FusionConfig, float], None]] = None,
                 chunk_bytes: Optional[int] = None,
                 **predict: Any) -> list[tuple[FusionConfig, float]]:
    """FusionTuner on the simulator's predicted iteration times, for `budget` trials (no early
    stop: a trial is cheap). Returns the `top_k` best (config, predicted seconds), fastest
    first, one per distinct candidate: configs that plan the same buckets and all-gather groups
    (and, planned, cut them into the same chunks) are one (confirming both would measure the
    same thing twice). `chunk_bytes`: the planned schedule's chunk size for a config without
    one (Config's); given, the PLANNED schedule is replayed, each candidate with its own chunk
    size, which is searched too; None: DeAR's order. `predict`: what-if settings passed to
    Simulator.predict (bandwidth_bps, world_size, ...)."""
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    tuner = FusionTuner(model_bytes, budget=budget, patience=budget, initial=initial,
                        seed=seed, chunk_bytes=chunk_bytes)
    world = predict.get("world_size")
    best: dict[tuple, tuple[FusionConfig, float]] = {}      # candidate -> first config, time
    while (config := tuner.suggest()) is not None:
        key = candidate_key(sim, config, chunk_bytes, world)
        if key in best:                        # same layout and chunks: same prediction
            seconds = best[key][1]
        else:
            seconds = predict_config(sim, config, chunk_bytes, **predict)
            best[key] = (config, seconds)
        tuner.observe(config, seconds)
        if on_trial is not None:
            on_trial(config, seconds)
    return sorted(best.values(), key=lambda t: t[1])[:top_k]


def predict_config(sim: "Simulator", config: FusionConfig, chunk_bytes: Optional[int],
                   **predict: Any) -> float:
    """Predicted seconds per iteration of `config`: the PLANNED replay with its chunk size
    (else `chunk_bytes`, the one it would run with) when `chunk_bytes` is given, else DEAR."""
    from ..diagnose.simulate import Schedule
    if chunk_bytes is None:
        return sim.predict(Schedule.DEAR, fusion=config, **predict).iteration_time
    fusion = dataclasses.replace(config, chunk_bytes=config.chunk_bytes or chunk_bytes)
    return sim.predict(Schedule.PLANNED, fusion=fusion, **predict).iteration_time


def candidate_key(sim: "Simulator", config: FusionConfig, chunk_bytes: Optional[int],
                  world: Optional[int] = None) -> tuple:
    """What a config runs as: its layout and, planned, how many chunks each bucket's
    all-gather is cut into (chunk sizes that cut every bucket alike plan alike)."""
    layout = sim.layout(config, world)
    if chunk_bytes is None:
        return layout.signature()
    chunk = config.chunk_bytes or chunk_bytes
    return layout.signature(), tuple(-(-nbytes // chunk) for _, nbytes in layout.buckets)


class _Phase(enum.Enum):
    SETTLE = "settle"
    TRACE = "trace"
    CONFIRM = "confirm"


class OfflineAutotuner(TrialDriver):
    """Drives offline tuning from the optimizer's step(): the same switches on every rank, at
    the same call, as OnlineAutotuner (whose interface it has: on_step, current, finished)."""

    def __init__(self, optimizer: Any, comm: Communicator, start: FusionConfig, *,
                 fingerprint: str, model_bytes: int, settle: int = 2, window: int = 5,
                 simulated_trials: int = SIMULATED_TRIALS, confirm: int = CONFIRM,
                 log_path: Optional[str] = None, out_path: Optional[str] = None,
                 clock: Callable[[], float] = time.perf_counter, seed: int = 0) -> None:
        if simulated_trials < 1 or confirm < 1:
            raise ValueError(f"offline autotune needs simulated_trials >= 1 and confirm >= 1, "
                             f"got {simulated_trials}, {confirm}")
        try:                                   # fail now, not after the traced window
            import skopt  # noqa: F401
        except ImportError as exc:
            raise ImportError("autotuning needs scikit-optimize: pip install scikit-optimize "
                              "(or pip install 'dear[tune]')") from exc
        super().__init__(comm, start, fingerprint=fingerprint, settle=settle, window=window,
                         log_path=log_path, out_path=out_path, clock=clock)
        self._optimizer = weakref.ref(optimizer)   # the optimizer holds this object
        #: every rank: [(config, predicted s)] confirmed in this order (current first)
        self.plan: list[tuple[FusionConfig, float]] = []
        #: rank 0: [(config, predicted s, measured s)]
        self.confirmed: list[tuple[FusionConfig, float, float]] = []
        self.simulated_trials = 0
        #: seconds from the end of the traced window to the plan (rank 0: building the
        #: simulator and searching; the other ranks wait)
        self.search_s: Optional[float] = None
        self._model_bytes, self._seed = model_bytes, seed
        self._window = window
        self._budget, self._confirm = simulated_trials, confirm
        self._phase = _Phase.SETTLE
        self._tracer: Any = None
        self._skip = settle
        self._lines = 0

    @property
    def iterations(self) -> int:
        """Training iterations since tuning started (the real cost)."""
        return self._iteration

    def on_step(self) -> Optional[FusionConfig]:
        """Call at the end of every step() on every rank. Returns the config to switch to
        before the next iteration (the same on every rank, at the same call), or None."""
        if self.finished:
            return None
        self._iteration += 1
        if self._phase is _Phase.SETTLE:
            if self._skip > 0:
                self._skip -= 1
            else:
                self._start_trace()
            return None
        if self._phase is _Phase.TRACE:
            if self._tracer.iteration >= self._window:
                self._finish_trace()
            return None
        return self._timed_switch()

    def close(self) -> None:
        """Training ended inside the traced window (dear.shutdown()): detach the tracer and
        plan nothing; the current layout stays."""
        if self._tracer is not None:
            self._tracer.stop(write=False)
            self._tracer = None
        self.finished = True

    # ------------------------------------------------------------------------ trace, plan
    def _start_trace(self) -> None:
        from ..diagnose.trace import Tracer
        opt = self._optimizer()
        assert opt is not None
        # Iteration 0 only makes the all-gathers that iteration 1 waits for traced ones.
        self._tracer = Tracer(opt.dear_model, opt, out="", iterations=range(0, self._window + 1),
                              inside_step=True).start()
        self._phase = _Phase.TRACE

    def _finish_trace(self) -> None:
        tracer, self._tracer = self._tracer, None
        tracer.stop(write=False)               # hooks removed: later iterations pay nothing
        start = time.perf_counter()
        doc: Any = None
        try:
            doc = tracer.document()
            mine = [e for e in doc["traceEvents"] if e.get("cat") == "comm"]
        except Exception as exc:               # no rank may skip the collectives below
            doc, mine = f"{type(exc).__name__}: {exc}", []
        # A collective is on the link from the last rank's issue to the last rank's end: the
        # cost model needs every rank's collectives (a few per bucket), rank 0's profile only.
        collectives = self._comm.all_gather_object(mine)
        plan: Any = doc if isinstance(doc, str) else None
        plan = self._search_on_rank_0(plan, doc, collectives)
        self.search_s = time.perf_counter() - start
        if isinstance(plan, str):
            log.warning("dear autotune (offline): the traced iterations could not be simulated "
                        "(%s); keeping %s", plan, self.current.describe())
            self.finished = True
            return
        self.plan = plan
        self._phase = _Phase.CONFIRM
        self._timer.restart()

    def _search_on_rank_0(self, plan: Any, doc: Any, collectives: list[Any]) -> Any:
        """Rank 0 searches (6-48 s) in a thread while every rank meets it in a small broadcast
        every few seconds, so no rank waits longer than DEAR_TIMEOUT for the plan: a healthy
        search is never mistaken for a stalled peer. Returns rank 0's plan (or why none)."""
        found: dict[str, Any] = {}
        search = None
        if self._comm.rank == 0 and plan is None:
            def run() -> None:
                try:
                    found["plan"] = self._plan(doc, collectives)
                except Exception as exc:       # the fallback must be the same on every rank
                    found["plan"] = f"{type(exc).__name__}: {exc}"
            search = threading.Thread(target=run, name="dear-autotune-search", daemon=True)
            search.start()
        poll = min(5.0, max(0.05, runtime.config().timeout / 4))
        while True:
            message = None
            if self._comm.rank == 0:
                if search is not None:
                    search.join(poll)
                done = search is None or not search.is_alive()
                message = (done, found.get("plan", plan) if done else None)
            done, value = self._comm.broadcast_object(message, 0)
            if done:
                return value

    def _plan(self, doc: dict[str, Any], collectives: list[list[dict[str, Any]]]
              ) -> list[tuple[FusionConfig, float]]:
        """Rank 0: the simulator from this rank's trace and every rank's collectives, the
        search, the candidates."""
        from ..diagnose.chrome import Trace, parse_rank
        from ..diagnose.costmodel import CostModel
        from ..diagnose.graph import collective_samples
        from ..diagnose.simulate import Simulator
        from ..diagnose.targets import collect_params
        opt = self._optimizer()
        assert opt is not None
        mine = parse_rank(doc)
        ranks = [mine] + [parse_rank({"traceEvents": events, "dear": {**doc["dear"], "rank": r}})
                          for r, events in enumerate(collectives) if r != mine.rank]
        samples = collective_samples(Trace("<dear autotune>", ranks))
        cost = CostModel.fit(samples, self._comm.size) if samples else None
        sim = Simulator(Trace("<dear autotune>", [mine]), iterations=range(1, self._window + 1),
                        cost=cost)
        # Replay with the optimizer's own parameter order (rank 0's forward order), in the
        # tracer's parameter indices.
        index = {id(p): i for i, (_, p) in enumerate(collect_params(opt.dear_model, opt))}
        order = [index[id(opt.dear_parameters[i])] for i in opt.dear_order]
        order += [i for i in range(len(index)) if i not in set(order)]
        rows = opt.dear_row_sparse   # alone in the layouts
        sim = Simulator.from_model(dataclasses.replace(
            sim.model, forward_order=order, unclaimed=[],
            alone=sorted(index[id(opt.dear_parameters[i])] for i in rows)), sim.fitted)
        # The planned schedule's chunk size is searched where a plan can run (its default
        # otherwise: DeAR's order is replayed, where the chunk size does nothing).
        chunk = opt.dear_schedule.searched_chunk_bytes
        current = candidate_key(sim, self.current, chunk)
        predicted_now = predict_config(sim, self.current, chunk)
        found = tune_offline(sim, self._model_bytes, budget=self._budget,
                             top_k=self._confirm + 1, initial=self.current, seed=self._seed,
                             on_trial=self._log_simulated, chunk_bytes=chunk)
        others = [(c, t) for c, t in found if candidate_key(sim, c, chunk) != current]
        log.info("dear autotune (offline): %d simulated trials; current %s predicted %.4f s, "
                 "best %s", self.simulated_trials, self.current.describe(), predicted_now,
                 ", ".join(f"{c.describe()} {t:.4f} s" for c, t in others[:self._confirm]))
        return [(self.current, predicted_now)] + others[:self._confirm]

    # -------------------------------------------------------------------------- confirm
    def _decide(self, seconds: float) -> tuple[bool, FusionConfig]:
        config, predicted = self.plan[len(self.confirmed)]
        self.confirmed.append((config, predicted, seconds))
        best_time = min(t for _, _, t in self.confirmed)
        self._log_confirmed(config, predicted, seconds, best_time)
        if len(self.confirmed) < len(self.plan):
            return False, self.plan[len(self.confirmed)][0]
        best, best_predicted, _ = min(self.confirmed, key=lambda c: c[2])
        log.warning("dear autotune (offline): done after %d simulated trials and %d confirmed "
                    "(%d iterations); best %s at %.4f s/iteration (predicted %.4f s)",
                    self.simulated_trials, len(self.confirmed), self._iteration,
                    best.describe(), best_time, best_predicted)
        if self._out_path:
            fusion_config.save(self._out_path, best, self._fingerprint,
                               iteration_time_s=best_time, predicted_s=best_predicted,
                               trials=len(self.confirmed),
                               simulated_trials=self.simulated_trials,
                               world_size=self._comm.size, autotune="offline")
        return True, best

    # -------------------------------------------------------------------------------- log
    def _log_simulated(self, config: FusionConfig, predicted: float) -> None:
        self.simulated_trials += 1
        self._write({"phase": "simulated", **sizes_mb(config),
                     "predicted_s": round(predicted, 6)})

    def _log_confirmed(self, config: FusionConfig, predicted: float, seconds: float,
                       best: float) -> None:
        log.info("dear autotune (offline) confirmation %d: %s -> %.4f s/iteration "
                 "(predicted %.4f s)", len(self.confirmed), config.describe(), seconds,
                 predicted)
        self._write({"phase": "confirmed", "iteration": self._iteration, **sizes_mb(config),
                     "predicted_s": round(predicted, 6),
                     "iteration_time_s": round(seconds, 6),
                     "samples_per_s": self._samples_per_s(seconds),
                     "best_so_far_s": round(best, 6)})

    def _write(self, record: dict[str, Any]) -> None:
        self._lines += 1
        self._append_log({"trial": self._lines, **record})
