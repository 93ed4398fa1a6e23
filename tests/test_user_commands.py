"""The commands README.md gives a user run as written."""

import os
import re

from tests.subprocesses import BIN, run


def test_quickstart_under_torchrun():
    res = run([os.path.join(BIN, "torchrun"), "--nproc_per_node", "2",
               "examples/quickstart.py"], timeout=120)
    assert res.returncode == 0, res.stdout
    lines = re.findall(r"rank (\d)/2: loss ([\d.]+), accuracy ([\d.]+)", res.stdout)
    assert sorted(r for r, _, _ in lines) == ["0", "1"], res.stdout
    assert lines[0][1:] == lines[1][1:]             # every rank reports the same averages
    assert float(lines[0][2]) > 0.9                 # it learned


def test_quickstart_single_process():
    res = run([os.path.join(BIN, "python"), "examples/quickstart.py"], timeout=60)
    assert res.returncode == 0 and "rank 0/1" in res.stdout, res.stdout


def test_demo_short():
    res = run([os.path.join(BIN, "python"), "-m", "benchmarks.demo", "--iters", "8",
               "--hidden", "128"], timeout=120)
    assert res.returncode == 0, res.stdout
    assert re.search(r"^ddp\s+[\d.]+\s+[\d.]+$", res.stdout, re.M), res.stdout
    assert re.search(r"^dear\s+[\d.]+\s+[\d.]+$", res.stdout, re.M), res.stdout
