"""Hyperparameters (a value or a callable of the step, as in kfac-pytorch), their checks, and
which modules K-FAC takes."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Iterable
from typing import Any, Union

from torch import nn

from .layers import KFACLayer, make_layer, unsupported_reason

Hyper = Union[float, int, None, Callable[[int], Any]]
NAMES = ("lr", "damping", "factor_decay", "kl_clip", "factor_update_freq", "inv_update_freq")
ALIASES = {"factor_update_steps": "factor_update_freq",      # kfac-pytorch's names
           "inv_update_steps": "inv_update_freq"}


@dataclasses.dataclass(frozen=True)
class Hyperparameters:
    """The values in force at one step."""

    lr: float
    damping: float
    factor_decay: float
    kl_clip: float | None
    factor_update_freq: int
    inv_update_freq: int


def check(name: str, value: Any, step: int | None = None) -> Any:
    """`value` if valid for `name`, else a ValueError that says what is wrong and where from."""
    where = f" (returned by its callable at step {step})" if step is not None else ""

    def fail(expected: str) -> None:
        raise ValueError(f"dear.KFAC: {name} must be {expected}, got {value!r}{where}")

    if name in ("factor_update_freq", "inv_update_freq"):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            fail("an integer >= 1")
        return value
    if name == "kl_clip" and value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        fail("a finite number")
    if name == "damping" and value <= 0:
        fail("> 0 (it keeps (F + damping I) invertible; kfac-pytorch's default is 0.001)")
    if name == "factor_decay" and not 0 <= value <= 1:
        fail("in [0, 1] (the weight of the old factor in the running average; 1 keeps the "
             "factors at their start, as kfac-pytorch allows)")
    if name in ("lr", "kl_clip") and value < 0:
        fail(">= 0")
    return float(value)


def value_at(sources: dict[str, Hyper], name: str, step: int) -> Any:
    """One hyperparameter's value at `step` (its callable evaluated and checked)."""
    source = sources[name]
    return check(name, source(step), step) if callable(source) else source


def resolve(sources: dict[str, Hyper], step: int) -> Hyperparameters:
    return Hyperparameters(**{name: value_at(sources, name, step) for name in NAMES})


def _skipped(name: str, module: nn.Module, skip: Iterable[str | type]) -> bool:
    """kfac-pytorch's rule (kfac/layers/register.py): a string is a regular expression SEARCHED
    (re.search, case-sensitive) in the module's name and in its class name; dear also takes
    module types (isinstance)."""
    for rule in skip:
        if isinstance(rule, type):
            if isinstance(module, rule):
                return True
        elif re.search(rule, name) or re.search(rule, type(module).__name__):
            return True
    return False


def find_layers(model: nn.Module, skip_layers: Iterable[str | type]
                ) -> tuple[list[KFACLayer], list[str]]:
    """The supported layers of `model` in registration order, and a description of every module
    with parameters of its own that K-FAC leaves to the optimizer (with the reason)."""
    skip = list(skip_layers)
    for rule in skip:
        if not isinstance(rule, (str, type)):
            raise TypeError(f"dear.KFAC: skip_layers holds regular expressions (searched in "
                            f"module names and class names) or module types; got {rule!r}")
        if isinstance(rule, str):
            try:
                re.compile(rule)
            except re.error as exc:
                raise ValueError(f"dear.KFAC: skip_layers: {rule!r} is not a regular "
                                 f"expression: {exc}") from None
    layers: list[KFACLayer] = []
    others: list[str] = []
    for name, module in model.named_modules():
        if not any(True for _ in module.parameters(recurse=False)):
            continue
        kind = type(module).__name__
        if _skipped(name, module, skip):
            others.append(f"{name} ({kind}: skip_layers)")
            continue
        layer = make_layer(name, module)
        if layer is not None:
            layers.append(layer)
        else:
            reason = unsupported_reason(module)
            others.append(f"{name} ({kind}{': ' + reason if reason else ''})")
    return layers, others
