"""Quantized compression's state between iterations: the warm-up count and the residuals.

The residuals live in the quantized buckets (one flat buffer each, dear/fusion/quantized.py);
this object carries them per parameter across a re-layout (autotuner, new parameters, the end
of the warm-up), into `optimizer.state_dict()` and back from `load_state_dict()`. Residuals
are per rank: a checkpoint holds the saving rank's, and a rank that loads another rank's
starts its own from zero (said once at WARNING), so a bit-identical resume saves every rank's
optimizer.state_dict() and loads each into its own rank.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Optional

import torch

from ..comm.compression import ERROR_FEEDBACK_KEY, Compression, Compressor
from ..fusion.quantized import QuantizedBucket

if TYPE_CHECKING:
    from .engine import Engine

log = logging.getLogger("dear")

STATE_KEY = ERROR_FEEDBACK_KEY


class ErrorFeedback:
    def __init__(self, compression: Compressor) -> None:
        self.compression = compression
        self.steps = 0                     # step()s that averaged gradients (the warm-up)
        self.saved: dict[int, torch.Tensor] = {}   # per parameter, between layouts
        self.said_no_residuals = False     # load_without_residuals' warning, said once

    @property
    def warm(self) -> bool:
        return self.steps >= getattr(self.compression, "warmup_steps", 0)

    def wire_compression(self) -> Compressor:
        """What the next layout's buckets use: fp32 until the warm-up is over."""
        return self.compression if self.warm else Compression.none

    def snapshot(self, engine: "Engine") -> dict[int, torch.Tensor]:
        """Every parameter's residual: copies out of the buckets, and those still saved."""
        out = dict(self.saved)
        for bucket in engine.buckets or ():
            if isinstance(bucket, QuantizedBucket) and bucket.residual is not None:
                for j, i in enumerate(bucket.spec.params):
                    view = bucket.residual_of(j)
                    assert view is not None
                    out[i] = view.clone()
        return out

    def collect(self, engine: "Engine") -> None:
        """Before a re-layout: every parameter's residual, copied out of its bucket."""
        self.saved = self.snapshot(engine)

    def restore(self, engine: "Engine") -> None:
        """After a re-layout: the residuals into the new buckets (what no bucket takes, e.g.
        during the warm-up, stays saved)."""
        if not self.saved:
            return
        for bucket in engine.buckets or ():
            if isinstance(bucket, QuantizedBucket) and bucket.residual is not None:
                for j, i in enumerate(bucket.spec.params):
                    saved = self.saved.pop(i, None)
                    view = bucket.residual_of(j)
                    if saved is not None and view is not None:
                        view.copy_(saved.reshape(-1))

    def after_step(self, engine: "Engine") -> bool:
        """Count a step(); True when the warm-up just ended (the caller re-lays out, at the
        same step() on every rank, with nothing in flight)."""
        was_warm = self.warm
        self.steps += 1
        return self.warm and not was_warm and engine.buckets is not None

    # ------------------------------------------------------------------ checkpoints
    def state(self, engine: "Engine") -> dict[str, Any]:
        residuals = self.snapshot(engine)
        return {"rank": engine.comm.rank, "world_size": engine.comm.size, "steps": self.steps,
                "compression": repr(self.compression),
                "residuals": {i: t.view_as(engine.params[i]) for i, t in residuals.items()}}

    def load(self, engine: "Engine", state: Optional[dict[str, Any]]) -> None:
        """From a state_dict(): the warm-up count always, the residuals if they are this
        rank's (else zero, said once)."""
        if state is None:
            return
        self.steps = int(state.get("steps", 0))
        rank, size = engine.comm.rank, engine.comm.size
        residuals = state.get("residuals", {})
        mine = state.get("rank") == rank and state.get("world_size") == size
        if residuals and not mine:
            log.warning("dear: the checkpoint's error-feedback residuals are rank %s's (of %s); "
                        "rank %d starts its own from zero. For a bit-identical resume, save "
                        "each rank's optimizer.state_dict() and load it on the same rank",
                        state.get("rank"), state.get("world_size"), rank)
        for bucket in engine.buckets or ():
            if isinstance(bucket, QuantizedBucket) and bucket.residual is not None:
                bucket.residual.zero_()
        self.saved = {}
        if mine:
            self.saved = {int(i): t.to(engine.params[int(i)].device, torch.float32).clone()
                          for i, t in residuals.items()}
            self.restore(engine)

    def load_without_residuals(self, engine: "Engine", steps: int) -> None:
        """From a sharded (DCP) checkpoint: the warm-up count; the residuals start from zero
        (such a checkpoint holds none: they are per rank and do not reshard), said once."""
        if not self.said_no_residuals:
            self.said_no_residuals = True
            log.warning("dear: a sharded (DCP) checkpoint holds no error-feedback residuals "
                        "(they are per rank and do not reshard): they start from zero. For a "
                        "bit-identical resume on the same ranks, save and load each rank's "
                        "optimizer.state_dict()")
        self.load(engine, {"steps": steps})
