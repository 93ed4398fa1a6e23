"""The engine's state between phases: where an iteration is (`Phase`), what it accumulates
(`Iteration`, replaced as a whole when it ends, so no flag of one iteration leaks into the
next), and what step() leaves for the next forward (`Pending`, emptied as its buckets are
applied)."""

from __future__ import annotations

import dataclasses
import enum
import weakref
from typing import Any, Optional

import torch

from ..guards.written import Fingerprint, PendingWrites

VIEW = -2   # `Iteration.taken`'s version of a gradient view: its bucket's version is checked

class Phase(enum.Enum):
    """Where the engine's iteration is. The phase methods move it along `TRANSITIONS` (and
    raise `PhaseError` on any other move), so a phase method called out of turn fails at once,
    naming both phases, instead of corrupting a bucket."""
    LEARNING = "learning"      # no layout yet: the first forward records the execution order
    IDLE = "idle"              # a layout, nothing launched since the last step(), nothing pending
    BACKWARD = "backward"      # reduce-scatters launched as buckets fill
    REDUCED = "reduced"        # every reduce-scatter finished and averaged (clip, GradScaler)
    PENDING = "pending"        # step() returned; all-gathers in flight, updates not applied


#: The moves the phase methods make. From LEARNING: the layout is built (IDLE). A bucket whose
#: module skipped the forward keeps its update pending into the next backward (PENDING to
#: BACKWARD); step() without a backward reduces nothing new (IDLE or PENDING to REDUCED).
#: Ending an iteration (step() done, or abandoned) starts the next from any phase.
TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.LEARNING: frozenset({Phase.IDLE}),
    Phase.IDLE: frozenset({Phase.BACKWARD, Phase.REDUCED}),
    Phase.BACKWARD: frozenset({Phase.BACKWARD, Phase.REDUCED}),
    Phase.REDUCED: frozenset({Phase.PENDING}),
    Phase.PENDING: frozenset({Phase.IDLE, Phase.BACKWARD, Phase.REDUCED}),
}


class PhaseError(RuntimeError):
    """A phase method called in a phase it cannot follow: a bug in dear or in a collaborator
    driving the engine (docs/ARCHITECTURE.md, "Extension points")."""


def check_transition(now: Phase, to: Phase, what: str) -> None:
    if to not in TRANSITIONS[now]:
        raise PhaseError(f"dear: {what} in phase {now.value!r}, which it cannot follow "
                         f"(from {now.value!r} the engine goes to "
                         f"{sorted(p.value for p in TRANSITIONS[now])}); this is a bug in dear "
                         "or in code driving its engine directly: please report it")


@dataclasses.dataclass
class Iteration:
    """What one iteration accumulates between its first gradient and the end of its step().
    Collaborators read it through the optimizer's `dear_iteration` (docs/ARCHITECTURE.md)."""

    passes: list[int]                       # backward passes seen per parameter this step
    grads_since_step: bool = False          # a backward (Python hooks) ran since step()
    next_launch: int = 0                    # position in reduce order (last bucket first)
    # Whether this iteration compares contents (the `.data` checks, dear/engine/checks.py):
    # decided when the iteration starts, the same on every rank.
    check_contents: bool = True
    # What each gradient the Python hook took was (weakly) and its version: an edit of .grad
    # after dear took it would be silently ignored, so step() refuses it (native buckets keep
    # the same record in C++: GradReady.first_edited).
    taken: dict[int, tuple[Optional[weakref.ref], int]] = dataclasses.field(default_factory=dict)
    # The contents of each dense gradient the Python hook took (dear/guards/written.py's
    # fingerprint): an edit through .data (p.grad.data.clamp_(...)) leaves the version counter
    # where it was.
    fingerprints: dict[int, Fingerprint] = dataclasses.field(default_factory=dict)
    # Each bucket's parameters as step() found them (PendingWrites.note_step), by bucket index.
    param_prints: dict[int, list[Fingerprint]] = dataclasses.field(default_factory=dict)
    reduced: bool = False                   # reduce-scatters finished (clip_grad_norm_, step)
    stream_verified: bool = False           # dear/guards/stream.py's check issued
    amp_found_inf: Optional[torch.Tensor] = None   # shards unscaled; the agreed found-inf
    clipped_scaled: bool = False            # clipped without knowing of a GradScaler
    synchronized: bool = False              # synchronize() put the averaged gradients in .grad
    preconditioner_synced: bool = False     # dear.KFAC called synchronize() for this step
    # clip / unscale factors that must reach chunks gathered before step(): applied to the
    # gathered gradients instead of the shards (the same multiplications, the same bits)
    deferred: list[torch.Tensor] = dataclasses.field(default_factory=list)
    # clipping's coefficients applied to the shards in place (shard_optimizer_state checks that
    # an update run early, or one it may run early next time, saw the same gradients)
    scaled: list[torch.Tensor] = dataclasses.field(default_factory=list)
    # the param groups' hyperparameters when the first reduce-scatter started (the early
    # updates of shard_optimizer_state use them; step() checks they still hold)
    hyper_at_backward: Optional[list[dict]] = None

    @classmethod
    def start(cls, num_params: int, check_contents: bool = True) -> "Iteration":
        return cls(passes=[0] * num_params, check_contents=check_contents)

    def taken_into_views(self, views: Any, params: list[torch.nn.Parameter],
                         where: list[tuple[Any, int]]) -> None:
        """Gradients taken before the buckets existed, now views of the new buffers
        (gradient_as_bucket_view): their buckets' versions are checked, not their contents
        (dear writes the buffers)."""
        for i in self.taken:
            p = params[i]
            if views.owns(p) and p.grad is not None:
                self.taken[i] = (weakref.ref(p.grad), VIEW)
                self.fingerprints.pop(i, None)
                bucket = where[i][0]
                bucket.taken_version = bucket.user_version()


@dataclasses.dataclass
class Pending:
    """What step() leaves for the next forward: the buckets whose update waits, the
    hyperparameters in force at step() (an LR scheduler may move on before the update runs),
    the clip / unscale factors the chunks gathered in backward still need, and the parameters'
    state at step() for the write checks."""

    count: int = 0
    hyper: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    deferred: list[torch.Tensor] = dataclasses.field(default_factory=list)
    writes: PendingWrites = dataclasses.field(default_factory=PendingWrites)


@dataclasses.dataclass
class ForwardOrder:
    """What the iterations before the first layout show: the parameters in first-execution
    order and the modules in first-run order (the forward), or the gradients' order (without
    model=); rank 0's becomes the layout's order."""

    params: list[int] = dataclasses.field(default_factory=list)
    seen: set[int] = dataclasses.field(default_factory=set)
    modules: dict[torch.nn.Module, None] = dataclasses.field(default_factory=dict)
    grads: list[int] = dataclasses.field(default_factory=list)

    def saw_module(self, module: torch.nn.Module, index: dict[torch.nn.Parameter, int]) -> None:
        self.modules.setdefault(module)
        for p in module.parameters(recurse=False):
            i = index.get(p)
            if i is not None and i not in self.seen:
                self.seen.add(i)
                self.params.append(i)


def hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    """A param group's hyperparameters (tensors copied: the scheduler may change them in place)."""
    return {k: v.clone() if isinstance(v, torch.Tensor) else v
            for k, v in group.items() if k != "params"}


def same_hyperparameters(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    def same(x: Any, y: Any) -> bool:
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            return (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)
                    and x.shape == y.shape and bool(torch.equal(x, y)))
        return bool(x == y)
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(same(x[k], y[k]) for k in x) for x, y in zip(a, b))
