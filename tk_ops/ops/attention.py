"""Softmax attention: ``tk.attention(q, k, v, causal=..., scale=..., window=..., softcap=..., sinks=...,
return_lse=...)`` and its packed-sequence form ``tk.attention_varlen``.

q (B, Hq, Nq, D), k (B, Hkv, Nk, D), v (B, Hkv, Nk, Dv) with Hq % Hkv == 0: query head h reads
key/value head h // (Hq / Hkv) (GQA; MQA when Hkv == 1), without copying K or V.

  T = scale * q k^T,  S = c * tanh(T / c) with softcap c > 0 (S = T when off),  S = -inf where the
  mask hides a key,  lse = log(sum_j exp(S_j) + exp(sink)),  P = exp(S - lse),  out = P v.

The mask is bottom-right aligned: with offset = Nk - Nq, query i sees key j iff
  i + offset - left <= j <= i + offset + right     (window = (left, right), -1 = unbounded),
and causal is right = 0 (with causal, the window's right is taken as 0). window = (-1, -1) and
causal=False: every key.

sinks (Hq,): one logit per query head that joins each row's softmax denominator only (GPT-OSS's
attention sinks, FlashAttention-4's ``learnable_sink``): it takes probability exp(sink - lse) but adds
nothing to out, and lse includes it. Without sinks, a query row that sees no key has out = 0,
lse = -inf and zero gradients. With sinks, such a row is what the formulas give: its denominator is
exp(sink) alone, so out = 0, lse = sink (finite), zero gradients for q, k and v, and
d sink += dlse (the row's lse gradient; dout does not reach it since out is 0). A sink of -inf is
the same as no sink.

Forward op
  tk::attention(Tensor q, Tensor k, Tensor v, bool causal, float scale, bool deterministic,
                int window_left=-1, int window_right=-1, float softcap=0., Tensor? sinks=None)
      -> (Tensor out, Tensor lse)
      out (B, Hq, Nq, Dv) contiguous in q's dtype; lse (B, Hq, Nq) contiguous fp32, natural log.
      ``deterministic`` only concerns the backward (autograd hands it on). The four options come last,
      with defaults that switch them off, so a call with the first six arguments (the CUDA kernels'
      original schema) means what it always meant. softcap 0 is off. sinks: (Hq,) fp32 (fp64 beside
      fp64 inputs).
Backward op
  tk::attention_bwd(Tensor grad_out, Tensor? grad_lse, Tensor q, Tensor k, Tensor v, Tensor out,
                    Tensor lse, bool causal, float scale, bool deterministic, int window_left=-1,
                    int window_right=-1, float softcap=0., Tensor? sinks=None)
      -> (Tensor grad_q, Tensor grad_k, Tensor grad_v, Tensor grad_sinks)
      grad_lse is None when lse was not used; grad_sinks is (Hq,) in the sinks' dtype, or an empty
      (0,) fp32 tensor without sinks. With dP = dO v^T the gradient of P, and per row the Jacobians
      dP_i/dS_i = diag(P_i) - P_i P_i^T and dlse_i/dS_i = P_i (over the keys; the sink takes the rest
      of the row's probability, p_sink = exp(sink - lse_i), and has dP = 0 since it adds no value):
        dS_ij = P_ij (dP_ij - delta_i) + dlse_i P_ij,  delta_i = sum_j P_ij dP_ij = rowsum(dO_i * out_i),
        d sink_h = sum over the rows of head h of p_sink_i (dlse_i - delta_i),
      so dS = P * (dP - (delta - dlse)). Through the softcap, dT = dS * (1 - (S / c)^2)
      (d/dT of c tanh(T / c)); without it dT = dS. Then dq = scale * dT k, dk = scale * dT^T q,
      dv = P^T dO, with dk, dv summed over the query heads of each group (shapes of k and v).
      On the kernels dq has two methods. one-pass: the dk/dv pass also adds each block's dq
      partial into an fp32 accumulator (bulk reductions in an order that varies between runs, so
      dq may differ in its last bits from run to run), then a pass converts it. recompute: a second
      kernel recomputes the scores per query block and sums dq in registers, bitwise reproducible.
      deterministic=True always takes recompute; False takes the faster for the shape (one-pass at D = 64
      and from Nk = 4096 at D = 128, as measured on the H100), or the method named
      by the environment variable TK_OPS_ATTENTION_BACKWARD (one_pass / recompute). dk and dv are reproducible always.

Varlen ops (packed sequences, FlashAttention's ``flash_attn_varlen_func`` layout)
  tk::attention_varlen(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k,
                       int max_seqlen_q, int max_seqlen_k, bool causal, float scale, int window_left,
                       int window_right, float softcap, Tensor? sinks, bool deterministic)
      -> (Tensor out, Tensor lse)
      q (total_q, Hq, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv); sequence b is rows
      cu_seqlens_q[b]:cu_seqlens_q[b + 1] of q against rows cu_seqlens_k[b]:cu_seqlens_k[b + 1] of k
      and v, with every option meaning what it means above for that one sequence (Nq and Nk are its
      own lengths: causal and the window are bottom-right aligned per sequence). out
      (total_q, Hq, Dv) contiguous in q's dtype, lse (Hq, total_q) contiguous fp32.
  tk::attention_varlen_bwd(Tensor grad_out, Tensor? grad_lse, Tensor q, Tensor k, Tensor v,
                           Tensor out, Tensor lse, <the forward's arguments from cu_seqlens_q on>)
      -> (Tensor grad_q, Tensor grad_k, Tensor grad_v, Tensor grad_sinks), the formulas above.
  On CUDA (csrc/torch/attention.cpp) one launch of the kernels' packed variant runs every sequence.

The kernels serve bf16/fp16 with D = Dv in {64, 128, 192, 256}, forward and backward, with or without
window, softcap and sinks, dense or packed; the forward also D = Dv = 96 (at 192 and 256 the backward
splits each gradient's columns between its two consumer warpgroups, recompute method only; written, not
yet run on a GPU). tk.attention also runs Dv < D (MLA's (192, 128)) on v zero-padded to D, the output
cropped (the backward: v, out and grad_out padded, dv cropped), and its backward at D = 96 the D = 128
kernels on zero-padded copies of q, k, v, out and grad_out; attention_varlen with Dv != D or at D = 96
runs the reference backward. tk.attention with one query row against 256 keys or more (no
window, D = Dv a forward head dim) runs as tk.attention_with_kvcache's decode form
(csrc/torch/attention.cpp). Everything else runs the reference, which computes an exact softmax in fp32
(fp64 for fp64 inputs) over blocks of query rows, each against the keys its rows can see (a sliding
window reads W + rows keys, not Nk), so that long sequences never hold more than
``_REFERENCE_BLOCK_BYTES`` of scores per block.
"""

from __future__ import annotations

import math
import operator
from typing import Iterator, NamedTuple, Optional

import torch

from tk_ops import _checks, _library
from tk_ops._autocast import autocast_inputs

# Bytes of one block of scores (B * Hq * rows * Nk) in the reference; the backward holds about four
# tensors of that size at once (scores, probabilities, dP, dS).
_REFERENCE_BLOCK_BYTES = 128 * 2**20

_NEG_INF = float("-inf")


# ----------------------------------------------------------------------------------- reference


def _rows_per_block(q: torch.Tensor, k: torch.Tensor) -> int:
    batch, q_heads = q.shape[0], q.shape[1]
    row_bytes = max(1, batch * q_heads * k.shape[2] * _checks.compute_dtype(q.dtype).itemsize)
    return max(1, _REFERENCE_BLOCK_BYTES // row_bytes)


def _right_bound(causal: bool, window_right: int) -> int:
    """The window's right edge as the mask applies it: 0 under causal, -1 (unbounded) or >= 0 otherwise."""
    return 0 if causal else window_right


def _query_blocks(q, k, left: int, right: int) -> Iterator[tuple[int, int, int, int]]:
    """(start, stop, key_start, key_stop): query rows [start, stop) see no key outside [key_start, key_stop).

    ``right`` is the mask's right edge (causal already folded in: _right_bound). The range may be empty.
    """
    q_len, key_len = q.shape[2], k.shape[2]
    offset = key_len - q_len
    rows = _rows_per_block(q, k)
    for start in range(0, q_len, rows):
        stop = min(start + rows, q_len)
        key_start = 0 if left < 0 else min(max(start + offset - left, 0), key_len)
        key_stop = key_len if right < 0 else min(max(stop + offset + right, 0), key_len)
        yield start, stop, key_start, max(key_start, key_stop)


def _fold_group(t: torch.Tensor) -> torch.Tensor:
    """(B, Hkv, G, rows, X) -> (B, Hkv, G * rows, X): one matmul per K/V head serves its whole group."""
    return t.reshape(t.shape[0], t.shape[1], t.shape[2] * t.shape[3], t.shape[4])


def _hidden(start, rows, key_start, keys, offset, left, right, device) -> Optional[torch.Tensor]:
    """(rows, keys) bool, True where query row start + r does not see key key_start + c; None if all are seen."""
    if left < 0 and right < 0:
        return None
    distance = (
        torch.arange(key_start, key_start + keys, device=device)[None, :]
        - torch.arange(start + offset, start + offset + rows, device=device)[:, None]
    )
    hidden = None
    if left >= 0:
        hidden = distance < -left
    if right >= 0:
        hidden = distance > right if hidden is None else hidden | (distance > right)
    return hidden


def _block_probabilities(q_rows, k_keys, start, key_start, offset, left, right, scale, softcap, sink_rows,
                         absent_keys=None):
    """Probabilities (B, Hkv, G * rows, keys), lse (B, Hkv, G * rows) and, with a softcap, tanh(T / c)
    (same shape as the probabilities; None without) of one query block.

    q_rows: (B, Hkv, G, rows, D) for query rows [start, start + rows); k_keys: (B, Hkv, keys, D) for keys
    [key_start, key_start + keys); sink_rows: (Hkv, G * rows) or None; absent_keys: (B, keys) bool, True
    for keys of a sequence that no row of it sees (None: none). Rows that see no key get probabilities 0
    and lse -inf, or lse = sink with sinks (not NaN).
    """
    batch, kv_heads, group, rows, _ = q_rows.shape
    keys = k_keys.shape[2]
    scores = torch.matmul(_fold_group(q_rows), k_keys.transpose(-1, -2)).mul_(scale)
    tanh = None
    if softcap:
        tanh = torch.tanh(scores.div_(softcap))
        scores = tanh * softcap
    hidden = _hidden(start, rows, key_start, keys, offset, left, right, scores.device)
    if hidden is not None:
        scores.view(batch, kv_heads, group, rows, keys).masked_fill_(hidden, _NEG_INF)
    if absent_keys is not None:
        scores.masked_fill_(absent_keys[:, None, None, :], _NEG_INF)
    lse = torch.logsumexp(scores, dim=-1)
    if sink_rows is not None:
        lse = torch.logaddexp(lse, sink_rows)
    finite_lse = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    return torch.exp(scores - finite_lse.unsqueeze(-1)), lse, tanh


def _sink_rows(sinks, kv_heads, group, rows, compute) -> Optional[torch.Tensor]:
    """The sinks of a block's folded rows: (Hkv, G * rows), row g * rows + r of K/V head h holding sinks[h * G + g]."""
    if sinks is None:
        return None
    return sinks.to(compute).view(kv_heads, group, 1).expand(kv_heads, group, rows).reshape(kv_heads, group * rows)


def _forward(q, k, v, causal, scale, window_left, window_right, softcap, sinks, absent_keys=None):
    """The forward of the module docstring for q (B, Hq, Nq, D), k (B, Hkv, Nk, D), v (B, Hkv, Nk, Dv):
    (out (B, Hq, Nq, Dv) in q's dtype, lse (B, Hq, Nq) fp32), both contiguous. ``absent_keys`` (B, Nk)
    bool hides keys from every row of their sequence, on top of the mask (None: no key is absent)."""
    batch, q_heads, q_len, _ = q.shape
    kv_heads, key_len, value_dim = k.shape[1], k.shape[2], v.shape[3]
    group = q_heads // kv_heads
    right = _right_bound(causal, window_right)
    compute = _checks.compute_dtype(q.dtype)
    q_grouped = q.unflatten(1, (kv_heads, group))
    k_compute, v_compute = k.to(compute), v.to(compute)
    out = q.new_empty((batch, kv_heads, group, q_len, value_dim))
    lse = q.new_empty((batch, kv_heads, group, q_len), dtype=torch.float32)
    for start, stop, key_start, key_stop in _query_blocks(q, k, window_left, right):
        rows = stop - start
        probs, block_lse, _ = _block_probabilities(
            q_grouped[:, :, :, start:stop].to(compute), k_compute[:, :, key_start:key_stop], start, key_start,
            key_len - q_len, window_left, right, scale, softcap, _sink_rows(sinks, kv_heads, group, rows, compute),
            None if absent_keys is None else absent_keys[:, key_start:key_stop],
        )
        block_out = torch.matmul(probs, v_compute[:, :, key_start:key_stop])
        out[:, :, :, start:stop] = block_out.view(batch, kv_heads, group, rows, value_dim)
        lse[:, :, :, start:stop] = block_lse.view(batch, kv_heads, group, rows)
    return out.view(batch, q_heads, q_len, value_dim), lse.view(batch, q_heads, q_len)


def _backward(grad_out, grad_lse, q, k, v, out, causal, scale, window_left, window_right, softcap, sinks):
    """The formulas of the module docstring, block by block over query rows: (grad_q, grad_k, grad_v) in
    the inputs' dtypes and grad_sinks (Hq,) in the compute dtype (None without sinks).

    The probabilities are recomputed with an exact softmax at the compute precision instead of
    exp(S - lse) from the fp32 lse (the kernels read lse), so fp64 gradients stay exact.
    """
    batch, q_heads, q_len, head_dim = q.shape
    kv_heads, key_len = k.shape[1], k.shape[2]
    group = q_heads // kv_heads
    right = _right_bound(causal, window_right)
    compute = _checks.compute_dtype(q.dtype)
    q_grouped = q.unflatten(1, (kv_heads, group))
    grad_out_grouped = grad_out.unflatten(1, (kv_heads, group))
    out_grouped = out.unflatten(1, (kv_heads, group))
    grad_lse_grouped = None if grad_lse is None else grad_lse.unflatten(1, (kv_heads, group))
    k_compute, v_compute = k.to(compute), v.to(compute)
    grad_q = q.new_empty((batch, kv_heads, group, q_len, head_dim))
    grad_k = torch.zeros(k.shape, dtype=compute, device=k.device)
    grad_v = torch.zeros(v.shape, dtype=compute, device=v.device)
    grad_sinks = None if sinks is None else torch.zeros((kv_heads, group), dtype=compute, device=q.device)
    for start, stop, key_start, key_stop in _query_blocks(q, k, window_left, right):
        rows = stop - start
        q_rows = q_grouped[:, :, :, start:stop].to(compute)
        k_keys, v_keys = k_compute[:, :, key_start:key_stop], v_compute[:, :, key_start:key_stop]
        sink_rows = _sink_rows(sinks, kv_heads, group, rows, compute)
        probs, block_lse, tanh = _block_probabilities(
            q_rows, k_keys, start, key_start, key_len - q_len, window_left, right, scale, softcap, sink_rows
        )
        grad_out_rows = _fold_group(grad_out_grouped[:, :, :, start:stop].to(compute))
        delta = (grad_out_rows * _fold_group(out_grouped[:, :, :, start:stop].to(compute))).sum(-1)
        if grad_lse_grouped is not None:
            delta -= grad_lse_grouped[:, :, :, start:stop].reshape(delta.shape).to(compute)
        if sinks is not None:
            # p_sink = exp(sink - lse); 0 where lse is -inf (a -inf sink on a row that sees no key).
            finite_lse = torch.where(torch.isneginf(block_lse), torch.zeros_like(block_lse), block_lse)
            sink_probs = torch.where(torch.isneginf(block_lse), 0.0, torch.exp(sink_rows - finite_lse))
            grad_sinks -= (sink_probs * delta).view(batch, kv_heads, group, rows).sum((0, 3))
        grad_probs = torch.matmul(grad_out_rows, v_keys.transpose(-1, -2))
        grad_scores = probs * (grad_probs - delta.unsqueeze(-1))
        if tanh is not None:
            grad_scores *= 1 - tanh * tanh
        block_grad_q = torch.matmul(grad_scores, k_keys).mul_(scale)
        grad_q[:, :, :, start:stop] = block_grad_q.view(batch, kv_heads, group, rows, head_dim)
        grad_k[:, :, key_start:key_stop] += torch.matmul(grad_scores.transpose(-1, -2), _fold_group(q_rows)).mul_(scale)
        grad_v[:, :, key_start:key_stop] += torch.matmul(probs.transpose(-1, -2), grad_out_rows)
    grad_sinks = None if grad_sinks is None else grad_sinks.view(q_heads)
    return grad_q.view(q.shape), grad_k.to(k.dtype), grad_v.to(v.dtype), grad_sinks


def _no_sink_gradient(q: torch.Tensor) -> torch.Tensor:
    """grad_sinks of a call without sinks: an empty fp32 tensor (the schema returns a Tensor)."""
    return q.new_empty((0,), dtype=torch.float32)


def _attention_reference(q, k, v, causal, scale, deterministic, window_left=-1, window_right=-1, softcap=0.0,
                         sinks=None):
    return _forward(q, k, v, causal, scale, window_left, window_right, softcap, sinks)


def _attention_fake(q, k, v, causal, scale, deterministic, window_left=-1, window_right=-1, softcap=0.0, sinks=None):
    batch, q_heads, q_len, _ = q.shape
    return q.new_empty((batch, q_heads, q_len, v.shape[3])), q.new_empty((batch, q_heads, q_len), dtype=torch.float32)


def _attention_bwd_reference(grad_out, grad_lse, q, k, v, out, lse, causal, scale, deterministic, window_left=-1,
                             window_right=-1, softcap=0.0, sinks=None):
    grad_q, grad_k, grad_v, grad_sinks = _backward(
        grad_out, grad_lse, q, k, v, out, causal, scale, window_left, window_right, softcap, sinks
    )
    grad_sinks = _no_sink_gradient(q) if sinks is None else grad_sinks.to(sinks.dtype)
    return grad_q, grad_k, grad_v, grad_sinks


def _attention_bwd_fake(grad_out, grad_lse, q, k, v, out, lse, causal, scale, deterministic, window_left=-1,
                        window_right=-1, softcap=0.0, sinks=None):
    grad_sinks = _no_sink_gradient(q) if sinks is None else sinks.new_empty(sinks.shape)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), grad_sinks


# The options come last, with defaults that switch them off: the CUDA entries of csrc/torch/attention.cpp
# take all ten arguments; the forward's kernel computes the options, the backward's entry hands any call
# with an option switched on to tk::attention_bwd_ref.
_OPTIONS = "int window_left=-1, int window_right=-1, float softcap=0., Tensor? sinks=None"

attention_op = _library.define(
    "attention",
    f"(Tensor q, Tensor k, Tensor v, bool causal, float scale, bool deterministic, {_OPTIONS}) "
    "-> (Tensor out, Tensor lse)",
    reference=_attention_reference,
    fake=_attention_fake,
)
attention_bwd_op = _library.define(
    "attention_bwd",
    "(Tensor grad_out, Tensor? grad_lse, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, bool causal, "
    f"float scale, bool deterministic, {_OPTIONS}) -> (Tensor grad_q, Tensor grad_k, Tensor grad_v, Tensor grad_sinks)",
    reference=_attention_bwd_reference,
    fake=_attention_bwd_fake,
)


# ------------------------------------------------------------------------------- varlen reference


def sequence_bounds(name: str, cu_seqlens: torch.Tensor, total: int, max_seqlen: int) -> list[tuple[int, int]]:
    """(start, stop) of every sequence of ``cu_seqlens`` (read with .tolist(): a device sync on a GPU).

    Raises ValueError unless cu_seqlens starts at 0, never decreases, ends at ``total`` (the packed
    tensor's first dimension) and no sequence is longer than ``max_seqlen``.
    """
    values = cu_seqlens.tolist()
    if values[0] != 0:
        raise ValueError(f"{name} must start at 0, got {values[0]}")
    lengths = [stop - start for start, stop in zip(values[:-1], values[1:])]
    if any(length < 0 for length in lengths):
        index = next(i for i, length in enumerate(lengths) if length < 0)
        raise ValueError(f"{name} must be non-decreasing, got {values[index]} then {values[index + 1]}")
    if values[-1] != total:
        raise ValueError(f"{name} must end at the packed length {total} (the first dimension), got {values[-1]}")
    longest = max(lengths)
    if longest > max_seqlen:
        max_name = name.replace("cu_seqlens", "max_seqlen")
        raise ValueError(f"{max_name} ({max_seqlen}) must be at least the longest sequence of {name} ({longest})")
    return list(zip(values[:-1], values[1:]))


def _as_batch(t: torch.Tensor) -> torch.Tensor:
    """Rows of a packed (N, H, X) tensor as a (1, H, N, X) view."""
    return t.transpose(0, 1).unsqueeze(0)


def _varlen_sequences(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    queries = sequence_bounds("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q)
    keys = sequence_bounds("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k)
    return [(q_rows, k_rows) for q_rows, k_rows in zip(queries, keys) if q_rows[1] > q_rows[0]]


def _attention_varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale,
                                window_left, window_right, softcap, sinks, deterministic):
    """Sequence by sequence, each one the dense reference on (1, H, N, D) views of its rows. The lengths
    are read here, inside the op, so a compiled graph holds one opaque call (no .tolist() for Dynamo)."""
    total_q, q_heads = q.shape[0], q.shape[1]
    out = q.new_zeros((total_q, q_heads, v.shape[2]))
    lse = q.new_full((q_heads, total_q), _NEG_INF, dtype=torch.float32)
    for (q_start, q_stop), (k_start, k_stop) in _varlen_sequences(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                                  max_seqlen_k):
        sequence_out, sequence_lse = _forward(
            _as_batch(q[q_start:q_stop]), _as_batch(k[k_start:k_stop]), _as_batch(v[k_start:k_stop]), causal, scale,
            window_left, window_right, softcap, sinks,
        )
        out[q_start:q_stop] = sequence_out[0].transpose(0, 1)
        lse[:, q_start:q_stop] = sequence_lse[0]
    return out, lse


def _attention_varlen_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale,
                           window_left, window_right, softcap, sinks, deterministic):
    total_q, q_heads = q.shape[0], q.shape[1]
    return q.new_empty((total_q, q_heads, v.shape[2])), q.new_empty((q_heads, total_q), dtype=torch.float32)


def _attention_varlen_bwd_reference(grad_out, grad_lse, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, causal, scale, window_left, window_right, softcap, sinks,
                                    deterministic):
    compute = _checks.compute_dtype(q.dtype)
    grad_q = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    grad_k = torch.zeros(k.shape, dtype=k.dtype, device=k.device)
    grad_v = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    grad_sinks = None if sinks is None else torch.zeros(sinks.shape, dtype=compute, device=sinks.device)
    for (q_start, q_stop), (k_start, k_stop) in _varlen_sequences(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                                  max_seqlen_k):
        sequence_grad_lse = None if grad_lse is None else grad_lse[:, q_start:q_stop].unsqueeze(0)
        sequence_grads = _backward(
            _as_batch(grad_out[q_start:q_stop]), sequence_grad_lse, _as_batch(q[q_start:q_stop]),
            _as_batch(k[k_start:k_stop]), _as_batch(v[k_start:k_stop]), _as_batch(out[q_start:q_stop]), causal, scale,
            window_left, window_right, softcap, sinks,
        )
        grad_q[q_start:q_stop] = sequence_grads[0][0].transpose(0, 1)
        grad_k[k_start:k_stop] = sequence_grads[1][0].transpose(0, 1)
        grad_v[k_start:k_stop] = sequence_grads[2][0].transpose(0, 1)
        if grad_sinks is not None:
            grad_sinks += sequence_grads[3]
    grad_sinks = _no_sink_gradient(q) if sinks is None else grad_sinks.to(sinks.dtype)
    return grad_q, grad_k, grad_v, grad_sinks


def _attention_varlen_bwd_fake(grad_out, grad_lse, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                               max_seqlen_k, causal, scale, window_left, window_right, softcap, sinks, deterministic):
    grad_sinks = _no_sink_gradient(q) if sinks is None else sinks.new_empty(sinks.shape)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), grad_sinks


_VARLEN_ARGUMENTS = (
    "Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, bool causal, float scale, "
    "int window_left, int window_right, float softcap, Tensor? sinks, bool deterministic"
)
attention_varlen_op = _library.define(
    "attention_varlen",
    f"(Tensor q, Tensor k, Tensor v, {_VARLEN_ARGUMENTS}) -> (Tensor out, Tensor lse)",
    reference=_attention_varlen_reference,
    fake=_attention_varlen_fake,
)
attention_varlen_bwd_op = _library.define(
    "attention_varlen_bwd",
    f"(Tensor grad_out, Tensor? grad_lse, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, {_VARLEN_ARGUMENTS}) "
    "-> (Tensor grad_q, Tensor grad_k, Tensor grad_v, Tensor grad_sinks)",
    reference=_attention_varlen_bwd_reference,
    fake=_attention_varlen_bwd_fake,
)


# ------------------------------------------------------------------------------------ autograd


# An output that is not used gets no gradient (materialize_grads=False), so the backward skips the
# lse term; an unused out is a gradient of zeros.
_library.register_derivatives(
    attention_op,
    "attention_bwd(grad_out, grad_lse, q, k, v, out, lse, causal, scale, deterministic, window_left, window_right,"
    " softcap, sinks) -> q, k, v, sinks",
    materialize_grads=False,
    zeros="grad_out like out",
    layout=_checks.unit_last_stride,
)


def _setup_varlen_context(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, *arguments, sinks, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, sinks)
    ctx.arguments = (*arguments, deterministic)
    ctx.set_materialize_grads(False)


def _backward_of_attention_varlen(ctx, grad_out, grad_lse):
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, sinks = ctx.saved_tensors
    max_seqlen_q, max_seqlen_k, causal, scale, window_left, window_right, softcap, deterministic = ctx.arguments
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    if grad_lse is not None:
        grad_lse = _checks.unit_last_stride(grad_lse)
    grad_q, grad_k, grad_v, grad_sinks = attention_varlen_bwd_op(
        _checks.unit_last_stride(grad_out), grad_lse, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
        max_seqlen_k, causal, scale, window_left, window_right, softcap, sinks, deterministic,
    )
    return (grad_q, grad_k, grad_v, *(None,) * 9, None if sinks is None else grad_sinks, None)


_library.register_autograd(attention_varlen_op, _backward_of_attention_varlen, _setup_varlen_context)


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
    _check_heads_and_scale(q.shape[1], k.shape[1], scale)


def _check_heads_and_scale(q_heads: int, kv_heads: int, scale) -> None:
    if q_heads % kv_heads != 0:
        raise ValueError(f"q's head count Hq ({q_heads}) must be a multiple of k's head count Hkv ({kv_heads})")
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


def _window_and_causal(window, causal) -> tuple[bool, int, int]:
    """(causal, window_left, window_right) as the ops take them, from the public ``window`` and ``causal``.

    window=None is (-1, -1). A right edge of 0 is causal (query i sees key j iff j <= i + Nk - Nq in both),
    so it is passed as causal=True with the right edge -1 (with causal the right edge is not read): a
    causal call, with or without a left edge, has window_right = -1 and the kernels can tell at a glance.
    """
    if window is None:
        left, right = -1, -1
    else:
        if not isinstance(window, (tuple, list)) or len(window) != 2:
            raise TypeError(f"window must be None or a pair of ints (left, right), got {window!r}")
        try:
            if any(isinstance(edge, bool) for edge in window):
                raise TypeError
            left, right = (operator.index(edge) for edge in window)
        except TypeError:
            raise TypeError(f"window must be None or a pair of ints (left, right), got {window!r}") from None
        if left < -1 or right < -1:
            raise ValueError(f"window entries must be >= -1 (-1 = unbounded), got {tuple(window)}")
    if causal or right == 0:
        return True, left, -1
    return False, left, right


def _softcap_value(softcap) -> float:
    """The ops' softcap: 0.0 for off (None or 0), else a finite c > 0."""
    if softcap is None:
        return 0.0
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap must be None or a number > 0, got {softcap!r}")
    if not (math.isfinite(softcap) and softcap >= 0):
        raise ValueError(f"softcap must be > 0 (None or 0 switches it off), got {softcap}")
    return float(softcap)


def _check_sinks(sinks, q: torch.Tensor, q_heads: int) -> Optional[torch.Tensor]:
    """sinks: None, or (Hq,) fp32 on q's device (fp64 also beside fp64 inputs, which the reference keeps exact)."""
    if sinks is None:
        return None
    dtypes = (torch.float32, torch.float64) if q.dtype == torch.float64 else (torch.float32,)
    _checks.check_tensor("sinks", sinks, ndim=1, dtypes=dtypes)
    _checks.check_dim("sinks", sinks, 0, q_heads, "q's head count Hq")
    _checks.check_same_device(q=q, sinks=sinks)
    return sinks.contiguous()


class MaskOptions(NamedTuple):
    """The options every attention op takes, as its schema takes them."""

    causal: bool
    scale: float
    window_left: int
    window_right: int
    softcap: float
    sinks: Optional[torch.Tensor]


def mask_options(q: torch.Tensor, head_dim: int, q_heads: int, *, causal, scale, window, softcap, sinks) -> MaskOptions:
    """The public causal, scale, window, softcap and sinks of attention, attention_varlen and
    attention_with_kvcache, checked and normalised once (scale defaults to 1/sqrt(head_dim))."""
    causal, window_left, window_right = _window_and_causal(window, causal)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    return MaskOptions(causal, scale, window_left, window_right, _softcap_value(softcap), _check_sinks(sinks, q, q_heads))


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: Optional[float] = None,
    window: Optional[tuple[int, int]] = None,
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
    return_lse: bool = False,
    deterministic: Optional[bool] = None,
):
    """softmax(softcap(scale * q k^T) + mask) v for q (B, Hq, Nq, D), k (B, Hkv, Nk, D), v (B, Hkv, Nk, Dv).

    ``causal`` masks bottom-right aligned (query i sees key j iff j <= i + Nk - Nq); ``scale``
    defaults to 1/sqrt(D). ``window`` = (left, right), -1 unbounded (FlashAttention's window_size):
    query i sees key j iff i + Nk - Nq - left <= j <= i + Nk - Nq + right; with causal, right is taken
    as 0; None = (-1, -1). ``softcap`` c > 0 maps each scaled score s to c * tanh(s / c) before the
    mask (None or 0: off). ``sinks`` (Hq,) fp32: one logit per query head in each row's softmax
    denominator only; it gets a gradient. Returns out (B, Hq, Nq, Dv) in q's dtype, or (out, lse) with
    ``return_lse``: lse (B, Hq, Nq) fp32, the natural-log logsumexp of the masked, capped, scaled
    scores and the sink. A row that sees no key has out 0 and lse -inf (with sinks: lse = its sink).
    Inputs may be views with any strides and a unit last stride, e.g.
    ``x.view(B, N, H, D).transpose(1, 2)``. The kernels take window, softcap and sinks, forward
    and backward.

    ``deterministic``: True makes the backward on the kernels bitwise reproducible (dq from a
    second kernel that recomputes the scores); False (the default, as in FlashAttention) lets it
    sum dq in the dk/dv pass with fp32 reductions in varying order where that is faster (D = 64, and
    Nk >= 4096 at D = 128: 2-16% less backward time on the H100), so dq may differ in its last bits
    between runs. None follows ``torch.are_deterministic_algorithms_enabled()``.
    """
    if not (_checks.uniform_floats(q, k, v, autocast=True) and _plain_shapes(q.shape, k.shape, v.shape, scale)):
        q, k, v = autocast_inputs(q, k, v)
        _check_inputs(q, k, v, scale)
    options = mask_options(q, q.shape[3], q.shape[1], causal=causal, scale=scale, window=window, softcap=softcap,
                           sinks=sinks)
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    out, lse = attention_op(
        _checks.unit_last_stride(q),
        _checks.unit_last_stride(k),
        _checks.unit_last_stride(v),
        options.causal,
        options.scale,
        bool(deterministic),
        options.window_left,
        options.window_right,
        options.softcap,
        options.sinks,
    )
    return (out, lse) if return_lse else out


def _check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        _checks.check_tensor(name, t, ndim=3, allow_empty=True)
        if any(size == 0 for size in t.shape[1:]):
            raise ValueError(f"{name}'s heads and head dim must not be empty, got shape {tuple(t.shape)}")
    _checks.check_same_device(q=q, k=k, v=v)
    _checks.check_same_dtype(q=q, k=k, v=v)
    _checks.check_dim("k", k, 2, q.shape[2], "q.shape[2] (head dim)")
    _checks.check_dim("v", v, 0, k.shape[0], "k.shape[0] (total_k)")
    _checks.check_dim("v", v, 1, k.shape[1], "k.shape[1] (Hkv)")
    _check_heads_and_scale(q.shape[1], k.shape[1], scale)
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        _checks.check_tensor(name, cu, ndim=1, dtypes=(torch.int32,))
        if cu.shape[0] < 2:
            raise ValueError(f"{name} must be (B + 1,) with B >= 1 sequences, got shape {tuple(cu.shape)}")
    _checks.check_same_device(q=q, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    if cu_seqlens_k.shape[0] != cu_seqlens_q.shape[0]:
        raise ValueError(
            f"cu_seqlens_k must have cu_seqlens_q's length {cu_seqlens_q.shape[0]} (B + 1), got {cu_seqlens_k.shape[0]}"
        )
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
            raise TypeError(f"{name} must be a Python int, got {type(value).__name__}")
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = False,
    scale: Optional[float] = None,
    window: Optional[tuple[int, int]] = None,
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
    return_lse: bool = False,
    deterministic: Optional[bool] = None,
):
    """Attention over a batch of sequences packed without padding (FlashAttention's ``flash_attn_varlen_func``).

    q (total_q, Hq, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv), Hq % Hkv == 0; cu_seqlens_q/k
    (B + 1,) int32 on q's device: sequence b is rows cu_seqlens_q[b]:cu_seqlens_q[b + 1] of q against
    rows cu_seqlens_k[b]:cu_seqlens_k[b + 1] of k and v. Sequences may be empty. max_seqlen_q/k:
    Python ints >= 1 and >= the longest sequence (the kernels size their grids by them). Every option
    means what it means in ``tk_ops.attention``, per sequence (causal and the window are bottom-right
    aligned in each sequence). Returns out (total_q, Hq, Dv) in q's dtype, or (out, lse) with
    ``return_lse``: lse (Hq, total_q) fp32. Differentiable in q, k, v and sinks.

    Checks. Types, shapes, dtypes, devices and the options are checked here, before any compute. The
    contents of cu_seqlens (starting at 0, non-decreasing, ending at total_q / total_k, no sequence
    longer than max_seqlen) are checked here only in eager mode on CPU tensors: reading them from a
    GPU would cost a device sync on every call, and under torch.compile/export it would be a graph
    break. On a GPU they are the caller's contract, as with FlashAttention: the CUDA kernels read them
    on the device (a call can be captured in a CUDA graph and replayed with new lengths) and clamp
    what they read to the packed tensors, so bad contents give unspecified numbers but never an
    access outside the tensors. The reference (CPU, and what the kernels do not take) reads the
    lengths anyway and raises the same ValueErrors as the checks here.

    On Hopper with bf16/fp16 and D = Dv in {64, 128, 192, 256} (the forward also 96): one launch of the
    attention kernels' packed variant (forward, and the backward's kernels), tasks of (sequence, head,
    row block) up to max_seqlen. Elsewhere the reference: a loop over the sequences, each the dense reference, exact in
    fp32 (fp64 for fp64 inputs).
    """
    q, k, v = autocast_inputs(q, k, v)
    _check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale)
    options = mask_options(q, q.shape[2], q.shape[1], causal=causal, scale=scale, window=window, softcap=softcap,
                           sinks=sinks)
    if _checks.may_read_contents(cu_seqlens_q, device_sync=False):
        sequence_bounds("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q)
        sequence_bounds("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k)
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    out, lse = attention_varlen_op(
        _checks.unit_last_stride(q),
        _checks.unit_last_stride(k),
        _checks.unit_last_stride(v),
        cu_seqlens_q.contiguous(),
        cu_seqlens_k.contiguous(),
        max_seqlen_q,
        max_seqlen_k,
        options.causal,
        options.scale,
        options.window_left,
        options.window_right,
        options.softcap,
        options.sinks,
        bool(deterministic),
    )
    return (out, lse) if return_lse else out
