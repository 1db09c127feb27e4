"""Based linear attention: ``tk.based_attention(q, k, v)``, causal, with the Taylor feature map.

phi(x) = [1, x / F**0.25, vec(x x^T) / (sqrt(2) * sqrt(F))], so that with s = q . k / sqrt(F)
    phi(q) . phi(k) = 1 + s + s^2 / 2          (2nd-order Taylor expansion of exp(s)), and
    out_i = sum_{j<=i} (phi(q_i) . phi(k_j)) v_j / (sum_{j<=i} phi(q_i) . phi(k_j) + eps)
with normalize=True (the numerator alone with normalize=False). 1 + s + s^2/2 >= 1/2, so the
denominator is positive. q, k (B, H, N, F); v (B, H, N, Dv); out (B, H, N, Dv), input dtype.

Forward op
  tk::based_attention(Tensor q, Tensor k, Tensor v, float eps, bool normalize)
      -> (Tensor out, Tensor denominator)
  denominator_i = sum_{j<=i} phi(q_i) . phi(k_j) (eps not added), (B, H, N) in fp32 (fp64 for
  fp64 inputs); with normalize=False it is not computed and comes back empty (shape (0,)).
  It is not differentiable.
Backward op
  tk::based_attention_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out,
                          Tensor denominator, float eps, bool normalize)
      -> (Tensor grad_q, Tensor grad_k, Tensor grad_v)
  out and denominator are the forward's outputs, read only with normalize=True.

Gradients: those of tk.linear_attention (see linear_attention.py: the normalised case runs the
unnormalised formulas on v' = [v, 1], g' = [g / d, -(g . out) / d]) with A_ij = f(s_ij),
f(s) = 1 + s + s^2/2, s_ij = q_i . k_j / sqrt(F). A kernel working on scores uses
  dA_ij = g'_i . v'_j (j <= i),  ds_ij = dA_ij (1 + s_ij),
  grad_q = ds k / sqrt(F),  grad_k = ds^T q / sqrt(F),  grad_v = A^T g';
the chunked reference carries the same sums through the moment state sum_j phi(k_j) v_j^T of
size (1 + F + F^2) x Dv (its 0th, 1st and 2nd-order blocks) and differentiates phi directly.

Kernels: the forward runs a Hopper kernel (csrc/kernels/based_attention) for bf16/fp16 on a
GPU of compute capability 9.0 with F = 16 and Dv a multiple of 32 up to 256 (strided views with a
unit last stride and 16-byte aligned strides, any N >= 1). The backward runs Hopper kernels on the
same inputs (grad_out, and out when normalising, under v's layout rules; denominator fp32 and
contiguous): a per-row statistics kernel (normalised only: 1/d and -(g . out)/d), a forward
sweep for grad_q, a reverse sweep for grad_k and grad_v (both per 32 value columns, phi only in
registers) and a kernel that adds the per-value-block fp32 partials of grad_q and grad_k; the
gradients come back contiguous in the input dtype. Everything else (CPU, fp32/fp64, other F or
Dv, other layouts) runs the reference, which accepts any F and Dv (on a GPU with a one-time
warning).

flash-linear-attention computes the same thing: its parallel_based / fused_chunk_based apply
the Taylor map inside as s = (q * scale) . k, 1 + s + s^2/2, with scale defaulting to F**-0.5,
which is our phi. They take the (B, N, H, F) layout and divide by (z + 1e-6), so our numbers
with eps=1e-6 are
  o = fla.ops.based.parallel_based(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                   scale=None, use_norm=normalize).transpose(1, 2)
and likewise fused_chunk_based (F <= 16). fla rounds o (and, in parallel_based, z) to the input
dtype before dividing, so bf16 results differ at the bf16 rounding level.
"""

from __future__ import annotations

import math

import torch

from tk_ops import _checks, _library
from tk_ops.ops import linear_attention as _linear

CHUNK_SIZE = 64


def _taylor_features(x: torch.Tensor) -> torch.Tensor:
    scaled = x * x.shape[-1] ** -0.25
    second_order = (scaled.unsqueeze(-1) * scaled.unsqueeze(-2)).flatten(-2) / math.sqrt(2.0)
    return torch.cat([scaled.new_ones(*scaled.shape[:-1], 1), scaled, second_order], dim=-1)


def _taylor_features_vjp(x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    features = x.shape[-1]
    scale = features**-0.25
    scaled = x * scale
    grad_outer = grad[..., 1 + features :].unflatten(-1, (features, features))
    # d/dx of sum_ab G_ab x_a x_b = (G + G^T) x
    grad_second_order = torch.matmul(grad_outer + grad_outer.mT, scaled.unsqueeze(-1)).squeeze(-1) / math.sqrt(2.0)
    return (grad[..., 1 : 1 + features] + grad_second_order) * scale


TAYLOR = _linear.FeatureMap(dim=lambda f: 1 + f + f * f, features=_taylor_features, features_vjp=_taylor_features_vjp)


# ----------------------------------------------------------------------------------- reference


def _based_attention_reference(q, k, v, eps, normalize):
    return _linear.causal_attention_reference(q, k, v, eps, normalize, TAYLOR, CHUNK_SIZE)


def _based_attention_bwd_reference(grad_out, q, k, v, out, denominator, eps, normalize):
    return _linear.causal_attention_backward_reference(
        grad_out, q, k, v, out, denominator, eps, normalize, TAYLOR, CHUNK_SIZE
    )


based_attention_op = _library.define(
    "based_attention",
    "(Tensor q, Tensor k, Tensor v, float eps, bool normalize) -> (Tensor out, Tensor denominator)",
    reference=_based_attention_reference,
    fake=_linear.forward_fake,
)
based_attention_bwd_op = _library.define(
    "based_attention_bwd",
    "(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor denominator, float eps, bool normalize)"
    " -> (Tensor grad_q, Tensor grad_k, Tensor grad_v)",
    reference=_based_attention_bwd_reference,
    fake=_linear.backward_fake,
)


# ------------------------------------------------------------------------------------ autograd

_linear.register_derivatives(based_attention_op, "based_attention_bwd")


# ----------------------------------------------------------------------------------- public API


def based_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, eps: float = 1e-12, normalize: bool = True
) -> torch.Tensor:
    """Causal Based attention: q, k (B, H, N, F), v (B, H, N, Dv) -> (B, H, N, Dv).

    Scores phi(q_i) . phi(k_j) = 1 + s + s^2/2 with s = q_i . k_j / sqrt(F); the output is
    normalised by their causal row sum + eps unless ``normalize=False``.
    """
    _linear.check_inputs(q, k, v, eps)
    q, k, v = (_checks.unit_last_stride(t) for t in (q, k, v))
    out, _ = based_attention_op(q, k, v, float(eps), bool(normalize))
    return out
