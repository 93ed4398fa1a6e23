"""kfac-pytorch's KFACPreconditioner arguments, with its meanings, against the single-process
reference of tests/kfac_workloads.py (which follows kfac-pytorch's rules: see ReferenceKFAC) and
kfac-pytorch's registration rule (kfac/layers/register.py: re.search of each pattern in the
module's name and class name) written out here."""

from __future__ import annotations

import enum
import logging
import re

import pytest
import torch
from torch import nn

from dear.kfac import (KFAC, AssignmentStrategy, ComputeMethod, DistributedStrategy,
                       KFACPreconditioner, Strategy)
from tests import kfac_workloads as W

ARGS = dict(lr=0.1, damping=0.003, factor_decay=0.9, kl_clip=0.001)
TOL = 1e-9


class Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential()
        self.encoder.add_module("linear1", nn.Linear(4, 6))
        self.encoder.add_module("conv_like", nn.Linear(6, 6))
        self.fc = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.encoder(x))


def kfac_pytorch_registers(model: nn.Module, patterns: list[str]) -> list[str]:
    """kfac-pytorch 0.4.2's register_modules, for the layer types both support."""
    def any_match(query: str) -> bool:
        return any(re.compile(p).search(query) for p in patterns)
    return [name for name, m in model.named_modules()
            if not list(m.children()) and isinstance(m, (nn.Linear, nn.Conv2d))
            and not any_match(name) and not any_match(type(m).__name__)]


@pytest.mark.parametrize("model", [W.CNN, Nested])
@pytest.mark.parametrize("patterns", [[], ["conv"], ["fc"], ["linear"], ["Linear"], ["^conv1$"],
                                      ["encoder\\."], ["conv1", "Linear"], ["[0-9]$"]])
def test_skip_layers_are_searched_regular_expressions(model, patterns):
    net = model()
    want = kfac_pytorch_registers(net, patterns)
    if not want:
        with pytest.raises(ValueError, match="no layer K-FAC can precondition"):
            KFAC(net, skip_layers=patterns)
        return
    assert [s.name for s in KFAC(net, skip_layers=patterns).layers] == want
    assert [s.name for s in KFACPreconditioner(net, skip_layers=patterns).layers] == want


def _run(name: str, steps: int, make, passes: int = 1) -> tuple[list[dict], KFAC]:
    model = W.make_model(name)
    precond = make(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    out = []
    for step in range(steps):
        opt.zero_grad()
        for j in range(passes):
            x, y = W.batch(name, step * passes + j, 1)
            W.loss_fn(model(x), y).backward()
        precond.step()
        out.append(W.grads_of(model))
        opt.step()
    return out, precond


def _reference(name: str, steps: int, passes: int = 1, **kfac) -> list[dict]:
    model = W.make_model(name)
    ref = W.ReferenceKFAC(model, **kfac)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    out = []
    for step in range(steps):
        ref.backward_on_passes([[W.batch(name, step * passes + j, 1)] for j in range(passes)])
        ref.step()
        out.append(W.grads_of(model))
        opt.step()
    return out


def _same(got: list[dict], want: list[dict], tol: float = TOL) -> None:
    for step, (g, w) in enumerate(zip(got, want)):
        assert W.max_rel_diff(g, w) < tol, step


class TheirComputeMethod(enum.Enum):      # kfac.enums.ComputeMethod's shape
    EIGEN = 1
    INVERSE = 2


@pytest.mark.parametrize("method", ["inverse", "INVERSE", ComputeMethod.INVERSE,
                                    TheirComputeMethod.INVERSE])
def test_update_steps_and_compute_method(method):
    got, precond = _run("cnn", 7, lambda m: KFAC(m, **ARGS, factor_update_steps=2,
                                                inv_update_steps=3, compute_method=method))
    assert precond.method is ComputeMethod.INVERSE
    assert precond.factor_update_steps == 2 and precond.inv_update_freq == 3
    _same(got, _reference("cnn", 7, **ARGS, factor_update_freq=2, inv_update_freq=3,
                          method="inverse"))
    with pytest.raises(ValueError, match="name the same setting"):
        KFAC(W.make_model("cnn"), inv_update_freq=4, inv_update_steps=3)


def test_damping_schedule_between_decompositions():
    """kfac-pytorch (compute_eigenvalue_outer_product=True, its default and dear's): the damping
    of the step that decomposed is used until the next decomposition; False: the current one."""
    sched = dict(ARGS, damping=lambda s: [0.05, 0.02, 0.004, 0.001, 0.03, 0.0005, 0.01][s],
                 inv_update_freq=3)
    frozen = _reference("mlp", 7, **sched)
    current = _reference("mlp", 7, **sched, compute_eigenvalue_outer_product=False)
    assert W.max_rel_diff(frozen[2], current[2]) > 1e-3        # the two rules differ
    _same(_run("mlp", 7, lambda m: KFAC(m, **sched))[0], frozen)
    _same(_run("mlp", 7, lambda m: KFAC(m, **sched, compute_eigenvalue_outer_product=False))[0],
          current)


@pytest.mark.parametrize("passes,accumulation,in_hook", [(2, 1, True), (2, 2, True),
                                                         (3, 2, True), (2, 1, False)])
def test_accumulation_steps(passes, accumulation, in_hook):
    """kfac-pytorch: with update_factors_in_hook every `accumulation_steps` passes make one
    running-average update (leftover passes wait for the next step); without it, one update
    per step."""
    got, _ = _run("cnn", 5, lambda m: KFAC(m, **ARGS, inv_update_freq=2,
                                          accumulation_steps=accumulation,
                                          update_factors_in_hook=in_hook), passes)
    want = _reference("cnn", 5, passes, **ARGS, inv_update_freq=2,
                      accumulation_steps=accumulation if in_hook else None)
    _same(got, want)
    if (passes, accumulation) == (2, 1):     # it matters: dear's default differs
        default, _ = _run("cnn", 5, lambda m: KFAC(m, **ARGS, inv_update_freq=2), passes)
        assert (W.max_rel_diff(default[-1], want[-1]) > 1e-4) == in_hook


def test_hyperparameter_attributes_are_current_values():
    precond = KFAC(W.make_model("mlp"), lr=lambda s: 0.1 / (s + 1), damping=0.002,
                   inv_update_steps=lambda s: 1 + s)
    precond.steps = 3
    assert precond.lr == pytest.approx(0.025) and precond.damping == 0.002
    assert precond.inv_update_steps == 4 == precond.inv_update_freq
    precond.factor_update_steps = 5
    assert precond.factor_update_freq == 5


def test_memory_usage_and_reset_batch():
    model = W.make_model("mlp")
    precond = KFAC(model, **ARGS)
    x, y = W.batch("mlp", 0, 1)
    W.loss_fn(model(x), y).backward()
    sizes = precond.memory_usage()
    assert sizes["a_batch"] == 8 * (11 * 11 + 16 * 16 + 13 * 13)   # float64, fc1..fc3 (+bias)
    assert sizes["a_factors"] == sizes["a_inverses"] == 0
    precond.reset_batch()
    assert precond.memory_usage()["a_batch"] == 0
    precond.step()                               # nothing recorded: factors stay unset
    assert all(s.a is None for s in precond.layers)
    W.loss_fn(model(x), y).backward()
    precond.step()
    sizes = precond.memory_usage()
    assert sizes["a_factors"] == 8 * (11 * 11 + 16 * 16 + 13 * 13)
    assert sizes["g_inverses"] == 8 * (16 * 17 + 12 * 13 + 4 * 5)   # Q and d of each G
    assert sizes["total"] == sum(v for k, v in sizes.items() if k != "total")


def test_factor_and_inverse_dtypes():
    got, precond = _run("mlp", 4, lambda m: KFAC(m, **ARGS, inv_update_freq=2,
                                                factor_dtype=torch.float32,
                                                inv_dtype=torch.float32))
    s = precond.layers[0]
    assert s.a.dtype == torch.float32 and s.g_dec.q.dtype == torch.float32
    _same(got, _reference("mlp", 4, **ARGS, inv_update_freq=2), tol=1e-4)   # float32 rounding
    # half-precision factors (kfac-pytorch's factor_dtype) are decomposed in float32
    got, precond = _run("mlp", 4, lambda m: KFAC(m, **ARGS, inv_update_freq=2,
                                                factor_dtype=torch.bfloat16))
    s = precond.layers[0]
    assert s.a.dtype == torch.bfloat16 and s.g_dec.q.dtype == torch.float32
    _same(got, _reference("mlp", 4, **ARGS, inv_update_freq=2), tol=0.1)    # bf16: 3 digits


def test_kfac_preconditioner_has_kfac_pytorchs_defaults():
    precond = KFACPreconditioner(W.make_model("mlp"))
    assert (precond.inv_update_steps, precond.factor_update_steps) == (1, 1)
    assert precond.settings.inv_dtype == torch.float32 and precond.settings.colocate
    assert precond.settings.accumulation_steps == 1 and not precond.symmetric
    assert precond.strategy is Strategy.COMM_OPT
    assert precond.settings.assignment is AssignmentStrategy.COMPUTE
    got, _ = _run("mlp", 4, lambda m: KFACPreconditioner(m, inv_dtype=torch.float64))
    _same(got, _reference("mlp", 4, damping=0.001, factor_decay=0.95, kl_clip=0.001, lr=0.1,
                          inv_update_freq=1))


def test_grad_worker_fraction_on_one_rank_and_bad_values():
    model = W.make_model("mlp")
    for fraction in (1, 0.5, 0, DistributedStrategy.MEM_OPT, "hybrid_opt"):
        assert KFAC(model, grad_worker_fraction=fraction).strategy is Strategy.COMM_OPT
    with pytest.raises(ValueError, match="grad_worker_fraction must be in"):
        KFAC(model, grad_worker_fraction=1.5)
    with pytest.raises(ValueError, match="pass one of them"):
        KFAC(model, strategy="pad", grad_worker_fraction=1)


def test_loads_a_kfac_pytorch_checkpoint():
    """kfac-pytorch's state_dict: 'steps', plain hyperparameters, and per layer only 'A' and
    'G'; loading restores them and recomputes the decompositions at the next step (unless
    compute_inverses=False); dear's state_dict has the same keys."""
    model = W.make_model("mlp")
    names = [n for n, _ in W.kfac_layers(model)]
    factors = {n: {"A": torch.eye(d) * 2.0, "G": torch.eye(e) * 3.0}
               for n, d, e in zip(names, (11, 16, 13), (16, 12, 4))}
    theirs = {"steps": 5, "damping": 0.01, "inv_update_steps": 4, "factor_update_steps": 1,
              "factor_decay": 0.9, "kl_clip": 0.002, "lr": 0.2, "layers": factors}
    precond = KFAC(model, **ARGS)
    precond.load_state_dict(theirs)
    assert (precond.steps, precond.damping, precond.inv_update_steps, precond.lr) == (5, 0.01,
                                                                                      4, 0.2)
    assert torch.equal(precond.layers[0].a, factors["fc1"]["A"])
    x, y = W.batch("mlp", 0, 1)
    W.loss_fn(model(x), y).backward()
    precond.step()                      # step 5 is no inverse step (every 4): decomposes anyway
    assert precond.layers[0].a_dec is not None and precond._dec_damping == 0.01
    mine = precond.state_dict()
    assert {k for k in theirs if k != "layers"} <= set(mine)
    lazy = KFAC(W.make_model("mlp"), **ARGS)
    lazy.load_state_dict(theirs, compute_inverses=False)
    assert not lazy._force_decompose


def test_loglevel_of_the_registration_lines(caplog):
    with caplog.at_level(logging.INFO, logger="dear"):
        KFAC(W.make_model("cnn"), loglevel=logging.INFO)
        KFAC(W.make_model("mlp"))                      # kfac-pytorch's default: DEBUG
    messages = [r.getMessage() for r in caplog.records]
    registered = [m for m in messages if "Registered" in m]        # kfac-pytorch's word
    assert [re.search(r"name='(\w+)'", m).group(1) for m in registered] == ["conv1", "conv2", "fc"]
    # at kfac-pytorch's default level nothing reaches INFO (its tests count the records)
    assert sum("KAISAAssignment" in m for m in messages) == 1, messages
    # dear.KFAC says at INFO which layers it left to the optimizer (both constructions)
    assert sum("left to the optimizer" in m for m in messages) == 2, messages
    assert len(messages) == 6, messages
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="dear"):   # kfac-pytorch's class: nothing
        KFACPreconditioner(W.make_model("mlp"))
    assert not caplog.records, [r.getMessage() for r in caplog.records]


class _ParamScheduler:
    """What kfac-pytorch's LambdaParamScheduler does to a preconditioner (kfac/scheduler.py,
    v0.4.2): refuse a hyperparameter that is already a callable, then multiply the stored
    values by the lambdas' factors at each step, through the underscore attributes."""

    NAMES = ("factor_update_steps", "inv_update_steps", "damping", "factor_decay", "kl_clip",
             "lr")

    def __init__(self, preconditioner, **lambdas):
        self.p, self.lambdas = preconditioner, lambdas
        for name in lambdas:
            if callable(getattr(preconditioner, f"_{name}")):
                raise ValueError(f"preconditioner.{name} is already a callable")

    def step(self, step=None):
        for name, fn in self.lambdas.items():
            factor = fn(step if step is not None else self.p.steps)
            value = getattr(self.p, f"_{name}") * factor
            setattr(self.p, f"_{name}", int(value) if name.endswith("steps") else value)


def test_kfac_pytorchs_param_scheduler_drives_the_preconditioner():
    """kfac-pytorch's CIFAR example builds its LambdaParamScheduler on the preconditioner: it
    reads and writes `_factor_update_steps`, `_damping`, ... (it crashed on AttributeError)."""
    p = KFACPreconditioner(W.make_model("mlp"), factor_update_steps=2, inv_update_steps=4,
                           damping=0.01, lr=0.1)
    with pytest.raises(ValueError):
        _ParamScheduler(KFACPreconditioner(W.make_model("mlp"), damping=lambda s: 0.01),
                        damping=lambda s: 2)
    sched = _ParamScheduler(p, damping=lambda s: 0.5, inv_update_steps=lambda s: 2,
                            lr=lambda s: 0.1)
    p._steps = 3                               # kfac-pytorch's own counter, as its tests set it
    assert p.steps == 3
    sched.step()
    assert (p.damping, p.inv_update_steps, p.factor_update_steps) == (0.005, 8, 2)
    assert p.lr == pytest.approx(0.01) and p._damping == 0.005
    p._damping = lambda step: 0.001 * step     # a callable, as given, evaluated when read
    assert callable(p._damping) and p.damping == pytest.approx(0.003)


def test_kfac_pytorchs_read_only_attributes_and_argument_rules():
    p = KFACPreconditioner(W.make_model("mlp"), allreduce_bucket_cap_mb=0,
                           assignment_strategy="memory", compute_method="inverse")
    assert p.allreduce_method.name == "ALLREDUCE"
    assert p.assignment_strategy is AssignmentStrategy.MEMORY
    assert p.compute_method is ComputeMethod.INVERSE
    assert p.distributed_strategy is DistributedStrategy.COMM_OPT and p.grad_worker_fraction == 1
    assert KFACPreconditioner(W.make_model("mlp")).allreduce_method.name == "ALLREDUCE_BUCKETED"
    with pytest.raises(ValueError, match="colocate_factors"):
        KFACPreconditioner(W.make_model("mlp"), compute_method="eigen", colocate_factors=False)
    with pytest.warns(UserWarning, match="Enabling colocate_factors"):
        p = KFACPreconditioner(W.make_model("mlp"), compute_method="inverse",
                               colocate_factors=False,
                               grad_worker_fraction=DistributedStrategy.MEM_OPT)
    assert p.colocate_factors is True
    KFACPreconditioner(W.make_model("mlp"), factor_decay=1)   # (0, 1] as kfac-pytorch


# kfac-pytorch 0.4.2's kfac/enums.py, as its users import them (values ints, dear's strings).
THEIR_MEMBERS = {"ComputeMethod": {"EIGEN": 1, "INVERSE": 2},
         "AssignmentStrategy": {"COMPUTE": 1, "MEMORY": 2},
         "DistributedStrategy": {"COMM_OPT": 1, "MEM_OPT": 2, "HYBRID_OPT": 3},
         "AllreduceMethod": {"ALLREDUCE": 1, "ALLREDUCE_BUCKETED": 2}}
THEIRS = {name: enum.Enum(name, members) for name, members in THEIR_MEMBERS.items()}


def test_what_a_kfac_pytorch_user_reads_back_equals_kfac_pytorchs_members():
    """kfac-pytorch's test_preconditioner_init compares the preconditioner's choices with its own
    enum members: they compare equal either side first (and hash alike, for dict lookups),
    differently named members do not, and dear's own members still compare by identity."""
    D, A = THEIRS["DistributedStrategy"], THEIRS["AllreduceMethod"]
    p = KFACPreconditioner(W.make_model("mlp"), compute_method="inverse",
                           assignment_strategy="memory", allreduce_bucket_cap_mb=0)
    pairs = [(p.compute_method, THEIRS["ComputeMethod"].INVERSE),
             (p.assignment_strategy, THEIRS["AssignmentStrategy"].MEMORY),
             (p.distributed_strategy, D.COMM_OPT), (p.allreduce_method, A.ALLREDUCE)]
    for ours, theirs in pairs:
        assert ours == theirs and theirs == ours and not ours != theirs, (ours, theirs)
        assert {theirs: 1}.get(ours) == 1 and {ours: 1}.get(theirs) == 1
    assert p.distributed_strategy != D.MEM_OPT and D.HYBRID_OPT != p.distributed_strategy
    assert p.allreduce_method != A.ALLREDUCE_BUCKETED
    assert KFACPreconditioner(W.make_model("mlp")).allreduce_method == A.ALLREDUCE_BUCKETED
    assert p.distributed_strategy is DistributedStrategy.COMM_OPT
    assert DistributedStrategy.MEM_OPT != Strategy.MEM_OPT      # another enum of dear's
    assert DistributedStrategy.MEM_OPT != "mem-opt" and DistributedStrategy.MEM_OPT != 2
