"""tk.attention's inputs (tests/op_db.py and tests/test_attention.py)."""

from __future__ import annotations

import torch


def make_qkv(batch, q_heads, kv_heads, q_len, key_len, head_dim, dtype=torch.float64, value_dim=None,
             device="cpu", requires_grad=True):
    value_dim = head_dim if value_dim is None else value_dim
    shapes = [(batch, q_heads, q_len, head_dim), (batch, kv_heads, key_len, head_dim),
              (batch, kv_heads, key_len, value_dim)]
    return [torch.randn(s, dtype=dtype, device=device).requires_grad_(requires_grad) for s in shapes]
