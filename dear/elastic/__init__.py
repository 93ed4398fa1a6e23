"""Elastic training under torchrun's elastic agent: training goes on when a worker is lost or
added (docs/elastic.md).

    state = dear.elastic.State(model=model, optimizer=optimizer, sampler=sampler, epoch=0)

    @dear.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            for x, y in loader:
                ...
                state.sampler.record_batch(i, batch_size)
                state.commit()                 # in memory and on disk; may end the process
            state.sampler.set_epoch(state.epoch + 1)

    train(state)

launched by `torchrun --nnodes MIN:MAX --max-restarts N --rdzv-backend c10d --rdzv-endpoint
HOST:PORT --rdzv-id JOB` with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 and DEAR_ELASTIC_DIR on
storage every node reads. dear.horovod.elastic is Horovod's API over the same machinery.
"""

from .errors import HostsUpdatedInterrupt, HostUpdateResult, register_recoverable
from .handlers import get_handler_registry, set_handler_registry
from .run import run, run_fn, stop_requested
from .sampler import ElasticSampler
from .state import BaseState, ObjectState, State

__all__ = ["BaseState", "ElasticSampler", "HostUpdateResult", "HostsUpdatedInterrupt",
           "ObjectState", "State", "get_handler_registry", "register_recoverable", "run",
           "run_fn", "set_handler_registry", "stop_requested"]
