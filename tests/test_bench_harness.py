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
