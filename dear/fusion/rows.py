"""A bucket for one embedding table whose gradient is mostly zero rows.

A word embedding's gradient is dense in memory but non-zero only in the rows of the tokens the
batch used (a BERT fine-tune touches a few thousand of 30,522 rows), and it is the worst tensor
to send densely: complete only at the end of backward, needed by the first layer of the next
forward, so its whole transfer sits between the two (BERT-Base's 89 MiB table bounds every
dense schedule: docs/benchmarks.md#bert-base-the-dependency-bound). Here only the rows some rank
touched travel:

    1. every rank marks its non-zero rows; a tiny all-reduce of the marks gives the union,
       the same on every rank (so the data collective has the same size everywhere);
    2. one all-reduce of those rows (and the bucket's usage flag) sums them;
    3. the averaged rows are written into the dense buffer, zero elsewhere: every rank now
       holds the whole averaged gradient, so the "all-gather" is local.

Exact: a row that is zero on every rank averages to zero. Between 2 and 3 the bucket looks like
any other (its shard is the dense slice, for clipping norms and GradScaler's inf check); the
scale factors those apply to shards reach it as to chunks gathered early
(`DistributedOptimizer._apply_deferred`). Every rank issues the same two collectives in the same
order; the issuing thread waits for the first (a few hundred KB) before it issues the second.

`send_dense` (set by the optimizer while a dear.diagnose Tracer is attached, whose replay models
dense reduce-scatters and all-gathers) makes an iteration's table travel like any bucket.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Optional, Sequence, Union

import torch

from ..comm.base import Communicator, DoneWork, Work, collective_error
from .bucket import Bucket, Stage
from .planner import BucketSpec


class RowSparseBucket(Bucket):
    """A bucket holding exactly one 2-D parameter (rows x columns), sent as its used rows."""

    chunkable = False            # no all-gather: the planned schedule leaves it alone
    views_supported = False      # its buffer is rebuilt from the rows: .grad stays its own

    def __init__(self, spec: BucketSpec, params: Sequence[torch.nn.Parameter], rank: int,
                 sparse_as_dense: bool = False, native: Optional[bool] = None) -> None:
        if len(params) != 1 or params[0].dim() != 2:
            raise ValueError("a row-sparse bucket holds exactly one 2-D parameter")
        super().__init__(spec, params, None, sparse_as_dense, native)   # no wire compression
        self.rank = rank
        self.rows, self.cols = params[0].shape
        self.sent_rows = 0                    # rows in this iteration's all-reduce (all ranks)
        self.send_dense = False               # from the next reduce-scatter on: as any bucket
        self._dense = False                   # this iteration's choice
        self._index: Optional[torch.Tensor] = None
        self._compact: Optional[torch.Tensor] = None

    @property
    def reduce_bytes(self) -> int:
        """Two all-reduces, the marks and the rows sent last time, each as long as a
        reduce-scatter and an all-gather of its bytes. (Modelled as the whole table, it made
        the planned schedule's check read a faster link:
        docs/benchmarks.md#a-row-sparse-tables-modelled-traffic.)"""
        if self._dense:
            return super().reduce_bytes
        return 2 * self.buffer.element_size() * (self.rows + self.sent_rows * self.cols + 1)

    def _table(self) -> torch.Tensor:
        return self.buffer[:self.rows * self.cols].view(self.rows, self.cols)

    def start_reduce_scatter(self, comm: Communicator, prescale: float,
                             submit: Optional[Callable[..., Work]] = None) -> None:
        self._dense = self.send_dense          # latched for the iteration
        super().start_reduce_scatter(comm, prescale, submit)

    def _reduce(self, comm: Communicator) -> Work:
        """The marks' all-reduce (waited for here), then the all-reduce of the used rows."""
        if self._dense:
            self.sent_rows = self.rows
            return super()._reduce(comm)
        table = self._table()
        marks = table.any(dim=1).to(self.spec.dtype)         # NaN and inf rows count
        try:
            comm.all_reduce(marks).wait()
        except Exception as exc:
            raise collective_error(
                f"dear: the row-sparse exchange of bucket {self.spec.index} failed; another "
                f"rank probably died or stalled: {exc}", exc) from exc
        index = marks.nonzero().view(-1)
        self.sent_rows = int(index.numel())
        if self.sent_rows == self.rows:        # every row: the table and its flag, in place
            self._index = None
            self._compact = self.buffer[:self.spec.flags_offset + 1]
        else:
            flag = self.buffer[self.spec.flags_offset:self.spec.flags_offset + 1]
            self._index = index
            self._compact = torch.cat([table.index_select(0, index).view(-1), flag])
        return comm.all_reduce(self._compact)

    def finish_reduce_scatter(self, postscale: float) -> None:
        """Wait for the rows, average them and write the dense averaged gradient (zeros in the
        rows nobody touched) into the buffer; the shard is this rank's slice of it."""
        if self._dense:
            super().finish_reduce_scatter(postscale)
            return
        with self._finish_lock:
            if self._averaged:
                return
            assert self.stage in (Stage.REDUCING, Stage.GATHERING)
            self._wait("row-sparse all-reduce")
            compact, index = self._compact, self._index
            assert compact is not None
            if postscale != 1.0:
                compact.mul_(postscale)
            if index is not None:              # else the all-reduce ran in the buffer itself
                # Rows outside the union are zero here already (this rank's marks are in the
                # union), so only the union's rows are written: no pass over the whole table.
                self._table().index_copy_(0, index, compact[:-1].view(-1, self.cols))
                self.buffer[self.spec.flags_offset] = compact[-1]
            length = self.spec.shard_numel
            self.shard.copy_(self.buffer[self.rank * length:(self.rank + 1) * length])
            self._compact = None
            self._averaged = True

    def start_all_gather(self, comm: Communicator) -> None:
        """Nothing to send: finish_reduce_scatter left the whole averaged gradient here."""
        if self._dense:
            super().start_all_gather(comm)
            return
        self.gathering(DoneWork())

    def gather_columns(self, comm: Communicator, start: int, length: int) -> Work:
        raise RuntimeError("a row-sparse bucket has no all-gather to cut into chunks")

    def reset(self) -> None:
        super().reset()
        self._index = None
        self._compact = None


MIN_TABLE_BYTES = 1 << 20     # smaller tables: the marks' round trip costs more than it saves


def resolve_row_sparse(setting: Union[bool, str, Sequence[str], None],
                       named: Sequence[tuple[str, torch.nn.Parameter]],
                       model: Optional[torch.nn.Module], explicit: bool = True,
                       world_size: Optional[int] = None) -> set[int]:
    """Which parameters (indices into `named`) are sent as their used rows. `setting`: False /
    "off"; True / "auto": the weights (>= 1 MB, 2-D) of the model's dense nn.Embedding and
    nn.EmbeddingBag tables that no other module holds (needs model=; from DEAR_ROW_SPARSE,
    `explicit=False`, a missing model= just means none); or parameter names, comma-separated
    or a list. A table tied to an output layer (GPT-2's wte and lm_head) is left out: the
    output layer's gradient fills every row, so its rows would only cost the marks' round trip
    and the all-gather's place in the next forward. "auto" at `world_size` 1 chooses none:
    there is no link to save, and finding the used rows reads a count on the host (on a GPU,
    a host-device synchronization an iteration)."""
    if setting is None or setting is False or setting == "off" or setting == "":
        return set()
    index = {name: i for i, (name, _) in enumerate(named)}
    if setting is True or setting == "auto":
        if world_size == 1:
            return set()
        if model is None:
            if not explicit:
                return set()
            raise ValueError("row_sparse='auto' finds the embedding tables through model=; "
                             "pass model=, or the parameters' names")
        holders = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
        tables = {id(m.weight) for m in model.modules()
                  if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and not m.sparse
                  and holders[id(m.weight)] == 1}
        return {i for i, (_, p) in enumerate(named) if id(p) in tables and p.dim() == 2
                and p.numel() * p.element_size() >= MIN_TABLE_BYTES}
    names = setting.split(",") if isinstance(setting, str) else list(setting)
    chosen = set()
    for name in (n.strip() for n in names):
        if name not in index:
            raise ValueError(f"row_sparse names {name!r}, which is not a parameter this "
                             f"optimizer averages (e.g. {next(iter(index), '-')!r}); give the "
                             "names from named_parameters(), or 'auto' / 'off'")
        if named[index[name]][1].dim() != 2:
            raise ValueError(f"row_sparse: {name!r} has shape "
                             f"{tuple(named[index[name]][1].shape)}; only a 2-D table "
                             "(rows x columns) can be sent by rows")
        chosen.add(index[name])
    return chosen
