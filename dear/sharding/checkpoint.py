"""Sharded checkpoints of shard_optimizer_state through torch.distributed.checkpoint (DCP).

`sharded_state_dict()` describes each elementwise state tensor as one flat tensor per parameter,
of which this rank holds the pieces in its shards (a ShardedTensor whose metadata every rank
computes alone from the layout: no collective). DCP writes each piece once and, on load, reads
for each rank whatever overlaps what it asks for, so a checkpoint saved on N ranks resumes on M:
with a layout (after the first step) a rank asks for its own pieces only; before it, for whole
tensors, cut at the first step.

    state = {"model": model.state_dict(), "optim": optimizer.sharded_state_dict()}
    torch.distributed.checkpoint.save(state, checkpoint_id=path)        # every rank
    ...
    state = {"model": model.state_dict(), "optim": optimizer.sharded_state_dict()}
    torch.distributed.checkpoint.load(state, checkpoint_id=path)        # every rank, any world
    model.load_state_dict(state["model"]); optimizer.load_sharded_state_dict(state["optim"])
"""

from __future__ import annotations

import collections
import copy
from typing import Any, Optional

import torch

from ..interfaces import DearOptimizer
from .reshard import Piece, interim
from .state import ShardedState, flat, pieces

_STATE, _GROUPS = "state", "param_groups"


def _sharded_tensor(pieces: list[tuple[int, int, int]], local: Optional[torch.Tensor],
                    numel: int, dtype: torch.dtype, device: torch.device, rank: int) -> Any:
    """A 1-D ShardedTensor of `numel` elements: `pieces` (rank, lo, hi) are every rank's."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import (
        ShardedTensorMetadata,
        TensorProperties,
    )
    kind = device.type if device.type == "cpu" else f"{device.type}:{device.index or 0}"
    metas = [ShardMetadata(shard_offsets=[lo], shard_sizes=[hi - lo],
                           placement=f"rank:{r}/{kind}") for r, lo, hi in pieces]
    shards = [Shard(local, m) for m in metas if local is not None
              and m.placement is not None and m.placement.rank() == rank]
    meta = ShardedTensorMetadata(shards_metadata=metas, size=torch.Size([numel]),
                                 tensor_properties=TensorProperties(dtype=dtype))
    return ShardedTensor._init_from_local_shards_and_global_metadata(shards, meta)  # torch's  # noqa: SLF001


def _pieces(sharded: ShardedState, world: int) -> dict[Any, list[tuple[int, int, int]]]:
    """Per parameter: every rank's (rank, lo, hi) piece of it, from the buckets' specs."""
    out: dict[Any, list[tuple[int, int, int]]] = {}
    for bucket in sharded.buckets:
        for r in range(world):
            for j, lo, hi, _ in pieces(bucket.spec, r):
                out.setdefault(bucket.params[j], []).append((r, lo, hi))
    return out


def sharded_state_dict(optimizer: Any, names: dict[Any, str], rank: int,
                       world: int) -> dict[str, Any]:
    """This rank's part of the state, for DCP (see the module's docstring)."""
    sharded = _sharded(optimizer)
    full_groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"}
                   | {"params": [names[p] for p in g["params"] if p in names]}
                   for g in optimizer.param_groups]
    if not sharded.state and not optimizer.state and sharded.carried is None:
        _initialize(optimizer, names, rank, world)  # a template needs every key (as FSDP's)
    state: dict[str, dict[str, Any]] = {}
    if sharded.carried is not None and not sharded.buckets:    # the interim cut
        params = sharded.params()
        for piece in sharded.carried:
            p = params[piece.param]
            cut = [(r, *interim(p.numel(), r, world)) for r in range(world)]
            cut = [(r, lo, hi) for r, lo, hi in cut if hi > lo]
            out = state.setdefault(names[p], {})
            for key, v in piece.state.items():
                out[key] = (_sharded_tensor(cut, v if piece.numel else None, p.numel(),
                                            v.dtype, p.device, rank)
                            if isinstance(v, torch.Tensor) and v.dim() > 0 else v)
    if sharded.buckets:
        pieces = _pieces(sharded, world)
        for segments in sharded.segments:
            for seg in segments:
                entry = sharded.state.get(seg.value)
                if not entry:
                    continue
                out = state.setdefault(names[seg.param], {})
                for key, v in entry.items():
                    if isinstance(v, torch.Tensor) and v.dim() > 0:
                        out[key] = _sharded_tensor(pieces[seg.param], v, seg.param.numel(),
                                                   v.dtype, v.device, rank)
                    else:
                        out[key] = v
    for p, entry in optimizer.state.items():     # unsharded entries (before the first step)
        if p in names and entry:
            state[names[p]] = {k: (v.reshape(-1) if isinstance(v, torch.Tensor) and v.dim() > 0
                                   else v) for k, v in entry.items()}
    return {_STATE: state, _GROUPS: full_groups}


def _sharded(optimizer: DearOptimizer) -> ShardedState:
    state = optimizer.dear_sharded_state
    assert state is not None, "the optimizer's callers check shard_optimizer_state"
    return state


def _initialize(optimizer: Any, names: dict[Any, str], rank: int, world: int) -> None:
    """Create the state's entries with a step of zero gradients at lr 0 (parameters unchanged)
    on this rank's pieces: its segments if there is a layout, else its interim cut (carried to
    the first layout); loading overwrites every entry. Never whole on a rank."""
    sharded = _sharded(optimizer)
    groups = optimizer.param_groups
    saved = [(g["params"], g.get("lr")) for g in groups]
    kept_state = optimizer.state
    member = {p: k for k, g in enumerate(groups) for p in g["params"]}
    lists: list[list[torch.Tensor]] = [[] for _ in groups]
    interim_cut: list[tuple[int, int, int, torch.Tensor]] = []
    try:
        if sharded.buckets:
            optimizer.state = sharded.state
            for segments in sharded.segments:
                for seg in segments:
                    seg.value.copy_(flat(seg.param)[seg.lo:seg.hi])
                    lists[member[seg.param]].append(seg.value)
        else:
            optimizer.state = collections.defaultdict(dict)
            for i, p in enumerate(sharded.params()):
                if p in names and p in member:
                    lo, hi = interim(p.numel(), rank, world)
                    t = flat(p)[lo:hi].clone()
                    interim_cut.append((i, lo, hi, t))
                    lists[member[p]].append(t)
        tensors = [t for m in lists for t in m]
        for t in tensors:
            t.grad = torch.zeros_like(t)
        for g, m in zip(groups, lists):
            g["params"] = m
            g["lr"] = 0.0 if not isinstance(g.get("lr"), torch.Tensor) else g["lr"] * 0
        optimizer.dear_inner_step()
        for t in tensors:
            t.grad = None
        if not sharded.buckets:
            sharded.carried = [Piece(i, lo, hi, optimizer.state.get(t, {}))
                               for i, lo, hi, t in interim_cut]
    finally:
        optimizer.state = kept_state
        for g, (params, lr) in zip(groups, saved):
            g["params"] = params
            if lr is not None:
                g["lr"] = lr


def load_sharded_state_dict(optimizer: Any, state_dict: dict[str, Any],
                            names: dict[Any, str], rank: int, world: int) -> None:
    """What DCP loaded into sharded_state_dict()'s template, put in place: this rank's pieces
    into its segments, whole tensors into the optimizer's (unsharded) state."""
    sharded = _sharded(optimizer)
    by_name = {n: p for p, n in names.items()}
    groups = state_dict.get(_GROUPS) or []
    if len(groups) != len(optimizer.param_groups):
        raise ValueError(f"the checkpoint has {len(groups)} param groups, the optimizer "
                         f"{len(optimizer.param_groups)}")
    for g, saved in zip(optimizer.param_groups, groups):
        if [names.get(p) for p in g["params"] if p in names] != list(saved["params"]):
            raise ValueError("the checkpoint's param groups hold other parameters than the "
                             "optimizer's (by name)")
        g.update({k: v for k, v in saved.items() if k != "params"})
    seg_of = {seg.param: seg for segments in sharded.segments for seg in segments}
    sharded.state.clear()
    sharded.carried = None
    index = {p: i for i, p in enumerate(sharded.params())}
    carried: list[Piece] = []
    for name, entry in (state_dict.get(_STATE) or {}).items():
        p = by_name.get(name)
        if p is None:
            raise ValueError(f"the checkpoint has optimizer state for {name!r}, which this "
                             "optimizer does not train")
        whole: dict[str, Any] = {}
        mine: dict[str, Any] = {}
        offsets: set[tuple[int, int]] = set()
        for key, v in entry.items():
            if hasattr(v, "local_shards"):       # a ShardedTensor: this rank's pieces
                shards = v.local_shards()
                if shards:
                    mine[key] = shards[0].tensor.detach().clone()
                    offsets.add((shards[0].metadata.shard_offsets[0],
                                 shards[0].metadata.shard_sizes[0]))
            elif isinstance(v, torch.Tensor) and v.dim() > 0:
                whole[key] = v.detach().reshape(p.shape).clone()
            else:
                whole[key] = mine[key] = v
        seg = seg_of.get(p)
        in_pieces = [k for k, v in entry.items() if hasattr(v, "local_shards")]
        if seg is not None and in_pieces:
            if offsets and offsets != {(seg.lo, seg.hi - seg.lo)}:
                raise ValueError(
                    f"the sharded state of {name!r} was cut otherwise than this rank's shard "
                    "(a sharded_state_dict() taken before the first step, when the state is "
                    "held in an interim cut, put back after it): load it through "
                    "torch.distributed.checkpoint.load into sharded_state_dict()'s template, "
                    "which reads whichever pieces this rank needs")
            sharded.state[seg.value] = mine
        elif in_pieces and not sharded.buckets:  # the interim cut, placed at the first layout
            for key in in_pieces:
                mine.setdefault(key, torch.empty(0, dtype=entry[key].dtype, device=p.device))
            carried.append(Piece(index[p], *interim(p.numel(), rank, world), mine))
        elif any(isinstance(v, torch.Tensor) and v.dim() > 0 for v in whole.values()):
            optimizer.state[p] = whole
    if carried:
        sharded.carried = carried
    if sharded.buckets:
        sharded.absorb(optimizer.state)
