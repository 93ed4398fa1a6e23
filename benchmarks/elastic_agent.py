"""What torchrun's elastic agent does on localhost, with timestamps: 2-3 agents as "nodes"
(`--nnodes MIN:MAX --rdzv-backend c10d`, one worker each), a worker killed, an agent killed or
stopped, an agent added, the size falling under MIN. No dear in the workers: a Gloo all-reduce
every 50 ms, so what is timed is the agent's own behaviour.

    python -m benchmarks.elastic_agent --name elastic_agent          # every scenario
    python -m benchmarks.elastic_agent --scenarios kill-worker       # one

Each worker appends JSON lines (start with its environment, first collective at its size, the
error that ended it, SIGTERM) to a file the driver reads; times are wall-clock on one machine.
"""

from __future__ import annotations

import time

T_EXEC = time.time()                     # the worker's process began (before torch's import)

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable  # noqa: E402

_EXTRA_ENV: dict[str, str] = {}

ENV_KEYS = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
            "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
            "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE", "DEAR_ELASTIC_AGENT"]


# ------------------------------------------------------------------------------- worker side
def _worker(out: Path, steps: int) -> None:
    from dear.testing.elastic import die_with_parent
    die_with_parent()
    import datetime

    import torch
    import torch.distributed as dist

    agent = os.environ.get("DEAR_ELASTIC_AGENT", "?")
    path = out / f"agent{agent}.jsonl"

    def event(kind: str, **data: Any) -> None:
        line = json.dumps({"t": time.time(), "event": kind, "agent": agent, "pid": os.getpid(),
                           "rank": int(os.environ["RANK"]),
                           "world": int(os.environ["WORLD_SIZE"]), **data})
        with open(path, "a") as fh:
            fh.write(line + "\n")

    def on_term(signum: int, frame: Any) -> None:
        event("sigterm")
        os._exit(143)

    signal.signal(signal.SIGTERM, on_term)
    event("exec", at=T_EXEC)
    event("start", env={k: os.environ.get(k) for k in ENV_KEYS})
    try:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=10))
        event("init")
        x = torch.ones(1)
        for step in range(steps):
            dist.all_reduce(x)
            x.fill_(1)
            if step == 0:
                event("first_step")
            if (out / "stop").exists():
                break
            time.sleep(0.05)
        event("done")
    except Exception as exc:               # the collective a dead peer broke
        event("error", error=f"{type(exc).__name__}: {str(exc)[:300]}")
        raise


# ------------------------------------------------------------------------------- driver side
def _events(out: Path) -> list[dict[str, Any]]:
    rows = []
    for f in sorted(out.glob("agent*.jsonl")):
        for line in f.read_text().splitlines():
            if line.strip():
                rows.append(json.loads(line))
    return sorted(rows, key=lambda r: r["t"])


def _first(rows: list[dict[str, Any]], after: float, pred: Callable[[dict[str, Any]], bool]
           ) -> Any:
    for r in rows:
        if r["t"] >= after and pred(r):
            return r
    return None


def _cluster(out: Path, nnodes: str, conf: dict[str, Any], monitor: float, restarts: int,
             timeout: float) -> Any:
    """The agents; the rendezvous store in a process of its own (as a stable endpoint)."""
    from dear.testing.elastic import ElasticCluster
    return ElasticCluster([str(Path(__file__).resolve()), "--worker", "--out", str(out)],
                          nnodes=nnodes, rdzv_conf=conf, monitor_interval=monitor,
                          max_restarts=restarts, workdir=out, timeout=timeout,
                          env={"PYTHONPATH": str(Path(__file__).resolve().parent.parent),
                               **_EXTRA_ENV})


def _running(out: Path, world: int, after: float = 0.0) -> Callable[[], Any]:
    return lambda: _first(_events(out), after, lambda r: r["event"] == "first_step"
                          and r["world"] == world)


def scenario(name: str, conf: dict[str, Any], monitor: float, timeout: float) -> dict[str, Any]:
    """Run one scenario; the times (s) from the fault to what the workers saw."""
    out = Path(tempfile.mkdtemp(prefix=f"dear-agent-{name}-"))
    nnodes = "2:3" if name == "under-min" else "1:3"
    row: dict[str, Any] = {"scenario": name, "rdzv_conf": conf, "monitor_interval": monitor}
    with _cluster(out, nnodes, conf, monitor, 3, timeout) as cluster:
        t_start = time.time()
        agents = [cluster.start_agent(), cluster.start_agent()]
        first = cluster.wait_for(_running(out, 2), "2 workers running")
        row["start_to_first_step_2"] = round(first["t"] - t_start, 2)
        t0 = time.time()
        if name == "kill-worker":
            cluster.kill_worker(agents[1])
        elif name in ("kill-agent", "under-min"):
            cluster.kill_agent(agents[1])
        elif name == "stop-agent":
            cluster.kill_agent(agents[1], signal.SIGTERM)
        elif name == "kill-rank0-agent":
            cluster.kill_agent(agents[0])
        elif name == "add-agent":
            agents.append(cluster.start_agent())
        target = {"kill-worker": 2, "kill-agent": 1, "stop-agent": 1, "kill-rank0-agent": 1,
                  "add-agent": 3, "under-min": None}[name]
        if target is not None:
            hit = cluster.wait_for(_running(out, target, t0), f"first step at size {target}")
        else:
            cluster.wait_agents([agents[0]])
            hit = None
        rows = _events(out)
        err = _first(rows, t0, lambda r: r["event"] == "error")
        term = _first(rows, t0, lambda r: r["event"] == "sigterm")
        start = _first(rows, t0, lambda r: r["event"] == "start")
        execd = _first(rows, t0, lambda r: r["event"] == "exec")
        row.update({
            "survivor_error_s": round(err["t"] - t0, 2) if err else None,
            "survivor_error": err["error"][:160] if err else None,
            "sigterm_s": round(term["t"] - t0, 2) if term else None,
            "new_worker_exec_s": round(execd["at"] - t0, 2) if execd else None,
            "new_worker_imported_s": round(start["t"] - t0, 2) if start else None,
            "first_step_new_size_s": round(hit["t"] - t0, 2) if hit else None,
            "new_env": start["env"] if start else None,
        })
        (out / "stop").write_text("")
        codes = cluster.wait_agents([a for a in cluster.agents if a.proc.poll() is None]
                                    or cluster.agents)
        row["agent_exit_codes"] = [a.proc.returncode for a in cluster.agents]
        row["exit_s"] = round(time.time() - t0, 2)
        del codes
        if name == "under-min":
            row["survivor_log_tail"] = cluster.agents[0].log.read_text()[-600:]
    return row


SCENARIOS = ["kill-worker", "kill-agent", "stop-agent", "add-agent", "kill-rank0-agent",
             "under-min"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path)
    p.add_argument("--steps", type=int, default=100000)
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--conf", default="", help="--rdzv-conf for every agent, k=v,k=v")
    p.add_argument("--monitor-interval", type=float, default=0.1)
    p.add_argument("--timeout", type=float, default=180)
    p.add_argument("--name", default=None, help="write benchmarks/results/NAME.json and .md")
    p.add_argument("--env", default="", help="extra environment for the agents, K=V,K=V")
    args = p.parse_args(argv)
    _EXTRA_ENV.update(kv.split("=", 1) for kv in args.env.split(",") if kv)
    if args.worker:
        _worker(args.out, args.steps)
        return 0
    conf = dict(kv.split("=", 1) for kv in args.conf.split(",") if kv)
    rows = []
    for name in args.scenarios.split(","):
        row = scenario(name, conf, args.monitor_interval, args.timeout)
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.name:
        from benchmarks.results import markdown_table, write
        keys = ["survivor_error_s", "sigterm_s", "new_worker_exec_s", "new_worker_imported_s",
                "first_step_new_size_s", "agent_exit_codes"]
        table = markdown_table(["scenario", *keys],
                               [[r["scenario"], *(r.get(k, "") for k in keys)] for r in rows])
        write(args.name, "torchrun's elastic agent on localhost: what the workers see",
              {"rows": rows, "rdzv_conf": conf, "env": _EXTRA_ENV,
               "monitor_interval": args.monitor_interval}, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
