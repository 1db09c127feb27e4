"""``Mamba2Mixer``: the Mamba-2 mixer on ``tk.causal_conv1d``, ``tk.mamba2_ssd`` and ``tk.rms_norm``.

A drop-in for Hugging Face transformers' ``Mamba2Mixer`` (and mamba_ssm's ``Mamba2``): the same
parameters, names and shapes, so state_dicts load either way unchanged:

    in_proj.weight (2I + 2GN + H, hidden) [+ in_proj.bias]      out_proj.weight (hidden, I) [+ out_proj.bias]
    conv1d.weight (I + 2GN, 1, W) [+ conv1d.bias]               dt_bias, A_log, D (H,)      norm.weight (I,)

with I = expand * hidden_size = H * P (H heads of P = head_dim), G = n_groups, N = state_size and
W = conv_kernel. For hidden_states u (B, L, hidden):

    [z, xBC, dt] = in_proj(u)                             split I | I + 2GN | H
    xBC          = silu(causal depthwise conv1d(xBC))     tk.causal_conv1d, (B, L, D) seen as (B, D, L)
    [x, B, C]    = xBC                                    split I | GN | GN, as (B, L, H, P), (B, L, G, N)
    y            = SSD(x, dt, A = -exp(A_log), B, C, D)   tk.mamba2_ssd, dt_bias and softplus inside
    out          = out_proj(norm(y * silu(z)))            gated RMSNorm, group size I / G

Gated norm: mamba_ssm's ``RMSNormGated(norm_before_gate=False)`` / HF's ``MambaRMSNormGated``:
the gate is applied first (in fp32, plain torch), the product is normalised over groups of I / G
channels (``tk.rms_norm`` without a weight, on the (B, L, G, I / G) view), then multiplied by
``norm.weight`` over all I channels (plain torch: tk.rms_norm's weight would be per group). The
weighted result is in fp32 (fp64 for fp64 models), as in HF's torch path, and is cast to the input
dtype before ``out_proj``.

Norm groups and transformers versions: this module normalises per group of I / G channels, as
mamba_ssm does and HF's ``MambaRMSNormGated`` does from transformers 5.23 (which gave it a
``group_size`` attribute, I // n_groups). Before 5.23 HF's gated norm has no ``group_size`` and
normalises over all I channels whatever n_groups, so for n_groups > 1 HF's torch path computes
another function than this module (the same for n_groups = 1). ``mamba2_mixer_forward`` reads the
grouping from the norm it is handed (``gated_norm_group_size``): on HF's own mixer (the switch in
``tk_ops.transformers``) it therefore computes what the installed transformers computes.

Time-step limit: with the default ``time_step_limit = (0, inf)`` the SSD op takes dt_bias and
applies softplus itself; any other limit computes ``clamp(softplus(dt + dt_bias), lo, hi)`` in
torch first (as HF's torch path does) and hands the op that step.

Attention mask: a 2D (B, L) padding mask (1 keeps, 0 pads), as HF's torch path uses it: the input
rows and the conv output (x, B, C) at padded positions are zeroed, so padding (left padding in
particular) adds nothing to the state. ``None`` skips the masking.

Differences from HF's torch path, all at rounding level: HF computes its SSD and its norm in fp32
whatever the model dtype (fp64 included); here fp64 models compute in fp64, and in bf16/fp16 the
SSD output is rounded to the model dtype before the gate (tk.mamba2_ssd returns x's dtype), where
HF keeps it in fp32.

Cache: ``forward`` computes full sequences only; a ``cache_params`` (or ``cache``, its name in HF's
mixer from transformers 5.24) raises NotImplementedError (no prefill, no single-step decode).
``tk_ops.transformers.apply_tk_kernels_to_mamba2`` patches HF's own mixer, which does handle caches
(prefill through the tk ops, decode steps through HF's code).

On Hopper, tk.causal_conv1d, tk.mamba2_ssd and tk.rms_norm run their CUDA kernels for the inputs
each op's docstring lists; other inputs, and other devices, run their PyTorch references.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from tk_ops._checks import compute_dtype
from tk_ops.nn.hf_mixer import from_hf_config, refuse_cache
from tk_ops.nn.linear import Linear
from tk_ops.ops.causal_conv1d import causal_conv1d
from tk_ops.ops.mamba2_ssd import mamba2_ssd
from tk_ops.ops.rms_norm import rms_norm

SILU_NAMES = ("silu", "swish")
DEFAULT_TIME_STEP_LIMIT = (0.0, float("inf"))



def gated_norm_group_size(norm: torch.nn.Module) -> int:
    """How many channels a gated norm normalises together: its ``group_size`` (this module's
    ``MambaRMSNormGated``; HF's from transformers 5.23, = intermediate_size // n_groups), else all of
    its channels: HF's ``MambaRMSNormGated`` before 5.23 has no ``group_size`` and normalises over the
    whole last dimension."""
    group_size = getattr(norm, "group_size", None)
    return norm.weight.shape[-1] if group_size is None else int(group_size)


def gated_rms_norm(
    hidden_states: torch.Tensor,
    gate: Optional[torch.Tensor],
    weight: torch.Tensor,
    group_size: int,
    eps: float,
) -> torch.Tensor:
    """``weight * rmsnorm_groups(hidden_states * silu(gate))``: HF's MambaRMSNormGated / mamba_ssm's
    RMSNormGated with norm_before_gate=False. Gate in fp32 (fp64 for fp64 inputs), normalisation by
    ``tk.rms_norm`` over each group of ``group_size`` channels, the weight over all channels; the
    result is in the promotion of weight's dtype and fp32 (fp64), as HF's."""
    h = hidden_states.to(compute_dtype(hidden_states.dtype))
    if gate is not None:
        h = h * F.silu(gate.to(h.dtype))
    normed = rms_norm(h.unflatten(-1, (-1, group_size)), None, eps).flatten(-2)
    return weight * normed


class MambaRMSNormGated(torch.nn.Module):
    """HF's ``MambaRMSNormGated`` (parameter ``weight`` (hidden_size,), attributes ``group_size`` and
    ``variance_epsilon``) on ``gated_rms_norm``."""

    def __init__(self, hidden_size: int, group_size: int, eps: float = 1e-6, device=None, dtype=None) -> None:
        super().__init__()
        if hidden_size % group_size != 0:
            raise ValueError(f"hidden_size ({hidden_size}) must be a multiple of group_size ({group_size})")
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.variance_epsilon = eps
        self.group_size = group_size

    def forward(self, hidden_states: torch.Tensor, gate: Optional[torch.Tensor] = None) -> torch.Tensor:
        return gated_rms_norm(hidden_states, gate, self.weight, self.group_size, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, group_size={self.group_size}, eps={self.variance_epsilon}"


def _zero_padding(hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor]) -> torch.Tensor:
    """Rows at padded positions (attention_mask == 0) set to zero, in hidden_states' dtype."""
    if attention_mask is None:
        return hidden_states
    return (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)


def mamba2_mixer_forward(mixer: torch.nn.Module, hidden_states: torch.Tensor, attention_mask=None, cache_params=None):
    """The Mamba-2 mixer over a full sequence, on the tk ops, for any module with HF's Mamba2Mixer
    attributes (this module's ``Mamba2Mixer`` or HF's own): (B, L, hidden) -> (B, L, hidden).

    With ``cache_params`` (an HF cache holding no state for ``mixer.layer_idx`` yet: a prefill), the
    conv state and the final SSM state are written to it as HF's mixer writes them.
    """
    batch, seq_len, _ = hidden_states.shape
    dtype = hidden_states.dtype
    heads, head_dim, groups, state_size = mixer.num_heads, mixer.head_dim, mixer.n_groups, mixer.ssm_state_size
    intermediate = mixer.intermediate_size

    projected = mixer.in_proj(_zero_padding(hidden_states, attention_mask))
    gate, xBC, dt = projected.split([intermediate, mixer.conv_dim, heads], dim=-1)

    # Causal depthwise conv over the (B, L, conv_dim) slice, seen as (B, conv_dim, L): no copy.
    xBC = xBC.transpose(1, 2)
    if cache_params is not None:
        cache_params.update_conv_state(xBC, mixer.layer_idx, conv_kernel_size=mixer.conv_kernel_size)
    weight = mixer.conv1d.weight.squeeze(1)
    if mixer.activation in SILU_NAMES:
        xBC = causal_conv1d(xBC, weight, mixer.conv1d.bias, activation="silu")
    else:
        xBC = mixer.act(causal_conv1d(xBC, weight, mixer.conv1d.bias))
    xBC = _zero_padding(xBC.transpose(1, 2), attention_mask)
    x, B, C = xBC.split([intermediate, groups * state_size, groups * state_size], dim=-1)

    A = -torch.exp(mixer.A_log.to(compute_dtype(mixer.A_log.dtype)))
    dt_bias, dt_softplus = mixer.dt_bias, True
    limit = tuple(float(v) for v in mixer.time_step_limit)
    if limit != DEFAULT_TIME_STEP_LIMIT:
        dt = torch.clamp(F.softplus(dt.to(A.dtype) + dt_bias.to(A.dtype)), min=limit[0], max=limit[1])
        dt_bias, dt_softplus = None, False
    result = mamba2_ssd(
        x.unflatten(-1, (heads, head_dim)),
        dt,
        A,
        B.unflatten(-1, (groups, state_size)),
        C.unflatten(-1, (groups, state_size)),
        chunk_size=mixer.chunk_size,
        D=mixer.D,
        dt_bias=dt_bias,
        dt_softplus=dt_softplus,
        return_final_states=cache_params is not None,
    )
    if cache_params is not None:
        y, final_states = result
        cache_params.update_recurrent_state(final_states, layer_idx=mixer.layer_idx)
    else:
        y = result

    norm = mixer.norm
    out = gated_rms_norm(y.flatten(2), gate, norm.weight, gated_norm_group_size(norm), norm.variance_epsilon)
    return mixer.out_proj(out.to(dtype))


class Mamba2Mixer(torch.nn.Module):
    """The Mamba-2 mixer with HF's ``Mamba2Mixer`` parameters and attributes (see the module docstring).

    Constructor arguments are the Mamba2Config fields of the same names (``layer_norm_epsilon`` is the
    gated norm's eps); ``Mamba2Mixer.from_config(config, layer_idx)`` reads them from a config.
    Initialisation as HF's: nn.Linear / nn.Conv1d defaults, A_log = log(1..H), D = 1, dt_bias the
    inverse softplus of steps log-uniform in [time_step_min, time_step_max] (at least
    time_step_floor), norm.weight = 1.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        state_size: int = 128,
        n_groups: int = 8,
        conv_kernel: int = 4,
        expand: int = 2,
        chunk_size: int = 256,
        use_bias: bool = False,
        use_conv_bias: bool = True,
        hidden_act: str = "silu",
        layer_norm_epsilon: float = 1e-5,
        time_step_limit: Sequence[float] = DEFAULT_TIME_STEP_LIMIT,
        time_step_min: float = 0.001,
        time_step_max: float = 0.1,
        time_step_floor: float = 1e-4,
        layer_idx: Optional[int] = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        intermediate = int(expand * hidden_size)
        if intermediate != num_heads * head_dim:
            raise ValueError(
                f"expand * hidden_size ({intermediate}) must equal num_heads * head_dim ({num_heads * head_dim})"
            )
        if num_heads % n_groups != 0:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of n_groups ({n_groups})")
        if hidden_act not in SILU_NAMES:
            raise ValueError(f"hidden_act must be 'silu' or 'swish' (the conv's activation), got {hidden_act!r}")
        if len(time_step_limit) != 2 or not 0 <= time_step_limit[0] <= time_step_limit[1]:
            raise ValueError(f"time_step_limit must be (lo, hi) with 0 <= lo <= hi, got {tuple(time_step_limit)}")
        factory = {"device": device, "dtype": dtype}
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.ssm_state_size = state_size
        self.n_groups = n_groups
        self.conv_kernel_size = conv_kernel
        self.intermediate_size = intermediate
        self.chunk_size = chunk_size
        self.use_bias = use_bias
        self.use_conv_bias = use_conv_bias
        self.activation = hidden_act
        self.act = torch.nn.SiLU()
        self.layer_norm_epsilon = layer_norm_epsilon
        self.time_step_limit = tuple(time_step_limit)
        self.time_step_min = time_step_min
        self.time_step_max = time_step_max
        self.time_step_floor = time_step_floor
        self.layer_idx = layer_idx
        self.conv_dim = intermediate + 2 * n_groups * state_size

        self.conv1d = torch.nn.Conv1d(
            self.conv_dim,
            self.conv_dim,
            kernel_size=conv_kernel,
            groups=self.conv_dim,
            padding=conv_kernel - 1,
            bias=use_conv_bias,
            **factory,
        )
        self.in_proj = Linear(hidden_size, intermediate + self.conv_dim + num_heads, bias=use_bias, **factory)
        self.dt_bias = torch.nn.Parameter(torch.empty(num_heads, **factory))
        self.A_log = torch.nn.Parameter(torch.empty(num_heads, **factory))
        self.norm = MambaRMSNormGated(intermediate, intermediate // n_groups, eps=layer_norm_epsilon, **factory)
        self.D = torch.nn.Parameter(torch.empty(num_heads, **factory))
        self.out_proj = Linear(intermediate, hidden_size, bias=use_bias, **factory)
        self.reset_ssm_parameters()

    @torch.no_grad()
    def reset_ssm_parameters(self) -> None:
        """A_log = log(1..H), D = 1, dt_bias = softplus^-1(dt), dt log-uniform in [time_step_min, time_step_max]."""
        if self.A_log.device.type == "meta":
            return
        heads = self.num_heads
        self.A_log.copy_(torch.log(torch.arange(1, heads + 1, dtype=torch.float32)))
        self.D.fill_(1.0)
        low, high = math.log(self.time_step_min), math.log(self.time_step_max)
        dt = torch.exp(torch.rand(heads) * (high - low) + low).clamp(min=self.time_step_floor)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))

    @classmethod
    def from_config(cls, config, layer_idx: Optional[int] = None, device=None, dtype=None) -> "Mamba2Mixer":
        """From a transformers ``Mamba2Config`` (or any object with its fields)."""
        return from_hf_config(cls, config, layer_idx, device, dtype)

    def forward(
        self,
        hidden_states: torch.Tensor,
        cache_params=None,
        attention_mask: Optional[torch.Tensor] = None,
        cache=None,
        **kwargs,
    ) -> torch.Tensor:
        """hidden_states (B, L, hidden_size) -> (B, L, hidden_size). attention_mask: (B, L), 1 keeps and 0
        pads, or None. A cache, under either of HF's names (``cache_params``; ``cache`` from transformers
        5.24), is refused. Other keyword arguments are ignored, as HF's torch path ignores them."""
        refuse_cache(self, cache_params, cache, "Mamba2Mixer", "apply_tk_kernels_to_mamba2")
        return mamba2_mixer_forward(self, hidden_states, attention_mask)

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
            f"state_size={self.ssm_state_size}, n_groups={self.n_groups}, conv_kernel={self.conv_kernel_size}, "
            f"chunk_size={self.chunk_size}"
        )
