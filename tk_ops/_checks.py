"""Argument checks shared by the public ops: each error names the argument and what was expected.

They run in the Python wrappers before dispatch (on real and fake tensors alike), so a bad input
never reaches a kernel. Shape mismatches raise ValueError, wrong types and dtypes TypeError.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
KERNEL_DTYPES = (torch.float16, torch.bfloat16)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the references accumulate in and the statistics and states have: fp64 for fp64
    inputs, fp32 for every other floating dtype (the kernels' fp32 accumulation)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _dtype_names(dtypes: Iterable[torch.dtype]) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(
    name: str,
    t,
    *,
    ndim: Optional[int | tuple[int, ...]] = None,
    dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES,
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
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in ({_dtype_names(dtypes)}), got {t.dtype}")
    if not allow_empty and t.numel() == 0:
        raise ValueError(f"{name} must not be empty, got shape {tuple(t.shape)}")
    return t


def uniform_floats(first, *others: Optional[torch.Tensor], autocast: bool) -> bool:
    """The public functions' fast path: True when their detailed checks of these tensors' kind would
    all pass: every one (``others`` may hold None, skipped) a torch.Tensor of one dtype in
    FLOAT_DTYPES on one device, none empty, and, with ``autocast`` (the op casts under autocast),
    autocast enabled on no device. A public function that gets True and also finds its shape
    relations right skips the detailed checks; on False it runs them, which raise the error that
    names the argument, or pass (an fp32 parameter beside a bf16 x, an autocast cast)."""
    if autocast and torch._C._is_any_autocast_enabled():
        return False
    if not isinstance(first, torch.Tensor) or first.dtype not in FLOAT_DTYPES or first.numel() == 0:
        return False
    dtype, device = first.dtype, first.device
    for t in others:
        if t is not None and (
            not isinstance(t, torch.Tensor) or t.dtype != dtype or t.device != device or t.numel() == 0
        ):
            return False
    return True


def check_optional(name: str, t, **kwargs) -> Optional[torch.Tensor]:
    return None if t is None else check_tensor(name, t, **kwargs)


def _check_same(attribute: str, relation: str, error: type, tensors: dict) -> None:
    """Every non-None tensor's `attribute` equals the first one's; the message names both tensors."""
    first_name, value = None, None
    for n, t in tensors.items():
        if t is None:
            continue
        if value is None:
            first_name, value = n, getattr(t, attribute)
        elif getattr(t, attribute) != value:
            raise error(f"{n} must {relation} {first_name}'s {attribute} {value}, got {getattr(t, attribute)}")


def check_same_device(**tensors: Optional[torch.Tensor]) -> None:
    _check_same("device", "be on", ValueError, tensors)


def check_same_dtype(**tensors: Optional[torch.Tensor]) -> None:
    _check_same("dtype", "have", TypeError, tensors)


def check_dim(name: str, t: torch.Tensor, dim: int, expected: int, what: str) -> None:
    """Check one size: ``t.shape[dim] == expected``, where ``what`` says where ``expected`` comes from."""
    if t.shape[dim] != expected:
        raise ValueError(
            f"{name}.shape[{dim}] must equal {what} ({expected}), got shape {tuple(t.shape)}"
        )


def may_read_contents(index: torch.Tensor, *, device_sync: bool) -> bool:
    """Whether a public function may read an index tensor's values on the host to check them: in eager
    mode (not traced by torch.compile or torch.export: no graph break, no fake tensor), and on the CPU, or,
    where the caller accepts a device sync, on a GPU while no CUDA graph is being captured (a host read
    there is an error, and a replay would not repeat it)."""
    if torch.compiler.is_compiling() or isinstance(index, torch._subclasses.fake_tensor.FakeTensor):
        return False
    if index.device.type == "cpu":
        return True
    return device_sync and not (index.device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def unit_last_stride(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Kernels accept any strides with a unit last stride; anything else is copied, never misread.
    None (an absent optional input) stays None; a contiguous tensor, the common case, is returned
    after one cheap test."""
    if t is None or t.is_contiguous():
        return t
    if t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        return t.contiguous()
    return t
