"""Moved: dear/engine/state.py (`Iteration`). Kept so that `dear.iteration.Iteration` still
imports."""

from .engine.state import Iteration

__all__ = ["Iteration"]
