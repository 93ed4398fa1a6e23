"""The planned schedule's states (dear/fusion/schedule.py's ScheduleState): a ScheduleDriver
walked through them in one process, on stand-in buckets and a one-rank view of a 2-rank world
(rank 0, a broadcast that returns its object), the link probe and the clock between step()s
replaced; and a transition from a state it does not leave from raises before doing anything."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Iterator, Optional

import pytest
import torch

import dear.fusion.schedule as schedule
from dear.comm.link import LinkModel
from dear.fusion.executor import mark_planned
from dear.fusion.schedule import ScheduleDriver, ScheduleState, ScheduleStateError

S = ScheduleState
PLAN_AFTER = 2
BUCKETS = 3


def _slow_link() -> LinkModel:
    """So slow that no chunk fits a gap: the plan is made but has no chunk (nothing to issue
    from stand-in buckets)."""
    return LinkModel({"reduce_scatter": 0.0, "all_gather": 0.0},
                     {"reduce_scatter": 1.0, "all_gather": 1.0}, 2)


@pytest.fixture
def probes(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    """The link probe (a collective) replaced; each call noted."""
    calls: list[Any] = []

    def probe(*args: Any, **kwargs: Any) -> LinkModel:
        calls.append(args)
        return _slow_link()
    monkeypatch.setattr(schedule, "probe_link", probe)
    yield calls


@pytest.fixture
def drivers() -> Iterator[list[ScheduleDriver]]:
    """The drivers a test made: none is left marked as running a plan in this process."""
    made: list[ScheduleDriver] = []
    yield made
    for driver in made:
        mark_planned(driver, False)


def _driver(made: list[ScheduleDriver], mode: Optional[str] = "stream", enabled: bool = True,
            verify: bool = False, size: int = 2, contention_limit: float = 1.0
            ) -> ScheduleDriver:
    comm = SimpleNamespace(size=size, rank=0, broadcast_object=lambda obj, root: obj)
    driver = ScheduleDriver(lambda: comm, enabled, PLAN_AFTER, 1 << 20, mode, verify=verify,
                            contention_limit=contention_limit)
    made.append(driver)
    return driver


def _buckets() -> list[Any]:
    return [SimpleNamespace(spec=SimpleNamespace(index=i), reduce_bytes=1000, gather_numel=125,
                            chunkable=True, buffer=torch.zeros(1)) for i in range(BUCKETS)]


def _iteration(driver: ScheduleDriver) -> ScheduleState:
    """One iteration as the engine drives it: backward submits the reduce-scatters (last
    bucket first), step() has them back, may plan, ends; the state it ends in."""
    for bucket in reversed(driver._buckets):
        driver.reduce_scatter_submitted(bucket, 1.0)
    driver.reduced()
    driver.maybe_plan([4] * len(driver._buckets))
    driver.end_step()
    return driver.state


def test_measured_then_planned_and_checked(probes: list[Any],
                                           drivers: list[ScheduleDriver]) -> None:
    """NO_LAYOUT until the first layout; plan_after iterations measured, then every rank
    probes and the plan runs (PLANNED_CHECKING) for as many, then it is checked (PLANNED).
    Only the measuring states keep a clock."""
    driver = _driver(drivers)
    assert driver.state is S.NO_LAYOUT and driver.enabled and driver._clock is None
    driver.maybe_plan([4] * BUCKETS)                      # nothing to do without a layout
    assert driver.state is S.NO_LAYOUT and not probes
    driver.reset(_buckets())
    assert driver.state is S.MEASURING and driver._clock is not None and driver.plan is None
    states = [_iteration(driver) for _ in range(7)]
    assert states == [S.MEASURING] * 2 + [S.PLANNED_CHECKING] * 2 + [S.PLANNED] * 3, states
    assert len(probes) == 1
    assert driver.plan is not None and driver.plan.num_chunks == 0 and driver.active
    assert driver._clock is None                          # settled: nothing more to measure
    assert driver.settling_iterations == 2 * PLAN_AFTER


def test_a_host_bound_link_settles_on_dears_order(probes: list[Any],
                                                  drivers: list[ScheduleDriver],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 makes no plan where the chunks' link time would come out of backward's compute:
    MEASURING -> DEAR_ORDER, for good (until a new layout). Here all of it would, above
    DEAR_PLAN_CONTENTION's 0.5."""
    monkeypatch.setattr(schedule, "contention", lambda *args: 1.0)
    driver = _driver(drivers, mode="thread", contention_limit=0.5)
    driver.reset(_buckets())
    states = [_iteration(driver) for _ in range(6)]
    assert states == [S.MEASURING] * 2 + [S.DEAR_ORDER] * 4, states
    assert driver.plan is None and not driver.active and driver._clock is None
    assert len(probes) == 1


def test_nothing_measured_gives_no_plan(probes: list[Any],
                                        drivers: list[ScheduleDriver]) -> None:
    """Without a complete backward measured (no sample), rank 0 plans nothing."""
    driver = _driver(drivers)
    driver.reset(_buckets())
    for _ in range(PLAN_AFTER + 1):
        driver.maybe_plan([4] * BUCKETS)
        driver.end_step()
    assert driver.state is S.DEAR_ORDER and driver.plan is None


@pytest.mark.parametrize("planned_step_s,kept", [(0.5, True), (2.0, False)])
def test_the_trial_alternates_windows_and_keeps_only_a_faster_plan(
        planned_step_s: float, kept: bool, probes: list[Any], drivers: list[ScheduleDriver],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """plan_verify: after the check, windows of plan_after iterations alternate between DeAR's
    order and the plan, VERIFY_ROUNDS of each; the plan is kept (PLANNED) only if its step()
    intervals were shorter, else DEAR_ORDER. A virtual clock: 1 s an iteration in DeAR's
    order, `planned_step_s` while the plan runs."""
    now = [0.0]
    monkeypatch.setattr(schedule, "_now", lambda: now[0])
    driver = _driver(drivers, mode="thread", verify=True)
    driver.reset(_buckets())
    states = []
    for _ in range(driver.settling_iterations + 2):
        now[0] += planned_step_s if driver.active else 1.0
        states.append(_iteration(driver))
        assert (driver.plan is not None) == (driver.state in (
            S.PLANNED_CHECKING, S.TRIAL_PLANNED, S.PLANNED)), states
    trial = ([S.TRIAL_DEAR_ORDER] * PLAN_AFTER + [S.TRIAL_PLANNED] * PLAN_AFTER) \
        * schedule.VERIFY_ROUNDS
    settled = S.PLANNED if kept else S.DEAR_ORDER
    assert states == ([S.MEASURING] * PLAN_AFTER + [S.PLANNED_CHECKING] * PLAN_AFTER
                      + trial + [settled] * 2), states
    assert driver._clock is None and driver._trial is None
    assert schedule.planned_somewhere() == kept


def test_paused_and_held_keep_the_state(probes: list[Any],
                                        drivers: list[ScheduleDriver]) -> None:
    """`paused` (dear.KFAC, a tracer) and `held` (sharded: an iteration that may not update
    early) stop the plan from running, not the state machine's counting: paused, the
    transition waits; unpaused, it comes at the next step()."""
    driver = _driver(drivers)
    driver.reset(_buckets())
    driver.paused = True
    states = [_iteration(driver) for _ in range(PLAN_AFTER + 2)]
    assert states == [S.MEASURING] * (PLAN_AFTER + 2) and not probes
    driver.paused = False
    assert _iteration(driver) is S.PLANNED_CHECKING and len(probes) == 1
    assert driver.active
    driver.held = True
    assert not driver.active
    assert _iteration(driver) is S.PLANNED_CHECKING
    assert _iteration(driver) is S.PLANNED                # held: still checked
    driver.held = False
    assert driver.active


def test_a_new_layout_measures_again_from_any_state(probes: list[Any],
                                                    drivers: list[ScheduleDriver]) -> None:
    """reset() (the autotuner's new layout or chunk size) from a measuring, a planned and a
    settled state: the plan dropped, MEASURING from its first step()."""
    driver = _driver(drivers)
    driver.reset(_buckets())
    for leave_after in (1, PLAN_AFTER + 1, 2 * PLAN_AFTER + 1):
        left = [_iteration(driver) for _ in range(leave_after)][-1]
        driver.reset(_buckets()[:2], chunk_bytes=4096)
        assert driver.state is S.MEASURING and driver.plan is None and driver._steps == 0
        assert driver._clock is not None and driver._chunk_bytes == 4096
        assert len(driver._buckets) == 2, left
    assert left is S.PLANNED


@pytest.mark.parametrize("enabled,mode,size", [(False, "thread", 2), (True, None, 2),
                                               (True, "thread", 1)])
def test_disabled_stays_disabled(enabled: bool, mode: Optional[str], size: int, probes: list[Any],
                                 drivers: list[ScheduleDriver]) -> None:
    """DEAR_SCHEDULE=dear, no issue_mode(), one rank: DISABLED, whatever happens."""
    driver = _driver(drivers, mode=mode, enabled=enabled, size=size)
    assert driver.state is S.DISABLED and not driver.enabled
    assert driver.searched_chunk_bytes is None
    driver.reset(_buckets())
    assert [_iteration(driver) for _ in range(5)] == [S.DISABLED] * 5
    assert driver._clock is None and not probes


def test_which_states_count() -> None:
    assert {s for s in S if s.counts} == {S.MEASURING, S.PLANNED_CHECKING,
                                          S.TRIAL_DEAR_ORDER, S.TRIAL_PLANNED}
    assert {s for s in S if s.on_trial} == {S.TRIAL_DEAR_ORDER, S.TRIAL_PLANNED}


def test_a_wrong_transition_raises_before_doing_anything(
        probes: list[Any], drivers: list[ScheduleDriver]) -> None:
    """Each transition leaves from its own states only: asked from another, it raises a
    ScheduleStateError naming both, and neither probes nor changes anything."""
    driver = _driver(drivers)
    with pytest.raises(ScheduleStateError, match="cannot plan from NO_LAYOUT, only from "
                                                 "MEASURING$"):
        driver._plan([4] * BUCKETS)
    driver.reset(_buckets())
    with pytest.raises(ScheduleStateError, match="cannot check the plan from MEASURING, only "
                                                 "from PLANNED_CHECKING$"):
        driver._check([4] * BUCKETS)
    with pytest.raises(ScheduleStateError, match="cannot end a window of the trial from "
                                                 "MEASURING, only from TRIAL_DEAR_ORDER or "
                                                 "TRIAL_PLANNED$"):
        driver._alternate()
    with pytest.raises(ScheduleStateError, match="cannot start a window of the trial from "
                                                 "MEASURING, only from PLANNED_CHECKING, "
                                                 "TRIAL_DEAR_ORDER or TRIAL_PLANNED$"):
        driver._switch(True)
    assert driver.state is S.MEASURING and driver.plan is None and not driver._medians
    for _ in range(2 * PLAN_AFTER + 1):
        _iteration(driver)
    assert driver.state is S.PLANNED
    plan = driver.plan
    with pytest.raises(ScheduleStateError, match="cannot plan from PLANNED,"):
        driver._plan([4] * BUCKETS)
    with pytest.raises(ScheduleStateError, match="trial from PLANNED,"):
        driver._switch(False)                  # a settled plan is not put on trial again
    assert driver.state is S.PLANNED and driver.plan is plan and len(probes) == 1
    assert issubclass(ScheduleStateError, RuntimeError)
