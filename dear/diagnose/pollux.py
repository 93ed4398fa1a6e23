"""Pollux's throughput model (Qiao et al., OSDI 2021; AdaptDL's goodput.py), the anchor to beat.

    T_grad = alpha_c + beta_c * local_batch
    T_sync = 0 on one worker; alpha_r + beta_r (N - 2) on one node; alpha_n + beta_n (N - 2)
             across nodes
    T_iter = (T_grad^gamma + T_sync^gamma)^(1 / gamma),  gamma in [1, 10]

Fitted as Pollux fits it (`fit_pollux`): minimise the RMSE of log step times plus the RMSE of
log compute times, plus 1e-3 (gamma - 1)^2 and 1e-2 ((beta_n / alpha_n)^2 + (beta_r /
alpha_r)^2), every parameter >= 1e-8, starting from (0.1, 0.01) x 3 and gamma 1.001, with the
parameters the observations cannot inform pinned: alpha_c at half the mean compute time when
one local batch size was seen; alpha_n, beta_n at 1e-8 without a multi-node observation;
alpha_r, beta_r at 1e-8 without a one-node multi-worker one; beta_n, beta_r at 1e-8 without an
observation of more than 2 workers. From the two points a 2-rank trace gives (1 and 2 workers)
that leaves the sync time flat in N: Pollux then predicts T_iter(N) = T_iter(2) for every N > 2.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import numpy as np

FLOOR = 1e-8
START = (1e-1, 1e-2, 1e-1, 1e-2, 1e-1, 1e-2, 1.0 + 1e-3)


@dataclasses.dataclass(frozen=True)
class Observation:
    """One measured configuration: seconds per step, and of compute alone, at a batch size."""

    nodes: int
    workers: int
    step_s: float
    compute_s: float
    local_batch: float = 1.0


@dataclasses.dataclass(frozen=True)
class PolluxParams:
    alpha_c: float
    beta_c: float
    alpha_n: float
    beta_n: float
    alpha_r: float
    beta_r: float
    gamma: float

    def sync_s(self, nodes: int, workers: int) -> float:
        if workers <= 1:
            return FLOOR
        alpha, beta = ((self.alpha_n, self.beta_n) if nodes > 1
                       else (self.alpha_r, self.beta_r))
        return alpha + beta * max(workers - 2, FLOOR)

    def compute_s(self, local_batch: float = 1.0) -> float:
        return self.alpha_c + self.beta_c * local_batch

    def step_s(self, nodes: int, workers: int, local_batch: float = 1.0) -> float:
        g = self.gamma
        return (self.compute_s(local_batch) ** g + self.sync_s(nodes, workers) ** g) ** (1 / g)


def _loss(x: np.ndarray, obs: Sequence[Observation], regularize: bool
          ) -> tuple[float, np.ndarray]:
    """Pollux's objective and its exact gradient (Pollux differentiates it with autograd;
    finite differences stall on the square roots near a perfect fit)."""
    p = PolluxParams(*map(float, x))
    err = np.zeros(2)
    grads = np.zeros((2, 7))
    terms: list[list[tuple[float, np.ndarray]]] = [[], []]
    g = p.gamma
    for o in obs:
        c = p.compute_s(o.local_batch)
        dc = np.zeros(7)
        dc[0], dc[1] = 1.0, o.local_batch
        s = p.sync_s(o.nodes, o.workers)
        ds = np.zeros(7)
        if o.workers > 1:
            i = 2 if o.nodes > 1 else 4
            ds[i], ds[i + 1] = 1.0, max(o.workers - 2, FLOOR)
        q = c ** g + s ** g
        dlog = (c ** (g - 1) * dc + s ** (g - 1) * ds) / q
        dlog[6] = (-math.log(q) / g ** 2
                   + (c ** g * math.log(c) + s ** g * math.log(s)) / (g * q))
        terms[0].append((math.log(q) / g - math.log(o.step_s), dlog))
        terms[1].append((math.log(c) - math.log(o.compute_s), dc / c))
    for k in (0, 1):
        e = np.array([t for t, _ in terms[k]])
        rmse = math.sqrt(float(np.mean(e ** 2)))
        err[k] = rmse
        if rmse > 0:
            grads[k] = sum(t * d for t, d in terms[k]) / len(e) / rmse
    loss, grad = float(err.sum()), grads.sum(axis=0)
    if regularize:
        loss += 1e-3 * (g - 1) ** 2
        grad[6] += 2e-3 * (g - 1)
        for a, b in ((2, 3), (4, 5)):
            r = x[b] / x[a]
            loss += 1e-2 * r ** 2
            grad[b] += 2e-2 * r / x[a]
            grad[a] -= 2e-2 * r ** 2 / x[a]
    return loss, grad


def fit_pollux(observations: Sequence[Observation], regularize: bool = True,
               start: Optional[Sequence[float]] = None) -> PolluxParams:
    """Pollux's fit of its 7 parameters (see the module's docstring); `regularize=False`
    drops its two penalties (to check that exact data give back their parameters)."""
    from scipy.optimize import minimize
    obs = list(observations)
    if not obs:
        raise ValueError("fit_pollux needs at least one observation")
    for o in obs:
        if not (o.step_s > 0 and o.compute_s > 0 and o.workers >= 1 and 1 <= o.nodes
                <= o.workers):
            raise ValueError(f"bad observation {o}: times must be > 0 and "
                             "1 <= nodes <= workers")
    x0 = list(START if start is None else start)
    lower = [FLOOR] * 6 + [1.0]
    upper = [math.inf] * 6 + [10.0]

    def pin(i: int, value: float) -> None:
        x0[i] = lower[i] = upper[i] = value
    if len({o.local_batch for o in obs}) == 1:
        pin(0, float(np.mean([o.compute_s for o in obs])) / 2)
    if not any(o.nodes > 1 for o in obs):
        pin(2, FLOOR)
        pin(3, FLOOR)
    if not any(o.nodes == 1 and o.workers > 1 for o in obs):
        pin(4, FLOOR)
        pin(5, FLOOR)
    if not any(o.workers > 2 for o in obs):
        pin(3, FLOOR)
        pin(5, FLOOR)
    result = minimize(_loss, np.array(x0), args=(obs, regularize), jac=True, method="L-BFGS-B",
                      bounds=list(zip(lower, upper)),
                      options={"ftol": 1e-15, "gtol": 1e-12, "maxiter": 5000})
    return PolluxParams(*map(float, result.x))
