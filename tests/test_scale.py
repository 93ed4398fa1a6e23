"""dear.diagnose.scale: throughput vs workers against closed forms on hand-built graphs (ring
costs on a flat and a two-level topology, the queueing model's max-plus forms), Pollux's fit
recovering the parameters its data were drawn from, and the `scale` command's files."""

from __future__ import annotations

import json
import math

import pytest

from dear.diagnose.costmodel import CostModel
from dear.diagnose.pollux import Observation, PolluxParams, fit_pollux
from dear.diagnose.queueing import QueueModel, drain
from dear.diagnose.scale import scaling_curve
from dear.diagnose.simulate import Simulator
from dear.diagnose.topology import Topology
from tests.test_diagnose_sim import (F0, F1, G0, G1, MB, UPDATE, _bucket_bytes, _model,
                                     _synthetic_dear_trace)

COMPUTE = F0 + F1 + G0 + G1 + UPDATE           # the hand-built model's compute per iteration
WORKERS = [1, 2, 3, 4, 8, 16, 64, 256]


def _ring_allreduce(n: int, nbytes: float, alpha: float, rate_bps: float) -> float:
    """A ring all-reduce written out: 2(N-1) steps, each one latency and one chunk S/N."""
    return 0.0 if n == 1 else 2 * (n - 1) * (alpha + nbytes / n / (rate_bps / 8))


def _sim(schedule: str = "ddp") -> Simulator:
    return Simulator.from_model(_model(schedule, buckets=[] if schedule != "dear" else None),
                                CostModel.ideal(2e9, 1e-4, world_size=2))


def test_no_overlap_curve_is_compute_plus_ring_cost():
    # One all-reduce after backward overlaps nothing: T(N) = compute + ring cost of 4 MB.
    topo = Topology(bandwidth_bps=2e9, latency_s=1e-4)
    curve = scaling_curve(_sim(), WORKERS, ["allreduce"], topology=topo, batch_size=32)
    want = [COMPUTE + _ring_allreduce(n, 4 * MB, 1e-4, 2e9) for n in WORKERS]
    for model in ("replay", "queueing"):
        assert curve.seconds[model]["allreduce"] == pytest.approx(want, rel=1e-9)
        assert curve.samples_per_s("allreduce", model) == pytest.approx(
            [32 * n / t for n, t in zip(WORKERS, want)], rel=1e-9)
        eff = curve.efficiency("allreduce", model)
        assert eff[0] == pytest.approx(1.0, abs=1e-12)
        assert eff == pytest.approx([COMPUTE / t for t in want], rel=1e-9)
    assert set(curve.cost_s) == {"replay", "queueing"} and all(
        s > 0 for s in curve.cost_s.values())


def test_compute_scale_scales_only_the_compute():
    topo = Topology(bandwidth_bps=2e9, latency_s=1e-4)
    curve = scaling_curve(_sim(), [1, 4], ["allreduce"], topology=topo, compute_scale=0.5)
    want = [0.5 * COMPUTE + _ring_allreduce(n, 4 * MB, 1e-4, 2e9) for n in (1, 4)]
    for model in ("replay", "queueing"):
        assert curve.seconds[model]["allreduce"] == pytest.approx(want, rel=1e-9)
    with pytest.raises(ValueError, match="compute_scale"):
        scaling_curve(_sim(), [1], compute_scale=0)


def test_curves_are_monotone_and_never_above_linear():
    # Every collective costs more with more workers: iteration times never fall, efficiency
    # never rises above 1, and throughput still grows (compute per worker is fixed).
    topo = Topology(bandwidth_bps=1e9, latency_s=5e-5)
    for schedule in ("ddp", "dear"):
        curve = scaling_curve(_sim(schedule), WORKERS, [schedule, "planned", "wfbp", "horovod"]
                              if schedule == "dear" else [schedule], topology=topo)
        for s in curve.schedules:
            for model in ("replay", "queueing"):
                t = curve.seconds[model][s]
                assert all(a <= b * (1 + 1e-12) for a, b in zip(t, t[1:])), (s, model, t)
                assert all(e <= 1 + 1e-12 for e in curve.efficiency(s, model))
                x = curve.samples_per_s(s, model)
                assert all(a < b for a, b in zip(x, x[1:]))


def test_flat_ring_runs_at_its_slowest_hop():
    # 4 GPUs a node on 100 Gbit/s (2 us); nodes on 1 Gbit/s (50 us). Inside one node the
    # intra link alone; beyond it every ring step waits for the inter-node hop.
    topo = Topology(bandwidth_bps=1e9, latency_s=50e-6, gpus_per_node=4,
                    intra_bandwidth_bps=100e9, intra_latency_s=2e-6)
    curve = scaling_curve(_sim(), WORKERS, ["allreduce"], topology=topo)
    want = [COMPUTE + (_ring_allreduce(n, 4 * MB, 2e-6, 100e9) if n <= 4
                       else _ring_allreduce(n, 4 * MB, 50e-6, 1e9)) for n in WORKERS]
    assert curve.seconds["replay"]["allreduce"] == pytest.approx(want, rel=1e-9)
    assert curve.seconds["queueing"]["allreduce"] == pytest.approx(want, rel=1e-9)


def test_hierarchical_collectives_closed_form_and_never_slower_than_flat():
    kw = dict(bandwidth_bps=1e9, latency_s=50e-6, gpus_per_node=4, intra_bandwidth_bps=100e9,
              intra_latency_s=2e-6)
    hier = scaling_curve(_sim(), [8, 16, 64], ["allreduce", "ddp"],
                         topology=Topology(hierarchical=True, **kw))
    flat = scaling_curve(_sim(), [8, 16, 64], ["allreduce", "ddp"], topology=Topology(**kw))
    s = 4 * MB
    for i, n in enumerate([8, 16, 64]):
        m = n // 4                  # intra reduce-scatter + all-gather, nodes' all-reduce
        ar = (2 * 3 * 2e-6 + 2 * 3 / 4 * s / (100e9 / 8)
              + 2 * (m - 1) * 50e-6 + 2 * (m - 1) / m * s / (1e9 / 8))
        assert hier.seconds["replay"]["allreduce"][i] == pytest.approx(COMPUTE + ar, rel=1e-9)
        for schedule in ("allreduce", "ddp"):
            assert hier.seconds["replay"][schedule][i] <= flat.seconds["replay"][schedule][i]


def test_queueing_model_matches_hand_closed_forms():
    # DeAR, 2 buckets of one 2 MB parameter: only the last reduce-scatter and the first
    # all-gather are exposed (see test_diagnose_sim's replay of the same graph).
    cost = CostModel.ideal(2e9, 0.0, world_size=2)
    one = cost.time("reduce_scatter", _bucket_bytes(1))
    queue = QueueModel(_model())
    assert queue.iteration_time("dear", cost) == pytest.approx(COMPUTE + 2 * one, rel=1e-9)
    # DDP with a bucket per gradient on 4 workers: p1's all-reduce hides behind G0.
    cost4 = CostModel.ideal(2e9, 1e-4, world_size=4)
    ar = _ring_allreduce(4, 2 * MB, 1e-4, 2e9)
    assert ar < G0
    ddp = QueueModel(_model("ddp", buckets=[]))
    assert ddp.iteration_time("ddp", cost4, fusion_threshold=1) == pytest.approx(
        COMPUTE + ar, rel=1e-9)
    # A link so slow that both all-reduces queue: p1's starts at G1 and p0's follows it.
    slow = CostModel.ideal(1e8, 0.0, world_size=4)
    ar_slow = _ring_allreduce(4, 2 * MB, 0.0, 1e8)
    assert ar_slow > G0
    assert ddp.iteration_time("ddp", slow, fusion_threshold=1) == pytest.approx(
        F0 + F1 + G1 + 2 * ar_slow + UPDATE, rel=1e-9)


def test_queueing_planned_fills_backwards_gap_closed_form():
    # A 1 ms forward per layer: DeAR's order leaves both all-gathers (2 x `one`) exposed at
    # the next forward; the plan moves all but the first group's into backward's 40 ms gap
    # (bucket 1 reduced at 30 ms, bucket 0 ready at 70 ms). On a link with no gap, the plan
    # is DeAR's order.
    import dataclasses as dc

    from dear.diagnose.graph import Segment
    model = _model()
    fast = [dc.replace(p, forward=[Segment(0.0), Segment(0.001, (0,)), Segment(0.001, (1,))],
                       update=0.001) for p in model.profiles]
    queue = QueueModel(dc.replace(model, profiles=fast))
    cost = CostModel.ideal(2e9, 0.0, world_size=2)
    one = cost.time("all_gather", _bucket_bytes(1))
    backward = G1 + G0
    assert queue.iteration_time("dear", cost) == pytest.approx(
        0.0005 + 2 * one + 0.001 + backward + one, rel=1e-9)
    assert queue.iteration_time("planned", cost) == pytest.approx(
        one + 0.003 + backward + one, rel=1e-9)
    slow = CostModel.ideal(1e8, 0.0, world_size=2)
    assert queue.iteration_time("planned", slow) == pytest.approx(
        queue.iteration_time("dear", slow), rel=1e-12)


def test_drain_is_the_fifo_queue():
    # Jobs at 0, 1 and 5 needing 2, 2, 1: 0-2, 2-4, 5-6. A job issued before its predecessor
    # waits for it to be issued (issue order is service order).
    assert drain([0, 1, 5], [2, 2, 1]) == 6
    assert drain([3, 1], [1, 1]) == 5
    assert drain([], []) == 0


def _pollux_obs(truth: PolluxParams, workers: list[int]) -> list[Observation]:
    return [Observation(nodes=n, workers=n, step_s=truth.step_s(n, n),
                        compute_s=truth.compute_s()) for n in workers]


def test_pollux_fit_recovers_known_parameters():
    # One GPU a node (every worker its own link), one batch size: alpha_c is pinned at half
    # the compute and the intra-node pair at the floor, as Pollux does; the rest is free.
    truth = PolluxParams(0.25, 0.25, 0.3, 0.05, 1e-8, 1e-8, 2.0)
    fit = fit_pollux(_pollux_obs(truth, [1, 2, 3, 4, 8]), regularize=False)
    assert fit.alpha_c == pytest.approx(0.25) and fit.alpha_r == fit.beta_r == 1e-8
    assert fit.compute_s() == pytest.approx(0.5, rel=1e-4)
    assert fit.alpha_n == pytest.approx(0.3, rel=1e-2)
    assert fit.beta_n == pytest.approx(0.05, rel=1e-2)
    assert fit.gamma == pytest.approx(2.0, rel=1e-2)
    for n in (16, 64):             # and so its extrapolation
        assert fit.step_s(n, n) == pytest.approx(truth.step_s(n, n), rel=1e-2)


def test_pollux_from_two_points_predicts_a_flat_step_time():
    # Only 1 and 2 workers seen: beta_n is pinned at the floor, so every N > 2 steps as 2 do.
    obs = [Observation(1, 1, 0.5, 0.5), Observation(2, 2, 0.8, 0.5)]
    fit = fit_pollux(obs)
    assert fit.beta_n == 1e-8
    assert fit.step_s(2, 2) == pytest.approx(0.8, rel=1e-3)
    assert fit.step_s(64, 64) == pytest.approx(fit.step_s(2, 2), rel=1e-6)
    with pytest.raises(ValueError, match="nodes <= workers"):
        fit_pollux([Observation(3, 2, 0.8, 0.5)])


def test_curve_at_the_traced_size_is_the_simulators_prediction(tmp_path):
    path = _synthetic_dear_trace(tmp_path)
    sim = Simulator(path)
    curve = scaling_curve(path, [1, 2, 8], ["dear", "ddp"])
    for schedule in ("dear", "ddp"):
        assert curve.seconds["replay"][schedule][1] == pytest.approx(
            sim.predict(schedule).iteration_time, rel=1e-12)


def test_scale_cli_writes_table_json_and_png(tmp_path, capsys):
    from dear.diagnose.__main__ import main
    (tmp_path / "t").mkdir()
    path = _synthetic_dear_trace(tmp_path / "t")
    out = tmp_path / "out" / "curve"
    assert main(["scale", path, "--bandwidth", "1gbit", "--workers", "1-16,24",
                 "--schedule", "planned,ddp", "--batch", "32", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.count("| planned |") == 6 and text.count("| ddp |") == 6     # 1,2,4,8,16,24
    data = json.loads((tmp_path / "out" / "curve.json").read_text())
    assert data["workers"] == [1, 2, 4, 8, 16, 24] and data["batch_size"] == 32
    row = next(r for r in data["rows"] if r["schedule"] == "ddp" and r["workers"] == 8)
    assert row["replay_samples_per_s"] == pytest.approx(8 * 32 / row["replay_iteration_s"])
    assert math.isfinite(row["queueing_efficiency"])
    assert (tmp_path / "out" / "curve.md").read_text().startswith("# Throughput vs workers")
    assert (tmp_path / "out" / "curve.png").read_bytes()[:4] == b"\x89PNG"


def test_bad_input_is_refused_clearly(tmp_path, capsys):
    from dear.diagnose.__main__ import main
    sim = _sim()
    with pytest.raises(ValueError, match="integers >= 1"):
        scaling_curve(sim, [0, 2])
    with pytest.raises(ValueError, match="repeat"):
        scaling_curve(sim, [2, 2])
    with pytest.raises(ValueError, match="batch_size"):
        scaling_curve(sim, [2], batch_size=0)
    with pytest.raises(ValueError, match="nope"):
        scaling_curve(sim, [2], ["nope"])
    with pytest.raises(ValueError, match="intra_bandwidth_bps"):
        Topology(gpus_per_node=8)
    with pytest.raises(ValueError, match="bandwidth_bps must be > 0"):
        Topology(bandwidth_bps=0)
    with pytest.raises(ValueError, match="the link"):      # no collective traced, no link
        Topology().cost(None, 4)
    path = _synthetic_dear_trace(tmp_path)
    assert main(["scale", path, "--gpus-per-node", "8"]) == 2
    assert "--intra-bandwidth" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--workers"):
        main(["scale", path, "--workers", "8-2"])
    with pytest.raises(SystemExit, match="--workers"):
        main(["scale", path, "--workers", "four"])
