"""The norms' fast entries (csrc/torch/fast_entry.cpp): a plain eager call of tk_ops.layer_norm or
tk_ops.rms_norm runs in C++ and gives the Python path's outputs and gradients bit for bit; any other
call (another dtype beside x, a subclass, a TorchFunctionMode, dropout, an int eps, ...) gets None from
the entry and runs the Python path, which names the argument in its errors.

On the GPU the entries are tk_ops._C's (the Python path is the same public function with
``_library.EXTENSION`` set to None). Without a GPU, test_cpu_build builds fast_entry.cpp and module.cpp
for CPU tensors (TK_OPS_FAST_ENTRY_DEVICE=CPU; a g++ build through torch.utils.cpp_extension, cached) and
runs this module's tests in a child process with that module as ``_library.EXTENSION``.
"""

from __future__ import annotations

import importlib.util
import os
import shutil

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import tk_ops
import tk_testing
from tk_ops import _library
from tk_ops.ops import layer_norm as layer_norm_module

ENTRY_VARIABLE = "TK_OPS_TEST_FAST_ENTRY"  # the CPU build of the entries, set by test_cpu_build for its child
IN_CHILD = bool(os.environ.get(ENTRY_VARIABLE))

if IN_CHILD:
    _spec = importlib.util.spec_from_file_location("_C", os.environ[ENTRY_VARIABLE])
    _library.EXTENSION = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_library.EXTENSION)

DEVICE = "cpu" if IN_CHILD else "cuda"
X_DTYPES = (torch.float32, torch.float64) if IN_CHILD else (torch.bfloat16, torch.float16, torch.float32)
NARROW = torch.float64 if IN_CHILD else torch.bfloat16  # x's dtype where an fp32 parameter is a different one
HAS_ENTRIES = IN_CHILD or (torch.cuda.is_available() and _library.EXTENSION is not None)


def runs_entries(test):
    """A GPU test (``-m gpu`` selects it on the device), which the CPU build's child runs too."""
    reason = f"needs tk_ops._C on a GPU (extension: {tk_ops.extension_status()})"
    return pytest.mark.gpu(pytest.mark.skipif(not HAS_ENTRIES, reason=reason)(test))


HIDDEN = 48


def _t(shape, dtype, grad=True, device=DEVICE):
    return torch.randn(*shape, device=device, dtype=dtype).requires_grad_(grad)


def _run(function, args, kwargs):
    """Outputs and input gradients of function(*args, **kwargs) on fresh leaves, for a loss with fixed
    random weights over every output."""
    leaves = [a.detach().clone().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a for a in args]
    kwargs = {k: v.detach().clone().requires_grad_(v.requires_grad) if isinstance(v, torch.Tensor) else v
              for k, v in kwargs.items()}
    outputs = function(*leaves, **kwargs)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    generator = torch.Generator(device=outputs[0].device).manual_seed(3)
    loss = sum((o.double() * torch.randn(o.shape, generator=generator, device=o.device, dtype=torch.float64)).sum()
               for o in outputs)
    if loss.requires_grad:
        loss.backward()
    grads = [t.grad for t in [*leaves, *kwargs.values()] if isinstance(t, torch.Tensor)]
    return outputs, grads


# (name, public function, positional args, keyword args) of plain calls
def _plain_cases(dtype, device=DEVICE):
    x = _t((3, 5, HIDDEN), dtype, device=device)
    w, b = _t((HIDDEN,), dtype, device=device), _t((HIDDEN,), dtype, device=device)
    residual = _t((3, 5, HIDDEN), dtype, device=device)
    strided = _t((5, 3, HIDDEN), dtype, device=device).detach().transpose(0, 1).requires_grad_()  # no copy
    transposed = _t((HIDDEN, 15), dtype, device=device).detach().mT.requires_grad_()  # non-unit last stride: copied
    frozen = _t((HIDDEN,), dtype, grad=False, device=device)
    return [
        ("layer_norm", tk_ops.layer_norm, (x, w, b), {}),
        ("layer_norm_bare", tk_ops.layer_norm, (x, None, None, 1e-3), {}),
        ("layer_norm_residual_h", tk_ops.layer_norm, (x, w, None), dict(residual=residual, return_residual=True)),
        ("layer_norm_h_is_x", tk_ops.layer_norm, (x, frozen, b), dict(return_residual=True, dropout_p=0.0)),
        ("layer_norm_strided", tk_ops.layer_norm, (strided, w, b), {}),
        ("layer_norm_transposed", tk_ops.layer_norm, (transposed, w, b), {}),
        ("rms_norm", tk_ops.rms_norm, (x, w), {}),
        ("rms_norm_bare", tk_ops.rms_norm, (x, None, 1e-5), {}),
        ("rms_norm_residual_h", tk_ops.rms_norm, (x, w), dict(residual=residual, return_residual=True)),
        ("rms_norm_h_is_x", tk_ops.rms_norm, (x, frozen), dict(return_residual=True)),
        ("rms_norm_transposed", tk_ops.rms_norm, (transposed, w), {}),
    ]


PLAIN_NAMES = [name for name, *_ in _plain_cases(torch.float32, "meta")]


def _entry_arguments(function, args, kwargs):
    """The entry's positional arguments for a public call, with the public function's defaults."""
    if function is tk_ops.layer_norm:
        x, weight, bias, eps = (*args, 1e-5)[:4]
        return _library.EXTENSION.layer_norm, (x, weight, bias, eps, kwargs.get("residual"),
                                               kwargs.get("dropout_p", 0.0), kwargs.get("return_residual", False))
    x, weight, eps = (*args, 1e-6)[:3]
    return _library.EXTENSION.rms_norm, (x, weight, eps, kwargs.get("residual"), kwargs.get("return_residual", False))


@pytest.fixture
def python_checks_counted(monkeypatch):
    """Counts the calls of the Python path's fast check (every Python path of both norms runs it once)."""
    calls = []
    plain = layer_norm_module._plain_norm_arguments

    def counted(*args):
        calls.append(args)
        return plain(*args)

    monkeypatch.setattr(layer_norm_module, "_plain_norm_arguments", counted)
    return calls


@runs_entries
@pytest.mark.parametrize("dtype", X_DTYPES, ids=str)
@pytest.mark.parametrize("index", range(len(PLAIN_NAMES)), ids=PLAIN_NAMES)
def test_plain_calls_take_the_entry_and_match_the_python_path(index, dtype, python_checks_counted, monkeypatch):
    _, function, args, kwargs = _plain_cases(dtype)[index]
    entry, entry_args = _entry_arguments(function, args, kwargs)
    with torch.no_grad():
        assert entry(*entry_args) is not None
    python_checks_counted.clear()
    ours, our_grads = _run(function, args, kwargs)
    assert not python_checks_counted, "a plain call ran the Python checks"
    monkeypatch.setattr(_library, "EXTENSION", None)
    python, python_grads = _run(function, args, kwargs)
    assert python_checks_counted, "the Python path was not taken"
    # Bit for bit on any machine: both paths call the same tk ops with the same arguments.
    for i, (got, want) in enumerate(zip(ours, python, strict=True)):
        assert got.requires_grad == want.requires_grad and got.dtype == want.dtype, f"output {i}"
        assert got.stride() == want.stride() and torch.equal(got.detach(), want.detach()), f"output {i} differs"
        assert (got.grad_fn is None) == (want.grad_fn is None) and (
            got.grad_fn is None or got.grad_fn.name() == want.grad_fn.name()), f"output {i}: grad_fn"
    for i, (got, want) in enumerate(zip(our_grads, python_grads, strict=True)):
        assert (got is None) == (want is None), f"gradient {i}"
        assert got is None or (got.dtype == want.dtype and torch.equal(got, want)), f"gradient {i} differs"


class _Subclass(torch.Tensor):
    pass


def _recording(mode_class, hook: str):
    """A mode of ``mode_class`` (TorchFunctionMode or TorchDispatchMode) whose ``hook`` records every
    function it sees in ``seen`` and runs it."""

    def __init__(self):
        mode_class.__init__(self)
        self.seen = []

    def record(self, func, types, args=(), kwargs=None):
        self.seen.append(func)
        return func(*args, **(kwargs or {}))

    return type(f"Recording{mode_class.__name__}", (mode_class,), {"__init__": __init__, hook: record})


_RecordingFunctions = _recording(TorchFunctionMode, "__torch_function__")
_RecordingDispatch = _recording(TorchDispatchMode, "__torch_dispatch__")


def _other_calls(device=DEVICE):
    """(name, public function, args, kwargs) of calls the entries leave to Python."""
    x, w = _t((4, HIDDEN), NARROW, device=device), _t((HIDDEN,), NARROW, device=device)
    wide_w, wide_residual = _t((HIDDEN,), torch.float32, device=device), _t((4, HIDDEN), torch.float32, device=device)
    cases = [
        ("layer_norm_fp32_weight", tk_ops.layer_norm, (x, wide_w, None), {}),
        ("layer_norm_fp32_residual", tk_ops.layer_norm, (x, w, None),
         dict(residual=wide_residual, return_residual=True)),
        ("layer_norm_subclass", tk_ops.layer_norm, (x.detach().as_subclass(_Subclass), w, None), {}),
        ("layer_norm_dropout", tk_ops.layer_norm, (x, w, None), dict(dropout_p=0.25)),
        ("layer_norm_int_eps", tk_ops.layer_norm, (x, w, None, 1), {}),
        ("layer_norm_int_return_residual", tk_ops.layer_norm, (x, w, None), dict(return_residual=1)),
        ("rms_norm_fp32_weight", tk_ops.rms_norm, (x, wide_w), {}),
        ("rms_norm_subclass_weight", tk_ops.rms_norm, (x, w.detach().as_subclass(_Subclass)), {}),
        ("rms_norm_int_eps", tk_ops.rms_norm, (x, w, 1), {}),
    ]
    if DEVICE == "cuda":
        cases.append(("rms_norm_cpu_x", tk_ops.rms_norm, (_t((4, HIDDEN), torch.float32, device="cpu"), None), {}))
    return cases


OTHER_NAMES = [name for name, *_ in _other_calls("meta")]


@runs_entries
@pytest.mark.parametrize("index", range(len(OTHER_NAMES)), ids=OTHER_NAMES)
def test_other_calls_take_the_python_path(index, python_checks_counted):
    _, function, args, kwargs = _other_calls()[index]
    entry, entry_args = _entry_arguments(function, args, kwargs)
    assert entry(*entry_args) is None
    function(*args, **kwargs)
    assert len(python_checks_counted) == 1


@runs_entries
@pytest.mark.parametrize("function", [tk_ops.layer_norm, tk_ops.rms_norm], ids=["layer_norm", "rms_norm"])
def test_bad_calls_raise_the_python_errors(function):
    x, w = _t((4, HIDDEN), NARROW), _t((HIDDEN,), NARROW)
    bias = (None,) if function is tk_ops.layer_norm else ()  # layer_norm's bias, positional
    calls = [
        ((x, w[:-1], *bias), {}, ValueError, r"weight.shape\[0\] must equal x.shape\[-1\]"),
        ((x, w, *bias), dict(residual=w), ValueError, "residual must have x's shape"),
        ((x, w, *bias, -1.0), {}, ValueError, "eps must be > 0"),
        ((x, w.int(), *bias), {}, TypeError, "weight must have dtype in"),
        ((x[:0], w, *bias), {}, ValueError, "x must not be empty"),
    ]
    for args, kwargs, error, message in calls:
        entry, entry_args = _entry_arguments(function, args, kwargs)
        assert entry(*entry_args) is None
        with pytest.raises(error, match=message):
            function(*args, **kwargs)


@runs_entries
@pytest.mark.parametrize("function", [tk_ops.layer_norm, tk_ops.rms_norm], ids=["layer_norm", "rms_norm"])
def test_a_torch_function_mode_sees_the_python_path(function, python_checks_counted):
    args = (_t((4, HIDDEN), NARROW), _t((HIDDEN,), NARROW), *((None,) if function is tk_ops.layer_norm else ()))
    entry, entry_args = _entry_arguments(function, args, {})
    with _RecordingFunctions() as mode:
        assert entry(*entry_args) is None
        function(*args)
    assert len(python_checks_counted) == 1
    assert getattr(torch.ops.tk, function.__name__).default in mode.seen


@runs_entries
def test_a_dispatch_mode_sees_the_op_of_the_entry(python_checks_counted):
    x, w = _t((4, HIDDEN), NARROW), _t((HIDDEN,), NARROW)
    with _RecordingDispatch() as mode:
        tk_ops.layer_norm(x, w, None)
        tk_ops.rms_norm(x, w)
    assert not python_checks_counted
    assert torch.ops.tk.layer_norm.default in mode.seen and torch.ops.tk.rms_norm.default in mode.seen


@runs_entries
def test_compiled_calls_stay_in_the_graph(python_checks_counted):
    x, w = _t((4, HIDDEN), NARROW), _t((HIDDEN,), NARROW)

    def block(x, w):
        return tk_ops.rms_norm(tk_ops.layer_norm(x, w, None), w)

    compiled = torch.compile(block, backend="eager", fullgraph=True)
    # backend="eager" runs the graph's tk ops as they are: the same calls as eager, the same bits.
    torch.testing.assert_close(compiled(x, w), block(x, w), rtol=0, atol=0)


# ------------------------------------------------------------------ CPU, through a child process


@pytest.mark.skipif(IN_CHILD, reason="the child runs the checks")
@pytest.mark.skipif(shutil.which("g++") is None or shutil.which("ninja") is None, reason="needs g++ and ninja")
def test_cpu_build():
    library = tk_testing.build_cpu_variant("_C", ["torch/fast_entry.cpp", "torch/module.cpp"],
                                           "TK_OPS_FAST_ENTRY_DEVICE=CPU", python_module=True)
    tk_testing.run_tests_in_child(__file__, "not test_cpu_build", ENTRY_VARIABLE, library)