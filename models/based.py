"""The Based language model (Arora et al. 2024, "Simple linear attention language models balance the
recall-throughput tradeoff") on tk_ops: pre-norm blocks of a Based linear-attention mixer
(``tk_ops.nn.BasedLinearAttention``: 2nd-order Taylor feature map, causal, on ``tk.based_attention``)
and a SwiGLU MLP, with RMSNorm, a tied embedding and, optionally, full causal attention (Llama's,
with RoPE) in every ``attention_every``-th block: the paper's hybrid.

State_dict keys: ``model.embed_tokens``, ``model.layers.{i}.norm`` / ``.mixer`` / ``.mlp_norm`` /
``.mlp``, ``model.norm``, ``lm_head``; a Based mixer's keys are flash-linear-attention's
(``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``), an attention mixer's Llama's. The paper's
short convolutions and sliding-window attention layers are not implemented.

``config.reference=True`` runs the same parameters on standard PyTorch ops: the Based attention
in its quadratic form, o_i = sum_{j<=i} f(s_ij) v_j / (sum_{j<=i} f(s_ij) + eps) with
f(s) = 1 + s + s^2/2, s_ij = q_i . k_j / sqrt(F) (what the Taylor features compute, without them).
``config.peer=True`` (with reference=True) runs the Based attention on flash-linear-attention's
``parallel_based`` instead (``models.peers``).
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Optional

import torch
import torch.nn.functional as F

import tk_ops
from models import peers
from models.layers import CausalLM, MixerBlock, ResidualRMSNorm, rotary_inverse_frequencies, rotary_tables
from models.llama import LlamaAttention
from tk_ops.nn.based import CAUSAL_EPS


@dataclasses.dataclass
class BasedConfig:
    vocab_size: int = 8192
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 4
    num_heads: int = 4  # Based heads; value head dim hidden_size // num_heads (64 on the kernels)
    feature_dim: int = 16  # q/k head dim of the Taylor feature map (16 on the kernels)
    attention_every: int = 0  # every k-th block (k-1, 2k-1, ...) is full causal attention; 0: none
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    head_dim: Optional[int] = None  # None: hidden_size // num_attention_heads
    rope_theta: float = 10000.0
    attention_bias: bool = False
    max_position_embeddings: int = 2048  # the context generate() keeps
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = True
    initializer_range: float = 0.02
    reference: bool = False  # True: standard PyTorch ops only
    peer: bool = False  # True (with reference): the Based attention on fla's parallel_based

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        peers.check_flags(self.reference, self.peer)

    def is_attention_layer(self, index: int) -> bool:
        return self.attention_every > 0 and (index + 1) % self.attention_every == 0

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


def reference_based_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eps: float) -> torch.Tensor:
    """Causal Based attention of q, k (B, H, N, F) and v (B, H, N, Dv) in its quadratic form."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    weights = (1 + scores + scores * scores / 2).tril()
    return (weights @ v) / (weights.sum(-1, keepdim=True) + eps)


class BasedMixer(tk_ops.nn.BasedLinearAttention):
    """tk_ops.nn.BasedLinearAttention (causal, parallel mode's epsilon) with a pure-PyTorch path
    (``reference``) and a peer path (``peer``: the reference's projections around fla's parallel_based,
    whose fixed epsilon 1e-6 is the parallel mode's)."""

    def __init__(self, config: BasedConfig) -> None:
        super().__init__(
            config.hidden_size,
            feature_dim=config.feature_dim,
            num_key_value_heads=config.num_heads,
            num_heads=config.num_heads,
        )
        self.reference = config.reference
        self.peer_attention = peers.fla_parallel_based() if config.peer else None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if not self.reference:
            return super().forward(hidden_states)

        def heads(projection: torch.nn.Linear, head_dim: int) -> torch.Tensor:  # (B, N, H, head_dim)
            return F.linear(hidden_states, projection.weight).unflatten(-1, (self.num_heads, head_dim))

        q, k, v = heads(self.q_proj, self.head_k_dim), heads(self.k_proj, self.head_k_dim), heads(self.v_proj, self.head_v_dim)
        if self.peer_attention is not None:
            out = self.peer_attention(q, k, v, scale=self.head_k_dim**-0.5, use_norm=True)
        else:
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            out = reference_based_attention(q, k, v, CAUSAL_EPS[self.mode]).transpose(1, 2)
        return F.linear(out.flatten(-2), self.o_proj.weight)


class BasedModel(torch.nn.Module):
    inverse_frequencies: torch.Tensor

    def __init__(self, config: BasedConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = torch.nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = torch.nn.ModuleList(
            MixerBlock(
                LlamaAttention(config) if config.is_attention_layer(i) else BasedMixer(config),
                config.hidden_size,
                config.intermediate_size,
                eps=config.rms_norm_eps,
                reference=config.reference,
            )
            for i in range(config.num_hidden_layers)
        )
        self.norm = ResidualRMSNorm(config.hidden_size, config.rms_norm_eps, reference=config.reference)
        self.register_buffer(
            "inverse_frequencies", rotary_inverse_frequencies(config.head_dim, config.rope_theta), persistent=False
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        cos, sin = rotary_tables(self.inverse_frequencies, input_ids.shape[1])
        x, residual = self.embed_tokens(input_ids), None
        for i, layer in enumerate(self.layers):
            rotary = {"cos": cos, "sin": sin} if self.config.is_attention_layer(i) else {}
            x, residual = layer(x, residual, **rotary)
        return self.norm(x, residual)[0]


class BasedForCausalLM(CausalLM):
    def __init__(self, config: BasedConfig) -> None:
        super().__init__()
        self.config = config
        self.model = BasedModel(config)
        self.init_head(self.model.embed_tokens)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 3 x (2 x matmul parameters + the attention of each mixer).

        A Based mixer, in its linear (recurrent) form, adds phi(k_j) v_j^T (and phi(k_j)) to its
        state and reads it with phi(q_i): 2 x 2 x D_phi x (Dv + 1) per head, D_phi = 1 + F + F(F+1)/2;
        an attention block counts as Llama's (causal scores, half of the keys on average)."""
        c = self.config
        hidden, value_dim = c.hidden_size, c.hidden_size // c.num_heads
        features = 1 + c.feature_dim + c.feature_dim * (c.feature_dim + 1) // 2
        attention_layers = sum(c.is_attention_layer(i) for i in range(c.num_hidden_layers))
        based_layers = c.num_hidden_layers - attention_layers
        based_proj = 2 * hidden * c.num_heads * c.feature_dim + 2 * hidden * hidden
        attention_proj = hidden * c.head_dim * (2 * c.num_attention_heads + 2 * c.num_key_value_heads)
        mlp = 3 * hidden * c.intermediate_size
        matmul_params = (
            based_layers * based_proj + attention_layers * attention_proj + c.num_hidden_layers * mlp
            + hidden * c.vocab_size
        )  # fmt: skip
        linear_attention = based_layers * c.num_heads * 2 * 2 * features * (value_dim + 1)
        attention_scores = attention_layers * c.num_attention_heads * 2 * seq_len * c.head_dim
        return 3.0 * (2.0 * matmul_params + linear_attention + attention_scores)
