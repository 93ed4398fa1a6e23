"""What one iteration accumulates between its first gradient and the end of its step(): one
object, replaced as a whole when the iteration ends (`_DistributedOptimizer._end_iteration`), so no
flag of one iteration can leak into the next."""

from __future__ import annotations

import dataclasses
import weakref
from typing import Optional

import torch

from .written import Fingerprint


@dataclasses.dataclass
class Iteration:
    """Per-iteration state of dear.DistributedOptimizer. Collaborators read it through the
    optimizer's `iteration` property (docs/ARCHITECTURE.md, extension points)."""

    passes: list[int]                       # backward passes seen per parameter this step
    grads_since_step: bool = False          # a backward (Python hooks) ran since step()
    next_launch: int = 0                    # position in reduce order (last bucket first)
    # What each gradient the Python hook took was (weakly) and its version: an edit of .grad
    # after dear took it would be silently ignored, so step() refuses it (native buckets keep
    # the same record in C++: GradReady.first_edited).
    taken: dict[int, tuple[Optional[weakref.ref], int]] = dataclasses.field(default_factory=dict)
    # The contents of each dense gradient the Python hook took (dear/written.py's fingerprint):
    # an edit through .data (p.grad.data.clamp_(...)) leaves the version counter where it was.
    fingerprints: dict[int, Fingerprint] = dataclasses.field(default_factory=dict)
    # Each bucket's parameters as step() found them (PendingWrites.note_step), by bucket index.
    param_prints: dict[int, list[Fingerprint]] = dataclasses.field(default_factory=dict)
    reduced: bool = False                   # reduce-scatters finished (clip_grad_norm_, step)
    stream_verified: bool = False           # dear/stream.py's check issued
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
    def start(cls, num_params: int) -> "Iteration":
        return cls(passes=[0] * num_params)
