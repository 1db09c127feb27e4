"""tk.linear_attention's inputs (tests/op_db.py and tests/test_linear_attention.py)."""

from __future__ import annotations

import torch

B, H, F, DV = 2, 3, 9, 7


def make_inputs(n, *, normalize, f=F, dv=DV, dtype=torch.float64, device="cpu", requires_grad=False):
    """Random q, k, v; normalised cases get positive features so the denominator stays away from 0."""
    if normalize:
        q, k = (torch.rand(B, H, n, f, dtype=dtype, device=device) + 0.1 for _ in range(2))
    else:
        q, k = (torch.randn(B, H, n, f, dtype=dtype, device=device) for _ in range(2))
    v = torch.randn(B, H, n, dv, dtype=dtype, device=device)
    return tuple(t.requires_grad_(requires_grad) for t in (q, k, v))


def scaled_inputs(n, *, normalize, f, dv, dtype, b=B, h=H, requires_grad=False):
    """make_inputs on the GPU with q scaled by F**-0.5: unit-scale scores keep fp16 (the state's copy,
    the unnormalised output) in range at every F."""
    q, k, v = make_inputs(n, normalize=normalize, f=f, dv=dv, dtype=dtype, device="cuda")
    q = (q.float() * f**-0.5).to(dtype)
    return tuple(t.requires_grad_(requires_grad) for t in (q, k, v))


def naive_linear_attention(q, k, v, normalize, eps):
    """out_i = sum_{j<=i} (q_i . k_j) v_j (/ (sum_{j<=i} q_i . k_j + eps)), the full N x N matrix in float64."""
    n = q.shape[-2]
    causal = torch.arange(n)[:, None] >= torch.arange(n)[None, :]
    scores = torch.where(causal.to(q.device), torch.einsum("bhif,bhjf->bhij", q.double(), k.double()), 0.0)
    numerator = torch.einsum("bhij,bhjd->bhid", scores, v.double())
    if not normalize:
        return numerator
    return numerator / (scores.sum(-1, keepdim=True) + eps)
