"""tk.linear_cross_entropy's inputs and float64 definition (tests/op_db.py and tests/test_linear_cross_entropy.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def make_inputs(N, H, V, *, dtype=torch.float64, with_bias=True, ignored=3, device="cpu", requires_grad=False):
    """x ~ N(0, 1) (N, H); weight ~ N(0, 1 / H) (V, H), so that logits are O(1); bias ~ N(0, 1) (V,);
    target (N,) int64 uniform in [0, V), its first ``ignored`` rows IGNORE_INDEX."""
    x = torch.randn(N, H, device=device).to(dtype)
    weight = (torch.randn(V, H, device=device) / H**0.5).to(dtype)
    bias = torch.randn(V, device=device).to(dtype) if with_bias else None
    target = torch.randint(0, V, (N,), device=device)
    target[:ignored] = IGNORE_INDEX
    leaves = tuple(t if t is None else t.requires_grad_(requires_grad) for t in (x, weight, bias))
    return (*leaves, target)


def float64_loss(x, weight, target, bias=None, *, ignore_index=IGNORE_INDEX, label_smoothing=0.0, reduction="mean",
                 softcap=None):
    """The definition in float64 on the same values: F.cross_entropy of the (softcapped) logits, every leading
    index of x one row; autograd flows to x, weight and bias."""
    logits = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    loss = F.cross_entropy(logits.reshape(-1, weight.shape[0]), target.reshape(-1), ignore_index=ignore_index,
                           label_smoothing=label_smoothing, reduction=reduction)
    return loss.view(target.shape) if reduction == "none" else loss
