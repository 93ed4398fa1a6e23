"""Where dear's code is called from: a gradient hook on each trained parameter (C++ on the
native path: it records the gradient in its bucket without a Python frame and calls Python only
when the bucket is full or the iteration is unusual) and a forward pre-hook on each module that
holds one (dear/engine/compiled.py: an op of the graph under torch.compile).

Parameters' hooks live where the garbage collector cannot follow them: they hold the engine
weakly, or a dropped optimizer would keep itself and the model alive forever. The model's hooks
hold it strongly, so while the model lives a pending update is never lost.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch

from .. import native
from ..comm import runtime
from ..guards import model_guard
from . import compiled
from .compiled import PreForwardHook

if TYPE_CHECKING:
    from ..fusion.bucket import Bucket
    from .engine import Engine
    from .state import Iteration


class Hooks:
    """The handles of one engine's hooks, and the switch its C++ gradient hooks read."""

    def __init__(self) -> None:
        self.handles: list[Any] = []
        self.switch: Any = None                # the C++ hooks' HookSwitch (None: Python hooks)
        self.native: list[Any] = []            # the C++ GradHook of each parameter
        self.modules: dict[torch.nn.Module, PreForwardHook] = {}   # every module's pre-hook
        self.kept: Optional[frozenset[torch.nn.Module]] = None   # narrowed to these (None: all)

    def register(self, engine: "Engine") -> None:
        """A gradient hook on each parameter, a forward pre-hook on each module holding one."""
        on_grad = weak_method(engine.post_backward)
        # Native path: a C++ hook per parameter records gradients without a Python frame and
        # falls back to post_backward whenever `arm` says the iteration is not a plain one.
        ext = native.extension() if native.enabled(runtime.config().native) else None
        self.switch = ext.HookSwitch() if ext is not None else None
        self.native = []
        for i, p in enumerate(engine.params):
            if ext is not None:
                hook: Any = ext.GradHook(self.switch, i, engine.names[i], on_grad,
                                         weak_method(engine.launch))
                self.native.append(hook)
            else:
                hook = _python_hook(on_grad, i)
            self.handles.append(p.register_post_accumulate_grad_hook(hook))
        if engine.model is not None:
            self._hook_model(engine, engine.model)

    def _hook_model(self, engine: "Engine", model: torch.nn.Module) -> None:
        pre_forward = weak_method(engine.pre_forward)
        for module in model.modules():
            if module is model or any(p in engine.index
                                      for p in module.parameters(recurse=False)):
                # eager, or an op of the graph under torch.compile (dear/engine/compiled.py)
                hook = PreForwardHook(module, pre_forward)
                self.modules[module] = hook
                self.handles.append(hook)
        if engine.views is not None:
            # Backward writes into the buffers at once: an update still pending when the
            # forward ends (its module did not run) must read them first.
            self.handles.append(model_guard.track(
                model.register_forward_hook(eager(engine.after_forward))))
        # Loading into the model through a container that holds it (parent.load_state_dict)
        # reaches it here, not through its own load_state_dict (dear/guards/model_guard.py): a
        # pending update applied after the load would overwrite what was loaded.
        flush = weak_method(engine.flush)
        self.handles.append(model_guard.track(model.register_load_state_dict_pre_hook(
            lambda *args: flush())))

    def arm(self, buckets: Optional[Sequence["Bucket"]], provisional: bool,
            iteration: "Iteration", passes_needed: int) -> None:
        """Let the C++ hooks take gradients only in a plain iteration: buckets built for good,
        one backward pass per step, nothing reduced early (clip_grad_norm_). Buckets with a
        pending update send their gradients to post_backward themselves (GradReady.pending).
        Whether they digest the gradients they take follows the iteration's checks."""
        if self.switch is not None:
            self.switch.fast = (buckets is not None and not provisional
                                and not iteration.reduced and passes_needed == 1)
        for bucket in buckets or ():
            if bucket.ready is not None:
                bucket.ready.set_digest(iteration.check_contents)

    def hook_modules(self, keep: Optional[set[torch.nn.Module]]) -> None:
        """Hook only the modules in `keep` (each bucket's first module and the root: the
        engine's choice), or every module holding trained parameters (None). A pre-hook costs
        a module call the slow path of torch's Module.__call__, for each of the ~100 modules of
        a ResNet-50 or BERT-Base (docs/benchmarks.md#module-hooks-only-where-needed); dynamo
        guards on the hooks, so once a compiled graph ran dear's op (dear/engine/compiled.py)
        they all stay."""
        if keep is not None and compiled.compiled_seen:
            keep = None
        kept = None if keep is None else frozenset(keep)
        if kept == self.kept:
            return
        for module, hook in self.modules.items():
            if kept is None or module in kept:
                hook.attach()
            else:
                hook.detach()
        self.kept = kept

    def bind(self, buckets: Optional[Sequence["Bucket"]],
             where: Sequence[tuple["Bucket", int]]) -> None:
        """Point each C++ hook at its slot in the new layout (none: no layout yet)."""
        for i, hook in enumerate(self.native):
            ready = where[i][0].ready if buckets is not None else None
            if ready is None:
                hook.unbind()
            else:
                hook.bind(ready, where[i][1])

    @property
    def any(self) -> bool:
        """A gradient was recorded by a C++ hook since the flag was last cleared."""
        return bool(self.switch is not None and self.switch.any)

    @any.setter
    def any(self, value: bool) -> None:
        if self.switch is not None:
            self.switch.any = value

    def remove(self) -> None:
        remove_hooks(self.handles)
        self.handles.clear()
        self.modules.clear()
        self.kept = None


def weak_method(method: Callable[..., Any]) -> Callable[..., Any]:
    """`method` called through a weak reference to its object: a no-op once it is collected."""
    import weakref
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> Any:
        bound = ref()
        return None if bound is None else bound(*args)
    return call


def _python_hook(on_grad: Callable[..., Any], i: int) -> Callable[[torch.Tensor], Any]:
    return lambda param: on_grad(i, param)


def eager(hook: Callable[..., Any]) -> Callable[..., Any]:
    """`hook` run eagerly under torch.compile: it waits for all-gathers and runs the wrapped
    optimizer's update, which dynamo cannot trace; the compiled graph breaks around it."""
    return torch.compiler.disable(hook, recursive=True)


def remove_hooks(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()
