"""The commands README.md gives a user run as written."""

import os
import re

import pytest

from tests.subprocesses import BIN, ROOT, run


def readme_commands() -> list[str]:
    """The command lines of README.md's bash blocks (continuations joined, comments dropped)."""
    with open(os.path.join(ROOT, "README.md")) as fh:
        blocks = re.findall(r"```bash\n(.*?)```", fh.read(), re.S)
    lines = []
    for block in blocks:
        text = re.sub(r"\\\n\s*", " ", block)
        lines += [ln.split("#")[0].strip() for ln in text.splitlines() if ln.split("#")[0].strip()]
    return lines


def test_readme_commands_need_no_activated_venv():
    """After `make demo` / `make test` nothing is on PATH: a program the set-up installed
    (python, torchrun, horovodrun, mpirun, ...) is named by its .venv/bin path."""
    installed = set(os.listdir(BIN))
    commands = readme_commands()
    assert any(".venv/bin/torchrun" in c for c in commands)
    for command in commands:
        for word in re.split(r"[\s;&|()]+", command):
            assert word not in installed, f"{word!r} needs the venv on PATH: {command}"


def test_quickstart_under_torchrun():
    """README's quick-start line, as written, in a shell whose PATH has no .venv/bin."""
    line = next(c for c in readme_commands() if "examples/quickstart.py" in c)
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin"}
    res = run(["bash", "-c", line], timeout=120, env=env)
    assert res.returncode == 0, res.stdout
    lines = re.findall(r"rank (\d)/2: loss ([\d.]+), accuracy ([\d.]+)", res.stdout)
    assert sorted(r for r, _, _ in lines) == ["0", "1"], res.stdout
    assert lines[0][1:] == lines[1][1:]             # every rank reports the same averages
    assert float(lines[0][2]) > 0.9                 # it learned


def test_quickstart_single_process():
    res = run([os.path.join(BIN, "python"), "examples/quickstart.py"], timeout=60)
    assert res.returncode == 0 and "rank 0/1" in res.stdout, res.stdout


def test_demo_short():
    res = run([os.path.join(BIN, "python"), "-m", "benchmarks.demo", "--loopback", "--iters", "8",
               "--rounds", "2", "--hidden", "128"], timeout=180)
    assert res.returncode == 0, res.stdout
    for method in ("ddp", "dear"):            # median, one median per round, final loss
        assert re.search(rf"^{method}\s+[\d.]+\s+[\d.]+ [\d.]+\s+[\d.]+$", res.stdout,
                         re.M), res.stdout
    ratio = re.search(r"^DeAR / DDP iteration time per round: ([\d.]+) ([\d.]+) ", res.stdout,
                      re.M)
    assert ratio, res.stdout
    # Whatever the ratio, loopback's numbers come with what they cannot show.
    assert "no link time for DeAR to hide" in res.stdout, res.stdout


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="the shaped link needs root")
def test_demo_on_a_shaped_link():
    """What `make demo` runs as root: ratios to T_lb for DDP and DeAR, losses compared (one
    round instead of two: the suite checks that it works, the ratios are `make demo`'s)."""
    res = run([os.path.join(BIN, "python"), "-m", "benchmarks.demo", "--rounds", "1"],
              timeout=420)
    assert res.returncode == 0, res.stdout + res.stderr
    rows = {m: re.search(rf"^{m}\s+(\d+)\s+([\d.]+)\s+same$", res.stdout, re.M)
            for m in ("ddp", "dear")}
    assert all(rows.values()), res.stdout
    assert "physical limit T_lb" in res.stdout
