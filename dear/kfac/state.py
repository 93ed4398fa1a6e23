"""One layer's K-FAC state: this step's batch factors (accumulated over every forward and
backward pass since the last step), the running factors, and their decompositions."""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from .enums import ComputeMethod
from .layers import KFACLayer, factor_dtype
from .linalg import Decomposition, DecompositionError, decompose

log = logging.getLogger("dear")


class LayerState:
    def __init__(self, index: int, layer: KFACLayer) -> None:
        self.index = index
        self.layer = layer
        self.dtype = factor_dtype(layer.weight)
        self.device = layer.weight.device
        self.a_sum: Tensor | None = None     # sum of this step's batch factors
        self.g_sum: Tensor | None = None
        self.a_calls = 0
        self.g_calls = 0
        self.a_expected = 0                     # calls per step seen in the first factor step
        self.g_expected = 0
        self.a: Tensor | None = None         # running factors (None: never updated)
        self.g: Tensor | None = None
        self.a_dec: Decomposition | None = None
        self.g_dec: Decomposition | None = None
        self.warned: set[str] = set()

    @property
    def name(self) -> str:
        return self.layer.name

    # ------------------------------------------------------------------ batch factors
    def add_a(self, factor: Tensor) -> int:
        self.a_sum = factor if self.a_sum is None else self.a_sum + factor
        self.a_calls += 1
        return self.a_calls

    def add_g(self, factor: Tensor) -> int:
        self.g_sum = factor if self.g_sum is None else self.g_sum + factor
        self.g_calls += 1
        return self.g_calls

    def batch_a(self) -> Tensor | None:
        return None if self.a_sum is None else self.a_sum / self.a_calls

    def batch_g(self) -> Tensor | None:
        return None if self.g_sum is None else self.g_sum / self.g_calls

    def clear_batch(self) -> None:
        self.a_sum = self.g_sum = None
        self.a_calls = self.g_calls = 0

    # ------------------------------------------------------------------ running factors
    def identity(self, which: str) -> Tensor:
        if which == "A" and self.layer.diagonal_a:
            return torch.ones(self.layer.a_dim, dtype=self.dtype, device=self.device)
        dim = self.layer.a_dim if which == "A" else self.layer.g_dim
        return torch.eye(dim, dtype=self.dtype, device=self.device)

    def update(self, which: str, batch: Tensor, decay: float) -> None:
        """F = decay F + (1 - decay) batch, F starting at the identity. A non-finite batch
        factor is skipped (the running factor stays finite) with a warning."""
        if not torch.isfinite(batch).all():
            self.warn_once(f"skip-{which}", "dear.KFAC: layer %s: the batch %s factor has "
                           "non-finite entries (inf/NaN activations or gradients); this "
                           "update of %s is skipped", self.name, which, which)
            return
        current = getattr(self, which.lower())
        if current is None:
            current = self.identity(which)
        setattr(self, which.lower(), current.mul(decay).add_(batch.to(self.dtype), alpha=1 - decay))

    # ------------------------------------------------------------------ decompositions
    def decompose(self, which: str, method: ComputeMethod, damping: float) -> Decomposition:
        """Decompose the running factor (the identity if it was never updated). If that fails,
        keep the previous decomposition, or use the identity's, and warn: never NaN."""
        factor = getattr(self, which.lower())
        diagonal = which == "A" and self.layer.diagonal_a
        try:
            return decompose(self.identity(which) if factor is None else factor, method,
                             damping, diagonal)
        except DecompositionError as exc:
            previous = self.a_dec if which == "A" else self.g_dec
            self.warn_once(f"dec-{which}", "dear.KFAC: layer %s: factor %s: %s; %s", self.name,
                           which, exc, "keeping the previous decomposition" if previous
                           else "using the identity")
            if previous is not None:
                return previous
            return decompose(self.identity(which), method, damping, diagonal)

    def warn_once(self, key: str, msg: str, *args: object) -> None:
        if key not in self.warned:
            self.warned.add(key)
            log.warning(msg, *args)
