"""tk.attention's inputs (tests/op_db.py and tests/test_attention.py)."""

from __future__ import annotations

import contextlib
import os
from unittest import mock

import torch

# The backward's two dq methods on the kernels: the one-pass method forced through the environment
# (by default it runs only where it is faster: long sequences at D = 128, causal ones at D = 64),
# and the deterministic one.
BACKWARD_ENV = "TK_OPS_ATTENTION_BACKWARD"
BACKWARD_METHODS = ["one_pass", "deterministic"]
# A relative difference as small as one bf16 rounding step (2^-8): what varying fp32 summation
# order can leave after the result is rounded to bf16.
BF16_ROUNDING = 2.0**-8


def make_qkv(batch, q_heads, kv_heads, q_len, key_len, head_dim, dtype=torch.float64, value_dim=None,
             device="cpu", requires_grad=True):
    value_dim = head_dim if value_dim is None else value_dim
    shapes = [(batch, q_heads, q_len, head_dim), (batch, kv_heads, key_len, head_dim),
              (batch, kv_heads, key_len, value_dim)]
    return [torch.randn(s, dtype=dtype, device=device).requires_grad_(requires_grad) for s in shapes]


@contextlib.contextmanager
def backward_method(method: str):
    """The backward method ``method`` (one of BACKWARD_METHODS) selected inside the block, as
    test_attention.use_backward_method selects it for a whole test (the environment is restored after)."""
    with mock.patch.dict(os.environ):
        if method == "one_pass":
            os.environ[BACKWARD_ENV] = "one_pass"
        else:
            os.environ.pop(BACKWARD_ENV, None)
        yield
