"""dear.DistributedOptimizer inside real Horovod's elastic mode (dear/comm/horovod_elastic.py):
tests/horovod_elastic_script.py under `horovodrun --host-discovery-script`, with hosts removed
and added between epochs (sharded optimizer state), and with a rank killed mid-epoch.

After every change, at each epoch's end, every rank's model and optimizer state are bitwise
equal (their serialized bytes hash alike), and the final model equals single-process training
that replays the committed steps (each step's global batch at the world size it ran at, the LR
the reset callback set for that size): judged as float32 against a float64 replay, with an
independent float32 replay as the measure of rounding (tests/workloads.py's argument: the
same kind of error, summed in another order)."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.horovod_elastic_script import BASE_LR, global_batch, make_model
from tests.horovod_launch import NO_HOROVOD, horovod_available
from tests.subprocesses import BIN, ROOT, run
from tests.workloads import assert_float32_close

pytestmark = pytest.mark.skipif(not horovod_available(), reason=NO_HOROVOD)

SCRIPT = os.path.join(ROOT, "tests", "horovod_elastic_script.py")


def _discovery(tmp: Path, hosts_by_epoch: list[list[str]]) -> str:
    """A host discovery script whose answer follows the epochs rank 0 has finished (lines of
    epochs.log), as Horovod's own elastic tests do; the last entry holds from there on."""
    lines = ["#!/bin/bash", f"n=$(cat {tmp}/epochs.log 2>/dev/null | wc -l)"]
    for k, hosts in enumerate(hosts_by_epoch):
        cond = "else" if k == len(hosts_by_epoch) - 1 else \
            f"{'if' if k == 0 else 'elif'} [ \"$n\" -le {k} ]; then"
        lines.append(cond)
        lines += [f"  echo {h}" for h in hosts]
    lines.append("fi" if len(hosts_by_epoch) > 1 else "")
    if len(hosts_by_epoch) == 1:
        lines = [lines[0], *[f"echo {h}" for h in hosts_by_epoch[0]]]
    path = tmp / "discover.sh"
    path.write_text("\n".join(lines) + "\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def _horovodrun(tmp: Path, np: int, min_np: int, max_np: int, hosts_by_epoch: list[list[str]],
                *script_args: str) -> list[dict]:
    cmd = [os.path.join(BIN, "horovodrun"), "-np", str(np), "--min-np", str(min_np),
           "--max-np", str(max_np), "--host-discovery-script", _discovery(tmp, hosts_by_epoch),
           sys.executable, SCRIPT, "--out", str(tmp), *script_args]
    # a hard limit (the whole process group is killed past it): a hang fails, never blocks
    proc = run(cmd, timeout=float(os.environ.get("HVD_ELASTIC_TIMEOUT", "420")),
               env={"PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "DEAR_TIMEOUT": "30"})
    assert proc.returncode == 0, proc.stdout[-6000:]
    return [json.loads(line) for p in sorted(tmp.glob("rank*.jsonl"))
            for line in p.read_text().splitlines()]


def _replay(history: list[list[int]], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    model, opt = _replayed(history, dtype)
    out = {k: v.detach().float() for k, v in model.state_dict().items()}
    names = [n for n, _ in model.named_parameters()]
    for i, p in enumerate(model.parameters()):
        out[f"momentum.{names[i]}"] = opt.state[p]["momentum_buffer"].detach().float()
    return out


def _replayed(history: list[list[int]], dtype: torch.dtype
              ) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Single process: each committed step's global batch (its world's rows), the mean loss
    (every rank's share is equal, so the ranks' average is the global mean), SGD with
    momentum at the LR the reset callback sets for that world."""
    model = make_model().to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=BASE_LR, momentum=0.9)
    for step, size in history:
        for group in opt.param_groups:
            group["lr"] = BASE_LR * size
        x, y = global_batch(step, size)
        opt.zero_grad()
        F.mse_loss(model(x.to(dtype)), y.to(dtype)).backward()
        opt.step()
    return model, opt


def _check(tmp: Path, logs: list[dict], sizes_seen: set[int]) -> None:
    final = torch.load(tmp / "final.pt")
    history = [list(h) for h in final["history"]]
    assert {size for _, size in history} == sizes_seen, history
    steps = [step for step, _ in history]
    assert steps == list(range(len(steps))), f"a committed step lost or repeated: {steps}"
    # every rank at the same committed point holds the same bytes
    points: dict[str, list[dict]] = {}
    for entry in logs:
        points.setdefault(json.dumps(entry["history"]), []).append(entry)
    for entries in points.values():
        assert len(entries) == entries[0]["size"], entries      # every rank of that world
        assert len({e["model"] for e in entries}) == 1, entries
        assert len({e["optimizer"] for e in entries}) == 1, entries
    # the model and the optimizer's state (momentum: what a resharding could get wrong)
    got = {k: v.float() for k, v in final["model"].items()}
    for i, name in enumerate(final["model"]):      # the model has parameters only
        got[f"momentum.{name}"] = final["optimizer"]["state"][i]["momentum_buffer"].float()
    exact = _replay(history, torch.float64)
    assert_float32_close(got, exact, _replay(history, torch.float32),
                         what="dear under Horovod Elastic")


def test_hosts_removed_then_added_with_sharded_state(tmp_path: Path) -> None:
    """2 ranks, then 1 (a host removed), then 2 (a new process joins); sharded state, never
    put together whole by dear while training (the script fails if it is)."""
    both = ["localhost:1", "127.0.0.1:1"]
    logs = _horovodrun(tmp_path, 2, 1, 2, [both, ["localhost:1"], both],
                       "--epochs", "3", "--discovery", "--sharded", "--never-whole")
    _check(tmp_path, logs, {1, 2})


def _third_local_name() -> str:
    """A third name for this machine (Horovod counts hosts by name): its host name, if that
    resolves to one of its own addresses."""
    import socket

    import psutil
    name = socket.gethostname()
    ours = {a.address for addrs in psutil.net_if_addrs().values() for a in addrs
            if a.family == socket.AF_INET}
    try:
        address = socket.gethostbyname(name)
    except OSError:
        address = None
    if name in ("localhost", "127.0.0.1") or address not in ours:
        pytest.skip("this machine's host name does not resolve to one of its addresses: "
                    "no third local host name for Horovod")
    return name


def test_a_rank_killed_with_sharded_state_resumes_from_its_copy(tmp_path: Path) -> None:
    """3 ranks on 3 hosts, sharded state, a commit every 3 batches; the rank on 127.0.0.1 kills
    itself at epoch 1's third batch. Its pieces of the last commit live on in the copy its
    buddy (another host) kept: the 2 survivors go on from the commit with the state cut for
    2, equal to single-process training of the committed steps (model and momentum), never
    having put it together whole, and before the loss each rank kept 2/3 of the state."""
    third = _third_local_name()
    logs = _horovodrun(tmp_path, 3, 2, 3, [["localhost:1", "127.0.0.1:1", f"{third}:1"]],
                       "--epochs", "3", "--kill", "1,2,127.0.0.1", "--commit-every", "3",
                       "--sharded", "--never-whole")
    assert (tmp_path / "killed").exists()
    _check(tmp_path, logs, {2, 3})
    whole = torch.load(tmp_path / "final.pt")["whole_bytes"]
    held = [(size, n) for entry in logs for size, n in entry["held"]]
    assert any(size == 3 for size, _ in held), held
    for size, n in held:
        assert n == pytest.approx(whole * min(2, size) / size, rel=0.1), (size, n, whole)


def test_a_rank_killed_mid_epoch(tmp_path: Path) -> None:
    """3 ranks, a commit every 3 batches; the one on host 127.0.0.1 kills itself at epoch 1's
    third batch, after two steps that were not committed (the first of them applied on every
    rank, since every rank took part in the second): Horovod blacklists that host, and the
    survivors drop those steps (model and optimizer back to the commit) and go on at 2."""
    logs = _horovodrun(tmp_path, 3, 2, 3, [["localhost:2", "127.0.0.1:1"]],
                       "--epochs", "3", "--kill", "1,2,127.0.0.1", "--commit-every", "3")
    assert (tmp_path / "killed").exists()
    _check(tmp_path, logs, {2, 3})
