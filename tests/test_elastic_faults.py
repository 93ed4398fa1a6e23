"""The bad cases of elastic training under torchrun's real agent (workers from
test_elastic_torchrun.py): too few nodes for longer than the rendezvous' join timeout, every
worker failing, one worker failing again and again (torchrun's --max-restarts is the reset
limit), a worker lost in the middle of a commit, a node that freezes. In each, the job ends
(never hangs: every wait has the cluster's deadline) or goes on, and nothing committed is
lost."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest

from tests.test_elastic_torchrun import (
    _agent_of_rank,
    _at,
    _cluster,
    _go,
    _hold,
    _tail,
    check,
    generations,
    read_logs,
)


def _newest_commit_step(tmp: Path) -> int:
    """The `step` attribute of the newest complete commit, read back from its files alone."""
    import torch.distributed.checkpoint as dcp

    from dear.elastic.commit import CommitDir, unpack
    roots = list((tmp / "commits").iterdir())
    assert len(roots) == 1, roots
    directory = CommitDir(tmp / "commits", roots[0].name)
    n = directory.newest()
    assert n is not None, "no complete commit"
    template: dict[str, Any] = {"objects": b""}
    dcp.load(template, checkpoint_id=str(directory.commit_path(n)), no_dist=True)
    return int(unpack(template["objects"])["step"])


def test_fewer_than_min_nodes_ends_the_job_naming_the_cause(tmp_path: Path) -> None:
    """2:3 nodes, one lost: the survivor's agent waits join_timeout for a second node, then
    exits non-zero with the rendezvous' timeout; the commit of step 2 is still there."""
    _hold(tmp_path, 2, 3)
    with _cluster(tmp_path, {}, 8, "2:3") as cluster:
        cluster.rdzv_conf["join_timeout"] = 8
        a, b = cluster.start_agent(), cluster.start_agent()
        cluster.wait_for(lambda: _at(tmp_path, 2, 3, 2), "both ranks at their 3rd step")
        lost = [a, b][_agent_of_rank(tmp_path, 2, 1)]
        survivor = a if lost is b else b
        cluster.kill_agent(lost)
        _go(tmp_path, 2, 3)
        [code] = cluster.wait_agents([survivor])
        log = survivor.log.read_text(errors="replace")
    assert code != 0
    assert "RendezvousTimeoutError" in log, log[-3000:]
    assert "dear.elastic: rank 0 failed" in log       # the worker said why it left
    assert not cluster.leftovers()
    assert _newest_commit_step(tmp_path) == 2


@pytest.mark.parametrize("ranks", [[0, 1], [1]], ids=["every-worker", "one-worker"])
def test_failing_again_and_again_hits_the_reset_limit(tmp_path: Path, ranks: list[int]) -> None:
    """Workers that raise at step 3 in every generation: torchrun restarts them
    --max-restarts times (here 1), then every agent exits non-zero; the job does not hang,
    torchrun's summary names the worker's error, and the commit of step 2 remains."""
    options = {"fail": {"ranks": ranks, "step": 3}}
    with _cluster(tmp_path, options, 8, "2:2") as cluster:
        cluster.max_restarts = 1
        cluster.start_agent()
        cluster.start_agent()
        codes = cluster.wait_agents()
        logs = "".join(a.log.read_text(errors="replace") for a in cluster.agents)
    assert all(code != 0 for code in codes), codes
    assert f"injected failure of rank {ranks[0]} at step 3" in logs
    gens = generations(read_logs(tmp_path))
    assert [(g["world"], g["start"]) for g in gens] == [(2, 0), (2, 2)]
    assert not cluster.leftovers()
    assert _newest_commit_step(tmp_path) == 2


def test_worker_lost_in_the_middle_of_a_commit(tmp_path: Path) -> None:
    """Rank 1 is killed inside the commit of step 4, its files written, the commit's metadata
    not: that commit is incomplete, the job resumes from step 3's and ends equal to the
    fault-free reference."""
    options = {"pause_in_commit": {"rank": 1, "step": 4}}
    with _cluster(tmp_path, options, 8, "2:2") as cluster:
        agents = [cluster.start_agent(), cluster.start_agent()]
        cluster.wait_for(lambda: (tmp_path / "inside-commit").exists(), "rank 1 mid-commit")
        partial = Path((tmp_path / "inside-commit").read_text())
        assert any(partial.iterdir()) and not (partial / ".metadata").exists()
        cluster.kill_worker(agents[_agent_of_rank(tmp_path, 2, 1)])
        codes = cluster.wait_agents()
        assert codes == [0, 0], cluster.logs()
    assert not cluster.leftovers()
    gens = check(tmp_path, options, 8)
    assert [(g["world"], g["start"]) for g in gens] == [(2, 0), (2, 3)]


def test_a_frozen_node_is_left_behind_without_waiting_for_dear_timeout(tmp_path: Path) -> None:
    """A node freezes at the 3rd step of 2 (its agent and worker stopped, their connections
    open, so no collective fails): torchrun's rendezvous declares it dead when its heartbeat
    expires, and the survivor leaves at once for a restart at size 1 from the 2nd step's
    commit. DEAR_TIMEOUT is 600 s and the cluster's deadline 240 s: a survivor that waited for
    its collective to time out could not finish in time."""
    steps = 6
    _hold(tmp_path, 2, 3)
    with _cluster(tmp_path, {}, steps, "1:2", {"DEAR_TIMEOUT": "600"}) as cluster:
        a, b = cluster.start_agent(), cluster.start_agent()
        cluster.wait_for(lambda: _at(tmp_path, 2, 3, 2), "both ranks at their 3rd step")
        frozen = [a, b][_agent_of_rank(tmp_path, 2, 1)]
        survivor = a if frozen is b else b
        cluster.kill_worker(frozen, signal.SIGSTOP)
        cluster.kill_agent(frozen, signal.SIGSTOP)
        _go(tmp_path, 2, 3)
        [code] = cluster.wait_agents([survivor])
        log = survivor.log.read_text(errors="replace")
    assert code == 0, log[-3000:]
    assert "declared 1 node(s) of this round dead" in log, log[-3000:]
    assert not cluster.leftovers()
    gens = check(tmp_path, {}, steps)
    assert _tail(gens, 2) == [(2, 0), (1, 2)], [(g["world"], g["start"]) for g in gens]
