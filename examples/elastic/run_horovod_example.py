"""Run one of Horovod's elastic examples (its import changed to `import dear.horovod as hvd`)
under torchrun's elastic agent, on 2 agents as nodes on this machine, and lose a node in the
middle of the run:

    git show v0.28.1:examples/elastic/pytorch/pytorch_mnist_elastic.py \\
        | sed 's/^import horovod.torch as hvd$/import dear.horovod as hvd/' > /tmp/mnist.py
    python examples/elastic/run_horovod_example.py /tmp/mnist.py --epochs 3

`--kill worker` kills one worker (its agent restarts the group at the same size, spending one
of --max-restarts); `--kill agent` (the default) kills one agent with its worker (the job goes
on with one node); `--add` then starts a new agent (the job grows back to two). Where
torchvision is missing, examples/elastic/synthetic_torchvision stands in for it (MNIST's
shapes, synthetic data). Prints each agent's output and what each generation of workers did.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("example", help="Horovod's example with the import changed")
    p.add_argument("--kill", choices=["agent", "worker"], default="agent")
    p.add_argument("--add", action="store_true", help="then add a node")
    p.add_argument("--after", default="Train Epoch: 2 ",
                   help="lose the node once a worker printed this")
    p.add_argument("--timeout", type=float, default=600)
    args, example_args = p.parse_known_args()     # the rest: the example's own arguments

    from dear.testing.elastic import ElasticCluster
    work = Path(tempfile.mkdtemp(prefix="dear-hvd-example-"))
    try:
        import torchvision  # noqa: F401
        extra = ""
    except ImportError:
        extra = str(HERE / "synthetic_torchvision")
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "DEAR_ELASTIC_DIR": str(work / "commits"),
           "PYTHONPATH": ":".join(x for x in (extra, str(ROOT)) if x), "OMP_NUM_THREADS": "1",
           "PYTHONUNBUFFERED": "1", "DEAR_LOG_LEVEL": "INFO"}
    rdzv = {"last_call_timeout": 2, "keep_alive_interval": 1, "keep_alive_max_attempt": 5}
    marks: list[tuple[float, str]] = []
    with ElasticCluster([args.example, *example_args], nnodes="1:2", max_restarts=3,
                        rdzv_conf=rdzv, env=env, workdir=work / "agents",
                        timeout=args.timeout) as cluster:
        start = time.monotonic()
        a, b = cluster.start_agent(), cluster.start_agent()
        cluster.wait_for(lambda: args.after in a.log.read_text(errors="replace")
                         + b.log.read_text(errors="replace"), repr(args.after))
        marks.append((time.monotonic() - start, f"kill {args.kill} of agent 1"))
        if args.kill == "agent":
            cluster.kill_agent(b)
        else:
            cluster.kill_worker(b)
        if args.add:
            cluster.wait_for(lambda: "rank 0 of 1 resumed" in a.log.read_text(errors="replace"),
                             "the job at size 1")
            marks.append((time.monotonic() - start, "add agent 2"))
            cluster.start_agent()
        alive = [x for x in cluster.agents if not (args.kill == "agent" and x is b)]
        codes = cluster.wait_agents(alive)
        marks.append((time.monotonic() - start, f"agents exited {codes}"))
        for agent in cluster.agents:
            print(f"===== agent {agent.index} (exit {agent.proc.returncode})")
            print(agent.log.read_text(errors="replace"))
    print("===== events (s since the first agent started)")
    for t, what in marks:
        print(f"{t:7.1f}  {what}")
    return 0 if all(c == 0 for c in codes) else 1


if __name__ == "__main__":
    sys.exit(main())
