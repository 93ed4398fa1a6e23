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
    def __init__(self, index: int, layer: KFACLayer, dtype: torch.dtype | None = None,
                 inv_dtype: torch.dtype | None = None) -> None:
        self.index = index
        self.layer = layer
        self.dtype = dtype or factor_dtype(layer.weight)      # kfac-pytorch's factor_dtype
        # kfac-pytorch's inv_dtype; by default the factors' (at least float32: eigh and inv
        # have no half-precision kernels)
        self.inv_dtype = inv_dtype or (self.dtype if self.dtype.itemsize >= 4 else torch.float32)
        self.device = layer.weight.device
        self.a_sum: Tensor | None = None     # sum of the batch factors since the last update
        self.g_sum: Tensor | None = None
        self.a_calls = 0                     # passes in a_sum
        self.g_calls = 0
        self.a_passes = 0                    # passes this step (pipelining counts these)
        self.g_passes = 0
        self.a_expected = 0                     # calls per step seen in the first factor step
        self.g_expected = 0
        # accumulation_steps=k (kfac-pytorch): every k passes are one running-average update;
        # the updates of one step are folded into one tensor, sent once (see fold()).
        self.fold: dict[str, tuple[Tensor, int]] = {}
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
        self.a_passes += 1
        return self.a_calls

    def add_g(self, factor: Tensor) -> int:
        self.g_sum = factor if self.g_sum is None else self.g_sum + factor
        self.g_calls += 1
        self.g_passes += 1
        return self.g_calls

    def batch_a(self) -> Tensor | None:
        return None if self.a_sum is None else self.a_sum / self.a_calls

    def batch_g(self) -> Tensor | None:
        return None if self.g_sum is None else self.g_sum / self.g_calls

    def fold_chunk(self, which: str, decay: float) -> None:
        """An update is due (kfac-pytorch's accumulation_steps): F' = d F + (1 - d) mean, the
        mean over every pass since the last update.
        Kept as C = sum_j (1 - d) d^(u-1-j) mean_j over the u updates of this step, so that
        F after them is d^u F + C: linear in the batch factors, so ranks can average C."""
        mean = self.batch_a() if which == "A" else self.batch_g()
        assert mean is not None
        old = self.fold.get(which)
        folded = mean * (1 - decay) if old is None else old[0] * decay + mean * (1 - decay)
        self.fold[which] = (folded, 1 if old is None else old[1] + 1)
        if which == "A":
            self.a_sum, self.a_calls = None, 0
        else:
            self.g_sum, self.g_calls = None, 0

    def folded(self, which: str, decay: float) -> tuple[Tensor, float] | None:
        """(batch, weight of the old factor) standing for this step's u updates:
        F' = d^u F + (1 - d^u) batch, batch = C / (1 - d^u)."""
        entry = self.fold.get(which)
        if entry is None:
            return None
        keep = decay ** entry[1]
        return entry[0] / (1 - keep), keep

    def clear_batch(self, keep_partial: bool = False) -> None:
        """After a factor step: drop what was sent (with keep_partial, passes that did not make
        a whole accumulation_steps chunk wait for the next step, as in kfac-pytorch)."""
        if not keep_partial:
            self.a_sum = self.g_sum = None
            self.a_calls = self.g_calls = 0
        self.a_passes = self.g_passes = 0
        self.fold = {}

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
                             damping, diagonal, self.inv_dtype)
        except DecompositionError as exc:
            previous = self.a_dec if which == "A" else self.g_dec
            self.warn_once(f"dec-{which}", "dear.KFAC: layer %s: factor %s: %s; %s", self.name,
                           which, exc, "keeping the previous decomposition" if previous
                           else "using the identity")
            if previous is not None:
                return previous
            return decompose(self.identity(which), method, damping, diagonal, self.inv_dtype)

    def warn_once(self, key: str, msg: str, *args: object) -> None:
        if key not in self.warned:
            self.warned.add(key)
            log.warning(msg, *args)

    def memory_usage(self) -> dict[str, int]:
        """Bytes this rank holds for the layer, under kfac-pytorch's keys."""
        def size(*ts: Tensor | None) -> int:
            return sum(t.numel() * t.element_size() for t in ts if t is not None)

        def dec(d: Decomposition | None) -> int:
            return 0 if d is None else size(d.q, d.d, d.inv)
        return {"a_factors": size(self.a), "g_factors": size(self.g),
                "a_batch": size(self.a_sum, *(f[0] for k, f in self.fold.items() if k == "A")),
                "g_batch": size(self.g_sum, *(f[0] for k, f in self.fold.items() if k == "G")),
                "a_inverses": dec(self.a_dec), "g_inverses": dec(self.g_dec)}
