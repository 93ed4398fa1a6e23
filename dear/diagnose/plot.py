"""PNG timeline: per rank a compute lane and a communication lane (matplotlib, no display)."""

from __future__ import annotations

from typing import Optional, Sequence

from .chrome import Trace, load_trace

COLORS = {"forward": "#4c72b0", "backward": "#dd8452", "update": "#55a868", "step": "#c44e52",
          "wait": "#bbbbbb", "reduce_scatter": "#8172b3", "all_gather": "#64b5cd",
          "all_reduce": "#937860", "broadcast": "#da8bc3", "compute": "#4c72b0"}


def plot_timeline(trace: Trace | str, path: str,
                  iterations: Optional[Sequence[int]] = None) -> str:
    """Draw `iterations` (default: the last two traced on every rank) into `path`."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if isinstance(trace, str):
        trace = load_trace(trace)
    common = trace.common_iterations()
    chosen = list(iterations) if iterations is not None else common[-2:]
    if not chosen or not set(chosen) <= set(common):
        raise ValueError(f"iterations {chosen} are not all in the trace (it has {common})")
    lo = min(r.iterations[i].start for r in trace.ranks for i in chosen)
    hi = max(r.iterations[i].end for r in trace.ranks for i in chosen)
    fig, ax = plt.subplots(figsize=(12, 1.0 + 0.9 * len(trace.ranks)))
    labels, y = [], 0
    for rank in trace.ranks:
        bars: dict[str, list[tuple[float, float]]] = {}
        for s in rank.spans:
            root_forward = s.cat == "forward" and s.args.get("module") == 0
            if s.iteration in chosen and (root_forward or s.cat in ("backward", "update",
                                                                     "step", "wait")):
                bars.setdefault(s.cat, []).append((s.start - lo, s.duration))
        for cat in ("forward", "backward", "update", "step", "wait"):   # waits on top
            if cat in bars:
                ax.broken_barh(bars[cat], (y + 0.1, 0.8), color=COLORS[cat])
        labels.append(f"rank {rank.rank} compute")
        y += 1
        comm: dict[str, list[tuple[float, float]]] = {}
        for s in rank.of("comm"):
            if s.end >= lo and s.start <= hi:
                comm.setdefault(s.args["kind"], []).append((s.start - lo, max(s.duration, 1e-5)))
        for kind, xs in comm.items():
            ax.broken_barh(xs, (y + 0.1, 0.8), color=COLORS.get(kind, "#333333"), alpha=0.8)
        labels.append(f"rank {rank.rank} comm")
        y += 1
    ax.set_yticks([k + 0.5 for k in range(y)], labels)
    ax.set_xlim(0, hi - lo)
    ax.set_xlabel(f"seconds from the start of iteration {min(chosen)}")
    ax.invert_yaxis()
    cats = ["forward", "backward", "update", "step", "wait", "reduce_scatter", "all_gather",
            "all_reduce"]
    ax.legend(handles=[Patch(color=COLORS[c], label=c.replace("_", "-")) for c in cats],
              loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=len(cats), fontsize=8)
    ax.set_title(f"{trace.path}: schedule {trace.meta.get('schedule')}, "
                 f"iterations {min(chosen)}-{max(chosen)}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
