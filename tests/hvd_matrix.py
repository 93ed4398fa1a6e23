"""Runs on every Horovod rank: each configuration trained with hvd.DistributedOptimizer and with
the one-line swap to dear.DistributedOptimizer; rank 0 saves both results to argv[1], every other
rank r to argv[1] + f".{r}"."""

import itertools
import os
import sys

import horovod.torch as hvd
import torch

import dear
from examples.horovod_train import train

CONFIGS = list(itertools.product(("sgd", "adam"), ("none", "fp16"), (1, 2)))
CLIPPED = ("sgd", "none", 1)                   # + synchronize / skip_synchronize loop


def main() -> None:
    hvd.init()
    only = sys.argv[2].split(",") if len(sys.argv) > 2 else None
    out = {}
    for opt, comp, passes in CONFIGS:
        key = f"{opt}-{comp}-{passes}"
        if only and key not in only:
            continue
        out[key] = {impl: train(opt, comp, passes, use_dear=(impl == "dear"))
                    for impl in ("horovod", "dear")}
    if not only or "clip" in only:
        out["clip"] = {impl: train(*CLIPPED, use_dear=(impl == "dear"), clip=0.05)
                       for impl in ("horovod", "dear")}
    assert dear.rank() == hvd.rank() and dear.size() == hvd.size()
    plane = os.environ.get("DEAR_HOROVOD_DATA_PLANE", "gloo")
    name = dear.comm.runtime.communicator().name
    assert name == {"gloo": "horovod-gloo-pairwise", "horovod": "horovod"}[plane], name
    torch.save(out, sys.argv[1] + (f".{hvd.rank()}" if hvd.rank() else ""))
    dear.shutdown()


if __name__ == "__main__":
    main()
