"""tk_ops.layer_norm / tk_ops.rms_norm against Liger, torch eager and torch.compile in the same run.

Rows = 32768, hidden 256, 1000, 1024, 4000, 4096, 8192 (1000 and 4000: not powers of two), bf16. Passes per norm:
  fwd       out = norm(x)                                    (eager, Liger)
  fwd+res   out, h = norm(x + residual), h returned (the pre-norm residual stream), bf16 residual
                                                             (eager, compiled)
  fwd+bwd   forward, then grad of x and the parameters for a given grad_out  (eager, Liger, compiled)
GB/s counts the bytes that must cross HBM (inputs read once, outputs written once: fwd 2 x 2 B per
element, fwd+res 4 x 2 B, fwd+bwd 5 x 2 B; parameters and statistics on top), and is also shown as
a fraction of the device-to-device copy bandwidth measured in this run (ours_of_floor); ours is
also replayed in a CUDA graph (device time without host overhead). Rows: benchmarks/common.py's, a
row per baseline; ratio_vs_best is the best baseline's time over ours. Writes
benchmarks/results/norms.json and norms.png (and into --out).

  python3 -m benchmarks.bench_norms [--out DIR] [--pass P]  benchmark (checks every kernel path first)
  python3 -m benchmarks.bench_norms --check         only the correctness sweep (small shapes, also
                                                    what compute-sanitizer runs)
  python3 -m benchmarks.bench_norms --dry-run [--out DIR]   CPU, tiny cases, nothing timed
Liger comes from the carried wheels (.baselines); without it its rows say why.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings

import torch
import torch.nn.functional as F

import tk_ops
from benchmarks import common
from tk_ops import _library

ROWS = 32768
HIDDEN_SIZES = (256, 1000, 1024, 4000, 4096, 8192)
EPS = 1e-5
DTYPE = torch.bfloat16
LIGER = ("liger_kernel.transformers.functional", "liger-kernel")  # the module and its distribution


# ---------------------------------------------------------------------------------- correctness

CHECK_ROWS = 67
CHECK_DEVICE = "cuda"
# NaN after the end of every row of the row-strided layout and of every parameter vector: a kernel
# that reads past an end and lets what it reads reach a result fails the check, whatever the
# allocator left beyond the tensor (a read past the end starts at the end, so one element would do).
ROW_PADDING = 8  # elements: rows stay 16-byte aligned for bf16/fp16 when hidden is a multiple of 8
PARAMETER_CANARY = 8  # elements
# Sizes that are no multiple of 8 (one-element accesses, one and several warps per row), a warp per
# row with 1 / 2 / 4 accesses, several warps per row with a partial last warp, and the largest.
CHECK_HIDDEN = (37, 200, 256, 512, 1000, 1001, 1032, 4000, 8192)
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 5e-3, torch.float32: 1e-4}


@contextlib.contextmanager
def poisoned_allocations():
    """Every tensor allocated inside starts as NaN (the op's outputs included, allocated in C++ by
    at::empty), so an element the kernel never writes fails the check: torch's deterministic mode
    fills uninitialised memory."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        assert torch.empty(1, device=CHECK_DEVICE, dtype=torch.float16).isnan().all(), "allocations are not poisoned"
        yield
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = fill
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)


def call_kernel(op, *args):
    """Run a tk op on poisoned outputs and fail if it fell back to its reference (which warns once per op name)."""
    _library._REFERENCE_WARNED.clear()
    with warnings.catch_warnings(record=True) as caught, poisoned_allocations():
        warnings.simplefilter("always")
        result = op(*args)
    fallbacks = [str(w.message) for w in caught if "reference path" in str(w.message)]
    assert not fallbacks, f"the kernel fell back to the reference: {fallbacks[0]}"
    return result


def reference(op, *args):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return op(*args)


def compare(name: str, got, expected, failures: list) -> None:
    for label, (g, e) in enumerate(zip(got, expected)):
        if e.numel() == 0:
            assert g.numel() == 0, f"{name}[{label}]: expected an empty output"
            continue
        tol = TOLERANCE.get(e.dtype, 1e-4)
        err = common.relative_difference(g, e)
        if not (err <= tol) or g.dtype != e.dtype or g.shape != e.shape:
            failures.append(f"{name}[{label}]: rel err {err:.2e} (tol {tol:.0e}), {g.dtype}{tuple(g.shape)} vs {e.dtype}{tuple(e.shape)}")


def check_cases():
    """(kind, dtype, hidden, residual dtype, parameter dtype, dropout_p, layout) covering every path."""
    cases = []
    for kind in ("layer", "rms"):
        for dtype in (torch.bfloat16, torch.float16):
            for i, hidden in enumerate(CHECK_HIDDEN):
                residual = (None, dtype, torch.float32)[i % 3]
                parameters = (dtype, torch.float32)[i % 2]
                dropout = 0.15 if kind == "layer" and i % 2 == 0 else 0.0
                layout = ("contiguous", "row-strided", "transposed")[i % 3]
                cases.append((kind, dtype, hidden, residual, parameters, dropout, layout))
    return cases


def make_activation(dtype, hidden, layout):
    """A random (rows, hidden) activation (3 x rows when transposed) in the case's layout."""
    if layout == "row-strided":  # rows `hidden + ROW_PADDING` apart, NaN between them: a view, no copy
        rows = torch.full((CHECK_ROWS, hidden + ROW_PADDING), math.nan, device=CHECK_DEVICE, dtype=dtype)
        rows[:, :hidden] = torch.randn(CHECK_ROWS, hidden, device=CHECK_DEVICE)
        return rows[:, :hidden]
    if layout == "transposed":  # leading dims permuted: the kernel's glue copies it
        return torch.randn(CHECK_ROWS, 3, hidden, device=CHECK_DEVICE, dtype=dtype).transpose(0, 1)
    return torch.randn(CHECK_ROWS, hidden, device=CHECK_DEVICE, dtype=dtype)


def make_parameter(values: torch.Tensor, dtype) -> torch.Tensor:
    """``values`` in ``dtype``, a view of a buffer that holds NaN past its end."""
    buffer = torch.full((values.numel() + PARAMETER_CANARY,), math.nan, device=CHECK_DEVICE, dtype=dtype)
    buffer[: values.numel()] = values
    return buffer[: values.numel()]


def make_check_inputs(dtype, hidden, residual_dtype, parameter_dtype, layout):
    x = make_activation(dtype, hidden, layout)
    residual = None if residual_dtype is None else make_activation(residual_dtype, hidden, layout)
    weight = make_parameter(1 + 0.5 * torch.randn(hidden, device=CHECK_DEVICE), parameter_dtype)
    bias = make_parameter(torch.randn(hidden, device=CHECK_DEVICE), parameter_dtype)
    return x, residual, weight, bias


def run_check() -> None:
    assert tk_ops.backends()["layer_norm"] == "cuda kernel", f"tk_ops extension: {tk_ops.extension_status()}"
    assert tk_ops.backends()["rms_norm"] == "cuda kernel", f"tk_ops extension: {tk_ops.extension_status()}"
    ops = torch.ops.tk
    failures: list[str] = []
    for kind, dtype, hidden, residual_dtype, parameter_dtype, p, layout in check_cases():
        name = f"{kind} {str(dtype)[6:]} C={hidden} res={residual_dtype and str(residual_dtype)[6:]} param={str(parameter_dtype)[6:]} p={p} {layout}"
        x, residual, weight, bias = make_check_inputs(dtype, hidden, residual_dtype, parameter_dtype, layout)
        seed = torch.tensor(0x1234_5678_9ABC_DEF, device=CHECK_DEVICE, dtype=torch.int64) if p > 0 else None
        if kind == "layer":
            fwd_args = (x, weight, bias, residual, seed, EPS, p)
            got = call_kernel(ops.layer_norm, *fwd_args)
            expected = reference(ops.layer_norm_ref, *fwd_args)
            _, h, mean, rstd = got
        else:
            fwd_args = (x, weight, residual, EPS)
            got = call_kernel(ops.rms_norm, *fwd_args)
            expected = reference(ops.rms_norm_ref, *fwd_args)
            _, h, rstd = got
        compare(name + " fwd", got, expected, failures)
        if got[1].numel() and not torch.equal(got[1], expected[1]):
            failures.append(f"{name} fwd: h differs from the reference's bits (dropout mask or rounding)")
        h = h if h.numel() else x
        grad_out = make_activation(dtype, hidden, layout)
        grad_h = make_activation(h.dtype, hidden, layout) if residual is not None else None
        masks = ([True, residual is not None, True, True], [False, False, True, False], [True, False, False, False])
        for mask in masks:
            if kind == "layer":
                bwd_args = (grad_out, grad_h, h, weight, bias, mean, rstd, seed, p, mask)
                got_b = call_kernel(ops.layer_norm_bwd, *bwd_args)
                expected_b = reference(ops.layer_norm_bwd_ref, *bwd_args)
            else:
                bwd_args = (grad_out, grad_h, h, weight, rstd, mask[:3])
                got_b = call_kernel(ops.rms_norm_bwd, *bwd_args)
                expected_b = reference(ops.rms_norm_bwd_ref, *bwd_args)
            compare(f"{name} bwd mask={mask}", got_b, expected_b, failures)
    torch.cuda.synchronize()
    common.finish_check(f"correctness sweep: {len(check_cases())} cases x (fwd + 3 bwd masks)", failures)


# ------------------------------------------------------------------------------------ benchmark


@dataclasses.dataclass(frozen=True)
class Case:
    norm: str  # "layer" or "rms"
    hidden: int
    rows: int = ROWS
    dtype: str = "bf16"

    @property
    def label(self) -> str:
        return f"{self.norm} hidden={self.hidden}"

    def hbm_bytes(self, pass_: str) -> int:
        element = DTYPE.itemsize
        tensors = {"fwd": 2, "fwd+res": 4, "fwd+bwd": 5}[pass_]
        twice = 2 if pass_ == "fwd+bwd" else 1
        parameters = (2 if self.norm == "layer" else 1) * self.hidden * element * twice
        statistics = self.rows * 4 * (2 if self.norm == "layer" else 1) * twice
        return self.rows * self.hidden * element * tensors + parameters + statistics


PASSES = ("fwd", "fwd+res", "fwd+bwd")
CASES = [Case(norm, hidden) for hidden in HIDDEN_SIZES for norm in ("layer", "rms")]
DRY_RUN_CASES = [Case("layer", 40, rows=16), Case("rms", 40, rows=16)]


def layer_norm_eager(x, weight, bias):
    return F.layer_norm(x, (x.shape[-1],), weight, bias, EPS)


def layer_norm_residual_eager(x, residual, weight, bias):
    h = x + residual
    return F.layer_norm(h, (x.shape[-1],), weight, bias, EPS), h


def rms_norm_eager(x, weight):
    return F.rms_norm(x, (x.shape[-1],), weight, EPS)


def rms_norm_residual_eager(x, residual, weight):
    h = x + residual
    return F.rms_norm(h, (x.shape[-1],), weight, EPS), h


def forms(name: str, norm: str) -> tuple:
    """(the plain form on (x, weight[, bias]), the residual form on (x, residual, weight[, bias])) of
    one implementation of one norm; "compiled" compiles eager's."""
    if name == "tk_ops" and norm == "layer":
        return (lambda x, w, b: tk_ops.layer_norm(x, w, b, EPS),
                lambda x, r, w, b: tk_ops.layer_norm(x, w, b, EPS, residual=r, return_residual=True))
    if name == "tk_ops":
        return (lambda x, w: tk_ops.rms_norm(x, w, EPS),
                lambda x, r, w: tk_ops.rms_norm(x, w, EPS, residual=r, return_residual=True))
    if name == "liger" and norm == "layer":  # no residual form
        layer_norm = common.need(*LIGER).liger_layer_norm
        return lambda x, w, b: layer_norm(x, w, b, EPS), None
    if name == "liger":
        rms_norm = common.need(*LIGER).liger_rms_norm
        return lambda x, w: rms_norm(x, w, EPS, in_place=False), None
    return (layer_norm_eager, layer_norm_residual_eager) if norm == "layer" else (rms_norm_eager, rms_norm_residual_eager)


NOT_TIMED = {("compiled", "fwd"), ("liger", "fwd+res")}  # (provider, pass)


def provider(name: str, **options) -> common.Provider:
    """fwd: norm(x); fwd+res: norm(x + residual) and the sum; fwd+bwd: the forward, then the gradients
    of x and the parameters for a given grad_out."""

    def build(case: Case, pass_: str):
        if (name, pass_) in NOT_TIMED:
            return None
        plain, residual = forms(name, case.norm)
        fn = residual if pass_ == "fwd+res" else plain
        fn = torch.compile(fn, dynamic=False, fullgraph=True) if name == "compiled" else fn
        return common.step(fn, backward=True) if pass_ == "fwd+bwd" else fn

    return common.Provider(name, build, **options)


def make_inputs(case: Case, pass_: str, device) -> tuple:
    """fwd: (x, weight[, bias]); fwd+res: (x, residual, weight[, bias]); fwd+bwd: (x, weight[, bias], grad_out)."""
    x = torch.randn(case.rows, case.hidden, device=device, dtype=DTYPE)
    params = [1 + 0.5 * torch.randn(case.hidden, device=device, dtype=DTYPE)]
    if case.norm == "layer":
        params.append(torch.randn(case.hidden, device=device, dtype=DTYPE))
    if pass_ == "fwd+res":
        return (x, torch.randn_like(x), *params)
    if pass_ == "fwd+bwd":
        return (x.requires_grad_(), *(p.requires_grad_() for p in params), torch.randn_like(x))
    return (x, *params)


BENCH = common.Bench(
    "norms", "Norms: tk_ops vs Liger, eager, torch.compile (bf16; hatched: ours in a CUDA graph)",
    ours=provider("tk_ops", graph=True),  # ours also replayed in a CUDA graph: device time alone
    baselines=(provider("eager"), provider("liger"), provider("compiled")),
    inputs=make_inputs, passes=PASSES, set_bytes=lambda case, pass_, inputs: 2 * common.tensor_bytes(inputs),
    graph_below_ms=math.inf, panel=lambda row: row["norm"], tick=lambda row: str(row["hidden"]),
)


def main(argv=None) -> None:
    args = common.arguments(__doc__, PASSES).parse_args(argv)
    torch.manual_seed(0)
    if common.without_gpu(args, BENCH, DRY_RUN_CASES):
        return
    run_check()
    if args.check:
        return
    common.run(BENCH, CASES, passes=args.passes, out=args.out, copy_gbps=common.measured_copy_bandwidth(),
               liger=common.peer(*LIGER)[1])


if __name__ == "__main__":
    main()
