"""An emulated accelerator: real models' parameters, compute that leaves the CPU free.

Why: on the CPU benchmark (benchmarks/results/bench_analysis.md) every rank's one core runs the
model AND the network stack, so compute slows by 12-35% while communication runs and no schedule
can reach its bound. On a GPU cluster the compute runs on the device and the core is free. Here
every layer of ResNet-50, VGG-16 or BERT-Base keeps its real parameters (names, shapes, order:
the gradient volume and bucket layouts are the real ones), but its forward and backward SLEEP
their share of a chosen compute time (time.sleep frees the core, as a GPU kernel does):

- per-layer times from forward FLOPs (convolutions and linears; norms and embeddings a few FLOPs
  per output element), scaled so that forward + backward = the chosen compute time, backward =
  2 x forward by default; or from a `dear.diagnose` trace (`times_from_trace`);
- each layer is a custom autograd.Function: forward sleeps, adds a small probe of its parameters
  (the first PROBE elements of each) to a tiny (batch, PROBE) activation, so autograd runs the
  layers' backwards in reverse layer order and the loss depends on every parameter; backward
  sleeps and returns, per parameter, a dense gradient of its shape: a constant that depends on
  the rank's data (grad_output's mean) times a fixed per-parameter factor, plus the exact
  gradient on the probe elements. One fill per gradient: the write a GPU would also do.
  Deterministic: every method can be compared on losses and parameters;
- the sleeps follow an emulated device stream (`DeviceClock`): a layer's kernel starts when the
  previous one ends or when the CPU reaches it, whichever is later, so the CPU's small overheads
  between layers overlap the sleeps (as kernel launches overlap a GPU's work) while a real wait
  (an all-gather the forward needs) delays the stream;
- `EmulatedSGD`: SGD with momentum applied to the probe elements only (a GPU updates 110 M
  parameters in a millisecond, a CPU core takes 0.2-0.4 s and would be the bottleneck);
  `update="full"` updates everything (tests compare whole parameters).

`scale` > 1 divides every parameter's first dimension (and so its size) by `scale`, for runs
where many ranks would saturate the cores with network work: scale the bandwidth by the same
factor and communication takes as long as at full size.

    python -m benchmarks.emulated [resnet50 vgg16 bert_base] [--scale 4]   # layers and FLOPs
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import random
import time
from collections import OrderedDict
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from benchmarks import models as real_models

PROBE = 8                  # activation width; each parameter's first PROBE elements are used
BACKWARD_FACTOR = 2.0      # backward time = 2 x forward time (a layer's two matmuls)
SLACK = 1e-3               # CPU behind the stream by less than this: a sleep's late wake-up
                           # or Python overhead, not a wait; the stream keeps its own time

# Nominal shapes the FLOPs are counted at (only the layers' shares matter).
FLOP_INPUTS = {"resnet50": ("image", 224), "vgg16": ("image", 224), "bert_base": ("tokens", 128)}
MODELS = tuple(FLOP_INPUTS)
WORD_EMBEDDINGS = ("word", "embeddings.word_embeddings")   # layers that look tokens up


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """One module of the real model that owns parameters."""

    name: str                                      # its path in the real model, e.g. layer1.0.conv1
    params: tuple[tuple[str, tuple[int, ...]], ...]  # (local name, shape), registration order
    flops: float                                   # forward FLOPs at the nominal input

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for _, s in self.params)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """What an emulated model is built from: layers in order, FSDP2 blocks, per-layer times."""

    name: str
    layers: tuple[LayerSpec, ...]
    blocks: tuple[str, ...]                        # module paths sharded one by one by FSDP2
    forward_s: tuple[float, ...] = ()              # per layer; () = not timed yet (all zero)
    backward_s: tuple[float, ...] = ()
    scale: int = 1
    # Token positions per batch and rank (0: off). When set, the word embedding's gradient is
    # non-zero only in the rows those tokens look up, as nn.Embedding's backward writes it (a
    # BERT fine-tune of 32 x 128 tokens touches ~1-2 thousand of 30,522 rows).
    tokens: int = 0

    @property
    def numel(self) -> int:
        return sum(layer.numel for layer in self.layers)

    @property
    def forward_total(self) -> float:
        return sum(self.forward_s)

    @property
    def backward_total(self) -> float:
        return sum(self.backward_s)

    def timed(self, compute_s: float, backward_factor: float = BACKWARD_FACTOR) -> "ModelSpec":
        """Per-layer times proportional to FLOPs, forward + backward = compute_s."""
        total = sum(layer.flops for layer in self.layers)
        fwd = compute_s / (1.0 + backward_factor)
        forward = tuple(fwd * layer.flops / total for layer in self.layers)
        return dataclasses.replace(self, forward_s=forward,
                                   backward_s=tuple(backward_factor * t for t in forward))

    def with_times(self, forward: Sequence[float], backward: Sequence[float],
                   compute_s: Optional[float] = None) -> "ModelSpec":
        """Given per-layer times (e.g. from a trace), optionally rescaled to sum to compute_s."""
        k = compute_s / (sum(forward) + sum(backward)) if compute_s else 1.0
        return dataclasses.replace(self, forward_s=tuple(k * t for t in forward),
                                   backward_s=tuple(k * t for t in backward))

    def scaled(self, scale: int) -> "ModelSpec":
        """Every parameter's first dimension divided by `scale` (at least 1)."""
        if scale == 1:
            return self
        layers = tuple(dataclasses.replace(layer, params=tuple(
            (n, (max(1, round(s[0] / scale)),) + tuple(s[1:])) for n, s in layer.params))
            for layer in self.layers)
        return dataclasses.replace(self, layers=layers, scale=self.scale * scale)


# ---------------------------------------------------------------- specs from the real models


def real_model(name: str) -> nn.Module:
    """The real model (benchmarks.models) on the meta device: shapes, no memory."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; expected one of {MODELS}")
    with torch.device("meta"):
        return real_models.build(name).make_model()


def _leaf_flops(module: nn.Module, inputs: tuple, output: Tensor) -> float:
    out = output.numel()
    if isinstance(module, nn.Conv2d):
        kh, kw = module.kernel_size
        return 2.0 * out * module.in_channels // module.groups * kh * kw
    if isinstance(module, nn.Linear):
        return 2.0 * out * module.in_features
    if isinstance(module, (nn.BatchNorm2d, nn.LayerNorm)):
        return 5.0 * out
    return float(out)                              # embedding: a gather


def spec(name: str, scale: int = 1) -> ModelSpec:
    """Layers (modules owning parameters, in the real model's order) with their forward FLOPs;
    attention's two matmuls (not modules) go to its output projection."""
    model = real_model(name)
    flops: dict[str, float] = {}
    names = {m: n for n, m in model.named_modules()}
    leaves = [(n, m) for n, m in model.named_modules() if list(m.parameters(recurse=False))]

    def hook(module: nn.Module, inputs: tuple, output: Tensor) -> None:
        flops[names[module]] = flops.get(names[module], 0.0) + _leaf_flops(module, inputs, output)

    handles = [m.register_forward_hook(hook) for _, m in leaves]
    kind, size = FLOP_INPUTS[name]
    with torch.device("meta"):
        x = (torch.zeros(1, size, dtype=torch.long) if kind == "tokens"
             else torch.zeros(1, 3, size, size))
        model(x)
    for h in handles:
        h.remove()
    if name == "bert_base":                        # QK^T and AV: 2 x 2 x seq^2 x hidden
        for n, _ in leaves:
            if n.endswith("attn_out"):
                flops[n] += 4.0 * size * size * model.config.hidden
    layers = tuple(LayerSpec(n, tuple((pn, tuple(p.shape)) for pn, p in
                                      m.named_parameters(recurse=False)), flops.get(n, 0.0))
                   for n, m in leaves)
    workload = real_models.build(name)
    blocks = tuple(names[b] for b in workload.blocks(model))
    return ModelSpec(name, layers, blocks).scaled(scale)


def times_from_trace(model_spec: ModelSpec, trace_dir: str,
                     compute_s: Optional[float] = None) -> ModelSpec:
    """Per-layer forward and backward times from a `dear.diagnose` trace of the real model (rank
    0's median iteration): a forward segment's time goes to the layer of the parameters it first
    uses, a backward segment's to the layer of the gradient that ends it (matched by name)."""
    from dear.diagnose.chrome import load_trace
    from dear.diagnose.graph import build_model

    trace = load_trace(trace_dir)
    traced = build_model(trace)
    names = [p["name"] for p in trace.meta["params"]]
    layer_of = {f"{layer.name}.{pn}": i for i, layer in enumerate(model_spec.layers)
                for pn, _ in layer.params}
    fwd = [0.0] * len(model_spec.layers)
    bwd = [0.0] * len(model_spec.layers)
    prof = traced.profiles[0]
    for seg in prof.forward:
        hits = [layer_of[names[i]] for i in seg.needs if names[i] in layer_of]
        for i in hits:
            fwd[i] += seg.duration / len(hits)
    for seg in prof.backward:
        if seg.produces is not None and names[seg.produces] in layer_of:
            bwd[layer_of[names[seg.produces]]] += seg.duration
    if not any(fwd) or not any(bwd):
        raise ValueError(f"{trace_dir}: no parameter of {model_spec.name} found in the trace")
    return model_spec.with_times(fwd, bwd, compute_s)


# ---------------------------------------------------------------- the emulated device


class DeviceClock:
    """One stream of an emulated accelerator: run(t) blocks until a kernel of t seconds,
    enqueued now, has finished."""

    def __init__(self) -> None:
        self.end = 0.0
        self.busy = 0.0                            # seconds of kernels run (for checks)

    def run(self, seconds: float) -> None:
        _fine_timer_slack()
        now = time.perf_counter()
        if now - self.end > SLACK:                 # the stream was idle (the CPU waited)
            self.end = now
        self.end += seconds
        self.busy += seconds
        if self.end > now:
            time.sleep(self.end - now)


_SLACK_SET = False


def _fine_timer_slack() -> None:
    """Linux rounds a sleeping thread's wake-up up by its timer slack (50 us by default): 1 us."""
    global _SLACK_SET
    if not _SLACK_SET:
        _SLACK_SET = True
        try:
            import ctypes
            ctypes.CDLL(None).prctl(29, 1000, 0, 0, 0)   # PR_SET_TIMERSLACK, nanoseconds
        except (OSError, AttributeError):
            pass


class _Op(torch.autograd.Function):
    """forward: sleep, h + probes of the parameters; backward: sleep, cheap dense gradients."""

    @staticmethod
    def forward(ctx: Any, layer: "EmulatedLayer", h: Tensor, *params: Tensor) -> Tensor:
        layer.clock.run(layer.forward_s)
        out = h.clone()
        for p in params:
            k = min(PROBE, p.numel())
            out[:, :k] += p.detach().reshape(-1)[:k]
        ctx.layer = layer
        ctx.probes = [min(PROBE, p.numel()) for p in params]
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], ...]:
        layer = ctx.layer
        column = grad.sum(0)
        level = float(grad.mean())
        grads = []
        rows = layer.touched_rows()
        for i, (k, factor) in enumerate(zip(ctx.probes, layer.factors)):
            g = layer.grad_buffer(i)
            if rows is None:
                g.fill_(level * factor)
            else:                                  # zeros, then the looked-up rows
                g.zero_()
                g.index_fill_(0, rows, level * factor)
            g.view(-1)[:k] += column[:k]
            grads.append(g.view(g.shape))          # a new tensor: autograd keeps it as .grad
        layer.clock.run(layer.backward_s)
        return (None, grad, *grads)


class EmulatedLayer(nn.Module):
    """The parameters of one real module; its forward and backward sleep their times."""

    def __init__(self, layer: LayerSpec, forward_s: float, backward_s: float, clock: DeviceClock,
                 seed: int) -> None:
        super().__init__()
        self.path, self.forward_s, self.backward_s, self.clock = (layer.name, forward_s,
                                                                   backward_s, clock)
        rng = random.Random(seed)
        self._grads: list[Optional[Tensor]] = [None] * len(layer.params)
        self.factors = []
        for pname, shape in layer.params:
            p = torch.zeros(shape)                 # untouched pages: no cost until written
            k = min(PROBE, p.numel())
            p.view(-1)[:k] = torch.tensor([rng.gauss(0.0, 0.02) for _ in range(k)])
            self.register_parameter(pname, nn.Parameter(p))
            self.factors.append(rng.uniform(0.5, 1.5))

    def forward(self, h: Tensor) -> Tensor:
        return _Op.apply(self, h, *self.parameters(recurse=False))

    def look_up(self, tokens: int, rank: int) -> None:
        """Make this layer a word embedding: each backward, `tokens` draws from a Zipf-like
        distribution over the rows (frequent tokens low), different on every rank, plus row 0
        (the [CLS] token, where the probe elements are: losses do not depend on the draw)."""
        vocab = next(self.parameters(recurse=False)).shape[0]
        self._weights = 1.0 / (torch.arange(vocab, dtype=torch.float64) + 10.0)
        self._tokens = tokens
        self._draws = torch.Generator().manual_seed(7919 * (rank + 1))

    def touched_rows(self) -> Optional[Tensor]:
        if not getattr(self, "_tokens", 0):
            return None
        drawn = torch.multinomial(self._weights, self._tokens, replacement=True,
                                  generator=self._draws)
        return torch.cat([torch.zeros(1, dtype=torch.long), drawn]).unique()

    def grad_buffer(self, i: int) -> Tensor:
        """The i-th parameter's gradient memory, allocated once: a fresh 100-400 MB of
        gradients every iteration costs more in page faults than the fill (0.3-0.9 s for
        BERT-Base on one core). Not reused while it is still that parameter's .grad
        (zero_grad(set_to_none=False) or accumulation: autograd adds into .grad)."""
        p = list(self.parameters(recurse=False))[i]
        buf = self._grads[i]
        if buf is None or buf.shape != p.shape:
            buf = self._grads[i] = torch.empty(p.shape, dtype=p.dtype)
        grad = p.grad
        if grad is not None and (hasattr(grad, "to_local")     # FSDP2's sharded gradient
                                 or grad.untyped_storage().data_ptr() == buf.data_ptr()):
            return torch.empty(p.shape, dtype=p.dtype)
        return buf

    def extra_repr(self) -> str:
        return f"{self.path}: fwd {self.forward_s * 1e3:.2f} ms, bwd {self.backward_s * 1e3:.2f} ms"


class EmulatedModel(nn.Sequential):
    """Nested Sequentials with the real model's module paths, so parameter names, shapes and
    order equal the real model's, and FSDP2 can shard the real blocks. Input: (batch, PROBE)."""

    def __init__(self, model_spec: ModelSpec, clock: Optional[DeviceClock] = None) -> None:
        super().__init__()
        self.spec = model_spec
        self.clock = clock or DeviceClock()
        fwd = model_spec.forward_s or (0.0,) * len(model_spec.layers)
        bwd = model_spec.backward_s or (0.0,) * len(model_spec.layers)
        for i, layer in enumerate(model_spec.layers):
            parent: nn.Module = self
            *path, leaf = layer.name.split(".")
            for part in path:
                if not hasattr(parent, part):
                    parent.add_module(part, nn.Sequential(OrderedDict()))
                parent = getattr(parent, part)
            parent.add_module(leaf, EmulatedLayer(layer, fwd[i], bwd[i], self.clock, seed=i))
            if model_spec.tokens and layer.name in WORD_EMBEDDINGS:
                getattr(parent, leaf).look_up(model_spec.tokens, int(os.environ.get("RANK", 0)))

    def blocks(self) -> list[nn.Module]:
        return [self.get_submodule(b) for b in self.spec.blocks]


def loss_fn(out: Tensor, target: Tensor) -> Tensor:
    return F.mse_loss(out, target)


def make_batch(step: int, rank: int, batch_size: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(batch_size, PROBE, generator=g), torch.randn(batch_size, PROBE, generator=g)


class EmulatedSGD(torch.optim.Optimizer):
    """SGD with momentum on the probe elements (what the emulated loss sees) or, with
    update="full", on whole parameters (then the same numbers as torch.optim.SGD). Elementwise:
    dear's shard_optimizer_state may run it on slices of the parameters."""

    dear_elementwise = True

    def __init__(self, params: Any, lr: float = 0.01, momentum: float = 0.9,
                 update: str = "probe") -> None:
        if update not in ("probe", "full"):
            raise ValueError(f"update must be 'probe' or 'full', got {update!r}")
        self.update = update
        super().__init__(params, {"lr": lr, "momentum": momentum})

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                w, g = _local(p), _local(p.grad)
                if self.update == "probe":
                    k = min(PROBE, w.numel())
                    w, g = w.view(-1)[:k], g.reshape(-1)[:k]
                if w.numel() == 0:
                    continue
                state = self.state[p]
                buf = state.get("momentum_buffer")
                if buf is None:
                    buf = state["momentum_buffer"] = g.clone()
                else:
                    buf.mul_(group["momentum"]).add_(g)
                w.add_(buf, alpha=-group["lr"])


def _local(t: Tensor) -> Tensor:
    """A DTensor's (FSDP2) local shard, else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description="layers, parameters and FLOP shares")
    p.add_argument("models", nargs="*", default=list(MODELS))
    p.add_argument("--scale", type=int, default=1)
    p.add_argument("--layers", action="store_true", help="print every layer")
    args = p.parse_args(argv)
    for name in args.models:
        s = spec(name, args.scale)
        total = sum(layer.flops for layer in s.layers)
        print(f"{name}: {len(s.layers)} layers, {s.numel:,} parameters "
              f"({s.numel * 4 / 2**20:.1f} MB), {total / 1e9:.1f} GFLOP forward per sample, "
              f"{len(s.blocks)} FSDP2 blocks")
        if args.layers:
            for layer in s.layers:
                print(f"  {layer.name:40s} {layer.numel:>12,} {100 * layer.flops / total:6.2f}%")


if __name__ == "__main__":
    main()
