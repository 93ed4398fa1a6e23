"""Per-layer factor math: how a module's input and output gradient become its K-FAC factors, and
how its weight (and bias) gradient is read as one matrix and written back.

Conventions are kfac-pytorch's (KAISA), so figures compare with the system users know:
  Linear:    a = input rows (+ a column of ones with a bias), A = a^T a / rows;
             g = output-gradient rows exactly as autograd delivers them, G = g^T g / rows.
  Conv2d:    a = im2col patches (batch*out_h*out_w rows, in_c*kh*kw [+1] columns), divided by
             out_h*out_w (the ones column too, as kfac-pytorch appends it before dividing);
             g = output gradients as rows of out_channels divided by out_h*out_w.
  Embedding: the input is one-hot, so A = diag(token counts) / tokens is DIAGONAL and is kept
             as a vector; G as for Linear. The weight (vocab, dim) is the transpose of the
             equivalent Linear's, so its gradient matrix is weight.grad^T (dim x vocab).
The gradient matrix is (out, in[*kh*kw]) with the bias gradient as its last column.
Batch factors are symmetrised ((F + F^T) / 2) so that sending only the upper triangle is exact.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def factor_dtype(t: Tensor) -> torch.dtype:
    """Factors are kept in float32 (float64 for float64 models), whatever the activations are."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def covariance(rows: Tensor) -> Tensor:
    """rows^T rows / len(rows), exactly symmetric."""
    cov = rows.t() @ (rows / rows.shape[0])
    return (cov + cov.t()) / 2


class KFACLayer:
    """One supported module. Subclasses say how its tensors become factor rows."""

    kind = "layer"
    diagonal_a = False   # A kept as a vector (Embedding)

    def __init__(self, name: str, module: nn.Module) -> None:
        self.name = name
        self.module = module

    @property
    def weight(self) -> Tensor:
        return self.module.weight  # type: ignore[return-value]

    @property
    def bias(self) -> Tensor | None:
        bias = getattr(self.module, "bias", None)
        return bias if isinstance(bias, Tensor) and bias.requires_grad else None

    @property
    def a_dim(self) -> int:
        raise NotImplementedError

    @property
    def g_dim(self) -> int:
        raise NotImplementedError

    def batch_a(self, x: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        """This pass's A, in `dtype` (default: factor_dtype of the input)."""
        raise NotImplementedError

    def batch_g(self, g: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        raise NotImplementedError

    def matrix_of(self, weight: Tensor, bias: Tensor | None) -> Tensor:
        """(g_dim, a_dim): a weight-shaped tensor with a bias-shaped one as the last column (the
        gradient, or anything laid out like it: a fusion bucket's slots)."""
        m = weight.reshape(weight.shape[0], -1)
        if bias is not None:
            m = torch.cat([m, bias.reshape(-1, 1)], dim=1)
        return m

    def write_matrix(self, matrix: Tensor, weight: Tensor, bias: Tensor | None) -> None:
        """The inverse of matrix_of: copy a (g_dim, a_dim) matrix into the two tensors."""
        n = weight[0].numel()
        weight.copy_(matrix[:, :n].reshape(weight.shape))
        if bias is not None:
            bias.copy_(matrix[:, n].reshape(bias.shape))

    def grad_matrix(self) -> Tensor | None:
        """The gradient as matrix_of lays it out; None when the weight has no gradient (the
        layer took no part in the loss)."""
        w = self.weight.grad
        if w is None:
            return None
        b = None
        if self.bias is not None:
            b = self.bias.grad if self.bias.grad is not None else torch.zeros_like(self.bias)
        return self.matrix_of(w, b)

    def set_grad(self, matrix: Tensor) -> None:
        """Write a (g_dim, a_dim) matrix back into .grad (in place, keeping the tensors)."""
        assert self.weight.grad is not None
        if self.bias is not None and self.bias.grad is None:
            self.bias.grad = torch.zeros_like(self.bias)
        self.write_matrix(matrix, self.weight.grad,
                          None if self.bias is None else self.bias.grad)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, A {self.a_dim}, G {self.g_dim})"


class LinearLayer(KFACLayer):
    kind = "Linear"

    @property
    def a_dim(self) -> int:
        return self.weight.shape[1] + (self.bias is not None)

    @property
    def g_dim(self) -> int:
        return self.weight.shape[0]

    def batch_a(self, x: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        a = x.detach().reshape(-1, x.shape[-1]).to(dtype or factor_dtype(x))
        if self.bias is not None:
            a = torch.cat([a, a.new_ones(a.shape[0], 1)], dim=1)
        return covariance(a)

    def batch_g(self, g: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        return covariance(g.detach().reshape(-1, g.shape[-1]).to(dtype or factor_dtype(g)))


class Conv2dLayer(KFACLayer):
    kind = "Conv2d"

    @property
    def module_conv(self) -> nn.Conv2d:
        return self.module  # type: ignore[return-value]

    @property
    def a_dim(self) -> int:
        return self.weight[0].numel() + (self.bias is not None)

    @property
    def g_dim(self) -> int:
        return self.weight.shape[0]

    def batch_a(self, x: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        m = self.module_conv
        patches = F.unfold(x.detach(), m.kernel_size, dilation=m.dilation,
                           padding=_padding(m), stride=m.stride)      # (N, C*kh*kw, L)
        spatial = patches.shape[-1]
        a = patches.transpose(1, 2).reshape(-1, patches.shape[1]).to(dtype or factor_dtype(x))
        if self.bias is not None:
            a = torch.cat([a, a.new_ones(a.shape[0], 1)], dim=1)
        return covariance(a / spatial)

    def batch_g(self, g: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        spatial = g.shape[2] * g.shape[3]
        rows = g.detach().permute(0, 2, 3, 1).reshape(-1, g.shape[1]).to(dtype or factor_dtype(g))
        return covariance(rows / spatial)


class EmbeddingLayer(KFACLayer):
    kind = "Embedding"
    diagonal_a = True

    @property
    def bias(self) -> Tensor | None:
        return None

    @property
    def a_dim(self) -> int:
        return self.weight.shape[0]

    @property
    def g_dim(self) -> int:
        return self.weight.shape[1]

    def batch_a(self, x: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        counts = torch.bincount(x.detach().reshape(-1), minlength=self.a_dim)
        return counts.to(dtype or factor_dtype(self.weight)) / x.numel()

    def batch_g(self, g: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        return covariance(g.detach().reshape(-1, g.shape[-1]).to(dtype or factor_dtype(g)))

    def matrix_of(self, weight: Tensor, bias: Tensor | None) -> Tensor:
        return weight.t()

    def write_matrix(self, matrix: Tensor, weight: Tensor, bias: Tensor | None) -> None:
        weight.copy_(matrix.t())


def _padding(conv: nn.Conv2d) -> tuple[int, int]:
    if conv.padding == "valid":
        return (0, 0)
    if conv.padding == "same":
        pad = [d * (k - 1) // 2 for d, k in zip(conv.dilation, conv.kernel_size)]
        return pad[0], pad[1]
    return conv.padding  # type: ignore[return-value]


def unsupported_reason(module: nn.Module) -> str | None:
    """Why a Linear/Conv2d/Embedding cannot be preconditioned; None when it can."""
    if isinstance(module, nn.Conv2d):
        if module.groups != 1:
            return f"groups={module.groups} (only groups=1)"
        if module.padding_mode != "zeros":
            return f"padding_mode={module.padding_mode!r} (only 'zeros')"
        if module.padding == "same" and any(d * (k - 1) % 2 for d, k in
                                            zip(module.dilation, module.kernel_size)):
            return "padding='same' with an even effective kernel (asymmetric padding)"
    if isinstance(module, nn.Embedding) and module.sparse:
        return "sparse=True (sparse gradients)"
    if isinstance(module, (nn.Linear, nn.Conv2d, nn.Embedding)) and not module.weight.requires_grad:
        return "frozen weight"
    return None


def make_layer(name: str, module: nn.Module) -> KFACLayer | None:
    """The K-FAC view of `module`, or None when it is not a supported layer."""
    if unsupported_reason(module) is not None:
        return None
    if type(module) is nn.Linear or isinstance(module, nn.Linear):
        return LinearLayer(name, module)
    if isinstance(module, nn.Conv2d):
        return Conv2dLayer(name, module)
    if isinstance(module, nn.Embedding):
        return EmbeddingLayer(name, module)
    return None
