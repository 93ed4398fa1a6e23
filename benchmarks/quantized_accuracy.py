"""Accuracy of quantized gradient compression (dear.Compression.int8 / int4, with and without
error feedback) against fp32, on real data that needs no download: scikit-learn's bundled
digits (1797 8x8 images, 10 classes), 2 Gloo ranks on loopback, each rank training on its half
of every global batch.

    python -m benchmarks.quantized_accuracy [--models cnn,transformer]
        [--methods fp32,int8,int8_noef,int4,int4_noef] [--seeds 0,1,2] [--epochs 10]
        [--name quantized_accuracy] [--out benchmarks/results]

Data: a stratified split (seed 0, the same for every run) of 1437 training and 360 held-out
images, each pixel standardized with the training set's mean and std. Models:
- cnn: conv 3x3 1->16, ReLU, conv 3x3 16->32, ReLU, max-pool 2, linear 512->10 (9,930 params);
- transformer: the 8 image rows as 8 tokens of 8 features, a linear embedding to d_model=32
  plus a learned position embedding, 2 nn.TransformerEncoder layers (4 heads, feed-forward 64,
  no dropout), mean-pool, linear head (17,962 params).
Every method runs with the same hyperparameters (chosen on fp32 alone, never per method): Adam,
lr 3e-3 constant, global batch 64 (32 a rank), 22 steps an epoch (the last partial batch
dropped), `--epochs` epochs. A seed fixes the model's initialization and the data order.

Methods: fp32 = dear.Compression.none; int8 = dear.Compression.int8 (block 256, error feedback);
int8_noef = dear.Compression.quantized(bits=8, error_feedback=False); int4 =
dear.Compression.int4 (block 128, error feedback); int4_noef =
dear.Compression.quantized(bits=4, block_size=128, error_feedback=False).

Per run and every step, the gradient dear applied (Horovod's loop: backward; synchronize() puts
the averaged, dequantized gradient in .grad; step() inside skip_synchronize()) against the exact
fp32 average of the same local gradients (cloned right after backward, all-reduced in fp32 on
a process group of its own): ||g_dear - g_exact|| / ||g_exact|| over all parameters. Reading
.grad changes nothing in training; fp32 must give < 1e-6 (checked). Also checked: the cloned
local gradient equals plain torch's gradient of the same parameters on the same batch (a shadow
copy of the model, every CHECK_EVERY steps), and at the end every rank holds bit-identical
parameters. Held-out accuracy and loss: after opt.flush_updates(), in eval mode, rank 0's model.
Training loss: the mean over the last epoch of each rank's loss on its half-batch, averaged over
the ranks (= the mean loss of the global batches).

Outputs <out>/<name>.json, <name>.md and <name>_error.png (per-step relative gradient error, the
mean over seeds, one line per method, one panel per model).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import hashlib
import json
import os
import statistics
import sys
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import dear
import dear.native
from benchmarks import results
from dear.testing.ranks import run_distributed

WORLD = 2
GLOBAL_BATCH = 64
LR = 3e-3
EPOCHS = 10
SPLIT_SEED = 0
HELD_OUT = 360
CHECK_EVERY = 25            # steps between shadow checks of the cloned local gradient
FP32_TOLERANCE = 1e-6

METHODS: dict[str, Callable[[], Any]] = {
    "fp32": lambda: dear.Compression.none,
    "int8": lambda: dear.Compression.int8,
    "int8_noef": lambda: dear.Compression.quantized(bits=8, error_feedback=False),
    "int4": lambda: dear.Compression.int4,
    "int4_noef": lambda: dear.Compression.quantized(bits=4, block_size=128,
                                                    error_feedback=False),
}
DEFAULT_METHODS = tuple(METHODS)
# int4 variants tried on the transformer, where int4 (block 128) ends below fp32's spread
METHODS["int4_b64"] = lambda: dear.Compression.quantized(bits=4, block_size=64)
METHODS["int4_b32"] = lambda: dear.Compression.quantized(bits=4, block_size=32)
METHODS["int4_wu20"] = lambda: dear.Compression.quantized(bits=4, warmup_steps=20)
MODELS = ("cnn", "transformer")


# ------------------------------------------------------------------------------------ data
def digits() -> dict[str, torch.Tensor]:
    """sklearn's bundled digits: a stratified 1437/360 split (seed 0), standardized per pixel
    with the training set's statistics (a pixel constant in training keeps std 1)."""
    import numpy as np
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    data = load_digits()
    xtr, xte, ytr, yte = train_test_split(
        data.data.astype(np.float32), data.target, test_size=HELD_OUT, stratify=data.target,
        random_state=SPLIT_SEED)
    mean, std = xtr.mean(0), xtr.std(0)
    std[std == 0] = 1.0
    return {"xtr": torch.tensor((xtr - mean) / std).view(-1, 1, 8, 8),
            "ytr": torch.tensor(ytr, dtype=torch.long),
            "xte": torch.tensor((xte - mean) / std).view(-1, 1, 8, 8),
            "yte": torch.tensor(yte, dtype=torch.long)}


# ---------------------------------------------------------------------------------- models
class RowTransformer(nn.Module):
    """The 8 rows of an image as 8 tokens of 8 features."""

    def __init__(self, d_model: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Linear(8, d_model)
        self.position = nn.Parameter(torch.randn(8, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(d_model, heads, 2 * d_model, dropout=0.0,
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.embed(x.reshape(-1, 8, 8)) + self.position
        return self.head(self.encoder(tokens).mean(dim=1))


def build_model(name: str) -> nn.Module:
    if name == "cnn":
        return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
                             nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Flatten(), nn.Linear(512, 10))
    if name == "transformer":
        return RowTransformer()
    raise ValueError(f"unknown model {name!r}: {', '.join(MODELS)}")


# ------------------------------------------------------------------------------ one rank
def _flat_grads(params: list[nn.Parameter]) -> torch.Tensor:
    return torch.cat([p.grad.detach().reshape(-1) for p in params])


def _digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for t in model.state_dict().values():
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def train_rank(model_name: str, method: str, seed: int, epochs: int,
               data: dict[str, torch.Tensor]) -> dict[str, Any]:
    """One rank of one run (run_distributed calls it with RANK/WORLD_SIZE set)."""
    torch.set_num_threads(1)
    dear.init()
    rank, world = dear.rank(), dear.size()
    exact_group = dist.new_group(backend="gloo")   # the fp32 reference's own collectives
    xtr, ytr = data["xtr"], data["ytr"]
    torch.manual_seed(seed)
    model = build_model(model_name)
    shadow = copy.deepcopy(model)                    # plain torch, for the local-gradient check
    params = list(model.parameters())
    opt = dear.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=LR), model=model,
                                    compression=METHODS[method]())
    local = GLOBAL_BATCH // world
    steps_per_epoch = len(ytr) // GLOBAL_BATCH
    order = torch.Generator().manual_seed(seed)
    errors: list[float] = []
    losses: list[float] = []
    applied_sum = torch.zeros(sum(p.numel() for p in params), dtype=torch.float64)
    exact_sum = torch.zeros_like(applied_sum)
    shadow_diff = 0.0
    start = time.perf_counter()
    model.train()
    for epoch in range(epochs):
        perm = torch.randperm(len(ytr), generator=order)
        losses = []
        for s in range(steps_per_epoch):
            step = epoch * steps_per_epoch + s
            idx = perm[s * GLOBAL_BATCH + rank * local:s * GLOBAL_BATCH + (rank + 1) * local]
            x, y = xtr[idx], ytr[idx]
            check = step % CHECK_EVERY == 0
            if check:
                opt.flush_updates()
                shadow.load_state_dict(model.state_dict())
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            mine = _flat_grads(params).clone()       # this rank's local gradient
            if check:
                shadow.zero_grad()
                F.cross_entropy(shadow(x), y).backward()
                plain = _flat_grads(list(shadow.parameters()))
                shadow_diff = max(shadow_diff, ((mine - plain).norm() / plain.norm()).item())
            opt.synchronize()                        # .grad: the average dear applies
            applied = _flat_grads(params).clone()
            with opt.skip_synchronize():
                opt.step()
            dist.all_reduce(mine, group=exact_group)
            exact = mine / world
            errors.append(((applied - exact).norm() / exact.norm()).item())
            applied_sum += applied
            exact_sum += exact
            losses.append(loss.item())
    opt.flush_updates()
    seconds = time.perf_counter() - start
    model.eval()
    with torch.no_grad():
        out = model(data["xte"])
        correct = int((out.argmax(1) == data["yte"]).sum())
        test_loss = F.cross_entropy(out, data["yte"]).item()
    digest = _digest(model)
    dear.shutdown()
    return {"rank": rank, "errors": errors, "last_epoch_loss": statistics.fmean(losses),
            "correct": correct, "accuracy": correct / len(data["yte"]), "test_loss": test_loss,
            "cumulative_error": ((applied_sum - exact_sum).norm() / exact_sum.norm()).item(),
            "digest": digest,
            "shadow_max_rel_diff": shadow_diff, "train_seconds": seconds}


# ------------------------------------------------------------------------------- one run
def run_one(model_name: str, method: str, seed: int, epochs: int,
            data: dict[str, torch.Tensor], timeout: float) -> dict[str, Any]:
    """Both ranks of one run; rank 0's held-out figures, the ranks' mean training loss."""
    start = time.perf_counter()
    ranks = run_distributed(train_rank, WORLD, model_name, method, seed, epochs, data,
                            timeout=timeout)
    wall = time.perf_counter() - start
    zero = ranks[0]
    if any(r["digest"] != zero["digest"] for r in ranks):
        raise RuntimeError(f"{model_name}/{method}/seed {seed}: the ranks' final parameters "
                           f"differ: {[r['digest'][:12] for r in ranks]}")
    if any(r["errors"] != zero["errors"] for r in ranks):
        raise RuntimeError(f"{model_name}/{method}/seed {seed}: the ranks measured different "
                           "gradient errors (their applied gradients differ)")
    for r in ranks:
        if r["shadow_max_rel_diff"] > 1e-5:
            raise RuntimeError(
                f"{model_name}/{method}/seed {seed}: rank {r['rank']}'s .grad after backward is "
                f"not its local gradient (relative difference {r['shadow_max_rel_diff']:.3g} to "
                "plain torch's)")
    errors = zero["errors"]
    return {"model": model_name, "method": method, "seed": seed,
            "compression": repr(METHODS[method]()),
            "accuracy": zero["accuracy"], "correct": zero["correct"],
            "test_loss": zero["test_loss"],
            "train_loss": statistics.fmean(r["last_epoch_loss"] for r in ranks),
            "train_loss_by_rank": [r["last_epoch_loss"] for r in ranks],
            "grad_error": errors, "grad_error_mean": statistics.fmean(errors),
            "grad_error_max": max(errors), "cumulative_error": zero["cumulative_error"],
            "shadow_max_rel_diff": max(r["shadow_max_rel_diff"] for r in ranks),
            "train_seconds": max(r["train_seconds"] for r in ranks), "wall_seconds": wall}


# --------------------------------------------------------------------------------- report
def _pct(v: float) -> str:
    return f"{100 * v:.1f}"


def _within(mean_acc: float, fp32: list[float]) -> bool:
    """min <= mean <= max, up to float rounding (a mean of k/360s equal to one of them)."""
    return min(fp32) - 1e-9 <= mean_acc <= max(fp32) + 1e-9


def verdict(mean_acc: float, fp32: Optional[list[float]]) -> str:
    if fp32 is None:
        return "n/a (no fp32 runs)"
    lo, hi = min(fp32), max(fp32)
    if _within(mean_acc, fp32):
        return "yes"
    return (f"no: below ({_pct(mean_acc - lo)} pt)" if mean_acc < lo
            else f"no: above (+{_pct(mean_acc - hi)} pt)")


def summarize(runs: list[dict[str, Any]], models: list[str], methods: list[str],
              seeds: list[int]) -> dict[str, dict[str, Any]]:
    """Per model and method: per-seed figures, mean and spread, verdict against fp32."""
    out: dict[str, dict[str, Any]] = {}
    for m in models:
        by = {meth: sorted((r for r in runs if r["model"] == m and r["method"] == meth),
                           key=lambda r: seeds.index(r["seed"])) for meth in methods}
        fp32 = [r["accuracy"] for r in by["fp32"]] if "fp32" in by else None
        out[m] = {}
        for meth in methods:
            rs = by[meth]
            acc = [r["accuracy"] for r in rs]
            mean_acc = statistics.fmean(acc)
            out[m][meth] = {
                "accuracy": acc, "accuracy_mean": mean_acc,
                "accuracy_min": min(acc), "accuracy_max": max(acc),
                "train_loss": [r["train_loss"] for r in rs],
                "train_loss_mean": statistics.fmean(r["train_loss"] for r in rs),
                "test_loss": [r["test_loss"] for r in rs],
                "test_loss_mean": statistics.fmean(r["test_loss"] for r in rs),
                "grad_error_mean": statistics.fmean(r["grad_error_mean"] for r in rs),
                "grad_error_max": max(r["grad_error_max"] for r in rs),
                "cumulative_error_mean": statistics.fmean(r["cumulative_error"] for r in rs),
                "within_fp32_spread": (None if fp32 is None or meth == "fp32"
                                       else _within(mean_acc, fp32)),
                "verdict": "reference" if meth == "fp32" else verdict(mean_acc, fp32),
            }
    return out


def tables(summary: dict[str, dict[str, Any]]) -> str:
    parts = []
    for m, by in summary.items():
        rows = []
        for meth, s in by.items():
            rows.append([
                meth, " / ".join(_pct(a) for a in s["accuracy"]), _pct(s["accuracy_mean"]),
                f"{_pct(s['accuracy_min'])}-{_pct(s['accuracy_max'])}",
                " / ".join(f"{v:.4f}" for v in s["train_loss"]), f"{s['train_loss_mean']:.4f}",
                f"{s['test_loss_mean']:.4f}", f"{s['grad_error_mean']:.2e}",
                f"{s['grad_error_max']:.2e}", f"{s['cumulative_error_mean']:.2e}",
                s["verdict"]])
        parts.append(f"### {m}\n\n" + results.markdown_table(
            ["method", "held-out acc % (per seed)", "mean", "min-max",
             "final train loss (per seed)", "mean", "held-out loss (mean)",
             "grad rel. error (mean over steps)", "(max)", "cumulative error at the end",
             "mean acc within fp32's min-max?"], rows))
    return "\n\n".join(parts)


def error_figure(runs: list[dict[str, Any]], models: list[str], methods: list[str]
                 ) -> Callable[[str], None]:
    def draw(path: str) -> None:
        plt = results.pyplot()
        fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.2), squeeze=False)
        for ax, m in zip(axes.flat, models):
            skipped = []
            for meth in methods:
                curves = [r["grad_error"] for r in runs if r["model"] == m and r["method"] == meth]
                mean = torch.tensor(curves, dtype=torch.float64).mean(0)
                if not bool((mean > 0).any()):
                    skipped.append(meth)
                    continue
                ax.plot(range(1, len(mean) + 1), mean.tolist(), linewidth=0.9, label=meth)
            ax.set_yscale("log")
            ax.set_xlabel("step")
            ax.set_ylabel("||g_dear - g_exact|| / ||g_exact||")
            title = f"{m}: applied vs exact averaged gradient (mean over seeds)"
            if skipped:
                title += f"\n{', '.join(skipped)}: exactly 0 every step (not drawn on log y)"
            ax.set_title(title, fontsize=9)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
    return draw


def write(out: str, name: str, data: dict[str, Any], body: str,
          figure: Callable[[str], None]) -> str:
    """results.write()'s files and header, into `out`, the figure as <name>_error.png."""
    os.makedirs(out, exist_ok=True)
    meta = {"command": results.command(), "commit": results.commit(),
            "machine": results.machine(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    with open(os.path.join(out, f"{name}.json"), "w") as fh:
        json.dump({**meta, **data}, fh, indent=2, default=str)
    figure(os.path.join(out, f"{name}_error.png"))
    md = os.path.join(out, f"{name}.md")
    with open(md, "w") as fh:
        fh.write(f"# Quantized gradient compression: accuracy on sklearn digits, 2 ranks\n\n"
                 f"Command: `{meta['command']}`  \nCommit: {meta['commit']}  \n"
                 f"Machine: {meta['machine']}  \nDate: {meta['date']}\n\n{body}\n\n"
                 f"![{name}_error]({name}_error.png)\n")
    return md


def notes(summary: dict[str, dict[str, Any]], runs: list[dict[str, Any]], epochs: int,
          seeds: list[int], total: float) -> str:
    steps = len(runs[0]["grad_error"]) if runs else 0
    lines = [
        f"2 Gloo ranks on loopback, one thread each; each rank trains on its half of every "
        f"global batch of {GLOBAL_BATCH}. Adam lr {LR:g} (constant), {epochs} epochs = {steps} "
        f"steps, the same for every method and model (chosen on fp32 only). Seeds {seeds} fix "
        f"the initialization and the data order; the split (1437 train / 360 held-out, "
        f"stratified, seed {SPLIT_SEED}) is the same in every run.",
        "",
        "Held-out accuracy and loss: rank 0's model after `opt.flush_updates()`, eval mode (the "
        "ranks' final parameters were checked bit-identical in every run). Final train loss: the "
        "mean over the last epoch of each rank's half-batch loss, averaged over the 2 ranks. "
        "Gradient error: every step, ||g_dear - g_exact|| / ||g_exact|| over all parameters, "
        "g_dear the averaged gradient dear applied (`synchronize()`), g_exact the fp32 all-reduce "
        "of the same local gradients; with error feedback g_dear includes the residual carried "
        "from earlier steps, so this is the error of what was applied at that step, not of the "
        "cumulative update. Cumulative error: ||sum_t g_dear - sum_t g_exact|| / "
        "||sum_t g_exact|| over the whole run (the mean over seeds), what error feedback bounds "
        "(by the last residuals); with Adam the update is not linear in the gradient, so it is "
        "not the parameters' error.",
        "",
        "Verdict: is the method's mean held-out accuracy (over seeds) within the fp32 runs' own "
        "min-max across the same seeds? The target is yes for int8 and int4 with error feedback. "
        f"With {len(seeds)} seed(s) and 360 held-out images (one image = 0.28 pt) this spread is "
        "narrow, so 'no' by a fraction of a point is not evidence of harm and 'yes' is not "
        "evidence of equality; 'above' is not a loss.",
    ]
    for m, by in summary.items():
        fp = by.get("fp32")
        if fp is not None and fp["grad_error_max"] >= FP32_TOLERANCE:
            lines.append(f"\n**{m}: fp32's gradient error reached {fp['grad_error_max']:.3g}**")
        for meth in ("int8", "int4"):
            s = by.get(meth)
            if s is not None and s["within_fp32_spread"] is False:
                lines.append(f"\n**{m}: {meth} (error feedback) misses the target: mean "
                             f"{_pct(s['accuracy_mean'])}% vs fp32 "
                             f"{_pct(fp['accuracy_min'])}-{_pct(fp['accuracy_max'])}%: "
                             f"{s['verdict']}.**")
    lines += ["", f"Run time: {len(runs)} runs, {total:.0f} s in all (the first run's time "
              "includes starting the forkserver that forks the ranks)."]
    for m in summary:
        walls = [r["wall_seconds"] for r in runs if r["model"] == m]
        loops = [r["train_seconds"] for r in runs if r["model"] == m]
        lines.append(f"- {m}: one run (both ranks, start to exit) {min(walls):.1f}-"
                     f"{max(walls):.1f} s, mean {statistics.fmean(walls):.1f} s; its training "
                     f"loop {min(loops):.1f}-{max(loops):.1f} s.")
    lines += ["",
              f"Checked in every run: the local gradient cloned after backward equals plain "
              f"torch's (a shadow copy of the model, every {CHECK_EVERY} steps; max relative "
              f"difference {max(r['shadow_max_rel_diff'] for r in runs):.1g}); fp32's applied "
              f"gradient error < {FP32_TOLERANCE:g} every step."]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------- main
def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.quantized_accuracy",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS), help="cnn,transformer")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                   help=f"{','.join(METHODS)} (fp32 gives the verdict's reference)")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--epochs", type=int, default=EPOCHS)
    p.add_argument("--name", default="quantized_accuracy",
                   help="output stem: <name>.json, <name>.md, <name>_error.png")
    p.add_argument("--out", default=results.RESULTS_DIR, help="output directory")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds before one run's ranks are killed")
    args = p.parse_args(argv)
    models, methods = _csv(args.models), _csv(args.methods)
    seeds = [int(s) for s in _csv(args.seeds)]
    for m in models:
        build_model(m)
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        p.error(f"unknown methods {unknown}: {', '.join(METHODS)}")
    torch.set_num_threads(1)
    data = digits()
    runs: list[dict[str, Any]] = []
    start = time.perf_counter()
    for m in models:
        for seed in seeds:
            for meth in methods:
                r = run_one(m, meth, seed, args.epochs, data, args.timeout)
                runs.append(r)
                print(f"{m:12s} {meth:10s} seed {seed}: held-out acc {_pct(r['accuracy'])}% "
                      f"loss {r['test_loss']:.4f}, train loss {r['train_loss']:.4f}, grad error "
                      f"mean {r['grad_error_mean']:.2e} max {r['grad_error_max']:.2e} "
                      f"({r['wall_seconds']:.1f} s)", flush=True)
                if meth == "fp32" and r["grad_error_max"] >= FP32_TOLERANCE:
                    raise AssertionError(f"{m} seed {seed}: fp32's applied gradient differs "
                                         f"from the exact average by {r['grad_error_max']:.3g}")
    total = time.perf_counter() - start
    summary = summarize(runs, models, methods, seeds)
    body = tables(summary) + "\n\n" + notes(summary, runs, args.epochs, seeds, total)
    config = {"world_size": WORLD, "global_batch": GLOBAL_BATCH, "optimizer": "Adam",
              "lr": LR, "epochs": args.epochs, "seeds": seeds, "models": models,
              "methods": {m: repr(METHODS[m]()) for m in methods},
              "split": {"train": len(data["ytr"]), "held_out": len(data["yte"]),
                        "stratified": True, "seed": SPLIT_SEED},
              "native": dear.native.build_info(), "total_seconds": total}
    md = write(args.out, args.name, {"config": config, "summary": summary, "runs": runs}, body,
               error_figure(runs, models, methods))
    print(body)
    print(f"wrote {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
