"""The emulated-cluster launcher: set-up, the environment each rank sees, clean-up after normal
runs, crashes and signals, the loopback path, and the measured bandwidth.

Every test has a hard timeout; the `owned` fixture removes (and fails on) any namespace left by a
launcher this test started, so nothing is left behind even when a test fails."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from benchmarks import cluster
from benchmarks.cluster import EmulatedCluster

ROOT = Path(__file__).resolve().parent.parent
WHY_NOT = cluster.check_can_shape()
Launchers = list[subprocess.Popen]
needs_root = pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")
pytestmark = pytest.mark.timeout(60)  # tests that need less say so

RANK_SCRIPT = """
import json, os, socket, sys
from datetime import timedelta
import torch, torch.distributed as dist
info = {k: v for k, v in os.environ.items()
        if k.startswith(("HOROVOD_", "BENCH_", "MASTER_", "LOCAL_", "GLOO_", "OMP_"))
        or k in ("RANK", "WORLD_SIZE")}
info["affinity"] = sorted(os.sched_getaffinity(0))
info["ifaces"] = sorted(name for _, name in socket.if_nameindex())
with open("/proc/sys/net/ipv4/tcp_congestion_control") as f:
    info["congestion"] = f.read().strip()
dist.init_process_group("gloo", timeout=timedelta(seconds=20))
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
info["sum"] = t.item()
dist.destroy_process_group()
with open(os.path.join(sys.argv[1], "rank%s.json" % os.environ["RANK"]), "w") as f:
    json.dump(info, f)
"""
# sh -c SLEEPER DIR CRASHING_RANK: write the pid, then rank CRASHING_RANK exits 3, others sleep.
SLEEPER = 'echo $$ > "$0/pid$RANK"; [ "$RANK" = "$1" ] && { sleep 0.3; exit 3; }; exec sleep 60'


def leftovers(pid: int) -> list[str]:
    """Namespaces, their /etc/netns files, and links here, made by a launcher with this pid."""
    tag = f"{pid:06x}"
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    etc = os.listdir("/etc/netns") if os.path.isdir("/etc/netns") else []
    return ([line.split()[0] for line in ns.splitlines() if line.startswith(f"dear-{tag}")]
            + [f"/etc/netns/{name}" for name in etc if name.startswith(f"dear-{tag}")]
            + [line.split(":")[1].strip() for line in links.splitlines()
               if f"v{tag}" in line or f"b{tag}" in line])


@pytest.fixture
def owned() -> Iterator[Launchers]:
    """Launchers started by the test: stopped if still running; what they (or this process)
    left behind is removed, and fails the test."""
    launchers: list[subprocess.Popen] = []
    yield launchers
    for proc in launchers:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    if WHY_NOT is not None:
        return
    left = [name for pid in [os.getpid()] + [p.pid for p in launchers] for name in leftovers(pid)]
    for name in left:
        if name.startswith("dear-"):
            for pid in subprocess.run(["ip", "netns", "pids", name], capture_output=True,
                                      text=True).stdout.split():
                os.kill(int(pid), signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        shutil.rmtree(name, ignore_errors=True) if name.startswith("/etc/netns/") else None
    assert not left, f"left behind: {left}"


def launch(args: list[str], owned: Launchers, env: dict[str, str] | None = None
           ) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.cluster", *args], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    owned.append(proc)
    return proc


def finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str]:
    """Exit code and output; past the timeout, SIGTERM (the launcher cleans up), then SIGKILL."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # `owned` then removes what it left
        out, _ = proc.communicate()
        raise AssertionError(f"launcher did not finish within {timeout} s:\n{out}")
    return proc.returncode, out


def wait_for(paths: list[Path], timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() and p.read_text().strip() for p in paths):
        assert time.monotonic() < deadline, f"ranks did not start: {paths}"
        time.sleep(0.05)


def alive(pid: str) -> bool:
    """Running (a zombie awaiting its reaper counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def assert_dead(pid_files: list[Path], timeout: float = 5) -> None:
    deadline = time.monotonic() + timeout
    for path in pid_files:
        while alive(path.read_text().strip()):
            assert time.monotonic() < deadline, f"{path.name} still alive"
            time.sleep(0.05)


# ------------------------------------------------------------------ no root needed


def test_parsing_and_tc_commands() -> None:
    assert cluster.parse_rate("1gbit") == 1e9 and cluster.parse_rate("500mbit") == 5e8
    assert cluster.parse_rate("100mbps") == 8e8
    assert cluster.parse_time("100us") == pytest.approx(1e-4)
    with pytest.raises(ValueError):
        cluster.parse_rate("fast")
    cmds = cluster.Shape(1e9, delay_s=1e-3).commands("eth9")
    assert "netem" in cmds[0] and "delay" in cmds[0]
    assert cmds[1][cmds[1].index("burst") + 1] == str(256 * 1024) and "parent" in cmds[1]
    c = EmulatedCluster(250)
    assert max(len(c.ifname(249)), len(f"v{c.tag}s249"), len(f"b{c.tag}")) <= 15


def test_congestion_control_is_loss_based_where_a_namespace_may_choose_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    allowed = tmp_path / "allowed"
    monkeypatch.setattr(cluster, "_ALLOWED", str(allowed))
    for listed, auto in (("reno cubic bbr", "cubic"), ("reno bbr", "reno"), ("bbr", None)):
        allowed.write_text(listed + "\n")
        assert cluster.pick_congestion("auto") == auto, listed
        assert cluster.pick_congestion("system") is None
        assert cluster.pick_congestion("bbr") == "bbr"
    with pytest.raises(cluster.ClusterError,
                       match="net.ipv4.tcp_allowed_congestion_control lists bbr;.*'system'"):
        cluster.pick_congestion("cubic")
    monkeypatch.setattr(cluster, "_ALLOWED", str(tmp_path / "missing"))
    assert cluster.pick_congestion("auto") is None


def test_clear_message_without_root_or_tools(monkeypatch: pytest.MonkeyPatch,
                                             owned: Launchers) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "--no-shaping" in (cluster.check_can_shape() or "")
    monkeypatch.setattr(cluster.shutil, "which", lambda tool: None)
    assert "not found" in (cluster.check_can_shape() or "")
    code, out = finish(launch(["--", "true"], owned, env={"PATH": "/nonexistent"}), 30)
    assert code == 2 and "--no-shaping" in out, out


def test_no_shaping_runs_ranks_on_loopback(tmp_path: Path, owned: Launchers) -> None:
    code, out = finish(launch(["--nproc", "2", "--no-shaping", "--", sys.executable, "-c",
                               RANK_SCRIPT, str(tmp_path)], owned), 50)
    assert code == 0, out
    for rank in range(2):
        info = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert info["MASTER_ADDR"] == "127.0.0.1" and info["GLOO_SOCKET_IFNAME"] == "lo"
        assert info["LOCAL_RANK"] == str(rank) and info["LOCAL_WORLD_SIZE"] == "2"
        assert not any(k.startswith("HOROVOD_") for k in info), "only with --horovod"
        assert "BENCH_CLUSTER_BANDWIDTH_MEASURED" not in info and info["sum"] == 3.0


@pytest.mark.timeout(30)
def test_timeout_and_failure_exit_codes_on_loopback() -> None:
    c = EmulatedCluster(2, shaping=False, pin=False)
    assert c.run(["sleep", "30"], timeout=1) == 124
    assert c.run(["sh", "-c", 'exit $((RANK + 4))']) in (4, 5)


# ------------------------------------------------------------------ root: namespaces and tc


@pytest.mark.root
@needs_root
def test_ranks_see_their_host_and_everything_is_removed(tmp_path: Path, owned: Launchers) -> None:
    proc = launch(["--nproc", "2", "--bandwidth", "1gbit", "--", sys.executable, "-c",
                   RANK_SCRIPT, str(tmp_path)], owned)
    code, out = finish(proc, 50)
    assert code == 0, out
    assert "requested 1 Gbit/s, measured" in out, out
    infos = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    expected_cc = cluster.pick_congestion("auto")
    if expected_cc is None:  # no loss-based one allowed here: the host's default stays
        expected_cc = Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()
        assert infos[0]["BENCH_CLUSTER_CONGESTION"] == "system"
        infos = [dict(info, BENCH_CLUSTER_CONGESTION=expected_cc) for info in infos]
    assert f"TCP congestion control {infos[0]['BENCH_CLUSTER_CONGESTION']}" in out, out
    master = infos[0]["MASTER_ADDR"]
    assert master.startswith("10.") and master.endswith(".1")
    for rank, info in enumerate(infos):
        dev = info["GLOO_SOCKET_IFNAME"]
        assert info["ifaces"] == sorted(["lo", dev]), "a rank sees only its own veth"
        assert dev.startswith(f"v{proc.pid:06x}") and len(dev) <= 15
        assert info["MASTER_ADDR"] == master and info["MASTER_PORT"].isdigit()
        assert (info["RANK"], info["WORLD_SIZE"]) == (str(rank), "2")
        assert (info["LOCAL_RANK"], info["LOCAL_WORLD_SIZE"]) == ("0", "1")
        assert not any(k.startswith("HOROVOD_") for k in info), "only with --horovod"
        assert 0 < float(info["BENCH_CLUSTER_BANDWIDTH_MEASURED"]) < 1.05e9
        assert info["OMP_NUM_THREADS"] == "1" and len(info["affinity"]) == 1
        assert info["sum"] == 3.0  # Gloo all_reduce across the two namespaces
        assert info["congestion"] == info["BENCH_CLUSTER_CONGESTION"] == expected_cc
    if len(os.sched_getaffinity(0)) > 1:
        assert infos[0]["affinity"] != infos[1]["affinity"]
    assert leftovers(proc.pid) == []


@pytest.mark.root
@needs_root
@pytest.mark.timeout(30)
def test_a_crashing_rank_ends_the_run_and_everything_is_removed(tmp_path: Path,
                                                                owned: Launchers) -> None:
    proc = launch(["--nproc", "2", "--no-measure", "--", "sh", "-c", SLEEPER, str(tmp_path),
                   "1"], owned)
    start = time.monotonic()
    code, out = finish(proc, 25)
    assert code == 3 and "rank 1 exited with 3" in out, out
    assert time.monotonic() - start < 15, "rank 0 (sleep 60) was not killed promptly"
    assert_dead([tmp_path / "pid0", tmp_path / "pid1"])
    assert leftovers(proc.pid) == []


@pytest.mark.root
@needs_root
@pytest.mark.timeout(30)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_kills_the_ranks_and_everything_is_removed(tmp_path: Path, owned: Launchers,
                                                            sig: signal.Signals) -> None:
    proc = launch(["--nproc", "3", "--no-measure", "--", "sh", "-c", SLEEPER, str(tmp_path),
                   "none"], owned)
    pid_files = [tmp_path / f"pid{r}" for r in range(3)]
    wait_for(pid_files)
    assert len([n for n in leftovers(proc.pid) if n.startswith("dear-")]) == 4  # 3 + switch
    proc.send_signal(sig)
    code, out = finish(proc, 20)
    assert code == 130 and "interrupted" in out, out
    assert_dead(pid_files)
    assert leftovers(proc.pid) == []


def shaped_rates(links: str) -> list[float]:
    """The tbf rate tc reports on each link named in BENCH_CLUSTER_LINKS (bits/s)."""
    rates = []
    for link in links.split(";"):
        ns, dev, _ = link.split(",")
        shown = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "show", "dev", dev],
                               capture_output=True, text=True, check=True).stdout
        rates += [cluster.parse_rate(r) for r in re.findall(r"tbf .*?rate (\S+)", shown)]
    return rates


@pytest.mark.root
@needs_root
@pytest.mark.timeout(30)
def test_measured_bandwidth_follows_the_requested_rate(owned: Launchers) -> None:
    # A shaper caps what goes through; a busy machine only lowers it. So the measured rate
    # has an upper bound (rate + tbf's burst over the 0.3 s transfer), and the rate itself is
    # read back from tc, not inferred from a lower bound that load can break.
    with EmulatedCluster(2, "500mbit") as c:
        assert shaped_rates(c.env(0, 1)["BENCH_CLUSTER_LINKS"]) == [500e6] * 4
        one_way = c.measure_bandwidth()
        both = c.measure_bandwidth(both_ways=True)
        assert 0 < one_way < 0.52e9, one_way
        assert len(c.probe_rates) == 2 and 0 < both < 0.52e9, c.probe_rates
        assert c.env(0, 1)["BENCH_CLUSTER_BANDWIDTH_MEASURED"] == f"{one_way:.0f}"
    assert leftovers(os.getpid()) == []


@pytest.mark.root
@needs_root
def test_set_bandwidth_changes_every_link_of_a_running_cluster(owned: Launchers,
                                                               monkeypatch) -> None:
    with EmulatedCluster(2, "1gbit") as c:
        links = c.env(0, 1)["BENCH_CLUSTER_LINKS"]
        assert shaped_rates(links) == [1e9] * 4
        # What a rank sees: the run's links in its environment.
        monkeypatch.setenv("BENCH_CLUSTER_LINKS", links)
        cluster.set_bandwidth("300mbit")
        assert shaped_rates(links) == [300e6] * 4
        after = c.measure_bandwidth(both_ways=True)  # the new cap holds (see above)
        assert 0 < after < 0.32e9, after
    monkeypatch.delenv("BENCH_CLUSTER_LINKS")
    with pytest.raises(cluster.ClusterError, match="BENCH_CLUSTER_LINKS"):
        cluster.set_bandwidth("1gbit")
    assert leftovers(os.getpid()) == []


@pytest.mark.root
@needs_root
@pytest.mark.timeout(30)
def test_two_runs_at_once_do_not_collide(owned: Launchers) -> None:
    with EmulatedCluster(2) as a, EmulatedCluster(2) as b:
        assert a.tag != b.tag and not set(a.namespaces) & set(b.namespaces)
        assert len([n for n in leftovers(os.getpid()) if n.startswith("dear-")]) == 6
        assert a.run(["true"]) == 0 and b.run(["true"]) == 0
    assert leftovers(os.getpid()) == []


@pytest.mark.root
@needs_root
@pytest.mark.timeout(30)
def test_latency_needs_netem(owned: Launchers) -> None:
    try:
        with EmulatedCluster(2, "1gbit", latency="2ms") as c:
            qdiscs = subprocess.run(["ip", "netns", "exec", c.ns(0), "tc", "qdisc", "show"],
                                    capture_output=True, text=True).stdout
            assert "netem" in qdiscs and "delay 2ms" in qdiscs, qdiscs
    except cluster.ClusterError as exc:
        assert "no netem" in str(exc)
        assert leftovers(os.getpid()) == []
        pytest.skip("this kernel has no netem qdisc (--latency is refused, as tested)")


HOROVOD_SCRIPT = """
import json, os, sys
import torch, horovod.torch as hvd
hvd.init()
t = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum)
info = {k: v for k, v in os.environ.items() if k.startswith("HOROVOD_")}
info.update(rank=hvd.rank(), size=hvd.size(), local=hvd.local_rank(), cross=hvd.cross_rank(),
            sum=t.item())
hvd.shutdown()
with open(os.path.join(sys.argv[1], "rank%d.json" % info["rank"]), "w") as f:
    json.dump(info, f)
"""


@pytest.mark.root
@needs_root
def test_horovod_runs_across_the_namespaces(tmp_path: Path, owned: Launchers) -> None:
    pytest.importorskip("horovod.torch", reason="Horovod is not installed")
    proc = launch(["--nproc", "2", "--horovod", "--no-measure", "--timeout", "50", "--",
                   sys.executable, "-c", HOROVOD_SCRIPT, str(tmp_path)], owned)
    code, out = finish(proc, 55)
    assert code == 0, out
    for rank in range(2):
        info = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert (info["rank"], info["size"], info["local"], info["cross"]) == (rank, 2, 0, rank)
        assert info["sum"] == 3.0 and info["HOROVOD_HOSTNAME"] == f"rank{rank}"
        assert info["HOROVOD_GLOO_IFACE"].startswith(f"v{proc.pid:06x}")
        assert info["HOROVOD_GLOO_RENDEZVOUS_ADDR"].startswith("10.")
        assert info["HOROVOD_CONTROLLER"] == info["HOROVOD_CPU_OPERATIONS"] == "gloo"
    assert leftovers(proc.pid) == []


def test_horovod_rendezvous_clears_each_scope_when_its_ranks_finish() -> None:
    """Horovod 0.28's server, when one scope's last rank finishes, clears the finished lists of
    every scope: a scope then in progress keeps its keys, and the next hvd.init() reads stale
    addresses ("Connection refused"; at 8 ranks on every second init). The cluster's server
    must clear the completed scope's keys whatever order the scopes finish in."""
    pytest.importorskip("horovod.torch", reason="Horovod is not installed")
    import urllib.error
    import urllib.request
    server = subprocess.Popen([sys.executable, "-c",
                               cluster.rendezvous_script("rank0:1,rank1:1,rank2:1", 3)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())  # type: ignore[union-attr]

        def call(method: str, path: str, body: bytes = b"") -> int:
            req = urllib.request.Request(f"http://127.0.0.1:{port}/{path}", data=body or None,
                                         method=method)
            try:
                with urllib.request.urlopen(req, timeout=10) as resp:
                    return resp.status
            except urllib.error.HTTPError as err:
                return err.code

        for rank in range(3):                      # what each rank's Gloo store writes
            assert call("PUT", f"global/rank_{rank}", b"address") == 200
        call("DELETE", "global/0")
        call("DELETE", "global/1")
        call("DELETE", "local_rank0/0")            # a 1-rank scope completes in between
        assert call("GET", "global/rank_2") == 200  # global not finished yet: keys kept
        call("DELETE", "global/2")
        assert [call("GET", f"global/rank_{r}") for r in range(3)] == [404] * 3
        # the next init's round: the same scope completes again, and is cleared again
        for rank in range(3):
            call("PUT", f"global/rank_{rank}", b"new address")
        for rank in range(3):
            call("DELETE", f"global/{rank}")
        assert call("GET", "global/rank_0") == 404
    finally:
        server.stdin.close()                       # type: ignore[union-attr]
        server.wait(timeout=10)


@pytest.mark.root
@needs_root
def test_cleanup_removes_what_a_killed_launcher_left(tmp_path: Path, owned: Launchers) -> None:
    proc = launch(["--nproc", "2", "--no-measure", "--", "sh", "-c", SLEEPER, str(tmp_path),
                   "none"], owned)
    pid_files = [tmp_path / f"pid{r}" for r in range(2)]
    wait_for(pid_files)
    proc.kill()  # SIGKILL: no chance to clean up
    proc.wait()
    assert len(leftovers(proc.pid)) == 5  # 2 ranks + switch, 2 hosts files
    code, out = finish(launch(["--cleanup"], owned), 30)
    assert code == 0 and f"removed dear-{proc.pid:06x}" in out, out
    assert_dead(pid_files)
    assert leftovers(proc.pid) == []
