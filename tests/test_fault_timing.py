"""How fast a fault ends the other ranks (tests/conftest.py marks this module serial: its
assertions read how soon a kill or a stall is noticed, which a machine busy with another
module's ranks stretches by seconds).

- A rank that dies or stalls: the other rank raises an error naming the collective and the bucket,
  within DEAR_TIMEOUT, on the torch (Gloo) backend and on the Horovod backend; time to error is
  measured from the moment the rank died or stalled.
- A rank that never joins a collective (dear's object broadcast on a user's group with torch's
  30-minute default, dear.horovod's agreement round): the other fails within DEAR_TIMEOUT.
- The survivor's process ends too, under torchrun and horovodrun, with a frozen peer included.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest
import torch
import torch.nn.functional as F

import dear
from tests.distributed import run_distributed, wait_for_file
from tests.horovod_launch import run_horovod
from tests.workloads import batch, make_net, max_diff, state_of

TIMEOUT = 3.0                                  # DEAR_TIMEOUT in the fault tests
LOAD_MARGIN = 10.0                             # seconds a loaded machine may add to a timing


# --------------------------------------------------------------------- dead or stalled rank
def _start_together(marker: str) -> None:
    """Every rank at the optimizer's first collective together: on a busy 2-core machine one
    rank's start-up can outlast the short DEAR_TIMEOUT (seen: rank 0 timed out in the
    optimizer's setup all_gather_object while rank 1 was still starting), which is not the
    fault these tests inject."""
    open(f"{marker}.ready{dear.rank()}", "w").close()
    for r in range(dear.size()):
        wait_for_file(f"{marker}.ready{r}", 60)


def _faulty_training(fault: str, marker: str) -> dict:
    """Rank 1 dies (SIGKILL) or stalls at step 3; rank 0 reports its error and how long after
    the fault (rank 1 writes the time to `marker`) it came, and its parameters after the 3 good
    steps (AMP and clipping: the same bits on both backends)."""
    rank = dear.rank()
    model = make_net()
    _start_together(marker)
    opt = dear.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                                    fusion_threshold=2048)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    good = None
    try:
        for step in range(20):
            if step == 3 and rank == 1:
                stalled = time.time()
                with open(marker, "w") as fh:
                    fh.write(repr(stalled))
                if fault == "dies":
                    os.kill(os.getpid(), signal.SIGKILL)
                wait_for_file(marker + ".seen", 30)   # stalls until rank 0 gave up on it
                os._exit(0)
            opt.zero_grad()
            x, y = batch(step, dear.size(), rank)
            scaler.scale(F.mse_loss(model(x), y)).backward()
            opt.clip_grad_norm_(0.5, grad_scaler=scaler)
            scaler.step(opt)
            scaler.update()
            if step == 2:
                opt.flush_updates()
                good = state_of(model)
    except Exception as exc:
        failed = time.time()
        open(marker + ".seen", "w").close()
        with open(marker) as fh:
            return {"error": str(exc), "after": failed - float(fh.read()), "params": good}
    return {"error": None}


def _torch_fault(fault: str, marker: str) -> dict:
    dear.init()
    return _faulty_training(fault, marker)


def _three_good_steps(world: int = 2) -> dict:
    """The reference for the steps before the fault: one process, the global batch, torch's
    GradScaler and clip_grad_norm_."""
    model = make_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    for step in range(3):
        opt.zero_grad()
        x, y = batch(step, world)
        scaler.scale(F.mse_loss(model(x), y)).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        scaler.step(opt)
        scaler.update()
    return state_of(model)


def _check_fault(result: dict, fault: str, hops: int = 1) -> None:
    assert result["error"] is not None, "rank 0 trained on although rank 1 was gone"
    assert "dear: " in result["error"] and "of bucket" in result["error"], result["error"]
    assert "reduce-scatter" in result["error"] or "all-gather" in result["error"]
    if fault == "stalls":                      # in a ring, the wait may pass through a rank
        # Not before the timeout; after it, within a margin a loaded 2-core machine keeps
        # (a rank descheduled for seconds), far below what no timeout would give (the ranks'
        # 60 s deadline; Gloo's own default is 30 minutes).
        assert TIMEOUT - 0.5 < result["after"] < hops * TIMEOUT + LOAD_MARGIN, result
    else:
        assert result["after"] < TIMEOUT, result


@pytest.mark.parametrize("fault", ["dies", "stalls"])
def test_torch_backend_fails_within_the_timeout(fault: str, tmp_path) -> None:
    marker = str(tmp_path / "fault")
    outcomes = run_distributed(_torch_fault, 2, fault, marker, timeout=60, expect_failure=True,
                               env={"DEAR_TIMEOUT": str(TIMEOUT)})
    print(f"torch backend, rank 1 {fault}: rank 0 failed {outcomes[0]['after']:.2f} s later")
    _check_fault(outcomes[0], fault)
    assert max_diff(outcomes[0]["params"], _three_good_steps()) < 1e-6


@pytest.mark.parametrize("fault", ["dies", "stalls"])
def test_torch_backend_fails_within_the_timeout_on_three_ranks(fault: str, tmp_path) -> None:
    """With 3 ranks the exchange is a ring driven by its own thread: rank 0 never talks to
    rank 1 directly after the first step, and still fails, naming the bucket."""
    marker = str(tmp_path / "fault")
    outcomes = run_distributed(_torch_fault, 3, fault, marker, timeout=60, expect_failure=True,
                               env={"DEAR_TIMEOUT": str(TIMEOUT)})
    print(f"torch backend, 3 ranks, rank 1 {fault}: rank 0 failed "
          f"{outcomes[0]['after']:.2f} s later")
    _check_fault(outcomes[0], fault, hops=2)
    assert max_diff(outcomes[0]["params"], _three_good_steps(3)) < 1e-6


@pytest.mark.parametrize("fault", ["dies", "stalls"])
def test_horovod_backend_fails_within_the_timeout(fault: str, tmp_path) -> None:
    out, marker = str(tmp_path / "result.pt"), str(tmp_path / "fault")
    os.environ["DEAR_TIMEOUT"] = str(TIMEOUT)
    try:
        run_horovod(["-m", "tests.test_fault_timing", fault, marker, out], np=2, timeout=90)
    except AssertionError as exc:              # rank 1's SIGKILL; rank 0 must not have hung
        assert fault == "dies" and "rank 1 failed (exit -9)" in str(exc), str(exc)
    finally:
        del os.environ["DEAR_TIMEOUT"]
    result = torch.load(out)
    print(f"Horovod backend, rank 1 {fault}: rank 0 failed {result['after']:.2f} s later")
    _check_fault(result, fault)
    assert max_diff(result["params"], _three_good_steps()) < 1e-6   # AMP + clip on Horovod


def _horovod_main(fault: str, marker: str, out: str) -> None:
    import horovod.torch as hvd
    hvd.init()
    dear.init()
    result = _faulty_training(fault, marker)
    if hvd.rank() == 0:
        torch.save(result, out)
    sys.exit(0)


if __name__ == "__main__":
    _horovod_main(*sys.argv[1:4])


# --------------------------------------------------------------------- a peer that never joins
def _nobody_joins(kind: str, done: str) -> dict:
    """Rank 1 never joins rank 0's collective: dear's object broadcast on the user's own process
    group, made with torch's 30-minute default (`broadcast`), or dear.horovod's agreement round
    (`agreement`). Rank 0 reports its error and how long it waited; rank 1 stays alive (its exit
    would end the collective early) until rank 0 is done, or 60 s, and says whether it was."""
    import datetime

    import torch.distributed as dist
    if kind == "broadcast":
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=30))
        dear.init()
    else:
        import dear.horovod as hvd
        hvd.init()
    _start_together(done)
    if dear.rank() == 1:
        return {"peer_alive": wait_for_file(done, 60)}
    start = time.monotonic()
    error: "tuple[str, str] | None" = None
    try:
        if kind == "broadcast":
            dear.comm.runtime.communicator().broadcast_object({"plan": 1}, 0)
        else:
            hvd.allreduce(torch.ones(2))
    except Exception as exc:                     # noqa: BLE001 - the error is the result
        error = (type(exc).__name__, str(exc))
    elapsed = time.monotonic() - start
    open(done, "w").close()
    return {"error": error, "elapsed": elapsed}


@pytest.mark.parametrize("kind", ["broadcast", "agreement"])
def test_a_collective_nobody_joins_fails_within_the_timeout(kind: str, tmp_path) -> None:
    """Rank 0 fails while rank 1 is still alive (so not because it left), not before
    DEAR_TIMEOUT and within it plus the module's margin for a loaded machine: without the
    timeout it would wait for rank 1's exit (60 s) or torch's 30 minutes."""
    ranks = run_distributed(_nobody_joins, 2, kind, str(tmp_path / "done"), timeout=120,
                            env={"DEAR_TIMEOUT": str(TIMEOUT)})
    zero = ranks[0]
    print(f"{kind}: rank 0 failed after {zero['elapsed']:.2f} s")
    assert zero["error"] is not None, "the collective returned without rank 1"
    if kind == "agreement":
        assert zero["error"][0] == "HorovodInternalError", zero["error"]
        assert "agreement round" in zero["error"][1], zero["error"]
    assert ranks[1]["peer_alive"], "rank 0 failed only when rank 1 left"
    assert TIMEOUT - 0.5 < zero["elapsed"] < TIMEOUT + LOAD_MARGIN, zero


@pytest.mark.parametrize("case", ["user-group", "kfac"])
def test_the_survivor_of_a_stalled_peer_leaves_its_process(case: str) -> None:
    """Not only the exception: the process itself must end. A collective on a group made with
    torch's 30-minute default (the user's, Lightning's, dear.KFAC's own) held Gloo's worker
    thread, and so the process after it raised, for those 30 minutes. Now the Gloo operation
    itself is bounded by DEAR_TIMEOUT (5 s here); the bound below leaves a minute for a busy
    machine's teardown (measured: 0.6-1.5 s after the error, benchmarks/results/fault_exit.md)."""
    from benchmarks.fault_exit import _measure
    result = _measure(case, "stalls", 5.0)
    assert result.get("raised_s") is not None, result
    assert result["exited_s"] is not None and result["exited_s"] < 5.0 + 60, result


def test_a_frozen_peer_under_horovodrun_does_not_hold_the_survivor() -> None:
    """A peer frozen in backward (SIGSTOP: none of its threads runs, as in a stuck driver call)
    under horovodrun: rank 0's process lived until Horovod's own 30 s Gloo timeout ended the
    wait inside its shutdown (measured 31.0 s after the fault). dear now sets that timeout from
    DEAR_TIMEOUT (5 s + 3 here; measured 9.0 s); the bound leaves a busy machine's teardown well
    below the 30 s it would take without."""
    from benchmarks.fault_exit import _measure
    result = _measure("horovod", "frozen", 5.0)
    assert result.get("raised_s") is not None, result
    assert result["rank0_exited_s"] is not None and result["rank0_exited_s"] < 25.0, result


def test_horovods_gloo_timeout_follows_dear_timeout() -> None:
    from dear.comm.launch import HOROVOD_GLOO_SLACK, align_horovod_timeout
    env = {"HOROVOD_RANK": "0", "DEAR_TIMEOUT": "4.5"}
    align_horovod_timeout(environ=env)
    assert env["HOROVOD_GLOO_TIMEOUT_SECONDS"] == str(5 + HOROVOD_GLOO_SLACK)
    mine = {"HOROVOD_RANK": "0", "DEAR_TIMEOUT": "5", "HOROVOD_GLOO_TIMEOUT_SECONDS": "60"}
    align_horovod_timeout(environ=mine)                 # the user's setting wins
    assert mine["HOROVOD_GLOO_TIMEOUT_SECONDS"] == "60"
    for env in ({"DEAR_TIMEOUT": "5"}, {"HOROVOD_RANK": "0"}):  # not horovodrun; no timeout
        align_horovod_timeout(environ=env)
        assert "HOROVOD_GLOO_TIMEOUT_SECONDS" not in env
    env = {"HOROVOD_RANK": "1"}
    align_horovod_timeout(7.0, environ=env)              # dear.init(timeout=...) starting Horovod
    assert env["HOROVOD_GLOO_TIMEOUT_SECONDS"] == str(7 + HOROVOD_GLOO_SLACK)
