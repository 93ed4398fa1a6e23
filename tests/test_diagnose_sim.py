"""dear.diagnose replay: the engine, each schedule and the cost model on hand-built graphs whose
iteration time has a closed form; graph extraction from a synthetic trace; the CLI."""

from __future__ import annotations

import dataclasses
import json

import pytest

from dear.diagnose.chrome import FORMAT_VERSION, load_trace
from dear.diagnose.costmodel import CostModel
from dear.diagnose.engine import replay, replay_contended, stretched
from dear.diagnose.graph import Model, Profile, Segment, build_model, collective_samples
from dear.diagnose.simulate import Schedule, Simulator, fit_contention, predict_iteration_time
from dear.fusion.fusion_config import FusionConfig

MB = 2**20


def test_engine_closed_form():
    # Rank 0 issues A at 1, rank 1 at 3: A runs 3-4.5. B, issued by both at 4.5, queues behind
    # nothing and runs 4.5-5.5; C, issued at once after B, waits for the link: 5.5-6.5.
    progs = [[("compute", 1, "f"), ("issue", "A"), ("compute", 2, "f"), ("wait", "A"),
              ("issue", "B"), ("issue", "C"), ("wait", "C"), ("mark", "end")],
             [("compute", 3, "f"), ("issue", "A"), ("wait", "A"), ("issue", "B"),
              ("issue", "C"), ("mark", "end")]]
    cost = {"A": 1.5, "B": 1.0, "C": 1.0}
    out = replay(progs, cost.__getitem__)
    assert out.comm == {"A": (3, 4.5), "B": (4.5, 5.5), "C": (5.5, 6.5)}
    assert out.mark_times("end") == [[6.5], [4.5]]
    assert out.waits[0] == [(3, 4.5, "A"), (4.5, 6.5, "C")]


def test_post_work_follows_the_transfer_on_one_thread_closed_form():
    """`post` (a quantized bucket's decoding): a wait returns after the transfer plus its
    post work, which runs on one thread in link order; the link is free meanwhile."""
    progs = [[("issue", "A"), ("issue", "B"), ("wait", "A"), ("wait", "B"), ("mark", "end")]]
    out = replay(progs, {"A": 1.0, "B": 1.0}.__getitem__, post={"A": 2.0, "B": 0.5}.__getitem__)
    assert out.comm == {"A": (0, 1.0), "B": (1.0, 2.0)}      # B's transfer overlaps A's post
    assert out.done == {"A": 3.0, "B": 3.5}                  # B's post queues behind A's
    assert out.waits[0] == [(0, 3.0, "A"), (3.0, 3.5, "B")]
    plain = replay(progs, {"A": 1.0, "B": 1.0}.__getitem__, post=lambda k: 0.0)
    assert plain.done == {} and plain.mark_times("end") == [[2.0]]
    with pytest.raises(ValueError, match="slots=1"):
        replay(progs, lambda k: 1.0, slots=2, post=lambda k: 1.0)
    with pytest.raises(ValueError, match="negative post"):
        replay(progs, lambda k: 1.0, post=lambda k: -1.0)


def test_engine_rejects_inconsistent_programs():
    with pytest.raises(ValueError, match="another order"):
        replay([[("issue", "A"), ("issue", "B")], [("issue", "B"), ("issue", "A")]],
               lambda k: 1.0)
    with pytest.raises(ValueError, match="never issued"):
        replay([[("wait", "A")]], lambda k: 1.0)
    with pytest.raises(ValueError, match="negative"):
        replay([[("compute", -1, "x")]], lambda k: 1.0)


# Two parameters of 2 MB: forward uses p0 then p1, backward produces p1 then p0.
F0, F1, G1, G0, UPDATE = 0.010, 0.020, 0.030, 0.040, 0.008
NUMEL = 2 * MB // 4


def _model(schedule: str = "dear", buckets: list[list[int]] | None = None) -> Model:
    prof = Profile(rank=0, lead=0.0,
                   forward=[Segment(0.0), Segment(F0, (0,)), Segment(F1, (1,))], loss=0.0,
                   backward=[Segment(G1, produces=1), Segment(G0, produces=0)],
                   backward_tail=0.0, update=UPDATE, step_extra=0.0, tail=0.0)
    return Model(param_bytes=[2 * MB, 2 * MB], param_numel=[NUMEL, NUMEL], forward_order=[0, 1],
                 backward_order=[1, 0], schedule=schedule,
                 buckets=buckets if buckets is not None else [[0], [1]],
                 fusion_threshold=None, world_size=2, profiles=[prof, prof])


def _bucket_bytes(params: int, world: int = 2) -> int:
    numel = params * NUMEL + params                    # + one usage flag per parameter
    return -(-numel // world) * world * 4


def test_dear_two_buckets_closed_form():
    # 2 Gbit/s: a 2 MB bucket's reduce-scatter or all-gather (half of it sent) takes ~4.2 ms,
    # less than G0 and F0 + its update, so only the last reduce-scatter (after backward) and
    # the first all-gather (at the next forward) are exposed.
    cost = CostModel.ideal(2e9, 0.0, world_size=2)
    one = cost.time("reduce_scatter", _bucket_bytes(1))
    assert one < G0 and one < F0 + UPDATE / 2
    p = Simulator.from_model(_model(), cost).predict(Schedule.DEAR)
    compute = F0 + F1 + G1 + G0 + UPDATE
    assert p.buckets == 2
    assert p.iteration_time == pytest.approx(compute + 2 * one, rel=1e-9)
    assert p.compute == pytest.approx(compute, rel=1e-9)
    assert p.exposed == pytest.approx(2 * one, rel=1e-9)
    assert p.comm == pytest.approx(4 * one, rel=1e-9)
    assert p.overlap == pytest.approx(0.5, rel=1e-9)


def test_sharded_closed_form():
    """shard_optimizer_state under the plan: p1's bucket, reduced during G0, is updated early
    (on the collective thread, beside backward) and gathered in G0's idle link time; p0's
    half (a quarter of UPDATE) is updated in step(), before its all-gather, on the critical
    path; the forward only waits for the gathered parameters."""
    cost = CostModel.ideal(2e9, 0.0, world_size=2)
    one = cost.time("reduce_scatter", _bucket_bytes(1))
    assert G1 + 2 * one < G1 + G0                      # p1's rs and ag both fit inside G0
    p = Simulator.from_model(_model(), cost).predict(Schedule.SHARDED)
    compute = F0 + F1 + G1 + G0 + UPDATE / 4
    assert p.iteration_time == pytest.approx(compute + 2 * one, rel=1e-9)
    assert p.compute == pytest.approx(compute, rel=1e-9)


def test_dear_one_bucket_has_no_overlap():
    cost = CostModel.ideal(2e9, 0.0, world_size=2)
    sim = Simulator.from_model(_model(), cost)
    p = sim.predict(Schedule.DEAR, fusion_threshold=64 * MB)
    both = cost.time("reduce_scatter", _bucket_bytes(2)) + cost.time("all_gather",
                                                                      _bucket_bytes(2))
    assert p.buckets == 1
    assert p.iteration_time == pytest.approx(F0 + F1 + G1 + G0 + UPDATE + both, rel=1e-9)
    assert p.overlap == pytest.approx(0.0, abs=1e-12)


def test_ddp_wfbp_allreduce_closed_forms():
    # With a 1 MB cap every 2 MB gradient is a bucket of its own: p1's all-reduce hides behind
    # G0, p0's is exposed, then the update. One all-reduce after backward hides nothing.
    cost = CostModel.ideal(2e9, 1e-4, world_size=4)
    sim = Simulator.from_model(_model("ddp", buckets=[]), cost)
    ar = cost.time("all_reduce", 2 * MB)
    assert ar == pytest.approx(2 * 3 * 1e-4 + 2 * 3 / 4 * 2 * MB / (2e9 / 8))
    assert ar < G0
    compute = F0 + F1 + G1 + G0 + UPDATE
    ddp = sim.predict(Schedule.DDP, fusion_threshold=1, world_size=4)
    wfbp = sim.predict(Schedule.WFBP, fusion_threshold=1, world_size=4)
    assert ddp.buckets == wfbp.buckets == 2
    assert ddp.iteration_time == pytest.approx(compute + ar, rel=1e-9)
    assert wfbp.iteration_time == pytest.approx(compute + ar, rel=1e-9)
    one = sim.predict(Schedule.ALLREDUCE, world_size=4)
    assert one.buckets == 1
    assert one.iteration_time == pytest.approx(compute + cost.time("all_reduce", 4 * MB),
                                               rel=1e-9)
    # DDP's default: the 1 MB first bucket closes with p1, the 25 MB one holds p0: as above.
    assert sim.predict(Schedule.DDP, world_size=4).iteration_time == pytest.approx(
        compute + ar, rel=1e-9)
    # WFBP with 25 MB buckets: one bucket, all-reduced after backward.
    assert sim.predict(Schedule.WFBP, world_size=4).iteration_time == pytest.approx(
        one.iteration_time)
    # The same graph on 2 ranks: the latency and the volume factor 2(N-1)/N shrink.
    two = sim.predict(Schedule.DDP, fusion_threshold=1)
    assert two.world_size == 2 and two.iteration_time == pytest.approx(
        compute + 2 * 1e-4 + 2 * MB / (2e9 / 8), rel=1e-9)


def test_cost_model_fit_and_what_if():
    # Samples drawn from alpha 50 us, 1 Gbit/s on 2 ranks are fitted back exactly.
    alpha, rate = 50e-6, 1e9 / 8
    samples = [{"kind": "reduce_scatter", "bytes": b, "seconds": alpha + b / 2 / rate}
               for b in (MB, 4 * MB, 16 * MB)]
    samples += [{"kind": "all_gather", "bytes": b, "seconds": alpha + b / 2 / (2 * rate)}
                for b in (MB, 8 * MB)]
    fitted = CostModel.fit(samples, world_size=2)
    assert fitted.alpha["reduce_scatter"] == pytest.approx(alpha)
    assert fitted.rate["reduce_scatter"] == pytest.approx(rate)
    assert fitted.rate["all_gather"] == pytest.approx(2 * rate)
    # No all-reduce traced: the ring identity, all-reduce = reduce-scatter + all-gather.
    assert fitted.time("all_reduce", 8 * MB) == pytest.approx(
        fitted.time("reduce_scatter", 8 * MB) + fitted.time("all_gather", 8 * MB))
    # 10x the traced 1 Gbit/s link keeps each kind's efficiency; 64 ranks: (N-1) steps.
    fast = fitted.what_if(bandwidth_bps=10e9, world_size=64, traced_bandwidth_bps=1e9)
    assert fast.time("reduce_scatter", 64 * MB) == pytest.approx(
        63 * alpha + 63 / 64 * 64 * MB / (10 * rate))
    ideal = fitted.what_if(bandwidth_bps=10e9, latency_s=0.0)
    assert ideal.time("all_gather", 8 * MB) == pytest.approx(4 * MB / (10e9 / 8))
    with pytest.raises(ValueError, match="bandwidth must be > 0"):
        fitted.what_if(bandwidth_bps=0)
    with pytest.raises(ValueError, match="no completed collective"):
        CostModel.fit([], world_size=2)


def _span(cat, start_ms, end_ms, **args):
    return {"ph": "X", "pid": 0, "tid": 1, "cat": cat, "name": cat, "ts": start_ms * 1e3,
            "dur": (end_ms - start_ms) * 1e3, "args": {"iteration": 0, **args}}


def _synthetic_dear_trace(tmp_path) -> str:
    """Two ranks, one iteration 0-100 ms: lead 0-5; forward 5-40 with fc1 (p0) at 10-20,
    bucket 0's update 20-26 holding a wait 21-23, fc2 (p1) at 26-36; loss 40-45; backward with
    p1's gradient at 60 and p0's at 75; step 80-95 holding a wait 82-90; reduce-scatters
    and all-gathers of 1 MB buckets."""
    comm = dict(bytes=MB, end_source="watcher")
    events = [_span("iteration", 0, 100), _span("forward", 5, 40, module=0),
              _span("forward", 10, 20, module=1), _span("update", 20, 26, bucket=0),
              _span("wait", 21, 23, seq=1), _span("forward", 26, 36, module=2),
              _span("backward", 45, 60, module=2), _span("backward", 60, 75, module=1),
              {"ph": "i", "pid": 0, "tid": 1, "cat": "grad", "name": "g", "ts": 60e3,
               "args": {"iteration": 0, "param": 1}},
              {"ph": "i", "pid": 0, "tid": 1, "cat": "grad", "name": "g", "ts": 75e3,
               "args": {"iteration": 0, "param": 0}},
              _span("step", 80, 95), _span("wait", 82, 90, seq=3),
              _span("comm", 60, 70, kind="reduce_scatter", bucket=1, seq=2, **comm),
              _span("comm", 75, 88, kind="reduce_scatter", bucket=0, seq=3, **comm),
              _span("comm", 95, 99, kind="all_gather", bucket=0, seq=4, **comm)]
    meta = {"version": FORMAT_VERSION, "world_size": 2, "schedule": "dear",
            "modules": [{"name": "<root>", "leaf": False, "params": []},
                        {"name": "fc1", "leaf": True, "params": [0]},
                        {"name": "fc2", "leaf": True, "params": [1]}],
            "params": [{"name": "fc1.weight", "numel": NUMEL // 2, "bytes": MB // 2},
                       {"name": "fc2.weight", "numel": NUMEL // 2, "bytes": MB // 2}],
            "buckets": [[0], [1]], "fusion_threshold": MB // 2}
    for rank in (0, 1):
        with open(tmp_path / f"rank{rank}.json", "w") as fh:
            json.dump({"traceEvents": events, "dear": {**meta, "rank": rank}}, fh)
    return str(tmp_path)


def test_graph_from_trace(tmp_path):
    trace = load_trace(_synthetic_dear_trace(tmp_path))
    model = build_model(trace)
    prof = model.profiles[0]
    ms = pytest.approx
    assert prof.lead == ms(0.005)
    # Cut at fc1 (needs p0) and fc2 (needs p1); the update 20-26 is not forward compute.
    assert [s.needs for s in prof.forward] == [(), (0,), (1,)]
    assert [s.duration for s in prof.forward] == [ms(0.005), ms(0.010), ms(0.014)]
    assert prof.loss == ms(0.005)
    assert [(s.produces, s.duration) for s in prof.backward] == [(1, ms(0.015)), (0, ms(0.015))]
    assert prof.update == ms(0.004)                    # 6 ms minus its 2 ms wait
    assert prof.step_extra == ms(0.007)                # 15 ms minus its 8 ms wait
    # 75-80 after the last gradient is blocked on the reduce-scatter (as DDP's wait would be).
    assert prof.backward_tail == ms(0.0) and prof.tail == ms(0.005)
    assert model.forward_order == [0, 1] and model.backward_order == [1, 0]
    samples = collective_samples(trace)
    # FIFO service times: 60-70, then 75-88, then 95-99.
    assert [round(s["seconds"], 6) for s in samples] == [0.010, 0.013, 0.004]


def test_predict_iteration_time_objective(tmp_path):
    path = _synthetic_dear_trace(tmp_path)
    sim = Simulator(path)
    times = [predict_iteration_time(sim, t, bandwidth_bps=1e8) for t in (0, 512 * 1024, 4 * MB)]
    assert all(isinstance(t, float) and t > 0 for t in times)
    slow = predict_iteration_time(path, bandwidth_bps=1e7)
    fast = predict_iteration_time(path, bandwidth_bps=1e10)
    assert slow > fast
    with pytest.raises(ValueError, match="fusion_threshold"):
        predict_iteration_time(sim, -1)


def test_simulate_cli(tmp_path, capsys):
    from dear.diagnose.__main__ import main
    path = _synthetic_dear_trace(tmp_path)
    assert main(["simulate", path, "--bandwidth", "1gbit", "--world-size", "2,16",
                 "--schedule", "dear,ddp"]) == 0
    out = capsys.readouterr().out
    assert out.count("| dear |") == 2 and out.count("| ddp |") == 2
    assert main(["simulate", str(tmp_path / "nowhere")]) == 2
    # DeAR's full layout and the contention model from the command line, as the API gives them.
    assert main(["simulate", path, "--bandwidth", "1gbit", "--schedule", "dear",
                 "--rs-threshold", "2MB", "--contention", "0.5"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines()
               if line.startswith("| dear |"))
    want = Simulator(path, contention=0.5).predict(
        Schedule.DEAR, fusion=FusionConfig(2 * MB, 2 * MB, None), bandwidth_bps=1e9)
    traced = Simulator(path).predict(Schedule.DEAR, bandwidth_bps=1e9)   # one bucket a param
    assert row.split("|")[4].strip() == f"{want.iteration_time * 1e3:.1f}" != \
        f"{traced.iteration_time * 1e3:.1f}"
    # A table sent by rows (dear's default), named as traced.
    assert main(["simulate", path, "--bandwidth", "1gbit", "--schedule", "dear",
                 "--row-sparse", "fc1.weight=64:8"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines()
               if line.startswith("| dear |"))
    want = Simulator(path).predict(Schedule.DEAR, bandwidth_bps=1e9, row_sparse={0: (64, 8)})
    assert row.split("|")[4].strip() == f"{want.iteration_time * 1e3:.1f}"
    with pytest.raises(SystemExit, match="NAME=ROWS:SENT"):
        main(["simulate", path, "--row-sparse", "fc9.weight=64:8"])


def test_concurrent_collectives_share_the_link(tmp_path):
    """Gloo runs some all-reduces at once: 0-10 ms alone, 10-30 ms shared by two, 30-40 ms the
    second alone. Each gets half of the shared time; the kind's total is the busy time, 40 ms,
    so the fitted rate is total bytes over 40 ms."""
    from dear.diagnose.chrome import Trace, parse_rank
    comm = dict(end_source="callback", kind="all_reduce")
    events = [_span("iteration", 0, 50), _span("comm", 0, 30, bytes=MB, seq=1, **comm),
              _span("comm", 10, 40, bytes=3 * MB, seq=2, **comm)]
    doc = {"traceEvents": events, "dear": {"version": FORMAT_VERSION, "rank": 0,
                                           "world_size": 2, "params": []}}
    samples = collective_samples(Trace("t", [parse_rank(doc)]))
    assert [round(s["seconds"], 6) for s in samples] == [0.020, 0.020]
    assert [s["alone"] for s in samples] == [False, False]
    fitted = CostModel.fit(samples, world_size=2)
    assert fitted.alpha["all_reduce"] == 0.0
    assert fitted.rate["all_reduce"] == pytest.approx(4 * MB / 0.040)   # volume = bytes at N=2


def test_dear_smaller_first_all_gather_group_closed_form():
    # A bucket per 2 MB parameter (rs 2 MB). ag 64 MB gathers both buckets as one message: the
    # next forward waits for all of it (2 x one) before fc1 can run. A first bucket of its own
    # (first_bucket, gathered alone) costs the forward one, and bucket 1's all-gather hides
    # behind fc1 and its update. Backward as before: the last reduce-scatter is exposed.
    cost = CostModel.ideal(2e9, 0.0, world_size=2)
    one = cost.time("all_gather", _bucket_bytes(1))
    assert one < F0 + UPDATE / 2 and one < G0
    sim = Simulator.from_model(_model(), cost)
    fused, first = FusionConfig(2 * MB, 64 * MB), FusionConfig(2 * MB, 64 * MB, 2 * MB)
    assert sim.layout(fused).signature() == (((0,), (1,)), ((0, 1),))
    assert sim.layout(first).signature() == (((0,), (1,)), ((0,), (1,)))
    compute = F0 + F1 + G1 + G0 + UPDATE
    p_fused = sim.predict(Schedule.DEAR, fusion=fused)
    p_first = sim.predict(Schedule.DEAR, fusion=first)
    assert p_fused.buckets == p_first.buckets == 2
    assert p_fused.iteration_time == pytest.approx(compute + 3 * one, rel=1e-9)
    assert p_first.iteration_time == pytest.approx(compute + 2 * one, rel=1e-9)
    assert p_fused.comm == pytest.approx(p_first.comm, rel=1e-9)   # same bytes, no latency
    # fusion_threshold= is FusionConfig.single, as dear's own argument.
    assert sim.predict(Schedule.DEAR, fusion_threshold=64 * MB).iteration_time == \
        pytest.approx(sim.predict(Schedule.DEAR, fusion=FusionConfig.single(64 * MB))
                      .iteration_time, rel=1e-12)
    with pytest.raises(ValueError, match="fusion= is DeAR's layout"):
        sim.predict(Schedule.DDP, fusion=fused)
    with pytest.raises(TypeError, match="FusionConfig"):
        sim.predict(Schedule.DEAR, fusion=8 * MB)


def test_simulated_layout_is_the_optimizers():
    """The simulator plans with dear.fusion.layout's own function: same buckets, bytes and
    all-gather groups as the layout the optimizer builds, for every kind of config."""
    from dear.comm.compression import Compression
    from dear.fusion.layout import build_layout
    from tests.workloads import make_net
    params = list(make_net().parameters())
    order = [3, 2, 0, 1] + list(range(4, len(params)))
    model = Model(param_bytes=[p.numel() * 4 for p in params],
                  param_numel=[p.numel() for p in params], forward_order=order,
                  backward_order=order[::-1], schedule="dear", buckets=[],
                  fusion_threshold=None, world_size=2, profiles=[])
    sim = Simulator.from_model(model, CostModel.ideal(1e9, 0.0, world_size=3))
    for config in (FusionConfig.single(1024), FusionConfig(700, 5000, 300),
                   FusionConfig(0, 0), FusionConfig(3000, 3000, 100), FusionConfig(1, 10**6)):
        for world in (2, 3):
            real = build_layout(params, order, config, world, None, Compression.none, False)
            mine = sim.layout(config, world_size=world)
            assert [ps for ps, _ in mine.buckets] == [list(b.spec.params) for b in real.buckets]
            assert [nb for _, nb in mine.buckets] == [b.buffer.numel() * 4 for b in real.buckets]
            assert mine.groups == [[b.spec.index for b in g.buckets]
                                   for g in real.gather_groups]
            assert mine.group_bytes() == [g.nbytes for g in real.gather_groups]


def test_compute_slowed_while_the_link_is_busy_closed_form():
    # 1 s of work from t=0; busy 0.5-1.0 at half speed (k=1): 0.5 + 0.25 by t=1, 0.25 after.
    assert stretched(0.0, 1.0, [(0.5, 1.0)], 1.0) == pytest.approx(1.25)
    assert stretched(0.0, 1.0, [(0.5, 1.0)], 0.0) == 1.0
    assert stretched(2.0, 1.0, [(0.5, 1.0)], 1.0) == pytest.approx(1.0)    # after the busy
    # A collective of 1 s issued at 0, then 1 s of compute: half speed while it runs.
    prog = [[("issue", "c"), ("compute", 1.0, "x"), ("wait", "c"), ("mark", "end")]]
    plain = replay_contended(prog, lambda key: 1.0, 0.0)
    slowed = replay_contended(prog, lambda key: 1.0, 1.0)
    assert plain.compute[0][0][:2] == (0.0, 1.0)
    assert slowed.compute[0][0][:2] == (0.0, pytest.approx(1.5))


def test_contention_takes_the_trace_back_to_quiet_compute(tmp_path):
    trace = load_trace(_synthetic_dear_trace(tmp_path))
    quiet, slowed = build_model(trace).profiles[0], build_model(trace, contention=1.0).profiles[0]
    # Compute that overlapped a collective counts half with k = 1; the rest is unchanged.
    assert slowed.compute < quiet.compute
    assert slowed.lead == quiet.lead                   # no collective in flight before forward
    # The overlapped trace against itself as the "clean" one: nothing to explain, k = 0.
    assert fit_contention(trace, trace) == 0.0
    with pytest.raises(ValueError, match="contention"):
        Simulator(trace, contention=-1)


def test_trace_without_model_says_what_to_pass(tmp_path) -> None:
    """A DEAR_TRACE of an optimizer built Horovod-style (named_parameters, no model=) has no
    forward to replay: the error must say to pass model=, not blame gradient accumulation."""
    import torch

    import dear
    from dear import diagnose
    dear.init(backend="local")
    try:
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
        opt = dear.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters())
        out = str(tmp_path / "trace")
        with diagnose.Tracer(None, opt, out, range(1, 3)):
            for _ in range(4):
                opt.zero_grad()
                model(torch.ones(4, 8)).sum().backward()
                opt.step()
    finally:
        dear.shutdown()
    with pytest.raises(ValueError, match="model=") as info:
        Simulator(out).predict(Schedule.DEAR)
    assert "accumulation" not in str(info.value)


def test_planned_schedule_replayed() -> None:
    """dear's default schedule in the replay: with a gap in backward (bucket 1 ready 40 ms
    before bucket 0) and a forward too short to hide bucket 1's all-gather, the plan moves that
    all-gather into the gap: the prediction drops by about one all-gather, which DeAR's order
    leaves exposed at the next forward's second layer."""
    import dataclasses as dc
    cost = CostModel.ideal(2e9, 0.0, world_size=2)
    model = _model()
    fast = [dc.replace(p, forward=[Segment(0.0), Segment(0.001, (0,)), Segment(0.001, (1,))],
                       update=0.001) for p in model.profiles]
    model = dc.replace(model, profiles=fast)
    sim = Simulator.from_model(model, cost)
    dear = sim.predict(Schedule.DEAR)
    planned = sim.predict(Schedule.PLANNED)
    ag = cost.time("all_gather", _bucket_bytes(1))
    assert planned.iteration_time < dear.iteration_time - 0.5 * ag
    assert planned.comm == pytest.approx(dear.comm, rel=0.05)   # the same bytes, moved
    # Link-bound (100 Mbit/s): no gap to fill, the plan is DeAR's order.
    slow = Simulator.from_model(model, CostModel.ideal(1e8, 0.0, world_size=2))
    assert slow.predict(Schedule.PLANNED).iteration_time == pytest.approx(
        slow.predict(Schedule.DEAR).iteration_time, rel=1e-9)


def test_horovod_fuses_what_is_ready_when_the_link_frees():
    """Horovod's dynamic fusion (dear.diagnose.dynamic): gradients ready at 10, 20, 30 ms, 25 ms
    per all-reduce, 1 ms cycle: a alone at 11 ms (link free at 36), then b and c together (both
    ready by 37); with a 1 MB threshold b and c go one by one; a parameter never produced goes
    last."""
    from dear.diagnose.dynamic import horovod_buckets
    prof = Profile(rank=0, lead=0.0, forward=[Segment(0.0)], loss=0.0,
                   backward=[Segment(0.010, produces=0), Segment(0.010, produces=1),
                             Segment(0.010, produces=2)],
                   backward_tail=0.0, update=0.0, step_extra=0.0, tail=0.0)
    cost = lambda b: 0.025  # noqa: E731
    assert horovod_buckets([prof], [MB] * 3, cost, cycle_s=1e-3) == [([0], MB), ([1, 2], 2 * MB)]
    assert horovod_buckets([prof], [MB] * 3, cost, threshold=MB, cycle_s=1e-3) == [
        ([0], MB), ([1], MB), ([2], MB)]
    assert horovod_buckets([prof], [MB] * 4, cost, cycle_s=1e-3)[-1] == ([3], MB)
    # A later rank decides: the coordinator waits for every rank's request.
    late = dataclasses.replace(prof, lead=0.050)
    assert [b for b, _ in horovod_buckets([prof, late], [MB] * 3, cost, cycle_s=1e-3)] == [
        [0], [1, 2]]
    # A fused response (several tensors: Horovod's fusion buffer copies) may cost more than a
    # tensor alone: gradients ready at 10, 20, 30, 70, 80 ms; [1, 2] ends at 62 ms at 25 ms, so
    # 3 and 4 go one by one; at 50 ms it ends at 87 and they are fused.
    five = dataclasses.replace(prof, backward=[Segment(0.010, produces=0)] + [
        Segment(d, produces=i) for i, d in ((1, 0.010), (2, 0.010), (3, 0.040), (4, 0.010))])
    assert [b for b, _ in horovod_buckets([five], [MB] * 5, cost, cycle_s=1e-3)] == [
        [0], [1, 2], [3], [4]]
    assert [b for b, _ in horovod_buckets([five], [MB] * 5, cost, cycle_s=1e-3,
                                          fused_s=lambda b: 0.050)] == [[0], [1, 2], [3, 4]]


def test_horovod_schedule_and_step_overhead_closed_form():
    """On the two-gradient model with a fast link each gradient is its own all-reduce (p1's
    hides behind G0): Horovod is DDP's closed form plus one negotiation cycle. A step overhead
    (WFBP's unpacking) adds to the iteration as is."""
    from dear.diagnose.dynamic import HOROVOD_CYCLE_S
    cost = CostModel.ideal(2e9, 0.0, world_size=2)
    sim = Simulator.from_model(_model("ddp", buckets=[]), cost)
    compute = F0 + F1 + G1 + G0 + UPDATE
    ar = cost.time("all_reduce", 2 * MB)
    hvd = sim.predict(Schedule.HOROVOD)
    assert hvd.buckets == 2
    assert hvd.iteration_time == pytest.approx(compute + HOROVOD_CYCLE_S + ar, rel=1e-9)
    # every response holds one tensor: a fused response's cost does not apply
    slow = CostModel.ideal(2e8, 0.0, world_size=2)
    assert sim.predict(Schedule.HOROVOD, fused_cost=slow).iteration_time == pytest.approx(
        hvd.iteration_time, rel=1e-12)
    with pytest.raises(ValueError, match="fused_cost"):
        sim.predict(Schedule.DDP, fused_cost=slow)
    wfbp = sim.predict(Schedule.WFBP).iteration_time
    assert sim.predict(Schedule.WFBP, step_overhead_s=0.005).iteration_time == pytest.approx(
        wfbp + 0.005, rel=1e-9)
    with pytest.raises(ValueError, match="step_overhead_s"):
        sim.predict(Schedule.WFBP, step_overhead_s=-1.0)


def test_horovod_fused_cost_closed_form_and_what_if():
    """Both gradients ready at once: Horovod fuses them into one response, which costs
    `fused_cost`. A fused cost equal to the usual one changes nothing at any world size or
    bandwidth asked (it is moved there as the trace's cost is)."""
    from dear.diagnose.dynamic import HOROVOD_CYCLE_S
    base = _model("ddp", buckets=[])
    prof = dataclasses.replace(base.profiles[0], backward=[Segment(G1, produces=1),
                                                           Segment(0.0, produces=0)])
    model = dataclasses.replace(base, profiles=[prof, prof])
    cost = CostModel.ideal(2e9, 0.0, world_size=2)
    slow = CostModel.ideal(1e9, 0.0, world_size=2)
    sim = Simulator.from_model(model, cost)
    compute = F0 + F1 + G1 + UPDATE
    fused = sim.predict(Schedule.HOROVOD, fused_cost=slow)
    assert fused.buckets == 1
    assert fused.iteration_time == pytest.approx(
        compute + HOROVOD_CYCLE_S + slow.time("all_reduce", 4 * MB), rel=1e-9)
    for kw in ({}, {"world_size": 8}, {"bandwidth_bps": 5e8}, {"latency_s": 1e-3}):
        assert sim.predict(Schedule.HOROVOD, fused_cost=cost, **kw).iteration_time == (
            pytest.approx(sim.predict(Schedule.HOROVOD, **kw).iteration_time, rel=1e-12)), kw


def test_cost_fit_takes_the_median_iteration_rate():
    """One traced iteration whose collectives ran at half the rate (a shared machine) does not
    slow the fitted link: per-iteration rates, their median."""
    rate = 1e9 / 8
    samples = [{"kind": "reduce_scatter", "bytes": 8 * MB, "iteration": it,
                "seconds": 4 * MB / rate * (2 if it == 3 else 1)} for it in range(4)]
    assert CostModel.fit(samples, 2).rate["reduce_scatter"] == pytest.approx(rate)
    pooled = [{k: v for k, v in s.items() if k != "iteration"} for s in samples]
    assert CostModel.fit(pooled, 2).rate["reduce_scatter"] == pytest.approx(rate * 4 / 5)


def test_each_traced_iteration_replayed_on_its_own_link():
    """Per-iteration link rates (iteration_rates) scale the fitted cost for that iteration's
    replay only: an iteration whose transport ran at half rate replays as one (ALLREDUCE:
    compute + one all-reduce, closed form), the others at the fitted rate."""
    from dear.diagnose.costmodel import iteration_rates
    cost = CostModel.ideal(2e9, 0.0, world_size=2)
    bw = 2e9 / 8
    # samples: iteration 7's all-reduce of 4 MB took twice the ideal time
    ideal = cost.time("all_reduce", 4 * MB)
    rates = iteration_rates([{"kind": "all_reduce", "bytes": 4 * MB, "seconds": ideal,
                              "iteration": 6},
                             {"kind": "all_reduce", "bytes": 4 * MB, "seconds": 2 * ideal,
                              "iteration": 7},
                             {"kind": "all_reduce", "bytes": 4 * MB, "seconds": 1.0}], cost)
    assert rates == {6: {"all_reduce": pytest.approx(bw)},
                     7: {"all_reduce": pytest.approx(bw / 2)}}
    model = _model("ddp", buckets=[])
    model.iterations = [model.profiles] * 3
    model.iteration_ids = [5, 6, 7]            # 5: nothing traced, the fitted rate
    sim = Simulator.from_model(model, cost)
    sim.iteration_rates = rates
    compute = F0 + F1 + G1 + G0 + UPDATE
    slow = sim._iteration_cost(sim.cost_model(), 2)
    assert slow.time("all_reduce", 4 * MB) == pytest.approx(2 * ideal)
    assert sim._iteration_cost(sim.cost_model(), 0).rate == cost.rate
    # the median of the three replays: compute + the fitted all-reduce
    assert sim.predict(Schedule.ALLREDUCE).iteration_time == pytest.approx(compute + ideal)
    model.iteration_ids = [7, 7, 6]            # two slow iterations: the median is slow
    assert sim.predict(Schedule.ALLREDUCE).iteration_time == pytest.approx(compute + 2 * ideal)
    # what-if: a 4x faster link keeps the iteration's ratio
    fast = sim._iteration_cost(sim.cost_model(bandwidth_bps=8e9), 0)
    assert fast.time("all_reduce", 4 * MB) == pytest.approx(ideal / 2)


def test_unpack_runs_bucket_by_bucket_while_later_buckets_travel_closed_form():
    """WFBP copies bucket b out right after its wait: with two 2 MB buckets the first one's half
    of the unpacking runs while the second bucket's all-reduce (exposed after backward) is
    still on the link, so only the second half adds to the iteration."""
    cost = CostModel.ideal(2e9, 0.0, world_size=2)
    sim = Simulator.from_model(_model("ddp", buckets=[]), cost)
    ar = cost.time("all_reduce", 2 * MB)
    unpack = 0.004
    assert unpack / 2 < ar
    wfbp = sim.predict(Schedule.WFBP, fusion_threshold=1).iteration_time
    assert sim.predict(Schedule.WFBP, fusion_threshold=1, unpack_s=unpack).iteration_time == \
        pytest.approx(wfbp + unpack / 2, rel=1e-9)
    with pytest.raises(ValueError, match="unpack_s"):
        sim.predict(Schedule.WFBP, unpack_s=-1.0)


def _flat(comm: dict) -> list[float]:
    return [t for key in sorted(comm) for t in comm[key]]


def test_shared_link_closed_form():
    """slots=2 (torch's Gloo process group): two collectives share the link equally, the next
    starts when one ends. A (1 s alone) and B (4 s) from 0: A ends at 2; C (1 s) joins B and
    ends at 4; B, 1 s of its own left, at 6. One at a time: 1, 5, 6."""
    prog = [("issue", "A"), ("issue", "B"), ("issue", "C"),
            ("wait", "A"), ("wait", "B"), ("wait", "C")]
    cost = {"A": 1.0, "B": 4.0, "C": 1.0}
    shared = replay([prog, prog], cost.__getitem__, slots=2)
    assert _flat(shared.comm) == pytest.approx(_flat({"A": (0, 2), "B": (0, 6), "C": (2, 4)}))
    assert [t for a, b, _ in shared.waits[0] for t in (a, b)] == pytest.approx([0, 2, 2, 6])
    fifo = replay([prog, prog], cost.__getitem__, slots=1)
    assert {k: v[1] for k, v in fifo.comm.items()} == {"A": 1, "B": 5, "C": 6}
    with pytest.raises(ValueError, match="slots"):
        replay([prog], cost.__getitem__, slots=0)


def test_shared_link_end_is_final_only_when_nothing_can_join():
    """Y (1 s alone) and A (4 s) share the link from 0: Y ends at 2. Rank 1 issues C (4 s) only
    after Y, so C joins A at 2: A ends at 8, not 5, and C at 9. Rank 2 reaches its wait for A
    before rank 1 has issued C: A's end must not be taken from the link as it is then (5),
    since C can still start before it."""
    progs = [[("issue", "Y"), ("issue", "A"), ("issue", "C"), ("wait", "A")],
             [("issue", "Y"), ("issue", "A"), ("wait", "Y"), ("issue", "C"), ("wait", "A")],
             [("issue", "Y"), ("issue", "A"), ("compute", 0.5, "f"), ("issue", "C"),
              ("wait", "A"), ("mark", "end")]]
    out = replay(progs, {"Y": 1.0, "A": 4.0, "C": 4.0}.__getitem__, slots=2)
    assert _flat(out.comm) == pytest.approx(_flat({"A": (0, 8), "C": (2, 9), "Y": (0, 2)}))
    assert out.mark_times("end")[2] == pytest.approx([8])


def test_wfbp_unpack_waits_for_a_shared_link_closed_form():
    """Two 2 MB buckets, the second issued G0 after the first, each ar = 4 x G0 alone. One at a
    time, the first ends at t + ar and half the unpacking (1.5 x G0) hides behind the second.
    Sharing the link (Gloo's two at a time), the first ends at t + 2 ar - G0 and the second at
    t + 2 ar as before, so only G0 of that half hides: 0.5 x G0 more. The default follows the
    traced backend."""
    bandwidth = 2 * MB * 8 / (4 * G0)
    cost = CostModel.ideal(bandwidth, 0.0, world_size=2)
    assert cost.time("all_reduce", 2 * MB) == pytest.approx(4 * G0)
    model = _model("ddp", buckets=[])
    sim = Simulator.from_model(model, cost)
    unpack = 3 * G0
    one, two = (sim.predict(Schedule.WFBP, fusion_threshold=1, unpack_s=unpack,
                            allreduce_slots=k).iteration_time for k in (1, 2))
    assert two == pytest.approx(one + 0.5 * G0, rel=1e-9)
    assert sim.predict(Schedule.WFBP, fusion_threshold=1, unpack_s=unpack).iteration_time == \
        pytest.approx(one)                                  # backend unknown: one at a time
    gloo = Simulator.from_model(dataclasses.replace(model, backend="gloo-pairwise"), cost)
    assert gloo.predict(Schedule.WFBP, fusion_threshold=1, unpack_s=unpack).iteration_time == \
        pytest.approx(two)
    with pytest.raises(ValueError, match="allreduce_slots"):
        sim.predict(Schedule.DEAR, allreduce_slots=2)
    with pytest.raises(ValueError, match="allreduce_slots"):
        sim.predict(Schedule.DDP, allreduce_slots=0)


def test_layout_keeps_row_sparse_tables_alone_as_the_optimizer_does():
    """The offline autotuner replays layouts of an optimizer that keeps row-sparse tables in
    buckets of their own (Model.alone): the simulated layout must have the same buckets."""
    model = dataclasses.replace(_model("dear"), param_bytes=[2 * MB] * 3,
                                param_numel=[NUMEL] * 3, forward_order=[0, 1, 2],
                                backward_order=[2, 1, 0])
    sim = Simulator.from_model(model, CostModel.ideal(2e9, 0.0, world_size=2))
    fusion = FusionConfig(25 * MB, 25 * MB)
    assert [ps for ps, _ in sim.layout(fusion).buckets] == [[0, 1, 2]]
    alone = Simulator.from_model(dataclasses.replace(model, alone=[1]), sim.fitted)
    assert [ps for ps, _ in alone.layout(fusion).buckets] == [[0], [1], [2]]
    assert [1] in alone.layout(fusion).groups          # all-gathered alone, as dear does


def test_row_sparse_table_replayed_closed_form():
    """Parameter 0 as a table of 1024 rows sent by rows (dear/fusion/rows.py): its reduce-scatter
    is the marks' all-reduce plus the rows' all-reduce, and nothing is all-gathered. With every
    row sent, the rows' all-reduce carries what the reduce-scatter and all-gather carried
    (ring identity), so the iteration is longer by the marks' all-reduce alone; with none
    sent it is shorter than dense."""
    cost = CostModel.ideal(2e9, 0.0, world_size=2)
    sim = Simulator.from_model(_model("dear"), cost)
    dense = sim.predict(Schedule.DEAR).iteration_time
    every = sim.predict(Schedule.DEAR, row_sparse={0: (1024, 1024)}).iteration_time
    marks = cost.time("all_reduce", 1024 * 4)
    assert every == pytest.approx(dense + marks, abs=cost.time("all_reduce", 16))
    none = sim.predict(Schedule.DEAR, row_sparse={0: (1024, 0)}).iteration_time
    assert none < dense
    planned = sim.predict(Schedule.PLANNED, row_sparse={0: (1024, 0)}).iteration_time
    assert planned <= none + 1e-12
    with pytest.raises(ValueError, match="row_sparse"):
        sim.predict(Schedule.DDP, row_sparse={0: (1024, 10)})
    with pytest.raises(ValueError, match="row_sparse"):
        sim.predict(Schedule.DEAR, row_sparse={0: (1024, 2000)})
