"""What one optimizer trains: its parameters in dear's index order, their names, the sparse ones
kept out of the buckets, the embedding tables sent as rows, and the cheap test of whether the
set changed since (add_param_group, requires_grad flipped). `ParameterSet.build` makes it, at
the wrap and again when the set changes: one function for both."""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Optional, Sequence

import torch

from ..fusion.rows import resolve_row_sparse
from ..guards import model_guard
from ..guards.stream import parameter_digest

Named = Sequence[tuple[str, torch.nn.Parameter]]


@dataclasses.dataclass
class ParameterSet:
    names: list[str]
    params: list[torch.nn.Parameter]
    index: dict[torch.nn.Parameter, int]
    #: every name known, also of parameters trained later (filled from the model on demand)
    name_of: dict[torch.nn.Parameter, str]
    #: Embedding(sparse=True) weights (dear/engine/sparse.py): trained, never in a bucket
    sparse_ids: frozenset[int]
    #: indices of the tables sent as the rows some rank used (dear/fusion/rows.py)
    row_sparse: set[int]
    #: the stream check's digest of names, shapes and dtypes, and the ids it was taken of
    digest: int
    digest_key: tuple[int, ...]
    #: each param group's list (identity, length) and the parameters not trained, as built:
    #: what `maybe_changed` compares against
    groups_key: list[tuple[int, int]]
    untrained: list[torch.nn.Parameter]

    @classmethod
    def build(cls, opt: torch.optim.Optimizer, named: Named, model: Optional[torch.nn.Module],
              sparse_ids: frozenset[int], row_sparse: Any, row_sparse_explicit: bool,
              world_size: int, name_of: Optional[dict[torch.nn.Parameter, str]] = None
              ) -> "ParameterSet":
        """`named`: the trained parameters in index order; `row_sparse`: the row_sparse=
        setting (resolved here against these parameters)."""
        params = [p for _, p in named]
        known = dict(name_of or {})
        known.update({p: n for n, p in named})
        trained = set(params)
        groups = opt.param_groups
        return cls(
            names=[n for n, _ in named], params=params,
            index={p: i for i, p in enumerate(params)}, name_of=known, sparse_ids=sparse_ids,
            row_sparse=resolve_row_sparse(row_sparse, named, model, explicit=row_sparse_explicit,
                                          world_size=world_size),
            digest=parameter_digest(named), digest_key=tuple(id(p) for p in params),
            groups_key=[(id(g["params"]), len(g["params"])) for g in groups],
            untrained=[p for g in groups for p in g["params"]
                       if p not in trained and id(p) not in sparse_ids])

    def trainable(self, opt: torch.optim.Optimizer) -> list[torch.nn.Parameter]:
        """What `opt` trains now: its parameters with requires_grad, sparse ones aside."""
        return [p for g in opt.param_groups for p in g["params"]
                if p.requires_grad and id(p) not in self.sparse_ids]

    def trainable_named(self, opt: torch.optim.Optimizer, model: Optional[torch.nn.Module]
                        ) -> list[tuple[str, torch.nn.Parameter]]:
        """`trainable` with names (the model's, for parameters added after the wrap)."""
        if model is not None and any(p not in self.name_of for p in self.trainable(opt)):
            with model_guard.quiet():
                for n, p in model.named_parameters():
                    self.name_of.setdefault(p, n)
        return [(self.name_of.get(p) or f"group{k}.param{j}", p)
                for k, g in enumerate(opt.param_groups) for j, p in enumerate(g["params"])
                if p.requires_grad and id(p) not in self.sparse_ids]

    def current_digest(self, opt: torch.optim.Optimizer, model: Optional[torch.nn.Module],
                       always: bool) -> int:
        """The stream check's digest of what is trained now (recomputed when it changed)."""
        if not self.maybe_changed(opt, always):
            return self.digest
        key = tuple(id(p) for p in self.trainable(opt))
        if key != self.digest_key:
            self.digest_key = key
            self.digest = parameter_digest(self.trainable_named(opt, model))
        return self.digest

    def changed(self, opt: torch.optim.Optimizer, always: bool) -> bool:
        """The trained parameters are not these (add_param_group, requires_grad flipped):
        compared tensor by tensor where the cheap test cannot rule it out."""
        if not self.maybe_changed(opt, always):
            return False
        now = self.trainable(opt)
        return len(now) != len(self.params) or any(a is not b for a, b in zip(now, self.params))

    def maybe_changed(self, opt: torch.optim.Optimizer, always: bool) -> bool:
        """Whether the trained set may have changed since it was built: a param group added or
        its list replaced or resized, a trained parameter frozen, an untrained one unfrozen;
        and `always` (the iterations that compare contents, dear/engine/checks.py: a list
        edited in place at the same length). A few attribute reads instead of a walk over
        every group."""
        if always:
            return True
        groups = opt.param_groups
        return (len(groups) != len(self.groups_key)
                or any((id(g["params"]), len(g["params"])) != key
                       for g, key in zip(groups, self.groups_key))
                or not all(map(_REQUIRES_GRAD, self.params))      # C-level loops
                or any(map(_REQUIRES_GRAD, self.untrained)))


_REQUIRES_GRAD = operator.attrgetter("requires_grad")


__all__ = ["ParameterSet"]
