"""The sizes that decide the bucket layout and the planned schedule, and the JSON file that
keeps a tuned choice.

Why three, not one threshold:
- `rs_threshold`: bytes of gradient per reduce-scatter bucket. Small buckets start reducing
  early in backward but pay per-collective latency; large ones start late.
- `ag_threshold`: bytes per all-gather. Consecutive buckets (in forward order) are all-gathered
  together up to this size: the all-gathers overlap a forward pass that has no backward-style
  readiness constraint, so they can prefer fewer, larger messages than the reduce-scatters.
  It can only merge whole reduce-scatter buckets (each rank holds a shard of every bucket).
- `first_bucket`: bytes of the first bucket in forward order, reduced last and gathered first.
  It sits on the critical path twice: its reduce-scatter is what remains exposed after backward
  ends, its all-gather is what the next forward waits for before the first layer can run.
  None: no special first bucket.
- `chunk_bytes`: bytes of an all-gather chunk the planned schedule sends in backward's idle link
  time (dear/fusion/schedule.py). Small chunks fit shorter gaps but each pays a collective's
  latency; large ones fit only long gaps. None: Config's (DEAR_CHUNK_BYTES). It changes no
  bucket, only the plan, and does nothing in DeAR's order.

A saved file names the model it was tuned for (a fingerprint of parameter names, shapes and
dtypes); loading it for another model is refused, not silently applied.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from typing import Any, Optional, Sequence

import torch

FORMAT = "dear-fusion-config/1"


@dataclasses.dataclass(frozen=True)
class FusionConfig:
    rs_threshold: int
    ag_threshold: int
    first_bucket: Optional[int] = None
    chunk_bytes: Optional[int] = None

    def __post_init__(self) -> None:
        for name in ("rs_threshold", "ag_threshold"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative number of bytes, got {value!r}")
        if self.first_bucket is not None and (not isinstance(self.first_bucket, int)
                                              or self.first_bucket < 0):
            raise ValueError(f"first_bucket must be None or a non-negative number of bytes, "
                             f"got {self.first_bucket!r}")
        if self.chunk_bytes is not None and (not isinstance(self.chunk_bytes, int)
                                             or self.chunk_bytes < 1):
            raise ValueError(f"chunk_bytes must be None or a positive number of bytes, "
                             f"got {self.chunk_bytes!r}")

    @classmethod
    def single(cls, threshold: int) -> "FusionConfig":
        """One threshold for both collectives: DeAR's (and Horovod's) one knob."""
        return cls(rs_threshold=threshold, ag_threshold=threshold)

    def describe(self) -> str:
        first = "-" if self.first_bucket is None else _mb(self.first_bucket)
        chunk = "" if self.chunk_bytes is None else f" / chunk {_mb(self.chunk_bytes)}"
        return (f"rs {_mb(self.rs_threshold)} / ag {_mb(self.ag_threshold)} / first {first}"
                f"{chunk}")


def _mb(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MB"


def model_fingerprint(named: Sequence[tuple[str, torch.Tensor]]) -> str:
    """Names, shapes and dtypes of the trained parameters, in order: what a layout depends on."""
    digest = hashlib.sha256()
    for name, p in named:
        digest.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
    return digest.hexdigest()[:16]


def gradient_bytes(named: Sequence[tuple[str, torch.Tensor]]) -> int:
    """Bytes of gradient the trained parameters produce per iteration: what sizes a layout."""
    return sum(p.numel() * p.element_size() for _, p in named)


def save(path: str, config: FusionConfig, fingerprint: str, **info: Any) -> None:
    """Write atomically (temp file + rename): a crash never leaves half a file behind."""
    payload = {"format": FORMAT, "model_fingerprint": fingerprint,
               "config": dataclasses.asdict(config), **info}
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".dear-fusion-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(payload, f, indent=2)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load(path: str, fingerprint: str) -> FusionConfig:
    """Read a saved config; refuse one that is malformed or was tuned for another model."""
    hint = "delete it or tune again (autotune=True)"
    try:
        with open(path) as f:
            payload = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"fusion config {path} does not exist") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"fusion config {path} is not valid JSON ({exc}); {hint}") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise ValueError(f"fusion config {path} is not a dear fusion config (expected format "
                         f"{FORMAT!r}); {hint}")
    if payload.get("model_fingerprint") != fingerprint:
        raise ValueError(
            f"fusion config {path} was tuned for another model (fingerprint "
            f"{payload.get('model_fingerprint')!r}, this model's is {fingerprint!r}: parameter "
            f"names, shapes or dtypes differ); {hint}")
    raw: Any = payload.get("config")
    try:                                       # files from before chunk_bytes: None, the default
        config = FusionConfig(int(raw["rs_threshold"]), int(raw["ag_threshold"]),
                              _optional_int(raw.get("first_bucket")),
                              _optional_int(raw.get("chunk_bytes")))
    except (TypeError, KeyError, ValueError, OverflowError) as exc:
        # OverflowError: Infinity (json reads it as a float), int() cannot hold it
        raise ValueError(f"fusion config {path} has a malformed 'config' entry ({exc!r}); "
                         f"{hint}") from None
    if config.chunk_bytes is not None and config.chunk_bytes < 1024:
        raise ValueError(f"fusion config {path}: chunk_bytes must be >= 1KB, as "
                         f"DEAR_CHUNK_BYTES must, got {config.chunk_bytes}; {hint}")
    return config


def _optional_int(value: Any) -> Optional[int]:
    return None if value is None else int(value)
