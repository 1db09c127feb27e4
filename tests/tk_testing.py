"""Shared helpers for the op tests: float64 comparisons, devices, GPU skips."""

from __future__ import annotations

import pytest
import torch

import tk_ops
from tk_ops import _library

HAS_CUDA = torch.cuda.is_available()
IS_HOPPER = HAS_CUDA and torch.cuda.get_device_capability() == (9, 0)

def _gpu_test(skip_condition: bool, reason: str):
    """Mark a test ``gpu`` (the device script selects them with ``-m gpu``) and skip it where it can't run."""
    skip = pytest.mark.skipif(skip_condition, reason=reason)

    def apply(test):
        return pytest.mark.gpu(skip(test))

    return apply


requires_cuda = _gpu_test(not HAS_CUDA, "needs a CUDA device")


def requires_kernel(op_name: str):
    """Skip unless a Hopper GPU is present and tk_ops._C registered a CUDA kernel for the op."""
    return _gpu_test(
        not (IS_HOPPER and _library.has_cuda_kernel(op_name)),
        f"needs an sm_90 GPU and the tk_ops CUDA kernel for tk.{op_name} (extension: {tk_ops.extension_status()})",
    )


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (NaN anywhere gives inf)."""
    out64, ref64 = out.detach().double().cpu(), ref.detach().double().cpu()
    if not torch.isfinite(out64).all():
        return float("inf")
    denominator = ref64.norm().item()
    difference = (out64 - ref64).norm().item()
    return difference / denominator if denominator > 0 else difference


def assert_rel_close(out: torch.Tensor, ref: torch.Tensor, tol: float, what: str = "output") -> None:
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    err = rel_err(out, ref)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e}"


# Relative-error budgets vs float64: low-precision inputs and outputs vs fp32 arithmetic.
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 5e-3}
