"""tk.rms_norm's inputs (tests/op_db.py and tests/test_rms_norm.py)."""

from __future__ import annotations

import torch

EPS = 1e-6


def make_inputs(shape, dtype=torch.float64, *, weight=True, residual_dtype=None, requires_grad=False):
    x = torch.randn(shape, dtype=dtype)
    w = 1 + 0.5 * torch.randn(shape[-1], dtype=dtype) if weight else None
    residual = torch.randn(shape, dtype=residual_dtype) if residual_dtype is not None else None
    tensors = (x, w, residual)
    for t in tensors:
        if t is not None:
            t.requires_grad_(requires_grad)
    return tensors
