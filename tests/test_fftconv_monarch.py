"""CPU emulation of the fftconv kernel's Monarch decomposition (csrc/kernels/fftconv/fftconv.cuh).

The same M1 x M2 factoring of the FFT of size 2N, the same stages, scales and conjugations, the
operands rounded to fp16/bf16 where the kernel rounds them (after stages 2, 4 and 6, the DFT
factors, the input), fp32 where it keeps fp32 (twiddles, the filter's spectrum), products in
float64 (standing in for fp32 accumulation): against the op's reference, for every N the kernel
takes, with an odd batch (one sequence without a partner). It pins the algebra the CUDA kernel
implements and the error budget of its 16-bit rounding points.
"""

from __future__ import annotations

import math

import pytest
import torch

from tk_ops.ops.fftconv import _fftconv_reference
from tk_testing import assert_rel_close

# The CPU emulation's errors against float64 (bf16: 1.5-2.5e-3, fp16: 1.5-3.2e-4 at B = 3, H = 2),
# with headroom; tests/test_fftconv.py's kernel budgets are 2e-2 and 5e-3.
EMULATION_TOLERANCE = {torch.bfloat16: 5e-3, torch.float16: 6e-4}


def monarch_plan(N: int) -> tuple[int, int]:
    """(M1, M2) of monarch_plan<N>: M2 = 16, 32 or 64 columns, M1 = 2N / M2 rows."""
    cols = 16 if N == 256 else 32 if N <= 1024 else 64
    return 2 * N // cols, cols


def rounded(z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Both planes of a complex tensor rounded to the kernel's operand type."""
    return torch.complex(z.real.to(dtype).double(), z.imag.to(dtype).double())


def unit_roots(rows: torch.Tensor, cols: torch.Tensor, size: int) -> torch.Tensor:
    """W_size^(rows * cols) from the exact residue, as the kernel's tables compute them."""
    angle = 2 * math.pi * (rows[:, None] * cols[None, :]).remainder(size).double() / size
    return torch.polar(torch.ones_like(angle), -angle)


def as_fp32(z: torch.Tensor) -> torch.Tensor:
    return z.to(torch.complex64).to(torch.complex128)


def monarch_fftconv(u: torch.Tensor, k: torch.Tensor, D: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    B, H, N = u.shape
    M1, M2 = monarch_plan(N)
    half = M1 // 2
    r1, r2 = torch.arange(M1), torch.arange(M2)
    dft_rows = rounded(unit_roots(r1, r1, M1), dtype)  # F_M1, the stage 1 and 7 table
    dft_cols = rounded(unit_roots(r2, r2, M2), dtype)  # F_M2 in shared memory
    twiddle = as_fp32(unit_roots(r1, r2, 2 * N) * (2 / M1))
    spectrum = torch.fft.rfft(k.float(), n=2 * N).to(torch.complex128)  # the op's fp32 rfft
    full = torch.cat([spectrum, spectrum[:, 1:N].flip(-1).conj()], -1)  # Hermitian completion
    filter_table = as_fp32(full[:, r1[:, None] + M1 * r2[None, :]] / M2)
    y = torch.empty(B, H, N, dtype=torch.float64)
    for h in range(H):
        for first in range(0, B, 2):
            second = u[first + 1, h].double() if first + 1 < B else torch.zeros(N, dtype=torch.float64)
            z = torch.complex(u[first, h].double(), second)
            x = rounded(z.reshape(half, M2), dtype)
            x = dft_rows[:, :half] @ x                                             # stage 1
            x = rounded(as_fp32(x) * twiddle, dtype)                               # stage 2
            x = rounded(as_fp32(x @ dft_cols) * filter_table[h], dtype)            # stages 3, 4
            x = x @ dft_cols.conj()                                                # stage 5
            x = rounded(as_fp32(x) * twiddle.conj() * (M1 / (2 * M2)), dtype)      # stage 6
            out = (dft_rows.conj()[:half, :] @ x).reshape(N) * (M2 / 2) + D[h].double() * z  # stage 7, + D u
            y[first, h] = out.real
            if first + 1 < B:
                y[first + 1, h] = out.imag
    return y


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("N", [256, 512, 1024, 2048, 4096, 8192, 16384])
def test_monarch_emulation_matches_the_reference(N, dtype):
    torch.manual_seed(N)
    B, H = 3, 2
    L = N if N % 4096 else N // 3 + 1
    u = torch.randn(B, H, N).to(dtype)
    k = torch.randn(H, L) / L**0.5
    D = torch.randn(H)
    want = _fftconv_reference(u.double(), k.double(), D.double())
    assert_rel_close(monarch_fftconv(u, k, D, dtype), want, EMULATION_TOLERANCE[dtype])


def test_scales_multiply_to_the_inverse_dft():
    for N in (256, 1024, 4096, 16384):
        M1, M2 = monarch_plan(N)
        assert M1 * M2 == 2 * N and M1 >= 32 and M2 % 16 == 0
        forward, filter_scale, inverse_twiddle, output = 2 / M1, 1 / M2, M1 / (2 * M2), M2 / 2
        # the inverse twiddle also undoes the forward scale folded into the shared twiddle table
        assert math.isclose(forward * filter_scale * (forward * inverse_twiddle) * output, 1 / (2 * N))
