"""Horovod parity (issue 16, item 7): the positional order of hvd.DistributedOptimizer's
arguments (its 7th is the deprecated num_groups), process_set= (the global set is accepted,
others refused clearly) and set_backward_passes_per_step()."""

from __future__ import annotations

import inspect

import pytest
import torch.nn.functional as F

import dear
from tests.distributed import run_distributed
from tests.workloads import OPTIMIZERS, batch, make_net, max_diff, state_of


@pytest.fixture
def local_dear():
    dear.init(backend="local")
    yield
    dear.shutdown()


def test_positional_order_is_horovods() -> None:
    import horovod.torch as hvd
    theirs = list(inspect.signature(hvd.DistributedOptimizer).parameters)
    ours = list(inspect.signature(dear.DistributedOptimizer).parameters)
    assert theirs[6] == "num_groups"
    assert ours[:len(theirs)] == theirs


def test_seventh_positional_argument_is_num_groups(local_dear) -> None:
    model = make_net()
    sgd = OPTIMIZERS["sgd"](model.parameters())
    with pytest.warns(DeprecationWarning, match="num_groups"):
        opt = dear.DistributedOptimizer(sgd, model.named_parameters(), dear.Compression.none, 1,
                                        dear.Average, 1.0, 2)
    assert opt.dear_engine.options.groups == 2       # as Horovod: num_groups becomes groups
    x, y = batch(0, 1, 0)
    F.mse_loss(model(x), y).backward()
    opt.step()
    assert len(opt.dear_engine.buckets) == 2
    # The 8th positional argument is groups, the 9th sparse_as_dense (Horovod's order).
    model = make_net()
    lists = [[model.fc1.weight, model.fc1.bias]]
    opt = dear.DistributedOptimizer(OPTIMIZERS["sgd"](model.parameters()),
                                    model.named_parameters(), dear.Compression.none, 1,
                                    dear.Average, 1.0, 0, lists, True)
    options = opt.dear_engine.options
    assert options.groups == [[2, 3]] and options.sparse_as_dense is True


def test_process_set_global_is_accepted_unregistered_refused(local_dear) -> None:
    import horovod.torch as hvd
    model = make_net()
    for accepted in (None, hvd.global_process_set):
        dear.DistributedOptimizer(OPTIMIZERS["sgd"](model.parameters()), model=model,
                                  process_set=accepted)
    # A set of some ranks averages over them (tests/test_horovod.py); one Horovod does not
    # know of (not registered, or Horovod not started) is refused clearly.
    with pytest.raises(ValueError, match=r"process_set=.*not registered.*add_process_set"):
        dear.DistributedOptimizer(OPTIMIZERS["sgd"](model.parameters()), model=model,
                                  process_set=hvd.ProcessSet([0]))


def _passes_schedule() -> dict:
    """One pass per step, then two (set_backward_passes_per_step(2)), as Horovod does it."""
    dear.init()
    rank, world = dear.rank(), dear.size()
    model = make_net()
    opt = dear.DistributedOptimizer(OPTIMIZERS["sgd"](model.parameters()), model=model,
                                    fusion_threshold=2048)
    for step in range(4):
        if step == 2:
            opt.set_backward_passes_per_step(2)
        opt.zero_grad()
        x, y = batch(step, world, rank)
        if step < 2:
            F.mse_loss(model(x), y).backward()
        else:
            for half in (slice(0, 2), slice(2, 4)):
                (F.mse_loss(model(x[half]), y[half]) / 2).backward()
        if step == 3:
            try:
                opt.set_backward_passes_per_step(1)
            except RuntimeError as exc:
                refused = str(exc)
        opt.step()
    out = {"params": state_of(model), "refused": refused}
    dear.shutdown()
    return out


def test_set_backward_passes_per_step_matches_the_larger_batch() -> None:
    from tests.workloads import reference
    ref = reference("sgd", 2, 4)               # the global batch, one pass per step
    for out in run_distributed(_passes_schedule, 2, timeout=120):
        # Float32 training of the same batches, only summed in another order: rounding.
        assert max_diff(out["params"], ref) < 1e-5
        assert "between backward and step()" in out["refused"]
