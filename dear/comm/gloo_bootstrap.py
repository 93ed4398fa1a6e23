"""A private pair of Gloo process groups, started through another framework's control plane.

The Horovod backend carries its reduce-scatters and all-gathers over Gloo point-to-point messages
(`PairwiseExchange`, torch_dist.py). Those groups must not occupy torch.distributed's default
group, which belongs to the user (benchmarks/train.py, for one, runs DDP on it in the same
processes), so they are bare ProcessGroupGloo backends on a TCPStore of their own, registered
nowhere in torch.distributed: rank 0 opens the store on a free port, tells the others where through
the caller's broadcast_object (Horovod's), and every rank joins both groups.

Where rank 0 can be reached: the IPv4 (else IPv6) address of the interface Gloo is told to use
(GLOO_SOCKET_IFNAME, then HOROVOD_GLOO_IFACE, which horovodrun sets), else HOROVOD_HOSTNAME, else
this host's name, resolved. Both groups bind to that interface (Gloo's default device otherwise).
Under benchmarks/cluster.py every rank sits in its own network namespace with its own veth, named
in both variables. Every rank reports whether it reached the store before anyone waits in Gloo's
rendezvous, so an unreachable address is one clear error on every rank, not a hang.
"""

from __future__ import annotations

import dataclasses
import datetime
import socket
from typing import Any, Callable, Optional

import torch.distributed as dist

from . import launch

_PREFIX = "dear.gloo"


@dataclasses.dataclass
class GlooPair:
    """Two Gloo groups over the same ranks (the exchange's group and its twin) and their store."""

    store: Any
    forward: Any
    reverse: Any
    address: str

    def close(self) -> None:
        """Close both groups' connections (pending messages fail on the peers)."""
        for group in (self.forward, self.reverse):
            try:
                group.shutdown()
            except (AttributeError, RuntimeError):
                pass
        self.forward = self.reverse = self.store = None


def reachable_address(iface: Optional[str]) -> tuple[str, str]:
    """(address other ranks can reach this host at, where it came from)."""
    if iface:
        import psutil  # a dependency of Horovod
        addrs = psutil.net_if_addrs().get(iface)
        if addrs is None:
            raise RuntimeError(f"dear: network interface {iface!r} (GLOO_SOCKET_IFNAME / "
                               "HOROVOD_GLOO_IFACE) does not exist on this host")
        for family in (socket.AF_INET, socket.AF_INET6):
            for addr in addrs:
                if addr.family == family and not addr.address.startswith("fe80"):
                    return addr.address.split("%")[0], f"interface {iface}"
        raise RuntimeError(f"dear: network interface {iface!r} has no IP address")
    host = launch.horovod_hostname() or socket.gethostname()
    try:
        return socket.gethostbyname(host), f"host name {host!r}"
    except OSError as exc:
        raise RuntimeError(f"dear: cannot resolve host name {host!r} to an address other ranks "
                           "can reach; set GLOO_SOCKET_IFNAME to the interface to use") from exc


def _group(store: Any, name: str, rank: int, size: int, iface: Optional[str],
           timeout: datetime.timedelta) -> Any:
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # noqa: SLF001 (torch's Gloo options)
    options._timeout = timeout  # torch's Gloo options  # noqa: SLF001
    options._devices = [dist.ProcessGroupGloo.create_device(interface=iface) if iface  # torch's  # noqa: SLF001
                        else dist.ProcessGroupGloo.create_default_device()]
    return dist.ProcessGroupGloo(dist.PrefixStore(f"{_PREFIX}.{name}", store), rank, size,
                                 options)


def store_listening_on(host: str, size: int, wait: datetime.timedelta) -> Any:
    """Rank 0's TCPStore, listening on `host` only (TCPStore alone listens on every interface,
    beside the launcher's own rendezvous): a socket bound here, handed over as master_listen_fd
    (the store owns the descriptor from then on)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((host, 0))
        sock.listen(max(128, size))
        store = dist.TCPStore(host, sock.getsockname()[1], size, is_master=True, timeout=wait,
                              wait_for_workers=False, master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()                              # the store's now: not closed with the object
    return store


def open_store(rank: int, size: int, broadcast_object: Callable[[Any, int], Any],
               all_gather_object: Callable[[Any], list[Any]], timeout: float,
               host: Optional[str] = None, origin: str = "") -> tuple[Any, Any, list[str]]:
    """Rank 0's TCPStore, listening on `host` only (None: the address `reachable_address`
    finds), joined by every rank through the caller's object collectives: (store, (host, port,
    origin), problems). A collective: every rank calls it once, in the same order. With
    problems, or where None, no rank may use the store."""
    wait = datetime.timedelta(seconds=timeout)
    store, where, problem = None, None, None
    if rank == 0:
        try:
            if host is None:
                host, origin = reachable_address(launch.gloo_interface())
            store = store_listening_on(host, size, wait)
            where = (host, int(store.port), origin)
        except Exception as exc:            # noqa: BLE001 - told to every rank below
            problem = f"rank 0 could not open a rendezvous store: {exc}"
    where = broadcast_object(where, 0)
    if rank != 0 and where is not None:
        try:
            store = dist.TCPStore(where[0], where[1], size, is_master=False, timeout=wait)
        except Exception as exc:            # noqa: BLE001
            problem = (f"rank {rank} could not reach rank 0 at {where[0]}:{where[1]} (from "
                       f"rank 0's {where[2]}): {exc}")
    problems = [p for p in all_gather_object(problem) if p]
    return store, where, problems


def start(rank: int, size: int, broadcast_object: Callable[[Any, int], Any],
          all_gather_object: Callable[[Any], list[Any]], timeout: float) -> GlooPair:
    """Start the pair on every rank (a collective: all ranks call it, in the same order)."""
    wait = datetime.timedelta(seconds=timeout)
    iface = launch.gloo_interface()
    store, where, problems = open_store(rank, size, broadcast_object, all_gather_object, timeout)
    if problems or where is None:
        raise RuntimeError("dear: the Horovod backend's Gloo data plane did not start: "
                           + "; ".join(problems) + ". Set GLOO_SOCKET_IFNAME (every rank) to "
                           "an interface the ranks share, or DEAR_HOROVOD_DATA_PLANE=horovod to "
                           "use Horovod's own collectives")
    forward = _group(store, "forward", rank, size, iface, wait)
    reverse = _group(store, "reverse", rank, size, iface, wait)
    return GlooPair(store, forward, reverse, f"{where[0]}:{where[1]}")
