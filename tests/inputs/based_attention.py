"""tk.based_attention's inputs (tests/op_db.py and tests/test_based_attention.py)."""

from __future__ import annotations

import torch

B, H, F, DV = 2, 3, 5, 7


def make_inputs(n, *, f=F, dv=DV, dtype=torch.float64, device="cpu", requires_grad=False):
    q, k = (torch.randn(B, H, n, f, dtype=dtype, device=device) for _ in range(2))
    v = torch.randn(B, H, n, dv, dtype=dtype, device=device)
    return tuple(t.requires_grad_(requires_grad) for t in (q, k, v))
