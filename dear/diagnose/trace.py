"""The tracer: module hooks, optimizer hooks and a traced communicator, for a range of iterations.

    with dear.diagnose.trace(model, optimizer, out="traces/", iterations=range(10, 20)):
        for x, y in loader: ...

or DEAR_TRACE=traces/ (DEAR_TRACE_ITERATIONS=10:20) for a dear.DistributedOptimizer. An
iteration ends when `optimizer.step()` returns (without an optimizer: when the model's next
training forward starts); iteration 0 is the first one that starts after the tracer does. Hooks
stay installed while the tracer is attached but only record inside `iterations`, so the trace
holds those iterations and nothing else. Each rank writes `<out>/rank<r>.json` (Chrome trace)
when the tracer stops: on leaving the `with` block, or with DEAR_TRACE at the first forward one
iteration after the range (at exit if the optimizer was given no model=).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import logging
import os
import time
import weakref
from typing import Any, Iterator, Optional

import torch

from ..interfaces import DearOptimizer
from .align import clock_offset, current_group
from .comm import CompletionWatcher, TracingCommunicator, ddp_comm_hook
from .recorder import Clock, CollectiveKind, Ev, Recorder
from .targets import collect_params, describe

log = logging.getLogger("dear")

# DDP keeps a comm hook for good: each traced DDP model's hook asks its slot for the tracer.
_DDP_SLOTS: "weakref.WeakKeyDictionary[torch.nn.Module, list]" = weakref.WeakKeyDictionary()


def parse_iterations(text: str) -> range:
    """'10:20' -> range(10, 20) (DEAR_TRACE_ITERATIONS)."""
    try:
        start, stop = (int(x) for x in text.split(":"))
    except ValueError:
        raise ValueError(f"trace iterations must look like START:STOP (e.g. 10:20), got {text!r}")
    return _check_iterations(range(start, stop))


def _check_iterations(iterations: Any) -> range:
    if not isinstance(iterations, range) or iterations.step != 1:
        raise TypeError(f"iterations must be a range with step 1, e.g. range(10, 20); "
                        f"got {iterations!r}")
    if iterations.start < 0 or len(iterations) == 0:
        raise ValueError(f"iterations must be a non-empty range of non-negative iteration "
                         f"numbers, got {iterations!r}")
    return iterations


class Tracer:
    """Records the iterations in `iterations` of this rank; see the module docstring.

    `inside_step`: started and stopped from inside the optimizer's step() (dear's offline
    autotuner): the step() running at start() ends no iteration (iteration 0 starts when it
    returns) and the one running at stop() ends the last iteration."""

    def __init__(self, model: Optional[torch.nn.Module] = None, optimizer: Any = None,
                 out: str = "traces", iterations: range = range(10, 20), *,
                 clock: Clock = time.perf_counter_ns, finish_after_range: bool = False,
                 inside_step: bool = False) -> None:
        if model is None and optimizer is None:
            raise ValueError("dear.diagnose.trace needs a model, an optimizer or both")
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if optimizer is not None and not callable(getattr(optimizer, "step", None)):
            raise TypeError(f"optimizer must have a step() method, got {type(optimizer).__name__}")
        self.model, self.optimizer = model, optimizer
        self.out = os.fspath(out)
        self.iterations = _check_iterations(iterations)
        self.recorder = Recorder(clock)
        self._finish_after_range = finish_after_range
        self._inside_step = inside_step
        self._count = 0
        self._recording: Optional[int] = None
        self._step_depth = 0
        self._step_start = 0
        self._handles: list[Any] = []
        self._proxy: Optional[TracingCommunicator] = None
        self._watcher: Optional[CompletionWatcher] = None
        self._ddp_slot: Optional[list] = None
        self._bucket_map: tuple[Any, dict[int, tuple[int, Optional[int]]]] = (None, {})
        self._started = self._stopped = False
        self._seen_forward = False
        self._patched: list[str] = []
        self._unobserve: list[Any] = []         # dear_observe_updates' removers
        self._schedule_was_paused = False
        self._named_modules: list[tuple[str, torch.nn.Module]] = []
        # Quantized buckets' decode-thread totals when the first recorded iteration began
        self._decode_at_start: Optional[tuple[Any, dict[str, list[float]]]] = None
        self.path: Optional[str] = None
        self.meta: dict[str, Any] = {}

    # ------------------------------------------------------------------ context manager
    def __enter__(self) -> "Tracer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def iteration(self) -> int:
        """Iterations completed since the tracer started."""
        return self._count

    @property
    def recording(self) -> Optional[int]:
        """The iteration being recorded now, or None between recorded iterations."""
        return self._recording

    def _active(self) -> Optional[int]:
        return self._recording

    # ---------------------------------------------------------------------- attach/detach
    def start(self) -> "Tracer":
        if self._started:
            raise RuntimeError("this tracer was already started; make a new one")
        self._started = True
        clock = self.recorder.clock
        self._watcher = CompletionWatcher(clock)
        comm = self._install_comm()
        flush = getattr(self.optimizer, "flush_updates", None)
        if callable(flush):
            flush()                            # no all-gather in flight while clocks align
        group = current_group(comm.inner if comm is not None else None)
        offset, origin, error = clock_offset(group, clock)
        self.meta.update(rank=group.rank, world_size=group.size, clock_offset_ns=offset,
                         clock_offset_error_ns=error, origin_ns=origin,
                         backend=comm.name if comm is not None else None)
        self._params = collect_params(self.model, self.optimizer)
        self._param_index = {id(p): i for i, (_, p) in enumerate(self._params)}
        if self.model is not None:
            self._hook_model(self.model)
        self._hook_params()
        if self.optimizer is not None:
            self._hook_optimizer(self.optimizer)
        if self._inside_step:                  # the running step() ends "iteration -1"
            self._step_depth, self._step_start = 1, clock()
        self._set_count(-1 if self._inside_step else 0, clock())
        if self._finish_after_range:
            atexit.register(self.stop)
        return self

    def stop(self, write: bool = True) -> Optional[str]:
        """Detach, wait for the traced collectives to complete, write the trace (unless not
        `write`: `document()` then gives it in memory); return its path."""
        if not self._started or self._stopped:
            return self.path
        self._stopped = True
        if self._inside_step and self._step_depth == 1:
            self._step_post()                  # the running step() ends the last iteration
        self._recording = None
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._ddp_slot is not None:
            self._ddp_slot[0] = None
        for name in self._patched:              # our instance attributes over its methods
            delattr(self.optimizer, name)
        self._patched.clear()
        for remove in self._unobserve:
            remove()
        self._unobserve.clear()
        self._uninstall_comm()
        assert self._watcher is not None
        if not self._watcher.close():
            log.warning("dear.diagnose: collectives still in flight after 600 s; their end "
                        "times are missing from the trace")
        self.path = self.write() if write else None
        return self.path

    def _install_comm(self) -> Optional[TracingCommunicator]:
        from ..comm import runtime
        dear_opt = isinstance(self.optimizer, DearOptimizer)
        opt_comm = self.optimizer.dear_communicator if dear_opt else None
        rt_comm = runtime.current_communicator()
        target = opt_comm if opt_comm is not None else rt_comm
        if target is None:
            return None
        assert self._watcher is not None
        proxy = TracingCommunicator(target, self.recorder, self._watcher, self._active,
                                    self._bucket_of, self._buffer_bytes_of)
        if opt_comm is not None:
            self.optimizer.dear_communicator = proxy
        schedule = self.optimizer.dear_schedule if dear_opt else None
        if schedule is not None:               # the replay models DeAR's order: trace that
            self._schedule_was_paused, schedule.paused = schedule.paused, True
        if rt_comm is target:
            runtime.replace_communicator(target, proxy)
        self._proxy = proxy
        return proxy

    def _uninstall_comm(self) -> None:
        from ..comm import runtime
        proxy = self._proxy
        if proxy is None:
            return
        inner = proxy.inner
        if isinstance(self.optimizer, DearOptimizer):
            if self.optimizer.dear_communicator is proxy:
                self.optimizer.dear_communicator = inner
            self.optimizer.dear_schedule.paused = self._schedule_was_paused
        runtime.replace_communicator(proxy, inner)

    # ------------------------------------------------------------------------- iterations
    def _set_count(self, count: int, t_ns: int) -> None:
        rec = self.recorder
        if self._recording is not None:
            rec.iteration_ends[self._recording] = t_ns
        self._count = count
        self._recording = count if count in self.iterations else None
        if self._recording is not None:
            rec.iteration_starts[count] = t_ns
            if self._decode_at_start is None:
                self._decode_at_start = decode_totals(self.optimizer)

    def _end_iteration(self) -> None:
        self._set_count(self._count + 1, self.recorder.clock())

    # ------------------------------------------------------------------------------ hooks
    def _hook_model(self, model: torch.nn.Module) -> None:
        self._named_modules = list(model.named_modules())
        self._handles.append(model.register_forward_pre_hook(self._root_forward))
        for idx, (_, module) in enumerate(self._named_modules):
            leaf = next(module.children(), None) is None
            self._handles.append(module.register_forward_pre_hook(
                functools.partial(self._forward_start, idx)))
            self._handles.append(module.register_forward_hook(
                functools.partial(self._forward_end, idx, leaf)))
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            self._hook_ddp(model)

    def _hook_ddp(self, ddp: torch.nn.parallel.DistributedDataParallel) -> None:
        slot: Any = _DDP_SLOTS.get(ddp)
        if slot is None:
            if getattr(ddp, "_comm_hooks", None):
                log.warning("dear.diagnose: this DDP model has its own comm hook; its "
                            "all-reduces are not traced")
                return
            slot = [None]                      # DDP keeps a comm hook for good: it asks
            ddp.register_comm_hook(ddp.process_group, ddp_comm_hook(slot))  # the slot
            _DDP_SLOTS[ddp] = slot
        slot[0] = self
        self._ddp_slot = slot

    def _hook_params(self) -> None:
        for idx, (_, p) in enumerate(self._params):
            self._handles.append(p.register_post_accumulate_grad_hook(
                functools.partial(self._grad_ready, idx)))

    def _hook_optimizer(self, optimizer: Any) -> None:
        if isinstance(optimizer, torch.optim.Optimizer):
            self._handles.append(optimizer.register_step_pre_hook(self._step_pre))
            self._handles.append(optimizer.register_step_post_hook(self._step_post))
        else:                                  # any object with step(): wrap it
            step = optimizer.step

            def traced_step(*args: Any, **kwargs: Any) -> Any:
                self._step_pre()
                try:
                    return step(*args, **kwargs)
                finally:
                    self._step_post()
            optimizer.step = traced_step
            self._patched.append("step")
        allreduce = getattr(optimizer, "_allreduce_grad_async", None)
        if callable(allreduce) and hasattr(optimizer, "_handles"):  # horovod.torch's optimizer
            optimizer._allreduce_grad_async = self._traced_horovod(allreduce)  # horovod.torch's  # noqa: SLF001
            self._patched.append("_allreduce_grad_async")
        if isinstance(optimizer, DearOptimizer):   # dear: per-bucket updates
            @contextlib.contextmanager
            def timed_update(bucket: Any) -> Iterator[None]:
                it = self._recording
                if it is None:
                    yield
                    return
                start = self.recorder.clock()
                try:
                    yield
                finally:
                    self.recorder.events.append((Ev.UPDATE, it, start, self.recorder.clock(),
                                                 bucket.spec.index))
            self._unobserve.append(optimizer.dear_observe_updates(timed_update))

    def _traced_horovod(self, allreduce: Any) -> Any:
        """Record each of Horovod's per-tensor all-reduces; the watcher polls its handle."""
        from .comm import _horovod_poll

        def traced(p: torch.Tensor) -> Any:
            it = self._recording
            if it is None or p.grad is None:
                return allreduce(p)
            grad = p.grad
            rec = self.recorder.collective(CollectiveKind.ALL_REDUCE,
                                           grad.numel() * grad.element_size(),
                                           self._param_index.get(id(p)), it)
            out = allreduce(p)
            poll = _horovod_poll(out[0] if isinstance(out, tuple) else out)
            if poll is not None and self._watcher is not None:
                self._watcher.poll_for(rec, poll)
            return out
        return traced

    def _root_forward(self, module: torch.nn.Module, args: Any) -> None:
        if not module.training:
            return
        if self.optimizer is None:
            if self._seen_forward:
                self._end_iteration()
            self._seen_forward = True
        if self._finish_after_range and self._count > self.iterations.stop:
            # DEAR_TRACE: one iteration after the range, so the last updates were applied and
            # nothing traced is in flight. (Not from a step hook: torch iterates over those.)
            self.stop()

    def _forward_start(self, idx: int, module: torch.nn.Module, args: Any) -> None:
        it = self._recording
        if it is not None and module.training:
            self.recorder.events.append((Ev.FORWARD_START, it, self.recorder.clock(), idx))

    def _forward_end(self, idx: int, leaf: bool, module: torch.nn.Module, args: Any,
                     output: Any) -> None:
        it = self._recording
        if it is None or not module.training:
            return
        self.recorder.events.append((Ev.FORWARD_END, it, self.recorder.clock(), idx))
        if leaf and torch.is_grad_enabled():
            tensor = _first_grad_tensor(output)
            if tensor is not None:
                tensor.register_hook(functools.partial(self._backward_start, idx, it))

    def _backward_start(self, idx: int, it: int, grad: torch.Tensor) -> None:
        self.recorder.events.append((Ev.BACKWARD_START, it, self.recorder.clock(), idx))

    def _grad_ready(self, idx: int, param: torch.Tensor) -> None:
        it = self._recording
        if it is not None:
            self.recorder.events.append((Ev.GRAD_READY, it, self.recorder.clock(), idx))

    def _step_pre(self, *args: Any) -> None:
        self._step_depth += 1
        if self._step_depth == 1:
            self._step_start = self.recorder.clock()

    def _step_post(self, *args: Any) -> None:
        self._step_depth -= 1
        if self._step_depth:
            return
        it = self._recording
        end = self.recorder.clock()
        if it is not None:
            self.recorder.events.append((Ev.STEP, it, self._step_start, end))
        self._set_count(self._count + 1, end)

    def _bucket_of(self, tensor: torch.Tensor) -> Optional[int]:
        return self._bucket_entry(tensor)[0]

    def _buffer_bytes_of(self, tensor: torch.Tensor) -> Optional[int]:
        """The bytes of the bucket's own buffer that a compressed wire carries (None when the
        wire is the buffer's dtype): the replay costs buckets by their buffers' bytes, so the
        link is fitted in the same units."""
        return self._bucket_entry(tensor)[1]

    def _bucket_entry(self, tensor: torch.Tensor) -> tuple[Optional[int], Optional[int]]:
        layout = self.optimizer.dear_layout if isinstance(self.optimizer, DearOptimizer) \
            else None
        if layout is None or not layout.buckets:
            return None, None
        buckets = layout.buckets
        key, table = self._bucket_map
        if key is not buckets:
            table = {}
            for b in buckets:
                slots = max((t.numel() * t.element_size() for t in b.wires
                             if not t.dtype.is_floating_point), default=0)
                for t in b.wires:
                    table[t.data_ptr()] = (b.spec.index, _buffer_bytes(b.buffer, t, slots))
            for g in layout.gather_groups:                       # fused all-gathers:
                send = g.send_buffer                                 # named by first bucket
                if send is not None:
                    first = g.buckets[0]
                    table[send.data_ptr()] = (first.spec.index,
                                              _buffer_bytes(first.buffer, send, 0))
            self._bucket_map = (buckets, table)
        return table.get(tensor.data_ptr(), (None, None))

    # ------------------------------------------------------------------------------ output
    def describe(self) -> dict[str, Any]:
        return {**self.meta, **describe(self.model, self.optimizer, self._params,
                                        self._named_modules),
                "iterations": [self.iterations.start, self.iterations.stop],
                "decode_s_per_byte": self._decode_rates()}

    def _decode_rates(self) -> dict[str, float]:
        """Seconds per bucket byte dear's decode thread spent after each reduce-scatter
        ("reduce") and all-gather ("gather") of quantized buckets in the recorded iterations
        (empty without them, or if the layout changed meanwhile)."""
        start, now = self._decode_at_start, decode_totals(self.optimizer)
        if start is None or now is None or start[0] is not now[0]:
            return {}
        return {phase: (now[1][phase][0] - seconds) / (now[1][phase][1] - nbytes)
                for phase, (seconds, nbytes) in start[1].items()
                if now[1][phase][1] > nbytes}

    def document(self) -> dict[str, Any]:
        """This rank's Chrome trace document (what `write` saves)."""
        from .chrome import build_trace
        return build_trace(self.recorder, self.describe())

    def write(self) -> str:
        doc = self.document()
        os.makedirs(self.out, exist_ok=True)
        path = os.path.join(self.out, f"rank{self.meta.get('rank', 0)}.json")
        with open(path, "w") as fh:
            json.dump(doc, fh, separators=(",", ":"))
        return path


def decode_totals(optimizer: Any) -> Optional[tuple[Any, dict[str, list[float]]]]:
    """(the layout's buckets, per phase [seconds, bytes]) summed over its quantized buckets'
    `decode_time` (dear/fusion/quantized.py); None without a dear layout."""
    layout = optimizer.dear_layout if isinstance(optimizer, DearOptimizer) else None
    if layout is None or not layout.buckets:
        return None
    totals: dict[str, list[float]] = {"reduce": [0.0, 0.0], "gather": [0.0, 0.0]}
    for bucket in layout.buckets:
        for phase, (seconds, nbytes) in getattr(bucket, "decode_time", {}).items():
            totals[phase][0] += seconds
            totals[phase][1] += nbytes
    return layout.buckets, totals


def _buffer_bytes(buffer: torch.Tensor, wire: torch.Tensor, slots: int) -> Optional[int]:
    """What `wire` carries in `buffer`'s bytes: a cast (fp16 on the wire) by its elements, a
    quantized wire by its share of the bucket's slots (`slots`: the bytes of a whole set)."""
    if wire.dtype == buffer.dtype:
        return None
    if wire.dtype.is_floating_point or not slots:
        return wire.numel() * buffer.element_size()
    return buffer.numel() * buffer.element_size() * wire.numel() * wire.element_size() // slots


def _first_grad_tensor(output: Any) -> Optional[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return output if output.requires_grad else None
    if isinstance(output, (tuple, list)):
        for item in output:
            found = _first_grad_tensor(item)
            if found is not None:
                return found
    return None


def trace(model: Optional[torch.nn.Module] = None, optimizer: Any = None, out: str = "traces",
          iterations: range = range(10, 20)) -> Tracer:
    """Context manager tracing `iterations` (counted from entry) into `<out>/rank<r>.json`."""
    return Tracer(model, optimizer, out, iterations)


def attach_from_config(optimizer: Any, model: Optional[torch.nn.Module]) -> Optional[Tracer]:
    """DEAR_TRACE: trace a dear.DistributedOptimizer from its creation; write after the range."""
    from ..comm import runtime
    cfg = runtime.config()
    if not cfg.trace:
        return None
    tracer = Tracer(model, optimizer, cfg.trace, parse_iterations(cfg.trace_iterations),
                    finish_after_range=True)
    return tracer.start()
