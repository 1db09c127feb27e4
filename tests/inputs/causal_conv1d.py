"""tk.causal_conv1d's inputs (tests/op_db.py and tests/test_causal_conv1d.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import tk_testing

ROW_ALIGNMENT = 8  # elements: 16 bytes of bf16/fp16, 32 of fp32; the NaN margins of the padded layouts


def make_inputs(B, D, L, W, *, dtype=torch.float64, param_dtype=None, with_bias=True, device="cpu"):
    """x ~ N(0, 1); taps scaled by W**-0.5 so the output stays O(1); bias ~ N(0, 1)."""
    param_dtype = param_dtype or dtype
    x = torch.randn(B, D, L, device=device).to(dtype)
    weight = (torch.randn(D, W, device=device) / W**0.5).to(param_dtype)
    bias = torch.randn(D, device=device).to(param_dtype) if with_bias else None
    return x, weight, bias


def gpu_activation(values: torch.Tensor, layout: str) -> torch.Tensor:
    """(B, D, L) values on the GPU, stored as
    "bdl"         contiguous (B, D, L): channel-first, rows 16-byte aligned when L is a multiple of a vector
    "bld"         a contiguous (B, L, D) transposed: channel-last
    "bdl-padded"  rows of a NaN buffer, ROW_ALIGNMENT NaN before t = 0 and at least as many after t = L - 1,
                  rows 16-byte aligned whatever L (so a vector cut by the row's end at odd L)
    "bld-slice"   a column slice of a NaN (B, L + ROW_ALIGNMENT, D + 2 ROW_ALIGNMENT) buffer, transposed
                  (NaN rows before t = 0, NaN columns around the slice)
    so a kernel that reads past an end (or before t = 0) produces NaN."""
    b, d, n = values.shape
    if layout == "bdl":
        return values.cuda()
    if layout == "bld":
        return values.transpose(1, 2).contiguous().cuda().transpose(1, 2)
    pad = ROW_ALIGNMENT
    if layout == "bdl-padded":
        row = -(-(n + 2 * pad) // pad) * pad
        buffer = torch.full((b, d, row), float("nan"), dtype=values.dtype, device="cuda")
        buffer[..., pad : pad + n] = values
        return buffer[..., pad : pad + n]
    assert layout == "bld-slice", layout
    buffer = torch.full((b, n + pad, d + 2 * pad), float("nan"), dtype=values.dtype, device="cuda")
    buffer[:, pad:, pad : pad + d] = values.transpose(1, 2)
    return buffer[:, pad:, pad : pad + d].transpose(1, 2)


def kernel_case(B, D, L, W, dtype, param_dtype, layout, with_bias=True):
    """x and the output gradient in `layout` (NaN around them where padded), weight and bias on the GPU
    with NaN past their ends; the CPU float64 copies of the same rounded values."""
    x, weight, bias = make_inputs(B, D, L, W, dtype=dtype, param_dtype=param_dtype, with_bias=with_bias)
    grad = torch.randn(B, D, L).to(dtype)
    parameters = [None if t is None else tk_testing.on_gpu_with_canary(t.flatten()).view(t.shape) for t in (weight, bias)]
    gpu = (gpu_activation(x, layout), *parameters, gpu_activation(grad, layout))
    return gpu, (x.double(), weight.double(), None if bias is None else bias.double(), grad.double())


def conv1d_reference(x, weight, bias=None, silu=False):
    """causal_conv1d's reference: a depthwise conv1d padded by W - 1 on both sides, cut to L."""
    dim, width = weight.shape
    out = F.conv1d(x, weight.unsqueeze(1), bias, padding=width - 1, groups=dim)[..., : x.shape[-1]]
    return F.silu(out) if silu else out


def reference_out_and_grads(x, weight, bias, silu, grad):
    """out and the gradients of x, weight, bias (float64, on the CPU)."""
    leaves = [t.detach().requires_grad_() for t in (x, weight) + (() if bias is None else (bias,))]
    out = conv1d_reference(leaves[0], leaves[1], leaves[2] if bias is not None else None, silu)
    return (out.detach(), *torch.autograd.grad(out, leaves, grad))
