"""When a collective fails: which rank did not issue it, and what every rank last issued.

A collective that times out only says "Operation timed out!" on the ranks that waited; a peer
that died says "Connection closed". Neither names the rank that is missing or what it was doing.
So each rank publishes its flight record (dear/comm/flight.py: counters and recent
collectives) to the rendezvous store from a small thread, out of band, never through the group
that may be stuck: once a second while it issues nothing new, every 10 s while it trains. When
a collective fails, the rank publishes at once and reads every rank's record twice, `grace`
seconds apart: a record whose heartbeat did not move belongs to a rank that died or froze, one
that moved to a rank that is alive but somewhere else. Then it compares sequence numbers: every
rank issues dear's collectives in the same order, so a rank whose last issued number is below
the failed one never issued it, and one that issued it as another kind or size took a
different branch. The text goes into the exception and, with the records, into
`<DEAR_HANG_REPORT>/<store>/rank<r>.json`; `python -m dear.diagnose hang DIR` shows them.

Records travel as JSON (numbers and strings): nothing read from the store is unpickled.
"""

from __future__ import annotations

import datetime
import glob
import json
import os
import tempfile
import threading
import time
from typing import Any, Callable, Optional, Sequence

from . import launch
from .flight import MAIN, FlightChannel, FlightRecord, RecordedCommunicator

_KEY = "dear/flight/rank{}"
#: seconds between two publications of a rank's record (its heartbeat) while it issues nothing
INTERVAL = 1.0
#: while it issues collectives, one publication every EVERY intervals
EVERY = 10
#: collectives of each rank shown in a report
SHOWN = 16


def default_directory() -> str:
    return os.path.join(tempfile.gettempdir(), "dear-hang")


def out_of_band_store(comm: Any) -> Optional[Any]:
    """A new client of the store the ranks met at, with short timeouts, or None: torch's
    default store (torchrun, dear.init), else the backend's own (`rendezvous_store`: the
    Horovod backend's Gloo store, the MPI backend's)."""
    store: Any = None
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            store = dist.distributed_c10d._get_default_store()
    except Exception:                          # noqa: BLE001 - no store: a local report only
        store = None
    if store is None:
        store = comm.rendezvous_store           # Horovod's data plane, MPI: their own
    if store is None:
        return None
    try:
        store = store.clone()                  # its own connection: never blocks the group's
        store.set_timeout(datetime.timedelta(seconds=3))
    except Exception:                          # noqa: BLE001
        return None
    return store


def _where(store: Any) -> str:
    inner = store
    while hasattr(inner, "underlying_store"):
        inner = inner.underlying_store
    host, port = getattr(inner, "host", None), getattr(inner, "port", None)
    return f"{host}_{port}" if host is not None else f"pid{os.getpid()}"


class HangReporter:
    """Publishes this rank's flight record and, on the first failure, writes the report."""

    def __init__(self, comm: RecordedCommunicator, store: Optional[Any], directory: str = "",
                 interval: float = INTERVAL) -> None:
        self._comm = comm
        self._store = store
        self._interval = interval
        self._dir = os.path.join(directory or default_directory(),
                                 _where(store) if store is not None else f"pid{os.getpid()}")
        self._beat = 0
        self._failed: Optional[dict[str, Any]] = None
        self._lock = threading.Lock()          # one publication at a time
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._channels: dict[str, FlightChannel] = {MAIN: comm.channel}
        comm.channel.on_failure = self.report
        if store is not None and comm.size > 1:
            self._thread = threading.Thread(target=self._run, name="dear-flight", daemon=True)
            self._thread.start()

    @property
    def store(self) -> Optional[Any]:
        """The rendezvous store's client with short timeouts (None: the backend has none)."""
        return self._store

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        for name, channel in self._channels.items():   # the others are this reporter's own
            if name != MAIN or channel.on_failure == self.report:
                channel.on_failure = None

    def channel(self, name: str, members: list[int]) -> FlightChannel:
        """The flight record of another stream of collectives (a process group of dear.KFAC's
        own), published with this rank's and reported on the same way when one fails."""
        with self._lock:
            channel = self._channels.get(name)
            if channel is None:
                channel = self._channels[name] = FlightChannel(name, members)
                channel.on_failure = (lambda rec, exc, name=name:
                                      self.report(rec, exc, channel=name))
            return channel

    # -- meeting out of band ---------------------------------------------------------------
    def meet(self, name: str, timeout: float) -> list[int]:
        """Wait until every rank reached the point `name` (the same on every rank), through the
        store, not the data path. Returns [] when all came, else the ranks that went on
        without it: they issued collectives past this rank's count (their published records
        say so within a second of their stopping). TimeoutError after `timeout` otherwise."""
        size, rank = self._comm.size, self._comm.rank
        if self._store is None or size == 1:
            return []
        mine = self._comm.recorder.issued
        key = f"dear/meet/{name}/rank"
        with self._lock:
            self._store.set(f"{key}{rank}", str(mine))
        deadline = time.monotonic() + timeout
        while True:
            # The records are read before the keys are checked: a rank that met and went on
            # set its key before publishing a higher count, so it is seen as come. (Read
            # after, a rank descheduled between the two reads took it for one gone.)
            with self._lock:
                records = self._read() or {}
                came = [r for r in range(size) if self._store.check([f"{key}{r}"])]
            if len(came) == size:
                return []
            gone = [r for r in range(size) if r not in came
                    and records.get(r, {}).get("issued", 0) > mine]
            if gone:
                return gone
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks {[r for r in range(size) if r not in came]} did not "
                                   f"reach {name} within {timeout:g} s")
            time.sleep(0.05)

    # -- publishing --------------------------------------------------------------------------
    def _run(self) -> None:
        """Publish once a second while this rank issues nothing new (stalled, waiting in a
        collective, or between phases), and every EVERY-th second regardless. A store write
        each second while training slowed dear measurably
        (docs/benchmarks.md#the-hang-reports-heartbeat); a report needs beats only from ranks
        that stopped issuing, and a recent record of the others."""
        last: Optional[list[tuple[int, int]]] = None
        wakes = 0
        while not self._stop.wait(self._interval):
            wakes += 1
            now = [(c.recorder.issued, c.recorder.completed)
                   for c in list(self._channels.values())]
            began = any(i for i, _ in now) and not any(i for i, _ in last or [])
            if now == last or began or wakes % EVERY == 0:
                if not self._publish():
                    return                     # the store is gone: nothing left to publish to
            last = now

    def _record(self) -> dict[str, Any]:
        snap = self._comm.recorder.snapshot(SHOWN)
        snap.update(rank=self._comm.rank, beat=self._beat, failed=self._failed,
                    host=os.uname().nodename, pid=os.getpid(), published=time.time(),
                    channels={name: c.recorder.snapshot(SHOWN) for name, c
                              in list(self._channels.items()) if name != MAIN})
        return snap

    def _publish(self) -> bool:
        if self._store is None:
            return False
        with self._lock:
            self._beat += 1
            try:
                self._store.set(_KEY.format(self._comm.rank), json.dumps(self._record()))
            except Exception:                  # noqa: BLE001 - the store's host may be gone
                return False
        return True

    def _read(self) -> Optional[dict[int, dict[str, Any]]]:
        """Every rank's record, or None if the store cannot be reached (its host is gone)."""
        records: dict[int, dict[str, Any]] = {}
        if self._store is None:
            return None
        keys = [_KEY.format(r) for r in range(self._comm.size)]
        try:
            present = [r for r in range(self._comm.size) if self._store.check([keys[r]])]
            values = self._store.multi_get([keys[r] for r in present]) if present else []
        except Exception:                      # noqa: BLE001 - unreachable: said in the report
            return None
        for r, value in zip(present, values):
            try:
                records[r] = json.loads(value)
            except ValueError:
                continue
        return records

    # -- the report --------------------------------------------------------------------------
    def report(self, rec: FlightRecord, exc: BaseException, grace: Optional[float] = None,
               channel: str = MAIN) -> str:
        """Called once per channel, by the first of its collectives that fails on this rank."""
        started = time.monotonic()
        members = self._channels[channel].members
        self._failed = {"seq": rec.seq, "kind": rec.kind, "error": str(exc)[:400],
                        "channel": channel}
        self._stop.set()                       # the thread publishes no more; this does
        self._publish()
        first = self._read()
        grace = 2 * self._interval + 0.2 if grace is None else grace
        second = None if first is None else self._await(
            lambda now: self._settled(first, now), started + grace)
        me = self._record()
        reachable = second is not None
        records = dict(second or {})
        records[self._comm.rank] = me
        text = compose(self._comm.rank, members, rec, view(records, channel),
                       view(first or {}, channel), reachable, channel)
        path = self._write(text, me, records)
        if reachable and self._hosts_store():
            # The store lives in this process: stay until the other ranks still waiting have
            # failed too and read it (bounded: every rank leaves within DEAR_TIMEOUT + 5 s).
            self._await(lambda now: self._peers_done(rec.seq, view(first or {}, channel),
                                                     view(now, channel)), started + 4.0)
        where = (f"\nThe report is in {path}; every rank's: python -m dear.diagnose hang "
                 f"{os.path.dirname(path)}" if path else "")
        return text + where

    def _settled(self, first: dict[int, dict[str, Any]], now: dict[int, dict[str, Any]]) -> bool:
        """Every other rank either failed too or showed a heartbeat since `first`."""
        return all(r in now and (now[r].get("failed") or _beat_moved(r, first, now))
                   for r in range(self._comm.size) if r != self._comm.rank)

    def _peers_done(self, seq: int, first: dict[int, dict[str, Any]],
                    now: dict[int, dict[str, Any]]) -> bool:
        """No other rank is still waiting in a collective: each failed too, is gone (no record,
        or a heartbeat that stopped), or never issued collective `seq` (it is elsewhere)."""
        gone = _gone(first, now)
        return all(r not in now or r in gone or now[r].get("failed") or now[r]["issued"] < seq
                   for r in range(self._comm.size) if r != self._comm.rank)

    def _await(self, done: Callable[[dict[int, dict[str, Any]]], bool],
               deadline: float) -> Optional[dict[int, dict[str, Any]]]:
        """Read the records every 0.1 s until `done(records)` or the deadline; None if the
        store went away."""
        while True:
            time.sleep(0.1)
            now = self._read()
            if now is None or done(now) or time.monotonic() >= deadline:
                self._publish()
                return now

    def _hosts_store(self) -> bool:
        """Rank 0 holds the TCPStore unless torchrun's agent does."""
        return self._comm.rank == 0 and not launch.agent_store()

    def _write(self, text: str, me: dict[str, Any],
               records: dict[int, dict[str, Any]]) -> Optional[str]:
        path = os.path.join(self._dir, f"rank{self._comm.rank}.json")
        try:
            os.makedirs(self._dir, exist_ok=True)
            with open(path + ".tmp", "w") as f:
                json.dump({"rank": self._comm.rank, "size": self._comm.size, "text": text,
                           "time": datetime.datetime.now().isoformat(timespec="seconds"),
                           "records": {str(r): v for r, v in sorted(records.items())}}, f,
                          indent=1)
            os.replace(path + ".tmp", path)
        except OSError:
            return None
        return path


def view(records: dict[int, dict[str, Any]], channel: str) -> dict[int, dict[str, Any]]:
    """Each rank's record as seen by one channel: its counters and recent collectives in
    place of the main ones (a rank that has not made the channel yet issued nothing on it)."""
    if channel == MAIN:
        return records
    empty = {"issued": 0, "completed": 0, "recent": []}
    return {r: {**record, **record.get("channels", {}).get(channel, empty)}
            for r, record in records.items()}


def _gone(before: dict[int, dict[str, Any]], now: dict[int, dict[str, Any]]) -> list[int]:
    """Ranks whose heartbeat did not move between the two reads and that did not fail."""
    return [r for r, record in now.items() if not record.get("failed") and
            not _beat_moved(r, before, now)]


def _beat_moved(r: int, before: dict[int, dict[str, Any]], now: dict[int, dict[str, Any]]) -> bool:
    """Rank r published between the two reads (a first record counts: a rank publishes once a
    second only after it stops issuing collectives)."""
    return r in now and (r not in before or
                         now[r].get("beat", 0) > before[r].get("beat", 0))


def _describe(entry: Optional[dict[str, Any]]) -> str:
    if entry is None:
        return "nothing"
    what = f", {entry['what']}" if entry.get("what") else ""
    return (f"#{entry['seq']} {entry['kind']} of {entry['bytes']} B{what} "
            f"(iteration {entry['iteration']}, {entry['phase']}"
            f"{'' if entry.get('done') else ', not complete'})")


def _entry(record: dict[str, Any], seq: int) -> Optional[dict[str, Any]]:
    for entry in record.get("recent", []):
        if entry["seq"] == seq:
            return entry
    return None


def _age(record: dict[str, Any], mine: dict[str, Any]) -> str:
    """How long before this report (`mine`, published when it was written) `record` was."""
    published, at = record.get("published"), mine.get("published")
    if published is None or at is None:
        return "of unknown age"
    clocks = "" if record.get("host") == mine.get("host") else " by the two hosts' clocks"
    return f"published {max(0.0, at - published):.1f} s before this report{clocks}"


def compose(rank: int, members: Sequence[int], rec: FlightRecord,
            now: dict[int, dict[str, Any]], before: dict[int, dict[str, Any]], reachable: bool,
            channel: str = MAIN) -> str:
    """The report's text, from the records read `before` and `now` (a pure function: tested
    on records made by hand). `members`: the ranks of the failed collective's stream; the
    records are that stream's (`view`)."""
    mine = _entry(now[rank], rec.seq) or {"seq": rec.seq, "kind": rec.kind, "bytes": rec.nbytes,
                                          "iteration": rec.iteration, "phase": rec.phase,
                                          "what": None, "done": False}
    stream = "" if channel == MAIN else f" on {channel}"
    lines = [f"dear hang report from rank {rank}: collective {_describe(mine)}{stream} failed."]
    if not reachable:
        lines.append("  The other ranks' records could not be read: no rendezvous store "
                     "reachable (rank 0, which held it, is gone; or the backend has none).")
        return "\n".join(lines)
    missing, differ, gone = [], [], []
    for r in members:
        record = now.get(r)
        if r == rank:
            continue
        if record is None:
            gone.append(r)
            lines.append(f"  rank {r}: published no record (it died or froze before its first, "
                         "or cannot reach the store)")
            continue
        last = record["recent"][-1] if record.get("recent") else None
        theirs = _entry(record, rec.seq)
        alive = _beat_moved(r, before, now)
        if not alive and not record.get("failed"):
            gone.append(r)
            lines.append(f"  rank {r}: NOT RESPONDING (died or froze); its last record, "
                         f"{_age(record, now[rank])}, had issued up to #{record['issued']}, "
                         f"last {_describe(last)} (a rank that issues collectives publishes "
                         f"every {INTERVAL * EVERY:g} s: it may have issued more since)")
            continue
        state = "also failed" if record.get("failed") else "alive, busy outside dear's collectives"
        if record["issued"] < rec.seq:
            missing.append(r)
            lines.append(f"  rank {r}: did NOT issue #{rec.seq}; its last was {_describe(last)}; "
                         f"{state}")
        elif theirs is not None and (theirs["kind"], theirs["bytes"]) != (mine["kind"],
                                                                          mine["bytes"]):
            differ.append(r)
            lines.append(f"  rank {r}: issued #{rec.seq} as {_describe(theirs)}: a different "
                         f"collective (the ranks took different branches); {state}")
        else:
            lines.append(f"  rank {r}: issued #{rec.seq} too; its last was {_describe(last)}; "
                         f"{state}")
    summary = []
    if gone:
        summary.append(f"Rank(s) not responding: {', '.join(map(str, gone))}.")
    if missing:
        summary.append(f"Rank(s) that did not issue it: {', '.join(map(str, missing))}.")
    if differ:
        summary.append(f"Rank(s) that issued another collective in its place: "
                       f"{', '.join(map(str, differ))}.")
    if summary:
        lines.insert(1, "  " + " ".join(summary))
    return "\n".join(lines)


def show(directory: str) -> str:
    """Every report under `directory` (python -m dear.diagnose hang DIR)."""
    paths = sorted(glob.glob(os.path.join(directory, "rank*.json")) +
                   glob.glob(os.path.join(directory, "*", "rank*.json")))
    if not paths:
        raise FileNotFoundError(f"no rank*.json hang report under {directory}")
    texts = []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        texts.append(f"{path} ({data.get('time', '?')}):\n{data['text']}")
    return "\n\n".join(texts)
