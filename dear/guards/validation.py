"""Checks run once when an optimizer is wrapped: bad input fails here, clearly, on every rank,
instead of hanging or silently diverging later."""

from __future__ import annotations

import inspect
import os
import sys
from typing import Any, Iterable, Optional

import torch

from ..comm.base import Communicator
from ..interfaces import DearOptimizer, DearProcessSet


def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    closure = inspect.signature(type(optimizer).step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise ValueError(
            f"{type(optimizer).__name__}.step() needs a closure (it re-evaluates the loss), which "
            "a deferred update cannot provide; use an optimizer whose step takes no closure")


def named_params_of(optimizer: torch.optim.Optimizer,
                    named_parameters: Optional[Iterable[tuple[str, torch.nn.Parameter]]],
                    model: Optional[torch.nn.Module], sparse_as_dense: bool = False
                    ) -> list[tuple[str, torch.nn.Parameter]]:
    """The optimizer's trainable parameters with names, in the optimizer's order."""
    opt_params = [p for g in optimizer.param_groups for p in g["params"]]
    if len({id(p) for p in opt_params}) != len(opt_params):
        raise ValueError("a parameter appears twice in the optimizer's param_groups")
    devices = {p.device for p in opt_params}
    if len(devices) > 1:
        raise ValueError(f"parameters live on several devices {sorted(map(str, devices))}; "
                         "dear needs one device per process (move the model with .to(device))")
    if named_parameters is None and model is not None:
        named_parameters = model.named_parameters()
    if named_parameters is None:
        names = {id(p): f"param.{i}" for i, p in enumerate(opt_params)}
    else:
        pairs = list(named_parameters)
        if any(not isinstance(x, tuple) or len(x) != 2 for x in pairs):
            raise ValueError("named_parameters must be (name, parameter) pairs, e.g. "
                             "model.named_parameters()")
        seen: dict[str, int] = {}
        for name, _ in pairs:
            seen[name] = seen.get(name, 0) + 1
        dups = sorted(n for n, c in seen.items() if c > 1)
        if dups:
            raise ValueError(f"named_parameters contains duplicate names: {dups}")
        names = {id(p): n for n, p in pairs}
        missing = [i for i, p in enumerate(opt_params) if id(p) not in names]
        if missing:
            shapes = [tuple(opt_params[i].shape) for i in missing[:5]]
            raise ValueError(
                f"{len(missing)} optimizer parameter(s) are missing from named_parameters "
                f"(shapes {shapes}...); pass model.named_parameters() of the model that "
                "owns every parameter in the optimizer")
    return [(names[id(p)], p) for p in opt_params if p.requires_grad]


def check_same_across_ranks(named: list[tuple[str, torch.nn.Parameter]],
                            comm: Communicator) -> None:
    """Every rank must hold the same parameters (names, shapes, dtypes) in the same order."""
    mine = [(n, tuple(p.shape), str(p.dtype)) for n, p in named]
    if comm.size == 1:
        return
    everyone = comm.all_gather_object(mine)
    for r, theirs in enumerate(everyone):
        if theirs == mine:
            continue
        if len(theirs) != len(mine):
            raise ValueError(f"rank {r} has {len(theirs)} trainable parameters, rank "
                             f"{comm.rank} has {len(mine)}: every rank must build the same model")
        for a, b in zip(mine, theirs):
            if a != b:
                raise ValueError(f"parameter {a[0]} differs across ranks: {a[1:]} on rank "
                                 f"{comm.rank}, {b[1:]} on rank {r}; every rank must build the "
                                 "same model")


# ------------------------------------------------------------------------------ wrapping twice
def _is_horovod_optimizer(optimizer: object) -> bool:
    """hvd.DistributedOptimizer builds a class from horovod.torch.optimizer's methods."""
    return any(getattr(klass.__dict__.get("synchronize"), "__module__", "")
               .startswith("horovod.") for klass in type(optimizer).__mro__)


def check_not_wrapped(optimizer: torch.optim.Optimizer) -> None:
    """dear over dear, or dear over hvd.DistributedOptimizer: refused with what to do."""
    if isinstance(optimizer, DearOptimizer):
        raise TypeError(
            "this optimizer is already a dear.DistributedOptimizer; wrap the plain torch "
            "optimizer once and use the result (wrapping twice would average every gradient "
            "twice)")
    if _is_horovod_optimizer(optimizer):
        raise TypeError(
            "this optimizer is already a hvd.DistributedOptimizer, which averages the gradients "
            "itself; wrap the plain torch optimizer with dear.DistributedOptimizer INSTEAD of "
            "hvd.DistributedOptimizer (the one-line swap), not on top of it")


def refuse_construction(obj: object) -> None:
    """A dear optimizer class is only ever instantiated by dear.DistributedOptimizer (which
    never calls __init__); reaching __init__ means someone (hvd.DistributedOptimizer) is
    wrapping an optimizer dear already wrapped."""
    raise TypeError(
        f"{type(obj).__name__} here is a dear.DistributedOptimizer, which must not be wrapped "
        "again (e.g. by hvd.DistributedOptimizer: both would average every gradient) nor "
        "re-instantiated from its class; wrap the plain torch optimizer with either "
        "dear.DistributedOptimizer or hvd.DistributedOptimizer, once")


def _ddp_owning(param: torch.nn.Parameter) -> bool:
    """Whether a live DistributedDataParallel holds `param` (DDP keeps its parameters in the
    list `_module_parameters`). Looks two referrer levels up from one parameter."""
    import gc

    from torch.nn.parallel import DistributedDataParallel as DDP
    for holder in gc.get_referrers(param):
        if not isinstance(holder, list):
            continue
        for owner in gc.get_referrers(holder):
            if isinstance(owner, DDP) or (isinstance(owner, dict)
                                          and owner.get("_module_parameters") is holder):
                return True
    return False


def held_by_ddp(param: torch.nn.Parameter) -> bool:
    """Whether a live DistributedDataParallel wraps the module holding `param` (for error
    messages: DDP writes the averaged gradient into .grad at the end of backward)."""
    import torch.distributed as dist
    return dist.is_available() and dist.is_initialized() and _ddp_owning(param)


def warn_if_ddp(model: Optional[torch.nn.Module],
                named: list[tuple[str, torch.nn.Parameter]]) -> None:
    """A DDP-wrapped model under dear's optimizer all-reduces every gradient twice (DDP's own,
    then dear's): correct values, double the communication. Warn."""
    import warnings

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    inner = getattr(model, "_orig_mod", model)          # torch.compile's wrapper
    wrapped = inner is not None and any(isinstance(m, DDP) for m in inner.modules())
    if not wrapped and named and dist.is_available() and dist.is_initialized():
        wrapped = _ddp_owning(named[0][1])
    if wrapped:
        warnings.warn(
            "dear.DistributedOptimizer got the parameters of a DistributedDataParallel model: "
            "DDP all-reduces the gradients in backward and dear averages them again, so every "
            "gradient is communicated twice (the values stay right). Give dear the plain model "
            "(ddp.module, not wrapped in DDP) and train that", UserWarning, stacklevel=3)


# ------------------------------------------------------------------------ Horovod's arguments
def process_set_communicator(process_set: object, timeout: float) -> Optional[Any]:
    """Horovod's process_set=: None or the global set gives None (dear's own communicator);
    a set of some ranks gives a communicator over those ranks only, so the optimizer averages
    over its set (Horovod's meaning; every rank of the set must create the optimizer); on a
    rank outside the set, a world of one (Horovod's optimizer there averages nothing)."""
    if process_set is None or getattr(process_set, "process_set_id", None) == 0:
        return None                            # the global set
    if isinstance(process_set, DearProcessSet):   # dear.horovod's ProcessSet
        return process_set.dear_communicator(timeout)
    hvd = sys.modules.get("horovod.torch")
    if hvd is None or not callable(getattr(process_set, "included", None)):
        raise ValueError(f"process_set={process_set!r} is not a Horovod process set: pass one "
                         "made by hvd.add_process_set (or hvd.ProcessSet at hvd.init), or "
                         "leave the default")
    if getattr(process_set, "process_set_id", None) is None or not hvd.is_initialized():
        raise ValueError(f"process_set={process_set!r} is not registered with Horovod: call "
                         "hvd.init() and hvd.add_process_set(ranks) (or hvd.init(process_sets="
                         "[...])) on every rank first")
    if not process_set.included():  # type: ignore[attr-defined]
        # Horovod's optimizer on a rank outside its set reduces nothing: a local optimizer.
        from ..comm.local import LocalCommunicator
        return LocalCommunicator()
    from ..comm.horovod import HorovodCommunicator
    return HorovodCommunicator(timeout=timeout, process_set=process_set)


def horovod_groups(num_groups: int, groups: object) -> object:
    """Horovod's deprecated num_groups= (its 7th positional argument) means groups=num_groups."""
    if num_groups:
        import warnings
        warnings.warn("num_groups is deprecated in Horovod, which replaced it by groups=; dear "
                      "takes it as groups=num_groups", DeprecationWarning, stacklevel=3)
        if groups is None:
            return num_groups
    return groups


def explicit_groups(groups: Any, index: dict[torch.nn.Parameter, int]) -> Any:
    """`groups=` as parameter indices (`index`: parameter -> its position), checked; None and
    Horovod's int (N groups of consecutive parameters) pass through."""
    if groups is None or isinstance(groups, int):
        if isinstance(groups, int) and groups < 1:
            raise ValueError(f"groups must be >= 1 or a list of parameter lists, got {groups}")
        return groups
    out = []
    for group in groups:
        try:
            out.append([index[p] for p in group])
        except KeyError:
            raise ValueError("groups holds a parameter that the optimizer does not train "
                             "(or that has requires_grad=False)") from None
    if len({i for g in out for i in g}) != sum(len(g) for g in out):
        raise ValueError("a parameter appears in more than one of groups")
    return out


# --------------------------------------------------------- what DDP's constructor guarantees
#: DEAR_* knobs that change nothing another rank sees (local logging, paths, timeouts, how this
#: process drives progress): they may differ across ranks. Every other knob must match.
_LOCAL_KNOBS = frozenset({"timeout", "trace_iterations", "log_level", "autotune_log", "hang_report",
                          "autotune_out", "fusion_config", "native", "mpi_progress",
                          "mpi_progress_interval", "elastic_dir", "elastic_grace"})


def collective_knobs(config: Any) -> dict[str, str]:
    """The DEAR_* settings that change which collectives run or what they carry."""
    import dataclasses
    out = {}
    for field in dataclasses.fields(config):
        if field.name in _LOCAL_KNOBS:
            continue
        value = getattr(config, field.name)
        if field.name == "trace":              # tracing on or off; the path is local
            value = bool(value)
        var = config.variables().get(field.name, field.name)
        out[var] = repr(value)
    return out


def check_settings_match(settings: dict[str, str], comm: Communicator) -> None:
    """One exchange of every setting that must match across ranks; a mismatch is an error on
    every rank naming the setting, its values and the ranks (instead of a hang, a crash in the
    transport, or every rank agreeing on wrong parameters)."""
    if comm.size == 1:
        return
    everyone = comm.all_gather_object(settings)
    problems = []
    for key in sorted({k for s in everyone for k in s}):
        values: dict[str, list[int]] = {}
        for r, theirs in enumerate(everyone):
            values.setdefault(theirs.get(key, "<missing>"), []).append(r)
        if len(values) > 1:
            problems.append(f"{key}: " + ", ".join(f"{v} on rank{'s' if len(rs) > 1 else ''} "
                                                   f"{', '.join(map(str, rs))}"
                                                   for v, rs in values.items()))
    if problems:
        raise ValueError(
            "dear: settings that must be the same on every rank differ (every rank raises "
            "this):\n  " + "\n  ".join(problems) + "\nGive every rank the same arguments, "
            "DEAR_* variables and fusion config file")


def autotune_output_problem(config: Any) -> Optional[str]:
    """Why this process could not write the autotuner's trial log (appended) or its best
    layout (a temporary file renamed into place), or None."""
    for var, path in (("DEAR_AUTOTUNE_LOG", config.autotune_log),
                      ("DEAR_AUTOTUNE_OUT", config.autotune_out)):
        if not path:
            continue
        target = os.path.abspath(path)
        directory = os.path.dirname(target)
        why = None
        if os.path.isdir(target):
            why = "is a directory"
        elif not os.path.isdir(directory):
            why = f"its directory {directory} does not exist"
        elif not os.access(directory, os.W_OK | os.X_OK):
            why = f"its directory {directory} is not writable"
        elif os.path.exists(target) and not os.access(target, os.W_OK):
            why = "is not writable"
        if why is not None:
            return (f"{var}={path!r} {why}; point it at a writable place (or set it to '' to "
                    "not write it)")
    return None


def model_settings(model: Optional[torch.nn.Module]) -> dict[str, str]:
    """The model's buffer set (DDP checks that every rank built the same model)."""
    if model is None:
        return {}
    buffers = [(n, tuple(b.shape), str(b.dtype)) for n, b in model.named_buffers()]
    return {"the model's buffers": f"{len(buffers)} buffers {_digest(buffers)}"
            if buffers else "none"}


def _digest(obj: Any) -> str:
    import hashlib
    return hashlib.sha256(repr(obj).encode()).hexdigest()[:12]


def broadcast_model(model: torch.nn.Module, comm: Communicator, root: int = 0) -> None:
    """Every rank takes `root`'s parameters and buffers: DDP's constructor (training scripts
    seed each rank differently and rely on it) and dear.join()'s final sync from the last
    joiner."""
    if comm.size == 1:
        return
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
    tensors = list(dict.fromkeys([*model.parameters(), *model.buffers()]))
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    with torch.no_grad():
        pending = []
        for (dtype, _), group in by_kind.items():
            comm.check_dtype(dtype)
            flat = _flatten_dense_tensors([t.data for t in group])
            pending.append((group, flat, comm.broadcast(flat, root)))
        for group, flat, work in pending:
            work.wait()
            if comm.rank != root:
                for t, value in zip(group, _unflatten_dense_tensors(flat, group)):
                    t.data.copy_(value)
