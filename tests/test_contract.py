"""The contract with DDP scripts (issue 33): one optimizer object, no stale reads through the
model, DDP's constructor guarantees (rank 0's weights, settings checked across ranks).

References: single-process training on the global batch (tests/workloads.py), computed here in
float64 and judged with `assert_float32_close` against an independent float32 run; "every rank
equal" where the question is whether the replicas agree."""

from __future__ import annotations

import copy
import io
import os
import pickle
from typing import Optional

import pytest
import torch
import torch.nn.functional as F

from tests.distributed import run_distributed
from tests.workloads import Net, assert_float32_close, batch, max_diff, state_of

WORLD = 2


def _reference(steps: int, dtype: torch.dtype, *, resume_at: int = 0,
               ema: bool = False) -> dict[str, dict[str, torch.Tensor]]:
    """Plain torch on the global batch: SGD with momentum, StepLR made before anything else;
    with resume_at, a new model/optimizer/scheduler resumed from a checkpoint at that step."""
    torch.manual_seed(0)
    model = Net().to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
    averaged = torch.optim.swa_utils.AveragedModel(model) if ema else None
    checkpoint = None
    for step in range(steps):
        if resume_at and step == resume_at:
            torch.manual_seed(123)
            model = Net().to(dtype)
            model.load_state_dict(checkpoint["model"])
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
            opt.load_state_dict(checkpoint["opt"])
            sched.load_state_dict(checkpoint["sched"])
        opt.zero_grad()
        x, y = batch(step, WORLD)
        F.mse_loss(model(x.to(dtype)), y.to(dtype)).backward()
        opt.step()
        sched.step()
        if averaged is not None:
            averaged.update_parameters(model)
        if resume_at and step == resume_at - 1:
            checkpoint = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(),
                                        "sched": sched.state_dict()})
    out = {"model": state_of(model), "lr": {"lr": torch.tensor(opt.param_groups[0]["lr"])}}
    if averaged is not None:
        out["ema"] = state_of(averaged.module)
    return out


def _dear_loop(steps: int, resume_at: int = 0, ema: bool = False) -> dict:
    """A DDP script's habits with the README's swap: each rank seeded differently (DDP's
    constructor broadcasts rank 0's weights), the scheduler made BEFORE the wrap, a resume that
    builds everything anew and loads the checkpoint, an EMA updated right after step()."""
    import dear
    dear.init()
    rank = dear.rank()

    def build(seed: int):
        torch.manual_seed(seed)
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
        opt = dear.DistributedOptimizer(opt, model=model, fusion_threshold=1024)
        return model, opt, sched

    model, opt, sched = build(rank)            # rank 0's seed is the reference's
    averaged = torch.optim.swa_utils.AveragedModel(model) if ema else None
    checkpoint = None
    for step in range(steps):
        if resume_at and step == resume_at:
            model, opt, sched = build(100 + rank)
            model.load_state_dict(checkpoint["model"])
            opt.load_state_dict(checkpoint["opt"])
            sched.load_state_dict(checkpoint["sched"])
        opt.zero_grad()
        x, y = batch(step, WORLD, rank)
        F.mse_loss(model(x), y).backward()
        opt.step()
        sched.step()
        if averaged is not None:
            averaged.update_parameters(model)
        if resume_at and step == resume_at - 1:
            buf = io.BytesIO()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict()}, buf)
            buf.seek(0)
            checkpoint = torch.load(buf, weights_only=False)
    out = {"model": {k: v.clone() for k, v in model.state_dict().items()},
           "lr": {"lr": torch.tensor(opt.param_groups[0]["lr"])}}
    if averaged is not None:
        out["ema"] = state_of(averaged.module)
    dear.shutdown()
    return out


@pytest.mark.parametrize("resume_at,ema", [(0, True), (3, False)])
def test_a_ddp_script_with_scheduler_ema_and_resume_trains_like_one_process(resume_at, ema):
    steps = 6
    results = run_distributed(_dear_loop, WORLD, steps, resume_at, ema, timeout=180)
    exact = _reference(steps, torch.float64, resume_at=resume_at, ema=ema)
    peer = _reference(steps, torch.float32, resume_at=resume_at, ema=ema)
    for r, result in enumerate(results):
        assert result["lr"]["lr"].item() == pytest.approx(exact["lr"]["lr"].item())
        for key in result:
            assert_float32_close(result[key], exact[key], peer[key], what=f"rank {r} {key}")


def _one_object() -> dict:
    import dear
    dear.init()
    model = Net()
    plain = torch.optim.Adam(model.parameters(), lr=0.01)
    before = torch.optim.lr_scheduler.LambdaLR(plain, lambda s: 0.5 ** s)
    opt = dear.DistributedOptimizer(plain, model=model)
    out = {"same": opt is plain, "isinstance": isinstance(opt, torch.optim.Adam)}
    dear.broadcast_optimizer_state(opt, root_rank=0)   # replaces param_groups on rank 1
    for step in range(3):
        opt.zero_grad()
        x, y = batch(step, WORLD, dear.rank())
        F.mse_loss(model(x), y).backward()
        opt.step()
        before.step()
    out["lr"] = plain.param_groups[0]["lr"]
    out["scheduler_sees_it"] = before.optimizer is opt
    out["model"] = state_of(model)
    dear.shutdown()
    return out


def test_the_users_optimizer_is_dears_so_every_holder_sees_one_object():
    """kfac-pytorch's CIFAR example: LambdaLR made before the wrap, broadcast_optimizer_state:
    the ranks must end equal (they ended 0.20 apart with two objects)."""
    results = run_distributed(_one_object, WORLD, timeout=120)
    for r in results:
        assert r["same"] and r["isinstance"] and r["scheduler_sees_it"]
        assert r["lr"] == pytest.approx(0.01 * 0.5 ** 3)
    assert max_diff(results[0]["model"], results[1]["model"]) == 0.0


def _stale_reads() -> dict:
    """After step(), every way of reading the model through it sees the updated weights."""
    import dear
    dear.init()
    rank = dear.rank()
    torch.manual_seed(rank)
    model = Net()
    opt = dear.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                    model=model, fusion_threshold=1024)
    reads = {}
    for step in range(2):
        opt.zero_grad()
        x, y = batch(step, WORLD, rank)
        F.mse_loss(model(x), y).backward()
        opt.step()
        if step == 0:
            reads["parameters"] = {str(i): p.detach().clone()
                                   for i, p in enumerate(model.parameters())}
        elif step == 1:
            reads["deepcopy"] = state_of(copy.deepcopy(model))
    x, y = batch(2, WORLD, rank)
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    model.zero_grad()                          # HF Trainer's habit: must not force the update
    reads["pending_after_zero_grad"] = opt.flush_updates()   # buckets still pending
    buf = io.BytesIO()
    torch.save(model, buf)                     # the whole module, as under DDP
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    reads["torch.save"] = state_of(loaded)
    reads["plain_class"] = type(loaded) is Net and not loaded._forward_pre_hooks
    reads["pickle"] = state_of(pickle.loads(pickle.dumps(model)))
    reads["final"] = state_of(model)
    dear.shutdown()
    return reads


def _reference_reads(dtype: torch.dtype) -> dict:
    torch.manual_seed(0)
    model = Net().to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    reads = {}
    for step in range(3):
        opt.zero_grad()
        x, y = batch(step, WORLD)
        F.mse_loss(model(x.to(dtype)), y.to(dtype)).backward()
        opt.step()
        if step == 0:
            reads["parameters"] = {str(i): p.detach().clone()
                                   for i, p in enumerate(model.parameters())}
        elif step == 1:
            reads["deepcopy"] = state_of(model)
    reads["torch.save"] = reads["pickle"] = reads["final"] = state_of(model)
    return reads


def test_reads_through_the_model_after_step_see_the_updated_weights():
    results = run_distributed(_stale_reads, WORLD, timeout=120)
    exact, peer = _reference_reads(torch.float64), _reference_reads(torch.float32)
    for r, result in enumerate(results):
        assert result["plain_class"], "a saved model must load as its own class, without hooks"
        assert result["pending_after_zero_grad"] > 0, "model.zero_grad() forced the update"
        for key in ("parameters", "deepcopy", "torch.save", "pickle", "final"):
            assert_float32_close(result[key], exact[key], peer[key], what=f"rank {r} {key}")


CLAMP = 0.15                  # bites: Linear(24, 32)'s initial weights reach 1/sqrt(24) = 0.2
# Writes to the parameters after step() (WGAN's weight clipping, a projection onto constraints).
# Through the model they apply the pending update first and train as DDP does; through a tensor
# kept from before, the update would land on the written values, so it is refused: an in-place
# write in the forward that would apply the update, a write through .data at the next step().
WRITES = {"model": None, "flush_then_kept": None, "kept_no_grad": "written in place",
          "kept_data": "written through .data", "param_groups_data": "written through .data",
          "submodule_data": "written through .data"}


def _write_after_step(kind: str, model: torch.nn.Module, kept: list, opt) -> None:
    if kind == "model":
        for p in model.parameters():
            p.data.clamp_(-CLAMP, CLAMP)
    elif kind == "flush_then_kept":
        opt.flush_updates()
        for p in kept:
            p.data.clamp_(-CLAMP, CLAMP)
    elif kind == "kept_no_grad":
        with torch.no_grad():
            for p in kept:
                p.clamp_(-CLAMP, CLAMP)
    elif kind == "kept_data":
        for p in kept:
            p.data.clamp_(-CLAMP, CLAMP)
    elif kind == "param_groups_data":
        for group in opt.param_groups:
            for p in group["params"]:
                p.data.clamp_(-CLAMP, CLAMP)
    elif kind == "submodule_data":
        for p in model.fc1.parameters():
            p.data.clamp_(-CLAMP, CLAMP)


def _writes(sharded: bool) -> dict:
    """sharded: shard_optimizer_state under a forced plan, so the step's fingerprints of the
    parameters come from the early-update check (ShardedState.unwritten)."""
    import dear
    from tests.test_sharded import force_plan
    dear.init()
    rank = dear.rank()
    out = {}
    for kind in WRITES:
        torch.manual_seed(0)
        model = Net()
        kept = list(model.parameters())
        opt = dear.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1,
                                                        momentum=0.9),
                                        model=model, fusion_threshold=1024,
                                        schedule="planned" if sharded else "dear",
                                        shard_optimizer_state=sharded)
        error = None
        try:
            for step in range(3):
                if sharded:
                    force_plan(opt)
                where = f"forward {step}"
                opt.zero_grad()
                x, y = batch(step, WORLD, rank)
                loss = F.mse_loss(model(x), y)
                loss.backward()
                where = f"step {step}"
                opt.step()
                _write_after_step(kind, model, kept, opt)
            where = "end"
            opt.flush_updates()
        except RuntimeError as exc:
            error = (where, str(exc))
        out[kind] = {"error": error, "params": state_of(model)}
        del opt
    dear.shutdown()
    return out


def _reference_writes(dtype: torch.dtype) -> dict:
    torch.manual_seed(0)
    model = Net().to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        opt.zero_grad()
        x, y = batch(step, WORLD)
        F.mse_loss(model(x.to(dtype)), y.to(dtype)).backward()
        opt.step()
        for p in model.parameters():
            p.data.clamp_(-CLAMP, CLAMP)
    return state_of(model)


@pytest.mark.parametrize("sharded", [False, True])
def test_writes_to_parameters_after_step_train_as_ddp_or_are_refused(sharded: bool):
    results = run_distributed(_writes, WORLD, sharded, timeout=120,
                              env={"DEAR_PLAN_AFTER": "100"} if sharded else None)
    exact, peer = _reference_writes(torch.float64), _reference_writes(torch.float32)
    for r, result in enumerate(results):
        for kind, says in WRITES.items():
            error = result[kind]["error"]
            if says is None:
                assert error is None, f"rank {r} {kind}: {error}"
                assert_float32_close(result[kind]["params"], exact, peer, what=f"rank {r} {kind}")
                continue
            assert error is not None, f"rank {r} {kind}: the write was silently composed"
            where, text = error
            # in place: refused before the update runs; through .data: seen at the next step()
            assert where == ("forward 1" if kind == "kept_no_grad" else "step 1"), (kind, error)
            assert says in text and "flush_updates()" in text, (kind, text)


def _mismatch(setting: str) -> str:
    import dear
    rank = int(os.environ["RANK"])
    if setting == "schedule":
        os.environ["DEAR_SCHEDULE"] = "dear" if rank else "planned"
    dear.init()
    model = Net()
    if setting == "buffer" and rank == 1:
        model.register_buffer("extra", torch.zeros(3))
    kwargs = {}
    if setting == "op":
        kwargs["op"] = dear.Sum if rank else dear.Average
    if setting == "threshold":
        kwargs["fusion_threshold"] = 1024 * (1 + rank)
    dear.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                              **kwargs)
    return "wrapped"


@pytest.mark.parametrize("setting,named", [("op", "op: Average on rank 0, Sum on rank 1"),
                                           ("schedule", "DEAR_SCHEDULE: 'planned' on rank 0"),
                                           ("threshold", "fusion layout"),
                                           ("buffer", "the model's buffers")])
def test_settings_that_differ_across_ranks_fail_on_every_rank(setting, named):
    outcomes = run_distributed(_mismatch, WORLD, setting, timeout=60, expect_failure=True)
    for r, outcome in enumerate(outcomes):
        assert isinstance(outcome, str) and "must be the same on every rank" in outcome, \
            f"rank {r}: {outcome}"
        assert named in outcome


def _initial_weights(init_sync: bool) -> dict:
    import dear
    dear.init()
    torch.manual_seed(dear.rank())             # as torchvision's and timm's scripts do
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    model[1].running_mean.fill_(dear.rank())
    dear.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                              init_sync=init_sync)
    out = state_of(model)
    dear.shutdown()
    return out


def test_the_wrap_gives_every_rank_rank_0s_parameters_and_buffers():
    synced = run_distributed(_initial_weights, WORLD, True, timeout=60)
    assert max_diff(synced[0], synced[1]) == 0.0
    torch.manual_seed(0)
    assert torch.equal(synced[1]["0.weight"], torch.nn.Linear(4, 4).weight.detach())
    unsynced = run_distributed(_initial_weights, WORLD, False, timeout=60)
    assert max_diff(unsynced[0], unsynced[1]) > 0.0


# ------------------------------------------------------------ a parameter set that may change
def _changing(dtype: torch.dtype, rank: Optional[int], steps: int = 7) -> dict:
    """Gradual unfreezing (fc2 frozen at the wrap, unfrozen at step 2), add_param_group (branch
    added at step 4) and freezing (conv frozen at step 5). rank None: single process, global
    batch (the reference); else a rank of the dear run."""
    if rank is not None:
        import dear
        dear.init()
    torch.manual_seed(0 if rank is None else rank)
    model = Net(frozen=True).to(dtype)
    params = [p for n, p in model.named_parameters() if not n.startswith("branch")]
    opt = torch.optim.Adam(params, lr=0.01)
    if rank is not None:
        opt = dear.DistributedOptimizer(opt, model=model, fusion_threshold=1024)
    for step in range(steps):
        if step == 2:
            model.fc2.requires_grad_(True)
        if step == 4:
            opt.add_param_group({"params": list(model.branch.parameters()), "lr": 0.005})
        if step == 5:
            model.conv.requires_grad_(False)
        opt.zero_grad()
        if rank is None:
            x, y = batch(step, WORLD)
        else:
            x, y = batch(step, WORLD, rank)
        F.mse_loss(model(x.to(dtype)), y.to(dtype)).backward()
        opt.step()
    out = state_of(model)
    if rank is not None:
        dear.shutdown()
    return out


def test_a_changing_parameter_set_trains_like_one_process():
    results = run_distributed(_changing_rank, WORLD, timeout=180)
    exact, peer = _changing(torch.float64, None), _changing(torch.float32, None)
    for r, result in enumerate(results):
        assert_float32_close(result, exact, peer, what=f"rank {r}")


def _changing_rank() -> dict:
    return _changing(torch.float32, int(os.environ["RANK"]))


def _shifted(kind: str) -> str:
    """One rank steps once more (no backward) / unfreezes a layer alone."""
    import dear
    dear.init()
    rank = dear.rank()
    model = Net()
    opt = dear.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                                    fusion_threshold=1024)
    for step in range(6):
        opt.zero_grad()
        x, y = batch(step, WORLD, rank)
        F.mse_loss(model(x), y).backward()
        if kind == "freeze" and step == 3 and rank == 1:
            model.fc2.requires_grad_(False)
        opt.step()
        if kind == "extra step" and step == 2 and rank == 0:
            opt.step()
    return "trained on"


@pytest.mark.parametrize("kind,says", [("extra step", "WITHOUT a backward"),
                                       ("freeze", "trains parameter set")])
def test_a_rank_whose_collectives_shift_stops_every_rank(kind, says):
    outcomes = run_distributed(_shifted, WORLD, kind, timeout=90, expect_failure=True)
    for r, outcome in enumerate(outcomes):
        assert isinstance(outcome, str) and "no longer pair up" in outcome, f"rank {r}: {outcome}"
        assert says in outcome and "rank 0" in outcome and "rank 1" in outcome


class _AsksItsDevice(Net):
    """Hugging Face's habit: the forward reads `next(self.parameters())` (for .device/.dtype)."""

    def forward(self, x: torch.Tensor, use_branch: bool = True) -> torch.Tensor:
        x = x.to(next(self.parameters()).dtype)
        return super().forward(x, use_branch)


def _reads_inside_forward() -> dict:
    import logging

    import dear
    dear.init()
    warnings: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warnings.append(record.getMessage())
    logging.getLogger("dear").addHandler(Catch())
    torch.manual_seed(0)
    model = _AsksItsDevice()
    opt = dear.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                                    fusion_threshold=1024)
    for step in range(3):
        opt.zero_grad()
        x, y = batch(step, WORLD, dear.rank())
        F.mse_loss(model(x), y).backward()
        opt.step()
    out = {"forced": [w for w in warnings if "read the model" in w], "model": state_of(model)}
    dear.shutdown()
    return out


def test_reads_inside_the_forward_keep_the_overlap():
    results = run_distributed(_reads_inside_forward, WORLD, timeout=120)
    for r in results:
        assert r["forced"] == [], r["forced"]
    assert max_diff(results[0]["model"], results[1]["model"]) == 0.0


def _load_through_parent() -> dict:
    import dear
    dear.init()
    model = Net()
    parent = torch.nn.ModuleDict({"net": model})
    opt = dear.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                                    fusion_threshold=1024)
    saved = {k: v.clone() for k, v in parent.state_dict().items()}
    opt.zero_grad()
    x, y = batch(0, WORLD, dear.rank())
    F.mse_loss(model(x), y).backward()
    opt.step()                                 # an update is pending
    parent.load_state_dict(saved)              # then the checkpoint is loaded through a parent
    out = {"loaded": {k: v.clone() for k, v in parent.state_dict().items()}, "saved": saved}
    dear.shutdown()
    return out


def test_a_load_through_a_parent_module_is_not_overwritten_by_a_pending_update():
    for r in run_distributed(_load_through_parent, WORLD, timeout=120):
        assert max_diff(r["loaded"], r["saved"]) == 0.0


# ------------------------------------------------------------------ a GAN: two optimizers
def _gan(dtype: torch.dtype, rank: Optional[int], freeze: bool, steps: int = 4) -> dict:
    """WGAN-style loop: D's step, then G's loss backpropagating through D. `rank` None: one
    process on the global batch (the reference); else dear on 2 ranks, each half the batch."""
    torch.manual_seed(0)
    g, d = torch.nn.Linear(4, 8).to(dtype), torch.nn.Linear(8, 1).to(dtype)
    opt_g = torch.optim.Adam(g.parameters(), lr=0.01)
    opt_d = torch.optim.SGD(d.parameters(), lr=0.05, momentum=0.9)
    if rank is not None:
        import dear
        dear.init()
        opt_g = dear.DistributedOptimizer(opt_g, model=g)
        opt_d = dear.DistributedOptimizer(opt_d, model=d)
    error = None
    try:
        for step in range(steps):
            gen = torch.Generator().manual_seed(100 + step)
            z = torch.randn(8, 4, generator=gen).to(dtype)
            real = torch.randn(8, 8, generator=gen).to(dtype)
            if rank is not None:
                z, real = z[rank * 4:(rank + 1) * 4], real[rank * 4:(rank + 1) * 4]
            opt_d.zero_grad()
            (d(g(z).detach()).mean() - d(real).mean()).backward()
            opt_d.step()
            for p in d.parameters():
                p.requires_grad_(not freeze)
            opt_g.zero_grad()
            (-d(g(z)).mean()).backward()
            opt_g.step()
            for p in d.parameters():
                p.requires_grad_(True)
        if rank is not None:
            opt_g.flush_updates()
            opt_d.flush_updates()
    except RuntimeError as exc:
        error = str(exc)
    out = {"error": error, "g": state_of(g), "d": state_of(d)}
    if rank is not None:
        import dear
        dear.shutdown()
    return out


def _gan_rank(freeze: bool) -> dict:
    import dear  # noqa: F401  (rank from the launcher's environment)
    return _gan(torch.float32, int(os.environ["RANK"]), freeze)


def test_a_gan_loop_trains_like_one_process_or_says_why_not():
    """The generator's loss backpropagates through the discriminator. With D frozen around that
    backward (the usual pattern), two dear optimizers train as one process on the global batch;
    without, D's gradients from it would be reduced, so dear stops and names the cause."""
    ref, peer = _gan(torch.float64, None, True), _gan(torch.float32, None, True)
    for res in run_distributed(_gan_rank, 2, True, timeout=120):
        assert res["error"] is None, res["error"]
        for part in ("g", "d"):
            assert_float32_close(res[part], ref[part], peer[part], what=part)
    for res in run_distributed(_gan_rank, 2, False, timeout=120, expect_failure=True):
        text = res["error"] if isinstance(res, dict) else str(res)
        assert text is not None and "another model's loss" in text, text
