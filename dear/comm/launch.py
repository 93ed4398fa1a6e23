"""Where this process sits in the job, read from whatever launched it: torchrun, srun or mpirun.

torch.distributed's env:// rendezvous reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, which
only torchrun sets. `detect()` reads the same facts from the other launchers people use on
clusters, and `export()` writes them as torchrun would, so dear.init() starts the process group
the same way under every launcher:

    launcher       rank                    size                   local rank
    torchrun       RANK                    WORLD_SIZE             LOCAL_RANK
    Open MPI       OMPI_COMM_WORLD_RANK    OMPI_COMM_WORLD_SIZE   OMPI_COMM_WORLD_LOCAL_RANK
    MPICH, Intel   PMI_RANK                PMI_SIZE               MPI_LOCALRANKID
    srun (Slurm)   SLURM_PROCID            SLURM_NTASKS           SLURM_LOCALID

Checked in that order: under `mpirun` inside a Slurm allocation the SLURM_* variables describe
the batch step, not the MPI job, so MPI's own variables win. Master address and port: MASTER_ADDR
and MASTER_PORT when set; under srun the first host of SLURM_STEP_NODELIST (or SLURM_JOB_NODELIST,
compressed lists like `node[01-04,07]` expanded) and a port derived from the job id, the same on
every task; under mpirun with every rank on this host, 127.0.0.1 and a port derived from the
launcher's process that all of them descend from (no MPI is started: mpi4py's MPI_Init would open
listeners on the external interface in every rank, for nothing); across hosts, agreed through MPI
(rank 0's address and a port free on it, broadcast by mpi4py).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import socket
import sys
import zlib
from typing import Mapping, MutableMapping, Optional

#: first port tried when nothing names one (torchrun's default)
DEFAULT_PORT = 29500
#: where derived rendezvous ports lie: below Linux's ephemeral ports (32768-60999 by default),
#: so no outgoing connection on the master's host holds the one a job derives (a port of
#: 38110 derived by an mpirun launch was once taken by a client socket: EADDRINUSE)
DERIVED_PORTS = (20000, 32768)


@dataclasses.dataclass(frozen=True)
class Placement:
    """This process's place in the job, as one launcher describes it."""

    launcher: str                    # "torchrun", "openmpi", "pmi" (MPICH / Intel MPI), "slurm"
    rank: int
    size: int
    local_rank: int
    local_size: int
    master_addr: Optional[str]       # None: to be agreed (MPI) or unknown
    master_port: Optional[int]
    job: Optional[str] = None        # whose rendezvous this is, where dear derived its port


def _int(env: Mapping[str, str], *names: str) -> Optional[int]:
    for name in names:
        value = env.get(name, "").strip()
        if value:
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"{name}={value!r} is not an integer") from None
    return None


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed host list to host names: 'node[01-03,07],gpu-a[1-2]-ib,login' ->
    node01 node02 node03 node07 gpu-a1-ib gpu-a2-ib login. Zero padding is kept; several
    bracket groups in one name multiply ('r[1-2]n[1-2]' -> r1n1 r1n2 r2n1 r2n2)."""
    hosts: list[str] = []
    depth, start = 0, 0
    parts: list[str] = []
    for i, ch in enumerate(text):
        depth += ch == "["
        depth -= ch == "]"
        if depth < 0:
            raise ValueError(f"unbalanced brackets in host list {text!r}")
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"unbalanced brackets in host list {text!r}")
    parts.append(text[start:])
    for part in (p.strip() for p in parts):
        if part:
            hosts.extend(_expand_one(part))
    return hosts


def _expand_one(name: str) -> list[str]:
    m = re.search(r"\[([^\]]*)\]", name)
    if m is None:
        return [name]
    head, tail = name[:m.start()], name[m.end():]
    out: list[str] = []
    for item in m.group(1).split(","):
        lo, sep, hi = item.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad range {item!r} in host list entry {name!r}")
        if not sep:
            values = [lo]
        else:
            width = len(lo) if lo.startswith("0") or len(lo) == len(hi) else 0
            values = [str(v).zfill(width) for v in range(int(lo), int(hi) + 1)]
        for value in values:
            out.extend(_expand_one(head + value + tail))
    return out


def _slurm_tasks_on_node(env: Mapping[str, str]) -> Optional[int]:
    """Tasks of this step on this node, from SLURM_STEP_TASKS_PER_NODE ('2(x3),1') and
    SLURM_NODEID."""
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    node = _int(env, "SLURM_NODEID")
    if not spec or node is None:
        return None
    counts: list[int] = []
    for item in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if m is None:
            return None
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts[node] if node < len(counts) else None


def detect(environ: Optional[Mapping[str, str]] = None) -> Optional[Placement]:
    """This process's placement from the launcher's variables; None when none is recognised."""
    env = os.environ if environ is None else environ
    addr = env.get("MASTER_ADDR") or None
    port = _int(env, "MASTER_PORT")
    if "RANK" in env and "WORLD_SIZE" in env:
        size = _int(env, "WORLD_SIZE") or 1
        return Placement("torchrun", _int(env, "RANK") or 0, size, _int(env, "LOCAL_RANK") or 0,
                         _int(env, "LOCAL_WORLD_SIZE") or size, addr, port)
    if "OMPI_COMM_WORLD_RANK" in env and "OMPI_COMM_WORLD_SIZE" in env:
        size = _int(env, "OMPI_COMM_WORLD_SIZE") or 1
        return Placement("openmpi", _int(env, "OMPI_COMM_WORLD_RANK") or 0, size,
                         _int(env, "OMPI_COMM_WORLD_LOCAL_RANK") or 0,
                         _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE") or size, addr, port)
    if "PMI_RANK" in env and "PMI_SIZE" in env:
        size = _int(env, "PMI_SIZE") or 1
        return Placement("pmi", _int(env, "PMI_RANK") or 0, size,
                         _int(env, "MPI_LOCALRANKID", "PMI_LOCAL_RANK") or 0,
                         _int(env, "MPI_LOCALNRANKS", "PMI_LOCAL_SIZE") or size, addr, port)
    if "SLURM_PROCID" in env and ("SLURM_NTASKS" in env or "SLURM_NPROCS" in env):
        size = _int(env, "SLURM_NTASKS", "SLURM_NPROCS") or 1
        if addr is None:
            nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") \
                or env.get("SLURM_NODELIST") or ""
            hosts = expand_hostlist(nodes)
            addr = hosts[0] if hosts else None
        if port is None:
            port = slurm_port(_int(env, "SLURM_JOB_ID", "SLURM_JOBID") or 0,
                              _int(env, "SLURM_STEP_ID", "SLURM_STEPID") or 0)
        local_size = _slurm_tasks_on_node(env) or _int(env, "SLURM_NTASKS_PER_NODE") or size
        return Placement("slurm", _int(env, "SLURM_PROCID") or 0, size,
                         _int(env, "SLURM_LOCALID") or 0, local_size, addr, port)
    return None


def slurm_port(job: int, step: int) -> int:
    """The rendezvous port of a Slurm step, the same on every task, in DERIVED_PORTS: the job
    id modulo 600 and the step id modulo 20 side by side, so steps of jobs less than 600 apart
    never share one (job * 7 + step gave job J step 7 and job J+1 step 0 the same). Steps 600
    jobs apart may: `job_identity` lets the rendezvous refuse a store that belongs to another
    step."""
    return DERIVED_PORTS[0] + (job % 600) * 20 + step % 20


def job_identity(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The job and step this process belongs to, where the launcher says (Slurm): written by
    export() so that it outlives the translation to torchrun's variables."""
    env = os.environ if environ is None else environ
    return env.get("DEAR_LAUNCH_JOB") or None


#: the per-host processes of MPI launchers (MPICH's Hydra, Open MPI's ORTE / PRRTE), or the
#: launcher itself, that every rank on a host descends from (names as /proc shows them)
_MPI_DAEMONS = frozenset({"hydra_pmi_proxy", "orted", "prted", "mpiexec.hydra", "mpiexec",
                          "mpirun", "prterun"})


def mpi_launcher_process(pid: Optional[int] = None) -> Optional[tuple[int, int]]:
    """(pid, start time in clock ticks) of this process's nearest ancestor that is an MPI
    launcher's per-host process, read from /proc; None without /proc or such an ancestor. The
    pair names one launch: a pid alone may be reused by a later one."""
    pid = os.getppid() if pid is None else pid
    for _ in range(32):
        try:
            with open(f"/proc/{pid}/stat") as fh:
                stat = fh.read()
        except OSError:
            return None
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()   # from field 3 (state) on
        if name in _MPI_DAEMONS:
            return pid, int(fields[19])                 # field 22: starttime
        pid = int(fields[1])                            # field 4: ppid
        if pid <= 1:
            return None
    return None


def mpirun_port(launcher: tuple[int, int]) -> int:
    """The rendezvous port of one mpirun launch on one host, in DERIVED_PORTS, the same on
    every rank (they share the launcher's process)."""
    lo, hi = DERIVED_PORTS
    return lo + zlib.crc32(f"{launcher[0]}:{launcher[1]}".encode()) % (hi - lo)


def _agree_on_master(placement: Placement) -> Placement:
    """MASTER_ADDR/MASTER_PORT for an mpirun launch that gave none. Every rank on this host:
    127.0.0.1 and a port derived from the launcher's process, without starting MPI. Across
    hosts: rank 0's address and a port free on it, broadcast through MPI (mpi4py)."""
    if placement.local_size == placement.size:
        launcher = mpi_launcher_process()
        if launcher is not None:
            job = (f"{placement.launcher} launch (launcher process {launcher[0]}, started at "
                   f"tick {launcher[1]})")
            return dataclasses.replace(
                placement, master_addr=placement.master_addr or "127.0.0.1",
                master_port=placement.master_port or mpirun_port(launcher),
                job=None if placement.master_port else job)
    try:
        from mpi4py import MPI
    except ImportError:
        if placement.local_size != placement.size:
            raise RuntimeError(
                f"dear.init(): launched by {placement.launcher} over several hosts without "
                "MASTER_ADDR/MASTER_PORT and without mpi4py to agree on them: export "
                "MASTER_ADDR=<first host> MASTER_PORT=<free port> to every rank (mpirun -x), "
                "or pip install mpi4py") from None
        return dataclasses.replace(placement, master_addr=placement.master_addr or "127.0.0.1",
                                   master_port=placement.master_port or DEFAULT_PORT)
    comm = MPI.COMM_WORLD
    if comm.Get_size() != placement.size:
        raise RuntimeError(f"mpi4py sees {comm.Get_size()} ranks but {placement.launcher}'s "
                           f"variables say {placement.size}: is mpi4py built for this MPI?")
    host = socket.gethostname()
    hosts = comm.allgather(host)
    proposal = None
    if comm.Get_rank() == 0:
        addr = placement.master_addr
        if addr is None:
            addr = "127.0.0.1" if all(h == host for h in hosts) else _address_of(host)
        port = placement.master_port or _free_port()
        proposal = (addr, port)
    addr, port = comm.bcast(proposal, root=0)
    return dataclasses.replace(placement, master_addr=addr, master_port=port)


def _address_of(host: str) -> str:
    try:
        return socket.gethostbyname(host)
    except OSError:
        return host


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def export(placement: Placement, environ: Optional[MutableMapping[str, str]] = None) -> Placement:
    """Write the placement as torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK,
    LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), agreeing on the master through MPI where the
    launcher gave none; variables already set are kept. Returns the completed placement."""
    env = os.environ if environ is None else environ
    if placement.launcher in ("openmpi", "pmi") and (placement.master_addr is None
                                                     or placement.master_port is None):
        placement = _agree_on_master(placement)
    if placement.master_addr is None:
        raise RuntimeError(f"dear.init(): no master address for the {placement.launcher} "
                           "launch: set MASTER_ADDR (and MASTER_PORT)")
    values = {"RANK": placement.rank, "WORLD_SIZE": placement.size,
              "LOCAL_RANK": placement.local_rank, "LOCAL_WORLD_SIZE": placement.local_size,
              "MASTER_ADDR": placement.master_addr,
              "MASTER_PORT": placement.master_port or DEFAULT_PORT}
    for name, value in values.items():
        env.setdefault(name, str(value))
    if placement.job is not None:
        env.setdefault("DEAR_LAUNCH_JOB", placement.job)
    if placement.launcher == "slurm":
        env.setdefault("DEAR_LAUNCH_JOB", "Slurm job {} step {}".format(
            env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID") or "?",
            env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID") or "?"))
    return placement


def setup_env(environ: Optional[MutableMapping[str, str]] = None) -> Optional[Placement]:
    """detect() then export(): after it, torch.distributed's env:// rendezvous works under srun
    and mpirun as under torchrun. None (nothing written) when no launcher is recognised."""
    placement = detect(environ)
    if placement is None or placement.launcher == "torchrun":
        return placement
    return export(placement, environ)


def launched(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether torchrun's variables describe a job (set by torchrun, or by setup_env)."""
    env = os.environ if environ is None else environ
    return "WORLD_SIZE" in env


def under_horovodrun(environ: Optional[Mapping[str, str]] = None) -> bool:
    env = os.environ if environ is None else environ
    return "HOROVOD_RANK" in env


def host_name(environ: Optional[Mapping[str, str]] = None) -> str:
    """This process's host as the launcher names it (horovodrun's HOROVOD_HOSTNAME: two names
    of one machine are two hosts to it), else the machine's name."""
    env = os.environ if environ is None else environ
    return env.get("HOROVOD_HOSTNAME") or socket.gethostname()


#: seconds Horovod's own Gloo waits may take beyond DEAR_TIMEOUT: dear raises first (DEAR_TIMEOUT
#: plus its hang report), and Horovod's background thread, stuck on a frozen peer, lets the
#: process end soon after (it ends only when that wait times out: 30 s by default)
HOROVOD_GLOO_SLACK = 3


#: Horovod's Gloo timeout where HOROVOD_GLOO_TIMEOUT_SECONDS is unset when hvd.init() runs
HOROVOD_GLOO_DEFAULT = 30


def _horovod_started() -> bool:
    """Whether hvd.init() has run in this process (horovod.torch imported and initialised)."""
    hvd = sys.modules.get("horovod.torch")
    try:
        return bool(hvd is not None and hvd.is_initialized())
    except Exception:
        return False


def align_horovod_timeout(timeout: Optional[float] = None,
                          environ: Optional[MutableMapping[str, str]] = None) -> None:
    """Under horovodrun, before hvd.init(): Horovod's Gloo timeout (HOROVOD_GLOO_TIMEOUT_SECONDS,
    unless set) follows DEAR_TIMEOUT (the environment's, or `timeout`), so a rank whose peer
    froze leaves within about DEAR_TIMEOUT + 5 s, not Horovod's 30. Without either, Horovod's
    default stays. After hvd.init() it is too late, and nothing is written: Horovod read the
    variable there, and `horovod_timeout_too_long` says so when dear takes that Horovod."""
    env = os.environ if environ is None else environ
    if not under_horovodrun(env) or "HOROVOD_GLOO_TIMEOUT_SECONDS" in env:
        return
    if environ is None and _horovod_started():
        return
    if timeout is None:
        try:
            timeout = float(env["DEAR_TIMEOUT"])
        except (KeyError, ValueError):
            return
    if timeout > 0 and timeout != float("inf"):
        env["HOROVOD_GLOO_TIMEOUT_SECONDS"] = str(math.ceil(timeout) + HOROVOD_GLOO_SLACK)


def horovod_timeout_too_long(timeout: float,
                             environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """Where Horovod runs on Gloo and was started without HOROVOD_GLOO_TIMEOUT_SECONDS
    (hvd.init() before `import dear`, or DEAR_TIMEOUT given to dear.init() only) while
    `timeout` (DEAR_TIMEOUT) + HOROVOD_GLOO_SLACK is shorter than Horovod's 30 s: what to tell
    the user. Else None."""
    env = os.environ if environ is None else environ
    if "HOROVOD_GLOO_TIMEOUT_SECONDS" in env:
        return None
    wanted = math.ceil(timeout) + HOROVOD_GLOO_SLACK
    if wanted >= HOROVOD_GLOO_DEFAULT:
        return None
    return (f"dear: Horovod was started (hvd.init()) without HOROVOD_GLOO_TIMEOUT_SECONDS, so "
            f"its Gloo waits keep Horovod's {HOROVOD_GLOO_DEFAULT} s timeout: a peer that "
            f"freezes keeps this process alive until those {HOROVOD_GLOO_DEFAULT} s run out, "
            f"not DEAR_TIMEOUT + {HOROVOD_GLOO_SLACK} ({wanted} s). Import dear before hvd.init() "
            f"with DEAR_TIMEOUT in the environment (dear then sets the variable), or set "
            f"HOROVOD_GLOO_TIMEOUT_SECONDS={wanted} before hvd.init()")


def process_env(environ: Optional[Mapping[str, str]] = None) -> Placement:
    """This process's place from torchrun's variables (srun's and mpirun's once setup_env has
    translated them); a world of one where none is set. The one reader of those variables:
    every backend asks here, so none of them can see a world of one under srun."""
    env = os.environ if environ is None else environ
    size = _int(env, "WORLD_SIZE") or 1
    port = _int(env, "MASTER_PORT")
    return Placement(launcher="env", rank=_int(env, "RANK") or 0, size=size,
                     local_rank=_int(env, "LOCAL_RANK") or 0,
                     local_size=_int(env, "LOCAL_WORLD_SIZE") or 1,
                     master_addr=env.get("MASTER_ADDR") or None, master_port=port)


def local_rank_given(environ: Optional[Mapping[str, str]] = None) -> bool:
    env = os.environ if environ is None else environ
    return "LOCAL_RANK" in env


def agent_store(environ: Optional[Mapping[str, str]] = None) -> bool:
    """torchrun's agent holds the rendezvous TCPStore (TORCHELASTIC_USE_AGENT_STORE), not
    rank 0."""
    env = os.environ if environ is None else environ
    return env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"


def gloo_interface(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The network interface Gloo is told to use, if any (GLOO_SOCKET_IFNAME, then
    HOROVOD_GLOO_IFACE, which horovodrun sets; the first of a comma-separated list)."""
    env = os.environ if environ is None else environ
    for var in ("GLOO_SOCKET_IFNAME", "HOROVOD_GLOO_IFACE"):
        value = env.get(var, "").split(",")[0].strip()
        if value:
            return value
    return None


def horovod_hostname(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The host name horovodrun gave this process (HOROVOD_HOSTNAME), if any."""
    env = os.environ if environ is None else environ
    return env.get("HOROVOD_HOSTNAME") or None


def horovod_elastic(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Launched by horovodrun in elastic mode (--min-np/--max-np/--host-discovery-script)."""
    env = os.environ if environ is None else environ
    return env.get("HOROVOD_ELASTIC") == "1"


def torchelastic(environ: Optional[Mapping[str, str]] = None
                 ) -> Optional[tuple[str, int, int]]:
    """(run id, restart count, max restarts) that torchrun's agent gave this worker
    (TORCHELASTIC_*), or None outside torchrun."""
    env = os.environ if environ is None else environ
    run_id = env.get("TORCHELASTIC_RUN_ID")
    if not run_id:
        return None
    return (run_id, int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
            int(env.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0))


__all__ = ["Placement", "agent_store", "detect", "expand_hostlist", "export", "gloo_interface",
           "horovod_elastic", "horovod_hostname", "launched", "local_rank_given",
           "process_env", "setup_env", "torchelastic", "under_horovodrun"]
