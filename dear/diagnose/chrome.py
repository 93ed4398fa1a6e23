"""Chrome trace JSON (opens in Perfetto and chrome://tracing): writing one rank, reading many.

One file per rank, `rank<r>.json`, in the JSON Object Format: `traceEvents` plus a `dear` key
(ignored by viewers) with what replay needs: parameters, modules, buckets, world size, schedule.
Timestamps are microseconds on rank 0's clock since a time zero shared by all ranks (see
`dear.diagnose.align`), so the files of all ranks can be opened together. Lanes (threads) per
rank: 0 iterations, 1 the training thread (forward, backward, update, step, wait), 2.. the
collectives in flight (one lane per concurrent collective).
"""

from __future__ import annotations

import bisect
import dataclasses
import glob
import json
import os
from typing import Any, Optional

from .recorder import Ev, Recorder

FORMAT_VERSION = 1
LANE_ITERATION, LANE_COMPUTE, LANE_COMM = 0, 1, 2
COMPUTE_CATS = ("forward", "backward", "update", "step", "wait")


def build_trace(recorder: Recorder, meta: dict[str, Any]) -> dict[str, Any]:
    """The Chrome trace document of one rank's recorded iterations."""
    rank = int(meta.get("rank", 0))
    shift = int(meta.get("clock_offset_ns", 0)) - int(meta.get("origin_ns", 0))

    def us(t_ns: int) -> float:
        return round((t_ns + shift) / 1000.0, 3)

    modules = [m["name"] for m in meta.get("modules", [])]
    params = [p["name"] for p in meta.get("params", [])]
    events: list[dict[str, Any]] = []

    def span(lane: int, cat: str, name: str, start: int, end: int, **args: Any) -> None:
        events.append({"ph": "X", "pid": rank, "tid": lane, "cat": cat, "name": name,
                       "ts": us(start), "dur": round(max(end - start, 0) / 1000.0, 3),
                       "args": args})

    for it, start in sorted(recorder.iteration_starts.items()):
        end = recorder.iteration_ends.get(it)
        if end is not None:
            span(LANE_ITERATION, "iteration", f"iteration {it}", start, end, iteration=it)

    raw = sorted(recorder.events, key=lambda e: e[2])
    open_forward: dict[int, list[int]] = {}
    boundaries = [e[2] for e in raw if e[0] in (Ev.FORWARD_START, Ev.STEP)]
    backward = [e for e in raw if e[0] is Ev.BACKWARD_START]
    for e in raw:
        kind, it, t = e[0], e[1], e[2]
        if kind is Ev.FORWARD_START:
            open_forward.setdefault(e[3], []).append(t)
        elif kind is Ev.FORWARD_END and open_forward.get(e[3]):
            start = open_forward[e[3]].pop()
            span(LANE_COMPUTE, "forward", modules[e[3]], start, t, iteration=it, module=e[3])
        elif kind is Ev.GRAD_READY:
            events.append({"ph": "i", "s": "t", "pid": rank, "tid": LANE_COMPUTE, "cat": "grad",
                           "name": f"grad {params[e[3]]}", "ts": us(t),
                           "args": {"iteration": it, "param": e[3]}})
        elif kind is Ev.STEP:
            span(LANE_COMPUTE, "step", "step", t, e[3], iteration=it)
        elif kind is Ev.UPDATE:
            span(LANE_COMPUTE, "update", f"update bucket {e[4]}", t, e[3], iteration=it,
                 bucket=e[4])
        elif kind is Ev.WAIT:
            span(LANE_COMPUTE, "wait", f"wait #{e[4]}", t, e[3], iteration=it, seq=e[4])
    grads = sorted(e[2] for e in raw if e[0] is Ev.GRAD_READY)
    for i, e in enumerate(backward):
        # A module's backward lasts until the next module's starts; the last one before a
        # forward or step (or the trace's end) lasts until the last gradient before that.
        k = bisect.bisect_right(boundaries, e[2])
        following = boundaries[k:k + 1]
        nxt = backward[i + 1][2] if i + 1 < len(backward) else None
        if nxt is not None and (not following or nxt <= following[0]):
            end = nxt
        else:
            limit = following[0] if following else float("inf")
            last = bisect.bisect_right(grads, limit) - 1
            end = grads[last] if last >= 0 and grads[last] > e[2] else e[2]
        span(LANE_COMPUTE, "backward", modules[e[3]], e[2], end, iteration=e[1], module=e[3])

    lane_free: list[int] = []                  # greedy: the first lane free at issue time
    for rec in sorted(recorder.collectives, key=lambda r: r.issue_ns):
        end = rec.end_ns if rec.end_ns is not None else rec.issue_ns
        lane = next((k for k, free in enumerate(lane_free) if free <= rec.issue_ns), None)
        if lane is None:
            lane = len(lane_free)
            lane_free.append(end)
        lane_free[lane] = end
        where = f" bucket {rec.bucket}" if rec.bucket is not None else ""
        extra = {} if rec.buffer_bytes is None else {"buffer_bytes": rec.buffer_bytes}
        span(LANE_COMM + lane, "comm", f"{rec.kind.value}{where}", rec.issue_ns, end,
             iteration=rec.iteration, kind=rec.kind.value, bytes=rec.nbytes, bucket=rec.bucket,
             seq=rec.seq, end_source=rec.end_source or "missing", **extra)

    names = {LANE_ITERATION: "iterations", LANE_COMPUTE: "training thread"}
    names.update({LANE_COMM + k: f"collectives {k}" for k in range(len(lane_free))})
    meta_events = [{"ph": "M", "pid": rank, "tid": 0, "name": "process_name",
                    "args": {"name": f"rank {rank}"}},
                   {"ph": "M", "pid": rank, "tid": 0, "name": "process_sort_index",
                    "args": {"sort_index": rank}}]
    for tid, name in names.items():
        meta_events.append({"ph": "M", "pid": rank, "tid": tid, "name": "thread_name",
                            "args": {"name": name}})
        meta_events.append({"ph": "M", "pid": rank, "tid": tid, "name": "thread_sort_index",
                            "args": {"sort_index": tid}})
    return {"traceEvents": meta_events + events, "displayTimeUnit": "ms",
            "otherData": {"producer": "dear.diagnose", "rank": rank,
                          "world_size": meta.get("world_size", 1)},
            "dear": {**meta, "version": FORMAT_VERSION}}


# ------------------------------------------------------------------------------- reading
@dataclasses.dataclass
class Span:
    """An interval of one rank, in seconds since the shared time zero."""

    cat: str
    name: str
    start: float
    end: float
    iteration: int
    args: dict[str, Any]

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclasses.dataclass
class RankTrace:
    rank: int
    meta: dict[str, Any]
    spans: list[Span]

    def of(self, cat: str, iteration: Optional[int] = None) -> list[Span]:
        return [s for s in self.spans
                if s.cat == cat and (iteration is None or s.iteration == iteration)]

    @property
    def iterations(self) -> dict[int, Span]:
        return {s.iteration: s for s in self.spans if s.cat == "iteration"}


@dataclasses.dataclass
class Trace:
    path: str
    ranks: list[RankTrace]

    @property
    def world_size(self) -> int:
        return int(self.ranks[0].meta.get("world_size", len(self.ranks)))

    @property
    def meta(self) -> dict[str, Any]:
        return self.ranks[0].meta

    def common_iterations(self) -> list[int]:
        """Iterations complete on every rank that was read."""
        sets = [set(r.iterations) for r in self.ranks]
        return sorted(set.intersection(*sets)) if sets else []


def parse_rank(doc: dict[str, Any], where: str = "<trace>") -> RankTrace:
    if not isinstance(doc, dict) or "traceEvents" not in doc or "dear" not in doc:
        raise ValueError(f"{where} is not a dear.diagnose trace (no traceEvents/dear keys); "
                         "make one with dear.diagnose.trace(...) or DEAR_TRACE=dir")
    meta = doc["dear"]
    if meta.get("version") != FORMAT_VERSION:
        raise ValueError(f"{where}: trace format version {meta.get('version')} is not "
                         f"{FORMAT_VERSION}; re-record it with this version of dear")
    spans = []
    for ev in doc["traceEvents"]:
        ph = ev.get("ph")
        if ph not in ("X", "i"):
            continue
        start = ev["ts"] / 1e6
        args = ev.get("args", {})
        spans.append(Span(ev.get("cat", ""), ev.get("name", ""), start,
                          start + ev.get("dur", 0.0) / 1e6, int(args.get("iteration", -1)), args))
    spans.sort(key=lambda s: (s.start, -s.end))
    return RankTrace(int(meta.get("rank", 0)), meta, spans)


def load_trace(path: str) -> Trace:
    """Read `rank*.json` from a directory (or one file); ranks in rank order."""
    path = os.fspath(path)
    files = sorted(glob.glob(os.path.join(path, "rank*.json"))) if os.path.isdir(path) else [path]
    if not files or not all(os.path.exists(f) for f in files):
        raise FileNotFoundError(f"no trace at {path!r}: expected a directory holding rank*.json "
                                "(written by dear.diagnose.trace or DEAR_TRACE)")
    ranks = []
    for f in files:
        with open(f) as fh:
            try:
                doc = json.load(fh)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{f} is not valid JSON ({exc}); was the run interrupted "
                                 "while writing it?") from None
        ranks.append(parse_rank(doc, f))
    ranks.sort(key=lambda r: r.rank)
    return Trace(path, ranks)
