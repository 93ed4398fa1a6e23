"""dear.DistributedOptimizer inside real Horovod's `hvd.elastic.run`, with
`hvd.elastic.TorchState(model, optimizer)`.

Horovod keeps the processes: on a failed collective it restores the last commit on every
survivor and re-forms its world in place (`hvd.shutdown(); hvd.init()`); on a host update it
re-forms without restoring; then every rank, new ones included, calls `state.sync()` at the same
point. Horovod's own optimizer handler would commit `state_dict()` and broadcast rank 0's state;
dear's optimizer also holds what is cut for the old world (buckets padded to N, shards, a plan,
named collectives), so TorchState's registry gets this handler for dear's optimizers:

1. `save` (commit): a commit sees the applied update, never a pending one. Whole state: the
   optimizer's state_dict(), as Horovod's handler keeps it. With shard_optimizer_state: this
   rank's pieces and a copy of one other rank's, on another host where there is one (a
   collective: dear/sharding/commit.py), never the whole state;
2. `restore` (after a failed collective, before Horovod re-forms the world): the engine drops
   what waited on the dead world (pending updates, the iteration, the layout), the same on every
   rank, and goes back to the commit with no collective;
3. `sync` (every rank, after the world changed, at the same point): the engine starts over in
   the new world (`rejoin`: a new layout at the next step, the wrap's cross-rank checks again).
   Sharded state is cut for the new size from the pieces the survivors hold, without being
   whole anywhere, and rank 0's hyperparameters are broadcast; whole state is broadcast from
   rank 0 as Horovod's handler does.

Collectives go through Horovod's own operations under elastic (dear/comm/horovod.py), so they
follow the new world and fail with HorovodInternalError, which `hvd.elastic.run` catches.
"""

from __future__ import annotations

from typing import Any

from ..interfaces import DearOptimizer


class OptimizerStateHandler:
    """TorchState's handler of a dear optimizer (Horovod calls `save`, `restore`, `sync`,
    `set_value` and reads `value`)."""

    def __init__(self, optimizer: DearOptimizer) -> None:
        self.value = optimizer
        self._saved: Any = None
        self.save()

    def save(self) -> None:
        self._saved = self.value.dear_elastic_commit()

    def restore(self) -> None:
        self.value.dear_elastic_restore(self._saved)

    def sync(self) -> None:
        from horovod.torch.functions import broadcast_optimizer_state
        if not self.value.dear_elastic_rejoin(self._saved):
            broadcast_optimizer_state(self.value, root_rank=0)

    def set_value(self, value: DearOptimizer) -> None:
        self.value = value
        self.save()


def install() -> None:
    """Put the handler first in Horovod's TorchState registry (once per process): TorchState
    picks the first entry whose type the value is an instance of."""
    from horovod.torch.elastic import state
    registry = state.get_handler_registry()
    if any(kind is DearOptimizer for kind, _ in registry):
        return
    state.set_handler_registry([(DearOptimizer, OptimizerStateHandler), *registry])


__all__ = ["OptimizerStateHandler", "install"]
