"""A Qwen3-Next-style hybrid language model on tk_ops: pre-norm blocks whose token mixer is Gated DeltaNet
(``tk_ops.nn.GatedDeltaNet``: short conv on ``tk.causal_conv1d``, ``tk.gated_delta_rule``, gated norm on
``tk.rms_norm``) in three blocks of every four and gated full attention in the fourth (on
``tk.attention``), each followed by a SwiGLU MLP, with RMSNorm and a tied or untied embedding.

The gated attention is Qwen3-Next's: q_proj gives each head a query and an output gate of head_dim
channels each; q and k are RMS-normalised per head; RoPE turns only the first
``partial_rotary_factor * head_dim`` channels of each head; the attention's output is multiplied by
sigmoid(gate) before o_proj. Qwen3-Next's mixture-of-experts MLPs are left out: every block has one
dense SwiGLU MLP (Qwen3-Next's layers listed in ``mlp_only_layers``), and there is no multi-token
prediction head. Its RMSNorms are zero-centred, out = norm(x) * (1 + weight) with weight starting at
0, here too (not the gated norm inside Gated DeltaNet, which scales by its weight); they cast the
normalised stream before the product, as the repo's other norms, where HF casts after it (the same
in fp32 and fp64, a rounding apart in 16 bits).

State_dict keys are those of Hugging Face's ``Qwen3NextForCausalLM`` built with ``num_experts=0``
(``model.embed_tokens``, ``model.layers.{i}.input_layernorm`` / ``.linear_attn`` or ``.self_attn`` /
``.post_attention_layernorm`` / ``.mlp``, ``model.norm``, ``lm_head``); ``GDNConfig.to_hf_dict``
gives the config under which HF loads them and computes the same logits. Full sequences only: no
cache, no padding mask, no packed documents.

``config.reference=True`` runs the same parameters on standard PyTorch ops: ``F.linear``,
``F.conv1d``, the gated delta rule as its token-by-token recurrence (fp32, fp64 for fp64 models),
SDPA, RoPE and the norms written out. The tk path's ``tk.gated_delta_rule`` runs its forward kernel on
a GPU where it takes the inputs (bf16/fp16, K = V = 128: the 1b preset's head dim; slower than
flash-linear-attention's) and its PyTorch reference (chunked) for the backward and everything else, so
this model's mixers are not fast anywhere yet (the model has not been trained on a GPU).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Optional

import torch
import torch.nn.functional as F

import tk_ops
from tk_ops.nn.hf_mixer import config_arguments
from models.layers import (
    CausalLM,
    ResidualRMSNorm,
    SwiGLUMLP,
    at_least_fp32,
    make_linear,
    reference_attention,
    reference_rope,
    rotary_inverse_frequencies,
    rotary_tables,
)


@dataclasses.dataclass
class GDNConfig:
    """The fields of Hugging Face's ``Qwen3NextConfig`` that a dense model uses (``rope_theta`` and
    ``partial_rotary_factor`` HF keeps in ``rope_parameters``), plus ``reference``."""

    vocab_size: int = 8192
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 4
    full_attention_interval: int = 4  # blocks k-1, 2k-1, ... are full attention, the others Gated DeltaNet
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: Optional[int] = None  # None: hidden_size // num_attention_heads
    partial_rotary_factor: float = 0.25  # the fraction of each attention head's channels RoPE turns
    rope_theta: float = 10000.0
    attention_bias: bool = False
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4  # a multiple of linear_num_key_heads
    linear_key_head_dim: int = 64
    linear_value_head_dim: int = 64
    linear_conv_kernel_dim: int = 4
    max_position_embeddings: int = 2048  # the context generate() keeps
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    initializer_range: float = 0.02
    reference: bool = False  # True: standard PyTorch ops only

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.full_attention_interval < 1:
            raise ValueError(f"full_attention_interval must be >= 1, got {self.full_attention_interval}")
        if self.rotary_dim < 2 or self.rotary_dim % 2 != 0:
            raise ValueError(
                f"partial_rotary_factor * head_dim must round down to an even number >= 2, got "
                f"int({self.partial_rotary_factor} * {self.head_dim}) = {self.rotary_dim}"
            )

    @property
    def rotary_dim(self) -> int:
        """The channels of each attention head that RoPE turns (HF rounds down as here)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def is_attention_layer(self, index: int) -> bool:
        return (index + 1) % self.full_attention_interval == 0

    def to_hf_dict(self) -> dict:
        """A Hugging Face ``config.json`` for this model: ``transformers`` loads it as Qwen3NextForCausalLM
        without experts."""
        values = dataclasses.asdict(self)
        del values["reference"], values["full_attention_interval"]
        rope = {
            "rope_type": "default",
            "rope_theta": values.pop("rope_theta"),
            "partial_rotary_factor": values.pop("partial_rotary_factor"),
        }
        layer_types = [
            "full_attention" if self.is_attention_layer(i) else "linear_attention"
            for i in range(self.num_hidden_layers)
        ]
        return {
            **values, "rope_parameters": rope, "layer_types": layer_types, "hidden_act": "silu", "num_experts": 0,
            "model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"],
        }  # fmt: skip

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


class ZeroCenteredRMSNorm(ResidualRMSNorm):
    """Qwen3-Next's RMSNorm: the normalised stream times (1 + weight), weight initialised to 0."""

    def __init__(self, hidden_size: int, eps: float, *, reference: bool) -> None:
        super().__init__(hidden_size, eps, reference=reference)
        torch.nn.init.zeros_(self.weight)

    def scale(self) -> torch.Tensor:
        return 1 + self.weight


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum(x^2) + 1e-6) over the last dim: the q/k normalisation of fla, HF and tk.gated_delta_rule."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)


def reference_gated_delta_rule(q, k, v, g, beta) -> torch.Tensor:
    """o (B, T, Hv, V) of the gated delta rule with l2-normalised q, k (B, T, Hk, K), v (B, T, Hv, V), log
    decays g and step sizes beta (B, T, Hv), token by token, in fp32 (fp64 for fp64 inputs):
    S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - (exp(g_t) S_{t-1})^T k_t)^T,  o_t = S_t^T q_t / sqrt(K),
    which is tk.gated_delta_rule's S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T."""
    batch, seq_len, key_heads, key_dim = q.shape
    value_heads = v.shape[2]
    dtype = at_least_fp32(v).dtype

    def per_value_head(t: torch.Tensor) -> torch.Tensor:  # value head h reads key head h // group
        return l2_normalize(t.to(dtype)).repeat_interleave(value_heads // key_heads, dim=2)

    q, k = per_value_head(q) * key_dim**-0.5, per_value_head(k)
    values, decays, steps = v.to(dtype), torch.exp(g.to(dtype)), beta.to(dtype)
    state = q.new_zeros(batch, value_heads, key_dim, v.shape[-1])
    outputs = []
    for t in range(seq_len):
        state = decays[:, t, :, None, None] * state
        # the delta rule: move the state's answer for k_t towards v_t by the step beta_t
        correction = steps[:, t, :, None] * (values[:, t] - torch.einsum("bhkv,bhk->bhv", state, k[:, t]))
        state = state + k[:, t, :, :, None] * correction[:, :, None, :]
        outputs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    return torch.stack(outputs, dim=1).to(v.dtype)


class GatedDeltaNetMixer(tk_ops.nn.GatedDeltaNet):
    """tk_ops.nn.GatedDeltaNet with a pure-PyTorch path (``reference``) that computes, from the same
    parameters, what its module docstring lists."""

    def __init__(self, config: GDNConfig, layer_idx: int) -> None:
        super().__init__(**config_arguments(tk_ops.nn.GatedDeltaNet, config), layer_idx=layer_idx)
        self.reference = config.reference

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if not self.reference:
            return super().forward(hidden_states)
        seq_len = hidden_states.shape[1]
        group = self.num_v_heads // self.num_k_heads
        # per key head: [q | k | v | z] and [b | a], its value heads' channels side by side
        qkvz = F.linear(hidden_states, self.in_proj_qkvz.weight).unflatten(-1, (self.num_k_heads, -1))
        value_channels = group * self.head_v_dim
        q, k, v, z = qkvz.split([self.head_k_dim, self.head_k_dim, value_channels, value_channels], dim=-1)
        b, a = F.linear(hidden_states, self.in_proj_ba.weight).unflatten(-1, (self.num_k_heads, -1)).split(group, -1)

        qkv = torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], dim=-1).transpose(1, 2)
        qkv = F.conv1d(qkv, self.conv1d.weight, padding=self.conv_kernel_size - 1, groups=self.conv_dim)
        qkv = F.silu(qkv[..., :seq_len]).transpose(1, 2)  # the padding's last outputs would see the future
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)

        a, dt_bias, A_log = at_least_fp32(a.flatten(2)), at_least_fp32(self.dt_bias), at_least_fp32(self.A_log)
        g = -torch.exp(A_log) * F.softplus(a + dt_bias.to(a.dtype))
        o = reference_gated_delta_rule(
            q.unflatten(-1, (self.num_k_heads, self.head_k_dim)),
            k.unflatten(-1, (self.num_k_heads, self.head_k_dim)),
            v.unflatten(-1, (self.num_v_heads, self.head_v_dim)),
            g,
            torch.sigmoid(b.flatten(2)),
        )
        # the gated norm per value head: normalised in fp32, cast, times weight, times silu(z) in fp32
        wide = at_least_fp32(o)
        normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.norm.variance_epsilon)
        normed = normed.to(o.dtype) * self.norm.weight
        gate = at_least_fp32(z.reshape(o.shape))
        out = (at_least_fp32(normed) * F.silu(gate)).to(o.dtype)
        return F.linear(out.flatten(2), self.out_proj.weight)


def reference_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the first R channels of each head of x (B, H, N, D), cos and sin (N, R / 2); the rest pass."""
    rotary_dim = 2 * cos.shape[-1]
    return torch.cat((reference_rope(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]), dim=-1)


class GatedAttention(torch.nn.Module):
    """Qwen3-Next's full attention (see the module docstring): causal, GQA, per-head q/k RMSNorm, partial
    RoPE, an output gate sigmoid(gate) per channel."""

    def __init__(self, config: GDNConfig) -> None:
        super().__init__()
        self.reference = config.reference
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden, bias, reference = config.hidden_size, config.attention_bias, config.reference
        # per head: head_dim query channels, then head_dim gate channels
        self.q_proj = make_linear(hidden, 2 * self.num_heads * self.head_dim, bias=bias, reference=reference)
        self.k_proj = make_linear(hidden, self.num_kv_heads * self.head_dim, bias=bias, reference=reference)
        self.v_proj = make_linear(hidden, self.num_kv_heads * self.head_dim, bias=bias, reference=reference)
        self.o_proj = make_linear(self.num_heads * self.head_dim, hidden, bias=bias, reference=reference)
        self.q_norm = ZeroCenteredRMSNorm(self.head_dim, config.rms_norm_eps, reference=reference)
        self.k_norm = ZeroCenteredRMSNorm(self.head_dim, config.rms_norm_eps, reference=reference)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """cos, sin: (N, R / 2) for the R = rotary_dim channels RoPE turns."""
        batch, seq_len, _ = x.shape
        query, gate = self.q_proj(x).view(batch, seq_len, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(query)[0].transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(batch, seq_len, self.num_kv_heads, self.head_dim))[0].transpose(1, 2)
        v = self.v_proj(x).view(batch, seq_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.reference:
            q, k = reference_partial_rope(q, cos, sin), reference_partial_rope(k, cos, sin)
            out = reference_attention(q, k, v, causal=True)
        else:
            q, k = tk_ops.rope_qk(q, k, cos, sin)  # half tables narrower than D/2: the rest passes through
            out = tk_ops.attention(q, k, v, causal=True)
        out = out.transpose(1, 2).reshape(batch, seq_len, -1) * torch.sigmoid(gate.reshape(batch, seq_len, -1))
        return self.o_proj(out)


class GDNDecoderLayer(torch.nn.Module):
    """Qwen3-Next's decoder layer with a dense MLP. ``forward(x, residual, cos, sin) -> (x, residual)``: the
    block's output x is added to the residual stream by the next norm (the next block's, or the final one)."""

    def __init__(self, config: GDNConfig, layer_idx: int) -> None:
        super().__init__()
        hidden, eps, reference = config.hidden_size, config.rms_norm_eps, config.reference
        self.is_attention = config.is_attention_layer(layer_idx)
        self.input_layernorm = ZeroCenteredRMSNorm(hidden, eps, reference=reference)
        if self.is_attention:
            self.self_attn = GatedAttention(config)
        else:
            self.linear_attn = GatedDeltaNetMixer(config, layer_idx)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(hidden, eps, reference=reference)
        self.mlp = SwiGLUMLP(hidden, config.intermediate_size, bias=False, reference=reference)

    def forward(self, x, residual, cos, sin):
        normed, residual = self.input_layernorm(x, residual)
        x = self.self_attn(normed, cos, sin) if self.is_attention else self.linear_attn(normed)
        normed, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(normed), residual


class GDNModel(torch.nn.Module):
    inverse_frequencies: torch.Tensor

    def __init__(self, config: GDNConfig) -> None:
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = torch.nn.ModuleList(GDNDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps, reference=config.reference)
        # not in the state_dict, as Hugging Face's rotary_emb.inv_freq
        self.register_buffer(
            "inverse_frequencies", rotary_inverse_frequencies(config.rotary_dim, config.rope_theta), persistent=False
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        cos, sin = rotary_tables(self.inverse_frequencies, input_ids.shape[1])
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin)
        return self.norm(x, residual)[0]


class GDNForCausalLM(CausalLM):
    def __init__(self, config: GDNConfig) -> None:
        super().__init__()
        self.config = config
        self.model = GDNModel(config)
        self.init_head(self.model.embed_tokens)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 3 x (2 x matmul parameters + the sequence mixing of each block).

        A Gated DeltaNet block adds its depthwise conv (2 W per channel of q, k, v) and, per value head,
        the recurrent form's k^T S, rank-1 update and read S^T q: 3 x 2 K V; an attention block counts as
        Llama's (causal scores, half of the keys on average)."""
        c = self.config
        linear_params = sum(m.weight.numel() for m in self.modules() if isinstance(m, torch.nn.Linear))
        attention_layers = sum(c.is_attention_layer(i) for i in range(c.num_hidden_layers))
        key_dim, value_dim = c.linear_key_head_dim, c.linear_value_head_dim
        conv_channels = 2 * c.linear_num_key_heads * key_dim + c.linear_num_value_heads * value_dim
        conv = 2 * c.linear_conv_kernel_dim * conv_channels
        delta_rule = c.linear_num_value_heads * 6 * key_dim * value_dim
        linear_mixing = (c.num_hidden_layers - attention_layers) * (conv + delta_rule)
        attention_scores = attention_layers * c.num_attention_heads * 2 * seq_len * c.head_dim
        return 3.0 * (2.0 * linear_params + linear_mixing + attention_scores)
