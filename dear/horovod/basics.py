"""Start and stop, ranks and topology, process sets: Horovod's basics on torch.distributed.

Every process set owns two groups: `group`, the torch.distributed group its tensors travel on
(the default group for the global set, which dear.DistributedOptimizer shares), and `control`,
a Gloo group that carries the small agreement round each collective starts with
(negotiate.py). Like Horovod's, add_process_set/remove_process_set must be called by every rank
of the job in the same order (torch.distributed.new_group needs every rank).
"""

from __future__ import annotations

import datetime
import json
import socket
import warnings
from typing import Iterable, Optional, Sequence, Union

import torch
import torch.distributed as dist

from ..comm import launch, runtime
from ..comm.runtime import default_backend
from .control import allgather_bytes
from .handles import forget_handles
from .negotiate import Call, Kind, negotiate


class ProcessSet:
    """Ranks that run collectives together (Horovod's class). Build it from a list of global
    ranks, then pass it to init(process_sets=...) or add_process_set() on every rank."""

    process_set_id: Optional[int] = None
    ranks: Optional[list[int]] = None

    def __init__(self, ranks: Iterable[int]) -> None:
        if not isinstance(ranks, Iterable) or isinstance(ranks, (str, bytes)):
            raise ValueError("dear.horovod builds a ProcessSet from a list of ranks (an mpi4py "
                             f"communicator is not supported), got {ranks!r}")
        listed = list(ranks)
        if any(isinstance(r, bool) or not isinstance(r, int) for r in listed):
            raise ValueError(f"ProcessSet ranks must be ints, got {listed!r}")
        self.ranks = sorted(listed)
        self.group: Optional[dist.ProcessGroup] = None      # None: the default group
        self.control: Optional[dist.ProcessGroup] = None
        self.rounds = 0                  # agreement rounds so far (the same on every member)
        self.deferred: list = []         # named calls waiting for the others (negotiate.py)

    def size(self) -> Optional[int]:
        """Number of ranks; None before the set is registered."""
        return None if self.process_set_id is None or self.ranks is None else len(self.ranks)

    def rank(self) -> Optional[int]:
        """This process's rank inside the set (collectives still name roots by global rank)."""
        if self.process_set_id is None or self.ranks is None:
            return None
        me = rank()
        if me not in self.ranks:
            raise ValueError(f"rank {me} is not included in {self}")
        return self.ranks.index(me)

    def included(self) -> Optional[bool]:
        return None if self.ranks is None else rank() in self.ranks

    def dear_communicator(self, timeout: float) -> object:
        """What dear.DistributedOptimizer(process_set=this set) averages over: the set's ranks
        (each of them must create the optimizer), or, on a rank outside the set, this rank
        alone (Horovod's optimizer there reduces nothing)."""
        from ..comm.local import LocalCommunicator
        from ..comm.torch_dist import TorchCommunicator
        _check_registered(self)
        if not self.included():
            return LocalCommunicator()
        return TorchCommunicator(self.group, timeout=timeout)

    def __str__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"

    __repr__ = __str__


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


class _State:
    initialized = False
    owns_runtime = False             # hvd.init() called dear.init(), so hvd.shutdown() ends it
    owns_world = False               # hvd.init() started the default group itself
    generation = 0                   # hvd.init() calls so far in this process
    next_id = 1
    sets: dict[int, ProcessSet] = {}
    topology: dict[str, int] = {}


_state = _State()


def _timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=runtime.config().timeout)


def init(comm: Optional[Sequence[int]] = None,
         process_sets: Union[Sequence[ProcessSet], str, None] = None) -> None:
    """Start dear (dear.init(): torch.distributed from torchrun's, srun's or mpirun's
    variables; a world of one without a launcher) and register `process_sets`. Calling it again
    while initialized does nothing, as in Horovod."""
    if _state.initialized:
        return
    if not dist.is_available():
        raise RuntimeError("dear.horovod needs torch.distributed, which this torch lacks")
    if runtime.is_initialized():
        if not dist.is_initialized():
            raise RuntimeError("dear.init() was called with a backend other than torch.distributed"
                               "; dear.horovod runs on torch.distributed: call hvd.init() alone "
                               "(or dear.shutdown() first)")
    else:
        if not dist.is_initialized() and launch.detect() is None:
            if launch.under_horovodrun():
                raise RuntimeError(
                    "dear.horovod runs on torch.distributed and does not read horovodrun's Gloo "
                    "rendezvous: launch with torchrun, srun or mpirun instead (e.g. torchrun "
                    "--nproc_per_node N script.py)")
            # No launcher: a world of one, as Horovod runs without horovodrun.
            dist.init_process_group(default_backend(), store=dist.HashStore(), rank=0,
                                    world_size=1, timeout=_timeout())
            _state.owns_world = True
        elif not dist.is_initialized() and _state.generation and launch.agent_store():
            _restart_under_torchrun()
        runtime.init(backend="torch")
        _state.owns_runtime = True
    size = dist.get_world_size()
    if comm is not None and sorted(int(r) for r in comm) not in ([], list(range(size))):
        _abandon()
        raise NotImplementedError("hvd.init(comm=...) with a subset of the ranks is not "
                                  "supported by dear.horovod: start the job with those ranks only, "
                                  "or use a ProcessSet")
    global_process_set.ranks = list(range(size))
    global_process_set.control = dist.new_group(backend="gloo", timeout=_timeout(),
                                                group_desc="dear_horovod_control")
    global_process_set.rounds = 0
    global_process_set.deferred = []
    _state.sets = {0: global_process_set}
    _state.topology = _topology(global_process_set.control)
    _state.initialized = True
    _state.generation += 1
    if process_sets is not None and not isinstance(process_sets, str):   # "dynamic": nothing
        for ps in process_sets:
            add_process_set(ps)


def _restart_under_torchrun() -> None:
    """hvd.init() after hvd.shutdown() under torchrun: the agent's store outlives the groups and
    torch names groups again from 0, so a rank could read the address a peer published for the
    previous group ("Connection refused"). Each restart gets keys of its own."""
    store, rank_, world = next(dist.rendezvous("env://", timeout=_timeout()))
    prefixed = dist.PrefixStore(f"dear.horovod/init{_state.generation}", store)
    dist.init_process_group(default_backend(), store=prefixed, rank=rank_, world_size=world,
                            timeout=_timeout())
    _state.owns_world = True


def _abandon() -> None:
    if _state.owns_runtime:
        runtime.shutdown()
    if _state.owns_world and dist.is_initialized():
        dist.destroy_process_group()
    _state.owns_runtime = _state.owns_world = False


def _topology(control: Optional[dist.ProcessGroup]) -> dict[str, int]:
    """local/cross ranks from every rank's host and launcher's local rank (one exchange):
    Horovod's local set is the ranks on one host, its cross set the ranks with one local rank."""
    env = launch.process_env()
    given = launch.local_rank_given()
    mine = [socket.gethostname(), env.local_rank if given else -1,
            env.local_size if given else -1]
    table = [json.loads(b) for b in allgather_bytes(json.dumps(mine).encode(), control)]
    me = dist.get_rank()
    hosts = [row[0] for row in table]
    same_host = [r for r, h in enumerate(hosts) if h == hosts[me]]
    local = [row[1] if row[1] >= 0 else same_host_index(hosts, r) for r, row in enumerate(table)]
    local_size = table[me][2] if table[me][2] > 0 else len(same_host)
    cross = [r for r in range(len(table)) if local[r] == local[me]]
    sizes = {h: sum(1 for x in hosts if x == h) for h in hosts}
    return {"local_rank": local[me], "local_size": local_size, "cross_rank": cross.index(me),
            "cross_size": len(cross), "homogeneous": int(len(set(sizes.values())) == 1)}


def same_host_index(hosts: list[str], r: int) -> int:
    return sum(1 for q in range(r) if hosts[q] == hosts[r])




def shutdown() -> None:
    """Release the process sets' groups, then dear (pending updates applied) if hvd.init()
    started it."""
    if not _state.initialized:
        return
    forget_handles()
    for ps in list(_state.sets.values()):
        if ps is not global_process_set:
            _release(ps)
            ps.process_set_id = None
    if global_process_set.control is not None and dist.is_initialized():
        dist.destroy_process_group(global_process_set.control)
    global_process_set.control = None
    _state.sets = {}
    _state.initialized = False
    _abandon()


def is_initialized() -> bool:
    return _state.initialized


def check_initialized() -> None:
    if not _state.initialized:
        raise ValueError("dear.horovod has not been initialized; use hvd.init().")


def rank() -> int:
    check_initialized()
    return dist.get_rank()


def size() -> int:
    check_initialized()
    return dist.get_world_size()


def local_rank() -> int:
    check_initialized()
    return _state.topology["local_rank"]


def local_size() -> int:
    check_initialized()
    return _state.topology["local_size"]


def cross_rank() -> int:
    check_initialized()
    return _state.topology["cross_rank"]


def cross_size() -> int:
    check_initialized()
    return _state.topology["cross_size"]


def is_homogeneous() -> bool:
    check_initialized()
    return bool(_state.topology["homogeneous"])


# ---------------------------------------------------------------------------- process sets
def add_process_set(process_set: Union[ProcessSet, Sequence[int]]) -> ProcessSet:
    """Register a process set (every rank of the job calls it, in the same order) and return
    it: its own torch.distributed group for the tensors and a Gloo group for the agreement."""
    check_initialized()
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    assert ps.ranks is not None
    world = size()
    if not ps.ranks or len(set(ps.ranks)) != len(ps.ranks) \
            or not all(0 <= r < world for r in ps.ranks):
        raise ValueError(f"a process set needs distinct ranks in [0, {world}), got {ps.ranks}")
    if ps.process_set_id is not None:
        raise ValueError(f"{ps} is registered already")
    negotiate(global_process_set, Call(Kind.PROCESS_SET, shape_key=tuple(ps.ranks)))
    if any(other.ranks == ps.ranks for other in _state.sets.values()):
        raise ValueError(f"Attempted to add a duplicate process set: {ps}")
    ps.group = dist.new_group(ps.ranks, timeout=_timeout(), group_desc="dear_horovod_set")
    ps.control = dist.new_group(ps.ranks, backend="gloo", timeout=_timeout(),
                                group_desc="dear_horovod_set_control")
    ps.rounds, ps.deferred = 0, []
    ps.process_set_id = _state.next_id
    _state.next_id += 1
    _state.sets[ps.process_set_id] = ps
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set (every rank calls it); False for the global set or an
    unregistered one, as Horovod."""
    check_initialized()
    set_id = process_set.process_set_id
    if set_id is None or set_id == 0 or _state.sets.get(set_id) is not process_set:
        return False
    negotiate(global_process_set, Call(Kind.PROCESS_SET, shape_key=("remove", set_id)))
    _release(process_set)
    del _state.sets[set_id]
    process_set.process_set_id = None
    return True


def _release(ps: ProcessSet) -> None:
    for group in (ps.group, ps.control):
        if group is not None and group != dist.GroupMember.NON_GROUP_MEMBER \
                and dist.is_initialized():
            dist.destroy_process_group(group)
    ps.group = ps.control = None


def _check_registered(ps: ProcessSet) -> None:
    if ps.process_set_id is None or _state.sets.get(ps.process_set_id) is not ps:
        raise ValueError(f"{ps} is not registered: call hvd.add_process_set() on every rank")


def member(process_set: Optional[ProcessSet]) -> ProcessSet:
    """The registered set a collective runs on (None: the global set); this rank must be in it."""
    check_initialized()
    ps = global_process_set if process_set is None else process_set
    if not isinstance(ps, ProcessSet):
        raise ValueError(f"process_set must be a ProcessSet, got {ps!r}")
    _check_registered(ps)
    if not ps.included():
        raise ValueError(f"rank {rank()} is not a member of {ps}")
    return ps


# ------------------------------------------------------------------ what Horovod was built with
def mpi_threads_supported() -> bool:
    return False


def mpi_enabled() -> bool:
    return False


def mpi_built() -> bool:
    return False


def gloo_enabled() -> bool:
    return True


def gloo_built() -> bool:
    return True


def nccl_built() -> int:
    """NCCL's version code (as NCCL_VERSION_CODE) where torch has NCCL and CUDA, else 0."""
    if not (torch.cuda.is_available() and dist.is_nccl_available()):
        return 0
    major, minor, patch = torch.cuda.nccl.version()  # type: ignore[no-untyped-call]
    return major * 1000 + minor * 100 + patch if (major, minor) < (2, 9) \
        else major * 10000 + minor * 100 + patch


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    return torch.cuda.is_available()


def rocm_built() -> bool:
    return getattr(torch.version, "hip", None) is not None


_timeline_warned = False


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Horovod's timeline records its own background thread, which dear.horovod does not have:
    a warning, nothing recorded (torch.profiler and DEAR_TRACE record dear's collectives)."""
    global _timeline_warned
    if not _timeline_warned:
        warnings.warn("hvd.start_timeline(): dear.horovod has no Horovod timeline; nothing is "
                      "written to " + repr(file_path) + " (use torch.profiler, or DEAR_TRACE for "
                      "dear.DistributedOptimizer)", stacklevel=2)
        _timeline_warned = True


def stop_timeline() -> None:
    return None

