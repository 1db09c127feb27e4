"""RMSNorm with a fused residual add: ``tk.rms_norm`` (the Llama / ``torch.nn.RMSNorm`` definition).

Forward op
  tk::rms_norm(Tensor x, Tensor? weight, Tensor? residual, float eps)
      -> (Tensor out, Tensor h, Tensor rstd)
      h    = x + residual                              (residual optional)
      rstd = 1 / sqrt(mean(h^2) + eps)                 over the last dim
      out  = round_to_x_dtype(round_to_x_dtype(h * rstd) * weight)
  Normalise in fp32, cast to x's dtype, then multiply by the weight (in fp32, rounded once more),
  exactly as Hugging Face's LlamaRMSNorm and ``torch.nn.functional.rms_norm`` do with a weight
  in x's dtype.
Backward op
  tk::rms_norm_bwd(Tensor grad_out, Tensor? grad_h, Tensor h, Tensor? weight, Tensor rstd,
                   bool[3] output_mask) -> (Tensor grad_x, Tensor grad_residual, Tensor grad_weight)
      xhat = h * rstd,  g = grad_out * weight
      dh   = rstd * (g - xhat * mean(g * xhat)) + grad_h
      grad_x = grad_residual = dh (each in its own dtype)
      grad_weight = sum over rows of grad_out * round_to_x_dtype(xhat)
  (the cast to x's dtype between normalising and weighting is treated as the identity, as
  autograd does for ``.to()``). ``output_mask`` says which of (grad_x, grad_residual,
  grad_weight) to compute; the others come back as empty tensors.

Shapes and dtypes
  x (..., C), any leading dims and strides with a unit last stride; weight (C,) in x's dtype or
  fp32; residual like x, in x's dtype or fp32. out: x's dtype. rstd: x's leading shape, fp32
  (fp64 for fp64 x, which only the reference accepts). Math in fp32 (fp64 for fp64 x).
  h has x's dtype, or fp32 when residual is fp32; the norm reads h after rounding it to that
  dtype, so out == RMSNorm(h) for the h returned (eager ``h = x + residual; norm(h)``).
  grad_x has grad_out's dtype (x's), grad_residual h's dtype, grad_weight weight's dtype
  (reduced over rows in fp32).

When h is materialised: only with a residual, for the reasons given in ``tk_ops.ops.layer_norm``
(without one the op returns ``x.new_empty(0)`` and the backward receives x as ``h``).
"""

from __future__ import annotations

from typing import Optional

import torch

from tk_ops import _checks, _library
from tk_ops.ops import layer_norm as layer_norm_module  # its _plain_norm_arguments, looked up per call
from tk_ops.ops.layer_norm import check_norm_arguments, stream_dtype

# ----------------------------------------------------------------------------------- reference


def _rms_norm_reference(x, weight, residual, eps):
    compute = _checks.compute_dtype(x.dtype)
    stream = x.to(compute)
    if residual is not None:
        stream = stream + residual.to(compute)
    h = stream.to(stream_dtype(x, residual))
    normed_input = h.to(compute)
    rstd = torch.rsqrt(normed_input.square().mean(-1, keepdim=True) + eps)
    out = (normed_input * rstd).to(x.dtype)
    if weight is not None:
        out = (out.to(compute) * weight.to(compute)).to(x.dtype)
    h_out = h.contiguous() if residual is not None else x.new_empty(0)
    return out.contiguous(), h_out, rstd.squeeze(-1).contiguous()


def _rms_norm_fake(x, weight, residual, eps):
    h = x.new_empty(x.shape, dtype=stream_dtype(x, residual)) if residual is not None else x.new_empty(0)
    return x.new_empty(x.shape), h, x.new_empty(x.shape[:-1], dtype=_checks.compute_dtype(x.dtype))


def _rms_norm_bwd_reference(grad_out, grad_h, h, weight, rstd, output_mask):
    compute = _checks.compute_dtype(h.dtype)
    grad = grad_out.to(compute)
    rstd = rstd.to(compute).unsqueeze(-1)
    xhat = h.to(compute) * rstd
    grad_xhat = grad * weight.to(compute) if weight is not None else grad
    grad_h_total = rstd * (grad_xhat - xhat * (grad_xhat * xhat).mean(-1, keepdim=True))
    if grad_h is not None:
        grad_h_total = grad_h_total + grad_h.to(compute)
    grad_x, grad_residual, grad_weight = (grad_out.new_empty(0) for _ in range(3))
    if output_mask[0]:
        grad_x = grad_h_total.to(grad_out.dtype).contiguous()
    if output_mask[1]:
        # a copy: grad_x may be grad_h_total itself, and outputs must not alias each other
        grad_residual = grad_h_total.to(h.dtype, memory_format=torch.contiguous_format, copy=True)
    if output_mask[2]:
        weighted_input = xhat.to(grad_out.dtype).to(compute)
        grad_weight = (grad * weighted_input).reshape(-1, h.shape[-1]).sum(0).to(weight.dtype)
    return grad_x, grad_residual, grad_weight


def _rms_norm_bwd_fake(grad_out, grad_h, h, weight, rstd, output_mask):
    grad_x = grad_out.new_empty(h.shape) if output_mask[0] else grad_out.new_empty(0)
    grad_residual = h.new_empty(h.shape) if output_mask[1] else grad_out.new_empty(0)
    grad_weight = weight.new_empty(weight.shape) if output_mask[2] else grad_out.new_empty(0)
    return grad_x, grad_residual, grad_weight


rms_norm_op = _library.define(
    "rms_norm",
    "(Tensor x, Tensor? weight, Tensor? residual, float eps) -> (Tensor out, Tensor h, Tensor rstd)",
    reference=_rms_norm_reference,
    fake=_rms_norm_fake,
)
rms_norm_bwd_op = _library.define(
    "rms_norm_bwd",
    "(Tensor grad_out, Tensor? grad_h, Tensor h, Tensor? weight, Tensor rstd, bool[3] output_mask)"
    " -> (Tensor grad_x, Tensor grad_residual, Tensor grad_weight)",
    reference=_rms_norm_bwd_reference,
    fake=_rms_norm_bwd_fake,
)


# ------------------------------------------------------------------------------------ autograd


# As layer_norm's: rstd is not differentiable, nor h without a residual (the backward then gets x as h).
_library.register_derivatives(
    rms_norm_op,
    "rms_norm_bwd(grad_out, grad_h, h if residual else x, weight, rstd, mask) -> x, residual, weight if grad_out",
    differentiable="out, h if residual",
    materialize_grads=False,
    zeros="grad_out like h",
)


# ----------------------------------------------------------------------------------- public API


def rms_norm(
    x: torch.Tensor,
    weight: Optional[torch.Tensor],
    eps: float = 1e-6,
    *,
    residual: Optional[torch.Tensor] = None,
    return_residual: bool = False,
):
    """RMSNorm over the last dim of ``h = x + residual`` (normalised in fp32, cast, times weight).

    Returns ``out`` in x's dtype, or ``(out, h)`` with ``return_residual=True``: h is the pre-norm
    residual stream in x's dtype (fp32 when residual is fp32).
    """
    if _library.EXTENSION is not None and not torch.compiler.is_compiling():
        # Plain eager CUDA calls in C++ (csrc/torch/fast_entry.cpp); None: take the path below.
        result = _library.EXTENSION.rms_norm(x, weight, eps, residual, return_residual)
        if result is not None:
            return result
    if not layer_norm_module._plain_norm_arguments(x, residual, eps, weight):
        check_norm_arguments(x, residual, eps, weight=weight)
        eps = float(eps)
    x, weight, residual = (_checks.unit_last_stride(t) for t in (x, weight, residual))
    out, h, _ = rms_norm_op(x, weight, residual, eps)
    if not return_residual:
        return out
    if residual is None:
        h = x.clone(memory_format=torch.contiguous_format)
    return out, h
