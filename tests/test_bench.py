"""A 2-iteration smoke run of every benchmark method on loopback, through the same launcher the
benchmark uses, with the loss check that refuses a method whose losses differ from DDP's."""

import json
import os
import sys

from tests.subprocesses import run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_method_runs_and_matches_ddp(tmp_path):
    name = "_smoke_test"
    cmd = [sys.executable, "-m", "benchmarks.cluster", "--nproc", "2", "--no-shaping",
           "--horovod", "--timeout", "240", "--", sys.executable, "-m", "benchmarks.train",
           "--model", "resnet_tiny", "--warmup", "1", "--iters", "2", "--comm-repeats", "1",
           "--rounds", "2",     # interleaved: Horovod shut down and started again in between
           "--methods", "ddp,fsdp2,allreduce,wfbp,horovod,zero,dear,dear-hvd,sharded",
           "--name", name]
    res = run(cmd, timeout=300)
    path = os.path.join(ROOT, "benchmarks", "results", f"{name}.json")
    try:
        assert res.returncode == 0, res.stdout
        with open(path) as fh:
            report = json.load(fh)
        assert set(report["methods"]) == {"ddp", "fsdp2", "allreduce", "wfbp", "horovod",
                                          "zero", "dear", "dear-hvd", "sharded"}
        for method, r in report["methods"].items():
            assert r["loss_matches_ddp"], f"{method}: losses differ from DDP's"
            assert r["median_s"] > 0
            assert len(r["losses"]) == 3          # one round's trajectory, compared to DDP's
        assert report["t_compute_s"] > 0 and report["t_lb_s"] >= report["t_compute_s"]
    finally:
        for ext in ("json", "md"):
            p = os.path.join(ROOT, "benchmarks", "results", f"{name}.{ext}")
            if os.path.exists(p):
                os.remove(p)
