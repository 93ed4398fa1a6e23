"""The collective stream cannot shift silently.

Every rank must issue dear's collectives in the same order. A rank that calls step() once more
than the others (no backward before it), trains a different set of parameters, or rebuilt its
optimizer, would otherwise keep issuing collectives that pair with another iteration's on the
other ranks: a hang, or every rank agreeing on wrong parameters. So each iteration carries one
tiny all-gather, issued after that iteration's reduce-scatters (the same place in every rank's
stream), of what the rank believes: its step count, whether a backward ran before this step,
and a digest of the parameters it trains. Any difference stops every rank, naming the ranks.
"""

from __future__ import annotations

import zlib
from typing import Optional, Sequence

import torch

from ..comm.base import Communicator, Work, collective_error

_FIELDS = ("step", "backward passes before it", "trained parameters (digest)")


def parameter_digest(named: Sequence[tuple[str, torch.Tensor]]) -> int:
    """A process-independent digest of names, shapes and dtypes (Python's hash() is salted)."""
    text = "|".join(f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in named)
    return zlib.crc32(text.encode()) | (len(named) << 32)


class StreamCheck:
    """One all-gather of four integers per iteration. `issue` sends it without waiting (step()
    must not wait behind the all-gather chunks still on the link); `settle` waits and raises on
    any difference. dear settles before it applies any update of that step (the collectives in
    between pair up on every rank even when the check fails: the same kinds and sizes), and
    before it issues the next check."""

    def __init__(self, comm: Communicator) -> None:
        self._comm = comm
        self.steps = 0
        self._pending: Optional[tuple[Work, torch.Tensor]] = None
        self._after = ""
        self.everyone_used = True

    def issue(self, had_gradients: bool, digest: int, after: str = "",
              all_used: bool = True) -> None:
        """`after`: what the check follows in the stream, for the error if a peer is gone.
        `all_used` (this rank had a gradient for every parameter) rides along, not compared:
        `everyone_used` says, once settled, whether every rank had."""
        self.settle()
        self.steps += 1
        self._after = after
        self.everyone_used = all_used
        comm = self._comm
        if comm.size == 1:
            return
        row = torch.tensor([self.steps, int(had_gradients), digest, int(all_used)],
                           dtype=torch.int64)
        table = torch.empty(4 * comm.size, dtype=torch.int64)
        self._pending = (comm.all_gather(row, table), table)

    def settle(self) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        work, table = pending
        try:
            work.wait()
        except Exception as exc:
            raise collective_error(
                f"dear: the stream check of step() #{self.steps} (a tiny all-gather issued "
                f"after {self._after or 'its reduce-scatters'}) failed; another rank probably "
                f"died or stalled: {exc}", exc) from exc
        rows = table.view(self._comm.size, 4).tolist()
        self.everyone_used = all(r[3] for r in rows)
        rows = [r[:3] for r in rows]
        if all(r == rows[0] for r in rows):
            return
        lines = []
        for r, (steps, grads, dig) in enumerate(rows):
            after = "after a backward" if grads else "WITHOUT a backward since the last step()"
            lines.append(f"rank {r}: step() #{steps}, {after}, trains parameter set "
                         f"{dig & 0xffffffff:08x} ({dig >> 32} tensors)")
        raise RuntimeError(
            "dear: the ranks' collectives no longer pair up, so training stopped here on every "
            "rank (the alternative is a hang or silently wrong parameters):\n  "
            + "\n  ".join(lines) + "\nEvery rank must call step() the same number of times, "
            "each after a backward, and train the same parameters (freeze, unfreeze and "
            "add_param_group on every rank at the same step)")


__all__ = ["StreamCheck", "parameter_digest"]
