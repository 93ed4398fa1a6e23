"""dear.KFAC's checkpoint contents: running factors and decompositions per layer, as tensors
detached from the live state (so a later step cannot change a saved checkpoint)."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

from torch import Tensor

from .enums import ComputeMethod
from .linalg import Decomposition
from .state import LayerState

# kfac-pytorch's state_dict keys for the hyperparameters that are plain values
_HYPER_KEYS = {"factor_update_steps": "factor_update_freq", "inv_update_steps": "inv_update_freq",
               "damping": "damping", "factor_decay": "factor_decay", "kl_clip": "kl_clip",
               "lr": "lr"}


def save(steps: int, method: ComputeMethod, decomposition_damping: float | None,
         sources: Mapping[str, Any], layers: Sequence[LayerState],
         include_factors: bool) -> dict[str, Any]:
    """kfac-pytorch's layout ('steps', plain hyperparameters, 'layers' with 'A' and 'G') plus
    the decompositions and the damping they were made with (`sources`: each hyperparameter's
    value or callable; callables are not saved)."""
    out: dict[str, Any] = {"steps": steps, "method": method.value,
                           "decomposition_damping": decomposition_damping}
    for key, name in _HYPER_KEYS.items():
        if not callable(sources[name]):
            out[key] = sources[name]
    if include_factors:
        out["layers"] = {s.name: layer_state(s) for s in layers}
    return out


@dataclasses.dataclass
class Restored:
    """What load() read that the preconditioner itself keeps."""

    steps: int
    hyperparameters: dict[str, Any]          # plain values saved, by kfac-pytorch's names
    decomposition_damping: float | None
    force_decompose: bool                    # decompositions to recompute at the next step


def load(state: dict[str, Any], layers: Sequence[LayerState], method: ComputeMethod,
         compute_inverses: bool = True) -> Restored:
    """As kfac-pytorch: saved plain hyperparameters replace the current ones; factors are
    restored into `layers`; decompositions are recomputed at the next step where the checkpoint
    lacks them (a kfac-pytorch checkpoint never has them), unless compute_inverses=False."""
    if "steps" not in state:
        raise ValueError("dear.KFAC.load_state_dict: not a KFAC state_dict (no 'steps')")
    names = {s.name: s for s in layers}
    unknown = sorted(set(state.get("layers", {})) - set(names))
    if unknown:
        raise ValueError(f"dear.KFAC.load_state_dict: the checkpoint has layers this model "
                         f"lacks: {unknown}")
    same_method = state.get("method") == method.value
    steps = int(state["steps"])
    hyper = {name: state[key] for key, name in _HYPER_KEYS.items() if key in state}
    damping = state.get("decomposition_damping")
    for name, saved in state.get("layers", {}).items():
        s = names[name]
        s.a, s.g = clone(saved.get("A")), clone(saved.get("G"))
        s.a_dec = decomposition(saved.get("A_dec"), method) if same_method else None
        s.g_dec = decomposition(saved.get("G_dec"), method) if same_method else None
    # Decompositions missing where factors exist are recomputed at the next step, by every
    # rank's plan (all ranks load the same checkpoint, so they agree); so is a checkpoint that
    # does not say with which damping they were made.
    force = compute_inverses and ("layers" not in state or not same_method or any(
        (s.a is not None and s.a_dec is None) for s in layers) or (
        damping is None and steps > 0))
    return Restored(steps, hyper, damping, force)


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
