"""tk.matmul's and tk.linear's references (tests/op_db.py and tests/test_matmul.py)."""

from __future__ import annotations

import torch


def float64_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The float64 product on the GPU (the outer-product form would not fit in memory at these sizes)."""
    return a.double() @ b.double()
