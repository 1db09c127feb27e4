"""``tk_ops.nn.LayerNorm`` and ``tk_ops.nn.RMSNorm``: drop-ins for the torch modules on tk norm ops.

Both subclass the torch modules, so the constructor arguments, initialisation, ``extra_repr`` and
state_dict keys (``weight``, ``bias``) are torch's. ``RMSNorm`` also loads a Hugging Face
``LlamaRMSNorm`` state_dict (key ``weight``) and gives its output for the same eps (HF's default
is 1e-6). ``eps=None`` means, as in torch, the machine epsilon of the compute type: that of fp32
for fp16/bf16/fp32 inputs, of fp64 for fp64 inputs. A multi-dimensional
``normalized_shape`` is handled by flattening the normalised trailing dims into one.
"""

from __future__ import annotations

from typing import Optional

import torch

from tk_ops._checks import compute_dtype
from tk_ops.ops.layer_norm import layer_norm
from tk_ops.ops.rms_norm import rms_norm


def _flatten_normalized_dims(x: torch.Tensor, normalized_shape: tuple[int, ...]) -> torch.Tensor:
    """View x (..., *normalized_shape) as (..., prod(normalized_shape)); one normalised dim is kept as is."""
    trailing = len(normalized_shape)
    if x.dim() < trailing or tuple(x.shape[x.dim() - trailing :]) != tuple(normalized_shape):
        raise ValueError(
            f"input must end with normalized_shape {tuple(normalized_shape)}, got shape {tuple(x.shape)}"
        )
    if trailing == 1:
        return x
    return x.reshape(*x.shape[: x.dim() - trailing], -1)


def _flat(parameter: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if parameter is None else parameter.reshape(-1)


class LayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` (same arguments, incl. ``elementwise_affine`` and ``bias``) on ``tk.layer_norm``."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        flat = _flatten_normalized_dims(input, self.normalized_shape)
        out = layer_norm(flat, _flat(self.weight), _flat(self.bias), self.eps)
        return out.view(input.shape)


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` on ``tk.rms_norm``; also a drop-in for Hugging Face's ``LlamaRMSNorm``."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        eps = torch.finfo(compute_dtype(input.dtype)).eps if self.eps is None else self.eps
        flat = _flatten_normalized_dims(input, self.normalized_shape)
        return rms_norm(flat, _flat(self.weight), eps).view(input.shape)
