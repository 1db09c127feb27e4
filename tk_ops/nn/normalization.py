"""PLACEHOLDER: replaced by the norms implementation."""

import torch


class LayerNorm(torch.nn.LayerNorm):
    pass


class RMSNorm(torch.nn.RMSNorm):
    pass
