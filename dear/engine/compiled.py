"""The pre-forward phase under torch.compile: an opaque custom op instead of a graph break.

A module's pre-forward hook waits for its buckets' all-gathers and runs the wrapped optimizer's
update. Dynamo cannot trace that, and a graph break inside a submodule's hook makes dynamo compile
every later submodule call as a frame of its own: the same `Module._call_impl` and
`Conv2d.forward` code objects get one cache entry per module instance, the recompile limit is
reached and the rest of the model falls back to eager
(docs/benchmarks.md#torchcompile-without-graph-breaks).

So when dynamo traces the hook, the hook emits `torch.ops.dear.pre_forward(x, token)` instead: an
op of the graph like any other, which at run time does exactly what the eager hook does and
returns `x` (a copy: a custom op may not return its input). The module reads `x` through the
op's output, so no compiler can run the module before its update, whatever it reorders; the
graph has no break, and the all-gathers still overlap the forward.

Under torch.compile every module holding trained parameters keeps its hook and emits the op: a
wait placed only in each bucket's first module would be cheaper (no copy, no fusion barrier at
the other modules) but is not safe, since a module of the same bucket that does not consume the
first one's output (a parallel branch, an embedding lookup) may be scheduled before it. In eager
mode the engine keeps only each bucket's first module hooked once it has seen the modules run in
a fixed order (dear/engine/hooks.py); dynamo guards on hooks, so once a compiled graph has run
the op (`compiled_seen`) every hook stays.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any, Callable, Optional

import torch

from ..guards import model_guard

Eager = Callable[[torch.nn.Module, tuple[Any, ...]], None]

_tokens = itertools.count(1)
_hooks: "weakref.WeakValueDictionary[int, PreForwardHook]" = weakref.WeakValueDictionary()


@torch.library.custom_op("dear::pre_forward", mutates_args=())
def _pre_forward_op(x: torch.Tensor, token: int) -> torch.Tensor:
    global compiled_seen
    compiled_seen = True
    hook = _hooks.get(token)
    if hook is not None:
        hook.run_eager((x,))
    return x.clone()


@_pre_forward_op.register_fake
def _(x: torch.Tensor, token: int) -> torch.Tensor:
    return torch.empty_like(x)


torch.library.register_autograd("dear::pre_forward", lambda ctx, grad: (grad, None))

#: A compiled graph has run the op: dynamo guards on the modules' hooks, so whoever adds and
#: removes hooks between iterations (dear/engine/hooks.py) stops doing so (each change would
#: recompile).
compiled_seen = False

def _no_callback_known() -> Any:
    return True                         # (older torch) always through torch.compiler.disable


try:                                    # None while no torch.compile'd code runs
    from torch._C._dynamo.eval_frame import get_eval_frame_callback
    _frame_callback: Callable[[], Any] = get_eval_frame_callback
except ImportError:                     # pragma: no cover
    _frame_callback = _no_callback_known


class PreForwardHook:
    """One module's pre-forward hook; `remove()` and `id` as torch's hook handles have.
    `detach()` / `attach()` take it off the module and put it back (first of its pre-hooks, as
    when registered: a hook that computes a weight from parameters, such as weight_norm's,
    must see them updated)."""

    def __init__(self, module: torch.nn.Module, eager: Eager) -> None:
        self.token = next(_tokens)
        self._module = weakref.ref(module)
        self._eager = eager
        _hooks[self.token] = self
        disabled = torch.compiler.disable(eager, recursive=True)
        token = self.token

        def hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                 ) -> Optional[tuple[tuple[Any, ...], dict[str, Any]]]:
            if torch.compiler.is_compiling():
                for k, a in enumerate(args):
                    if isinstance(a, torch.Tensor):
                        x = torch.ops.dear.pre_forward(a, token)
                        return args[:k] + (x,) + args[k + 1:], kwargs
                for key, a in kwargs.items():
                    if isinstance(a, torch.Tensor):
                        return args, {**kwargs, key: torch.ops.dear.pre_forward(a, token)}
            if _frame_callback() is None:
                eager(module, args)      # plain eager: no compiled frame to keep out of it
            else:
                disabled(module, args)   # inside compiled code, or traced with no tensor
            return None
        self._hook = hook
        self.handle: Any = None
        self.attach()

    @property
    def attached(self) -> bool:
        return self.handle is not None

    def attach(self) -> None:
        module = self._module()
        if self.handle is not None or module is None:
            return
        self.handle = module.register_forward_pre_hook(self._hook, with_kwargs=True,
                                                       prepend=True)
        self.id = self.handle.id
        model_guard.track(self.handle)

    def detach(self) -> None:
        if self.handle is not None:
            model_guard.untrack(self.handle)
            self.handle.remove()
            self.handle = None

    def run_eager(self, args: tuple[Any, ...]) -> None:
        module = self._module()
        if module is not None:
            self._eager(module, args)

    def remove(self) -> None:
        _hooks.pop(self.token, None)
        self.detach()
