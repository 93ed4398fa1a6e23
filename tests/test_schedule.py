"""The planned schedule (dear/fusion/schedule.py): all-gather chunks in backward's idle link time.

What must hold whatever each rank's timing: every rank issues the same collectives in the same
order (2 and 3 ranks, a rank whose backward is slower in one layer, a branch one rank skips),
training equals single-process training on the global batch and DDP, and a new layout mid-run
is planned again. Plus the planner's greedy replay and the executor on their own.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import dear
from dear.comm.base import Communicator, DoneWork, Work, WrappedCommunicator
from dear.comm.compression import Compression
from dear.fusion.fusion_config import FusionConfig
from dear.fusion.layout import build_layout
from dear.fusion.plan import BackwardClock, calibrate, contention, probe_link, replay_tail
from dear.comm.link import LinkModel
from dear.fusion.schedule import CommExecutor, Plan, ScheduleDriver, chunk_columns, plan_gaps
from tests.distributed import run_distributed
from tests.workloads import (OPTIMIZERS, batch, branch_used, init_in_issue_mode, make_net, max_diff,
                             reference, state_of)

STEPS = 7


# ------------------------------------------------------------------------------ the planner

def _link(alpha_rs: float, rate_rs: float, alpha_ag: float, rate_ag: float) -> LinkModel:
    """A 2-rank link on which a collective of S bytes takes alpha + S / rate (the ring sends
    S/2 at rate/2 in one step)."""
    return LinkModel({"reduce_scatter": alpha_rs, "all_gather": alpha_ag},
                     {"reduce_scatter": rate_rs / 2, "all_gather": rate_ag / 2}, 2)


def test_plan_fills_idle_gaps_and_leaves_a_busy_link_alone() -> None:
    cost = _link(alpha_rs=0.0, rate_rs=1e6, alpha_ag=0.0, rate_ag=1e6)   # 1 MB/s
    # 3 buckets of 1000 bytes, 2 ranks, float32 shards of 125 elements; chunks of <= 63 columns
    shard, item, world = [125] * 3, [4] * 3, 2
    # Buckets 2, 1, 0 ready at 0, 10 ms, 20 ms: each reduce-scatter takes 1 ms, so after
    # bucket 2's there are 9 ms idle: both pieces of bucket 2 (0.5 ms each) fit, and being
    # consecutive columns of one bucket in one gap they are one collective.
    plan = plan_gaps([0.020, 0.010, 0.0], [1000] * 3, shard, item, world, cost, 504)
    assert plan.after[2] == ((2, 0, 125),)
    # after bucket 1's: bucket 1's; after bucket 0's nothing (step() gathers the rest)
    assert plan.after[1] == ((1, 0, 125),) and 0 not in plan.after
    assert plan.predicted_gap_fill_s == pytest.approx(4 * 0.504e-3, rel=0.01)
    # Link-bound: every bucket ready at once, no gap, DeAR's order.
    busy = plan_gaps([0.0, 0.0, 0.0], [1000] * 3, shard, item, world, cost, 504)
    assert busy.after == {} and busy.num_chunks == 0


def test_plan_pays_one_alpha_for_consecutive_pieces() -> None:
    """With a per-collective cost (alpha: a message per ring step), two pieces of one bucket
    sent as one collective fit a gap that two collectives would overrun."""
    cost = _link(alpha_rs=0.0, rate_rs=1e6, alpha_ag=1e-3, rate_ag=1e6)
    shard, item, world = [125] * 2, [4] * 2, 2
    # Bucket 1's reduce-scatter 0-1 ms, bucket 0 ready at 3.6 ms: 2.6 ms for its pieces
    # (504 and 496 B): 1 + 0.504 + 0.496 = 2.0 ms as one collective, 3.0 ms as two.
    plan = plan_gaps([0.0036, 0.0], [1000] * 2, shard, item, world, cost, 504, slack=0.0)
    assert plan.after == {1: ((1, 0, 125),)}
    assert plan.predicted_gap_fill_s == pytest.approx(2e-3)
    # A gap too short for the first piece and its alpha leaves the bucket to step().
    short = plan_gaps([0.0025, 0.0], [1000] * 2, shard, item, world, cost, 504, slack=0.0)
    assert short.after == {}


def test_replay_tail_is_a_fifo_link_in_the_plans_order() -> None:
    cost = _link(alpha_rs=0.0, rate_rs=1e6, alpha_ag=0.0, rate_ag=1e6)   # 1000 B: 1 ms
    # Buckets 1 and 0 (1000 bytes each) ready at 0 and 2 ms. Alone: bucket 0's reduce-scatter
    # runs from its ready time, 1 ms. With a chunk of bucket 1 after bucket 1's reduce-scatter
    # (2 ranks x 250 float32 columns = 2000 B, 1-3 ms), bucket 0's waits for it: 3-4 ms.
    ready, rs, items = [0.002, 0.0], [1000, 1000], [4, 4]
    plan = Plan(after={1: ((1, 0, 250),)})
    assert replay_tail(Plan({}), ready, rs, items, 2, cost) == pytest.approx(0.001)
    assert replay_tail(plan, ready, rs, items, 2, cost) == pytest.approx(0.002)
    # Twice as slow: rs(1) 0-2 ms, the chunk 2-6 ms, rs(0) 6-8 ms: 6 ms after bucket 0 is ready.
    assert replay_tail(plan, ready, rs, items, 2, cost.slower(2.0)) == pytest.approx(0.006)


def test_calibrate_finds_how_much_slower_the_link_was() -> None:
    cost = _link(alpha_rs=1e-4, rate_rs=1e6, alpha_ag=2e-4, rate_ag=2e6)
    ready, rs, items = [0.004, 0.002, 0.0], [1000, 3000, 2000], [4, 4, 4]
    plan = Plan(after={2: ((2, 0, 100), (2, 100, 150)), 1: ((1, 0, 375),)})

    def tail(factor: float) -> float:
        return replay_tail(plan, ready, rs, items, 2, cost.slower(factor))
    for truth in (0.7, 1.0, 1.37, 3.2):
        assert calibrate(tail(truth), tail, 0.0) == pytest.approx(truth, abs=2e-3)
    assert calibrate(0.0, tail, 0.0) == 0.5 and calibrate(10.0, tail, 0.0) == 4.0   # bounds
    # Within 5% of the replay's tail, or 2% of backward's duration, the model stands.
    assert calibrate(tail(1.0) * 1.04, tail, 0.0) == 1.0
    assert calibrate(tail(1.0) + 0.019, tail, 1.0) == 1.0
    assert calibrate(tail(1.0) + 0.021, tail, 1.0) > 1.0


def test_contention_is_the_link_time_that_backward_loses() -> None:
    """plan.contention: what backward (load) and a collective (host share) need beyond the
    rank's cores, over backward's load, at most 1."""
    assert contention(1.0, 0.9, 1.0) == pytest.approx(0.9)     # loopback: one core each
    assert contention(1.0, 0.9, 2.0) == 0.0                    # an idle core takes the copying
    assert contention(8.0, 0.2, 8.0) == pytest.approx(0.025)   # a NIC's interrupts, 8 threads
    assert contention(0.5, 2.0, 1.0) == 1.0                    # never more than all of it
    assert contention(0.0, 1.0, 1.0) == 0.0                    # a GPU's backward: host idle
    assert contention(1.0, 0.0, 1.0) == 0.0                    # a link that costs no host


class _FakeClocks:
    """plan.py's `time`: wall and process CPU clocks moved by hand."""

    def __init__(self) -> None:
        self.wall, self.cpu = 0.0, 0.0

    def perf_counter(self) -> float:
        return self.wall

    def process_time(self) -> float:
        return self.cpu


def test_backward_host_load_is_cpu_over_wall_from_first_to_last_submission(monkeypatch) -> None:
    clocks = _FakeClocks()
    monkeypatch.setattr(dear.fusion.plan, "time", clocks)
    clock = BackwardClock(3)
    assert clock.host_load() == 0.0                            # nothing measured yet
    for cpu in (0.5, 0.25, 1.0):                               # three backwards of 1 s
        for bucket in (2, 1, 0):
            clock.reduce_scatter_submitted(bucket)
            clock.reduce_scatter_submitted(bucket)             # a second piece: not a mark
            clocks.wall += 0.5 if bucket else 0.0
            clocks.cpu += cpu / 2 if bucket else 0.0
        clocks.wall += 7.0                                     # the rest: not backward's
        clocks.cpu += 7.0
        clock.reduced()
    assert clock.host_load() == pytest.approx(0.5)             # the median
    assert BackwardClock(1).host_load() == 0.0                 # one bucket: no span


class _TimedComm:
    """A 2-rank communicator whose collectives take 1 s of wall time and `cpu` s of CPU."""

    size = 2

    def __init__(self, clocks: _FakeClocks, cpu: float) -> None:
        self.clocks, self.cpu = clocks, cpu

    def barrier(self) -> None:
        self.clocks.wall += 5.0                                # waiting: not the collective's

    def _run(self, *args: Any) -> Work:
        self.clocks.wall += 1.0
        self.clocks.cpu += self.cpu
        return DoneWork()

    reduce_scatter = all_gather = _run


def test_probe_measures_the_host_share_of_its_collectives(monkeypatch) -> None:
    clocks = _FakeClocks()
    monkeypatch.setattr(dear.fusion.plan, "time", clocks)
    for cpu in (0.0, 0.3, 1.2):
        model = probe_link(_TimedComm(clocks, cpu), (4096, 65536))   # type: ignore[arg-type]
        assert model.host_share == pytest.approx(cpu)
        assert model.slower(2.0).host_share == pytest.approx(cpu / 2)   # same work, longer


def test_chunk_columns_cover_the_shard_once() -> None:
    assert chunk_columns(10, 4) == [(0, 4), (4, 3), (7, 3)]
    assert sum(n for _, n in chunk_columns(1001, 7)) == 1001
    assert chunk_columns(0, 4) == []


def test_a_parameter_larger_than_a_bucket_is_reduce_scattered_in_pieces() -> None:
    """build_layout: a bucket over the reduce-scatter threshold (a lone parameter larger than
    it) travels in column pieces of at most the threshold on the wire; buckets within it, one
    rank, a threshold of 0 (a bucket per parameter) and a row-sparse table go whole."""
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (1000, 10, 30)]
    fusion = FusionConfig.single(1024)
    layout = build_layout(params, [0, 1, 2], fusion, 3, None, Compression.none, False)
    big, small = layout.buckets
    assert big.spec.params == (0,) and small.spec.params == (1, 2)
    assert small.rs_pieces == [(0, small.spec.shard_numel)]
    assert sum(n for _, n in big.rs_pieces) == big.spec.shard_numel
    assert [s for s, _ in big.rs_pieces] == list(itertools.accumulate(
        [0] + [n for _, n in big.rs_pieces[:-1]]))
    assert len(big.rs_pieces) == 4 and all(3 * n * 4 <= 1024 for _, n in big.rs_pieces)
    fp16 = build_layout(params, [0, 1, 2], fusion, 3, None, Compression.fp16, False)
    assert len(fp16.buckets[0].rs_pieces) == 2        # the wire's bytes count: half as many
    for world, f in ((1, fusion), (3, FusionConfig.single(0))):
        one = build_layout(params, [0, 1, 2], f, world, None, Compression.none, False)
        assert all(len(b.rs_pieces) == 1 for b in one.buckets)
    table = [torch.nn.Parameter(torch.zeros(100, 10))]
    rows = build_layout(table, [0], fusion, 3, None, Compression.none, False, row_sparse={0})
    assert rows.buckets[0].rs_pieces == [(0, rows.buckets[0].spec.shard_numel)]


def test_plan_leaves_a_bucket_without_all_gather_alone() -> None:
    """A row-sparse table (dear/fusion/rows.py) has no all-gather: the optimizer gives it a
    shard of 0 columns, and no chunk of it may be planned (the CPU benchmark's BERT-Base, whose
    table is bucket 1, failed with one)."""
    cost = _link(alpha_rs=0.0, rate_rs=1e6, alpha_ag=0.0, rate_ag=1e6)
    plan = plan_gaps([0.030, 0.020, 0.010, 0.0], [1000] * 4, [125, 0, 125, 125], [4] * 4, 2,
                     cost, 504)
    planned = [c for chunks in plan.after.values() for c in chunks]
    assert planned and all(b != 1 for b, _, _ in planned)


def test_executor_issues_in_submission_order_after_dependencies() -> None:
    ex = CommExecutor()
    gate = threading.Event()
    order: list[str] = []

    def issue(name: str) -> Any:
        def run() -> Work:
            order.append(name)
            return DoneWork()
        return run

    first = ex.submit(issue("a"), before=lambda: gate.wait(5))
    second = ex.submit(issue("b"))
    time.sleep(0.05)
    assert order == [], "a task ran before the one ahead of it was issued"
    gate.set()
    second.wait()
    first.wait()
    ex.drain()
    assert order == ["a", "b"]
    failing = ex.submit(issue("c"), before=lambda: (_ for _ in ()).throw(OSError("peer gone")))
    with pytest.raises(RuntimeError, match="peer gone"):
        failing.wait()
    ex.close()


# ---------------------------------------------------------------------- on several ranks
class RecordingCommunicator(WrappedCommunicator):
    """Logs every collective this rank issues, in issue order, from whichever thread."""

    def __init__(self, inner: Communicator) -> None:
        super().__init__(inner)
        self.log: list[Any] = []
        self._lock = threading.Lock()

    def _note(self, *what: Any) -> None:
        with self._lock:
            self.log.append(what)

    def reduce_scatter(self, input: torch.Tensor, output: torch.Tensor) -> Work:
        self._note("rs", input.numel())
        return self.inner.reduce_scatter(input, output)

    def pieces_in_place(self, tensor: torch.Tensor) -> bool:
        return self.inner.pieces_in_place(tensor)

    def reduce_scatter_columns(self, input: torch.Tensor, output: torch.Tensor, start: int,
                               length: int) -> Work:
        self._note("rs-piece", input.numel(), start, length)
        return self.inner.reduce_scatter_columns(input, output, start, length)

    def all_gather(self, input: torch.Tensor, output: torch.Tensor) -> Work:
        self._note("ag", output.numel())
        return self.inner.all_gather(input, output)

    def all_gather_columns(self, input: torch.Tensor, output: torch.Tensor, start: int,
                           length: int) -> Work:
        self._note("ag-chunk", output.numel(), start, length)
        return self.inner.all_gather_columns(input, output, start, length)

    def all_reduce(self, tensor: torch.Tensor) -> Work:
        self._note("ar", tensor.numel())
        return self.inner.all_reduce(tensor)

    def broadcast(self, tensor: torch.Tensor, root: int) -> Work:
        self._note("bc", tensor.numel())
        return self.inner.broadcast(tensor, root)

    def broadcast_object(self, obj: Any, root: int) -> Any:
        self._note("bco")
        return self.inner.broadcast_object(obj, root)

    def all_gather_object(self, obj: Any) -> list[Any]:
        self._note("ago")
        return self.inner.all_gather_object(obj)


def record_collectives() -> RecordingCommunicator:
    """After dear.init(): every collective of this rank from now on goes through a recorder."""
    inner = dear.comm.runtime.current_communicator()
    recorder = RecordingCommunicator(inner)
    assert dear.comm.runtime.replace_communicator(inner, recorder)
    return recorder


def _slow_in_backward(module: torch.nn.Module, seconds: float) -> None:
    module.register_full_backward_pre_hook(lambda *_: time.sleep(seconds))


def _planned_run(forced: bool, relayout_at: int, mode: str = "thread", device: str = "cpu",
                 check_factor: float = 0.0) -> dict:
    """Adam on make_net() with the planned schedule; rank 1's fc1 backward is slow, the branch
    runs on some ranks only. `forced`: after every bucket's reduce-scatter, gather all of that
    bucket in 3-column chunks (the most chunks in backward any plan can have). `mode` "stream":
    the GPU's way of issuing (the training thread issues the chunks, dear/fusion/schedule.py),
    here on CPU tensors, where the side stream is the host itself. `check_factor`: the probe
    finds a link of 1 byte/s (no chunk fits) and the check a link `check_factor` x as slow."""
    if check_factor:
        schedule = dear.fusion.schedule
        schedule.probe_link = lambda *args, **kwargs: _link(0.0, 1.0, 0.0, 1.0)
        schedule.ScheduleDriver._factor = lambda *args: check_factor
    init_in_issue_mode(mode, device)
    rank, world = dear.rank(), dear.size()
    recorder = record_collectives()
    model = make_net().to(device)
    if rank == 1:
        _slow_in_backward(model.fc1, 0.02)
    opt = dear.DistributedOptimizer(OPTIMIZERS["adam"](model.parameters()), model=model,
                                    fusion_threshold=1024, schedule="planned")
    chunks_in_backward, plans, num_chunks = 0, 0, []
    for step in range(STEPS):
        if step == relayout_at:                # what the autotuner does between steps
            opt.flush_updates()
            opt.dear_engine.relayout(FusionConfig.single(512))
        if forced and opt.dear_engine.buckets is not None and opt.dear_engine.schedule.plan is None:
            opt.dear_engine.schedule.plan = Plan(after={
                b.spec.index: tuple((b.spec.index, s, n)
                                    for s, n in chunk_columns(b.spec.shard_numel, 3))
                for b in opt.dear_engine.buckets if b.spec.index > 0})
        opt.zero_grad()
        x, y = (t.to(device) for t in batch(step, world, rank))
        F.mse_loss(model(x, branch_used(step, rank)), y).backward()
        before = len(recorder.log)
        opt.step()
        chunks_in_backward += sum(1 for e in recorder.log[:before] if e[0] == "ag-chunk")
        plans += opt.dear_engine.schedule.plan is not None
        plan = opt.dear_engine.schedule.plan
        num_chunks.append(None if plan is None else plan.num_chunks)
    opt.flush_updates()
    params = {k: v.cpu() for k, v in state_of(model).items()}
    out = {"params": params, "log": list(recorder.log), "plans": plans, "num_chunks": num_chunks,
           "chunks_in_backward": chunks_in_backward, "buckets": len(opt.dear_engine.buckets),
           "pieces": sum(1 for e in recorder.log if e[0] == "rs-piece")}
    dear.shutdown()
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_forced_plan_same_order_everywhere_and_same_training(world: int) -> None:
    ranks = run_distributed(_planned_run, world, True, -1, timeout=180,
                            env={"DEAR_PLAN_AFTER": "100"})
    ref = reference("adam", world, STEPS, branch=True)
    for rank, res in enumerate(ranks):
        assert res["chunks_in_backward"] > 0, "no all-gather chunk was issued in backward"
        # fc1's weight (3 KB) is larger than a bucket (1 KB): its reduce-scatter is in pieces
        assert res["pieces"] >= 3 * STEPS, "a parameter larger than a bucket went whole"
        assert res["log"] == ranks[0]["log"], f"rank {rank} issued another collective order"
        scale = max(v.abs().max().item() for v in ref.values())
        assert max_diff(res["params"], ref) <= 1e-6 * scale
    assert max_diff(ranks[0]["params"], ranks[1]["params"]) == 0.0


def test_gpu_issue_mode_same_order_everywhere_and_same_training() -> None:
    """The planned schedule as it runs on CUDA tensors, the chunks issued by the training
    thread: forced chunks, then a measured plan after a new layout."""
    _check_stream_mode("cpu", {}, torch.float32, 1e-6, timeout=180)


def _check_stream_mode(device: str, env: dict, ref_dtype: torch.dtype, tol: float,
                       timeout: float) -> None:
    """Forced chunks, then a measured plan after a new layout, in the "stream" mode on 2
    ranks: the same order everywhere, the single-process reference's parameters."""
    forced = run_distributed(_planned_run, 2, True, -1, "stream", device, timeout=timeout,
                             env={**env, "DEAR_PLAN_AFTER": "100"})
    measured = run_distributed(_planned_run, 2, False, 4, "stream", device, timeout=timeout,
                               env={**env, "DEAR_PLAN_AFTER": "2"})
    ref = reference("adam", 2, STEPS, branch=True, dtype=ref_dtype)
    scale = max(v.abs().max().item() for v in ref.values())
    for ranks in (forced, measured):
        for res in ranks:
            assert res["log"] == ranks[0]["log"], "the ranks issued different orders"
            assert max_diff(res["params"], ref) <= tol * scale
    assert all(res["chunks_in_backward"] > 0 for res in forced)
    assert all(res["plans"] >= 3 for res in measured)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_issue_mode_on_cuda_tensors() -> None:
    """The same on CUDA tensors, the chunks' waits and averaging on the side stream, the plan
    timed by CUDA events (two ranks share the one GPU through Gloo's CUDA collectives, which
    order streams as NCCL's do)."""
    _check_stream_mode("cuda", {"DEAR_GLOO_COLLECTIVES": "native"}, torch.float64, 1e-5,
                       timeout=240)


def test_measured_plan_and_a_new_layout_mid_run() -> None:
    """The plan comes from rank 0's measured backward and a link probe at the same step
    everywhere; a new layout (step 4) drops it and is planned again 2 steps later."""
    ranks = run_distributed(_planned_run, 2, False, 4, timeout=180,
                            env={"DEAR_PLAN_AFTER": "2"})
    ref = reference("adam", 2, STEPS, branch=True)
    scale = max(v.abs().max().item() for v in ref.values())
    for res in ranks:
        assert res["log"] == ranks[0]["log"]
        assert res["plans"] >= 3               # planned in the first layout and in the second
        assert max_diff(res["params"], ref) <= 1e-6 * scale


def test_plan_checked_against_the_link_and_made_again() -> None:
    """After the plan has run plan_after iterations, rank 0 checks it against the tail it
    measured and plans again where the link was off: here the probe finds a link so slow that
    no chunk fits, the check one 10^9 x faster (every chunk fits rank 0's short gaps). The new
    plan reaches every rank at the same step; orders and training stay exact."""
    ranks = run_distributed(_planned_run, 2, False, -1, "thread", "cpu", 1e-9,
                            timeout=180, env={"DEAR_PLAN_AFTER": "2"})
    ref = reference("adam", 2, STEPS, branch=True)
    scale = max(v.abs().max().item() for v in ref.values())
    seen = ranks[0]["num_chunks"]
    assert 0 in seen and seen[-1] > 0 and seen.index(0) < seen.index(seen[-1]), seen
    for res in ranks:
        assert res["num_chunks"] == seen and res["log"] == ranks[0]["log"]
        assert res["chunks_in_backward"] > 0
        assert max_diff(res["params"], ref) <= 1e-6 * scale


VERIFY_STEPS = 22   # learn 2, planned 2 (its check), 3 x (2 in DeAR's order, 2 planned), decided


def _verified_run(planned_step_s: float, host_bound: bool, sharded: bool = False) -> dict:
    """Adam with the planned schedule under a virtual clock between step()s: each iteration
    takes 1 s in DeAR's order and `planned_step_s` while a plan is in force. `host_bound`: the
    probe finds a link so fast that every chunk fits, whose collectives cost the host a core,
    on a rank of almost no cores (plan.contention 1). `sharded`: shard_optimizer_state (the
    chunks carry parameters updated early)."""
    schedule = dear.fusion.schedule
    now = [0.0]
    schedule._now = lambda: now[0]
    if host_bound:
        fast = dataclasses.replace(_link(0.0, 1e15, 0.0, 1e15), host_share=1.0)
        schedule.probe_link = lambda *args, **kwargs: fast
        schedule.cores_per_rank = lambda: 1e-3
    dear.init()
    rank, world = dear.rank(), dear.size()
    recorder = record_collectives()
    model = make_net()
    opt = dear.DistributedOptimizer(OPTIMIZERS["adam"](model.parameters()), model=model,
                                    fusion_threshold=1024, schedule="planned",
                                    shard_optimizer_state=sharded)
    driver = opt.dear_engine.schedule
    plans, threaded = [], []
    for step in range(VERIFY_STEPS):
        now[0] += planned_step_s if driver.active else 1.0
        opt.zero_grad()
        x, y = batch(step, world, rank)
        F.mse_loss(model(x), y).backward()
        opt.step()
        plans.append(driver.plan is not None)
        threaded.append(schedule.planned_somewhere())
    opt.flush_updates()
    out = {"params": state_of(model), "plans": plans, "threaded": threaded,
           "log": list(recorder.log)}
    dear.shutdown()
    return out


@pytest.mark.parametrize("planned_step_s,verify,kept,sharded", [
    (2.0, "1", False, False), (0.5, "1", True, False), (2.0, "0", True, False),
    (2.0, "1", False, True), (0.5, "1", True, True)])
def test_a_plan_slower_than_dears_order_is_dropped(planned_step_s: float, verify: str,
                                                   kept: bool, sharded: bool) -> None:
    """DEAR_PLAN_VERIFY=1 (off by default; a virtual clock, so no timing): after its check the
    plan alternates with DeAR's order (backward's collectives then issued by the training
    thread), three windows of each, and is kept only if its iterations were faster, on every
    rank at the same step; with the check off a slower plan runs on. Training equals the
    single process either way, with shard_optimizer_state too (its early updates come and go
    with the plan)."""
    ranks = run_distributed(_verified_run, 2, planned_step_s, False, sharded, timeout=180,
                            env={"DEAR_PLAN_AFTER": "2", "DEAR_PLAN_VERIFY": verify})
    ref = reference("adam", 2, VERIFY_STEPS)
    scale = max(v.abs().max().item() for v in ref.values())
    for res in ranks:
        plans, threaded = res["plans"], res["threaded"]
        assert res["log"] == ranks[0]["log"]
        assert plans == ranks[0]["plans"] and threaded == ranks[0]["threaded"]
        assert max_diff(res["params"], ref) <= 1e-6 * scale
        assert plans.count(True) >= 2, plans                   # a plan was made and ran
        first = plans.index(True)
        held = [k for k in range(first, len(plans)) if not plans[k]]
        if verify == "0":
            assert not held and threaded[-1], res
            continue
        # held back in 3 windows of DeAR's order (then, dropped, for good), on one thread
        windows = sum(1 for k in held if k - 1 not in held)
        assert windows == 3 + (not kept) and not any(threaded[k] for k in held), res
        assert plans[-1] == kept and threaded[-1] == kept, res


@pytest.mark.parametrize("contention,planned", [("0.5", False), ("1", True)])
def test_a_host_bound_link_keeps_dears_order(contention: str, planned: bool) -> None:
    """Where the chunks' link time would come out of backward's compute (a link whose
    collectives cost the host a core, a rank with no spare core: contention 1), rank 0 makes no
    plan: DeAR's order on every rank (no chunk, nothing on the collective thread), unless
    DEAR_PLAN_CONTENTION allows it. Training equals the single process either way."""
    ranks = run_distributed(_verified_run, 2, 1.0, True, timeout=180,
                            env={"DEAR_PLAN_AFTER": "2", "DEAR_PLAN_CONTENTION": contention})
    ref = reference("adam", 2, VERIFY_STEPS)
    scale = max(v.abs().max().item() for v in ref.values())
    for res in ranks:
        assert res["log"] == ranks[0]["log"] and res["plans"] == ranks[0]["plans"]
        assert max_diff(res["params"], ref) <= 1e-6 * scale
        chunks = sum(1 for e in res["log"] if e[0] == "ag-chunk")
        assert any(res["plans"]) == planned and (chunks > 0) == planned, res
        assert any(res["threaded"]) == planned, res


def test_settling_counts_the_check_and_the_trial() -> None:
    """What the online autotuner waits for after each new layout before timing it: plan_after
    measured, as many planned before the check, and with DEAR_PLAN_VERIFY the trial's 3
    windows of each schedule (on CPU tensors; on a GPU there is no trial)."""
    comm = SimpleNamespace(size=2)
    assert ScheduleDriver(lambda: comm, True, 4, 1 << 20, "stream").settling_iterations == 8
    assert ScheduleDriver(lambda: comm, True, 4, 1 << 20, "stream",
                          verify=True).settling_iterations == 8
    assert ScheduleDriver(lambda: comm, True, 3, 1 << 20, "thread",
                          verify=True).settling_iterations == 24


def _two_optimizers() -> dict:
    """Two dear optimizers on one model (half the parameters each), both planned: their
    backward collectives share one executor, so one order on every rank."""
    dear.init()
    rank, world = dear.rank(), dear.size()
    model = make_net()
    named = list(model.named_parameters())
    opts = [dear.DistributedOptimizer(OPTIMIZERS["adam"]([p for _, p in part]),
                                      named_parameters=part, model=model, fusion_threshold=512)
            for part in (named[:6], named[6:])]
    for step in range(STEPS):
        for opt in opts:
            opt.zero_grad()
        x, y = batch(step, world, rank)
        F.mse_loss(model(x), y).backward()
        for opt in opts:
            opt.step()
    for opt in opts:
        opt.flush_updates()
    out = {"params": state_of(model),
           "plans": [o.dear_engine.schedule.plan is not None for o in opts]}
    dear.shutdown()
    return out


def test_two_optimizers_share_one_order() -> None:
    ranks = run_distributed(_two_optimizers, 2, timeout=180, env={"DEAR_PLAN_AFTER": "2"})
    ref = reference("adam", 2, STEPS)
    scale = max(v.abs().max().item() for v in ref.values())
    for res in ranks:
        assert res["plans"] == [True, True]
        assert max_diff(res["params"], ref) <= 1e-6 * scale
    assert max_diff(ranks[0]["params"], ranks[1]["params"]) == 0.0
