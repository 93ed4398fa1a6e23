"""The emulated accelerator (benchmarks/emulated.py): the real models' parameters, compute that
sleeps instead of using the CPU, and methods that agree with DDP on it."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from benchmarks import emulated, emulated_bench, methods
from benchmarks import models as real_models
from tests.distributed import run_distributed

pytestmark = pytest.mark.timeout(120)


def _shapes(model: torch.nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    return [(n, tuple(p.shape)) for n, p in model.named_parameters()]


@pytest.mark.parametrize("name,count", [("resnet50", 25_557_032), ("vgg16", 138_357_544),
                                        ("bert_base", 109_483_778)])
def test_parameters_are_the_real_models(name: str, count: int) -> None:
    """Names, shapes and order of benchmarks.models' plain-torch ResNet-50 / VGG-16 / BERT-Base
    (whose counts test_models checks against torchvision's and Hugging Face's)."""
    with torch.device("meta"):
        real = real_models.build(name).make_model()
    emu = emulated.EmulatedModel(emulated.spec(name))
    assert _shapes(emu) == _shapes(real)
    assert sum(p.numel() for p in emu.parameters()) == count
    # FSDP2 shards the real model's blocks
    assert [n for n, m in emu.named_modules() if m in set(emu.blocks())] == list(emu.spec.blocks)


def test_scaled_model_divides_first_dimensions() -> None:
    full, quarter = emulated.spec("resnet50"), emulated.spec("resnet50", scale=4)
    assert quarter.scale == 4 and len(quarter.layers) == len(full.layers)
    for a, b in zip(full.layers, quarter.layers):
        for (_, sa), (_, sb) in zip(a.params, b.params):
            assert sb == (max(1, round(sa[0] / 4)),) + sa[1:]
    assert 0.24 < quarter.numel / full.numel < 0.26


def test_times_follow_flops_and_compute_leaves_the_cpu_free() -> None:
    s = emulated.spec("resnet50", scale=16).timed(0.15)
    assert s.forward_total == pytest.approx(0.05) and s.backward_total == pytest.approx(0.10)
    convs = {layer.name: t for layer, t in zip(s.layers, s.forward_s)}
    assert convs["layer1.0.conv2"] > 10 * convs["layer1.0.bn2"]     # a 3x3 conv vs its norm
    torch.manual_seed(0)
    model = emulated.EmulatedModel(s)
    x, y = emulated.make_batch(0, 0, 4)
    emulated.loss_fn(model(x), y).backward()                          # first touches memory
    for p in model.parameters():
        p.grad = None
    threads = torch.get_num_threads()
    torch.set_num_threads(1)           # as the benchmark's ranks: no OpenMP threads spinning
    try:
        cpu, wall = time.process_time(), time.perf_counter()
        emulated.loss_fn(model(x), y).backward()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    finally:
        torch.set_num_threads(threads)
    assert wall >= 0.14                # the stream may start up to SLACK (1 ms) early
    assert cpu < 0.5 * wall, f"{cpu:.3f} s of CPU in {wall:.3f} s: compute is not sleeping"
    # gradients: every parameter's shape, the probe's exact gradient, a data-dependent level
    for p in model.parameters():
        assert p.grad is not None and p.grad.shape == p.shape


def test_gradients_flow_in_reverse_layer_order_and_are_deterministic() -> None:
    s = emulated.spec("bert_base", scale=32)
    order: list[str] = []
    runs = []
    for _ in range(2):
        model = emulated.EmulatedModel(s)
        if not order:
            for n, p in model.named_parameters():
                p.register_post_accumulate_grad_hook(lambda p, n=n: order.append(n))
        x, y = emulated.make_batch(3, 1, 4)
        emulated.loss_fn(model(x), y).backward()
        runs.append([p.grad.clone() for p in model.parameters()])
    names = [n for n, _ in model.named_parameters()]
    layer_of = {n: n.rsplit(".", 1)[0] for n in names}
    layers = [layer.name for layer in s.layers]
    seen = [layer_of[n] for n in order]
    assert sorted(set(seen), key=seen.index) == layers[::-1]
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_method_specs() -> None:
    m = methods.parse_method("dear:first_bucket=2MB:overlap_allgather=false")
    assert m.base == "dear" and m.label == "dear:first_bucket=2MB:overlap_allgather=false"
    assert m.options == {"first_bucket": 2 * 2**20, "overlap_allgather": False}
    assert methods.parse_method("wfbp:threshold=512KB").options == {"threshold": 2**19}
    assert methods.parse_value("0.5") == 0.5 and methods.parse_value("x") == "x"
    # the CPU table's short names are options of the same builders, under their own label
    hvd = methods.parse_method("dear-hvd")
    assert (hvd.label, hvd.base, hvd.options) == ("dear-hvd", "dear", {"backend": "horovod"})
    assert hvd.uses_horovod and hvd.backend_switch and not methods.parse_method("dear").uses_horovod
    assert methods.parse_method("dear-order").options == {"schedule": "dear"}
    with pytest.raises(ValueError, match="unknown method"):
        methods.parse_method("dearr")
    with pytest.raises(ValueError, match="KEY=VALUE"):
        methods.parse_method("dear:first_bucket")
    assert emulated_bench.parse_setup("resnet50:8") == ("resnet50", 8, "500mbit", 2)
    assert emulated_bench.parse_setup("vgg16:2:2gbit:1") == ("vgg16", 2, "2gbit", 1)


def _train_methods(labels: list[str]) -> dict[str, tuple[list[float], dict[str, torch.Tensor],
                                                          Any]]:
    import torch.distributed as dist

    import dear
    dist.init_process_group("gloo")
    dear.init(backend="torch")
    s = emulated.spec("resnet50", scale=64)
    out = {}
    for label in labels:
        # 8 steps: dear's planned schedule plans after 4 (DEAR_PLAN_AFTER) and runs its plan
        res = emulated_bench.train(methods.parse_method(label), s, warmup=0, iters=8,
                                   batch_size=4, update="full", plan_warmup=False)
        out[label] = (res["losses"], res["params"], res["commit"])
    dear.shutdown()
    return out


def test_dear_equals_ddp_on_the_emulated_model_two_ranks() -> None:
    # commit=K: the elastic-commit cost benchmark's option, which must not change training
    labels = ["ddp", "dear", "dear:fusion_threshold=64KB:first_bucket=16KB", "dear:schedule=dear",
              "wfbp", "dear:commit=3", "dear:commit=2:commit_to=memory"]
    per_rank = run_distributed(_train_methods, 2, labels, timeout=100)
    for rank in per_rank:
        ddp_losses, ddp_params, _ = rank["ddp"]
        assert len(ddp_losses) == 8 and ddp_losses[0] != ddp_losses[-1]
        assert len(rank["dear:commit=3"][2]["seconds"]) == 2      # steps 3 and 6 of 8
        assert len(rank["dear:commit=2:commit_to=memory"][2]["seconds"]) == 4
        assert rank["dear"][2] is None
        for label in labels[1:]:
            losses, params, _ = rank[label]
            assert losses == pytest.approx(ddp_losses, rel=1e-5), label
            for name, p in ddp_params.items():
                torch.testing.assert_close(params[name], p, rtol=1e-5, atol=1e-6,
                                           msg=f"{label}: {name}")
    # both ranks hold the same model (the average of both ranks' gradients)
    for name, p in per_rank[0]["dear"][1].items():
        assert torch.equal(p, per_rank[1]["dear"][1][name])


def _trace_and_read(out: str) -> tuple[list[float], list[float], list[float], list[float]]:
    """The emulated model traced on a virtual clock: its sleeps advance the clock the tracer
    reads, and nothing else does, so a loaded machine cannot move a layer's time."""
    import types

    import torch.distributed as dist

    from dear.diagnose import Tracer
    dist.init_process_group("gloo")
    now = [0.0]

    def sleep(seconds: float) -> None:
        now[0] += max(seconds, 0.0)
    emulated.time = types.SimpleNamespace(perf_counter=lambda: now[0], sleep=sleep)
    s = emulated.spec("resnet50", scale=16).timed(0.3)
    model = emulated.EmulatedModel(s)
    opt = emulated.EmulatedSGD(model.parameters())
    with Tracer(model, opt, out=out, iterations=range(1, 3), clock=lambda: round(now[0] * 1e9)):
        for step in range(4):
            x, y = emulated.make_batch(step, 0, 4)
            opt.zero_grad()
            emulated.loss_fn(model(x), y).backward()
            opt.step()
    t = emulated.times_from_trace(emulated.spec("resnet50", scale=16), out, compute_s=0.3)
    return list(s.forward_s), list(t.forward_s), list(s.backward_s), list(t.backward_s)


def test_layer_times_from_a_dear_diagnose_trace(tmp_path) -> None:
    """Tracing the emulated model gives back its own per-layer times, every layer's forward and
    backward, to the clock's nanosecond (a segment's time is two nanosecond stamps apart)."""
    fwd, traced_fwd, bwd, traced_bwd = run_distributed(_trace_and_read, 1, str(tmp_path),
                                                       timeout=60)[0]
    assert len(traced_fwd) == len(fwd) and len(traced_bwd) == len(bwd)
    for what, want, got in (("forward", fwd, traced_fwd), ("backward", bwd, traced_bwd)):
        for i, (w, g) in enumerate(zip(want, got)):
            assert g == pytest.approx(w, abs=5e-9), (what, i, w, g)
