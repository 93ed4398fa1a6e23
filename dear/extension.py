"""The members of dear.DistributedOptimizer that its collaborators use: dear.KFAC, dear.join,
the autotuners and the tracer read and drive the data path through these and nothing else of the
class (docs/ARCHITECTURE.md, "Extension points"). All are named dear_* so that they cannot collide
with the wrapped optimizer's own attributes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from .iteration import Iteration

if TYPE_CHECKING:
    from .buffers import BufferBroadcast
    from .fusion.bucket import Bucket
    from .fusion.layout import Layout
    from .fusion.schedule import ScheduleDriver


class ExtensionPoints:
    """Mixed into `_DistributedOptimizer` (dear/deferred.py), whose state they expose."""

    if TYPE_CHECKING:
        _iteration: Iteration
        _model: Optional[torch.nn.Module]
        _params: list[torch.nn.Parameter]
        _names: list[str]
        _index: dict[torch.nn.Parameter, int]
        _layout: Layout
        _buckets: Optional[list[Bucket]]
        _order: list[int]
        _row_sparse: Any
        _transform: Any
        _schedule: ScheduleDriver
        _buffer_sync: Optional[BufferBroadcast]
        _comm: Any
        _update_observers: list[Callable[[Bucket], Any]]

        @property
        def _had_gradients(self) -> bool: ...
        def _finish_reduce(self, verify: bool = True) -> None: ...
        def _attach_transform(self, transform: Any, ties: list[list[int]]) -> None: ...

    @property
    def dear_iteration(self) -> Iteration:
        """The state of the iteration in progress (dear/iteration.py); replaced at its end."""
        return self._iteration

    @property
    def dear_model(self) -> Optional[torch.nn.Module]:
        """The `model=` given at the wrap (None without one)."""
        return self._model

    @property
    def dear_parameters(self) -> list[torch.nn.Parameter]:
        """The trained parameters, in dear's index order (what `dear_layout.where` indexes)."""
        return self._params

    @property
    def dear_parameter_names(self) -> list[str]:
        return self._names

    @property
    def dear_parameter_index(self) -> dict[torch.nn.Parameter, int]:
        return self._index

    @property
    def dear_layout(self) -> Optional[Layout]:
        """Buckets and all-gather groups in force; None until the first step() plans them
        (and again after the trained parameters changed)."""
        return self._layout if self._buckets is not None else None

    @property
    def dear_order(self) -> list[int]:
        """Rank 0's forward order of the parameters, which the layout was planned from."""
        return self._order

    @property
    def dear_row_sparse(self) -> Any:
        """Indices of the parameters the layout sends as rows (none under dear.KFAC)."""
        return self._row_sparse if self._transform is None else ()

    @property
    def dear_schedule(self) -> ScheduleDriver:
        return self._schedule

    @property
    def dear_buffer_sync(self) -> Optional[BufferBroadcast]:
        """DDP's broadcast_buffers (dear/buffers.py); dear.join moves its root."""
        return self._buffer_sync

    @property
    def dear_synchronized(self) -> bool:
        """synchronize() has put this iteration's averaged gradients in .grad."""
        return self._iteration.synchronized

    @property
    def dear_had_gradients(self) -> bool:
        """A backward ran since the last step()."""
        return self._had_gradients

    @property
    def dear_communicator(self) -> Any:
        """Every collective of this optimizer goes through it; a tracer may put a proxy with
        the same interface in its place (dear/diagnose/comm.py) and restore it after."""
        return self._comm

    @dear_communicator.setter
    def dear_communicator(self, comm: Any) -> None:
        self._comm = comm

    def dear_finish_reduce(self, verify: bool = True) -> None:
        """Finish this iteration's reduce-scatters now (dear.join, dear.KFAC's clip)."""
        self._finish_reduce(verify)

    def dear_attach_transform(self, transform: Any, ties: list[list[int]]) -> None:
        """dear.KFAC's eigenbasis path (dear/kfac/overlap.py): `transform.before_reduce` and
        `after_gather` edit each bucket around its collectives; `ties` share a bucket."""
        self._attach_transform(transform, ties)

    def dear_observe_updates(self, observer: Callable[[Bucket], Any]) -> Callable[[], None]:
        """`observer(bucket)` returns a context manager entered around each bucket's update
        (the tracer times them); returns the function that removes it."""
        self._update_observers.append(observer)
        return lambda: self._update_observers.remove(observer)
