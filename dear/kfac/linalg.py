"""Turning factors into preconditioners, and preconditioning one gradient matrix.

Definitions (kfac-pytorch's):
  eigen:   A = QA diag(dA) QA^T, G = QG diag(dG) QG^T (eigenvalues clamped at 0),
           P(grad) = QG [ (QG^T grad QA) / (dG dA^T + damping) ] QA^T
  inverse: P(grad) = (G + damping I)^-1 grad (A + damping I)^-1
A diagonal factor (Embedding's A) is its own eigendecomposition: Q = I, d = the diagonal.

A `Decomposition` is what one factor contributes; it travels between ranks as one flat tensor
(`flatten` / `unflatten`), so its layout is fixed by the method and the factor's size.

Every tensor of a Decomposition is contiguous (row-major). eigh and inv return column-major
matrices; a rank that receives one gets a row-major copy of the same values, and a matrix
product rounds differently with the other layout. Making the decomposing rank copy too keeps
replicas bitwise equal (the same bits, the same layout, the same products on every rank).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from .enums import ComputeMethod


class DecompositionError(RuntimeError):
    """A factor could not be decomposed (non-finite, or the solver did not converge)."""


@dataclasses.dataclass
class Decomposition:
    """EIGEN: q (None for a diagonal factor) and d. INVERSE: inv (a vector when diagonal)."""

    method: ComputeMethod
    q: Tensor | None = None
    d: Tensor | None = None
    inv: Tensor | None = None


def flat_size(method: ComputeMethod, dim: int, diagonal: bool) -> int:
    """Elements of a decomposition of a dim x dim factor when sent as one flat tensor."""
    if diagonal:
        return dim
    return dim * dim + dim if method is ComputeMethod.EIGEN else dim * dim


def decompose(factor: Tensor, method: ComputeMethod, damping: float,
              diagonal: bool = False, dtype: torch.dtype | None = None) -> Decomposition:
    """The decomposition of one (running-average) factor, stored in `dtype` (default: the
    factor's; kfac-pytorch's inv_dtype). Raises DecompositionError rather than returning
    something non-finite."""
    if factor.dtype.itemsize < 4:            # half precision: decomposed in float32
        factor = factor.float()
    result = _decompose(factor, method, damping, diagonal)
    out = dtype or factor.dtype
    return Decomposition(method, *(None if t is None else t.to(out).contiguous()
                                   for t in (result.q, result.d, result.inv)))


def _decompose(factor: Tensor, method: ComputeMethod, damping: float,
               diagonal: bool) -> Decomposition:
    if not torch.isfinite(factor).all():
        raise DecompositionError("factor has non-finite entries")
    if diagonal:
        if method is ComputeMethod.EIGEN:
            return Decomposition(method, None, factor.clamp(min=0.0))
        return Decomposition(method, inv=1.0 / (factor + damping))
    if method is ComputeMethod.EIGEN:
        try:
            d, q = torch.linalg.eigh(factor)
        except RuntimeError as exc:      # torch.linalg.LinAlgError subclasses RuntimeError
            raise DecompositionError(f"eigendecomposition failed: {exc}") from None
        result = Decomposition(method, q, d.clamp(min=0.0))
    else:
        eye = torch.eye(factor.shape[0], dtype=factor.dtype, device=factor.device)
        try:
            inv = torch.linalg.inv(factor + damping * eye)
        except RuntimeError as exc:
            raise DecompositionError(f"inverse failed: {exc}") from None
        result = Decomposition(method, inv=inv)
    if not all(torch.isfinite(t).all() for t in (result.q, result.d, result.inv) if t is not None):
        raise DecompositionError("decomposition has non-finite entries")
    return result


def flatten(dec: Decomposition, out: Tensor) -> None:
    """Write `dec` into the flat tensor `out` (numel = flat_size)."""
    parts = [t.reshape(-1) for t in (dec.q, dec.d, dec.inv) if t is not None]
    torch.cat(parts, out=out) if len(parts) > 1 else out.copy_(parts[0])


def unflatten(flat: Tensor, method: ComputeMethod, dim: int, diagonal: bool) -> Decomposition:
    if diagonal:
        return (Decomposition(method, None, flat.clone()) if method is ComputeMethod.EIGEN
                else Decomposition(method, inv=flat.clone()))
    if method is ComputeMethod.EIGEN:
        return Decomposition(method, flat[:dim * dim].reshape(dim, dim).clone(),
                             flat[dim * dim:].clone())
    return Decomposition(method, inv=flat.reshape(dim, dim).clone())


def precondition(grad: Tensor, a: Decomposition, g: Decomposition, damping: float) -> Tensor:
    """P(grad) for a (g_dim, a_dim) gradient matrix."""
    grad = grad.to(g.d.dtype if g.d is not None else g.inv.dtype)  # type: ignore[union-attr]
    if g.method is ComputeMethod.EIGEN:
        assert g.q is not None and g.d is not None and a.d is not None
        v = g.q.t() @ grad
        v = v @ a.q if a.q is not None else v
        v = v / (g.d.unsqueeze(1) * a.d.unsqueeze(0) + damping)
        v = g.q @ v
        return v @ a.q.t() if a.q is not None else v
    assert g.inv is not None and a.inv is not None
    v = g.inv @ grad
    return v * a.inv.unsqueeze(0) if a.inv.dim() == 1 else v @ a.inv
