"""shard_optimizer_state=True under the planned schedule: the chunks gathered in backward carry
parameters, so each rank updates those buckets' shards early, on the collective thread (or, with
CUDA tensors, on the chunks' side stream: the "stream" mode, run here on CPU tensors too), and
step() keeps the early updates only if nothing they assumed changed (dear/engine/updates.py,
ShardedUpdates.settle). Every habit of a loop between backward and step() must give the bits of
dear without sharding (itself checked against single-process training and DDP elsewhere),
whether the early updates were kept or undone."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import dear
from tests.distributed import run_distributed
from tests.test_sharded import _same, force_plan
from tests.workloads import batch, branch_used, init_in_issue_mode, make_net, state_of, to_cpu

STEPS = 6
START = 2           # the habits begin here, after clean steps: the first one meets early updates
NO_PLAN = {"DEAR_PLAN_AFTER": "100"}          # only the forced plan below runs

# What the loop does between backward and step(), and whether the early updates can stand.
HABITS = {
    "plain": True,
    "clip_not_reached": True,                 # clip_grad_norm_ whose coefficient is 1
    "clip": False,                            # a coefficient < 1: undone, then held back
    "grad_scaler": False,                     # its unscale deferred, then applied to shards
    "clip_grad_scaler": False,
    "lr_set_before_step": False,              # a warm-up written before optimizer.step()
    "param_edited": False,                    # the parameters written before step()
    "param_data_edited": False,               # the same through .data (no version bump)
    "param_data_one_element": False,          # one element through .data: one rank's shard
    "horovod_synchronize": False,             # synchronize(); edit .grad; skip_synchronize
    "state_dict_mid_iteration": False,        # checkpoint between backward and step()
    "branch": False,                          # some ranks skip a layer: not everyone used all
}
EVERY_STEP = {"clip", "grad_scaler", "clip_grad_scaler", "lr_set_before_step", "param_edited",
              "param_data_edited", "param_data_one_element", "horovod_synchronize"}


def _run(opt_name: str, sharded: bool, habit: str, device: str = "cpu") -> dict:
    rank, world = dear.rank(), dear.size()
    model = make_net().to(device)
    inner = (torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=0.01)
             if opt_name == "adam" else
             torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True))
    opt = dear.DistributedOptimizer(inner, model=model, fusion_threshold=700,
                                    schedule="planned" if sharded else "dear",
                                    shard_optimizer_state=sharded)
    scaler = (torch.amp.GradScaler(device, init_scale=2.0 ** 10) if "grad_scaler" in habit
              else None)
    counts = {"early": 0, "undone": 0}
    if sharded:
        state = opt.dear_engine.updates.state
        update_early, undo_early = state.update_early, state.undo_early

        def counted_update(*args: Any, **kwargs: Any) -> None:
            before = len(state.early)          # once per bucket and iteration; the other
            update_early(*args, **kwargs)      # chunks of the bucket find it done
            counts["early"] += len(state.early) - before

        def counted_undo() -> None:
            counts["undone"] += len(state.early)
            undo_early()
        state.update_early, state.undo_early = counted_update, counted_undo
    saved = []
    for step in range(STEPS):
        if sharded:
            force_plan(opt)
        opt.zero_grad()
        x, y = (t.to(device) for t in batch(step, world, rank))
        loss = F.mse_loss(model(x, branch_used(step, rank) if habit == "branch" else True), y)
        now = step >= START
        use_scaler = scaler is not None and now
        (scaler.scale(loss) if use_scaler else loss).backward()
        if habit == "clip_not_reached":
            opt.clip_grad_norm_(1e6)
        elif habit == "clip" and now:
            opt.clip_grad_norm_(0.05)
        elif habit == "clip_grad_scaler" and now:
            opt.clip_grad_norm_(0.05, grad_scaler=scaler)
        elif habit == "lr_set_before_step" and now:
            for g in opt.param_groups:
                g["lr"] = 0.01 * (step + 1) / STEPS
        elif habit == "param_edited" and now:
            with torch.no_grad():
                model.head.weight.mul_(0.99)
        elif habit == "param_data_edited" and now:
            model.head.weight.data.mul_(0.99)
        elif habit == "param_data_one_element" and now:
            model.head.weight.data[-1, -1] += 0.01
        elif habit == "state_dict_mid_iteration" and step == 3:
            saved.append(copy.deepcopy(opt.state_dict()))   # torch returns live tensors
        if habit == "horovod_synchronize" and now:
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            with opt.skip_synchronize():
                opt.step()
        elif use_scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
    counts["buckets"] = len(opt.dear_engine.buckets)
    counts["mode"] = opt.dear_engine.schedule.mode
    return {"params": to_cpu(state_of(model)), "state": to_cpu(opt.state_dict()),
            "counts": counts, "saved": to_cpu(saved)}


def early_checks(habits: list[str], opt_name: str, mode: str = "thread",
                 device: str = "cpu") -> dict:
    init_in_issue_mode(mode, device)
    out = {}
    for habit in habits:
        out[habit] = {"plain": _run(opt_name, False, habit, device),
                      "sharded": _run(opt_name, True, habit, device)}
    dear.shutdown()
    return out


@pytest.mark.parametrize("world,opt_name", [(2, "adam"), (3, "sgd")])
def test_early_updates_kept_or_undone_give_the_unsharded_bits(world: int, opt_name: str) -> None:
    ranks = run_distributed(early_checks, world, list(HABITS), opt_name, env=NO_PLAN,
                            timeout=300)
    _check(ranks, "thread")


def test_early_updates_in_the_gpu_issue_mode() -> None:
    """The same where the training thread issues the chunks and runs the early updates (a
    GPU's "stream" mode; the side stream is the host here)."""
    ranks = run_distributed(early_checks, 2, list(HABITS), "adam", "stream", env=NO_PLAN,
                            timeout=300)
    _check(ranks, "stream")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_early_updates_on_cuda_tensors() -> None:
    """The same on CUDA tensors: the early updates run on the chunks' side stream, step()
    orders its stream after them (two ranks share the one GPU through Gloo's CUDA
    collectives, which order streams as NCCL's do)."""
    ranks = run_distributed(early_checks, 2, list(HABITS), "adam", "stream", "cuda",
                            env={**NO_PLAN, "DEAR_GLOO_COLLECTIVES": "native"}, timeout=400)
    _check(ranks, "stream")


def _check(ranks: list[dict], mode: str) -> None:
    for rank, res in enumerate(ranks):
        for habit, stands in HABITS.items():
            plain, sharded = res[habit]["plain"], res[habit]["sharded"]
            where = f"rank {rank}, {habit}"
            assert _same(plain["params"], sharded["params"]), f"{where}: parameters differ"
            assert _same(plain["state"], sharded["state"]), f"{where}: state differs"
            assert _same(plain["saved"], sharded["saved"]), f"{where}: mid-iteration state_dict"
            counts = dict(sharded["counts"])
            assert counts.pop("mode") == mode, f"{where}: issued in another mode"
            buckets = counts["buckets"]
            if stands:                         # every step after the first (which lays out)
                assert counts == {"early": buckets * (STEPS - 1), "undone": 0,
                                  "buckets": buckets}, f"{where}: {counts}"
            elif habit in EVERY_STEP:          # kept before START, undone once, then held back
                assert counts["early"] == buckets * START and counts["undone"] == buckets, \
                    f"{where}: {counts}"
            elif habit == "state_dict_mid_iteration":   # undone in that iteration only
                assert counts["early"] == buckets * (STEPS - 1) and counts["undone"] == buckets
            else:                              # branch: some rank skips it whenever it ran early
                assert counts["early"] == counts["undone"] > 0, f"{where}: {counts}"
