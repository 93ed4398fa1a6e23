"""dear.init() under srun and mpirun (dear/comm/launch.py).

Slurm and Open MPI are not installed here, so their variables are set by hand as srun and
mpirun set them, on two plain processes; MPICH's mpirun (the `mpich` wheel, installed by
`make setup`) is run for real, with and without mpi4py to agree on the master. Each launch
trains nothing: dear.init() must start a 2-rank Gloo group, and an all-reduce over it must give
the sum, on every rank.
"""

from __future__ import annotations

import os
import re
import random
import shutil
import socket
import subprocess
import sys
import time

import pytest

from dear.comm import launch
from tests.subprocesses import BIN, NO_MPIRUN, ROOT, run

# What each rank runs: dear.init() alone must find its place; prints one line to check.
BODY = """
import os, sys, torch, dear, torch.distributed as dist
sys.modules.update({m: None for m in os.environ.get("HIDE_MODULES", "").split(",") if m})
dear.init()
x = torch.tensor([float(dear.rank() + 1)])
dear.comm.runtime.communicator().all_reduce(x).wait()
print(f"OK rank={dear.rank()} size={dear.size()} local={dear.local_rank()} sum={x.item():g} "
      f"pg={dist.is_initialized()} master={os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
      flush=True)
dear.shutdown()
"""

_TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
             "MASTER_PORT", "GROUP_RANK")


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in _TORCHRUN and not k.startswith(("SLURM_", "OMPI_", "PMI_", "MPI_"))}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _free_port(lo: int = 20000, hi: int = 40000) -> int:
    """A port in [lo, hi) that nothing listens on now (random tries)."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(lo, hi)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port")


def _run_ranks(envs: list[dict[str, str]], timeout: float = 120) -> list[str]:
    """Start one process per environment (as a launcher would), hard timeout, kill on failure."""
    procs = [subprocess.Popen([sys.executable, "-c", BODY], cwd=ROOT, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              start_new_session=True) for env in envs]
    deadline = time.monotonic() + timeout
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outs.append(out)
            assert p.returncode == 0, f"a rank failed:\n{out}"
    except subprocess.TimeoutExpired:
        raise AssertionError(f"ranks did not finish within {timeout:.0f} s (hang?); killed")
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    return outs


def _ok_lines(outs: list[str]) -> list[str]:
    """The ranks' OK reports. Under mpirun the ranks share one pipe and a report's newline may
    be written after the next rank's text ("...:39480OK rank=0 ..."), so split on the marker."""
    pieces = (piece.strip() for out in outs for line in out.splitlines()
              for piece in re.split(r"(?=OK rank=)", line))
    return sorted(piece for piece in pieces if piece.startswith("OK "))


# ----------------------------------------------------------------------------- unit tests
@pytest.mark.parametrize("text, hosts", [
    ("node01", ["node01"]),
    ("node[01-04]", ["node01", "node02", "node03", "node04"]),
    ("node[01-02,07],login", ["node01", "node02", "node07", "login"]),
    ("gpu-a[8-10]-ib", ["gpu-a8-ib", "gpu-a9-ib", "gpu-a10-ib"]),
    ("r[1-2]n[09-10]", ["r1n09", "r1n10", "r2n09", "r2n10"]),
    ("c[098-101]", ["c098", "c099", "c100", "c101"]),
    ("a,b[1,3]", ["a", "b1", "b3"]),
])
def test_expand_hostlist(text: str, hosts: list[str]) -> None:
    assert launch.expand_hostlist(text) == hosts


@pytest.mark.parametrize("text", ["node[01-", "node[a-b]", "node]1["])
def test_expand_hostlist_refuses_garbage(text: str) -> None:
    with pytest.raises(ValueError, match="host list"):
        launch.expand_hostlist(text)


def test_detect_each_launcher() -> None:
    slurm = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
             "SLURM_NODEID": "2", "SLURM_STEP_TASKS_PER_NODE": "2(x3),1",
             "SLURM_JOB_NODELIST": "gpu[003-006]", "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0"}
    p = launch.detect(slurm)
    assert p == launch.Placement("slurm", 5, 8, 1, 2, "gpu003", launch.slurm_port(4242, 0))
    # The step's own node list wins over the job's; an explicit master wins over both.
    p = launch.detect({**slurm, "SLURM_STEP_NODELIST": "gpu[005-006]"})
    assert p is not None and p.master_addr == "gpu005"
    p = launch.detect({**slurm, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"})
    assert p is not None and (p.master_addr, p.master_port) == ("10.0.0.1", 1234)
    ompi = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
            "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    assert launch.detect(ompi) == launch.Placement("openmpi", 3, 4, 1, 2, None, None)
    # mpirun inside a Slurm allocation: MPI's variables describe the job, Slurm's the batch step
    p = launch.detect({**slurm, **ompi})
    assert p is not None and (p.launcher, p.rank, p.size) == ("openmpi", 3, 4)
    pmi = {"PMI_RANK": "1", "PMI_SIZE": "3", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "3"}
    assert launch.detect(pmi) == launch.Placement("pmi", 1, 3, 1, 3, None, None)
    torchrun = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "9"}
    p = launch.detect({**torchrun, **pmi})
    assert p is not None and p.launcher == "torchrun"
    assert launch.detect({}) is None
    with pytest.raises(ValueError, match="SLURM_PROCID='x' is not an integer"):
        launch.detect({**slurm, "SLURM_PROCID": "x"})


def test_export_writes_torchrun_variables() -> None:
    env = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0",
           "SLURM_JOB_NODELIST": "node[07-08]", "SLURM_JOB_ID": "17", "MASTER_PORT": "4000"}
    placement = launch.setup_env(env)
    assert placement is not None
    assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                "MASTER_PORT")} == {
        "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "node07",
        "MASTER_PORT": "4000"}
    assert launch.setup_env({}) is None


def test_every_backend_reads_srun_variables_through_launch(monkeypatch) -> None:
    """dear.init(backend=...) translates srun's variables before any backend reads its place
    (the NCCL backend used to read RANK/WORLD_SIZE itself: a world of one per process under
    srun), and launch.process_env is where every backend reads it."""
    import dear.comm.runtime as runtime
    env = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1",
           "SLURM_JOB_NODELIST": "node[07-08]", "SLURM_JOB_ID": "17", "MASTER_PORT": "4000"}
    # setup_env writes into os.environ itself: a private copy, restored after the test
    monkeypatch.setattr(os, "environ", {**{k: v for k, v in os.environ.items()
                                           if k not in _TORCHRUN}, **env})
    seen = {}

    def fake_create(timeout: float) -> None:
        place = launch.process_env()
        seen.update(rank=place.rank, size=place.size, local=place.local_rank)
        raise RuntimeError("stop here")
    import dear.comm.nccl as nccl
    monkeypatch.setattr(nccl, "create", fake_create)
    with pytest.raises(RuntimeError, match="stop here"):
        runtime._make_communicator("nccl", runtime.Config())
    assert seen == {"rank": 1, "size": 2, "local": 1}
    assert launch.process_env({}).size == 1


def test_other_launcher_variables() -> None:
    assert launch.agent_store({"TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert not launch.agent_store({"TORCHELASTIC_USE_AGENT_STORE": "False"})
    assert not launch.agent_store({})
    assert launch.gloo_interface({"GLOO_SOCKET_IFNAME": "eth1,eth2",
                                  "HOROVOD_GLOO_IFACE": "ib0"}) == "eth1"
    assert launch.gloo_interface({"HOROVOD_GLOO_IFACE": " ib0 "}) == "ib0"
    assert launch.gloo_interface({"GLOO_SOCKET_IFNAME": ""}) is None
    assert launch.horovod_hostname({"HOROVOD_HOSTNAME": "node3"}) == "node3"
    assert launch.horovod_hostname({}) is None


def test_only_launch_and_config_read_the_environment() -> None:
    """Launcher variables have one reader (dear/comm/launch.py) and DEAR_* knobs one home
    (dear/config.py): a backend that read RANK or WORLD_SIZE itself saw a world of one under
    srun. dear/testing sets variables for the ranks it starts."""
    package = os.path.join(ROOT, "dear")
    readers = []
    for folder, _, files in os.walk(package):
        for name in files:
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, package)
            if not name.endswith(".py") or rel in ("comm/launch.py", "config.py") \
                    or rel.startswith("testing"):
                continue
            with open(path) as f:
                text = f.read()
            if re.search(r"os\.environ|os\.getenv|getenv\(", text):
                readers.append(rel)
    assert readers == [], f"modules reading the environment outside launch.py/config.py: {readers}"


# ------------------------------------------------------------------------ real processes
def test_slurm_variables_by_hand() -> None:
    """Two processes with the variables srun gives two tasks on one node; the port is the one
    dear derives from the job id (chosen here so that it is free)."""
    rng = random.Random()
    while True:                                    # a job id whose derived port is free now
        job = rng.randrange(1, 10**6)
        port = launch.slurm_port(job, 0)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        break
    envs = []
    for rank in range(2):
        env = _clean_env()
        env.update({"SLURM_PROCID": str(rank), "SLURM_NTASKS": "2", "SLURM_LOCALID": str(rank),
                    "SLURM_NODEID": "0", "SLURM_STEP_TASKS_PER_NODE": "2",
                    "SLURM_JOB_NODELIST": "localhost,nid[0002-0003]", "SLURM_JOB_ID": str(job),
                    "SLURM_STEP_ID": "0"})
        envs.append(env)
    lines = _ok_lines(_run_ranks(envs))
    assert lines == [f"OK rank={r} size=2 local={r} sum=3 pg=True master=localhost:{port}"
                     for r in range(2)]


def test_a_derived_port_already_taken_names_master_port() -> None:
    """Rank 0 of a Slurm step whose derived port another process listens on stops at once,
    saying which port and that MASTER_PORT is the way out (torch's own error names neither)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        rng = random.Random()
        while True:                                # hold the derived port of some job id
            job = rng.randrange(1, 10**6)
            try:
                sock.bind(("127.0.0.1", launch.slurm_port(job, 0)))
            except OSError:
                continue
            break
        sock.listen()
        env = _clean_env()
        env.update({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0",
                    "SLURM_NODEID": "0", "SLURM_STEP_TASKS_PER_NODE": "2",
                    "SLURM_JOB_NODELIST": "localhost", "SLURM_JOB_ID": str(job),
                    "SLURM_STEP_ID": "0"})
        out = run([sys.executable, "-c", BODY], timeout=60, env=env)
    assert out.returncode != 0, out.stdout
    assert f"cannot listen on localhost:{launch.slurm_port(job, 0)}" in out.stdout, out.stdout
    assert "MASTER_PORT" in out.stdout, out.stdout


def test_openmpi_variables_by_hand() -> None:
    port = _free_port()
    envs = []
    for rank in range(2):
        env = _clean_env()
        env.update({"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": "2",
                    "OMPI_COMM_WORLD_LOCAL_RANK": str(rank), "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
        envs.append(env)
    lines = _ok_lines(_run_ranks(envs))
    assert lines == [f"OK rank={r} size=2 local={r} sum=3 pg=True master=127.0.0.1:{port}"
                     for r in range(2)]


def _mpirun() -> str:
    path = os.path.join(BIN, "mpirun")
    if not os.path.exists(path):
        path = shutil.which("mpirun") or ""
    if not path:
        pytest.skip(NO_MPIRUN)
    return path


def _mpirun_env(env: dict[str, str]) -> dict[str, str]:
    """Open MPI's mpirun (the system's, where the venv has no mpich) refuses to start as root
    without these; MPICH ignores them."""
    return {**env, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def test_real_mpirun_on_one_host_starts_no_mpi() -> None:
    """mpirun -np 2 with nothing else, mpi4py installed: 127.0.0.1 and a port derived from the
    launcher's process, the same on both ranks, and MPI never started (mpi4py's MPI_Init opens
    listeners on the external interface in every rank)."""
    pytest.importorskip("mpi4py")
    body = BODY.replace('flush=True)', 'flush=True)\nprint(f"MPI {rank}", flush=True)'.replace(
        "{rank}", "{'mpi4py.MPI' in sys.modules}"))
    out = run([_mpirun(), "-np", "2", sys.executable, "-c", body], timeout=120,
              env=_mpirun_env(_clean_env()))
    assert out.returncode == 0, out.stdout
    lines = _ok_lines([out.stdout])
    assert [line.split(" master=")[0] for line in lines] == [
        f"OK rank={r} size=2 local={r} sum=3 pg=True" for r in range(2)]
    masters = {line.split(" master=")[1] for line in lines}
    assert len(masters) == 1, masters
    addr, port = masters.pop().split(":")
    assert addr == "127.0.0.1" and 20000 <= int(port) < 32768, (addr, port)
    assert re.findall(r"MPI (True|False)", out.stdout) == ["False", "False"], out.stdout


def test_mpirun_launcher_process_names_one_launch() -> None:
    """The launcher process is found through /proc whatever sits between it and the rank (a
    shell here), and two launches get different ports."""
    if not os.path.exists("/proc/self/stat"):
        pytest.skip("no /proc")
    probe = ("import sys; sys.path.insert(0, %r); from dear.comm import launch; "
             "p = launch.mpi_launcher_process(); print('L', p, launch.mpirun_port(p))" % ROOT)
    ports = []
    for _ in range(2):
        out = run([_mpirun(), "-np", "1", "sh", "-c", f'{sys.executable} -c "{probe}"'],
                  timeout=60, env=_mpirun_env(_clean_env()))
        assert out.returncode == 0, out.stdout
        found = re.search(r"L \((\d+), (\d+)\) (\d+)", out.stdout)
        assert found, out.stdout
        ports.append(found.group(3))
    assert ports[0] != ports[1], ports                 # equal with probability 1/12768
    assert launch.mpi_launcher_process(os.getpid()) is None   # pytest is no MPI launch


def test_real_mpirun_without_mpi4py() -> None:
    """Without mpi4py the ranks cannot agree on a port: MASTER_PORT comes from the environment
    (mpirun passes it on), the address is 127.0.0.1 because every rank is on this host."""
    port = _free_port()
    env = _clean_env()
    env.update({"MASTER_PORT": str(port), "HIDE_MODULES": "mpi4py,mpi4py.MPI"})
    out = run([_mpirun(), "-np", "2", sys.executable, "-c", BODY], timeout=120,
              env=_mpirun_env(env))
    assert out.returncode == 0, out.stdout
    assert _ok_lines([out.stdout]) == [
        f"OK rank={r} size=2 local={r} sum=3 pg=True master=127.0.0.1:{port}" for r in range(2)]


def test_slurm_ports_of_neighbouring_steps_differ() -> None:
    """job * 7 + step gave job J step 7 and job J+1 step 0 the same port on one host."""
    ports = {launch.slurm_port(job, step) for job in range(5000, 5040) for step in range(12)}
    lo, hi = launch.DERIVED_PORTS
    assert len(ports) == 40 * 12 and all(lo <= p < hi for p in ports)
    # Below Linux's ephemeral ports, where a client socket could hold the derived port.
    assert hi <= 32768 and max(launch.slurm_port(j, 19) for j in range(600)) < hi
    assert launch.slurm_port(77, 3) == launch.slurm_port(77, 3)      # the same on every task


def _slurm_rank(job_of_rank_1: str, timeout: str) -> str:
    """A 2-task Slurm step on this host whose rank 1 belongs to another job (same port)."""
    import dear
    rank = int(os.environ.pop("RANK"))
    for name in ("WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        os.environ.pop(name, None)
    os.environ.update(SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_LOCALID=str(rank),
                      SLURM_JOB_NODELIST="localhost", SLURM_STEP_ID="0", DEAR_TIMEOUT=timeout,
                      SLURM_JOB_ID=job_of_rank_1 if rank == 1 else "900")
    dear.init()
    dear.shutdown()
    return "joined"


def test_a_rank_refuses_the_rendezvous_of_another_slurm_job() -> None:
    """Two steps that derived one port: the stray task stops with an error naming both jobs
    instead of joining the other job's group."""
    from tests.distributed import run_distributed
    outcomes = run_distributed(_slurm_rank, 2, "901", "5", timeout=120, expect_failure=True)
    assert "belongs to Slurm job 900 step 0, not to this Slurm job 901 step 0" in outcomes[1]
    assert run_distributed(_slurm_rank, 2, "900", "60", timeout=120) == ["joined", "joined"]
