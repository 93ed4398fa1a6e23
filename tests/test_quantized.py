"""Quantized compression (dear.Compression.int8/int4): error feedback's algebra against a
reference of several ranks in one process (plain torch, quantizing with the numpy closed form of
tests/quantize_closed_form.py, no code of dear's), ranks bit-identical, the warm-up,
checkpoint/resume with the residuals, the settings check and the refusals."""

from __future__ import annotations

import functools
import math
import os
import tempfile
from typing import Optional

import pytest
import torch
import torch.nn.functional as F

import dear
from tests import kfac_workloads as W
from tests import quantize_closed_form as CF
from tests.distributed import run_distributed
from tests.workloads import batch, make_net, max_diff, state_of

IN, OUT, STEPS, LR = 24, 50, 6, 0.1


def _linear() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(IN, OUT, bias=False)


def _data(step: int, world: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, _ = batch(step, world, rank)
    g = torch.Generator().manual_seed(7 + step)
    y = torch.randn(world * x.shape[0], OUT, generator=g)[rank * x.shape[0]:(rank + 1) * x.shape[0]]
    return x, y


def _train_linear(compression, steps: int = STEPS, passes: int = 1, early: bool = False,
                  **kwargs) -> torch.Tensor:
    """`early`: a planned schedule from the first step (sharded: each bucket updated in
    backward and its parameters gathered in chunks)."""
    from tests.test_sharded import force_plan
    dear.init()
    model = _linear()
    opt = dear.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR), model=model,
                                    compression=compression, backward_passes_per_step=passes,
                                    **kwargs)
    for step in range(steps):
        if early:
            force_plan(opt)
        opt.zero_grad()
        x, y = _data(step, dear.size(), dear.rank())
        for xs, ys in zip(x.chunk(passes), y.chunk(passes)):
            F.mse_loss(model(xs), ys).backward()
        opt.step()
    opt.flush_updates()
    return model.weight.detach().clone()


def _q(x: torch.Tensor, residual, bits: int, block: int) -> torch.Tensor:
    """Quantize-dequantize with the numpy closed form (residual updated in place)."""
    out, new = CF.round_trip(x.numpy(), None if residual is None else residual.numpy(), block,
                             bits)
    if residual is not None:
        residual.copy_(torch.from_numpy(new))
    return torch.from_numpy(out)


def _reference(world: int, bits: int, block: int, steps: int = STEPS,
               feedback: bool = True, passes: int = 1, sharded: bool = False,
               averages: Optional[list] = None) -> torch.Tensor:
    """The algebra of docs/compression.md written out for one weight (one bucket: the gradient,
    one usage flag, zero padding), every rank in this process: chunk c of rank r is quantized
    with r's residual and summed in rank order by rank c, unquantized for r == c; the average
    is quantized once more, its rounding (times the world size) kept by its owner. `sharded`
    (shard_optimizer_state): the owner updates its chunk with the average itself and the
    parameters travel in fp32, so nothing is rounded a second time and the owner's residual
    is spent. `averages` receives each step's average of the gradient before the all-gather
    rounds it (what clipping sees)."""
    model = _linear()
    numel = model.weight.numel()
    padded = -(-(numel + 1) // world) * world
    shard = padded // world
    residual = [torch.zeros(padded) for _ in range(world)]
    for step in range(steps):
        bufs = []
        for r in range(world):
            model.zero_grad()
            x, y = _data(step, world, r)
            for xs, ys in zip(x.chunk(passes), y.chunk(passes)):   # .grad accumulates
                F.mse_loss(model(xs), ys).backward()
            buf = torch.zeros(padded)
            buf[:numel] = model.weight.grad.reshape(-1)
            buf[numel] = 1.0
            bufs.append(buf)
        averaged = torch.empty(padded)
        for c in range(world):
            lo, hi = c * shard, (c + 1) * shard
            q = min(max(numel - lo, 0), shard)          # quantized length of chunk c
            total = torch.zeros(shard)
            for r in range(world):
                res = residual[r][lo:lo + q] if feedback else None
                part = bufs[r][lo:hi].clone()
                if r == c:
                    if feedback:
                        part[:q] += res
                else:
                    part[:q] = _q(part[:q].clone(), res, bits, block)
                total += part
            avg = total * (1.0 / world)
            if averages is not None:
                if c == 0:
                    averages.append(torch.empty(padded))
                averages[-1][lo:hi] = avg
            own = residual[c][lo:lo + q] if feedback else None
            if feedback:
                own.zero_()
            if sharded:
                averaged[lo:hi] = avg
                continue
            averaged[lo:lo + q] = _q(avg[:q].clone(), own, bits, block)
            averaged[lo + q:hi] = avg[q:]
            if feedback and world != 1:
                own.div_(1.0 / world)
        with torch.no_grad():                           # torch.optim.SGD's arithmetic
            model.weight.add_(averaged[:numel].view_as(model.weight), alpha=-LR)
    return model.weight.detach().clone()


@functools.lru_cache(maxsize=None)
def _runs(world: int, bits: int, block: int, feedback: bool, passes: int = 1,
          views: bool = False, sharded: bool = False, early: bool = False) -> tuple:
    comp = dear.Compression.quantized(bits=bits, block_size=block, error_feedback=feedback)
    return tuple(run_distributed(_train_linear, world, comp, STEPS, passes, early,
                                 gradient_as_bucket_view=views, shard_optimizer_state=sharded,
                                 timeout=120))


@pytest.mark.parametrize("world,bits,block,feedback", [
    (2, 8, 64, True), (3, 8, 50, True), (2, 4, 32, True), (2, 8, 64, False)])
def test_error_feedback_matches_the_plain_torch_reference(world, bits, block, feedback):
    ranks = _runs(world, bits, block, feedback)
    ref = _reference(world, bits, block, feedback=feedback)
    for r, weight in enumerate(ranks):
        assert torch.equal(weight, ranks[0]), f"rank {r} differs from rank 0"
    # The same operations in the same order: equal to the last bit (the native kernels
    # reproduce the reference quantizer bitwise, tests/test_quantize.py).
    assert torch.equal(ranks[0], ref), (ranks[0] - ref).abs().max()
    # And it is not the fp32 answer (the test could tell them apart).
    fp32 = _reference_fp32(world)
    assert not torch.equal(ranks[0], fp32)


@pytest.mark.parametrize("world,bits,early", [(2, 8, False), (3, 4, False), (2, 8, True)])
def test_sharded_optimizer_state_quantizes_the_reduce_scatter_only(world, bits, early):
    """shard_optimizer_state=True: each rank updates its chunk with the average of the
    quantized reduce-scatter, and the parameters come back in fp32: the reference's sharded
    algebra to the last bit, and not the unsharded one (which rounds the average again).
    `early`: the same with each update run in backward and the parameters gathered in
    chunks (a planned schedule)."""
    ranks = _runs(world, bits, 64, True, sharded=True, early=early)
    ref = _reference(world, bits, 64, sharded=True)
    for r, weight in enumerate(ranks):
        assert torch.equal(weight, ref), (r, (weight - ref).abs().max())
    assert not torch.equal(ranks[0], _reference(world, bits, 64))


def _train_chunked(bits: int) -> tuple[torch.Tensor, int]:
    """_train_linear with a planned schedule from the first step, counting the all-gather
    chunks the quantized bucket sent."""
    from dear.fusion.quantized import QuantizedBucket
    chunks = []
    original = QuantizedBucket.gather_columns

    def counted(self, comm, start, length):
        chunks.append((start, length))
        return original(self, comm, start, length)
    QuantizedBucket.gather_columns = counted
    try:
        weight = _train_linear(dear.Compression.quantized(bits=bits, block_size=64), early=True)
    finally:
        QuantizedBucket.gather_columns = original
    return weight, len(chunks)


@pytest.mark.parametrize("world,bits", [(2, 8), (3, 4)])
def test_all_gather_chunks_in_backward_give_the_reference(world, bits):
    """A planned schedule sends the quantized all-gather in chunks during backward (byte
    ranges of the slot, quantized once at the first): every chunk went out, and the weights
    are the reference's algebra to the last bit, as when the slot is gathered whole."""
    ranks = run_distributed(_train_chunked, world, bits, timeout=120)
    ref = _reference(world, bits, 64)
    for weight, chunks in ranks:
        assert chunks > STEPS, chunks            # several chunks a step, every step
        assert torch.equal(weight, ref), (weight - ref).abs().max()


def _clipped(early: bool) -> tuple[float, torch.Tensor]:
    from tests.test_sharded import force_plan
    dear.init()
    model = _linear()
    opt = dear.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR), model=model,
                                    compression=dear.Compression.quantized(bits=4, block_size=32))
    norm = 0.0
    for step in range(2):
        if early:
            force_plan(opt)
        opt.zero_grad()
        x, y = _data(step, dear.size(), dear.rank())
        F.mse_loss(model(x), y).backward()
        got = float(opt.clip_grad_norm_(0.01))
        norm = norm or got
        opt.step()
    opt.flush_updates()
    return norm, model.weight.detach().clone()


@pytest.mark.parametrize("early", [False, True])
def test_clipping_sees_the_averaged_dequantized_gradient(early):
    """clip_grad_norm_ under int4: its norm is that of the average the quantized
    reduce-scatter gives (the reference's, before the all-gather rounds it), to float32
    rounding, and not the fp32 average's (first step); the clipped updates are the same bits
    on every rank. `early`: from the second step the all-gathers go in chunks during backward
    and the clip factor multiplies what they bring."""
    ranks = run_distributed(_clipped, 2, early, timeout=120)
    averages: list = []
    _reference(2, 4, 32, steps=1, averages=averages)
    want = float(torch.linalg.vector_norm(averages[0][:IN * OUT]))
    model = _linear()                            # fp32's first averaged gradient
    loss = sum(F.mse_loss(model(x), y) for x, y in (_data(0, 2, r) for r in range(2))) / 2
    loss.backward()
    fp32 = float(torch.linalg.vector_norm(model.weight.grad))
    # Float32 sums of 1,200 squares in another order differ by at most n x eps (1.4e-4) of
    # the sum, 7e-5 of the norm: 1e-4 covers that; int4's rounding moves the norm by 7e-3.
    assert abs(want - fp32) > 1e-3 * fp32       # the two norms can be told apart
    for norm, weight in ranks:
        assert norm > 0.01                       # clipping acted
        assert abs(norm - want) <= 1e-4 * want, (norm, want, fp32)
        assert torch.equal(weight, ranks[0][1])
        assert bool(torch.isfinite(weight).all())


def _reference_fp32(world: int, steps: int = STEPS) -> torch.Tensor:
    model = _linear()
    for step in range(steps):
        model.zero_grad()
        loss = sum(F.mse_loss(model(x), y) for x, y in (_data(step, world, r)
                                                        for r in range(world))) / world
        loss.backward()
        with torch.no_grad():
            model.weight.add_(model.weight.grad, alpha=-LR)
    return model.weight.detach().clone()


@pytest.mark.parametrize("passes,views", [(2, False), (1, True)])
def test_accumulation_and_bucket_views_give_the_reference(passes, views):
    """backward_passes_per_step=2 quantizes the accumulated gradient; with
    gradient_as_bucket_view the .grad views are the quantized buffer: both the reference's
    algebra to the last bit."""
    ranks = _runs(2, 8, 64, True, passes, views)
    ref = _reference(2, 8, 64, passes=passes)
    for weight in ranks:
        assert torch.equal(weight, ref), (weight - ref).abs().max()


def test_error_feedback_keeps_training_on_the_fp32_path():
    """Error feedback delays what rounding drops instead of losing it: after a few steps the
    int8 weights are closer to fp32 training's with it than without it."""
    with_ef = _runs(2, 8, 64, True)[0]
    without = _runs(2, 8, 64, False)[0]
    fp32 = _reference_fp32(2)
    assert (with_ef - fp32).norm() < (without - fp32).norm()


def _train_net(compression, steps: int, save_at: int = -1, load: str = "",
               sharded: bool = False) -> dict:
    dear.init()
    rank, world = dear.rank(), dear.size()
    model = make_net()
    opt = dear.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), model=model,
                                    compression=compression, fusion_threshold=2048,
                                    shard_optimizer_state=sharded)
    start = 0
    if load:
        blob = torch.load(os.path.join(load, f"{rank}.pt"), weights_only=False)
        model.load_state_dict(blob["model"])
        opt.load_state_dict(blob["opt"])
        start = blob["step"]
    for step in range(start, steps):
        opt.zero_grad()
        x, y = batch(step, world, rank)
        F.mse_loss(model(x), y).backward()
        opt.step()
        if step + 1 == save_at:
            opt.flush_updates()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": save_at},
                       os.path.join(os.environ["CKPT"], f"{rank}.pt"))
    opt.flush_updates()
    return state_of(model)


@pytest.mark.parametrize("sharded", [False, True])
def test_checkpoint_resume_is_bit_identical_with_residuals(sharded):
    """Each rank saves and loads its own optimizer.state_dict() (with shard_optimizer_state
    the whole state, gathered): the resumed run has the uninterrupted run's bits."""
    comp = dear.Compression.quantized(bits=8, block_size=16)
    with tempfile.TemporaryDirectory() as ckpt:
        env = {"CKPT": ckpt}
        straight = run_distributed(_train_net, 2, comp, 8, 4, "", sharded, env=env, timeout=120)
        resumed = run_distributed(_train_net, 2, comp, 8, -1, ckpt, sharded, env=env,
                                  timeout=120)
        blob = torch.load(os.path.join(ckpt, "1.pt"), weights_only=False)
    state = blob["opt"]["dear_error_feedback"]
    assert state["rank"] == 1 and state["steps"] == 4
    assert any(t.abs().max() > 0 for t in state["residuals"].values())
    for a, b in zip(straight, resumed):
        assert max_diff(a, b) == 0.0


def _warmup_run(compression) -> list[dict]:
    return run_distributed(_train_net, 2, compression, 5, timeout=120)


def test_warmup_steps_run_in_fp32_then_quantize():
    fp32 = run_distributed(_train_net, 2, dear.Compression.none, 3, timeout=120)
    warm3 = run_distributed(_train_net, 2, dear.Compression.quantized(warmup_steps=3), 3,
                            timeout=120)
    assert max_diff(fp32[0], warm3[0]) == 0.0           # the warm-up is fp32 exactly
    warm2 = run_distributed(_train_net, 2, dear.Compression.quantized(warmup_steps=2,
                                                                      block_size=16), 3,
                            timeout=120)
    assert max_diff(fp32[0], warm2[0]) > 0.0            # the third step was quantized
    assert max_diff(warm2[0], warm2[1]) == 0.0


def _mismatched() -> str:
    dear.init()
    comp = dear.Compression.int8 if dear.rank() == 0 else dear.Compression.int4
    model = make_net()
    try:
        dear.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                                  compression=comp)
    except Exception as exc:                    # noqa: BLE001 - the message is the result
        return str(exc)
    return "no error"


def test_ranks_compressing_differently_are_refused_on_every_rank():
    for message in run_distributed(_mismatched, 2, timeout=120):
        assert "settings that must be the same on every rank differ" in message
        assert "bits=8, block_size=256" in message and "bits=4, block_size=128" in message


def test_bad_settings_and_sharding_are_refused():
    with pytest.raises(ValueError, match="bits=8 or bits=4"):
        dear.Compression.quantized(bits=2)
    with pytest.raises(ValueError, match="block_size"):
        dear.Compression.quantized(block_size=0)
    dear.init(backend="local")
    try:
        model = make_net()
        with pytest.raises(ValueError, match="shard_optimizer_state.*would round"):
            dear.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                                      compression=dear.Compression.fp16,
                                      shard_optimizer_state=True)
    finally:
        dear.shutdown()


def _exchange_blocks() -> list[torch.Tensor]:
    dear.init()
    from dear.comm import runtime
    comm = runtime.communicator()
    n, me = comm.size, comm.rank
    out = []
    for dtype in (torch.uint8, torch.float32):
        send = (torch.arange(n * 5) + 100 * me).to(dtype)
        recv = torch.empty_like(send)
        comm.all_to_all(send, recv).wait()
        out.append(recv)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_all_to_all_sends_block_r_to_rank_r(world):
    for me, got in enumerate(run_distributed(_exchange_blocks, world, timeout=120)):
        for recv in got:
            expect = torch.cat([torch.arange(me * 5, me * 5 + 5) + 100 * r
                                for r in range(world)]).to(recv.dtype)
            assert torch.equal(recv, expect)


def _unused(which: str) -> dict:
    """The branch used by rank 0 only ('one') or by no rank ('none')."""
    dear.init()
    rank, world = dear.rank(), dear.size()
    model = make_net()
    opt = dear.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                    model=model, compression=dear.Compression.int8,
                                    fusion_threshold=2048)
    for step in range(4):
        opt.zero_grad()
        x, y = batch(step, world, rank)
        F.mse_loss(model(x, use_branch=which == "one" and rank == 0), y).backward()
        opt.step()
    opt.flush_updates()
    momentum = {n for n, p in model.named_parameters() if "momentum_buffer" in opt.state[p]}
    return {"params": state_of(model), "momentum": momentum}


@pytest.mark.parametrize("which", ["one", "none"])
def test_unused_parameters_keep_their_flags_exact(which):
    """The usage flags travel unquantized: a parameter no rank used is neither moved nor given
    optimizer state (as single-process training leaves it); one rank's use reaches all."""
    ranks = run_distributed(_unused, 2, which, timeout=120)
    assert max_diff(ranks[0]["params"], ranks[1]["params"]) == 0.0
    start = state_of(make_net())
    branch = {k for k in start if k.startswith("branch.")}
    moved = {k for k in branch if not torch.equal(ranks[0]["params"][k], start[k])}
    if which == "none":
        assert not moved
        assert not any(n.startswith("branch.") for n in ranks[0]["momentum"])
    else:
        assert moved == branch
        assert {n for n in ranks[0]["momentum"] if n.startswith("branch.")} == branch


def _scaled(early: bool) -> dict:
    from tests.test_amp import _injected_loss
    from tests.test_sharded import force_plan
    dear.init()
    rank, world = dear.rank(), dear.size()
    model = make_net()
    opt = dear.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), model=model,
                                    compression=dear.Compression.quantized(block_size=16))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=2)
    scales = []
    for step in range(8):
        if early:
            force_plan(opt)
        opt.zero_grad()
        x, y = batch(step, world, rank)
        scaler.scale(_injected_loss(model, F.mse_loss(model(x), y), step)).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    opt.flush_updates()
    residuals = opt.state_dict()["dear_error_feedback"]["residuals"].values()
    return {"params": state_of(model), "scales": scales,
            "finite": all(bool(torch.isfinite(t).all()) for t in residuals),
            "adam_steps": {int(s["step"]) for s in opt.state_dict()["state"].values()}}


def _ddp_scaled() -> dict:
    from tests.test_amp import amp_loop
    dear.init()
    return amp_loop("ddp")


@pytest.mark.filterwarnings("ignore:GradScaler is going to stop:FutureWarning")
@pytest.mark.parametrize("early", [False, True])
def test_gradscaler_skips_a_step_with_inf_on_every_rank(early):
    """An inf or NaN in one rank's gradient makes its block's scale NaN, so the summed shard is
    not finite and GradScaler's check (on the reduced shards) skips the step on every rank;
    the skipped step's residuals are dropped, so none stays NaN. `early`: the all-gathers go
    in chunks during backward (a planned schedule), the unscale deferred to after them."""
    from tests.test_amp import INJECT
    ranks = run_distributed(_scaled, 2, early, timeout=120)
    ddp = run_distributed(_ddp_scaled, 2, timeout=120)
    assert ranks[0]["scales"] == ranks[1]["scales"] == ddp[0]["scales"]
    assert ranks[0]["adam_steps"] == {8 - len(INJECT)}
    assert max_diff(ranks[0]["params"], ranks[1]["params"]) == 0.0
    assert all(r["finite"] for r in ranks)
    assert all(bool(torch.isfinite(t).all()) for t in ranks[0]["params"].values())


KFAC_ARGS = {**W.ARGS, "inv_update_freq": 2}
KFAC_SGD_LR = 0.05


def _kfac_int8() -> tuple:
    from dear.fusion.quantized import QuantizedBucket
    dear.init()
    rank, world = dear.rank(), dear.size()
    model = W.make_model("mlp", torch.float32)           # only fp32 buckets are quantized
    opt = dear.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=KFAC_SGD_LR),
                                    model=model, compression=dear.Compression.int8)
    precond = dear.KFAC(model, strategy="comm-opt", **KFAC_ARGS)
    for step in range(4):
        x, y = W.batch("mlp", step, world, rank, dtype=torch.float32)
        opt.zero_grad()
        W.loss_fn(model(x), y).backward()
        precond.step()
        opt.step()
    opt.flush_updates()
    quantized = all(isinstance(b, QuantizedBucket) for b in opt.dear_engine.buckets)
    return W.params_of(model), precond.overlapped_steps, quantized


def test_kfac_preconditions_the_averaged_gradient_without_the_eigenbasis_overlap():
    """dear.KFAC's eigenbasis path would carry residuals across bases: under quantization it
    preconditions after synchronize() instead (no overlapped step), and trains on every rank
    alike, every bucket quantized."""
    ranks = run_distributed(_kfac_int8, 2, timeout=120)
    assert [overlapped for _, overlapped, _ in ranks] == [0, 0]
    assert all(quantized for _, _, quantized in ranks)
    assert max_diff(ranks[0][0], ranks[1][0]) == 0.0
    assert all(bool(torch.isfinite(t).all()) for t in ranks[0][0].values())


def _first_steps() -> dict:
    """One step from the same weights and batch: dear.KFAC under int8 and fp32, and plain SGD
    (no K-FAC) under int8 and fp32."""
    dear.init()
    rank, world = dear.rank(), dear.size()
    out = {}
    for kfac in (True, False):
        for comp in (dear.Compression.int8, dear.Compression.none):
            model = W.make_model("mlp", torch.float32)
            opt = dear.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=KFAC_SGD_LR),
                                            model=model, compression=comp)
            precond = dear.KFAC(model, strategy="comm-opt", **KFAC_ARGS) if kfac else None
            x, y = W.batch("mlp", 0, world, rank, dtype=torch.float32)
            opt.zero_grad()
            W.loss_fn(model(x), y).backward()
            if precond is not None:
                precond.step()
            opt.step()
            opt.flush_updates()
            out[("kfac" if kfac else "sgd", comp.name)] = W.params_of(model)
            if precond is not None:
                precond.remove_hooks()
    return out


def _distance(a: dict, b: dict) -> float:
    return math.sqrt(sum(float(((a[k].double() - b[k].double()) ** 2).sum()) for k in a))


def _kfac_int8_bounds(world: int) -> dict:
    """Bounds, in parameter space (Euclidean norm over every parameter), on how far one int8
    step lands from the fp32 one, from the first step's gradients.

    The error of one element of the applied average (residuals still zero): the reduce-scatter
    quantizes each other rank's chunk (error <= its block's scale / 2 = max|g_r| / 254 at most,
    the block maximum bounded by the rank's whole maximum M_r), averaged over `world`; the
    all-gather quantizes the average once more (<= max|average| / 254). So |e_i| <= b =
    (world - 1) / world * M / 254 + (A + (world - 1) / world * M / 254) / 254, M = max_r M_r,
    A = max|exact average|, and ||e|| <= b sqrt(n) over n elements.

    Plain SGD moves by lr * e: within lr b sqrt(n).

    K-FAC (kfac-pytorch's eigen method, as dear.KFAC): u = nu P g on its layers, P symmetric
    with eigenvalues 1 / (dG_i dA_j + damping), the d's clamped at 0, so ||P|| = 1 /
    (min dG min dA + damping) <= 1 / damping; the KL clip nu = min(1, R / |z|), z = P^(1/2) g,
    R = sqrt(kl_clip) / lr_kfac, so u = P^(1/2) pi(z), pi the projection onto the ball of
    radius R. Both runs have the same factors (the same weights and batch), so P is the same;
    |z' - z| <= delta = sqrt(||P||) ||e||. With both outside the ball (checked: |z| - delta >
    R), Dunkl-Williams (inner-product form) gives |pi(z') - pi(z)| <= 2 R delta / (|z| + |z'|)
    <= 2 R delta / (2 |z| - delta), so ||u' - u|| <= sqrt(||P||) 2 R delta / (2 |z| - delta).
    The LayerNorm's parameters are left to SGD: lr b sqrt(n_norm). |z| and ||P|| come from the
    independent float64 reference K-FAC (tests/kfac_workloads.py) on the same batch, moved 1e-4
    the unfavourable way to cover float32's rounding of them in dear's run; and each run's own
    float32 rounding of its update (a few sums of <= 17 terms, ~100 ulps at most) is covered by
    adding 1e-4 of the largest possible step."""
    lr, lam = KFAC_SGD_LR, KFAC_ARGS["damping"]
    model = W.make_model("mlp", torch.float32)
    grads = []
    for r in range(world):                              # each rank's fp32 gradient
        model.zero_grad()
        x, y = W.batch("mlp", 0, world, r, dtype=torch.float32)
        W.loss_fn(model(x), y).backward()
        grads.append({n: p.grad.detach().double().clone() for n, p in model.named_parameters()})
    M = max(float(g[n].abs().max()) for g in grads for n in g)
    average = {n: sum(g[n] for g in grads) / world for n in grads[0]}
    A = max(float(t.abs().max()) for t in average.values())
    hop = (world - 1) / world * M / 254
    b = (hop + (A + hop) / 254) * (1 + 1e-4)
    numel = {n: t.numel() for n, t in average.items()}
    n_norm = sum(v for n, v in numel.items() if n.startswith("norm."))
    n_kfac = sum(numel.values()) - n_norm
    ref = W.ReferenceKFAC(W.make_model("mlp"), **KFAC_ARGS)
    ref.backward_on_shards([(x.double(), y) for x, y in (
        W.batch("mlp", 0, world, r, dtype=torch.float32) for r in range(world))])
    ref.step()
    norm_p = max(1 / (float(dg.min()) * float(da.min()) + lam)
                 for _, da, _, dg in ref.pre.values()) * (1 + 1e-4)
    R = math.sqrt(KFAC_ARGS["kl_clip"]) / KFAC_ARGS["lr"]
    assert ref.last_nu < 1, "the KL clip does not act: the bound below assumes it does"
    z = R / ref.last_nu * (1 - 1e-4)
    delta = math.sqrt(norm_p) * b * math.sqrt(n_kfac)
    assert z - delta > R, (z, delta, R)
    kfac_layers = lr * math.sqrt(norm_p) * 2 * R * delta / (2 * z - delta)
    norm_layers = lr * b * math.sqrt(n_norm)
    g_norm = math.sqrt(sum(float((average[n] ** 2).sum()) for n in numel
                           if n.startswith("norm.")))
    largest = lr * (math.sqrt(norm_p) * R + g_norm + b * math.sqrt(n_norm))
    return {"kfac": math.hypot(kfac_layers, norm_layers) + 1e-4 * largest,
            "sgd": lr * b * math.sqrt(n_kfac + n_norm) * (1 + 1e-4)}


def test_kfac_under_int8_is_the_fp32_step_within_int8s_error():
    """One dear.KFAC step under int8 lands within the bound that int8's rounding allows of the
    fp32 one (_kfac_int8_bounds), and plain SGD's int8 step within its own bound of SGD's fp32
    one; the K-FAC step is farther than the bound from SGD's, so preconditioning the wrong
    gradient (or none) would show."""
    ranks = run_distributed(_first_steps, 2, timeout=180)
    bound = _kfac_int8_bounds(2)
    for got in ranks:
        kfac8, kfac32 = got[("kfac", "int8")], got[("kfac", "none")]
        sgd8, sgd32 = got[("sgd", "int8")], got[("sgd", "none")]
        assert 0 < _distance(kfac8, kfac32) <= bound["kfac"], (_distance(kfac8, kfac32), bound)
        assert 0 < _distance(sgd8, sgd32) <= bound["sgd"], (_distance(sgd8, sgd32), bound)
        assert _distance(kfac8, sgd8) > 2 * bound["kfac"], (_distance(kfac8, sgd8), bound)
        assert max_diff(kfac8, ranks[0][("kfac", "int8")]) == 0.0


def test_memory_stats_count_the_residuals_and_messages():
    dear.init(backend="local")
    try:
        sizes = {}
        for comp in (dear.Compression.none, dear.Compression.int8):
            model = make_net()
            opt = dear.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                            model=model, compression=comp)
            x, y = batch(0, 1, 0)
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.flush_updates()
            sizes[comp.name] = opt.memory_stats()["buffers"]
        residual = sum(b.residual.numel() * 4 for b in opt.dear_engine.buckets)
        # int8 adds an fp32 residual per element and its message slots (send, receive, gathered)
        assert sizes["int8"] > sizes["none"] + residual
    finally:
        dear.shutdown()


def _peer_dies() -> str:
    dear.init()
    rank = dear.rank()
    model = make_net()
    opt = dear.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                                    compression=dear.Compression.int8, fusion_threshold=2048)
    for step in range(4):
        opt.zero_grad()
        if step == 2 and rank == 1:
            os._exit(7)                        # gone before its all-to-alls
        x, y = batch(step, 2, rank)
        try:
            F.mse_loss(model(x), y).backward()
            opt.step()
            model(x)
        except RuntimeError as exc:
            return str(exc)
    return "no error"


def test_a_dead_peer_fails_the_quantized_exchange_clearly():
    """A rank that dies makes the survivor raise dear's RuntimeError on its training thread (the
    all-to-all waited on the decode thread fails and is re-raised; no hang), naming what failed
    and why: "dear: <collective> ... failed; another rank probably died or stalled", not
    Gloo's own error alone."""
    outcomes = run_distributed(_peer_dies, 2, timeout=120, expect_failure=True,
                               env={"DEAR_TIMEOUT": "10"})
    message = outcomes[0]
    assert isinstance(message, str) and message != "no error", message
    assert message.startswith("dear: "), message
    assert "failed; another rank probably died or stalled" in message, message


def _broadcast_keeps_residuals() -> dict:
    import logging
    dear.init()
    rank, world = dear.rank(), dear.size()
    model = make_net()
    opt = dear.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                    model=model, fusion_threshold=2048,
                                    compression=dear.Compression.quantized(bits=8,
                                                                           block_size=16))
    for step in range(3):
        opt.zero_grad()
        x, y = batch(step, world, rank)
        F.mse_loss(model(x), y).backward()
        opt.step()
    before = opt.state_dict()["dear_error_feedback"]["residuals"]
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("dear").addHandler(handler)
    dear.broadcast_optimizer_state(opt, root_rank=0)
    after = opt.state_dict()["dear_error_feedback"]
    out = {"same": all(torch.equal(before[i], after["residuals"][i]) for i in before),
           "nonzero": any(t.abs().max() > 0 for t in before.values()),
           "rank": after["rank"], "warnings": [m for m in records if "residual" in m]}
    dear.shutdown()
    return out


def test_broadcast_optimizer_state_leaves_each_ranks_residuals():
    """dear.broadcast_optimizer_state gives every rank rank 0's state, but the error-feedback
    residuals are each rank's own (what its own rounding dropped): every rank keeps its own,
    with no warning about loading another rank's."""
    for rank, res in enumerate(run_distributed(_broadcast_keeps_residuals, 2, timeout=120)):
        assert res["nonzero"] and res["same"] and res["rank"] == rank, res
        assert not res["warnings"], res["warnings"]
