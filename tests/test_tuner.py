"""Fusion autotuner: the search on a synthetic noisy objective, layout switches mid-training
(same parameters as a fixed layout, same layout on every rank), and the saved config."""

from __future__ import annotations

import json
import math
import random
import statistics

import pytest
import torch
import torch.nn.functional as F

import dear
from dear.fusion import fusion_config
from dear.fusion.fusion_config import FusionConfig
from dear.autotune.online import FusionTuner
from tests.distributed import run_distributed
from tests.workloads import OPTIMIZERS, batch, make_net, train_autotuned

MB = 1 << 20


# ------------------------------------------------------------------------------- the search
def _objective(config: FusionConfig, rng: random.Random, chunks: bool = False
               ) -> tuple[float, float]:
    """A pipeline model of iteration time for a 100 MB model (independent of the tuner): 5 ms
    per collective, a 100 MB/s link; the first bucket's reduce-scatter and all-gather stay
    exposed, larger buckets start later. Returns (with 2% Gaussian noise, without).
    `chunks`: plus the planned schedule's chunks: half the model gathered in backward's gaps,
    6.4 ms per chunk, and a chunk that does not fit a gap stays exposed for twice its transfer
    (optimum near 4 MB; the 1 MB default costs 0.17 s more)."""
    model = 100 * MB
    rs = min(config.rs_threshold, model)
    ag = max(min(config.ag_threshold, model), rs)
    first = min(config.first_bucket or rs, rs)
    n_rs = math.ceil((model - first) / rs) + 1
    n_ag = math.ceil((model - first) / ag) + 1
    bandwidth = 100 * MB
    true = 0.5 + 0.005 * (n_rs + n_ag) + (first + 0.5 * rs + 0.3 * ag) / bandwidth
    if chunks:
        chunk = config.chunk_bytes or MB
        true += 0.0064 * math.ceil(model / 2 / chunk) + 2 * chunk / bandwidth
    return true * (1 + rng.gauss(0, 0.02)), true


def _random_search(seed: int, budget: int) -> float:
    """The baseline a tuner must beat: the initial layout, then budget - 1 layouts drawn
    log-uniformly from the tuner's range (1-128 MB); the best true time found."""
    draw = random.Random(1000 + seed)
    found = [_objective(FusionConfig.single(25 * MB), random.Random(seed))[1]]
    for _ in range(budget - 1):
        config = FusionConfig(*(int(2 ** draw.uniform(20, 27)) for _ in range(3)))
        found.append(_objective(config, random.Random(seed))[1])
    return min(found)


def test_tuner_finds_the_minimum_of_a_noisy_objective_within_budget() -> None:
    """What the tuner is for: with the same 12 trials, its median search finds a better layout
    than random search's median (seeded, so the same every run: measured 1.002 against 1.069 of
    the grid's optimum), and near the optimum (within 5%); every seed counts."""
    grid = [2.0 ** k * MB for k in range(0, 8)]     # ground truth: grid search, no noise
    optimum = min(_objective(FusionConfig(int(a), int(b), int(c)), random.Random(0))[1]
                  for a in grid for b in grid for c in grid)
    ratios, baseline = [], []
    for seed in range(10):                     # every seed counts: no picking the lucky ones
        rng = random.Random(seed)
        tuner = FusionTuner(100 * MB, budget=12, initial=FusionConfig.single(25 * MB),
                            seed=seed)
        truths = {}
        while (config := tuner.suggest()) is not None:
            noisy, truths[config] = _objective(config, rng)
            tuner.observe(config, noisy)
        assert len(tuner.trials) <= 12
        ratios.append(min(truths.values()) / optimum)
        baseline.append(_random_search(seed, 12) / optimum)
    median = statistics.median
    assert median(ratios) < median(baseline), (sorted(ratios), sorted(baseline))
    assert median(ratios) <= 1.05, sorted(ratios)


def test_tuner_searches_the_chunk_size_too() -> None:
    """A fourth dimension for the planned schedule: every search moves the chunk size towards
    its optimum. Four dimensions in the default 12 trials find less than three: measured,
    median within 8%, worst within 27% (16 trials: median 4%)."""
    sizes = [2.0 ** k * MB for k in range(0, 8)]
    chunks = [2.0 ** (k / 2) * MB for k in range(-4, 9)]
    optimum = min(_objective(FusionConfig(int(a), int(b), int(c), int(d)), random.Random(0),
                             chunks=True)[1]
                  for a in sizes for b in sizes for c in sizes for d in chunks)
    ratios = []
    for seed in range(10):
        rng = random.Random(seed)
        tuner = FusionTuner(100 * MB, budget=12, initial=FusionConfig.single(25 * MB),
                            seed=seed, chunk_bytes=MB)
        assert tuner.dimensions[-1] == "chunk_bytes"
        truths = {}
        while (config := tuner.suggest()) is not None:
            noisy, truths[config] = _objective(config, rng, chunks=True)
            tuner.observe(config, noisy)
        best = min(truths, key=truths.get)
        assert best.chunk_bytes is not None and 2 * MB <= best.chunk_bytes <= 16 * MB, best
        ratios.append(truths[best] / optimum)
    ratios.sort()
    assert ratios[len(ratios) // 2] <= 1.10, ratios
    assert ratios[-1] <= 1.30, ratios


def test_chunk_size_is_searched_only_where_a_plan_runs() -> None:
    """256 KB-16 MB log-uniform, capped at the model's size; none without chunk_bytes (DeAR's
    order: the chunk size does nothing there, no trial is spent on it)."""
    from dear.autotune.online import CHUNK_MAX_BYTES, CHUNK_MIN_BYTES
    for model_bytes, top in ((512 * MB, CHUNK_MAX_BYTES), (3 * MB, 3 * MB)):
        tuner = FusionTuner(model_bytes, budget=8, chunk_bytes=MB, initial=FusionConfig(MB, MB))
        seen = []
        while (config := tuner.suggest()) is not None:
            seen.append(config.chunk_bytes)
            tuner.observe(config, 1.0 + (config.chunk_bytes or MB) / MB)
        assert seen[0] is None                 # the initial config: Config's chunk size
        assert all(CHUNK_MIN_BYTES * 0.99 <= c <= top * 1.01 for c in seen[1:]), seen
        assert len(set(seen[1:])) > 1
    plain = FusionTuner(64 * MB, budget=4)
    assert plain.dimensions == ["rs_threshold", "ag_threshold", "first_bucket"]
    while (config := plain.suggest()) is not None:
        assert config.chunk_bytes is None
        plain.observe(config, 1.0)


def test_tuner_stops_when_it_stops_improving() -> None:
    tuner = FusionTuner(256 * MB, budget=50, patience=3, n_initial_points=2)
    while (config := tuner.suggest()) is not None:
        tuner.observe(config, 1.0)             # flat: nothing ever improves
    assert len(tuner.trials) == 1 + 2 + 3      # first + random points + patience guided ones


def test_search_space_is_capped_at_the_model_size() -> None:
    tuner = FusionTuner(3 * MB, budget=6)
    while (config := tuner.suggest()) is not None:
        assert MB * 0.99 <= config.rs_threshold <= 3 * MB * 1.01
        tuner.observe(config, 1.0 + config.rs_threshold / MB)


# -------------------------------------------------------------------------------- the file
def test_config_file_round_trip_and_rejections(tmp_path) -> None:
    model = make_net()
    named = list(model.named_parameters())
    fp = fusion_config.model_fingerprint(named)
    path = str(tmp_path / "fusion.json")
    config = FusionConfig(rs_threshold=3 * MB, ag_threshold=40 * MB, first_bucket=MB)
    fusion_config.save(path, config, fp, iteration_time_s=0.5)
    assert fusion_config.load(path, fp) == config
    other = list(torch.nn.Linear(3, 3).named_parameters())
    with pytest.raises(ValueError, match="tuned for another model"):
        fusion_config.load(path, fusion_config.model_fingerprint(other))
    chunked = FusionConfig(rs_threshold=3 * MB, ag_threshold=40 * MB, chunk_bytes=300_000)
    fusion_config.save(path, chunked, fp)
    assert fusion_config.load(path, fp) == chunked
    with open(path) as f:
        assert json.load(f)["config"]["chunk_bytes"] == 300_000
    with open(path, "w") as f:                 # a file from before chunk_bytes: Config's
        json.dump({"format": fusion_config.FORMAT, "model_fingerprint": fp,
                   "config": {"rs_threshold": 5, "ag_threshold": 7, "first_bucket": None}}, f)
    assert fusion_config.load(path, fp) == FusionConfig(5, 7, None, None)
    with pytest.raises(ValueError, match="chunk_bytes"):
        FusionConfig(MB, MB, chunk_bytes=0)
    with open(path, "w") as f:
        f.write("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        fusion_config.load(path, fp)
    with open(path, "w") as f:
        json.dump({"format": fusion_config.FORMAT, "model_fingerprint": fp,
                   "config": {"rs_threshold": -5, "ag_threshold": 1}}, f)
    with pytest.raises(ValueError, match="malformed"):
        fusion_config.load(path, fp)
    with open(path, "w") as f:
        json.dump({"hello": 1}, f)
    with pytest.raises(ValueError, match="not a dear fusion config"):
        fusion_config.load(path, fp)


@pytest.mark.parametrize("entry", [{"rs_threshold": float("inf")}, {"chunk_bytes": 1}],
                         ids=["Infinity", "chunk_bytes-1"])
def test_config_file_values_that_cannot_work_are_refused_with_the_file(tmp_path, entry) -> None:
    """Infinity (json writes and reads it) would overflow int() without the file's name; a 1-byte
    chunk is what DEAR_CHUNK_BYTES refuses (under 1KB: thousands of collectives a bucket)."""
    fp = fusion_config.model_fingerprint(list(make_net().named_parameters()))
    path = str(tmp_path / "fusion.json")
    with open(path, "w") as f:
        json.dump({"format": fusion_config.FORMAT, "model_fingerprint": fp,
                   "config": {"rs_threshold": MB, "ag_threshold": MB, **entry}}, f)
    with pytest.raises(ValueError, match=f"fusion config {path}"):
        fusion_config.load(path, fp)


# ------------------------------------------------------------------- switches mid-training
STEPS = 14


def _train(autotune: bool, out_dir: str, world: int) -> dict:
    model, _, layouts = train_autotuned(
        autotune, out_dir, world, STEPS,
        dict(DEAR_AUTOTUNE_WINDOW="1", DEAR_AUTOTUNE_SETTLE="0", DEAR_AUTOTUNE_TRIALS="6"),
        lambda model, opt: opt.dear_engine.layout.signature())
    params = {k: v.clone() for k, v in model.state_dict().items()}
    dear.shutdown()
    return {"params": params, "layouts": layouts}


@pytest.mark.parametrize("world", [2, 3])
def test_layout_switches_keep_parameters_and_agree_across_ranks(world: int, tmp_path) -> None:
    tuned = run_distributed(_train, world, True, str(tmp_path), world, timeout=120)
    fixed = run_distributed(_train, world, False, str(tmp_path / "fixed"), world, timeout=120)
    distinct = {json.dumps(lay) for lay in tuned[0]["layouts"]}
    assert len(distinct) >= 3, "the tuner never switched layouts"
    for rank in range(1, world):               # every rank held the same layout every step
        assert tuned[rank]["layouts"] == tuned[0]["layouts"]
    for rank in range(world):
        for name, value in fixed[rank]["params"].items():
            got = tuned[rank]["params"][name]
            if world == 2:                     # a + b == b + a: bit-identical
                assert torch.equal(got, value), name
            else:                              # 3 shards: the sum order follows the layout
                torch.testing.assert_close(got, value, rtol=0, atol=1e-6)
    lines = [json.loads(x) for x in open(tmp_path / "trials.jsonl")]
    assert 1 <= len(lines) <= 6 and {"rs_threshold_mb", "iteration_time_s",
                                     "samples_per_s"} <= set(lines[0])
    assert lines[0]["samples_per_s"] > 0


def _reload(path: str) -> dict:
    dear.init()
    model = make_net()
    opt = dear.DistributedOptimizer(OPTIMIZERS["sgd"](model.parameters()), model=model,
                                    fusion_config=path, autotune=True)
    x, y = batch(0, dear.size(), dear.rank())
    F.mse_loss(model(x), y).backward()
    opt.step()
    out = {"fusion": opt.dear_engine.fusion, "tuning": opt.dear_engine.autotuner is not None}
    dear.shutdown()
    return out


def test_saved_config_is_reloaded_and_skips_tuning(tmp_path) -> None:
    path = str(tmp_path / "fusion.json")
    config = FusionConfig(rs_threshold=900, ag_threshold=5000, first_bucket=300)
    fusion_config.save(path, config, fusion_config.model_fingerprint(
        list(make_net().named_parameters())))
    for res in run_distributed(_reload, 2, path, timeout=60):
        assert res == {"fusion": config, "tuning": False}


# ---------------------------------------------- the planned schedule's chunk size, re-planned
PLANNED_STEPS = 42


def _train_planned(out_dir: str) -> dict:
    """Adam on make_net() with the online autotuner and the planned schedule: trials switch
    the chunk size (16 B-4 KB here: this model's shards are 100-500 bytes), each new config is
    measured and planned again. Every layer's backward sleeps, so rank 0's backward has link
    gaps to fill; every collective each rank issues is recorded, in order."""
    import os

    import dear.autotune.online as tuner_module
    from tests.test_schedule import _slow_in_backward, record_collectives
    from tests.workloads import state_of
    tuner_module.MIN_BYTES = 256
    tuner_module.CHUNK_MIN_BYTES, tuner_module.CHUNK_MAX_BYTES = 16, 4096
    os.environ.update(DEAR_SCHEDULE="planned", DEAR_PLAN_AFTER="2", DEAR_AUTOTUNE_WINDOW="1",
                      DEAR_AUTOTUNE_SETTLE="0", DEAR_AUTOTUNE_TRIALS="5",
                      DEAR_AUTOTUNE_LOG=os.path.join(out_dir, "trials.jsonl"),
                      DEAR_AUTOTUNE_OUT=os.path.join(out_dir, "fusion.json"))
    dear.init()
    rank, world = dear.rank(), dear.size()
    recorder = record_collectives()
    model = make_net()
    for module in (model.fc1, model.fc2, model.branch, model.head):
        _slow_in_backward(module, 0.004)
    opt = dear.DistributedOptimizer(OPTIMIZERS["adam"](model.parameters()), model=model,
                                    fusion_threshold=1024, autotune=True)
    seen = []
    for step in range(PLANNED_STEPS):
        opt.zero_grad()
        x, y = batch(step, world, rank)
        F.mse_loss(model(x), y).backward()
        opt.step()
        plan = opt.dear_engine.schedule.plan
        seen.append((opt.dear_engine.fusion, opt.dear_engine.schedule._chunk_bytes,
                     None if plan is None else plan.num_chunks))
    opt.flush_updates()
    out = {"params": state_of(model), "seen": seen, "log": list(recorder.log),
           "current": opt.autotuner.current, "finished": opt.autotuner.finished,
           "default": opt.dear_engine.schedule.default_chunk_bytes}
    dear.shutdown()
    return out


def test_chunk_size_switches_replan_and_keep_training_exact(tmp_path) -> None:
    from tests.workloads import max_diff, reference
    ranks = run_distributed(_train_planned, 2, str(tmp_path), timeout=180)
    first = ranks[0]
    for res in ranks[1:]:                      # same config, plan and collectives everywhere
        assert res["seen"] == first["seen"]
        assert res["log"] == first["log"], "the ranks issued different collective orders"
        assert res["current"] == first["current"]
    for fusion, chunk, _ in first["seen"]:     # the driver plans with the config's chunk size
        assert chunk == (fusion.chunk_bytes or first["default"])
    planned = {chunk for _, chunk, chunks in first["seen"] if chunks}
    assert len(planned) >= 2, f"no two chunk sizes were planned with chunks: {first['seen']}"
    assert first["finished"] and first["seen"][-1][0] == first["current"]
    ref = reference("adam", 2, PLANNED_STEPS)
    scale = max(v.abs().max().item() for v in ref.values())
    for res in ranks:
        assert max_diff(res["params"], ref) <= 1e-6 * scale
    assert max_diff(ranks[0]["params"], ranks[1]["params"]) == 0.0
    lines = [json.loads(x) for x in open(tmp_path / "trials.jsonl")]
    assert "chunk_mb" in lines[0] and len({x["chunk_mb"] for x in lines}) >= 2
