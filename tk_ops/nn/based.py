"""``BasedLinearAttention``: flash-linear-attention's Based mixer, with the attention on ``tk.based_attention``.

A drop-in for ``fla.layers.BasedLinearAttention`` (flash-linear-attention 0.6.0): the same
constructor arguments and defaults, attributes and submodules, so state_dicts (``q_proj.weight``,
``k_proj.weight``, ``v_proj.weight``, ``o_proj.weight``) load either way, and the same output for
the same weights. For x (B, T, hidden_size), F = feature_dim and H = num_heads:

    q, k = x W_q^T, x W_k^T in H heads of F;  v = x W_v^T in H heads of hidden_size // H
    o_i = sum_{j<=i} f(s_ij) v_j / (sum_{j<=i} f(s_ij) + eps),  f(s) = 1 + s + s^2/2,  s_ij = q_i . k_j / sqrt(F)
    out = o W_o^T            (o's heads concatenated)

Scale: fla's layer passes q and k unscaled to ``parallel_based(q, k, v, scale=F**-0.5)``, which
forms s = (q * scale) . k; ``tk.based_attention`` applies the same 1/sqrt(F) inside its feature
map, so q and k go to it unscaled too.

Epsilon: as in fla, the constructor's ``eps`` serves only ``causal=False``. The causal path adds
the fixed epsilon of the fla kernel that ``mode`` names: 1e-6 for ``'parallel'`` (parallel_based's
``use_norm``), 1e-10 for ``'chunk'`` and ``'fused_chunk'`` (fla's layer runs chunk_linear_attn /
fused_chunk_linear_attn on its Taylor features with scale 1 and normalize=True, which divide by
the denominator + 1e-10). The mode picks nothing else here: every causal mode runs
``tk.based_attention``, which accepts any F (fla's layer stops at 128 in parallel mode). In fp32
and fp64 the outputs are fla's up to rounding; in bf16/fp16 they differ at that precision's
rounding level (fla rounds intermediates to the input dtype: the Taylor features in the chunk
modes, the numerator and in parallel_based the denominator before dividing; tk.based_attention
accumulates and divides in fp32).

``causal=False`` is fla's PyTorch reference, here in PyTorch too (no tk op covers it): the
Taylor features ``feature_map`` of fla's ``TaylorFeatureMap`` (same features, same order), then
o_i = phi(q_i) . sum_j phi(k_j) v_j^T / (phi(q_i) . sum_j phi(k_j) + eps) over the whole sequence.

The projections are ``tk_ops.nn.Linear`` (``nn.Linear``'s parameters, keys and initialisation)
without bias, as fla's. ``forward(hidden_states, **kwargs)`` ignores extra keyword arguments, as
fla's does (there is no attention mask), and returns the output tensor alone.
"""

from __future__ import annotations

import math

import torch

from tk_ops.nn.linear import Linear
from tk_ops.ops.based_attention import based_attention

MODES = ("parallel", "chunk", "fused_chunk")

# The epsilon each causal fla kernel adds to the denominator (parallel_based's use_norm; the
# normalize step of chunk_linear_attn / fused_chunk_linear_attn).
CAUSAL_EPS = {"parallel": 1e-6, "chunk": 1e-10, "fused_chunk": 1e-10}


class TaylorFeatureMap(torch.nn.Module):
    """fla's Taylor feature map of x (..., F), 1 + F + F(F+1)/2 features (153 for F = 16):

        phi(x) = [1, x / F**0.25, x_a^2 / sqrt(2F) for each a, x_a x_b / sqrt(F) for a < b (row by row)]

    so that phi(q) . phi(k) = 1 + s + s^2/2 with s = q . k / sqrt(F). No parameters.
    """

    def __init__(self, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows, cols = torch.triu_indices(self.head_dim, self.head_dim, offset=1, device=x.device)
        root_dim = math.sqrt(self.head_dim)
        return torch.cat(
            [
                torch.ones_like(x[..., :1]),
                x / math.sqrt(root_dim),
                x * x / (root_dim * math.sqrt(2.0)),
                x[..., rows] * x[..., cols] / root_dim,
            ],
            dim=-1,
        )

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}"


class BasedLinearAttention(torch.nn.Module):
    """fla's ``BasedLinearAttention`` on tk ops: (B, T, hidden_size) -> (B, T, hidden_size).

    Arguments as fla's: ``hidden_size``; ``feature_dim`` (F, the q/k head dim, default 16);
    ``num_key_value_heads`` and ``num_heads`` (equal, default 12); ``feature_name`` (only
    ``'taylor_exp'``); ``eps`` (the denominator epsilon without causality, default 1e-12);
    ``causal`` (default True); ``mode`` (``'parallel'``, ``'chunk'`` or ``'fused_chunk'``: the fla
    kernel whose epsilon the causal path uses). The value head dim is hidden_size // num_heads.
    """

    def __init__(
        self,
        hidden_size: int,
        feature_dim: int = 16,
        num_key_value_heads: int = 12,
        num_heads: int = 12,
        feature_name: str = "taylor_exp",
        eps: float = 1e-12,
        causal: bool = True,
        mode: str = "parallel",
    ) -> None:
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if feature_name != "taylor_exp":
            raise ValueError(f"feature_name must be 'taylor_exp' (the only feature map), got {feature_name!r}")
        for name, value in (("hidden_size", hidden_size), ("feature_dim", feature_dim),
                            ("num_heads", num_heads), ("num_key_value_heads", num_key_value_heads)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if num_key_value_heads != num_heads:
            raise ValueError(
                f"num_key_value_heads must equal num_heads ({num_heads}), got {num_key_value_heads}"
            )
        if hidden_size < num_heads:
            raise ValueError(f"hidden_size must be at least num_heads ({num_heads}), got {hidden_size}")

        self.mode = mode
        self.hidden_size = hidden_size
        self.feature_name = feature_name
        self.feature_dim = feature_dim
        self.num_heads = num_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_k_dim = feature_dim
        self.head_v_dim = hidden_size // num_heads
        self.head_dim = self.head_v_dim
        self.causal = causal
        self.eps = eps

        self.feature_map = TaylorFeatureMap(head_dim=self.head_k_dim)
        self.q_proj = Linear(hidden_size, num_heads * self.head_k_dim, bias=False)
        self.k_proj = Linear(hidden_size, num_key_value_heads * self.head_k_dim, bias=False)
        self.v_proj = Linear(hidden_size, num_key_value_heads * self.head_v_dim, bias=False)
        self.o_proj = Linear(num_heads * self.head_v_dim, hidden_size, bias=False)
        self.dropout = torch.nn.Identity()

    def forward(self, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
        if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 3 \
                or hidden_states.shape[-1] != self.hidden_size:
            shape = tuple(hidden_states.shape) if isinstance(hidden_states, torch.Tensor) else type(hidden_states).__name__
            raise ValueError(f"hidden_states must be (batch, seq_len, hidden_size={self.hidden_size}), got {shape}")
        # (B, T, H, D) views; transposed they are the (B, H, T, D) strided views the op reads in place.
        q = self.q_proj(hidden_states).unflatten(-1, (self.num_heads, self.head_k_dim))
        k = self.k_proj(hidden_states).unflatten(-1, (self.num_key_value_heads, self.head_k_dim))
        v = self.v_proj(hidden_states).unflatten(-1, (self.num_key_value_heads, self.head_v_dim))
        if self.causal:
            o = based_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), eps=CAUSAL_EPS[self.mode])
            o = o.transpose(1, 2)
        else:
            o = self._whole_sequence_attention(q, k, v)
        return self.dropout(self.o_proj(o.flatten(-2)))

    def _whole_sequence_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Non-causal Based attention on (B, T, H, D) tensors through the Taylor features."""
        phi_q, phi_k = self.feature_map(q), self.feature_map(k)
        key_values = torch.einsum("bthp,bthd->bhpd", phi_k, v)
        numerator = torch.einsum("bthp,bhpd->bthd", phi_q, key_values)
        denominator = torch.einsum("bthp,bhp->bth", phi_q, phi_k.sum(1))
        return numerator / (denominator.unsqueeze(-1) + self.eps)
