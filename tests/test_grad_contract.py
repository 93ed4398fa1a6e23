"""What a training loop may do to `.grad` between backward and step() under dear (issue 16).

dear reduces each gradient as backward produces it, so an edit of `.grad` afterwards (torch's
clip_grad_norm_, GradScaler.unscale_, a replacement) cannot reach the update. It must be refused
with a clear error, the same way in every iteration (the first one included) and on both hook
paths (C++ hooks: DEAR_NATIVE=1; Python hooks: DEAR_NATIVE=0), and the ways that work must keep
working: optimizer.clip_grad_norm_, Horovod's synchronize()/skip_synchronize(), grad_norm()."""

from __future__ import annotations

from typing import Optional

import pytest
import torch
import torch.nn.functional as F

import dear
from dear.guards.written import DEFERRED_DEVICES
from tests.distributed import run_distributed
from tests.test_sharded import force_plan
from tests.workloads import (OPTIMIZERS, assert_float32_close, batch, init_in_issue_mode,
                             make_net, max_diff, reference, state_of, to_cpu)

EDITS = ("clip", "replace", "unscale", "none", "data-clamp", "data-neg", "data-ulp")
# Writes through .data leave autograd's version counter where it was: the DQN tutorial's
# p.grad.data.clamp_(-1, 1) on every parameter, a sign flip of a tensor with an even number of
# elements (what a sum of bit patterns cannot see), one element moved by one ulp (what a float
# sum cannot see).
DATA_EDITED = {"data-neg": "fc2.weight", "data-ulp": "head.bias"}


def _edit(kind: str, model: torch.nn.Module, opt: torch.optim.Optimizer, scaler) -> None:
    if kind == "clip":
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    elif kind == "replace":
        model.fc2.weight.grad = model.fc2.weight.grad * 0.5
    elif kind == "none":
        model.head.bias.grad = None
    elif kind == "unscale":
        scaler.unscale_(opt)
    elif kind == "data-clamp":
        for p in model.parameters():
            p.grad.data.clamp_(-1e-3, 1e-3)
    elif kind == "data-neg":
        assert model.fc2.weight.numel() % 2 == 0
        model.fc2.weight.grad.data.neg_()
    elif kind == "data-ulp":
        g = model.head.bias.grad.data.view(-1)
        g[0] = torch.nextafter(g[0], torch.tensor(float("inf"), device=g.device))


def _edit_loop(kind: str, bad_step: int, sharded: bool = False, device: str = "cpu") -> dict:
    """Good steps, then one step with the edit (`bad_step`); the error's text and the state
    before the bad step, after the refused step and after one more. `sharded`:
    shard_optimizer_state under a forced plan, so the step refused has buckets updated early,
    in backward, to undo. On a GPU an edit through .data is refused at a later step()
    (docs/deferred-update.md): its own update ran, and the step that sees it is the one
    dropped (`late`: the state after the edited step); the device is synchronized first, so
    that this later step is the next one."""
    rank, world = dear.rank(), dear.size()
    model = make_net().to(device)
    opt = dear.DistributedOptimizer(OPTIMIZERS["adam"](model.parameters()), model=model,
                                    fusion_threshold=2048 if not sharded else 700,
                                    schedule="planned" if sharded else "dear",
                                    shard_optimizer_state=sharded)
    scaler = torch.amp.GradScaler(device, init_scale=4.0) if kind == "unscale" else None

    def step(i: int, edit: bool, scaler=scaler) -> Optional[str]:
        if sharded:
            force_plan(opt)
        opt.zero_grad()
        x, y = (t.to(device) for t in batch(i, world, rank))
        loss = F.mse_loss(model(x), y)
        (scaler.scale(loss) if scaler else loss).backward()
        if edit:
            _edit(kind, model, opt, scaler)
        try:
            if scaler:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
        except RuntimeError as exc:
            return str(exc)
        return None

    for i in range(bad_step):
        assert step(i, False) is None
    opt.flush_updates()
    good = to_cpu(state_of(model))
    error = step(bad_step, True)
    late = None
    if error is None and device in DEFERRED_DEVICES and kind.startswith("data"):
        if device == "cuda":
            torch.cuda.synchronize()
        opt.flush_updates()
        late = {"edited": to_cpu(state_of(model))}
        error = step(bad_step + 1, False)
    opt.flush_updates()
    before = state_of(model)
    # The dropped step left the optimizer usable: train on, without the edit.
    last = bad_step + (2 if late else 1)
    again = step(last, False, scaler=None)   # (a scaler whose step raised needs update())
    assert again is None, f"{kind}: the step after the refused one raised: {again}"
    opt.flush_updates()
    return {"error": error, "good": good, "before": to_cpu(before),
            "after": to_cpu(state_of(model)), "late": late}


def _init(device: str) -> None:
    """On CUDA: two ranks on one GPU, the planned schedule issued as on NCCL."""
    init_in_issue_mode("stream" if device == "cuda" else "thread", device)


def _every_edit(device: str = "cpu") -> dict:
    _init(device)
    out = {(kind, bad_step): _edit_loop(kind, bad_step, device=device)
           for kind in EDITS for bad_step in (0, 2)}
    dear.shutdown()
    return out


def _sharded_edits(device: str = "cpu") -> dict:
    _init(device)
    out = {kind: _edit_loop(kind, 2, sharded=True, device=device)
           for kind in ("data-clamp", "data-ulp")}
    dear.shutdown()
    return out


@pytest.mark.parametrize("native", ["1", "0"])
def test_edit_of_grad_after_backward_is_refused_in_every_iteration(native: str) -> None:
    _check_every_edit(run_distributed(_every_edit, 2, timeout=180, env={"DEAR_NATIVE": native}))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_edits_of_cuda_gradients_are_refused() -> None:
    """The same on CUDA tensors (their fingerprints are sums on the GPU), and the sharded
    edits with the early updates on the side stream."""
    env = {"DEAR_GLOO_COLLECTIVES": "native"}
    _check_every_edit(run_distributed(_every_edit, 2, "cuda", timeout=300, env=env))
    _check_sharded_edits(run_distributed(_sharded_edits, 2, "cuda", timeout=200, env=env))


def _check_every_edit(ranks: list[dict]) -> None:
    for (kind, bad_step) in ranks[0]:           # the first iteration, and a later one
        for rank, outcomes in enumerate(ranks):
            res = outcomes[(kind, bad_step)]
            assert res["error"] is not None, (
                f"{kind} at step {bad_step} on rank {rank} was accepted (silently ignored)")
            if kind == "unscale":
                assert "scaler.unscale_(optimizer) does not work" in res["error"]
            else:
                name = {"replace": "fc2.weight", "none": "head.bias", **DATA_EDITED}.get(kind, "")
                assert f"gradient of {name}" in res["error"], res["error"]
            assert "optimizer.clip_grad_norm_" in res["error"]
            assert "skip_synchronize" in res["error"]
        zero, one = ranks[0][(kind, bad_step)], ranks[1][(kind, bad_step)]
        assert max_diff(zero["after"], one["after"]) == 0.0
        _check_step_dropped(zero, bad_step, f"{kind} at step {bad_step}")


def _check_step_dropped(res: dict, bad_step: int, what: str) -> None:
    """The refused step changed nothing (parameters and Adam's state as if its batch had never
    come), and training went on: against single-process Adam on the global batch of every
    step but the refused one, as float32 training is judged (tests/workloads.py). Refused late
    (a .data edit on a GPU, docs/deferred-update.md): the edited step's update ran, on values
    that may hold the edit, so the steps before it are judged against the reference, the
    refused step must have changed nothing (bitwise), and a one-ulp edit, which cannot move
    the update beyond float32 rounding, is judged against the reference too."""
    _close(res["good"], list(range(bad_step)), f"{what}, before the bad step")
    assert max_diff(res["before"], res["after"]) > 0.0, "training did not go on"
    if res["late"] is None:
        _close(res["before"], list(range(bad_step)), f"{what}, before the next step")
        _close(res["after"], [*range(bad_step), bad_step + 1], f"{what}, after the next step")
        return
    assert max_diff(res["before"], res["late"]["edited"]) == 0.0, (
        f"{what}: the step refused late changed the model or the optimizer's state")
    if "data-ulp" in what:
        _close(res["before"], list(range(bad_step + 1)), f"{what}, refused late")
        _close(res["after"], [*range(bad_step + 1), bad_step + 2], f"{what}, after it")


def _close(state: dict, steps: list[int], what: str) -> None:
    exact = reference("adam", 2, steps, dtype=torch.float64)
    assert_float32_close(state, exact, reference("adam", 2, steps), what=what)


def test_edit_through_data_is_refused_with_sharded_state_updated_early() -> None:
    """The refused step undoes the buckets updated in backward; the ranks train on alike."""
    _check_sharded_edits(run_distributed(_sharded_edits, 2, timeout=120))


def _check_sharded_edits(ranks: list[dict]) -> None:
    for kind in ranks[0]:
        for rank, outcomes in enumerate(ranks):
            error = outcomes[kind]["error"]
            assert error is not None, f"{kind} on rank {rank} was accepted (silently ignored)"
            assert f"gradient of {DATA_EDITED.get(kind, '')}" in error, error
        zero, one = ranks[0][kind], ranks[1][kind]
        assert max_diff(zero["after"], one["after"]) == 0.0
        _check_step_dropped(zero, 2, f"sharded, {kind}")


def _ways_that_work(world_check: bool) -> dict:
    """dear's clip, Horovod's loop with torch's clip, and grad_norm(): against DDP."""
    dear.init()
    rank, world = dear.rank(), dear.size()
    out = {}
    for mode in ("ddp", "dear-clip", "dear-sync", "dear-norm"):
        model = make_net()
        net = torch.nn.parallel.DistributedDataParallel(model) if mode == "ddp" else model
        opt = OPTIMIZERS["sgd"](model.parameters())
        if mode != "ddp":
            opt = dear.DistributedOptimizer(opt, model=model, fusion_threshold=2048)
        norms = []
        for step in range(4):
            opt.zero_grad()
            x, y = batch(step, world, rank)
            F.mse_loss(net(x), y).backward()
            if mode == "ddp":
                norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05).item())
                opt.step()
            elif mode == "dear-clip":
                norms.append(opt.clip_grad_norm_(0.05).item())
                opt.step()
            elif mode == "dear-sync":
                opt.synchronize()
                norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05).item())
                with opt.skip_synchronize():
                    opt.step()
            else:
                norms.append(opt.grad_norm().item())
                opt.step()
        out[mode] = {"params": state_of(model), "norms": norms}
    dear.shutdown()
    return out


def test_the_ways_that_work_match_ddp() -> None:
    ranks = run_distributed(_ways_that_work, 2, True, timeout=120)
    for res in ranks:
        ddp = res["ddp"]
        for mode in ("dear-clip", "dear-sync"):
            assert max_diff(res[mode]["params"], ddp["params"]) < 1e-6, mode
        # grad_norm() is the norm DDP users see in the all-reduced .grad (before clipping: the
        # unclipped run's first norm is the clipped run's first norm)
        assert res["dear-norm"]["norms"][0] == pytest.approx(ddp["norms"][0], rel=1e-6)
        for mode in ("dear-clip", "dear-sync"):
            assert res[mode]["norms"] == pytest.approx(ddp["norms"], rel=1e-5), mode
    assert ranks[0]["dear-norm"]["norms"] == ranks[1]["dear-norm"]["norms"]  # same bits


def _horovod_state_init() -> dict:
    """Horovod's resume idiom with dear's optimizer: rank 0 holds a state (loaded from a
    checkpoint), the others a fresh optimizer; hvd.broadcast_optimizer_state sets zero .grad and
    calls step() on the ranks whose state is empty, and only there (this is its code, inlined
    so the test runs on torch.distributed too)."""
    dear.init()
    rank, world = dear.rank(), dear.size()
    model = make_net()
    opt = dear.DistributedOptimizer(OPTIMIZERS["adam"](model.parameters()), model=model)
    if rank == 0:                               # "loaded from a checkpoint"
        plain = make_net()
        plain_opt = OPTIMIZERS["adam"](plain.parameters())
        for step in range(2):
            plain_opt.zero_grad()
            x, y = batch(step, 1, 0)
            F.mse_loss(plain(x), y).backward()
            plain_opt.step()
        model.load_state_dict(plain.state_dict())
        opt.load_state_dict(plain_opt.state_dict())
    state = opt.state_dict()
    if len(state["state"]) == 0:
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
    dear.broadcast_parameters(model.state_dict(), root_rank=0)
    dear.broadcast_optimizer_state(opt, root_rank=0)
    for step in range(2, 4):
        opt.zero_grad()
        x, y = batch(step, world, rank)
        F.mse_loss(model(x), y).backward()
        opt.step()
    opt.flush_updates()
    out = {"params": state_of(model),
           "steps": sorted({int(s["step"]) for s in opt.state_dict()["state"].values()})}
    dear.shutdown()
    return out


def test_horovods_broadcast_optimizer_state_idiom_does_not_hang() -> None:
    ranks = run_distributed(_horovod_state_init, 2, timeout=60)
    assert max_diff(ranks[0]["params"], ranks[1]["params"]) == 0.0
    assert ranks[0]["steps"] == ranks[1]["steps"] == [4]


def _scheduler_made_before_wrapping() -> dict:
    """torch's LR schedulers patch `step` onto the optimizer instance; one made before wrapping
    must not make the wrapped optimizer run the original step (no averaging at all)."""
    dear.init()
    rank, world = dear.rank(), dear.size()
    model = make_net()
    opt = OPTIMIZERS["sgd"](model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
    opt = dear.DistributedOptimizer(opt, model=model)
    for step in range(5):
        opt.zero_grad()
        x, y = batch(step, world, rank)
        F.mse_loss(model(x), y).backward()
        opt.step()
        sched.step()
    opt.flush_updates()
    out = state_of(model)
    dear.shutdown()
    return out


def test_lr_scheduler_made_before_wrapping() -> None:
    from tests.workloads import reference
    ranks = run_distributed(_scheduler_made_before_wrapping, 2, timeout=60)
    ref = reference("sgd", 2, 5, scheduler=True)
    scale = max(v.abs().max().item() for v in ref.values())
    for res in ranks:
        assert max_diff(res, ref) <= 1e-6 * scale
    assert max_diff(ranks[0], ranks[1]) == 0.0
