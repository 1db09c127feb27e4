"""CPU emulation of the fftconv kernel's Monarch decomposition (csrc/kernels/fftconv/fftconv.cuh).

The same M1 x M2 factoring of the FFT of size 2N, the same stages, scales and conjugations, the
operands rounded to fp16/bf16 where the kernel rounds them (after stages 2, 4 and 6, the DFT
factors, the input), fp32 where it keeps fp32 (twiddles, the filter's spectrum), products in
float64 (standing in for fp32 accumulation): against the op's reference, for every N the kernel
takes, with an odd batch (one sequence without a partner). It pins the algebra the CUDA kernel
implements and the error budget of its 16-bit rounding points.

fp32 u (csrc/kernels/fftconv/precision.cuh): each of those operands is the fp32 value split into
bf16 hi = bf16(a) and lo = bf16(a - hi), and each tensor-core product keeps a_hi b_hi + a_hi b_lo +
a_lo b_hi (a_lo b_lo dropped), exactly as the kernel forms them.
"""

from __future__ import annotations

import math

import pytest
import torch

from tk_ops.ops.fftconv import _fftconv_bwd_reference, _fftconv_reference
from tk_testing import assert_rel_close

# fp32 u (split operands), B = 3, H = 2: forward and grad_u 3.3-5.5e-6, grad_k 7.3-9.1e-6, grad_D
# 3-10e-6 (the values hi + lo carry) at N = 256..16384, against the kernels' contract of 1e-4.
FP32_EMULATION_TOLERANCE = 2e-5

# The CPU emulation's errors against float64 (bf16: 1.5-2.5e-3, fp16: 1.5-3.2e-4 at B = 3, H = 2),
# with headroom; tests/test_fftconv.py's kernel budgets are 2e-2 and 5e-3.
EMULATION_TOLERANCE = {torch.bfloat16: 5e-3, torch.float16: 6e-4, torch.float32: FP32_EMULATION_TOLERANCE}
# The backward's (B = 3, H = 2, grad_y of size 1e-2): grad_u 1.6-2.9e-3 (bf16), 2-11e-4 (fp16); grad_k
# 4-5.2e-3 (bf16), 4.5-5.8e-4 (fp16): both spectra are rounded to 16 bits before their product.
BACKWARD_EMULATION_TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: FP32_EMULATION_TOLERANCE}
# The sequence lengths the kernels take per u dtype (fp32: the split tiles do not fit at 16384).
EMULATED_SEQ_LENS = {
    torch.bfloat16: [256, 512, 1024, 2048, 4096, 8192, 16384],
    torch.float16: [256, 512, 1024, 2048, 4096, 8192, 16384],
    torch.float32: [256, 512, 1024, 2048, 4096, 8192],
}


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


class Operand:
    """A tensor-core operand of the kernel for u of `dtype`: z rounded to fp16/bf16 (lo = 0), or for
    fp32 u the fp32 value of z split into bf16 hi + lo. Products keep hi hi + hi lo + lo hi."""

    def __init__(self, hi: torch.Tensor, lo: torch.Tensor):
        self.hi, self.lo = hi, lo

    @classmethod
    def of(cls, z: torch.Tensor, dtype: torch.dtype) -> "Operand":
        if dtype != torch.float32:
            hi = rounded(z, dtype)
            return cls(hi, torch.zeros_like(hi))
        z = as_fp32(z)
        hi = rounded(z, torch.bfloat16)
        return cls(hi, rounded(z - hi, torch.bfloat16))  # z - hi is exact in fp32 (and here)

    def __matmul__(self, other: "Operand") -> torch.Tensor:
        return self.hi @ other.hi + self.hi @ other.lo + self.lo @ other.hi

    def __getitem__(self, index) -> "Operand":
        return Operand(self.hi[index], self.lo[index])

    def conj(self) -> "Operand":
        return Operand(self.hi.conj(), self.lo.conj())

    def value(self) -> torch.Tensor:
        """hi + lo, as the kernel's elementwise steps take a split operand (in fp32)."""
        return as_fp32(self.hi + self.lo)


class MonarchStages:
    """The kernel's tables for N and its stages on one pair (a complex sequence), rounded as it rounds."""

    def __init__(self, N: int, dtype: torch.dtype):
        self.N, self.dtype = N, dtype
        self.M1, self.M2 = monarch_plan(N)
        r1, r2 = torch.arange(self.M1), torch.arange(self.M2)
        self.dft_rows = Operand.of(unit_roots(r1, r1, self.M1), dtype)  # F_M1, the stage 1 and 7 table
        self.dft_cols = Operand.of(unit_roots(r2, r2, self.M2), dtype)  # F_M2 in shared memory
        self.twiddle = as_fp32(unit_roots(r1, r2, 2 * N) * (2 / self.M1))
        self.spectrum_order = r1[:, None] + self.M1 * r2[None, :]  # X[k1 + M1 k2] at (k1, k2)

    def filter_table(self, k: torch.Tensor, conjugate: bool) -> torch.Tensor:
        """K / M2 (or conj(K) / M2) per head in the (k1, k2) order, from the op's fp32 rfft."""
        spectrum = torch.fft.rfft(k.float(), n=2 * self.N).to(torch.complex128)
        full = torch.cat([spectrum, spectrum[:, 1 : self.N].flip(-1).conj()], -1)  # Hermitian completion
        table = as_fp32(full[:, self.spectrum_order] / self.M2)
        return table.conj() if conjugate else table

    def operand(self, z: torch.Tensor) -> Operand:
        return Operand.of(z, self.dtype)

    def input(self, z: torch.Tensor) -> Operand:
        """The pair's input tile (rows n1 < M1/2), as the kernel loads it."""
        return self.operand(z.reshape(self.M1 // 2, self.M2))

    def spectrum_rows(self, z: torch.Tensor) -> torch.Tensor:
        """Stages 1-3 (fp32 result): the pair's spectrum times 2/M1, in the (k1, k2) order."""
        x = self.dft_rows[:, : self.M1 // 2] @ self.input(z)                        # stage 1
        x = self.operand(as_fp32(x) * self.twiddle)                                 # stage 2
        return as_fp32(x @ self.dft_cols)                                           # stage 3

    def inverse(self, x: Operand) -> torch.Tensor:
        """Stages 5-7 of a spectrum operand, before stage 7's scale: rows n1 < M1/2, flattened to t < N."""
        x = x @ self.dft_cols.conj()                                                # stage 5
        x = self.operand(as_fp32(x) * self.twiddle.conj() * (self.M1 / (2 * self.M2)))  # stage 6
        return (self.dft_rows.conj()[: self.M1 // 2, :] @ x).reshape(self.N)        # stage 7

    def pairs(self, x: torch.Tensor, h: int):
        """(first batch, complex sequence) of each pair of head h; a missing second sequence is zero."""
        B = x.shape[0]
        for first in range(0, B, 2):
            second = x[first + 1, h].double() if first + 1 < B else torch.zeros(self.N, dtype=torch.float64)
            yield first, torch.complex(x[first, h].double(), second)


def monarch_fftconv(u: torch.Tensor, k: torch.Tensor, D: torch.Tensor, dtype: torch.dtype, conjugate=False):
    """The convolution kernel: y with K (the forward), or with conj(K): grad_u for the input grad_y."""
    B, H, N = u.shape
    st = MonarchStages(N, dtype)
    filter_table = st.filter_table(k, conjugate)
    y = torch.empty(B, H, N, dtype=torch.float64)
    for h in range(H):
        for first, z in st.pairs(u, h):
            x = st.operand(st.spectrum_rows(z) * filter_table[h])                   # stage 4
            u_values = st.input(z).value().reshape(N)                               # D u from the input tile
            out = st.inverse(x) * (st.M2 / 2) + D[h].double() * u_values            # stage 7 scale, + D u
            y[first, h] = out.real
            if first + 1 < B:
                y[first + 1, h] = out.imag
    return y


def monarch_filter_gradient(grad: torch.Tensor, u: torch.Tensor, L: int, dtype: torch.dtype):
    """filter_gradient_kernel: per head, the fp32 sum over pairs of the 16-bit (or split) spectra's
    products, scaled by a power of two into [0.5, 1), inverted, its real part scaled back by M1 / 4
    (grad_k), and the fp32 sum of grad * u from the input tiles (grad_D)."""
    B, H, N = u.shape
    st = MonarchStages(N, dtype)
    grad_k = torch.empty(H, L, dtype=torch.float64)
    grad_D = torch.empty(H, dtype=torch.float64)
    for h in range(H):
        total, dot = 0, 0
        for (_, g), (_, z) in zip(st.pairs(grad, h), st.pairs(u, h)):
            g_spectrum = st.operand(st.spectrum_rows(g)).value()
            u_spectrum = st.operand(st.spectrum_rows(z)).value()
            total = as_fp32(total + g_spectrum * u_spectrum.conj())
            g_values, u_values = st.input(g).value(), st.input(z).value()
            dot += (g_values.real * u_values.real + g_values.imag * u_values.imag).sum()
        largest = max(total.real.abs().max().item(), total.imag.abs().max().item())
        exponent = math.frexp(largest)[1] if largest > 0 else 0
        x = st.operand(total * 2.0**-exponent)
        grad_k[h] = (st.inverse(x).real * (st.M1 / 4) * 2.0**exponent)[:L]
        grad_D[h] = dot
    return grad_k, grad_D


EMULATED_CASES = [(dtype, N) for dtype, seq_lens in EMULATED_SEQ_LENS.items() for N in seq_lens]


@pytest.mark.parametrize("dtype, N", EMULATED_CASES)
def test_monarch_emulation_matches_the_reference(N, dtype):
    torch.manual_seed(N)
    B, H = 3, 2
    L = N if N % 4096 else N // 3 + 1
    u = torch.randn(B, H, N).to(dtype)
    k = torch.randn(H, L) / L**0.5
    D = torch.randn(H)
    want = _fftconv_reference(u.double(), k.double(), D.double())
    assert_rel_close(monarch_fftconv(u, k, D, dtype), want, EMULATION_TOLERANCE[dtype])


@pytest.mark.parametrize("dtype, N", EMULATED_CASES)
def test_monarch_backward_emulation_matches_the_reference(N, dtype):
    """grad_u: the convolution kernel with conj(K) on grad_y; grad_k: the filter-gradient kernel's
    chain. grad_y of size 1e-2: the kernels keep 16-bit values on the scale of their inputs, and
    fp16 loses digits to subnormals below about 1e-3 (grad_u's error at N = 4096: 1.9e-4 at 1,
    4.5e-4 at 1e-2, 4.5e-3 at 1e-3; bf16 does not care)."""
    torch.manual_seed(N + 1)
    B, H = 3, 2
    L = N if N % 4096 else N // 3 + 1
    u = torch.randn(B, H, N).to(dtype)
    grad = (torch.randn(B, H, N) * 1e-2).to(dtype)
    k = torch.randn(H, L) / L**0.5
    D = torch.randn(H)
    want_u, want_k, want_D = _fftconv_bwd_reference(grad.double(), u.double(), k.double(), D.double())
    tol = BACKWARD_EMULATION_TOLERANCE[dtype]
    assert_rel_close(monarch_fftconv(grad, k, D, dtype, conjugate=True), want_u, tol, "grad_u")
    grad_k, grad_D = monarch_filter_gradient(grad, u, L, dtype)
    assert_rel_close(grad_k, want_k, tol, "grad_k")
    # 16-bit values are exact in the sum; split ones carry 2^-17 of each value
    assert_rel_close(grad_D, want_D, FP32_EMULATION_TOLERANCE if dtype == torch.float32 else 1e-6, "grad_D")


def test_scales_multiply_to_the_inverse_dft():
    for N in (256, 1024, 4096, 16384):
        M1, M2 = monarch_plan(N)
        assert M1 * M2 == 2 * N and M1 >= 32 and M2 % 16 == 0
        forward, filter_scale, inverse_twiddle, output = 2 / M1, 1 / M2, M1 / (2 * M2), M2 / 2
        # the inverse twiddle also undoes the forward scale folded into the shared twiddle table
        assert math.isclose(forward * filter_scale * (forward * inverse_twiddle) * output, 1 / (2 * N))
