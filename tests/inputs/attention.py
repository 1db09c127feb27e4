"""tk.attention's and tk.attention_varlen's inputs (tests/op_db.py, tests/test_attention.py and
tests/test_attention_features.py)."""

from __future__ import annotations

import contextlib
import itertools
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


def make_varlen(q_lengths, k_lengths, q_heads=4, kv_heads=2, head_dim=16, value_dim=None, dtype=torch.float64,
                device="cpu", requires_grad=True):
    """Packed q (total_q, Hq, D), k, v (total_k, Hkv, D/Dv) and int32 cu_seqlens for the given lengths."""
    value_dim = head_dim if value_dim is None else value_dim
    cu_q = torch.tensor([0, *itertools.accumulate(q_lengths)], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, *itertools.accumulate(k_lengths)], dtype=torch.int32, device=device)
    q, k, v = (torch.randn(shape, dtype=dtype, device=device).requires_grad_(requires_grad) for shape in (
        (sum(q_lengths), q_heads, head_dim), (sum(k_lengths), kv_heads, head_dim), (sum(k_lengths), kv_heads, value_dim)))
    return q, k, v, cu_q, cu_k, max(max(q_lengths), 1), max(max(k_lengths), 1)


# Packed sequences captured in a CUDA graph: the kernels read cu_seqlens on the device, so a replay follows
# the lengths copied into them (of the same count, none longer than the captured max_seqlen).
VARLEN_GRAPH_LENGTHS = ([100, 30, 250], [120, 30, 250])
VARLEN_GRAPH_MAX_SEQLEN = 250


def varlen_graph_inputs() -> list[torch.Tensor]:
    """q, k, v, cu_seqlens_q, cu_seqlens_k of VARLEN_GRAPH_LENGTHS (bf16, D = 64, on the GPU) and a grad_out."""
    q, k, v, cu_q, cu_k, _, _ = make_varlen(*VARLEN_GRAPH_LENGTHS, head_dim=64, dtype=torch.bfloat16, device="cuda",
                                            requires_grad=False)
    return [q, k, v, cu_q, cu_k, torch.randn_like(q)]


def varlen_graph_step(q, k, v, cu_seqlens_q, cu_seqlens_k, grad_out) -> tuple[torch.Tensor, ...]:
    """out, lse and the gradients of q, k, v: causal with a window of 64, the deterministic backward (the
    one-pass dq's sums come in no fixed order, so replays could not equal eager calls bitwise)."""
    arguments = (cu_seqlens_q, cu_seqlens_k, VARLEN_GRAPH_MAX_SEQLEN, VARLEN_GRAPH_MAX_SEQLEN, True, 64**-0.5, 64, -1,
                 0.0, None, True)
    out, lse = torch.ops.tk.attention_varlen(q, k, v, *arguments)
    grad_q, grad_k, grad_v, _ = torch.ops.tk.attention_varlen_bwd(grad_out, None, q, k, v, out, lse, *arguments)
    return out, lse, grad_q, grad_k, grad_v
