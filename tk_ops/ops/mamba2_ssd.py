"""Mamba-2 state-space duality (SSD) scan: ``tk.mamba2_ssd``.

Semantics are those of mamba_ssm's ``mamba_chunk_scan_combined`` (``mamba_ssm/ops/triton/
ssd_combined.py``) with its default ``dt_limit=(0.0, inf)``. Per batch and head h (group
g = h // (H / G)), with the state s_t of shape (P, N):

  dt_t = max(softplus(dt_t + dt_bias), 0)      (bias and softplus optional; softplus(v) = v for v > 20)
  s_t  = exp(dt_t * A) s_{t-1} + dt_t * x_t B_t^T      s_{-1} = initial_states (or 0)
  y_t  = (s_t C_t + D * x_t) * silu(z_t)               (D and z optional; D is (H,) or (H, P))

The clamp at 0 is mamba_ssm's default ``dt_limit`` lower bound: a negative step (possible only
without softplus) becomes 0 and passes no gradient. Other ``dt_limit`` values are not offered.
``chunk_size`` changes the order of the arithmetic only, never the function.

Forward op
  tk::mamba2_ssd(Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, int chunk_size, Tensor? D,
                 Tensor? z, Tensor? dt_bias, bool dt_softplus, Tensor? initial_states)
      -> (Tensor y, Tensor final_states, Tensor chunk_states)
  x (Bt, L, H, P), dt (Bt, L, H), A (H,), B, C (Bt, L, G, N), z like x, dt_bias (H,),
  initial_states (Bt, H, P, N); y (Bt, L, H, P) in x's dtype; final_states (Bt, H, P, N) and
  chunk_states (Bt, ceil(L / chunk_size), H, P, N), the state entering each chunk (chunk 0:
  initial_states or 0), so that the backward needs no inter-chunk scan. States are fp32
  (fp64 for fp64 x); chunk_states is not differentiable.
Backward op
  tk::mamba2_ssd_bwd(Tensor grad_y, Tensor? grad_final_states, Tensor x, Tensor dt, Tensor A,
                     Tensor B, Tensor C, int chunk_size, Tensor? D, Tensor? z, Tensor? dt_bias,
                     bool dt_softplus, Tensor? initial_states, Tensor chunk_states)
      -> (Tensor grad_x, Tensor grad_dt, Tensor grad_A, Tensor grad_B, Tensor grad_C, Tensor grad_D,
          Tensor grad_z, Tensor grad_dt_bias, Tensor grad_initial_states)
  Each gradient has its input's dtype, except grad_A and grad_dt_bias: fp32 (fp64 for fp64 x),
  as mamba_ssm returns them (autograd casts them to the parameter's dtype). The gradient of an
  absent optional input is an empty tensor.

Chunked algorithm (both the reference below and the kernels). Positions are split into chunks
of Q = chunk_size (the last one zero-padded: dt = 0 leaves the state unchanged). Within a chunk,
a_i = dt_i A, cum_i = a_0 + ... + a_i, u_j = dt_j x_j, and for j <= i
  M[i, j] = (C_i . B_j) exp(cum_i - cum_j)                      (0 for j > i)
  y_i     = sum_j M[i, j] u_j + exp(cum_i) S C_i + D x_i       (S: the chunk's entering state)
  S_next  = exp(cum_{Q-1}) S + sum_j exp(cum_{Q-1} - cum_j) u_j B_j^T
Backward, with gy = grad_y * silu(z) (grad_z = grad_y * y_pre * silu'(z), y_pre the ungated y):
  state gradients, a reverse scan over chunks from grad_final_states (or 0):
    dS = sum_i exp(cum_i) gy_i C_i^T + exp(cum_{Q-1}) dS_next ;  grad_initial_states = dS of chunk 0
  du_j = sum_{i>=j} M[i, j] gy_i + exp(cum_{Q-1} - cum_j) dS_next B_j
  grad_x = dt * du + D gy ;  grad_D = sum gy x
  dM[i, j] = gy_i . u_j ; grad_C_i / grad_B_j get (dM exp(cum_i - cum_j)) B_j / C_i, plus
    exp(cum_i) S^T gy_i (C) and exp(cum_{Q-1} - cum_j) dS_next^T u_j (B), summed over the heads
    of a group
  da_k (each term written so that no large terms cancel):
      sum_{i>=k} sum_{j<k} dM[i, j] M[i, j]                      (intra-chunk decays)
    + sum_{i>=k} gy_i . exp(cum_i) S C_i                          (decay of the entering state)
    + sum_{j<k} exp(cum_{Q-1} - cum_j) u_j . (dS_next B_j)         (decay into the next state)
    + exp(cum_{Q-1}) <dS_next, S>                                 (decay of the whole chunk)
  grad_A = sum da dt ; d(dt) = du . x + da A, then through the clamp, softplus and dt_bias.

CUDA kernels (csrc/kernels/mamba2_ssd, registered by csrc/torch/mamba2_ssd.cpp): x, B, C, z (and
grad_y) in bf16/fp16 with a unit last stride (any other strides), P = 64, N in {64, 128},
chunk_size in {64, 128, 256}, any L, G groups with H % G == 0, D (H,) or (H, P), z, dt_bias and
softplus, initial_states, grad_final_states; dt, A, D, dt_bias, initial_states, chunk_states and
grad_final_states of any float dtype are read as fp32 (the reference's state dtype for 16-bit x).
Both directions walk the sequence in 64-position blocks, each block a chunk of its own (the function
does not depend on where chunks start; chunk_size only picks which states chunk_states holds).
Forward: one (batch, head) per consumer warpgroup (at N = 128 two heads of a group per thread block,
sharing the B and C tiles), carrying the state in fp32 wgmma accumulators (its 16-bit copy in shared
memory for C S), writing chunk_states at each chunk start and final_states at the end; when few
(batch, head) sequences would leave SMs idle, each sequence is split into segments of whole chunks:
a first launch computes each segment's end state from zero and its total decay, a scan gives the
state entering each segment, and the forward runs per (batch, head, segment) from it. Backward, three launches: the state entering every 64-position block, from
chunk_states through each chunk's blocks (16-bit, a workspace); a reverse sweep per (batch, head)
carrying dS in fp32 accumulators that writes grad_x, grad_z, grad_dt and grad_initial_states, per-head
fp32 partials of grad_B and grad_C and per-(batch, head) sums of grad_A, grad_D and grad_dt_bias
(summed over the batch afterwards), with da from per-position terms through an exclusive prefix scan
and a suffix scan (the block formulas in csrc/kernels/mamba2_ssd/mamba2_ssd_bwd.cu); and the sum of
the grad_B and grad_C partials over the heads of each group, in a fixed order (no atomics: the
gradients are bitwise reproducible). Everything else (fp32/fp64 x, other P, N or chunk_size, another
GPU) runs the reference, on a GPU with a one-time warning; it accepts any positive chunk_size, P, N
and fp16/bf16/fp32/fp64 inputs.

Comparing against mamba_ssm (benchmarks):
  from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
  y, final_states = mamba_chunk_scan_combined(
      x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias, initial_states=initial_states,
      dt_softplus=dt_softplus, return_final_states=True)
  computes the same y (x's dtype) and final_states (fp32) as
  tk_ops.mamba2_ssd(x, dt, A, B, C, chunk_size=chunk_size, D=D, z=z, dt_bias=dt_bias,
                    dt_softplus=dt_softplus, initial_states=initial_states, return_final_states=True).
  mamba_ssm's chunk_size is positional without a default; its grad_A and grad_dt_bias are fp32,
  grad_D is in D's dtype, grad_initial_states in x's dtype (ours: initial_states' dtype).
  Checked on an H100 against mamba_ssm 2.3.2.post1 (all options, negative dt without softplus):
  y, final_states and every gradient agree to 2e-3 in fp32 (mamba_ssm's Triton dots run in TF32)
  and 5e-3 in bf16.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from tk_ops import _checks, _library



def _num_chunks(seqlen, chunk_size: int):
    return (seqlen + chunk_size - 1) // chunk_size


def _split_chunks(t: torch.Tensor, chunk_size: int, dtype: torch.dtype) -> torch.Tensor:
    """(Bt, L, ...) -> (Bt, nchunks, chunk_size, ...) in ``dtype``, zero-padding the last chunk."""
    seqlen = t.shape[1]
    padding = _num_chunks(seqlen, chunk_size) * chunk_size - seqlen
    t = F.pad(t.to(dtype), (0, 0) * (t.dim() - 2) + (0, padding))
    return t.unflatten(1, (-1, chunk_size))


def _merge_chunks(t: torch.Tensor, seqlen: int) -> torch.Tensor:
    """(Bt, nchunks, chunk_size, ...) -> (Bt, L, ...), dropping the padding."""
    return t.flatten(1, 2)[:, :seqlen]


def _steps_before_clamp(dt, dt_bias, dt_softplus: bool, dtype: torch.dtype):
    """(dt + dt_bias, softplus of it or itself): the step before the clamp at 0."""
    biased = dt.to(dtype) if dt_bias is None else dt.to(dtype) + dt_bias.to(dtype)
    return biased, (F.softplus(biased) if dt_softplus else biased)


@dataclass
class _ChunkTerms:
    """Per-chunk quantities shared by the forward and the backward (layouts in comments)."""

    x: torch.Tensor  # (Bt, c, Q, H, P)
    steps: torch.Tensor  # (Bt, c, Q, H), dt after bias, softplus and clamp; 0 on padding
    B: torch.Tensor  # (Bt, c, Q, G, N)
    C: torch.Tensor  # (Bt, c, Q, G, N)
    B_heads: torch.Tensor  # (Bt, c, Q, H, N)
    C_heads: torch.Tensor  # (Bt, c, Q, H, N)
    cum: torch.Tensor  # (Bt, c, Q, H), inclusive cumsum of steps * A within the chunk
    decay: torch.Tensor  # (Bt, c, H, Q, Q), exp(cum_i - cum_j) for j <= i, else 0
    scores: torch.Tensor  # (Bt, c, H, Q, Q), M = (C_i . B_j) * decay
    u: torch.Tensor  # (Bt, c, Q, H, P), steps * x
    to_chunk_end: torch.Tensor  # (Bt, c, Q, H), exp(cum_last - cum_j)
    chunk_decay: torch.Tensor  # (Bt, c, H), exp(cum_last)


def _chunk_terms(x, dt, A, B, C, chunk_size, dt_bias, dt_softplus, dtype) -> _ChunkTerms:
    heads_per_group = x.shape[2] // B.shape[2]
    _, steps = _steps_before_clamp(dt, dt_bias, dt_softplus, dtype)
    steps = _split_chunks(steps.clamp(min=0), chunk_size, dtype)
    xs = _split_chunks(x, chunk_size, dtype)
    Bs, Cs = _split_chunks(B, chunk_size, dtype), _split_chunks(C, chunk_size, dtype)
    cum = torch.cumsum(steps * A.to(dtype), dim=2)
    cum_by_head = cum.transpose(2, 3)
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=x.device).tril()
    segment = cum_by_head[..., :, None] - cum_by_head[..., None, :]
    decay = torch.exp(segment.masked_fill(~causal, float("-inf")))
    group_scores = torch.einsum("bcign,bcjgn->bcgij", Cs, Bs)
    scores = group_scores.repeat_interleave(heads_per_group, dim=2) * decay
    cum_last = cum[:, :, -1]
    return _ChunkTerms(
        x=xs,
        steps=steps,
        B=Bs,
        C=Cs,
        B_heads=Bs.repeat_interleave(heads_per_group, dim=3),
        C_heads=Cs.repeat_interleave(heads_per_group, dim=3),
        cum=cum,
        decay=decay,
        scores=scores,
        u=xs * steps[..., None],
        to_chunk_end=torch.exp(cum_last[:, :, None] - cum),
        chunk_decay=torch.exp(cum_last),
    )


def _skip_term(x: torch.Tensor, D: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """D * x with D of shape (H,) or (H, P)."""
    weight = D.to(dtype) if D.dim() == 2 else D.to(dtype)[:, None]
    return x.to(dtype) * weight


def _ungated_output(terms: _ChunkTerms, chunk_states, x, D, dtype) -> torch.Tensor:
    """y before the silu(z) gate, (Bt, L, H, P) in the state dtype."""
    intra = torch.einsum("bchij,bcjhp->bcihp", terms.scores, terms.u)
    entering = torch.einsum("bcihn,bchpn->bcihp", terms.C_heads, chunk_states)
    y = _merge_chunks(intra + entering * torch.exp(terms.cum)[..., None], x.shape[1])
    return y if D is None else y + _skip_term(x, D, dtype)


# ----------------------------------------------------------------------------------- reference


def _mamba2_ssd_reference(x, dt, A, B, C, chunk_size, D, z, dt_bias, dt_softplus, initial_states):
    dtype = _checks.compute_dtype(x.dtype)
    batch, _, heads, head_dim = x.shape
    terms = _chunk_terms(x, dt, A, B, C, chunk_size, dt_bias, dt_softplus, dtype)
    chunk_inputs = torch.einsum("bcjhp,bcjhn->bchpn", terms.u * terms.to_chunk_end[..., None], terms.B_heads)
    state = (
        x.new_zeros((batch, heads, head_dim, B.shape[-1]), dtype=dtype)
        if initial_states is None
        else initial_states.to(dtype)
    )
    entering = []
    for chunk in range(chunk_inputs.shape[1]):
        entering.append(state)
        state = terms.chunk_decay[:, chunk, :, None, None] * state + chunk_inputs[:, chunk]
    chunk_states = torch.stack(entering, dim=1)
    y = _ungated_output(terms, chunk_states, x, D, dtype)
    if z is not None:
        y = y * F.silu(z.to(dtype))
    return y.to(x.dtype).contiguous(), state.contiguous(), chunk_states.contiguous()


def _mamba2_ssd_fake(x, dt, A, B, C, chunk_size, D, z, dt_bias, dt_softplus, initial_states):
    batch, seqlen, heads, head_dim = x.shape
    state_shape = (batch, heads, head_dim, B.shape[-1])
    dtype = _checks.compute_dtype(x.dtype)
    chunks_shape = (batch, _num_chunks(seqlen, chunk_size), *state_shape[1:])
    return x.new_empty(x.shape), x.new_empty(state_shape, dtype=dtype), x.new_empty(chunks_shape, dtype=dtype)


def _mamba2_ssd_bwd_reference(
    grad_y, grad_final_states, x, dt, A, B, C, chunk_size, D, z, dt_bias, dt_softplus, initial_states, chunk_states
):
    dtype = _checks.compute_dtype(x.dtype)
    seqlen, groups = x.shape[1], B.shape[2]
    terms = _chunk_terms(x, dt, A, B, C, chunk_size, dt_bias, dt_softplus, dtype)

    grad_y = grad_y.to(dtype)
    if z is None:
        grad_z = x.new_empty(0)
    else:
        gate = torch.sigmoid(z.to(dtype))
        y_pre = _ungated_output(terms, chunk_states, x, D, dtype)
        grad_z = (grad_y * y_pre * gate * (1 + z.to(dtype) * (1 - gate))).to(z.dtype).contiguous()
        grad_y = grad_y * z.to(dtype) * gate
    if D is None:
        grad_D = x.new_empty(0)
    else:
        reduce_dims = (0, 1) if D.dim() == 2 else (0, 1, 3)
        grad_D = (grad_y * x.to(dtype)).sum(reduce_dims).to(D.dtype)
    gy = _split_chunks(grad_y, chunk_size, dtype)

    # Entering states: y_i += exp(cum_i) S C_i.
    out_decay = torch.exp(terms.cum)[..., None]
    grad_states_from_y = torch.einsum("bcihp,bcihn->bchpn", gy, terms.C_heads * out_decay)
    grad_C_heads = torch.einsum("bcihp,bchpn->bcihn", gy, chunk_states) * out_decay
    grad_cum_from_states = (grad_C_heads * terms.C_heads).sum(-1)

    # Reverse scan over chunks: the gradient of the state leaving chunk c is that of the next one.
    grad_state = (
        chunk_states.new_zeros(chunk_states[:, 0].shape) if grad_final_states is None else grad_final_states.to(dtype)
    )
    leaving = []
    for chunk in reversed(range(chunk_states.shape[1])):
        leaving.append(grad_state)
        grad_state = grad_states_from_y[:, chunk] + terms.chunk_decay[:, chunk, :, None, None] * grad_state
    grad_next = torch.stack(leaving[::-1], dim=1)
    grad_initial_states = (
        x.new_empty(0) if initial_states is None else grad_state.to(initial_states.dtype).contiguous()
    )
    grad_chunk_decay = (grad_next * chunk_states).sum((-2, -1)) * terms.chunk_decay

    # Chunk inputs: S_next += exp(cum_last - cum_j) u_j B_j^T.
    grad_next_B = torch.einsum("bchpn,bcjhn->bcjhp", grad_next, terms.B_heads)
    weight = terms.to_chunk_end[..., None]
    grad_u = grad_next_B * weight
    grad_B_heads = torch.einsum("bchpn,bcjhp->bcjhn", grad_next, terms.u) * weight
    grad_to_chunk_end = (grad_next_B * terms.u).sum(-1) * terms.to_chunk_end

    # Intra-chunk: y_i += sum_j M[i, j] u_j.
    grad_u = grad_u + torch.einsum("bchij,bcihp->bcjhp", terms.scores, gy)
    grad_scores = torch.einsum("bcihp,bcjhp->bchij", gy, terms.u)
    grad_group_scores = (grad_scores * terms.decay).unflatten(2, (groups, -1)).sum(3)
    grad_segment = grad_scores * terms.scores
    # B and C are shared by the heads of a group: their gradients sum over those heads.
    grad_C = torch.einsum("bcgij,bcjgn->bcign", grad_group_scores, terms.B)
    grad_C = grad_C + grad_C_heads.unflatten(3, (groups, -1)).sum(4)
    grad_B = torch.einsum("bcgij,bcign->bcjgn", grad_group_scores, terms.C)
    grad_B = grad_B + grad_B_heads.unflatten(3, (groups, -1)).sum(4)

    # Log decays a_k = steps_k * A: each term summed over the decay spans that contain k.
    strictly_lower = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=x.device).tril(-1)
    rows_from_k = grad_segment.flip(-2).cumsum(-2).flip(-2)
    grad_a = (rows_from_k * strictly_lower).sum(-1).transpose(2, 3)
    grad_a = grad_a + grad_cum_from_states.flip(2).cumsum(2).flip(2)
    grad_a = grad_a + F.pad(torch.cumsum(grad_to_chunk_end, dim=2)[:, :, :-1], (0, 0, 1, 0))
    grad_a = grad_a + grad_chunk_decay[:, :, None, :]

    grad_A = (grad_a * terms.steps).sum((0, 1, 2))
    grad_steps = _merge_chunks((grad_u * terms.x).sum(-1) + grad_a * A.to(dtype), seqlen)
    biased, before_clamp = _steps_before_clamp(dt, dt_bias, dt_softplus, dtype)
    grad_steps = grad_steps * (before_clamp >= 0)
    if dt_softplus:
        grad_steps = grad_steps * torch.where(biased <= 20, torch.sigmoid(biased), 1)
    grad_dt_bias = x.new_empty(0) if dt_bias is None else grad_steps.sum((0, 1))

    grad_x = _merge_chunks(grad_u * terms.steps[..., None], seqlen)
    if D is not None:
        grad_x = grad_x + _skip_term(grad_y, D, dtype)
    return (
        grad_x.to(x.dtype).contiguous(),
        grad_steps.to(dt.dtype).contiguous(),
        grad_A,
        _merge_chunks(grad_B, seqlen).to(B.dtype).contiguous(),
        _merge_chunks(grad_C, seqlen).to(C.dtype).contiguous(),
        grad_D,
        grad_z,
        grad_dt_bias,
        grad_initial_states,
    )


def _mamba2_ssd_bwd_fake(
    grad_y, grad_final_states, x, dt, A, B, C, chunk_size, D, z, dt_bias, dt_softplus, initial_states, chunk_states
):
    dtype = _checks.compute_dtype(x.dtype)

    def like(t: Optional[torch.Tensor], grad_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        if t is None:
            return x.new_empty(0)
        return t.new_empty(t.shape, dtype=grad_dtype or t.dtype)

    return (
        like(x),
        like(dt),
        like(A, dtype),
        like(B),
        like(C),
        like(D),
        like(z),
        like(dt_bias, dtype),
        like(initial_states),
    )


_FORWARD_ARGS = (
    "Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, int chunk_size, Tensor? D, Tensor? z, "
    "Tensor? dt_bias, bool dt_softplus, Tensor? initial_states"
)
mamba2_ssd_op = _library.define(
    "mamba2_ssd",
    f"({_FORWARD_ARGS}) -> (Tensor y, Tensor final_states, Tensor chunk_states)",
    reference=_mamba2_ssd_reference,
    fake=_mamba2_ssd_fake,
)
mamba2_ssd_bwd_op = _library.define(
    "mamba2_ssd_bwd",
    f"(Tensor grad_y, Tensor? grad_final_states, {_FORWARD_ARGS}, Tensor chunk_states) -> "
    "(Tensor grad_x, Tensor grad_dt, Tensor grad_A, Tensor grad_B, Tensor grad_C, Tensor grad_D, "
    "Tensor grad_z, Tensor grad_dt_bias, Tensor grad_initial_states)",
    reference=_mamba2_ssd_bwd_reference,
    fake=_mamba2_ssd_bwd_fake,
)


# ------------------------------------------------------------------------------------ autograd


# chunk_states is not differentiable; an output that receives no gradient arrives as None (y's as zeros).
_library.register_derivatives(
    mamba2_ssd_op,
    "mamba2_ssd_bwd(grad_y, grad_final_states, x, dt, A, B, C, chunk_size, D, z, dt_bias, dt_softplus, initial_states,"
    " chunk_states) -> x, dt, A, B, C, D, z, dt_bias, initial_states",
    differentiable="y, final_states",
    materialize_grads=False,
    zeros="grad_y like x",
)


# ----------------------------------------------------------------------------------- public API


def _check_arguments(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states) -> None:
    _checks.check_tensor("x", x, ndim=4)
    _checks.check_tensor("dt", dt, ndim=3)
    _checks.check_tensor("A", A, ndim=1)
    _checks.check_tensor("B", B, ndim=4)
    _checks.check_tensor("C", C, ndim=4)
    _checks.check_optional("D", D, ndim=(1, 2))
    _checks.check_optional("z", z, ndim=4)
    _checks.check_optional("dt_bias", dt_bias, ndim=1)
    _checks.check_optional("initial_states", initial_states, ndim=4)
    _checks.check_same_device(
        x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias, initial_states=initial_states
    )
    _checks.check_same_dtype(x=x, B=B, C=C, z=z)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
        raise TypeError(f"chunk_size must be an int, got {type(chunk_size).__name__}")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")

    batch, seqlen, heads, head_dim = x.shape
    for dim, (size, what) in enumerate(((batch, "x.shape[0] (batch)"), (seqlen, "x.shape[1] (seqlen)"))):
        _checks.check_dim("dt", dt, dim, size, what)
        _checks.check_dim("B", B, dim, size, what)
    _checks.check_dim("dt", dt, 2, heads, "x.shape[2] (heads)")
    _checks.check_dim("A", A, 0, heads, "x.shape[2] (heads)")
    groups, state_size = B.shape[2], B.shape[3]
    if heads % groups != 0:
        raise ValueError(
            f"the number of heads H = x.shape[2] ({heads}) must be a multiple of the number of "
            f"groups G = B.shape[2] ({groups})"
        )
    if C.shape != B.shape:
        raise ValueError(f"C must have B's shape {tuple(B.shape)}, got shape {tuple(C.shape)}")
    if z is not None and z.shape != x.shape:
        raise ValueError(f"z must have x's shape {tuple(x.shape)}, got shape {tuple(z.shape)}")
    if D is not None and D.shape not in ((heads,), (heads, head_dim)):
        raise ValueError(f"D must have shape ({heads},) or ({heads}, {head_dim}) (H or H, P), got {tuple(D.shape)}")
    if dt_bias is not None:
        _checks.check_dim("dt_bias", dt_bias, 0, heads, "x.shape[2] (heads)")
    if initial_states is not None and initial_states.shape != (batch, heads, head_dim, state_size):
        raise ValueError(
            f"initial_states must have shape ({batch}, {heads}, {head_dim}, {state_size}) (Bt, H, P, N), "
            f"got {tuple(initial_states.shape)}"
        )


def mamba2_ssd(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    chunk_size: int = 256,
    D: Optional[torch.Tensor] = None,
    z: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
    dt_softplus: bool = False,
    initial_states: Optional[torch.Tensor] = None,
    return_final_states: bool = False,
):
    """Mamba-2 SSD scan, as mamba_ssm's ``mamba_chunk_scan_combined`` (see the module docstring).

    x (Bt, L, H, P), dt (Bt, L, H), A (H,), B, C (Bt, L, G, N) with H % G == 0, D (H,) or (H, P),
    z like x, dt_bias (H,), initial_states (Bt, H, P, N). x, B, C and z share one dtype; dt, A, D,
    dt_bias and initial_states may be fp32. Returns y (Bt, L, H, P) in x's dtype, and with
    ``return_final_states`` also the final states (Bt, H, P, N) in fp32.
    """
    _check_arguments(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states)
    x, dt, A, B, C, D, z, dt_bias, initial_states = (
        _checks.unit_last_stride(t) for t in (x, dt, A, B, C, D, z, dt_bias, initial_states)
    )
    y, final_states, _ = mamba2_ssd_op(
        x, dt, A, B, C, chunk_size, D, z, dt_bias, bool(dt_softplus), initial_states
    )
    return (y, final_states) if return_final_states else y
