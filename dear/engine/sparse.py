"""Sparse gradients (nn.Embedding(sparse=True), nn.EmbeddingBag(sparse=True)), as Horovod
treats them.

Their parameters are kept out of dear's dense buckets. At step() (and synchronize()), after the
reduce-scatters have finished and before the all-gathers start, every rank runs the same
collectives, in parameter order:
  sparse_as_dense=False (Horovod's default): all-gather of each rank's gradient as indices and
    values (Horovod's sparse allreduce): one tiny all-gather of the entry counts, then one
    all-gather of the indices and one per value dtype, padded to the largest count; the pieces
    are concatenated, coalesced (duplicate rows summed) and averaged.
  sparse_as_dense=True: the gradients densified and all-reduced as one flat buffer.
The wrapped optimizer then receives a SPARSE averaged gradient in both cases, as with Horovod
and as without any distribution (SparseAdam takes nothing else): rows present on any rank (the
union of the ranks' rows), each the sum over ranks times the averaging factor. In the dense mode
the rows are those whose averaged value is not all zero (a row whose contributions cancel
exactly is absent; Horovod's to_sparse() drops single zero elements too).

The update of the sparse parameters is applied inside step(), not deferred to the next forward
(the all-gather here cannot overlap anything: the sizes are known only after backward). After
synchronize() `.grad` holds the averaged sparse gradient (Horovod's meaning). A parameter no
rank produced a gradient for gets none (no update), as in single-process training.

Not supported with sparse parameters (clear errors): GradScaler, optimizer.clip_grad_norm_
(use synchronize(), torch's clip, skip_synchronize()), compression of their values.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any, Optional

import torch

from ..comm.base import Communicator
from ..fusion.executor import issue_pending

_SPARSE_MODULES = (torch.nn.Embedding, torch.nn.EmbeddingBag)


def sparse_parameters(named: list[tuple[str, torch.nn.Parameter]],
                      model: Optional[torch.nn.Module]) -> set[int]:
    """ids of the parameters whose gradients are sparse: weights of Embedding / EmbeddingBag
    modules built with sparse=True. Without model= they are found among the live modules (one
    pass over the garbage collector's objects, once, at wrap time; cheap enough:
    docs/benchmarks.md#sparse-embeddings-without-model)."""
    mine = {id(p) for _, p in named}
    if model is not None:
        modules = list(model.modules())
    else:                                      # every live embedding module, one pass
        modules = [m for m in gc.get_objects() if issubclass(type(m), _SPARSE_MODULES)]
    return {id(m.weight) for m in modules
            if isinstance(m, _SPARSE_MODULES) and getattr(m, "sparse", False)
            and id(m.weight) in mine}


class SparseGradients:
    """The sparse parameters of one dear.DistributedOptimizer and their averaging."""

    def __init__(self, optimizer: Any, named: list[tuple[str, torch.nn.Parameter]],
                 comm: Communicator, sparse_as_dense: bool) -> None:
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self.params = self._params             # which parameters it holds (read-only use)
        self._comm = comm
        self._as_dense = sparse_as_dense
        self._averaged: list[Optional[torch.Tensor]] = []
        if len({(p.dtype, p.device) for p in self._params}) > 1:
            raise ValueError("dear: the sparse parameters (Embedding(sparse=True) weights) must "
                             "share one dtype and device")
        for p in self._params:
            if not sparse_as_dense:
                comm.check_dtype(torch.int64)
            comm.check_dtype(p.dtype)
        # dear's own hooks are on the dense parameters only; these tell step() that a backward
        # produced gradients (sparse ones), so it communicates. Held weakly, as dear's hooks.
        ref = weakref.ref(optimizer)

        def mark(_: torch.Tensor) -> None:
            opt = ref()
            if opt is not None:
                opt.dear_iteration.grads_since_step = True
        self._hooks = [p.register_post_accumulate_grad_hook(mark) for p in self._params]
        self._hooks.append(optimizer.register_step_pre_hook(_refuse_grad_scaler))
        weakref.finalize(optimizer, _remove, self._hooks)
        if hasattr(optimizer, "clip_grad_norm_"):
            optimizer.clip_grad_norm_ = self._no_clip   # per instance: the dense path's norm
                                                         # would leave the sparse rows out

    # ------------------------------------------------------------------ inside _communicate
    def reduce(self, prescale: float, postscale: float) -> None:
        """Average every sparse parameter's gradient over ranks (same collectives everywhere)."""
        issue_pending()                        # other optimizers' collective threads first
        local = []
        for p in self._params:
            g = p.grad
            if g is not None and not g.is_sparse and not self._as_dense:
                raise RuntimeError(f"{self._names[self._params.index(p)]} is a sparse module's "
                                   "weight but its gradient is dense")
            local.append(g)
        if self._as_dense:
            self._averaged = self._reduce_dense(local, prescale, postscale)
        else:
            self._averaged = self._gather_sparse(local, prescale, postscale)

    def _reduce_dense(self, local: list[Optional[torch.Tensor]], prescale: float,
                      postscale: float) -> list[Optional[torch.Tensor]]:
        p0 = self._params[0]
        numels = [p.numel() for p in self._params]
        flat = torch.zeros(sum(numels) + len(self._params), dtype=p0.dtype, device=p0.device)
        parts = flat.split(numels + [len(self._params)])
        for part, g, p in zip(parts, local, self._params):
            if g is not None:
                part.copy_((g.to_dense() if g.is_sparse else g).reshape(-1))
        parts[-1].copy_(torch.tensor([float(g is not None) for g in local], device=p0.device))
        if prescale != 1.0:
            flat[:sum(numels)].mul_(prescale)
        self._comm.all_reduce(flat).wait()
        out: list[Optional[torch.Tensor]] = []
        used = parts[-1].tolist()
        for part, p, u in zip(parts, self._params, used):
            if not u:
                out.append(None)
                continue
            dense = part.view(p.shape)
            if postscale != 1.0:
                dense = dense * postscale
            out.append(dense.to_sparse(1).coalesce())
        return out

    def _gather_sparse(self, local: list[Optional[torch.Tensor]], prescale: float,
                       postscale: float) -> list[Optional[torch.Tensor]]:
        comm, world = self._comm, self._comm.size
        device = self._params[0].device
        coalesced = [g.coalesce() if g is not None else None for g in local]
        # Entry counts (-1: no gradient on this rank), all-gathered.
        counts = torch.tensor([g._nnz() if g is not None else -1 for g in coalesced],
                              dtype=torch.int64, device=device)
        every = torch.empty(world * counts.numel(), dtype=torch.int64, device=device)
        comm.all_gather(counts, every).wait()
        every_counts = every.view(world, -1).tolist()
        most = [max(max(c[k] for c in every_counts), 0) for k in range(len(self._params))]
        sparse_dims = [1] * len(self._params)  # embedding gradients: whole rows
        # Indices: every parameter's (sparse_dim x most) block, flat, padded with zeros.
        idx_sizes = [d * m for d, m in zip(sparse_dims, most)]
        row_shapes = [tuple(p.shape[d:]) for p, d in zip(self._params, sparse_dims)]
        row_numels = [int(torch.Size(s).numel()) for s in row_shapes]
        val_sizes = [m * r for m, r in zip(most, row_numels)]
        idx = torch.zeros(sum(idx_sizes), dtype=torch.int64, device=device)
        vals = torch.zeros(sum(val_sizes), dtype=self._params[0].dtype, device=device)
        for k, g in enumerate(coalesced):
            if g is None or g._nnz() == 0:
                continue
            n = g._nnz()
            i_block = idx[sum(idx_sizes[:k]):sum(idx_sizes[:k + 1])].view(sparse_dims[k], most[k])
            i_block[:, :n].copy_(g._indices())
            v_block = vals[sum(val_sizes[:k]):sum(val_sizes[:k + 1])].view(most[k], row_numels[k])
            v_block[:n].copy_(g._values().reshape(n, -1))  # torch's sparse tensor  # noqa: SLF001
        if prescale != 1.0:
            vals.mul_(prescale)
        all_idx = torch.empty(world * idx.numel(), dtype=idx.dtype, device=device)
        all_vals = torch.empty(world * vals.numel(), dtype=vals.dtype, device=device)
        works = [comm.all_gather(idx, all_idx), comm.all_gather(vals, all_vals)]
        for work in works:
            work.wait()
        all_idx, all_vals = all_idx.view(world, -1), all_vals.view(world, -1)
        out: list[Optional[torch.Tensor]] = []
        for k, p in enumerate(self._params):
            if all(c[k] < 0 for c in every_counts):
                out.append(None)               # no rank produced a gradient
                continue
            pieces_i, pieces_v = [], []
            for r in range(world):
                n = every_counts[r][k]
                if n <= 0:
                    continue
                i_block = all_idx[r, sum(idx_sizes[:k]):sum(idx_sizes[:k + 1])]
                v_block = all_vals[r, sum(val_sizes[:k]):sum(val_sizes[:k + 1])]
                pieces_i.append(i_block.view(sparse_dims[k], most[k])[:, :n])
                pieces_v.append(v_block.view(most[k], row_numels[k])[:n]
                                .reshape(n, *row_shapes[k]))
            if pieces_i:
                indices, values = torch.cat(pieces_i, 1), torch.cat(pieces_v, 0)
            else:
                indices = torch.zeros(sparse_dims[k], 0, dtype=torch.int64, device=device)
                values = torch.zeros(0, *row_shapes[k], dtype=p.dtype, device=device)
            if postscale != 1.0:
                values = values * postscale
            out.append(torch.sparse_coo_tensor(indices, values, p.shape,
                                               check_invariants=False).coalesce())
        return out

    # ------------------------------------------------------------------------ after averaging
    def apply(self, optimizer: Any, grad_scaler: Optional[Any] = None) -> None:
        """step(): the wrapped optimizer's update of the sparse parameters only, now, with the
        averaged gradients; the rank's own .grad is put back. (A GradScaler never gets here:
        step()'s pre-hook refuses it.)"""
        if len(self._averaged) != len(self._params):
            return                             # nothing was averaged in this step
        mine = set(self._params)
        groups = optimizer.param_groups
        originals = [g["params"] for g in groups]
        saved = [p.grad for p in self._params]
        try:
            for p, g in zip(self._params, self._averaged):
                p.grad = g
            for g in groups:
                g["params"] = [p for p in g["params"] if p in mine]
            optimizer.dear_engine.inner_step(optimizer)
        finally:
            for g, original in zip(groups, originals):
                g["params"] = original
            for p, g in zip(self._params, saved):
                p.grad = g
            self._averaged = []

    def to_grad(self) -> None:
        """synchronize(): the averaged sparse gradients in .grad, as Horovod leaves them."""
        if len(self._averaged) != len(self._params):
            return
        for p, g in zip(self._params, self._averaged):
            p.grad = g
        self._averaged = []

    def _no_clip(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise NotImplementedError(
            "optimizer.clip_grad_norm_() computes the norm from dear's dense buckets, which do "
            "not hold the sparse gradients. Use Horovod's pattern: optimizer.synchronize(); "
            "torch.nn.utils.clip_grad_norm_(...); with optimizer.skip_synchronize(): "
            "optimizer.step()")


def _refuse_grad_scaler(optimizer: Any, args: Any, kwargs: dict[str, Any]) -> None:
    """Before step() does anything: GradScaler's unscale and inf check run on dear's dense
    shards, which do not hold the sparse gradients."""
    if kwargs.get("grad_scaler") is not None:
        raise NotImplementedError("GradScaler with sparse gradients (Embedding(sparse=True)) is "
                                  "not supported by dear.DistributedOptimizer")


def _remove(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()
