"""Each schedule's layout and per-rank program for the replay (dear.diagnose.simulate).

A program is the list of actions one rank performs over ITERATIONS iterations: compute segments
from the traced profile, collectives issued and waited for, marks at iteration boundaries
(`engine.Action`). The layouts come from the same planners the runtime uses (dear's
`plan_layout`, DDP's and WFBP's bucket rules), so the replay lays a model out as a run would.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from ..fusion.fusion_config import FusionConfig
from .engine import Action
from .graph import Model, Profile

DEFAULT_THRESHOLD = 25 * 2**20
DDP_FIRST_BUCKET = 2**20
ITERATIONS = 4


@dataclasses.dataclass
class DearLayout:
    """DeAR's layout in the simulator: what is reduce-scattered and what is all-gathered."""

    buckets: list[tuple[list[int], int]]      # (parameters, wire bytes) per bucket, forward order
    groups: list[list[int]]                   # all-gather groups: bucket indices, forward order

    def signature(self) -> tuple:
        """Equal for two configs that lay the model out the same way."""
        return (tuple(tuple(ps) for ps, _ in self.buckets),
                tuple(tuple(g) for g in self.groups))

    def group_bytes(self) -> list[int]:
        return [sum(self.buckets[b][1] for b in g) for g in self.groups]


def traced_fusion(model: Model) -> FusionConfig:
    """The traced FusionConfig (dear's traces), else 25 MB for both collectives."""
    dear = model.schedule == "dear"
    return (FusionConfig(**model.fusion) if dear and model.fusion
            else FusionConfig.single(model.fusion_threshold if dear and
                                     model.fusion_threshold is not None
                                     else DEFAULT_THRESHOLD))


def dear_layout(model: Model, fusion: Optional[FusionConfig], world_size: int,
                unclaimed_first: bool = False) -> DearLayout:
    """Buckets and all-gather groups as dear.fusion.layout plans them for `fusion` (its own
    function, on meta tensors). None: the traced layout (dear, same world size), else the
    traced FusionConfig re-planned, else 25 MB for both collectives.

    `unclaimed_first`: put the parameters no module claims first in forward order (where dear
    updates them: before the root's forward, and where its planner puts them) instead of last
    (the trace's forward order)."""
    from ..fusion.layout import plan_layout
    order = model.forward_order
    if unclaimed_first and model.unclaimed:
        order = model.unclaimed + [p for p in order if p not in set(model.unclaimed)]
    dear = model.schedule == "dear"
    if fusion is None and model.buckets and dear and world_size == model.world_size \
            and not unclaimed_first:
        groups = model.buckets
        gathers = model.gather_groups or [[b] for b in range(len(groups))]  # older traces
    else:
        if fusion is None:
            fusion = traced_fusion(model)
        specs, gathers = plan_layout(_fake_params(model), order, fusion, world_size,
                                     row_sparse=model.alone)
        groups = [list(s.params) for s in specs]
    out = []
    for g in groups:
        numel = sum(model.param_numel[p] for p in g) + len(g)        # + one flag per parameter
        padded = -(-numel // world_size) * world_size
        width = model.param_bytes[g[0]] // max(model.param_numel[g[0]], 1)
        out.append((g, padded * width))
    return DearLayout(out, [list(g) for g in gathers])


def _dtype_of(nbytes: int, numel: int) -> torch.dtype:
    return {2: torch.float16, 8: torch.float64}.get(nbytes // max(numel, 1), torch.float32)


def _gradient_order(model: Model) -> list[int]:
    seen = set(model.backward_order)
    return model.backward_order + [p for p in range(len(model.param_bytes)) if p not in seen]


def wfbp_buckets(model: Model, threshold: int) -> list[tuple[list[int], int]]:
    """WFBP (Horovod-style, benchmarks.baselines.WFBP): gradient order, dear's planner rule (a
    bucket never exceeds the threshold unless one parameter does), no padding."""
    from ..fusion.planner import plan_buckets
    specs = plan_buckets(_fake_params(model), _gradient_order(model), threshold, 1)
    return [(list(s.params), sum(model.param_bytes[p] for p in s.params)) for s in specs]


def _fake_params(model: Model) -> list[torch.Tensor]:
    return [torch.empty(n, device="meta", dtype=_dtype_of(b, n))
            for b, n in zip(model.param_bytes, model.param_numel)]


def ddp_buckets(model: Model, threshold: int, first_bucket: Optional[int]
                ) -> list[tuple[list[int], int]]:
    """DDP: gradient order; a bucket closes once it holds at least its cap (torch's rule)."""
    out: list[tuple[list[int], int]] = []
    current: list[int] = []
    size = 0
    for p in _gradient_order(model):
        current.append(p)
        size += model.param_bytes[p]
        cap = first_bucket if (first_bucket is not None and not out) else threshold
        if size >= cap:
            out.append((current, size))
            current, size = [], 0
    if current:
        out.append((current, size))
    return out


def dear_program(prof: Profile, layout: DearLayout, numel: list[int],
                  plan: Optional[Any] = None, sharded: Optional[float] = None) -> list[Action]:
    """DeAR's program; with a `plan` (dear.fusion.schedule.Plan) the planned schedule: after
    bucket b's reduce-scatter, the chunks plan.after[b] ("agc" keys); at step() the rest of each
    bucket touched by a chunk ("agr"), whole groups otherwise. A chunk issued right after a
    reduce-scatter starts on the FIFO link after it, hence after its own bucket's (earlier).
    `sharded` (shard_optimizer_state, this rank's share of each bucket): the update of that
    share runs in step(), before the all-gathers, and the forward only waits for them; a bucket
    the plan gathers in backward was updated early, on the collective thread, beside
    backward's compute (its chunks wait for it on the link's order, not on the compute)."""
    after = plan.after if plan is not None else {}
    early = {c[0] for chunks in after.values() for c in chunks}
    buckets = layout.buckets
    owner = {p: b for b, (ps, _) in enumerate(buckets) for p in ps}
    gather = {b: g for g, members in enumerate(layout.groups) for b in members}
    total_numel = max(sum(numel), 1)
    update = [prof.update * sum(numel[p] for p in ps) / total_numel for ps, _ in buckets]
    sizes = [len(ps) for ps, _ in buckets]
    prog: list[Action] = []
    for it in range(ITERATIONS):
        prog += [("mark", "iteration"), ("compute", prof.lead, "idle")]
        pending = list(range(len(buckets))) if it else []
        needed = {owner[p] for s in prof.forward for p in s.needs}
        first = [b for b in pending if b not in needed]            # applied at the root
        for seg in prof.forward:
            due = first + sorted({owner[p] for p in seg.needs} & set(pending))
            first = []
            for b in due:
                if b in pending:               # waits for its group's all-gather (once in flight)
                    if b in early:
                        prog += [("wait", ("agc", it - 1, b, c[1])) for chunks in after.values()
                                 for c in chunks if c[0] == b]
                        prog.append(("wait", ("agr", it - 1, b)))
                    else:
                        prog.append(("wait", ("ag", it - 1, gather[b])))
                    if sharded is None:
                        prog.append(("compute", update[b], "update"))
                    pending.remove(b)
            prog.append(("compute", seg.duration, "forward"))
        prog.append(("compute", prof.loss, "forward"))
        filled, nxt = [0] * len(buckets), len(buckets) - 1
        for seg in prof.backward:
            prog.append(("compute", seg.duration, "backward"))
            if seg.produces is not None:
                filled[owner[seg.produces]] += 1
            while nxt >= 0 and filled[nxt] == sizes[nxt]:
                prog.append(("issue", ("rs", it, nxt)))
                prog += [("issue", ("agc", it, c[0], c[1])) for c in after.get(nxt, ())]
                nxt -= 1
        prog.append(("compute", prof.backward_tail, "backward"))
        for b in range(nxt, -1, -1):
            prog.append(("issue", ("rs", it, b)))
            prog += [("issue", ("agc", it, c[0], c[1])) for c in after.get(b, ())]
        prog += [("wait", ("rs", it, b)) for b in reversed(range(len(buckets)))]
        prog.append(("compute", prof.step_extra, "step"))
        if sharded is not None:
            prog.append(("compute", sharded * sum(
                u for b, u in enumerate(update) if b not in early), "update"))
        for g, members in enumerate(layout.groups):
            if any(b in early for b in members):
                prog += [("issue", ("agr", it, b)) for b in members]
            else:
                prog.append(("issue", ("ag", it, g)))
        prog.append(("compute", prof.tail, "idle"))
    prog.append(("mark", "iteration"))
    return prog


def allreduce_program(prof: Profile, buckets: list[tuple[list[int], int]],
                       after_backward: bool, step_overhead_s: float = 0.0,
                       unpack_s: float = 0.0) -> list[Action]:
    owner = {p: b for b, (ps, _) in enumerate(buckets) for p in ps}
    sizes = [len(ps) for ps, _ in buckets]
    total = sum(nbytes for _, nbytes in buckets) or 1
    prog: list[Action] = []
    for it in range(ITERATIONS):
        prog += [("mark", "iteration"), ("compute", prof.lead, "idle")]
        prog += [("compute", s.duration, "forward") for s in prof.forward]
        prog.append(("compute", prof.loss, "forward"))
        filled, nxt = [0] * len(buckets), 0
        for seg in prof.backward:
            prog.append(("compute", seg.duration, "backward"))
            if seg.produces is not None:
                filled[owner[seg.produces]] += 1
            while not after_backward and nxt < len(buckets) and filled[nxt] == sizes[nxt]:
                prog.append(("issue", ("ar", it, nxt)))
                nxt += 1
        prog.append(("compute", prof.backward_tail, "backward"))
        prog += [("issue", ("ar", it, b)) for b in range(nxt, len(buckets))]
        for b, (_, nbytes) in enumerate(buckets):
            prog.append(("wait", ("ar", it, b)))
            if unpack_s:                     # bucket b's copy-out while later ones travel
                prog.append(("compute", unpack_s * nbytes / total, "step"))
        prog += [("compute", prof.update + step_overhead_s, "step"),
                 ("compute", prof.tail, "idle")]
    prog.append(("mark", "iteration"))
    return prog
