"""The choices K-FAC offers, as enums (strings are accepted at the API and converted once)."""

from __future__ import annotations

import enum
from typing import Any, TypeVar

E = TypeVar("E", bound=enum.Enum)


class ComputeMethod(enum.Enum):
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
    PAD:      factors REDUCED to the layer's owner only; owners are contiguous blocks of layers
              (dynamic programming, minimal maximum load), so reduces and broadcasts fuse.
    AUTO:     the cheapest of the three under an alpha-beta network model and the calibrated
              compute model, decided once the layers are known.
    """

    COMM_OPT = "comm-opt"
    MEM_OPT = "mem-opt"
    PAD = "pad"
    AUTO = "auto"


def parse(cls: type[E], value: Any, what: str) -> E:
    """`value` as a member of `cls`: a member, or its value string (case-insensitive, '_'/'-')."""
    if isinstance(value, cls):
        return value
    if isinstance(value, str):
        key = value.strip().lower().replace("_", "-")
        for member in cls:
            if member.value == key:
                return member
    choices = ", ".join(repr(m.value) for m in cls)
    raise ValueError(f"{what} must be one of {choices} (or {cls.__name__}.*), got {value!r}")
