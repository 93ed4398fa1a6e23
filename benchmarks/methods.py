"""Every schedule the benchmarks measure, in one registry.

A method is `NAME[:KEY=VALUE[:KEY=VALUE...]]`; values: 2MB / 512KB / 1GB (bytes), true/false,
none, numbers, else strings. The names (BUILDERS):

- `none`: every rank trains alone, no communication (T_compute);
- `ddp`: torch DistributedDataParallel (options go to it; default 25 MB buckets; `hook=fp16`
  or `hook=powersgd` (`rank=2`, `start=2`): torch's compression hooks);
- `fsdp2`: fully_shard(reshard_after_forward=False) per block (benchmarks/baselines.py);
- `horovod`: hvd.DistributedOptimizer (options go to it);
- `zero`: torch's ZeroRedundancyOptimizer (optimizer state sharded) under DDP;
- `allreduce`: one all-reduce of the flattened gradient after backward (no overlap);
- `wfbp`: wait-free backprop, Horovod's schedule on torch.distributed (`threshold=8MB`);
- `dear`: dear.DistributedOptimizer (options go to it; `rs_threshold`, `ag_threshold` and
  `first_bucket` make a FusionConfig, missing sizes default to fusion_threshold or
  DEAR_FUSION_THRESHOLD; `chunk_bytes`: the planned schedule's chunk size; `backend=horovod`:
  dear on Horovod's collectives). On the emulated model (benchmarks/emulated.py), whose layers
  are not nn.Embedding, `row_sparse` true / "auto" / "tables" (and dear's own default) names
  the word embeddings that --tokens made row-sparse; `row_sparse=off` sends them whole.
  `compression=fp16|int8|int4` (dear.Compression's; `int8-noef`: without error feedback).

Any method takes `clip=NORM`: the averaged gradient clipped to that global norm each step (dear:
optimizer.clip_grad_norm_, the others torch's clip_grad_norm_). `dear` takes `commit=K`: every K
steps a commit of dear.elastic.State(model, optimizer) inside the timed step, as under torchrun
(a copy in memory, the host check, a torch.distributed.checkpoint write to a temporary
directory; `commit_to=memory`: the copy and the check only, as under Horovod Elastic). The CPU
table's short names are ALIASES of these. To add a method, add a function to BUILDERS.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import re
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

OptFactory = Callable[[Any], torch.optim.Optimizer]
Blocks = Callable[[torch.nn.Module], list[torch.nn.Module]]

# The CPU table's names (benchmarks.train) for options of `dear`.
ALIASES = {
    "dear-order": "dear:schedule=dear", "dear-rows": "dear:row_sparse=true",
    "dear-dense": "dear:row_sparse=false", "dear-views": "dear:gradient_as_bucket_view=true",
    "sharded": "dear:shard_optimizer_state=true", "dear-sharded": "dear:shard_optimizer_state=true",
    "dear-hvd": "dear:backend=horovod",
}


@dataclasses.dataclass(frozen=True)
class Method:
    label: str                                    # as given, e.g. dear:first_bucket=2MB
    base: str                                     # a key of BUILDERS
    options: dict[str, Any]

    @property
    def uses_horovod(self) -> bool:
        return self.base == "horovod" or self.options.get("backend") == "horovod"

    @property
    def backend_switch(self) -> bool:
        """dear on another backend than torch.distributed: dear restarts around it (Built)."""
        return self.base == "dear" and "backend" in self.options


def parse_value(text: str) -> Any:
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low == "none":
        return None
    m = re.fullmatch(r"([\d.]+)\s*(b|kb|kib|mb|mib|gb|gib)", low)
    if m:
        unit = {"b": 1, "kb": 2**10, "kib": 2**10, "mb": 2**20, "mib": 2**20, "gb": 2**30,
                "gib": 2**30}[m.group(2)]
        return int(float(m.group(1)) * unit)
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_method(text: str) -> Method:
    label = text.strip()
    base, *opts = ALIASES.get(label, label).split(":")
    if base not in BUILDERS:
        raise ValueError(f"unknown method {base!r} in {text!r}; expected one of "
                         f"{sorted(BUILDERS)} or {sorted(ALIASES)}")
    options = {}
    for opt in opts:
        key, sep, value = opt.partition("=")
        if not sep or not key:
            raise ValueError(f"bad option {opt!r} in {text!r}: expected KEY=VALUE")
        options[key.strip()] = parse_value(value)
    return Method(label, base, options)


def parse_methods(text: str) -> list[Method]:
    return [parse_method(m) for m in text.split(",") if m.strip()]


def horovod_installed() -> bool:
    """Horovod importable with its torch extension built (make horovod)."""
    try:
        import horovod.torch as hvd
    except ImportError:
        return False
    return hasattr(hvd, "init")


# ---------------------------------------------------------------- builders


def _none(model: torch.nn.Module, make_opt: OptFactory, opts: dict[str, Any],
          blocks: Blocks) -> tuple:
    """Every rank alone: no communication (the compute a method has to hide its link time in)."""
    return model, make_opt(model.parameters())


def _ddp(model: torch.nn.Module, make_opt: OptFactory, opts: dict[str, Any],
         blocks: Blocks) -> tuple:
    """`hook=fp16` (torch's fp16_compress_hook) or `hook=powersgd` (torch's PowerSGD hook with
    error feedback; `rank=` its matrix rank, default 2, `start=` the first compressed
    iteration, default 2: torch's minimum with error feedback) as DDP communication hooks."""
    opts = dict(opts)
    hook, rank, start = opts.pop("hook", None), opts.pop("rank", 2), opts.pop("start", 2)
    net = torch.nn.parallel.DistributedDataParallel(model, **opts)
    if hook == "fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        net.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                                            start_powerSGD_iter=start)
        net.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    elif hook is not None:
        raise ValueError(f"ddp: unknown hook={hook!r}; expected fp16 or powersgd")
    return net, make_opt(model.parameters())


def _fsdp2(model: torch.nn.Module, make_opt: OptFactory, opts: dict[str, Any],
           blocks: Blocks) -> tuple:
    from benchmarks.baselines import fsdp2_wrap
    net = fsdp2_wrap(model, blocks)
    return net, make_opt(net.parameters())


def _wfbp(model: torch.nn.Module, make_opt: OptFactory, opts: dict[str, Any],
          blocks: Blocks) -> tuple:
    from benchmarks.baselines import WFBP
    return model, WFBP(model, make_opt(model.parameters()), **opts)


def _allreduce(model: torch.nn.Module, make_opt: OptFactory, opts: dict[str, Any],
               blocks: Blocks) -> tuple:
    from benchmarks.baselines import AllReduceAfterBackward
    return model, AllReduceAfterBackward(model, make_opt(model.parameters()))


def _zero(model: torch.nn.Module, make_opt: OptFactory, opts: dict[str, Any],
          blocks: Blocks) -> tuple:
    """torch's ZeroRedundancyOptimizer (its optimizer state sharded) under DDP."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    inner = make_opt(model.parameters())        # its class and settings, built sharded here
    net = torch.nn.parallel.DistributedDataParallel(model)
    return net, ZeroRedundancyOptimizer(model.parameters(), optimizer_class=type(inner),
                                        **inner.defaults, **opts)


def _horovod(model: torch.nn.Module, make_opt: OptFactory, opts: dict[str, Any],
             blocks: Blocks) -> tuple:
    try:
        import horovod.torch as hvd
    except ImportError as exc:
        raise RuntimeError("method 'horovod' needs Horovod installed (make horovod)") from exc
    dist.barrier()                                # every rank done with the last shutdown
    hvd.init()
    opt = make_opt(model.parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    return model, hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), **opts)


def _dear(model: torch.nn.Module, make_opt: OptFactory, opts: dict[str, Any],
          blocks: Blocks) -> tuple:
    import dear
    from benchmarks import emulated
    from dear.fusion.fusion_config import FusionConfig

    opts = dict(opts)
    if isinstance(model, emulated.EmulatedModel):
        # dear's default (row_sparse="auto") finds the real model's untied nn.Embedding tables;
        # the emulated layers are not nn.Embedding, so the word embeddings --tokens made
        # row-sparse are named for it. (The real BERT's 1.5 MB position table, which auto would
        # also send by rows, travels whole here: its emulated gradient is dense.)
        setting = opts.pop("row_sparse", None)
        if setting is None:                        # dear's own default: DEAR_ROW_SPARSE
            setting = dear.comm.runtime.config().row_sparse
        if setting in ("tables", "auto", True):
            opts["row_sparse"] = [f"{name}.weight" for name, m in model.named_modules()
                                  if getattr(m, "_tokens", 0)] or False
        elif setting not in ("off", False, ""):
            opts["row_sparse"] = setting
        else:
            opts["row_sparse"] = False
    if isinstance(opts.get("compression"), str):   # compression=fp16 / int8 / int4[-noef]
        name = opts["compression"]
        base = getattr(dear.Compression, name.removesuffix("-noef"))
        opts["compression"] = (dear.Compression.quantized(bits=base.bits,
                                                          block_size=base.block_size,
                                                          error_feedback=False)
                               if name.endswith("-noef") else base)
    sizes = {k: opts.pop(k) for k in ("rs_threshold", "ag_threshold", "first_bucket") if k in opts}
    chunk = opts.pop("chunk_bytes", None)       # alone: dear's default layout, this chunk size
    if sizes or chunk:
        cfg = dear.comm.runtime.config()
        default = (opts.pop("fusion_threshold", None) or cfg.fusion_threshold
                   or dear.config.auto_threshold(sum(p.numel() * p.element_size()
                                                     for p in model.parameters())))
        opts["fusion_config"] = FusionConfig(
            sizes.get("rs_threshold", default), sizes.get("ag_threshold", default),
            sizes.get("first_bucket") if sizes else cfg.first_bucket, chunk_bytes=chunk)
    return model, dear.DistributedOptimizer(make_opt(model.parameters()), model=model, **opts)


# name -> build(model, optimizer factory, options, blocks) -> (module to call, object with
# zero_grad() and step()). Add a method here.
BUILDERS: dict[str, Callable[..., tuple]] = {
    "ddp": _ddp, "fsdp2": _fsdp2, "wfbp": _wfbp, "allreduce": _allreduce, "horovod": _horovod,
    "zero": _zero, "dear": _dear, "none": _none,
}


# ---------------------------------------------------------------- one method's life


def _blocks_of(model: torch.nn.Module) -> list[torch.nn.Module]:
    return model.blocks()                         # type: ignore[operator]


class Built:
    """A method wrapped around one fresh model: `net(x)` for the forward, `opt.zero_grad()`,
    `clip()` after backward, `opt.step()`, and `finish()` once, which leaves the process as it
    found it (dear's last updates applied, hooks dropped, Horovod shut down, dear back on
    torch.distributed)."""

    def __init__(self, method: Method, model: torch.nn.Module, make_opt: OptFactory,
                 blocks: Optional[Blocks] = None) -> None:
        import dear

        self.method = method
        options = dict(method.options)
        self.clip_norm: Optional[float] = options.pop("clip", None)
        self.backend = options.pop("backend", None) if method.base == "dear" else None
        if self.backend is not None:               # same schedule, another backend's collectives
            dear.shutdown()
            dear.init(backend=self.backend)
        every = options.pop("commit", None) if method.base == "dear" else None
        to = options.pop("commit_to", "disk") if method.base == "dear" else None
        self.net, self.opt = BUILDERS[method.base](model, make_opt, options, blocks or _blocks_of)
        if every is not None:
            self.opt = Committing(self.opt, model, int(every), to)

    @property
    def is_dear(self) -> bool:
        return self.method.base == "dear"

    def clip(self) -> None:
        """Clip the averaged gradient to clip_norm, each method its own way (no-op without)."""
        if self.clip_norm is None:
            return
        if self.is_dear:
            self.opt.clip_grad_norm_(self.clip_norm)
        else:
            torch.nn.utils.clip_grad_norm_(self.net.parameters(), self.clip_norm)

    def finish(self) -> None:
        import dear

        if self.is_dear:
            self.opt.synchronize()                 # the last step's updates
        if isinstance(self.opt, Committing):
            self.opt.finish()
            self.opt = self.opt.opt
        release(self.opt)
        self.net = self.opt = None                # type: ignore[assignment]
        gc.collect()
        if self.method.base == "horovod":
            # Horovod's background thread keeps cycling after training: left running it would
            # take CPU from every method measured after this one (one core per rank).
            import horovod.torch as hvd
            hvd.shutdown()
        if self.backend is not None:
            dear.shutdown()
            dear.init(backend="torch")


class Committing:
    """The optimizer's step, then every `every` steps a commit of dear.elastic.State(model,
    optimizer): what a training loop that commits adds to its iteration. to="disk" commits as
    under torchrun (in memory, the host check, then a torch.distributed.checkpoint directory
    every rank writes: one shared temporary directory, removed by finish()); "memory": as under
    Horovod Elastic. Everything else is the optimizer's."""

    def __init__(self, opt: Any, model: torch.nn.Module, every: int, to: str) -> None:
        import tempfile

        from dear.elastic import State
        from dear.elastic.agent import Launch, TermWatch
        from dear.elastic.session import Session

        if every < 1 or to not in ("disk", "memory"):
            raise ValueError(f"commit={every!r}, commit_to={to!r}: commit takes a number of "
                             "steps (1 or more), commit_to 'disk' or 'memory'")
        self.opt, self.every, self.steps = opt, every, 0
        self.state = State(model=model, optimizer=opt)
        self.commit_s: list[float] = []
        self.directory: Optional[str] = None
        if to == "disk":
            made = [tempfile.mkdtemp(prefix="dear-bench-commit-") if dist.get_rank() == 0
                    else None]
            dist.broadcast_object_list(made, src=0)
            self.directory = made[0]
            os.environ["DEAR_ELASTIC_DIR"] = self.directory   # read when the session is made
            try:                                   # torchrun's worker side, without the agent
                self.state.attach(Session(Launch(run_id="bench", restart_count=0,
                                                 max_restarts=0, agent_store=False),
                                          TermWatch(), "bench", self.state.ops))
            finally:
                del os.environ["DEAR_ELASTIC_DIR"]

    def step(self, closure: Any = None) -> Any:
        out = self.opt.step(closure)
        self.steps += 1
        if self.steps % self.every == 0:
            start = time.perf_counter()
            self.state.commit()
            self.commit_s.append(time.perf_counter() - start)
        return out

    def state_mb(self) -> float:
        """The MB of tensors one in-memory commit copies (model and optimizer)."""
        from benchmarks.elastic import state_mb
        return state_mb(self.state.model, self.opt)

    def finish(self) -> None:
        import shutil
        dist.barrier()
        if self.directory is not None and dist.get_rank() == 0:
            shutil.rmtree(self.directory, ignore_errors=True)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.opt, name)


def release(opt: Any) -> None:
    """Drop the hooks a method left on its parameters. Hooks on tensors are out of the garbage
    collector's sight, so without this every method run keeps its model alive (1 GB a run for
    BERT-Base: the benchmark ran out of memory). dear's own optimizer holds itself weakly there."""
    for handle in getattr(opt, "hooks", ()):
        handle.remove()
    if hasattr(opt, "_grad_accs"):              # hvd.DistributedOptimizer: its hooks live on
        opt._grad_accs.clear()                  # these autograd nodes; let them go
