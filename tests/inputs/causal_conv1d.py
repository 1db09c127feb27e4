"""tk.causal_conv1d's inputs (tests/op_db.py and tests/test_causal_conv1d.py)."""

from __future__ import annotations

import torch


def make_inputs(B, D, L, W, *, dtype=torch.float64, param_dtype=None, with_bias=True, device="cpu"):
    """x ~ N(0, 1); taps scaled by W**-0.5 so the output stays O(1); bias ~ N(0, 1)."""
    param_dtype = param_dtype or dtype
    x = torch.randn(B, D, L, device=device).to(dtype)
    weight = (torch.randn(D, W, device=device) / W**0.5).to(param_dtype)
    bias = torch.randn(D, device=device).to(param_dtype) if with_bias else None
    return x, weight, bias
