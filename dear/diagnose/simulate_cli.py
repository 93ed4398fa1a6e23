"""`python -m dear.diagnose simulate`: filled in with the simulator."""

from __future__ import annotations

from typing import Any


def add_parser(sub: Any) -> None:
    return None
