"""Process-wide state: which communicator is active, and the optimizers to flush on shutdown."""

from __future__ import annotations

import datetime
import gc
import logging
import weakref
from typing import Any, Callable, Iterable, Mapping, Optional, Union

import torch
import torch.distributed as dist

from ..config import Config
from ..interfaces import DearOptimizer
from . import launch
from .base import Communicator, ReduceOp, resolve_op
from .compression import ERROR_FEEDBACK_KEY
from .flight import FlightChannel, RecordedCommunicator, mark_phase
from .hang import HangReporter, out_of_band_store
from .local import LocalCommunicator

log = logging.getLogger("dear")

# torch.distributed.nn.functional binds `group=group.WORLD` as default arguments when it is first
# imported, and torch.compile's dynamo imports it (through FSDP) the first time anything uses
# torch.compiler.disable, which dear's forward pre-hooks do. Imported after the process group
# exists, it keeps ten references to it for the life of the interpreter: the group is then
# destroyed during the interpreter's teardown, which aborts the process now and then
# ("terminate called without an active exception", tests/test_shutdown.py). Imported first, the
# defaults are None.
if dist.is_available() and not dist.is_initialized():
    import torch.distributed.nn.functional  # noqa: F401

_BACKENDS = ("auto", "torch", "horovod", "local", "nccl", "mpi")


class _State:
    comm: Optional[Communicator] = None
    config: Config = Config()
    owns_group: bool = False
    reporter: Optional[HangReporter] = None       # dear/comm/hang.py
    optimizers: "weakref.WeakSet[DearOptimizer]" = weakref.WeakSet()


_state = _State()


_log_handler: Optional[logging.Handler] = None


def _show_log(rank: int) -> None:
    """DEAR_LOG_LEVEL below WARNING where nothing would print it (no handler on the "dear"
    logger or the root; Python's last resort prints warnings only): to stderr, each line after
    the rank. A script that configured logging keeps its own handlers."""
    global _log_handler
    logger = logging.getLogger("dear")
    if _log_handler is not None:               # an earlier init()'s
        logger.removeHandler(_log_handler)
        _log_handler = None
    if (logger.getEffectiveLevel() >= logging.WARNING or logger.handlers
            or logging.getLogger().handlers):
        return
    _log_handler = logging.StreamHandler()
    _log_handler.setFormatter(logging.Formatter(f"[rank {rank}] %(message)s"))
    logger.addHandler(_log_handler)


def init(backend: str = "auto", **config: Any) -> None:
    """Start dear. `auto`: Horovod when launched by horovodrun (HOROVOD_RANK set); else reuse
    torch.distributed's default group, or start one from the launcher's variables (torchrun,
    srun, mpirun: dear/comm/launch.py; NCCL with CUDA, Gloo otherwise); else run alone as a world of
    size 1. `nccl`: NCCL directly, without torch.distributed's process group
    (dear/comm/nccl.py; needs CUDA). `mpi`: MPI non-blocking collectives through mpi4py on CPU
    tensors (dear/comm/mpi.py; launch with mpirun)."""
    if backend not in _BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {_BACKENDS}")
    if _state.comm is not None:
        raise RuntimeError("dear.init() was already called; call dear.shutdown() first")
    cfg = Config.from_env(**config)
    if backend == "auto":                  # DEAR_BACKEND=mpi: the data plane chosen at launch
        backend = cfg.backend
        if backend not in _BACKENDS:
            raise ValueError(f"DEAR_BACKEND={backend!r} is not one of {_BACKENDS}")
    logging.getLogger("dear").setLevel(cfg.log_level.upper())
    backend_comm, owns = _make_communicator(backend, cfg)
    _show_log(backend_comm.rank)
    comm = RecordedCommunicator(backend_comm)     # the flight record: dear/comm/flight.py
    _state.reporter = HangReporter(comm, out_of_band_store(backend_comm), cfg.hang_report)
    _state.comm, _state.config, _state.owns_group = comm, cfg, owns
    log.info("dear: rank %d of %d on %s", comm.rank, comm.size, comm.name)


def _make_communicator(backend: str, cfg: Config) -> tuple[Communicator, bool]:
    """The communicator for `backend`, and whether dear started the process group."""
    if backend == "auto" and launch.under_horovodrun() and not dist.is_initialized():
        backend = "horovod"
    if backend not in ("horovod", "local") and not dist.is_initialized() \
            and not launch.launched():
        launch.setup_env()                 # srun / mpirun: their variables as torchrun's
    if backend == "horovod":
        from .horovod import HorovodCommunicator
        return HorovodCommunicator(timeout=cfg.timeout, data_plane=cfg.horovod_data_plane), False
    if backend == "local":
        return LocalCommunicator(), False
    if backend == "nccl":                  # direct NCCL: csrc/ communicator or nccl4py
        from . import nccl
        return nccl.create(cfg.timeout), False
    if backend == "mpi":
        from .mpi import MPICommunicator
        return MPICommunicator(timeout=cfg.timeout, progress=cfg.mpi_progress,
                               interval=cfg.mpi_progress_interval), False
    from .torch_dist import TorchCommunicator
    owns = False
    if not dist.is_initialized() and launch.launched():
        init_process_group_from_env(cfg.timeout)
        owns = True
    if not dist.is_initialized():
        if backend == "torch":
            raise RuntimeError("backend='torch' needs torch.distributed: launch with torchrun or "
                               "call torch.distributed.init_process_group() before dear.init()")
        return LocalCommunicator(), False
    _select_local_gpu()
    return TorchCommunicator(gloo_collectives=cfg.gloo_collectives, timeout=cfg.timeout), owns


def default_backend() -> str:
    """What dear.init() starts from torchrun's variables: Gloo for CPU tensors, and NCCL for
    CUDA tensors where CUDA is there (torch's own default). The same on every rank, whatever
    each rank's model lives on: a CPU model on a GPU machine (two ranks on one GPU, say) must
    not be handed to NCCL alone."""
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def init_process_group_from_env(timeout: float) -> None:
    """Start the default group from torchrun's variables (default_backend()). Under Slurm, where
    dear derived the port, the store is dear's: a rank refuses a store that another job or
    step started on the same port, instead of joining its group."""
    wait = datetime.timedelta(seconds=timeout)
    job = launch.job_identity()
    if job is None:
        dist.init_process_group(backend=default_backend(), timeout=wait)
        return
    place = launch.process_env()
    assert place.master_addr is not None and place.master_port is not None  # export() set them
    try:
        store = dist.TCPStore(place.master_addr, place.master_port, place.size,
                              is_master=place.rank == 0, timeout=wait, wait_for_workers=False)
    except dist.DistNetworkError as exc:
        if place.rank != 0:
            raise
        raise RuntimeError(
            f"dear.init(): rank 0 cannot listen on {place.master_addr}:{place.master_port}, the "
            f"port dear derived for this {job} ({exc}): another process holds it. Set "
            "MASTER_PORT to a free port, the same on every rank (mpirun -x MASTER_PORT=...)"
        ) from exc
    if place.rank == 0:
        store.set("dear/job", job)
    else:
        owner = store.get("dear/job").decode()
        if owner != job:
            raise RuntimeError(
                f"dear.init(): the rendezvous at {place.master_addr}:{place.master_port} "
                f"belongs to {owner}, not to this {job}: two jobs derived the same port. "
                "Set MASTER_PORT to a free port for this step (the same on every task)")
    dist.init_process_group(backend=default_backend(), store=store, rank=place.rank,
                            world_size=place.size, timeout=wait)


def _select_local_gpu() -> None:
    """torchrun's LOCAL_RANK picks this rank's GPU, as DDP users expect; where there are fewer
    GPUs than local ranks (CPU training on a GPU machine) none is picked."""
    if not torch.cuda.is_available() or not launch.local_rank_given():
        return
    local = launch.process_env().local_rank
    if local < torch.cuda.device_count():
        torch.cuda.set_device(local)


_at_shutdown: list[Callable[[], None]] = []


def at_shutdown(release: Callable[[], None]) -> None:
    """Run `release` in every dear.shutdown(), after the optimizers' pending updates and before
    the communicator goes: what a layer above keeps per process (the collective thread)."""
    if release not in _at_shutdown:
        _at_shutdown.append(release)


def shutdown() -> None:
    """Apply every pending update, then release the process group if dear started it."""
    if _state.comm is None:
        return
    for opt in list(_state.optimizers):
        opt.dear_shutdown()
    for release in list(_at_shutdown):         # e.g. the collective thread (fusion/schedule.py)
        release()
    if _state.reporter is not None:
        _state.reporter.close()
        _state.reporter = None
    _state.comm.shutdown()
    if _state.owns_group and dist.is_initialized():
        dist.destroy_process_group()
    _state.comm, _state.owns_group = None, False
    # Free what reference cycles still hold (optimizers and their model hooks, pending Work
    # with tensors) while the interpreter is whole, not in its teardown (see TorchCommunicator).
    gc.collect()


def is_initialized() -> bool:
    return _state.comm is not None


def communicator() -> Communicator:
    """dear's communicator. Before dear.init(), with torch.distributed's default group
    initialised (a DDP script that kept its dist.init_process_group()), dear starts on that
    group exactly as dear.init() would have, and says so once."""
    if _state.comm is None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "dear is not initialised: call dear.init() first, or "
                "torch.distributed.init_process_group() before this call (dear then takes "
                "its default group, as dear.init() does)")
        init()
        log.info("dear: started on torch.distributed's default group, as dear.init() does "
                 "(the script called init_process_group() and not dear.init())")
    assert _state.comm is not None
    return _state.comm


def current_communicator() -> Optional[Communicator]:
    """The process's communicator, or None before dear.init()."""
    return _state.comm


def replace_communicator(old: object, new: Any) -> bool:
    """Put `new` in place of `old` if `old` is the process's communicator (dear.diagnose's
    tracer wraps it while it records, and unwraps it after); whether it did."""
    if _state.comm is not old:
        return False
    _state.comm = new
    return True


def config() -> Config:
    return _state.config


def meet(name: str) -> list[int]:
    """Every rank reaches the point `name` before any collective that follows it is issued,
    agreed out of band (dear/comm/hang.py's store client): [] when all came, else the ranks that
    went on without it. Unchecked ([]) where there is no store."""
    reporter = _state.reporter
    if reporter is None:
        return []
    return reporter.meet(name, _state.config.timeout)


def flight_channel(name: str, members: list[int]) -> Optional[FlightChannel]:
    """The flight record of another stream of collectives (dear.KFAC's own process groups:
    dear/comm/hang.py reports on it when one fails), or None outside dear.init()."""
    reporter = _state.reporter
    return reporter.channel(name, members) if reporter is not None else None


def optimizers() -> list[DearOptimizer]:
    """The live dear.DistributedOptimizers (dear.KFAC finds the ones training its layers)."""
    return list(_state.optimizers)


def register_optimizer(opt: DearOptimizer) -> None:
    _state.optimizers.add(opt)


def rank() -> int:
    return communicator().rank


def size() -> int:
    return communicator().size


def local_rank() -> int:
    if launch.local_rank_given():
        return launch.process_env().local_rank
    return 0 if size() == 1 else communicator().local_rank


def flush_all() -> None:
    """Before a collective of the user's: pending updates applied, and whatever an optimizer's
    collective thread was given is issued, so this one keeps its place in the order."""
    for opt in list(_state.optimizers):
        opt.dear_schedule.drain()
        opt.flush_updates()


def broadcast_parameters(params: Union[Mapping[str, torch.Tensor],
                                       Iterable[tuple[str, torch.Tensor]],
                                       Iterable[torch.Tensor]],
                         root_rank: int = 0) -> None:
    """Copy rank `root_rank`'s tensors to every rank, in place (a state_dict, named_parameters()
    or a list of tensors), in the same order on every rank."""
    comm = communicator()
    flush_all()
    mark_phase("dear.broadcast_parameters")
    items = params.items() if isinstance(params, Mapping) else params
    tensors = [t[1] if isinstance(t, tuple) else t for t in items]
    works = []
    with torch.no_grad():
        for tensor in tensors:
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"broadcast_parameters expects tensors, got {type(tensor)}")
            works.append(comm.broadcast(tensor.data, root_rank))
        for work in works:
            work.wait()


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0) -> None:
    """Give every rank rank `root_rank`'s optimizer state and hyperparameters."""
    comm = communicator()
    flush_all()
    mark_phase("dear.broadcast_optimizer_state")
    if getattr(optimizer, "shard_optimizer_state", False):
        # Each rank holds its own shards of one state: only the hyperparameters are rank 0's.
        hyper = comm.broadcast_object(
            [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
            if comm.rank == root_rank else None, root_rank)
        for g, values in zip(optimizer.param_groups, hyper):
            g.update(values)
        return
    # Sent with its tensors on the CPU: pickled CUDA tensors would be unpickled onto the root's
    # GPU index on every rank (a CUDA context on GPU 0 for each); load_state_dict() moves each
    # state tensor to its parameter's device.
    # Quantized compression's error-feedback residuals are each rank's own: not sent.
    state = comm.broadcast_object(_without_residuals(_on_cpu(optimizer.state_dict()))
                                  if comm.rank == root_rank else None, root_rank)
    if comm.rank != root_rank:
        # As Horovod: the root's values go into the existing param_groups dicts, so whatever
        # holds them (an LR scheduler, kfac-pytorch's scheduler) keeps seeing the live ones.
        groups = optimizer.param_groups
        dicts = list(groups)
        optimizer.load_state_dict(state)
        for old, new in zip(dicts, optimizer.param_groups):
            old.update(new)
        groups[:] = dicts
        optimizer.param_groups = groups


def _without_residuals(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in state.items() if k != ERROR_FEEDBACK_KEY}


def _on_cpu(obj: Any) -> Any:
    """`obj` (dicts, lists and tuples of tensors and plain values) with CPU tensors."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _on_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_on_cpu(v) for v in obj)
    return obj


def allreduce(tensor: torch.Tensor, op: Any = ReduceOp.Average) -> torch.Tensor:
    """Return the sum or average of `tensor` over ranks (a new tensor, as Horovod does)."""
    op = resolve_op(op)
    comm = communicator()
    for opt in list(_state.optimizers):        # keep its place after what backward submitted
        opt.dear_schedule.drain()
    out = tensor.detach().clone().contiguous()
    mark_phase("dear.allreduce")
    comm.all_reduce(out).wait()
    if op is ReduceOp.Average:
        if out.is_floating_point() or out.is_complex():
            out.div_(comm.size)
        else:
            out.floor_divide_(comm.size)
    return out
