"""The one report writer: a benchmark's figures to benchmarks/results/<name>.json, .md and (with a
figure) .png, with the exact command, the commit, the machine and the date, so every number
quoted in the docs can be traced to the run that produced it."""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def machine() -> dict[str, Any]:
    return {"cpus": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def command() -> str:
    """The command as a user would type it again: `python -m benchmarks.x ...` from the repo
    root."""
    argv = list(sys.argv)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = os.path.abspath(argv[0]) if argv else ""
    if script.startswith(repo + os.sep) and script.endswith(".py"):
        module = os.path.relpath(script, repo)[:-3].replace(os.sep, ".")
        argv = ["-m", module, *argv[1:]]
    return " ".join(shlex.quote(a) for a in ["python", *argv])


def commit() -> str:
    """The checkout's commit, "+changes" when tracked files differ from it ("unknown" outside
    git)."""
    import subprocess
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, text=True,
                              capture_output=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", ".",
                                ":(exclude)benchmarks/results"], cwd=repo,
                               timeout=10).returncode != 0
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head + ("+changes" if dirty else "")) if head else "unknown"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def fmt(v: Any) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def write(name: str, title: str, data: dict[str, Any], table: str, notes: str = "",
          figure: Optional[Callable[[str], None]] = None) -> str:
    """Write <name>.json and <name>.md, and with `figure` (draws to the path it is given)
    <name>.png, linked at the end of the .md; return the .md path."""
    os.makedirs(RESULTS_DIR, exist_ok=True)
    meta = {"command": command(), "commit": commit(), "machine": machine(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    with open(os.path.join(RESULTS_DIR, f"{name}.json"), "w") as fh:
        json.dump({**meta, **data}, fh, indent=2, default=str)
    if figure is not None:
        figure(os.path.join(RESULTS_DIR, f"{name}.png"))
        notes = f"{notes}\n\n![{name}]({name}.png)".lstrip()
    md = os.path.join(RESULTS_DIR, f"{name}.md")
    with open(md, "w") as fh:
        fh.write(f"# {title}\n\nCommand: `{meta['command']}`  \nCommit: {meta['commit']}  \n"
                 f"Machine: {meta['machine']}  \nDate: {meta['date']}\n\n{table}\n")
        if notes:
            fh.write(f"\n{notes}\n")
    return md


def pyplot() -> Any:
    """matplotlib's pyplot, drawing to files (no display on these machines)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


@dataclass
class Panel:
    """One setup's bars: each method's iteration time as a ratio to T_lb."""
    title: str
    ratios: dict[str, float]
    bound: Optional[float] = None             # DeAR's bound x T_lb, drawn as a line


def ratio_chart(panels: Sequence[Panel], top: Optional[float] = None
                ) -> Callable[[str], None]:
    """A figure for write(): a panel per setup, a bar per method (dear's red), the ratio on
    each, T_lb at 1. top: bars above it are clipped (FSDP2 on Gloo/CPU runs at 3-5x)."""
    def draw(path: str) -> None:
        plt = pyplot()
        cols = min(3, len(panels))
        rows = -(-len(panels) // cols)
        fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 4 * rows), squeeze=False)
        for ax in axes.flat[len(panels):]:
            ax.axis("off")
        for ax, panel in zip(axes.flat, panels):
            labels = list(panel.ratios)
            ratios = [panel.ratios[m] for m in labels]
            shown = [min(r, top) if top else r for r in ratios]
            ax.bar(range(len(labels)), shown,
                   color=["tab:red" if m.startswith("dear") else "tab:gray" for m in labels])
            for i, r in enumerate(ratios):
                ax.text(i, shown[i], f"{r:.2f}", ha="center", va="bottom", fontsize=7)
            if top:
                ax.set_ylim(0, top * 1.08)
            ax.axhline(1.0, color="black", linewidth=1, linestyle="--", label="T_lb")
            if panel.bound is not None:
                ax.axhline(panel.bound, color="tab:red", linewidth=1, linestyle=":",
                           label="DeAR bound")
            ax.set_xticks(range(len(labels)), labels, rotation=35, ha="right", fontsize=8)
            ax.set_title(panel.title, fontsize=10)
            ax.set_ylabel("iteration / T_lb")
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
    return draw
