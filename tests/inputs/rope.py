"""tk.rope's and tk.rope_qk's inputs (tests/op_db.py and tests/test_rope.py)."""

from __future__ import annotations

import torch


def random_angles(batch: int, seq_len: int, rotary_dim: int, device="cpu") -> torch.Tensor:
    """Angles theta (batch, N, R/2) in float64, spread over several turns."""
    return 4 * torch.randn(batch, seq_len, rotary_dim // 2, dtype=torch.float64, device=device)


def tables(theta: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return theta.cos().to(dtype), theta.sin().to(dtype)
