"""The gated delta rule (Gated DeltaNet, Qwen3-Next's linear attention): ``tk.gated_delta_rule``.

Semantics and layout are those of flash-linear-attention's ``chunk_gated_delta_rule``
(``fla/ops/gated_delta_rule/chunk.py``). For every value head h (key head h // (Hv / Hk)), with the
state S_t of shape (K, V) and S_{-1} = initial_state (or 0):

  S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T
  o_t = scale * S_t^T q_t

where q_t, k_t are first normalised over K when ``use_qk_l2norm`` (x / sqrt(sum(x^2) + 1e-6), fla's
and Hugging Face's l2norm). With cu_seqlens (B = 1), rows cu_seqlens[n]:cu_seqlens[n + 1] are
sequence n, which starts from initial_state[n] (or 0) and ends in final_state[n]; sequences may be
empty (their final state is their initial state).

Forward op
  tk::gated_delta_rule(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, float scale,
                       Tensor? initial_state, Tensor? cu_seqlens, bool use_qk_l2norm)
      -> (Tensor o, Tensor final_state)
  q, k (B, T, Hk, K); v (B, T, Hv, V), Hv % Hk == 0; g, beta (B, T, Hv); initial_state (N, Hv, K, V);
  cu_seqlens (N + 1,) int32, or None (then N = B). o (B, T, Hv, V) in v's dtype; final_state
  (N, Hv, K, V) in fp32 (fp64 for fp64 inputs), always computed (the public function returns it
  only with output_final_state).
Backward op
  tk::gated_delta_rule_bwd(Tensor grad_o, Tensor? grad_final_state, <the forward's arguments>)
      -> (Tensor grad_q, Tensor grad_k, Tensor grad_v, Tensor grad_g, Tensor grad_beta,
          Tensor grad_initial_state)
  Each gradient has its input's dtype; grad_initial_state is empty (shape (0,)) when initial_state
  is None. The backward recomputes the forward's chunk states from the inputs (nothing but the
  inputs is saved).

Dtypes: q, k, v share one dtype (fp16, bf16, fp32 or fp64); g and beta have v's dtype, or fp32
when v is fp16/bf16 (Qwen3-Next computes g in fp32); initial_state is fp32 (fp64 for fp64 v).
Arithmetic in fp32 (fp64 for fp64 inputs).

Chunked algorithm (the reference; the form a kernel takes). Positions are cut into chunks of
Q = CHUNK_SIZE (each sequence's last chunk padded with g = beta = 0 and zero q, k, v, which leave
the state unchanged). In a chunk entering with state S, with gamma_i = g_0 + ... + g_i, the
per-position updates u_i (rows of U, Q x V) satisfy S_i = exp(gamma_i) S + sum_{j<=i}
exp(gamma_i - gamma_j) k_j u_j^T, and the delta rule gives them by one triangular solve (the WY /
UT form):
  A[i, j] = beta_i exp(gamma_i - gamma_j) (k_i . k_j)      for j < i (0 on and above the diagonal)
  U0 = (I + A)^-1 diag(beta) V ;   W = (I + A)^-1 diag(beta exp(gamma)) K
  U  = U0 - W S
  O  = diag(exp(gamma)) Q S + (D o Q K^T) U                 D[i, j] = exp(gamma_i - gamma_j), j <= i, else 0
  S_next = exp(gamma_last) S + (diag(exp(gamma_last - gamma)) K)^T U
(q already scaled). A, U0, W and D o Q K^T are computed for every chunk at once; only U, O and
S_next walk the chunks in order. Every exponent is <= 0 when g <= 0 (as the contract asks), so
nothing overflows. The backward walks the chunks in reverse with the state gradient dS (from
grad_final_state, or 0):
  dU = (D o Q K^T)^T dO + diag(exp(gamma_last - gamma)) K dS_next
  dS = (diag(exp(gamma)) Q)^T dO + exp(gamma_last) dS_next - W^T dU   (grad_initial_state: dS of chunk 0)
then, per chunk at once: dW = -dU S^T, the solve transposed (dV' = (I + A)^-T dU,
dK' = (I + A)^-T dW, dA = -(dV' U0^T + dK' W^T) below the diagonal), and the products' rules for q,
k, v, beta and the cumulative decays gamma; grad_g is the reverse cumulative sum of d gamma within
each chunk. The l2norm (y = x r, r = (sum x^2 + eps)^-1/2: dx = r (dy - y (y . dy))) and the head
grouping (a sum over the value heads of each key head) come last.

Memory: O(B T H (K + V) + B T H Q) per pass; with cu_seqlens the sequences are laid out side by
side, padded to the longest, so O(N max_len ...) instead of O(T ...).

CUDA kernels: the forward for bf16/fp16 q, k, v with K = V = 128 (csrc/kernels/gated_delta_rule; tested on
the H200, 1.33-1.76x flash-linear-attention's forward there: benchmarks/results/gated_delta_rule.md), and where
no sequence is longer than 16 (decoding) a recurrent kernel at K = V in {64, 128} (the state stepped in
registers, in fp32; tested on the H200, not yet benchmarked); every other forward runs the reference (on a GPU with a
one-time warning), and so does the backward.

Comparing against flash-linear-attention:
  from fla.ops.gated_delta_rule import chunk_gated_delta_rule
  o, final_state = chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=h0,
      output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm, cu_seqlens=cu_seqlens)
  computes what tk_ops.gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=h0,
  output_final_state=True, cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm) computes; fla names
  the l2norm flag ``use_qk_l2norm_in_kernel``, takes its options positionally too, and takes
  cu_seqlens as int64 (tk: int32, FlashAttention's convention).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from tk_ops import _checks, _library

CHUNK_SIZE = 64  # fla's chunk; the function does not depend on it, only the order of the arithmetic
L2NORM_EPS = 1e-6  # fla's and Hugging Face's l2norm
_LOW_PRECISION = (torch.float16, torch.bfloat16)


# ---------------------------------------------------------------------------- layout of sequences


def sequence_bounds(cu_seqlens: torch.Tensor, total: int) -> list[tuple[int, int]]:
    """(start, stop) of every sequence of ``cu_seqlens`` (read with .tolist(): a device sync on a GPU).

    Raises ValueError unless cu_seqlens starts at 0, never decreases and ends at ``total`` (T)."""
    values = cu_seqlens.tolist()
    if values[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {values[0]}")
    for index, (start, stop) in enumerate(zip(values[:-1], values[1:])):
        if stop < start:
            raise ValueError(f"cu_seqlens must be non-decreasing, got {start} then {stop} at index {index}")
    if values[-1] != total:
        raise ValueError(f"cu_seqlens must end at T = q.shape[1] ({total}), got {values[-1]}")
    return list(zip(values[:-1], values[1:]))


class _Sequences:
    """Where the sequences lie in the (B, T) inputs: the batch rows, or the packed rows of cu_seqlens
    laid out side by side as (N, longest) with the positions past each sequence's end masked."""

    def __init__(self, seq_len: int, cu_seqlens: Optional[torch.Tensor], device: torch.device):
        self.seq_len = seq_len
        self.index = self.valid = None
        if cu_seqlens is None:
            return
        bounds = torch.tensor(sequence_bounds(cu_seqlens, seq_len), dtype=torch.long, device=device)
        starts, lengths = bounds[:, 0], bounds[:, 1] - bounds[:, 0]
        positions = torch.arange(int(lengths.max()), device=device)
        self.valid = positions < lengths[:, None]
        self.index = (starts[:, None] + positions).clamp(max=seq_len - 1)

    def split(self, t: torch.Tensor) -> torch.Tensor:
        """(B, T, ...) -> (N, longest, ...), zero past each sequence's end."""
        if self.index is None:
            return t
        rows = t[0][self.index]
        # where, not a product: a non-finite value of another sequence must not leak into the padding.
        return torch.where(self.valid.view(*self.valid.shape, *(1,) * (rows.dim() - 2)), rows, 0)

    def merge(self, t: torch.Tensor) -> torch.Tensor:
        """(N, longest, ...) -> (B, T, ...), the inverse of split."""
        if self.index is None:
            return t
        packed = t.new_zeros((1, self.seq_len, *t.shape[2:]))
        packed[0, self.index[self.valid]] = t[self.valid]
        return packed


# ----------------------------------------------------------------------------------- reference


def _l2_normalised(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x / sqrt(sum(x^2) + eps) over the last dim, and the factor 1 / sqrt(sum(x^2) + eps)."""
    inverse_norm = torch.rsqrt(x.square().sum(-1, keepdim=True) + L2NORM_EPS)
    return x * inverse_norm, inverse_norm


def _l2_norm_backward(grad: torch.Tensor, normalised: torch.Tensor, inverse_norm: torch.Tensor) -> torch.Tensor:
    return inverse_norm * (grad - normalised * (normalised * grad).sum(-1, keepdim=True))


def _per_head(t: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """(N, L, H[, X]) -> (N, H, chunks, chunk_size[, X]), zero-padded at the end."""
    t = t.movedim(2, 1)
    padding = -t.shape[2] % chunk_size
    if t.dim() == 4:
        return F.pad(t, (0, 0, 0, padding)).unflatten(2, (-1, chunk_size))
    return F.pad(t, (0, padding)).unflatten(2, (-1, chunk_size))


def _per_position(t: torch.Tensor, seq_len: int) -> torch.Tensor:
    """(N, H, chunks, chunk_size[, X]) -> (N, L, H[, X]), the inverse of _per_head."""
    return t.flatten(2, 3)[:, :, :seq_len].movedim(1, 2)


@dataclass
class _Inputs:
    """The inputs as the chunked algorithm reads them: per value head, in the compute dtype."""

    sequences: _Sequences
    seq_len: int  # L, the longest sequence
    q: torch.Tensor  # (N, H, c, Q, K), normalised, grouped to the value heads, times scale
    k: torch.Tensor  # (N, H, c, Q, K), normalised, grouped to the value heads
    v: torch.Tensor  # (N, H, c, Q, V)
    g: torch.Tensor  # (N, H, c, Q)
    beta: torch.Tensor  # (N, H, c, Q)
    q_normalised: Optional[tuple[torch.Tensor, torch.Tensor]]  # with use_qk_l2norm: _l2_normalised(q)
    k_normalised: Optional[tuple[torch.Tensor, torch.Tensor]]


def _inputs(q, k, v, g, beta, scale, cu_seqlens, use_qk_l2norm, chunk_size) -> _Inputs:
    dtype = _checks.compute_dtype(v.dtype)
    group = v.shape[2] // k.shape[2]
    q, k = q.to(dtype), k.to(dtype)
    q_normalised = k_normalised = None
    if use_qk_l2norm:
        q_normalised, k_normalised = _l2_normalised(q), _l2_normalised(k)
        q, k = q_normalised[0], k_normalised[0]
    sequences = _Sequences(q.shape[1], cu_seqlens, q.device)

    def prepare(t):
        t = sequences.split(t.to(dtype))
        return _per_head(t, chunk_size), t.shape[1]

    q_heads, seq_len = prepare(q.repeat_interleave(group, dim=2) * scale)
    k_heads, _ = prepare(k.repeat_interleave(group, dim=2))
    (v_heads, _), (g_heads, _), (beta_heads, _) = prepare(v), prepare(g), prepare(beta)
    return _Inputs(sequences, seq_len, q_heads, k_heads, v_heads, g_heads, beta_heads, q_normalised, k_normalised)


@dataclass
class _ChunkTerms:
    """What every chunk computes without its entering state (layouts as in _Inputs)."""

    gamma: torch.Tensor  # (N, H, c, Q), cumulative log decay within the chunk
    decay: torch.Tensor  # (N, H, c, Q, Q), exp(gamma_i - gamma_j) for j <= i, else 0
    solve_matrix: torch.Tensor  # (N, H, c, Q, Q), A: beta_i decay_ij (k_i . k_j) for j < i, else 0
    u0: torch.Tensor  # (N, H, c, Q, V), (I + A)^-1 diag(beta) V
    w: torch.Tensor  # (N, H, c, Q, K), (I + A)^-1 diag(beta exp(gamma)) K
    scores: torch.Tensor  # (N, H, c, Q, Q), decay o (q k^T)
    to_chunk_end: torch.Tensor  # (N, H, c, Q), exp(gamma_last - gamma)
    chunk_decay: torch.Tensor  # (N, H, c), exp(gamma_last)


def _solve(matrix: torch.Tensor, rhs: torch.Tensor, transpose: bool = False) -> torch.Tensor:
    """(I + A)^-1 rhs, or (I + A)^-T rhs, for A strictly lower triangular (unitriangular: its zero
    diagonal is read as ones)."""
    if transpose:
        return torch.linalg.solve_triangular(matrix.mT, rhs, upper=True, unitriangular=True)
    return torch.linalg.solve_triangular(matrix, rhs, upper=False, unitriangular=True)


def _chunk_terms(x: _Inputs) -> _ChunkTerms:
    chunk_size = x.g.shape[-1]
    gamma = x.g.cumsum(-1)
    on_or_below = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=gamma.device).tril()
    # exp only of gamma_i - gamma_j with j <= i: the rest is -inf, so no exp can overflow.
    decay = torch.exp((gamma[..., :, None] - gamma[..., None, :]).masked_fill(~on_or_below, float("-inf")))
    solve_matrix = (x.beta[..., :, None] * decay * (x.k @ x.k.mT)).tril(-1)
    beta_decayed = x.beta * torch.exp(gamma)
    gamma_last = gamma[..., -1:]
    return _ChunkTerms(
        gamma=gamma,
        decay=decay,
        solve_matrix=solve_matrix,
        u0=_solve(solve_matrix, x.v * x.beta[..., None]),
        w=_solve(solve_matrix, x.k * beta_decayed[..., None]),
        scores=decay * (x.q @ x.k.mT),
        to_chunk_end=torch.exp(gamma_last - gamma),
        chunk_decay=torch.exp(gamma_last[..., 0]),
    )


def _scan(x: _Inputs, terms: _ChunkTerms, initial_state: Optional[torch.Tensor]):
    """The walk over the chunks: the output (N, H, c, Q, V), the final state and the state entering
    every chunk (N, H, c, K, V)."""
    batch, heads, chunks, _, key_dim = x.k.shape
    state = (
        x.v.new_zeros((batch, heads, key_dim, x.v.shape[-1])) if initial_state is None else initial_state.to(x.v.dtype)
    )
    outputs, entering = [], []
    for c in range(chunks):
        entering.append(state)
        u = terms.u0[:, :, c] - terms.w[:, :, c] @ state
        outputs.append(torch.exp(terms.gamma[:, :, c])[..., None] * (x.q[:, :, c] @ state) + terms.scores[:, :, c] @ u)
        keys_to_end = x.k[:, :, c] * terms.to_chunk_end[:, :, c, :, None]
        state = terms.chunk_decay[:, :, c, None, None] * state + keys_to_end.mT @ u
    return torch.stack(outputs, dim=2), state, torch.stack(entering, dim=2)


def _gated_delta_rule_reference(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm):
    x = _inputs(q, k, v, g, beta, scale, cu_seqlens, use_qk_l2norm, CHUNK_SIZE)
    o, final_state, _ = _scan(x, _chunk_terms(x), initial_state)
    o = x.sequences.merge(_per_position(o, x.seq_len))
    return o.to(v.dtype).contiguous(), final_state.contiguous()


def _states_count(q: torch.Tensor, cu_seqlens: Optional[torch.Tensor]) -> int:
    return q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1


def _gated_delta_rule_fake(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm):
    state_shape = (_states_count(q, cu_seqlens), v.shape[2], k.shape[3], v.shape[3])
    return v.new_empty(v.shape), v.new_empty(state_shape, dtype=_checks.compute_dtype(v.dtype))


def _backward_scan(x: _Inputs, terms: _ChunkTerms, grad_o: torch.Tensor, grad_final_state):
    """The reverse walk: the gradients of U (N, H, c, Q, V) and of the state leaving every chunk
    (N, H, c, K, V), and that of the initial state."""
    batch, heads, chunks, _, key_dim = x.k.shape
    if grad_final_state is None:
        grad_state = x.v.new_zeros((batch, heads, key_dim, x.v.shape[-1]))
    else:
        grad_state = grad_final_state.to(x.v.dtype)
    grad_u, leaving = [None] * chunks, [None] * chunks
    for c in reversed(range(chunks)):
        leaving[c] = grad_state
        keys_to_end = x.k[:, :, c] * terms.to_chunk_end[:, :, c, :, None]
        grad_u[c] = terms.scores[:, :, c].mT @ grad_o[:, :, c] + keys_to_end @ grad_state
        queries_decayed = x.q[:, :, c] * torch.exp(terms.gamma[:, :, c])[..., None]
        grad_state = (
            queries_decayed.mT @ grad_o[:, :, c]
            + terms.chunk_decay[:, :, c, None, None] * grad_state
            - terms.w[:, :, c].mT @ grad_u[c]
        )
    return torch.stack(grad_u, dim=2), torch.stack(leaving, dim=2), grad_state


def _segment_sums(pairwise: torch.Tensor) -> torch.Tensor:
    """d gamma from a term f(gamma_i - gamma_j) with d f = pairwise[i, j]: + row sums - column sums."""
    return pairwise.sum(-1) - pairwise.sum(-2)


def _gated_delta_rule_bwd_reference(
    grad_o, grad_final_state, q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm
):
    x = _inputs(q, k, v, g, beta, scale, cu_seqlens, use_qk_l2norm, CHUNK_SIZE)
    terms = _chunk_terms(x)
    _, _, states = _scan(x, terms, initial_state)
    u = terms.u0 - terms.w @ states
    grad_o = _per_head(x.sequences.split(grad_o.to(x.v.dtype)), x.g.shape[-1])
    grad_u, grad_next, grad_initial = _backward_scan(x, terms, grad_o, grad_final_state)
    exp_gamma = torch.exp(terms.gamma)

    # O = diag(exp(gamma)) Q S + scores U,  scores = decay o Q K^T
    grad_scores = (grad_o @ u.mT) * terms.decay
    grad_q = exp_gamma[..., None] * (grad_o @ states.mT) + grad_scores @ x.k
    grad_k = grad_scores.mT @ x.q
    grad_gamma = (exp_gamma[..., None] * (x.q @ states) * grad_o).sum(-1)
    grad_gamma = grad_gamma + _segment_sums(grad_scores * (x.q @ x.k.mT))

    # S_next = chunk_decay S + (K o to_chunk_end)^T U
    grad_keys_to_end = u @ grad_next.mT
    grad_k = grad_k + terms.to_chunk_end[..., None] * grad_keys_to_end
    to_end_terms = terms.to_chunk_end * (grad_keys_to_end * x.k).sum(-1)
    grad_gamma = grad_gamma - to_end_terms
    grad_gamma_last = to_end_terms.sum(-1) + terms.chunk_decay * (grad_next * states).sum((-2, -1))

    # U = U0 - W S, U0 = (I + A)^-1 diag(beta) V, W = (I + A)^-1 diag(beta exp(gamma)) K
    grad_w = -grad_u @ states.mT
    grad_beta_v = _solve(terms.solve_matrix, grad_u, transpose=True)
    grad_beta_k = _solve(terms.solve_matrix, grad_w, transpose=True)
    grad_solve_matrix = -(grad_beta_v @ terms.u0.mT + grad_beta_k @ terms.w.mT).tril(-1)
    grad_v = x.beta[..., None] * grad_beta_v
    beta_decayed = x.beta * exp_gamma
    grad_k = grad_k + beta_decayed[..., None] * grad_beta_k
    grad_beta = (grad_beta_v * x.v).sum(-1) + exp_gamma * (grad_beta_k * x.k).sum(-1)
    grad_gamma = grad_gamma + beta_decayed * (grad_beta_k * x.k).sum(-1)

    # A = beta_i decay_ij (k_i . k_j) below the diagonal
    weighted = grad_solve_matrix * terms.decay
    grad_beta = grad_beta + (weighted * (x.k @ x.k.mT)).sum(-1)
    grad_dots = weighted * x.beta[..., None]
    grad_k = grad_k + (grad_dots + grad_dots.mT) @ x.k
    grad_gamma = grad_gamma + _segment_sums(grad_solve_matrix * terms.solve_matrix)

    grad_gamma[..., -1] += grad_gamma_last
    grad_g = grad_gamma.flip(-1).cumsum(-1).flip(-1)

    def to_inputs(t: torch.Tensor) -> torch.Tensor:
        return x.sequences.merge(_per_position(t, x.seq_len))

    group = v.shape[2] // k.shape[2]
    grad_q = (to_inputs(grad_q) * scale).unflatten(2, (-1, group)).sum(3)
    grad_k = to_inputs(grad_k).unflatten(2, (-1, group)).sum(3)
    if use_qk_l2norm:
        grad_q = _l2_norm_backward(grad_q, *x.q_normalised)
        grad_k = _l2_norm_backward(grad_k, *x.k_normalised)
    grad_initial_state = q.new_empty(0) if initial_state is None else grad_initial.to(initial_state.dtype)
    return (
        grad_q.to(q.dtype).contiguous(),
        grad_k.to(k.dtype).contiguous(),
        to_inputs(grad_v).to(v.dtype).contiguous(),
        to_inputs(grad_g).to(g.dtype).contiguous(),
        to_inputs(grad_beta).to(beta.dtype).contiguous(),
        grad_initial_state.contiguous(),
    )


def _gated_delta_rule_bwd_fake(
    grad_o, grad_final_state, q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm
):
    grad_initial_state = q.new_empty(0) if initial_state is None else initial_state.new_empty(initial_state.shape)
    return tuple(t.new_empty(t.shape) for t in (q, k, v, g, beta)) + (grad_initial_state,)


_FORWARD_ARGS = (
    "Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, float scale, Tensor? initial_state, Tensor? cu_seqlens, "
    "bool use_qk_l2norm"
)
gated_delta_rule_op = _library.define(
    "gated_delta_rule",
    f"({_FORWARD_ARGS}) -> (Tensor o, Tensor final_state)",
    reference=_gated_delta_rule_reference,
    fake=_gated_delta_rule_fake,
)
gated_delta_rule_bwd_op = _library.define(
    "gated_delta_rule_bwd",
    f"(Tensor grad_o, Tensor? grad_final_state, {_FORWARD_ARGS}) -> (Tensor grad_q, Tensor grad_k, Tensor grad_v, "
    "Tensor grad_g, Tensor grad_beta, Tensor grad_initial_state)",
    reference=_gated_delta_rule_bwd_reference,
    fake=_gated_delta_rule_bwd_fake,
)


# ------------------------------------------------------------------------------------ autograd


# Positions in the forward schema of the inputs whose gradients tk::gated_delta_rule_bwd returns, in order.
_GRADIENT_INPUTS = (0, 1, 2, 3, 4, 6)


def _setup_context(ctx, inputs, output):
    q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm = inputs
    # An output that receives no gradient (final_state, unless returned and used) arrives as None.
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens)
    ctx.scale = scale
    ctx.use_qk_l2norm = use_qk_l2norm


def _gated_delta_rule_backward(ctx, grad_o, grad_final_state):
    q, k, v, g, beta, initial_state, cu_seqlens = ctx.saved_tensors
    if grad_o is None:
        grad_o = torch.zeros_like(v)
    grads = gated_delta_rule_bwd_op(
        _checks.unit_last_stride(grad_o), grad_final_state, q, k, v, g, beta, ctx.scale, initial_state, cu_seqlens,
        ctx.use_qk_l2norm,
    )
    grad_q, grad_k, grad_v, grad_g, grad_beta, grad_initial_state = (
        grad if ctx.needs_input_grad[index] else None for grad, index in zip(grads, _GRADIENT_INPUTS)
    )
    return grad_q, grad_k, grad_v, grad_g, grad_beta, None, grad_initial_state, None, None


_library.register_autograd(gated_delta_rule_op, _gated_delta_rule_backward, _setup_context)


# ----------------------------------------------------------------------------------- public API


def _check_gate(name: str, t: torch.Tensor, v: torch.Tensor, shape: tuple[int, ...]) -> None:
    """g or beta: (B, T, Hv) in v's dtype, or fp32 when v is fp16/bf16."""
    allowed = (v.dtype, torch.float32) if v.dtype in _LOW_PRECISION else (v.dtype,)
    if t.dtype not in allowed:
        names = " or ".join(str(d).replace("torch.", "") for d in allowed)
        raise TypeError(f"{name} must have dtype {names} (v is {v.dtype}), got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape} (B, T, Hv), got {tuple(t.shape)}")


def _check_cu_seqlens(cu_seqlens: torch.Tensor, q: torch.Tensor) -> None:
    if cu_seqlens.shape[0] < 2:
        raise ValueError(f"cu_seqlens must be (N + 1,) with N >= 1 sequences, got shape {tuple(cu_seqlens.shape)}")
    if q.shape[0] != 1:
        raise ValueError(
            f"with cu_seqlens the sequences are packed along T: q.shape[0] (B) must be 1, got shape {tuple(q.shape)}"
        )


def _check_arguments(q, k, v, g, beta, scale, initial_state, cu_seqlens) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        _checks.check_tensor(name, t, ndim=4)
    _checks.check_tensor("g", g, ndim=3)
    _checks.check_tensor("beta", beta, ndim=3)
    _checks.check_optional("initial_state", initial_state, ndim=4)
    if cu_seqlens is not None:
        _checks.check_tensor("cu_seqlens", cu_seqlens, ndim=1, dtypes=(torch.int32,))
    _checks.check_same_device(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state, cu_seqlens=cu_seqlens)
    _checks.check_same_dtype(q=q, k=k, v=v)
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape {tuple(q.shape)} (B, T, Hk, K), got {tuple(k.shape)}")
    batch, seq_len, key_heads, key_dim = q.shape
    _checks.check_dim("v", v, 0, batch, "q.shape[0] (B)")
    _checks.check_dim("v", v, 1, seq_len, "q.shape[1] (T)")
    value_heads = v.shape[2]
    if value_heads % key_heads != 0:
        raise ValueError(
            f"the value heads Hv = v.shape[2] ({value_heads}) must be a multiple of the key heads "
            f"Hk = q.shape[2] ({key_heads})"
        )
    _check_gate("g", g, v, (batch, seq_len, value_heads))
    _check_gate("beta", beta, v, (batch, seq_len, value_heads))
    if scale is not None and (
        isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale)
    ):
        raise ValueError(f"scale must be None or a finite number, got {scale!r}")
    states = batch
    if cu_seqlens is not None:
        _check_cu_seqlens(cu_seqlens, q)
        states = cu_seqlens.shape[0] - 1
        if _checks.may_read_contents(cu_seqlens, device_sync=False):
            sequence_bounds(cu_seqlens, seq_len)
    if initial_state is not None:
        state_dtype = _checks.compute_dtype(v.dtype)
        if initial_state.dtype != state_dtype:
            raise TypeError(
                f"initial_state must have dtype {str(state_dtype).replace('torch.', '')} (the state dtype for "
                f"{str(v.dtype).replace('torch.', '')} v), got {initial_state.dtype}"
            )
        expected = (states, value_heads, key_dim, v.shape[3])
        if tuple(initial_state.shape) != expected:
            which = "N = len(cu_seqlens) - 1" if cu_seqlens is not None else "B"
            raise ValueError(
                f"initial_state must have shape {expected} ({which}, Hv, K, V), got {tuple(initial_state.shape)}"
            )


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    use_qk_l2norm: bool = False,
):
    """The gated delta rule, as flash-linear-attention's ``chunk_gated_delta_rule`` (see the module docstring).

    q, k (B, T, Hk, K); v (B, T, Hv, V) with Hv % Hk == 0 (value head h reads key head h // (Hv / Hk));
    g (B, T, Hv) log decays (<= 0) and beta (B, T, Hv) in (0, 1), each in v's dtype or fp32 when v is
    fp16/bf16; scale defaults to 1 / sqrt(K); use_qk_l2norm normalises q and k over K first.
    cu_seqlens (N + 1,) int32 on q's device, with B = 1: N sequences packed along T, each from its own
    initial state. initial_state (N or B, Hv, K, V) in fp32 (fp64 for fp64 inputs). Returns
    ``(o, final_state)``: o (B, T, Hv, V) in v's dtype, final_state (N or B, Hv, K, V) in fp32 (fp64)
    with ``output_final_state``, else None. Differentiable in q, k, v, g, beta and initial_state.

    The contents of cu_seqlens (from 0, non-decreasing, ending at T) are checked here in eager mode on
    CPU tensors; elsewhere (a GPU: a device sync; under torch.compile: a graph break) the reference,
    which reads the lengths anyway, raises the same ValueError.
    """
    _check_arguments(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    if scale is None:
        scale = q.shape[3] ** -0.5
    q, k, v, g, beta, initial_state = (_checks.unit_last_stride(t) for t in (q, k, v, g, beta, initial_state))
    o, final_state = gated_delta_rule_op(
        q, k, v, g, beta, float(scale), initial_state,
        None if cu_seqlens is None else cu_seqlens.contiguous(), bool(use_qk_l2norm),
    )
    return o, (final_state if output_final_state else None)
