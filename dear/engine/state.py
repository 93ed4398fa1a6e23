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
    """Where the engine's iteration is (for errors, tests and debuggers: no branch of the data
    path reads it); the phase methods set it."""
    LEARNING = "learning"      # no layout yet: the first forward records the execution order
    IDLE = "idle"              # nothing launched since the last step(), nothing pending
    BACKWARD = "backward"      # reduce-scatters launched as buckets fill
    REDUCED = "reduced"        # every reduce-scatter finished and averaged (clip, GradScaler)
    PENDING = "pending"        # step() returned; all-gathers in flight, updates not applied


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
