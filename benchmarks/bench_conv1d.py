"""tk_ops.causal_conv1d against F.conv1d(padding=W - 1)[..., :L] + SiLU, eager and torch.compile, in the same run.

Shapes: a Mamba-2 layer's short convolution, B = 8, D = 4096 + 2 * 128 = 4352 (the x channels plus
the B and C channels of d_state 128, one group), L = 2048 and 4096, W = 4, bias, SiLU, bf16; x
contiguous (B, D, L), and at L = 4096 also as a mixer has it, a (B, L, D) tensor seen as (B, D, L)
(every implementation gets the same view). Forward, and forward + backward (the gradients of x,
weight and bias for a given output gradient, in x's layout as a mixer's would be).

Baselines (the causal_conv1d package's own reference form):
  eager     F.silu(F.conv1d(x, weight.unsqueeze(1), bias, padding=W - 1, groups=D)[..., :L])
  compiled  the same under torch.compile(fullgraph=True, dynamic=False)
Each row also has the relative difference of ours from the baseline (output, and for fwd+bwd the
gradients).

HBM floor: the bytes that must cross HBM once (forward: x read and out written, plus weight and
bias; forward + backward adds x and the output gradient read and grad_x written: with SiLU the
backward recomputes the pre-activation from x) over the device-to-device copy bandwidth measured in
this run. Rows: benchmarks/common.py's schema (ratio = baseline_ms / ours_ms: above 1 we are faster,
floor_ms and the fraction of it each side reaches). Writes benchmarks/results/conv1d.json and
conv1d.png (and into --out).
"ours" is the CUDA kernel where tk_ops._C is built for the GPU, the PyTorch reference otherwise
(``tk_ops.backends()`` says which; the header records it).

  python3 -m benchmarks.bench_conv1d [--out DIR] [--pass fwd|fwd+bwd]
                                  benchmark (after the correctness sweep)
  python3 -m benchmarks.bench_conv1d --check
                                  only the correctness sweep, every kernel path on small shapes: both
                                  layouts at each W in {2, 3, 4}, with 16-byte (channel-first) or
                                  4-byte (channel-last) vectors and element by element, a vector cut
                                  by a row's end, several segments; bias and SiLU on and off;
                                  bf16/fp16 with 16-bit or fp32 parameters and fp32; L = 1, W > L,
                                  W = 1 (the reference). Forward and gradients against float64
                                  F.conv1d, and on a GPU with the kernels, no fallback where they
                                  should run; exits non-zero on a failure
  python3 -m benchmarks.bench_conv1d --dry-run [--out DIR]
                                  CPU, tiny shapes, nothing timed: runs every implementation once
                                  and builds and prints the rows (the JSON and plot into --out)
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings

import torch
import torch.nn.functional as F

import tk_ops
from benchmarks import common
from tk_ops import _library

DTYPE = torch.bfloat16
PASSES = ("fwd", "fwd+bwd")
ACTIVATION = "silu"


@dataclasses.dataclass(frozen=True)
class Shape:
    batch: int
    dim: int
    seq_len: int
    width: int
    # "bdl": contiguous (B, D, L); "bld": (B, L, D) storage seen as (B, D, L); "bdl-padded": the
    # first L of rows padded to a multiple of 8 elements (aligned rows, odd L: a vector cut by the end)
    layout: str

    @property
    def label(self) -> str:
        return f"B={self.batch} D={self.dim} L={self.seq_len} W={self.width} {self.layout}"

    def hbm_bytes(self, pass_: str) -> int:
        """x read and out written once, weight and bias read; forward + backward adds x and grad_out
        read and grad_x written (grad_weight and grad_bias are D (W + 1) elements)."""
        activations = self.batch * self.dim * self.seq_len
        parameters = self.dim * (self.width + 1)
        forward = 2 * activations + parameters
        return DTYPE.itemsize * (forward if pass_ == "fwd" else forward + 3 * activations + parameters)


MAMBA2_DIM = 4096 + 2 * 128
SHAPES = (
    Shape(8, MAMBA2_DIM, 2048, 4, "bdl"),
    Shape(8, MAMBA2_DIM, 4096, 4, "bdl"),
    Shape(8, MAMBA2_DIM, 4096, 4, "bld"),
)
# --dry-run: both layouts at sizes a CPU runs in a moment.
DRY_RUN_SHAPES = (Shape(2, 24, 33, 4, "bdl"), Shape(2, 24, 33, 4, "bld"))


# ------------------------------------------------------------------------------ providers and inputs


def ours(x, weight, bias):
    return tk_ops.causal_conv1d(x, weight, bias, activation=ACTIVATION)


def conv1d_silu(x, weight, bias):
    """causal_conv1d's reference form."""
    out = F.conv1d(x, weight.unsqueeze(1), bias, padding=weight.shape[1] - 1, groups=weight.shape[0])
    return F.silu(out[..., : x.shape[-1]])


ROW_ALIGNMENT = 8  # elements of a "bdl-padded" row: 16 bytes of bf16/fp16


def activation(shape: Shape, device, dtype) -> torch.Tensor:
    """A (B, D, L) tensor ~ N(0, 1) in the shape's layout."""
    b, d, n = shape.batch, shape.dim, shape.seq_len
    if shape.layout == "bld":
        return torch.randn(b, n, d, device=device, dtype=dtype).transpose(1, 2)
    if shape.layout == "bdl-padded":
        return torch.randn(b, d, -(-n // ROW_ALIGNMENT) * ROW_ALIGNMENT + ROW_ALIGNMENT, device=device, dtype=dtype)[..., :n]
    return torch.randn(b, d, n, device=device, dtype=dtype)


def input_set(shape: Shape, device, dtype, backward: bool) -> tuple:
    """(x, weight, bias, grad_out): x and grad_out in the shape's layout, taps scaled by W**-0.5."""
    x = activation(shape, device, dtype)
    weight = (torch.randn(shape.dim, shape.width, device=device) / shape.width**0.5).to(dtype)
    bias = torch.randn(shape.dim, device=device).to(dtype)
    grad_out = activation(shape, device, dtype)
    for t in (x, weight, bias):
        t.requires_grad_(backward)
    return x, weight, bias, grad_out


BENCH = common.Bench(
    "conv1d", "Causal conv1d: tk_ops vs F.conv1d + SiLU (bf16)",
    ours=common.stepped("tk_ops", ours),
    baselines=(common.stepped("eager", conv1d_silu),
               common.stepped("compiled", torch.compile(conv1d_silu, fullgraph=True, dynamic=False))),
    inputs=lambda shape, pass_, device: input_set(shape, device, DTYPE, pass_ == "fwd+bwd"),
    passes=PASSES,
)


# ---------------------------------------------------------------------------------- correctness

# (B, D, L, W, layout): at each W in {2, 3, 4}, both layouts with vectors (channel-first: L a
# multiple of the vector; channel-last: D even) and element by element (odd L or D), a vector cut by
# a row's end (bdl-padded), several 1024-position segments (L > 2048); L = 1; W > L; W = 1 (reference)
CHECK_SHAPES = (
    (2, 40, 1, 4, "bdl"), (2, 40, 17, 4, "bld"), (1, 264, 1000, 4, "bdl"), (2, 24, 2501, 4, "bdl"),
    (2, 37, 50, 4, "bld"), (2, 16, 3, 4, "bld"),
    (3, 72, 333, 3, "bld"), (2, 24, 333, 3, "bdl"), (2, 40, 512, 3, "bdl"), (2, 24, 2065, 3, "bdl-padded"),
    (2, 37, 50, 3, "bld"),
    (2, 48, 1024, 2, "bdl"), (2, 48, 129, 2, "bdl"), (2, 48, 129, 2, "bld"), (2, 37, 50, 2, "bld"),
    (2, 24, 77, 1, "bdl"),
)
KERNEL_WIDTHS = (2, 3, 4)
CHECK_DTYPES = {  # (x dtype, parameter dtype) -> forward tolerance; gradients 2x
    (torch.bfloat16, torch.bfloat16): 1e-2, (torch.bfloat16, torch.float32): 1e-2,
    (torch.float16, torch.float16): 5e-3, (torch.float16, torch.float32): 5e-3,
    (torch.float32, torch.float32): 1e-5,
}
REFERENCE_WARNING = "running the PyTorch reference path"


@contextlib.contextmanager
def fallbacks_seen():
    """The tk ops that ran their reference inside (each warns on a GPU; earlier warnings are forgotten)."""
    for op in ("causal_conv1d", "causal_conv1d_bwd"):
        _library._REFERENCE_WARNED.discard(op)
    seen: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield seen
    seen += [str(w.message) for w in caught if REFERENCE_WARNING in str(w.message)]


def run_check(device) -> None:
    failures, cases = [], 0
    on_kernel = device == "cuda" and tk_ops.backends()["causal_conv1d"] == "cuda kernel"
    for b, d, n, w, layout in CHECK_SHAPES:
        for (dtype, param_dtype), tolerance in CHECK_DTYPES.items():
            for with_bias in (True, False):
                for silu in (True, False):
                    cases += 1
                    x, weight, bias, grad_out = input_set(Shape(b, d, n, w, layout), device, dtype, backward=True)
                    weight = weight.detach().to(param_dtype).requires_grad_()
                    bias = bias.detach().to(param_dtype).requires_grad_() if with_bias else None
                    leaves = [t for t in (x, weight, bias) if t is not None]
                    with fallbacks_seen() as fallbacks:
                        out = tk_ops.causal_conv1d(x, weight, bias, activation="silu" if silu else None)
                        grads = torch.autograd.grad(out, leaves, grad_out)
                    # float64 on the CPU: under compute-sanitizer the GPU runs only the kernels checked
                    exact = [t.detach().cpu().double().requires_grad_() for t in leaves]
                    reference = F.conv1d(exact[0], exact[1].unsqueeze(1), exact[2] if with_bias else None,
                                         padding=w - 1, groups=d)[..., :n]
                    reference = F.silu(reference) if silu else reference
                    reference_grads = torch.autograd.grad(reference, exact, grad_out.cpu().double())
                    name = (f"B={b} D={d} L={n} W={w} {layout} {str(dtype)[6:]}/{str(param_dtype)[6:]} "
                            f"bias={with_bias} silu={silu}")
                    compared = [("out", out, reference, tolerance, dtype)] + [
                        (f"grad_{label}", g, r, 2 * tolerance, t.dtype)
                        for label, g, r, t in zip(("x", "weight", "bias"), grads, reference_grads, leaves)]
                    for label, got, want, tol, want_dtype in compared:
                        error = common.relative_difference(got.cpu(), want)
                        if not error <= tol or got.dtype != want_dtype:
                            failures.append(f"{name} {label}: rel err {error:.2e} (tol {tol:.0e}), {got.dtype}")
                    if on_kernel and w in KERNEL_WIDTHS and fallbacks:
                        failures.append(f"{name}: ran the reference, not the kernel ({fallbacks[0]})")
    common.finish_check(f"correctness sweep on {device} (causal_conv1d: {tk_ops.backends()['causal_conv1d']}): "
                        f"{cases} cases (out and the gradients of x, weight, bias)", failures)


# ------------------------------------------------------------------------------------------ main


def main(argv=None) -> None:
    args = common.arguments(__doc__, PASSES).parse_args(argv)
    torch.manual_seed(0)
    if common.without_gpu(args, BENCH, DRY_RUN_SHAPES):
        return
    run_check("cuda")
    if args.check:
        return
    common.run(BENCH, SHAPES, passes=args.passes, out=args.out, copy_gbps=common.measured_copy_bandwidth(),
               dtype="bf16",
               activation=ACTIVATION, ours_backend=tk_ops.backends()["causal_conv1d"])


if __name__ == "__main__":
    main()
