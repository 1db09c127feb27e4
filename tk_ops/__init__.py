"""tk_ops: PyTorch operators on Hopper (sm_90a) kernels written on a ThunderKittens-style tile core.

Every op is a ``torch.ops.tk.*`` op with a CUDA kernel (when ``tk_ops._C`` is built), a PyTorch
reference (CPU and unsupported inputs), a fake impl and autograd through a dedicated backward op.
``tk_ops.backends()`` says which implementation serves each op on CUDA tensors.
"""

from tk_ops import _library
from tk_ops.ops.attention import attention, attention_varlen
from tk_ops.ops.attention_with_kvcache import attention_with_kvcache
from tk_ops.ops.based_attention import based_attention
from tk_ops.ops.causal_conv1d import causal_conv1d
from tk_ops.ops.fftconv import fftconv
from tk_ops.ops.gated_delta_rule import gated_delta_rule
from tk_ops.ops.layer_norm import layer_norm
from tk_ops.ops.linear_attention import linear_attention
from tk_ops.ops.linear_cross_entropy import linear_cross_entropy
from tk_ops.ops.mamba2_ssd import mamba2_ssd
from tk_ops.ops.matmul import linear, matmul
from tk_ops.ops.rms_norm import rms_norm
from tk_ops.ops.rope import rope, rope_qk
from tk_ops import nn

_library.load_extension()

backends = _library.backends


def extension_status() -> str:
    """``"loaded"``; ``"not built: <why>"`` (a pure-Python install: why setup.py built no extension, e.g.
    ``"not built: torch 2.13.0+cpu has no CUDA"``, from the record it writes in tk_ops/_build_info.py);
    ``"failed to load: <error>"`` (built, but for another torch or CUDA); or ``"disabled by
    TK_OPS_DISABLE_EXTENSION=1"``."""
    return _library.EXTENSION_STATUS


__all__ = [
    "attention",
    "attention_varlen",
    "attention_with_kvcache",
    "backends",
    "based_attention",
    "causal_conv1d",
    "extension_status",
    "fftconv",
    "gated_delta_rule",
    "layer_norm",
    "linear",
    "linear_attention",
    "linear_cross_entropy",
    "mamba2_ssd",
    "matmul",
    "nn",
    "rms_norm",
    "rope",
    "rope_qk",
]
