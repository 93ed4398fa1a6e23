"""Elastic training under torchrun's real elastic agent: two or three agents on localhost as
"nodes" (dear/testing/elastic.py), workers that train a small model with dear.elastic or
hvd.elastic, and nodes lost and added at chosen steps.

What is checked, after every change of the workers:
- replicas: every rank's model and (whole) optimizer state have the same bytes, at the start
  of each generation and at the end;
- a reference: a fault-free run (ranks forked by dear.testing.run_distributed, no torchrun, no
  dear.elastic) that trains the same global batches in the same sequence of world sizes,
  carrying its state between sizes through dear's documented whole-state path
  (optimizer.state_dict() / load_state_dict()). The elastic run's state must equal it BIT FOR
  BIT at every resume and at the end. Exact equality is the right tolerance: at one world size
  dear's reductions run in an order fixed by the size and the layout, every kernel here is
  deterministic on CPU, DCP stores tensors' raw bytes, and the steps redone after a failure
  see the same data; any difference is a state that did not come back;
- samples: within the epoch, the batches that make up the final history (each step as trained
  by the last generation that trained it) hold no sample twice and skip none (they are a
  prefix of the epoch's permutation).

Kills happen at steps the workers announce (files), never after a sleep, so no assertion
depends on timing. Run this file as a script and it is the worker.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SAMPLES, FEATURES, CLASSES, BATCH = 96, 8, 4, 2
BASE_LR = {False: 0.05, True: 0.01}             # SGD's, Adam's

# Fast rendezvous rounds on one machine: a node that stops heart-beating leaves after ~8 s
# (keep_alive_interval x keep_alive_max_attempt; at 2 s a busy agent's late heartbeat got it
# dropped while alive), a round below MAX closes 2 s after MIN.
RDZV = {"last_call_timeout": 2, "keep_alive_interval": 1, "keep_alive_max_attempt": 8,
        "join_timeout": 60}
AGENT_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "DEAR_TIMEOUT": "20",
             "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


# ------------------------------------------------------------------------ the workload
def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    return (torch.randn(SAMPLES, FEATURES, generator=g),
            torch.randint(0, CLASSES, (SAMPLES,), generator=g))


def build(options: dict[str, Any]) -> tuple[torch.nn.Module, Any]:
    import dear
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.ReLU(),
                                torch.nn.Linear(16, CLASSES))
    lr = BASE_LR[bool(options.get("adam"))]
    inner = (torch.optim.Adam(model.parameters(), lr=lr) if options.get("adam")
             else torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9))
    kwargs: dict[str, Any] = {"model": model}
    if options.get("sharded"):
        kwargs["shard_optimizer_state"] = True
    if options.get("compression") == "int8":
        kwargs["compression"] = dear.Compression.int8
    return model, dear.DistributedOptimizer(inner, **kwargs)


def train_step(model: torch.nn.Module, optimizer: Any, idx: list[int]) -> None:
    x, y = data()
    optimizer.zero_grad()
    torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
    optimizer.step()


def digests(model: torch.nn.Module, optimizer: Any) -> dict[str, str]:
    """sha256 of every model tensor and every whole optimizer state tensor (state_dict() is a
    collective with shard_optimizer_state: every rank calls this)."""
    out = {}
    for k, v in model.state_dict().items():
        out[f"model.{k}"] = hashlib.sha256(v.detach().contiguous().numpy().tobytes()).hexdigest()
    state = optimizer.state_dict()
    for i, entry in state["state"].items():
        for k, v in entry.items():
            if isinstance(v, torch.Tensor):
                out[f"optim.{i}.{k}"] = hashlib.sha256(
                    v.detach().contiguous().numpy().tobytes()).hexdigest()
    return out


# ------------------------------------------------------------------------ the worker
def worker(args: argparse.Namespace) -> None:
    from dear.testing.elastic import die_with_parent
    die_with_parent()
    torch.set_num_threads(1)
    out = Path(args.out)
    options = json.loads(args.options)
    if os.environ.get("DEAR_ELASTIC_TEST_NO_RESTORE") == "1":    # the broken build
        import dear.elastic.session as session
        session.Session.load = lambda self, state, n: None      # type: ignore[method-assign]
    horovod = options.get("api") == "horovod"
    if horovod:
        import dear.horovod as hvd
        hvd.init()
        elastic: Any = hvd.elastic
        rank, size = hvd.rank, hvd.size
    else:
        import dear
        import dear.elastic as elastic
        dear.init()
        rank, size = dear.rank, dear.size
    import dear.elastic as dear_elastic
    agent = os.environ.get("DEAR_ELASTIC_AGENT", "?")
    fail = options.get("fail")                  # {"ranks": [...], "step": s}: raise there
    pause = options.get("pause_in_commit")      # {"rank": r, "step": s}: stop mid-commit
    in_commit = [False]
    if pause:
        _hold_inside_dcp_writes(out, in_commit)
    log_path = out / f"log-{os.getpid()}.jsonl"

    def log(kind: str, **fields: Any) -> None:
        with open(log_path, "a") as fh:
            fh.write(json.dumps({"event": kind, "t": time.time(), "pid": os.getpid(),
                                 "agent": agent, "rank": rank(), "world": size(),
                                 **fields}) + "\n")

    model, optimizer = build(options)
    sampler = elastic.ElasticSampler(list(range(SAMPLES)), shuffle=True, seed=7)
    state_cls = elastic.TorchState if horovod else elastic.State
    state = state_cls(model=model, optimizer=optimizer, sampler=sampler, step=0)
    base_lr = optimizer.param_groups[0]["lr"]
    resets: list[int] = []

    def on_reset() -> None:                     # the LR scaled by the size, as Horovod's
        resets.append(size())                   # examples do
        for group in optimizer.param_groups:
            group["lr"] = base_lr * size()

    state.register_reset_callbacks([on_reset])
    for group in optimizer.param_groups:        # the first generation's size, as a reset's
        group["lr"] = base_lr * size()

    @elastic.run
    def train(state: Any) -> None:
        log("resume", step=state.step, resets=list(resets),
            round=f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
            digests=digests(state.model, state.optimizer))
        batches = iter(state.sampler)
        start = state.step
        while state.step < args.steps:
            idx = [next(batches) for _ in range(BATCH)]
            train_step(state.model, state.optimizer, idx)
            state.sampler.record_batch(0, BATCH)
            state.step += 1
            log("step", step=state.step, idx=idx, lr=state.optimizer.param_groups[0]["lr"],
                **({"digests": digests(state.model, state.optimizer)}
                   if os.environ.get("TEST_STEP_DIGESTS") else {}))
            # a hold: the k-th step of a generation of this size waits for the driver
            k = state.step - start
            if (out / f"hold-w{size()}-k{k}").exists() and state.step != args.steps:
                (out / f"at-w{size()}-k{k}-r{rank()}").write_text("")
                end = time.monotonic() + float(os.environ.get("TEST_HOLD_SECONDS", "120"))
                while not (out / f"go-w{size()}-k{k}").exists() \
                        and not dear_elastic.stop_requested() and time.monotonic() < end:
                    time.sleep(0.02)
            if fail and rank() in fail["ranks"] and state.step == fail["step"]:
                raise RuntimeError(f"injected failure of rank {rank()} at step {state.step}")
            in_commit[0] = bool(pause and rank() == pause["rank"] and state.step == pause["step"]
                                and not (out / "inside-commit").exists())
            try:
                state.commit()
            except elastic.HostsUpdatedInterrupt:   # raised once the commit is written
                log("committed", step=state.step)
                raise
            log("committed", step=state.step)

    train(state)
    log("end", step=state.step, digests=digests(model, optimizer))


def _hold_inside_dcp_writes(out: Path, armed: list[bool]) -> None:
    """Make this rank stop inside a commit, after its files are written and before rank 0
    can write the commit's metadata (DCP gathers every rank's write results first), until it
    is killed: a worker lost in the middle of a commit."""
    import torch.distributed.checkpoint.filesystem as fs
    original = fs.FileSystemWriter.write_data

    def write_data(self: Any, plan: Any, planner: Any) -> Any:
        result = original(self, plan, planner)
        if armed[0]:
            result.wait()
            (out / "inside-commit").write_text(str(self.path))
            time.sleep(120)
        return result

    fs.FileSystemWriter.write_data = write_data      # type: ignore[method-assign]


# ------------------------------------------------------------------------ the driver
def read_logs(out: Path) -> list[dict[str, Any]]:
    rows = []
    for f in out.glob("log-*.jsonl"):
        rows += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return sorted(rows, key=lambda r: r["t"])


def generations(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per generation of workers (their resumes share a world and a start step),
    in order: world, the step it resumed at, each rank's batches by step, its digests."""
    gens: dict[tuple, dict[str, Any]] = {}
    by_pid: dict[int, dict[str, Any]] = {}
    for r in rows:
        if r["event"] == "resume":             # a round: its store's address (a new port
            key = (r["round"], r["world"], r["step"])    # each round) and where it started
            gen = gens.setdefault(key, {"world": r["world"], "start": r["step"], "pids": [],
                                        "steps": {}, "resume": {}, "end": {},
                                        "committed": -1})
            gen["pids"].append(r["pid"])
            gen["resume"][r["rank"]] = r["digests"]
            by_pid[r["pid"]] = gen
        elif r["event"] == "step":
            by_pid[r["pid"]]["steps"].setdefault(r["step"], {})[r["rank"]] = r["idx"]
        elif r["event"] == "committed":
            gen = by_pid[r["pid"]]
            gen["committed"] = max(gen["committed"], r["step"])
        elif r["event"] == "end":
            by_pid[r["pid"]]["end"][r["rank"]] = r["digests"]
    # a round some of whose workers never resumed trained nothing: not a generation
    return [g for g in gens.values() if len(g["resume"]) == g["world"]]


def history(gens: list[dict[str, Any]], steps: int) -> list[tuple[int, list[list[int]]]]:
    """The steps the final state is made of: step s as trained by the generation that last
    trained it before the next one resumed past it. (world, each rank's batch) per step."""
    out = []
    for i, gen in enumerate(gens):
        stop = gens[i + 1]["start"] if i + 1 < len(gens) else steps
        for s in range(gen["start"] + 1, stop + 1):
            ranks = gen["steps"][s]
            assert sorted(ranks) == list(range(gen["world"])), (s, ranks)
            out.append((gen["world"], [ranks[r] for r in range(gen["world"])]))
    return out


def _reference_phase(options: dict[str, Any], start: Optional[dict[str, Any]],
                     batches: list[list[list[int]]], snapshot_every: list[int]
                     ) -> dict[str, Any]:
    import dear
    dear.init()
    rank = dear.rank()
    model, optimizer = build(options)
    # The arguments' tensors arrive in shared memory, the same pages on every rank, and torch's
    # load_state_dict keeps the tensors it is given: each rank needs copies of its own.
    start = copy.deepcopy(start)
    if start is not None:
        model.load_state_dict(start["model"])
        optimizer.load_state_dict(start["optim"])
    for group in optimizer.param_groups:            # the LR for this size
        group["lr"] = BASE_LR[bool(options.get("adam"))] * dear.size()
    snapshots = {}
    for k, step in enumerate(batches):
        train_step(model, optimizer, step[rank])
        if k + 1 in snapshot_every:
            snapshots[k + 1] = digests(model, optimizer)
    out = {"model": {k: v.clone() for k, v in model.state_dict().items()},
           "optim": optimizer.state_dict(), "snapshots": snapshots}
    dear.shutdown()
    return out


def reference(options: dict[str, Any], hist: list[tuple[int, list[list[int]]]],
              marks: list[int]) -> tuple[dict[int, dict[str, str]], dict[str, Any]]:
    """The fault-free run of `hist`, one phase per run of equal world sizes; the digests after
    each step in `marks` and the final state."""
    from dear.testing import run_distributed
    at: dict[int, dict[str, str]] = {}
    state: Optional[dict[str, Any]] = None
    done = 0
    while done < len(hist):
        world = hist[done][0]
        end = done
        while end < len(hist) and hist[end][0] == world:
            end += 1
        phase = [b for _, b in hist[done:end]]
        wanted = [m - done for m in marks if done < m <= end]
        results = run_distributed(_reference_phase, world, options, state, phase, wanted,
                                  timeout=120, env={"DEAR_TIMEOUT": "20"})
        for m in wanted:
            at[done + m] = results[0]["snapshots"][m]
        state = results[0]
        if done == 0 and 0 in marks:
            pass
        done = end
    assert state is not None
    return at, state


def check(out: Path, options: dict[str, Any], steps: int) -> list[dict[str, Any]]:
    """Every check of the module's docstring; returns the generations."""
    gens = generations(read_logs(out))
    assert gens, "no generation of workers ran"
    for gen in gens:                                     # replicas equal at each resume
        assert sorted(gen["resume"]) == list(range(gen["world"])), gen["resume"].keys()
        first = gen["resume"][0]
        for r, d in gen["resume"].items():
            assert d == first, f"rank {r} differs from rank 0 after resuming at {gen['start']}"
    last = gens[-1]
    assert sorted(last["end"]) == list(range(last["world"])), "the last generation did not end"
    for r, d in last["end"].items():
        assert d == last["end"][0], f"rank {r} differs from rank 0 at the end"
    for before, after in zip(gens, gens[1:]):          # nothing committed is lost
        assert after["start"] == max(before["committed"], 0), (
            f"a generation resumed at step {after['start']}, but the one before it had "
            f"committed step {before['committed']}")
    hist = history(gens, steps)
    assert len(hist) == steps
    # samples: one epoch, a prefix of its permutation, nothing twice
    seen = [i for _, ranks in hist for batch in ranks for i in batch]
    assert len(seen) == len(set(seen)), "a sample was trained on twice within the epoch"
    order = list(range(SAMPLES))
    random.Random(7 + 0).shuffle(order)
    assert sorted(seen) == sorted(order[:len(seen)]), "a sample of the epoch was skipped"
    # the reference: at each resume and at the end
    marks = sorted({g["start"] for g in gens if g["start"] > 0} | {steps})
    at, final = reference(options, hist, marks)
    for gen in gens:
        if gen["start"] > 0:
            assert gen["resume"][0] == at[gen["start"]], (
                f"the state resumed at step {gen['start']} (world {gen['world']}) is not the "
                "fault-free run's")
    assert last["end"][0] == at[steps], "the final state is not the fault-free run's"
    del final
    return gens


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--options", default="{}")
    worker(p.parse_args())


# ------------------------------------------------------------------------ the tests
def _cluster(tmp: Path, options: dict[str, Any], steps: int, nnodes: str,
             extra_env: Optional[dict[str, str]] = None, timeout: float = 240) -> Any:
    from dear.testing.elastic import ElasticCluster
    return ElasticCluster([str(Path(__file__).resolve()), "--out", str(tmp), "--steps",
                           str(steps), "--options", json.dumps(options)],
                          nnodes=nnodes, max_restarts=3, rdzv_conf=RDZV, timeout=timeout,
                          env={**AGENT_ENV, "DEAR_ELASTIC_DIR": str(tmp / "commits"),
                               **(extra_env or {})}, workdir=tmp / "agents")


def _hold(tmp: Path, world: int, k: int) -> None:
    """Make the k-th step of a generation of `world` ranks wait (before its commit) until
    _go() (or, for a single rank waiting on an added node, the agent's SIGTERM). Relative to the
    generation's start: agents that start a little apart may first form a smaller round."""
    (tmp / f"hold-w{world}-k{k}").write_text("")


def _at(tmp: Path, world: int, k: int, ranks: int) -> bool:
    return all((tmp / f"at-w{world}-k{k}-r{r}").exists() for r in range(ranks))


def _go(tmp: Path, world: int, k: int) -> None:
    (tmp / f"go-w{world}-k{k}").write_text("")


def _tail(gens: list[dict[str, Any]], n: int) -> list[tuple[int, int]]:
    """The last n generations as (world, steps since the first of them started)."""
    base = gens[-n]["start"]
    return [(g["world"], g["start"] - base) for g in gens[-n:]]


def _agent_of_rank(tmp: Path, world: int, rank: int) -> int:
    rows = [r for r in read_logs(tmp) if r["event"] == "resume" and r["world"] == world
            and r["rank"] == rank]
    return int(rows[-1]["agent"])


def scenario_2_1_2(tmp: Path, options: dict[str, Any], extra_env: Optional[dict[str, str]]
                   = None) -> list[dict[str, Any]]:
    """Two nodes; one is lost at their 3rd step (its agent killed, its worker dies with it);
    the survivor goes on alone; a new node joins at its 4th step, the job goes on with two."""
    steps = 10
    _hold(tmp, 2, 3)
    _hold(tmp, 1, 4)
    with _cluster(tmp, options, steps, "1:2", extra_env) as cluster:
        a, b = cluster.start_agent(), cluster.start_agent()
        cluster.wait_for(lambda: _at(tmp, 2, 3, 2), "both ranks at their 3rd step")
        lost = b if _agent_of_rank(tmp, 2, 1) == b.index else a
        cluster.kill_agent(lost)
        _go(tmp, 2, 3)
        cluster.wait_for(lambda: _at(tmp, 1, 4, 1), "the survivor alone at its 4th step")
        cluster.start_agent()                       # holds until the agent's SIGTERM comes
        codes = cluster.wait_agents([x for x in cluster.agents if x is not lost])
        assert codes == [0, 0], cluster.logs()
    assert not cluster.leftovers()
    gens = check(tmp, options, steps)
    # lost before the 3rd step's commit: resumed from the 2nd; the add was planned: the
    # survivor committed its 4th step and the pair resumed there, nothing lost
    assert _tail(gens, 3) == [(2, 0), (1, 2), (2, 6)], [(g["world"], g["start"]) for g in gens]
    return gens


def scenario_3_2(tmp: Path, options: dict[str, Any], lost_rank: int,
                 extra_env: Optional[dict[str, str]] = None) -> list[dict[str, Any]]:
    """Three nodes; the node of rank `lost_rank` is lost before their 4th step's commit; the
    two survivors go on at size 2 from the 3rd."""
    steps = 8
    _hold(tmp, 3, 4)
    with _cluster(tmp, options, steps, "2:3", extra_env) as cluster:
        agents = [cluster.start_agent() for _ in range(3)]
        cluster.wait_for(lambda: _at(tmp, 3, 4, 3), "the three ranks at their 4th step")
        lost = agents[_agent_of_rank(tmp, 3, lost_rank)]
        cluster.kill_agent(lost)
        _go(tmp, 3, 4)
        codes = cluster.wait_agents([x for x in agents if x is not lost])
        assert codes == [0, 0], cluster.logs()
    assert not cluster.leftovers()
    gens = check(tmp, options, steps)
    assert _tail(gens, 2) == [(3, 0), (2, 3)], [(g["world"], g["start"]) for g in gens]
    return gens


def scenario_worker_killed(tmp: Path, options: dict[str, Any],
                           extra_env: Optional[dict[str, str]] = None) -> list[dict[str, Any]]:
    """Two nodes; rank 1's worker (not its agent) is killed before their 4th step's commit: its
    agent restarts the workers (one of --max-restarts) and the job goes on at the same size."""
    steps = 8
    _hold(tmp, 2, 4)
    with _cluster(tmp, options, steps, "2:2", extra_env) as cluster:
        agents = [cluster.start_agent() for _ in range(2)]
        cluster.wait_for(lambda: _at(tmp, 2, 4, 2), "both ranks at their 4th step")
        cluster.kill_worker(agents[_agent_of_rank(tmp, 2, 1)])
        _go(tmp, 2, 4)
        codes = cluster.wait_agents()
        assert codes == [0, 0], cluster.logs()
    assert not cluster.leftovers()
    gens = check(tmp, options, steps)
    assert _tail(gens, 2) == [(2, 0), (2, 3)], [(g["world"], g["start"]) for g in gens]
    return gens


def test_2_1_2_node_lost_then_added(tmp_path: Path) -> None:
    scenario_2_1_2(tmp_path, {})



def test_3_2_sharded_adam(tmp_path: Path) -> None:
    """shard_optimizer_state=True: each survivor reads its new shards of the Adam state from
    the pieces three ranks wrote; the fault-free reference gathers and re-cuts the whole."""
    scenario_3_2(tmp_path, {"sharded": True, "adam": True}, lost_rank=2)


def test_3_2_int8(tmp_path: Path) -> None:
    """compression=int8: the residuals (per rank, laid out for 3) are dropped at the change to
    2, as the reference drops them when it loads a 3-rank state on 2 ranks."""
    scenario_3_2(tmp_path, {"compression": "int8"}, lost_rank=1)


def test_worker_killed_int8_keeps_residuals(tmp_path: Path) -> None:
    """compression=int8, a restart at the same size: each rank gets its residuals back, so the
    run equals the reference that never stopped (dropping them would not)."""
    scenario_worker_killed(tmp_path, {"compression": "int8"})


def test_worker_killed_sharded_int8_keeps_residuals(tmp_path: Path) -> None:
    """The same with shard_optimizer_state=True, whose sharded pieces hold no residuals: each
    rank's are committed beside them and come back, so the run equals the reference that never
    stopped."""
    scenario_worker_killed(tmp_path, {"compression": "int8", "sharded": True})


def test_3_2_losing_rank_0_horovod_api(tmp_path: Path) -> None:
    """The node of rank 0 is lost; hvd.elastic.TorchState / hvd.elastic.run: nothing depended
    on what only the old rank 0 held."""
    scenario_3_2(tmp_path, {"api": "horovod"}, lost_rank=0)


if __name__ == "__main__":
    main()
