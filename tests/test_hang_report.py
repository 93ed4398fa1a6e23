"""The hang report (dear/comm/hang.py): when a collective fails, every surviving rank says which
rank did not issue it and what each rank last issued, and writes it where `python -m dear.diagnose
hang` shows it. The reference is the fault each test causes itself: which rank stalls, dies or
takes another branch, and where."""

from __future__ import annotations

import glob
import os
import re
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import dear
from dear.comm.flight import FlightRecord, mark
from dear.comm.hang import HangReporter, compose
from tests.distributed import run_distributed
from tests.workloads import batch, make_net

TIMEOUT = 3.0                                  # DEAR_TIMEOUT in these tests
FAULT_STEP = 3


# --------------------------------------------------------------------- the text, by hand
def _record(issued: int, beat: int, recent: list[tuple[int, str, int]], failed=None) -> dict:
    return {"issued": issued, "completed": issued - 1, "beat": beat, "failed": failed,
            "recent": [{"seq": s, "kind": k, "bytes": b, "iteration": 7, "phase": "backward",
                        "what": "bucket 2 (3 parameters)", "done": False}
                       for s, k, b in recent]}


def _failed(seq: int, kind: str, nbytes: int) -> FlightRecord:
    mark("backward", 7)
    rec = FlightRecord(seq, kind, torch.zeros(nbytes // 4))
    return rec


def test_a_rank_that_stopped_short_is_named_with_what_it_last_issued() -> None:
    rec = _failed(10, "reduce_scatter", 64)
    me = _record(10, 5, [(9, "all_gather", 64), (10, "reduce_scatter", 64)], failed={"seq": 10})
    slow = _record(9, 4, [(9, "all_gather", 64)])
    text = compose(0, range(3), rec, {0: me, 1: _record(10, 9, [(10, "reduce_scatter", 64)],
                                                 failed={"seq": 10}),
                               2: dict(slow, beat=6)}, {1: dict(me, beat=8), 2: slow}, True)
    assert "Rank(s) that did not issue it: 2." in text, text
    assert "rank 2: did NOT issue #10; its last was #9 all_gather" in text, text
    assert "rank 1: issued #10 too" in text and "also failed" in text, text


def test_a_rank_whose_heartbeat_stopped_is_not_responding() -> None:
    rec = _failed(10, "reduce_scatter", 64)
    dead = _record(8, 3, [(8, "all_gather", 64)])
    text = compose(0, range(2), rec, {0: _record(10, 5, []), 1: dead}, {1: dead}, True)
    assert "Rank(s) not responding: 1." in text and "NOT RESPONDING" in text, text
    text = compose(0, range(2), rec, {0: _record(10, 5, [])}, {}, True)
    assert "Rank(s) not responding: 1." in text and "published no record" in text, text


def test_a_not_responding_ranks_record_says_how_old_it_is() -> None:
    """A record published long before the report (a training rank publishes every 10 s) is
    never presented as the rank's last state without its age."""
    rec = _failed(10, "reduce_scatter", 64)
    me = dict(_record(10, 5, []), published=1000.0, host="a")
    dead = dict(_record(0, 3, []), published=991.7, host="a")
    text = compose(0, range(2), rec, {0: me, 1: dead}, {1: dead}, True)
    assert "its last record, published 8.3 s before this report, had issued up to #0" in text, \
        text
    assert "it may have issued more since" in text, text
    text = compose(0, range(2), rec, {0: me, 1: dict(dead, host="b")}, {1: dead}, True)
    assert "published 8.3 s before this report by the two hosts' clocks" in text, text
    text = compose(0, range(2), rec, {0: me, 1: _record(0, 3, [])}, {1: dead}, True)
    assert "its last record, of unknown age," in text, text


def test_another_collective_in_the_same_place_is_a_different_branch() -> None:
    rec = _failed(10, "all_reduce", 4)
    other = _record(11, 4, [(10, "reduce_scatter", 64), (11, "reduce_scatter", 64)],
                    failed={"seq": 11})
    text = compose(0, range(2), rec, {0: _record(10, 5, []), 1: other}, {1: dict(other, beat=3)},
                   True)
    assert "issued another collective in its place: 1" in text, text
    assert "issued #10 as #10 reduce_scatter of 64 B" in text, text


def test_without_a_store_the_report_says_so() -> None:
    text = compose(0, range(2), _failed(3, "all_reduce", 4), {0: _record(3, 1, [])}, {}, False)
    assert "could not be read" in text, text


# --------------------------------------------------------------------- real faults
def _training(fault: str, faulty: int, marker: str) -> dict:
    """Train; rank `faulty` stalls, dies or skips a collective at FAULT_STEP. Returns this
    rank's error text, or None if it trained to the end."""
    dear.init()
    rank = dear.rank()
    model = make_net()
    precond = None
    if fault == "stalls-in-kfac":
        # dear.KFAC's collectives alone after the start (no DDP, whose unrecorded all-reduce
        # could be the first to time out): the report must come from KFAC's own groups
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        precond = dear.KFAC(model, strategy="comm-opt", inv_update_steps=1)
    else:
        opt = dear.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        model=model, fusion_threshold=2048)
    try:
        for step in range(12):
            if step == FAULT_STEP and rank == faulty and fault in ("stalls", "dies"):
                _fault(fault, marker)
            opt.zero_grad()
            x, y = batch(step, dear.size(), rank)
            loss = F.mse_loss(model(x), y)
            loss.backward()
            if precond is not None:
                # after its backward, before dear.KFAC's own collectives of this step
                if step == FAULT_STEP and rank == faulty:
                    _fault("stalls", marker)
                precond.step()
            opt.step()
            if fault == "stalls-in-logging":    # every rank logs the average loss
                if step == FAULT_STEP and rank == faulty:
                    _fault("stalls", marker)
                dear.allreduce(loss.detach())
            # A logging branch only rank 0 takes (the classic mistake): its all-reduce has no
            # partner; rank 1's next reduce-scatter comes in its place.
            if fault == "branch" and step == FAULT_STEP and rank != faulty:
                dear.allreduce(loss.detach())
    except Exception as exc:
        open(f"{marker}.seen{rank}", "w").close()
        return {"error": str(exc)}
    return {"error": None}


def _fault(fault: str, marker: str) -> None:
    open(marker, "w").close()
    if fault == "dies":
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.time()                         # until every survivor has given up on it
    while len(glob.glob(marker + ".seen*")) < dear.size() - 1 and time.time() < start + 60:
        time.sleep(0.05)
    os._exit(0)


def _run(fault: str, world: int, faulty: int, tmp_path) -> tuple[list, str]:
    hang_dir = str(tmp_path / "hang")
    outcomes = run_distributed(_training, world, fault, faulty, str(tmp_path / "fault"),
                               timeout=90, expect_failure=True,
                               env={"DEAR_TIMEOUT": str(TIMEOUT), "DEAR_HANG_REPORT": hang_dir})
    return outcomes, hang_dir


def _shown(hang_dir: str) -> str:
    jobs = glob.glob(os.path.join(hang_dir, "*"))
    assert len(jobs) == 1, jobs
    done = subprocess.run([sys.executable, "-m", "dear.diagnose", "hang", jobs[0]],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_stalled_rank_is_named_by_every_survivor(tmp_path) -> None:
    outcomes, hang_dir = _run("stalls", 3, 2, tmp_path)
    for rank in (0, 1):
        error = outcomes[rank]["error"]
        assert error is not None, f"rank {rank} trained on past a stalled peer"
        assert "Rank(s) that did not issue it: 2." in error, error
        assert "rank 2: did NOT issue" in error and "alive, busy outside" in error, error
        assert f"(iteration {FAULT_STEP}, step" in error, error   # its last: step 3's gather
    shown = _shown(hang_dir)
    assert shown.count("dear hang report from rank") == 2, shown


def test_a_dead_rank_is_named_not_responding(tmp_path) -> None:
    outcomes, hang_dir = _run("dies", 2, 1, tmp_path)
    error = outcomes[0]["error"]
    assert error is not None and "Rank(s) not responding: 1." in error, error
    assert "dear hang report from rank 0" in _shown(hang_dir)


def test_a_collective_only_one_rank_issues_is_named_as_a_different_branch(tmp_path) -> None:
    """Rank 0 all-reduces its loss at step 3, rank 1 does not: the ranks' streams part there."""
    outcomes, _ = _run("branch", 2, 1, tmp_path)
    errors = [o["error"] for o in outcomes]
    assert all(e is not None for e in errors), errors
    assert "all_reduce of 4 B" in errors[0] and "(iteration 4, dear.allreduce" in errors[0]
    assert "issued another collective in its place: 1" in errors[0], errors[0]
    assert "issued another collective in its place: 0" in errors[1], errors[1]


def test_dear_allreduce_on_a_stalled_peer_names_it(tmp_path) -> None:
    """It used to say only "Operation timed out!"."""
    outcomes, _ = _run("stalls-in-logging", 2, 1, tmp_path)
    error = outcomes[0]["error"]
    assert error is not None and "Rank(s) that did not issue it: 1." in error, error
    assert f"all_reduce of 4 B (iteration {FAULT_STEP + 1}, dear.allreduce" in error, error


def test_a_peer_stalled_before_dear_kfac_s_collectives_is_named(tmp_path) -> None:
    """dear.KFAC's collectives go on process groups of its own, with a flight record of their
    own (their sequence numbers are not dear's communicator's): the report names the stream.
    Rank 1 stalls after its backward, before dear.KFAC's step exchanges the factors."""
    outcomes, hang_dir = _run("stalls-in-kfac", 2, 1, tmp_path)
    error = outcomes[0]["error"]
    assert error is not None, "rank 0 trained on past a stalled peer"
    assert "on dear.KFAC's group failed." in error, error
    # KFAC's step count labels it (no dear optimizer): this step's or the next one's exchange
    assert re.search(rf"\(iteration ({FAULT_STEP}|{FAULT_STEP + 1}), dear\.KFAC\.step, "
                     r"not complete\) on dear\.KFAC's group", error), error
    assert "Rank(s) that did not issue it: 1." in error, error
    assert "rank 1: did NOT issue" in error and "alive, busy outside" in error, error
    assert "dear hang report from rank 0" in _shown(hang_dir)


class _WorldMovesOn:
    """A store in which rank 0 reaches the meeting and goes on (its key set, then a record
    that it issued more) right after the reporter's first existence check."""

    def __init__(self, meeting: str, went_on: bool) -> None:
        self.inner = torch.distributed.HashStore()
        self.meeting, self.went_on, self.checks = meeting, went_on, 0

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def check(self, keys: list) -> bool:
        answer = self.inner.check(keys)
        self.checks += 1
        if self.checks == 1:
            if not self.went_on:                    # rank 0 met: key first, then its record
                self.inner.set(f"dear/meet/{self.meeting}/rank0", "5")
            self.inner.set("dear/flight/rank0", '{"issued": 9}')
        return answer


@pytest.mark.parametrize("went_on", [False, True])
def test_a_rank_that_met_and_went_on_is_not_taken_for_one_gone(went_on: bool) -> None:
    """meet() reads the records before the keys: a rank that set its key and then issued more
    between the two reads is one that came (read the other way round it was called gone:
    seen on a busy CI machine); one that issued more without coming is gone."""
    comm = SimpleNamespace(size=2, rank=1, recorder=SimpleNamespace(issued=5),
                           channel=SimpleNamespace(on_failure=None))
    reporter = HangReporter(comm, _WorldMovesOn("m", went_on), interval=3600)  # type: ignore
    try:
        assert reporter.meet("m", timeout=5) == ([0] if went_on else [])
    finally:
        reporter.close()
