"""What a script may not do behind dear's back, and how dear sees it (docs/contract.md).

Two windows matter. A `.grad` edited after backward handed it to dear (the reduce-scatter
already took the old values) is refused at step(); a parameter written between step() and
the forward that applies its update (the update would land on the written values) is refused
when it is seen. Writes that move autograd's version counter (in-place ops, clip_grad_norm_,
GradScaler.unscale_, a replaced or None `.grad`) are seen in every iteration, for free: the
counters are integers. A write through `.data` leaves the counter alone and shows only in the
contents, which costs a read of every gradient and parameter twice an iteration; so contents
are compared in the first CHECKED_FIRST iterations of every layout and then in about one
iteration in `Config.check_every` (DEAR_CHECK_EVERY; 1: every iteration), chosen by a hash of
the step count so that every rank checks the same iterations and no periodic habit can always
fall between them (`contents_checked`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

import torch

from ..fusion.bucket import Stage
from ..fusion.schedule import scope
from ..guards.validation import held_by_ddp
from ..guards.written import Fingerprint, Verdict, fingerprints, first_settled
from .state import VIEW

if TYPE_CHECKING:
    from .engine import Engine

#: Iterations after a layout is built (the first step() included) whose contents are always
#: compared: a habit of the training loop shows in its first iteration.
CHECKED_FIRST = 8

_MASK = (1 << 64) - 1


def _mix(n: int) -> int:
    """splitmix64's finalizer: consecutive step counts to unrelated 64-bit values."""
    z = (n + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def contents_checked(since_layout: int, step: int, every: int) -> bool:
    """Whether the iteration that ends in step() number `step` (counted the same on every
    rank: dear/guards/stream.py checks it), the `since_layout`-th of its layout, compares
    contents."""
    if every <= 0:
        return False
    if every == 1 or since_layout < CHECKED_FIRST:
        return True
    return _mix(step) % every == 0


def written_error(name: str, how: str) -> RuntimeError:
    """A parameter written between step() and the forward that applies its update."""
    return RuntimeError(
        f"dear: parameter {name} was written {how} after optimizer.step() and before the "
        "forward that applies its update: dear applies each update in the next forward, so "
        "it would land on the written values, while under DDP the write comes after the "
        "update. Write the parameters through the model (model.parameters(), "
        "model.state_dict() and the like apply pending updates first), or call "
        "optimizer.flush_updates() after step() and before writing (docs/deferred-update.md)")


def edited_grad_error(name: str, param: torch.nn.Parameter, views: bool) -> RuntimeError:
    """A `.grad` changed after backward handed it to dear."""
    if views:
        name += " (or of another parameter in its bucket: .grad is a view of it)"
    if held_by_ddp(param):    # the usual writer: DDP (Accelerate's prepare())
        return RuntimeError(
            f"dear: the gradient of {name} was overwritten after backward handed it to "
            "dear.DistributedOptimizer: the model is wrapped in DistributedDataParallel "
            "(by your script, or by Accelerate's prepare(), which Hugging Face's Trainer "
            "calls), and DDP all-reduces into .grad while dear averages the gradients "
            "itself. Train the plain model, not a DDP wrapper: with Hugging Face's Trainer "
            "use dear.huggingface.DeARTrainer in place of transformers.Trainer; with "
            "Accelerate, dear.huggingface.DeARAccelerator in place of Accelerator "
            "(docs/huggingface.md). This step was dropped on this rank.")
    return RuntimeError(
        f"dear: the gradient of {name} was changed after backward handed it to "
        "dear.DistributedOptimizer (edited in place, also through .data as in "
        "p.grad.data.clamp_(-1, 1), replaced or set to None), e.g. by "
        "torch.nn.utils.clip_grad_norm_ or scaler.unscale_(optimizer). dear reduces each "
        "gradient as soon as backward produces it, so the change would be silently "
        "ignored; this step was dropped on this rank. To clip, call "
        "optimizer.clip_grad_norm_(max_norm) (with a GradScaler: "
        "optimizer.clip_grad_norm_(max_norm, grad_scaler=scaler), without "
        "scaler.unscale_); to edit the averaged gradients in any other way, use Horovod's "
        "pattern: optimizer.synchronize(); <edit .grad>; with "
        "optimizer.skip_synchronize(): optimizer.step(). Hugging Face's Trainer clips, "
        "and measures the norm it logs, with torch's clip_grad_norm_ at every step: use "
        "dear.huggingface.DeARTrainer (docs/huggingface.md).")


def late_grad_error(name: Optional[str]) -> RuntimeError:
    """A `.grad` edit through `.data` seen at a later step (its contents were compared on the
    device, without stopping the host: dear/guards/written.py's Verdict)."""
    return RuntimeError(
        f"dear: the gradient of {name or 'a parameter'} was changed through .data after "
        "backward handed it to dear.DistributedOptimizer in an earlier iteration (seen "
        "now: its contents are compared on the GPU without stopping the host, so that update "
        "was applied, with what the reduce-scatters had taken: the values backward "
        "produced, or the edited ones where they were taken after the edit; this step was "
        "dropped). dear reduces "
        "each gradient as backward produces it: to clip, call "
        "optimizer.clip_grad_norm_(max_norm); to edit the averaged gradients, use Horovod's "
        "pattern: optimizer.synchronize(); <edit .grad>; with "
        "optimizer.skip_synchronize(): optimizer.step()")


# ------------------------------------------------------------------ the .grad edit check
def refuse_edited_grads(engine: "Engine") -> None:
    """Refuse, the same way in every iteration, an edit of .grad made after backward handed
    it to dear: the reduce-scatter already took the old values. A parameter written through
    .data before the last update ran shows here too (its contents are compared now)."""
    with scope("dear::check"):
        written = engine.pending.writes.written_since_step()
        if written is not None:
            engine.abandon_iteration()
            raise written_error(
                engine.names[engine.index[written]], "through .data (seen now: the update of "
                "the last step landed on the written values; this step was dropped on this "
                "rank)")
        late = _late_edit(engine)
        if late is not None:
            engine.abandon_iteration()
            raise late_grad_error(engine.names[late])
        queued = len(engine.late_edits)
        i = edited_parameter(engine)
    if i is None:
        return
    engine.late_edits.drop_from(queued)   # this iteration's own verdicts: it is refused already
    engine.abandon_iteration()
    p = engine.params[i]
    raise edited_grad_error(engine.names[i], p,
                                   engine.views is not None and engine.views.owns(p))


def edited_parameter(engine: "Engine") -> Optional[int]:
    """A parameter whose .grad changed since dear took it this iteration, or None."""
    for i, (ref, version) in engine.iteration.taken.items():
        grad = engine.params[i].grad
        if ref is None:
            if grad is not None:
                return i
        elif grad is None or (version != VIEW and grad._version != version) \
                or grad is not ref():
            return i
    by_contents = _edited_contents(engine)
    if by_contents is not None:
        return by_contents
    buckets = () if engine.layout is None else engine.layout.buckets
    if engine.views is not None and engine.layout is not None:
        edited = engine.views.edited(buckets)
        if edited is not None:
            return edited
    on_device: dict[int, Fingerprint] = {}     # C++ records of device gradients: see below
    for bucket in buckets:
        ready = bucket.ready
        if ready is not None and bucket.stage is not Stage.GATHERING:
            j = ready.first_edited(bucket.params)
            if j >= 0:
                return bucket.spec.params[j]
            for j, before in ready.device_fingerprints():
                on_device[bucket.spec.params[j]] = (before,)
    if on_device:
        return _compare_contents(engine, on_device)
    return None


def _edited_contents(engine: "Engine") -> Optional[int]:
    """A parameter whose .grad is the tensor dear took, at its version, but holds other
    values (written through .data), or None. One comparison for all."""
    taken = engine.iteration.fingerprints
    if not taken:
        return None
    return _compare_contents(engine, taken)


def _compare_contents(engine: "Engine", taken: dict[int, Fingerprint]) -> Optional[int]:
    """The parameter (index) whose gradient's contents changed since `taken` recorded them,
    or None. Fingerprints on a GPU are compared there (dear/guards/written.py's Verdict) and the
    answer read at a later step() (`_late_edit`), so the host never waits for the device."""
    grads = [engine.params[i].grad for i in taken]
    assert all(g is not None for g in grads), "the caller checked it is the gradient dear took"
    verdict = Verdict(list(taken.values()), fingerprints(grads))   # type: ignore[arg-type]
    if not verdict.on_device:
        k = verdict.first()
        return None if k is None else list(taken)[k]
    engine.late_edits.add(list(taken), verdict)
    return None


def _late_edit(engine: "Engine") -> Optional[int]:
    """A gradient edit of an earlier iteration whose verdict came back from the device since
    (or, at a flush, all of them), or None."""
    return engine.late_edits.first_settled()


class LateEdits:
    """Gradient contents compared on a GPU, whose verdicts are read at a later step()."""

    def __init__(self) -> None:
        self._queue: list[tuple[Sequence[int], Verdict]] = []

    def __len__(self) -> int:
        return len(self._queue)

    def add(self, taken: Sequence[int], verdict: Verdict) -> None:
        self._queue.append((taken, verdict))

    def drop_from(self, count: int) -> None:
        del self._queue[count:]

    def first_settled(self) -> Optional[int]:
        found, self._queue = first_settled(self._queue)
        return found
