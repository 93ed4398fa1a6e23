"""The one link model (dear/comm/link.py) against the ring formulas it stands for, its one
measurement against a link whose costs are known, and the three users holding that model: the
planned schedule's probe, dear.KFAC's network figures and dear.diagnose's fitted cost model."""

from __future__ import annotations

import math

import pytest

from dear.comm.link import LinkModel, measure_link
from dear.diagnose import CostModel
from dear.fusion import plan
from dear.kfac import NetworkModel


def test_collectives_cost_what_a_ring_moves() -> None:
    a, rate, n, s = 1e-4, 1e8, 4, 8e6
    link = LinkModel.uniform(a, 1 / rate, world_size=n)
    assert link.time("reduce_scatter", s) == pytest.approx((n - 1) * a + (n - 1) / n * s / rate)
    assert link.time("all_gather", s) == pytest.approx((n - 1) * a + (n - 1) / n * s / rate)
    assert link.time("all_reduce", s) == pytest.approx(2 * (n - 1) * a
                                                       + 2 * (n - 1) / n * s / rate)
    assert link.time("broadcast", s) == pytest.approx((n - 1) * a + s / rate)
    assert link.time("send", s) == pytest.approx(a + s / rate)
    assert link.time("all_reduce", s, world_size=1) == 0.0
    assert link.bytes_in("reduce_scatter", link.reduce_scatter(s)) == pytest.approx(s)
    assert link.slower(2).all_gather(s) == pytest.approx(2 * link.all_gather(s))
    assert LinkModel.uniform(0.0, 0.0).time("all_reduce", 1e9) == 0.0   # a free network


@pytest.mark.parametrize("n", [2, 3, 8])
def test_the_measurement_recovers_a_known_link(n: int) -> None:
    """A virtual clock that each collective advances by a known model's time: the two-size fit
    returns that model's latency and rate for each kind measured."""
    true = LinkModel({"reduce_scatter": 3e-5, "all_gather": 5e-5, "all_reduce": 4e-5},
                     {"reduce_scatter": 1.2e8, "all_gather": 0.9e8, "all_reduce": 1.1e8}, n)
    now = [0.0]

    def run(kind: str, nbytes: int) -> None:
        now[0] += true.time(kind, nbytes)

    got = measure_link(run, ("reduce_scatter", "all_gather", "all_reduce"), (1 << 20, 8 << 20),
                       n, clock=lambda: now[0])
    for kind in ("reduce_scatter", "all_gather", "all_reduce"):
        assert got.alpha[kind] == pytest.approx(true.alpha[kind], rel=1e-6)
        assert got.rate[kind] == pytest.approx(true.rate[kind], rel=1e-9)
    with pytest.raises(ValueError, match="two sizes"):
        measure_link(run, ("all_reduce",), (8 << 20, 1 << 20), n)


def test_the_planner_kfac_and_the_simulator_hold_the_same_model() -> None:
    import typing
    hints = typing.get_type_hints(plan.probe_link)
    assert hints["return"] is LinkModel
    assert issubclass(CostModel, LinkModel)
    net = NetworkModel(2e-5, 1e-9)
    assert isinstance(net.link, LinkModel)
    assert net.all_reduce(1e6, 4) == pytest.approx(net.link.time("all_reduce", 1e6, 4))
    # K-FAC's direct sends: the busiest rank's busier direction, one latency per message
    assert net.owners_exchange([1e6, 3e6], messages=2) == pytest.approx(2 * 2e-5 + 3e6 * 1e-9)
    assert math.isinf(NetworkModel(0.0, 0.0).link.rate["all_reduce"])
