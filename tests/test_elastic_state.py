"""dear.elastic's and dear.horovod.elastic's state, sampler, commits and run loop, in one
process or on ranks forked by dear.testing.run_distributed (no torchrun): Horovod v0.28.1's
test/single/test_torch_elastic.py mirrored (both APIs), the sampler across a change of the
number of ranks, the commit directory (DCP) resharding a sharded optimizer state from 3 ranks
to 2, and the bad inputs. The torchrun scenarios are in test_elastic_torchrun.py."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

import dear
import dear.elastic as elastic
import dear.horovod as hvd
from dear.elastic import agent as agent_mod
from dear.elastic.commit import CommitDir, default_directory
from dear.elastic.handlers import merge_kfac
from dear.testing import run_distributed

APIS = ["dear", "horovod"]


@pytest.fixture(autouse=True)
def _leave_dear_stopped() -> Iterator[None]:
    """A test that starts dear in this process (hvd.init() at a world of one) stops it, and
    the process group under it: the next module's tests run in the same worker and start
    their own."""
    yield
    hvd.shutdown()
    if dear.is_initialized():
        dear.shutdown()
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()


def _api(name: str) -> Any:
    if name == "horovod":
        hvd.init()
        return hvd.elastic
    return elastic


def _state(api: str, *args: Any, **kwargs: Any) -> Any:
    module = _api(api)
    cls = module.TorchState if api == "horovod" else module.State
    return cls(*args, **kwargs)


@pytest.fixture(autouse=True)
def _no_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are about one process's semantics: not under torchrun even if pytest is."""
    for var in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(var, raising=False)


# ------------------------------------------------ Horovod's test_torch_elastic.py, mirrored
def _horovod_state_test(api: str) -> dict[str, Any]:
    """Horovod's test_elastic_state, on every rank: rank-dependent values, sync() gives rank
    0's; restore() returns to the last save (here the state's construction: sync() saves
    nothing, as in Horovod, whose test compares the live tensors with themselves there);
    commit() then restore() keeps the committed values."""
    rank = dist_rank()
    v = 1.0 if rank == 0 else 2.0
    model1 = torch.nn.Sequential(torch.nn.Linear(2, 2))
    model1.load_state_dict({"0.weight": torch.tensor([[v, v], [v, v]]),
                            "0.bias": torch.tensor([v, v])})
    model2 = torch.nn.Sequential(torch.nn.Linear(2, 2))
    model2.load_state_dict({"0.weight": torch.tensor([[1.0, 2.0], [3.0, 4.0]]),
                            "0.bias": torch.tensor([0.0, 0.0])})
    optimizer = torch.optim.SGD(model1.parameters(), lr=0.001)
    state = _state(api, model1, optimizer, batch=20 + rank, epoch=10 + rank)
    state.sync()
    out: dict[str, Any] = {"synced": [w.clone() for w in state.model.state_dict().values()],
                           "batch": state.batch, "epoch": state.epoch}
    constructed = [torch.full_like(w, v) for w in model1.state_dict().values()]
    model1.load_state_dict(model2.state_dict())
    state.batch, state.epoch = 21, 11
    state.restore()
    out["restored_equal"] = all(torch.equal(a, b) for a, b in
                                zip(model1.state_dict().values(), constructed))
    out["restored"] = (state.batch, state.epoch)
    model1.load_state_dict(model2.state_dict())
    state.batch, state.epoch = 21, 11
    state.commit()
    state.restore()
    out["committed_equal"] = all(torch.equal(a, b) for a, b in
                                 zip(model1.state_dict().values(),
                                     model2.state_dict().values()))
    out["committed"] = (state.batch, state.epoch)
    return out


def dist_rank() -> int:
    import torch.distributed as dist
    if not dist.is_initialized():
        dear.init()
    return dist.get_rank()


@pytest.mark.parametrize("api", APIS)
def test_horovod_elastic_state_two_ranks(api: str) -> None:
    for out in run_distributed(_horovod_state_test, 2, api, timeout=90):
        assert all(torch.equal(w, torch.ones_like(w)) for w in out["synced"])
        assert (out["batch"], out["epoch"]) == (20, 10)
        assert out["restored_equal"] and out["restored"] == (20, 10)   # rank 0's, synced
        assert out["committed_equal"] and out["committed"] == (21, 11)


@pytest.mark.parametrize("api", APIS)
def test_horovod_elastic_sampler_one_process(api: str) -> None:
    """Horovod's test_elastic_sampler (a world of one, as Horovod runs it)."""
    from torch.utils.data import DataLoader
    module = _api(api)
    batch_size, per_worker = 2, 8
    dataset = list(range(per_worker))
    sampler = module.ElasticSampler(dataset, shuffle=True)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    state = _state(api, sampler=sampler)
    state.sync()
    assert (state.sampler.epoch, state.sampler.processed_num) == (0, 0)
    total = 0
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for i, _ in enumerate(loader):
            sampler.record_batch(i, batch_size)
            assert sampler.processed_num == batch_size * (i + 1)
            total += 1
    assert total == per_worker // batch_size * 2
    assert sum(1 for _ in loader) == per_worker // batch_size    # epoch not reset: repeats
    sampler.set_epoch(2)
    sampler.record_batch(0, batch_size)
    sampler.record_batch(1, batch_size)
    state.commit()
    sampler.record_batch(2, batch_size)
    sampler.record_batch(3, batch_size)
    state.restore()
    assert sampler.processed_num == 2 * batch_size
    sampler.record_batch(2, batch_size)
    state.commit()
    state.sync()
    assert sampler.processed_num == 3 * batch_size
    assert len(sampler) == batch_size and sum(1 for _ in loader) == 1
    sampler.set_epoch(3)
    assert len(sampler) == per_worker and sum(1 for _ in loader) == per_worker // batch_size


# ---------------------------------------------------------------------- the sampler
def _draw(sampler: Any, steps: int, batch: int) -> list[int]:
    it = iter(sampler)
    out = []
    for _ in range(steps):
        out += [next(it) for _ in range(batch)]
    return out


@pytest.mark.parametrize("before,after", [(3, 2), (2, 3), (1, 2), (4, 1)])
def test_sampler_change_skips_and_repeats_nothing(before: int, after: int) -> None:
    """Ranks of `before` train k global batches and commit; `after` ranks deal the rest: the
    samples of the epoch come out once each, in the permutation's order (a prefix of it
    after k batches), whatever the sizes."""
    n, batch = 60, 2
    order = list(range(n))
    random.Random(5 + 0).shuffle(order)             # Horovod's permutation: seed + epoch

    def ranks(size: int, state: dict[str, int]) -> list[elastic.ElasticSampler]:
        out = []
        for r in range(size):
            s = elastic.ElasticSampler(list(range(n)), seed=5,
                                       rank_size=lambda r=r: (r, size))
            s.load_state_dict(state)
            out.append(s)
        return out

    first = ranks(before, {"epoch": 0, "processed_num": 0})
    k = 3
    seen = [i for s in first for i in _draw(s, k, batch)]
    for s in first:
        for b in range(k):
            s.record_batch(b, batch)
    committed = first[0].state_dict()
    assert committed["processed_num"] == k * batch * before
    assert sorted(seen) == sorted(order[:len(seen)])
    rest = ranks(after, committed)
    left = [i for s in rest for i in s]
    padded = rest[0].padding()
    assert len(padded) < after
    assert sorted(seen + left) == sorted(order + padded)
    assert len(set(seen) | set(left)) == n


def test_sampler_pads_fewer_than_the_ranks_at_the_end() -> None:
    """The documented exception: 10 samples on 3 ranks: every rank 4, the first 2 of the
    epoch dealt twice (Horovod's and DistributedSampler's rule)."""
    samplers = [elastic.ElasticSampler(list(range(10)), shuffle=False,
                                       rank_size=lambda r=r: (r, 3)) for r in range(3)]
    lists = [list(s) for s in samplers]
    assert [len(x) for x in lists] == [4, 4, 4]
    assert samplers[0].padding() == [0, 1]
    flat = sorted(i for x in lists for i in x)
    assert flat == sorted(list(range(10)) + [0, 1])


def test_sampler_bad_input() -> None:
    with pytest.raises(TypeError, match="needs a dataset with a length"):
        elastic.ElasticSampler(iter(range(3)))        # type: ignore[arg-type]
    s = elastic.ElasticSampler(list(range(4)))
    with pytest.raises(ValueError, match="expects"):
        s.load_state_dict({"epoch": 1})
    with pytest.raises(ValueError, match=">= 0"):
        s.load_state_dict({"epoch": 1, "processed_num": -2})


# -------------------------------------------------------------------- state semantics
def test_object_state_restore_undoes_changes_made_in_place() -> None:
    state = elastic.ObjectState(history=[1, 2])
    state.history.append(3)
    state.commit()
    state.history.append(4)
    state.restore()
    assert state.history == [1, 2, 3]
    state.history.append(5)                       # restore() gave a copy: commit unchanged
    state.restore()
    assert state.history == [1, 2, 3]


def test_assigning_a_handled_attribute_saves_it() -> None:
    """Horovod's TorchState.__setattr__: a new model assigned is saved at once."""
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    state = elastic.State(model=a)
    state.model = b
    expected = b.weight.detach().clone()
    with torch.no_grad():
        b.weight.add_(1.0)
    state.restore()
    assert torch.equal(b.weight.detach(), expected)


@pytest.mark.parametrize("update,skip", [(elastic.HostUpdateResult.removed, True),
                                         (elastic.HostUpdateResult.added, False)])
def test_host_update_interrupts_the_next_commit(update: Any, skip: bool) -> None:
    state = elastic.ObjectState(batch=0)
    state.commit()                                   # nothing to say: no interrupt
    state.on_hosts_updated(10.0, update)
    state.batch = 1
    with pytest.raises(elastic.HostsUpdatedInterrupt) as info:
        state.commit()
    assert info.value.skip_sync is skip
    state.restore()
    assert state.batch == 1                          # committed before the interrupt
    state.on_hosts_updated(5.0, update)              # older than the last: ignored
    state.commit()


def test_run_in_process_restores_on_a_failed_collective() -> None:
    """Without torchrun, Horovod's loop: a registered error restores the last commit, runs the
    reset callbacks and calls the function again; HostsUpdatedInterrupt does not restore."""
    state = elastic.ObjectState(step=0)
    resets: list[int] = []
    state.register_reset_callbacks([lambda: resets.append(state.step)])

    class Lost(RuntimeError):
        pass

    elastic.register_recoverable(Lost)
    calls: list[int] = []

    @elastic.run
    def train(state: Any) -> int:
        calls.append(state.step)
        while state.step < 6:
            state.step += 1
            if state.step == 3 and len(calls) == 1:
                raise Lost("a peer died")
            if state.step == 5 and len(calls) == 2:
                state.on_hosts_updated(1.0, elastic.HostUpdateResult.added)
            state.commit()
        return state.step

    assert train(state) == 6
    assert calls == [0, 2, 5]          # restored to commit 2; no rollback after the update
    assert resets == [2, 5]


def test_run_refuses_a_first_argument_that_is_not_a_state() -> None:
    @elastic.run
    def train(state: Any) -> None:
        pass
    with pytest.raises(TypeError, match="elastic state as its first argument"):
        train(object())


# ------------------------------------------------------------ the torchrun side, in parts
def test_launch_refuses_the_shared_agent_store(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    launch = agent_mod.Launch.detect()
    assert launch is not None
    with pytest.raises(RuntimeError, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        launch.check()


def test_only_launches_that_restart_need_the_store_setting() -> None:
    from argparse import Namespace
    static = agent_mod.Launch(run_id="j", restart_count=0, max_restarts=0, agent_store=True)
    assert not agent_mod.elastic_launch(static, Namespace(nnodes="2"))
    assert not agent_mod.elastic_launch(static, Namespace(nnodes="2:2"))
    assert agent_mod.elastic_launch(static, Namespace(nnodes="1:3"))
    assert agent_mod.elastic_launch(static, None)           # not known: assume it restarts
    static.check(elastic=False)
    restarts = agent_mod.Launch(run_id="j", restart_count=0, max_restarts=2, agent_store=True)
    assert agent_mod.elastic_launch(restarts, Namespace(nnodes="2"))


def test_commit_directory_needs_a_job_id(monkeypatch: pytest.MonkeyPatch,
                                         tmp_path: Path) -> None:
    monkeypatch.delenv("DEAR_ELASTIC_DIR", raising=False)
    with pytest.raises(RuntimeError, match="--rdzv-id"):
        default_directory("none")
    monkeypatch.setenv("DEAR_ELASTIC_DIR", str(tmp_path))
    assert default_directory("none") == tmp_path


def test_torchrun_command_lines_are_read() -> None:
    args = ["--nnodes", "1:2", "--rdzv-endpoint", "h:1", "x.py"]
    assert agent_mod._torchrun_args(["/v/bin/python", "/v/bin/torchrun", *args]) == args
    assert agent_mod._torchrun_args(["python", "-m", "torch.distributed.run", *args]) == args
    assert agent_mod._torchrun_args(["python", "train.py"]) is None


def test_prune_keeps_the_newest_two_complete(tmp_path: Path) -> None:
    d = CommitDir(tmp_path, "train")
    for n, complete in [(0, True), (1, False), (2, True), (3, True), (4, False)]:
        p = d.commit_path(n)
        p.mkdir(parents=True)
        if complete:
            (p / ".metadata").write_bytes(b"")
    d.prune()
    assert d.listed() == ([2, 3, 4], [2, 3])   # 4 may be a commit in progress: kept


def test_merge_kfac_takes_factors_and_drops_decompositions() -> None:
    a, g = torch.ones(2, 2), torch.full((3, 3), 2.0)
    dec = {"q": a, "d": a, "inv": a}
    states = [{"steps": 4, "method": "eigen", "layers": {"l": {"A": None, "G": g, "A_dec": None,
                                                               "G_dec": dec}}},
              {"steps": 4, "method": "eigen", "layers": {"l": {"A": a, "G": g, "A_dec": dec,
                                                               "G_dec": dec}}}]
    merged = merge_kfac(states)
    assert merged["steps"] == 4
    layer = merged["layers"]["l"]
    assert torch.equal(layer["A"], a) and torch.equal(layer["G"], g)
    assert layer["A_dec"] is None and layer["G_dec"] is None


# ------------------------------------------- commits through DCP on forked ranks (no agent)
def _commit_then_resume(phase: str, directory: str, world_before: int) -> dict[str, Any]:
    """Phase "write": train 3 Adam steps with shard_optimizer_state on this world, commit
    through a Session as run() would. Phase "read": a fresh optimizer on this world resumes
    from it. Both return the whole state (a collective)."""
    from dear.elastic.session import Session
    dear.init()
    rank = dear.rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 3))
    optimizer = dear.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                          model=model, shard_optimizer_state=True)
    sampler = elastic.ElasticSampler(list(range(30)), seed=1)
    state = elastic.State(model=model, optimizer=optimizer, sampler=sampler, step=0)
    launch = agent_mod.Launch(run_id="unit", restart_count=0, max_restarts=0,
                              agent_store=False)
    session = Session(launch, agent_mod.TermWatch(grace=60), "train", state.ops)
    state.attach(session)
    g = torch.Generator().manual_seed(rank)
    if phase == "write":
        session.resume(state)
        for _ in range(3):
            optimizer.zero_grad()
            model(torch.randn(4, 6, generator=g)).pow(2).mean().backward()
            optimizer.step()
            sampler.record_batch(0, 2)
            state.step += 1
            state.commit()
    else:
        assert session.resume(state) is True
    whole = optimizer.state_dict()
    out = {"model": {k: v.clone() for k, v in model.state_dict().items()},
           "optim": whole, "step": state.step, "sampler": sampler.state_dict(),
           "resumed_from": session.resumed_from, "world_before": world_before}
    state.attach(None)
    dear.shutdown()
    return out


def test_sharded_state_reshards_from_three_ranks_to_two(tmp_path: Path) -> None:
    """Written by 3 ranks (each its own pieces of the Adam state), read by 2: each new rank's
    shards come from the files that hold them, and the whole state equals the one the 3
    ranks had, bit for bit (compared with the whole state they gathered, not with the
    commit)."""
    env = {"DEAR_ELASTIC_DIR": str(tmp_path)}
    before = run_distributed(_commit_then_resume, 3, "write", str(tmp_path), 3, env=env,
                             timeout=120)
    after = run_distributed(_commit_then_resume, 2, "read", str(tmp_path), 3, env=env,
                            timeout=120)
    ref = before[0]
    for out in after:
        assert out["step"] == 3 and out["sampler"] == ref["sampler"]
        assert out["resumed_from"] == 2                   # commits 0, 1, 2: the newest
        for k, v in ref["model"].items():
            assert torch.equal(out["model"][k], v), k
        for i, entry in ref["optim"]["state"].items():
            for key, v in entry.items():
                got = out["optim"]["state"][i][key]
                assert torch.equal(torch.as_tensor(got), torch.as_tensor(v)), (i, key)
    assert sorted(os.listdir(tmp_path / "train")) == ["commit-00000001", "commit-00000002"]


def _see_commits(directory: str) -> None:
    from dear.elastic.session import Session
    dear.init()
    os.environ["DEAR_ELASTIC_DIR"] = f"{directory}/rank{dear.rank()}"
    CommitDir(Path(os.environ["DEAR_ELASTIC_DIR"]), "train").commit_path(dear.rank()).mkdir(
        parents=True)
    (CommitDir(Path(os.environ["DEAR_ELASTIC_DIR"]), "train").commit_path(dear.rank())
     / ".metadata").write_bytes(b"")
    launch = agent_mod.Launch(run_id="unit", restart_count=0, max_restarts=0,
                              agent_store=False)
    session = Session(launch, agent_mod.TermWatch(grace=60), "train", elastic.ops.DEAR)
    session.resume(elastic.ObjectState(x=1))


def test_a_directory_that_is_not_shared_is_refused(tmp_path: Path) -> None:
    outcomes = run_distributed(_see_commits, 2, str(tmp_path), timeout=90,
                               expect_failure=True)
    for out in outcomes:
        assert isinstance(out, str) and "shared file system" in out, out


def _kfac_phase(phase: str, world_before: int) -> dict[str, Any]:
    """dear.KFAC (mem-opt: each layer's decomposition on its owner only) in an elastic State:
    "write" trains 3 steps and commits; "read" resumes on this world and takes one step."""
    from dear.elastic.session import Session
    dear.init()
    rank = dear.rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    optimizer = dear.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                          model=model)
    precond = dear.KFAC(model, lr=0.1, inv_update_freq=10, strategy="mem-opt")
    state = elastic.State(model=model, optimizer=optimizer, precond=precond, step=0)
    launch = agent_mod.Launch(run_id="unit", restart_count=0, max_restarts=0,
                              agent_store=False)
    session = Session(launch, agent_mod.TermWatch(grace=60), "kfac", state.ops)
    state.attach(session)
    g = torch.Generator().manual_seed(rank)

    def step() -> None:
        optimizer.zero_grad()
        model(torch.randn(4, 6, generator=g)).pow(2).mean().backward()
        precond.step()
        optimizer.step()

    session.resume(state)
    loaded = precond.state_dict(include_factors=True)
    if phase == "write":
        for _ in range(3):
            step()
            state.step += 1
            state.commit()
        loaded = precond.state_dict(include_factors=True)
    else:
        step()
    out = {"loaded": loaded, "after": precond.state_dict(include_factors=True),
           "params": [p.detach().clone() for p in model.parameters()]}
    state.attach(None)
    dear.shutdown()
    return out


def _factors(state: dict[str, Any]) -> dict[str, Any]:
    return {name: (layer["A"], layer["G"]) for name, layer in state["layers"].items()}


@pytest.mark.parametrize("after", [3, 2])
def test_kfac_factors_carried_and_owners_reassigned(tmp_path: Path, after: int) -> None:
    """3 ranks commit dear.KFAC; `after` ranks resume. Same size: every rank gets its own
    state back, decompositions included. Two ranks: every rank gets the factors (equal on
    every old rank) and no decomposition, which the new owners compute at the next step;
    the replicas stay equal."""
    env = {"DEAR_ELASTIC_DIR": str(tmp_path)}
    before = run_distributed(_kfac_phase, 3, "write", 3, env=env, timeout=120)
    resumed = run_distributed(_kfac_phase, after, "read", 3, env=env, timeout=120)
    for r, out in enumerate(resumed):
        assert out["loaded"]["steps"] == before[0]["loaded"]["steps"] == 3
        for name, (a, g) in _factors(before[0]["loaded"]).items():
            got_a, got_g = _factors(out["loaded"])[name]
            assert torch.equal(got_a, a) and torch.equal(got_g, g), name
        for name, layer in out["loaded"]["layers"].items():
            old = before[r]["loaded"]["layers"][name] if after == 3 else None
            for key in ("A_dec", "G_dec"):
                if old is None:
                    assert layer[key] is None, (name, key)
                elif old[key] is None:
                    assert layer[key] is None
                else:
                    assert all((v is None and layer[key][k] is None)
                               or torch.equal(layer[key][k], v) for k, v in old[key].items())
        assert any(layer["A_dec"] is not None for layer in out["after"]["layers"].values())
        for p, q in zip(out["params"], resumed[0]["params"]):
            assert torch.equal(p, q)
