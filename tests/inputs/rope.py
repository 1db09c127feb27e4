"""tk.rope's and tk.rope_qk's inputs (tests/op_db.py and tests/test_rope.py)."""

from __future__ import annotations

import torch


def random_angles(batch: int, seq_len: int, rotary_dim: int, device="cpu") -> torch.Tensor:
    """Angles theta (batch, N, R/2) in float64, spread over several turns."""
    return 4 * torch.randn(batch, seq_len, rotary_dim // 2, dtype=torch.float64, device=device)


def tables(theta: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return theta.cos().to(dtype), theta.sin().to(dtype)


def rotation_matrices(theta: torch.Tensor, head_dim: int, interleaved: bool) -> torch.Tensor:
    """One (D, D) matrix per (batch, position): a plane rotation for each channel pair, identity elsewhere."""
    batch, seq_len, half = theta.shape
    matrices = torch.eye(head_dim, dtype=torch.float64, device=theta.device).repeat(batch, seq_len, 1, 1)
    for i in range(half):
        a, b = (2 * i, 2 * i + 1) if interleaved else (i, i + half)
        c, s = theta[..., i].cos(), theta[..., i].sin()
        matrices[..., a, a], matrices[..., a, b] = c, -s
        matrices[..., b, a], matrices[..., b, b] = s, c
    return matrices


def reference_rope(x: torch.Tensor, theta: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """out[b, h, n] = M[b, n] @ x[b, h, n] in float64 (differentiable in x)."""
    matrices = rotation_matrices(theta, x.shape[-1], interleaved).expand(x.shape[0], -1, -1, -1)
    return torch.einsum("bnij,bhnj->bhni", matrices, x.double())
