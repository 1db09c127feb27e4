"""``GatedDeltaNet``: Qwen3-Next's linear-attention mixer on ``tk.causal_conv1d``, ``tk.gated_delta_rule`` and
``tk.rms_norm``.

A drop-in for Hugging Face transformers' ``Qwen3NextGatedDeltaNet`` (the mixer of the layers whose
``config.layer_types`` entry is "linear_attention"): the same parameters, names and shapes, so state_dicts
load either way unchanged:

    in_proj_qkvz.weight (2 Hk K + 2 Hv V, hidden)     in_proj_ba.weight (2 Hv, hidden)
    conv1d.weight (2 Hk K + Hv V, 1, W)               dt_bias, A_log (Hv,)
    norm.weight (V,)                                  out_proj.weight (hidden, Hv V)

with Hk = linear_num_key_heads heads of K = linear_key_head_dim, Hv = linear_num_value_heads heads of
V = linear_value_head_dim (Hv % Hk == 0, G = Hv / Hk value heads per key head) and W =
linear_conv_kernel_dim. For hidden_states x (B, L, hidden):

    in_proj_qkvz(x), per key head   [q | k | v | z]   K | K | G V | G V     (value head h: key head h // G)
    in_proj_ba(x),   per key head   [b | a]           G | G
    [q, k, v] = silu(causal depthwise conv1d([q, k, v]))          tk.causal_conv1d, no bias
    g = -exp(A_log) * softplus(a + dt_bias) ;  beta = sigmoid(b)
    o = gated delta rule(q, k, v, g, beta), q and k l2-normalised  tk.gated_delta_rule
    out = out_proj(norm(o) * silu(z))                              per value head, over V

The gated norm is Qwen3-Next's (norm before the gate): ``tk.rms_norm`` of each head's o with
``norm.weight`` (normalised in fp32, cast to the model dtype, times the weight), then times silu(z)
in fp32 (fp64 for fp64 models), cast to the model dtype. g is computed in fp32 (fp64), beta in the
model dtype, as in HF.

Attention mask: a 2D (B, L) padding mask (1 keeps, 0 pads) zeroes the input rows at padded positions,
as HF's mixer does. ``None`` skips the masking.

Differences from HF's torch path, all at rounding level: HF computes the delta rule and the gated norm
in fp32 whatever the model dtype (and A = exp(A_log) in fp32); here fp64 models compute in fp64.

Cache: ``forward`` computes full sequences only; a cache (``cache``, or ``cache_params`` before
transformers 5.24) raises NotImplementedError, and so do packed sequences (``cu_seq_lens_q``): the
short convolution would run across their boundaries. ``tk_ops.transformers.apply_tk_kernels_to_qwen3_next``
patches HF's own mixer, which handles caches (prefill on the tk ops, decode steps through HF's code).

No kernel serves tk.gated_delta_rule yet (its PyTorch reference runs everywhere); tk.causal_conv1d and
tk.rms_norm run their CUDA kernels on Hopper for the inputs their docstrings list.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from tk_ops._checks import compute_dtype
from tk_ops.nn.hf_mixer import from_hf_config, refuse_cache
from tk_ops.nn.linear import Linear
from tk_ops.ops.causal_conv1d import causal_conv1d
from tk_ops.ops.gated_delta_rule import gated_delta_rule
from tk_ops.ops.rms_norm import rms_norm

SILU_NAMES = ("silu", "swish")


def gated_rms_norm(hidden_states: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3-Next's gated RMSNorm over the last dim: ``rms_norm(hidden_states) * weight`` (tk.rms_norm: in fp32,
    cast, times weight), times silu(gate) in fp32 (fp64 for fp64 inputs), in hidden_states' dtype."""
    dtype = compute_dtype(hidden_states.dtype)
    normed = rms_norm(hidden_states, weight, eps)
    return (normed.to(dtype) * F.silu(gate.to(dtype))).to(hidden_states.dtype)


class GatedRMSNorm(torch.nn.Module):
    """HF's ``Qwen3NextRMSNormGated`` (parameter ``weight`` (hidden_size,), attribute ``variance_epsilon``) on
    ``gated_rms_norm``."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, device=None, dtype=None) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(hidden_states, gate, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.variance_epsilon}"


def _zero_padding(hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor]) -> torch.Tensor:
    """Rows at padded positions (attention_mask == 0) set to zero, in hidden_states' dtype."""
    if attention_mask is None:
        return hidden_states
    return (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)


def gated_deltanet_forward(mixer: torch.nn.Module, hidden_states: torch.Tensor, attention_mask=None, cache=None):
    """Qwen3-Next's linear-attention mixer over full sequences on the tk ops, for any module with the attributes
    of HF's ``Qwen3NextGatedDeltaNet`` (this module's ``GatedDeltaNet`` or HF's own): (B, L, hidden) -> (B, L,
    hidden). The conv's activation must be SiLU.

    With ``cache`` (an HF cache holding no state for ``mixer.layer_idx`` yet: a prefill), the conv state and the
    final recurrent state are written to it as HF's mixer writes them.
    """
    batch, seq_len, _ = hidden_states.shape
    key_heads, value_heads = mixer.num_k_heads, mixer.num_v_heads
    key_dim, value_dim = mixer.head_k_dim, mixer.head_v_dim
    group = value_heads // key_heads

    hidden_states = _zero_padding(hidden_states, attention_mask)
    qkvz = mixer.in_proj_qkvz(hidden_states).unflatten(-1, (key_heads, -1))
    q, k, v, z = qkvz.split([key_dim, key_dim, group * value_dim, group * value_dim], dim=-1)
    b, a = mixer.in_proj_ba(hidden_states).unflatten(-1, (key_heads, -1)).split([group, group], dim=-1)

    # The conv's channels are [q | k | v] each head after head: (B, L, conv_dim), seen as (B, conv_dim, L).
    qkv = torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], dim=-1).transpose(1, 2)
    if cache is not None:
        cache.update_conv_state(qkv, mixer.layer_idx, conv_kernel_size=mixer.conv_kernel_size)
    qkv = causal_conv1d(qkv, mixer.conv1d.weight.squeeze(1), mixer.conv1d.bias, activation="silu").transpose(1, 2)
    q, k, v = qkv.split([mixer.key_dim, mixer.key_dim, mixer.value_dim], dim=-1)

    dtype = compute_dtype(hidden_states.dtype)
    g = -torch.exp(mixer.A_log.to(dtype)) * F.softplus(a.flatten(2).to(dtype) + mixer.dt_bias.to(dtype))
    o, final_state = gated_delta_rule(
        q.unflatten(-1, (key_heads, key_dim)),
        k.unflatten(-1, (key_heads, key_dim)),
        v.unflatten(-1, (value_heads, value_dim)),
        g,
        torch.sigmoid(b.flatten(2)),
        output_final_state=cache is not None,
        use_qk_l2norm=True,
    )
    if cache is not None:
        cache.update_recurrent_state(final_state, mixer.layer_idx)

    norm = mixer.norm
    out = gated_rms_norm(o, z.reshape(batch, seq_len, value_heads, value_dim), norm.weight, norm.variance_epsilon)
    return mixer.out_proj(out.flatten(2))


class GatedDeltaNet(torch.nn.Module):
    """Qwen3-Next's Gated DeltaNet mixer with the parameters and attributes of HF's ``Qwen3NextGatedDeltaNet``
    (see the module docstring).

    Constructor arguments are the Qwen3NextConfig fields of the same names (``hidden_act`` is the conv's
    activation, ``rms_norm_eps`` the gated norm's eps); ``GatedDeltaNet.from_config(config, layer_idx)`` reads
    them from a config. Initialisation as HF's: nn.Linear / nn.Conv1d defaults, dt_bias = 1,
    A_log = log(A) with A uniform in [0.01, 16], norm.weight = 1.
    """

    def __init__(
        self,
        hidden_size: int,
        linear_num_key_heads: int = 16,
        linear_num_value_heads: int = 32,
        linear_key_head_dim: int = 128,
        linear_value_head_dim: int = 128,
        linear_conv_kernel_dim: int = 4,
        hidden_act: str = "silu",
        rms_norm_eps: float = 1e-6,
        layer_idx: Optional[int] = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        if linear_num_value_heads % linear_num_key_heads != 0:
            raise ValueError(
                f"linear_num_value_heads ({linear_num_value_heads}) must be a multiple of linear_num_key_heads "
                f"({linear_num_key_heads})"
            )
        if hidden_act not in SILU_NAMES:
            raise ValueError(f"hidden_act must be 'silu' or 'swish' (the conv's activation), got {hidden_act!r}")
        factory = {"device": device, "dtype": dtype}
        self.hidden_size = hidden_size
        self.num_k_heads = linear_num_key_heads
        self.num_v_heads = linear_num_value_heads
        self.head_k_dim = linear_key_head_dim
        self.head_v_dim = linear_value_head_dim
        self.key_dim = self.head_k_dim * self.num_k_heads
        self.value_dim = self.head_v_dim * self.num_v_heads
        self.conv_kernel_size = linear_conv_kernel_dim
        self.layer_idx = layer_idx
        self.activation = hidden_act
        self.layer_norm_epsilon = rms_norm_eps
        self.conv_dim = 2 * self.key_dim + self.value_dim

        self.conv1d = torch.nn.Conv1d(
            self.conv_dim,
            self.conv_dim,
            kernel_size=linear_conv_kernel_dim,
            groups=self.conv_dim,
            padding=linear_conv_kernel_dim - 1,
            bias=False,
            **factory,
        )
        self.in_proj_qkvz = Linear(hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False, **factory)
        self.in_proj_ba = Linear(hidden_size, 2 * self.num_v_heads, bias=False, **factory)
        self.dt_bias = torch.nn.Parameter(torch.ones(self.num_v_heads, **factory))
        self.A_log = torch.nn.Parameter(torch.empty(self.num_v_heads, **factory))
        self.norm = GatedRMSNorm(self.head_v_dim, eps=rms_norm_eps, **factory)
        self.out_proj = Linear(self.value_dim, hidden_size, bias=False, **factory)
        self.reset_decay_parameters()

    @torch.no_grad()
    def reset_decay_parameters(self) -> None:
        """dt_bias = 1, A_log = log(A) with A uniform in [0.01, 16] (kept away from 0 so that log(A) is finite)."""
        if self.A_log.device.type == "meta":
            return
        self.dt_bias.fill_(1.0)
        self.A_log.copy_(torch.empty(self.num_v_heads).uniform_(0.01, 16).log())

    @classmethod
    def from_config(cls, config, layer_idx: Optional[int] = None, device=None, dtype=None) -> "GatedDeltaNet":
        """From a transformers ``Qwen3NextConfig`` (or any object with its fields)."""
        return from_hf_config(cls, config, layer_idx, device, dtype)

    def forward(
        self,
        hidden_states: torch.Tensor,
        cache_params=None,
        attention_mask: Optional[torch.Tensor] = None,
        cache=None,
        **kwargs,
    ) -> torch.Tensor:
        """hidden_states (B, L, hidden_size) -> (B, L, hidden_size). attention_mask: (B, L), 1 keeps and 0 pads,
        or None. A cache, under either of HF's names, and packed sequences (``cu_seq_lens_q``) are refused;
        other keyword arguments are ignored, as HF's torch path ignores them."""
        refuse_cache(self, cache_params, cache, "Qwen3NextGatedDeltaNet", "apply_tk_kernels_to_qwen3_next")
        if kwargs.get("cu_seq_lens_q") is not None:
            raise NotImplementedError(
                "tk_ops.nn.GatedDeltaNet does not take packed sequences (cu_seq_lens_q): its short convolution "
                "would run across their boundaries"
            )
        return gated_deltanet_forward(self, hidden_states, attention_mask)

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, num_k_heads={self.num_k_heads}, num_v_heads={self.num_v_heads}, "
            f"head_k_dim={self.head_k_dim}, head_v_dim={self.head_v_dim}, conv_kernel={self.conv_kernel_size}"
        )
