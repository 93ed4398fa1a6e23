"""Where a bucket's update runs: the strategy the engine is given.

`Updates` (the default): every rank holds the whole optimizer state; step() starts the
all-gathers of the averaged gradients and the next forward runs the wrapped optimizer on each
bucket's parameters just before their first module (`apply`).

`ShardedUpdates` (shard_optimizer_state=True, dear/sharding/state.py): each rank holds and updates
only its 1/N shard of each bucket; the update runs in step() on the averaged shard, right before the
all-gather of its group, which then carries the new parameters; the next forward only copies
them in (`apply`). Under the planned schedule a bucket whose chunks go in backward is updated
before its first chunk (`before_gather`), undoably: step() keeps those updates only if nothing
they assumed changed (`settle`).
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch

from ..comm.launch import host_name
from ..fusion.bucket import Bucket, Stage
from ..fusion.schedule import scope
from ..sharding import commit as shard_commit
from ..sharding.commit import ShardCommit
from ..sharding.state import KFAC_REFUSED, ShardedState, meet_every_rank, tensor_bytes
from ..shardops import clip
from .state import hyperparameters, same_hyperparameters

if TYPE_CHECKING:
    from .engine import Engine


class Updates:
    """The wrapped optimizer's update on whole buckets, in the next forward."""

    sharded = False
    #: step() fingerprints the parameters for the write checks (dear/guards/written.py's
    # PendingWrites)
    prints_at_step = True

    def launched(self, engine: "Engine", bucket: Bucket) -> None:
        """A bucket's reduce-scatter is about to start (training thread)."""

    def settle(self, engine: "Engine", grad_scaler: Optional[Any], gradients: bool) -> None:
        """step(), every reduce-scatter done: nothing was updated early."""

    def updater(self, engine: "Engine", gradients: bool
                ) -> Optional[Callable[[Sequence[Bucket]], None]]:
        """What runs before each all-gather group is issued (None: nothing)."""
        return None

    def end_step(self) -> None:
        """step()'s all-gathers are issued."""

    def apply(self, engine: "Engine", bucket: Bucket,
              more: Sequence[Bucket] = ()) -> None:
        """The update of `bucket`, its all-gather waited for: its parameters get the averaged
        gradients as .grad (a view into the gathered buffer) for the wrapped optimizer's step,
        on them only, with the hyperparameters of step(); the user's .grad is put back. Calls
        `engine.applied(bucket)` once the update ran (not when the all-gather failed).
        `more`: buckets updated in the same call of the optimizer."""
        buckets = [bucket, *more]
        used = []
        for b in buckets:                      # every wait first: a failed one swaps nothing
            used.append(engine.finish_all_gather(b))
            engine.apply_deferred(b)
        saved = [b.swap_grads(b.grad_views if b.all_used_here else
                              [v if u else None for v, u in zip(b.grad_views, flags)])
                 for b, flags in zip(buckets, used)]
        groups = engine.opt.param_groups
        originals = [dict(g) for g in groups]
        hyper = engine.pending.hyper
        try:
            members = [group_members(engine, b) for b in buckets]
            for k, g in enumerate(groups):
                if k < len(hyper) and k < len(members[0]):
                    g.update(hyper[k])
                    g["params"] = [p for m in members for p in m[k]]
                else:                          # added after step(): not in this update
                    g["params"] = []
            engine.inner_step(engine.opt)
        finally:
            for g, original in zip(groups, originals):
                g.update(original)
            for b, grads in zip(buckets, saved):
                b.swap_grads(grads)
                b.zero_pending_views()         # zero_grad() while it was pending
                engine.applied(b)

    def state_dict(self, engine: "Engine", torch_state_dict: Callable[[], dict[str, Any]]
                   ) -> dict[str, Any]:
        """optimizer.state_dict(): torch's, of the state the optimizer holds."""
        return torch_state_dict()

    def loaded(self, engine: "Engine") -> None:
        """optimizer.load_state_dict() ran: the param groups may be others now."""
        for bucket in engine.buckets or ():
            bucket.group_members = None  # type: ignore[attr-defined]

    #: Horovod Elastic's last commit of sharded state, and the world's generation (sharded)
    commit: Optional[ShardCommit] = None
    generation = 0

    def abandon(self, engine: "Engine") -> bool:
        """The world this state was cut for is gone (Horovod Elastic): whether the optimizer
        holds the whole state now (here it always does)."""
        return True

    def make_commit(self, engine: "Engine") -> bool:
        """Horovod Elastic's commit of sharded state: none here (the state is whole)."""
        return False

    def resume(self, engine: "Engine", commit: Optional[ShardCommit], generation: int) -> bool:
        """A new world: nothing sharded to put back together."""
        return False

    def undo_early(self, engine: "Engine") -> None:
        """Nothing runs early."""

    def unshard(self, engine: "Engine") -> None:
        """The whole state is already in the optimizer."""

    def release(self, engine: "Engine") -> None:
        """Before a new layout: the whole state stays in the optimizer."""

    def layout(self, buckets: Sequence[Bucket]) -> None:
        """A new layout is in force."""

    def clear(self) -> None:
        """What was cut for the layout is dropped (its world is gone)."""

    def check_step_without_backward(self) -> None:
        """step() with zero gradients only (Horovod's broadcast_optimizer_state): allowed."""

    def check_discard(self) -> None:
        """discard_pending_updates(): allowed."""

    def check_transform(self) -> None:
        """dear.KFAC's eigenbasis path: allowed."""

    def memory(self) -> tuple[int, int, int]:
        """Bytes beyond the buckets' buffers and the optimizer's own state: (buffers, state,
        peak saved for undo)."""
        return 0, 0, 0


def group_members(engine: "Engine", bucket: Bucket) -> list[list[torch.nn.Parameter]]:
    """The bucket's parameters by param group (cached on the bucket: built once per layout,
    dropped by load_state_dict, which may bring other groups)."""
    members = getattr(bucket, "group_members", None)
    if members is None:
        groups = engine.opt.param_groups
        owner = {p: gi for gi, g in enumerate(groups) for p in g["params"]}
        members = [[] for _ in groups]
        for p in bucket.params:
            members[owner[p]].append(p)
        bucket.group_members = members  # type: ignore[attr-defined]
    return members


class ShardedUpdates(Updates):
    """shard_optimizer_state=True: this rank's update of its shards, in step()."""

    sharded = True
    prints_at_step = False                     # settle() takes them (ShardedState.unwritten)

    def __init__(self, state: ShardedState) -> None:
        self.state = state
        # Horovod Elastic: this rank's part of the last commit (dear/sharding/commit.py), kept
        # from world to world until the next commit; the steps since it (a reset without a
        # restore must find the shards as committed); this world's generation (it names the
        # commits) and each rank's host (where the copies go).
        self.commit: Optional[ShardCommit] = None
        self.generation = 0
        self._commits = 0
        self._since_commit = 0
        self._hosts: Optional[list[str]] = None

    def launched(self, engine: "Engine", bucket: Bucket) -> None:
        it = engine.iteration
        if it.hyper_at_backward is None:
            it.hyper_at_backward = [hyperparameters(g) for g in engine.opt.param_groups]
            self.state.attributes = dict(engine.opt.__dict__)   # read on that thread
        self.state.launched(bucket, engine.schedule.updates_early)

    def before_gather(self, engine: "Engine", bucket: Bucket) -> None:
        """Before the first chunk of `bucket` is gathered in backward (on the collective
        thread): this rank's update of its shard, with the hyperparameters of the start of
        backward, undoable until step() keeps it. A bucket some parameter of which had no
        gradient here is left alone: then not every rank had them all, and every rank undoes."""
        hyper = engine.iteration.hyper_at_backward
        if hyper is None or not bucket.all_used_here:
            return
        with scope("dear::update_early"):
            self.state.update_early(engine.opt, engine.inner_step, bucket, hyper)

    def settle(self, engine: "Engine", grad_scaler: Optional[Any], gradients: bool) -> None:
        """step(), sharded, every reduce-scatter done: keep the updates run early only if
        step() would run the same ones: no GradScaler, clipping that scaled by exactly 1,
        every parameter with a gradient on some rank (on every rank, as each assumed), the
        same hyperparameters and no parameter written since. Else undo them (the same decision
        on every rank: these are global facts). Whether the next iteration may run them early
        follows from the same test. The parameters' fingerprints that test takes go into the
        iteration's param_prints (step() writes no parameter, and undoing touches only the
        optimizer state: note_step reuses them)."""
        it = engine.iteration
        engine.stream.settle()                 # everyone_used
        kept = (grad_scaler is None and not gradients and engine.stream.everyone_used
                and all(bool((f == 1).all()) for f in it.deferred + it.scaled)
                and it.hyper_at_backward is not None
                and same_hyperparameters(it.hyper_at_backward,
                                         [hyperparameters(g) for g in engine.opt.param_groups])
                and self.state.unwritten(it.param_prints))
        engine.schedule.held = not kept
        if not kept:
            self.undo_early(engine)
        it.deferred = []                       # each was 1 (or was applied to the shards)

    def updater(self, engine: "Engine", gradients: bool
                ) -> Optional[Callable[[Sequence[Bucket]], None]]:
        """step(): the wrapped optimizer's update on this rank's shards of some buckets (those
        not updated early), called for each all-gather group before it is issued. After the
        stream check: nothing of a step is applied before it passed; which parameters some
        rank had a gradient for is learnt once, here (maybe a collective)."""
        if gradients:
            return None
        assert engine.buckets is not None
        engine.stream.settle()
        used = _used_anywhere(engine)
        hyper = [hyperparameters(g) for g in engine.opt.param_groups]
        state = self.state

        def update(buckets: Sequence[Bucket]) -> None:
            with scope("dear::update_shards"):
                state.update(engine.opt, engine.inner_step, used, hyper, only=buckets)
        return update

    def end_step(self) -> None:
        self.state.end_step()
        self._since_commit += 1

    def abandon(self, engine: "Engine") -> bool:
        """The shards were cut for a world that is gone, and some of them with it: they are
        dropped, and the last commit's pieces (kept) are what the next world resumes from;
        whether that loses nothing: no step updated the shards since the commit (Horovod
        raises its host update from commit()), or nothing was sharded."""
        sharded = self.state.sharded_now
        self.state.clear()
        return not sharded or (self.commit is not None and self._since_commit == 0)

    def make_commit(self, engine: "Engine") -> bool:
        """Horovod Elastic's commit (every rank): this rank's pieces, and copies of another
        rank's, kept in memory (dear/sharding/commit.py); False, doing nothing, while the
        state is whole in the optimizer (no layout yet)."""
        if not self.state.sharded_now:
            return False
        engine.flush()
        self.undo_early(engine)
        comm = engine.comm
        if self._hosts is None:
            self._hosts = comm.all_gather_object(host_name())
        own = self.state.own_pieces() or []
        self._commits += 1
        self.commit = shard_commit.make(comm, own, self._hosts,
                                        (self.generation, self._commits),
                                        lambda i: engine.params[i].device)
        self._since_commit = 0
        return True

    def resume(self, engine: "Engine", commit: Optional[ShardCommit], generation: int) -> bool:
        """Every rank of a new world, at the same point (after `rejoin`): the last commit's
        pieces, wherever the survivors hold them, become this world's interim cut, placed
        into the shards at the next layout; whether there were any."""
        self.commit = commit
        self.generation, held = shard_commit.agree(engine.comm, commit, generation)
        if held is None:
            return False
        self.state.carry(held)
        return True

    def apply(self, engine: "Engine", bucket: Bucket,
              more: Sequence[Bucket] = ()) -> None:
        """The all-gather carried the new parameters: copy them in (one bucket at a time:
        there is no optimizer call here to share)."""
        assert not more, "sharded buckets are installed one at a time"
        try:
            engine.finish_all_gather(bucket)
            self.state.install(bucket)
        finally:
            engine.applied(bucket)

    def undo_early(self, engine: "Engine") -> None:
        """The early updates of this iteration are undone and their chunks forgotten: step()
        updates and gathers every bucket as in DeAR's order; factors deferred for the chunks
        (clipping, unscaling) are applied to the shards instead, the same multiplications."""
        state = self.state
        if not (state.early or engine.schedule.gathered_early()):
            return
        engine.schedule.drain()
        state.undo_early()
        for bucket in engine.buckets or ():
            if bucket.stage is Stage.REDUCING:
                bucket.forget_early_gathers()
        engine.schedule.forget_early()
        it = engine.iteration
        if it.deferred and engine.buckets:
            for factor in it.deferred:
                clip.scale_(engine.buckets, engine.comm.rank, factor)
            it.deferred = []

    def unshard(self, engine: "Engine") -> None:
        """Before a step on whole tensors: the sharded state, gathered, goes into the
        optimizer's state in torch's form (absorbed again at the next sharded step)."""
        if self.state.buckets:
            engine.flush()
            self.undo_early(engine)
            engine.opt.state.update(self.state.take_full())  # type: ignore[arg-type]
        elif self.state.carried is not None:
            engine.opt.state.update(self.state.take_carried_whole())  # type: ignore[arg-type]

    def release(self, engine: "Engine") -> None:
        """Before a new layout (every rank): the state leaves the old shards for the interim
        cut, never whole on any rank, and the new layout takes its shards from there."""
        if self.state.buckets:
            engine.flush()
            self.undo_early(engine)
            held = self.state.own_pieces() or []
            self.state.clear()
            self.state.carry(held)

    def state_dict(self, engine: "Engine", torch_state_dict: Callable[[], dict[str, Any]]
                   ) -> dict[str, Any]:
        """The whole (unsharded) state, gathered from every rank (a collective: every rank
        calls optimizer.state_dict()), in torch's form."""
        if not self.state.buckets:
            if self.state.carried is not None:     # a world changed: put back together
                meet_every_rank("optimizer.state_dict()", engine.comm.size)
                engine.opt.state.update(self.state.take_carried_whole())  # type: ignore[arg-type]
            return torch_state_dict()
        full = self.gather_full(engine, "optimizer.state_dict()")
        opt = engine.opt
        kept = opt.state
        merged: Any = collections.defaultdict(dict, kept)
        merged.update(full)
        opt.state = merged
        try:
            return torch_state_dict()
        finally:
            opt.state = kept

    def loaded(self, engine: "Engine") -> None:
        """optimizer.load_state_dict() ran: this rank keeps only its shards of the state."""
        super().loaded(engine)
        if self.state.buckets:
            self.state.state.clear()
            self.state.absorb(engine.opt.state)

    def gather_full(self, engine: "Engine", what: str) -> dict[Any, dict[str, Any]]:
        """Every rank's shards of the state, unsharded (a collective, after the ranks met through
        the rendezvous store so that a rank calling it alone gets an error, not a hang)."""
        self.undo_early(engine)
        meet_every_rank(what, engine.comm.size)
        return self.state.gather_full()

    def layout(self, buckets: Sequence[Bucket]) -> None:
        self.state.layout(buckets)

    def clear(self) -> None:
        self.state.clear()

    def check_step_without_backward(self) -> None:
        if self.state.buckets:
            raise RuntimeError(
                "dear: step() without a backward on this rank, after training began, with "
                "shard_optimizer_state=True: each rank updates only its own shard, so every "
                "rank must call step() after a backward")

    def check_discard(self) -> None:
        raise RuntimeError(
            "dear: with shard_optimizer_state=True each rank updated its optimizer state "
            "for the last step in step(), before the all-gathers that failed, so no whole "
            "step can be saved here; resume from the last checkpoint instead")

    def check_transform(self) -> None:
        raise ValueError(KFAC_REFUSED)

    def memory(self) -> tuple[int, int, int]:
        return (tensor_bytes(self.state.shard_values),
                sum(tensor_bytes(s.values()) for s in self.state.state.values()),
                self.state.peak_saved_bytes)


def _used_anywhere(engine: "Engine") -> list[list[bool]]:
    """Per bucket, which parameters some rank had a gradient for: known without a collective
    when every rank had them all (the stream check says), else one all-reduce of the flags."""
    buckets = engine.buckets or []
    if engine.stream.everyone_used:
        return [[True] * len(b.params) for b in buckets]
    flags = torch.tensor([u for b in buckets for u in b.local_used()], dtype=torch.float32)
    if engine.comm.size > 1:
        engine.comm.all_reduce(flags).wait()
    used = (flags > 0).tolist()
    out, k = [], 0
    for b in buckets:
        out.append(used[k:k + len(b.params)])
        k += len(b.params)
    return out


__all__ = ["ShardedUpdates", "Updates", "group_members"]

