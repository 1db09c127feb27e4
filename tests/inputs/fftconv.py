"""tk.fftconv's inputs (tests/op_db.py and tests/test_fftconv.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tk_ops.ops.fftconv import _fftconv_bwd_reference
from tk_testing import TOLERANCE, assert_rel_close

# The kernel runs its FFTs as fp16/bf16 tensor-core matmuls (Monarch form) with fp32 accumulation:
# each of its stages rounds, so its budget is wider than one output rounding (TOLERANCE). The CPU
# emulation of its exact stages (tests/test_fftconv_monarch.py) gives 1.5-2.5e-3 (bf16) and
# 1.5-3.2e-4 (fp16) at every N for the forward; the backward's grad_u and grad_k 1.6-5.2e-3 (bf16)
# and 2-11e-4 (fp16). fp32 u splits every operand into bf16 hi + lo (three products each): the
# emulation gives 3-9e-6 for the forward and the three gradients; its contract is 1e-4. fp32 u runs
# the kernels up to N = 8192 (the split tiles do not fit shared memory at 16384: the reference).
KERNEL_TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-4}


def make_inputs(B, H, N, L, *, dtype=torch.float64, param_dtype=None, with_D=True, device="cpu"):
    """u ~ N(0, 1); k scaled like a long filter so that y stays O(1); D ~ N(0, 1)."""
    param_dtype = param_dtype or dtype
    u = torch.randn(B, H, N, device=device).to(dtype)
    k = (torch.randn(H, L, device=device) / L**0.5).to(param_dtype)
    D = torch.randn(H, device=device).to(param_dtype) if with_D else None
    return u, k, D


def conv_reference(u, k, D=None):
    """Direct causal convolution: conv1d (a cross-correlation) with flipped filters and L - 1 zeros on the left."""
    heads, filter_len = k.shape
    y = F.conv1d(F.pad(u, (filter_len - 1, 0)), k.flip(-1).unsqueeze(1), groups=heads)
    return y if D is None else y + D[:, None] * u


def float64_reference(u, k, D):
    """The direct convolution of the same (already rounded) values in float64."""
    return conv_reference(u.double(), k.double(), None if D is None else D.double())


def float64_backward(grad, u, k, D):
    """The reference backward of the same (already rounded) values in float64."""
    return _fftconv_bwd_reference(grad.double(), u.double(), k.double(), None if D is None else D.double())


def check_backward(got, grad, u, k, D, dtype):
    """The backward's gradients ``got`` (grad_u, grad_k, grad_D) against float64_backward."""
    grad_u, grad_k, grad_D = got
    want = float64_backward(grad, u, k, D)
    assert grad_u.dtype == u.dtype and grad_u.shape == u.shape and grad_u.is_contiguous()
    assert grad_k.dtype == k.dtype and grad_k.shape == k.shape
    assert_rel_close(grad_u, want[0], KERNEL_TOLERANCE[dtype], "grad_u")
    assert_rel_close(grad_k, want[1], KERNEL_TOLERANCE[dtype], "grad_k")
    if D is None:
        assert grad_D.numel() == 0
    else:
        assert grad_D.dtype == D.dtype and grad_D.shape == D.shape
        # an fp32 sum of the rounded products: fp32's error, not the FFT's
        assert_rel_close(grad_D, want[2], 1e-4 if D.dtype == torch.float32 else TOLERANCE[D.dtype], "grad_D")
