"""Mixed precision under the deferred update, against torch DDP on the same data (2 Gloo ranks).

GradScaler: an inf or NaN injected into ONE rank's gradient, at an element whose reduced value
lives in the OTHER rank's shard, must skip the step on every rank, exactly as DDP's all-reduce
does; parameters, optimizer state and the scale sequence must match DDP's. Low-precision
parameters (bf16, fp16) must reduce in buckets of their own dtype and match DDP.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F

import dear
from tests.distributed import run_distributed
from tests.workloads import batch, make_net, max_diff, state_of

# dear/shardops/amp.py silences this warning (it addresses optimizer authors); pytest re-enables it.
pytestmark = pytest.mark.filterwarnings("ignore:GradScaler is going to stop:FutureWarning")

STEPS = 8
# step -> (rank that overflows, parameter, element, value): each lands in the other rank's shard
INJECT = {2: (1, "fc1.weight", 0, math.inf), 5: (0, "head.bias", 3, math.nan)}
SKIPPED = sorted(INJECT)


def _injected_loss(model: torch.nn.Module, loss: torch.Tensor, step: int) -> torch.Tensor:
    if step in INJECT and INJECT[step][0] == dear.rank():
        _, name, element, value = INJECT[step]
        loss = loss + value * dict(model.named_parameters())[name].view(-1)[element]
    return loss


def _shard_owner(opt: torch.optim.Optimizer, name: str, element: int) -> int:
    """Which rank's shard holds this gradient element after the reduce-scatter."""
    i = opt.dear_engine.names.index(name)                             # type: ignore[attr-defined]
    bucket, j = opt.dear_layout.where[i]                            # type: ignore[attr-defined]
    return (bucket.spec.offsets[j] + element) // bucket.spec.shard_numel


def amp_loop(mode: str, threshold: int = 1 << 30) -> dict:
    """mode: 'ddp', 'ddp-clip', 'dear', 'dear-clip' (optimizer.clip_grad_norm_(grad_scaler=)),
    'dear-sync-clip' (synchronize + scaler.unscale_ + torch's clip_grad_norm_)."""
    rank, world = dear.rank(), dear.size()
    model = make_net()
    net = torch.nn.parallel.DistributedDataParallel(model) if mode.startswith("ddp") else model
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    if mode.startswith("dear"):
        opt = dear.DistributedOptimizer(opt, model=model, fusion_threshold=threshold)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=2)
    scales, norms, owners = [], [], []
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step, world, rank)
        loss = _injected_loss(model, F.mse_loss(net(x), y), step)
        scaler.scale(loss).backward()
        if mode == "ddp-clip":
            scaler.unscale_(opt)
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5).item())
        elif mode == "dear-clip":
            norms.append(opt.clip_grad_norm_(0.5, grad_scaler=scaler).item())
        elif mode == "dear-sync-clip":
            opt.synchronize()
            scaler.unscale_(opt)
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5).item())
        if mode == "dear-sync-clip":
            with opt.skip_synchronize():
                scaler.step(opt)
        else:
            scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        if mode.startswith("dear") and step in INJECT:
            owners.append((INJECT[step][0], _shard_owner(opt, *INJECT[step][1:3])))
    adam_steps = {int(s["step"]) for s in opt.state_dict()["state"].values()}
    return {"params": state_of(model), "scales": scales, "norms": norms, "owners": owners,
            "adam_steps": adam_steps}


def fp16_wire_overflow() -> dict:
    """Each rank's scaled gradient (2^15) fits fp16; their sum (2^16) on the fp16 wire does not.
    A check of the local gradients would miss it; dear checks the reduced one."""
    w = torch.nn.Linear(1, 1, bias=False)
    torch.nn.init.ones_(w.weight)
    opt = dear.DistributedOptimizer(torch.optim.SGD(w.parameters(), lr=0.5), model=w,
                                    compression=dear.Compression.fp16)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**15, growth_interval=1000)
    weights, local_finite = [], []
    for _ in range(2):
        opt.zero_grad()
        scaler.scale(w(torch.ones(1, 1)).sum()).backward()
        local_finite.append(bool(torch.isfinite(w.weight.grad.half()).all()))
        scaler.step(opt)
        scaler.update()
        opt.flush_updates()
        weights.append(w.weight.item())
    return {"weights": weights, "local_finite": local_finite, "scale": scaler.get_scale()}


class MixedNet(torch.nn.Module):
    """fp32, bf16 and fp16 layers in one model (cast to half, not autocast)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(24, 16)
        self.b = torch.nn.Linear(16, 16).to(torch.bfloat16)
        self.c = torch.nn.Linear(16, 16).to(torch.float16)
        self.d = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        h = torch.relu(self.b(h.bfloat16())).float()
        h = torch.relu(self.c(h.half())).float()
        return self.d(h)


def low_precision(mode: str) -> dict:
    """mode: ddp/dear x mixed (half-cast layers) / autocast (bf16 autocast, fp32 parameters)."""
    rank, world = dear.rank(), dear.size()
    kind, method = mode.split("-")
    model = MixedNet() if kind == "mixed" else make_net()
    net = torch.nn.parallel.DistributedDataParallel(model) if method == "ddp" else model
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if method == "dear":
        opt = dear.DistributedOptimizer(opt, model=model)   # 25 MB: one bucket per dtype
    for step in range(4):
        opt.zero_grad()
        x, y = batch(step, world, rank)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=kind == "autocast"):
            out = net(x)
        F.mse_loss(out.float(), y).backward()
        opt.step()
    buckets = [[(b.spec.dtype, p.dtype) for p in b.params] for b in opt.dear_engine.buckets] \
        if method == "dear" else []
    return {"params": state_of(model), "buckets": buckets}


def all_cases() -> dict:
    dear.init()
    out = {mode: amp_loop(mode) for mode in ("ddp", "ddp-clip", "dear", "dear-clip",
                                             "dear-sync-clip")}
    out["dear-per-param"] = amp_loop("dear", threshold=0)
    out["fp16-wire"] = fp16_wire_overflow()
    for mode in ("mixed-ddp", "mixed-dear", "autocast-ddp", "autocast-dear"):
        out[mode] = low_precision(mode)
    dear.shutdown()
    return out


@functools.lru_cache(maxsize=None)
def results() -> list[dict]:
    return run_distributed(all_cases, 2, timeout=150)


@pytest.mark.parametrize("mode,ref", [("dear", "ddp"), ("dear-per-param", "ddp"),
                                      ("dear-clip", "ddp-clip"), ("dear-sync-clip", "ddp-clip")])
def test_grad_scaler_matches_ddp_with_an_overflow_on_one_rank(mode: str, ref: str) -> None:
    for rank, res in enumerate(results()):
        ours, theirs = res[mode], res[ref]
        scales = theirs["scales"]
        skipped = [s for s in range(STEPS) if scales[s] < (scales[s - 1] if s else 2.0**16)]
        assert skipped == SKIPPED, "DDP reference did not skip exactly the injected steps"
        assert ours["scales"] == scales, f"rank {rank}: skip decisions differ from DDP"
        assert ours["adam_steps"] == {STEPS - len(SKIPPED)}, "a skipped step touched Adam's state"
        assert max_diff(ours["params"], theirs["params"]) <= 1e-6, f"rank {rank} differs from DDP"
        if mode == "dear":                     # no clipping: the same operations as DDP's
            assert max_diff(ours["params"], theirs["params"]) == 0.0
        for got, want in zip(ours["norms"], theirs["norms"]):
            assert got == pytest.approx(want, rel=1e-5, nan_ok=True), "clip norm differs"
        # The overflow is in one rank's gradient but the other rank's shard: only the agreement
        # between ranks can make both skip.
        for injecting, owner in ours["owners"]:
            assert injecting != owner


def test_ranks_agree_bitwise() -> None:
    r0, r1 = results()
    for mode in ("dear", "dear-clip", "dear-sync-clip", "dear-per-param"):
        assert max_diff(r0[mode]["params"], r1[mode]["params"]) == 0.0


def test_overflow_made_by_the_fp16_wire_skips_on_every_rank() -> None:
    for res in results():
        fp16 = res["fp16-wire"]
        assert fp16["local_finite"] == [True, True]     # a local check would not have skipped
        assert fp16["weights"][0] == 1.0                # step 0 skipped: sum 2^16 > fp16 max
        assert fp16["weights"][1] == pytest.approx(0.5)  # step 1 (scale 2^14) applied: 1 - 0.5*1
        assert fp16["scale"] == 2.0**14


def test_low_precision_parameters_reduce_in_their_own_dtype_buckets() -> None:
    for res in results():
        layout = res["mixed-dear"]["buckets"]
        assert all(bucket == p for b in layout for bucket, p in b)
        assert {b[0][0] for b in layout} == {torch.float32, torch.bfloat16, torch.float16}
        assert max_diff(res["mixed-dear"]["params"], res["mixed-ddp"]["params"]) <= 1e-6
        assert [b[0][0] for b in res["autocast-dear"]["buckets"]] == [torch.float32]
        assert max_diff(res["autocast-dear"]["params"], res["autocast-ddp"]["params"]) <= 1e-6


def test_misuse_fails_clearly() -> None:
    dear.init(backend="local")
    try:
        model = make_net()
        opt = dear.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
        scaler = torch.amp.GradScaler("cpu")
        x, y = batch(0, 1, 0)
        scaler.scale(F.mse_loss(model(x), y)).backward()
        before = state_of(model)
        scaler.unscale_(opt)                   # reaches only the local .grad under dear
        with pytest.raises(RuntimeError, match="grad_scaler=scaler"):
            opt.clip_grad_norm_(1.0)           # it sees the gradients unscaled_ wrote
            scaler.step(opt)
        opt.flush_updates()
        assert max_diff(state_of(model), before) == 0.0   # the dropped step changed nothing
        half = torch.nn.Linear(2, 2).half()
        opt = dear.DistributedOptimizer(torch.optim.SGD(half.parameters(), lr=0.1), model=half)
        scaler = torch.amp.GradScaler("cpu")
        scaler.scale(half(torch.ones(1, 2).half()).sum()).backward()
        with pytest.raises(ValueError, match="float16 gradients"):
            scaler.step(opt)
    finally:
        dear.shutdown()
