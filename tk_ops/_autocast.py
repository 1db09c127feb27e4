"""``torch.autocast`` for the ops autocast runs in lower precision: matmul, linear, attention.

Under autocast, ``F.linear``, ``torch.matmul`` and ``F.scaled_dot_product_attention`` cast their
fp32 inputs to the autocast dtype (fp64 is left alone); the tk versions do the same in their
public functions, before the argument checks, so a mixed-precision model with fp32 master weights
needs no casts of its own. Norms are not autocast (torch keeps them in fp32 too); they accept an
fp32 weight with a 16-bit input instead.
"""

from __future__ import annotations

from typing import Optional

import torch


def autocast_inputs(*tensors: Optional[torch.Tensor]) -> tuple[Optional[torch.Tensor], ...]:
    if not torch._C._is_any_autocast_enabled():  # the common case, in 0.1 us (Dynamo constant-folds it)
        return tensors
    first = next((t for t in tensors if isinstance(t, torch.Tensor)), None)
    if first is None:
        return tensors  # nothing to cast; the argument checks will say what is wrong
    device_type = first.device.type
    if not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)

    def cast(t):
        eligible = isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64
        return t.to(dtype) if eligible and t.dtype != dtype else t

    return tuple(cast(t) for t in tensors)
