"""``RotaryEmbedding``: Hugging Face's Llama rotary module, applying the rotation with ``tk.rope_qk``."""

from __future__ import annotations

from typing import Optional

import torch

from tk_ops.ops.rope import rope_qk


class RotaryEmbedding(torch.nn.Module):
    """Drop-in for Hugging Face's ``LlamaRotaryEmbedding`` (default rope type).

    ``RotaryEmbedding(dim, max_position_embeddings=2048, base=10000.0, device=None)``, the
    constructor of the transformers releases before rope configs: ``dim`` is the rotary dim (the
    head dim, or less for partial rotary), ``inv_freq[i] = base ** (-2i / dim)`` is a
    non-persistent buffer as in HF (the state_dict is empty). ``max_position_embeddings`` is kept
    as an attribute for code that reads it; positions beyond it are computed like any other.

    ``forward(x, position_ids)`` returns HF's ``(cos, sin)``: (B, N, dim) with duplicated halves,
    computed in fp32 and cast to x's dtype (x is read only for its dtype and device).
    ``apply_rotary_pos_emb(q, k, cos, sin)`` rotates q (B, Hq, N, D) and k (B, Hk, N, D) like
    HF's ``apply_rotary_pos_emb`` (q and k in HF's (B, H, N, D) layout) in one ``tk.rope_qk``
    launch; the last D - dim channels pass through unchanged. (It is not called ``apply``, which
    would shadow ``nn.Module.apply(fn)``, the recursive initialiser HF models call.)
    """

    inv_freq: torch.Tensor

    def __init__(
        self,
        dim: int,
        max_position_embeddings: int = 2048,
        base: float = 10000.0,
        device: Optional[torch.device] = None,
    ) -> None:
        super().__init__()
        if dim <= 0 or dim % 2 != 0:
            raise ValueError(f"dim must be a positive even integer (the rotary dim), got {dim}")
        self.dim = dim
        self.max_position_embeddings = max_position_embeddings
        self.base = base
        exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
        self.register_buffer("inv_freq", 1.0 / (base**exponents), persistent=False)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # An elementwise product in fp32 (HF's is a matmul with autocast disabled): autocast leaves it alone.
        angles = position_ids[..., None].float() * self.inv_freq.float()
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos().to(x.dtype), angles.sin().to(x.dtype)

    def apply_rotary_pos_emb(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if cos.shape[-1] != self.dim:
            raise ValueError(
                f"cos.shape[-1] must equal dim ({self.dim}): pass the (cos, sin) this module returned, "
                f"got shape {tuple(cos.shape)}"
            )
        half = self.dim // 2
        return rope_qk(q, k, cos[..., :half], sin[..., :half])

    def extra_repr(self) -> str:
        return f"dim={self.dim}, max_position_embeddings={self.max_position_embeddings}, base={self.base}"
