"""Hugging Face Transformers' Trainer and Accelerate, with DeAR's schedule instead of DDP.

    from .huggingface import DeARTrainer
    trainer = DeARTrainer(model=model, args=training_args, train_dataset=train, eval_dataset=val)
    trainer.train()                                   # torchrun --nproc_per_node 2 train.py

Passing `dear.DistributedOptimizer` to a plain `Trainer(optimizers=...)` is refused at the first
step, and working around it took four changes to a script (docs/huggingface.md). The reasons:

* Accelerate's `prepare()` wraps the model in DistributedDataParallel, which all-reduces into
  `.grad` at the end of backward, after dear took the gradients: both average, and dear refuses
  the overwritten `.grad`.
* Trainer clips with `accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)`, and with
  `max_grad_norm=0` still calls it with `inf` to log `grad_norm`: torch's clip on `.grad`, which
  under dear is this rank's local gradient (the average exists only as reduced shards), and which
  multiplies `.grad` in place even by 1.0.
* Trainer builds its optimizer and scheduler inside `train()` (`create_optimizer`, then
  `accelerator.prepare`, then `create_scheduler`), so a script cannot wrap them beforehand.
* Trainer accumulates gradients itself (Accelerate's `no_sync` on the DDP model); dear needs the
  count up front (`backward_passes_per_step`).

`DeARAccelerator` is Accelerate's `Accelerator` with those points changed through its public
methods: `prepare_model` does all but the DDP wrap (device placement, autocast, torch.compile:
Accelerate's `evaluation_mode`), `prepare_optimizer` wraps the optimizer in
`dear.DistributedOptimizer` around the prepared model it trains, `clip_grad_norm_` on that
optimizer's parameters goes to `optimizer.clip_grad_norm_` (the global norm of the averaged
gradient, from the shards; `inf` only measures it), and GradScaler's unscale and step go to
dear's shards (dear/shardops/amp.py). Accelerate scripts use it directly (`DeARAccelerator(...)`).
`DeARTrainer` is `transformers.Trainer` whose accelerator is converted to a `DeARAccelerator`
with `backward_passes_per_step=args.gradient_accumulation_steps`; the optimizer and scheduler
are still Trainer's own. Tested with transformers 5.24.0 and accelerate 1.15.0
(tests/test_huggingface.py). Optional: `pip install 'dear[huggingface]'`.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, Optional, Union

import torch

from .comm import runtime
from .engine.optimizer import DistributedOptimizer
from .interfaces import DearOptimizer

try:
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.utils import DistributedType
    from transformers import Trainer
except ImportError as exc:
    raise ImportError("dear.huggingface needs transformers and accelerate: "
                      "pip install 'dear[huggingface]'") from exc

# What DeARAccelerator does not replace: these shard or place the model themselves.
_REFUSED = {DistributedType.DEEPSPEED: "DeepSpeed", DistributedType.FSDP: "FSDP",
            DistributedType.MEGATRON_LM: "Megatron-LM", DistributedType.XLA: "XLA"}
# Set by DeARAccelerator itself: dear's argument, not an option to pass.
_OWN_OPTIONS = ("model", "named_parameters", "backward_passes_per_step")


def _is_dear(optimizer: Any) -> bool:
    return isinstance(optimizer, DearOptimizer)


def _inner(optimizer: Any) -> Any:
    while isinstance(optimizer, AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    return optimizer


class _DeARAcceleratedOptimizer(AcceleratedOptimizer):
    """AcceleratedOptimizer around a dear optimizer; only step() with a GradScaler differs.
    Accelerate's step() puts a `(*args, **kwargs)` wrapper on the optimizer's step() to learn
    whether GradScaler called it; that hides `step(grad_scaler=)` from GradScaler, which then
    checks the LOCAL .grad itself and dear refuses the step. And under dear GradScaler always
    calls step(): the skip is decided inside it, on the reduced gradient. So GradScaler gets the
    optimizer itself, and a skipped step is read from the scale, which update() lowers exactly
    when an inf/NaN was found (GradScaler requires backoff_factor < 1)."""

    def step(self, closure: Optional[Callable[[], float]] = None) -> None:
        if self.scaler is None or not self.gradient_state.sync_gradients:
            super().step(closure)
            return
        before = self.scaler.get_scale()
        self.scaler.step(self.optimizer, closure)
        self.scaler.update()
        self._is_overflow = self.scaler.get_scale() < before


class DeARAccelerator(Accelerator):
    """Accelerate's Accelerator, with dear.DistributedOptimizer averaging the gradients instead
    of DistributedDataParallel. `backward_passes_per_step`: dear's (None: the Accelerator's
    gradient_accumulation_steps); `dear_options`: keyword arguments for
    dear.DistributedOptimizer (e.g. {"fusion_threshold": 4 << 20}). Everything else is
    Accelerator's. dear.init() is called here if the script has not called it (it reuses the
    process group Accelerate started)."""

    def __init__(self, *args: Any, backward_passes_per_step: Optional[int] = None,
                 dear_options: Optional[Mapping[str, Any]] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._dear_setup(backward_passes_per_step, dear_options)

    @classmethod
    def convert(cls, accelerator: Accelerator, *, backward_passes_per_step: Optional[int] = None,
                dear_options: Optional[Mapping[str, Any]] = None) -> "DeARAccelerator":
        """Turn an Accelerator that already exists (Trainer's) into a DeARAccelerator in place,
        as dear converts optimizers: whatever holds it (Trainer's bound gather_function) sees
        dear's. Call it before anything was prepared."""
        if type(accelerator) is not Accelerator and not isinstance(accelerator, cls):
            raise TypeError(f"DeARAccelerator.convert takes an accelerate.Accelerator, got "
                            f"{type(accelerator).__name__} (a subclass dear cannot merge with)")
        accelerator.__class__ = cls
        converted: DeARAccelerator = accelerator  # type: ignore[assignment]
        converted._dear_setup(backward_passes_per_step, dear_options)
        return converted

    def _dear_setup(self, passes: Optional[int], options: Optional[Mapping[str, Any]]) -> None:
        refused = _REFUSED.get(self.distributed_type)
        config = self.parallelism_config
        sharded = ("tp_enabled", "cp_enabled", "sp_enabled", "dp_shard_enabled")
        if refused is None and (self.is_fsdp2 or (config is not None and any(
                getattr(config, name, False) for name in sharded))):
            refused = "a ParallelismConfig that shards the model or its inputs"
        if refused is not None:
            raise ValueError(f"dear replaces DistributedDataParallel (data parallelism with a "
                             f"whole model per rank); it cannot run under {refused}")
        if passes is not None and passes < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {passes}")
        own = sorted(set(options or {}) & set(_OWN_OPTIONS))
        if own:
            raise ValueError(f"dear_options {own}: DeARAccelerator sets these itself (the "
                             "prepared model; backward_passes_per_step= is an argument)")
        self._dear_passes = passes
        self._dear_options = dict(options or {})
        # What this accelerator prepared for training (Accelerate's own lists are private):
        self._dear_models: list[torch.nn.Module] = []
        self._dear_optimizers: list[Any] = []      # dear's optimizers, unwrapped
        self._dear_prepared: list[Any] = []        # every optimizer prepared, as returned
        self._dear_check = False                   # prepared since the last coverage check
        if not runtime.is_initialized():
            runtime.init()

    # ------------------------------------------------------------------------- prepare
    def prepare(self, *args: Any, device_placement: Optional[list[bool]] = None) -> Any:
        """Accelerator.prepare, with the models prepared first (then in the given order), so
        that dear wraps each optimizer around its model as placed and autocast."""
        order = sorted(range(len(args)), key=lambda i: not isinstance(args[i], torch.nn.Module))
        if order == list(range(len(args))):
            return super().prepare(*args, device_placement=device_placement)
        placement = None if device_placement is None else [device_placement[i] for i in order]
        done = super().prepare(*(args[i] for i in order), device_placement=placement)
        result: list[Any] = [None] * len(args)
        for j, i in enumerate(order):
            result[i] = done[j]
        return tuple(result)

    def prepare_model(self, model: torch.nn.Module, device_placement: Optional[bool] = None,
                      evaluation_mode: bool = False) -> Any:
        """Accelerate's preparation without the DistributedDataParallel wrap (its
        `evaluation_mode`: device placement, autocast, torch.compile); dear's optimizer, made
        by prepare_optimizer, averages the gradients and broadcasts rank 0's weights."""
        prepared = super().prepare_model(model, device_placement=device_placement,
                                         evaluation_mode=True)
        if not evaluation_mode and all(m is not prepared for m in self._dear_models):
            self._dear_models.append(prepared)
            self._dear_check = True
        return prepared

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer,
                          device_placement: Optional[bool] = None) -> Any:
        """`optimizer` converted in place into dear.DistributedOptimizer (model= the prepared
        model holding its parameters; one already dear's is kept), inside Accelerate's
        optimizer wrapper."""
        if not isinstance(optimizer, AcceleratedOptimizer):     # else prepared before
            passes = self._dear_passes or self.gradient_accumulation_steps
            if _is_dear(optimizer):
                optimizer.set_backward_passes_per_step(passes)  # type: ignore[attr-defined]
            else:
                optimizer = DistributedOptimizer(optimizer, model=self._model_of(optimizer),
                                                 backward_passes_per_step=passes,
                                                 **self._dear_options)
        prepared = super().prepare_optimizer(optimizer, device_placement)
        if all(opt is not prepared for opt in self._dear_prepared):
            self._dear_prepared.append(prepared)
        inner = _inner(prepared)
        if _is_dear(inner):
            if type(prepared) is AcceleratedOptimizer:   # in place: Accelerate holds it
                prepared.__class__ = _DeARAcceleratedOptimizer
            if all(opt is not inner for opt in self._dear_optimizers):
                self._dear_optimizers.append(inner)
            self._dear_check = True
        return prepared

    def _model_of(self, optimizer: torch.optim.Optimizer) -> torch.nn.Module:
        first = next((p for g in optimizer.param_groups for p in g["params"]), None)
        for prepared in self._dear_models:
            model = self.unwrap_model(prepared, keep_torch_compile=False)
            if first is not None and any(p is first for p in model.parameters()):
                return model
        raise ValueError("DeARAccelerator.prepare_optimizer: no model prepared for training "
                         "holds this optimizer's parameters; prepare the model it trains with "
                         "it (accelerator.prepare(model, optimizer)): dear hooks its forward and "
                         "broadcasts rank 0's weights, as DDP's constructor does")

    def free_memory(self, *objects: Any) -> Any:
        """Accelerate's, which forgets what was prepared; so does dear's registry."""
        self._dear_models, self._dear_optimizers, self._dear_prepared = [], [], []
        return super().free_memory(*objects)

    # -------------------------------------------------------------- backward and clipping
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        if self._dear_check:
            self._check_every_model_is_averaged()
        super().backward(loss, **kwargs)

    def _check_every_model_is_averaged(self) -> None:
        """Without DDP, a model prepared for training whose optimizer was never prepared would
        train on each rank's own gradients, silently: refuse at its first backward."""
        covered = {id(p) for opt in self._dear_optimizers for p in opt.dear_parameters}
        for model in self._dear_models:
            trainable = [p for p in model.parameters() if p.requires_grad]
            if trainable and not any(id(p) in covered for p in trainable):
                raise RuntimeError(
                    f"DeARAccelerator: the {type(model).__name__} prepared for training has no "
                    "prepared optimizer, so nothing averages its gradients across ranks (dear "
                    "averages them in the optimizer, not in a model wrapper): prepare its "
                    "optimizer too, accelerator.prepare(model, optimizer)")
        self._dear_check = False

    def _dear_optimizer_of(self, params: list[torch.Tensor]) -> Optional[Any]:
        """The dear optimizer training `params` (None: none does); params it does not train
        that have a gradient would escape its clipping: refused."""
        ids = {id(p) for p in params}
        hits = [opt for opt in self._dear_optimizers
                if any(id(p) in ids for p in opt.dear_parameters)]
        if not hits:
            return None
        if len(hits) > 1:
            raise ValueError("clip_grad_norm_ over the parameters of several dear optimizers: "
                             "call it once per optimizer, with its own parameters")
        trained = {id(p) for p in hits[0].dear_parameters}
        if any(p.grad is not None and id(p) not in trained for p in params):
            raise ValueError("clip_grad_norm_ over parameters of which only some are trained by "
                             "dear: their global norm cannot be formed from dear's shards")
        return hits[0]

    def clip_grad_norm_(self, parameters: Union[torch.Tensor, Iterable[torch.Tensor]],
                        max_norm: float, norm_type: float = 2) -> Any:
        """Parameters trained by dear: `optimizer.clip_grad_norm_`, which clips the AVERAGED
        gradient (what DDP's clip sees) on its reduced shards and returns its global norm; with
        `max_norm=inf` (Trainer's logged grad_norm) it only measures. Others: Accelerate's."""
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        opt = self._dear_optimizer_of(params)
        if opt is None:
            return super().clip_grad_norm_(params, max_norm, norm_type)
        return opt.clip_grad_norm_(float(max_norm), norm_type, grad_scaler=self.scaler)

    def clip_grad_value_(self, parameters: Union[torch.Tensor, Iterable[torch.Tensor]],
                         clip_value: float) -> None:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        if self._dear_optimizer_of(params) is not None:
            raise ValueError("dear clips by norm only (clip_grad_norm_): the averaged gradient "
                             "exists only as reduced shards, which dear clips by the global norm")
        super().clip_grad_value_(params, clip_value)

    def unscale_gradients(self, optimizer: Any = None) -> None:
        """Accelerate's, except for dear's optimizers: their .grad is local, so GradScaler's
        unscale_ would not reach what is averaged (dear unscales the reduced shards in
        clip_grad_norm_ or step, dear/shardops/amp.py)."""
        chosen = (self._dear_prepared if optimizer is None else
                  list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer])
        rest = [opt for opt in chosen if not _is_dear(_inner(opt))]
        if rest:
            super().unscale_gradients(rest)

    def flush_updates(self) -> None:
        """Apply every pending update of dear's optimizers now (no collective: safe on one
        rank). Reads through the model do this themselves (docs/contract.md)."""
        for opt in self._dear_optimizers:
            opt.flush_updates()


class DeARTrainer(Trainer):
    """transformers.Trainer, data-parallel with DeAR instead of DDP: a drop-in for `Trainer`
    (same arguments) whose accelerator is a DeARAccelerator. Trainer's own optimizer and
    scheduler (or those passed as `optimizers=`) are kept, the optimizer converted in place;
    `gradient_accumulation_steps` becomes dear's backward_passes_per_step, `max_grad_norm` and
    the logged `grad_norm` come from the averaged gradient, `ddp_broadcast_buffers` is passed on
    as dear's broadcast_buffers (other `ddp_*` arguments configure DDP and do nothing here).
    `dear_options`: keyword arguments for dear.DistributedOptimizer."""

    def __init__(self, *args: Any, dear_options: Optional[Mapping[str, Any]] = None,
                 **kwargs: Any) -> None:
        self.dear_options = dict(dear_options or {})  # read by create_accelerator_and_postprocess
        super().__init__(*args, **kwargs)

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        options = dict(self.dear_options)
        if self.args.ddp_broadcast_buffers is not None:
            options.setdefault("broadcast_buffers", bool(self.args.ddp_broadcast_buffers))
        DeARAccelerator.convert(self.accelerator, dear_options=options,
                                backward_passes_per_step=self.args.gradient_accumulation_steps)

    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        """Trainer.save_model (also what its checkpoints call), with the last step's update
        applied first: the saved weights are those after that step, as under DDP. (Reading
        the model would apply it too, with a warning meant for reads inside a training loop.)"""
        accelerator: DeARAccelerator = self.accelerator
        accelerator.flush_updates()
        super().save_model(output_dir, _internal_call)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Trainer's, except that a sharded dear optimizer (shard_optimizer_state) gathers its
        state on every rank (Trainer calls state_dict() on the saving rank only), then the
        saving rank writes it."""
        inner: Any = _inner(self.optimizer) if self.optimizer is not None else None
        if not getattr(inner, "shard_optimizer_state", False):
            super()._save_optimizer_and_scheduler(output_dir)
            return
        gathered = inner.state_dict()
        inner.state_dict = lambda: gathered       # this one call: already gathered
        try:
            super()._save_optimizer_and_scheduler(output_dir)
        finally:
            del inner.state_dict

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """Trainer.train, then the last step's update applied: afterwards the model holds its
        final weights however it is read (a submodule's tensors included)."""
        output = super().train(*args, **kwargs)
        accelerator: DeARAccelerator = self.accelerator
        accelerator.flush_updates()
        return output


__all__ = ["DeARAccelerator", "DeARTrainer"]
