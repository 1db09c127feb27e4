"""Shared helpers for the op tests: float64 comparisons, devices, GPU skips, compile / export / dispatch checks,
kernel or reference path."""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterable, Sequence

import pytest
import torch
from torch._inductor.utils import run_and_get_code
from torch.utils._python_dispatch import TorchDispatchMode

import tk_ops
from tk_ops import _library

HAS_CUDA = torch.cuda.is_available()
IS_HOPPER = HAS_CUDA and torch.cuda.get_device_capability() == (9, 0)


def _gpu_marks(skip_condition: bool, reason: str) -> tuple:
    """A GPU test's marks: ``gpu`` (the device script selects them with ``-m gpu``) and a skip where it can't run."""
    return (pytest.mark.gpu, pytest.mark.skipif(skip_condition, reason=reason))


def _marked(marks: tuple):
    def apply(test):
        for mark in marks:
            test = mark(test)
        return test

    return apply


CUDA_MARKS = _gpu_marks(not HAS_CUDA, "needs a CUDA device")
requires_cuda = _marked(CUDA_MARKS)


def kernel_marks(*op_names: str) -> tuple:
    """Skip unless a Hopper GPU is present and tk_ops._C registered a CUDA kernel for each op."""
    ops = " and ".join(f"tk.{name}" for name in op_names)
    return _gpu_marks(
        not (IS_HOPPER and all(_library.has_cuda_kernel(name) for name in op_names)),
        f"needs an sm_90 GPU and the tk_ops CUDA kernel for {ops} (extension: {tk_ops.extension_status()})",
    )


def requires_kernel(op_name: str):
    return _marked(kernel_marks(op_name))


# What a tk op's reference twin warns (once per op, tk_ops._library) when it serves a CUDA call.
REFERENCE_WARNING = "running the PyTorch reference path"


@contextlib.contextmanager
def runs_the_kernels(*op_names: str):
    """Inside the block none of the ops may fall back to its reference: the reference's warning (forgotten
    first, as it is given once per op) raises."""
    _library._REFERENCE_WARNED.difference_update(op_names)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=f".*{REFERENCE_WARNING}")
        yield


@contextlib.contextmanager
def runs_the_references(*op_names: str):
    """Inside the block each op must fall back to its reference twin, which warns, naming it (its once-per-op
    warning is forgotten first, so that an earlier one cannot stand in for it)."""
    _library._REFERENCE_WARNED.difference_update(op_names)
    with pytest.warns(UserWarning, match=REFERENCE_WARNING) as record:
        yield
    messages = [str(warning.message) for warning in record]
    for name in op_names:
        assert any(f"tk.{name} has no" in message for message in messages), f"tk.{name} gave no reference warning"


def capture_cuda_graph(step: Callable[[], object], warm_up: bool = True) -> tuple[torch.cuda.CUDAGraph, object]:
    """``step()`` captured in a CUDA graph, after one call on a side stream unless not ``warm_up`` (as
    torch.cuda.graphs asks: a first call's lazy setup must not be captured). Returns the graph and what the
    captured ``step()`` returned: the tensors each replay writes."""
    if warm_up:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    return graph, captured


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (NaN anywhere gives inf)."""
    out64, ref64 = out.detach().double().cpu(), ref.detach().double().cpu()
    if not torch.isfinite(out64).all():
        return float("inf")
    denominator = ref64.norm().item()
    difference = (out64 - ref64).norm().item()
    return difference / denominator if denominator > 0 else difference


def transformers_release() -> tuple[int, ...]:
    """The installed transformers' release numbers, e.g. (5, 17, 0) (for tests that know what a release does)."""
    import transformers

    return tuple(int(n) for n in re.match(r"\d+(?:\.\d+)*", transformers.__version__).group().split("."))


def hf_gated_norm_per_group() -> bool:
    """Whether the installed transformers' MambaRMSNormGated normalises per group of intermediate_size // n_groups
    channels (from 5.23, as mamba_ssm); before 5.23 it normalises over all intermediate channels whatever n_groups
    (each release's modeling_mamba2.py)."""
    return transformers_release() >= (5, 23)


def assert_rel_close(out: torch.Tensor, ref: torch.Tensor, tol: float, what: str = "output") -> None:
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    err = rel_err(out, ref)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e}"


# Relative-error budgets vs float64: low-precision inputs and outputs vs fp32 arithmetic.
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 5e-3}


def assert_gradients_close(
    out: torch.Tensor,
    inputs: Sequence[torch.Tensor],
    reference: torch.Tensor,
    reference_inputs: Sequence[torch.Tensor],
    tol: float,
    names: Iterable[str],
) -> None:
    """For one random output gradient (the same values for both), the gradients of ``out`` w.r.t. ``inputs``
    match those of ``reference`` w.r.t. ``reference_inputs`` within the relative error ``tol``
    (``names`` name the inputs in messages)."""
    grad = torch.randn_like(out)
    grads = torch.autograd.grad(out, inputs, grad)
    reference_grads = torch.autograd.grad(reference, reference_inputs, grad.to(reference.dtype))
    for name, got, want in zip(names, grads, reference_grads, strict=True):
        assert_rel_close(got, want, tol, f"grad_{name}")


def check_matches_contiguous_copies(
    fn: Callable[..., torch.Tensor], views: Sequence[torch.Tensor], tol: float = 1e-12
) -> None:
    """``fn`` of strided views gives the output and input gradients it gives on contiguous copies of them
    (assert_close with rtol = atol = ``tol``)."""
    leaves = [t.detach().requires_grad_() for t in views]
    copies = [t.detach().contiguous().requires_grad_() for t in views]
    out, expected = fn(*leaves), fn(*copies)
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol)
    grad = torch.randn_like(out)
    for got, want in zip(torch.autograd.grad(out, leaves, grad), torch.autograd.grad(expected, copies, grad)):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def parametrize_with_ids(argnames: str, cases: Sequence[tuple]):
    """``pytest.mark.parametrize`` over rows ``(id, *values)``: the first item of each row names the case
    (with one argname, the row's one value is passed as it is, not as a 1-tuple)."""
    one_value = "," not in argnames
    values = [case[1] if one_value else case[1:] for case in cases]
    return pytest.mark.parametrize(argnames, values, ids=[case[0] for case in cases])


def _assert_close(got: torch.Tensor, want: torch.Tensor, tol: float | None, what: str) -> None:
    """Relative error within ``tol`` (0: equal), or torch.testing.assert_close's dtype defaults when ``tol`` is None."""
    if tol is None:
        torch.testing.assert_close(got, want, msg=lambda message: f"{what}: {message}")
    else:
        assert_rel_close(got, want, tol, what)


def _as_tuple(outputs) -> tuple:
    return outputs if isinstance(outputs, tuple) else (outputs,)


def check_compile_fullgraph(
    fn: Callable,
    inputs: Sequence[torch.Tensor],
    ops: Iterable[str],
    *,
    loss: Callable[..., torch.Tensor] | None = None,
    tol: float | None = None,
    seed: int | None = None,
) -> None:
    """``torch.compile(fn, fullgraph=True)`` runs forward and backward with ``torch.ops.tk.<op>.default`` for
    every name in ``ops`` in its generated code, and gives eager's outputs and input gradients (forward only
    when no input requires grad: ops without a gradient).

    ``fn`` returns a tensor or a tuple of tensors; backward starts from ``loss(*outputs)``, or from the
    output itself when ``loss`` is None. Both runs use fresh leaves with the ``requires_grad`` of ``inputs``;
    outputs and gradients are compared within the relative error ``tol`` (None: assert_close's defaults).
    With a ``seed``, both runs start from ``torch.manual_seed(seed)`` (for an ``fn`` that draws random numbers).
    """

    def forward_backward(run):
        if seed is not None:
            torch.manual_seed(seed)
        leaves = [t.detach().requires_grad_(t.requires_grad) for t in inputs]
        outputs = _as_tuple(run(*leaves))
        if any(t.requires_grad for t in leaves):
            (outputs[0] if loss is None else loss(*outputs)).backward()
        return [out.detach() for out in outputs], [t.grad for t in leaves if t.requires_grad]

    (outputs, grads), codes = run_and_get_code(forward_backward, torch.compile(fn, fullgraph=True))
    code = "\n".join(codes)
    for op in ops:
        assert f"torch.ops.tk.{op}.default" in code, f"tk.{op} missing from the generated code"
    eager_outputs, eager_grads = forward_backward(fn)
    for i, (got, want) in enumerate(zip(outputs, eager_outputs, strict=True)):
        _assert_close(got, want, tol, f"output {i}")
    for i, (got, want) in enumerate(zip(grads, eager_grads, strict=True)):
        _assert_close(got, want, tol, f"gradient of input {i}")


def check_export(module: torch.nn.Module, args: tuple, ops: Iterable[str], *, tol: float | None = None) -> None:
    """``torch.export.export(module, args)`` keeps ``torch.ops.tk.<op>.default`` for every name in ``ops`` in
    its graph, and the exported program gives the module's outputs (within ``tol``, as check_compile_fullgraph)."""
    exported = torch.export.export(module, args)
    targets = {node.target for node in exported.graph.nodes}
    for op in ops:
        assert getattr(torch.ops.tk, op).default in targets, f"tk.{op} missing from the exported graph"
    outputs, expected = _as_tuple(exported.module()(*args)), _as_tuple(module(*args))
    for i, (got, want) in enumerate(zip(outputs, expected, strict=True)):
        _assert_close(got, want, tol, f"output {i}")


class RecordTkCalls(TorchDispatchMode):
    """Records the positional arguments of every tk op call, by op name (``"rope_bwd"``), in call order:
    what reaches the op (strides, storage) after the public function's checks and views."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[str, list[tuple]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "tk":
            self.calls.setdefault(func.overloadpacket.__name__, []).append(args)
        return func(*args, **(kwargs or {}))


# ------------------------------------------------------------- kernels that must not over-read

ROW_PADDING = 8  # NaN elements after each row of a row-strided activation (rows stay 16-byte aligned)
PARAMETER_CANARY = 8  # NaN elements after the end of a parameter


def on_gpu_rows(values: torch.Tensor, layout: str) -> torch.Tensor:
    """(rows, hidden) values on the GPU; row-strided: a view whose rows are followed by NaN."""
    if layout == "contiguous":
        return values.cuda()
    count, hidden = values.shape
    rows = torch.full((count, hidden + ROW_PADDING), float("nan"), dtype=values.dtype, device="cuda")
    rows[:, :hidden] = values
    return rows[:, :hidden]


def on_gpu_with_canary(values: torch.Tensor) -> torch.Tensor:
    """A (C,) parameter on the GPU, a view of a buffer holding NaN past its end."""
    buffer = torch.full((values.numel() + PARAMETER_CANARY,), float("nan"), dtype=values.dtype, device="cuda")
    buffer[: values.numel()] = values
    return buffer[: values.numel()]


BENCH_ROW_KEYS = ("shape", "pass", "baseline", "ours_ms", "baseline_ms", "ratio", "best_baseline", "ratio_vs_best",
                  "rel_diff_vs_baseline")


def assert_bench_rows(rows: Sequence[dict], cases: Sequence, passes: Sequence[str], baselines,
                      timed: bool = False) -> None:
    """A bench's rows in benchmarks/common.py's schema: one per case, pass and baseline in that order
    (`baselines`: the names, or a function of (case, pass) that gives them), none flagged a mismatch,
    and (unless `timed`) nothing timed: a dry run."""
    names = baselines if callable(baselines) else lambda case, pass_: baselines
    expected = [(case.label, pass_, name) for case in cases for pass_ in passes for name in names(case, pass_)]
    assert [(row["shape"], row["pass"], row["baseline"]) for row in rows] == expected
    for row in rows:
        assert all(key in row for key in BENCH_ROW_KEYS) and not row.get("mismatch"), row
        assert timed or (row["ours_ms"], row["baseline_ms"], row["ratio"]) == (None, None, None), row


# ------------------------------------------------- C++ of the CUDA build, compiled for CPU tensors

_REPOSITORY = pathlib.Path(__file__).resolve().parent.parent
_CHILD_TIMEOUT_S = 900


def build_cpu_variant(name: str, sources: Sequence[str], define: str, *, python_module: bool) -> str:
    """Build csrc/ ``sources`` with torch.utils.cpp_extension and ``-D<define>`` (the switch that makes them
    serve CPU tensors) in a child process, so that nothing is loaded or registered in this one; return
    the library's path. The build directory is kept between runs, as cpp_extension keeps it."""
    script = (
        "import sys, torch.utils.cpp_extension as e\n"
        "name, define, python_module, include, *sources = sys.argv[1:]\n"
        "e.load(name=name, sources=sources, extra_include_paths=[include], is_python_module=python_module == '1',\n"
        "       extra_cflags=['-O1', '-std=c++20', '-D' + define])\n"
        "print(e._get_build_directory(name, False))\n"
    )
    csrc = _REPOSITORY / "csrc"
    built = subprocess.run(
        [sys.executable, "-c", script, name, define, str(int(python_module)), str(csrc), *(str(csrc / s) for s in sources)],
        capture_output=True, text=True, timeout=_CHILD_TIMEOUT_S,
    )
    assert built.returncode == 0, f"building the CPU variant failed:\n{built.stdout}\n{built.stderr}"
    return str(pathlib.Path(built.stdout.strip().splitlines()[-1]) / f"{name}.so")


def run_tests_in_child(test_file: str, selection: str, variable: str, library: str) -> None:
    """Run ``test_file``'s tests that ``-k selection`` picks in a child process whose environment names
    ``library`` in ``variable`` (the test file loads it there); all of them must pass, none skip."""
    child = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", selection, test_file],
        capture_output=True, text=True, timeout=_CHILD_TIMEOUT_S, cwd=_REPOSITORY, env={**os.environ, variable: library},
    )
    assert child.returncode == 0, f"child tests failed:\n{child.stdout[-6000:]}\n{child.stderr[-3000:]}"
    assert " passed" in child.stdout and "skipped" not in child.stdout.splitlines()[-1], child.stdout[-2000:]
