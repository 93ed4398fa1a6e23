"""Small models, data and training loops shared by the ranks and by the single-process reference.

The reference is independent of dear: plain torch on the concatenated global batch (the mean of
the per-rank losses, which is what data-parallel averaging computes)."""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.nn.functional as F

PER_RANK = 4


class Net(torch.nn.Module):
    """A few layers of different kinds and sizes, and an optional branch."""

    def __init__(self, frozen: bool = False) -> None:
        super().__init__()
        self.conv = torch.nn.Conv1d(2, 3, kernel_size=3, padding=1)
        self.fc1 = torch.nn.Linear(24, 32)
        self.norm = torch.nn.LayerNorm(32)
        self.fc2 = torch.nn.Linear(32, 16)
        self.branch = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 4)
        if frozen:
            self.fc2.requires_grad_(False)

    def forward(self, x: torch.Tensor, use_branch: bool = True) -> torch.Tensor:
        h = F.relu(self.conv(x.view(-1, 2, 12))).flatten(1)[:, :24]
        h = F.relu(self.norm(self.fc1(h)))
        h = F.relu(self.fc2(h))
        if use_branch:
            h = h + torch.tanh(self.branch(h))
        return self.head(h)


def make_net(frozen: bool = False) -> Net:
    torch.manual_seed(0)
    return Net(frozen)


def batch(step: int, world: int, rank: Optional[int] = None, per_rank: int = PER_RANK
          ) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(per_rank * world, 24, generator=g)
    y = torch.randn(per_rank * world, 4, generator=g)
    if rank is None:
        return x, y
    return x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.05),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.05),
}


def branch_used(step: int, rank: int) -> bool:
    """The branch runs on some ranks, on all, or on none, depending on the step."""
    if step % 3 == 2:
        return False
    return (step + rank) % 2 == 0 or step % 3 == 0


def reference(opt: Union[str, Callable[[Any], torch.optim.Optimizer]], world: int,
              steps: Union[int, Sequence[int]], *, frozen: bool = False,
              branch: bool = False, scheduler: bool = False, dtype: torch.dtype = torch.float32
              ) -> dict[str, torch.Tensor]:
    """Single process, global batch, plain torch; dtype=torch.float64 gives the exact answer
    (to float32's eyes) that float32 implementations are judged against (`assert_float32_close`).
    `steps`: how many, or which steps' batches (a step left out: an update dropped). `opt`: a
    name of OPTIMIZERS or a factory."""
    model = make_net(frozen).to(dtype)
    make = OPTIMIZERS[opt] if isinstance(opt, str) else opt
    optimizer = make([p for p in model.parameters() if p.requires_grad])
    sched = torch.optim.lr_scheduler.StepLR(optimizer, 2, 0.5) if scheduler else None
    for step in (range(steps) if isinstance(steps, int) else steps):
        optimizer.zero_grad()
        losses = []
        for r in range(world):
            x, y = batch(step, world, r)
            out = model(x.to(dtype), branch_used(step, r) if branch else True)
            losses.append(F.mse_loss(out, y.to(dtype)))
        torch.stack(losses).mean().backward()
        optimizer.step()
        if sched:
            sched.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def set_net() -> torch.nn.Module:
    """The small model of the process-set tests (tests/test_horovod.py, test_horovod_api.py)."""
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def set_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s batch of step `step` in the process-set tests."""
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)


def set_reference(start: dict[str, torch.Tensor], ranks: Sequence[int], steps: int = 4
                  ) -> dict[str, torch.Tensor]:
    """Single-process SGD (momentum 0.9) from `start` on the concatenated batches of `ranks`:
    what an optimizer averaging over the process set `ranks` must give."""
    net = set_net()
    net.load_state_dict(start)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        xs, ys = zip(*(set_batch(step, k) for k in ranks))
        opt.zero_grad()
        F.mse_loss(net(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
    return net.state_dict()


def state_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def to_cpu(value: Any) -> Any:
    """Tensors in (nested dicts, lists, tuples of) `value` on the CPU: what a rank returns."""
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {k: to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_cpu(v) for v in value)
    return value


def init_in_issue_mode(mode: str = "thread", device: str = "cpu") -> None:
    """dear.init() in a rank, `mode` "stream" forcing the GPU's way of issuing the planned
    schedule (dear/fusion/schedule.py's issue_mode; on CPU tensors the side stream is the
    host). On "cuda" the ranks share one GPU through Gloo's CUDA collectives, which order
    streams as NCCL's do (NCCL refuses two ranks on one GPU)."""
    import torch.distributed as dist

    import dear
    import dear.engine.engine
    if mode != "thread":
        dear.engine.engine.issue_mode = lambda params, comm: mode
    if device == "cuda":
        dist.init_process_group("gloo")
    dear.init()


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def train_autotuned(autotune: object, out_dir: str, world: int, steps: int,
                    settings: dict[str, str], observe: Callable[[Any, Any], Any]
                    ) -> tuple[torch.nn.Module, Any, list[Any]]:
    """On a rank: dear.init(), Adam on make_net() with the fusion autotuner (`settings`: its
    DEAR_AUTOTUNE_* variables; log and output in out_dir; a search space below 1 MB for this
    small model), `steps` iterations, `observe(model, optimizer)` after each step. The caller
    reads what it needs, then calls dear.shutdown()."""
    import os

    import dear
    import dear.autotune.online as tuner_module
    tuner_module.MIN_BYTES = 256
    # The tuners' own counting (settle, window) is what these tests check: DeAR's order, so a
    # trial's settling is not stretched to the planned schedule's measuring (2 x plan_after + 1).
    os.environ.setdefault("DEAR_SCHEDULE", "dear")
    os.environ.update(settings, DEAR_AUTOTUNE_LOG=os.path.join(out_dir, "trials.jsonl"),
                      DEAR_AUTOTUNE_OUT=os.path.join(out_dir, "fusion.json"))
    dear.init()
    rank = dear.rank()
    model = make_net()
    opt = dear.DistributedOptimizer(OPTIMIZERS["adam"](model.parameters()), model=model,
                                    fusion_threshold=1024, autotune=autotune)
    seen = []
    for step in range(steps):
        opt.zero_grad()
        x, y = batch(step, world, rank)
        F.mse_loss(model(x), y).backward()
        opt.step()
        seen.append(observe(model, opt))
    return model, opt, seen


# How far a float32 training run may be from the exact answer. Two correct float32
# implementations of the same math (dear, DDP, plain torch on the global batch) differ only in
# the order they sum gradients, so each carries its own rounding error, and optimizers that
# normalise the update (RMSprop, Adam, Adagrad) magnify it on components whose gradient is
# mostly cancellation (measured: RMSprop on 2 ranks, every float32 run 4.5e-4 from float64 while
# bit-identical to each other). No absolute tolerance fits every CPU: a run is judged against
# the float64 reference, by the error of the independent float32 runs made on the same machine.
FLOAT32_FACTOR = 4      # the same kind of error, summed in another order: same order of size
FLOAT32_FLOOR = 1e-6    # ~8 float32 ulps at the parameters' scale (|w| <= 1), for exact peers


def assert_float32_close(result: dict[str, torch.Tensor], exact: dict[str, torch.Tensor],
                         *peers: dict[str, torch.Tensor], what: str = "") -> None:
    """`result` is no farther from `exact` (float64 training) than FLOAT32_FACTOR times the
    farthest of `peers` (independent float32 runs of the same training), plus FLOAT32_FLOOR."""
    scale = max(max_diff(p, exact) for p in peers)
    err = max_diff(result, exact)
    assert err <= FLOAT32_FACTOR * scale + FLOAT32_FLOOR, (
        f"{what}: {err:.3g} from the float64 reference, while independent float32 runs are "
        f"{scale:.3g} from it")


def assert_trains_like_one_process(make_optimizer: Callable[[Any], torch.optim.Optimizer],
                                   device: str, steps: int = 4, **wrap: Any) -> None:
    """In a world of one (dear initialised), a small MLP trained through
    dear.DistributedOptimizer ends where plain torch ends (for the GPU tests: the device path
    of the deferred update against no dear at all)."""
    import dear
    torch.manual_seed(0)
    nets = [torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 2)).to(device) for _ in range(2)]
    nets[1].load_state_dict(nets[0].state_dict())
    opts = [dear.DistributedOptimizer(make_optimizer(nets[0].parameters()), model=nets[0],
                                      **wrap),
            make_optimizer(nets[1].parameters())]
    for _ in range(steps):
        x = torch.randn(32, 8, device=device)
        for net, opt in zip(nets, opts):
            opt.zero_grad()
            net(x).square().mean().backward()
            opt.step()
    opts[0].synchronize()
    for p, r in zip(*(net.parameters() for net in nets)):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)
