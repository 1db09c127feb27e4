"""A Hyena language model (Poli et al. 2023, "Hyena Hierarchy") on tk_ops: pre-norm blocks of Hyena's
order-2 operator (``tk_ops.nn.GatedLongConvolution``: input projection, short causal depthwise conv
on ``tk.causal_conv1d``, gates around a long convolution by an implicit filter on ``tk.fftconv``,
output projection) and a SwiGLU MLP, with RMSNorm and a tied embedding.

State_dict keys: ``model.embed_tokens``, ``model.layers.{i}.norm`` / ``.mixer`` / ``.mlp_norm`` /
``.mlp``, ``model.norm``, ``lm_head``. The long filters have ``max_position_embeddings`` taps
(the training sequence length); a shorter sequence meets their first taps.

``config.reference=True`` runs the same parameters on standard PyTorch ops: the projections,
``F.conv1d`` for the short conv, and the long convolution by ``torch.fft`` (real FFTs of size 2N,
in fp32). The implicit filter is plain PyTorch on both paths. The implicit filters keep their own
initialisation (the other linear layers and the embedding are N(0, initializer_range)).
``config.peer=True`` (with reference=True) is the reference model itself: torch.fft is both the
reference's long convolution and the peer of ``tk.fftconv`` (``models.peers``).
"""

from __future__ import annotations

import dataclasses
import json
import math

import torch
import torch.nn.functional as F

import tk_ops
from models import peers
from models.layers import CausalLM, MixerBlock, ResidualRMSNorm, at_least_fp32


@dataclasses.dataclass
class HyenaConfig:
    vocab_size: int = 8192
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 4
    short_conv_width: int = 3
    filter_width: int = 64  # units of each hidden layer of the implicit filter's MLP
    filter_depth: int = 2
    filter_frequencies: int = 8  # positional-encoding frequencies of the implicit filter
    max_position_embeddings: int = 2048  # taps of the long filters
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = True
    initializer_range: float = 0.02
    reference: bool = False  # True: standard PyTorch ops only
    peer: bool = False  # True (with reference): the peer model, which is the reference model

    def __post_init__(self) -> None:
        peers.check_flags(self.reference, self.peer)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


def reference_long_conv(u: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Causal convolution of u (B, H, N) by k (H, L), L <= N, through real FFTs of size 2N, in fp32."""
    seq_len = u.shape[-1]
    size = 2 * seq_len  # no wrap-around: the circular convolution of zero-padded signals is the linear one
    spectrum = torch.fft.rfft(at_least_fp32(u), n=size) * torch.fft.rfft(at_least_fp32(k), n=size)
    return torch.fft.irfft(spectrum, n=size)[..., :seq_len]


class HyenaMixer(tk_ops.nn.GatedLongConvolution):
    """tk_ops.nn.GatedLongConvolution with a pure-PyTorch path (``reference``)."""

    def __init__(self, config: HyenaConfig) -> None:
        super().__init__(
            config.hidden_size,
            config.max_position_embeddings,
            short_conv_width=config.short_conv_width,
            num_frequencies=config.filter_frequencies,
            width=config.filter_width,
            depth=config.filter_depth,
        )
        self.reference = config.reference

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if not self.reference:
            return super().forward(hidden_states)
        seq_len = hidden_states.shape[1]
        projected = F.linear(hidden_states, self.in_proj.weight, self.in_proj.bias).transpose(1, 2)
        conv = self.short_conv
        mixed = F.conv1d(projected, conv.weight, conv.bias, padding=conv.padding, groups=projected.shape[1])
        output_gate, input_gate, value = mixed[..., :seq_len].split(self.hidden_size, dim=1)
        u = input_gate * value
        long_conv = self.long_conv
        y = reference_long_conv(u, long_conv.filter(min(seq_len, long_conv.max_len))) + long_conv.D[:, None] * u
        out = (output_gate * y.to(u.dtype)).transpose(1, 2)
        return F.linear(out, self.out_proj.weight, self.out_proj.bias)


class HyenaModel(torch.nn.Module):
    def __init__(self, config: HyenaConfig) -> None:
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = torch.nn.ModuleList(
            MixerBlock(
                HyenaMixer(config), config.hidden_size, config.intermediate_size,
                eps=config.rms_norm_eps, reference=config.reference,
            )  # fmt: skip
            for _ in range(config.num_hidden_layers)
        )
        self.norm = ResidualRMSNorm(config.hidden_size, config.rms_norm_eps, reference=config.reference)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(x, residual)
        return self.norm(x, residual)[0]


class HyenaForCausalLM(CausalLM):
    def __init__(self, config: HyenaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = HyenaModel(config)
        self.init_head(self.model.embed_tokens, keep=(tk_ops.nn.ImplicitLongFilter,))

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 3 x (2 x matmul parameters + the short and the long convolutions).

        Matmuls: the projections (3 H^2 + H^2), the MLP and the output layer; the implicit filters'
        MLPs run once per sequence, not per token, and are left out. Short conv: 2 x W per projected
        channel. Long conv per channel and token: a real FFT of size 2N and its inverse, 2.5 x 2N
        log2(2N) each per sequence (10 log2(2N) per token), and the complex product (6 per token)."""
        c = self.config
        hidden = c.hidden_size
        matmul_params = c.num_hidden_layers * (4 * hidden * hidden + 3 * hidden * c.intermediate_size)
        matmul_params += hidden * c.vocab_size
        short_conv = 2 * c.short_conv_width * 3 * hidden
        long_conv = hidden * (10 * math.log2(2 * seq_len) + 6)
        return 3.0 * (2.0 * matmul_params + c.num_hidden_layers * (short_conv + long_conv))
