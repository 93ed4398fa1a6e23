"""dear.KFAC inside dear.DistributedOptimizer's schedule (dear/kfac/overlap.py), on 2 and 3 Gloo
ranks: the plain loop `backward(); precond.step(); optimizer.step()` trains like the
single-process reference in which factors and gradients are averaged over the same shards of the
global batch (tests/kfac_workloads.py), while steps that keep the decompositions precondition the
reduced shards and leave the all-gathers to the next forward pass."""

from __future__ import annotations

import pytest
import torch

from tests import kfac_workloads as W
from tests.distributed import run_distributed

STEPS = 5
ARGS = {**W.ARGS, "inv_update_freq": 2}     # steps 0, 2, 4 decompose; 1 and 3 overlap
# (model, fusion threshold in bytes, read the parameters after every step, K-FAC options)
COMM_OPT = {"strategy": "comm-opt"}
CASES = [
    ("mlp", 25 << 20, True, COMM_OPT),   # one bucket; LayerNorm, a bias-free Linear
    ("cnn", 0, True, COMM_OPT),          # a bucket per layer: weight and bias stay together
    ("embed", 200, False, COMM_OPT),     # Embedding (diagonal A); applied by the next forward
    ("cnn", 1000, False, COMM_OPT),
    # no eigenbasis on every rank: every step synchronizes, then preconditions .grad
    ("mlp", 1000, True, {"strategy": "pad"}),
    ("cnn", 1000, False, {"strategy": "comm-opt", "method": "inverse"}),
]


def _train(cases: list, native: bool) -> list:
    import dear
    dear.init(native=native)
    rank, world = dear.rank(), dear.size()
    out = []
    for name, threshold, every_step, options in cases:
        model = W.make_model(name)
        opt = dear.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                        model=model, fusion_threshold=threshold)
        precond = dear.KFAC(model, **options, **ARGS)
        params, pending = [W.params_of(model)], []
        for step in range(STEPS):
            x, y = W.batch(name, step, world, rank)
            opt.zero_grad()
            W.loss_fn(model(x), y).backward()
            precond.step()
            opt.step()
            pending.append(opt.dear_engine.pending.count)
            if every_step:
                opt.flush_updates()
                params.append(W.params_of(model))
        opt.flush_updates()
        params.append(W.params_of(model))
        where, index = opt.dear_layout.where, opt.dear_parameter_index
        ties = all(where[index[m.weight]][0] is where[index[m.bias]][0]
                   for m in model.modules() if getattr(m, "bias", None) is not None
                   and hasattr(m, "weight"))
        out.append((params, pending, precond.overlapped_steps, ties))
        precond.remove_hooks()
    dear.shutdown()
    return out


def _delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


@pytest.mark.parametrize("world,native", [(1, True), (2, True), (3, False)])
def test_plain_loop_matches_the_reference_and_keeps_the_allgather_overlap(world, native):
    results = run_distributed(_train, world, CASES, native, timeout=240)
    for k, (name, _, every_step, options) in enumerate(CASES):
        method = options.get("method", "eigen")
        want = W.reference_params(name, world, STEPS, **ARGS, method=method)
        # at one rank PAD's gradient workers (a 1/world fraction) are every rank: comm-opt
        overlaps = (options["strategy"] == "comm-opt" or world == 1) and method == "eigen"
        for rank in range(world):
            params, pending, overlapped, ties = results[rank][k]
            assert overlapped == (2 if overlaps else 0), (name, options, overlapped)
            assert ties or not overlaps, "a layer's weight and bias were in different buckets"
            # overlapped steps (1 and 3) leave the all-gathers pending for the next forward;
            # the others synchronize inside precond.step()
            expect = [overlaps and step % 2 == 1 for step in range(STEPS)]
            assert [p > 0 for p in pending] == expect, (name, options, pending)
            steps = range(1, STEPS + 1) if every_step else [STEPS]
            for t in steps:
                got = _delta(params[t if every_step else -1], params[t - 1 if every_step else 0])
                ref = _delta(want[t], want[t - 1 if every_step else 0])
                diff = W.max_rel_diff(got, ref)
                assert diff < 1e-9, (name, rank, t, diff)
