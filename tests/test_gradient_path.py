"""docs/ARCHITECTURE.md's "Life of one iteration" names the files a steady iteration enters, and
this test is where that list comes from: it records (sys.setprofile on the training thread,
threading.setprofile on the collective thread) which dear/ files the Python frames of one
steady iteration belong to, on 2 Gloo ranks, on the default path (C++ hooks, the planned
schedule, CPU tensors, model=, an iteration that does not compare contents), and compares that
set with the paths the section names."""

from __future__ import annotations

import re
import sys
import threading
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import dear
from tests.distributed import run_distributed
from tests.workloads import batch, make_net

ROOT = Path(__file__).resolve().parent.parent
DEAR = ROOT / "dear"
#: the threads whose frames belong to an iteration (not the hang report's publisher)
THREADS = ("MainThread", "dear-collectives")


def _record() -> dict[str, Any]:
    entered: set[str] = set()
    on = threading.Event()

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and on.is_set() and threading.current_thread().name in THREADS:
            name = frame.f_code.co_filename
            if name.startswith(str(DEAR)):
                entered.add(Path(name).relative_to(ROOT).as_posix())

    threading.setprofile(profile)              # threads started from here on (the executor)
    sys.setprofile(profile)
    try:
        dear.init()
        rank, world = dear.rank(), dear.size()
        model = make_net()
        opt = dear.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        model=model, fusion_threshold=2048)
        engine = opt.dear_engine
        recorded = None
        for step in range(40):
            # steady: planned and checked (plan_after 4 + 4), past the layout's checked
            # iterations, and one that does not compare contents
            record = (recorded is None and step >= 20 and engine.schedule.plan is not None
                      and not engine.iteration.check_contents)
            if record:
                on.set()
            opt.zero_grad()
            x, y = batch(step, world, rank)
            F.mse_loss(model(x), y).backward()
            opt.step()
            if record:
                engine.schedule.drain()        # what backward gave the thread is issued
                on.clear()
                recorded = step
        opt.flush_updates()
        dear.shutdown()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)             # type: ignore[arg-type]
    return {"files": sorted(entered), "step": recorded}


def documented() -> set[str]:
    """The dear/ files named in the life of one iteration (up to its phase diagram)."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    section = text.split("## Life of one iteration", 1)[1].split("```", 1)[0]
    return set(re.findall(r"`(dear/[\w/]+\.py)`", section))


def test_the_documented_path_is_the_one_a_steady_iteration_takes() -> None:
    results = run_distributed(_record, 2, timeout=240)
    for r in results:
        assert r["step"] is not None, "no steady iteration to record"
    entered = set(results[0]["files"]) | set(results[1]["files"])
    named = documented()
    assert entered == named, (f"entered but not in docs/ARCHITECTURE.md: {sorted(entered - named)}"
                              f"; named but not entered: {sorted(named - entered)}")
