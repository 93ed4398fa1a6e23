"""dear.lightning.DeARStrategy under Lightning's own loop, against strategy="ddp".

Each case runs `trainer.fit` on 2 CPU ranks (tests/distributed.py: spawned processes, Gloo on
loopback, hard timeout) for the same LightningModule, data and seed, once with strategy="ddp"
and once with strategy="dear", and compares the final parameters.

Why exact equality is expected, except where clipping enters. On 2 ranks both strategies average
a gradient element as one IEEE addition and one exact halving: DDP divides by the world size
(a power of two: exact) and all-reduces, dear sums in its reduce-scatter and multiplies the shard
by 1/2 (exact); fl(a/2 + b/2) = fl(a + b)/2 = fl(b + a)/2. Same averaged gradients, same SGD
update, same forward next step: bitwise the same parameters, also with bf16 autocast (the same
kernels on the same inputs), with gradient accumulation (both sum the k local gradients in .grad
before communicating) and with an LR scheduler.

With gradient_clip_val the clip coefficient min(1, c / ||g||) comes from a norm summed in a
different order (torch: per-tensor norms; dear: per-rank partial sums of squares of its shards),
so it may differ by a few units of rounding: |d||g||| / ||g|| <= N * eps for N summed squares
(the classic bound on a recursive sum). An update is at most lr * c in norm, so one step's
parameter difference is at most lr * c * N * eps; over S steps, with the differences fed back
through later gradients (a factor (1 + lr * L) per step, L the gradient's Lipschitz constant,
below 2 here for lr = 0.1 on this 2-layer tanh model: factor (1.2)^S), the bound used is
S * (1.2 ** S) * lr * c * N * eps, with N the parameter count.

A resumed run (fit to the end of epoch 1 with a checkpoint, then a new Trainer with ckpt_path=)
must equal the uninterrupted one bitwise: the checkpoint holds the parameters with the pending
update applied (state_dict() flushes it) and the optimizer and scheduler state, and the epoch's
DistributedSampler order depends only on the epoch.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

import pytest
import torch

from tests.distributed import run_distributed
from tests.subprocesses import NO_MPIRUN, ROOT, run

pytest.importorskip("lightning")

STEPS_PER_EPOCH = 4          # 2 ranks x 4 batches of 8 = 64 samples per epoch
BATCH = 8
LR = 0.1


def _module(clip: bool = False, sched: bool = False, momentum: float = 0.9) -> Any:
    import lightning.pytorch as L

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.body = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(),
                                            torch.nn.Linear(16, 16), torch.nn.Tanh())
            self.head = torch.nn.Linear(16, 3)
            self.val_losses: list[float] = []

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.body(x))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = torch.nn.functional.cross_entropy(self(x).float(), y)
            self.log("train_loss", loss, sync_dist=True)
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            loss = torch.nn.functional.cross_entropy(self(x).float(), y)
            self.val_losses.append(float(loss))
            self.log("val_loss", loss, sync_dist=True)

        def configure_optimizers(self) -> Any:
            opt = torch.optim.SGD(self.parameters(), lr=LR, momentum=momentum)
            if not sched:
                return opt
            return {"optimizer": opt,
                    "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)}

    return Net()


def _data(n: int, seed: int) -> Any:
    from torch.utils.data import DataLoader, TensorDataset
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 12, generator=g)
    y = (x[:, :3].sum(1) > 0).long() + (x[:, 3] > 1).long()
    return DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True,
                      generator=torch.Generator().manual_seed(seed))


def fit(strategy: str, epochs: int = 2, clip: float = 0.0, accumulate: int = 1,
        precision: str = "32-true", sched: bool = False, val_every: float = 1.0,
        ckpt_dir: str = "", resume: str = "", scaler: bool = False) -> dict[str, Any]:
    """One rank's trainer.fit; returns the final parameters and what the run saw."""
    import lightning.pytorch as L
    warnings.filterwarnings("ignore")
    import dear.lightning  # noqa: F401  (registers strategy="dear")
    label = strategy
    if strategy.endswith("+views"):            # gradient_as_bucket_view=True, as DDP's option
        from lightning.pytorch.strategies import DDPStrategy
        strategy = (dear.lightning.DeARStrategy(gradient_as_bucket_view=True)  # type: ignore
                    if strategy.startswith("dear") else DDPStrategy(gradient_as_bucket_view=True))
    L.seed_everything(1234, verbose=False)
    model = _module(sched=sched)
    callbacks: list[Any] = []
    if ckpt_dir:
        callbacks.append(L.callbacks.ModelCheckpoint(dirpath=ckpt_dir, save_top_k=-1,
                                                     every_n_epochs=1, filename="{epoch}"))
    plugins = []
    if scaler:
        from lightning.pytorch.plugins.precision import MixedPrecision
        plugins.append(MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu")))
        precision = None  # type: ignore[assignment]
    kwargs = {} if precision is None else {"precision": precision}
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=epochs,
                        gradient_clip_val=clip or None, accumulate_grad_batches=accumulate,
                        val_check_interval=val_every, limit_val_batches=2,
                        callbacks=callbacks, plugins=plugins, logger=False,
                        enable_checkpointing=bool(ckpt_dir), enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, **kwargs)
    train = _data(2 * STEPS_PER_EPOCH * BATCH, seed=7)
    val = _data(4 * BATCH, seed=8)
    trainer.fit(model, train, val, ckpt_path=resume or None)
    out = {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
           "steps": trainer.global_step, "val_batches": len(model.val_losses),
           "strategy": type(trainer.strategy).__name__, "label": label,
           "lr": trainer.optimizers[0].param_groups[0]["lr"]}
    if scaler:
        out["scale"] = float(trainer.precision_plugin.scaler.get_scale())
    return out


def fit_many(runs: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Several fits, one after the other, in the same 2 rank processes (spawning ranks and
    importing Lightning costs far more than these fits)."""
    return [fit(strategy, **kwargs) for strategy, kwargs in runs]


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[n].double() - b[n].double()).abs().max()) for n in a)


def _clip_bound(steps: int, clip: float, n: int) -> float:
    return steps * 1.2 ** steps * LR * clip * n * torch.finfo(torch.float32).eps


CASES = {
    "accumulate-scheduler": {"accumulate": 2, "sched": True},
    "accumulate-short-group": {"accumulate": 3},  # 4 batches an epoch: groups of 3, then 1
    "bf16-validation": {"precision": "bf16-mixed", "val_every": 0.5},
    "clip": {"clip": 0.05},                      # small enough that every step is clipped
    "gradscaler-clip": {"scaler": True, "clip": 1.0},
}


@pytest.fixture(scope="module")
def ddp_vs_dear() -> dict[str, list[dict[str, Any]]]:
    """Every case under both strategies, plus dear without clipping, in one 2-rank run."""
    runs = [(s, kw) for kw in CASES.values() for s in ("ddp", "dear")] + [("dear", {})]
    runs += [(s, CASES["accumulate-scheduler"]) for s in ("ddp+views", "dear+views")]
    outcomes = run_distributed(fit_many, 2, runs, timeout=400)
    by_case: dict[str, list[dict[str, Any]]] = {}
    for i, (strategy, kwargs) in enumerate(runs):
        name = next((k for k, v in CASES.items() if v == kwargs), "plain")
        name += "+views" if strategy.endswith("+views") else ""
        strategy = strategy.removesuffix("+views")
        # "case/strategy": [rank 0, rank 1]
        by_case.setdefault(f"{name}/{strategy}", [o[i] for o in outcomes])
    return by_case


@pytest.mark.parametrize("case", ["accumulate-scheduler", "accumulate-short-group",
                                  "bf16-validation"])
def test_dear_equals_ddp(ddp_vs_dear: dict[str, Any], case: str) -> None:
    ddp, dear_ = ddp_vs_dear[f"{case}/ddp"], ddp_vs_dear[f"{case}/dear"]
    for outcome in (ddp, dear_):
        assert _max_diff(outcome[0]["params"], outcome[1]["params"]) == 0.0, \
            "the two ranks ended with different parameters"
    assert dear_[0]["strategy"] == "DeARStrategy" and ddp[0]["strategy"] == "DDPStrategy"
    assert dear_[0]["steps"] == ddp[0]["steps"] > 0
    assert dear_[0]["val_batches"] == ddp[0]["val_batches"] > 0
    assert dear_[0]["lr"] == ddp[0]["lr"]
    assert _max_diff(dear_[0]["params"], ddp[0]["params"]) == 0.0


def test_gradient_as_bucket_view_equals_ddp(ddp_vs_dear: dict[str, Any]) -> None:
    """DeARStrategy(gradient_as_bucket_view=True) against DDPStrategy with the same option,
    with accumulation and a scheduler: bit for bit, as without views."""
    ddp = ddp_vs_dear["accumulate-scheduler+views/ddp"]
    dear_ = ddp_vs_dear["accumulate-scheduler+views/dear"]
    assert dear_[0]["strategy"] == "DeARStrategy" and dear_[0]["steps"] == ddp[0]["steps"] > 0
    assert _max_diff(dear_[0]["params"], dear_[1]["params"]) == 0.0
    assert _max_diff(dear_[0]["params"], ddp[0]["params"]) == 0.0


@pytest.mark.parametrize("case", ["clip", "gradscaler-clip"])
def test_dear_equals_ddp_with_clipping(ddp_vs_dear: dict[str, Any], case: str) -> None:
    ddp, dear_ = ddp_vs_dear[f"{case}/ddp"], ddp_vs_dear[f"{case}/dear"]
    assert _max_diff(dear_[0]["params"], dear_[1]["params"]) == 0.0
    steps = dear_[0]["steps"]
    assert steps == ddp[0]["steps"] == 2 * STEPS_PER_EPOCH
    n = sum(p.numel() for p in ddp[0]["params"].values())
    bound = _clip_bound(steps, CASES[case]["clip"], n)
    diff = _max_diff(dear_[0]["params"], ddp[0]["params"])
    assert diff <= bound, f"dear and DDP differ by {diff:.3g} > {bound:.3g}"
    if case == "clip":                         # clipping did happen: without it, elsewhere
        plain = ddp_vs_dear["plain/dear"]
        assert _max_diff(plain[0]["params"], dear_[0]["params"]) > 100 * bound
    else:                                      # the GradScaler saw the same inf checks
        assert dear_[0]["scale"] == ddp[0]["scale"]


def test_resume_equals_uninterrupted(tmp_path: Any) -> None:
    ckpt = tmp_path / "epoch=0.ckpt"
    runs = [("dear", {"epochs": 2, "sched": True}),
            ("dear", {"epochs": 1, "sched": True, "ckpt_dir": str(tmp_path)}),
            ("dear", {"epochs": 2, "sched": True, "resume": str(ckpt)})]
    outcomes = run_distributed(fit_many, 2, runs, timeout=300)
    whole, first, resumed = outcomes[0]
    assert ckpt.exists(), os.listdir(tmp_path)
    saved = torch.load(ckpt, weights_only=False)["state_dict"]
    assert _max_diff(dict(saved), first["params"]) == 0.0, \
        "the checkpoint does not hold the parameters with the last update applied"
    assert _max_diff(resumed["params"], outcomes[1][2]["params"]) == 0.0
    assert resumed["steps"] == whole["steps"] == 2 * STEPS_PER_EPOCH
    assert resumed["lr"] == whole["lr"]
    assert _max_diff(resumed["params"], whole["params"]) == 0.0


def test_value_clipping_is_refused() -> None:
    outcomes = run_distributed(_fit_value_clip, 2, timeout=240, expect_failure=True)
    for text in outcomes:
        assert isinstance(text, str) and "clips by norm only" in text


def _fit_value_clip() -> None:
    import lightning.pytorch as L
    import dear.lightning  # noqa: F401
    warnings.filterwarnings("ignore")
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="dear", max_steps=2,
                        gradient_clip_val=0.5, gradient_clip_algorithm="value", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(_module(), _data(64, 1))


def test_import_dear_without_lightning() -> None:
    """dear imports when Lightning cannot be imported; dear.lightning says what to install."""
    code = ("import sys; sys.modules['lightning'] = None; sys.modules['pytorch_lightning'] = None\n"
            "import dear\n"
            "try:\n    import dear.lightning\nexcept ImportError as e:\n    print('ERR', e)\n")
    out = run([sys.executable, "-c", code], timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stdout
    assert "ERR dear.lightning needs PyTorch Lightning: pip install 'dear[lightning]'" \
        in out.stdout


def test_mpirun_with_mpi_data_plane() -> None:
    """examples/lightning_train.py under a real `mpirun -np 2` (Lightning's MPI environment),
    dear's collectives on MPI (DEAR_BACKEND=mpi): the same parameters as strategy="ddp" there."""
    pytest.importorskip("mpi4py")
    mpirun = os.path.join(os.path.dirname(sys.executable), "mpirun")
    if not os.path.exists(mpirun):
        pytest.skip(NO_MPIRUN)
    sums = {}
    for strategy, env in (("dear", {"DEAR_BACKEND": "mpi"}), ("ddp", {})):
        out = run([mpirun, "-np", "2", sys.executable, "examples/lightning_train.py",
                   "--strategy", strategy, "--epochs", "1"], timeout=300, env=env, cwd=ROOT)
        assert out.returncode == 0, out.stdout
        lines = [line for line in out.stdout.splitlines() if line.startswith("strategy=")]
        assert len(lines) == 1, out.stdout
        sums[strategy] = lines[0].split("parameter checksum ")[1]
    assert sums["dear"] == sums["ddp"]


def test_the_strategys_process_group_times_out_after_dear_timeout(monkeypatch) -> None:
    """Lightning's DDP strategy gives its group torch's 30 minutes; dear's takes DEAR_TIMEOUT
    (or dear_options' timeout), so a rank stuck in a collective leaves with dear's error."""
    pytest.importorskip("pytorch_lightning")
    from datetime import timedelta

    from dear.lightning import DeARStrategy
    monkeypatch.setenv("DEAR_TIMEOUT", "9")
    assert DeARStrategy()._timeout == timedelta(seconds=9)
    assert DeARStrategy(dear_options={"timeout": 12.0})._timeout == timedelta(seconds=12)
    assert DeARStrategy(timeout=timedelta(minutes=2))._timeout == timedelta(minutes=2)
