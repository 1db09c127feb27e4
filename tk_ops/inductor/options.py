"""What the rewrites may do: which devices they fire on, whether GEMMs are rewritten, and whether
SDPA is rewritten even where the measured rule keeps its backend."""

from __future__ import annotations

import dataclasses

import torch

from tk_ops import _library


@dataclasses.dataclass(frozen=True)
class RewriteOptions:
    # Rewrite for tensors on any device (the tk reference path serves CPU); the CPU test suite
    # uses it to exercise the rewrite logic. By default only devices with a tk kernel qualify.
    any_device: bool = False
    # Rewrite mm/addmm to tk.matmul/tk.linear (only worth it where the GEMM benchmark shows a gain).
    matmul: bool = False
    # Rewrite every exact SDPA node, also where the speed rule of inductor/attention.py keeps the
    # SDPA backend because it measured faster (cuDNN): for benchmarking tk against it.
    always_rewrite_attention: bool = False

    def kernel_takes(self, op_name: str, property: str, value: int) -> bool:
        """Whether op_name's kernels take ``value`` for ``property`` (``"head_dims"``), as the extension
        declares (``_library.kernel_support``). With nothing declared (no extension), only under
        any_device, where the reference, exact for every value, serves the rewrite."""
        declared = _library.kernel_support(op_name).get(property)
        if declared is None:
            return self.any_device
        return value in declared

    def serves(self, device: torch.device, op_name: str) -> bool:
        if self.any_device:
            return True
        return (
            device.type == "cuda"
            and torch.cuda.get_device_capability(device) == (9, 0)
            and _library.has_cuda_kernel(op_name)
        )
