"""A training script for real Horovod's elastic mode with dear.DistributedOptimizer swapped in
(tests/test_horovod_elastic.py runs it under `horovodrun --host-discovery-script`): Horovod's
own elastic loop (hvd.elastic.run, hvd.elastic.TorchState, a reset callback rescaling the LR),
with deterministic data so that a single process can replay what was trained.

Step s trains on the global batch of step s: PER_RANK rows per rank of the world at that step,
drawn from a generator seeded with s; rank r takes rows [r*PER_RANK, (r+1)*PER_RANK). What was
committed is recorded in the state itself (`history`: one (step, world size) per committed
step, restored with the rest on a failure), and every rank writes its model's and optimizer's
bytes at each epoch's end (`--out`), so the test can compare the replicas and replay the steps.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

import dear  # before hvd.init(): dear sets Horovod's Gloo timeout from DEAR_TIMEOUT
import horovod.torch as hvd

PER_RANK = 4
BASE_LR = 0.05


def global_batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 + step)
    return (torch.randn(size * PER_RANK, 6, generator=g),
            torch.randn(size * PER_RANK, 3, generator=g))


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def digest(obj: object) -> str:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return hashlib.sha256(buf.getvalue()).hexdigest()


def guard_whole_state(whole: dict[str, bool]) -> None:
    """Every way dear puts sharded state together whole raises unless `whole["allowed"]`."""
    from dear.sharding.state import ShardedState
    for name in ("gather_full", "take_carried_whole"):
        original = getattr(ShardedState, name)

        def guarded(self: ShardedState, *a: object, _original=original, _name=name,
                    **k: object) -> object:
            if not whole["allowed"]:
                raise AssertionError(f"dear put the sharded optimizer state together whole "
                                     f"({_name}) while training")
            return _original(self, *a, **k)
        setattr(ShardedState, name, guarded)


def committed_bytes(opt: object) -> int:
    """Bytes of optimizer state this rank keeps for the last commit: its own pieces and the
    copies it holds of another rank's (0 when the state is not sharded). A test's look inside."""
    commit = opt.dear_engine.updates.commit      # type: ignore[attr-defined]
    if commit is None:
        return 0
    return sum(v.numel() * v.element_size() for pieces in commit.held.values()
               for piece in pieces for v in piece.state.values() if v.dim() > 0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--sharded", action="store_true")
    parser.add_argument("--never-whole", action="store_true",
                        help="fail if dear puts the sharded state together whole while training")
    parser.add_argument("--commit-every", type=int, default=1, help="batches per commit")
    parser.add_argument("--kill", default="",
                        help="epoch,batch,host: the process on that host kills itself there, "
                             "once (by host: which ranks a host gets varies between runs)")
    parser.add_argument("--discovery", action="store_true",
                        help="rank 0 waits at each epoch's end for the driver's host update")
    args = parser.parse_args()
    if os.environ.get("DEBUG_DUMP"):           # seconds: every process's stacks, repeatedly
        import faulthandler
        faulthandler.dump_traceback_later(float(os.environ["DEBUG_DUMP"]), repeat=True)
    whole = {"allowed": not args.never_whole}
    if args.never_whole:
        guard_whole_state(whole)
    hvd.init()
    torch.set_num_threads(1)
    host = os.environ.get("HOROVOD_HOSTNAME", "")
    model = make_model()
    opt = dear.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=BASE_LR * hvd.size(), momentum=0.9),
        named_parameters=model.named_parameters(), model=model,
        shard_optimizer_state=args.sharded)
    kill = args.kill.split(",") if args.kill else None
    killed_marker = os.path.join(args.out, "killed")

    def on_reset() -> None:
        for group in opt.param_groups:
            group["lr"] = BASE_LR * hvd.size()

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        while state.epoch < args.epochs:
            while state.batch < args.batches:
                step = state.epoch * args.batches + state.batch
                if kill is not None and [str(state.epoch), str(state.batch), host] == kill \
                        and not os.path.exists(killed_marker):
                    open(killed_marker, "w").close()
                    os.kill(os.getpid(), 9)
                x, y = global_batch(step, hvd.size())
                rows = slice(hvd.rank() * PER_RANK, (hvd.rank() + 1) * PER_RANK)
                opt.zero_grad()
                F.mse_loss(model(x[rows]), y[rows]).backward()
                opt.step()
                state.history = state.history + [(step, hvd.size())]
                state.batch += 1
                if state.batch % args.commit_every == 0:
                    state.commit()
                    held.append((hvd.size(), committed_bytes(opt)))
            with open(os.path.join(args.out, f"rank{hvd.rank()}.jsonl"), "a") as f:
                f.write(json.dumps({"epoch": state.epoch, "size": hvd.size(),
                                    "model": digest(model.state_dict()),
                                    "optimizer": "" if args.never_whole
                                    else digest(opt.state_dict()),
                                    "history": state.history, "held": held}) + "\n")
            if args.discovery and hvd.rank() == 0:
                with open(os.path.join(args.out, "epochs.log"), "a") as f:
                    f.write(f"{state.epoch}\n")
                # As Horovod's own elastic test script does: wait (at most 20 s) for the
                # driver's notification of the next epoch's hosts, so the change lands at
                # this epoch's commit (a private field of Horovod's State: a test's shortcut).
                deadline = time.monotonic() + 20
                state._last_updated_timestamp = 0       # noqa: SLF001
                while state._host_messages.empty() and time.monotonic() < deadline:  # noqa: SLF001
                    time.sleep(0.1)
            state.epoch += 1
            state.batch = 0
            state.commit()

    held: list[tuple[int, int]] = []
    state = hvd.elastic.TorchState(model, opt, epoch=0, batch=0, history=[])
    state.register_reset_callbacks([on_reset])
    train(state)
    whole["allowed"] = True
    optimizer_state = opt.state_dict()          # every rank (a gather when sharded)
    if hvd.rank() == 0:
        torch.save({"model": model.state_dict(), "history": state.history,
                    "optimizer": optimizer_state,
                    "whole_bytes": sum(p.numel() * p.element_size()
                                       for p in model.parameters())},
                   os.path.join(args.out, "final.pt"))
    dear.shutdown()


if __name__ == "__main__":
    sys.exit(main())
