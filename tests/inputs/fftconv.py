"""tk.fftconv's inputs (tests/op_db.py and tests/test_fftconv.py)."""

from __future__ import annotations

import torch


def make_inputs(B, H, N, L, *, dtype=torch.float64, param_dtype=None, with_D=True, device="cpu"):
    """u ~ N(0, 1); k scaled like a long filter so that y stays O(1); D ~ N(0, 1)."""
    param_dtype = param_dtype or dtype
    u = torch.randn(B, H, N, device=device).to(dtype)
    k = (torch.randn(H, L, device=device) / L**0.5).to(param_dtype)
    D = torch.randn(H, device=device).to(param_dtype) if with_D else None
    return u, k, D
