"""dear.KFAC's checkpoint contents: running factors and decompositions per layer, as tensors
detached from the live state (so a later step cannot change a saved checkpoint)."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from .enums import ComputeMethod
from .linalg import Decomposition
from .state import LayerState


def clone(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.detach().clone()


def layer_state(s: LayerState) -> dict[str, Any]:
    out: dict[str, Any] = {"A": clone(s.a), "G": clone(s.g)}
    for key, dec in (("A_dec", s.a_dec), ("G_dec", s.g_dec)):
        out[key] = None if dec is None else {"q": clone(dec.q), "d": clone(dec.d),
                                             "inv": clone(dec.inv)}
    return out


def decomposition(saved: dict[str, Any] | None, method: ComputeMethod) -> Decomposition | None:
    if saved is None:
        return None
    return Decomposition(method, clone(saved["q"]), clone(saved["d"]), clone(saved["inv"]))
