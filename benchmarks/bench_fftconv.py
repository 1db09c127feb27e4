"""tk_ops.fftconv against torch.fft (rfft of size 2N, multiply, irfft) eager and compiled, in the same run.

Shapes: the fftconv family's targets B = 16, H = 768, N = 256 / 1024 / 4096 and B = 4, H = 768, N = 16384, plus
N = 2048 (B = 16) and N = 8192 (B = 8); bf16 u (or fp32 u with --dtype fp32: the split-operand
kernels, N <= 8192; N = 16384 runs the reference there and is left out), fp32 filters k (L = N) and
D. The baseline is the convolution the op computes, written directly in torch.fft: y = irfft(rfft(u,
2N) rfft(k, 2N))[:N] + D u in fp32 (cuFFT takes no bf16), cast back to u's dtype; once eager, once
under torch.compile.
Forward, and forward + backward (the gradients of u, k and D for a given output gradient; our
backward runs its kernels: grad_u on the forward's kernel with conj(K), grad_k and grad_D on the
filter-gradient kernel). Each row also has the relative difference of ours from the baseline
(the output, and for fwd+bwd the gradients).

HBM floor: the bytes that must cross HBM once (forward: u read, y written, k and D read; forward +
backward adds the output gradient and u read, grad_u written, k's and D's gradients written) over
the device-to-device copy bandwidth measured in this run. Rows: benchmarks/common.py's schema
(ratio = baseline_ms / ours_ms: above 1 we are faster; floor_ms and the fraction of it each side
reaches). Writes benchmarks/results/fftconv.json and fftconv.png (fftconv_fp32.* for fp32
u; and into --out).

  python3 -m benchmarks.bench_fftconv [--out DIR] [--pass fwd|fwd+bwd] [--dtype bf16|fp32]
                                  benchmark (after the correctness sweep)
  python3 -m benchmarks.bench_fftconv --check
                                  only the correctness sweep: every kernel N, bf16/fp16/fp32, L = N or
                                  shorter, D on/off, odd B, strided u and grad, padded N, the
                                  forward and the backward (grad_u, grad_k, grad_D) against float64
                                  FFTs; exits non-zero on a failure
  python3 -m benchmarks.bench_fftconv --dry-run [--out DIR]
                                  CPU, tiny shapes, nothing timed: builds and prints the rows (the JSON
                                  and plot into --out)
"""

from __future__ import annotations

import dataclasses
import math

import torch

import tk_ops
from benchmarks import common

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}  # of u (--dtype)
PARAM_DTYPE = torch.float32
PASSES = ("fwd", "fwd+bwd")


@dataclasses.dataclass(frozen=True)
class Shape:
    batch: int
    heads: int
    seq_len: int
    dtype: str = "bf16"  # u's (--dtype)

    @property
    def label(self) -> str:
        return f"B={self.batch} H={self.heads} N={self.seq_len}"

    def hbm_bytes(self, pass_: str) -> int:
        """u read and y written once, k and D (fp32) read; forward + backward adds grad_out and u read,
        grad_u written, and k's and D's gradients written."""
        sequence = self.batch * self.heads * self.seq_len * DTYPES[self.dtype].itemsize
        parameters = self.heads * (self.seq_len + 1) * PARAM_DTYPE.itemsize
        forward = 2 * sequence + parameters
        return forward if pass_ == "fwd" else forward + 3 * sequence + parameters


SHAPES = (Shape(16, 768, 256), Shape(16, 768, 1024), Shape(16, 768, 2048), Shape(16, 768, 4096),
          Shape(8, 768, 8192), Shape(4, 768, 16384))
DRY_RUN_SHAPES = (Shape(2, 3, 256), Shape(3, 2, 1024))
FP32_KERNEL_MAX_SEQ_LEN = 8192  # fp32 u: the split-operand kernels' longest N


def shapes_for(dtype: str, shapes: tuple[Shape, ...] = SHAPES) -> tuple[Shape, ...]:
    """The shapes for u of `dtype` (bf16 or fp32): those its kernels take."""
    return tuple(dataclasses.replace(s, dtype=dtype) for s in shapes
                 if dtype != "fp32" or s.seq_len <= FP32_KERNEL_MAX_SEQ_LEN)


# ---------------------------------------------------------------------------------- the callables


def ours(u, k, D):
    return tk_ops.fftconv(u, k, D=D)


def ours_backward(grad, u, k, D):
    """grad_u, grad_k, grad_D of tk.fftconv (the op the autograd of ours calls)."""
    return torch.ops.tk.fftconv_bwd.default(grad, u, k, D)


def torch_fft(u, k, D):
    """The same convolution in torch.fft, fp32 inside (cuFFT has no bf16 transforms)."""
    n = u.shape[-1]
    u32 = u.float()
    y = torch.fft.irfft(torch.fft.rfft(u32, n=2 * n) * torch.fft.rfft(k.float(), n=2 * n), n=2 * n)[..., :n]
    return (y + D.float()[:, None] * u32).to(u.dtype)


def input_set(shape: Shape, device, backward: bool, dtype: torch.dtype = torch.bfloat16) -> tuple:
    """(u, k, D, grad_out): u ~ N(0, 1) in `dtype`, k ~ N(0, 1/L) and D in fp32, L = N."""
    u = torch.randn(shape.batch, shape.heads, shape.seq_len, device=device).to(dtype)
    k = torch.randn(shape.heads, shape.seq_len, device=device) / math.sqrt(shape.seq_len)
    D = torch.randn(shape.heads, device=device)
    grad_out = torch.randn_like(u)
    for t in (u, k, D):
        t.requires_grad_(backward)
    return u, k, D, grad_out


def bench(dtype: str) -> common.Bench:
    """fftconv.json for bf16 u, fftconv_fp32.json for fp32 u (whose outputs agree to ~1e-5)."""
    return common.Bench(
        "fftconv" if dtype == "bf16" else "fftconv_fp32", f"FFT long convolution: tk_ops vs torch.fft ({dtype} u)",
        ours=common.stepped("tk_ops", ours),
        baselines=(common.stepped("torch.fft eager", torch_fft), common.stepped("torch.fft compiled", torch.compile(torch_fft))),
        inputs=lambda shape, pass_, device: input_set(shape, device, pass_ == "fwd+bwd", DTYPES[shape.dtype]),
        passes=PASSES, tolerance=5e-2 if dtype == "bf16" else 1e-3)


# ---------------------------------------------------------------------------------- correctness

# fp32: the split operands' contract (the CPU emulation gives 3-9e-6, tests/test_fftconv_monarch.py)
CHECK_TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-4}
# (B, H, N, L, with_D, strided): every kernel N, L = N and shorter, odd B, padded N, strided u (for
# fp32 u, N = 16384 runs the reference)
CHECK_SHAPES = (
    (2, 3, 256, 256, True, False), (3, 2, 512, 100, False, False), (1, 3, 1024, 1024, True, True),
    (2, 2, 2048, 777, True, False), (3, 3, 4096, 4096, False, True), (2, 2, 8192, 3000, True, False),
    (2, 2, 16384, 16384, True, False), (2, 3, 1000, 600, True, True), (3, 2, 37, 5, False, False),
)


def float64_reference(u, k, D):
    """The convolution of the same (rounded) values in float64, through an exact-size FFT."""
    n = u.shape[-1]
    u64 = u.double()
    y = torch.fft.irfft(torch.fft.rfft(u64, n=2 * n) * torch.fft.rfft(k.double(), n=2 * n), n=2 * n)[..., :n]
    return y if D is None else y + D.double()[:, None] * u64


def float64_backward(grad, u, k, D):
    """grad_u, grad_k, grad_D of the same (rounded) values in float64: correlations through an exact-size FFT."""
    n, filter_len = u.shape[-1], k.shape[-1]
    g64, u64 = grad.double(), u.double()
    g_f = torch.fft.rfft(g64, n=2 * n)
    grad_u = torch.fft.irfft(g_f * torch.fft.rfft(k.double(), n=2 * n).conj(), n=2 * n)[..., :n]
    grad_k = torch.fft.irfft((g_f * torch.fft.rfft(u64, n=2 * n).conj()).sum(0), n=2 * n)[..., :filter_len]
    if D is None:
        return grad_u, grad_k, None
    return grad_u + D.double()[:, None] * g64, grad_k, (g64 * u64).sum((0, 2))


def run_check(device) -> None:
    """The forward (tk.fftconv) and the backward (tk.fftconv_bwd: grad_u, grad_k, grad_D) of every case."""
    failures = []
    cases = 0
    for b, h, n, filter_len, with_D, strided in CHECK_SHAPES:
        for dtype, tolerance in CHECK_TOLERANCE.items():
            cases += 1
            label = f"B={b} H={h} N={n} L={filter_len} D={with_D} strided={strided} {str(dtype)[6:]}"
            values = torch.randn(2, h, b, n, device=device).to(dtype)
            u, grad = (v.transpose(0, 1) if strided else v.transpose(0, 1).contiguous() for v in values)
            k = torch.randn(h, filter_len, device=device) / math.sqrt(filter_len)
            D = torch.randn(h, device=device) if with_D else None
            out = tk_ops.fftconv(u, k, D=D)
            error = common.relative_difference(out, float64_reference(u, k, D))
            if not error <= tolerance or out.dtype != dtype or out.shape != u.shape:
                failures.append(f"{label} forward: rel err {error:.2e} (tol {tolerance:.0e}), {out.dtype} {tuple(out.shape)}")
            grads = ours_backward(grad, u, k, D)
            for name, got, want, like in zip(("grad_u", "grad_k", "grad_D"), grads, float64_backward(grad, u, k, D),
                                             (u, k, D)):
                if like is None:
                    continue
                error = common.relative_difference(got, want)
                if not error <= tolerance or got.dtype != like.dtype or got.shape != like.shape:
                    failures.append(f"{label} {name}: rel err {error:.2e} (tol {tolerance:.0e}), {got.dtype} "
                                    f"{tuple(got.shape)}")
    backends = {op: tk_ops.backends()[op] for op in ("fftconv", "fftconv_bwd")}
    common.finish_check(f"correctness sweep on {device} (forward and backward; {backends}): {cases} cases", failures)


# ------------------------------------------------------------------------------------------ main


def main(argv=None) -> None:
    parser = common.arguments(__doc__, PASSES)
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bf16", help="u's dtype in the timed sweep")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    if common.without_gpu(args, bench(args.dtype), shapes_for(args.dtype, DRY_RUN_SHAPES)):
        return
    run_check("cuda")
    if args.check:
        return
    common.run(bench(args.dtype), shapes_for(args.dtype), passes=args.passes, out=args.out,
               copy_gbps=common.measured_copy_bandwidth(),
               dtype=f"{args.dtype} u, fp32 k and D",
               ours_backends={op: tk_ops.backends()[op] for op in ("fftconv", "fftconv_bwd")})


if __name__ == "__main__":
    main()
