"""tk.based_attention's inputs (tests/op_db.py and tests/test_based_attention.py)."""

from __future__ import annotations

import math

import torch

B, H, F, DV = 2, 3, 5, 7


def make_inputs(n, *, f=F, dv=DV, dtype=torch.float64, device="cpu", requires_grad=False):
    q, k = (torch.randn(B, H, n, f, dtype=dtype, device=device) for _ in range(2))
    v = torch.randn(B, H, n, dv, dtype=dtype, device=device)
    return tuple(t.requires_grad_(requires_grad) for t in (q, k, v))


def taylor_features(x):
    """phi(x) = [1, x / F**0.25, vec(x x^T) / (sqrt(2) * sqrt(F))], as the contract writes it."""
    f = x.shape[-1]
    outer = torch.einsum("...a,...b->...ab", x, x).reshape(*x.shape[:-1], f * f)
    return torch.cat([torch.ones_like(x[..., :1]), x / f**0.25, outer / (math.sqrt(2) * math.sqrt(f))], dim=-1)


def naive_based_attention(q, k, v, normalize, eps):
    """The N x N matrix phi(q_i) . phi(k_j), masked causally, in float64."""
    n = q.shape[-2]
    causal = torch.arange(n)[:, None] >= torch.arange(n)[None, :]
    scores = torch.einsum("bhip,bhjp->bhij", taylor_features(q.double()), taylor_features(k.double()))
    scores = torch.where(causal.to(q.device), scores, 0.0)
    numerator = torch.einsum("bhij,bhjd->bhid", scores, v.double())
    if not normalize:
        return numerator
    return numerator / (scores.sum(-1, keepdim=True) + eps)
