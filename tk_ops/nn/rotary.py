"""PLACEHOLDER: replaced by the rope implementation."""

import torch


class RotaryEmbedding(torch.nn.Module):
    pass
