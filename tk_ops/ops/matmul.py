"""GEMM: ``tk.matmul(a, b)`` and ``tk.linear(x, weight, bias)``.

Forward ops
  tk::matmul(Tensor a, Tensor b) -> Tensor                        a (M, K), b (K, N) -> (M, N)
  tk::linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor     x (M, K), weight (N, K) -> (M, N)
Backward ops (the same GEMM kernel, operands passed as transposed views, no copies)
  tk::matmul_bwd(Tensor grad, Tensor a, Tensor b, bool[2] output_mask) -> (Tensor, Tensor)
      grad_a = grad @ b^T, grad_b = a^T @ grad
  tk::linear_bwd(Tensor grad, Tensor x, Tensor weight, bool[3] output_mask) -> (Tensor, Tensor, Tensor)
      grad_x = grad @ weight, grad_weight = grad^T @ x, grad_bias = grad.sum(0)
A gradient that is not asked for (output_mask False) comes back as an empty tensor.

Operands may be row- or column-major (a transposed view is read without a copy); bf16/fp16 run on
the kernel with fp32 accumulation and outputs in the input dtype; fp32/fp64 run the reference.
"""

from __future__ import annotations

from typing import Optional

import torch

from tk_ops import _checks, _library
from tk_ops._autocast import autocast_inputs


def _unit_stride_either_way(t: torch.Tensor) -> torch.Tensor:
    """A 2-D GEMM operand may be row-major or column-major; any other layout is copied."""
    if t.stride(-1) == 1 or t.stride(-2) == 1:
        return t
    return t.contiguous()


# ----------------------------------------------------------------------------------- reference


def _matmul_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.matmul(a, b).contiguous()


def _matmul_fake(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.new_empty((a.shape[0], b.shape[1]))


def _matmul_bwd_reference(grad, a, b, output_mask):
    grad_a = torch.matmul(grad, b.mT).contiguous() if output_mask[0] else a.new_empty(0)
    grad_b = torch.matmul(a.mT, grad).contiguous() if output_mask[1] else b.new_empty(0)
    return grad_a, grad_b


def _matmul_bwd_fake(grad, a, b, output_mask):
    grad_a = a.new_empty(a.shape) if output_mask[0] else a.new_empty(0)
    grad_b = b.new_empty(b.shape) if output_mask[1] else b.new_empty(0)
    return grad_a, grad_b


def _linear_reference(x, weight, bias):
    return torch.nn.functional.linear(x, weight, bias).contiguous()


def _linear_fake(x, weight, bias):
    return x.new_empty((x.shape[0], weight.shape[0]))


def _linear_bwd_reference(grad, x, weight, output_mask):
    grad_x = torch.matmul(grad, weight).contiguous() if output_mask[0] else x.new_empty(0)
    grad_weight = torch.matmul(grad.mT, x).contiguous() if output_mask[1] else weight.new_empty(0)
    grad_bias = grad.sum(0, dtype=torch.promote_types(grad.dtype, torch.float32)).to(grad.dtype) if output_mask[2] else grad.new_empty(0)
    return grad_x, grad_weight, grad_bias


def _linear_bwd_fake(grad, x, weight, output_mask):
    grad_x = x.new_empty(x.shape) if output_mask[0] else x.new_empty(0)
    grad_weight = weight.new_empty(weight.shape) if output_mask[1] else weight.new_empty(0)
    grad_bias = grad.new_empty(grad.shape[1]) if output_mask[2] else grad.new_empty(0)
    return grad_x, grad_weight, grad_bias


matmul_op = _library.define(
    "matmul", "(Tensor a, Tensor b) -> Tensor", reference=_matmul_reference, fake=_matmul_fake
)
matmul_bwd_op = _library.define(
    "matmul_bwd",
    "(Tensor grad, Tensor a, Tensor b, bool[2] output_mask) -> (Tensor, Tensor)",
    reference=_matmul_bwd_reference,
    fake=_matmul_bwd_fake,
)
linear_op = _library.define(
    "linear", "(Tensor x, Tensor weight, Tensor? bias) -> Tensor", reference=_linear_reference, fake=_linear_fake
)
linear_bwd_op = _library.define(
    "linear_bwd",
    "(Tensor grad, Tensor x, Tensor weight, bool[3] output_mask) -> (Tensor, Tensor, Tensor)",
    reference=_linear_bwd_reference,
    fake=_linear_bwd_fake,
)


# ------------------------------------------------------------------------------------ autograd


_library.register_derivatives(matmul_op, "matmul_bwd(grad, a, b, mask) -> a, b")
_library.register_derivatives(linear_op, "linear_bwd(grad, x, weight, mask) -> x, weight, bias")


# ----------------------------------------------------------------------------------- public API


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for a (M, K) and b (K, N); either may be a transposed (column-major) view."""
    if not (_checks.uniform_floats(a, b, autocast=True) and a.dim() == 2 and b.dim() == 2 and b.shape[0] == a.shape[1]):
        _checks.check_tensor("a", a, ndim=2)
        _checks.check_tensor("b", b, ndim=2)
        a, b = autocast_inputs(a, b)
        _checks.check_same_device(a=a, b=b)
        _checks.check_same_dtype(a=a, b=b)
        _checks.check_dim("b", b, 0, a.shape[1], "a.shape[1] (K)")
    return matmul_op(_unit_stride_either_way(a), _unit_stride_either_way(b))


_LINEAR_RANKS = tuple(range(1, 9))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear``: x (..., K), weight (N, K), bias (N,) -> (..., N)."""
    if not (
        _checks.uniform_floats(x, weight, bias, autocast=True)
        and x.dim() in _LINEAR_RANKS
        and weight.dim() == 2
        and weight.shape[1] == x.shape[-1]
        and (bias is None or (bias.dim() == 1 and bias.shape[0] == weight.shape[0]))
    ):
        _checks.check_tensor("x", x, ndim=_LINEAR_RANKS)
        _checks.check_tensor("weight", weight, ndim=2)
        _checks.check_optional("bias", bias, ndim=1)
        x, weight, bias = autocast_inputs(x, weight, bias)
        _checks.check_same_device(x=x, weight=weight, bias=bias)
        _checks.check_same_dtype(x=x, weight=weight, bias=bias)
        _checks.check_dim("weight", weight, 1, x.shape[-1], "x.shape[-1] (in_features)")
        if bias is not None:
            _checks.check_dim("bias", bias, 0, weight.shape[0], "weight.shape[0] (out_features)")
    if x.dim() == 2:  # rows already: no reshape and view (each an autograd node when x requires grad)
        return linear_op(_unit_stride_either_way(x), _unit_stride_either_way(weight), bias)
    rows = x.reshape(-1, x.shape[-1])
    out = linear_op(_unit_stride_either_way(rows), _unit_stride_either_way(weight), bias)
    return out.view(*x.shape[:-1], weight.shape[0])
