"""Cost models: seconds to decompose and to precondition (calibrated on this machine), and an
alpha-beta network model (measured on the group), from which the plan and `auto` are made.

Decomposing a d x d factor costs c0 + c3 d^3 (eigh and inverse are both cubic; their constants
differ and are fitted separately by least squares on a few sizes). Preconditioning a (g, a)
gradient costs its matrix products' flops at the measured matmul rate. A message of b bytes
costs alpha + beta b; collectives are costed as ring / direct-send schedules move bytes
(dear/comm/link.py, the one link model).
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from collections.abc import Sequence

import torch

from ..comm.link import LinkModel
from .enums import ComputeMethod

_CALIBRATION_DIMS = (32, 96, 192, 256)


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Seconds of compute on this machine (one thread of the calling process)."""

    eigen: tuple[float, float] = (2e-5, 2.5e-9)     # (c0, c3): eigh of a d x d factor
    inverse: tuple[float, float] = (1e-5, 6e-10)    # (c0, c3): inverse of a d x d factor
    flop_s: float = 2e-11                           # seconds per multiply-add in matmul

    def decompose(self, method: ComputeMethod, dim: int, diagonal: bool = False) -> float:
        if diagonal:
            return self.inverse[0] + dim * self.flop_s
        c0, c3 = self.eigen if method is ComputeMethod.EIGEN else self.inverse
        return c0 + c3 * dim ** 3

    def precondition(self, method: ComputeMethod, g_dim: int, a_dim: int,
                     diagonal_a: bool = False) -> float:
        right = 0 if diagonal_a else g_dim * a_dim * a_dim
        products = g_dim * g_dim * a_dim + right
        return (2 if method is ComputeMethod.EIGEN else 1) * products * self.flop_s


@dataclasses.dataclass(frozen=True)
class NetworkModel:
    """dear.KFAC's figures of the link: `alpha` seconds per message, `beta` seconds per byte on
    one link direction. The collectives are costed by dear/comm/link.py's `LinkModel` (the
    model the planned schedule and dear.diagnose use) with this one latency and rate."""

    alpha: float = 5e-5
    beta: float = 8e-9 / 10      # 10 Gbit/s

    @functools.cached_property
    def link(self) -> LinkModel:
        return LinkModel.uniform(self.alpha, self.beta)

    def all_reduce(self, nbytes: float, ranks: int) -> float:
        if ranks == 1 or nbytes == 0:
            return 0.0
        return self.link.time("all_reduce", nbytes, ranks)

    def owners_exchange(self, bytes_by_owner: Sequence[float], messages: int = 1) -> float:
        """Reduce to owners or broadcast from owners by direct sends: owner r sends (or
        receives) (N-1) x its bytes, and receives (or sends) everyone else's: the busier
        direction of the busiest rank sets the time."""
        ranks, total = len(bytes_by_owner), sum(bytes_by_owner)
        if ranks == 1 or total == 0:
            return 0.0
        busiest = max(max((ranks - 1) * b, total - b) for b in bytes_by_owner)
        return (messages - 1) * self.alpha + self.link.time("send", busiest)


_calibrated: CostModel | None = None


def _median_seconds(fn, repeats: int) -> float:  # type: ignore[no-untyped-def]
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _fit(dims: Sequence[int], seconds: Sequence[float]) -> tuple[float, float]:
    """Least squares t = c0 + c3 d^3 (both clamped positive)."""
    x = torch.tensor([float(d) ** 3 for d in dims], dtype=torch.float64)
    y = torch.tensor(seconds, dtype=torch.float64)
    design = torch.stack([torch.ones_like(x), x], dim=1)
    c0, c3 = torch.linalg.lstsq(design, y.unsqueeze(1)).solution.squeeze(1).tolist()
    c3 = max(c3, 1e-15)
    return max(c0, 0.0), c3


def calibrate(dims: Sequence[int] = _CALIBRATION_DIMS, repeats: int = 3,
              refresh: bool = False) -> CostModel:
    """Time eigh, inverse and matmul on this process (once; cached for the process)."""
    global _calibrated
    if _calibrated is not None and not refresh:
        return _calibrated
    gen = torch.Generator().manual_seed(0)
    eig, inv = [], []
    for d in dims:
        x = torch.randn(d, d, generator=gen)
        spd = x @ x.t() / d + torch.eye(d)
        eig.append(_median_seconds(lambda m=spd: torch.linalg.eigh(m), repeats))
        inv.append(_median_seconds(lambda m=spd: torch.linalg.inv(m), repeats))
    n = 256
    a, b = torch.randn(n, n, generator=gen), torch.randn(n, n, generator=gen)
    mm = _median_seconds(lambda: a @ b, repeats)
    _calibrated = CostModel(_fit(dims, eig), _fit(dims, inv), mm / n ** 3)
    return _calibrated
