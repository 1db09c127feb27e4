"""Modules on tk ops: drop-ins with the state_dict keys of the torch / Hugging Face / flash-linear-attention
modules, and the long-convolution mixers of long_conv.py (Hyena-style; no reference implementation to match)."""

from tk_ops.nn.based import BasedLinearAttention
from tk_ops.nn.gated_deltanet import GatedDeltaNet
from tk_ops.nn.linear import Linear
from tk_ops.nn.long_conv import GatedLongConvolution, ImplicitLongFilter, LongConvolution
from tk_ops.nn.mamba2 import Mamba2Mixer
from tk_ops.nn.normalization import LayerNorm, RMSNorm
from tk_ops.nn.rotary import RotaryEmbedding

__all__ = [
    "BasedLinearAttention",
    "GatedDeltaNet",
    "GatedLongConvolution",
    "ImplicitLongFilter",
    "LayerNorm",
    "Linear",
    "LongConvolution",
    "Mamba2Mixer",
    "RMSNorm",
    "RotaryEmbedding",
]
