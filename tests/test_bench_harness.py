"""benchmarks/timing.py's one timed loop: which iterations are timed, what each phase holds."""

import pytest
import torch

from benchmarks import timing


class _CountingOptimizer:
    def __init__(self, params: list[torch.Tensor]) -> None:
        self.inner = torch.optim.SGD(params, lr=0.1)
        self.zeroed = self.stepped = 0

    def zero_grad(self) -> None:
        self.zeroed += 1
        self.inner.zero_grad()

    def step(self) -> None:
        self.stepped += 1
        self.inner.step()


def test_train_loop_times_only_the_iterations_after_warm_up() -> None:
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 1)
    opt = _CountingOptimizer(list(net.parameters()))
    clipped, after = [], []

    def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(step)
        return torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)

    run = timing.train_loop(net, opt, batch, torch.nn.functional.mse_loss, 3, 5, start=10,
                            barrier=False, after_backward=lambda: clipped.append(1),
                            after_step=after.append)
    assert opt.zeroed == opt.stepped == 8 and len(clipped) == 8
    assert after == [13, 14, 15, 16, 17]                 # the timed steps' batch numbers
    assert all(len(run.times[k]) == 5 for k in timing.PHASES)
    assert len(run.losses) == 8 and run.losses[0] != run.losses[-1]
    for i in range(5):                                    # total = forward + backward + step
        parts = sum(run.times[k][i] for k in ("forward", "backward", "step"))
        assert run.times["total"][i] == pytest.approx(parts, rel=1e-6, abs=1e-9)
    assert run.cpu_s >= 0 and 0 <= run.machine_busy <= 1
    assert len(timing.time_steps(net, opt, batch, torch.nn.functional.mse_loss, 2)) == 2


def test_quartiles() -> None:
    assert timing.quartiles([2.0]) == (2.0, 2.0, 2.0)
    q1, median, q3 = timing.quartiles([1.0, 2.0, 3.0, 4.0, 5.0])
    assert median == 3.0 and q1 < median < q3


def test_scale_validation_traces_every_scale_and_predicts_each_run_from_its_own(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """benchmarks/scale_validate.py: --trace-each-scale adds a traced 2-rank setup for each
    parameter scale the group's runs use (at the link slowed by that scale), and each run is
    predicted from the trace at its own scale, else from the group's first trace."""
    from benchmarks import scale_validate as sv

    assert sv.plan("m", "2gbit", [2, 3, 4, 6, 8], 2e9) == [
        (2, "m:2:1000mbit:2"), (3, "m:3:500mbit:4"), (4, "m:4:500mbit:4"),
        (6, "m:6:250mbit:8"), (8, "m:8:250mbit:8")]
    assert sv.plan("m", "2gbit", [2, 3, 4, 6, 8], 2e9, trace_each_scale=True) == [
        (2, "m:2:1000mbit:2"), (2, "m:2:500mbit:4"), (2, "m:2:250mbit:8"),
        (3, "m:3:500mbit:4"), (4, "m:4:500mbit:4"), (6, "m:6:250mbit:8"),
        (8, "m:8:250mbit:8")]

    def rep(n: int, scale: int, traced: bool = False) -> dict:
        r = {"model": "m", "link": "2gbit", "ranks": n, "scale": scale,
             "setup": f"m:{n}:{2000 // scale}mbit:{scale}"}
        if traced:
            r["extra"] = {}
        return r

    reps = [rep(2, 2, True), rep(2, 8, True), rep(3, 4), rep(6, 8), rep(8, 8)]
    seen: list = []
    monkeypatch.setattr(sv, "predict_group", lambda base, runs: seen.append(
        (base["setup"], [r["setup"] for r in runs])) or [])
    sv.groups(reps)
    assert seen == [("m:2:1000mbit:2", ["m:2:1000mbit:2", "m:3:500mbit:4"]),
                    ("m:2:250mbit:8", ["m:2:250mbit:8", "m:6:250mbit:8", "m:8:250mbit:8"])]
    seen.clear()
    sv.groups(reps, excluded=frozenset({"m:2:250mbit:8"}))
    assert seen == [("m:2:1000mbit:2", [r["setup"] for r in reps])]
