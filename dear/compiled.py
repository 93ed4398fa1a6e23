"""The pre-forward phase under torch.compile: an opaque custom op instead of a graph break.

A module's pre-forward hook waits for its buckets' all-gathers and runs the wrapped optimizer's
update. Dynamo cannot trace that, and a graph break inside a submodule's hook makes dynamo compile
every later submodule call as a frame of its own: the same `Module._call_impl` and
`Conv2d.forward` code objects get one cache entry per module instance, the recompile limit is
reached and the rest of the model falls back to eager (issue 33: 51 recompiles on a ResNet-18).

So when dynamo traces the hook, the hook emits `torch.ops.dear.pre_forward(x, token)` instead: an
op of the graph like any other, which at run time does exactly what the eager hook does and
returns `x` (a copy: a custom op may not return its input). The module reads `x` through the
op's output, so no compiler can run the module before its update, whatever it reorders; the
graph has no break, and the all-gathers still overlap the forward.

Every module holding trained parameters emits the op, as every module runs the eager hook: a
wait placed only in each bucket's first module would be cheaper (no copy, no fusion barrier at
the other modules) but is not safe, since a module of the same bucket that does not consume the
first one's output (a parallel branch, an embedding lookup) may be scheduled before it.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any, Callable, Optional

import torch

Eager = Callable[[torch.nn.Module, tuple[Any, ...]], None]

_tokens = itertools.count(1)
_hooks: "weakref.WeakValueDictionary[int, PreForwardHook]" = weakref.WeakValueDictionary()


@torch.library.custom_op("dear::pre_forward", mutates_args=())
def _pre_forward_op(x: torch.Tensor, token: int) -> torch.Tensor:
    hook = _hooks.get(token)
    if hook is not None:
        hook.run_eager((x,))
    return x.clone()


@_pre_forward_op.register_fake
def _(x: torch.Tensor, token: int) -> torch.Tensor:
    return torch.empty_like(x)


torch.library.register_autograd("dear::pre_forward", lambda ctx, grad: (grad, None))


class PreForwardHook:
    """One module's pre-forward hook; `remove()` and `id` as torch's hook handles have."""

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
            disabled(module, args)   # eager, or traced with no tensor to carry the order
            return None
        self.handle = module.register_forward_pre_hook(hook, with_kwargs=True)
        self.id = self.handle.id

    def run_eager(self, args: tuple[Any, ...]) -> None:
        module = self._module()
        if module is not None:
            self._eager(module, args)

    def remove(self) -> None:
        _hooks.pop(self.token, None)
        self.handle.remove()
