"""Offline fusion autotuning (autotune="offline"): the search on a hand-built graph, a 2-rank
run that traces, simulates, confirms and switches like the online tuner (same layouts on every
rank, same parameters as a fixed layout, tracer hooks gone), the settings."""

from __future__ import annotations

import dataclasses
import itertools
import json
import time
from typing import Optional

import pytest
import torch
import torch.nn.functional as F

import dear
from dear.config import Autotune, Config, parse_autotune
from dear.diagnose.costmodel import CostModel
from dear.diagnose.graph import Model, Profile, Segment
from dear.diagnose.simulate import Schedule, Simulator
from dear.fusion import fusion_config
from dear.fusion.fusion_config import FusionConfig
from dear.autotune.offline import candidate_key, predict_config, tune_offline
from tests.distributed import run_distributed
from tests.workloads import batch, make_net, train_autotuned

MB = 1 << 20


# ------------------------------------------------------------------ the search, simulated
def _chain(params: int = 8) -> Simulator:
    """8 parameters of 1 MB, 4 ms of forward and of backward each, on a 1 Gbit/s link with
    3 ms per latency step: many small buckets pay latency, few large ones hide nothing."""
    prof = Profile(rank=0, lead=0.0,
                   forward=[Segment(0.0)] + [Segment(0.004, (i,)) for i in range(params)],
                   loss=0.0, backward=[Segment(0.004, produces=i) for i in reversed(range(params))],
                   backward_tail=0.0, update=0.008, step_extra=0.0, tail=0.0)
    model = Model(param_bytes=[MB] * params, param_numel=[MB // 4] * params,
                  forward_order=list(range(params)), backward_order=list(reversed(range(params))),
                  schedule="dear", buckets=[], fusion_threshold=None, world_size=2,
                  profiles=[prof, prof])
    return Simulator.from_model(model, CostModel.ideal(1e9, 3e-3, world_size=2))


def test_offline_search_finds_what_the_simulator_says_is_best() -> None:
    sim = _chain()
    # Ground truth: every distinct layout of a fine grid (quarter powers of two), replayed.
    sizes = [int(2 ** (20 + k / 4)) for k in range(13)]
    truth: dict[tuple, float] = {}
    for rs, ag, first in itertools.product(sizes, sizes, sizes + [None]):
        config = FusionConfig(rs, ag, first)
        key = sim.layout(config).signature()
        if key not in truth:
            truth[key] = sim.predict(Schedule.DEAR, fusion=config).iteration_time
    optimum = min(truth.values())
    default = sim.predict(Schedule.DEAR, fusion=FusionConfig.single(25 * MB)).iteration_time
    assert optimum < 0.75 * default            # the layout matters on this graph
    trials: list[tuple[FusionConfig, float]] = []
    found = tune_offline(sim, 8 * MB, budget=24, top_k=3, initial=FusionConfig.single(25 * MB),
                         on_trial=lambda c, t: trials.append((c, t)))
    assert len(trials) == 24 and trials[0][0] == FusionConfig.single(25 * MB)
    assert len(found) == 3
    times = [t for _, t in found]
    assert times == sorted(times) and times[0] == min(t for _, t in trials)
    layouts = {sim.layout(c).signature() for c, _ in found}
    assert len(layouts) == 3                   # distinct layouts, not three names for one
    for config, predicted in found:            # what it reports is what the simulator says
        assert predicted == sim.predict(Schedule.DEAR, fusion=config).iteration_time
    assert times[0] <= 1.04 * optimum, (times[0], optimum)
    with pytest.raises(ValueError, match="top_k"):
        tune_offline(sim, 8 * MB, budget=2, top_k=0)


def _gappy_chain() -> Simulator:
    """_chain with a 0.5 ms forward per layer (too short to hide DeAR's all-gathers) on a
    2 Gbit/s link with 0.2 ms latency: backward leaves gaps the planned schedule fills, and
    how much it fills depends on the chunk size."""
    model = _chain().model
    prof = dataclasses.replace(model.profiles[0], update=0.001, forward=[Segment(0.0)] + [
        Segment(0.0005, (i,)) for i in range(len(model.param_bytes))])
    return Simulator.from_model(dataclasses.replace(model, profiles=[prof, prof]),
                                CostModel.ideal(2e9, 2e-4, world_size=2))


def test_planned_replay_uses_the_candidates_chunk_size(monkeypatch) -> None:
    """Simulator's PLANNED replay plans with the FusionConfig's chunk size (Config's when it
    has none): 64 KB chunks are many small collectives, 64 MB ones a whole shard each, and
    the predictions differ (measured: 49.8 ms and 53.3 ms; 1 MB 46.0 ms)."""
    import dear.fusion.schedule as schedule_module
    monkeypatch.setenv("DEAR_PLAN_SLACK", "0.1")   # the gaps here are exact: little kept free
    sim = _gappy_chain()
    plans: list = []
    plan_gaps = schedule_module.plan_gaps
    monkeypatch.setattr(schedule_module, "plan_gaps",
                        lambda *a, **k: plans.append(plan_gaps(*a, **k)) or plans[-1])
    layout = FusionConfig(MB, MB, None)
    predicted = {chunk: sim.predict(Schedule.PLANNED, fusion=dataclasses.replace(
        layout, chunk_bytes=chunk)).iteration_time for chunk in (64 << 10, 64 << 20, None)}
    assert len(plans) == 3                     # one replay, one plan each
    tiny, huge, default = (p.num_chunks for p in plans)
    assert tiny > huge, (tiny, huge)          # 64 MB: a whole shard per chunk, fits no gap
    assert abs(predicted[64 << 10] - predicted[64 << 20]) > 1e-3, predicted
    assert predicted[None] < min(predicted[64 << 10], predicted[64 << 20])
    assert predicted[None] == sim.predict(Schedule.PLANNED, fusion=dataclasses.replace(
        layout, chunk_bytes=Config().chunk_bytes)).iteration_time
    assert plans[-1] == plans[2] and default > 0
    # An all-gather group of three buckets, one gathered early in chunks: step() gathers the
    # group bucket by bucket, as ScheduleDriver.gather_rest does (this replay once failed).
    grouped = FusionConfig(3556745, 7820774, 1055446, chunk_bytes=1249722)
    assert sim.layout(grouped).groups == [[0], [1, 2, 3]]
    assert sim.predict(Schedule.PLANNED, fusion=grouped).iteration_time > 0
    assert any(c[0] in (1, 2, 3) for cs in plans[-1].after.values() for c in cs)


def test_offline_search_of_the_chunk_size_replays_the_planned_schedule() -> None:
    """tune_offline(chunk_bytes=...): the PLANNED replay, each candidate with its own chunk
    size; candidates that cut the same layout into the same chunks are one."""
    sim = _gappy_chain()
    trials: list[tuple[FusionConfig, float]] = []
    found = tune_offline(sim, 8 * MB, budget=12, top_k=4, initial=FusionConfig(MB, MB),
                         chunk_bytes=MB, on_trial=lambda c, t: trials.append((c, t)))
    assert trials[0][0].chunk_bytes is None    # the current config: the default chunk size
    assert all(c.chunk_bytes is not None for c, _ in trials[1:])
    assert len({c.chunk_bytes for c, _ in trials}) > 3
    keys = {candidate_key(sim, c, MB) for c, _ in found}
    assert len(keys) == len(found)
    for config, seconds in found:
        fusion = dataclasses.replace(config, chunk_bytes=config.chunk_bytes or MB)
        assert seconds == sim.predict(Schedule.PLANNED, fusion=fusion).iteration_time
        assert seconds == predict_config(sim, config, MB)


# --------------------------------------------------------------------- 2 ranks, for real
STEPS = 20


def _hooks(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    modules = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    params = sum(len(getattr(p, "_post_accumulate_grad_hooks", None) or {})
                 for p in model.parameters())
    return modules + params + len(opt._optimizer_step_pre_hooks) + len(
        opt._optimizer_step_post_hooks)


def _train(autotune: object, out_dir: str, world: int, steps: int = STEPS,
           extra: Optional[dict] = None) -> dict:
    def observe(model: torch.nn.Module, opt: object) -> tuple:
        return (opt.dear_engine.layout.signature(), _hooks(model, opt),  # type: ignore[attr-defined]
                type(opt.dear_communicator).__name__ == "TracingCommunicator"  # type: ignore
                or bool(opt.dear_engine.listeners.updates))  # type: ignore[attr-defined]
    model, opt, seen = train_autotuned(
        autotune, out_dir, world, steps,
        dict(DEAR_AUTOTUNE_WINDOW="2", DEAR_AUTOTUNE_SETTLE="1",
             DEAR_AUTOTUNE_SIMULATED_TRIALS="8", DEAR_AUTOTUNE_CONFIRM="2", **(extra or {})),
        observe)
    layouts, hooks, traced = (list(column) for column in zip(*seen))
    tuner = opt.dear_engine.autotuner
    out = {"params": {k: v.clone() for k, v in model.state_dict().items()},
           "layouts": layouts, "hooks": hooks, "traced": traced,
           "plan": getattr(tuner, "plan", None), "finished": getattr(tuner, "finished", None),
           "current": getattr(tuner, "current", None),
           "iterations": getattr(tuner, "iterations", None), "fusion": opt.dear_engine.fusion,
           "fingerprint": fusion_config.model_fingerprint(list(model.named_parameters()))}
    dear.shutdown()
    return out


def test_offline_run_confirms_switches_everywhere_and_keeps_parameters(tmp_path) -> None:
    world = 2
    tuned = run_distributed(_train, world, "offline", str(tmp_path), world, timeout=180)
    fixed = run_distributed(_train, world, False, str(tmp_path / "fixed"), world, timeout=120)
    # Every rank held the same layout at every step, and tuning finished within the run: the
    # first step and settle 1, trace 3 (iteration 0 + window 2), then 3 layouts x (1 untimed
    # after the switch + settle 1 + window 2).
    for rank in range(1, world):
        assert tuned[rank]["layouts"] == tuned[0]["layouts"]
        assert tuned[rank]["plan"] == tuned[0]["plan"]
    first = tuned[0]
    assert first["finished"] and first["iterations"] == 2 + 3 + 3 * 4
    plan = first["plan"]
    # the current layout first: threshold 1024 for both, and (DEAR_FIRST_BUCKET) a first bucket
    assert len(plan) == 3 and plan[0][0] == FusionConfig(1024, 1024, 1024)
    assert all(p is not None and p > 0 for _, p in plan)
    assert len({json.dumps(lay) for lay in first["layouts"]}) >= 2, "never switched"
    assert first["fusion"] == first["current"] and first["current"] in [c for c, _ in plan]
    # The tracer was attached only for its window: hooks and proxies gone, and the hook count
    # back to what it was before tracing (an untraced iteration pays nothing).
    assert first["traced"] == [False] + [True] * 3 + [False] * (STEPS - 4)
    hooks = first["hooks"]
    assert hooks[0] == hooks[4] == hooks[-1] and hooks[1] == hooks[3] > hooks[0]
    # Numerics do not depend on the layout (2 shards: a + b == b + a, bit-identical).
    for rank in range(world):
        for name, value in fixed[rank]["params"].items():
            assert torch.equal(tuned[rank]["params"][name], value), name
    lines = [json.loads(x) for x in open(tmp_path / "trials.jsonl")]
    simulated = [x for x in lines if x["phase"] == "simulated"]
    confirmed = [x for x in lines if x["phase"] == "confirmed"]
    assert len(simulated) == 8 and len(confirmed) == 3 and len(lines) == 11
    assert all(x["predicted_s"] > 0 and "iteration_time_s" not in x for x in simulated)
    assert all(x["predicted_s"] > 0 and x["iteration_time_s"] > 0 for x in confirmed)
    assert [x["trial"] for x in lines] == list(range(1, 12))
    best = min(confirmed, key=lambda x: x["iteration_time_s"])
    saved = fusion_config.load(str(tmp_path / "fusion.json"), first["fingerprint"])
    assert saved == first["current"]
    assert round(saved.rs_threshold / MB, 3) == best["rs_threshold_mb"]
    with open(tmp_path / "fusion.json") as f:
        info = json.load(f)
    assert info["simulated_trials"] == 8 and info["trials"] == 3
    assert info["iteration_time_s"] == pytest.approx(best["iteration_time_s"], abs=1e-6)


def test_offline_run_with_the_planned_schedule_searches_chunk_sizes(tmp_path) -> None:
    """With the planned schedule the simulated candidates carry their own chunk size (the
    planned replay), every rank confirms the same ones, and training stays exact."""
    from tests.workloads import max_diff, reference
    steps = 36                                 # settle is 2 x plan_after + 1 = 5 per trial
    ranks = run_distributed(_train, 2, "offline", str(tmp_path), 2, steps,
                            {"DEAR_SCHEDULE": "planned", "DEAR_PLAN_AFTER": "2"}, timeout=180)
    first = ranks[0]
    assert ranks[1]["layouts"] == first["layouts"] and ranks[1]["plan"] == first["plan"]
    assert first["finished"] and first["current"] == ranks[1]["current"]
    plan = first["plan"]
    assert plan[0][0].chunk_bytes is None and len(plan) == 3
    assert all(c.chunk_bytes is not None for c, _ in plan[1:])
    lines = [json.loads(x) for x in open(tmp_path / "trials.jsonl")]
    simulated = [x for x in lines if x["phase"] == "simulated"]
    assert len({x["chunk_mb"] for x in simulated}) > 2
    ref = reference("adam", 2, steps)
    scale = max(v.abs().max().item() for v in ref.values())
    for res in ranks:
        assert max_diff(res["params"], ref) <= 1e-6 * scale


def test_shutdown_inside_the_traced_window_detaches_the_tracer(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("DEAR_AUTOTUNE_WINDOW", "5")
    monkeypatch.setenv("DEAR_AUTOTUNE_SETTLE", "1")
    monkeypatch.setenv("DEAR_AUTOTUNE_LOG", str(tmp_path / "trials.jsonl"))
    monkeypatch.setenv("DEAR_AUTOTUNE_OUT", str(tmp_path / "fusion.json"))
    dear.init(backend="local")
    model = make_net()
    opt = dear.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                                    autotune="offline")
    hooks = []
    for step in range(3):                      # step 0 settles, the tracer starts in step 1
        opt.zero_grad()
        x, y = batch(step, 1, 0)
        F.mse_loss(model(x), y).backward()
        opt.step()
        hooks.append(_hooks(model, opt))
    assert hooks[2] > hooks[0], "the tracer should be attached inside its window"
    dear.shutdown()
    assert _hooks(model, opt) == hooks[0] and opt.dear_engine.autotuner.finished
    assert not (tmp_path / "fusion.json").exists()


# ------------------------------------------------------------------------------ settings
def test_autotune_values() -> None:
    for value, mode in ((True, Autotune.ONLINE), ("1", Autotune.ONLINE),
                        ("online", Autotune.ONLINE), ("Offline", Autotune.OFFLINE),
                        (False, Autotune.OFF), ("0", Autotune.OFF), ("false", Autotune.OFF),
                        (None, Autotune.OFF)):
        assert parse_autotune(value) is mode
    assert not Autotune.OFF and Autotune.ONLINE and Autotune.OFFLINE
    assert Config.from_env({"DEAR_AUTOTUNE": "offline"}).autotune is Autotune.OFFLINE
    assert Config.from_env({"DEAR_AUTOTUNE": "1"}).autotune is Autotune.ONLINE
    assert Config(autotune=True).autotune is Autotune.ONLINE
    with pytest.raises(ValueError, match="DEAR_AUTOTUNE='sideways'"):
        Config.from_env({"DEAR_AUTOTUNE": "sideways"})
    with pytest.raises(ValueError, match="confirm"):
        Config(autotune_confirm=0)


@pytest.fixture
def local_dear():
    dear.init(backend="local")
    yield
    dear.shutdown()


def test_bad_autotune_arguments(local_dear) -> None:
    model = make_net()
    with pytest.raises(ValueError, match="autotune must be True/False, 'online' or 'offline'"):
        dear.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                                  autotune="sideways")
    with pytest.raises(ValueError, match="needs model="):
        dear.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  model.named_parameters(), autotune="offline")
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        dear.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                                  backward_passes_per_step=2, autotune="offline")
    with pytest.raises(ValueError, match="groups= fixes it"):
        dear.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                                  groups=2, autotune="offline")


def _slow_search(out_dir: str, world: int) -> bool:
    from dear.autotune import offline
    original = offline.OfflineAutotuner._plan

    def slow(self, *args, **kwargs):           # a search longer than DEAR_TIMEOUT (README:
        time.sleep(8)                          # 6-48 s on real models)
        return original(self, *args, **kwargs)
    offline.OfflineAutotuner._plan = slow      # type: ignore[method-assign]
    return bool(_train("offline", out_dir, world, extra={"DEAR_TIMEOUT": "3"})["finished"])


def test_a_search_longer_than_dear_timeout_does_not_kill_a_healthy_job(tmp_path) -> None:
    """Rank 0 searches while the others wait for its plan: they meet it every few seconds, so
    DEAR_TIMEOUT bounds a stalled peer, not the search (an 8 s search under DEAR_TIMEOUT=3)."""
    assert run_distributed(_slow_search, 2, str(tmp_path), 2, timeout=240) == [True, True]
