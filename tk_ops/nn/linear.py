"""``tk_ops.nn.Linear``: a drop-in ``torch.nn.Linear`` whose forward and backward run tk GEMMs."""

from __future__ import annotations

import torch

from tk_ops.ops.matmul import linear


class Linear(torch.nn.Linear):
    """Same parameters, initialisation and state_dict keys (``weight``, ``bias``) as ``nn.Linear``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
