"""tk_ops.fftconv against torch.fft (rfft of size 2N, multiply, irfft) eager and compiled, in the same run.

Shapes: the anchors' B = 16, H = 768, N = 256 / 1024 / 4096 and B = 4, H = 768, N = 16384, plus
N = 2048 (B = 16) and N = 8192 (B = 8); bf16 u (or fp32 u with --dtype fp32: the split-operand
kernels, N <= 8192; N = 16384 runs the reference there and is left out), fp32 filters k (L = N) and
D. The baseline is the convolution the op computes, written directly in torch.fft: y = irfft(rfft(u,
2N) rfft(k, 2N))[:N] + D u in fp32 (cuFFT takes no bf16), cast back to u's dtype; once eager, once
under torch.compile.
Forward, and forward + backward (the gradients of u, k and D for a given output gradient; our
backward runs its kernels: grad_u on the forward's kernel with conj(K), grad_k and grad_D on the
filter-gradient kernel). Each row also has the relative difference of the
baseline's forward output from ours.

HBM floor: the bytes that must cross HBM once (forward: u read, y written, k and D read; forward +
backward adds the output gradient and u read, grad_u written, k's and D's gradients written) over
the device-to-device copy bandwidth measured in this run. Rows: shape, pass, baseline, ours_ms,
baseline_ms, ratio (baseline_ms / ours_ms: above 1 we are faster), floor_ms, the fraction of the
floor each reaches. Writes benchmarks/results/fftconv.json and fftconv.png (fftconv_fp32.* for fp32
u; and into --out).

  python3 -m benchmarks.bench_fftconv [--out DIR] [--pass fwd|fwd+bwd] [--dtype bf16|fp32]
                                  benchmark (after the correctness sweep)
  python3 -m benchmarks.bench_fftconv --check
                                  only the correctness sweep: every kernel N, bf16/fp16/fp32, L = N or
                                  shorter, D on/off, odd B, strided u and grad, padded N, the
                                  forward and the backward (grad_u, grad_k, grad_D) against float64
                                  FFTs; exits non-zero on a failure
  python3 -m benchmarks.bench_fftconv --dry-run [--out DIR]
                                  CPU, tiny shapes, nothing timed: builds and prints the rows
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import pathlib
from typing import Callable, Optional

import torch

import tk_ops
from benchmarks import common

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}  # of u (--dtype)
PARAM_DTYPE = torch.float32
PASSES = ("fwd", "fwd+bwd")
BASELINES = ("torch.fft eager", "torch.fft compiled")


@dataclasses.dataclass(frozen=True)
class Shape:
    batch: int
    heads: int
    seq_len: int

    @property
    def label(self) -> str:
        return f"B={self.batch} H={self.heads} N={self.seq_len}"

    def hbm_bytes(self, pass_: str, element: int) -> int:
        """u read and y written once, k and D (fp32) read; forward + backward adds grad_out and u read,
        grad_u written, and k's and D's gradients written."""
        sequence = self.batch * self.heads * self.seq_len * element
        parameters = self.heads * (self.seq_len + 1) * PARAM_DTYPE.itemsize
        forward = 2 * sequence + parameters
        return forward if pass_ == "fwd" else forward + 3 * sequence + parameters


SHAPES = (Shape(16, 768, 256), Shape(16, 768, 1024), Shape(16, 768, 2048), Shape(16, 768, 4096),
          Shape(8, 768, 8192), Shape(4, 768, 16384))
DRY_RUN_SHAPES = (Shape(2, 3, 256), Shape(3, 2, 1024))
FP32_KERNEL_MAX_SEQ_LEN = 8192  # fp32 u: the split-operand kernels' longest N


def shapes_for(dtype: torch.dtype) -> tuple[Shape, ...]:
    """The timed shapes for u of `dtype`: those its kernels take."""
    return tuple(s for s in SHAPES if dtype != torch.float32 or s.seq_len <= FP32_KERNEL_MAX_SEQ_LEN)


def results_name(dtype: torch.dtype) -> str:
    return "fftconv" if dtype == torch.bfloat16 else "fftconv_fp32"


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


def baselines() -> dict[str, Callable]:
    return {"torch.fft eager": torch_fft, "torch.fft compiled": torch.compile(torch_fft)}


def input_set(shape: Shape, device, backward: bool, dtype: torch.dtype = torch.bfloat16) -> tuple:
    """(u, k, D, grad_out): u ~ N(0, 1) in `dtype`, k ~ N(0, 1/L) and D in fp32, L = N."""
    u = torch.randn(shape.batch, shape.heads, shape.seq_len, device=device).to(dtype)
    k = torch.randn(shape.heads, shape.seq_len, device=device) / math.sqrt(shape.seq_len)
    D = torch.randn(shape.heads, device=device)
    grad_out = torch.randn_like(u)
    for t in (u, k, D):
        t.requires_grad_(backward)
    return u, k, D, grad_out


def step(fn: Callable, backward: bool) -> Callable:
    def run(u, k, D, grad_out):
        out = fn(u, k, D)
        if backward:
            torch.autograd.grad(out, (u, k, D), grad_out)

    return run


def measure(shape: Shape, device, timer: Callable, copy_gbps: Optional[float], passes=PASSES,
            dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """The rows of one shape: per pass, ours against each baseline (ours timed once per pass)."""
    torch._dynamo.reset()  # each shape compiles afresh: past 8 recompiles dynamo silently ran eager
    functions = baselines()
    first = input_set(shape, device, backward=False, dtype=dtype)
    rel_diffs, errors = {}, {}
    with torch.no_grad():
        ours_out = ours(*first[:3])
        for name, fn in functions.items():
            try:
                rel_diffs[name] = common.relative_difference(fn(*first[:3]), ours_out)
            except Exception as error:  # a baseline that cannot run is reported, not fatal
                errors[name] = common.describe_error(error)
    del first, ours_out
    rows = []
    for pass_ in passes:
        backward = pass_ == "fwd+bwd"
        bytes_per_set = shape.hbm_bytes(pass_, dtype.itemsize)
        sets = [input_set(shape, device, backward, dtype) for _ in range(common.input_set_count(bytes_per_set, device))]
        ours_ms = timer(step(ours, backward), sets)
        for name, fn in functions.items():
            baseline_ms, error = None, errors.get(name)
            if error is None:
                try:
                    baseline_ms = timer(step(fn, backward), sets)
                except Exception as failure:
                    error = common.describe_error(failure)
            rows.append(common.floor_row(shape, pass_, name, ours_ms, baseline_ms, copy_gbps, dtype.itemsize,
                                         rel_diffs.get(name), error))
        del sets
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def plot(rows: list[dict], path: pathlib.Path, device_name: str, dtype_name: str = "bf16") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    passes = [pass_ for pass_ in PASSES if any(row["pass"] == pass_ for row in rows)]
    fig, axes = plt.subplots(1, len(passes), figsize=(8 * len(passes), 4.8), squeeze=False)
    colors = {"tk_ops": "tab:red", BASELINES[0]: "tab:blue", BASELINES[1]: "tab:green"}
    for c, pass_ in enumerate(passes):
        common.floor_bar_panel(axes[0][c], [row for row in rows if row["pass"] == pass_], ("tk_ops", *BASELINES),
                               colors, f"FFT convolution, {pass_}")
    fig.suptitle(f"FFT long convolution on {device_name}: tk_ops vs torch.fft ({dtype_name} u; lower is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


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


def parse_args(argv=None) -> argparse.Namespace:
    parser = common.sweep_arguments(__doc__, PASSES)
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bf16", help="u's dtype in the timed sweep")
    return parser.parse_args(argv)


ROW_WIDTHS = (22, 20)  # printed columns: shape, baseline


def dry_run(args: argparse.Namespace) -> list[dict]:
    dtype = DTYPES[args.dtype]
    rows = [row for shape in DRY_RUN_SHAPES for row in measure(shape, "cpu", common.run_once, None, dtype=dtype)]
    return common.finish_dry_run(results_name(dtype), rows, ROW_WIDTHS, args.out,
                                 lambda *a: plot(*a, dtype_name=args.dtype))


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.manual_seed(0)
    if args.dry_run:
        dry_run(args)
        return
    run_check("cuda")
    if args.check:
        return
    copy, ceiling = common.measured_copy_ceiling()
    passes = tuple(args.passes or PASSES)
    dtype = DTYPES[args.dtype]
    common.sweep_shapes(results_name(dtype), shapes_for(dtype),
                        lambda shape: measure(shape, "cuda", common.time_ms, copy, passes, dtype),
                        ROW_WIDTHS, args.out, lambda *a: plot(*a, dtype_name=args.dtype), **ceiling,
                        dtype=f"{args.dtype} u, fp32 k and D",
                        ours_backends={op: tk_ops.backends()[op] for op in ("fftconv", "fftconv_bwd")})


if __name__ == "__main__":
    main()
