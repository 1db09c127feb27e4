"""Causal linear attention: ``tk.linear_attention(q, k, v)`` on already feature-mapped q and k.

    out_i = sum_{j<=i} (q_i . k_j) v_j                                    normalize=False
    out_i = sum_{j<=i} (q_i . k_j) v_j / (sum_{j<=i} q_i . k_j + eps)     normalize=True
q, k (B, H, N, F); v (B, H, N, Dv); out (B, H, N, Dv) in the input dtype.

Forward op
  tk::linear_attention(Tensor q, Tensor k, Tensor v, float eps, bool normalize)
      -> (Tensor out, Tensor denominator)
  denominator_i = sum_{j<=i} q_i . k_j (eps not added), (B, H, N) in fp32 (fp64 for fp64
  inputs). It is what the normalised backward needs; with normalize=False it is not computed
  and comes back empty (shape (0,)). It is not differentiable.
Backward op
  tk::linear_attention_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out,
                           Tensor denominator, float eps, bool normalize)
      -> (Tensor grad_q, Tensor grad_k, Tensor grad_v)
  out and denominator are the forward's outputs; with normalize=False they are not read (the
  autograd formula passes empty tensors).

Gradients. Write A_ij = q_i . k_j (j <= i, 0 otherwise) and num = A v. Unnormalised, with
g = grad_out:
  dA_ij = g_i . v_j (j <= i);  grad_v = A^T g;  grad_q = dA k;  grad_k = dA^T q.
Normalised, out = num / d with d_i = denominator_i + eps, the output's gradient splits into
  grad_num_i = g_i / d_i   and   grad_den_i = -(g_i . out_i) / d_i,
and the denominator is the numerator of a value column of ones, so the unnormalised formulas
apply to v' = [v, 1] and g' = [grad_num, grad_den] (dropping the ones column of grad_v'). A
denominator near zero (q . k can be negative) is the caller's business; the unnormalised path
never divides.

The reference is chunked (CHUNK_SIZE positions): within a chunk the masked quadratic form,
across chunks a running state sum_j phi(k_j) v_j^T (forward, grad_q) or sum_i phi(q_i) g_i^T
(grad_k, grad_v, a reverse sweep), so memory stays O(N) for any N. The same engine serves
tk.based_attention with its Taylor feature map phi; here phi is the identity.

Kernels (csrc/kernels/linear_attention, Hopper sm_90a): the forward and backward ops, for bf16/fp16
q, k, v with F in {16, 32, 64, 128, 256}, Dv a multiple of 32 up to 256, any B, H and N >= 1, and
strided views with a unit last stride that TMA can describe (e.g. (B, N, H, F) storage transposed to
(B, H, N, F), or a column slice of v): no copies. The forward walks each sequence in chunks of 64
positions with the running state sum_j k_j v_j^T in fp32 tensor-core accumulators (read back through
a bf16/fp16 copy, so in fp16 the state's entries must stay below 65504) and the denominator's key sum
in fp32. The backward is four launches (no atomics, so bitwise reproducible): per-row statistics
1 / d and -(g . out) / d when normalising; a forward sweep for grad_q (state sum_j k_j v_j^T); a
reverse sweep for grad_k and grad_v (state sum_i q_i g_i^T / d_i); and a reduction of the fp32
per-32-value-column partials of grad_q and grad_k (a workspace of 2 * (Dv / 32) * B * H * N * F
floats). grad_out and out take v's layout rules. Everything else runs the reference (on a GPU with a
one-time warning): CPU, fp32/fp64, other F or Dv, strides TMA cannot take.

flash-linear-attention computes the same thing in the (B, N, H, F) layout with a fixed eps and
an output scale that defaults to F**-0.5; to get our numbers (eps=1e-10):
  o, _ = fla.ops.linear_attn.chunk_linear_attn(q.transpose(1, 2), k.transpose(1, 2),
                                               v.transpose(1, 2), scale=1.0, normalize=normalize)
  o = o.transpose(1, 2)   # likewise fused_chunk_linear_attn; fla divides by (q . cumsum k + 1e-10)
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch

from tk_ops import _checks, _library

CHUNK_SIZE = 64


class FeatureMap(NamedTuple):
    """A feature map phi applied to (..., C, F) chunks in the compute dtype, with its derivative."""

    dim: Callable[[int], int]  # F -> size of phi(x)
    features: Callable[[torch.Tensor], torch.Tensor]  # x -> phi(x)
    features_vjp: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x, dL/dphi(x)) -> dL/dx


IDENTITY = FeatureMap(dim=lambda f: f, features=lambda x: x, features_vjp=lambda x, grad: grad)



def check_inputs(q, k, v, eps) -> None:
    """The argument checks shared by linear_attention and based_attention."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _checks.check_tensor(name, t, ndim=4)
    _checks.check_same_device(q=q, k=k, v=v)
    _checks.check_same_dtype(q=q, k=k, v=v)
    for dim, what in enumerate(("q.shape[0] (batch)", "q.shape[1] (heads)", "q.shape[2] (sequence length)")):
        _checks.check_dim("k", k, dim, q.shape[dim], what)
        _checks.check_dim("v", v, dim, q.shape[dim], what)
    _checks.check_dim("k", k, 3, q.shape[3], "q.shape[3] (feature dim)")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"eps must be a float, got {type(eps).__name__}")
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")


# ----------------------------------------------------------------------------------- reference


def _with_ones_column(v: torch.Tensor) -> torch.Tensor:
    """[v, 1]: the denominator is the numerator of a value column of ones."""
    return torch.cat([v, v.new_ones(*v.shape[:-1], 1)], dim=-1)


def _new_state(q: torch.Tensor, v: torch.Tensor, feature_map: FeatureMap) -> torch.Tensor:
    return q.new_zeros(*q.shape[:-2], feature_map.dim(q.shape[-1]), v.shape[-1])


def _chunked_causal_product(q, k, v, feature_map: FeatureMap, chunk_size: int) -> torch.Tensor:
    """sum_{j<=i} (phi(q_i) . phi(k_j)) v_j for every i."""
    out = v.new_empty(v.shape)
    key_state = _new_state(q, v, feature_map)  # sum over earlier chunks of phi(k_j) v_j^T
    for start in range(0, q.shape[-2], chunk_size):
        rows = slice(start, start + chunk_size)
        phi_q, phi_k = feature_map.features(q[..., rows, :]), feature_map.features(k[..., rows, :])
        v_chunk = v[..., rows, :]
        scores = torch.matmul(phi_q, phi_k.mT).tril()
        out[..., rows, :] = torch.matmul(scores, v_chunk) + torch.matmul(phi_q, key_state)
        key_state += torch.matmul(phi_k.mT, v_chunk)
    return out


def _chunked_causal_product_backward(grad, q, k, v, feature_map: FeatureMap, chunk_size: int):
    """Gradients of _chunked_causal_product: a forward sweep for q, a reverse sweep for k and v."""
    grad_q, grad_k, grad_v = q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)
    starts = range(0, q.shape[-2], chunk_size)

    key_state = _new_state(q, v, feature_map)  # sum over earlier chunks of phi(k_j) v_j^T
    for start in starts:
        rows = slice(start, start + chunk_size)
        q_chunk, v_chunk, grad_chunk = q[..., rows, :], v[..., rows, :], grad[..., rows, :]
        phi_k = feature_map.features(k[..., rows, :])
        grad_scores = torch.matmul(grad_chunk, v_chunk.mT).tril()
        grad_phi_q = torch.matmul(grad_scores, phi_k) + torch.matmul(grad_chunk, key_state.mT)
        grad_q[..., rows, :] = feature_map.features_vjp(q_chunk, grad_phi_q)
        key_state += torch.matmul(phi_k.mT, v_chunk)

    query_state = _new_state(q, grad, feature_map)  # sum over later chunks of phi(q_i) g_i^T
    for start in reversed(starts):
        rows = slice(start, start + chunk_size)
        k_chunk, v_chunk, grad_chunk = k[..., rows, :], v[..., rows, :], grad[..., rows, :]
        phi_q, phi_k = feature_map.features(q[..., rows, :]), feature_map.features(k_chunk)
        scores = torch.matmul(phi_q, phi_k.mT).tril()
        grad_scores = torch.matmul(grad_chunk, v_chunk.mT).tril()
        grad_v[..., rows, :] = torch.matmul(scores.mT, grad_chunk) + torch.matmul(phi_k, query_state)
        grad_phi_k = torch.matmul(grad_scores.mT, phi_q) + torch.matmul(v_chunk, query_state.mT)
        grad_k[..., rows, :] = feature_map.features_vjp(k_chunk, grad_phi_k)
        query_state += torch.matmul(phi_q.mT, grad_chunk)
    return grad_q, grad_k, grad_v


def causal_attention_reference(q, k, v, eps: float, normalize: bool, feature_map: FeatureMap, chunk_size: int):
    """(out, denominator) of causal linear attention with feature map phi, in fp32 (fp64) math."""
    dtype = _checks.compute_dtype(q.dtype)
    q_c, k_c, v_c = q.to(dtype), k.to(dtype), v.to(dtype)
    if not normalize:
        out = _chunked_causal_product(q_c, k_c, v_c, feature_map, chunk_size)
        return out.to(v.dtype).contiguous(), q.new_empty(0, dtype=dtype)
    with_denominator = _chunked_causal_product(q_c, k_c, _with_ones_column(v_c), feature_map, chunk_size)
    numerator, denominator = with_denominator[..., :-1], with_denominator[..., -1]
    out = numerator / (denominator.unsqueeze(-1) + eps)
    return out.to(v.dtype).contiguous(), denominator.contiguous()


def causal_attention_backward_reference(
    grad_out, q, k, v, out, denominator, eps: float, normalize: bool, feature_map: FeatureMap, chunk_size: int
):
    """(grad_q, grad_k, grad_v) of causal_attention_reference's out."""
    dtype = _checks.compute_dtype(q.dtype)
    grad, q_c, k_c, v_c = grad_out.to(dtype), q.to(dtype), k.to(dtype), v.to(dtype)
    if normalize:
        shifted = denominator.to(dtype).unsqueeze(-1) + eps
        grad_numerator = grad / shifted
        grad_denominator = -(grad * out.to(dtype)).sum(-1, keepdim=True) / shifted
        grad = torch.cat([grad_numerator, grad_denominator], dim=-1)
        v_c = _with_ones_column(v_c)
    grad_q, grad_k, grad_v = _chunked_causal_product_backward(grad, q_c, k_c, v_c, feature_map, chunk_size)
    if normalize:
        grad_v = grad_v[..., :-1]
    return grad_q.to(q.dtype).contiguous(), grad_k.to(k.dtype).contiguous(), grad_v.to(v.dtype).contiguous()


def forward_fake(q, k, v, eps, normalize):
    """Fake impl shared with tk::based_attention (same outputs)."""
    denominator_shape = q.shape[:3] if normalize else (0,)
    return v.new_empty(v.shape), q.new_empty(denominator_shape, dtype=_checks.compute_dtype(q.dtype))


def backward_fake(grad_out, q, k, v, out, denominator, eps, normalize):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _linear_attention_reference(q, k, v, eps, normalize):
    return causal_attention_reference(q, k, v, eps, normalize, IDENTITY, CHUNK_SIZE)


def _linear_attention_bwd_reference(grad_out, q, k, v, out, denominator, eps, normalize):
    return causal_attention_backward_reference(
        grad_out, q, k, v, out, denominator, eps, normalize, IDENTITY, CHUNK_SIZE
    )


linear_attention_op = _library.define(
    "linear_attention",
    "(Tensor q, Tensor k, Tensor v, float eps, bool normalize) -> (Tensor out, Tensor denominator)",
    reference=_linear_attention_reference,
    fake=forward_fake,
)
linear_attention_bwd_op = _library.define(
    "linear_attention_bwd",
    "(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor denominator, float eps, bool normalize)"
    " -> (Tensor grad_q, Tensor grad_k, Tensor grad_v)",
    reference=_linear_attention_bwd_reference,
    fake=backward_fake,
)


# ------------------------------------------------------------------------------------ autograd


def register_derivatives(op, backward_op: str) -> None:
    """The autograd of a causal linear attention op (this one and tk::based_attention) whose backward op
    is ``backward_op``: the denominator is not differentiable, and out and the denominator are saved
    only when normalising, so the unnormalised case keeps nothing but q, k, v alive."""
    _library.register_derivatives(
        op,
        f"{backward_op}(grad_out, q, k, v, out if normalize, denominator if normalize, eps, normalize) -> q, k, v",
        differentiable="out",
        layout=_checks.unit_last_stride,
    )


register_derivatives(linear_attention_op, "linear_attention_bwd")


# ----------------------------------------------------------------------------------- public API


def linear_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, normalize: bool = False, eps: float = 1e-12
) -> torch.Tensor:
    """Causal linear attention on feature-mapped q, k (B, H, N, F) and v (B, H, N, Dv) -> (B, H, N, Dv).

    out_i = sum_{j<=i} (q_i . k_j) v_j, divided by (sum_{j<=i} q_i . k_j + eps) when ``normalize``.
    """
    check_inputs(q, k, v, eps)
    q, k, v = (_checks.unit_last_stride(t) for t in (q, k, v))
    out, _ = linear_attention_op(q, k, v, float(eps), bool(normalize))
    return out
