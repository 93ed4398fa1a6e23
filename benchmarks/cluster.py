"""Emulated cluster: N ranks, each in its own network namespace, behind a shaped switch.

    python -m benchmarks.cluster --nproc 2 --bandwidth 1gbit [--latency 100us] \
        [--no-shaping] [--no-pin] [--horovod] [--timeout S] -- python -m benchmarks.train ...

Why: over loopback, communication looks free. Here every byte between ranks crosses an emulated
network: rank i's namespace holds one end of a veth pair, the other end is on a bridge (the
switch) in a namespace of its own. tbf shapes both ends: the rank end's egress is the host's
upload, the switch end's its download. --latency adds a netem delay on each upload (the one-way
delay between ranks); kernels without netem (the development machines) refuse it clearly.

Shaping defaults, measured (2 ranks via the switch, 1gbit requested, 50 MB per direction, kernel
6.18, BBR; Gbit/s per direction; "both" = both directions at once, one socket each):
    tbf burst 256 KiB, latency 5 ms (the default): one way 0.93-0.95, both 0.86-0.93
    tbf burst 256 KiB, latency 50 ms:              one way 0.92-0.96, both 0.85-0.95
    tbf burst 32 KiB, latency 5 or 50 ms:          one way 0.63-0.78, both 0.40-0.52 (avoid)
    one socket carrying 50 MB each way at once: 0.416-0.44 s (0.91-0.96 each way, full duplex)
    with burst 256 KiB or 1 MiB and latency 1, 5 or 50 ms.
So burst = max(256 KiB, 2 ms at the rate), queue 5 ms (shallow, like a switch port); fq_codel,
sfq and netem do not exist on this kernel, so tbf keeps its own fifo. The 0.42 s vs 0.80 s of a
Gloo isend/irecv exchange is Gloo, not the link: 50 MB each way took 0.41-0.53 or 0.80-0.98 s at
random under every setting when ranks post isend before irecv (likely: the peer's "ready" can
queue behind 50 MB of data on the pair's one TCP connection), 0.418-0.443 s in 10 of 10 with
irecv first. Gloo all_reduce of 100 MB: 0.84-0.87 s (line rate), up to 1.1 s on a busy machine.

TCP congestion control: a new namespace starts with the host's default, on these machines BBR,
whose periodic probing (its RTT probe runs every 10 s per connection) stalls a link for 100-150
ms every few seconds. ResNet-50 x4, 1 Gbit/s, 16 iterations of each of 4 methods
(results/ab_congestion_{system,auto}.md): with BBR 16 of 64 iterations 100-154 ms slower than
their method's fastest (IQR up to 122 ms, DDP included); with reno in the ranks' namespaces 0 of
64 (IQR 3-6 ms), at the same bandwidth (0.95-0.96 Gbit/s measured). A datacenter link has no
such stalls (TCP there is loss-based: cubic, Linux's default, or DCTCP; NCCL over RDMA uses
none), so each rank's namespace runs cubic where the host lets a namespace choose it
(net.ipv4.tcp_allowed_congestion_control), else reno; --congestion names another, and `system`
keeps the host's.

Each namespace is a "host": LOCAL_RANK=0, LOCAL_WORLD_SIZE=1, GLOO_SOCKET_IFNAME=its veth.
--no-shaping runs the same ranks on 127.0.0.1 (one host, LOCAL_RANK=RANK), no root needed.
Names carry the launcher's pid and a random tag; the subnet, a random 10.x.y.0/24, exists only
in this run's namespaces. All is removed on exit, on SIGINT/SIGTERM and when a rank fails (the
others are killed, the exit code is non-zero); after a SIGKILL, `--cleanup` removes leftovers.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Optional

MASTER_PORT, PROBE_PORT = 29500, 5201
PREFIX = "dear-"  # namespaces are PREFIX + tag + "-r<rank>" / "-sw"; tag = pid (6 hex) + 4 hex


def parse_rate(text: str) -> float:
    """tc-style rate ('1gbit', '500mbit', '2.5g', '100mbps' = bytes/s) -> bits/s."""
    m = re.fullmatch(r"([\d.]+(?:e\d+)?)\s*([kmgt]?)(bit|bps)?", text.strip().lower())
    if not m:
        raise ValueError(f"bad rate {text!r}; e.g. 1gbit, 500mbit")
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[m.group(2)]
    return float(m.group(1)) * scale * (8 if m.group(3) == "bps" else 1)


def parse_time(text: str) -> float:
    """tc-style time ('100us', '2ms', '0.5s', '0') -> seconds."""
    m = re.fullmatch(r"([\d.]+)\s*(us|ms|s)?", text.strip().lower())
    if not m:
        raise ValueError(f"bad time {text!r}; e.g. 100us, 2ms")
    return float(m.group(1)) * {"us": 1e-6, "ms": 1e-3, "s": 1.0, None: 1.0}[m.group(2)]


@dataclasses.dataclass(frozen=True)
class Shape:
    """tc settings for one direction of one link (the defaults are justified above)."""

    rate_bps: float
    delay_s: float = 0.0
    burst_bytes: int = 0  # 0: max(256 KiB, 2 ms at the rate)
    queue_s: float = 0.005  # tbf latency: the longest a packet may wait in the shaper

    def commands(self, dev: str) -> list[list[str]]:
        """`tc` argument lists shaping egress of `dev` (run inside its namespace)."""
        cmds = []
        if self.delay_s:
            cmds.append(["qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay",
                         f"{self.delay_s * 1e6:.0f}us", "limit", "100000"])
        return cmds + [self.rate_command(dev, "add")]

    def rate_command(self, dev: str, verb: str = "change") -> list[str]:
        """The tbf qdisc of `dev` (`change`: set a new rate on a running link)."""
        burst = self.burst_bytes or max(256 * 1024, int(self.rate_bps / 8 * 0.002))
        parent = ["parent", "1:1"] if self.delay_s else ["root"]
        return ["qdisc", verb, "dev", dev, *parent, "handle", "10:", "tbf", "rate",
                f"{self.rate_bps:.0f}bit", "burst", str(burst),
                "latency", f"{self.queue_s * 1e3:g}ms"]


class ClusterError(RuntimeError):
    pass


LOSS_BASED = ("cubic", "reno")  # what `auto` picks, in order (why: the module's docstring)
_ALLOWED = "/proc/sys/net/ipv4/tcp_allowed_congestion_control"


def pick_congestion(requested: str = "auto") -> Optional[str]:
    """The TCP congestion control for each rank's namespace, or None to keep the host's.

    A namespace other than the host's may only choose what net.ipv4.tcp_allowed_congestion_control
    lists (the kernel refuses the rest with EPERM)."""
    if requested == "system":
        return None
    try:
        with open(_ALLOWED) as fh:
            allowed = fh.read().split()
    except OSError:
        allowed = []
    if requested == "auto":
        return next((cc for cc in LOSS_BASED if cc in allowed), None)
    if requested not in allowed:
        raise ClusterError(
            f"congestion control {requested!r} cannot be set in a network namespace here: "
            f"net.ipv4.tcp_allowed_congestion_control lists {' '.join(allowed) or 'nothing'}; "
            "add it there (sysctl -w, as root) or choose one of those, or 'system'")
    return requested


def _run(args: list[str]) -> str:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=30)
    if proc.returncode:
        err = proc.stderr.strip()
        if "netem" in args and "unknown" in err:
            err += " (this kernel has no netem: run without --latency)"
        raise ClusterError(f"`{' '.join(args)}` failed: {err}")
    return proc.stdout


def check_can_shape() -> Optional[str]:
    """None if namespaces and tc can be used here, else why not (with the way out)."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        why = f"{' and '.join(missing)} not found (install iproute2)"
    elif os.geteuid() != 0:
        why = "network namespaces and tc need root"
    else:
        return None
    return f"cannot emulate the network: {why}; use --no-shaping to run on loopback unshaped"


# Horovod 0.28's rendezvous server, with its DELETE handler fixed: when the last rank finishes
# one scope (global, local_<host>, cross_<i>) the original clears the finished lists of EVERY
# scope, so a scope still in progress never completes, its keys are never cleared, and the next
# hvd.init() in the same processes reads the last init's addresses: Gloo "connect ...:
# Connection refused". At 8 ranks (1-rank local scopes finish first) the second init failed in
# 3 runs of 3 (hvd.init(), one allreduce, hvd.shutdown(), repeated); with only the completed
# scope cleared, 6 inits in a row succeeded. Tested in tests/test_cluster.py.
_RENDEZVOUS_SERVER = """\
import sys
from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
from horovod.runner.http import http_server as h

class Handler(h.RendezvousHandler):
    def do_DELETE(self):
        paths = self.path.split("/")
        server = self.server
        if len(paths) != 3 or paths[1] not in server.scope_size:
            return super().do_DELETE()
        scope, key = paths[1], paths[2]
        with server.finished_list_lock:
            done = server.finished_list[scope]
            done.append(key)
            if len(done) == server.scope_size[scope]:
                with server.cache_lock:
                    server.cache.get(scope, {}).clear()
                done.clear()
        self.send_status_code(h.OK)

s = h.RendezvousServer()
port = s.start(Handler)
"""


def rendezvous_script(hosts: str, nproc: int) -> str:
    """Python source of Horovod's rendezvous server (fixed, above) for `hosts` ("host:slots,
    ..."): prints its port, serves until its stdin closes."""
    return _RENDEZVOUS_SERVER + (
        f"s.init(get_host_assignments(parse_hosts({hosts!r}), {nproc}))\n"
        "print(port, flush=True)\nsys.stdin.read()\n")


class EmulatedCluster:
    """Namespaces and shaped links for `nproc` ranks; a context manager that removes them all.

    shaping=False gives the same interface on loopback (nothing created, no root needed)."""

    def __init__(self, nproc: int, bandwidth: str | float = "1gbit", latency: str | float = 0,
                 shaping: bool = True, pin: bool = True, horovod: bool = False,
                 shape: Optional[Shape] = None, congestion: str = "auto") -> None:
        if not 1 <= nproc <= 250:
            raise ValueError("nproc must be in 1..250 (one /24 subnet)")
        self.nproc, self.shaping, self.pin, self.horovod = nproc, shaping, pin, horovod
        rate = parse_rate(bandwidth) if isinstance(bandwidth, str) else float(bandwidth)
        delay = parse_time(latency) if isinstance(latency, str) else float(latency)
        self.shape = shape or Shape(rate, delay)
        self.congestion_requested = congestion
        self.congestion: Optional[str] = None  # set by up(): what the ranks' namespaces run
        self.tag = f"{os.getpid():06x}{random.getrandbits(16):04x}"
        self.subnet = f"10.{random.randrange(256)}.{random.randrange(256)}"
        self.namespaces: list[str] = []
        self.measured_bps: Optional[float] = None  # one way, set by measure_bandwidth()
        self.probe_rates: list[float] = []  # per direction, of the last measurement
        self._procs: list[subprocess.Popen] = []

    def ns(self, rank: int) -> str:
        return f"{PREFIX}{self.tag}-r{rank}"

    def ifname(self, rank: int) -> str:
        return f"v{self.tag}r{rank}" if self.shaping else "lo"  # <= 15 characters

    def addr(self, rank: int) -> str:
        return f"{self.subnet}.{rank + 1}" if self.shaping else "127.0.0.1"

    def __enter__(self) -> "EmulatedCluster":
        try:
            self.up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.down()

    def up(self) -> None:
        """Create the switch, and per rank a namespace joined to it by a shaped veth pair."""
        if not self.shaping:
            return
        if why := check_can_shape():
            raise ClusterError(why)
        self.congestion = pick_congestion(self.congestion_requested)
        sw, bridge = f"{PREFIX}{self.tag}-sw", f"b{self.tag}"
        self._add_ns(sw)
        _run(["ip", "-n", sw, "link", "add", bridge, "type", "bridge"])
        _run(["ip", "-n", sw, "link", "set", bridge, "up"])
        download = dataclasses.replace(self.shape, delay_s=0.0)
        for rank in range(self.nproc):
            ns, dev, port = self.ns(rank), self.ifname(rank), f"v{self.tag}s{rank}"
            self._add_ns(ns)
            self._write_hosts(rank)
            _run(["ip", "-n", sw, "link", "add", port, "type", "veth", "peer", "name", dev,
                  "netns", ns])
            _run(["ip", "-n", sw, "link", "set", port, "master", bridge, "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{self.addr(rank)}/24", "dev", dev])
            _run(["ip", "-n", ns, "link", "set", dev, "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            if self.congestion:
                _run(["ip", "netns", "exec", ns, "sh", "-c", "echo " + self.congestion
                      + " > /proc/sys/net/ipv4/tcp_congestion_control"])
            for cmd in self.shape.commands(dev):
                _run(["ip", "netns", "exec", ns, "tc", *cmd])
            for cmd in download.commands(port):
                _run(["ip", "netns", "exec", sw, "tc", *cmd])

    def _add_ns(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self.namespaces.append(name)

    def _write_hosts(self, rank: int) -> None:
        """/etc/hosts inside rank's namespace (`ip netns exec` mounts /etc/netns/NS/hosts): the
        hostname is the rank's address, as Horovod 0.28's process sets bind to the hostname."""
        os.makedirs(f"/etc/netns/{self.ns(rank)}", exist_ok=True)
        lines = ["127.0.0.1 localhost"] + [
            f"{self.addr(i)} rank{i}" + (f" {socket.gethostname()}" if i == rank else "")
            for i in range(self.nproc)]
        with open(f"/etc/netns/{self.ns(rank)}/hosts", "w") as f:
            f.write("\n".join(lines) + "\n")

    def down(self) -> None:
        """Kill what this run started, then delete its namespaces (and so its links)."""
        main_thread = threading.current_thread() is threading.main_thread()
        sigs = (signal.SIGINT, signal.SIGTERM)  # ignored meanwhile: a 2nd Ctrl-C leaves nothing
        old = [signal.signal(s, signal.SIG_IGN) for s in sigs] if main_thread else []
        try:
            while self._procs:
                _kill_group(self._procs.pop())
            while self.namespaces:
                _delete_ns(self.namespaces.pop())
        finally:
            for sig, handler in zip(sigs, old):
                signal.signal(sig, handler)

    def _popen(self, rank: int, cmd: list[str], **kwargs: Any) -> subprocess.Popen:
        """Start `cmd` in rank's namespace, in a process group of its own (killed at down())."""
        prefix = ["ip", "netns", "exec", self.ns(rank)] if self.shaping else []
        proc = subprocess.Popen(prefix + cmd, start_new_session=True, **kwargs)
        self._procs.append(proc)
        return proc

    def _finish(self, proc: subprocess.Popen, timeout: float) -> str:
        try:
            out, _ = proc.communicate(timeout=timeout)
        finally:
            _kill_group(proc)
            self._procs.remove(proc)
        if proc.returncode:
            raise ClusterError(f"`{' '.join(map(str, proc.args))}` exited {proc.returncode}")
        return out

    def measure_bandwidth(self, nbytes: int = 0, both_ways: bool = False,
                          timeout: float = 10.0) -> float:
        """Bits/s of a TCP transfer (default: 0.3 s at the requested rate, 1-50 MB) from rank 1
        to rank 0; with both_ways at the same time as one from 0 to 1, the slower returned."""
        if self.nproc < 2:
            raise ClusterError("measuring a link needs 2 ranks")
        nbytes = nbytes or int(min(max(self.shape.rate_bps / 8 * 0.3, 1e6), 50e6))
        probe = [sys.executable, os.path.abspath(__file__), "_probe"]
        pairs = [(1, 0), (0, 1)] if both_ways else [(1, 0)]
        servers = [self._popen(dst, probe + ["recv", self.addr(dst), str(PROBE_PORT + i),
                                             str(timeout)], stdout=subprocess.PIPE, text=True)
                   for i, (_, dst) in enumerate(pairs)]
        for server in servers:  # each prints "listening" once it is
            server.stdout.readline()  # type: ignore[union-attr]
        senders = [self._popen(src, probe + ["send", self.addr(dst), str(PROBE_PORT + i),
                                             str(nbytes), str(timeout)],
                               stdout=subprocess.PIPE, text=True)
                   for i, (src, dst) in enumerate(pairs)]
        results = [json.loads(self._finish(p, timeout + 5)) for p in senders]
        for server in servers:
            self._finish(server, 5)
        self.probe_rates = [r["bytes"] * 8 / r["seconds"] for r in results]
        if not both_ways:
            self.measured_bps = self.probe_rates[0]
        return min(self.probe_rates)

    def env(self, rank: int, port: int, horovod_port: Optional[int] = None) -> dict[str, str]:
        """What torch.distributed and Gloo (and Horovod, given its rendezvous port) need on
        `rank`. HOROVOD_* only with Horovod's server: HOROVOD_RANK alone makes hvd.init() (and
        dear.init()'s auto backend) wait for a rendezvous that never comes."""
        n, hosts = self.nproc, self.shaping
        local, local_size = (0, 1) if hosts else (rank, n)
        env = {"MASTER_ADDR": self.addr(0), "MASTER_PORT": str(port), "RANK": str(rank),
               "WORLD_SIZE": str(n), "LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": str(local_size),
               "GLOO_SOCKET_IFNAME": self.ifname(rank)}
        if horovod_port:
            env.update(HOROVOD_RANK=str(rank), HOROVOD_SIZE=str(n),
                       HOROVOD_LOCAL_RANK=str(local), HOROVOD_LOCAL_SIZE=str(local_size),
                       HOROVOD_CROSS_RANK=str(rank - local),
                       HOROVOD_CROSS_SIZE=str(n // local_size),
                       HOROVOD_CONTROLLER="gloo", HOROVOD_CPU_OPERATIONS="gloo",
                       HOROVOD_GLOO_IFACE=self.ifname(rank), HOROVOD_HOSTNAME=self._host(rank),
                       HOROVOD_GLOO_RENDEZVOUS_ADDR=self.addr(0),
                       HOROVOD_GLOO_RENDEZVOUS_PORT=str(horovod_port))
        if self.shaping:
            env["BENCH_CLUSTER_BANDWIDTH_REQUESTED"] = f"{self.shape.rate_bps:.0f}"
            env["BENCH_CLUSTER_LINKS"] = ";".join(
                f"{ns},{dev},{delay:g}" for ns, dev, delay in self.links())
            env["BENCH_CLUSTER_CONGESTION"] = self.congestion or "system"
        if self.measured_bps:
            env["BENCH_CLUSTER_BANDWIDTH_MEASURED"] = f"{self.measured_bps:.0f}"
        if self.pin:
            env["OMP_NUM_THREADS"] = "1"
        return env

    def links(self) -> list[tuple[str, str, float]]:
        """(namespace, device, netem delay) of every shaped egress: ranks' uploads, then the
        switch ports (downloads)."""
        sw = f"{PREFIX}{self.tag}-sw"
        return ([(self.ns(r), self.ifname(r), self.shape.delay_s) for r in range(self.nproc)]
                + [(sw, f"v{self.tag}s{r}", 0.0) for r in range(self.nproc)])

    def _host(self, rank: int) -> str:
        return f"rank{rank}" if self.shaping else "localhost"

    def _start_horovod_rendezvous(self) -> int:
        """Horovod's RendezvousServer, in rank 0's namespace (the ranks reach only those)."""
        try:
            import horovod  # noqa: F401
        except ImportError as exc:
            raise ClusterError("--horovod needs Horovod installed (see README)") from exc
        hosts = (",".join(f"rank{r}:1" for r in range(self.nproc)) if self.shaping
                 else f"localhost:{self.nproc}")
        proc = self._popen(0, [sys.executable, "-c", rendezvous_script(hosts, self.nproc)],
                           stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True)
        line = proc.stdout.readline().strip()  # type: ignore[union-attr]
        if not line.isdigit():
            raise ClusterError("the Horovod rendezvous server did not start")
        return int(line)

    def run(self, cmd: list[str], timeout: Optional[float] = None) -> int:
        """Run `cmd` as every rank: 0 if all succeed, else the first failure's exit code (124 on
        timeout), after killing the ranks still running."""
        hvd_port = self._start_horovod_rendezvous() if self.horovod else None
        port = MASTER_PORT if self.shaping else _free_port()
        cores = sorted(os.sched_getaffinity(0))
        ranks = []
        for rank in range(self.nproc):
            pin = ["taskset", "-c", str(cores[rank % len(cores)])] if self.pin else []
            env = {**os.environ, **self.env(rank, port, hvd_port)}
            ranks.append(self._popen(rank, pin + list(cmd), env=env))
        deadline = time.monotonic() + timeout if timeout else float("inf")
        try:
            while True:
                codes = [p.poll() for p in ranks]
                bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
                if bad:
                    print(f"cluster: rank {bad[0][0]} exited with {bad[0][1]}; killing the rest",
                          file=sys.stderr, flush=True)
                    return bad[0][1] if bad[0][1] > 0 else 128 - bad[0][1]
                if all(c == 0 for c in codes):
                    return 0
                if time.monotonic() > deadline:
                    print(f"cluster: ranks still running after {timeout} s; killing them",
                          file=sys.stderr, flush=True)
                    return 124
                time.sleep(0.05)
        finally:
            for proc in ranks:
                _kill_group(proc)
                self._procs.remove(proc)


def set_bandwidth(rate: str | float) -> None:
    """From inside a run (any rank, root): give every link of this cluster a new rate, both
    directions, as --bandwidth would have. Lets one run measure several bandwidths in
    interleaved rounds, so the machine's drift hits every bandwidth alike."""
    links = os.environ.get("BENCH_CLUSTER_LINKS")
    if not links:
        raise ClusterError("set_bandwidth() works only inside a shaped benchmarks.cluster run "
                           "(BENCH_CLUSTER_LINKS is not set)")
    bps = parse_rate(rate) if isinstance(rate, str) else float(rate)
    for link in links.split(";"):
        ns, dev, delay = link.split(",")
        _run(["ip", "netns", "exec", ns, "tc",
              *Shape(bps, float(delay)).rate_command(dev)])


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM the process group, SIGKILL it after 3 s (and whatever is left in it), reap."""
    for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            break
        try:
            proc.wait(wait)
            if sig == signal.SIGTERM:  # the leader is gone; its children may not be
                os.killpg(proc.pid, signal.SIGKILL)
            break
        except (subprocess.TimeoutExpired, ProcessLookupError, PermissionError):
            continue
    proc.wait()


def _delete_ns(name: str) -> None:
    subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
    shutil.rmtree(f"/etc/netns/{name}", ignore_errors=True)
    try:
        os.rmdir("/etc/netns")  # only if empty (other runs may use it)
    except OSError:
        pass


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def cleanup_stale() -> list[str]:
    """Delete namespaces (killing what runs in them) of launchers that no longer exist."""
    names = [line.split()[0] for line in _run(["ip", "netns", "list"]).splitlines() if line]
    removed = []
    for name in (n for n in names if re.fullmatch(PREFIX + r"[0-9a-f]{10}-(sw|r\d+)", n)):
        if not os.path.exists(f"/proc/{int(name[len(PREFIX):len(PREFIX) + 6], 16)}"):
            for pid in _run(["ip", "netns", "pids", name]).split():
                os.kill(int(pid), signal.SIGKILL)
            _delete_ns(name)
            removed.append(name)
    return removed


def _probe(argv: list[str]) -> None:
    """`recv ADDR PORT TIMEOUT` or `send ADDR PORT NBYTES TIMEOUT`, run inside a namespace."""
    if argv[0] == "recv":
        with socket.create_server((argv[1], int(argv[2]))) as server:
            server.settimeout(float(argv[3]))
            print("listening", flush=True)
            conn, _ = server.accept()
            with conn:  # read to the end, then close: the sender's clock stops
                conn.settimeout(float(argv[3]))
                while conn.recv(1 << 20):
                    pass
        return
    nbytes, timeout = int(argv[3]), float(argv[4])
    payload, sent, start = memoryview(bytearray(1 << 20)), 0, time.perf_counter()
    with socket.create_connection((argv[1], int(argv[2])), timeout=timeout) as conn:
        while sent < nbytes and time.perf_counter() - start < timeout:
            sent += conn.send(payload[:nbytes - sent])
        conn.shutdown(socket.SHUT_WR)
        conn.recv(1)  # b"" once the receiver has read everything and closed
    print(json.dumps({"bytes": sent, "seconds": time.perf_counter() - start}))


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_probe"]:
        _probe(argv[1:])
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                usage="%(prog)s [options] -- command ...")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--bandwidth", default="1gbit", help="per host and direction (tc units)")
    p.add_argument("--latency", default="0", help="one-way delay, e.g. 100us (needs netem)")
    p.add_argument("--no-shaping", action="store_true", help="loopback, no namespaces, no root")
    p.add_argument("--no-pin", action="store_true", help="do not pin rank i to core i")
    p.add_argument("--horovod", action="store_true", help="run a Horovod rendezvous server")
    p.add_argument("--no-measure", action="store_true", help="skip the link measurement")
    p.add_argument("--congestion", default="auto",
                   help="TCP congestion control in the ranks' namespaces: auto (cubic, else "
                        "reno), a name, or system (the host's default)")
    p.add_argument("--timeout", type=float, default=0, help="kill the ranks after S seconds")
    p.add_argument("--cleanup", action="store_true", help="remove leftovers of dead launchers")
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not args.no_shaping and (why := check_can_shape()):
        print(f"error: {why}", file=sys.stderr)
        return 2
    if args.cleanup:
        print("\n".join(f"removed {name}" for name in cleanup_stale()) or "nothing to remove")
        return 0
    if not cmd:
        p.error("no command given (put it after --)")
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # clean up as on Ctrl-C
    # Also where SIGINT came in ignored (a script's background job: bash ignores it there, and
    # Python then installs no handler): `kill -INT` must still remove what this run made.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with EmulatedCluster(args.nproc, args.bandwidth, args.latency, not args.no_shaping,
                             not args.no_pin, args.horovod,
                             congestion=args.congestion) as cluster:
            if cluster.shaping and args.nproc >= 2 and not args.no_measure:
                one_way, both = cluster.measure_bandwidth(), cluster.measure_bandwidth(
                    both_ways=True)
                print(f"cluster: {args.nproc} ranks, TCP congestion control "
                      f"{cluster.congestion or 'system'}; bandwidth requested "
                      f"{cluster.shape.rate_bps / 1e9:.3g} Gbit/s, measured (TCP) "
                      f"{one_way / 1e9:.3g} one way, {both / 1e9:.3g} both ways at once",
                      file=sys.stderr, flush=True)
            return cluster.run(cmd, timeout=args.timeout or None)
    except KeyboardInterrupt:
        print("cluster: interrupted; ranks killed, namespaces removed", file=sys.stderr)
        return 130
    except ClusterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
