"""tk.layer_norm's inputs (tests/op_db.py and tests/test_layer_norm.py)."""

from __future__ import annotations

import torch

EPS = 1e-5


def make_inputs(shape, dtype=torch.float64, *, affine="both", residual_dtype=None, requires_grad=False):
    hidden = shape[-1]
    x = torch.randn(shape, dtype=dtype)
    weight = 1 + 0.5 * torch.randn(hidden, dtype=dtype) if affine in ("both", "weight") else None
    bias = torch.randn(hidden, dtype=dtype) if affine in ("both", "bias") else None
    residual = torch.randn(shape, dtype=residual_dtype) if residual_dtype is not None else None
    tensors = (x, weight, bias, residual)
    for t in tensors:
        if t is not None:
            t.requires_grad_(requires_grad)
    return tensors
