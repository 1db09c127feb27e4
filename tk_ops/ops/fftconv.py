"""Long causal convolution through the FFT (Hyena / H3 style): ``tk.fftconv(u, k, D)``.

    y[b, h, t] = sum_{s=0..min(t, L-1)} k[h, s] * u[b, h, t - s]  (+ D[h] * u[b, h, t])

for u (B, H, N), k (H, L) with 1 <= L <= N, D (H,) optional.

Forward op
  tk::fftconv(Tensor u, Tensor k, Tensor? D) -> Tensor                          y (B, H, N)
Backward op
  tk::fftconv_bwd(Tensor grad, Tensor u, Tensor k, Tensor? D) -> (Tensor grad_u, Tensor grad_k, Tensor grad_D)
      grad_u[b, h, t] = sum_s k[h, s] * grad[b, h, t + s] + D[h] * grad[b, h, t]   (anti-causal correlation)
      grad_k[h, s]    = sum_{b, t} grad[b, h, t] * u[b, h, t - s]                  (s < L)
      grad_D[h]       = sum_{b, t} grad[b, h, t] * u[b, h, t]
  grad_u has u's dtype and shape, grad_k k's, grad_D D's; grad_D is empty when D is None.

Dtypes: u is fp16, bf16, fp32 or fp64; k and D each have u's dtype, or fp32 when u is fp16/bf16
(filters kept in fp32, as FlashFFTConv takes them). The output has u's dtype. Arithmetic is fp32
(fp64 for fp64 inputs).

Kernels (csrc/kernels/fftconv), forward and backward: fp16/bf16 u with N zero-padded at the end to a
power of two from 256 to 16384, fp32 u up to 8192 (exact: the convolution is causal). The FFT of
size 2N runs as Monarch factors on tensor cores (mma.sync, fp16/bf16 operands, fp32 accumulation;
two sequences of a head per complex pass); the filter's spectrum comes from an fp32 rfft once per
call.
  forward   the spectrum of u times the filter's, inverted, + D u
  grad_u    the same kernel on grad with the conjugate filter spectrum (the correlation), + D grad
  grad_k    per head, sum over the batch of spectrum(grad) * conj(spectrum(u)) in fp32 (one block
            owns a head: a fixed order, no atomics), scaled by a power of two into [0.5, 1), one
            inverse per head; returned in fp32, cast to k's dtype
  grad_D    the fp32 sum of grad * u in the same kernel, cast to D's dtype
The kernels keep their 16-bit intermediates on the scale of their inputs, so fp16 inputs of small
size lose digits to subnormals (bf16 does not): in the CPU emulation of the kernels at N = 4096,
grad_u's error is 1.9e-4 for grad of size 1, 4.5e-4 at 1e-2, 4.5e-3 at 1e-3.
fp32 u (and grad) at fp32-level accuracy: every tensor-core operand a is carried as two bf16 parts,
a_hi = bf16(a) and a_lo = bf16(a - a_hi) (about 16 significant bits, fp32's range), and each product
as a_hi b_hi + a_hi b_lo + a_lo b_hi with fp32 accumulation (the dropped a_lo b_lo is below 2^-18 of
it): the DFT factors (hi and lo tables), u (split as it is loaded), the stage-2/4 intermediates (split
from the fp32 accumulators) and the tile stage 7 reads (split as it is stored). Twiddles, the filter
spectrum and the spectra's products stay fp32; y, grad_u, grad_k and grad_D come out in fp32. Three
mma.sync per product instead of one, twice the shared memory: at N = 16384 the tiles exceed a block's
227 KB, so fp32 u runs the kernels for N <= 8192. Error against float64 in the CPU emulation of these
exact steps: 3-6e-6 (y, grad_u), 7-9e-6 (grad_k), up to 1e-5 (grad_D, from u and grad as hi + lo);
the budget is 1e-4. fp64 u, fp32 u with N > 8192 and N > 16384 run the reference (on a GPU, each
op warns once).
The reference uses the smallest FFT size of the form 2^a 3^b 5^c that is >= N + L - 1, the least
padding with which no output of the circular convolution wraps around (2N when L == N is a power
of two).
"""

from __future__ import annotations

from typing import Optional

import torch

from tk_ops import _checks, _library

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _fft_size(min_size: int) -> int:
    """Smallest 2^a 3^b 5^c >= min_size: the sizes pocketfft (CPU) and cuFFT transform fastest."""
    best = 1 << (min_size - 1).bit_length()
    power_of_5 = 1
    while power_of_5 < best:
        odd_factor = power_of_5
        while odd_factor < best:
            power_of_2 = 1 << (-(-min_size // odd_factor) - 1).bit_length()
            best = min(best, odd_factor * power_of_2)
            odd_factor *= 3
        power_of_5 *= 5
    return best



# ----------------------------------------------------------------------------------- reference


def _fftconv_reference(u: torch.Tensor, k: torch.Tensor, D: Optional[torch.Tensor]) -> torch.Tensor:
    seq_len, filter_len = u.shape[-1], k.shape[-1]
    n_fft = _fft_size(seq_len + filter_len - 1)
    u_c = u.to(_checks.compute_dtype(u.dtype))
    u_f = torch.fft.rfft(u_c, n=n_fft)
    k_f = torch.fft.rfft(k.to(u_c.dtype), n=n_fft)
    y = torch.fft.irfft(u_f * k_f, n=n_fft)[..., :seq_len]
    if D is not None:
        y = y + D.to(u_c.dtype)[:, None] * u_c
    return y.to(u.dtype).contiguous()


def _fftconv_fake(u, k, D):
    return u.new_empty(u.shape)


def _fftconv_bwd_reference(grad, u, k, D):
    seq_len, filter_len = u.shape[-1], k.shape[-1]
    n_fft = _fft_size(seq_len + filter_len - 1)
    compute_dtype = _checks.compute_dtype(u.dtype)
    grad_c, u_c = grad.to(compute_dtype), u.to(compute_dtype)
    grad_f = torch.fft.rfft(grad_c, n=n_fft)
    u_f = torch.fft.rfft(u_c, n=n_fft)
    k_f = torch.fft.rfft(k.to(compute_dtype), n=n_fft)
    # Correlations are products with a conjugate; n_fft >= N + L - 1 keeps them from wrapping.
    # conj_physical, not the lazy conj view: the first call of an AOTAutograd-compiled graph
    # drops the conjugate bit inside this op (measured, torch 2.13) and returns a convolution.
    grad_u = torch.fft.irfft(grad_f * torch.conj_physical(k_f), n=n_fft)[..., :seq_len]
    # Summing over the batch in the frequency domain saves B - 1 inverse transforms.
    grad_k = torch.fft.irfft((grad_f * torch.conj_physical(u_f)).sum(0), n=n_fft)[..., :filter_len]
    if D is None:
        grad_D = u.new_empty(0)
    else:
        grad_u = grad_u + D.to(compute_dtype)[:, None] * grad_c
        grad_D = (grad_c * u_c).sum((0, 2)).to(D.dtype)
    return grad_u.to(u.dtype).contiguous(), grad_k.to(k.dtype).contiguous(), grad_D


def _fftconv_bwd_fake(grad, u, k, D):
    grad_D = u.new_empty(0) if D is None else D.new_empty(D.shape)
    return u.new_empty(u.shape), k.new_empty(k.shape), grad_D


fftconv_op = _library.define(
    "fftconv", "(Tensor u, Tensor k, Tensor? D) -> Tensor", reference=_fftconv_reference, fake=_fftconv_fake
)
fftconv_bwd_op = _library.define(
    "fftconv_bwd",
    "(Tensor grad, Tensor u, Tensor k, Tensor? D) -> (Tensor grad_u, Tensor grad_k, Tensor grad_D)",
    reference=_fftconv_bwd_reference,
    fake=_fftconv_bwd_fake,
)


# ------------------------------------------------------------------------------------ autograd


_library.register_derivatives(fftconv_op, "fftconv_bwd(grad, u, k, D) -> u, k, D", layout=_checks.unit_last_stride)


# ----------------------------------------------------------------------------------- public API


def _check_parameter_dtype(name: str, t: Optional[torch.Tensor], u: torch.Tensor) -> None:
    if t is None:
        return
    allowed = (u.dtype, torch.float32) if u.dtype in _LOW_PRECISION else (u.dtype,)
    if t.dtype not in allowed:
        names = " or ".join(str(d).replace("torch.", "") for d in allowed)
        raise TypeError(f"{name} must have dtype {names} (u is {u.dtype}), got {t.dtype}")


def fftconv(u: torch.Tensor, k: torch.Tensor, *, D: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal long convolution of u (B, H, N) with per-head filters k (H, L), L <= N, plus D (H,) * u.

    ``y[b, h, t] = sum_{s <= min(t, L - 1)} k[h, s] * u[b, h, t - s] + D[h] * u[b, h, t]``.
    k and D have u's dtype, or fp32 when u is fp16/bf16; the output has u's dtype.
    """
    _checks.check_tensor("u", u, ndim=3)
    _checks.check_tensor("k", k, ndim=2)
    _checks.check_optional("D", D, ndim=1)
    _checks.check_same_device(u=u, k=k, D=D)
    _check_parameter_dtype("k", k, u)
    _check_parameter_dtype("D", D, u)
    _checks.check_dim("k", k, 0, u.shape[1], "u.shape[1] (H)")
    if k.shape[1] > u.shape[2]:
        raise ValueError(
            f"k.shape[1] (the filter length L) must be at most u.shape[2] (N = {u.shape[2]}), "
            f"got k of shape {tuple(k.shape)}"
        )
    if D is not None:
        _checks.check_dim("D", D, 0, u.shape[1], "u.shape[1] (H)")
    return fftconv_op(_checks.unit_last_stride(u), _checks.unit_last_stride(k), _checks.unit_last_stride(D))
