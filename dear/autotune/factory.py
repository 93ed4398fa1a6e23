"""Which autotuner an optimizer runs (`autotune=` / DEAR_AUTOTUNE), built from the config.

Both kinds are driven by step() through `on_step()` and switch every rank at the same step:
`OnlineAutotuner` (dear/autotune/online.py) times real iterations, `OfflineAutotuner`
(dear/autotune/offline.py) ranks layouts by the simulator's predictions from a traced window.
"""

from __future__ import annotations

from typing import Any

import torch

from ..comm.base import Communicator
from ..config import Autotune
from ..fusion import fusion_config
from ..fusion.fusion_config import FusionConfig
from .online import FusionTuner, OnlineAutotuner, TrialDriver


def make_autotuner(optimizer: torch.optim.Optimizer,
                   named: list[tuple[str, torch.nn.Parameter]], mode: Autotune, cfg: Any,
                   comm: Communicator, fusion: FusionConfig, schedule: Any, *,
                   overlap: bool, passes_per_step: int) -> TrialDriver:
    """`schedule`: the optimizer's ScheduleDriver (dear/fusion/schedule.py)."""
    model_bytes = fusion_config.gradient_bytes(named)
    fingerprint = fusion_config.model_fingerprint(named)
    # A trial must time the layout as it will run: planned, once its plan is made and checked
    # (a new layout measures plan_after iterations, then runs the plan as many before the
    # check; with plan_verify, the trial against DeAR's order follows), so those are part of
    # the settling.
    settle = (max(cfg.autotune_settle, schedule.settling_iterations + 1) if schedule.enabled
              else cfg.autotune_settle)
    if mode is Autotune.OFFLINE:
        if not overlap:
            raise ValueError(
                "autotune='offline' simulates DeAR's schedule, all-gathers overlapped with "
                "the next forward pass, from a trace of the model's modules: it needs "
                "model= and overlap_allgather=True (or use autotune='online')")
        if passes_per_step > 1:
            raise ValueError("autotune='offline' does not model backward_passes_per_step > 1 "
                             "(use autotune='online')")
        from .offline import OfflineAutotuner
        return OfflineAutotuner(optimizer, comm, fusion, fingerprint=fingerprint,
                                model_bytes=model_bytes, settle=settle,
                                window=cfg.autotune_window,
                                simulated_trials=cfg.autotune_simulated_trials,
                                confirm=cfg.autotune_confirm,
                                log_path=cfg.autotune_log or None,
                                out_path=cfg.autotune_out or None)
    tuner = FusionTuner(model_bytes, budget=cfg.autotune_trials, initial=fusion,
                        chunk_bytes=schedule.searched_chunk_bytes)
    return OnlineAutotuner(tuner, comm, fusion, fingerprint=fingerprint, settle=settle,
                           window=cfg.autotune_window, log_path=cfg.autotune_log or None,
                           out_path=cfg.autotune_out or None)
