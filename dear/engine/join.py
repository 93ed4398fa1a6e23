"""dear.join(): uneven inputs, as DDP's `Join` and Horovod's `hvd.join()`.

    with dear.join(optimizer):
        for x, y in loader:                  # ranks may hold different numbers of batches
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()
            optimizer.step()

Collective order. Inside the context every rank that still has data starts each iteration (its
first training forward after a step()) with one tiny all-reduce, "who is still active", issued
from a forward pre-hook on the model before anything else of that iteration. A rank whose loop
has ended (it reached `__exit__`) issues the same all-reduce, saying "not active"; while the
answer names an active rank it shadows that rank's iteration with a `step()` of its own without
gradients: every parameter counts as unused (zero gradient, usage flag 0), so it issues the
same reduce-scatters (all of them, in reduce order, inside step(); the active ranks issue the
same ones during backward, in the same order), then the buffer broadcast, then the same
all-gathers, as an active rank's step(). The answer "nobody is active" reaches every rank in the
same round, so all leave together. An active rank's `optimizer.clip_grad_norm_()` (one tiny
all-gather) is shadowed too, as in the rank's own last iteration: so a loop inside dear.join()
clips in every iteration or in none, and when it clips every rank needs at least one batch (a
rank without any cannot know that the others clip).

Semantics, as DDP's Join (divide_by_initial_world_size=True): a joined rank contributes zero
gradients and the average still divides by the whole world size. A joined rank applies the
averaged update it receives, so its optimizer state (momentum, Adam's moments, step counts)
stays equal to the active ranks'; at the end every rank takes the parameters and buffers of the
highest rank among the last to join (DDP: the "last joiner"), which also undoes any difference
in hyperparameters (an LR scheduler that only the active ranks stepped). Buffers are broadcast
from the highest active rank in each iteration (DDP's choice under Join); dear broadcasts in
step() from the ranks active in that iteration, DDP before the next forward from those active
in the next one, so they differ only after the highest active rank joins: under DDP the next
highest keeps its own buffers for its next forward, under dear it starts from the joined rank's.

Several optimizers (`dear.join([opt_a, opt_b])`, e.g. SparseAdam for embeddings and Adam for
the rest) are shadowed in list order: list them so that an optimizer whose parameters get their
gradients earlier in backward comes first (the order their reduce-scatters are issued in; any
order when at most one of them has dense parameters), and give every rank at least one batch.

Not shadowed (refused when used inside the context, on every rank at the same step):
GradScaler (`scaler.step(optimizer)`); dear.KFAC is not supported inside it.
"""

from __future__ import annotations

import functools
from types import TracebackType
from typing import Any, Optional, Sequence, Union

import torch

from ..fusion.executor import issue_pending
from ..guards import model_guard
from ..guards.validation import broadcast_model
from ..interfaces import DearOptimizer


class join:  # noqa: N801 (used like a function: `with dear.join(optimizer):`)
    """Context manager for loops whose ranks run different numbers of iterations."""

    def __init__(self, optimizer: Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer]],
                 model: Optional[torch.nn.Module] = None, *, enable: bool = True) -> None:
        """`optimizer`: what dear.DistributedOptimizer returned, or a list of them in the order
        the loop steps them (e.g. SparseAdam for embeddings, then Adam). `model`: the module
        whose forward starts an iteration (default: the first optimizer's model=)."""
        opts: list[Any] = (list(optimizer) if isinstance(optimizer, (list, tuple))
                           else [optimizer])
        if not opts or not all(isinstance(o, DearOptimizer) for o in opts):
            raise TypeError("dear.join() takes the optimizer(s) dear.DistributedOptimizer "
                            "returned")
        if model is None:
            model = next((o.dear_model for o in opts if o.dear_model is not None), None)
        if model is None:
            raise ValueError("dear.join() needs the model, whose forward starts each iteration: "
                             "pass model= to dear.DistributedOptimizer or to dear.join()")
        self._opts = opts
        self._model = model
        self._comm = opts[0].dear_communicator
        self._enabled = enable and self._comm.size > 1
        self._hooks: list[Any] = []
        self._armed = True                     # the next training forward starts an iteration
        self._clipped = [False] * len(opts)    # each optimizer clipped in this rank's last step
        self._last_active: list[int] = list(range(self._comm.size))

    # ----------------------------------------------------------------- while this rank has data
    def __enter__(self) -> "join":
        if not self._enabled:
            return self
        self._hooks = [
            # Eager even under torch.compile: the hook issues a collective.
            self._model.register_forward_pre_hook(torch.compiler.disable(self._on_forward),
                                                  prepend=True),
        ]
        for k, opt in enumerate(self._opts):
            self._hooks += [opt.register_step_pre_hook(functools.partial(self._on_step, k)),
                            opt.register_step_post_hook(self._rearm)]
        self._set_buffer_root(self._last_active)
        return self

    def _on_forward(self, module: torch.nn.Module, args: Any) -> None:
        if self._armed and module.training and torch.is_grad_enabled():
            self._armed = False
            self._exchange(active=True)

    def _on_step(self, k: int, opt: Any, args: Any, kwargs: dict[str, Any]) -> None:
        if kwargs.get("grad_scaler") is not None:
            raise NotImplementedError(
                "GradScaler inside dear.join() is not supported: a rank that has joined cannot "
                "shadow the scaler's inf check. Train without the scaler (or with bf16 "
                "autocast) inside dear.join(), or give every rank the same number of batches")
        # optimizer.clip_grad_norm_ ran this iteration
        self._clipped[k] = opt.dear_iteration.reduced

    def _rearm(self, *args: Any) -> None:
        self._armed = True

    # ------------------------------------------------------------------ after this rank's loop
    def __exit__(self, exc_type: Optional[type], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        if not self._enabled or exc_type is not None:
            return
        params = [p for opt in self._opts for g in opt.param_groups for p in g["params"]]
        for p in params:                       # this rank's last gradients were reduced already
            p.grad = None
        previous = self._last_active
        while True:
            active = self._exchange(active=False)
            if not active:
                break
            previous = active
            for opt in self._opts:
                # "A backward ran" (of nothing): step() communicates, every gradient counting
                # as unused, instead of taking its no-backward path. The reduce-scatters the
                # others' backward issues come first, for every optimizer, in list order.
                opt.dear_iteration.grads_since_step = True
                opt.dear_finish_reduce(verify=False)   # its check: at clip or step()
            for opt, clipped in zip(self._opts, self._clipped):
                if clipped:
                    opt.clip_grad_norm_(1.0)   # zeros: the max_norm does not matter
                opt.step()
            for p in params:
                p.grad = None
        for opt in self._opts:
            opt.flush_updates()
        self._final_sync(max(previous))
        for opt in self._opts:
            if opt.dear_buffer_sync is not None:
                opt.dear_buffer_sync.root = 0

    # ------------------------------------------------------------------------------ helpers
    def _exchange(self, active: bool) -> list[int]:
        """The all-reduce every rank issues once per iteration: which ranks are still active."""
        issue_pending()
        with model_guard.quiet():              # a device lookup, not a read of the weights
            device = next((p.device for p in self._model.parameters()), torch.device("cpu"))
        mask = torch.zeros(self._comm.size, device=device)
        mask[self._comm.rank] = float(active)
        self._comm.all_reduce(mask).wait()
        ranks = [r for r, flag in enumerate(mask.tolist()) if flag > 0]
        if ranks:
            self._last_active = ranks
            self._set_buffer_root(ranks)
        return ranks

    def _set_buffer_root(self, active: list[int]) -> None:
        for opt in self._opts:
            if opt.dear_buffer_sync is not None:
                opt.dear_buffer_sync.root = max(active)

    def _final_sync(self, root: int) -> None:
        """Every rank takes `root`'s parameters and buffers (DDP's final model sync)."""
        issue_pending()
        broadcast_model(self._model, self._comm, root)
