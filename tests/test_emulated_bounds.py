"""benchmarks.emulated_report.dependency_bound against hand-computed cases."""

from __future__ import annotations

import pytest

from benchmarks.emulated_report import dependency_bound


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


def test_validator_costs_horovod_idle_cycles_as_serial_compute() -> None:
    """emulated_validate: Horovod's prediction carries the measured forward slowdown while
    Horovod is initialised and idle (never negative); WFBP its unpacking (bucket by bucket:
    unpack_s); others nothing."""
    from benchmarks import emulated_validate as ev

    class Sim:
        def predict(self, schedule, step_overhead_s=0.0, unpack_s=0.0, **kw):
            class P:
                iteration_time = 1.0 + step_overhead_s + 10 * unpack_s
            self.seen = (schedule, step_overhead_s, unpack_s, kw)
            return P()

    rep = {"extra": {"wfbp_unpack_s": 0.07,
                     "horovod_forward_s": {"plain": 0.29, "horovod": 0.37}}}
    sims = {"trace": Sim()}
    assert abs(ev._predict(sims, rep, "horovod") - 1.08) < 1e-9
    assert abs(ev._predict(sims, rep, "wfbp") - 1.7) < 1e-9     # as unpack_s (per bucket)
    assert ev._predict(sims, rep, "ddp") == 1.0
    # A table the run sent by rows: replayed with the rows it sent (median), by trace index.
    rep["methods"] = {"dear:row_sparse=tables": {"row_sparse": {"word.weight": [30522, 3900.5]}}}
    sims["params"] = [{"name": "pos.weight"}, {"name": "word.weight"}]
    ev._predict(sims, rep, "dear:row_sparse=tables")
    assert sims["trace"].seen == ("planned", 0.0, 0.0, {"row_sparse": {1: (30522, 3900)}})
    rep["extra"]["horovod_forward_s"] = {"plain": 0.30, "horovod": 0.29}
    assert ev.horovod_idle_s(rep) == 0.0
    assert ev.horovod_idle_s({"extra": {}}) == 0.0
