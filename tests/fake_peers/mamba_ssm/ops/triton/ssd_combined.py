"""``mamba_chunk_scan_combined`` as mamba-ssm 2.3.2 documents it, for the calls a Mamba-2 layer makes
(no z, no initial or final states, no sequence index): x (b, l, h, p), dt (b, l, h), A (h,), B and C
(b, l, g, n), D (h,) or (h, p); dt + dt_bias, softplus when ``dt_softplus``, clamped to ``dt_limit``;
y = SSD(x, dt, A, B, C) + D x in x's dtype, computed by models.mamba2.reference_ssd in fp32 (fp64 for
fp64 inputs). The shapes are checked, so that a wrong layout in the peer wiring fails. ``CALLS``
records each call's shapes and arguments."""

import math

import torch
import torch.nn.functional as F

from models.mamba2 import reference_ssd

CALLS: list[dict] = []


def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                              seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
                              return_final_states=False, return_varlen_states=False):
    unsupported = (z, initial_states, seq_idx, cu_seqlens, return_final_states or None, return_varlen_states or None)
    if any(a is not None for a in unsupported):
        raise NotImplementedError("the fake covers a Mamba-2 layer's call only")
    batch, seq_len, heads, _ = x.shape
    if dt.shape != (batch, seq_len, heads) or A.shape != (heads,):
        shapes = f"got {tuple(dt.shape)} and {tuple(A.shape)} for x {tuple(x.shape)}"
        raise ValueError(f"dt must be (b, l, h) and A (h,): {shapes}")
    if B.shape != C.shape or B.shape[:2] != (batch, seq_len) or heads % B.shape[2]:
        raise ValueError(f"B and C must be (b, l, g, n): got {tuple(B.shape)}, {tuple(C.shape)} for x {tuple(x.shape)}")
    CALLS.append({"x": tuple(x.shape), "B": tuple(B.shape), "chunk_size": chunk_size, "dt_softplus": dt_softplus,
                  "dt_limit": tuple(dt_limit)})
    compute = torch.promote_types(x.dtype, torch.float32)
    dt = dt.to(compute)
    if dt_bias is not None:
        dt = dt + dt_bias
    if dt_softplus:
        dt = F.softplus(dt)
    if tuple(dt_limit) != (0.0, math.inf):
        dt = dt.clamp(*dt_limit)
    y = reference_ssd(x.to(compute), dt, A.to(compute), B.to(compute), C.to(compute), chunk_size)
    if D is not None:
        y = y + x.to(compute) * (D[:, None] if D.dim() == 1 else D)
    return y.to(x.dtype)
