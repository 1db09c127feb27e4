"""Argument checks shared by the public ops: each error names the argument and what was expected.

They run in the Python wrappers before dispatch (on real and fake tensors alike), so a bad input
never reaches a kernel. Shape mismatches raise ValueError, wrong types and dtypes TypeError.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
KERNEL_DTYPES = (torch.float16, torch.bfloat16)


def _dtype_names(dtypes: Iterable[torch.dtype]) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(
    name: str,
    t,
    *,
    ndim: Optional[int | tuple[int, ...]] = None,
    dtypes: Iterable[torch.dtype] = FLOAT_DTYPES,
    allow_empty: bool = False,
) -> torch.Tensor:
    """Check type, rank, dtype and non-emptiness of one tensor argument; return it."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None:
        ranks = (ndim,) if isinstance(ndim, int) else ndim
        if t.dim() not in ranks:
            expected = " or ".join(str(r) for r in ranks)
            raise ValueError(f"{name} must have {expected} dimensions, got shape {tuple(t.shape)}")
    dtypes = tuple(dtypes)
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in ({_dtype_names(dtypes)}), got {t.dtype}")
    if not allow_empty and t.numel() == 0:
        raise ValueError(f"{name} must not be empty, got shape {tuple(t.shape)}")
    return t


def check_optional(name: str, t, **kwargs) -> Optional[torch.Tensor]:
    return None if t is None else check_tensor(name, t, **kwargs)


def check_same_device(**tensors: Optional[torch.Tensor]) -> None:
    named = [(n, t) for n, t in tensors.items() if t is not None]
    first_name, first = named[0]
    for n, t in named[1:]:
        if t.device != first.device:
            raise ValueError(f"{n} must be on {first_name}'s device {first.device}, got {t.device}")


def check_same_dtype(**tensors: Optional[torch.Tensor]) -> None:
    named = [(n, t) for n, t in tensors.items() if t is not None]
    first_name, first = named[0]
    for n, t in named[1:]:
        if t.dtype != first.dtype:
            raise TypeError(f"{n} must have {first_name}'s dtype {first.dtype}, got {t.dtype}")


def check_dim(name: str, t: torch.Tensor, dim: int, expected: int, what: str) -> None:
    """Check one size: ``t.shape[dim] == expected``, where ``what`` says where ``expected`` comes from."""
    if t.shape[dim] != expected:
        raise ValueError(
            f"{name}.shape[{dim}] must equal {what} ({expected}), got shape {tuple(t.shape)}"
        )


def unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    """Kernels accept any strides with a unit last stride; anything else is copied, never misread."""
    if t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        return t.contiguous()
    return t
