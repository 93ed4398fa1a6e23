"""PyTorch Lightning strategy: DeAR's schedule under Lightning's own training loop.

    import dear.lightning                      # registers strategy="dear"
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="dear", gradient_clip_val=1.0)
    trainer = L.Trainer(..., strategy=dear.lightning.DeARStrategy(fusion_threshold=4 << 20,
                                                                     autotune=True))

`DeARStrategy` is Lightning's DDPStrategy (its launchers, cluster environments, process group,
barrier, broadcast and metric reduction are kept) with DDP's wrapper replaced by
`dear.DistributedOptimizer` around every optimizer `configure_optimizers` returns:

* model: not wrapped in DistributedDataParallel; rank 0's parameters and buffers are broadcast
  once, as DDP's constructor does, and a thin wrapper module makes Lightning's training and
  validation steps run through the LightningModule's forward call, where dear's forward pre-hooks
  apply the pending update (the all-gather of step t overlaps forward t+1).
* optimizer step: Lightning hands `optimizer.step` a closure (training_step + backward), which a
  deferred update cannot take. The strategy runs the closure itself, then Lightning's
  `on_before_optimizer_step` hooks and gradient clipping, then `optimizer.step()` (or
  `scaler.step(optimizer)` with a GradScaler precision, without `scaler.unscale_`: dear unscales
  the reduced shards itself, see dear/shardops/amp.py).
* `gradient_clip_val` (clipping by norm) goes to `optimizer.clip_grad_norm_`, which clips the
  AVERAGED gradient from its reduced shards, as DDP users' clip does; editing `.grad` would not
  reach dear's buckets. Clipping by value (`gradient_clip_algorithm="value"`) is refused.
* `accumulate_grad_batches=k` becomes `backward_passes_per_step=k`: gradients accumulate locally
  in `.grad` and are reduced once on the k-th backward (DDP's no_sync). A last group of an epoch
  with fewer than k batches is stepped with the passes it has.
* LR schedulers built in `configure_optimizers` are moved onto the wrapped optimizer (the update
  runs in the next forward with the hyperparameters of the step that produced it).
* checkpoints: the model's and optimizer's `state_dict()` apply pending updates first
  (`flush_updates`), so `ModelCheckpoint` saves and `ckpt_path=` restores what DDP would;
  validation, test and predict loops start with every update applied.

In `on_before_optimizer_step` the `.grad` you see is this rank's own (the average exists only as
shards until the all-gather). Lightning is optional: `pip install .[lightning]`; `import dear`
works without it.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any, Callable, Optional, Union

import torch

from .comm import runtime
from .comm.base import ReduceOp
from .comm.compression import Compression
from .engine.optimizer import DistributedOptimizer

try:
    import lightning.pytorch as pl
    from lightning.pytorch.core.optimizer import LightningOptimizer
    from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
    from lightning.pytorch.utilities.exceptions import MisconfigurationException
except ImportError:                                   # the standalone package
    try:
        import pytorch_lightning as pl  # type: ignore[no-redef]
        from pytorch_lightning.core.optimizer import LightningOptimizer  # type: ignore
        from pytorch_lightning.strategies import DDPStrategy, StrategyRegistry  # type: ignore
        from pytorch_lightning.utilities.exceptions import MisconfigurationException  # type: ignore
    except ImportError as exc:
        raise ImportError("dear.lightning needs PyTorch Lightning: pip install 'dear[lightning]' "
                          "(or pip install lightning)") from exc

class _Forward(torch.nn.Module):
    """Makes Lightning call the LightningModule through its forward (see `_ForwardRedirection`),
    so dear's forward pre-hook on it runs before training_step / validation_step."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


class DeARStrategy(DDPStrategy):
    """Data-parallel training with DeAR (reduce-scatter in backward, all-gather in the next
    forward) under Lightning's loop. dear options: `fusion_threshold` (bytes), `autotune`
    (True / "online" / "offline"), `fusion_config`, `compression`, `op`,
    `gradient_predivide_factor`, `overlap_allgather`, `shard_optimizer_state` (each rank keeps
    1/N of the optimizer state; checkpoints gather it), `backend` (dear.init's: "auto" reuses
    Lightning's process group; "mpi" moves dear's collectives to MPI), and any dear.init option
    as `dear_options` (e.g. {"timeout": 60}). Everything else is DDPStrategy's (start_method,
    process_group_backend, timeout, cluster_environment, ...)."""

    strategy_name = "dear"

    def __init__(self, *, fusion_threshold: Optional[int] = None,
                 autotune: Optional[Union[bool, str]] = None, fusion_config: Any = None,
                 compression: Any = Compression.none, op: Any = ReduceOp.Average,
                 gradient_predivide_factor: float = 1.0, overlap_allgather: bool = True,
                 gradient_as_bucket_view: Optional[bool] = None,
                 shard_optimizer_state: Optional[bool] = None, backend: str = "auto",
                 dear_options: Optional[dict[str, Any]] = None,
                 accelerator: Any = None, parallel_devices: Optional[list[torch.device]] = None,
                 cluster_environment: Any = None, checkpoint_io: Any = None,
                 precision_plugin: Any = None, process_group_backend: Optional[str] = None,
                 timeout: Optional[timedelta] = None,
                 start_method: str = "popen") -> None:
        if timeout is None:                    # DEAR_TIMEOUT, not torch's 30 minutes: a rank
            # stuck in a collective on this group would otherwise outlive a fault by that long
            from .config import Config
            given = (dear_options or {}).get("timeout")
            timeout = timedelta(seconds=Config.from_env(timeout=given).timeout)
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin,
                         process_group_backend=process_group_backend, timeout=timeout,
                         start_method=start_method)  # type: ignore[arg-type]
        self._dear_wrap = {"fusion_threshold": fusion_threshold, "autotune": autotune,
                           "fusion_config": fusion_config, "compression": compression, "op": op,
                           "gradient_predivide_factor": gradient_predivide_factor,
                           "overlap_allgather": overlap_allgather,
                           "gradient_as_bucket_view": gradient_as_bucket_view,
                           "shard_optimizer_state": shard_optimizer_state}
        self._dear_backend = backend
        self._dear_options = dict(dear_options or {})
        self._owns_dear = False
        self._dear_optimizers: list[Any] = []  # a list: the strategy is pickled by "spawn"
        self._clip_patched: Optional[Any] = None

    # ------------------------------------------------------------------ process group & dear
    def setup_environment(self) -> None:
        super().setup_environment()           # torch.distributed, as for strategy="ddp"
        if not runtime.is_initialized():
            runtime.init(self._dear_backend, **self._dear_options)
            self._owns_dear = True

    # ------------------------------------------------------------------------- the model
    def configure_ddp(self) -> None:
        """No DistributedDataParallel: broadcast rank 0's state once, wrap for forward calls."""
        module = self.model
        assert module is not None
        runtime.broadcast_parameters(module.state_dict(), root_rank=0)
        self.model = _Forward(module)

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:  # type: ignore[override]
        return _Forward(model)

    # ---------------------------------------------------------------------- optimizers
    def setup_optimizers(self, trainer: "pl.Trainer") -> None:
        super().setup_optimizers(trainer)     # configure_optimizers: optimizers and schedulers
        module = self.lightning_module
        assert module is not None
        names = {p: n for n, p in module.named_parameters()}
        wrapped = []
        for optimizer in self.optimizers:
            if hasattr(optimizer, "flush_updates"):   # already dear's (a second fit)
                wrapped.append(optimizer)
                continue
            params = [p for g in optimizer.param_groups for p in g["params"]]
            missing = [p for p in params if p not in names]
            if missing:
                raise MisconfigurationException(
                    f"strategy='dear': an optimizer holds {len(missing)} tensor(s) that are not "
                    "parameters of the LightningModule; dear averages module parameters only")
            dist_opt = DistributedOptimizer(
                optimizer, named_parameters=[(names[p], p) for p in params], model=module,
                backward_passes_per_step=max(1, int(trainer.accumulate_grad_batches)),
                **{"init_sync": False, **self._dear_wrap})   # configure_ddp broadcasts once
            wrapped.append(dist_opt)
            self._dear_optimizers.append(dist_opt)
        self.optimizers = wrapped

    def setup(self, trainer: "pl.Trainer") -> None:
        super().setup(trainer)
        self._route_clipping()

    def _route_clipping(self) -> None:
        """Gradient clipping by norm, however Lightning reaches it (trainer.gradient_clip_val,
        configure_gradient_clipping, self.clip_gradients in manual optimization), goes through
        the precision plugin's clip_gradients: send it to dear's shard clipping."""
        precision = self.precision_plugin
        if self._clip_patched is precision:
            return
        original = precision.clip_gradients

        def clip_gradients(optimizer: Any, clip_val: Union[int, float, None] = 0.0,
                           gradient_clip_algorithm: Any = None) -> None:
            opt: Any = (optimizer._optimizer if isinstance(optimizer, LightningOptimizer)  # noqa: SLF001
                        else optimizer)
            if not hasattr(opt, "flush_updates"):   # not dear's: Lightning's own clipping
                return original(optimizer, clip_val,  # type: ignore[arg-type]
                                gradient_clip_algorithm)
            if clip_val is None or clip_val <= 0:
                return None
            algorithm = str(getattr(gradient_clip_algorithm, "value", gradient_clip_algorithm)
                            or "norm")
            if algorithm != "norm":
                raise MisconfigurationException(
                    "strategy='dear' clips by norm only (gradient_clip_algorithm='norm'): the "
                    "averaged gradient exists only as reduced shards, which dear clips by the "
                    "global norm")
            opt.clip_grad_norm_(float(clip_val), grad_scaler=getattr(precision, "scaler", None))
            return None

        precision.clip_gradients = clip_gradients   # type: ignore[method-assign]
        self._clip_patched = precision

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any],
                       model: Any = None, **kwargs: Any) -> Any:
        """Lightning's Precision.optimizer_step without handing the closure to step(): run it,
        the before-step hooks and clipping, then step (through the GradScaler if there is one)."""
        model = model or self.lightning_module
        # Lightning's wrapper and precision plugin: no public API for these
        opt = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer  # noqa: SLF001
        if not hasattr(opt, "flush_updates"):
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        precision = self.precision_plugin
        closure_result = closure()
        # on_before_optimizer_step hooks, then clipping
        precision._after_closure(model, opt)  # noqa: SLF001
        skipped_backward = closure_result is None
        if isinstance(model, pl.LightningModule) and model.automatic_optimization \
                and skipped_backward:
            return closure_result              # training_step returned None: no step
        scaler = getattr(precision, "scaler", None)
        if scaler is not None:
            output = scaler.step(opt, **kwargs)
            scaler.update()
            return output
        return opt.step(**kwargs)

    # ------------------------------------------------------------------- loops and teardown
    def flush(self) -> None:
        """Apply every pending update (no collective: safe on one rank)."""
        for opt in list(self._dear_optimizers):
            opt.flush_updates()

    def on_validation_start(self) -> None:
        self.flush()
        super().on_validation_start()

    def on_test_start(self) -> None:
        self.flush()
        super().on_test_start()

    def on_predict_start(self) -> None:
        self.flush()
        super().on_predict_start()

    def on_train_end(self) -> None:
        self.flush()
        super().on_train_end()

    def lightning_module_state_dict(self) -> dict[str, Any]:
        self.flush()
        return super().lightning_module_state_dict()

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        self.flush()
        return super().optimizer_state(optimizer)

    def teardown(self) -> None:
        self.flush()
        if isinstance(self.model, _Forward):
            self.model = self.model.module
        super().teardown()
        self._dear_optimizers = []
        if self._owns_dear and runtime.is_initialized():
            runtime.shutdown()
            self._owns_dear = False

    @contextlib.contextmanager
    def block_backward_sync(self) -> Any:
        """Accumulation is dear's backward_passes_per_step; nothing to block."""
        yield

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register("dear", cls, description="DeAR: reduce-scatter in backward, "
                                   "all-gather in the next forward (dear.lightning)",
                                   override=True)
        strategy_registry.register("dear_spawn", cls, description="DeAR with start_method "
                                   "'spawn'", start_method="spawn", override=True)


DeARStrategy.register_strategies(StrategyRegistry)

__all__ = ["DeARStrategy"]
