"""shard_optimizer_state=True: each rank updates only its reduced shard (ZeRO-2 on DeAR's schedule).

After a bucket's reduce-scatter this rank holds the averaged gradient of one slice of the bucket
(dear/shardops/shards.py). With sharding the wrapped optimizer's own update runs in step() on that
slice only, the parameters cut into flat segments where the shard's ends fall, and the all-gather
carries the updated parameters instead of the gradients; each bucket's parameters are copied from
it just before its first module runs (`install`, from _finalize). So the optimizer state exists
for 1/N of every parameter on each rank.

It is exact, bit for bit, because the optimizers allowed here update each element from that
element's gradient, parameter and state alone, and from scalars (step counts, bias corrections)
that are the same for every segment of a parameter. An optimizer that needs a whole tensor (a
norm, a trust ratio, a factored moment, K-FAC's preconditioning) is refused by name.

The state lives here, keyed by segment, and is put in the optimizer's place only while its step
runs. `gather_full` (a collective: every rank) rebuilds torch's unsharded form for state_dict(),
for a step that needs whole tensors (after synchronize()) and before a new layout; `absorb`
(local) cuts an unsharded state, loaded or gathered, back into this rank's segments.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable, Iterable, Optional, Sequence

import torch

from ..comm.base import Communicator
from ..fusion.bucket import Bucket
from ..guards.written import Fingerprint, fingerprints, first_changed
from .reshard import Piece, interim, redistribute

#: torch optimizers whose update is elementwise: safe on flat segments, the same bits.
ELEMENTWISE: tuple[type, ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop,
    torch.optim.Adagrad, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
    torch.optim.ASGD, torch.optim.Adadelta, torch.optim.Rprop)


#: dear.KFAC with a sharded optimizer: said where dear.KFAC attaches (dear/kfac/overlap.py)
#: and at the optimizer's extension point it would use (dear/engine/extension.py).
KFAC_REFUSED = (
    "dear.KFAC preconditions whole gradients, which a dear.DistributedOptimizer with "
    "shard_optimizer_state=True never holds (each rank updates only its slice of each "
    "parameter); wrap the optimizer without shard_optimizer_state to use dear.KFAC")


def check_shardable(optimizer: torch.optim.Optimizer) -> None:
    """Refuse, by name, an optimizer whose update is not known to be elementwise."""
    cls = type(optimizer)
    if getattr(cls, "dear_elementwise", False):    # the class's author vouches for it
        return
    for base in ELEMENTWISE:
        if isinstance(optimizer, base) and cls.step is getattr(base, "step"):
            return
    names = ", ".join(b.__name__ for b in ELEMENTWISE)
    raise ValueError(
        f"shard_optimizer_state=True runs {cls.__name__}'s update on flat slices of the "
        "parameters (each rank its 1/N), which gives the unsharded result only for an update "
        f"that is elementwise: torch's {names} (their subclasses that keep their step()). "
        f"{cls.__name__} is not one of them; it may need whole tensors (norms or trust ratios "
        "as in LAMB/LARS, factored moments as in Adafactor, K-FAC's preconditioning). Wrap it "
        "without shard_optimizer_state (every rank keeps the whole state), or, if its update "
        "is elementwise (each element from its own gradient, value and state, and scalars), "
        "set `dear_elementwise = True` on its class")


@dataclasses.dataclass
class Segment:
    """The part of one parameter that lies in this rank's shard of its bucket."""
    param: torch.nn.Parameter
    lo: int                      # its elements [lo, hi) of the flattened parameter
    hi: int
    at: int                      # where they start in the shard
    value: torch.Tensor          # a view of the bucket's parameter shard: what the step updates


def tensor_bytes(values: Iterable[Any]) -> int:
    """Bytes of the tensors among `values` (state entries hold ints and floats too)."""
    return sum(v.numel() * v.element_size() for v in values if isinstance(v, torch.Tensor))


class ShardedState:
    """This rank's segments of every bucket, and the optimizer state of each."""

    def __init__(self, comm: Communicator,
                 params: Callable[[], Sequence[torch.nn.Parameter]] = list) -> None:
        self._comm = comm
        self._trained = params                  # the engine's: a parameter's index is its id
        # State of a world that changed, in the interim cut (dear/sharding/reshard.py): put
        # into this rank's segments when the next layout is cut.
        self.carried: Optional[list[Piece]] = None
        self.buckets: list[Bucket] = []
        self.segments: list[list[Segment]] = []
        self._values: list[torch.Tensor] = []   # per bucket: the parameters of its shard
        self.state: collections.defaultdict[torch.Tensor, dict[str, Any]] = \
            collections.defaultdict(dict)
        self.updated: set[int] = set()          # buckets updated in this iteration
        # Updated early (in backward), and the state their segments had before (None: none
        # yet), for undo_early.
        self.early: set[int] = set()
        self._saved: dict[torch.Tensor, Optional[dict[str, Any]]] = {}
        # The parameters' versions when each bucket's reduce-scatter started, noted by the
        # training thread: an early update reads them at some later moment, step() at its own.
        self._versions: dict[int, list[int]] = {}
        self._prints: dict[int, list[Fingerprint]] = {}
        self._saved_bytes = 0                   # what _saved holds now
        self.peak_saved_bytes = 0               # the most state saved for undo at once
        # The optimizer's attributes as the training thread saw them when backward began: what
        # the stand-in of an early update starts from (that thread may be changing them).
        self.attributes: Optional[dict[str, Any]] = None

    @property
    def shard_values(self) -> list[torch.Tensor]:
        """Per bucket, this rank's shard of its parameters (memory accounting)."""
        return self._values

    @property
    def holds_state(self) -> bool:
        return any(self.state.values())

    @property
    def sharded_now(self) -> bool:
        """Whether the state is held in pieces (a layout's segments, or carried)."""
        return bool(self.buckets) or self.carried is not None

    def layout(self, buckets: Sequence[Bucket]) -> None:
        """Cut the parameters along this rank's shards of a new layout (state must be empty:
        gather it first)."""
        assert not self.holds_state, "the sharded state must be gathered before a new layout"
        self.state.clear()
        self.end_step()
        rank = self._comm.rank
        self.buckets, self.segments, self._values = list(buckets), [], []
        for bucket in buckets:
            spec = bucket.spec
            values = torch.zeros(spec.shard_numel, dtype=spec.dtype, device=spec.device)
            self.segments.append([Segment(bucket.params[j], lo, hi, at, values[at:at + hi - lo])
                                  for j, lo, hi, at in pieces(spec, rank)])
            self._values.append(values)
        if self.carried is not None:           # a collective: every rank lays out alike
            segments = [seg for segs in self.segments for seg in segs]
            index = self._index()
            placed = redistribute(self._comm, self.carried,
                                  [(index[s.param], s.lo, s.hi) for s in segments],
                                  self._device_of)
            by_range = {(p.param, p.lo, p.hi): p.state for p in placed}
            for seg in segments:
                entry = by_range.get((index[seg.param], seg.lo, seg.hi))
                if entry:
                    self.state[seg.value] = entry
            self.carried = None

    def params(self) -> Sequence[torch.nn.Parameter]:
        """The engine's trained parameters: a piece names its parameter by index here."""
        return self._trained()

    def _index(self) -> dict[torch.nn.Parameter, int]:
        return {p: i for i, p in enumerate(self._trained())}

    def _device_of(self, param: int) -> torch.device:
        return self._trained()[param].device

    # ------------------------------------------------------------ pieces (elastic)
    def own_pieces(self) -> Optional[list[Piece]]:
        """This rank's pieces of the state, copied (its segments', or what it carries); None
        if the state is not held in pieces now (it is whole in the optimizer)."""
        return self._pieces(copied=True) if self.sharded_now else None

    def _pieces(self, copied: bool) -> list[Piece]:
        keep = _saved_copy if copied else (lambda v: v)
        if self.buckets:
            index = self._index()
            return [Piece(index[seg.param], seg.lo, seg.hi,
                          {k: keep(v) for k, v in self.state[seg.value].items()})
                    for segments in self.segments for seg in segments
                    if self.state.get(seg.value)]
        return [Piece(p.param, p.lo, p.hi, {k: keep(v) for k, v in p.state.items()})
                for p in self.carried or ()]

    def carry(self, held: Sequence[Piece]) -> None:
        """Every rank, at the same point, with no layout: the pieces each rank holds (of one
        state, any cut) become this world's interim cut, placed at the next layout."""
        assert not self.buckets, "carried state is placed by the next layout"
        world, rank = self._comm.size, self._comm.rank
        wanted = [(i, *interim(p.numel(), rank, world)) for i, p in enumerate(self._trained())]
        self.carried = redistribute(self._comm, held, wanted, self._device_of)

    def take_carried_whole(self) -> dict[torch.nn.Parameter, dict[str, Any]]:
        """The carried state in torch's unsharded form, on every rank (a collective: for
        state_dict(), which is whole by definition)."""
        held, self.carried = self.carried or [], None
        return self._whole(held)

    def _whole(self, held: Sequence[Piece]) -> dict[torch.nn.Parameter, dict[str, Any]]:
        """The state every rank holds pieces of, whole on every rank, keyed by parameter."""
        params = self._trained()
        wanted = [(i, 0, p.numel()) for i, p in enumerate(params)]
        return {params[p.param]: {k: (v.view(params[p.param].shape)
                                      if isinstance(v, torch.Tensor) and v.dim() > 0 else v)
                                  for k, v in p.state.items()}
                for p in redistribute(self._comm, held, wanted, self._device_of)}

    def clear(self) -> None:
        self.buckets, self.segments, self._values = [], [], []
        self.state.clear()
        self.carried = None
        self.end_step()

    # ------------------------------------------------------------------------ the step
    def update(self, optimizer: Any, inner_step: Callable[[Any], Any],
               used: Sequence[Sequence[bool]], hyper: Sequence[dict[str, Any]],
               only: Optional[Sequence[Bucket]] = None,
               attributes: Optional[dict[str, Any]] = None) -> None:
        """The wrapped optimizer's step on this rank's segments of the buckets not updated yet
        in this iteration (`only`: just those), their .grad views of the averaged shards,
        with the hyperparameters `hyper` (one dict per param group). The new values are what
        each bucket's all-gather sends (`Bucket.outgoing`). The step runs on a stand-in
        optimizer (its own param groups, this state), so the user's optimizer is never edited
        and an early update may run on the collective thread."""
        chosen = [k for k, b in enumerate(self.buckets)
                  if k not in self.updated and (only is None or b in only)]
        if not chosen:
            return
        self.absorb(optimizer.state)
        group_of = {p: k for k, g in enumerate(optimizer.param_groups) for p in g["params"]}
        members: list[list[torch.Tensor]] = [[] for _ in hyper]
        for k in chosen:
            flag_of = dict(zip(self.buckets[k].params, used[k]))
            for seg in self.segments[k]:
                seg.value.copy_(flat(seg.param)[seg.lo:seg.hi])
                seg.value.grad = (self.buckets[k].shard[seg.at:seg.at + seg.hi - seg.lo]
                                  if flag_of[seg.param] else None)
                g = group_of.get(seg.param)
                if g is not None and g < len(members):
                    members[g].append(seg.value)
        stand_in = object.__new__(type(optimizer))
        stand_in.__dict__.update(optimizer.__dict__ if attributes is None else attributes)
        stand_in.param_groups = [{**h, "params": m} for h, m in zip(hyper, members)]
        stand_in.state = self.state
        try:
            inner_step(stand_in)
        finally:
            for k in chosen:
                for seg in self.segments[k]:
                    seg.value.grad = None
        for k in chosen:
            bucket, segments, values = self.buckets[k], self.segments[k], self._values[k]
            end = segments[-1].at + segments[-1].hi - segments[-1].lo if segments else 0
            values[end:].copy_(bucket.shard[end:])     # the usage flags and padding, as reduced
            bucket.outgoing = values
            self.updated.add(k)

    # --------------------------------------------------- early updates, in backward's gaps
    def launched(self, bucket: Bucket, contents: bool) -> None:
        """Its reduce-scatter starts (training thread): note its parameters' versions, and with
        `contents` (early updates may run in this iteration) their fingerprints: a write
        through `.data` leaves the version alone. Whole parameters, not this rank's segments,
        so that every rank sees the same writes and decides alike."""
        k = bucket.spec.index
        self._versions[k] = [p._version for p in bucket.params]
        if contents:
            self._prints[k] = fingerprints(bucket.params)

    def unwritten(self, now: dict[int, list[Fingerprint]]) -> bool:
        """No parameter was written since its bucket's reduce-scatter started: an update run
        since then, early or now, reads the same values (the same answer on every rank,
        however far the collective thread had got). The fingerprints it takes of the
        parameters as they are now go into `now`, per bucket."""
        if not all(p._version == v for k, versions in self._versions.items()
                   for p, v in zip(self.buckets[k].params, versions)):
            return False
        keys = sorted(self._prints)
        now.update((k, fingerprints(self.buckets[k].params)) for k in keys)
        return first_changed([f for k in keys for f in self._prints[k]],
                             [f for k in keys for f in now[k]]) is None

    def update_early(self, optimizer: Any, inner_step: Callable[[Any], Any], bucket: Bucket,
                     hyper: Sequence[dict[str, Any]]) -> None:
        """The update of one bucket before step() (its chunks are gathered in backward), kept
        undoable: its segments' state is saved first. Every parameter of the bucket had a
        gradient here; whether on every rank, step() learns (`everyone_used`)."""
        k = bucket.spec.index                   # its place in self.buckets (the layout's)
        if k in self.updated:
            return
        self.absorb(optimizer.state)
        for seg in self.segments[k]:
            entry = self.state.get(seg.value)
            saved = (None if entry is None else
                     {key: _saved_copy(v) for key, v in entry.items()})
            self._saved[seg.value] = saved
            self._saved_bytes += tensor_bytes((saved or {}).values())
        self.early.add(k)
        self.peak_saved_bytes = max(self.peak_saved_bytes, self._saved_bytes)
        self.update(optimizer, inner_step, [[True] * len(b.params) for b in self.buckets],
                    hyper, only=[bucket], attributes=self.attributes)

    def undo_early(self) -> None:
        """Put back the state the early updates started from; step() updates their buckets
        again (and gathers them again)."""
        for k in sorted(self.early):
            for seg in self.segments[k]:
                saved = self._saved.pop(seg.value, None)
                if saved is None:
                    self.state.pop(seg.value, None)
                    continue
                live = self.state[seg.value]
                for key in list(live):
                    if key not in saved:
                        del live[key]
                for key, v in saved.items():
                    old = live.get(key)
                    if isinstance(v, torch.Tensor) and isinstance(old, torch.Tensor) \
                            and old.shape == v.shape and old.dtype == v.dtype:
                        old.copy_(v)
                        _read_on_this_stream(v)
                    else:
                        live[key] = v
            self.buckets[k].outgoing = None
            self.updated.discard(k)
        self.early = set()
        self._saved = {}
        self._saved_bytes = 0

    def end_step(self) -> None:
        """The iteration's updates are final."""
        self.attributes = None
        self.updated = set()
        self.early = set()
        self._saved = {}
        self._saved_bytes = 0
        self._versions = {}
        self._prints = {}

    @staticmethod
    def install(bucket: Bucket) -> None:
        """The gathered parameters of `bucket` (in its buffer) into the model's parameters."""
        with torch.no_grad():
            for p, view in zip(bucket.params, bucket.grad_views):
                p.copy_(view)

    # ------------------------------------------------------------- unsharded <-> sharded
    def absorb(self, full: dict[Any, dict[str, Any]]) -> None:
        """Cut the unsharded state in `full` (keyed by parameter) into this rank's segments and
        remove it from `full`. Local: every rank holds the same unsharded state when this runs
        (loaded from one checkpoint, broadcast, or gathered)."""
        if not full:
            return
        for segments in self.segments:
            for seg in segments:
                entry = full.get(seg.param)
                if entry:
                    self.state[seg.value] = {k: _slice(v, seg) for k, v in entry.items()}
        for bucket in self.buckets:
            for p in bucket.params:
                full.pop(p, None)

    def gather_full(self) -> dict[torch.nn.Parameter, dict[str, Any]]:
        """Every rank's segments' state put together into torch's unsharded form, keyed by
        parameter (a collective: call it on every rank at the same point)."""
        return self._whole(self._pieces(copied=False))

    def take_full(self) -> dict[torch.nn.Parameter, dict[str, Any]]:
        """gather_full, and this rank's sharded state dropped (a new layout follows, or a step
        on whole tensors)."""
        full = self.gather_full()
        self.state.clear()
        return full


def pieces(spec: Any, rank: int) -> list[tuple[int, int, int, int]]:
    """(parameter j, its elements [lo, hi), where they start in the shard) for each parameter
    of the bucket `spec` that rank `rank`'s shard holds a piece of."""
    start, length = rank * spec.shard_numel, spec.shard_numel
    out = []
    for j, (o, n) in enumerate(zip(spec.offsets, spec.numels)):
        a, c = max(o, start), min(o + n, start + length)
        if c > a:
            out.append((j, a - o, c - o, a - start))
    return out


def flat(p: torch.Tensor) -> torch.Tensor:
    """The parameter's elements in the bucket's order (its logical order)."""
    p = p.detach()
    return p.view(-1) if p.is_contiguous() else p.reshape(-1)


def _slice(v: Any, seg: Segment) -> Any:
    if isinstance(v, torch.Tensor) and v.dim() > 0:
        if v.numel() != seg.param.numel():
            raise ValueError(
                f"optimizer state of shape {tuple(v.shape)} for a parameter of shape "
                f"{tuple(seg.param.shape)}: shard_optimizer_state=True handles elementwise state "
                "(one value per parameter element) and scalars only")
        _read_on_this_stream(v)
        return v.detach().reshape(-1)[seg.lo:seg.hi].to(seg.param.device).clone()
    if isinstance(v, torch.Tensor):
        _read_on_this_stream(v)
        return v.detach().clone()
    return v


def _read_on_this_stream(v: torch.Tensor) -> None:
    """`v` is read by work queued on the current stream and may be freed before that work runs
    (the unsharded state cut in an early update on the side stream, a saved copy put back on
    the training stream): its memory must not be handed out again until then."""
    if v.is_cuda:
        v.record_stream(torch.cuda.current_stream(v.device))


def _saved_copy(v: Any) -> Any:
    return v.detach().clone() if isinstance(v, torch.Tensor) else v


_meetings = 0       # how many this process held: the same sequence on every rank


def meet_every_rank(what: str, size: int) -> None:
    """Before a state gather over `size` ranks: every rank must be here. A collective that some
    rank never issues would otherwise pair with that rank's next one (a hang or wrong data).
    The meeting is dear's whole world's: an optimizer on a Horovod process set of fewer ranks
    gathers unchecked, as does a backend without a rendezvous store."""
    global _meetings
    from ..comm import runtime
    if size != runtime.size():
        return
    _meetings += 1
    try:
        gone = runtime.meet(f"sharded_state/{_meetings}")
    except TimeoutError as exc:
        timeout = runtime.config().timeout
        raise RuntimeError(_alone(what, f"{exc} (DEAR_TIMEOUT={timeout:g} s)")) from None
    if gone:
        raise RuntimeError(_alone(what, f"rank(s) {gone} went on training without calling it"))


def _alone(what: str, why: str) -> str:
    return (f"dear: {what} gathers the sharded optimizer state from every rank "
            f"(shard_optimizer_state=True), but {why}. Call it on every rank (e.g. `state = "
            "optimizer.state_dict()` before `if rank == 0: torch.save(state, ...)`), as with "
            "FSDP or ZeRO")
