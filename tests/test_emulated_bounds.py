"""benchmarks.emulated_bench.dependency_bound against hand-computed cases."""

from __future__ import annotations

import pytest

from benchmarks.emulated_bench import dependency_bound


def test_first_layer_ready_last_and_needed_first() -> None:
    # F = 3. Layer 1: ready at 3 + (2 + 4) = 9, its 3 s of link after that, needed at T + 0:
    # T >= 12. Layer 2: ready at 3 + 4 = 7, layers 1..2 need 4 s, needed at T + 1: T >= 10.
    # T_comm = 4, T_compute = 9.
    assert dependency_bound([1, 2], [2, 4], [3, 1]) == pytest.approx(12)


def test_link_bound_case() -> None:
    # Layer 2 binds: ready at 2 + 1 = 3, 10 s of link, needed at T + 1: T >= 12 > T_comm = 10.
    assert dependency_bound([1, 1], [1, 1], [5, 5]) == pytest.approx(12)
    # no communication: the compute
    assert dependency_bound([1, 2], [2, 4], [0, 0]) == pytest.approx(9)
    with pytest.raises(ValueError):
        dependency_bound([1], [1, 2], [1])
