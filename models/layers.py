"""What the Llama and BERT models share: linear layers, autocast casts for the norms, rotary tables.

Every model module has a ``reference`` flag. ``reference=False`` runs on tk_ops (``tk_ops.linear``,
``tk_ops.attention``, ``tk_ops.rms_norm``, ``tk_ops.layer_norm``, ``tk_ops.rope_qk``);
``reference=True`` runs on standard PyTorch ops only (``F.linear``,
``F.scaled_dot_product_attention``, ``F.layer_norm``, ...). Both paths have the same parameters
and state_dict keys, so one checkpoint serves both.

Under ``torch.autocast``, tk_ops.linear / matmul / attention cast fp32 inputs to the autocast
dtype themselves, as their torch counterparts do. The norms are not autocast (in torch either);
the tk path hands them activations in the autocast dtype (``to_autocast_dtype``) so the fused
residual stream and the kernels run in 16-bit, with the fp32 master weights.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

import tk_ops


def autocast_dtype(device: torch.device) -> Optional[torch.dtype]:
    """The dtype ``torch.autocast`` computes in on ``device`` now, or None outside autocast."""
    if not torch.is_autocast_enabled(device.type):
        return None
    return torch.get_autocast_dtype(device.type)


def to_autocast_dtype(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``t`` cast to the autocast dtype of its device when autocast is on there, else ``t`` itself."""
    if t is None or not t.is_floating_point():
        return t
    dtype = autocast_dtype(t.device)
    return t if dtype is None or t.dtype == dtype else t.to(dtype)


def at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    """bf16/fp16 upcast to fp32 (the loss, the reference RMSNorm); fp32 and fp64 unchanged."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def make_linear(in_features: int, out_features: int, *, bias: bool, reference: bool) -> torch.nn.Linear:
    """``nn.Linear`` on the reference path, ``tk_ops.nn.Linear`` on the tk path (same parameters and keys)."""
    cls = torch.nn.Linear if reference else tk_ops.nn.Linear
    return cls(in_features, out_features, bias=bias)


def rotary_inverse_frequencies(rotary_dim: int, theta: float) -> torch.Tensor:
    """``theta ** (-2i / rotary_dim)`` for i < rotary_dim / 2, in fp32 (Hugging Face's default rope)."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    return 1.0 / (theta**exponents)


def rotary_tables(inverse_frequencies: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each (seq_len, rotary_dim / 2) in fp32: the half form ``tk_ops.rope_qk`` takes."""
    positions = torch.arange(seq_len, device=inverse_frequencies.device, dtype=torch.float32)
    angles = torch.outer(positions, inverse_frequencies.float())
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def reference_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Hugging Face's ``apply_rotary_pos_emb`` for one of q, k (B, H, N, D), full rotary."""
    cos = torch.cat((cos, cos), dim=-1).to(x.dtype)
    sin = torch.cat((sin, sin), dim=-1).to(x.dtype)
    return x * cos + rotate_half(x) * sin


def reference_attention(q, k, v, *, causal: bool, dropout_p: float = 0.0) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` with GQA (k, v may have fewer heads than q)."""
    return F.scaled_dot_product_attention(
        q, k, v, dropout_p=dropout_p, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1]
    )
