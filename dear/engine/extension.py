"""The members of dear.DistributedOptimizer that its collaborators use: dear.KFAC, dear.join,
the autotuners and the tracer read and drive the data path through these and nothing else of the
class (docs/ARCHITECTURE.md, "Extension points"). All are named dear_* so that they cannot collide
with the wrapped optimizer's own attributes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from .state import Iteration
from .updates import ShardedUpdates

if TYPE_CHECKING:
    from ..fusion.bucket import Bucket
    from ..fusion.fusion_config import FusionConfig
    from ..fusion.layout import Layout
    from ..fusion.schedule import ScheduleDriver
    from ..sharding.state import ShardedState
    from .buffers import BufferBroadcast
    from .engine import Engine


class ExtensionPoints:
    """Mixed into the optimizer's dear class (dear/engine/wrapper.py); they read its engine."""

    dear_engine: "Engine"

    @property
    def dear_iteration(self) -> Iteration:
        """The state of the iteration in progress (dear/engine/state.py); replaced at its end."""
        return self.dear_engine.iteration

    @property
    def dear_model(self) -> Optional[torch.nn.Module]:
        """The `model=` given at the wrap (None without one)."""
        return self.dear_engine.model

    @property
    def dear_parameters(self) -> list[torch.nn.Parameter]:
        """The trained parameters, in dear's index order (what `dear_layout.where` indexes)."""
        return self.dear_engine.params

    @property
    def dear_parameter_names(self) -> list[str]:
        return self.dear_engine.names

    @property
    def dear_parameter_index(self) -> dict[torch.nn.Parameter, int]:
        return self.dear_engine.index

    @property
    def dear_layout(self) -> Optional[Layout]:
        """Buckets and all-gather groups in force; None until the first step() plans them
        (and again after the trained parameters changed)."""
        engine = self.dear_engine
        return engine.layout if engine.buckets is not None else None

    @property
    def dear_fusion(self) -> FusionConfig:
        """The fusion thresholds in force (the autotuner's latest, or the wrap's)."""
        return self.dear_engine.fusion

    @property
    def dear_order(self) -> list[int]:
        """Rank 0's forward order of the parameters, which the layout was planned from
        (empty before the first layout)."""
        layout = self.dear_engine.layout
        return [] if layout is None else layout.order

    @property
    def dear_row_sparse(self) -> Any:
        """Indices of the parameters the layout sends as rows (none under dear.KFAC)."""
        return self.dear_engine.row_sparse

    @property
    def dear_schedule(self) -> ScheduleDriver:
        return self.dear_engine.schedule

    @property
    def dear_buffer_sync(self) -> Optional[BufferBroadcast]:
        """DDP's broadcast_buffers (dear/engine/buffers.py); dear.join moves its root."""
        return self.dear_engine.buffer_sync

    @property
    def dear_synchronized(self) -> bool:
        """synchronize() has put this iteration's averaged gradients in .grad."""
        return self.dear_engine.iteration.synchronized

    @property
    def dear_compression(self) -> Any:
        """The compressor in force (dear.Compression's); `.quantizes` for int8/int4."""
        return self.dear_engine.options.compression

    @property
    def dear_had_gradients(self) -> bool:
        """A backward ran since the last step()."""
        return self.dear_engine.had_gradients

    @property
    def dear_communicator(self) -> Any:
        """Every collective of this optimizer goes through it; a tracer may put a proxy with
        the same interface in its place (dear/diagnose/comm.py) and restore it after."""
        return self.dear_engine.comm

    @dear_communicator.setter
    def dear_communicator(self, comm: Any) -> None:
        self.dear_engine.use_communicator(comm)

    def dear_finish_reduce(self, verify: bool = True) -> None:
        """Finish this iteration's reduce-scatters now (dear.join, dear.KFAC's clip)."""
        self.dear_engine.reduce(verify)

    def dear_attach_transform(self, transform: Any, ties: list[list[int]]) -> None:
        """dear.KFAC's eigenbasis path (dear/kfac/overlap.py): `transform.before_reduce` and
        `after_gather` edit each bucket around its collectives; `ties` share a bucket. With
        buckets already planned, `ties` take effect at the next synchronized step() (dear.KFAC
        synchronizes until the layout fits)."""
        self.dear_engine.attach_transform(transform, ties)

    @property
    def dear_sharded_state(self) -> Optional["ShardedState"]:
        """With shard_optimizer_state: this rank's shards of the state (dear/sharding/); else
        None."""
        updates = self.dear_engine.updates
        return updates.state if isinstance(updates, ShardedUpdates) else None

    def dear_on_step(self, listener: Callable[[Any], Any]) -> None:
        """`listener(grad_scaler)` is called first thing in every step() (dear.KFAC learns the
        loss scale there: dear/shardops/amp.py)."""
        self.dear_engine.listeners.steps.append(listener)

    def dear_inner_step(self) -> None:
        """The wrapped optimizer's own step() on every parameter, now (e.g. to create empty
        state the way torch does): no collective, no dear bookkeeping."""
        self.dear_engine.inner_step(self)

    def dear_shutdown(self) -> None:
        """dear.shutdown(): apply what is pending, close the schedule and the autotuner."""
        self.dear_engine.shutdown()

    def dear_observe_updates(self, observer: Callable[[Bucket], Any]) -> Callable[[], None]:
        """`observer(bucket)` returns a context manager entered around each bucket's update
        (the tracer times them); returns the function that removes it."""
        observers = self.dear_engine.listeners.updates
        observers.append(observer)
        return lambda: observers.remove(observer)
