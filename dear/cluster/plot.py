"""The figure: CDF of job completion times, one line per policy, one panel per setup."""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np


def jct_cdf(panels: Mapping[str, Mapping[str, Sequence[float]]], path: str) -> None:
    """panels: {panel title: {policy: completion times in hours}} -> a PNG at `path` (log x)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cols = min(2, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4.2 * rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    for ax, (title, lines) in zip(axes.flat, panels.items()):
        for policy, times in lines.items():
            xs = np.sort(np.asarray(times, dtype=float))
            if len(xs) == 0:
                continue
            ys = np.arange(1, len(xs) + 1) / len(xs)
            ax.step(xs, ys, where="post", label=policy, linewidth=1.3)
        ax.set_xscale("log")
        ax.set_xlabel("job completion time (h)")
        ax.set_ylabel("fraction of jobs")
        ax.set_ylim(0, 1.01)
        ax.grid(alpha=0.3, linestyle="--")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
