"""tk_ops.layer_norm / tk_ops.rms_norm against Liger, torch eager and torch.compile in the same run.

Rows = 32768, hidden 256, 1000, 1024, 4000, 4096, 8192 (1000 and 4000: not powers of two), bf16. Cases per norm:
  fwd       out = norm(x)
  fwd+res   out, h = norm(x + residual), h returned (the pre-norm residual stream), bf16 residual
  fwd+bwd   forward, then grad of x and the parameters for a given grad_out
GB/s counts the bytes that must cross HBM (inputs read once, outputs written once: fwd 2 x 2 B per
element, fwd+res 4 x 2 B, fwd+bwd 5 x 2 B; parameters and statistics on top), and is also shown as
a fraction of the device-to-device copy bandwidth measured in this run. `ratio` is the best
baseline's time over ours. Writes benchmarks/results/norms.json and norms.png (and into --out).

  python3 -m benchmarks.bench_norms [--out DIR]     benchmark (checks every kernel path first)
  python3 -m benchmarks.bench_norms --check         only the correctness sweep (small shapes, also
                                                    what compute-sanitizer runs)
Liger comes from the carried wheels (.baselines); without it its columns stay empty.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import pathlib
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
COPY_BYTES = 2**30

try:
    from liger_kernel.transformers.functional import liger_layer_norm, liger_rms_norm
except ImportError:  # the wheels were not carried
    liger_layer_norm = liger_rms_norm = None


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


def rel_err(got: torch.Tensor, expected: torch.Tensor) -> float:
    got, expected = got.double(), expected.double()
    if not torch.isfinite(got).all():
        return math.inf
    return ((got - expected).norm() / expected.norm().clamp_min(1e-30)).item()


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
        err = rel_err(g, e)
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


def copy_gbps() -> float:
    sets = [(torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda"),
             torch.randint(0, 255, (COPY_BYTES,), dtype=torch.uint8, device="cuda")) for _ in range(2)]
    ms = common.time_ms(lambda dst, src: dst.copy_(src), sets)
    return 2 * COPY_BYTES / ms / 1e6


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


def compiled(fn):
    return torch.compile(fn, dynamic=False, fullgraph=True)


def implementations(kind: str, case: str) -> dict:
    """name -> function of the case's inputs (ours first)."""
    if kind == "layer":
        if case == "fwd+res":
            return {"tk_ops": lambda x, r, w, b: tk_ops.layer_norm(x, w, b, EPS, residual=r, return_residual=True),
                    "eager": layer_norm_residual_eager, "compiled": compiled(layer_norm_residual_eager)}
        impls = {"tk_ops": lambda x, w, b: tk_ops.layer_norm(x, w, b, EPS), "eager": layer_norm_eager}
        if liger_layer_norm is not None:
            impls["liger"] = lambda x, w, b: liger_layer_norm(x, w, b, EPS)
        if case == "fwd+bwd":
            impls["compiled"] = compiled(layer_norm_eager)
        return impls
    if case == "fwd+res":
        return {"tk_ops": lambda x, r, w: tk_ops.rms_norm(x, w, EPS, residual=r, return_residual=True),
                "eager": rms_norm_residual_eager, "compiled": compiled(rms_norm_residual_eager)}
    impls = {"tk_ops": lambda x, w: tk_ops.rms_norm(x, w, EPS), "eager": rms_norm_eager}
    if liger_rms_norm is not None:
        impls["liger"] = lambda x, w: liger_rms_norm(x, w, EPS, in_place=False)
    if case == "fwd+bwd":
        impls["compiled"] = compiled(rms_norm_eager)
    return impls


def make_inputs(kind: str, case: str, hidden: int) -> tuple:
    x = torch.randn(ROWS, hidden, device="cuda", dtype=DTYPE)
    params = [1 + 0.5 * torch.randn(hidden, device="cuda", dtype=DTYPE)]
    if kind == "layer":
        params.append(torch.randn(hidden, device="cuda", dtype=DTYPE))
    if case == "fwd+res":
        return (x, torch.randn_like(x), *params)
    if case == "fwd+bwd":
        return (x.requires_grad_(), torch.randn_like(x), *(p.requires_grad_() for p in params))
    return (x, *params)


def timed_function(fn, case: str):
    if case != "fwd+bwd":
        return fn

    def forward_backward(x, grad_out, *params):
        out = fn(x, *params)
        return torch.autograd.grad(out, (x, *params), grad_out)

    return forward_backward


def hbm_bytes(kind: str, case: str, hidden: int) -> int:
    element = torch.finfo(DTYPE).bits // 8
    tensors = {"fwd": 2, "fwd+res": 4, "fwd+bwd": 5}[case]
    parameters = (2 if kind == "layer" else 1) * hidden * element * (2 if case == "fwd+bwd" else 1)
    statistics = ROWS * 4 * (2 if kind == "layer" else 1) * (2 if case == "fwd+bwd" else 1)
    return ROWS * hidden * element * tensors + parameters + statistics


def first_output(result):
    return result[0] if isinstance(result, (tuple, list)) else result


def run_case(kind: str, case: str, hidden: int, copy: float) -> dict:
    first = make_inputs(kind, case, hidden)
    bytes_per_set = sum(t.numel() * t.element_size() for t in first) * 2
    sets = [first] + [make_inputs(kind, case, hidden) for _ in range(common.rotation_count(bytes_per_set) - 1)]
    impls = implementations(kind, case)
    timings, errors = {}, {}
    ours = first_output(timed_function(impls["tk_ops"], case)(*first))
    for name, fn in impls.items():
        timed = timed_function(fn, case)
        errors[name] = rel_err(first_output(timed(*first)).float(), ours.float()) if name != "tk_ops" else 0.0
        timings[name] = common.time_ms(timed, sets)
    # Ours again as one CUDA-graph replay: device time alone, to tell host-bound sizes apart.
    try:
        ours_graph_ms = common.time_graph_ms(timed_function(impls["tk_ops"], case), sets)
    except RuntimeError as error:  # a capture failure must not cost the run its other numbers
        print(f"CUDA-graph timing failed for {kind} {case} {hidden}: {error}")
        ours_graph_ms = float("nan")
    del sets, first
    torch.cuda.empty_cache()
    moved = hbm_bytes(kind, case, hidden)
    baselines = {name: ms for name, ms in timings.items() if name != "tk_ops"}
    best = min(baselines, key=baselines.get)
    row = {
        "norm": kind, "case": case, "rows": ROWS, "hidden": hidden, "dtype": "bf16", "hbm_bytes": moved,
        "ours_ms": round(timings["tk_ops"], 5),
        "ours_graph_ms": round(ours_graph_ms, 5),
        "graph_fraction_of_copy": round(moved / ours_graph_ms / 1e6 / copy, 3),
        "ours_gbps": round(moved / timings["tk_ops"] / 1e6, 1),
        "fraction_of_copy": round(moved / timings["tk_ops"] / 1e6 / copy, 3),
        "best_baseline": best,
        "ratio_vs_best": round(baselines[best] / timings["tk_ops"], 3),
    }
    for name, ms in baselines.items():
        row[f"{name}_ms"] = round(ms, 5)
        row[f"{name}_gbps"] = round(moved / ms / 1e6, 1)
        row[f"{name}_rel_diff"] = float(f"{errors[name]:.2e}")
    return row


def plot(rows: list[dict], copy: float, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = ("fwd", "fwd+res", "fwd+bwd")
    fig, axes = plt.subplots(2, 3, figsize=(17, 8.5))
    colors = {"tk_ops": "tab:red", "liger": "tab:blue", "eager": "tab:gray", "compiled": "tab:green"}
    for r, kind in enumerate(("layer", "rms")):
        for c, case in enumerate(cases):
            ax = axes[r][c]
            sel = [row for row in rows if row["norm"] == kind and row["case"] == case]
            if not sel:
                continue
            xs = [row["hidden"] for row in sel]
            for name, color in colors.items():
                key = "ours_gbps" if name == "tk_ops" else f"{name}_gbps"
                if key in sel[0]:
                    ax.plot(xs, [row[key] for row in sel], "o-", color=color, label=name)
            ax.axhline(copy, color="black", lw=0.8, ls=":", label="copy bandwidth")
            ax.axhline(0.9 * copy, color="black", lw=0.6, ls="--", label="90% of copy")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("hidden (rows = 32768, bf16)")
            ax.set_ylabel("GB/s of bytes that must cross HBM")
            ax.set_title(f"{'LayerNorm' if kind == 'layer' else 'RMSNorm'} {case}")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle(f"Norms on {torch.cuda.get_device_name()}: tk_ops vs Liger, eager, torch.compile (same run)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, help="also write the results and plot into this folder")
    parser.add_argument("--check", action="store_true", help="only the correctness sweep")
    args = parser.parse_args()
    torch.manual_seed(0)
    run_check()
    if args.check:
        return
    copy = copy_gbps()
    print(f"device-to-device copy in this run: {copy:.0f} GB/s")
    out_dirs = [common.RESULTS] + ([args.out] if args.out else [])
    rows = []
    print(f"{'norm':5} {'case':8} {'hidden':>6} {'ours ms':>8} {'GB/s':>6} {'of copy':>7} {'liger':>7} {'eager':>7} {'compiled':>8} {'best':>8} {'ratio':>6} {'graph ms':>8}")
    for hidden in HIDDEN_SIZES:
        for kind in ("layer", "rms"):
            for case in ("fwd", "fwd+res", "fwd+bwd"):
                row = run_case(kind, case, hidden, copy)
                rows.append(row)
                cells = [f"{row[f'{n}_ms']:7.4f}" if f"{n}_ms" in row else f"{'-':>7}" for n in ("liger", "eager")]
                compiled_cell = f"{row['compiled_ms']:8.4f}" if "compiled_ms" in row else f"{'-':>8}"
                print(f"{kind:5} {case:8} {hidden:6} {row['ours_ms']:8.4f} {row['ours_gbps']:6.0f} "
                      f"{row['fraction_of_copy']:7.3f} {cells[0]} {cells[1]} {compiled_cell} {row['best_baseline']:>8} "
                      f"{row['ratio_vs_best']:6.2f} {row['ours_graph_ms']:8.4f}")
        # Written after every size, so a run cut short still leaves its numbers.
        common.write_results("norms", rows, out_dirs, copy_gbps=round(copy, 1),
                             ceiling="device-to-device copy (read + write), this run",
                             liger="liger-kernel " + ("missing" if liger_layer_norm is None else "0.8.5"))
    for directory in out_dirs:
        plot(rows, copy, directory / "norms.png")


if __name__ == "__main__":
    main()
