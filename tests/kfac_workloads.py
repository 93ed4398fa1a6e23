"""Models, data and an independent reference K-FAC for the tests of dear.KFAC.

The reference computes K-FAC from the definitions in ANCHORS.md with none of dear.kfac's code:
im2col by explicit slicing per kernel offset, the embedding's A as a full one-hot covariance
(dear keeps its diagonal), full eigendecompositions / inverses of every factor, and the KL
clip. "Distributed" in the reference means: the global batch is cut into the same shards the
ranks get, each shard's loss (its own mean) gives that shard's factors and gradients, and
factors and gradients are averaged over shards, which is what data parallelism computes.

Run as a script under Horovod (`python -m tests.kfac_workloads hvd STRATEGY`) it trains with
hvd.DistributedOptimizer and prints the final parameters' checksum line for the test.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

DTYPE = torch.float64
PER_RANK = 6
STEPS = 3
ARGS: dict[str, Any] = dict(lr=0.1, damping=0.003, factor_decay=0.9, kl_clip=0.001,
                            inv_update_freq=2)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(10, 16)
        self.fc2 = nn.Linear(16, 12, bias=False)
        self.norm = nn.LayerNorm(12)          # left to the optimizer
        self.fc3 = nn.Linear(12, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc3(self.norm(torch.tanh(self.fc2(torch.tanh(self.fc1(x))))))


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(2, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 5, 3, stride=2, bias=False)
        self.fc = nn.Linear(5 * 3 * 3, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.relu(self.conv2(torch.relu(self.conv1(x))))
        return self.fc(h.flatten(1))


class EmbedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(12, 6)
        self.fc = nn.Linear(6, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(torch.tanh(self.emb(x)).mean(1))


MODELS: dict[str, Callable[[], nn.Module]] = {"mlp": MLP, "cnn": CNN, "embed": EmbedNet}


def make_model(name: str, dtype: torch.dtype = DTYPE) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name]().to(dtype)


def batch(name: str, step: int, world: int, rank: int | None = None,
          dtype: torch.dtype = DTYPE) -> tuple[Tensor, Tensor]:
    """Step `step`'s global batch (world * PER_RANK samples), or rank `rank`'s shard of it."""
    g = torch.Generator().manual_seed(100 + step)
    n = world * PER_RANK
    if name == "mlp":
        x = torch.randn(n, 10, generator=g, dtype=dtype)
    elif name == "cnn":
        x = torch.randn(n, 2, 7, 7, generator=g, dtype=dtype)
    else:
        x = torch.randint(12, (n, 5), generator=g)
    y = torch.randint(4, (n,), generator=g)
    if rank is None:
        return x, y
    return x[rank * PER_RANK:(rank + 1) * PER_RANK], y[rank * PER_RANK:(rank + 1) * PER_RANK]


def loss_fn(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out, y)


# ----------------------------------------------------------------- the reference

def _patches(x: Tensor, conv: nn.Conv2d) -> tuple[Tensor, int]:
    """im2col by slicing: rows (n, oh, ow), columns (channel, ki, kj); and oh * ow."""
    (kh, kw), (sh, sw), (ph, pw) = conv.kernel_size, conv.stride, conv.padding
    xp = F.pad(x, (pw, pw, ph, ph))
    oh = (x.shape[2] + 2 * ph - kh) // sh + 1
    ow = (x.shape[3] + 2 * pw - kw) // sw + 1
    cols = [xp[:, c, i:i + sh * oh:sh, j:j + sw * ow:sw]
            for c in range(x.shape[1]) for i in range(kh) for j in range(kw)]
    return torch.stack(cols, dim=-1).reshape(-1, len(cols)), oh * ow


def _with_ones(a: Tensor) -> Tensor:
    return torch.cat([a, torch.ones(a.shape[0], 1, dtype=a.dtype)], dim=1)


def reference_factors(module: nn.Module, x: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
    """(A, G) of one layer from its input x and the gradient g of the loss w.r.t. its output."""
    if isinstance(module, nn.Conv2d):
        a, spatial = _patches(x, module)
        if module.bias is not None:
            a = _with_ones(a)
        a = a / spatial
        rows = g.permute(0, 2, 3, 1).reshape(-1, g.shape[1]) / spatial
    elif isinstance(module, nn.Embedding):
        a = F.one_hot(x.reshape(-1), module.num_embeddings).to(g.dtype)
        rows = g.reshape(-1, g.shape[-1])
    else:
        a = x.reshape(-1, x.shape[-1])
        if module.bias is not None:
            a = _with_ones(a)
        rows = g.reshape(-1, g.shape[-1])
    return a.t() @ a / a.shape[0], rows.t() @ rows / rows.shape[0]


def grad_matrix(module: nn.Module) -> Tensor:
    w = module.weight.grad
    if isinstance(module, nn.Embedding):
        return w.t().clone()
    m = w.reshape(w.shape[0], -1)
    if module.bias is not None:
        m = torch.cat([m, module.bias.grad.reshape(-1, 1)], dim=1)
    return m.clone()


def set_grad_matrix(module: nn.Module, m: Tensor) -> None:
    if isinstance(module, nn.Embedding):
        module.weight.grad.copy_(m.t())
        return
    n = module.weight[0].numel()
    module.weight.grad.copy_(m[:, :n].reshape(module.weight.shape))
    if module.bias is not None:
        module.bias.grad.copy_(m[:, n])


def kfac_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules()
            if isinstance(m, (nn.Linear, nn.Conv2d, nn.Embedding))]


class ReferenceKFAC:
    """K-FAC from the definitions, on shards averaged as data parallelism averages them.

    kfac-pytorch's rules beyond the formulas: with compute_eigenvalue_outer_product (its
    default) the eigen method divides by dG dA^T + the damping of the step that decomposed;
    with accumulation_steps=k, after every k-th pass (forward and backward) of a step the mean
    of all passes recorded since the last update makes one running-average update, passes left
    over waiting for the next step; without it (dear's default) all passes of a step make one
    update."""

    def __init__(self, model: nn.Module, lr: float = 0.1, damping: float = 0.001,
                 factor_decay: float = 0.95, kl_clip: float | None = 0.001,
                 factor_update_freq: int = 1, inv_update_freq: int = 10,
                 method: str = "eigen", compute_eigenvalue_outer_product: bool = True,
                 accumulation_steps: int | None = None) -> None:
        self.model, self.lr, self.damping, self.decay = model, lr, damping, factor_decay
        self.kl_clip, self.ffreq, self.ifreq, self.method = (kl_clip, factor_update_freq,
                                                              inv_update_freq, method)
        self.outer_product, self.accumulation = (compute_eigenvalue_outer_product,
                                                 accumulation_steps)
        self.layers = kfac_layers(model)
        self.A: dict[str, Tensor] = {}
        self.G: dict[str, Tensor] = {}
        self.pre: dict[str, Any] = {}
        self.passes: list[dict[str, tuple[Tensor, Tensor]]] = []   # batch factors per pass
        self.carried = 0                  # of which left over from earlier steps
        self.steps = 0

    def backward_on_passes(self, passes: list[list[tuple[Tensor, Tensor]]]) -> None:
        """Several passes before one step (gradient accumulation): gradients summed over the
        passes, each pass's factors kept for step()."""
        total = {p: torch.zeros_like(p) for p in self.model.parameters()}
        for shards in passes:
            self.backward_on_shards(shards)
            for p in self.model.parameters():
                total[p] += p.grad
        for p in self.model.parameters():
            p.grad.copy_(total[p])

    def backward_on_shards(self, shards: list[tuple[Tensor, Tensor]]) -> None:
        """Gradients (averaged over shards) in .grad, and this pass's averaged batch factors."""
        seen: dict[str, tuple[Tensor, Tensor]] = {}
        handles = []
        for name, module in self.layers:
            def hook(mod: nn.Module, inp: Any, out: Tensor, name: str = name) -> None:
                out.retain_grad()
                seen[name] = (inp[0].detach(), out)
            handles.append(module.register_forward_hook(hook))
        grads = {p: torch.zeros_like(p) for p in self.model.parameters()}
        batch_factors: dict[str, list[tuple[Tensor, Tensor]]] = {n: [] for n, _ in self.layers}
        for x, y in shards:
            self.model.zero_grad()
            loss_fn(self.model(x), y).backward()
            for p in self.model.parameters():
                grads[p] += p.grad / len(shards)
            for name, module in self.layers:
                inp, out = seen[name]
                batch_factors[name].append(reference_factors(module, inp, out.grad))
        for h in handles:
            h.remove()
        for p in self.model.parameters():
            p.grad.copy_(grads[p])
        self.passes.append({n: (sum(a for a, _ in fs) / len(fs), sum(g for _, g in fs) / len(fs))
                            for n, fs in batch_factors.items()})

    def _at(self, value: Any) -> Any:
        return value(self.steps) if callable(value) else value

    def step(self) -> None:
        decay, damping, lr, kl_clip = (self._at(v) for v in (self.decay, self.damping, self.lr,
                                                               self.kl_clip))
        if self.steps % self._at(self.ffreq) == 0:
            # kfac-pytorch counts this step's passes; after every k-th, everything recorded
            # since the last update (leftovers of earlier steps included) makes one update
            new = self.passes[self.carried:]
            pending = self.passes[:self.carried]
            k = self.accumulation or len(new)
            for j, recorded in enumerate(new, start=1):
                pending.append(recorded)
                if j % k:
                    continue
                for name, _ in self.layers:
                    a = sum(p[name][0] for p in pending) / len(pending)
                    g = sum(p[name][1] for p in pending) / len(pending)
                    eye_a = torch.eye(a.shape[0], dtype=a.dtype)
                    eye_g = torch.eye(g.shape[0], dtype=g.dtype)
                    self.A[name] = decay * self.A.get(name, eye_a) + (1 - decay) * a
                    self.G[name] = decay * self.G.get(name, eye_g) + (1 - decay) * g
                pending = []
            self.passes, self.carried = pending, len(pending)
        else:                             # factors are not recorded on other steps
            self.passes = self.passes[:self.carried]
        if self.steps % self._at(self.ifreq) == 0:
            self.dec_damping = damping
            for name, _ in self.layers:
                if self.method == "eigen":
                    da, qa = torch.linalg.eigh(self.A[name])
                    dg, qg = torch.linalg.eigh(self.G[name])
                    self.pre[name] = (qa, da.clamp(min=0), qg, dg.clamp(min=0))
                else:
                    eye_a = torch.eye(self.A[name].shape[0], dtype=self.A[name].dtype)
                    eye_g = torch.eye(self.G[name].shape[0], dtype=self.G[name].dtype)
                    self.pre[name] = (torch.linalg.inv(self.A[name] + damping * eye_a),
                                      torch.linalg.inv(self.G[name] + damping * eye_g))
        out, vg = {}, 0.0
        for name, module in self.layers:
            grad = grad_matrix(module)
            if self.method == "eigen":
                qa, da, qg, dg = self.pre[name]
                d = self.dec_damping if self.outer_product else damping
                v = qg.t() @ grad @ qa / (dg[:, None] * da[None, :] + d)
                p = qg @ v @ qa.t()
            else:
                a_inv, g_inv = self.pre[name]
                p = g_inv @ grad @ a_inv
            out[name] = p
            vg += float((p * grad).sum()) * lr ** 2
        nu = min(1.0, math.sqrt(kl_clip / abs(vg))) if kl_clip else 1.0
        self.last_nu = nu
        for name, module in self.layers:
            set_grad_matrix(module, out[name] * nu)
        self.steps += 1


def grads_of(model: nn.Module) -> dict[str, Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()
            if p.grad is not None}


def reference_run(name: str, world: int, steps: int, opt_lr: float = 0.05,
                  **kfac: Any) -> list[dict[str, Tensor]]:
    """Preconditioned gradients at every step of SGD(opt_lr) training with the reference."""
    model = make_model(name)
    ref = ReferenceKFAC(model, **kfac)
    opt = torch.optim.SGD(model.parameters(), lr=opt_lr)
    out = []
    for step in range(steps):
        ref.backward_on_shards([batch(name, step, world, r) for r in range(world)])
        ref.step()
        out.append(grads_of(model))
        opt.step()
    return out


def reference_params(name: str, world: int, steps: int, opt_lr: float = 0.05,
                     **kfac: Any) -> list[dict[str, Tensor]]:
    """Parameters after every step of SGD(opt_lr) training with the reference (index 0: the
    initial ones)."""
    model = make_model(name)
    ref = ReferenceKFAC(model, **kfac)
    opt = torch.optim.SGD(model.parameters(), lr=opt_lr)
    out = [params_of(model)]
    for step in range(steps):
        ref.backward_on_shards([batch(name, step, world, r) for r in range(world)])
        ref.step()
        opt.step()
        out.append(params_of(model))
    return out


def params_of(model: nn.Module) -> dict[str, Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def max_rel_diff(a: dict[str, Tensor], b: dict[str, Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp(min=1e-30)) for k in a)


def _horovod_main(strategy: str) -> None:
    """Train the MLP under Horovod with hvd.DistributedOptimizer and dear.KFAC; print grads."""
    import horovod.torch as hvd

    import dear
    hvd.init()
    torch.set_num_threads(1)
    model = make_model("mlp")
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters())
    precond = dear.KFAC(model, strategy=strategy, **ARGS)
    result = []
    for step in range(STEPS):
        x, y = batch("mlp", step, hvd.size(), hvd.rank())
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.synchronize()
        precond.step()
        result.append(grads_of(model))
        with opt.skip_synchronize():
            opt.step()
    torch.save(result, sys.argv[3] + f".{hvd.rank()}")
    print("done", hvd.rank())


if __name__ == "__main__" and sys.argv[1:2] == ["hvd"]:
    _horovod_main(sys.argv[2])
