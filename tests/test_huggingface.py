"""dear.huggingface.DeARTrainer against transformers.Trainer with DDP (Accelerate's wrap).

Each case runs `trainer.train()` on 2 CPU ranks (tests/distributed.py: spawned processes, Gloo
on loopback, hard timeout) for the same tiny BERT (BertForSequenceClassification, hidden 32,
2 layers, 2 heads, vocabulary 100, dropout on), data and seed, once with `Trainer` (Accelerate
wraps the model in DistributedDataParallel) and once with `DeARTrainer`; Trainer builds the
optimizer and scheduler itself in both. Compared: the final parameters, the logged `grad_norm`
and `loss` of every step, the learning rate, the evaluation losses.

Why exact equality is expected without active clipping. On 2 ranks both average a gradient
element with one IEEE addition and one exact halving: DDP divides by the world size (a power of
two: exact) and all-reduces, dear sums in its reduce-scatter and multiplies the shard by 1/2;
fl(a/2 + b/2) = fl(a + b)/2 = fl(b + a)/2. The same averaged gradients give the same AdamW
update (element-wise), the same forward next step: bitwise equal parameters, also with bf16
autocast (the same kernels on the same inputs), with gradient accumulation (both sum the k
local gradients in .grad before communicating; Trainer scales each loss the same way, also in
an epoch's last, shorter group), with a clip that never bites (both multiply by exactly 1.0),
and after `resume_from_checkpoint` (the checkpoint holds the weights with the last update
applied: state_dict() flushes it).

The logged grad_norm is sqrt(S), S the sum of the N squared elements of that same averaged
gradient, summed in another order (torch: a norm per tensor, then the norm of those; dear: the
norm of each shard piece, squared, summed per rank, gathered, summed). For non-negative terms
any order of summation errs by at most (N - 1) u S (u = 2^-24), squaring each term by u more,
and the square root halves a relative error; so two such norms differ by at most about
(N + 8) u of the norm, and N * eps (eps = 2u) bounds it: GRAD_NORM_RTOL below.

With clipping that bites, the coefficient min(1, c / (||g|| + 1e-6)) inherits that relative
difference (<= N eps), so the trajectories part by rounding. The clip case uses plain SGD (the
argument of tests/test_lightning.py): an update is at most lr * c in norm, so one step adds at
most lr * c * N * eps to the parameter difference, and a difference d changes the next clipped
gradient by at most 2 (c / ||g||) L d; with lr = 0.1, c = 0.05 <= ||g|| and the loss' gradient
Lipschitz constant L <= 20 assumed, each step multiplies the difference by at most 1.2:
after S steps |diff| <= S * 1.2^S * lr * c * N * eps. The logged norms at step t then differ by
at most N eps ||g|| + L sqrt(N) times the parameter bound at t-1.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
import warnings
from typing import Any

import pytest
import torch

from tests.distributed import run_distributed
from tests.subprocesses import ROOT, run

needs_hf = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None
    or importlib.util.find_spec("accelerate") is None,
    reason="transformers or accelerate is not installed: pip install '.[huggingface]' "
           "(tests of dear.huggingface against Trainer / Accelerate with DDP)")

EPS = torch.finfo(torch.float32).eps
SEQ, BATCH, TRAIN, VAL = 16, 4, 48, 16      # 2 ranks x 4 = 8 samples a step: 6 steps an epoch
LR_SGD, CLIP = 0.1, 0.05
L_ASSUMED = 20.0


def _model(seed: int = 0) -> Any:
    from transformers import BertConfig, BertForSequenceClassification
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=64,
                        max_position_embeddings=SEQ, num_labels=3)
    return BertForSequenceClassification(config)


class _Data(torch.utils.data.Dataset):
    """Token sequences labelled by a sum of their first tokens (something to learn)."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, 100, (n, SEQ), generator=g)
        self.labels = self.ids[:, :4].sum(1) % 3

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(SEQ, dtype=torch.long),
                "labels": self.labels[i]}


def fit(kind: str, out: str, *, clip: float = 0.0, accumulate: int = 1, bf16: bool = False,
        optim: str = "", lr: float = 1e-3, scheduler: str = "linear",
        evaluate: bool = False, save_at: int = 0, resume: str = "",
        given_optimizer: str = "", sharded: bool = False, snapshots: bool = False
        ) -> dict[str, Any]:
    """One rank's Trainer.train() (kind "ddp") or DeARTrainer.train() (kind "dear").
    `snapshots`: the parameters at the start of every step (those its grad_norm is taken at)."""
    warnings.filterwarnings("ignore")
    import transformers
    from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments

    from dear.huggingface import DeARTrainer
    transformers.logging.set_verbosity_error()
    args = TrainingArguments(
        output_dir=out, per_device_train_batch_size=BATCH, per_device_eval_batch_size=BATCH,
        gradient_accumulation_steps=accumulate, num_train_epochs=2, learning_rate=lr,
        lr_scheduler_type=scheduler, warmup_steps=2, max_grad_norm=clip,
        bf16=bf16, use_cpu=True, seed=7, logging_steps=1, report_to="none",
        disable_tqdm=True, dataloader_num_workers=0,
        eval_strategy="steps" if evaluate else "no", eval_steps=2,
        save_strategy="steps" if save_at else "no", save_steps=save_at or 500,
        save_only_model=False, **({"optim": optim} if optim else {}))   # default: fused AdamW
    model = _model(seed=int(os.environ["RANK"]))   # DDP and dear broadcast rank 0's weights
    optimizers: Any = (None, None)
    if given_optimizer:                             # Trainer(optimizers=(opt, scheduler))
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
        if given_optimizer == "dear":               # wrapped by the script (the workaround)
            import dear
            opt = dear.DistributedOptimizer(opt, model=model)
        optimizers = (opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5))
    cls: Any = DeARTrainer if kind == "dear" else Trainer
    extra = {"dear_options": {"shard_optimizer_state": True}} if sharded else {}
    trainer = cls(model=model, args=args, train_dataset=_Data(TRAIN, 1),
                  eval_dataset=_Data(VAL, 2) if evaluate else None, optimizers=optimizers,
                  **extra)
    trainer.remove_callback(PrinterCallback)           # the logs are read from its state
    taken: list[torch.Tensor] = []
    if snapshots:
        class Snapshots(TrainerCallback):
            def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                flush = getattr(trainer.optimizer.optimizer, "flush_updates", None)
                if flush is not None:                  # dear: the last update applied now
                    flush()
                taken.append(torch.cat([p.detach().reshape(-1).clone()
                                        for p in model.parameters()]))
        trainer.add_callback(Snapshots())
    trainer.train(resume_from_checkpoint=resume or None)
    history = trainer.state.log_history
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "submodule": model.classifier.weight.detach().clone(),   # flushed by train()'s end
        "grad_norm": [h["grad_norm"] for h in history if "grad_norm" in h],
        "loss": [h["loss"] for h in history if "loss" in h and "grad_norm" in h],
        "lr": [h["learning_rate"] for h in history if "learning_rate" in h],
        "eval_loss": [h["eval_loss"] for h in history if "eval_loss" in h],
        "steps": trainer.state.global_step, "trainer": type(trainer).__name__, "out": out,
        "optimizer": type(trainer.optimizer.optimizer).__mro__[1].__name__,
        "fused": bool(trainer.optimizer.optimizer.defaults.get("fused")),
        "autocast": hasattr(model, "_original_forward"),     # Accelerate's autocast wrapper
        "model_wrapped": type(trainer.model_wrapped).__name__,
        "snapshots": taken,
    }


def fit_many(runs: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Several trainings one after the other in the same 2 rank processes (spawning ranks and
    importing transformers costs more than these trainings)."""
    return [fit(kind, **kwargs) for kind, kwargs in runs]


# The cases, each run with kind "ddp" and "dear".
CASES: dict[str, dict[str, Any]] = {
    # Trainer's default optimizer (fused AdamW, torch >= 2.8) and linear schedule with warmup,
    # evaluation every 2 steps, checkpoints every 3 steps (the one at step 3: mid-epoch)
    "plain": {"evaluate": True, "save_at": 3},
    # SGD, every step clipped.
    "clip": {"clip": CLIP, "optim": "sgd", "lr": LR_SGD, "snapshots": True},
    # 6 batches an epoch in groups of 4: a last, shorter group of 2; cosine schedule.
    "accumulate": {"accumulate": 4, "scheduler": "cosine"},
    # bf16 autocast; a clip that never bites (coefficient exactly 1.0) on the clipping path.
    "bf16": {"bf16": True, "clip": 1e6},
    # the user's own optimizer and scheduler, given as Trainer(optimizers=...); also (below,
    # "given-dear") one the script wrapped in dear.DistributedOptimizer itself, accumulating 2.
    "given-optimizer": {"given_optimizer": "torch"},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: Any) -> dict[str, list[dict[str, Any]]]:
    """Every case under both trainers, a resume of each plain run from its mid-epoch
    checkpoint, and SGD without clipping under dear; one 2-rank run. {"case/kind": [rank 0,
    rank 1]}."""
    root = tmp_path_factory.mktemp("hf")
    plan: list[tuple[str, str, dict[str, Any]]] = []
    for case, kwargs in CASES.items():
        for kind in ("ddp", "dear"):
            plan.append((f"{case}/{kind}", kind, {**kwargs, "out": str(root / case / kind)}))
    for kind in ("ddp", "dear"):
        plan.append((f"resume/{kind}", kind, {"evaluate": True, "save_at": 3,
                                              "out": str(root / "r" / kind),
                                              "resume": str(root / "plain" / kind /
                                                            "checkpoint-3")}))
    plan.append(("given-dear/dear", "dear", {"given_optimizer": "dear", "accumulate": 2,
                                             "out": str(root / "given-dear")}))
    plan.append(("given-dear/ddp", "ddp", {"given_optimizer": "torch", "accumulate": 2,
                                           "out": str(root / "given-dear-ddp")}))
    plan.append(("clip-off/dear", "dear", {"optim": "sgd", "lr": LR_SGD,
                                           "out": str(root / "clip-off")}))
    # shard_optimizer_state: Trainer saves the optimizer on rank 0 only; resumed mid-epoch.
    plan.append(("sharded/dear", "dear", {"evaluate": True, "save_at": 3, "sharded": True,
                                          "out": str(root / "sharded")}))
    plan.append(("sharded-resume/dear", "dear", {
        "evaluate": True, "save_at": 3, "sharded": True, "out": str(root / "sharded-r"),
        "resume": str(root / "sharded" / "checkpoint-3")}))
    outcomes = run_distributed(fit_many, 2, [(k, kw) for _, k, kw in plan], timeout=540)
    return {name: [o[i] for o in outcomes] for i, (name, _, _) in enumerate(plan)}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[n].double() - b[n].double()).abs().max()) for n in a)


def _count(params: dict[str, torch.Tensor]) -> int:
    return sum(p.numel() for p in params.values())


def _check_ranks_and_kinds(ddp: list[dict[str, Any]], dear_: list[dict[str, Any]]) -> None:
    for outcome in (ddp, dear_):
        assert _max_diff(outcome[0]["params"], outcome[1]["params"]) == 0.0, \
            "the two ranks ended with different parameters"
    assert ddp[0]["trainer"] == "Trainer" and ddp[0]["model_wrapped"] == \
        "DistributedDataParallel"
    assert dear_[0]["trainer"] == "DeARTrainer"
    assert dear_[0]["model_wrapped"] == "BertForSequenceClassification"   # no DDP
    assert dear_[0]["optimizer"] == "_DistributedOptimizer"   # Trainer's own, converted
    assert dear_[0]["steps"] == ddp[0]["steps"] > 0
    assert len(dear_[0]["grad_norm"]) == dear_[0]["steps"]
    # after train() the model's weights are final however they are read
    assert torch.equal(dear_[0]["submodule"], dear_[0]["params"]["classifier.weight"])


def _grad_norm_rdiff(ddp: dict[str, Any], dear_: dict[str, Any]) -> float:
    return max(abs(a - b) / abs(a) for a, b in zip(ddp["grad_norm"], dear_["grad_norm"]))


@needs_hf
@pytest.mark.parametrize("case", ["plain", "accumulate", "bf16", "given-optimizer",
                                  "given-dear"])
def test_dear_trainer_equals_ddp(runs: dict[str, Any], case: str) -> None:
    ddp, dear_ = runs[f"{case}/ddp"], runs[f"{case}/dear"]
    _check_ranks_and_kinds(ddp, dear_)
    diff = _max_diff(dear_[0]["params"], ddp[0]["params"])
    rdiff = _grad_norm_rdiff(ddp[0], dear_[0])
    print(f"{case}: max |param diff| {diff:.3g}; grad_norm max relative diff {rdiff:.3g} "
          f"(bound {_count(ddp[0]['params']) * EPS:.3g}); steps {ddp[0]['steps']}")
    assert diff == 0.0
    assert rdiff <= _count(ddp[0]["params"]) * EPS
    assert dear_[0]["loss"] == ddp[0]["loss"]
    assert dear_[0]["lr"] == ddp[0]["lr"]
    assert dear_[0]["eval_loss"] == ddp[0]["eval_loss"]
    if case == "plain":
        assert len(ddp[0]["eval_loss"]) >= 3          # evaluation ran during training
        assert dear_[0]["fused"]                      # Trainer's default optimizer
    assert dear_[0]["autocast"] == ddp[0]["autocast"] == (case == "bf16")


@needs_hf
def test_clipping_equals_ddp_within_rounding(runs: dict[str, Any]) -> None:
    ddp, dear_ = runs["clip/ddp"], runs["clip/dear"]
    _check_ranks_and_kinds(ddp, dear_)
    n, steps = _count(ddp[0]["params"]), ddp[0]["steps"]

    def bound(s: int) -> float:
        return s * 1.2 ** s * LR_SGD * CLIP * n * EPS

    diff = _max_diff(dear_[0]["params"], ddp[0]["params"])
    print(f"clip: max |param diff| {diff:.3g} (bound {bound(steps):.3g}); grad_norm max "
          f"relative diff {_grad_norm_rdiff(ddp[0], dear_[0]):.3g}; steps {steps}")
    assert diff <= bound(steps), f"dear and DDP differ by {diff:.3g} > {bound(steps):.3g}"
    assert min(ddp[0]["grad_norm"]) > CLIP                  # every step was clipped ...
    plain = runs["clip-off/dear"]                           # ... and it mattered
    assert _max_diff(plain[0]["params"], dear_[0]["params"]) > 10 * bound(steps)
    # grad_norm at step t is |g(theta_t)| on the same batch in both runs: it differs by the
    # rounding of a sum of n squares added in different orders (<= n eps |g|, whatever the
    # order) plus L |theta_t - theta'_t| (L: the gradient's Lipschitz constant, assumed),
    # with the parameter difference measured at every step. Those differences are
    # rounding-sized (L_ASSUMED's term is ~1e-7 of the norm: 100 x L would still be small),
    # so the tolerance stays under 1% of the norm (n eps is 0.26% here), below what a wrong
    # norm would be off by: a rank's local one, last step's, the clipped one (CLIP itself).
    snaps = list(zip(ddp[0]["snapshots"], dear_[0]["snapshots"]))
    assert len(snaps) == steps == len(ddp[0]["grad_norm"])
    worst = 0.0
    for t, (a, b, (x, y)) in enumerate(zip(ddp[0]["grad_norm"], dear_[0]["grad_norm"], snaps)):
        tol = n * EPS * a + L_ASSUMED * float((x - y).norm())
        worst = max(worst, tol / a)
        assert abs(a - b) <= tol, f"step {t + 1}: grad_norm {b} (dear) vs {a} (DDP), tol {tol}"
    assert worst < 1e-2, f"the grad_norm tolerance reached {worst:.2g} of the norm: too loose"


@needs_hf
def test_resume_from_checkpoint(runs: dict[str, Any]) -> None:
    """Resumed at step 3 of 12 (mid-epoch): the same end as the uninterrupted run, and as DDP
    resumed from its own checkpoint."""
    whole, ddp, dear_ = runs["plain/dear"], runs["resume/ddp"], runs["resume/dear"]
    _check_ranks_and_kinds(ddp, dear_)
    assert dear_[0]["steps"] == whole[0]["steps"]
    assert _max_diff(dear_[0]["params"], ddp[0]["params"]) == 0.0
    assert dear_[0]["eval_loss"] == ddp[0]["eval_loss"]
    diff = _max_diff(dear_[0]["params"], whole[0]["params"])
    print(f"resume: dear resumed vs uninterrupted: max |param diff| {diff:.3g}; vs DDP "
          "resumed: 0")
    assert diff == 0.0


def _saved(out: str, step: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(os.path.join(out, f"checkpoint-{step}", "model.safetensors"))


@needs_hf
def test_checkpoints_hold_the_applied_update(runs: dict[str, Any]) -> None:
    """The weights rank 0 saved (save_steps=3: steps 3, 6, 9, 12) are DDP's at every step,
    and the last are the final ones: the save applied the pending update first."""
    ddp, dear_ = runs["plain/ddp"][0], runs["plain/dear"][0]
    for step in (3, 6, 9, 12):
        saved = _saved(dear_["out"], step)
        assert _max_diff(saved, _saved(ddp["out"], step)) == 0.0, f"checkpoint-{step}"
    last = _saved(dear_["out"], 12)
    assert _max_diff({n: last[n] for n in dear_["params"]}, dear_["params"]) == 0.0


def accelerate_loop(kind: str, scaler: bool = False) -> dict[str, Any]:
    """A plain Accelerate loop (accumulate(), clip_grad_norm_, prepare() given the optimizer
    before the model) with Accelerator (DDP) or DeARAccelerator; then, under dear, a model
    prepared for training without its optimizer. `scaler`: a GradScaler (Accelerate makes one
    for fp16 on GPUs only, so it is set by hand here, without autocast) and an inf in rank 1's
    loss at the third step, which every rank must skip."""
    warnings.filterwarnings("ignore")
    from accelerate import Accelerator

    from dear.huggingface import DeARAccelerator
    torch.manual_seed(3)
    accelerator = (DeARAccelerator if kind == "dear" else Accelerator)(
        cpu=True, gradient_accumulation_steps=2)
    if scaler:
        accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    model = _model(seed=int(os.environ["RANK"]))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(_Data(TRAIN, 1), batch_size=BATCH, shuffle=True)
    optimizer, model, loader = accelerator.prepare(optimizer, model, loader)
    norms, skipped = [], []
    for _ in range(2):
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                if scaler and len(norms) == 2 and os.environ["RANK"] == "1":
                    loss = loss * math.inf
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    # a clip that never bites (DDP's is on the scaled gradient there)
                    max_norm = math.inf if scaler else 1e6
                    norms.append(float(accelerator.clip_grad_norm_(model.parameters(),
                                                                   max_norm)))
                optimizer.step()
                if accelerator.sync_gradients:
                    skipped.append(accelerator.optimizer_step_was_skipped)
                optimizer.zero_grad()
    if kind == "dear":
        accelerator.flush_updates()           # (reading through the model would do it too)
    out: dict[str, Any] = {"params": {n: p.detach().clone() for n, p in
                                      accelerator.unwrap_model(model).named_parameters()},
                           "grad_norm": norms, "wrapped": type(model).__name__,
                           "skipped": skipped}
    if scaler:
        out["scale"] = accelerator.scaler.get_scale()
    if kind == "dear" and not scaler:
        lone, data = accelerator.prepare(_model()), _Data(4, 0)
        try:
            accelerator.backward(lone(input_ids=data.ids, labels=data.labels).loss)
        except RuntimeError as exc:
            out["lone"] = str(exc)
    return out


def accelerate_all() -> list[dict[str, Any]]:
    return [accelerate_loop(kind, scaler) for scaler in (False, True)
            for kind in ("ddp", "dear")]


@pytest.fixture(scope="module")
def accelerate_runs() -> list[dict[str, Any]]:
    return run_distributed(accelerate_all, 2, timeout=240)[0]


@needs_hf
def test_accelerate_loop_equals_ddp(accelerate_runs: list[dict[str, Any]]) -> None:
    """DeARAccelerator in a hand-written Accelerate loop: accumulation by accumulate(), the
    norm by clip_grad_norm_ (a clip that never bites), prepare(optimizer, model, loader):
    bitwise DDP's parameters, the norms within N eps (module docstring)."""
    ddp, dear_ = accelerate_runs[:2]
    assert ddp["wrapped"] == "DistributedDataParallel"
    assert dear_["wrapped"] == "BertForSequenceClassification"
    n = _count(ddp["params"])
    assert len(dear_["grad_norm"]) == len(ddp["grad_norm"]) == 6
    rdiff = _grad_norm_rdiff(ddp, dear_)
    diff = _max_diff(dear_["params"], ddp["params"])
    print(f"accelerate loop: max |param diff| {diff:.3g}; grad_norm max relative diff "
          f"{rdiff:.3g}")
    assert diff == 0.0 and rdiff <= n * EPS
    assert "has no prepared optimizer" in dear_["lone"]


@needs_hf
def test_accelerate_grad_scaler_skips_with_ddp(accelerate_runs: list[dict[str, Any]]) -> None:
    """With a GradScaler, an inf on one rank skips that step on every rank, Accelerate reports
    it (optimizer_step_was_skipped: the LR scheduler is not stepped), the scale backs off the
    same way, and the parameters stay DDP's (unscaling by a power of two is exact)."""
    ddp, dear_ = accelerate_runs[2:]
    assert ddp["skipped"] == dear_["skipped"] == [False, False, True, False, False, False]
    assert dear_["scale"] == ddp["scale"]
    assert _max_diff(dear_["params"], ddp["params"]) == 0.0


def _trainer_with_dear_optimizer() -> None:
    """The issue's first try: a plain Trainer given dear.DistributedOptimizer."""
    warnings.filterwarnings("ignore")
    import transformers
    from transformers import Trainer, TrainingArguments

    import dear
    transformers.logging.set_verbosity_error()
    args = TrainingArguments(output_dir="unused", per_device_train_batch_size=BATCH,
                             max_steps=2, max_grad_norm=0.0, use_cpu=True, report_to="none",
                             save_strategy="no", disable_tqdm=True)
    model = _model()
    Trainer(model=model, args=args, train_dataset=_Data(TRAIN, 1))  # starts the process group
    dear.init()
    opt = dear.DistributedOptimizer(torch.optim.AdamW(model.parameters()), model=model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    Trainer(model=model, args=args, train_dataset=_Data(TRAIN, 1),
            optimizers=(opt, scheduler)).train()


@needs_hf
def test_plain_trainer_error_names_ddp_and_the_fix() -> None:
    outcomes = run_distributed(_trainer_with_dear_optimizer, 2, timeout=240,
                               expect_failure=True)
    for text in outcomes:
        assert isinstance(text, str), "a plain Trainer with dear's optimizer trained"
        assert "wrapped in DistributedDataParallel" in text, text[-2000:]
        assert "Accelerate's prepare()" in text and "dear.huggingface.DeARTrainer" in text


def test_import_dear_without_transformers() -> None:
    """dear imports when transformers cannot be imported; dear.huggingface says what to
    install."""
    code = ("import sys; sys.modules['transformers'] = None\n"
            "import dear\n"
            "try:\n    import dear.huggingface\nexcept ImportError as e:\n    print('ERR', e)\n")
    out = run([sys.executable, "-c", code], timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stdout
    assert "ERR dear.huggingface needs transformers and accelerate: pip install " \
        "'dear[huggingface]'" in out.stdout


@needs_hf
def test_sharded_optimizer_state_equals_ddp_and_resumes(runs: dict[str, Any]) -> None:
    """DeARTrainer with dear_options={"shard_optimizer_state": True}: DDP's bits (2 ranks), its
    checkpoints (written by rank 0 after every rank gathered the state) resume to them."""
    ddp, sharded, resumed = runs["plain/ddp"], runs["sharded/dear"], runs["sharded-resume/dear"]
    assert sharded[0]["fused"]                 # Trainer's default: fused AdamW
    # torch's fused CPU kernels vectorize from each tensor's start, so where a shard cuts a
    # parameter decides which elements take the vector or the scalar path: a few ulps of the
    # update (|AdamW's update| <= lr) per step, never more (docs/sharding.md). The for-loop
    # and foreach kernels give the same bits (tests/test_sharded.py).
    bound = ddp[0]["steps"] * 1e-3 * 2.0**-20
    for outcome in (sharded, resumed):
        assert _max_diff(outcome[0]["params"], ddp[0]["params"]) <= bound
        assert _max_diff(outcome[0]["params"], outcome[1]["params"]) == 0.0
    assert _max_diff(resumed[0]["params"], sharded[0]["params"]) == 0.0
    assert sharded[0]["eval_loss"] == pytest.approx(ddp[0]["eval_loss"], rel=1e-6)
    optim = torch.load(os.path.join(sharded[0]["out"], "checkpoint-3", "optimizer.pt"))
    assert {int(s["step"]) for s in optim["state"].values()} == {3}
    assert sum(s["exp_avg"].numel() for s in optim["state"].values()) == \
        _count(ddp[0]["params"])
