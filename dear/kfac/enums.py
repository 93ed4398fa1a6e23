"""The choices K-FAC offers, as enums (strings are accepted at the API and converted once).

ComputeMethod, AssignmentStrategy, DistributedStrategy and AllreduceMethod carry kfac-pytorch's
class and member names, and `parse` also takes kfac-pytorch's own enum members (matched by name),
so code written for kfac.preconditioner.KFACPreconditioner passes its arguments through
unchanged. What it reads back compares equal to kfac-pytorch's members too
(`p.distributed_strategy == kfac.enums.DistributedStrategy.MEM_OPT`, either side first): a member
equals a member of an enum class of the same name with the same member name, whatever its values.
"""

from __future__ import annotations

import enum
from typing import Any, TypeVar

E = TypeVar("E", bound=enum.Enum)


class _KfacNamed(enum.Enum):
    """Equal to the same-named member of a same-named enum class (kfac-pytorch's, whose values
    are ints where dear's are strings); hashed by name, as every Enum member is."""

    def __eq__(self, other: object) -> bool:
        if isinstance(other, enum.Enum) and type(other) is not type(self):
            return type(other).__name__ == type(self).__name__ and other.name == self.name
        return self is other if isinstance(other, enum.Enum) else NotImplemented

    def __hash__(self) -> int:
        return hash(self._name_)


class ComputeMethod(_KfacNamed):
    """How a factor is turned into something that preconditions (kfac-pytorch's names)."""

    EIGEN = "eigen"        # eigendecomposition; damping added to the eigenvalue products
    INVERSE = "inverse"    # (F + damping I)^-1 of each factor


class Strategy(enum.Enum):
    """Where factors go, who decomposes them and what is sent back.

    COMM_OPT: factors all-reduced; each factor decomposed by one rank (LPT) and broadcast;
              every rank preconditions every layer (KAISA's COMM-OPT).
    MEM_OPT:  factors all-reduced; each layer owned by one rank (LPT), which decomposes both of
              its factors, preconditions its gradient and broadcasts the result (KAISA's
              MEM-OPT: only the owner holds the decompositions).
    HYBRID_OPT: KAISA's grid: the ranks form grad_workers rows x (world / grad_workers)
              columns; a layer's decompositions go to the ranks of one column, which
              precondition it, and each sends the result along its row.
    PAD:      factors REDUCED to the layer's owner only; owners are contiguous blocks of layers
              (dynamic programming, minimal maximum load), so reduces and broadcasts fuse.
    AUTO:     the cheapest of COMM_OPT, MEM_OPT and PAD under an alpha-beta network model and
              the calibrated compute model, decided on rank 0 once the layers are known.
    """

    COMM_OPT = "comm-opt"
    MEM_OPT = "mem-opt"
    HYBRID_OPT = "hybrid-opt"
    PAD = "pad"
    AUTO = "auto"


class AssignmentStrategy(_KfacNamed):
    """kfac-pytorch's cost of decomposing a d x d factor when assigning work: COMPUTE d^3,
    MEMORY d^2 (greedy, largest layer first, to the least-loaded rank)."""

    COMPUTE = "compute"
    MEMORY = "memory"


class DistributedStrategy(_KfacNamed):
    """kfac-pytorch's shortcuts for grad_worker_fraction: COMM_OPT 1, HYBRID_OPT 0.5,
    MEM_OPT 1 / world size."""

    COMM_OPT = "comm-opt"
    MEM_OPT = "mem-opt"
    HYBRID_OPT = "hybrid-opt"


def parse(cls: type[E], value: Any, what: str) -> E:
    """`value` as a member of `cls`: a member, a member of another enum with the same name
    (kfac-pytorch's), or a value or name string (case-insensitive, '_' or '-')."""
    if isinstance(value, cls):
        return value
    if isinstance(value, enum.Enum) and value.name in cls.__members__:
        return cls[value.name]
    if isinstance(value, str):
        key = value.strip().lower().replace("_", "-")
        for member in cls:
            if member.value == key:
                return member
    choices = ", ".join(repr(m.value) for m in cls)
    raise ValueError(f"{what} must be one of {choices} (or {cls.__name__}.*), got {value!r}")


class AllreduceMethod(_KfacNamed):
    """kfac-pytorch's: how factors are all-reduced; from allreduce_bucket_cap_mb (0: one
    collective per factor, else fused into buckets of that size)."""

    ALLREDUCE = "allreduce"
    ALLREDUCE_BUCKETED = "allreduce-bucketed"
