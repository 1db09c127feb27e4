"""Softmax attention: ``tk.attention(q, k, v, causal=..., scale=..., return_lse=...)``.

q (B, Hq, Nq, D), k (B, Hkv, Nk, D), v (B, Hkv, Nk, Dv) with Hq % Hkv == 0: query head h reads
key/value head h // (Hq / Hkv) (GQA; MQA when Hkv == 1), without copying K or V.

  S = scale * q k^T (+ -inf where causal hides a key),  lse = logsumexp(S),  P = exp(S - lse),
  out = P v.

Causal masks are bottom-right aligned: query i sees key j iff j <= i + (Nk - Nq). A query row that
sees no key has out = 0, lse = -inf and zero gradients.

Forward op
  tk::attention(Tensor q, Tensor k, Tensor v, bool causal, float scale, bool deterministic)
      -> (Tensor out, Tensor lse)
      out (B, Hq, Nq, Dv) contiguous in q's dtype; lse (B, Hq, Nq) contiguous fp32, natural log.
      ``deterministic`` only concerns the backward (autograd hands it on).
Backward op
  tk::attention_bwd(Tensor grad_out, Tensor? grad_lse, Tensor q, Tensor k, Tensor v, Tensor out,
                    Tensor lse, bool causal, float scale, bool deterministic)
      -> (Tensor grad_q, Tensor grad_k, Tensor grad_v)
      grad_lse is None when lse was not used. With dP = dO v^T the gradient of P, and per row the
      Jacobians dP_i/dS_i = diag(P_i) - P_i P_i^T and dlse_i/dS_i = P_i:
        dS_ij = P_ij (dP_ij - delta_i) + dlse_i P_ij,  delta_i = sum_j P_ij dP_ij = rowsum(dO_i * out_i),
      so dS = P * (dP - (delta - dlse)),  dq = scale * dS k,  dk = scale * dS^T q,  dv = P^T dO,
      with dk, dv summed over the query heads of each group (shapes of k and v).
      On the kernels dq has two methods. one-pass: the dk/dv pass also adds each block's dq
      partial into an fp32 accumulator (bulk reductions in an order that varies between runs, so
      dq may differ in its last bits from run to run), then a pass converts it. recompute: a second
      kernel recomputes the scores per query block and sums dq in registers, bitwise reproducible.
      deterministic=True always takes recompute; False takes the faster for the shape (one-pass at D = 64
      and from Nk = 4096 at D = 128, as measured on the H100), or the method named
      by the environment variable TK_OPS_ATTENTION_BACKWARD (one_pass / recompute). dk and dv are reproducible always.

The kernels serve bf16/fp16 with D = Dv in {64, 128}; everything else runs the reference, which
computes an exact softmax in fp32 (fp64 for fp64 inputs) over blocks of query rows, so that long
sequences never hold more than ``_REFERENCE_BLOCK_BYTES`` of scores per block.
"""

from __future__ import annotations

import math
from typing import Iterator, Optional

import torch

from tk_ops import _checks, _library
from tk_ops._autocast import autocast_inputs

# Bytes of one block of scores (B * Hq * rows * Nk) in the reference; the backward holds about four
# tensors of that size at once (scores, probabilities, dP, dS).
_REFERENCE_BLOCK_BYTES = 128 * 2**20


# ----------------------------------------------------------------------------------- reference



def _rows_per_block(q: torch.Tensor, k: torch.Tensor) -> int:
    batch, q_heads = q.shape[0], q.shape[1]
    row_bytes = batch * q_heads * k.shape[2] * _checks.compute_dtype(q.dtype).itemsize
    return max(1, _REFERENCE_BLOCK_BYTES // row_bytes)


def _query_blocks(q: torch.Tensor, k: torch.Tensor, causal: bool) -> Iterator[tuple[int, int, int]]:
    """(start, stop, keys): query rows [start, stop) only see keys among the first ``keys``."""
    q_len, key_len = q.shape[2], k.shape[2]
    rows = _rows_per_block(q, k)
    for start in range(0, q_len, rows):
        stop = min(start + rows, q_len)
        keys = min(max(stop + key_len - q_len, 0), key_len) if causal else key_len
        yield start, stop, keys


def _fold_group(t: torch.Tensor) -> torch.Tensor:
    """(B, Hkv, G, rows, X) -> (B, Hkv, G * rows, X): one matmul per K/V head serves its whole group."""
    return t.reshape(t.shape[0], t.shape[1], t.shape[2] * t.shape[3], t.shape[4])


def _block_probabilities(q_rows, k_keys, start, q_len, key_len, causal, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax probabilities (B, Hkv, G * rows, keys) and lse (B, Hkv, G * rows) of one query block.

    q_rows: (B, Hkv, G, rows, D) for query rows [start, start + rows); k_keys: (B, Hkv, keys, D).
    Rows that see no key get probabilities 0 and lse -inf (not NaN).
    """
    batch, kv_heads, group, rows, _ = q_rows.shape
    scores = torch.matmul(_fold_group(q_rows), k_keys.transpose(-1, -2)).mul_(scale)
    if causal:
        row = torch.arange(start, start + rows, device=scores.device)
        key = torch.arange(k_keys.shape[2], device=scores.device)
        hidden = key[None, :] > row[:, None] + (key_len - q_len)
        scores.view(batch, kv_heads, group, rows, -1).masked_fill_(hidden, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    finite_lse = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    return torch.exp(scores - finite_lse.unsqueeze(-1)), lse


def _attention_reference(q, k, v, causal, scale, deterministic):
    batch, q_heads, q_len, _ = q.shape
    kv_heads, key_len, value_dim = k.shape[1], k.shape[2], v.shape[3]
    group = q_heads // kv_heads
    compute = _checks.compute_dtype(q.dtype)
    q_grouped = q.unflatten(1, (kv_heads, group))
    k_compute, v_compute = k.to(compute), v.to(compute)
    out = q.new_empty((batch, kv_heads, group, q_len, value_dim))
    lse = q.new_empty((batch, kv_heads, group, q_len), dtype=torch.float32)
    for start, stop, keys in _query_blocks(q, k, causal):
        rows = stop - start
        probs, block_lse = _block_probabilities(
            q_grouped[:, :, :, start:stop].to(compute), k_compute[:, :, :keys], start, q_len, key_len, causal, scale
        )
        out[:, :, :, start:stop] = torch.matmul(probs, v_compute[:, :, :keys]).view(batch, kv_heads, group, rows, -1)
        lse[:, :, :, start:stop] = block_lse.view(batch, kv_heads, group, rows)
    return out.view(batch, q_heads, q_len, value_dim), lse.view(batch, q_heads, q_len)


def _attention_fake(q, k, v, causal, scale, deterministic):
    batch, q_heads, q_len, _ = q.shape
    return q.new_empty((batch, q_heads, q_len, v.shape[3])), q.new_empty((batch, q_heads, q_len), dtype=torch.float32)


def _attention_bwd_reference(grad_out, grad_lse, q, k, v, out, lse, causal, scale, deterministic):
    """The formulas of the module docstring, block by block over query rows.

    The probabilities are recomputed with an exact softmax at the compute precision instead of
    exp(S - lse) from the fp32 lse (the kernels read lse), so fp64 gradients stay exact.
    """
    batch, q_heads, q_len, head_dim = q.shape
    kv_heads, key_len = k.shape[1], k.shape[2]
    group = q_heads // kv_heads
    compute = _checks.compute_dtype(q.dtype)
    q_grouped = q.unflatten(1, (kv_heads, group))
    grad_out_grouped = grad_out.unflatten(1, (kv_heads, group))
    out_grouped = out.unflatten(1, (kv_heads, group))
    k_compute, v_compute = k.to(compute), v.to(compute)
    grad_q = q.new_empty((batch, kv_heads, group, q_len, head_dim))
    grad_k = torch.zeros(k.shape, dtype=compute, device=k.device)
    grad_v = torch.zeros(v.shape, dtype=compute, device=v.device)
    for start, stop, keys in _query_blocks(q, k, causal):
        rows = stop - start
        q_rows = q_grouped[:, :, :, start:stop].to(compute)
        probs, _ = _block_probabilities(q_rows, k_compute[:, :, :keys], start, q_len, key_len, causal, scale)
        grad_out_rows = _fold_group(grad_out_grouped[:, :, :, start:stop].to(compute))
        delta = (grad_out_rows * _fold_group(out_grouped[:, :, :, start:stop].to(compute))).sum(-1)
        if grad_lse is not None:
            delta -= grad_lse.unflatten(1, (kv_heads, group))[:, :, :, start:stop].reshape(delta.shape).to(compute)
        grad_probs = torch.matmul(grad_out_rows, v_compute[:, :, :keys].transpose(-1, -2))
        grad_scores = probs * (grad_probs - delta.unsqueeze(-1))
        block_grad_q = torch.matmul(grad_scores, k_compute[:, :, :keys]).mul_(scale)
        grad_q[:, :, :, start:stop] = block_grad_q.view(batch, kv_heads, group, rows, head_dim)
        grad_k[:, :, :keys] += torch.matmul(grad_scores.transpose(-1, -2), _fold_group(q_rows)).mul_(scale)
        grad_v[:, :, :keys] += torch.matmul(probs.transpose(-1, -2), grad_out_rows)
    return grad_q.view(q.shape), grad_k.to(k.dtype), grad_v.to(v.dtype)


def _attention_bwd_fake(grad_out, grad_lse, q, k, v, out, lse, causal, scale, deterministic):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


attention_op = _library.define(
    "attention",
    "(Tensor q, Tensor k, Tensor v, bool causal, float scale, bool deterministic) -> (Tensor out, Tensor lse)",
    reference=_attention_reference,
    fake=_attention_fake,
)
attention_bwd_op = _library.define(
    "attention_bwd",
    "(Tensor grad_out, Tensor? grad_lse, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, bool causal, "
    "float scale, bool deterministic) -> (Tensor grad_q, Tensor grad_k, Tensor grad_v)",
    reference=_attention_bwd_reference,
    fake=_attention_bwd_fake,
)


# ------------------------------------------------------------------------------------ autograd


def _setup_context(ctx, inputs, output):
    q, k, v, causal, scale, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.causal, ctx.scale, ctx.deterministic = causal, scale, deterministic
    # An output that is not used gets no gradient (None), so the backward skips the lse term.
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    if grad_lse is not None:
        grad_lse = _checks.unit_last_stride(grad_lse)
    grad_q, grad_k, grad_v = attention_bwd_op(
        _checks.unit_last_stride(grad_out), grad_lse, q, k, v, out, lse, ctx.causal, ctx.scale, ctx.deterministic
    )
    return grad_q, grad_k, grad_v, None, None, None


_library.register_autograd(attention_op, _backward, _setup_context)


# ----------------------------------------------------------------------------------- public API


def _check_inputs(q, k, v, scale) -> None:
    _checks.check_tensor("q", q, ndim=4)
    _checks.check_tensor("k", k, ndim=4)
    _checks.check_tensor("v", v, ndim=4)
    _checks.check_same_device(q=q, k=k, v=v)
    _checks.check_same_dtype(q=q, k=k, v=v)
    _checks.check_dim("k", k, 0, q.shape[0], "q.shape[0] (batch)")
    _checks.check_dim("k", k, 3, q.shape[3], "q.shape[3] (head dim)")
    _checks.check_dim("v", v, 0, k.shape[0], "k.shape[0] (batch)")
    _checks.check_dim("v", v, 1, k.shape[1], "k.shape[1] (Hkv)")
    _checks.check_dim("v", v, 2, k.shape[2], "k.shape[2] (Nk)")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(
            f"q's head count Hq ({q.shape[1]}) must be a multiple of k's head count Hkv ({k.shape[1]})"
        )
    if scale is not None and not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number or None (1/sqrt(D)), got {scale}")


def _plain_shapes(q_shape, k_shape, v_shape, scale) -> bool:
    """The fast path's half of _check_inputs (the other is _checks.uniform_floats): shapes related right."""
    return (
        len(q_shape) == 4
        and len(k_shape) == 4
        and len(v_shape) == 4
        and k_shape[0] == q_shape[0]
        and k_shape[3] == q_shape[3]
        and v_shape[:3] == k_shape[:3]
        and q_shape[1] % k_shape[1] == 0
        and (scale is None or math.isfinite(scale))
    )


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: Optional[float] = None,
    return_lse: bool = False,
    deterministic: Optional[bool] = None,
):
    """softmax(scale * q k^T + mask) v for q (B, Hq, Nq, D), k (B, Hkv, Nk, D), v (B, Hkv, Nk, Dv).

    ``causal`` masks bottom-right aligned (query i sees key j iff j <= i + Nk - Nq); ``scale``
    defaults to 1/sqrt(D). Returns out (B, Hq, Nq, Dv) in q's dtype, or (out, lse) with
    ``return_lse``: lse (B, Hq, Nq) fp32, the natural-log logsumexp of the masked scaled scores.
    Inputs may be views with any strides and a unit last stride, e.g.
    ``x.view(B, N, H, D).transpose(1, 2)``.

    ``deterministic``: True makes the backward on the kernels bitwise reproducible (dq from a
    second kernel that recomputes the scores); False (the default, as in FlashAttention) lets it
    sum dq in the dk/dv pass with fp32 reductions in varying order where that is faster (D = 64, and
    Nk >= 4096 at D = 128: 2-16% less backward time on the H100), so dq may differ in its last bits
    between runs. None follows ``torch.are_deterministic_algorithms_enabled()``.
    """
    if not (_checks.uniform_floats(q, k, v, autocast=True) and _plain_shapes(q.shape, k.shape, v.shape, scale)):
        q, k, v = autocast_inputs(q, k, v)
        _check_inputs(q, k, v, scale)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[3])
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    out, lse = attention_op(
        _checks.unit_last_stride(q),
        _checks.unit_last_stride(k),
        _checks.unit_last_stride(v),
        bool(causal),
        float(scale),
        bool(deterministic),
    )
    return (out, lse) if return_lse else out
