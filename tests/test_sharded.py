"""shard_optimizer_state=True (dear/sharding/state.py): each rank updates only its shards and the
all-gathers carry parameters. Elementwise optimizers give the same bits as dear without sharding
(itself checked against single-process training elsewhere), on 2 and 3 ranks with uneven shards
and padding; the whole state comes back from state_dict() in torch's form; the rest is refused
by name."""

from __future__ import annotations

import os
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F

import dear
from dear.fusion.plan import Plan, chunk_columns
from tests.distributed import run_distributed
from tests.workloads import (OPTIMIZERS, assert_float32_close, batch, branch_used, make_net,
                             reference, state_of)

ELEMENTWISE: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
    "sgd_plain": lambda p: torch.optim.SGD(p, lr=0.1),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=0.01),
    "adam_amsgrad": lambda p: torch.optim.Adam(p, lr=0.01, amsgrad=True),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.05),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5, centered=True),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.05, lr_decay=0.01),
    "adamax": lambda p: torch.optim.Adamax(p, lr=0.01),
    "nadam": lambda p: torch.optim.NAdam(p, lr=0.01),
    "radam": lambda p: torch.optim.RAdam(p, lr=0.01),
    "asgd": lambda p: torch.optim.ASGD(p, lr=0.01, t0=2),
    "adadelta": lambda p: torch.optim.Adadelta(p, lr=0.5),
    "rprop": lambda p: torch.optim.Rprop(p, lr=0.01),
}
STEPS = 7


def _groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    """Two param groups with different hyperparameters, interleaved in forward order, so a
    shard holds segments of both."""
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    return [{"params": decay}, {"params": rest, "lr_scale": 1.0}]


def force_plan(opt: Any) -> None:
    """Until a measured plan exists: after every bucket's reduce-scatter, gather all of that
    bucket in 5-column chunks (with sharding: each bucket updated early, in backward)."""
    if opt.dear_engine.buckets is not None and opt.dear_engine.schedule.plan is None:
        opt.dear_engine.schedule.plan = Plan(after={
            b.spec.index: tuple((b.spec.index, s, n)
                                for s, n in chunk_columns(b.gather_numel, 5))
            for b in opt.dear_engine.buckets})


def _train(name: str, sharded: bool, schedule: str, steps: int = STEPS,
           branch: bool = True) -> tuple[dict, dict, torch.optim.Optimizer]:
    rank, world = dear.rank(), dear.size()
    model = make_net()
    inner = ELEMENTWISE[name](_groups(model))
    inner.param_groups[1]["lr"] = inner.param_groups[1]["lr"] * 0.5
    optimizer = dear.DistributedOptimizer(inner, model=model, fusion_threshold=700,
                                          schedule=schedule, shard_optimizer_state=sharded)
    for step in range(steps):
        if sharded and schedule == "planned":
            force_plan(optimizer)              # early updates from the second step on
        optimizer.zero_grad()
        x, y = batch(step, world, rank)
        use = branch_used(step, rank) if branch else True
        F.mse_loss(model(x, use), y).backward()
        optimizer.step()
    state = optimizer.state_dict()             # every rank: the sharded one gathers
    return state_of(model), state, optimizer


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype
                and torch.equal(a, b))
    if isinstance(a, dict):
        return (isinstance(b, dict) and a.keys() == b.keys()
                and all(_same(a[k], b[k]) for k in a))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def bitwise_checks(names: list[str]) -> dict:
    """On 2 ranks every parameter is used: the early updates of the planned steps are kept;
    on 3 a branch some ranks skip makes every step undo them (tests/test_sharded_early.py
    covers the other reasons)."""
    dear.init()
    out: dict = {}
    branch = dear.size() == 3
    for name in names:
        plain, plain_state, _ = _train(name, False, "dear", branch=branch)
        planned, _, _ = _train(name, False, "planned", branch=branch)
        sharded, sharded_state, opt = _train(name, True, "planned", branch=branch)
        held = opt.dear_engine.updates.state.state
        out[name] = {
            "params": _same(plain, sharded), "planned_params": _same(planned, sharded),
            "state": _same(plain_state, sharded_state),
            "held": sum(v.numel() for s in held.values() for v in s.values()
                        if isinstance(v, torch.Tensor) and v.dim() > 0),
            "whole": sum(v.numel() for s in plain_state["state"].values() for v in s.values()
                         if isinstance(v, torch.Tensor) and v.dim() > 0),
            "scalars": sum(1 for s in held.values() for v in s.values()
                           if isinstance(v, torch.Tensor) and v.dim() == 0),
            "stats": opt.memory_stats(),
        }
    dear.shutdown()
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_elementwise_optimizers_same_bits_as_unsharded(world: int) -> None:
    names = list(ELEMENTWISE)
    results = run_distributed(bitwise_checks, world, names, timeout=240)
    for rank, res in enumerate(results):
        for name in names:
            r = res[name]
            assert r["params"], f"{name}, rank {rank}: parameters differ from unsharded dear"
            assert r["planned_params"], f"{name}, rank {rank}: differ from the planned schedule"
            assert r["state"], f"{name}, rank {rank}: state_dict() differs from unsharded dear"
    for name in names:
        held = [res[name]["held"] for res in results]
        whole = results[0][name]["whole"]
        # Each rank holds its own slice: together exactly the whole, none more than its share
        # (a shard is ceil(bucket / world) elements; the flags and padding hold no state).
        assert sum(held) == whole, (name, held, whole)
        assert max(held) < whole / world + 64 * world, (name, held, whole)
        for res in results:                  # what memory_stats() reports: the same bytes
            r = res[name]                    # (fp32 slices, and 0-dim steps of <= 8 bytes)
            assert 4 * r["held"] <= r["stats"]["state"] <= 4 * r["held"] + 8 * r["scalars"], r


def against_reference(world_check: bool) -> dict:
    dear.init()
    model = make_net()
    opt = dear.DistributedOptimizer(OPTIMIZERS["adam"](model.parameters()), model=model,
                                    fusion_threshold=700, shard_optimizer_state=True)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)   # as workloads.reference's
    for step in range(5):
        opt.zero_grad()
        x, y = batch(step, dear.size(), dear.rank())
        F.mse_loss(model(x), y).backward()
        opt.step()
        sched.step()
    result = state_of(model)
    dear.shutdown()
    return result


def test_trains_like_one_process_with_a_scheduler() -> None:
    """Independent of unsharded dear: single-process training on the global batch."""
    results = run_distributed(against_reference, 2, True, timeout=120)
    exact = reference("adam", 2, 5, scheduler=True, dtype=torch.float64)
    peer = reference("adam", 2, 5, scheduler=True)
    for res in results:
        assert_float32_close(res, exact, peer, what="sharded Adam + StepLR")
    assert all(torch.equal(results[0][k], results[1][k]) for k in results[0])


def sharded_runs(names: list[str]) -> dict:
    dear.init()
    out = {}
    for name in names:
        model = make_net()
        opt = dear.DistributedOptimizer(ELEMENTWISE[name](model.parameters()), model=model,
                                        fusion_threshold=700, shard_optimizer_state=True)
        for step in range(STEPS):
            opt.zero_grad()
            x, y = batch(step, dear.size(), dear.rank())
            F.mse_loss(model(x), y).backward()
            opt.step()
        out[name] = state_of(model)           # reads through the model: the last update lands
    dear.shutdown()
    return out


LESS_COMMON = ["adamax", "nadam", "radam", "asgd", "adadelta", "rprop"]


def test_less_common_optimizers_sharded_train_like_one_process() -> None:
    """Adamax, NAdam, RAdam, ASGD, Adadelta and Rprop with sharded state on 2 ranks against
    single-process training on the global batch (not only against unsharded dear)."""
    results = run_distributed(sharded_runs, 2, LESS_COMMON, timeout=240)
    for name in LESS_COMMON:
        exact = reference(ELEMENTWISE[name], 2, STEPS, dtype=torch.float64)
        peer = reference(ELEMENTWISE[name], 2, STEPS)
        for rank, res in enumerate(results):
            assert_float32_close(res[name], exact, peer, what=f"sharded {name}, rank {rank}")


class _Rank:
    rank = 0
    size = 1


def emulated_ranks_match(make: Callable[[Any], torch.optim.Optimizer], world: int,
                         device: str, steps: int = 4) -> None:
    """dear/sharding/state.py's update itself, without processes: `world` replicas each update their
    shard of one bucket (offsets that split parameters mid-way, padding), the shards put
    together must be the bits of the unsharded optimizer's step. On CUDA this covers the
    foreach and fused kernels on segments at arbitrary offsets."""
    from dear.fusion.bucket import Bucket
    from dear.fusion.planner import BucketSpec
    from dear.sharding.state import ShardedState
    gen = torch.Generator().manual_seed(3)
    shapes = [(7, 5), (13,), (3, 4, 2), (1,), (11,)]
    base = [torch.randn(s, generator=gen).to(device) for s in shapes]
    grads = [[torch.randn(s, generator=gen).to(device) for s in shapes] for _ in range(steps)]
    numels = [b.numel() for b in base]
    offsets = [sum(numels[:j]) for j in range(len(numels))]
    flags = sum(numels)
    padded = -(-(flags + len(numels)) // world) * world
    ref_params = [torch.nn.Parameter(b.clone()) for b in base]
    ref = make(ref_params)
    replicas = []
    for r in range(world):
        params = [torch.nn.Parameter(b.clone()) for b in base]
        spec = BucketSpec(0, tuple(range(len(params))), tuple(offsets), tuple(numels), flags,
                          padded, torch.float32, torch.device(device), world)
        bucket = Bucket(spec, params, native=False)
        comm = _Rank()
        comm.rank, comm.size = r, world
        state = ShardedState(comm)             # type: ignore[arg-type]
        state.layout([bucket])
        replicas.append((params, make(params), bucket, state))
    for step in range(steps):
        for p, g in zip(ref_params, grads[step]):
            p.grad = g.clone()
        ref.step()
        full = torch.zeros(padded, device=device)
        for o, g in zip(offsets, grads[step]):
            full[o:o + g.numel()] = g.reshape(-1)
        gathered = torch.zeros(padded, device=device)
        length = padded // world
        for r, (params, opt, bucket, state) in enumerate(replicas):
            bucket.shard.copy_(full[r * length:(r + 1) * length])
            hyper = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
            state.update(opt, type(opt).step, [[True] * len(params)], hyper)
            state.end_step()
            gathered[r * length:(r + 1) * length] = bucket.outgoing_shard()
        for params, _, _, _ in replicas:       # the all-gather and install
            for p, o, n in zip(params, offsets, numels):
                with torch.no_grad():
                    p.copy_(gathered[o:o + n].view(p.shape))
    for params, _, _, _ in replicas:
        for p, q in zip(params, ref_params):
            assert torch.equal(p, q), (make, world, device, (p - q).abs().max().item())


@pytest.mark.parametrize("name", sorted(ELEMENTWISE))
def test_update_on_segments_is_the_unsharded_update(name: str) -> None:
    for world in (2, 3, 5):
        emulated_ranks_match(ELEMENTWISE[name], world, "cpu")


# ------------------------------------------------- what a training loop does around step()
SHARDED = {"DEAR_SHARD_OPTIMIZER_STATE": "1"}


def loops_against_ddp() -> dict:
    """tests/test_amp.py's and tests/test_clip.py's loops, dear's side sharded (the variable)."""
    from tests.test_amp import amp_loop
    from tests.test_clip import clip_loop
    dear.init()
    out = {mode: amp_loop(mode) for mode in ("ddp", "ddp-clip", "dear", "dear-clip",
                                             "dear-sync-clip")}
    for norm_type in (2.0, float("inf")):
        out[("clip-ddp", norm_type)] = clip_loop("ddp", norm_type)
        out[("clip-dear", norm_type)] = clip_loop("dear", norm_type, 2048)
    dear.shutdown()
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_grad_scaler_and_clipping_match_ddp(world: int) -> None:
    from tests.test_amp import SKIPPED
    from tests.workloads import max_diff
    ranks = run_distributed(loops_against_ddp, world, env=SHARDED, timeout=200)
    for rank, res in enumerate(ranks):
        for mode, ref in (("dear", "ddp"), ("dear-clip", "ddp-clip"),
                          ("dear-sync-clip", "ddp-clip")):
            ours, theirs = res[mode], res[ref]
            assert ours["scales"] == theirs["scales"], (rank, mode)
            assert ours["adam_steps"] == {len(theirs["scales"]) - len(SKIPPED)}, (rank, mode)
            # Without clipping on 2 ranks DDP's bits (a sum of two does not depend on the
            # order); on 3 ranks the reduce-scatter sums in another order than DDP's all-reduce,
            # and clipping's coefficient may be a few ulps apart: float32 rounding (|w| < 1).
            bound = 0.0 if mode == "dear" and world == 2 else 1e-6
            assert max_diff(ours["params"], theirs["params"]) <= bound, (rank, mode)
            for got, want in zip(ours["norms"], theirs["norms"]):
                assert got == pytest.approx(want, rel=1e-5, nan_ok=True), (rank, mode)
        for norm_type in (2.0, float("inf")):
            ours, theirs = res[("clip-dear", norm_type)], res[("clip-ddp", norm_type)]
            assert ours["norms"] == pytest.approx(theirs["norms"], rel=1e-5)
            scale = max(v.abs().max().item() for v in theirs["params"].values())
            assert max_diff(ours["params"], theirs["params"]) <= 1e-5 * scale, (rank, norm_type)
        assert max_diff(res["dear-clip"]["params"], ranks[0]["dear-clip"]["params"]) == 0.0


def _loop(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range,
          passes: int = 1) -> None:
    rank, world = dear.rank(), dear.size()
    for step in steps:
        if opt.shard_optimizer_state:          # early updates (kept or undone) in every case
            force_plan(opt)
        opt.zero_grad()
        for k in range(passes):
            x, y = batch(step * passes + k, world, rank)
            F.mse_loss(model(x, branch_used(step, rank)), y).backward()
        opt.step()


def _wrapped(sharded: bool, params: Any = None, model: Any = None, **kw: Any) -> Any:
    model = model if model is not None else make_net()
    inner = torch.optim.Adam(model.parameters() if params is None else params, lr=0.01)
    return model, dear.DistributedOptimizer(inner, model=model, fusion_threshold=700,
                                            shard_optimizer_state=sharded, **kw)


def resume_and_changes() -> dict:
    dear.init()
    out: dict = {}
    # Resume: a checkpoint after 3 steps, loaded into a new model and optimizer, goes on to the
    # bits of the run that never stopped.
    model, opt = _wrapped(True)
    _loop(model, opt, range(3))
    saved = ({k: v.clone() for k, v in model.state_dict().items()}, opt.state_dict())
    _loop(model, opt, range(3, 6))
    out["straight"] = state_of(model)
    model, opt = _wrapped(True)
    model.load_state_dict(saved[0])
    opt.load_state_dict(saved[1])
    _loop(model, opt, range(3, 6))
    out["resumed"] = state_of(model)
    out["checkpoint"] = saved[1]
    # The whole state loads into torch's own Adam, which goes on as unsharded dear does.
    plain = torch.optim.Adam(make_net().parameters(), lr=0.01)
    plain.load_state_dict(saved[1])
    out["plain_loads"] = all(
        plain.state[p]["exp_avg"].shape == p.shape for g in plain.param_groups
        for p in g["params"] if p in plain.state)
    # A parameter set that changes: frozen at the wrap and unfrozen at step 2; a group added
    # at step 4; gradient accumulation; dear.join with one rank short of batches.
    for sharded in (False, True):
        model = make_net(frozen=True)
        head = list(model.head.parameters())
        rest = [p for n, p in model.named_parameters() if not n.startswith("head")]
        model, opt = _wrapped(sharded, rest, model)
        _loop(model, opt, range(2))
        model.fc2.requires_grad_(True)
        _loop(model, opt, range(2, 4))
        opt.add_param_group({"params": head, "lr": 0.02})
        _loop(model, opt, range(4, 7))
        out[("changes", sharded)] = state_of(model)
        out[("changes_state", sharded)] = opt.state_dict()
        model, opt = _wrapped(sharded, backward_passes_per_step=2)
        _loop(model, opt, range(3), passes=2)
        out[("accumulate", sharded)] = state_of(model)
        torch.manual_seed(0)                   # buffers: BatchNorm's, broadcast by rank 0
        bn = torch.nn.Sequential(torch.nn.Linear(24, 16), torch.nn.BatchNorm1d(16),
                                 torch.nn.Linear(16, 4))
        bn_opt = dear.DistributedOptimizer(torch.optim.AdamW(bn.parameters(), lr=0.01), model=bn,
                                           fusion_threshold=700, shard_optimizer_state=sharded)
        for step in range(3):
            bn_opt.zero_grad()
            x, y = batch(step, dear.size(), dear.rank())
            F.mse_loss(bn(x), y).backward()
            bn_opt.step()
        out[("buffers", sharded)] = state_of(bn)
        model, opt = _wrapped(sharded)
        with dear.join(opt):
            _loop(model, opt, range(3 + dear.rank()))
        out[("join", sharded)] = state_of(model)
    dear.shutdown()
    return out


def test_resume_parameter_changes_accumulation_join() -> None:
    ranks = run_distributed(resume_and_changes, 2, timeout=200)
    for rank, res in enumerate(ranks):
        assert _same(res["straight"], res["resumed"]), f"rank {rank}: resume is not bitwise"
        assert res["plain_loads"]
        assert _same(res["checkpoint"], ranks[0]["checkpoint"])
        for what in ("changes", "changes_state", "accumulate", "join", "buffers"):
            assert _same(res[(what, True)], res[(what, False)]), f"rank {rank}: {what}"
        assert _same(res[("join", True)], ranks[0][("join", True)])


def state_dict_on_one_rank() -> str:
    dear.init()
    model, opt = _wrapped(True)
    _loop(model, opt, range(2))
    try:
        if dear.rank() == 0:
            opt.state_dict()                   # the DDP habit: rank 0 alone saves
        _loop(model, opt, range(2, 4))
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_state_dict_on_one_rank_is_an_error_not_a_hang() -> None:
    """The DDP habit `if rank == 0: torch.save(optimizer.state_dict())`: rank 0 learns from
    rank 1's published flight record that it went on training (its next reduce-scatter), and
    says so; not after DEAR_TIMEOUT (30 s here: that message would be another)."""
    ranks = run_distributed(state_dict_on_one_rank, 2, env={"DEAR_TIMEOUT": "30"},
                            timeout=150)
    assert "Call it on every rank" in ranks[0], ranks[0]
    assert "rank(s) [1] went on training without calling it" in ranks[0], ranks[0]
    assert ranks[1] != "no error"              # its next collective had no partner


def refusals() -> dict:
    dear.init()
    out = {}

    class Lamb(torch.optim.Adam):              # a subclass whose step needs whole tensors
        def step(self, closure: Any = None) -> Any:
            return super().step(closure)

    cases: dict[str, Callable[[Any], Any]] = {
        "subclass": lambda p: Lamb(p),
        "adafactor": lambda p: torch.optim.Adafactor(p),
    }
    for name, make in cases.items():
        model = make_net()
        try:
            dear.DistributedOptimizer(make(model.parameters()), model=model,
                                      shard_optimizer_state=True)
            out[name] = "accepted"
        except ValueError as exc:
            out[name] = str(exc)
    for name, kw in {"fp16": {"compression": dear.Compression.fp16},
                     "views": {"gradient_as_bucket_view": True}}.items():
        model = make_net()
        try:
            dear.DistributedOptimizer(torch.optim.Adam(model.parameters()), model=model,
                                      shard_optimizer_state=True, **kw)
            out[name] = "accepted"
        except ValueError as exc:
            out[name] = str(exc)
        out[name + "_unconverted"] = type(model).__name__
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = dear.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                                    shard_optimizer_state=True)
    precond = dear.KFAC(model)
    try:
        opt.zero_grad()
        model(torch.randn(8, 4)).square().mean().backward()
        precond.step()
        opt.step()
        out["kfac"] = "accepted"
    except (ValueError, RuntimeError) as exc:
        out["kfac"] = str(exc)
    dear.shutdown()
    return out


def test_refused_with_the_alternative_named() -> None:
    out = run_distributed(refusals, 1, timeout=60)[0]
    for name in ("subclass", "adafactor"):
        assert "elementwise" in out[name] and "without shard_optimizer_state" in out[name], out
    assert "compression=dear.Compression.none" in out["fp16"]
    assert "gradient_as_bucket_view" in out["views"]
    assert "dear.KFAC" in out["kfac"] and "without shard_optimizer_state" in out["kfac"], out
    # Refused before anything was converted: the model is still the user's own class.
    assert out["fp16_unconverted"] == out["views_unconverted"] == "Net"


# ------------------------------------------------------------ sharded checkpoints (DCP)
def _compression(name: str) -> Any:
    """none, or int8 with a warm-up of 4 steps (its count must survive a checkpoint)."""
    return (dear.Compression.quantized(bits=8, block_size=16, warmup_steps=4) if name == "int8"
            else dear.Compression.none)


def dcp_save(path: str, compression: str = "none") -> None:
    import torch.distributed.checkpoint as dcp
    dear.init()
    model, opt = _wrapped(True, compression=_compression(compression))
    _loop(model, opt, range(3))
    dcp.save({"model": model.state_dict(), "optim": opt.sharded_state_dict()},
             checkpoint_id=os.path.join(path, "dcp"))
    whole = opt.state_dict()                   # every rank: it gathers
    if dear.rank() == 0:
        torch.save({"model": model.state_dict(), "optim": whole}, os.path.join(path, "whole.pt"))
    dear.shutdown()


def _state_elements(opt: Any) -> tuple[int, int]:
    """(elementwise optimizer state elements this rank holds: whole in the optimizer, in its
    shards or carried in pieces; the model's parameter elements)."""
    sharded = opt.dear_sharded_state
    held = [v for entry in opt.state.values() for v in entry.values()]
    held += [v for entry in sharded.state.values() for v in entry.values()]
    held += [v for piece in sharded.carried or () for v in piece.state.values()]
    return (sum(v.numel() for v in held if isinstance(v, torch.Tensor) and v.dim() > 0),
            sum(p.numel() for p in opt.dear_engine.params))


def dcp_resume(path: str, compression: str = "none") -> dict:
    import torch.distributed.checkpoint as dcp
    dear.init()
    out = {}
    for how in ("dcp-fresh", "dcp-after-a-step", "whole"):
        model, opt = _wrapped(True, compression=_compression(compression))
        if how == "dcp-after-a-step":          # a layout exists: each rank reads its pieces
            _loop(model, opt, range(1))
        if how == "whole":
            saved = torch.load(os.path.join(path, "whole.pt"))
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["optim"])
        else:
            state = {"model": model.state_dict(), "optim": opt.sharded_state_dict()}
            dcp.load(state, checkpoint_id=os.path.join(path, "dcp"))
            model.load_state_dict(state["model"])
            opt.load_sharded_state_dict(state["optim"])
            out[how + "-held"] = _state_elements(opt)
        _loop(model, opt, range(3, 6))
        out[how] = state_of(model)
        out[how + "-state"] = opt.state_dict()
    dear.shutdown()
    return out


@pytest.mark.parametrize("saved_on,resumed_on,compression",
                         [(2, 3, "none"), (3, 2, "none"), (2, 3, "int8")])
def test_dcp_checkpoint_resumes_on_another_world_size(tmp_path: Any, saved_on: int,
                                                      resumed_on: int, compression: str) -> None:
    """int8: on other ranks no rank's residuals apply, so loading the whole state (warm-up
    count kept, residuals from zero) is the reference for DCP's too; the warm-up's last step
    falls after the resume, so a lost count would show."""
    run_distributed(dcp_save, saved_on, str(tmp_path), compression, timeout=120)
    ranks = run_distributed(dcp_resume, resumed_on, str(tmp_path), compression, timeout=120)
    for rank, res in enumerate(ranks):
        # Loading the whole state (torch.save of state_dict(), itself checked against unsharded
        # dear) is the reference: both DCP paths must give its bits.
        for how in ("dcp-fresh", "dcp-after-a-step"):
            assert _same(res[how], res["whole"]), (rank, how)
            assert _same(res[how + "-state"], res["whole-state"]), (rank, how)
            # read as this rank's pieces only (Adam: two elementwise entries), never whole:
            # 1/N of each parameter, give or take a parameter's rounding or a shard's padding
            held, numel = res[how + "-held"]
            assert held <= 2 * (numel / resumed_on + len(res["whole-state"]["state"])), \
                (rank, how, held, numel)
