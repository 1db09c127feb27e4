"""Drop-in modules on tk ops, with the state_dict keys of the torch / Hugging Face / flash-linear-attention modules."""

from tk_ops.nn.based import BasedLinearAttention
from tk_ops.nn.linear import Linear
from tk_ops.nn.mamba2 import Mamba2Mixer
from tk_ops.nn.normalization import LayerNorm, RMSNorm
from tk_ops.nn.rotary import RotaryEmbedding

__all__ = ["BasedLinearAttention", "LayerNorm", "Linear", "Mamba2Mixer", "RMSNorm", "RotaryEmbedding"]
