"""Write a benchmark's figures to benchmarks/results/<name>.json and .md with the exact command
and the machine, so every number quoted in a note can be traced to the run that produced it."""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import sys
from typing import Any, Sequence

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


def write(name: str, title: str, data: dict[str, Any], table: str, notes: str = "") -> str:
    """Write <name>.json and <name>.md; return the .md path."""
    os.makedirs(RESULTS_DIR, exist_ok=True)
    meta = {"command": command(), "commit": commit(), "machine": machine(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    with open(os.path.join(RESULTS_DIR, f"{name}.json"), "w") as fh:
        json.dump({**meta, **data}, fh, indent=2, default=str)
    md = os.path.join(RESULTS_DIR, f"{name}.md")
    with open(md, "w") as fh:
        fh.write(f"# {title}\n\nCommand: `{meta['command']}`  \nCommit: {meta['commit']}  \n"
                 f"Machine: {meta['machine']}  \nDate: {meta['date']}\n\n{table}\n")
        if notes:
            fh.write(f"\n{notes}\n")
    return md
