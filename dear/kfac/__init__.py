"""Distributed K-FAC: kfac-pytorch's preconditioner with SPD-KFAC's pipelined, bucketed,
symmetry-aware factor communication and load-balanced decompositions, and PAD-KFAC's
placement-aware reduce-to-owner with contiguous layer blocks. `KFACPreconditioner` takes
kfac-pytorch's arguments and defaults (a one-line swap of the import)."""

from .compat import KFACPreconditioner
from .costs import CostModel, NetworkModel
from .enums import AssignmentStrategy, ComputeMethod, DistributedStrategy, Strategy
from .preconditioner import KFAC

__all__ = ["KFAC", "AssignmentStrategy", "ComputeMethod", "CostModel", "DistributedStrategy",
           "KFACPreconditioner", "NetworkModel", "Strategy"]
