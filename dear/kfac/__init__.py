"""Distributed K-FAC: kfac-pytorch's preconditioner with SPD-KFAC's pipelined, bucketed,
symmetry-aware factor communication and load-balanced decompositions, and PAD-KFAC's
placement-aware reduce-to-owner with contiguous layer blocks."""

from .costs import CostModel, NetworkModel
from .enums import ComputeMethod, Strategy
from .preconditioner import KFAC

__all__ = ["KFAC", "ComputeMethod", "CostModel", "NetworkModel", "Strategy"]
