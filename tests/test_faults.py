"""Checkpoints and faults.

- Kill every rank at a random step after a checkpoint, resume from it: the parameters and the
  optimizer state end bit-identical to an uninterrupted run (AMP, clipping, LR schedule, dropout).
- A checkpoint write that dies half-way leaves the previous checkpoint intact.
- After a rank died inside step(), the survivor drops the pending update and saves the last whole
  step. How fast a fault is noticed: tests/test_fault_timing.py.
"""

from __future__ import annotations

import math
import os
import random
import signal

import pytest
import torch
import torch.nn.functional as F

import dear
from tests.distributed import run_distributed
from tests.subprocesses import BIN, run
from tests.workloads import batch, make_net, state_of

TOTAL, EVERY = 12, 3                           # steps; a checkpoint after every 3rd
OVERFLOW_AT = 7                                # rank 1 overflows: a skipped step after resuming
KILL_SEED = 7                                  # the kill test kills at step 8 (redoes 6-8)


# ------------------------------------------------------------------ checkpoint, kill, resume
def real_loop(ckpt_dir: str, kill_at: int = -1) -> dict:
    """Adam + GradScaler + clipping + StepLR + dropout, checkpointing every EVERY steps with
    dear.atomic_save; resumes from this rank's checkpoint if there is one."""
    dear.init()
    rank, world = dear.rank(), dear.size()
    model = make_net()
    opt = dear.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), model=model,
                                    fusion_threshold=2048)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=3)
    torch.manual_seed(100 + rank)              # dropout differs per rank, as in real training
    path = os.path.join(ckpt_dir, f"rank{rank}.pt")
    start = 0
    if os.path.exists(path):
        ckpt = torch.load(path, weights_only=False)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        sched.load_state_dict(ckpt["scheduler"])
        torch.set_rng_state(ckpt["rng"])
        start = ckpt["step"]
    for step in range(start, TOTAL):
        opt.zero_grad()
        x, y = batch(step, world, rank)
        loss = F.mse_loss(model(F.dropout(x, 0.2)), y)
        if step == OVERFLOW_AT and rank == 1:
            loss = loss + math.inf * model.fc1.bias[0]
        scaler.scale(loss).backward()
        opt.clip_grad_norm_(1.0, grad_scaler=scaler)
        scaler.step(opt)
        scaler.update()
        sched.step()
        if step == kill_at:                    # updates pending, all-gathers in flight
            os.kill(os.getpid(), signal.SIGKILL)
        if (step + 1) % EVERY == 0:
            dear.atomic_save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                              "scaler": scaler.state_dict(), "scheduler": sched.state_dict(),
                              "rng": torch.get_rng_state(), "step": step + 1}, path)
    state = {f"opt.{i}.{k}": v for i, s in opt.state_dict()["state"].items()
             for k, v in s.items()}
    result = {"params": state_of(model), "opt": state, "start": start,
              "scale": scaler.get_scale()}
    dear.shutdown()
    return result


def test_kill_every_rank_after_a_checkpoint_and_resume_bit_identically(tmp_path) -> None:
    kill_at = random.Random(KILL_SEED).randrange(EVERY, TOTAL - 1)   # after the first checkpoint
    (tmp_path / "straight").mkdir()
    (tmp_path / "killed").mkdir()
    straight = run_distributed(real_loop, 2, str(tmp_path / "straight"), timeout=120)
    outcomes = run_distributed(real_loop, 2, str(tmp_path / "killed"), kill_at, timeout=120,
                               expect_failure=True)
    assert all(isinstance(o, str) for o in outcomes), f"a rank survived kill_at={kill_at}"
    resumed = run_distributed(real_loop, 2, str(tmp_path / "killed"), timeout=120)
    for rank in range(2):
        want, got = straight[rank], resumed[rank]
        assert got["start"] == kill_at // EVERY * EVERY, f"kill_at={kill_at}"
        assert got["scale"] == want["scale"]
        for what in ("params", "opt"):
            assert got[what].keys() == want[what].keys()
            for k in want[what]:
                assert torch.equal(got[what][k], want[what][k]), \
                    f"rank {rank}: {k} differs after resuming (killed at step {kill_at})"


class _DiesWhilePickled:
    def __reduce__(self):                      # the process dies half-way through torch.save
        os._exit(9)


class _FailsWhilePickled:
    def __reduce__(self):
        raise RuntimeError("disk full")


def test_a_checkpoint_write_that_dies_leaves_the_previous_one(tmp_path) -> None:
    path = tmp_path / "ckpt.pt"
    dear.atomic_save({"step": 1, "w": torch.arange(4.0)}, path)
    with pytest.raises(RuntimeError, match="disk full"):
        dear.atomic_save({"w": torch.zeros(1 << 16), "bad": _FailsWhilePickled()}, path)
    assert os.listdir(tmp_path) == ["ckpt.pt"]         # the temporary file was removed
    code = ("import torch, dear, tests.test_faults as t\n"
            f"dear.atomic_save({{'w': torch.zeros(1 << 20), 'bad': t._DiesWhilePickled()}}, "
            f"{str(path)!r})\n")
    res = run([os.path.join(BIN, "python"), "-c", code], timeout=60)
    assert res.returncode == 9, res.stdout
    ckpt = torch.load(path)
    assert ckpt["step"] == 1 and torch.equal(ckpt["w"], torch.arange(4.0))
    assert len(os.listdir(tmp_path)) == 2          # the killed writer's temporary file...
    dear.atomic_save({"step": 2}, path)
    assert os.listdir(tmp_path) == ["ckpt.pt"]     # ...is removed by the next save
    assert torch.load(path)["step"] == 2


def test_a_checkpoint_gets_the_mode_torch_save_gives(tmp_path) -> None:
    """0666 less the umask, as torch.save (open()) creates it; not mkstemp's 0600."""
    old = os.umask(0o027)
    try:
        dear.atomic_save({"w": torch.ones(2)}, tmp_path / "a.pt")
        torch.save({"w": torch.ones(2)}, tmp_path / "b.pt")
    finally:
        os.umask(old)
    mode = os.stat(tmp_path / "a.pt").st_mode & 0o777
    assert mode == os.stat(tmp_path / "b.pt").st_mode & 0o777 == 0o640


# ------------------------------------------------------------------ an emergency checkpoint
def _emergency(path: str) -> dict:
    """Rank 1 dies inside step 3's step() (after its reduce-scatters, before its all-gathers):
    rank 0's pending update can never arrive. It drops it, saves, shuts down, starts again."""
    dear.init()
    rank = dear.rank()
    model = make_net()
    opt = dear.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                    model=model, fusion_threshold=2048)
    for step in range(4):
        opt.zero_grad()
        x, y = batch(step, 2, rank)
        F.mse_loss(model(x), y).backward()
        if step == 3 and rank == 1:
            opt.dear_schedule.gather_rest = lambda groups: os._exit(7)
        opt.step()
    error = None
    try:
        model(x)                               # the first update's all-gather never arrives
    except RuntimeError as exc:
        error = str(exc)
    with pytest.raises(RuntimeError):          # still pending: a read cannot flush it
        opt.state_dict()
    dropped = opt.discard_pending_updates()
    dear.atomic_save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    dear.shutdown()
    dear.init(backend="local")                 # not refused: the process can go on
    dear.shutdown()
    return {"error": error, "dropped": dropped}


def test_after_a_fault_the_last_whole_step_can_be_saved(tmp_path) -> None:
    path = str(tmp_path / "emergency.pt")
    outcomes = run_distributed(_emergency, 2, path, timeout=180, expect_failure=True,
                               env={"DEAR_TIMEOUT": "20"})
    res = outcomes[0]
    assert isinstance(res, dict) and res["error"] is not None and res["dropped"] > 0, res
    # The reference: one process, the global batch, the three whole steps (0, 1, 2).
    model = make_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        opt.zero_grad()
        x, y = batch(step, 2)
        F.mse_loss(model(x), y).backward()
        opt.step()
    saved = torch.load(path)
    for name, value in model.state_dict().items():
        # the same sums in another order (two halves vs one batch): float32 rounding
        torch.testing.assert_close(saved["model"][name], value, rtol=1e-5, atol=1e-6)
    state = saved["optimizer"]["state"]
    reference = [opt.state[p]["momentum_buffer"] for p in model.parameters()]
    assert sorted(state) == list(range(len(reference)))
    momentum = [state[i]["momentum_buffer"] for i in range(len(reference))]
    for got, want in zip(momentum, reference):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
