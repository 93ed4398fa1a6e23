"""dear.diagnose: the tracer (dear, DDP, DEAR_TRACE), the Chrome trace schema, clock alignment,
and the report's figures on synthetic traces with known answers."""

from __future__ import annotations

import json
import os

import pytest
import torch

from dear.diagnose.chrome import FORMAT_VERSION, load_trace, parse_rank
from dear.diagnose.report import build_report, format_report
from tests.distributed import run_distributed

SKEW_NS = 7_000_000_000                       # rank r's clock runs r * 7 s ahead


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(inplace=True),
                               torch.nn.Linear(128, 128), torch.nn.ReLU(),
                               torch.nn.Linear(128, 10))


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    rank = torch.distributed.get_rank()
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(16, 64, generator=g), torch.randint(10, (16,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def _dear_run(out: str) -> dict:
    import time

    import torch.distributed as dist

    import dear
    from dear import diagnose
    dist.init_process_group("gloo")
    dear.init()
    rank = dist.get_rank()
    plain = _model()
    opt = dear.DistributedOptimizer(torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9),
                                    model=plain, fusion_threshold=40_000)
    _train(plain, opt, 7)
    opt.flush_updates()
    traced = _model()
    opt = dear.DistributedOptimizer(torch.optim.SGD(traced.parameters(), lr=0.1, momentum=0.9),
                                    model=traced, fusion_threshold=40_000)
    clock = lambda: time.perf_counter_ns() + rank * SKEW_NS  # noqa: E731
    with diagnose.Tracer(traced, opt, out, range(2, 5), clock=clock) as tracer:
        _train(traced, opt, 7)
    opt.flush_updates()
    same = all(torch.equal(a, b) for a, b in zip(plain.parameters(), traced.parameters()))
    buckets = [b.buffer.numel() * b.buffer.element_size() for b in opt.dear_engine.buckets]
    comm = opt.dear_communicator
    restored = comm is dear.comm.runtime.communicator() and type(comm).__name__ != \
        "TracingCommunicator"
    dear.shutdown()
    return {"same": same, "bucket_bytes": buckets, "path": tracer.path, "restored": restored}


@pytest.mark.parametrize("world", [2, 3])
def test_trace_of_dear_run(tmp_path, world):
    """3 ranks: dear's exchange is a ring run by its own thread, which stamps completions."""
    out = str(tmp_path / "trace")
    results = run_distributed(_dear_run, world, out, timeout=120)
    assert all(r["same"] for r in results), "tracing changed the training result"
    assert all(r["restored"] for r in results), "the communicator was not restored"
    assert sorted(os.listdir(out)) == [f"rank{r}.json" for r in range(world)]
    trace = load_trace(out)
    nbuckets = len(results[0]["bucket_bytes"])
    assert nbuckets >= 3
    for rank in trace.ranks:
        meta = rank.meta
        assert meta["world_size"] == world and meta["schedule"] == "dear"
        # The layout replay needs: the FusionConfig and the all-gather groups, in bucket order.
        assert meta["fusion"] == {"rs_threshold": 40_000, "ag_threshold": 40_000,
                                  "first_bucket": 40_000, "chunk_bytes": None}
        assert [b for g in meta["gather_groups"] for b in g] == list(range(len(meta["buckets"])))
        # Clocks: rank 1's runs 7 s ahead; the measured offset must undo it to within the
        # bound the method gives (half the best round trip: on a loaded machine it may exceed
        # any fixed figure), which must be a bound (on one host the true offset is exactly the
        # injected skew), and useful when the machine is not starved (under 50 ms).
        error = meta["clock_offset_error_ns"]
        assert 0 <= error < 50_000_000 and (rank.rank > 0 or error == 0), error
        assert abs(meta["clock_offset_ns"] + rank.rank * SKEW_NS) <= error
        # Bounded: the traced iterations and nothing else.
        assert sorted(rank.iterations) == [2, 3, 4]
        assert {s.iteration for s in rank.spans} == {2, 3, 4}
        comm = rank.of("comm")
        kinds = [s.args["kind"] for s in comm]
        assert kinds.count("reduce_scatter") == kinds.count("all_gather") == 3 * nbuckets
        stamped_by = "watcher" if world == 2 else "callback"    # never the training thread
        assert all(s.args["end_source"] == stamped_by for s in comm), \
            {s.args["end_source"] for s in comm}
        for s in comm:
            assert s.args["bytes"] == results[rank.rank]["bucket_bytes"][s.args["bucket"]]
        # Reduce-scatters go last bucket first, all-gathers first bucket first.
        rs = [s.args["bucket"] for s in comm if s.args["kind"] == "reduce_scatter"][:nbuckets]
        assert rs == list(range(nbuckets))[::-1]
        for it in (2, 3, 4):
            assert len(rank.of("step", it)) == 1
            assert len(rank.of("grad", it)) == 6        # 3 Linear layers, weight and bias
            assert {s.args["bucket"] for s in rank.of("update", it)} == set(range(nbuckets))
    # Aligned clocks are causal: no collective completes on a rank before every rank issued it.
    by_seq = [{s.args["seq"]: s for s in r.of("comm")} for r in trace.ranks]
    for seq in by_seq[0]:
        issued = max(r[seq].start for r in by_seq)
        for r in by_seq:
            assert r[seq].end >= issued - 1e-3, f"collective {seq} ends before it was issued"
    # Iteration 2's forward waited for all-gathers issued before the trace: the replay leaves
    # it out (their waits would count as update compute).
    from dear.diagnose import Simulator
    assert Simulator(out).model.iteration_ids == [3, 4]
    report = build_report(out)
    for s in report.per_rank:
        assert s.compute > 0 and s.comm > 0 and 0 <= s.exposed <= s.comm
        assert s.time == pytest.approx(s.compute + s.exposed + s.idle, abs=1e-6)
    assert "overlap" in format_report(report)


def _ddp_and_env_run(out: str) -> dict:
    import torch.distributed as dist

    import dear
    from dear import diagnose
    dist.init_process_group("gloo")
    dear.init()                                # DEAR_TRACE and DEAR_TRACE_ITERATIONS are set
    plain = torch.nn.parallel.DistributedDataParallel(_model())
    _train(plain, torch.optim.SGD(plain.parameters(), lr=0.1), 5)
    traced = torch.nn.parallel.DistributedDataParallel(_model())
    opt = torch.optim.SGD(traced.parameters(), lr=0.1)
    with diagnose.trace(traced, opt, out=os.path.join(out, "ddp"), iterations=range(1, 3)):
        _train(traced, opt, 5)
    _train(traced, opt, 1)                     # the hook stays, untraced, after the trace
    _train(plain, torch.optim.SGD(plain.parameters(), lr=0.1), 1)
    same = all(torch.equal(a, b) for a, b in zip(plain.parameters(), traced.parameters()))
    model = _model()                           # DEAR_TRACE: no trace() call at all
    opt = dear.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
    _train(model, opt, 6)
    dear.shutdown()
    return {"same": same}


def test_trace_of_ddp_run_and_dear_trace_variable(tmp_path):
    out = str(tmp_path)
    env = {"DEAR_TRACE": os.path.join(out, "auto"), "DEAR_TRACE_ITERATIONS": "1:3"}
    results = run_distributed(_ddp_and_env_run, 2, out, env=env, timeout=120)
    assert all(r["same"] for r in results), "the tracing comm hook changed DDP's result"
    ddp = load_trace(os.path.join(out, "ddp"))
    for rank in ddp.ranks:
        assert rank.meta["schedule"] == "ddp"
        assert sorted(rank.iterations) == [1, 2]
        comm = rank.of("comm")
        assert comm and all(s.args["kind"] == "all_reduce" for s in comm)
        assert all(s.args["end_source"] == "callback" for s in comm)
        assert sum(s.args["bytes"] for s in comm if s.iteration == 1) == \
            sum(p["bytes"] for p in rank.meta["params"])
        assert rank.of("forward", 1) and rank.of("backward", 1) and rank.of("step", 1)
    auto = load_trace(os.path.join(out, "auto"))
    for rank in auto.ranks:
        assert rank.meta["schedule"] == "dear" and sorted(rank.iterations) == [1, 2]
        assert {s.args["kind"] for s in rank.of("comm")} == {"reduce_scatter", "all_gather"}


# ----------------------------------------------------------------------- schema and inputs
def test_chrome_schema(tmp_path):
    """What Perfetto and chrome://tracing need: JSON object format, known phases, numeric
    ts/dur in microseconds, pid/tid integers, metadata events naming processes and threads."""
    from dear.diagnose.chrome import build_trace
    from dear.diagnose.recorder import CollectiveKind, Ev, Recorder
    rec = Recorder(clock=lambda: 0)
    rec.iteration_starts[0], rec.iteration_ends[0] = 1_000, 9_000_000
    rec.events += [(Ev.FORWARD_START, 0, 2_000, 0), (Ev.FORWARD_START, 0, 3_000, 1),
                   (Ev.FORWARD_END, 0, 4_000, 1), (Ev.FORWARD_END, 0, 5_000, 0),
                   (Ev.BACKWARD_START, 0, 6_000, 1), (Ev.GRAD_READY, 0, 7_000, 0),
                   (Ev.STEP, 0, 8_000, 8_500_000), (Ev.WAIT, 0, 8_100, 8_400_000, 1)]
    c = rec.collective(CollectiveKind.ALL_REDUCE, 4096, 0, 0)
    c.complete(8_300_000, "watcher")
    meta = {"rank": 0, "world_size": 1, "modules": [{"name": "<root>", "leaf": False,
                                                     "params": []},
                                                    {"name": "fc", "leaf": True, "params": [0]}],
            "params": [{"name": "fc.weight", "numel": 1024, "bytes": 4096}]}
    doc = json.loads(json.dumps(build_trace(rec, meta)))
    assert isinstance(doc["traceEvents"], list) and doc["displayTimeUnit"] == "ms"
    for ev in doc["traceEvents"]:
        assert ev["ph"] in ("X", "i", "M") and isinstance(ev["pid"], int)
        assert isinstance(ev["tid"], int) and isinstance(ev["name"], str)
        if ev["ph"] == "X":
            assert isinstance(ev["ts"], (int, float)) and ev["dur"] >= 0
    names = {(e["name"], e["args"].get("name")) for e in doc["traceEvents"] if e["ph"] == "M"}
    assert ("thread_name", "training thread") in names and ("process_name", "rank 0") in names
    fwd = {e["name"]: e for e in doc["traceEvents"] if e.get("cat") == "forward"}
    assert fwd["fc"]["ts"] == 3.0 and fwd["fc"]["dur"] == 1.0          # ns -> us
    bwd = [e for e in doc["traceEvents"] if e.get("cat") == "backward"]
    assert len(bwd) == 1 and bwd[0]["dur"] == 1.0                      # until the last grad
    parsed = parse_rank(doc)
    assert parsed.iterations[0].duration == pytest.approx((9_000_000 - 1_000) / 1e9)
    with pytest.raises(ValueError, match="version"):
        parse_rank({**doc, "dear": {**doc["dear"], "version": FORMAT_VERSION + 1}})
    with pytest.raises(ValueError, match="not a dear.diagnose trace"):
        parse_rank({"traceEvents": []})


def test_bad_arguments(tmp_path):
    from dear.diagnose import trace
    from dear.diagnose.trace import parse_iterations
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="needs a model"):
        trace(None, None)
    with pytest.raises(ValueError, match="non-empty"):
        trace(model, iterations=range(5, 2))
    with pytest.raises(TypeError, match="range"):
        trace(model, iterations=[1, 2])
    with pytest.raises(ValueError, match="START:STOP"):
        parse_iterations("10-20")
    with pytest.raises(FileNotFoundError, match="rank\\*.json"):
        load_trace(str(tmp_path))
    from dear.config import Config
    with pytest.raises(ValueError, match="trace_iterations must be START:STOP"):
        Config.from_env({"DEAR_TRACE_ITERATIONS": "20:10"})


def test_single_process_trace_without_optimizer(tmp_path):
    """No optimizer, no torch.distributed: iterations are counted by training forwards."""
    from dear import diagnose
    model = _model()
    with diagnose.trace(model, out=str(tmp_path), iterations=range(1, 3)):
        for _ in range(4):
            model(torch.randn(4, 64)).sum().backward()
        model.eval()
        model(torch.randn(4, 64))              # evaluation forwards are not iterations
    rank = load_trace(str(tmp_path)).ranks[0]
    assert sorted(rank.iterations) == [1, 2] and rank.meta["world_size"] == 1
    assert len([s for s in rank.of("forward", 1) if s.args["module"] == 0]) == 1


# ----------------------------------------------------------------- report: known answers
def _synthetic(rank: int, spans: list[tuple], window: tuple[float, float]) -> dict:
    """A one-iteration rank trace from (cat, start_ms, end_ms, args) tuples."""
    ev = [{"ph": "X", "pid": rank, "tid": 0, "cat": "iteration", "name": "iteration 0",
           "ts": window[0] * 1e3, "dur": (window[1] - window[0]) * 1e3, "args": {"iteration": 0}}]
    for cat, start, end, args in spans:
        ev.append({"ph": "X", "pid": rank, "tid": 1, "cat": cat, "name": cat, "ts": start * 1e3,
                   "dur": (end - start) * 1e3, "args": {"iteration": 0, **args}})
    modules = [{"name": "<root>", "leaf": False, "params": []},
               {"name": "fc", "leaf": True, "params": [0]}]
    return {"traceEvents": ev, "dear": {"version": FORMAT_VERSION, "rank": rank,
                                        "world_size": 2, "schedule": "dear", "modules": modules,
                                        "params": [{"name": "w", "numel": 1, "bytes": 4}]}}


def _write(tmp_path, docs: list[dict]) -> str:
    for d in docs:
        with open(tmp_path / f"rank{d['dear']['rank']}.json", "w") as fh:
            json.dump(d, fh)
    return str(tmp_path)


def test_report_known_answers(tmp_path):
    # Rank 0, window 0-100 ms: forward 10-30, loss 30-35, backward 35-60, step 60-70 with a
    # wait 62-68, a reduce-scatter 40-66. Compute = 20 + 5 + 25 + 10 - 6 = 54; communication 26;
    # exposed = the part of 40-66 outside compute = 62-66 = 4; hidden 22; idle = 100-54-4 = 42.
    comm = {"kind": "reduce_scatter", "bytes": 8_000_000, "bucket": 0, "seq": 1}
    rank0 = _synthetic(0, [("forward", 10, 30, {"module": 0}), ("forward", 12, 20, {"module": 1}),
                           ("backward", 35, 50, {"module": 1}), ("backward", 50, 60, {"module": 1}),
                           ("step", 60, 70, {}), ("wait", 62, 68, {"seq": 1}),
                           ("comm", 40, 66, comm)], (0, 100))
    # Rank 1: the same work but 10 ms more forward; communication fully hidden.
    rank1 = _synthetic(1, [("forward", 0, 40, {"module": 0}), ("backward", 40, 70, {"module": 1}),
                           ("comm", 45, 65, comm)], (0, 100))
    report = build_report(_write(tmp_path, [rank0, rank1]))
    r0, r1 = report.per_rank
    assert (r0.compute, r0.comm, r0.exposed, r0.idle) == pytest.approx(
        (0.054, 0.026, 0.004, 0.042))
    assert r0.overlap == pytest.approx(22 / 26)
    assert (r1.compute, r1.comm, r1.exposed, r1.idle) == pytest.approx((0.070, 0.020, 0, 0.030))
    assert r1.overlap == pytest.approx(1.0)
    assert report.slowest_rank == 1
    assert report.layers[0][0] == "fc"
    assert report.layers[0][1] == pytest.approx(0.008 / 2)     # 8 ms over 2 rank-iterations
    assert report.layers[0][2] == pytest.approx((0.025 + 0.030) / 2)
    text = format_report(report)
    assert "Slowest rank: 1" in text


def test_report_cli_and_png(tmp_path):
    from dear.diagnose.__main__ import main
    comm = {"kind": "all_reduce", "bytes": 1000, "bucket": 0, "seq": 1}
    doc = _synthetic(0, [("forward", 0, 10, {"module": 0}), ("comm", 5, 20, comm)], (0, 30))
    path = _write(tmp_path, [doc, {**doc, "dear": {**doc["dear"], "rank": 1}}])
    png = str(tmp_path / "t.png")
    assert main(["report", path, "--png", png]) == 0
    with open(png, "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"


HOROVOD_SCRIPT = '''
import sys
import torch
import horovod.torch as hvd
from dear import diagnose
from tests.test_diagnose import _model

hvd.init()
torch.set_num_threads(1)
model = _model()
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters())
with diagnose.trace(model, opt, out=sys.argv[1], iterations=range(1, 3)):
    for step in range(4):
        g = torch.Generator().manual_seed(step * 10 + hvd.rank())
        x, y = torch.randn(16, 64, generator=g), torch.randint(10, (16,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
hvd.shutdown()
'''


def test_trace_of_horovod_run(tmp_path):
    from tests.horovod_launch import NO_HOROVOD, horovod_available, run_horovod
    if not horovod_available():
        pytest.skip(NO_HOROVOD)
    script = tmp_path / "hvd_trace.py"
    script.write_text(HOROVOD_SCRIPT)
    out = str(tmp_path / "trace")
    run_horovod([str(script), out], np=2, timeout=120)
    trace = load_trace(out)
    assert len(trace.ranks) == 2
    for rank in trace.ranks:
        assert rank.meta["schedule"] == "horovod" and rank.meta["world_size"] == 2
        assert sorted(rank.iterations) == [1, 2]
        comm = rank.of("comm")
        assert len(comm) == 2 * 6 and {s.args["kind"] for s in comm} == {"all_reduce"}
        assert all(s.args["end_source"] in ("watcher", "wait") for s in comm)
        assert rank.of("forward", 1) and rank.of("backward", 2) and rank.of("step", 2)
    assert build_report(out).per_rank


def _compressed_runs(out: str) -> dict:
    import torch.distributed as dist

    import dear
    from dear import diagnose
    dist.init_process_group("gloo")
    dear.init()
    buckets = {}
    for name in ("none", "fp16", "int8"):
        model = _model()
        opt = dear.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), model=model, fusion_threshold=40_000,
            compression=getattr(dear.Compression, name))
        with diagnose.Tracer(model, opt, os.path.join(out, name), range(2, 4)):
            _train(model, opt, 5)
        opt.flush_updates()
        buckets[name] = [b.buffer.numel() * b.buffer.element_size()
                         for b in opt.dear_engine.buckets]
    dear.shutdown()
    return buckets


def test_compressed_wires_are_fitted_in_their_buckets_bytes(tmp_path):
    """The replay costs a bucket by its buffer's bytes, so a trace of fp16 or int8 wires gives
    the link fit each collective's bucket bytes (the buffers' own sizes, read from the
    optimizer), while the trace still shows the wire's bytes (about 1/2 and 1/4 of them)."""
    from dear.diagnose.graph import collective_samples
    out = str(tmp_path / "trace")
    res = run_distributed(_compressed_runs, 2, out, timeout=180)[0]
    assert res["none"] == res["fp16"] == res["int8"]
    buffers = set(res["none"])
    for name, wire in (("none", 1.0), ("fp16", 0.5), ("int8", 0.25)):
        trace = load_trace(os.path.join(out, name))
        samples = collective_samples(trace)
        assert {s["kind"] for s in samples} == {"reduce_scatter", "all_gather"}
        assert {s["bytes"] for s in samples} == buffers
        raw = [int(s.args["bytes"]) for s in trace.ranks[0].of("comm")]
        ratio = sum(raw) / sum(s["bytes"] for s in samples)
        # int8: 1 byte a value + a 4-byte scale per 256, slots rounded up: within 10% of 1/4
        assert wire * 0.95 <= ratio <= wire * 1.1, (name, ratio)


def test_a_quantized_trace_replays_its_decoding_after_the_transfers(tmp_path):
    """An int8 trace records the decode thread's seconds per bucket byte after its
    reduce-scatters and all-gathers; the replay waits for them after each transfer, so it
    predicts a longer iteration than the same trace without them. An fp32 trace has none."""
    import dataclasses

    from dear.diagnose.simulate import Simulator
    out = str(tmp_path / "trace")
    run_distributed(_compressed_runs, 2, out, timeout=180)
    assert load_trace(os.path.join(out, "none")).meta.get("decode_s_per_byte") == {}
    sim = Simulator(os.path.join(out, "int8"))
    rates = sim.model.decode_s_per_byte
    assert set(rates) == {"reduce", "gather"} and all(r > 0 for r in rates.values()), rates
    traced = sim.model
    with_decode = sim.predict("dear").iteration_time
    sim.model = dataclasses.replace(traced, decode_s_per_byte={})
    without = sim.predict("dear").iteration_time
    assert with_decode >= without
    # Slow decoding (1 us a bucket byte) must show: the last
    # reduce-scatter's sum delays step()'s wait by at least its own time.
    sim.model = dataclasses.replace(traced, decode_s_per_byte={"reduce": 1e-6, "gather": 0.0})
    smallest = min(b for _, b in sim.layout().buckets)
    assert sim.predict("dear").iteration_time >= without + 1e-6 * smallest
